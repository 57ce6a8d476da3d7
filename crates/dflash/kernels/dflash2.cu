// DFlash2 draft kernels. Wrapped in src/nn/cuda/dflash2.rs; nn::dyn_conv and
// draft::dflash2 decide when they run.
//
//   dyn_conv     the grouped dynamic causal convolution over each block's rows (one launch
//                instead of ~6 candle ops per kernel offset)
//   dyn_conv_add_rmsnorm
//                the convolution after a sublayer fused with the residual add + RMSNorm that
//                follows it (bit-identical to dyn_conv then add_rmsnorm_bf16)
//   top_k_part   the k largest logits of each row and their ids (the selector's candidates),
//                in two stages (row parts over the whole GPU, then a merge), so the logits
//                never leave the device
//   selector_walk
//                the selector's left-to-right walk over those candidates, on the device (one
//                block), so a proposal is one download of n ids
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#include "reduce.cuh"

// The convolution of row i, channel c (dyn_conv's loop, the same order and rounding).
__device__ __forceinline__ float conv_at(const bf16* __restrict__ x, const bf16* __restrict__ dyn,
                                         long long dyn_stride, const bf16* __restrict__ base,
                                         int i, int c, int h, int K, int group, int block) {
  const int r = i % block, G = h / group, gc = c / group;
  float acc = 0.f;
  for (int o = 0; o < K && o <= r; ++o) {
    const float b = __bfloat162float(base[(size_t)o * h + c]);
    const float d = __bfloat162float(dyn[(size_t)i * dyn_stride + o * G + gc]);
    acc += (b + d) * __bfloat162float(x[(size_t)(i - o) * h + c]);
  }
  return acc;
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

// out_sum[i] = bf16(res[i] + bf16(conv(y)[i])), out_norm[i] = bf16(out_sum[i] * rsqrt(mean(
// out_sum[i]^2) + eps) * w): dyn_conv then add_rmsnorm_bf16 (fused.cu) in one launch. One block
// per row with add_rmsnorm_bf16's block size (the caller's block_for(min(h, 1024))), columns
// strided over the threads as there and the same block_sum, so every rounding and the sum's
// order are those of the two launches: the outputs are bit-identical.
extern "C" __global__ void dyn_conv_add_rmsnorm(const bf16* __restrict__ y, const bf16* __restrict__ dyn,
                                                long long dyn_stride, const bf16* __restrict__ base,
                                                const bf16* __restrict__ res, const bf16* __restrict__ w,
                                                int h, int K, int group, int block, float eps,
                                                bf16* __restrict__ out_sum, bf16* __restrict__ out_norm) {
  __shared__ float scratch[32];
  const int i = blockIdx.x;
  const bf16* a = res + (size_t)i * h;
  bf16* s = out_sum + (size_t)i * h;
  float ss = 0.f;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    const float v = __bfloat162float(__float2bfloat16(conv_at(y, dyn, dyn_stride, base, i, c, h, K, group, block)));
    const bf16 t = __float2bfloat16(__bfloat162float(a[c]) + v);
    s[c] = t;
    const float f = __bfloat162float(t);
    ss += f * f;
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / h + eps);
  bf16* o = out_norm + (size_t)i * h;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    o[c] = __float2bfloat16(__bfloat162float(s[c]) * inv * __bfloat162float(w[c]));
  }
}

#define TK_THREADS 128
#define TK_MAX 32

// a before b: larger value, then lower id.
__device__ __forceinline__ bool tk_before(float av, unsigned ai, float bv, unsigned bi) {
  return av > bv || (av == bv && ai < bi);
}

#define TK_PAD 0xffffffu  // the id of an empty slot: above every vocab id (< 2^24)

