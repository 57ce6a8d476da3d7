// dflash MoE kernels for 1-16 rows (decode, verify, draft-sized blocks), bf16 weights, f32
// arithmetic. Wrapped in src/nn/cuda/moe.rs; nn::moe decides when they run.
//
//   moe_route_union_e{4,8,16,32}
//                  router logits [n, E] (f32 or bf16) -> the k chosen experts and weights per
//                  row, on the device (no host round trip per layer): softmax + top-k
//                  (renormalized or not), top-k + softmax (gpt-oss), or sigmoid + correction
//                  bias + grouped top-k (deepseek_v3); per-expert scales and a scaling factor;
//                  then, in the same launch, the union: the experts some row chose, ascending,
//                  each with its (row, slot) pairs.
//   moe_gate_up    per expert: act(x W_gate^T (+b)) * (x W_up^T (+b)) for the rows routed to it
//   moe_down       per expert: h W_down^T (+b) for the (row, slot) pairs routed to it
//   moe_combine    out[r] = sum over the row's k slots, in slot order, of weight * expert output
//
// The expert GEMMs run over a grid of (union slot, tile) blocks, as many slots as there can be
// chosen experts (min(E, rows x k)); a slot past the union's size returns at once. So each
// expert the rows route to (the union) is read once per layer whatever the number of rows, and
// unchosen experts cost no blocks. Within a block one warp streams one weight row (16-byte
// loads, 4 in flight, as kernels/gemv.cu) and keeps one accumulator per pair.
//
// Batch invariance: a (pair, output) value is one warp's dot product over k in a fixed order
// (lane i takes chunks i, i + 32, ..., then a fixed xor reduction), and the combine adds a
// row's slots in slot order: no value depends on which other rows are in the call.
//
// moe_gate_up_mma / moe_down_mma: the same products on the tensor cores, for widths that are
// multiples of 32 (nn::cuda::moe picks them from the shapes alone, so a row always meets the
// same kernel). A block is one slot's tile of 16 units (gate and up rows) or 32 output rows;
// its 8 warps split k, each warp as the skinny GEMM of kernels/mma.cu (the weights the A
// operand, the slot's gathered rows the B operand, T tiles of 8 rows), and the block sums the
// warps' partials in warp order. The FMA kernels above keep one accumulator per pair for all P
// pairs the call could route to one expert: at 16 rows (P = 16) they ran at 21-38% of the
// union's bytes on gpt-oss-20b (docs/perf.md, session 22).
#include <cuda_bf16.h>
#include <stdint.h>

#include "affine.cuh"
#include "skinny.cuh"

typedef __nv_bfloat16 bf16;

#define MOE_MAX_PAIRS 16  // pairs of one expert in one call: at most one per row, n <= 16

__device__ __forceinline__ float rb(float x) { return __bfloat162float(__float2bfloat16(x)); }

#include "reduce.cuh"

// ---------------------------------------------------------------------------------------
// Routing.

// Warp-wide argmax of (v, i) pairs: the largest value, the lowest index among equal ones;
// i < 0 marks no candidate. Every lane ends with the same pair.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
      bv = ov;
      bi = oi;
    }
  }
}

// ---------------------------------------------------------------------------------------
// The union of the chosen experts, then the expert GEMMs over it.

// The union of the chosen experts, one block of 256 threads: slot s < count holds expert
// slots[s * (MOE_MAX_PAIRS + 2)], its pair count at + 1 and its pairs (ascending) at + 2 ..;
// count at slots[nslots * (MOE_MAX_PAIRS + 2)]. Experts ascending. ids [npairs] (npairs <= 256).
#define SLOT_W (MOE_MAX_PAIRS + 2)
// The union's construction, by one block of 256 threads (ids in global or shared memory,
// written before the call by other threads of the block or an earlier launch).
__device__ void build_union(const int* ids, int npairs, int E, int nslots, int* __restrict__ slots) {
  __shared__ int slot_of[1024];
  __shared__ int scan[256];
  const int t = threadIdx.x;
  for (int e = t; e < E; e += 256) slot_of[e] = 0;
  __syncthreads();
  const int mine = t < npairs ? ids[t] : -1;
  if (mine >= 0) slot_of[mine] = 1;  // benign race: every writer writes 1
  __syncthreads();
  // slot of each used expert = number of used experts below it: thread t counts experts
  // [4t, 4t + 4), then an inclusive scan over the threads.
  int c = 0;
  for (int u = 0; u < 4; ++u) c += (4 * t + u < E) ? slot_of[4 * t + u] : 0;
  scan[t] = c;
  __syncthreads();
  for (int off = 1; off < 256; off <<= 1) {
    const int v = t >= off ? scan[t - off] : 0;
    __syncthreads();
    scan[t] += v;
    __syncthreads();
  }
  int base = t > 0 ? scan[t - 1] : 0;
  const int count = scan[255];
  __syncthreads();
  for (int u = 0; u < 4; ++u) {
    const int e = 4 * t + u;
    if (e < E && slot_of[e]) {
      slot_of[e] = base;
      slots[base * SLOT_W] = e;
      ++base;
    } else if (e < E) {
      slot_of[e] = -1;
    }
  }
  __syncthreads();
  // each pair's place in its expert's list: the pairs before it with the same expert
  if (mine >= 0) {
    int before = 0;
    for (int q = 0; q < t; ++q) before += ids[q] == mine;
    const int s = slot_of[mine];
    if (before < MOE_MAX_PAIRS) slots[s * SLOT_W + 2 + before] = t;
    int total = before;
    for (int q = t; q < npairs; ++q) total += ids[q] == mine;
    if (before == 0) slots[s * SLOT_W + 1] = total < MOE_MAX_PAIRS ? total : MOE_MAX_PAIRS;
  }
  if (t == 0) slots[nslots * SLOT_W] = count;
}

