// dflash CUDA kernels: FP8 (e4m3) block-scaled weights kept as stored (the DeepSeek-V3 / Kimi /
// Qwen -FP8 checkpoints: `w[n, k] = e4m3[n, k] * s[n / bn, k / bk]`), multiplied on the tensor
// cores for 1..16 rows of x, and dequantized to bf16 for more.
//
// The skinny GEMM is kernels/mma.cu's with the weight bytes dequantized in registers: lane
// (g, c) loads the 8 bytes k [8c, 8c + 8) of its rows g and g + 8 in each 32-wide chunk (the
// k the bf16 kernel's lane loads as 16 bytes), makes each value bf16(f32(e4m3) * s) (the
// e4m3 pair converted exactly by cvt.rn.f16x2.e4m3x2, the product rounded in f32, then to
// bf16: the dequantized reference's arithmetic, source/fp8.rs), and feeds the same mma slots.
// The blocking (W warps splitting K, TN tiles a warp) is the bf16 kernel's for the same N, so
// the products are bit for bit the bf16 kernel's on the dequantized weights; U (chunks in
// flight) is larger, as a chunk carries half the bytes.
//
// Layout: the checkpoint's bytes, row-major [n, k]; scales f32 [ceil(n / bn), k / bk] with bk
// a multiple of 32 (a chunk never straddles two scale columns), any bn (each row finds its
// own). Batch invariance: as kernels/mma.cu, a row's arithmetic depends on N and K only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "skinny.cuh"

// 8 bytes of weights, read once (as load_weight, half the width).
__device__ __forceinline__ uint2 load_weight8(const uint2* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0,%1}, [%2];\n"
               : "=r"(r.x), "=r"(r.y)
               : "l"(p));
  return r;
}

// bf16x2 of (e4m3 pair in the low / high byte of `pair`) * s, rounded as the reference.
__device__ __forceinline__ uint32_t fp8_pair(uint32_t pair, float s) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(pair & 0xffff), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  __nv_bfloat162 v = __floats2bfloat162_rn(__fmul_rn(f.x, s), __fmul_rn(f.y, s));
  return *reinterpret_cast<uint32_t*>(&v);
}

// The A fragment words of 8 bytes (k 8c .. 8c + 7 of a chunk, in order).
__device__ __forceinline__ uint4 fp8_words(const uint2& w, float s) {
  return make_uint4(fp8_pair(w.x, s), fp8_pair(w.x >> 16, s), fp8_pair(w.y, s),
                    fp8_pair(w.y >> 16, s));
}

template <int W, int T, int U, int BW, int TN, typename OutT>
__device__ __forceinline__ void fp8_rows(const __nv_bfloat16* __restrict__ x,
                                         const uint8_t* __restrict__ w,
                                         const float* __restrict__ sc, OutT* __restrict__ y,
                                         int m_rows, int n_rows, int k, int bn, int bk) {
  constexpr int R = 16 * TN;
  __shared__ float red[W > 1 ? BW : 1][R][8 * T];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int n0 = (blockIdx.x * (BW / W) + warp / W) * R;
  const int kw = warp % W;
  const int scols = k / bk;
  // Rows past N are clamped on load and skipped on store; x rows past M are 0.
  const uint2* wp[2 * TN];
  const float* sp[2 * TN];
#pragma unroll
  for (int j = 0; j < 2 * TN; ++j) {
    const int row = min(n0 + 8 * j + g, n_rows - 1);
    wp[j] = reinterpret_cast<const uint2*>(w + (size_t)row * k) + c;
    sp[j] = sc + (size_t)(row / bn) * scols;
  }
  const uint4* xp[T];
  bool xok[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const int xr = 8 * t + g;
    xok[t] = xr < m_rows;
    xp[t] = reinterpret_cast<const uint4*>(x + (size_t)(xok[t] ? xr : 0) * k) + c;
  }
  // This warp's chunks of 32 k (the bf16 kernel's split).
  const int chunks = k / 32;
  const int c0 = kw * chunks / W, c1 = (kw + 1) * chunks / W;
  const int cps = bk / 32;  // chunks per scale column
  float acc[TN][T][4];
#pragma unroll
  for (int a = 0; a < TN; ++a)
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[a][t][j] = 0.f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint2 wv[U][2 * TN];
  uint4 xv[U][T];
  // Chunks past c1 are clamped (loaded again, never multiplied).
  auto load = [&](int ch) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 2 * TN; ++j) wv[u][j] = load_weight8(wp[j] + min(ch + u, c1 - 1) * 4);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int t = 0; t < T; ++t)
        xv[u][t] = xok[t] ? __ldg(xp[t] + min(ch + u, c1 - 1) * 4) : zero;
  };
  if (c0 < c1) load(c0);
  for (int ch = c0; ch < c1; ch += U) {
    uint2 cw[U][2 * TN];
    uint4 cx[U][T];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < 2 * TN; ++j) cw[u][j] = wv[u][j];
