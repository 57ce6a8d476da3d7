// dflash CUDA kernel: skinny bf16 GEMM on the tensor cores, for 1..16 rows of x.
//
// gemm_<cfg>_t<T>: y[m, n] = sum_k x[m, k] * w[n, k] for m < M <= 8*T rows, bf16 in and out,
// f32 accumulation. w is row-major [N, K] (the nn.Linear layout), x [M, K], y [M, N], all
// contiguous; K % 32 == 0 and 16-byte aligned rows (checked by the caller).
//
// A decode, verify or draft step multiplies 1..16 rows by every weight: bound by reading w
// once. 16 rows make 32 flops per weight, about what the CUDA cores can do at full bandwidth,
// so the products go to the tensor cores (mma.m16n8k16, bf16 -> f32). The weight is the A
// operand (16 weight rows per mma), x the B operand (8 rows of x per mma, T = 1 or 2 tiles).
//
// Loads: in each 32-wide chunk of k, the lane with group g = lane / 4 and c = lane % 4 loads
// 16 bytes (8 consecutive k, [8c, 8c + 8)) of weight rows g and g + 8 and of x row g. The mma
// fragments want k pairs {2c, 2c+1} and {2c+8, 2c+9} in each lane; since a dot product does
// not care about the order of k, lane c feeds its own 8 loaded values to those slots over two
// mma steps, the same way for weights and x, so every k meets its partner. No shuffles.
//
// Blocking (tools/gpu-bench/skinny measured the candidates on the H200, docs/perf.md run 5):
// a warp owns TN tiles of 16 weight rows (they share the x fragments: x bytes per weight byte
// 1/TN); W warps split K for one tile and sum their partials in shared memory in warp order;
// a block has BW warps (BW / W tiles). Each warp keeps U chunks in flight and loads the next U
// before multiplying the current ones (software pipelining: the kernel is bound by how many
// bytes are in flight, not by the mma). Weights are read with ld.global.nc.L1::no_allocate
// and a 256-byte L2 prefetch hint: they stream past L1, which keeps x.
//
// Batch invariance: the arithmetic that makes y[m, n] (the K split, each warp's order of k,
// the mma's own accumulation, the order of the warps' sum) depends on the configuration,
// which the caller picks from N and K only, never from M or from the other rows of x. So a
// row gives the same bits whether it is multiplied alone (a decode step) or among 16 (a
// verify): greedy speculative decoding reproduces plain decoding bit for bit on the GPU.
#include <cuda_bf16.h>
#include <stdint.h>

#include "skinny.cuh"


// EPI: the plain store (EPI_PLAIN), or a DFlash2 convolution in the epilogue (`cv`; skinny.cuh):
// the finishing one of the product (EPI_CONV, store_rows_conv), or the preparing one with the
// kernel projection as the product (EPI_KCONV, store_rows_kconv).
#define EPI_PLAIN 0
#define EPI_CONV 1
#define EPI_KCONV 2
template <int W, int T, int U, int BW, int TN, typename OutT, int EPI = EPI_PLAIN>
__device__ __forceinline__ void gemm_rows(const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ w,
                                          OutT* __restrict__ y, int m_rows, int n_rows,
                                          int k, ConvEpi cv = {}) {
  constexpr int R = 16 * TN;  // weight rows per warp
  __shared__ float red[W > 1 ? BW : 1][R][8 * T];
  // The preparing form's convolution operands (skinny.cuh, kconv_prefetch).
  __shared__ __align__(16) unsigned char slab_raw[EPI == EPI_KCONV ? sizeof(KconvSlab) : 16];
  KconvSlab& slab = *reinterpret_cast<KconvSlab*>(slab_raw);
  // A batch of independent products (grid y): x [b, M, K], w [b, N, K], y [b, M, N].
  x += (size_t)blockIdx.y * m_rows * k;
  w += (size_t)blockIdx.y * n_rows * k;
  y += (size_t)blockIdx.y * m_rows * n_rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int n0 = (blockIdx.x * (BW / W) + warp / W) * R;
  const int kw = warp % W;
  // Rows past N are clamped on load and skipped on store; x rows past M are 0.
  const uint4* wp[2 * TN];
#pragma unroll
  for (int j = 0; j < 2 * TN; ++j) {
    int row;
    if constexpr (EPI == EPI_KCONV)
      row = kconv_row(cv, blockIdx.x, 8 * j + g, k / cv.group);
    else
      row = min(n0 + 8 * j + g, n_rows - 1);
    wp[j] = reinterpret_cast<const uint4*>(w + (size_t)row * k) + c;
  }
  const uint4* xp[T];
  bool xok[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const int xr = 8 * t + g;
    xok[t] = xr < m_rows;
    xp[t] = reinterpret_cast<const uint4*>(x + (size_t)(xok[t] ? xr : 0) * k) + c;
  }
  if constexpr (EPI == EPI_KCONV) kconv_prefetch(slab, x, m_rows, k, cv);
  // This warp's chunks of 32 k (4 uint4 per row per chunk).
  const int chunks = k / 32;
  const int c0 = kw * chunks / W, c1 = (kw + 1) * chunks / W;
  float acc[TN][T][4];
#pragma unroll
  for (int a = 0; a < TN; ++a)
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[a][t][j] = 0.f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 wv[U][2 * TN], xv[U][T];
  // Chunks past c1 are clamped (loaded again, never multiplied).
  auto load = [&](int ch) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 2 * TN; ++j) wv[u][j] = load_weight(wp[j] + min(ch + u, c1 - 1) * 4);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int t = 0; t < T; ++t)
        xv[u][t] = xok[t] ? __ldg(xp[t] + min(ch + u, c1 - 1) * 4) : zero;
  };
  if (c0 < c1) load(c0);
  for (int ch = c0; ch < c1; ch += U) {
    uint4 cw[U][2 * TN], cx[U][T];
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
      if (ch + u < c1)
#pragma unroll
        for (int a = 0; a < TN; ++a)
#pragma unroll
          for (int t = 0; t < T; ++t)
            mma_chunk(acc[a][t], cw[u][2 * a], cw[u][2 * a + 1], cx[u][t]);
  }
  if constexpr (EPI == EPI_CONV)
    store_rows_conv<W, T, BW, TN>(acc, red, y, m_rows, n_rows, cv);
  else if constexpr (EPI == EPI_KCONV)
    store_rows_kconv<W, T, BW>(acc, red, y, slab, m_rows, n_rows, k, cv);
  else
    store_rows<W, T, BW, TN, OutT>(acc, red, y, m_rows, n_rows, n0);
}