// ---------------------------------------------------------------------------------------
// Routing and the union in one launch (one block of 8 warps for all n <= 16 rows): warp w
// routes rows w and w + 8, each lane holding experts lane + 32u (u < PER, E <= 32 PER), the
// top-k found by k warp-wide argmax rounds (shuffles, no block barrier); then the block builds
// the union from the chosen ids in shared memory (build_union). A row's arithmetic (its
// softmax sums in lane order, its choices) depends on its logits and E alone.

#define RU_WARPS 8

// One row's routing by one warp. mode 0: softmax over all, top-k, renormalized iff renorm;
// 1: top-k logits, softmax over them; 2: sigmoid scores, choice = score + corr, the best
// topk_group of n_group groups (each scored by its two best choices), top-k within them;
// weights = scores (renormalized iff renorm). Then w *= pe_scale[e] (if given) * scale. The
// chosen ids / weights to ids_out / w_out [k] (global) and ids_sh [k] (shared). s_choice:
// this warp's E floats of shared memory.
template <int PER>
__device__ void route_row(const void* __restrict__ logits_in, int logits_bf16, int row, int E, int k, int mode,
                          int renorm, const float* __restrict__ corr, int n_group, int topk_group,
                          const float* __restrict__ pe_scale, float scale, int* __restrict__ ids_out,
                          float* __restrict__ w_out, int* ids_sh, float* s_choice) {
  const int lane = threadIdx.x % 32;
  const float* lf = static_cast<const float*>(logits_in) + (size_t)row * E;
  const bf16* lb = static_cast<const bf16*>(logits_in) + (size_t)row * E;
  float x[PER], score[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int e = lane + 32 * u;
    x[u] = e >= E ? -INFINITY : logits_bf16 ? __bfloat162float(lb[e]) : lf[e];
  }
  if (mode == 0) {
    float m = -INFINITY;
#pragma unroll
    for (int u = 0; u < PER; ++u) m = fmaxf(m, x[u]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float z = 0.f;
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      score[u] = lane + 32 * u < E ? __expf(x[u] - m) : 0.f;
      z += score[u];
    }
    z = warp_sum(z);
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      score[u] = score[u] / z;
      x[u] = lane + 32 * u < E ? score[u] : -INFINITY;  // choose by probability
    }
  } else if (mode == 2) {
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int e = lane + 32 * u;
      score[u] = e < E ? 1.f / (1.f + __expf(-x[u])) : 0.f;
      x[u] = e < E ? score[u] + corr[e] : -INFINITY;
    }
    if (topk_group < n_group) {
      // group scores: the sum of each group's two best choices (lane g < n_group scans group
      // g), then the best topk_group groups (lane 0; ties to the lower group)
      const int per = E / n_group;
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const int e = lane + 32 * u;
        if (e < E) s_choice[e] = x[u];
      }
      __syncwarp();
      float gs[2] = {-INFINITY, -INFINITY};
      unsigned keep_lo = 0, keep_hi = 0;  // groups kept (n_group <= 64)
      for (int gb = 0; gb < n_group; gb += 32) {
        const int grp = gb + lane;
        float a = -INFINITY, b = -INFINITY;
        if (grp < n_group) {
          for (int j = 0; j < per; ++j) {
            const float c = s_choice[grp * per + j];
            if (c > a) {
              b = a;
              a = c;
            } else if (c > b) {
              b = c;
            }
          }
        }
        gs[gb / 32] = grp < n_group ? (per >= 2 ? a + b : a) : -INFINITY;
      }
      for (int r = 0; r < topk_group; ++r) {
        float bv = -INFINITY;
        int bi = -1;
        for (int h = 0; h < 2; ++h) {
          const int grp = 32 * h + lane;
          const bool kept = (h ? keep_hi : keep_lo) >> lane & 1u;
          if (grp < n_group && !kept && (bi < 0 || gs[h] > bv)) {
            bv = gs[h];
            bi = grp;
          }
        }
        warp_argmax(bv, bi);
        if (bi >= 0) {
          if (bi < 32) keep_lo |= 1u << bi;
          else keep_hi |= 1u << (bi - 32);
        }
      }
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const int e = lane + 32 * u;
        if (e < E) {
          const int grp = e / per;
          const bool kept = (grp < 32 ? keep_lo >> grp : keep_hi >> (grp - 32)) & 1u;
          if (!kept) x[u] = -INFINITY;
        }
      }
    }
  } else {
#pragma unroll
    for (int u = 0; u < PER; ++u) score[u] = x[u];
  }
  // top-k, largest first, ties to the lower index; lane 0 keeps the chosen (id, score)
  int chosen[16];
  float chosen_w[16];
  for (int r = 0; r < k; ++r) {
    float bv = -INFINITY;
    int bi = -1;
    // indices grow with u: a strict > keeps the lowest index among equal values; -inf and
    // NaN are never chosen
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      if (lane + 32 * u < E && x[u] > bv) {
        bv = x[u];
        bi = lane + 32 * u;
      }
    }
    warp_argmax(bv, bi);
    float sw = 0.f;
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      if (lane + 32 * u == bi) {
        sw = score[u];
        x[u] = -INFINITY;
      }
    }
    // the owner's score to every lane (bi < 0: nothing chosen, weight 0)
    sw = __shfl_sync(0xffffffffu, sw, bi < 0 ? 0 : bi % 32);