#pragma unroll
      for (int t = 0; t < T; ++t) cx[u][t] = xv[u][t];
    }
    if (ch + U < c1) load(ch + U);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (ch + u < c1) {
        const int col = (ch + u) / cps;
        uint4 av[2 * TN];
#pragma unroll
        for (int j = 0; j < 2 * TN; ++j) av[j] = fp8_words(cw[u][j], __ldg(sp[j] + col));
#pragma unroll
        for (int a = 0; a < TN; ++a)
#pragma unroll
          for (int t = 0; t < T; ++t) mma_chunk(acc[a][t], av[2 * a], av[2 * a + 1], cx[u][t]);
      }
  }
  store_rows<W, T, BW, TN, OutT>(acc, red, y, m_rows, n_rows, n0);
}

// Configurations: the bf16 kernel's W, BW, TN for the same N (nn::cuda::fp8 takes mma_config's
// choice), U = 4 chunks in flight. NAME_t{1,2}: bf16 out; _f32: the f32 of each bf16 value.
#define FP8_T(NAME, SUF, T, OutT, W, U, BW, MINB, TN)                                           \
  extern "C" __global__ void __launch_bounds__(32 * BW, MINB)                                   \
      NAME##SUF(const __nv_bfloat16* x, const uint8_t* w, const float* sc, OutT* y, int m_rows, \
                int n_rows, int k, int bn, int bk) {                                            \
    fp8_rows<W, T, U, BW, TN, OutT>(x, w, sc, y, m_rows, n_rows, k, bn, bk);                    \
  }
#define FP8(NAME, W, U, BW, MINB, TN)                                \
  FP8_T(fp8_##NAME, _t1, 1, __nv_bfloat16, W, U, BW, MINB, TN)       \
  FP8_T(fp8_##NAME, _t2, 2, __nv_bfloat16, W, U, BW, MINB, TN)       \
  FP8_T(fp8_##NAME, _t1_f32, 1, float, W, U, BW, MINB, TN)           \
  FP8_T(fp8_##NAME, _t2_f32, 2, float, W, U, BW, MINB, TN)
FP8(w16u2, 16, 4, 16, 1, 1)
FP8(w8u2, 8, 4, 8, 2, 1)
FP8(w1u4, 1, 4, 4, 1, 1)
FP8(w4u2n2, 4, 4, 4, 1, 2)

// The whole weight as bf16 [n, k] (prefill): one thread per 4 bytes, the reference's values.
extern "C" __global__ void fp8_dequant(const uint8_t* __restrict__ w, const float* __restrict__ sc,
                                       __nv_bfloat16* __restrict__ out, int n_rows, int k, int bn,
                                       int bk) {
  const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= (size_t)n_rows * k) return;
  const int r = (int)(i / k), c = (int)(i % k);
  const float s = sc[(size_t)(r / bn) * (k / bk) + c / bk];
  const uint32_t v = *reinterpret_cast<const uint32_t*>(w + i);
  const uint32_t a = fp8_pair(v, s), b = fp8_pair(v >> 16, s);
  *reinterpret_cast<uint2*>(out + i) = make_uint2(a, b);
}
