// dflash CUDA kernels: MLX affine-quantized weights (4 or 8 bits, groups of 32/64/128) kept as
// stored, multiplied on the tensor cores for 1..16 rows of x, and dequantized to bf16 for more.
//
// A weight is w[n, k] = s[n, g] * q[n, k] + b[n, g] for k in group g. The skinny GEMM follows
// kernels/mma.cu (the weight is the mma's A operand, 16 weight rows per mma; x the B operand, 8
// rows per tile; lane (g, c) = (lane / 4, lane % 4) holds 8 k of its rows in each 32-wide chunk
// of k, and both operands use the same k order, so every k meets its partner), with two
// changes:
// - The A operand is the integers: a 4-bit q becomes the bf16 128 + q by OR-ing it into the
//   mantissa of 128.0 (exact), an 8-bit q the bf16 of q - 128 (exact); each chunk's products go
//   to a fresh accumulator, then acc += s * d + o * sum(x over the chunk), with o the group's
//   offset (b - 128 s for 4 bits, b + 128 s for 8). The chunk sums of x come from one more mma
//   with A = 1. A chunk never straddles two groups (groups are multiples of 32).
// - Cheap 4-bit unpacking takes the nibble pairs (n0, n4), (n1, n5), (n2, n6), (n3, n7) of a
//   word; x is permuted to the same order with byte permutes (a dot product does not care).
// - 4 bits with bf16 scales (MLX) take a shorter path (DEQ): each weight is dequantized in
//   registers, q exactly as (128 + q) - 128 and then one bf16x2 fma, bf16(s q + b) rounded once
//   (the dequantized reference's value: s q is exact in f32, so it differs at most where the
//   reference's f32 sum rounds before its bf16 rounding), and the chunk's two mma accumulate
//   straight into the result: no x-sum mma and no per-chunk f32 epilogue. Measured on the H200
//   with tools/gpu-bench/skinny/affine_lab.cu (docs/perf.md, session 32): 10-30% faster than the
//   epilogue path at the Qwen3-8B shapes.
//
// Layout (made at load, nn/cuda/affine.rs): each row's u32 words are permuted inside blocks of
// 16 words so that lane c's words for 4 (4-bit) or 2 (8-bit) consecutive chunks are one 16-byte
// load (the same bytes as stored); scale and bias of a group are one u32 (scale in the low
// half), bf16 or f16 as stored.
//
// Batch invariance: as kernels/mma.cu, a row's arithmetic depends on N and K (the blocking)
// only, never on the other rows of x.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "affine.cuh"
#include "skinny.cuh"


