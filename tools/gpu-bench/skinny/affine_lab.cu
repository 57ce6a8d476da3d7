// Affine (MLX 4-bit) skinny-GEMM lab: times y = x w^T for 1, 8 and 16 rows of x, w MLX affine
// 4-bit (bf16 scale and bias per group of 64) in the production layout (nn/affine.rs), for the
// production kernels (crates/dflash/kernels/affine.cu, included as they are), candidate
// kernels, and the production bf16 kernel (kernels/mma.cu) on the same weights dequantized, at
// the shapes of a Qwen3-8B step. Every kernel is checked against an f32 product of the
// dequantized weights and for batch invariance (a row alone == the same row among 16).
//
//   build here: source ../shared/tools/cuda-env.sh; tools/gpu-bench/skinny/build.sh (builds both)
//   run there:  ./affine_lab [iters]  (one line per (shape, rows, kernel), a table last)
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../../../crates/dflash/kernels/affine.cu"
#include "../../../crates/dflash/kernels/mma.cu"

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

// ---------------------------------------------------------------------------------------
// Candidates: kernels/affine.cu's DEQ path (each weight dequantized in registers to bf16, then
// the bf16 kernel's mma straight into the accumulators) at other blockings. Session 32's first
// runs also tried a load-time layout whose nibbles come out in natural k order (no x permute):
// no faster, dropped.
template <int W, int T, int BW, int MINB, int TN, int UW>
__global__ void __launch_bounds__(32 * BW, MINB)
    lab_deq(const __nv_bfloat16* x, const uint32_t* qw, const uint32_t* sb, __nv_bfloat16* y,
            int m_rows, int n_rows, int k) {
  affine_rows<4, 64, __nv_bfloat16, W, T, BW, TN, UW, true>(x, qw, sb, y, m_rows, n_rows, k);
}

// The production bf16 kernel's main loop at other launch bounds (occupancy only: the same
// arithmetic as the production configuration of the same W, U, TN).
template <int W, int T, int U, int BW, int MINB, int TN>
__global__ void __launch_bounds__(32 * BW, MINB)
    lab_bf16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
             __nv_bfloat16* __restrict__ y, int m_rows, int n_rows, int k) {
  gemm_rows<W, T, U, BW, TN>(x, w, y, m_rows, n_rows, k);
}

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

__device__ uint32_t hash(size_t i, uint32_t seed) {
  uint32_t h = (uint32_t)i * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return h;
}
__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed, float scale) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16(((hash(i, seed) & 0xffff) / 65536.f - 0.5f) * scale);
}
__global__ void fill_u32(uint32_t* p, size_t n, uint32_t seed) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = hash(i, seed) * 2246822519u + 12345u;
}
// Scale ~0.003-0.006 and bias ~ -8 s (MLX's: bias = min of the group), bf16, packed (s | b << 16).
__global__ void fill_sb(uint32_t* p, size_t n, uint32_t seed) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float s = 0.003f + 0.003f * ((hash(i, seed) & 0xffff) / 65536.f);
    const float b = -8.f * s * (0.8f + 0.4f * ((hash(i, seed ^ 77) & 0xffff) / 65536.f));
    __nv_bfloat16 sv = __float2bfloat16(s), bv = __float2bfloat16(b);
    uint16_t su, bu;
    memcpy(&su, &sv, 2);
    memcpy(&bu, &bv, 2);
    p[i] = (uint32_t)su | ((uint32_t)bu << 16);
  }
}

typedef void (*AFn)(const __nv_bfloat16*, const uint32_t*, const uint32_t*, __nv_bfloat16*, int,
                    int, int);
struct Cand {
  std::string name;
  AFn t1, t2;
  int rows_per_block, threads;
  bool prod;
};
template <int W, int BW, int MINB, int TN, int UW>
Cand deq_cand() {
  char b[64];
  snprintf(b, sizeof b, "deq W%d B%d m%d TN%d UW%d", W, BW, MINB, TN, UW);
  return Cand{b, lab_deq<W, 1, BW, MINB, TN, UW>, lab_deq<W, 2, BW, MINB, TN, UW>,
              16 * TN * (BW / W), 32 * BW, false};
}