#pragma unroll
    for (int q = 0; q < 16; ++q)
      if (q == r) {
        chosen[q] = bi;
        chosen_w[q] = sw;
      }
  }
  if (lane == 0) {
    float sum = 0.f;
    if (mode == 1) {
      const float m = chosen_w[0];
#pragma unroll
      for (int r = 0; r < 16; ++r)
        if (r < k) {
          chosen_w[r] = __expf(chosen_w[r] - m);
          sum += chosen_w[r];
        }
    } else {
#pragma unroll
      for (int r = 0; r < 16; ++r)
        if (r < k) sum += chosen_w[r];
      if (mode == 2) sum += 1e-20f;
    }
    const bool div = mode == 1 || renorm;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      if (r < k) {
        const int e = chosen[r];
        float wt = div ? chosen_w[r] / sum : chosen_w[r];
        if (pe_scale != nullptr && e >= 0) wt *= pe_scale[e];
        wt *= scale;
        ids_out[r] = e < 0 ? 0 : e;
        w_out[r] = e < 0 ? 0.f : wt;
        ids_sh[r] = e < 0 ? 0 : e;
      }
    }
  }
}

// Routing of all n rows, then the union (slots as build_union). ids [n, k], w [n, k].
template <int PER>
__device__ void route_union_impl(const void* __restrict__ logits_in, int logits_bf16, int n, int E, int k,
                                 int mode, int renorm, const float* __restrict__ corr, int n_group,
                                 int topk_group, const float* __restrict__ pe_scale, float scale,
                                 int* __restrict__ ids, float* __restrict__ w, int nslots,
                                 int* __restrict__ slots, int shared_e, const bf16* __restrict__ x,
                                 const bf16* __restrict__ gate, int hidden) {
  __shared__ float s_choice[RU_WARPS][32 * PER];
  __shared__ int ids_sh[256];
  const int t = threadIdx.x, warp = t / 32;
  for (int row = warp; row < n; row += RU_WARPS)
    route_row<PER>(logits_in, logits_bf16, row, E, k, mode, renorm, corr, n_group, topk_group, pe_scale,
                   scale, ids + (size_t)row * k, w + (size_t)row * k, ids_sh + row * k, s_choice[warp]);
  build_union(ids_sh, n * k, E, nslots, slots);
  if (shared_e < 0) return;
  // The shared expert (where the host gives one): one more slot after the union, expert shared_e (= E),
  // pairs n k + r for every row r; its weight ws[r] = sigmoid(bf16(x_r . gate)) (gate null: 1)
  // at w[n k + r]. Warp w takes rows w, w + 8 (lane-strided dot in a fixed order, then the
  // warp's butterfly sum: a row's bits depend on its values alone).
  for (int row = warp; row < n; row += RU_WARPS) {
    float acc = 0.f;
    if (gate != nullptr) {
      const bf16* xr = x + (size_t)row * hidden;
      for (int c = threadIdx.x % 32; c < hidden; c += 32)
        acc = fmaf(__bfloat162float(xr[c]), __bfloat162float(gate[c]), acc);
      acc = warp_sum(acc);
    }
    if (threadIdx.x % 32 == 0)
      w[(size_t)n * k + row] = gate != nullptr ? 1.f / (1.f + __expf(-rb(acc))) : 1.f;
  }
  __syncthreads();
  if (t == 0) {
    const int count = slots[nslots * SLOT_W];
    int* sl = slots + (size_t)count * SLOT_W;
    sl[0] = shared_e;
    sl[1] = n;
    for (int r = 0; r < n; ++r) sl[2 + r] = n * k + r;
    slots[nslots * SLOT_W] = count + 1;
  }
}

#define ROUTE_UNION(PER)                                                                                 \
  extern "C" __global__ void __launch_bounds__(32 * RU_WARPS) moe_route_union_e##PER(                    \
      const void* logits_in, int logits_bf16, int n, int E, int k, int mode, int renorm,               \
      const float* corr, int n_group, int topk_group, const float* pe_scale, float scale, int* ids,     \
      float* w, int nslots, int* slots, int shared_e, const bf16* x, const bf16* gate, int hidden) {     \
    route_union_impl<PER>(logits_in, logits_bf16, n, E, k, mode, renorm, corr, n_group, topk_group,     \
                          pe_scale, scale, ids, w, nslots, slots, shared_e, x, gate, hidden);           \
  }
ROUTE_UNION(4)
ROUTE_UNION(8)
ROUTE_UNION(16)
ROUTE_UNION(32)

#define MOE_WARPS 8

// Block x handles union slot x (nothing past the union's size): its expert and pairs.
__device__ int expert_pairs(const int* __restrict__ slots, int nslots, int* e_out, int* pairs) {
  __shared__ int count;
  const int b = blockIdx.x;
  const bool live = b < slots[nslots * SLOT_W];
  const int* sl = slots + (size_t)b * SLOT_W;
  if (threadIdx.x == 0) {
    *e_out = live ? sl[0] : -1;
    count = live ? sl[1] : 0;
  }
  if (live && threadIdx.x < MOE_MAX_PAIRS) pairs[threadIdx.x] = sl[2 + threadIdx.x];
  __syncthreads();
  return count;
}

// act modes: 0 silu(g) * u, 1 gelu_tanh(g) * u, 2 gpt-oss (clamp(u,-l,l)+1) * g' sigmoid(alpha g'),
// g' = min(g, l); each op rounded to bf16 as the unfused candle path rounds.
__device__ __forceinline__ float expert_act(float g, float u, int mode, float limit, float alpha) {
  if (mode == 0) {
    return rb(rb(g / (1.f + __expf(-g))) * u);
  } else if (mode == 1) {
    const float c = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return rb(rb(0.5f * g * (1.f + tanhf(c))) * u);
  }
  const float gl = fminf(g, limit);
  const float ul = fminf(fmaxf(u, -limit), limit);
  const float sig = rb(1.f / (1.f + __expf(-rb(gl * alpha))));
  const float glu = rb(gl * sig);
  return rb(rb(ul + 1.f) * glu);
}

