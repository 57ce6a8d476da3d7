// DFlash2 draft kernels. Wrapped in src/nn/cuda/dflash2.rs; nn::dyn_conv and
// draft::dflash2 decide when they run.
//
//   dyn_conv     the grouped dynamic causal convolution over each block's rows (one launch
//                instead of ~6 candle ops per kernel offset)
//   top_k_rows   the k largest logits of each row and their ids (the selector's candidates),
//                so the logits never leave the device
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

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
  const int r = i % block, G = h / group, gc = c / group;
  float acc = 0.f;
  for (int o = 0; o < K && o <= r; ++o) {
    const float b = __bfloat162float(base[(size_t)o * h + c]);
    const float d = __bfloat162float(dyn[(size_t)i * dyn_stride + o * G + gc]);
    acc += (b + d) * __bfloat162float(x[(size_t)(i - o) * h + c]);
  }
  out[idx] = __float2bfloat16(acc);
}

#define TK_THREADS 128
#define TK_MAX 32

// a before b: larger value, then lower id.
__device__ __forceinline__ bool tk_before(float av, unsigned ai, float bv, unsigned bi) {
  return av > bv || (av == bv && ai < bi);
}

// out [n, 2K] f32: per row its K largest logits (largest first; equal values: lower id first;
// NaN counts as -inf), then their ids as floats (exact below 2^24). logits [n, V] f32, K <=
// TK_MAX <= V. grid (n), block TK_THREADS: each thread keeps the K best of its strided slice,
// then K rounds of a block-wide argmax over the threads' list heads.
extern "C" __global__ void __launch_bounds__(TK_THREADS)
    top_k_rows(const float* __restrict__ logits, int V, int K, float* __restrict__ out) {
  const int row = blockIdx.x, tid = threadIdx.x;
  const float* x = logits + (size_t)row * V;
  float lv[TK_MAX];
  unsigned li[TK_MAX];
  for (int t = 0; t < TK_MAX; ++t) {
    lv[t] = -INFINITY;
    li[t] = 0xffffffffu;
  }
  for (int j = tid; j < V; j += TK_THREADS) {
    float v = x[j];
    if (v != v) v = -INFINITY;
    if (!tk_before(v, (unsigned)j, lv[K - 1], li[K - 1])) continue;
    int p = K - 1;
    while (p > 0 && tk_before(v, (unsigned)j, lv[p - 1], li[p - 1])) {
      lv[p] = lv[p - 1];
      li[p] = li[p - 1];
      --p;
    }
    lv[p] = v;
    li[p] = (unsigned)j;
  }
  __shared__ float sv[TK_THREADS];
  __shared__ unsigned si[TK_THREADS];
  __shared__ int sw[TK_THREADS];
  int head = 0;
  for (int r = 0; r < K; ++r) {
    sv[tid] = head < K ? lv[head] : -INFINITY;
    si[tid] = head < K ? li[head] : 0xffffffffu;
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
      out[(size_t)row * 2 * K + r] = sv[0];
      out[(size_t)row * 2 * K + K + r] = (float)si[0];
    }
    if (tid == sw[0]) ++head;
    __syncthreads();
  }
}
