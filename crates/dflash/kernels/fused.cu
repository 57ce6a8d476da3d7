// dflash fused CUDA kernels for the decode / verify / draft steps (bf16 in and out, f32
// arithmetic). Compiled to PTX by build.rs with --features cuda; wrapped in src/nn/cuda.rs,
// which checks shapes, contiguity and alignment before launching.
//
// A decode step of a 36-layer model ran ~25 candle ops per layer, each costing ~6.5 us of
// host time, so the step was bound by launching, not by the GPU. These kernels replace the
// chains that sit between the matmuls:
//   add_rmsnorm  residual add + RMSNorm                          (2 ops -> 1)
//   swiglu       silu(gate) * up on the stacked gate/up output   (3 ops -> 1)
//   kv_write     k: per-head RMSNorm + RoPE, v: copy, both into the KV cache rows
//                (reshape/transpose/contiguous/norm/rope/slice_set: ~9 ops -> 1)
//   attn         q: per-head RMSNorm + RoPE + scale, then causal / sliding / full
//                attention over the cache with an online softmax, split over the keys
//                (flash-decoding) + attn_combine when there is more than one split
//                (mask upload, scale, 2 matmuls, softmax, transpose: ~7 ops -> 1 or 2)
#include <cuda_bf16.h>
#include <limits.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#include "reduce.cuh"

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// ---------------------------------------------------------------------------------------
// out_sum[r] = bf16(res[r] + delta[r]); out_norm[r] = bf16(out_sum[r] * rsqrt(mean(out_sum^2)
// + eps) * w). One block per row.
extern "C" __global__ void add_rmsnorm_bf16(const bf16* __restrict__ res, const bf16* __restrict__ delta,
                                            const bf16* __restrict__ w, bf16* __restrict__ out_sum,
                                            bf16* __restrict__ out_norm, int h, float eps) {
  __shared__ float scratch[32];
  const size_t row = blockIdx.x;
  const bf16* a = res + row * h;
  const bf16* b = delta + row * h;
  bf16* s = out_sum + row * h;
  float ss = 0.f;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    bf16 v = __float2bfloat16(__bfloat162float(a[c]) + __bfloat162float(b[c]));
    s[c] = v;
    float f = __bfloat162float(v);
    ss += f * f;
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / h + eps);
  bf16* o = out_norm + row * h;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    o[c] = __float2bfloat16(__bfloat162float(s[c]) * inv * __bfloat162float(w[c]));
  }
}

// out[r, j] = bf16(bf16(silu(gu[r, j])) * gu[r, inter + j]) (the rounding of candle's silu
// then mul). gu [n, 2 * inter], out [n, inter].
extern "C" __global__ void swiglu_bf16(const bf16* __restrict__ gu, bf16* __restrict__ out, int inter,
                                       int n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)inter * n) return;
  const size_t r = i / inter, j = i % inter;
  float g = __bfloat162float(gu[r * 2 * inter + j]);
  float u = __bfloat162float(gu[r * 2 * inter + inter + j]);
  float act = round_bf16(g / (1.f + __expf(-g)));
  out[i] = __float2bfloat16(act * u);
}

// out[i] = float(x[i]) for n bf16 values (exact): each thread converts 8 (one 16-byte load,
// two 16-byte stores) when both buffers are 16-byte aligned (`vec`), else one. The LM head's
// logits of many rows (candle's cast ran at ~0.6 TB/s on them, 390 us for 256 x 152k on an
// H100, session 39).
extern "C" __global__ void bf16_to_f32(const bf16* __restrict__ x, float* __restrict__ out, long long n,
                                       int vec) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (vec) {
    const long long i = t * 8;
    if (i + 8 <= n) {
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(x + i));
      const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
      float f[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        f[2 * j] = __uint_as_float(ws[j] << 16);
        f[2 * j + 1] = __uint_as_float(ws[j] & 0xffff0000u);
      }
      reinterpret_cast<float4*>(out + i)[0] = make_float4(f[0], f[1], f[2], f[3]);
      reinterpret_cast<float4*>(out + i)[1] = make_float4(f[4], f[5], f[6], f[7]);
    } else {
      for (long long j = i; j < n; ++j) out[j] = __bfloat162float(x[j]);
    }
  } else if (t < n) {
    out[t] = __bfloat162float(x[t]);
  }
}

// One head row of D values from `src`, optionally RMS-normed (per head, weight w, rounded to
// bf16 as the unfused path does), then rotated (neox layout) on its first `rot` dims by the
// table row cs = [cos(rot/2) | sin(rot/2)]. Called by blockDim.x >= D threads; xs [D] shared;
// thread e < D returns element e (f32, not rounded), others return 0.
__device__ __forceinline__ float load_norm_rope(const bf16* __restrict__ src, const bf16* __restrict__ w,
                                                float eps, const bf16* __restrict__ cs, int rot, int d,
                                                float* xs, float* scratch) {
  const int e = threadIdx.x;
  float x = e < d ? __bfloat162float(src[e]) : 0.f;
  if (w != nullptr) {
    const float inv = rsqrtf(block_sum(x * x, scratch) / d + eps);
    if (e < d) x = round_bf16(x * inv * __bfloat162float(w[e]));
  }
  __syncthreads();
  if (e < d) xs[e] = x;
  __syncthreads();
  if (e < rot) {
    const int half = rot / 2;
    if (e < half) {
      x = xs[e] * __bfloat162float(cs[e]) - xs[e + half] * __bfloat162float(cs[half + e]);
    } else {
      x = xs[e] * __bfloat162float(cs[e - half]) + xs[e - half] * __bfloat162float(cs[e]);
    }
  }
  return x;
}