// h[p, j] = act(x[p / k] . Wg[e, j] (+ bg), x[p / k] . Wu[e, j] (+ bu)) for the pairs p of
// expert e and j in this block's tile of `units` (8 warps x units / 8 each). gate_up [E, 2I, H]
// (gate rows, then up rows), bias [E, 2I] or null; h [npairs, I] bf16. H % 8 == 0. P bounds the
// pairs of one expert (the call's rows); a pair's sum does not depend on P.
template <int P>
__device__ void gate_up_impl(const bf16* __restrict__ x, const int* __restrict__ slots, int nslots, int k,
                             const bf16* __restrict__ gate_up, const bf16* __restrict__ bias, int inter,
                             int hidden, int units, int mode, float limit, float alpha,
                             bf16* __restrict__ h) {
  __shared__ int pairs[MOE_MAX_PAIRS];
  __shared__ int e_sh;
  const int np = expert_pairs(slots, nslots, &e_sh, pairs);
  if (np == 0) return;
  const int e = e_sh;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int kv = hidden / 8;
  const bf16* we = gate_up + (size_t)e * 2 * inter * hidden;
  const uint4* xr[P];
#pragma unroll
  for (int q = 0; q < P; ++q) xr[q] = reinterpret_cast<const uint4*>(x + (size_t)(pairs[q < np ? q : 0] / k) * hidden);
  for (int jj = warp; jj < units; jj += MOE_WARPS) {
    const int j = blockIdx.y * units + jj;
    if (j >= inter) break;
    const uint4* wg = reinterpret_cast<const uint4*>(we + (size_t)j * hidden);
    const uint4* wu = reinterpret_cast<const uint4*>(we + (size_t)(inter + j) * hidden);
    float ag[P], au[P];
#pragma unroll
    for (int q = 0; q < P; ++q) ag[q] = au[q] = 0.f;
#pragma unroll 4
    for (int i = lane; i < kv; i += 32) {
      const uint4 gv = __ldcs(wg + i), uv = __ldcs(wu + i);
      const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&gv);
      const __nv_bfloat162* up = reinterpret_cast<const __nv_bfloat162*>(&uv);
      float2 gf[4], uf[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        gf[t] = __bfloat1622float2(gp[t]);
        uf[t] = __bfloat1622float2(up[t]);
      }
#pragma unroll
      for (int q = 0; q < P; ++q) {
        if (q < np) {
          const uint4 xv = __ldg(xr[q] + i);
          const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const float2 xf = __bfloat1622float2(xp[t]);
            ag[q] = fmaf(gf[t].x, xf.x, ag[q]);
            ag[q] = fmaf(gf[t].y, xf.y, ag[q]);
            au[q] = fmaf(uf[t].x, xf.x, au[q]);
            au[q] = fmaf(uf[t].y, xf.y, au[q]);
          }
        }
      }
    }
#pragma unroll
    for (int q = 0; q < P; ++q) {
      if (q < np) {
        float g = rb(warp_sum(ag[q])), u = rb(warp_sum(au[q]));
        if (bias != nullptr) {
          g = rb(g + __bfloat162float(bias[(size_t)e * 2 * inter + j]));
          u = rb(u + __bfloat162float(bias[(size_t)e * 2 * inter + inter + j]));
        }
        if (lane == 0) h[(size_t)pairs[q] * inter + j] = __float2bfloat16(expert_act(g, u, mode, limit, alpha));
      }
    }
  }
}

// y[p, c] = h[p] . Wd[e, c] (+ b[e, c]) for the pairs p of expert e and c in this block's tile
// of `rows`; down [E, H, I], bias [E, H] or null; y [npairs, H] f32 (of the bf16-rounded value,
// as the unfused path rounds the expert's output). I % 8 == 0.
template <int P>
__device__ void down_impl(const bf16* __restrict__ h, const int* __restrict__ slots, int nslots,
                          const bf16* __restrict__ down,
                          const bf16* __restrict__ bias, int inter, int hidden, int rows,
                          float* __restrict__ y) {
  __shared__ int pairs[MOE_MAX_PAIRS];
  __shared__ int e_sh;
  const int np = expert_pairs(slots, nslots, &e_sh, pairs);
  if (np == 0) return;
  const int e = e_sh;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int kv = inter / 8;
  const bf16* we = down + (size_t)e * hidden * inter;
  const uint4* hr[P];
#pragma unroll
  for (int q = 0; q < P; ++q) hr[q] = reinterpret_cast<const uint4*>(h + (size_t)pairs[q < np ? q : 0] * inter);
  for (int cc = warp; cc < rows; cc += MOE_WARPS) {
    const int c = blockIdx.y * rows + cc;
    if (c >= hidden) break;
    const uint4* wr = reinterpret_cast<const uint4*>(we + (size_t)c * inter);
    float acc[P];
#pragma unroll
    for (int q = 0; q < P; ++q) acc[q] = 0.f;
#pragma unroll 4
    for (int i = lane; i < kv; i += 32) {
      const uint4 wv = __ldcs(wr + i);
      const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
      float2 wf[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) wf[t] = __bfloat1622float2(wp[t]);
#pragma unroll
      for (int q = 0; q < P; ++q) {
        if (q < np) {
          const uint4 hv = __ldg(hr[q] + i);
          const __nv_bfloat162* hp = reinterpret_cast<const __nv_bfloat162*>(&hv);
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const float2 hf = __bfloat1622float2(hp[t]);
            acc[q] = fmaf(wf[t].x, hf.x, acc[q]);
            acc[q] = fmaf(wf[t].y, hf.y, acc[q]);
          }
        }
      }
    }
#pragma unroll
    for (int q = 0; q < P; ++q) {
      if (q < np) {
        float v = rb(warp_sum(acc[q]));
        if (bias != nullptr) v = rb(v + __bfloat162float(bias[(size_t)e * hidden + c]));
        if (lane == 0) y[(size_t)pairs[q] * hidden + c] = v;
      }
    }
  }
}