// Configurations (name: W warps per tile, U chunks in flight, BW warps per block, TN tiles per
// warp); nn::cuda::mma_config picks one from N. Keep the two in step.
// NAME_t{1,2}: bf16 out; NAME_t{1,2}_f32: the same values as f32 (the LM head's logits).
#define GEMM_T(NAME, SUF, T, OutT, W, U, BW, MINB, TN)                                        \
  extern "C" __global__ void __launch_bounds__(32 * BW, MINB)                                 \
      NAME##SUF(const __nv_bfloat16* x, const __nv_bfloat16* w, OutT* y, int m_rows,          \
                int n_rows, int k) {                                                          \
    gemm_rows<W, T, U, BW, TN, OutT>(x, w, y, m_rows, n_rows, k);                             \
  }
#define GEMM(NAME, W, U, BW, MINB, TN)                                 \
  GEMM_T(NAME, _t1, 1, __nv_bfloat16, W, U, BW, MINB, TN)              \
  GEMM_T(NAME, _t2, 2, __nv_bfloat16, W, U, BW, MINB, TN)              \
  GEMM_T(NAME, _t1_f32, 1, float, W, U, BW, MINB, TN)                  \
  GEMM_T(NAME, _t2_f32, 2, float, W, U, BW, MINB, TN)
// NAME_t{1,2}_conv: bf16 out through the DFlash2 finishing convolution (ConvEpi), for the
// blockings whose warps sum a tile in shared memory (W > 1).
#define GEMM_CONV_T(NAME, T, W, U, BW, MINB, TN)                                               \
  extern "C" __global__ void __launch_bounds__(32 * BW, MINB) NAME##_t##T##_conv(              \
      const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int m_rows, int n_rows, \
      int k, const __nv_bfloat16* dyn, long long dyn_stride, const __nv_bfloat16* base,       \
      int conv_k, int group, int block) {                                                      \
    gemm_rows<W, T, U, BW, TN, __nv_bfloat16, EPI_CONV>(                                       \
        x, w, y, m_rows, n_rows, k,                                                            \
        ConvEpi{dyn, dyn_stride, base, conv_k, group, block, nullptr});                        \
  }
// NAME_t{T}_kconv: the kernel projection of a DFlash2 convolution with its preparing
// convolution of x in the epilogue (ConvEpi, skinny.cuh: store_rows_kconv); one tile a block.
#define GEMM_KCONV_T(NAME, T, W, U, BW, MINB)                                                  \
  extern "C" __global__ void __launch_bounds__(32 * BW, MINB) NAME##_t##T##_kconv(             \
      const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int m_rows, int n_rows, \
      int k, __nv_bfloat16* xc, const __nv_bfloat16* base, int conv_k, int group, int block) {  \
    gemm_rows<W, T, U, BW, 1, __nv_bfloat16, EPI_KCONV>(                                       \
        x, w, y, m_rows, n_rows, k, ConvEpi{nullptr, 0, base, conv_k, group, block, xc});      \
  }
#define GEMM_CONV(NAME, W, U, BW, MINB, TN)     \
  GEMM_CONV_T(NAME, 1, W, U, BW, MINB, TN)      \
  GEMM_CONV_T(NAME, 2, W, U, BW, MINB, TN)
// Narrowest weights (at most 128 tiles): 16 warps split K.
GEMM(gemm_w16u2, 16, 2, 16, 1, 1)
GEMM_CONV(gemm_w16u2, 16, 2, 16, 1, 1)
GEMM_KCONV_T(gemm_w16u2, 1, 16, 2, 16, 1)
GEMM_KCONV_T(gemm_w16u2, 2, 16, 2, 16, 1)
// Narrow weights (few tiles): 8 warps split K.
GEMM(gemm_w8u2, 8, 2, 8, 2, 1)
GEMM_CONV(gemm_w8u2, 8, 2, 8, 2, 1)
GEMM_KCONV_T(gemm_w8u2, 1, 8, 2, 8, 2)
GEMM_KCONV_T(gemm_w8u2, 2, 8, 2, 8, 2)
// Wide (gate+up): one warp per tile, 4 chunks in flight.
GEMM(gemm_w1u4, 1, 4, 4, 1, 1)
// The rest (K/V stacks, LM heads): 4 warps split K, 32 rows per warp.
GEMM(gemm_w4u2n2, 4, 2, 4, 1, 2)
GEMM_CONV(gemm_w4u2n2, 4, 2, 4, 1, 2)
