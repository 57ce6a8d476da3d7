// The grouped dynamic causal convolution of DFlash2 draft layers (nn::dyn_conv), one output
// value: shared by its own kernel (kernels/dflash2.cu, dyn_conv) and the skinny GEMM's
// convolving epilogues (kernels/mma.cu, *_conv and *_kconv), so all compute it with the same
// arithmetic in the same order and give the same bits.
#pragma once
#include <cuda_bf16.h>

// out[i, c] = sum over o < K, o <= i % block of (base(o) + dyn(i, o, c / group)) * x(i - o), in
// f32 (the caller rounds once to bf16). `xat(row)`: the input at channel c of `row`,
// `dat(row, o, group)`: the dynamic kernel value, `bat(o)`: the base kernel at (o, c), each as
// the f32 of its bf16 value.
template <typename X, typename D, typename B>
__device__ __forceinline__ float conv_value(X xat, D dat, B bat, int i, int c, int K, int group,
                                            int block) {
  const int r = i % block, gc = c / group;
  float acc = 0.f;
  for (int o = 0; o < K && o <= r; ++o) {
    const float b = bat(o);
    const float d = dat(i, o, gc);
    acc += (b + d) * xat(i - o);
  }
  return acc;
}

// dat for a dynamic kernel in memory: rows dyn_stride elements apart (a column slice of the
// kernel projection), value (o, g) at column o * G + g.
struct DynRows {
  const __nv_bfloat16* dyn;
  long long stride;
  int G;
  __device__ __forceinline__ float operator()(int i, int o, int g) const {
    return __bfloat162float(dyn[(size_t)i * stride + o * G + g]);
  }
};