#define MOE_GEMMS(P)                                                                                     \
  extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_gate_up_p##P(                         \
      const bf16* x, const int* slots, int nslots, int k, const bf16* gate_up, const bf16* bias,       \
      int inter, int hidden, int units, int mode, float limit, float alpha, bf16* h) {                  \
    gate_up_impl<P>(x, slots, nslots, k, gate_up, bias, inter, hidden, units, mode, limit, alpha, h);   \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_down_p##P(                            \
      const bf16* h, const int* slots, int nslots, const bf16* down, const bf16* bias, int inter,      \
      int hidden, int rows, float* y) {                                                                 \
    down_impl<P>(h, slots, nslots, down, bias, inter, hidden, rows, y);                                  \
  }
MOE_GEMMS(1)
MOE_GEMMS(2)
MOE_GEMMS(4)
MOE_GEMMS(8)
MOE_GEMMS(16)

// ---------------------------------------------------------------------------------------
// The expert GEMMs on the tensor cores.

#define MMA_WARPS 8

// Where a tile's weight rows come from. A source holds the 2A rows' pointers (lane column c
// included) and hands out, per 32-wide chunk of k, a raw load (issued U chunks ahead) and then
// the lane's 8 weights as bf16 (the uint4 the bf16 kernel loads): so every source feeds the
// mma the same values in the same order, and a source whose weights dequantize exactly to a
// bf16 matrix gives bit for bit the bf16 kernel's products on that matrix.

// bf16 weights: 16 bytes a lane a chunk.
template <int A>
struct BfRows {
  const uint4* p[2 * A];
  typedef uint4 Raw;
  __device__ __forceinline__ Raw load(int j, int ch) const { return load_weight(p[j] + ch * 4); }
  __device__ __forceinline__ static uint4 unpack(const Raw& r) { return r; }
  __device__ __forceinline__ static uint4 order(const uint4& x) { return x; }
};

// MXFP4 (OCP microscaling, gpt-oss's experts as published): a 32-wide chunk of a row is one
// group, 16 bytes of e2m1 codes (value 2i in byte i's low nibble, 2i + 1 in its high one) and
// one e8m0 scale byte; lane c's 8 values are the 4 bytes at 4c, nibble v = value v. Each code
// becomes its bf16 value by byte lookups (exact: e2m1 is {0, .5, 1, 1.5, 2, 3, 4, 6} x sign),
// then one bf16x2 multiply by 2^(scale - 127), exact in bf16 (a power of two times a value of
// two significant bits), so the weights are the load-time dequantization's to the bit.
__device__ __forceinline__ uint32_t e8m0_bf16x2(uint32_t s) {
  const uint32_t b = s != 0 ? s << 7 : 0x40u;  // 2^(s - 127); s = 0 is the subnormal 2^-127
  return b | (b << 16);
}

__device__ __forceinline__ uint4 mxfp4_bf16(uint32_t q, uint32_t scale) {
  // bf16 bytes of the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (codes 0-7): low, high
  const uint32_t lo0 = 0xC0800000u, lo1 = 0xC0804000u, hi0 = 0x3F3F3F00u, hi1 = 0x40404040u;
  const uint32_t sel = q & 0x77777777u, sel4 = sel >> 16;
  const uint32_t l0 = __byte_perm(lo0, lo1, sel), h0 = __byte_perm(hi0, hi1, sel);
  const uint32_t l1 = __byte_perm(lo0, lo1, sel4), h1 = __byte_perm(hi0, hi1, sel4);
  // signs: value 2i's is bit 7 of byte i of q << 4, value 2i + 1's bit 7 of byte i of q
  const uint32_t q4 = q << 4;
  const uint32_t m = 0x80008000u;
  uint32_t r[4];
  r[0] = __byte_perm(l0, h0, 0x5140) | (__byte_perm(q4, q, 0x4000) & m);
  r[1] = __byte_perm(l0, h0, 0x7362) | (__byte_perm(q4, q, 0x5010) & m);
  r[2] = __byte_perm(l1, h1, 0x5140) | (__byte_perm(q4, q, 0x6020) & m);
  r[3] = __byte_perm(l1, h1, 0x7362) | (__byte_perm(q4, q, 0x7030) & m);
  const __nv_bfloat162 s2 = *reinterpret_cast<const __nv_bfloat162*>(&scale);
  uint4 out;
  uint32_t* o = &out.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&r[i]), s2);
    o[i] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return out;
}

template <int A>
struct MxRows {
  const uint32_t* q[2 * A];  // the row's codes, at lane c's word
  const uint8_t* s[2 * A];   // the row's scales
  struct Raw {
    uint32_t q, s;
  };
  __device__ __forceinline__ Raw load(int j, int ch) const {
    return Raw{__ldg(q[j] + ch * 4), (uint32_t)__ldg(s[j] + ch)};
  }
  __device__ __forceinline__ static uint4 unpack(const Raw& r) { return mxfp4_bf16(r.q, e8m0_bf16x2(r.s)); }
  __device__ __forceinline__ static uint4 order(const uint4& x) { return x; }
};