// Write rows pos0 .. pos0 + n of the KV cache kv [2, kvh, cap, d] (keys then values) from
// src [n, src_stride]: keys at column k_off + h * k_hs (normed with kw when given, roped with
// cs [n, rot]), values at v_off + h * v_hs (with v_unit: a scale-less RMSNorm, rounded to bf16
// as the unfused norm's output is). grid (kvh, n), block: d rounded up to a warp.
__device__ __forceinline__ void kv_write_row(const bf16* __restrict__ row, int k_off, int k_hs, int v_off,
                                             int v_hs, int v_unit, const bf16* __restrict__ kw, float eps,
                                             const bf16* __restrict__ cs_row, int rot, bf16* __restrict__ kv,
                                             int kvh, long long cap, int pos, int d, float* xs,
                                             float* scratch) {
  const int h = blockIdx.x, e = threadIdx.x;
  float k = load_norm_rope(row + k_off + h * k_hs, kw, eps, cs_row, rot, d, xs, scratch);
  const size_t dst = ((size_t)h * cap + pos) * d;
  const bf16* vr = row + v_off + h * v_hs;
  float v = e < d ? __bfloat162float(vr[e]) : 0.f;
  if (v_unit) {
    const float inv = rsqrtf(block_sum(v * v, scratch) / d + eps);
    v = round_bf16(v * inv);
  }
  if (e < d) {
    kv[dst + e] = __float2bfloat16(k);
    kv[(size_t)kvh * cap * d + dst + e] = __float2bfloat16(v);
  }
}

extern "C" __global__ void kv_write_bf16(const bf16* __restrict__ src, int src_stride, int k_off, int k_hs,
                                         int v_off, int v_hs, int v_unit, const bf16* __restrict__ kw,
                                         float eps, const bf16* __restrict__ cs, int rot,
                                         bf16* __restrict__ kv, int kvh, long long cap, int pos0, int d) {
  __shared__ float scratch[32];
  extern __shared__ float xs[];
  const int i = blockIdx.y;
  kv_write_row(src + (size_t)i * src_stride, k_off, k_hs, v_off, v_hs, v_unit, kw, eps, cs + (size_t)i * rot,
               rot, kv, kvh, cap, pos0 + i, d, xs, scratch);
}

// Several sequences' rows at once (batched decoding): row i of src / cs belongs to segment
// seg = meta[SEG_META * nseg + i], whose cache and first position are in its SEG_META entries
// (see SEG_* below); otherwise as kv_write_bf16. grid (kvh, total rows).
#define SEG_META 6
#define SEG_PTR 0
#define SEG_CAP 1
#define SEG_POS0 2
#define SEG_ROW0 3
#define SEG_N 4
#define SEG_GRP0 5
// pos0s (or null): the segments' first positions on the device, read instead of SEG_POS0 (a
// CUDA graph replays the launch at other positions). cs_by_pos: cs is a table over absolute
// positions (row p for position p) instead of one row per source row.
extern "C" __global__ void kv_write_seg_bf16(const bf16* __restrict__ src, int src_stride, int k_off, int k_hs,
                                             int v_off, int v_hs, int v_unit, const bf16* __restrict__ kw,
                                             float eps, const bf16* __restrict__ cs, int rot,
                                             const long long* __restrict__ meta, int nseg, int kvh, int d,
                                             const long long* __restrict__ pos0s, int cs_by_pos) {
  __shared__ float scratch[32];
  extern __shared__ float xs[];
  const int i = blockIdx.y;
  const long long seg = meta[SEG_META * nseg + i];
  const long long* m = meta + SEG_META * seg;
  bf16* kv = reinterpret_cast<bf16*>(m[SEG_PTR]);
  const long long pos0 = pos0s != nullptr ? pos0s[seg] : m[SEG_POS0];
  const int pos = (int)(pos0 + i - m[SEG_ROW0]);
  kv_write_row(src + (size_t)i * src_stride, k_off, k_hs, v_off, v_hs, v_unit, kw, eps,
               cs + (size_t)(cs_by_pos ? pos : i) * rot, rot, kv, kvh, m[SEG_CAP], pos, d, xs, scratch);
}

// Attention of query rows (q at columns q_off + head * q_hs of src [n, src_stride], normed with
// qw when given, roped with cs, times scale) over keys 0 .. kv_len of the cache kv [2, kvh,
// cap, D]. Query row i sits at position q_pos0 + i; a key j is visible iff (!causal || j <=
// pos) && (window == 0 || (j + window > pos && j < pos + window)). Head h reads KV head h / rep. sinks [heads]
// (bf16, or null): a logit per head that joins each softmax (gpt-oss). gate_off >= 0: the
// output is multiplied by sigmoid of the gate at column q_off + head * q_hs + gate_off of the
// row (hybrid Qwen attention), rounded as the unfused bf16 ops round.
//
// grid (kvh, splits, groups): block (g, s, q) serves the (row, head) pairs q*P .. q*P + P of
// KV head g (pair p: row p / rep, head g * rep + p % rep) over the keys of chunk s, [s * chunk,
// (s + 1) * chunk). The block's 4 warps split the chunk's keys (warp w: keys s * chunk + 4w +
// 16t .. + 4); each warp loads 4 keys and values at a time and uses them for all P pairs, so
// the chunk is read once per block, not once per query row (a 16-row verify of a 32-head model
// read every key 16 x 4 times). Lane l owns dims [l * D/32, (l + 1) * D/32) of q, k, v and the
// accumulators; online softmax per (warp, pair), merged across the warps in warp order. With
// one split the block writes the bf16 output rows; otherwise (m, l, acc[D]) go to part[((h *
// n + i) * splits + s)] for attn_combine.
//
// Batch invariance: a pair's arithmetic (its q's norm and rope, which keys each warp takes and
// in which groups of 4, the masking, the merge order) depends on its row's position and the
// chunk only, never on n or on the other pairs of its block, so a row gives the same bits in a
// 1-row decode step and in a 16-row verify.
// One output value from the merged (max M, sum L, accumulator a) of a (row, head): a / L, with
// the head's sink joining the softmax when there is one, times sigmoid(gate[e]) when gate is
// given (each rounded to bf16 as the unfused ops round).
__device__ __forceinline__ bf16 attn_finish(float a, float L, float M, bool has_sink, float sink,
                                            const bf16* __restrict__ gate, int e) {
  float o;
  if (has_sink) {
    const float M2 = fmaxf(M, sink);
    const float f = M == -INFINITY ? 0.f : __expf(M - M2);
    o = (a * f) / (L * f + __expf(sink - M2));
  } else {
    o = L > 0.f ? a / L : 0.f;
  }
  if (gate != nullptr) {
    const float g = __bfloat162float(gate[e]);
    const float sg = round_bf16(1.f / (1.f + __expf(-g)));
    o = round_bf16(o) * sg;
  }
  return __float2bfloat16(o);
}

