// Skinny-GEMM lab: times y = x w^T (bf16, 1..16 rows of x) for candidate kernels against cuBLAS
// and the production kernels (crates/dflash/kernels/{gemv,mma}.cu, included as they are), at
// the shapes a Qwen3-8B decode / verify / draft step multiplies. Every candidate is also
// checked against an f32 reference and for batch invariance (a row alone == the same row among
// 16, bit for bit). Standalone on purpose: one nvcc build here, one device call there, many
// variants in one run (see build.sh; docs/perf.md "Run 5" has the results).
//
//   ./skinny [iters]     prints one line per (shape, rows, kernel) and a summary table last
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../../../crates/dflash/kernels/gemv.cu"
#include "../../../crates/dflash/kernels/mma.cu"

#include <cooperative_groups.h>
namespace cg = cooperative_groups;

// ---------------------------------------------------------------------------------------
// Candidate (session 26): narrow weights with K split over a cluster of S blocks, the block
// partials summed by block 0 through distributed shared memory. Measured: 10-20% faster than
// the production w8u2 on 64-tile weights at 1 row, slower at 16 rows for S >= 4, and no faster
// than one block of 16 warps a tile (reg W16 U2 B16); not adopted (docs/perf.md, session 26).
// The main loop of one warp (production gemm_rows's, with the chunk range given): the products of its weight rows n0 .. n0 + 16 TN (clamped to N)
// with the x rows over the 32-wide chunks [c0, c1) of k, into acc (zeroed here).
template <int T, int U, int TN>
__device__ __forceinline__ void warp_products(const __nv_bfloat16* __restrict__ x,
                                              const __nv_bfloat16* __restrict__ w, int m_rows,
                                              int n_rows, int k, int n0, int c0, int c1,
                                              float (&acc)[TN][T][4]) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
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
}

// Narrow weights (few 16-row tiles, e.g. N = 1,024 at K = 4,096: 64 tiles, about 1 MB of
// weight bytes in flight with one block a tile, where the H200 needs several): a cluster of S
// blocks shares one tile, block r of the cluster taking the chunks [r C / S, (r + 1) C / S)
// of k and its 8 warps splitting that range again. Each block sums its warps in warp order in
// shared memory; block 0 of the cluster then sums the S block partials in rank order through
// distributed shared memory and writes y. The split depends on N and K only (the caller picks
// S from them), so a row's bits do not depend on the other rows: batch-invariant. Grid x =
// tiles * S (consecutive blocks form a cluster), grid y = batch, 256 threads.
template <int S, int T, int U>
__device__ __forceinline__ void gemm_rows_split(const __nv_bfloat16* __restrict__ x,
                                                const __nv_bfloat16* __restrict__ w,
                                                __nv_bfloat16* __restrict__ y, int m_rows,
                                                int n_rows, int k) {
  constexpr int W = 8, R = 16;
  __shared__ float red[W][R][8 * T];
  __shared__ float part[R * 8 * T];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  x += (size_t)blockIdx.y * m_rows * k;
  w += (size_t)blockIdx.y * n_rows * k;
  y += (size_t)blockIdx.y * m_rows * n_rows;
  const int warp = threadIdx.x / 32;
  const int n0 = (blockIdx.x / S) * R;
  const int chunks = k / 32;
  const int b0 = rank * chunks / S, b1 = (rank + 1) * chunks / S;
  const int c0 = b0 + warp * (b1 - b0) / W, c1 = b0 + (warp + 1) * (b1 - b0) / W;
  float acc[1][T][4];
  warp_products<T, U, 1>(x, w, m_rows, n_rows, k, n0, c0, c1, acc);
  stage_rows<T, 1>(acc, red);
  // part[m * R + r]: this block's sum over its warps, in warp order.
  for (int i = threadIdx.x; i < R * 8 * T; i += blockDim.x) {
    const int r = i % R, m = i / R;
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < W; ++v) s += red[v][r][m];
    part[i] = s;
  }
  cluster.sync();
  if (rank == 0) {
    for (int i = threadIdx.x; i < R * 8 * T; i += blockDim.x) {
      const int r = i % R, m = i / R, n = n0 + r;
      if (m < m_rows && n < n_rows) {
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < S; ++q) s += cluster.map_shared_rank(part, q)[i];
        y[(size_t)m * n_rows + n] = __float2bfloat16(s);
      }
    }
  }
  // Keep every block's shared memory alive until block 0 has read it.
  cluster.sync();
}