// MLX affine 4-bit with bf16 scales (Qwen MoE experts as mlx-community publishes them), in
// nn::AffineWeight's layout: each row's words permuted inside blocks of 16 so that lane c's
// word of chunk ch is word (ch / 4) 16 + 4c + ch % 4, and a group's scale and bias one u32
// (scale low). A weight becomes bf16(s q + b) rounded once (kernels/affine.cuh, as the dense
// affine kernels' DEQ path), in the nibble-pair k order, so x is permuted to match.
template <int A>
struct AfRows {
  const uint32_t* q[2 * A];   // the row's words, at lane c's
  const uint32_t* sb[2 * A];  // the row's (scale, bias) words
  int gshift;                 // log2(group / 32)
  struct Raw {
    uint32_t q, p;
  };
  __device__ __forceinline__ Raw load(int j, int ch) const {
    return Raw{__ldg(q[j] + (ch >> 2) * 16 + (ch & 3)), __ldg(sb[j] + (ch >> gshift))};
  }
  __device__ __forceinline__ static uint4 unpack(const Raw& r) { return dequant4_word(r.q, r.p); }
  __device__ __forceinline__ static uint4 order(const uint4& x) { return order_x4(x); }
};

// An expert stack [E, rows, K] as a source of tiles: rows r[j] of expert e (sh: the layer's
// shared expert, bf16 only).
struct BfExperts {
  const bf16* w;
  const bf16* shared;
  int rows, K;
  template <int A>
  __device__ __forceinline__ BfRows<A> at(int e, bool sh, const int (&r)[2 * A]) const {
    const int c = threadIdx.x % 4;
    const bf16* we = sh ? shared : w + (size_t)e * rows * K;
    BfRows<A> src;
#pragma unroll
    for (int j = 0; j < 2 * A; ++j) src.p[j] = reinterpret_cast<const uint4*>(we + (size_t)r[j] * K) + c;
    return src;
  }
};

// MXFP4 stacks: codes [E, rows, K / 2], scales [E, rows, K / 32] (no shared expert).
struct MxExperts {
  const uint8_t* q;
  const uint8_t* s;
  int rows, K;
  template <int A>
  __device__ __forceinline__ MxRows<A> at(int e, bool, const int (&r)[2 * A]) const {
    const int c = threadIdx.x % 4;
    MxRows<A> src;
#pragma unroll
    for (int j = 0; j < 2 * A; ++j) {
      const size_t row = (size_t)e * rows + r[j];
      src.q[j] = reinterpret_cast<const uint32_t*>(q + row * (K / 2)) + c;
      src.s[j] = s + row * (K / 32);
    }
    return src;
  }
};

// Affine stacks: words [E, rows, K / 8] (permuted as above), (scale, bias) [E, rows, K / G]
// (no shared expert).
struct AfExperts {
  const uint32_t* q;
  const uint32_t* sb;
  int rows, K, gshift;
  template <int A>
  __device__ __forceinline__ AfRows<A> at(int e, bool, const int (&r)[2 * A]) const {
    const int c = threadIdx.x % 4;
    AfRows<A> src;
    src.gshift = gshift;
#pragma unroll
    for (int j = 0; j < 2 * A; ++j) {
      const size_t row = (size_t)e * rows + r[j];
      src.q[j] = q + row * (K / 8) + 4 * c;
      src.sb[j] = sb + row * (K >> (5 + gshift));
    }
    return src;
  }
};

// acc[a][t] += the products of weight rows 2a (rows g) / 2a + 1 (rows g + 8) of src with the
// gathered rows xp[t] (row 8t + g; xok false: zeros) over chunks [c0, c1) of 32 k. U chunks in
// flight (as kernels/mma.cu's gemm_rows); U changes when loads are issued, not the arithmetic.
template <int A, int T, int U, class Src>
__device__ __forceinline__ void mma_span(const Src& src, const uint4* const (&xp)[T], const bool (&xok)[T],
                                         int c0, int c1, float (&acc)[A][T][4]) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  typename Src::Raw wv[U][2 * A];
  uint4 xv[U][T];
  auto load = [&](int ch) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 2 * A; ++j) wv[u][j] = src.load(j, min(ch + u, c1 - 1));
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int t = 0; t < T; ++t) xv[u][t] = xok[t] ? __ldg(xp[t] + min(ch + u, c1 - 1) * 4) : zero;
  };
  if (c0 < c1) load(c0);
  for (int ch = c0; ch < c1; ch += U) {
    typename Src::Raw cw[U][2 * A];
    uint4 cx[U][T];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < 2 * A; ++j) cw[u][j] = wv[u][j];
#pragma unroll
      for (int t = 0; t < T; ++t) cx[u][t] = xv[u][t];
    }
    if (ch + U < c1) load(ch + U);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (ch + u < c1) {
        uint4 w[2 * A], xo[T];
#pragma unroll
        for (int j = 0; j < 2 * A; ++j) w[j] = Src::unpack(cw[u][j]);
#pragma unroll
        for (int t = 0; t < T; ++t) xo[t] = Src::order(cx[u][t]);
#pragma unroll
        for (int a = 0; a < A; ++a)
#pragma unroll
          for (int t = 0; t < T; ++t) mma_chunk(acc[a][t], w[2 * a], w[2 * a + 1], xo[t]);
      }
  }
}

// The slot's gathered row pointers: pair q's row is rows + (pairs[q] / div) * width (+ lane c);
// a pair p >= lim (the shared expert's, p = lim + row) reads row p - lim.
template <int T>
__device__ __forceinline__ void mma_rows(const bf16* __restrict__ rows, const int* pairs, int np, int div,
                                         int lim, int width, const uint4* (&xp)[T], bool (&xok)[T]) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const int q = 8 * t + g;
    xok[t] = q < np;
    const int p = pairs[xok[t] ? q : 0];
    xp[t] = reinterpret_cast<const uint4*>(rows + (size_t)(p >= lim ? p - lim : p / div) * width) + c;
  }
}

