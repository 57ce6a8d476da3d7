// DFlash2 draft kernels. Wrapped in src/nn/cuda/dflash2.rs; nn::dyn_conv and
// draft::dflash2 decide when they run.
//
//   dyn_conv     the grouped dynamic causal convolution over each block's rows (one launch
//                instead of ~6 candle ops per kernel offset)
//   top_k_warp   the k largest logits of each row and their ids (the selector's candidates),
//                in two stages (row parts over the whole GPU, then a merge), so the logits
//                never leave the device; each warp holds a sorted list, and a ballot against
//                its last entry passes the few candidates that can enter it
//   selector_pairs, selector_walk
//                the selector on the device: every row's pair scores from each candidate of
//                the row before, all at once, then the left-to-right walk over that table in
//                one block, so a proposal is one download of n ids
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#include "reduce.cuh"
#include "dyn_conv.cuh"

// The convolution of row i, channel c (kernels/dyn_conv.cuh: the same arithmetic as the skinny
// GEMM's convolving epilogue).
__device__ __forceinline__ float conv_at(const bf16* __restrict__ x, const bf16* __restrict__ dyn,
                                         long long dyn_stride, const bf16* __restrict__ base,
                                         int i, int c, int h, int K, int group, int block) {
  return conv_value([&](int row) { return __bfloat162float(x[(size_t)row * h + c]); },
                    DynRows{dyn, dyn_stride, h / group},
                    [&](int o) { return __bfloat162float(base[(size_t)o * h + c]); }, i, c, K,
                    group, block);
}

// out[i, c] = sum over o < K, o <= i % block of (base[o, c] + dyn[i, o * G + c / group]) *
// x[i - o, c], G = h / group, in f32, rounded once to bf16. x, out [n, h]; dyn rows of
// dyn_stride elements (a column slice of the kernel projection); base [K, h]. One thread per
// (row, channel).
extern "C" __global__ void dyn_conv(const bf16* __restrict__ x, const bf16* __restrict__ dyn,
                                    long long dyn_stride, const bf16* __restrict__ base, int n, int h,
                                    int K, int group, int block, bf16* __restrict__ out) {
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)n * h) return;
  const int i = idx / h, c = idx % h;
  const float acc = conv_at(x, dyn, dyn_stride, base, i, c, h, K, group, block);
  out[idx] = __float2bfloat16(acc);
}

#define TK_THREADS 128
#define TK_MAX 32

// a before b: larger value, then lower id.
__device__ __forceinline__ bool tk_before(float av, unsigned ai, float bv, unsigned bi) {
  return av > bv || (av == bv && ai < bi);
}

#define TK_PAD 0xffffffu  // the id of an empty slot: above every vocab id (< 2^24)

// ---------------------------------------------------------------------------------------
// top_k_warp: one stage of the per-row top-K (largest value first; equal values: lower id
// first; NaN counts as -inf). grid (n, parts): part p takes the candidates [p * chunk, (p + 1)
// * chunk) of its row, with value vals[r * row_stride + j] and id j (has_ids == 0: the logits)
// or ids[r * row_stride + j] (floats, exact below 2^24: the first stage's output); out holds
// the values of every (row, part), then their ids: out[(r * parts + p) * K + t] and out[n *
// parts * K + (r * parts + p) * K + t]. Stage one splits each row over many parts, stage two
// merges the parts' lists (parts = 1). Each warp holds a sorted list of the K best it has seen, one entry per lane (lane t < K
// holds the t-th; lanes >= K hold nothing). 32 candidates at a time are tested against the
// list's last entry with one ballot; the few that pass are inserted one by one (the entries
// before a candidate are a prefix, so its place is a popcount, and the lanes after it shift
// down by one shuffle). Then warp 0 merges the warps' lists the same way. The order is
// tk_before's total order (ids are unique), so the result does not depend on the order the
// candidates arrive in.
#define FULL 0xffffffffu

__device__ __forceinline__ void wl_insert(float& lv, unsigned& li, float cv, unsigned ci, int K,
                                          int lane) {
  const unsigned m = __ballot_sync(FULL, lane < K && tk_before(lv, li, cv, ci));
  const int pos = __popc(m);
  if (pos >= K) return;
  const float uv = __shfl_up_sync(FULL, lv, 1);
  const unsigned ui = __shfl_up_sync(FULL, li, 1);
  if (lane > pos) {
    lv = uv;
    li = ui;
  } else if (lane == pos) {
    lv = cv;
    li = ci;
  }
}

// Offer the lane's candidate (ok: it exists) to the warp's list.
__device__ __forceinline__ void wl_offer(float& lv, unsigned& li, float v, unsigned id, bool ok,
                                         int K, int lane) {
  const float tv = __shfl_sync(FULL, lv, K - 1);
  const unsigned ti = __shfl_sync(FULL, li, K - 1);
  unsigned m = __ballot_sync(FULL, ok && tk_before(v, id, tv, ti));
  while (m) {
    const int src = __ffs(m) - 1;
    m &= m - 1;
    const float cv = __shfl_sync(FULL, v, src);
    const unsigned ci = __shfl_sync(FULL, id, src);
    wl_insert(lv, li, cv, ci, K, lane);
  }
}

