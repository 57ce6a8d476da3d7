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

template <int W, int T, int U, int BW, int TN>
__device__ __forceinline__ void gemm_rows(const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ w,
                                          __nv_bfloat16* __restrict__ y, int m_rows, int n_rows,
                                          int k) {
  constexpr int R = 16 * TN;  // weight rows per warp
  __shared__ float red[W > 1 ? BW : 1][R][8 * T];
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
  for (int j = 0; j < 2 * TN; ++j)
    wp[j] = reinterpret_cast<const uint4*>(w + (size_t)min(n0 + 8 * j + g, n_rows - 1) * k) + c;
  const uint4* xp[T];
  bool xok[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const int xr = 8 * t + g;
    xok[t] = xr < m_rows;
    xp[t] = reinterpret_cast<const uint4*>(x + (size_t)(xok[t] ? xr : 0) * k) + c;
  }
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
  // d[0], d[1]: weight row g, x rows 2c, 2c+1 of the tile; d[2], d[3]: weight row g + 8.
  if (W == 1) {
#pragma unroll
    for (int a = 0; a < TN; ++a)
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const int m = 8 * t + 2 * c;
        const int na = n0 + 16 * a + g, nb = na + 8;
        if (m < m_rows) {
          if (na < n_rows) y[(size_t)m * n_rows + na] = __float2bfloat16(acc[a][t][0]);
          if (nb < n_rows) y[(size_t)m * n_rows + nb] = __float2bfloat16(acc[a][t][2]);
        }
        if (m + 1 < m_rows) {
          if (na < n_rows) y[(size_t)(m + 1) * n_rows + na] = __float2bfloat16(acc[a][t][1]);
          if (nb < n_rows) y[(size_t)(m + 1) * n_rows + nb] = __float2bfloat16(acc[a][t][3]);
        }
      }
    return;
  }
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
      y[(size_t)m * n_rows + n] = __float2bfloat16(s);
    }
  }
}

// Configurations (name: W warps per tile, U chunks in flight, BW warps per block, TN tiles per
// warp); nn::cuda::mma_config picks one from N. Keep the two in step.
#define GEMM(NAME, W, U, BW, MINB, TN)                                                        \
  extern "C" __global__ void __launch_bounds__(32 * BW, MINB)                                 \
      NAME##_t1(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int m_rows, \
                int n_rows, int k) {                                                          \
    gemm_rows<W, 1, U, BW, TN>(x, w, y, m_rows, n_rows, k);                                   \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(32 * BW, MINB)                                 \
      NAME##_t2(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int m_rows, \
                int n_rows, int k) {                                                          \
    gemm_rows<W, 2, U, BW, TN>(x, w, y, m_rows, n_rows, k);                                   \
  }
// Narrow weights (few tiles): 8 warps split K.
GEMM(gemm_w8u2, 8, 2, 8, 2, 1)
// Wide (gate+up): one warp per tile, 4 chunks in flight.
GEMM(gemm_w1u4, 1, 4, 4, 1, 1)
// The rest (K/V stacks, LM heads): 4 warps split K, 32 rows per warp.
GEMM(gemm_w4u2n2, 4, 2, 4, 1, 2)