// N consecutive bf16 (N even) from p as N / 2 raw 32-bit words, in the widest loads the
// alignment allows (p is 4 * (N / 2)-byte aligned: lane * N elements into a 16-byte aligned row).
template <int N>
__device__ __forceinline__ void load_bf16_words(const bf16* __restrict__ p, uint32_t (&w)[N / 2]) {
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int t = 0; t < N / 8; ++t) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + t);
      w[4 * t] = v.x;
      w[4 * t + 1] = v.y;
      w[4 * t + 2] = v.z;
      w[4 * t + 3] = v.w;
    }
  } else if constexpr (N % 4 == 0) {
#pragma unroll
    for (int t = 0; t < N / 4; ++t) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p) + t);
      w[2 * t] = v.x;
      w[2 * t + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int t = 0; t < N / 2; ++t) w[t] = __ldg(reinterpret_cast<const uint32_t*>(p) + t);
  }
}

// Element t of bf16 values held as raw words (little-endian: element 2i is word i's low half);
// exactly __bfloat162float of that element.
template <int W>
__device__ __forceinline__ float bf16_word_at(const uint32_t (&w)[W], int t) {
  const uint32_t x = w[t / 2];
  return __uint_as_float(t % 2 == 0 ? x << 16 : x & 0xffff0000u);
}

// A query row as both attention kernels take it, this lane's dims (lane * E ..): its D values
// from qr, RMS-normed by the weight qw when given (rounded to bf16 as the unfused path rounds),
// then rotated (neox layout) on its first `rot` dims by the table row c = [cos | sin]; xs [D]
// is the warp's scratch row (left holding the normed values). f32, not scaled.
template <int D, int E>
__device__ __forceinline__ void q_row(const bf16* __restrict__ qr, const bf16* __restrict__ qw, float eps,
                                      const bf16* __restrict__ c, int rot, int lane, float* xs,
                                      float (&x)[E]) {
  float ss = 0.f;
#pragma unroll
  for (int t = 0; t < E; ++t) {
    x[t] = __bfloat162float(qr[lane * E + t]);
    ss += x[t] * x[t];
  }
  if (qw != nullptr) {
    const float inv = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
    for (int t = 0; t < E; ++t) x[t] = round_bf16(x[t] * inv * __bfloat162float(qw[lane * E + t]));
  }
#pragma unroll
  for (int t = 0; t < E; ++t) xs[lane * E + t] = x[t];
  __syncwarp();
  const int half = rot / 2;
#pragma unroll
  for (int t = 0; t < E; ++t) {
    const int e = lane * E + t;
    if (e < half) {
      x[t] = xs[e] * __bfloat162float(c[e]) - xs[e + half] * __bfloat162float(c[half + e]);
    } else if (e < rot) {
      x[t] = xs[e] * __bfloat162float(c[e - half]) + xs[e - half] * __bfloat162float(c[e]);
    }
  }
  __syncwarp();
}

template <int DK, int DV, int P>
__device__ void attn_rows_block(const bf16* __restrict__ src, int src_stride, int q_off, int q_hs,
                                const bf16* __restrict__ qw, float eps, const bf16* __restrict__ cs,
                                int rot, float scale, const bf16* __restrict__ kp,
                                const bf16* __restrict__ vp, long long head_stride, int row_stride,
                                int kvh, int kv_len, int rep, int q_pos0, int causal, int window,
                                int chunk, int n, const bf16* __restrict__ sinks, int gate_off,
                                bf16* __restrict__ out, float* __restrict__ part, int grp, int part_n,
                                int part_row0, int* __restrict__ counters) {
  constexpr int D = DK;
  constexpr int E = DK / 32;   // key dims per lane
  constexpr int EV = DV / 32;  // value dims per lane
  constexpr int NW = 4;
  // Blocks of 1-2 pairs (decode steps, short blocks: nn::cuda::attention's attn_pick) with head
  // dims up to 256: the next 4 keys' loads are issued before the current 4 are used (and the
  // first 4 before the q preparation), so a warp waits for memory about once instead of once
  // per group. (At 8 pairs a block it ran slower on the H200, session 28: one group in
  // registers as before.)
  constexpr bool PIPE = E + EV <= 16 && P <= 2;
  __shared__ float qs[P][D];
  __shared__ float wm[NW][P], wl[NW][P];
  __shared__ float wacc[NW][P][DV];
  const int g = blockIdx.x, s = blockIdx.y;
  const int splits = gridDim.y, heads = kvh * rep, pairs = n * rep;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  const bf16* kbase = kp + (size_t)g * head_stride;
  const bf16* vbase = vp + (size_t)g * head_stride;
  const int j0 = s * chunk;
  const int jend = min(kv_len, j0 + chunk);
  // Raw bf16 words of 4 keys and their values (keys past the chunk: zeros).
  uint32_t kw[4][E / 2], vw[4][EV / 2];
  auto load_group = [&](int jb, uint32_t (&k)[4][E / 2], uint32_t (&v)[4][EV / 2]) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = jb + u;
      if (j < jend) {
        load_bf16_words<E>(kbase + (size_t)j * row_stride + lane * E, k[u]);
        load_bf16_words<EV>(vbase + (size_t)j * row_stride + lane * EV, v[u]);
      } else {
#pragma unroll
        for (int t = 0; t < E / 2; ++t) k[u][t] = 0u;
#pragma unroll
        for (int t = 0; t < EV / 2; ++t) v[u][t] = 0u;
      }
    }
  };
  if constexpr (PIPE) {
    if (j0 + warp * 4 < jend) load_group(j0 + warp * 4, kw, vw);
  }

  // 1. q of each pair: norm (warp sum), rope, scale; warp w prepares pairs w, w + NW, ...
  for (int pp = warp; pp < P; pp += NW) {
    const int p = grp * P + pp;
    if (p >= pairs) break;
    const int i = p / rep, h = g * rep + p % rep;
    float x[E];
    q_row<D, E>(src + (size_t)i * src_stride + q_off + h * q_hs, qw, eps, cs + (size_t)i * rot, rot, lane,
                qs[pp], x);
#pragma unroll
    for (int t = 0; t < E; ++t) qs[pp][lane * E + t] = x[t] * scale;
  }
  __syncthreads();

  // 2. This warp's keys of the chunk, 4 at a time, for every pair.
  float qv[P][E], m[P], l[P], acc[P][EV];
  int lo[P], hi[P];
