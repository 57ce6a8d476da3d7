// Shared by the skinny tensor-core GEMMs (kernels/mma.cu: bf16 weights; kernels/affine.cu: MLX
// affine weights): the mma of one 32-wide chunk of k, the streaming weight load, and the
// epilogue that writes a warp's accumulators (or sums the K-split warps' in warp order).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

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