extern "C" __global__ void __launch_bounds__(TK_THREADS)
    top_k_warp(const float* __restrict__ vals, const float* __restrict__ ids, int has_ids, int len,
               long long row_stride, int chunk, int K, float* __restrict__ out) {
  const int row = blockIdx.x, part = blockIdx.y, parts = gridDim.y, n = gridDim.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = TK_THREADS / 32;
  const float* x = vals + (size_t)row * row_stride;
  const float* xi = ids + (size_t)row * row_stride;
  const int j0 = part * chunk;
  const int j1 = min(len, j0 + chunk);
  float lv = -INFINITY;
  unsigned li = TK_PAD;
  for (int b = j0 + warp * 32; b < j1; b += nw * 32) {
    const int j = b + lane;
    const bool ok = j < j1;
    float v = ok ? x[j] : -INFINITY;
    if (v != v) v = -INFINITY;
    const unsigned id = ok ? (has_ids ? (unsigned)xi[j] : (unsigned)j) : TK_PAD;
    wl_offer(lv, li, v, id, ok, K, lane);
  }
  __shared__ float sv[TK_THREADS / 32][32];
  __shared__ unsigned si[TK_THREADS / 32][32];
  sv[warp][lane] = lv;
  si[warp][lane] = li;
  __syncthreads();
  if (warp != 0) return;
  lv = -INFINITY;
  li = TK_PAD;
  for (int w = 0; w < nw; ++w) wl_offer(lv, li, sv[w][lane], si[w][lane], lane < K, K, lane);
  if (lane < K) {
    const size_t base = ((size_t)row * parts + part) * K;
    out[base + lane] = lv;
    out[(size_t)n * parts * K + base + lane] = (float)li;
  }
}

// ---------------------------------------------------------------------------------------
// The selector (draft::dflash2::Selector) on the device. tk: a top-k output for n rows of k
// candidates (the values [n * k], then the ids as floats [n * k]); hp [n, rank] the projected
// hidden rows; pred, succ [vocab, rank] the codebooks.
//
// selector_pairs: grid (n, k), block 32 * k threads: warp j of block (p, i) writes tab[p, i, j]
// = tk[p, j] + sum_r pred[q_i, r] * (succ[c_pj, r] * hp[p, r]) in f32, for the predecessor q_i:
// the anchor for row 0 (block i = 0 only), candidate i of row p - 1 for the others. One pair a
// warp, every pair at once (the loads of a pair are a short dependent chain: latency, not
// bytes, is what this costs).
extern "C" __global__ void selector_pairs(const float* __restrict__ tk, const bf16* __restrict__ hp,
                                          long long hp_stride, const bf16* __restrict__ pred,
                                          const bf16* __restrict__ succ, int n, int k, int rank,
                                          unsigned anchor, float* __restrict__ tab) {
  const int p = blockIdx.x, i = blockIdx.y, lane = threadIdx.x % 32, j = threadIdx.x / 32;
  if ((p == 0 && i > 0) || j >= k) return;
  const float* ids = tk + (size_t)n * k;
  const unsigned q = p == 0 ? anchor : (unsigned)ids[(size_t)(p - 1) * k + i];
  const unsigned c = (unsigned)ids[(size_t)p * k + j];
  const bf16* hr = hp + (size_t)p * hp_stride;
  const bf16* pr = pred + (size_t)q * rank;
  const bf16* sr = succ + (size_t)c * rank;
  float acc = 0.f;
#pragma unroll 4
  for (int r = lane; r < rank; r += 32) {
    const float wv = __bfloat162float(sr[r]) * __bfloat162float(hr[r]);
    acc += wv * __bfloat162float(pr[r]);
  }
  acc = warp_sum(acc);
  if (lane == 0) tab[((size_t)p * k + i) * k + j] = tk[(size_t)p * k + j] + acc;
}

// selector_walk: one block. From the anchor's slot (i = 0 at row 0), row p takes the first
// best of tab[p, i, :] (a later candidate replaces it only when strictly greater, as the host
// walk) and that candidate's slot is the next row's i. The block copies the table into shared
// memory first when it fits (smem_floats >= n * k * k), then one thread walks it (else it
// walks global memory). out[p] = the chosen ids.
extern "C" __global__ void selector_walk(const float* __restrict__ tk, const float* __restrict__ tab,
                                         int n, int k, int smem_floats, unsigned* __restrict__ out) {
  extern __shared__ float st[];
  const size_t total = (size_t)n * k * k;
  const bool in_smem = total <= (size_t)smem_floats;
  if (in_smem)
    for (size_t e = threadIdx.x; e < total; e += blockDim.x) st[e] = tab[e];
  __syncthreads();
  if (threadIdx.x != 0) return;
  const float* t = in_smem ? st : tab;
  const float* ids = tk + (size_t)n * k;
  int i = 0;
  for (int p = 0; p < n; ++p) {
    const float* row = t + ((size_t)p * k + i) * k;
    int best = 0;
    for (int j = 1; j < k; ++j)
      if (row[j] > row[best]) best = j;
    out[p] = (unsigned)ids[(size_t)p * k + best];
    i = best;
  }
}