#pragma unroll
  for (int pp = 0; pp < P; ++pp) {
    const int p = grp * P + pp;
    const int pos = q_pos0 + (p < pairs ? p / rep : 0);
    lo[pp] = window > 0 ? pos - window + 1 : 0;
    hi[pp] = p >= pairs ? 0 : causal ? min(kv_len, pos + 1) : window > 0 ? min(kv_len, pos + window) : kv_len;
    m[pp] = -INFINITY;
    l[pp] = 0.f;
#pragma unroll
    for (int t = 0; t < E; ++t) qv[pp][t] = qs[pp][lane * E + t];
#pragma unroll
    for (int t = 0; t < EV; ++t) acc[pp][t] = 0.f;
  }
  for (int jb = j0 + warp * 4; jb < jend; jb += NW * 4) {
    float kf[4][E], vv[4][EV];
    if constexpr (PIPE) {
      uint32_t ck[4][E / 2], cv[4][EV / 2];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int t = 0; t < E / 2; ++t) ck[u][t] = kw[u][t];
#pragma unroll
        for (int t = 0; t < EV / 2; ++t) cv[u][t] = vw[u][t];
      }
      if (jb + NW * 4 < jend) load_group(jb + NW * 4, kw, vw);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int t = 0; t < E; ++t) kf[u][t] = bf16_word_at(ck[u], t);
#pragma unroll
        for (int t = 0; t < EV; ++t) vv[u][t] = bf16_word_at(cv[u], t);
      }
    } else {
      load_group(jb, kw, vw);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int t = 0; t < E; ++t) kf[u][t] = bf16_word_at(kw[u], t);
#pragma unroll
        for (int t = 0; t < EV; ++t) vv[u][t] = bf16_word_at(vw[u], t);
      }
    }
#pragma unroll
    for (int pp = 0; pp < P; ++pp) {
      // Warp-uniform: skip the pairs that see none of these 4 keys (as if not iterated).
      if (jb >= hi[pp] || jb + 3 < lo[pp]) continue;
      float sc[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float dot = 0.f;
#pragma unroll
        for (int t = 0; t < E; ++t) dot = fmaf(qv[pp][t], kf[u][t], dot);
        dot = warp_sum(dot);
        const int j = jb + u;
        sc[u] = (j < jend && j < hi[pp] && j >= lo[pp]) ? dot : -INFINITY;
      }
      const float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
      if (mx == -INFINITY) continue;
      const float mn = fmaxf(m[pp], mx);
      const float corr = __expf(m[pp] - mn);
      l[pp] *= corr;
#pragma unroll
      for (int t = 0; t < EV; ++t) acc[pp][t] *= corr;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float pr = __expf(sc[u] - mn);
        l[pp] += pr;
#pragma unroll
        for (int t = 0; t < EV; ++t) acc[pp][t] = fmaf(pr, vv[u][t], acc[pp][t]);
      }
      m[pp] = mn;
    }
  }

  // 3. Merge the warps per pair, in warp order.
#pragma unroll
  for (int pp = 0; pp < P; ++pp) {
    if (lane == 0) {
      wm[warp][pp] = m[pp];
      wl[warp][pp] = l[pp];
    }
#pragma unroll
    for (int t = 0; t < EV; ++t) wacc[warp][pp][lane * EV + t] = acc[pp][t];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < P * DV; idx += blockDim.x) {
    const int pp = idx / DV, e = idx % DV;
    const int p = grp * P + pp;
    if (p >= pairs) break;
    const int i = p / rep, h = g * rep + p % rep;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, wm[w][pp]);
    float L = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = wm[w][pp] == -INFINITY ? 0.f : __expf(wm[w][pp] - M);
      L += wl[w][pp] * f;
      a += wacc[w][pp][e] * f;
    }
    const size_t pidx = ((size_t)h * part_n + part_row0 + i) * splits + s;
    if (splits == 1) {
      const bf16* grow = gate_off >= 0 ? src + (size_t)i * src_stride + q_off + h * q_hs + gate_off : nullptr;
      out[(size_t)i * heads * DV + (size_t)h * DV + e] =
          attn_finish(a, L, M, sinks != nullptr, sinks != nullptr ? __bfloat162float(sinks[h]) : 0.f, grow, e);
    } else {
      part[pidx * (DV + 2) + 2 + e] = a;
      if (e == 0) {
        part[pidx * (DV + 2)] = M;
        part[pidx * (DV + 2) + 1] = L;
      }
    }
  }
  if (splits == 1 || counters == nullptr) return;

  // 4. The last of the splits' blocks to finish merges them (attn_combine's arithmetic, splits in
  // order, so the bits do not depend on which block is last): one launch instead of two. Only
  // for blocks of 1-2 pairs (the host passes no counters otherwise: at 8 pairs a block the
  // merge's serial tail cost more than attn_combine's launch, session 28). The
  // blocks of one (KV head, pair group) count their arrivals in counters[x * gridDim.z + z]; the
  // last resets it to 0 for the next launch.
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* cnt = counters + (size_t)blockIdx.x * gridDim.z + blockIdx.z;
    last = atomicAdd(cnt, 1) == splits - 1;
    if (last) *cnt = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  // Thread t merges elements t + 128 j of the block's P x DV outputs, all j at once (the loads
  // of every element and split go out together: a serial loop over the elements waited for
  // L2 once per element and split, slower than attn_combine's launch at P = 8).
  constexpr int PER = (P * DV + 127) / 128;
  float Mx[PER], Ls[PER], As[PER];
  const float* pr[PER];
  bool ok[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int idx = threadIdx.x + 128 * j;
    const int pp = idx / DV, p = grp * P + pp;
    ok[j] = idx < P * DV && p < pairs;
    const int i = ok[j] ? p / rep : 0, h = ok[j] ? g * rep + p % rep : 0;
    pr[j] = part + ((size_t)h * part_n + part_row0 + i) * splits * (DV + 2);
    Mx[j] = -INFINITY;
    Ls[j] = 0.f;
    As[j] = 0.f;
  }
  for (int t = 0; t < splits; ++t) {
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (ok[j]) Mx[j] = fmaxf(Mx[j], __ldcg(pr[j] + t * (DV + 2)));
  }
  for (int t = 0; t < splits; ++t) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      if (!ok[j]) continue;
      const int e = (threadIdx.x + 128 * j) % DV;
      const float ms = __ldcg(pr[j] + t * (DV + 2));
      const float lv = __ldcg(pr[j] + t * (DV + 2) + 1);
      const float av = __ldcg(pr[j] + t * (DV + 2) + 2 + e);
      if (ms == -INFINITY) continue;
      const float f = __expf(ms - Mx[j]);
      Ls[j] += lv * f;
      As[j] += av * f;
    }
  }
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    if (!ok[j]) continue;
    const int idx = threadIdx.x + 128 * j;
    const int pp = idx / DV, e = idx % DV, p = grp * P + pp;
    const int i = p / rep, h = g * rep + p % rep;
    const bf16* grow = gate_off >= 0 ? src + (size_t)i * src_stride + q_off + h * q_hs + gate_off : nullptr;
    out[(size_t)i * heads * DV + (size_t)h * DV + e] =
        attn_finish(As[j], Ls[j], Mx[j], sinks != nullptr, sinks != nullptr ? __bfloat162float(sinks[h]) : 0.f, grow, e);
  }
}