typedef void (*KFn)(const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, int, int, int);
struct KFnPair {
  KFn t1, t2;
  int rpb, threads;
};

struct BfCand {
  std::string name;
  KFn t1, t2;
  int rpb, threads;
};
template <int W, int U, int BW, int MINB, int TN>
BfCand bf_cand() {
  char b[64];
  snprintf(b, sizeof b, "bf16 W%d U%d B%d m%d TN%d", W, U, BW, MINB, TN);
  return BfCand{b, lab_bf16<W, 1, U, BW, MINB, TN>, lab_bf16<W, 2, U, BW, MINB, TN>,
                16 * TN * (BW / W), 32 * BW};
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
  std::vector<Shape> shapes = {
      {"qkv 6144x4096", 6144, 4096},       {"o 4096x4096", 4096, 4096},
      {"gate+up 24576x4096", 24576, 4096}, {"down 4096x12288", 4096, 12288},
      {"lm 151936x4096", 151936, 4096},
  };
  // The production blockings (nn/cuda/affine.rs `config`): aff_w8 (8 warps split K, one tile a
  // block) below 512 tiles, aff_w1 (4 warps a tile each) for 1024..4096, aff_w4n2 otherwise.
  std::vector<Cand> cands = {
      {"prod aff_w8", aff_w8_b4_g64_bf16_t1, aff_w8_b4_g64_bf16_t2, 16, 256, true},
      {"prod aff_w1", aff_w1_b4_g64_bf16_t1, aff_w1_b4_g64_bf16_t2, 64, 128, true},
      {"prod aff_w4n2", aff_w4n2_b4_g64_bf16_t1, aff_w4n2_b4_g64_bf16_t2, 32, 128, true},
      {"prod affd_w8", affd_w8_b4_g64_bf16_t1, affd_w8_b4_g64_bf16_t2, 16, 256, true},
      {"prod affd_w1", affd_w1_b4_g64_bf16_t1, affd_w1_b4_g64_bf16_t2, 64, 128, true},
  };
  cands.push_back(deq_cand<8, 8, 3, 1, 2>());
  cands.push_back(deq_cand<8, 8, 2, 1, 4>());
  cands.push_back(deq_cand<4, 4, 4, 1, 4>());
  cands.push_back(deq_cand<16, 16, 1, 1, 2>());
  cands.push_back(deq_cand<8, 8, 2, 2, 2>());
  cands.push_back(deq_cand<4, 4, 4, 2, 2>());
  cands.push_back(deq_cand<1, 4, 4, 1, 2>());
  cands.push_back(deq_cand<1, 4, 6, 1, 2>());
  cands.push_back(deq_cand<1, 4, 4, 2, 1>());
  std::vector<BfCand> bcands = {
      bf_cand<8, 2, 8, 2, 1>(), bf_cand<8, 2, 8, 3, 1>(), bf_cand<8, 2, 8, 4, 1>(),
      bf_cand<4, 2, 4, 6, 1>(), bf_cand<1, 4, 4, 1, 1>(), bf_cand<1, 4, 4, 4, 1>(),
      bf_cand<4, 2, 4, 1, 2>(), bf_cand<4, 2, 4, 3, 2>(),
  };

  const int rows_list[] = {1, 8, 16};
  struct Row {
    std::string shape;
    int m;
    float bf16, prod, best;
    std::string prod_name, best_name;
    double floor_us;
    float old = 0;
    float bf16_best = 1e9f;
    std::string bf16_best_name;
  };
  std::vector<Row> table;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  int failures = 0;
  for (const Shape& sh : shapes) {
    const size_t wn = (size_t)sh.n * sh.k;
    const size_t words = wn / 8, groups = wn / 64;
    const size_t qbytes = words * 4 + groups * 4;
    const int copies = (int)std::max<size_t>(2, (512ull << 20) / qbytes + 1);
    std::vector<uint32_t*> qs(copies), ss(copies);
    for (int i = 0; i < copies; ++i) {
      CK(cudaMalloc(&qs[i], words * 4));
      CK(cudaMalloc(&ss[i], groups * 4));
      fill_u32<<<1024, 256>>>(qs[i], words, 1234 + i);
      fill_sb<<<1024, 256>>>(ss[i], groups, 777 + i);
    }
    // bf16 twin (dequantized by the production kernel) for the reference and the bf16 timing.
    const int bf_copies = (int)std::max<size_t>(2, (512ull << 20) / (wn * 2) + 1);
    std::vector<__nv_bfloat16*> wb(bf_copies);
    for (int i = 0; i < bf_copies; ++i) {
      CK(cudaMalloc(&wb[i], wn * 2));
      affine_dequant_b4_bf16<<<(unsigned)((words + 255) / 256), 256>>>(
          qs[i % copies], ss[i % copies], wb[i], sh.n, sh.k, 64);
    }
    __nv_bfloat16 *x, *y, *y1;
    float* yr;
    CK(cudaMalloc(&x, 16 * (size_t)sh.k * 2));
    CK(cudaMalloc(&y, 16 * (size_t)sh.n * 2));
    CK(cudaMalloc(&y1, (size_t)sh.n * 2));
    CK(cudaMalloc(&yr, 16 * (size_t)sh.n * 4));
    fill_bf16<<<256, 256>>>(x, 16 * (size_t)sh.k, 99, 2.f);
    ref_kernel<<<dim3((sh.n + 127) / 128, 16), 128>>>(x, wb[0], yr, 16, sh.n, sh.k);
    CK(cudaDeviceSynchronize());
    std::vector<float> ref(16 * (size_t)sh.n);
    CK(cudaMemcpy(ref.data(), yr, ref.size() * 4, cudaMemcpyDeviceToHost));
    double ref_scale = 0;
    for (float v : ref) ref_scale = std::max(ref_scale, (double)fabsf(v));

    auto time_it = [&](auto launch, int nc) {
      for (int i = 0; i < 3; ++i) launch(i % nc);
      std::vector<float> t;
      for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < iters; ++i) launch(i % nc);
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
    };
    // The production bf16 kernel's choice for this N (kernels/mma.cu, nn/cuda/matmul.rs).
    const int tiles = (sh.n + 15) / 16;
    KFnPair bfk;
    if (tiles < 512) bfk = {gemm_w8u2_t1, gemm_w8u2_t2, 16, 256};
    else if (tiles >= 1024 && tiles < 4096) bfk = {gemm_w1u4_t1, gemm_w1u4_t2, 64, 128};
    else bfk = {gemm_w4u2n2_t1, gemm_w4u2n2_t2, 32, 128};
    // The affine kernels before session 32 (the bf16 GEMM's blocking) and now (nn/cuda/affine.rs).
    const char* old_name = tiles < 512 ? "prod aff_w8"
                           : (tiles >= 1024 && tiles < 4096) ? "prod aff_w1" : "prod aff_w4n2";
    const char* prod_name = tiles < 512 ? "prod affd_w8" : "prod affd_w1";
    for (int m : rows_list) {
      Row row{sh.name, m, 0, 0, 1e9f, prod_name, "", qbytes / 4.27e6};
      {
        auto f = m <= 8 ? bfk.t1 : bfk.t2;
        const int grid = (sh.n + bfk.rpb - 1) / bfk.rpb;
        auto run = [&](int i) { f<<<grid, bfk.threads>>>(x, wb[i], y, m, sh.n, sh.k); };
        row.bf16 = time_it(run, bf_copies);
        run(0);
        check(m, "bf16");
        printf("%-20s m=%2d %-26s %8.1f us %6.0f GB/s\n", sh.name, m, "bf16 prod", row.bf16,
               wn * 2 / 1e3 / row.bf16);
      }
      for (const BfCand& cd : bcands) {
        auto f = m <= 8 ? cd.t1 : cd.t2;
        const int grid = (sh.n + cd.rpb - 1) / cd.rpb;
        auto run = [&](int i) { f<<<grid, cd.threads>>>(x, wb[i], y, m, sh.n, sh.k); };
        const float us = time_it(run, bf_copies);
        run(0);
        check(m, cd.name.c_str());
        printf("%-20s m=%2d %-26s %8.1f us %6.0f GB/s\n", sh.name, m, cd.name.c_str(), us,
               wn * 2 / 1e3 / us);
        if (us < row.bf16_best) {
          row.bf16_best = us;
          row.bf16_best_name = cd.name;
        }
      }
      for (const Cand& cd : cands) {
        AFn f = m <= 8 ? cd.t1 : cd.t2;
        const int grid = (sh.n + cd.rows_per_block - 1) / cd.rows_per_block;
        std::vector<uint32_t*>& q = qs;
        auto run = [&](int i) { f<<<grid, cd.threads>>>(x, q[i], ss[i], y, m, sh.n, sh.k); };
        float us = time_it(run, copies);
        run(0);
        check(m, cd.name.c_str());
        if (m == 16) {
          for (int r : {0, 9}) {
            cd.t1<<<grid, cd.threads>>>(x + (size_t)r * sh.k, q[0], ss[0], y1, 1, sh.n, sh.k);
            f<<<grid, cd.threads>>>(x, q[0], ss[0], y, m, sh.n, sh.k);
            CK(cudaDeviceSynchronize());
            std::vector<__nv_bfloat16> a(sh.n), bb((size_t)16 * sh.n);
            CK(cudaMemcpy(a.data(), y1, sh.n * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(bb.data(), y, bb.size() * 2, cudaMemcpyDeviceToHost));
            if (memcmp(a.data(), bb.data() + (size_t)r * sh.n, sh.n * 2) != 0) {
              printf("!! %s %s: row %d alone != row %d of 16\n", sh.name, cd.name.c_str(), r, r);
              ++failures;
            }
          }
        }
        printf("%-20s m=%2d %-26s %8.1f us %6.0f GB/s %4.0f%% of floor\n", sh.name, m,
               cd.name.c_str(), us, qbytes / 1e3 / us, 100.0 * row.floor_us / us);
        if (cd.prod) {
          if (cd.name == prod_name) row.prod = us;
          if (cd.name == old_name) row.old = us;
        } else if (us < row.best) {
          row.best = us;
          row.best_name = cd.name;
        }
      }
      table.push_back(row);
    }
    for (int i = 0; i < copies; ++i) {
      CK(cudaFree(qs[i]));
      CK(cudaFree(ss[i]));
    }
    for (auto p : wb) CK(cudaFree(p));
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaFree(y1));
    CK(cudaFree(yr));
  }
  printf("\n| shape | rows | bf16 us | 4-bit floor us | old 4-bit us (%% floor) | now (%% floor) | best candidate (%% floor) | candidate |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : table)
    printf("| %s | %d | %.1f | %.1f | %.1f (%.0f%%) | %.1f (%.0f%%) | %.1f (%.0f%%) | %s |\n",
           r.shape.c_str(), r.m, r.bf16, r.floor_us, r.old, 100 * r.floor_us / r.old, r.prod,
           100 * r.floor_us / r.prod, r.best, 100 * r.floor_us / r.best, r.best_name.c_str());
  printf("\n| shape | rows | bf16 prod us | best bf16 variant us | variant |\n|---|---|---|---|---|\n");
  for (const Row& r : table)
    printf("| %s | %d | %.1f | %.1f | %s |\n", r.shape.c_str(), r.m, r.bf16, r.bf16_best,
           r.bf16_best_name.c_str());
  printf("failures: %d\n", failures);
  return failures ? 2 : 0;
}
