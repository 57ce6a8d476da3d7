// Shared by the skinny tensor-core GEMMs (kernels/mma.cu: bf16 weights; kernels/affine.cu: MLX
// affine weights): the mma of one 32-wide chunk of k, the streaming weight load, and the
// epilogue that writes a warp's accumulators (or sums the K-split warps' in warp order).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "dyn_conv.cuh"

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two k-steps of 16 from one 32-wide chunk: wa/wb = weight rows g / g+8, xv = x row.
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint4& wa, const uint4& wb,
                                          const uint4& xv) {
  mma_bf16(d, wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
  mma_bf16(d, wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
}

// 16 bytes of weights: read once, so not kept in L1; ask L2 for the whole 256-byte segment.
__device__ __forceinline__ uint4 load_weight(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// A warp's accumulators into red[warp][weight row 0..16TN][x row 0..8T] (layout of
// store_rows below), then a block barrier.
template <int T, int TN>
__device__ __forceinline__ void stage_rows(const float (&acc)[TN][T][4], float (*red)[16 * TN][8 * T]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int a = 0; a < TN; ++a)
#pragma unroll
    for (int t = 0; t < T; ++t) {
      red[warp][16 * a + g][8 * t + 2 * c] = acc[a][t][0];
      red[warp][16 * a + g][8 * t + 2 * c + 1] = acc[a][t][1];
      red[warp][16 * a + g + 8][8 * t + 2 * c] = acc[a][t][2];
      red[warp][16 * a + g + 8][8 * t + 2 * c + 1] = acc[a][t][3];
    }
  __syncthreads();
}

// The epilogue: acc[a][t] holds, for lane (g, c), weight rows g (d[0], d[1]) and g + 8 (d[2],
// d[3]) of tile a and x rows 2c, 2c+1 of x tile t. With W == 1 each warp writes its own; else
// the W warps that split K for a tile stage theirs in `red` (the caller's shared array) and the
// block sums them in warp order (a fixed order: batch-invariant). n0: the warp's first weight
// row.
// An output value as stored: bf16, or (the LM head's f32 logits) the f32 of that bf16, the
// value a bf16 output cast to f32 would hold, without the cast's launch.
__device__ __forceinline__ void put_out(__nv_bfloat16* y, size_t i, float v) { y[i] = __float2bfloat16(v); }
__device__ __forceinline__ void put_out(float* y, size_t i, float v) {
  y[i] = __bfloat162float(__float2bfloat16(v));
}

template <int W, int T, int BW, int TN, typename OutT>
__device__ __forceinline__ void store_rows(const float (&acc)[TN][T][4],
                                           float (*red)[16 * TN][8 * T],
                                           OutT* __restrict__ y, int m_rows, int n_rows,
                                           int n0) {
  constexpr int R = 16 * TN;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  if constexpr (W == 1) {
#pragma unroll
    for (int a = 0; a < TN; ++a)
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const int m = 8 * t + 2 * c;
        const int na = n0 + 16 * a + g, nb = na + 8;
        if (m < m_rows) {
          if (na < n_rows) put_out(y, (size_t)m * n_rows + na, acc[a][t][0]);
          if (nb < n_rows) put_out(y, (size_t)m * n_rows + nb, acc[a][t][2]);
        }
        if (m + 1 < m_rows) {
          if (na < n_rows) put_out(y, (size_t)(m + 1) * n_rows + na, acc[a][t][1]);
          if (nb < n_rows) put_out(y, (size_t)(m + 1) * n_rows + nb, acc[a][t][3]);
        }
      }
  } else {
    stage_rows<T, TN>(acc, red);
    // Per tile R weight rows x 8T x rows; consecutive threads write consecutive n.
    constexpr int PER_TILE = R * 8 * T;
    for (int i = threadIdx.x; i < (BW / W) * PER_TILE; i += blockDim.x) {
      const int tb = i / PER_TILE, e = i % PER_TILE;
      const int r = e % R, m = e / R;
      const int n = (blockIdx.x * (BW / W) + tb) * R + r;
      if (m < m_rows && n < n_rows) {
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < W; ++v) s += red[tb * W + v][r][m];
        put_out(y, (size_t)m * n_rows + n, s);
      }
    }
  }
}

// The DFlash2 finishing convolution over a product's rows, applied in the epilogue (the
// *_conv forms of kernels/mma.cu): the product y = x w^T is rounded to bf16 as it would be
// stored, then convolved over its rows (kernels/dyn_conv.cuh) and only that is stored. A
// block holds every row of its weight rows' columns, which is all the convolution reads.
struct ConvEpi {
  const __nv_bfloat16* dyn;  // finishing form: the dynamic kernel
  long long dyn_stride;
  const __nv_bfloat16* base;
  int K, group, block;
  __nv_bfloat16* xc;  // preparing form (kconv): the convolved input, [m_rows, h]
};

// The preparing form (*_kconv): the product is the kernel projection dyn = x P^T of the
// convolution's own input x [m, h] (h = K of the product, G = h / group groups, N = 2 K G:
// the preparing half, columns o * G + g, then the finishing half). Its first K G / 16 blocks
// take their 16 weight rows gathered as 16 / K groups x K offsets (tile row t: offset t % K of
// group b * 16 / K + t / K), so a block holds every offset of its groups and convolves x over
// their channels in its epilogue; the other blocks take 16 consecutive rows of the finishing
// half. Needs 16 % K == 0 and K G % 16 == 0 (checked by the caller).
__device__ __forceinline__ int kconv_row(const ConvEpi& cv, int bx, int t, int G) {
  const int nb0 = cv.K * G / 16;
  if (bx < nb0) return (t % cv.K) * G + bx * (16 / cv.K) + t / cv.K;
  return cv.K * G + (bx - nb0) * 16 + t;
}