// The segment of a batched attention block (blockIdx.z, from the metadata table's block
// column): its cache, capacity, first position (from the device step when given), first row,
// rows and first block.
struct SegBlock {
  const bf16* kp;
  long long cap;
  int pos0, row0, n, grp0;
};
__device__ __forceinline__ SegBlock seg_block(const long long* meta, int nseg, int total,
                                              const long long* pos0s) {
  const long long seg = meta[SEG_META * nseg + total + blockIdx.z];
  const long long* m = meta + SEG_META * seg;
  return SegBlock{reinterpret_cast<const bf16*>(m[SEG_PTR]), m[SEG_CAP],
                  (int)(pos0s != nullptr ? pos0s[seg] : m[SEG_POS0]), (int)m[SEG_ROW0], (int)m[SEG_N],
                  (int)m[SEG_GRP0]};
}

// Pairs per block: 8 (4 for head dim 256, to bound registers and shared memory).
// k / v: head g's keys and values start at kp / vp + g * head_stride, one row per position,
// row_stride apart (a joint cache: vp = kp + kvh * cap * D, head_stride cap * D, row_stride
// D; an MLA latent cache: one head, the values the first DV dims of the key rows).
#define ATTN(NAME, DK, DV, P)                                                                             \
  extern "C" __global__ void __launch_bounds__(128) NAME(                                                 \
      const bf16* src, int src_stride, int q_off, int q_hs, const bf16* qw, float eps, const bf16* cs,    \
      int rot, float scale, const bf16* kp, const bf16* vp, long long head_stride, int row_stride,       \
      int kvh, int kv_len, int rep, int q_pos0, int causal, int window, int chunk, int n,                 \
      const bf16* sinks, int gate_off, bf16* out, float* part, int* counters) {                           \
    attn_rows_block<DK, DV, P>(src, src_stride, q_off, q_hs, qw, eps, cs, rot, scale, kp, vp,            \
                               head_stride, row_stride, kvh, kv_len, rep, q_pos0, causal, window, chunk,  \
                               n, sinks, gate_off, out, part, blockIdx.z, n, 0, counters);                \
  }                                                                                                       \
  extern "C" __global__ void __launch_bounds__(128) NAME##_seg(                                           \
      const bf16* src, int src_stride, int q_off, int q_hs, const bf16* qw, float eps, const bf16* cs,    \
      int rot, float scale, const long long* meta, int nseg, int total, int kvh, int rep, int causal,     \
      int window, int chunk, const bf16* sinks, int gate_off, bf16* out, float* part,                     \
      const long long* pos0s, int cs_by_pos, int* counters) {                                             \
    const SegBlock sb = seg_block(meta, nseg, total, pos0s);                                              \
    const bf16* kp = sb.kp;                                                                               \
    const long long cap = sb.cap;                                                                         \
    const int pos0 = sb.pos0, row0 = sb.row0, n = sb.n;                                                   \
    attn_rows_block<DK, DV, P>(src + (size_t)row0 * src_stride, src_stride, q_off, q_hs, qw, eps,        \
                               cs + (size_t)(cs_by_pos ? pos0 : row0) * rot, rot, scale, kp,              \
                               kp + kvh * cap * DK, cap * DK,                                             \
                               DK, kvh, pos0 + n, rep, pos0, causal, window, chunk, n, sinks, gate_off,   \
                               out + (size_t)row0 * kvh * rep * DV, part, blockIdx.z - sb.grp0,  \
                               total, row0, counters);                                                    \
  }
ATTN(attn_bf16_d64, 64, 64, 8)
ATTN(attn_bf16_d128, 128, 128, 8)
ATTN(attn_bf16_d256, 256, 256, 4)
ATTN(attn_bf16_d512, 512, 512, 2)
// MLA (DeepSeek-V3 / Kimi): 512 latent + 64 rope dims per key row, the latent part as values.
ATTN(attn_bf16_k576_v512, 576, 512, 2)
// Fewer pairs per block, for grids that would leave multiprocessors idle (few KV heads, few
// rows, a short context: nn::cuda::attention's attn_pick). Same arithmetic per pair.
ATTN(attn_bf16_d64_p2, 64, 64, 2)
ATTN(attn_bf16_d64_p1, 64, 64, 1)
ATTN(attn_bf16_d128_p2, 128, 128, 2)
ATTN(attn_bf16_d128_p1, 128, 128, 1)
ATTN(attn_bf16_d256_p1, 256, 256, 1)
ATTN(attn_bf16_d512_p1, 512, 512, 1)
ATTN(attn_bf16_k576_v512_p1, 576, 512, 1)

// ---------------------------------------------------------------------------------------
// ATTN_MMA (nn::cuda::attention's attn_pick: launches of more than 16 rows, or every launch
// with DFLASH_ATTN_MMA=1; proven on an H100 in session 41, docs/perf.md): the same launches as ATTN
// (grid (kvh, splits, groups), 128 threads, the same arguments, the same partial results for
// attn_combine), with the (row, head) pairs of a block on the tensor cores: 64 pairs a block,
// 16 a warp (one mma row tile), against the chunk's 64 keys at once. The CUDA-core ATTN kernel
// takes a warp-wide dot product (five shuffles) per key and pair, so its time grows with the
// rows of a verify block: 143 us a layer at 32 sequences x 8 rows against 26 us at one row
// (H100, docs/perf.md session 39).
//
// Per block: (1) each pair's q row normed (weight qw) and rotated as ATTN does, then rounded to
// bf16 (the mma's operand; the scale multiplies the scores); (2) each warp's q tiles into
// registers; (3) the chunk's keys and values into shared memory (zeros past the chunk); (4) S =
// q k^T (16 x 64 a warp, f32), scaled and masked per (row position, key); (5) per row its max
// M, p = exp(s - M) rounded to bf16, L = the sum of the rounded p; (6) o = p v (16 x D, f32);
// (7) with one split, o / L (attn_finish: sinks, gate) into the output rows; otherwise (M, L,
// o) into `part` for attn_combine. A row's arithmetic (which keys, in which mma order, its
// reductions over the four lanes that hold it) depends on its q row, its position and the chunk
// only, never on the block's other rows: a verify row gives the bits of the decode step at its
// position when both run this kernel (DFLASH_ATTN_MMA=1; `auto` gives it only launches past the
// batch-invariant ones).
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two bf16 as the mma's 32-bit operand: `lo` the element of the lower index.
__device__ __forceinline__ uint32_t pack_bf16x2(bf16 lo, bf16 hi) {
  return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}