// One stage of the per-row top-K (largest value first; equal values: lower id first; NaN
// counts as -inf). Row r's candidates j < len have value vals[r * row_stride + j] and id j
// (has_ids == 0: the logits) or ids[r * row_stride + j] (floats, exact below 2^24: an
// earlier stage's output). grid (n, parts): part p takes the candidates
// [p * chunk, (p + 1) * chunk); each thread keeps the K best of its strided slice, then K
// rounds of a block-wide argmax over the threads' list heads. out holds the values of every
// (row, part) then their ids: out[(r * parts + p) * K + t] and out[n * parts * K + (r * parts
// + p) * K + t]. Stage one splits each row over many parts (the GPU fills up); stage two
// merges the parts' lists (parts = 1).
extern "C" __global__ void __launch_bounds__(TK_THREADS)
    top_k_part(const float* __restrict__ vals, const float* __restrict__ ids, int has_ids,
               int len, long long row_stride, int chunk, int K, float* __restrict__ out) {
  const int row = blockIdx.x, part = blockIdx.y, parts = gridDim.y, tid = threadIdx.x;
  const int n = gridDim.x;
  const float* x = vals + (size_t)row * row_stride;
  const float* xi = ids + (size_t)row * row_stride;
  const int j0 = part * chunk;
  const int j1 = min(len, j0 + chunk);
  float lv[TK_MAX];
  unsigned li[TK_MAX];
  for (int t = 0; t < TK_MAX; ++t) {
    lv[t] = -INFINITY;
    li[t] = TK_PAD;
  }
  for (int j = j0 + tid; j < j1; j += TK_THREADS) {
    float v = x[j];
    if (v != v) v = -INFINITY;
    const unsigned id = has_ids ? (unsigned)xi[j] : (unsigned)j;
    if (!tk_before(v, id, lv[K - 1], li[K - 1])) continue;
    int p = K - 1;
    while (p > 0 && tk_before(v, id, lv[p - 1], li[p - 1])) {
      lv[p] = lv[p - 1];
      li[p] = li[p - 1];
      --p;
    }
    lv[p] = v;
    li[p] = id;
  }
  __shared__ float sv[TK_THREADS];
  __shared__ unsigned si[TK_THREADS];
  __shared__ int sw[TK_THREADS];
  int head = 0;
  const size_t base = ((size_t)row * parts + part) * K;
  for (int r = 0; r < K; ++r) {
    sv[tid] = head < K ? lv[head] : -INFINITY;
    si[tid] = head < K ? li[head] : TK_PAD;
    sw[tid] = tid;
    __syncthreads();
    for (int s = TK_THREADS / 2; s > 0; s >>= 1) {
      if (tid < s && tk_before(sv[tid + s], si[tid + s], sv[tid], si[tid])) {
        sv[tid] = sv[tid + s];
        si[tid] = si[tid + s];
        sw[tid] = sw[tid + s];
      }
      __syncthreads();
    }
    if (tid == 0) {
      out[base + r] = sv[0];
      out[(size_t)n * parts * K + base + r] = (float)si[0];
    }
    if (tid == sw[0]) ++head;
    __syncthreads();
  }
}

#define WALK_THREADS 256

// The selector's greedy walk (draft::dflash2::Selector, one block). tk: top_k_part's output for
// n rows of k candidates (the values [n * k], then the ids as floats [n * k]); hp [n, rank]
// (rows hp_stride apart) the projected hidden rows; pred, succ [vocab, rank] the codebooks.
// From prev = anchor, row p scores candidate j as tk[p, j] + sum_r (succ[c_j, r] * hp[p, r]) *
// pred[prev, r] in f32, takes the first best (strictly greater replaces, as the host walk) and
// its id becomes prev. out[p] = the chosen ids.
extern "C" __global__ void __launch_bounds__(WALK_THREADS)
    selector_walk(const float* __restrict__ tk, const bf16* __restrict__ hp, long long hp_stride,
                  const bf16* __restrict__ pred, const bf16* __restrict__ succ, int n, int k, int rank,
                  unsigned anchor, unsigned* __restrict__ out) {
  __shared__ float score[TK_MAX];
  __shared__ unsigned chosen;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, nw = blockDim.x / 32;
  const float* ids = tk + (size_t)n * k;
  unsigned prev = anchor;
  for (int p = 0; p < n; ++p) {
    const bf16* hr = hp + (size_t)p * hp_stride;
    const bf16* pr = pred + (size_t)prev * rank;
    for (int j = warp; j < k; j += nw) {
      const unsigned c = (unsigned)ids[(size_t)p * k + j];
      const bf16* sr = succ + (size_t)c * rank;
      float acc = 0.f;
      for (int r = lane; r < rank; r += 32) {
        const float wv = __bfloat162float(sr[r]) * __bfloat162float(hr[r]);
        acc += wv * __bfloat162float(pr[r]);
      }
      acc = warp_sum(acc);
      if (lane == 0) score[j] = tk[(size_t)p * k + j] + acc;
    }
    __syncthreads();
    if (tid == 0) {
      int best = 0;
      for (int j = 1; j < k; ++j)
        if (score[j] > score[best]) best = j;
      chosen = (unsigned)ids[(size_t)p * k + best];
      out[p] = chosen;
    }
    __syncthreads();
    prev = chosen;
  }
}
