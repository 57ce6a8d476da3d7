// dflash CUDA kernel: skinny bf16 GEMM on the tensor cores, for 2..16 rows of x.
//
// gemm_bf16_t<T>: y[m, n] = sum_k x[m, k] * w[n, k] for m < M <= 8*T rows, bf16 in and out,
// f32 accumulation. w is row-major [N, K] (the nn.Linear layout), x [M, K], y [M, N], all
// contiguous; K % 32 == 0 and 16-byte aligned rows (checked by the caller).
//
// A verify or draft step multiplies 16 rows by every weight: still bound by reading w once,
// but 16 rows make 32 flops per weight, about what the CUDA cores can do at full bandwidth, so
// the products go to the tensor cores (mma.m16n8k16, bf16 -> f32). The weight is the A operand
// (16 weight rows per mma), x the B operand (8 rows of x per mma, T = 1 or 2 tiles).
//
// Loads: in each 32-wide chunk of k, the lane with group g = lane / 4 and c = lane % 4 loads
// 16 bytes (8 consecutive k, [8c, 8c + 8)) of weight rows g and g + 8 and of x row g: four
// lanes cover 64 contiguous bytes of a row, two chunks per iteration a whole 128-byte line.
// The mma fragments want k pairs {2c, 2c+1} and {2c+8, 2c+9} in each lane; since a dot
// product does not care about the order of k, lane c feeds its own 8 loaded values to those
// slots over two mma steps, the same way for weights and x, so every k meets its partner.
//
// One block = 8 warps on 16 weight rows; the warps split K and sum their partial tiles in
// shared memory. Rows past N are clamped on load and skipped on store; x rows past M are 0.
//
// Batch invariance: the arithmetic that makes y[m, n] (which k each warp sums, in which order,
// the mma's own accumulation, the order of the warps' sum) depends on k and n only, never on
// M or on the other rows of x. So a row gives the same bits whether it is multiplied alone (a
// decode step) or among 16 (a verify): with this kernel for 1..16 rows, greedy speculative
// decoding reproduces plain decoding bit for bit on the GPU too.
#include <cuda_bf16.h>
#include <stdint.h>

#define MMA_WARPS 8
#define MMA_U 4

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

template <int T>
__device__ __forceinline__ void gemm_rows(const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ w,
                                          __nv_bfloat16* __restrict__ y, int m_rows, int n_rows,
                                          int k) {
  __shared__ float red[MMA_WARPS][16][8 * T];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int c = lane % 4;
  const int n0 = blockIdx.x * 16;
  const int ra = min(n0 + g, n_rows - 1);
  const int rb = min(n0 + g + 8, n_rows - 1);
  const uint4* wpa = reinterpret_cast<const uint4*>(w + (size_t)ra * k) + c;
  const uint4* wpb = reinterpret_cast<const uint4*>(w + (size_t)rb * k) + c;
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
  const int c0 = warp * chunks / MMA_WARPS;
  const int c1 = (warp + 1) * chunks / MMA_WARPS;
  float acc[T][4];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[t][j] = 0.f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // MMA_U chunks per iteration: every load of the iteration is issued before the first mma, so a
  // warp keeps MMA_U * 1 KB of weights in flight (the kernel is bound by how much is in flight).
  int ch = c0;
  for (; ch + MMA_U <= c1; ch += MMA_U) {
    uint4 wa[MMA_U], wb[MMA_U], xv[T][MMA_U];
#pragma unroll
    for (int u = 0; u < MMA_U; ++u) {
      wa[u] = __ldcs(wpa + (ch + u) * 4);
      wb[u] = __ldcs(wpb + (ch + u) * 4);
    }
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int u = 0; u < MMA_U; ++u) xv[t][u] = xok[t] ? __ldg(xp[t] + (ch + u) * 4) : zero;
#pragma unroll
    for (int u = 0; u < MMA_U; ++u)
#pragma unroll
      for (int t = 0; t < T; ++t) mma_chunk(acc[t], wa[u], wb[u], xv[t][u]);
  }
  for (; ch < c1; ++ch) {
    const uint4 wa0 = __ldcs(wpa + ch * 4), wb0 = __ldcs(wpb + ch * 4);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const uint4 xv0 = xok[t] ? __ldg(xp[t] + ch * 4) : zero;
      mma_chunk(acc[t], wa0, wb0, xv0);
    }
  }
  // d[0], d[1]: weight row g, x rows 2c, 2c+1 of the tile; d[2], d[3]: weight row g + 8.
#pragma unroll
  for (int t = 0; t < T; ++t) {
    red[warp][g][8 * t + 2 * c] = acc[t][0];
    red[warp][g][8 * t + 2 * c + 1] = acc[t][1];
    red[warp][g + 8][8 * t + 2 * c] = acc[t][2];
    red[warp][g + 8][8 * t + 2 * c + 1] = acc[t][3];
  }
  __syncthreads();
  // 16 weight rows x 8T x rows; consecutive threads write consecutive n.
  for (int i = threadIdx.x; i < 16 * 8 * T; i += blockDim.x) {
    const int r = i % 16;
    const int m = i / 16;
    const int n = n0 + r;
    if (m < m_rows && n < n_rows) {
      float s = 0.f;
#pragma unroll
      for (int v = 0; v < MMA_WARPS; ++v) s += red[v][r][m];
      y[(size_t)m * n_rows + n] = __float2bfloat16(s);
    }
  }
}

extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)
    gemm_bf16_t1(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int m_rows,
                 int n_rows, int k) {
  gemm_rows<1>(x, w, y, m_rows, n_rows, k);
}

extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)
    gemm_bf16_t2(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int m_rows,
                 int n_rows, int k) {
  gemm_rows<2>(x, w, y, m_rows, n_rows, k);
}
