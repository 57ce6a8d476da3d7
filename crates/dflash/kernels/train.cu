// Training kernels (draft training, f32): the attention's masked softmax and its backward, and
// the weighted cross-entropy over the LM head's logits with its backward. Each replaces a chain
// of candle ops that read and write the whole [rows, columns] matrix several times, through
// broadcasting kernels (session 46's ncu: ~80% of a training step's GPU time). One block per
// row; a row (at most a few thousand columns) stays in L1/L2 between the passes.
#include "reduce.cuh"
#include <math.h>

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Max over the block (blockDim.x a multiple of 32). Every thread gets the max.
__device__ __forceinline__ float block_max(float v, float* scratch /* [32] */) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nw ? scratch[lane] : -INFINITY;
  return warp_max(t);
}

// y[r, :] = softmax(x[r, :] + mask[r % n, :]) for rows r of L columns (the attention's scores
// [groups, n, L] with an additive mask [n, L] shared by the groups).
extern "C" __global__ void masked_softmax_f32(const float* __restrict__ x,
                                              const float* __restrict__ mask,
                                              float* __restrict__ y, int L, int n) {
  __shared__ float scratch[32];
  const long r = blockIdx.x;
  const float* xr = x + r * L;
  const float* mr = mask + (r % n) * (long)L;
  float* yr = y + r * L;
  float m = -INFINITY;
  for (int j = threadIdx.x; j < L; j += blockDim.x) m = fmaxf(m, xr[j] + mr[j]);
  m = block_max(m, scratch);
  float s = 0.f;
  for (int j = threadIdx.x; j < L; j += blockDim.x) s += expf(xr[j] + mr[j] - m);
  const float inv = 1.f / block_sum(s, scratch);
  for (int j = threadIdx.x; j < L; j += blockDim.x) yr[j] = expf(xr[j] + mr[j] - m) * inv;
}

// dx = y * (dy - sum(y * dy)) per row: the softmax's backward.
extern "C" __global__ void softmax_bwd_f32(const float* __restrict__ y,
                                           const float* __restrict__ dy,
                                           float* __restrict__ dx, int L) {
  __shared__ float scratch[32];
  const long r = blockIdx.x;
  const float *yr = y + r * L, *gr = dy + r * L;
  float* dr = dx + r * L;
  float s = 0.f;
  for (int j = threadIdx.x; j < L; j += blockDim.x) s += yr[j] * gr[j];
  const float dot = block_sum(s, scratch);
  for (int j = threadIdx.x; j < L; j += blockDim.x) dr[j] = yr[j] * (gr[j] - dot);
}

// (max, sum of exp(x - max)) of a row of V, every thread of the block getting both.
__device__ __forceinline__ float2 row_lse(const float* xr, int V, float* scratch) {
  float m = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, xr[j]);
  m = block_max(m, scratch);
  float s = 0.f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(xr[j] - m);
  return make_float2(m, block_sum(s, scratch));
}

// out[r] = w[r] * (logsumexp(x[r, :]) - x[r, label[r]]): the weighted negative log-likelihood
// of each row's label (0 where w[r] is 0, without reading the row).
extern "C" __global__ void xent_fwd_f32(const float* __restrict__ x,
                                        const unsigned int* __restrict__ label,
                                        const float* __restrict__ w,
                                        float* __restrict__ out, int V) {
  __shared__ float scratch[32];
  const long r = blockIdx.x;
  const float wr = w[r];
  if (wr == 0.f) {
    if (threadIdx.x == 0) out[r] = 0.f;
    return;
  }
  const float* xr = x + r * V;
  const float2 ms = row_lse(xr, V, scratch);
  if (threadIdx.x == 0) out[r] = wr * (ms.x + logf(ms.y) - xr[label[r]]);
}

// dx[r, j] = g[r] * (softmax(x[r, :])_j - [j == label[r]]), g = the output's gradient times w
// (rows with g = 0 get 0).
extern "C" __global__ void xent_bwd_f32(const float* __restrict__ x,
                                        const unsigned int* __restrict__ label,
                                        const float* __restrict__ g,
                                        float* __restrict__ dx, int V) {
  __shared__ float scratch[32];
  const long r = blockIdx.x;
  const float gr = g[r];
  float* dr = dx + r * V;
  if (gr == 0.f) {
    for (int j = threadIdx.x; j < V; j += blockDim.x) dr[j] = 0.f;
    return;
  }
  const float* xr = x + r * V;
  const float2 ms = row_lse(xr, V, scratch);
  const float inv = 1.f / ms.y;
  const unsigned int lab = label[r];
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    dr[j] = gr * (expf(xr[j] - ms.x) * inv - (j == (int)lab ? 1.f : 0.f));
}

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w: RMSNorm of rows of h.
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ y, int h, float eps) {
  __shared__ float scratch[32];
  const long r = blockIdx.x;
  const float* xr = x + r * h;
  float s = 0.f;
  for (int j = threadIdx.x; j < h; j += blockDim.x) s += xr[j] * xr[j];
  const float inv = rsqrtf(block_sum(s, scratch) / h + eps);
  for (int j = threadIdx.x; j < h; j += blockDim.x) y[r * h + j] = xr[j] * inv * w[j];
}

// The RMSNorm's backward per row, with g = dy * w and inv = rsqrt(mean(x^2) + eps):
// out[0][r, :] = dx = inv * (g - x * inv^2 * mean(g * x)), and out[1][r, :] = dy * x * inv,
// whose sum over the rows is the weight's gradient. out is [2, rows, h].
extern "C" __global__ void rms_norm_bwd_f32(const float* __restrict__ x,
                                            const float* __restrict__ w,
                                            const float* __restrict__ dy,
                                            float* __restrict__ out, int h, int rows,
                                            float eps) {
  __shared__ float scratch[32];
  const long r = blockIdx.x;
  const float *xr = x + r * h, *gr = dy + r * h;
  float s = 0.f, d = 0.f;
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    s += xr[j] * xr[j];
    d += gr[j] * w[j] * xr[j];
  }
  const float ms = block_sum(s, scratch) / h;
  const float dot = block_sum(d, scratch) / h;
  const float inv = rsqrtf(ms + eps);
  float* dx = out + r * h;
  float* dw = out + ((long)rows + r) * h;
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    dx[j] = inv * (gr[j] * w[j] - xr[j] * inv * inv * dot);
    dw[j] = gr[j] * xr[j] * inv;
  }
}