// One slot's product, staged for the epilogue: the gathered rows (pair q's row rows +
// (pairs[q] / div) * width) times the 2A weight rows of src, k = width split over the warps
// (the same split for every A, T and source: an output's arithmetic depends on the widths
// alone).
template <int A, int T, int U, class Src>
__device__ __forceinline__ void slot_product(const Src& src, const bf16* __restrict__ rows, const int* pairs,
                                             int np, int div, int lim, int width,
                                             float (*red)[16 * A][8 * T]) {
  const uint4* xp[T];
  bool xok[T];
  mma_rows<T>(rows, pairs, np, div, lim, width, xp, xok);
  const int chunks = width / 32, warp = threadIdx.x / 32;
  float acc[A][T][4] = {};
  mma_span<A, T, U>(src, xp, xok, warp * chunks / MMA_WARPS, (warp + 1) * chunks / MMA_WARPS, acc);
  stage_rows<T, A>(acc, red);
}

// As gate_up_impl, on the tensor cores: grid (slots, ceil(I / 8A)); block y takes units
// [8Ay, 8Ay + 8A). A = 2: m16 tile 0 holds gate units j0..j0+15, tile 1 the same units' up rows;
// A = 1 (twice the blocks, half the work each; not instantiated, see MOE_MMA): the tile holds
// gate units j0..j0+7 (rows 0-7) and their up rows (8-15). H % 32 == 0. The slot of expert
// shared_e (>= 0: the layer's shared expert, E) takes ex's shared stack [2I, H] (no bias); its
// pairs npairs + r read row r.
template <int A, int T, int U, class Ex>
__device__ void gate_up_mma(const bf16* __restrict__ x, const int* __restrict__ slots, int nslots, int k,
                            const Ex& ex, const bf16* __restrict__ bias, int inter, int hidden, int mode,
                            float limit, float alpha, bf16* __restrict__ h, int shared_e, int npairs) {
  __shared__ int pairs[MOE_MAX_PAIRS];
  __shared__ int e_sh;
  __shared__ float red[MMA_WARPS][16 * A][8 * T];
  const int np = expert_pairs(slots, nslots, &e_sh, pairs);
  if (np == 0) return;
  const int e = e_sh;
  const bool sh = e == shared_e;
  const int lane = threadIdx.x % 32, g = lane / 4;
  constexpr int UNITS = 8 * A;
  const int j0 = blockIdx.y * UNITS;
  // row j: A = 2: gate g, gate g + 8, up g, up g + 8; A = 1: gate g, up g (clamped past I,
  // never stored). red row of gate unit r: r (A = 2: r < 16) / r (A = 1: r < 8); its up row:
  // 16 + r / 8 + r.
  int r[2 * A];
#pragma unroll
  for (int j = 0; j < 2 * A; ++j) {
    const int up = A == 2 ? j / 2 : j;
    r[j] = up * inter + min(j0 + g + (A == 2 ? 8 * (j % 2) : 0), inter - 1);
  }
  slot_product<A, T, U>(ex.template at<A>(e, sh, r), x, pairs, np, k, shared_e >= 0 ? npairs : INT_MAX, hidden,
                        red);
  for (int i = threadIdx.x; i < UNITS * np; i += blockDim.x) {
    const int r = i % UNITS, q = i / UNITS, j = j0 + r;
    if (j >= inter) continue;
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int w = 0; w < MMA_WARPS; ++w) {
      gs += red[w][r][q];
      us += red[w][UNITS + r][q];
    }
    float gv = rb(gs), uv = rb(us);
    if (bias != nullptr && !sh) {
      gv = rb(gv + __bfloat162float(bias[(size_t)e * 2 * inter + j]));
      uv = rb(uv + __bfloat162float(bias[(size_t)e * 2 * inter + inter + j]));
    }
    h[(size_t)pairs[q] * inter + j] = __float2bfloat16(expert_act(gv, uv, mode, limit, alpha));
  }
}

// As down_impl, on the tensor cores: grid (slots, ceil(H / 16A)); block y takes output rows
// [16Ay, 16Ay + 16A). I % 32 == 0. The slot of expert shared_e takes ex's shared stack [H, I].
template <int A, int T, int U, class Ex>
__device__ void down_mma(const bf16* __restrict__ h, const int* __restrict__ slots, int nslots, const Ex& ex,
                         const bf16* __restrict__ bias, int inter, int hidden, float* __restrict__ y,
                         int shared_e) {
  __shared__ int pairs[MOE_MAX_PAIRS];
  __shared__ int e_sh;
  __shared__ float red[MMA_WARPS][16 * A][8 * T];
  const int np = expert_pairs(slots, nslots, &e_sh, pairs);
  if (np == 0) return;
  const bool sh = e_sh == shared_e;
  const int e = sh ? 0 : e_sh;
  if (sh) bias = nullptr;
  const int g = (threadIdx.x % 32) / 4;
  constexpr int ROWS = 16 * A;
  const int r0 = blockIdx.y * ROWS;
  int r[2 * A];
#pragma unroll
  for (int j = 0; j < 2 * A; ++j) r[j] = min(r0 + 8 * j + g, hidden - 1);
  slot_product<A, T, U>(ex.template at<A>(e, sh, r), h, pairs, np, 1, INT_MAX, inter, red);
  for (int i = threadIdx.x; i < ROWS * np; i += blockDim.x) {
    const int rr = i % ROWS, q = i / ROWS, cc = r0 + rr;
    if (cc >= hidden) continue;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < MMA_WARPS; ++w) s += red[w][rr][q];
    float v = rb(s);
    if (bias != nullptr) v = rb(v + __bfloat162float(bias[(size_t)e * hidden + cc]));
    y[(size_t)pairs[q] * hidden + cc] = v;
  }
}