constexpr int MMA_PAIRS = 64;  // (row, head) pairs a block: 4 warps x 16
constexpr int MMA_KEYS = 64;   // keys a block: nn::cuda::attention's ATTN_CHUNK

template <int D>
__device__ void attn_mma_block(const bf16* __restrict__ src, int src_stride, int q_off, int q_hs,
                               const bf16* __restrict__ qw, float eps, const bf16* __restrict__ cs,
                               int rot, float scale, const bf16* __restrict__ kp,
                               const bf16* __restrict__ vp, long long head_stride, int row_stride,
                               int kvh, int kv_len, int rep, int q_pos0, int causal, int window,
                               int chunk, int n, const bf16* __restrict__ sinks, int gate_off,
                               bf16* __restrict__ out, float* __restrict__ part, int grp, int part_n,
                               int part_row0) {
  constexpr int P = MMA_PAIRS, NW = 4, KC = MMA_KEYS;
  constexpr int E = D / 32;   // q dims per lane while preparing
  constexpr int LD = D + 8;   // a shared row (bf16), padded: the fragment loads hit 32 banks
  constexpr int KT = D / 16;  // k steps of q k^T
  constexpr int NT = KC / 8;  // key tiles of S
  constexpr int DT = D / 8;   // value-dim tiles of o
  __shared__ __align__(16) bf16 ks[KC * LD];
  __shared__ __align__(16) bf16 qvs[P * LD];  // q rows, then the chunk's values
  __shared__ float xs[NW][D];
  const int g = blockIdx.x, s = blockIdx.y;
  const int splits = gridDim.y, heads = kvh * rep, pairs = n * rep;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gid = lane >> 2, tig = lane & 3;
  const bf16* kbase = kp + (size_t)g * head_stride;
  const bf16* vbase = vp + (size_t)g * head_stride;
  const int j0 = s * chunk;
  const int jend = min(kv_len, j0 + chunk);

  // 1. q rows: norm, rope (f32, as ATTN), rounded to bf16; padding pairs zero.
  for (int pp = warp; pp < P; pp += NW) {
    const int p = grp * P + pp;
    bf16* qrow = qvs + pp * LD;
    if (p >= pairs) {
      for (int t = lane; t < D; t += 32) qrow[t] = __float2bfloat16(0.f);
      continue;
    }
    const int i = p / rep, h = g * rep + p % rep;
    float x[E];
    q_row<D, E>(src + (size_t)i * src_stride + q_off + h * q_hs, qw, eps, cs + (size_t)i * rot, rot, lane,
                xs[warp], x);
#pragma unroll
    for (int t = 0; t < E; ++t) qrow[lane * E + t] = __float2bfloat16(x[t]);
  }
  __syncthreads();

  // 2. This warp's q tile (pairs warp * 16 ..) as mma A fragments, for every k step.
  uint32_t qa[KT][4];
  {
    const bf16* q0 = qvs + (warp * 16 + gid) * LD + tig * 2;
    const bf16* q8 = q0 + 8 * LD;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      qa[kt][0] = *reinterpret_cast<const uint32_t*>(q0 + kt * 16);
      qa[kt][1] = *reinterpret_cast<const uint32_t*>(q8 + kt * 16);
      qa[kt][2] = *reinterpret_cast<const uint32_t*>(q0 + kt * 16 + 8);
      qa[kt][3] = *reinterpret_cast<const uint32_t*>(q8 + kt * 16 + 8);
    }
  }
  __syncthreads();

  // 3. The chunk's keys and values (16-byte loads; zeros past the chunk's end).
  for (int idx = threadIdx.x; idx < KC * (D / 8); idx += blockDim.x) {
    const int r = idx / (D / 8), c8 = idx % (D / 8);
    const int j = j0 + r;
    uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = make_uint4(0u, 0u, 0u, 0u);
    if (j < jend) {
      kv = __ldg(reinterpret_cast<const uint4*>(kbase + (size_t)j * row_stride) + c8);
      vv = __ldg(reinterpret_cast<const uint4*>(vbase + (size_t)j * row_stride) + c8);
    }
    *reinterpret_cast<uint4*>(ks + r * LD + c8 * 8) = kv;
    *reinterpret_cast<uint4*>(qvs + r * LD + c8 * 8) = vv;
  }
  __syncthreads();
  if (grp * P + warp * 16 >= pairs) return;  // a warp of padding rows only

  // 4. S = q k^T, scaled; masked per (row, key) as ATTN masks.
  float sacc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) sacc[nt][c] = 0.f;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const bf16* kr = ks + (nt * 8 + gid) * LD + kt * 16 + tig * 2;
      mma_bf16_16816(sacc[nt], qa[kt], *reinterpret_cast<const uint32_t*>(kr),
                     *reinterpret_cast<const uint32_t*>(kr + 8));
    }
  }
  int lo[2], hi[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int p = grp * P + warp * 16 + gid + 8 * rr;
    const int pos = q_pos0 + (p < pairs ? p / rep : 0);
    lo[rr] = window > 0 ? pos - window + 1 : 0;
    hi[rr] = p >= pairs ? 0 : causal ? min(kv_len, pos + 1) : window > 0 ? min(kv_len, pos + window) : kv_len;
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int rr = c / 2, j = j0 + nt * 8 + tig * 2 + (c & 1);
      const float v = (j < jend && j >= lo[rr] && j < hi[rr]) ? sacc[nt][c] * scale : -INFINITY;
      sacc[nt][c] = v;
      mx[rr] = fmaxf(mx[rr], v);
    }
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
    mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
  }

  // 5. p = exp(s - M) rounded to bf16 (the operand of p v); L = the sum of those p.
  float l[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int rr = c / 2;
      const float e = mx[rr] == -INFINITY ? 0.f : round_bf16(__expf(sacc[nt][c] - mx[rr]));
      sacc[nt][c] = e;
      l[rr] += e;
    }
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
  }

  // 6. o = p v: S's accumulators are the A fragments of p (keys 16 ks ..), v's B fragments
  // gathered from the shared rows.
  float oacc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) oacc[dt][c] = 0.f;
  const bf16* vs = qvs;
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t pa[4];
    pa[0] = pack_bf16x2(__float2bfloat16(sacc[2 * kk][0]), __float2bfloat16(sacc[2 * kk][1]));
    pa[1] = pack_bf16x2(__float2bfloat16(sacc[2 * kk][2]), __float2bfloat16(sacc[2 * kk][3]));
    pa[2] = pack_bf16x2(__float2bfloat16(sacc[2 * kk + 1][0]), __float2bfloat16(sacc[2 * kk + 1][1]));
    pa[3] = pack_bf16x2(__float2bfloat16(sacc[2 * kk + 1][2]), __float2bfloat16(sacc[2 * kk + 1][3]));
    const bf16* v0 = vs + (kk * 16 + tig * 2) * LD + gid;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      const bf16* v = v0 + dt * 8;
      mma_bf16_16816(oacc[dt], pa, pack_bf16x2(v[0], v[LD]), pack_bf16x2(v[8 * LD], v[9 * LD]));
    }
  }

  // 7. Out: the bf16 rows (one split) or (M, L, o) for attn_combine.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int p = grp * P + warp * 16 + gid + 8 * rr;
    if (p >= pairs) continue;
    const int i = p / rep, h = g * rep + p % rep;
    const size_t pidx = ((size_t)h * part_n + part_row0 + i) * splits + s;
    const bf16* grow = gate_off >= 0 ? src + (size_t)i * src_stride + q_off + h * q_hs + gate_off : nullptr;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
      for (int c2 = 0; c2 < 2; ++c2) {
        const int e = dt * 8 + tig * 2 + c2;
        const float a = oacc[dt][rr * 2 + c2];
        if (splits == 1) {
          out[(size_t)i * heads * D + (size_t)h * D + e] =
              attn_finish(a, l[rr], mx[rr], sinks != nullptr, sinks != nullptr ? __bfloat162float(sinks[h]) : 0.f,
                          grow, e);
        } else {
          part[pidx * (D + 2) + 2 + e] = a;
        }
      }
    }
    if (splits > 1 && tig == 0) {
      part[pidx * (D + 2)] = mx[rr];
      part[pidx * (D + 2) + 1] = l[rr];
    }
  }
}