#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e = (x);                                                              \
    if (e != cudaSuccess) {                                                           \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

// ---------------------------------------------------------------------------------------
// Candidate: cp.async ring per warp. Block = BW warps; W of them split K for one 16-row tile
// (BW / W tiles per block). Each warp streams its chunks of 32 k (weight rows g, g+8 and the
// T x tiles: (2 + T) x 16 B per lane) through an S-stage ring in shared memory; a lane reads
// back only what it copied itself, so no barrier is needed inside the loop.

__device__ __forceinline__ void cp16(void* s, const void* g) {
  unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(g));
}
__device__ __forceinline__ void cp16_hint(void* s, const void* g, uint64_t pol) {
  unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(a), "l"(g),
               "l"(pol));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int W, int T, int S, int BW, bool HINT, bool XS>
__global__ void __launch_bounds__(32 * BW)
    sk_async(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
             __nv_bfloat16* __restrict__ y, int m_rows, int n_rows, int k) {
  extern __shared__ uint4 ring_all[];
  __shared__ float red[W > 1 ? BW : 1][16][8 * T];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int tile = blockIdx.x * (BW / W) + warp / W;
  const int kw = warp % W;
  const int n0 = tile * 16;
  const int ra = min(n0 + g, n_rows - 1), rb = min(n0 + g + 8, n_rows - 1);
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
  uint64_t pol = 0;
  if (HINT) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  constexpr int SLOT = (XS ? 2 + T : 2) * 32;
  uint4* ring = ring_all + warp * S * SLOT;
  const int chunks = k / 32;
  const int c0 = kw * chunks / W, c1 = (kw + 1) * chunks / W;
  const int n = c1 - c0;
  auto issue = [&](int ch, int slot) {
    uint4* s = ring + slot * SLOT;
    if (HINT) {
      cp16_hint(s + lane, wpa + ch * 4, pol);
      cp16_hint(s + 32 + lane, wpb + ch * 4, pol);
    } else {
      cp16(s + lane, wpa + ch * 4);
      cp16(s + 32 + lane, wpb + ch * 4);
    }
    if (XS)
#pragma unroll
      for (int t = 0; t < T; ++t)
        if (xok[t]) cp16(s + (2 + t) * 32 + lane, xp[t] + ch * 4);
  };
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < n) issue(c0 + s, s);
    cp_commit();
  }
  float acc[T][4];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[t][j] = 0.f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  int slot = 0;
  for (int i = 0; i < n; ++i) {
    cp_wait<S - 2>();
    const uint4* s = ring + slot * SLOT;
    const uint4 wa = s[lane], wb = s[32 + lane];
    uint4 xv[T];
#pragma unroll
    for (int t = 0; t < T; ++t)
      xv[t] = !xok[t] ? zero : XS ? s[(2 + t) * 32 + lane] : __ldg(xp[t] + (c0 + i) * 4);
    const int nxt = slot == 0 ? S - 1 : slot - 1;  // (i + S - 1) % S
    if (i + S - 1 < n) issue(c0 + i + S - 1, nxt);
    cp_commit();
#pragma unroll
    for (int t = 0; t < T; ++t) mma_chunk(acc[t], wa, wb, xv[t]);
    slot = slot + 1 == S ? 0 : slot + 1;
  }
  cp_wait<0>();
  if (W == 1) {
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int m = 8 * t + 2 * c;
      const int na = n0 + g, nb = n0 + g + 8;
      if (m < m_rows) {
        if (na < n_rows) y[(size_t)m * n_rows + na] = __float2bfloat16(acc[t][0]);
        if (nb < n_rows) y[(size_t)m * n_rows + nb] = __float2bfloat16(acc[t][2]);
      }
      if (m + 1 < m_rows) {
        if (na < n_rows) y[(size_t)(m + 1) * n_rows + na] = __float2bfloat16(acc[t][1]);
        if (nb < n_rows) y[(size_t)(m + 1) * n_rows + nb] = __float2bfloat16(acc[t][3]);
      }
    }
    return;
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
    red[warp][g][8 * t + 2 * c] = acc[t][0];
    red[warp][g][8 * t + 2 * c + 1] = acc[t][1];
    red[warp][g + 8][8 * t + 2 * c] = acc[t][2];
    red[warp][g + 8][8 * t + 2 * c + 1] = acc[t][3];
  }
  __syncthreads();
  constexpr int PER_TILE = 16 * 8 * T;
  for (int i = threadIdx.x; i < (BW / W) * PER_TILE; i += blockDim.x) {
    const int tb = i / PER_TILE, e = i % PER_TILE;
    const int r = e % 16, m = e / 16;
    const int nn = (blockIdx.x * (BW / W) + tb) * 16 + r;
    if (m < m_rows && nn < n_rows) {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < W; ++v) sum += red[tb * W + v][r][m];
      y[(size_t)m * n_rows + nn] = __float2bfloat16(sum);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Candidates with registers: the production template (kernels/mma.cu gemm_rows: software
// pipelined, U chunks in flight, W warps per tile, TN 16-row tiles per warp, BW warps per
// block) at other blockings. (The first two lab runs also had a copy of it with the weight
// load as a parameter: ld.global.cs vs ld.global.nc.L1::no_allocate(.L2::256B); the 256-byte
// hint was as fast or faster, and production keeps it.)
template <int W, int T, int U, int BW, int MINB, int TN>
__global__ void __launch_bounds__(32 * BW, MINB)
    lab_gemm(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
             __nv_bfloat16* __restrict__ y, int m_rows, int n_rows, int k) {
  gemm_rows<W, T, U, BW, TN>(x, w, y, m_rows, n_rows, k);
}

// The cluster split-K of narrow weights (kernels/mma.cu gemm_rows_split) at other S / U.
template <int S, int T, int U>
__global__ void __cluster_dims__(S, 1, 1) __launch_bounds__(256)
    lab_split(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
              __nv_bfloat16* __restrict__ y, int m_rows, int n_rows, int k) {
  gemm_rows_split<S, T, U>(x, w, y, m_rows, n_rows, k);
}

// f32 reference: one thread per output.
__global__ void ref_kernel(const __nv_bfloat16* x, const __nv_bfloat16* w, float* y, int m_rows,
                           int n_rows, int k) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  const int m = blockIdx.y;
  if (n >= n_rows) return;
  float s = 0.f;
  for (int i = 0; i < k; ++i)
    s += __bfloat162float(x[(size_t)m * k + i]) * __bfloat162float(w[(size_t)n * k + i]);
  y[(size_t)m * n_rows + n] = s;
}

__global__ void fill(__nv_bfloat16* p, size_t n, uint32_t seed, float scale) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * scale);
  }
}