// moe_{gate_up,down}_mma_t{T}: tiles of 16 units / 32 output rows (A = 2), 2 chunks in flight.
// (Tiles of 8 units / 16 rows at one row, A = 1 with 4 chunks in flight, ran on the H200 in
// session 24 no faster: qwen3_moe 18.1 + 13.6 us a layer vs 19.0 + 13.1, gpt_oss 44.0 + 24.2 vs
// 42.0 + 25.1; docs/perf.md.)
#define MOE_MMA(NAME, A, T, U, MINB)                                                                   \
  extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, MINB) moe_gate_up_mma_##NAME(              \
      const bf16* x, const int* slots, int nslots, int k, const bf16* gate_up, const bf16* bias,       \
      int inter, int hidden, int mode, float limit, float alpha, bf16* h, int shared_e, int npairs,     \
      const bf16* shared_gu) {                                                                          \
    gate_up_mma<A, T, U>(x, slots, nslots, k, BfExperts{gate_up, shared_gu, 2 * inter, hidden}, bias,   \
                         inter, hidden, mode, limit, alpha, h, shared_e, npairs);                       \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, MINB) moe_down_mma_##NAME(                 \
      const bf16* h, const int* slots, int nslots, const bf16* down, const bf16* bias, int inter,      \
      int hidden, float* y, int shared_e, const bf16* shared_down) {                                    \
    down_mma<A, T, U>(h, slots, nslots, BfExperts{down, shared_down, hidden, inter}, bias, inter, hidden, \
                      y, shared_e);                                                                     \
  }
MOE_MMA(t1, 2, 1, 2, 2)
MOE_MMA(t2, 2, 2, 2, 2)

// The same GEMMs over MXFP4 stacks (gpt-oss's experts kept as stored): codes [E, 2I, H / 2] /
// [E, H, I / 2], scales [E, 2I, H / 32] / [E, H, I / 32]; no shared expert. 4 chunks in flight
// (a chunk is 4 bytes a lane here, 16 for bf16).
#define MOE_MMA_MX(NAME, A, T, U, MINB)                                                                \
  extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, MINB) moe_gate_up_mma_mx_##NAME(           \
      const bf16* x, const int* slots, int nslots, int k, const uint8_t* q, const uint8_t* s,           \
      const bf16* bias, int inter, int hidden, int mode, float limit, float alpha, bf16* h) {           \
    gate_up_mma<A, T, U>(x, slots, nslots, k, MxExperts{q, s, 2 * inter, hidden}, bias, inter, hidden,  \
                         mode, limit, alpha, h, -1, 0);                                                 \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, MINB) moe_down_mma_mx_##NAME(              \
      const bf16* h, const int* slots, int nslots, const uint8_t* q, const uint8_t* s, const bf16* bias, \
      int inter, int hidden, float* y) {                                                                \
    down_mma<A, T, U>(h, slots, nslots, MxExperts{q, s, hidden, inter}, bias, inter, hidden, y, -1);     \
  }
MOE_MMA_MX(t1, 2, 1, 4, 2)
MOE_MMA_MX(t2, 2, 2, 4, 2)

// The same GEMMs over MLX affine 4-bit stacks (bf16 scales, groups of 32 << gshift): words
// [E, 2I, H / 8] / [E, H, I / 8], (scale, bias) [E, 2I, H / G] / [E, H, I / G]; no shared
// expert. 4 chunks in flight (4 bytes a lane a chunk).
#define MOE_MMA_AF(NAME, A, T, U, MINB)                                                                \
  extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, MINB) moe_gate_up_mma_af_##NAME(           \
      const bf16* x, const int* slots, int nslots, int k, const uint32_t* q, const uint32_t* sb,        \
      int gshift, const bf16* bias, int inter, int hidden, int mode, float limit, float alpha, bf16* h) { \
    gate_up_mma<A, T, U>(x, slots, nslots, k, AfExperts{q, sb, 2 * inter, hidden, gshift}, bias, inter,  \
                         hidden, mode, limit, alpha, h, -1, 0);                                         \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, MINB) moe_down_mma_af_##NAME(              \
      const bf16* h, const int* slots, int nslots, const uint32_t* q, const uint32_t* sb, int gshift,   \
      const bf16* bias, int inter, int hidden, float* y) {                                              \
    down_mma<A, T, U>(h, slots, nslots, AfExperts{q, sb, hidden, inter, gshift}, bias, inter, hidden, y, \
                      -1);                                                                              \
  }
MOE_MMA_AF(t1, 2, 1, 4, 2)
MOE_MMA_AF(t2, 2, 2, 4, 2)

// An MXFP4 stack dequantized to bf16 (out [groups * 32]): one thread a word of 8 codes.
// (Prefill's per-expert products, and the tests' device side of the dequantization.)
extern "C" __global__ void mxfp4_dequant(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                         long long groups, bf16* __restrict__ out) {
  const long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (w >= groups * 4) return;
  const uint32_t word = reinterpret_cast<const uint32_t*>(q)[w];
  reinterpret_cast<uint4*>(out)[w] = mxfp4_bf16(word, e8m0_bf16x2(s[w / 4]));
}

// out[r, c] = bf16(sum_{s < k} w[r, s] * y[r * k + s, c] (+ w[n k + r] y[n k + r, c] with the
// shared expert)), slots in order. grid (n, ceil(H / 256)).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ w, int k,
                                       int hidden, bf16* __restrict__ out, int shared) {
  const int r = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= hidden) return;
  float acc = 0.f;
  for (int s = 0; s < k; ++s) acc = fmaf(w[(size_t)r * k + s], y[((size_t)r * k + s) * hidden + c], acc);
  if (shared) {
    // the shared expert's pair of row r: n k + r
    const size_t p = (size_t)gridDim.x * k + r;
    acc = fmaf(w[p], y[p * hidden + c], acc);
  }
  out[(size_t)r * hidden + c] = __float2bfloat16(acc);
}