// The single-sequence and the batched (`_seg`) entry points, as ATTN's (the counters unused:
// the splits are merged by attn_combine).
#define ATTN_MMA(NAME, D)                                                                                 \
  extern "C" __global__ void __launch_bounds__(128) NAME(                                                 \
      const bf16* src, int src_stride, int q_off, int q_hs, const bf16* qw, float eps, const bf16* cs,    \
      int rot, float scale, const bf16* kp, const bf16* vp, long long head_stride, int row_stride,       \
      int kvh, int kv_len, int rep, int q_pos0, int causal, int window, int chunk, int n,                 \
      const bf16* sinks, int gate_off, bf16* out, float* part, int* counters) {                           \
    attn_mma_block<D>(src, src_stride, q_off, q_hs, qw, eps, cs, rot, scale, kp, vp, head_stride,        \
                      row_stride, kvh, kv_len, rep, q_pos0, causal, window, chunk, n, sinks, gate_off,    \
                      out, part, blockIdx.z, n, 0);                                                       \
  }                                                                                                       \
  extern "C" __global__ void __launch_bounds__(128) NAME##_seg(                                           \
      const bf16* src, int src_stride, int q_off, int q_hs, const bf16* qw, float eps, const bf16* cs,    \
      int rot, float scale, const long long* meta, int nseg, int total, int kvh, int rep, int causal,     \
      int window, int chunk, const bf16* sinks, int gate_off, bf16* out, float* part,                     \
      const long long* pos0s, int cs_by_pos, int* counters) {                                             \
    const SegBlock sb = seg_block(meta, nseg, total, pos0s);                                              \
    const bf16* kp = sb.kp;                                                                               \
    const long long cap = sb.cap;                                                                         \
    const int pos0 = sb.pos0, row0 = sb.row0, n = sb.n;                                                   \
    attn_mma_block<D>(src + (size_t)row0 * src_stride, src_stride, q_off, q_hs, qw, eps,                 \
                      cs + (size_t)(cs_by_pos ? pos0 : row0) * rot, rot, scale, kp, kp + kvh * cap * D,  \
                      cap * D, D, kvh, pos0 + n, rep, pos0, causal, window, chunk, n, sinks, gate_off,    \
                      out + (size_t)row0 * kvh * rep * D, part, blockIdx.z - sb.grp0, total,     \
                      row0);                                                                              \
  }
ATTN_MMA(attn_mma_d64, 64)
ATTN_MMA(attn_mma_d128, 128)

// Merge the splits of attn: grid (heads, n), block d threads (rounded up to a warp); sinks and
// the output gate as in attn (src, src_stride, q_off, q_hs locate the gate).
extern "C" __global__ void attn_combine_bf16(const float* __restrict__ part, bf16* __restrict__ out, int splits,
                                             int d, const bf16* __restrict__ sinks,
                                             const bf16* __restrict__ src, int src_stride, int q_off, int q_hs,
                                             int gate_off) {
  const int h = blockIdx.x, i = blockIdx.y, heads = gridDim.x, n = gridDim.y;
  const int e = threadIdx.x;
  const float* p = part + ((size_t)h * n + i) * splits * (d + 2);
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, p[s * (d + 2)]);
  float L = 0.f, a = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float ms = p[s * (d + 2)];
    if (ms == -INFINITY) continue;
    const float f = __expf(ms - M);
    L += p[s * (d + 2) + 1] * f;
    if (e < d) a += p[s * (d + 2) + 2 + e] * f;
  }
  if (e < d) {
    const bf16* grow = gate_off >= 0 ? src + (size_t)i * src_stride + q_off + h * q_hs + gate_off : nullptr;
    out[(size_t)i * heads * d + (size_t)h * d + e] =
        attn_finish(a, L, M, sinks != nullptr, sinks != nullptr ? __bfloat162float(sinks[h]) : 0.f, grow, e);
  }
}