// ---------------------------------------------------------------------------------------
typedef void (*KFn)(const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, int, int, int);

struct Cand {
  std::string name;
  KFn t1, t2;     // kernels for 1..8 and 9..16 rows
  int rows_per_block;  // weight rows per block (grid = ceil(N / rows_per_block))
  int threads;
  int smem1, smem2;  // dynamic shared memory for t1 / t2
  int split = 1;     // blocks per 16-row tile (a cluster; grid = tiles * split)
};

template <int W, int S, int BW, bool H, bool XS = true>
Cand async_cand() {
  char b[64];
  snprintf(b, sizeof b, "async W%d S%d B%d%s%s", W, S, BW, H ? " ef" : "", XS ? "" : " xg");
  Cand c{b, sk_async<W, 1, S, BW, H, XS>, sk_async<W, 2, S, BW, H, XS>, 16 * (BW / W), 32 * BW,
         BW * S * (XS ? 3 : 2) * 512, BW * S * (XS ? 4 : 2) * 512};
  CK(cudaFuncSetAttribute(c.t1, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem1));
  CK(cudaFuncSetAttribute(c.t2, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem2));
  return c;
}
template <int W, int U, int BW, int MINB, int TN>
Cand reg_cand() {
  char b[64];
  snprintf(b, sizeof b, "reg W%d U%d B%d m%d TN%d", W, U, BW, MINB, TN);
  return Cand{b, lab_gemm<W, 1, U, BW, MINB, TN>, lab_gemm<W, 2, U, BW, MINB, TN>,
              16 * TN * (BW / W), 32 * BW, 0, 0};
}