// store_rows for W > 1 with the convolution: the warps' sums (in warp order, as store_rows)
// rounded to bf16 go back into the first warp's slot of `red`, then each output value is the
// convolution over those rows (y: [m_rows, n_rows]; n_rows is the convolution's h).
template <int W, int T, int BW, int TN>
__device__ __forceinline__ void store_rows_conv(const float (&acc)[TN][T][4],
                                                float (*red)[16 * TN][8 * T],
                                                __nv_bfloat16* __restrict__ y, int m_rows,
                                                int n_rows, const ConvEpi& cv) {
  static_assert(W > 1, "the convolving epilogue needs the block-staged sum");
  constexpr int R = 16 * TN;
  constexpr int PER_TILE = R * 8 * T;
  stage_rows<T, TN>(acc, red);
  // Each (tile, r, m) is read and rewritten by one thread only: no barrier between.
  for (int i = threadIdx.x; i < (BW / W) * PER_TILE; i += blockDim.x) {
    const int tb = i / PER_TILE, e = i % PER_TILE;
    const int r = e % R, m = e / R;
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < W; ++v) s += red[tb * W + v][r][m];
    red[tb * W][r][m] = __bfloat162float(__float2bfloat16(s));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < (BW / W) * PER_TILE; i += blockDim.x) {
    const int tb = i / PER_TILE, e = i % PER_TILE;
    const int r = e % R, m = e / R;
    const int n = (blockIdx.x * (BW / W) + tb) * R + r;
    if (m < m_rows && n < n_rows) {
      const float v = conv_value(
          [&](int row) { return red[tb * W][r][row]; },
          DynRows{cv.dyn, cv.dyn_stride, n_rows / cv.group},
          [&](int o) { return __bfloat162float(cv.base[(size_t)o * n_rows + n]); }, m, n, cv.K,
          cv.group, cv.block);
      y[(size_t)m * n_rows + n] = __float2bfloat16(v);
    }
  }
}

// The preparing form's operands of its convolution, copied into shared memory asynchronously
// (cp.async) before the product's main loop, so the epilogue reads no global memory: x's rows
// over the block's channels and the base kernel there. The caller checks count = 16 / K * group
// <= KCONV_MAXC, a multiple of 8 (16-byte pieces), and 16-byte aligned rows.
#define KCONV_MAXC 256
struct KconvSlab {
  __nv_bfloat16 x[16][KCONV_MAXC];
  __nv_bfloat16 b[KCONV_MAXC];  // [K][count]
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void kconv_prefetch(KconvSlab& slab, const __nv_bfloat16* x, int m_rows,
                                               int h, const ConvEpi& cv) {
  const int G = h / cv.group;
  if ((int)blockIdx.x < cv.K * G / 16) {
    const int count = 16 / cv.K * cv.group, c0 = blockIdx.x * count, pieces = count / 8;
    for (int i = threadIdx.x; i < m_rows * pieces; i += blockDim.x) {
      const int m = i / pieces, q = i % pieces;
      cp_async16(&slab.x[m][q * 8], x + (size_t)m * h + c0 + q * 8);
    }
    for (int i = threadIdx.x; i < cv.K * pieces; i += blockDim.x) {
      const int o = i / pieces, q = i % pieces;
      cp_async16(&slab.b[o * count + q * 8], cv.base + (size_t)o * h + c0 + q * 8);
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// The preparing form's epilogue (one tile of 16 rows a block, W = BW warps splitting K): the
// warps' sums (in warp order, as store_rows) rounded to bf16 are stored to y (the kernel
// projection, [m_rows, n_rows], at their gathered columns) and kept in the first warp's slot of
// `red`; then a block of the preparing half convolves x (the product's input, [m_rows, h]) over
// its groups' channels with them, into cv.xc.
template <int W, int T, int BW>
__device__ __forceinline__ void store_rows_kconv(const float (&acc)[1][T][4],
                                                 float (*red)[16][8 * T],
                                                 __nv_bfloat16* __restrict__ y,
                                                 const KconvSlab& slab, int m_rows, int n_rows,
                                                 int h, const ConvEpi& cv) {
  static_assert(W == BW, "one tile a block");
  constexpr int R = 16;
  constexpr int PER_TILE = R * 8 * T;
  stage_rows<T, 1>(acc, red);
  const int G = h / cv.group;
  for (int i = threadIdx.x; i < PER_TILE; i += blockDim.x) {
    const int r = i % R, m = i / R;
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < W; ++v) s += red[v][r][m];
    const __nv_bfloat16 q = __float2bfloat16(s);
    red[0][r][m] = __bfloat162float(q);
    if (m < m_rows) y[(size_t)m * n_rows + kconv_row(cv, blockIdx.x, r, G)] = q;
  }
  asm volatile("cp.async.wait_all;\n" ::);
  __syncthreads();
  if ((int)blockIdx.x >= cv.K * G / 16) return;
  const int per = 16 / cv.K, g0 = blockIdx.x * per, count = per * cv.group;
  for (int i = threadIdx.x; i < m_rows * count; i += blockDim.x) {
    const int m = i / count, cc = i % count, c = g0 * cv.group + cc;
    const float v = conv_value(
        [&](int row) { return __bfloat162float(slab.x[row][cc]); },
        [&](int row, int o, int g) { return red[0][(g - g0) * cv.K + o][row]; },
        [&](int o) { return __bfloat162float(slab.b[o * count + cc]); }, m, c, cv.K, cv.group,
        cv.block);
    cv.xc[(size_t)m * h + c] = __float2bfloat16(v);
  }
}