// A single-thread busy wait of `cycles` SM clocks: the micro bench queues a step behind it to
// time the step's kernels with the host out of the way (nn::cuda::gpu_time_host_ahead).
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}


// Greedy choice per row of f32 logits x [rows, vocab]: the largest value, the lowest index
// among equal ones; NaN never wins; a row with no value above -inf gives 0 (as
// sampling::argmax on the host). Two launches: argmax_part (grid (chunks, rows), 256
// threads) reduces each chunk of a row to (value, index), argmax_final (grid rows, one warp)
// merges a row's chunks. candle's argmax gives a whole row to one block with 64-bit index
// arithmetic per element: ~40-90 us for the 152k-word vocabulary on the H200.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

__device__ __forceinline__ void argmax_warp(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    argmax_merge(v, i, v2, i2);
  }
}

extern "C" __global__ void argmax_part_f32(const float* __restrict__ x, int vocab, int chunk,
                                           float* __restrict__ pv, int* __restrict__ pi) {
  __shared__ float sv[8];
  __shared__ int si[8];
  const int c = blockIdx.x, r = blockIdx.y, chunks = gridDim.x;
  const float* row = x + (size_t)r * vocab;
  const int j0 = c * chunk, j1 = min(vocab, j0 + chunk);
  float v = -INFINITY;
  int i = INT_MAX;
  for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
    const float y = row[j];
    if (y > v) {  // j increases per thread: the first of equal values stays
      v = y;
      i = j;
    }
  }
  argmax_warp(v, i);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? sv[lane] : -INFINITY;
    i = lane < blockDim.x / 32 ? si[lane] : INT_MAX;
    argmax_warp(v, i);
    if (lane == 0) {
      pv[(size_t)r * chunks + c] = v;
      pi[(size_t)r * chunks + c] = i;
    }
  }
}

extern "C" __global__ void argmax_final(const float* __restrict__ pv, const int* __restrict__ pi,
                                        int chunks, uint32_t* __restrict__ out) {
  const int r = blockIdx.x, lane = threadIdx.x;
  float v = -INFINITY;
  int i = INT_MAX;
  for (int c = lane; c < chunks; c += 32) argmax_merge(v, i, pv[(size_t)r * chunks + c], pi[(size_t)r * chunks + c]);
  argmax_warp(v, i);
  if (lane == 0) out[r] = i == INT_MAX ? 0u : (uint32_t)i;
}

// Plain temperature sampling of every row of f32 logits x [rows, vocab] (no top-k / top-p /
// min-p), the host sampler's rule on the device: token j has weight w_j = exp((x_j - max) / t)
// (0 for non-finite logits); with u the row's uniform in [0, 1), the answer is the first j in
// token order whose cumulative weight exceeds u * sum(w) (the last positive-weight token if
// rounding leaves none). One block of 1024 threads per row; thread k owns the contiguous
// tokens [k * seg, (k + 1) * seg), sums its weights in f64, a block scan gives each thread
// its starting cumulative weight, and the one thread whose range holds u * sum scans its
// tokens. Sums are grouped differently from the host's single pass, so a draw can differ
// from the host's only when u * sum falls within rounding of a boundary between two tokens.
__device__ __forceinline__ float sample_weight(float x, float m, float t) {
  return isfinite(x) ? expf((x - m) / t) : 0.f;
}

extern "C" __global__ void __launch_bounds__(1024)
    sample_rows_f32(const float* __restrict__ x, int vocab, float t, const double* __restrict__ u,
                    uint32_t* __restrict__ out) {
  __shared__ float smax[32];
  __shared__ double ssum[32];
  __shared__ int slast[32];
  __shared__ int found;
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int nw = blockDim.x / 32;
  const float* row = x + (size_t)r * vocab;
  // 1. max over the finite logits (coalesced).
  float m = -INFINITY;
  for (int j = tid; j < vocab; j += blockDim.x) {
    const float v = row[j];
    if (isfinite(v)) m = fmaxf(m, v);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) smax[warp] = m;
  if (tid == 0) found = 0;
  __syncthreads();
  m = -INFINITY;
  for (int w = 0; w < nw; ++w) m = fmaxf(m, smax[w]);
  // 2. this thread's tokens: weight sum (f64) and last positive-weight token.
  const int seg = (vocab + blockDim.x - 1) / blockDim.x;
  const int a = min(vocab, tid * seg), b = min(vocab, a + seg);
  double s = 0.0;
  int last = -1;
  for (int j = a; j < b; ++j) {
    const float w = sample_weight(row[j], m, t);
    if (w > 0.f) {
      s += (double)w;
      last = j;
    }
  }
  // 3. block scan of s (inclusive within the warp, then over the warps' totals).
  double inc = s;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  int lw = last;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lw = max(lw, __shfl_xor_sync(0xffffffffu, lw, o));
  if (lane == 31) ssum[warp] = inc;
  if (lane == 0) slast[warp] = lw;
  __syncthreads();
  double before = 0.0, total = 0.0;
  int lastall = -1;
  for (int w = 0; w < nw; ++w) {
    if (w < warp) before += ssum[w];
    total += ssum[w];
    lastall = max(lastall, slast[w]);
  }
  // This thread's range [lo_t, hi): lo_t is the previous thread's hi (the same additions), so
  // the ranges tile [0, total) exactly and one thread holds the target.
  const double hi = before + inc;
  const double prev_hi = __shfl_up_sync(0xffffffffu, hi, 1);
  const double lo_t = lane == 0 ? before : prev_hi;
  const double target = u[r] * total;
  if (s > 0.0 && target >= lo_t && target < hi) {
    found = 1;
    const double rel = target - lo_t;
    double cum = 0.0;
    int pick = last;
    for (int j = a; j < b; ++j) {
      const float w = sample_weight(row[j], m, t);
      if (w > 0.f) {
        cum += (double)w;
        if (rel < cum) {
          pick = j;
          break;
        }
      }
    }
    out[r] = (uint32_t)pick;
  }
  __syncthreads();
  if (tid == 0 && !found) out[r] = lastall < 0 ? 0u : (uint32_t)lastall;
}