template <int S, int U>
Cand split_cand() {
  char b[64];
  snprintf(b, sizeof b, "split S%d U%d", S, U);
  Cand c{b, lab_split<S, 1, U>, lab_split<S, 2, U>, 16, 256, 0, 0};
  c.split = S;
  return c;
}

struct Shape {
  const char* name;
  int n, k;
};

static float bf2f(__nv_bfloat16 v) {
  uint16_t u;
  memcpy(&u, &v, 2);
  uint32_t f = (uint32_t)u << 16;
  float r;
  memcpy(&r, &f, 4);
  return r;
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 30;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("# %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
    fprintf(stderr, "cublasCreate failed\n");
    return 1;
  }
  std::vector<Shape> shapes = {
      {"q/o 4096x4096", 4096, 4096},      {"qkv 6144x4096", 6144, 4096},
      {"gate+up 24576x4096", 24576, 4096}, {"down 4096x12288", 4096, 12288},
      {"lm 151936x4096", 151936, 4096},   {"ctx-kv 10240x4096", 10240, 4096},
      {"fc 4096x20480", 4096, 20480},     {"smol qkv 960x576", 960, 576},
      {"smol gu 3072x576", 3072, 576},    {"smol lm 49152x576", 49152, 576},
      // narrow weights: DFlash2 kernel projection, MoE routers, a 30B-A3B o_proj
      {"dyn-k 1024x4096", 1024, 4096},     {"router 128x2048", 128, 2048},
      {"router 512x2048", 512, 2048},      {"router 32x2880", 32, 2880},
      {"o 2048x4096", 2048, 4096},         {"kv 1024x2048", 1024, 2048},
  };
  std::vector<Cand> cands;
  cands.push_back(Cand{"prod w8u2", gemm_w8u2_t1, gemm_w8u2_t2, 16, 256, 0, 0});
  cands.push_back(Cand{"prod w1u4", gemm_w1u4_t1, gemm_w1u4_t2, 64, 128, 0, 0});
  cands.push_back(Cand{"prod w4u2n2", gemm_w4u2n2_t1, gemm_w4u2n2_t2, 32, 128, 0, 0});
  cands.push_back(split_cand<2, 2>());
  cands.push_back(split_cand<4, 2>());
  cands.push_back(split_cand<8, 2>());
  cands.push_back(split_cand<2, 4>());
  cands.push_back(split_cand<4, 4>());
  cands.push_back(split_cand<8, 1>());
  cands.push_back(async_cand<4, 8, 8, false>());
  // TN = 1: 16 weight rows per warp
  cands.push_back(reg_cand<1, 4, 4, 1, 1>());
  cands.push_back(reg_cand<2, 4, 8, 1, 1>());
  cands.push_back(reg_cand<4, 2, 8, 2, 1>());
  cands.push_back(reg_cand<8, 2, 8, 2, 1>());
  cands.push_back(reg_cand<8, 4, 8, 1, 1>());
  cands.push_back(reg_cand<16, 2, 16, 1, 1>());
  // TN = 2: 32 weight rows per warp
  cands.push_back(reg_cand<1, 2, 4, 1, 2>());
  cands.push_back(reg_cand<1, 4, 4, 1, 2>());
  cands.push_back(reg_cand<2, 2, 8, 1, 2>());
  cands.push_back(reg_cand<4, 2, 8, 1, 2>());
  cands.push_back(reg_cand<8, 2, 8, 1, 2>());
  cands.push_back(reg_cand<16, 2, 16, 1, 2>());
  // TN = 4: 64 weight rows per warp
  cands.push_back(reg_cand<1, 1, 4, 1, 4>());
  cands.push_back(reg_cand<1, 2, 4, 1, 4>());
  cands.push_back(reg_cand<4, 1, 4, 1, 4>());
  cands.push_back(reg_cand<8, 1, 8, 1, 4>());

  const int rows_list[] = {1, 8, 16};
  struct Best {
    std::string shape;
    int m;
    float cublas, gemv, prod, best;
    std::string best_name;
  };
  std::vector<Best> table;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  int failures = 0;
  for (const Shape& sh : shapes) {
    const size_t wn = (size_t)sh.n * sh.k;
    const size_t wbytes = wn * 2;
    const int copies = (int)std::max<size_t>(2, (512ull << 20) / wbytes + 1);
    std::vector<__nv_bfloat16*> ws(copies);
    for (int i = 0; i < copies; ++i) {
      CK(cudaMalloc(&ws[i], wbytes));
      fill<<<1024, 256>>>(ws[i], wn, 1234 + i, 0.05f);
    }
    __nv_bfloat16 *x, *y, *y1;
    float* yr;
    CK(cudaMalloc(&x, 16 * (size_t)sh.k * 2));
    CK(cudaMalloc(&y, 16 * (size_t)sh.n * 2));
    CK(cudaMalloc(&y1, (size_t)sh.n * 2));
    CK(cudaMalloc(&yr, 16 * (size_t)sh.n * 4));
    fill<<<256, 256>>>(x, 16 * (size_t)sh.k, 99, 2.f);
    ref_kernel<<<dim3((sh.n + 127) / 128, 16), 128>>>(x, ws[0], yr, 16, sh.n, sh.k);
    CK(cudaDeviceSynchronize());
    std::vector<float> ref(16 * (size_t)sh.n);
    CK(cudaMemcpy(ref.data(), yr, ref.size() * 4, cudaMemcpyDeviceToHost));
    double ref_scale = 0;
    for (float v : ref) ref_scale = std::max(ref_scale, (double)fabsf(v));

    auto time_it = [&](auto launch) {
      for (int i = 0; i < 3; ++i) launch(ws[i % copies]);
      std::vector<float> t;
      for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < iters; ++i) launch(ws[i % copies]);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1000.f / iters);
      }
      CK(cudaGetLastError());
      std::sort(t.begin(), t.end());
      return t[2];
    };
    auto check = [&](int m, const char* name) {
      std::vector<__nv_bfloat16> out((size_t)m * sh.n);
      CK(cudaMemcpy(out.data(), y, out.size() * 2, cudaMemcpyDeviceToHost));
      double err = 0;
      for (size_t i = 0; i < out.size(); ++i)
        err = std::max(err, (double)fabsf(bf2f(out[i]) - ref[i]));
      err /= ref_scale;
      if (err > 1e-2) {
        printf("!! %s %s m=%d: max error %.3g of scale\n", sh.name, name, m, err);
        ++failures;
      }
      return out;
    };
    for (int m : rows_list) {
      Best b{sh.name, m, 0, 0, 0, 1e9f, ""};
      const float alpha = 1.f, beta = 0.f;
      b.cublas = time_it([&](const __nv_bfloat16* wp) {
        cublasStatus_t st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, m, sh.k, &alpha, wp,
                                         CUDA_R_16BF, sh.k, x, CUDA_R_16BF, sh.k, &beta, y,
                                         CUDA_R_16BF, sh.n, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT);
        static bool said = false;
        if (st != CUBLAS_STATUS_SUCCESS && !said) {
          printf("!! cublasGemmEx status %d\n", (int)st);
          said = true;
        }
      });
      check(m, "cublas");
      if (m == 1) {
        auto gv = [&](const __nv_bfloat16* wp) {
          gemv_bf16_m1<<<(sh.n + 7) / 8, 256>>>(x, wp, y, sh.n, sh.k);
        };
        b.gemv = time_it(gv);
        gv(ws[0]);
        check(m, "gemv");
      }
      const double gb = wbytes / 1e3;  // bytes / us -> GB/s when divided by us
      printf("%-20s m=%2d %-22s %8.1f us %6.0f GB/s\n", sh.name, m, "cublas", b.cublas,
             gb / b.cublas);
      if (m == 1)
        printf("%-20s m=%2d %-22s %8.1f us %6.0f GB/s\n", sh.name, m, "gemv", b.gemv,
               gb / b.gemv);
      for (const Cand& cd : cands) {
        if (sh.k % 32 != 0) continue;
        KFn f = m <= 8 ? cd.t1 : cd.t2;
        const int smem = m <= 8 ? cd.smem1 : cd.smem2;
        const int grid = (sh.n + cd.rows_per_block - 1) / cd.rows_per_block * cd.split;
        if (cd.split > 1 && sh.k / 32 < cd.split * 8) continue;  // fewer than a chunk a warp
        auto run = [&](const __nv_bfloat16* wp) {
          f<<<grid, cd.threads, smem>>>(x, wp, y, m, sh.n, sh.k);
        };
        float us = time_it(run);
        run(ws[0]);
        std::vector<__nv_bfloat16> out = check(m, cd.name.c_str());
        if (m == 16) {  // batch invariance: row 0 alone and row 9 alone give the same bits
          for (int row : {0, 9}) {
            KFn f1 = cd.t1;
            f1<<<grid, cd.threads, cd.smem1>>>(x + (size_t)row * sh.k, ws[0], y1, 1, sh.n, sh.k);
            f<<<grid, cd.threads, smem>>>(x, ws[0], y, m, sh.n, sh.k);
            CK(cudaDeviceSynchronize());
            std::vector<__nv_bfloat16> a(sh.n), bb((size_t)16 * sh.n);
            CK(cudaMemcpy(a.data(), y1, sh.n * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(bb.data(), y, bb.size() * 2, cudaMemcpyDeviceToHost));
            if (memcmp(a.data(), bb.data() + (size_t)row * sh.n, sh.n * 2) != 0) {
              printf("!! %s %s: row %d alone != row %d of 16\n", sh.name, cd.name.c_str(), row,
                     row);
              ++failures;
            }
          }
        }
        printf("%-20s m=%2d %-22s %8.1f us %6.0f GB/s\n", sh.name, m, cd.name.c_str(), us,
               gb / us);
        if (cd.name.rfind("prod", 0) == 0) b.prod = b.prod == 0 ? us : std::min(b.prod, us);
        else if (us < b.best) {
          b.best = us;
          b.best_name = cd.name;
        }
      }
      table.push_back(b);
    }
    for (auto p : ws) CK(cudaFree(p));
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaFree(y1));
    CK(cudaFree(yr));
  }
  printf("\n| shape | rows | cuBLAS us | GEMV us | mma now us | best new us | best new |\n");
  printf("|---|---|---|---|---|---|---|\n");
  for (const Best& b : table)
    printf("| %s | %d | %.1f | %s | %.1f | %.1f | %s |\n", b.shape.c_str(), b.m, b.cublas,
           b.m == 1 ? std::to_string(b.gemv).substr(0, 5).c_str() : "-", b.prod, b.best,
           b.best_name.c_str());
  printf("failures: %d\n", failures);
  return failures ? 2 : 0;
}
