// MLX affine 4-bit weights (w = s q + b, bf16 s and b) dequantized in registers, shared by
// kernels/affine.cu (dense matrices) and kernels/moe.cu (expert stacks).
//
// A lane's u32 word holds 8 consecutive values of a 32-wide chunk (value v in bits 4v..4v+3).
// The cheap unpacking takes nibble pairs (n0, n4), (n1, n5), (n2, n6), (n3, n7): the mma's A
// fragment then has the k order 0 4 1 5 2 6 3 7, and x (the B fragment) is permuted to the
// same order with `order_x4` (a dot product does not care about the order).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

// bf16x2 words of 128 + q for the nibble pairs (0, 4), (1, 5), (2, 6), (3, 7) of x: exact (q
// ORed into the mantissa of 128.0).
__device__ __forceinline__ uint4 nibbles_128(uint32_t x) {
  const uint32_t m = 0x000F000Fu, one28 = 0x43004300u;
  // (v & m) | one28 in one LOP3 (the compiler splits it in two: an instruction takes one
  // immediate, and it does not keep the second constant in a register by itself)
  auto pick = [&](uint32_t v) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(v), "r"(m), "r"(one28));
    return d;
  };
  return make_uint4(pick(x), pick(x >> 4), pick(x >> 8), pick(x >> 12));
}

__device__ __forceinline__ uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The A fragment words of one 4-bit word x: bf16(s q + b) for its nibble pairs, rounded once
// (s q is exact, then one fma), with p the group's packed bf16 (scale low, bias high).
__device__ __forceinline__ uint4 dequant4_word(uint32_t x, uint32_t p) {
  const uint32_t s2 = __byte_perm(p, 0, 0x1010), b2 = __byte_perm(p, 0, 0x3232);
  const uint32_t q128 = 0x43004300u;  // bf16x2 (128, 128)
  const uint4 a = nibbles_128(x);     // 128 + q, exact
  auto one = [&](uint32_t v) {
    __nv_bfloat162 q = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&v),
                               *reinterpret_cast<const __nv_bfloat162*>(&q128));
    return bf16x2_fma(*reinterpret_cast<uint32_t*>(&q), s2, b2);
  };
  return make_uint4(one(a.x), one(a.y), one(a.z), one(a.w));
}

// 8 bf16 x values (natural order) in the nibble-pair order (0,4)(1,5)(2,6)(3,7).
__device__ __forceinline__ uint4 order_x4(const uint4& x) {
  return make_uint4(__byte_perm(x.x, x.z, 0x5410), __byte_perm(x.x, x.z, 0x7632),
                    __byte_perm(x.y, x.w, 0x5410), __byte_perm(x.y, x.w, 0x7632));
}
