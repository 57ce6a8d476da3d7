// dflash CUDA kernels (compiled to PTX by build.rs with --features cuda).
//
// gemv_bf16_m<M>: y[m, n] = sum_k x[m, k] * w[n, k] for M = 1..8 rows of x, bf16 in and out,
// f32 accumulation. w is row-major [N, K] (the nn.Linear layout), x [M, K], y [M, N], all
// contiguous; K % 8 == 0 and 16-byte aligned rows (checked by the caller).
//
// Decode and short verify steps are GEMVs bound by reading w once: each warp streams one row
// of w with 16-byte loads (8 bf16 per lane per iteration, several iterations in flight), and
// keeps the M partial sums in registers; a warp shuffle reduces them. x is small and served
// by L1/L2. The weights are read with a streaming hint (they do not fit in L2 anyway).
#include <cuda_bf16.h>
#include <stdint.h>

template <int M>
__device__ __forceinline__ void gemv_rows(const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ w,
                                          __nv_bfloat16* __restrict__ y, int n_rows, int k) {
  const int warps_per_block = blockDim.x / 32;
  const int row = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n_rows) return;
  const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * k);
  const int kv = k / 8;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
#pragma unroll 4
  for (int i = lane; i < kv; i += 32) {
    uint4 wv = __ldcs(wr + i);
    const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wv);
    float2 wf[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) wf[j] = __bfloat1622float2(wp[j]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * k) + i);
      const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 xf = __bfloat1622float2(xp[j]);
        acc[m] = fmaf(wf[j].x, xf.x, acc[m]);
        acc[m] = fmaf(wf[j].y, xf.y, acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float v = acc[m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) y[(size_t)m * n_rows + row] = __float2bfloat16(v);
  }
}

#define GEMV(M)                                                                           \
  extern "C" __global__ void gemv_bf16_m##M(const __nv_bfloat16* x, const __nv_bfloat16* w, \
                                             __nv_bfloat16* y, int n_rows, int k) {        \
    gemv_rows<M>(x, w, y, n_rows, k);                                                     \
  }
GEMV(1)
GEMV(2)
GEMV(3)
GEMV(4)
GEMV(5)
GEMV(6)
GEMV(7)
GEMV(8)