__device__ __forceinline__ uint32_t comp(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// (scale, bias) of a packed u32.
template <typename ST>
__device__ __forceinline__ float2 scale_bias(uint32_t p);
template <>
__device__ __forceinline__ float2 scale_bias<__nv_bfloat16>(uint32_t p) {
  return make_float2(__uint_as_float(p << 16), __uint_as_float(p & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 scale_bias<__half>(uint32_t p) {
  return make_float2(__half2float(__ushort_as_half((unsigned short)(p & 0xffff))),
                     __half2float(__ushort_as_half((unsigned short)(p >> 16))));
}

__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The A fragment words of chunk u from a row's 16-byte load.
template <int BITS>
__device__ __forceinline__ uint4 unpack(const uint4& w, int u) {
  if (BITS == 4) {
    return nibbles_128(comp(w, u));
  } else {
    const uint32_t a = comp(w, 2 * u), b = comp(w, 2 * u + 1);
    auto v = [](uint32_t x, int i) { return (float)(int)((x >> (8 * i)) & 0xff) - 128.f; };
    return make_uint4(bf16_pair(v(a, 0), v(a, 1)), bf16_pair(v(a, 2), v(a, 3)),
                      bf16_pair(v(b, 0), v(b, 1)), bf16_pair(v(b, 2), v(b, 3)));
  }
}

// x in the A fragment's k order: natural for 8 bits, (0,4)(1,5)(2,6)(3,7) for 4 bits.
template <int BITS>
__device__ __forceinline__ uint4 order_x(const uint4& x) {
  if (BITS == 8) return x;
  return order_x4(x);
}

// The DEQ path's A fragment words of chunk u: bf16(s q + b) for the words' nibble pairs, with
// p the group's packed bf16 (scale, bias).
__device__ __forceinline__ uint4 dequant4(const uint4& w, int u, uint32_t p) { return dequant4_word(comp(w, u), p); }

// UW: super-chunks in the ring; DEQ: the dequantizing path (4 bits, bf16 scales only).
template <int BITS, int G, typename ST, int W, int T, int BW, int TN, int UW, bool DEQ>
__device__ __forceinline__ void affine_rows(const __nv_bfloat16* __restrict__ x,
                                            const uint32_t* __restrict__ qw,
                                            const uint32_t* __restrict__ sb,
                                            __nv_bfloat16* __restrict__ y, int m_rows, int n_rows,
                                            int k) {
  constexpr int CPC = BITS == 4 ? 4 : 2;  // chunks of 32 k per 16-byte load
  constexpr int SPL = CPC * 32 / G > 1 ? CPC * 32 / G : 1;  // groups per 16-byte load
  constexpr int group = G;
  constexpr int R = 16 * TN;
  __shared__ float red[W > 1 ? BW : 1][R][8 * T];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int n0 = (blockIdx.x * (BW / W) + warp / W) * R;
  const int kw = warp % W;
  const int row_words = k * BITS / 32, groups = k / group;
  const uint4* wp[2 * TN];
  const uint32_t* sp[2 * TN];
#pragma unroll
  for (int j = 0; j < 2 * TN; ++j) {
    const int r = min(n0 + 8 * j + g, n_rows - 1);
    wp[j] = reinterpret_cast<const uint4*>(qw + (size_t)r * row_words) + c;
    sp[j] = sb + (size_t)r * groups;
  }
  const uint4* xp[T];
  bool xok[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const int xr = 8 * t + g;
    xok[t] = xr < m_rows;
    xp[t] = reinterpret_cast<const uint4*>(x + (size_t)(xok[t] ? xr : 0) * k) + c;
  }
  // This warp's share of the super-chunks (CPC chunks, 16 words of a row).
  const int supers = k / (32 * CPC);
  const int s0 = kw * supers / W, s1 = (kw + 1) * supers / W;
  float acc[TN][T][4];
#pragma unroll
  for (int a = 0; a < TN; ++a)
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[a][t][j] = 0.f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const uint4 ones = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u);
  // Weights (and their scales) stream from memory through a ring of UW super-chunks in
  // registers, refilled as each is consumed: UW * 16 bytes per row in flight per lane, which is
  // what keeps the memory busy (a 4-bit super-chunk is a quarter of a bf16 one's bytes). x
  // (read by every block, in L1/L2) is loaded when it is used.
  static_assert(!DEQ || (BITS == 4 && sizeof(ST) == 2), "DEQ: 4 bits, bf16 scales");
  uint4 wv[UW][2 * TN];
  uint32_t sv[UW][2 * TN][SPL];
  auto load = [&](int i, int s) {
#pragma unroll
    for (int j = 0; j < 2 * TN; ++j) wv[i][j] = load_weight(wp[j] + s * 4);
#pragma unroll
    for (int v = 0; v < SPL; ++v)
#pragma unroll
      for (int j = 0; j < 2 * TN; ++j) sv[i][j][v] = __ldg(sp[j] + s * CPC * 32 / G + v);
  };
#pragma unroll
  for (int i = 0; i < UW; ++i)
    if (s0 + i < s1) load(i, s0 + i);
  for (int sb0 = s0; sb0 < s1; sb0 += UW) {
#pragma unroll
    for (int i = 0; i < UW; ++i) {
      const int s = sb0 + i;
      if (s >= s1) break;
      uint4 cw[2 * TN];
      uint32_t cs[2 * TN][SPL];
#pragma unroll
      for (int j = 0; j < 2 * TN; ++j) {
        cw[j] = wv[i][j];
#pragma unroll
        for (int v = 0; v < SPL; ++v) cs[j][v] = sv[i][j][v];
      }
      if (s + UW < s1) load(i, s + UW);
#pragma unroll
      for (int u = 0; u < CPC; ++u) {
        const int ch = s * CPC + u;
        if constexpr (DEQ) {
          constexpr int CPG = G / 32;
          const int v = SPL > 1 ? u / CPG : 0;
          uint4 av[2 * TN];
#pragma unroll
          for (int j = 0; j < 2 * TN; ++j) av[j] = dequant4(cw[j], u, cs[j][v]);
#pragma unroll
          for (int t = 0; t < T; ++t) {
            const uint4 xo = order_x<BITS>(xok[t] ? __ldg(xp[t] + ch * 4) : zero);
#pragma unroll
            for (int a = 0; a < TN; ++a) mma_chunk(acc[a][t], av[2 * a], av[2 * a + 1], xo);
          }
        } else {
#pragma unroll
          for (int t = 0; t < T; ++t) {
            const uint4 xr = xok[t] ? __ldg(xp[t] + ch * 4) : zero;
            float xs[4] = {0.f, 0.f, 0.f, 0.f};
            mma_chunk(xs, ones, ones, xr);
            const uint4 xo = order_x<BITS>(xr);
#pragma unroll
            for (int a = 0; a < TN; ++a) {
              float d[4] = {0.f, 0.f, 0.f, 0.f};
              mma_chunk(d, unpack<BITS>(cw[2 * a], u), unpack<BITS>(cw[2 * a + 1], u), xo);
              // this chunk's group among the load's (a group of 128 at 8 bits spans two loads)
              constexpr int CPG = G / 32;
              const int v = SPL > 1 ? u / CPG : 0;
              const float2 pa = scale_bias<ST>(cs[2 * a][v]), pb = scale_bias<ST>(cs[2 * a + 1][v]);
              const float oa = BITS == 4 ? pa.y - 128.f * pa.x : pa.y + 128.f * pa.x;
              const float ob = BITS == 4 ? pb.y - 128.f * pb.x : pb.y + 128.f * pb.x;
              acc[a][t][0] += pa.x * d[0] + oa * xs[0];
              acc[a][t][1] += pa.x * d[1] + oa * xs[1];
              acc[a][t][2] += pb.x * d[2] + ob * xs[2];
              acc[a][t][3] += pb.x * d[3] + ob * xs[3];
            }
          }
        }
      }
    }
  }
  store_rows<W, T, BW, TN>(acc, red, y, m_rows, n_rows, n0);
}

// Configurations as kernels/mma.cu's (nn::cuda::affine picks one from N the same way):
// <name>_b<BITS>_g<G>_<st>_t<T>.
#define AFF1(NAME, W, BW, MINB, TN, UW, DEQ, BITS, G, ST, SN, T)                               \
  extern "C" __global__ void __launch_bounds__(32 * BW, MINB)                                  \
      NAME##_b##BITS##_g##G##_##SN##_t##T(const __nv_bfloat16* x, const uint32_t* qw,          \
                                          const uint32_t* sb, __nv_bfloat16* y, int m_rows,    \
                                          int n_rows, int k) {                                 \
    affine_rows<BITS, G, ST, W, T, BW, TN, UW, DEQ>(x, qw, sb, y, m_rows, n_rows, k);          \
  }
#define AFF_G(NAME, W, BW, MINB, TN, BITS, G)                                 \
  AFF1(NAME, W, BW, MINB, TN, 2 / TN, false, BITS, G, __nv_bfloat16, bf16, 1) \
  AFF1(NAME, W, BW, MINB, TN, 2 / TN, false, BITS, G, __nv_bfloat16, bf16, 2) \
  AFF1(NAME, W, BW, MINB, TN, 2 / TN, false, BITS, G, __half, f16, 1)         \
  AFF1(NAME, W, BW, MINB, TN, 2 / TN, false, BITS, G, __half, f16, 2)
#define AFF(NAME, W, BW, MINB, TN)           \
  AFF_G(NAME, W, BW, MINB, TN, 4, 32)        \
  AFF_G(NAME, W, BW, MINB, TN, 4, 64)        \
  AFF_G(NAME, W, BW, MINB, TN, 4, 128)       \
  AFF_G(NAME, W, BW, MINB, TN, 8, 32)        \
  AFF_G(NAME, W, BW, MINB, TN, 8, 64)        \
  AFF_G(NAME, W, BW, MINB, TN, 8, 128)
// (min blocks per SM: at least 16 warps resident, so that enough bytes are in flight)
AFF(aff_w8, 8, 8, 2, 1)
AFF(aff_w1, 1, 4, 4, 1)
AFF(aff_w4n2, 4, 4, 4, 2)
// The DEQ path (4 bits, bf16 scales), blockings from the lab: 8 warps split K for weights of
// fewer than 512 tiles (4 super-chunks in flight a warp; 2 at groups of 32, whose scales take
// twice the registers), else a warp a tile (2 in flight; 24 warps a multiprocessor at one x
// tile where the registers allow). t1 and t2 share W and TN, so a row's arithmetic does not
// depend on the row count.
#define AFFD(G, UW8, MINB1)                                                    \
  AFF1(affd_w8, 8, 8, 2, 1, UW8, true, 4, G, __nv_bfloat16, bf16, 1)           \
  AFF1(affd_w8, 8, 8, 2, 1, UW8, true, 4, G, __nv_bfloat16, bf16, 2)           \
  AFF1(affd_w1, 1, 4, MINB1, 1, 2, true, 4, G, __nv_bfloat16, bf16, 1)         \
  AFF1(affd_w1, 1, 4, 4, 1, 2, true, 4, G, __nv_bfloat16, bf16, 2)
AFFD(32, 2, 4)
AFFD(64, 4, 6)
AFFD(128, 4, 6)

// The whole weight as bf16 [n, k] (prefill: more rows than the skinny kernel takes); one
// thread per stored word, the value s * q + b in f32, rounded once.
template <int BITS, typename ST>
__device__ void affine_dequant(const uint32_t* __restrict__ qw, const uint32_t* __restrict__ sb,
                               __nv_bfloat16* __restrict__ out, int n_rows, int k, int group) {
  constexpr int CPC = BITS == 4 ? 4 : 2, WPL = BITS / 4, PER = 32 / BITS;
  const int row_words = k * BITS / 32;
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)n_rows * row_words) return;
  const int r = (int)(i / row_words), wi = (int)(i % row_words);
  // stored index -> (chunk, lane c, word e) -> first k of the word
  const int blk = wi / 16, p = wi % 16;
  const int c = p / 4, rest = p % 4, ch = blk * CPC + rest / WPL, e = rest % WPL;
  const int k0 = ch * 32 + 8 * c + e * PER;
  const float2 s = scale_bias<ST>(sb[(size_t)r * (k / group) + k0 / group]);
  const uint32_t w = qw[i];
  __nv_bfloat16* o = out + (size_t)r * k + k0;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const float q = (float)((w >> (BITS * j)) & ((1u << BITS) - 1));
    o[j] = __float2bfloat16(__fadd_rn(__fmul_rn(s.x, q), s.y));  // as the CPU: no FMA
  }
}
#define DEQ(BITS, ST, SN)                                                                        \
  extern "C" __global__ void affine_dequant_b##BITS##_##SN(const uint32_t* qw, const uint32_t* sb, \
                                                           __nv_bfloat16* out, int n_rows, int k,  \
                                                           int group) {                            \
    affine_dequant<BITS, ST>(qw, sb, out, n_rows, k, group);                                     \
  }
DEQ(4, __nv_bfloat16, bf16)
DEQ(4, __half, f16)
DEQ(8, __nv_bfloat16, bf16)
DEQ(8, __half, f16)
