// dflash Gated DeltaNet kernels for decode and verify blocks (1..64 rows): the conv, the delta
// rule and the gated output norm of one layer in three launches (the candle path takes ~100
// small ops). Wrapped in src/nn/cuda/delta.rs; nn::gated_delta decides when they run.
//
//   delta_conv      causal depthwise conv over [window | new rows] + SiLU
//   delta_rule      per value head: q/k l2norm, beta, log decay, then the recurrence
//                   S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q
//                   row after row (state in registers, one block per (head, 32 state columns))
//   delta_out       gated RMSNorm per value head: rms_norm(o) * w * silu(z)
//
// The recurrence runs row by row, so a row's bits depend only on the rows before it: a verify
// block gives exactly the outputs and states of the decode steps (batch-invariant), and a
// rollback replays the accepted rows with the same kernel from the forward's start state.
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float rb(float x) { return __bfloat162float(__float2bfloat16(x)); }

// The conv inputs are the cached window `window [K - 1, cd]`, then the new rows' mixed columns
// (`proj [n, pstride]`, columns 0 .. cd): row r of them is window[r] for r < K - 1, else proj[r -
// (K - 1)].
__device__ __forceinline__ const bf16* conv_input(const bf16* window, const bf16* proj, int pstride, int K,
                                                  int cd, int r) {
  return r < K - 1 ? window + (size_t)r * cd : proj + (size_t)(r - (K - 1)) * pstride;
}

// out[i, c] = bf16(silu(bf16(sum_j inputs[i + j, c] * w[j, c]))) over the inputs above, w [K, cd]
// f32. One thread per (row, channel).
extern "C" __global__ void delta_conv(const bf16* __restrict__ window, const bf16* __restrict__ proj,
                                      int pstride, const float* __restrict__ w, int K, int cd, int n,
                                      bf16* __restrict__ out) {
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)n * cd) return;
  const int i = idx / cd, c = idx % cd;
  float acc = 0.f;
  for (int j = 0; j < K; ++j) {
    const float x = __bfloat162float(conv_input(window, proj, pstride, K, cd, i + j)[c]);
    const float p = __fmul_rn(x, w[(size_t)j * cd + c]);
    acc = j == 0 ? p : __fadd_rn(acc, p);
  }
  const float a = rb(acc);
  out[idx] = __float2bfloat16(a / (1.f + __expf(-a)));
}

#define DR_DK 128
#define DR_COLS 32
#define DR_GROUPS 8  // 256 threads: 8 groups of 16 state rows x 32 columns
#define DR_ROWS (DR_DK / DR_GROUPS)

// grid (hv, dv / 32), block 256. conv [n, cd]: q at [kh * 128], k at [hk * 128 + kh * 128], v at
// [2 * hk * 128 + vh * dv]; proj [n, pstride]: b at b_off + vh, a at a_off + vh. s_in / s_out
// [hv, 128, dv] f32 (distinct buffers); o [n, hv, dv] f32 (null: replay, state only). Rows 0 ..
// n. With win_out, also the conv window after row n: `win_out [K - 1, cd]` := conv inputs n ..
// n + K - 1 over `win_in` (the window before row 0) and proj (as delta_conv reads them).
extern "C" __global__ void __launch_bounds__(256)
    delta_rule(const bf16* __restrict__ conv, int cd, const bf16* __restrict__ proj, int pstride, int b_off,
               int a_off, const float* __restrict__ a_neg, const float* __restrict__ dt_bias, int hk, int hv,
               int dv, int n, const float* __restrict__ s_in, float* __restrict__ s_out,
               float* __restrict__ o, const bf16* __restrict__ win_in, int K, bf16* __restrict__ win_out) {
  __shared__ float qs[DR_DK], ks[DR_DK];
  __shared__ float red[DR_GROUPS][DR_COLS];
  __shared__ float ssq[2][4];
  __shared__ float gb[2];
  const int vh = blockIdx.x, c0 = blockIdx.y * DR_COLS;
  const int t = threadIdx.x, col = t % DR_COLS, grp = t / DR_COLS;
  const int kh = vh / (hv / hk);
  const int r0 = grp * DR_ROWS;
  const float qscale = rsqrtf((float)DR_DK);
  if (win_out != nullptr) {
    // The conv window after row n: inputs n .. n + K - 1 (see conv_input), spread over the grid.
    const size_t total = (size_t)(K - 1) * cd, step = (size_t)gridDim.x * gridDim.y * blockDim.x;
    for (size_t e = ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + t; e < total; e += step) {
      const int r = e / cd, c = e % cd;
      win_out[e] = conv_input(win_in, proj, pstride, K, cd, n + r)[c];
    }
  }
  float S[DR_ROWS];
  const float* sb = s_in + (size_t)vh * DR_DK * dv;
#pragma unroll
  for (int rr = 0; rr < DR_ROWS; ++rr) S[rr] = sb[(size_t)(r0 + rr) * dv + c0 + col];
  for (int i = 0; i < n; ++i) {
    const bf16* row = conv + (size_t)i * cd;
    // q, k of key head kh, l2-normalized (x / sqrt(sum x^2 + 1e-6)), q times 128^-0.5
    float qv = 0.f, kv = 0.f;
    if (t < DR_DK) {
      qv = __bfloat162float(row[kh * DR_DK + t]);
      kv = __bfloat162float(row[hk * DR_DK + kh * DR_DK + t]);
      float a = qv * qv, b = kv * kv;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, off);
        b += __shfl_xor_sync(0xffffffffu, b, off);
      }
      if (t % 32 == 0) {
        ssq[0][t / 32] = a;
        ssq[1][t / 32] = b;
      }
    }
    if (t == 0) {
      const float b = __bfloat162float(proj[(size_t)i * pstride + b_off + vh]);
      const float a = __bfloat162float(proj[(size_t)i * pstride + a_off + vh]) + dt_bias[vh];
      // beta = sigmoid(b) rounded as the bf16 op; g = -exp(A_log) * softplus(a + dt_bias)
      gb[0] = rb(1.f / (1.f + __expf(-b)));
      const float sp = fmaxf(a, 0.f) + logf(1.f + __expf(-fabsf(a)));
      gb[1] = sp * a_neg[vh];
    }
    __syncthreads();
    if (t < DR_DK) {
      const float sq = ssq[0][0] + ssq[0][1] + ssq[0][2] + ssq[0][3];
      const float sk = ssq[1][0] + ssq[1][1] + ssq[1][2] + ssq[1][3];
      qs[t] = qv * (1.f / sqrtf(sq + 1e-6f)) * qscale;
      ks[t] = kv * (1.f / sqrtf(sk + 1e-6f));
    }
    __syncthreads();
    const float beta = gb[0], eg = __expf(gb[1]);
    // S <- exp(g) S; kv_mem = S^T k
    float part = 0.f;
#pragma unroll
    for (int rr = 0; rr < DR_ROWS; ++rr) {
      S[rr] *= eg;
      part = fmaf(S[rr], ks[r0 + rr], part);
    }
    red[grp][col] = part;
    __syncthreads();
    float mem = 0.f;
#pragma unroll
    for (int g = 0; g < DR_GROUPS; ++g) mem += red[g][col];
    const float v = __bfloat162float(row[2 * hk * DR_DK + vh * dv + c0 + col]);
    const float delta = beta * (v - mem);
    // S <- S + k delta^T; o = S^T q
    part = 0.f;
#pragma unroll
    for (int rr = 0; rr < DR_ROWS; ++rr) {
      S[rr] = fmaf(ks[r0 + rr], delta, S[rr]);
      part = fmaf(S[rr], qs[r0 + rr], part);
    }
    __syncthreads();  // red was read by every group
    red[grp][col] = part;
    __syncthreads();
    if (o != nullptr && grp == 0) {
      float acc = 0.f;
#pragma unroll
      for (int g = 0; g < DR_GROUPS; ++g) acc += red[g][col];
      o[((size_t)i * hv + vh) * dv + c0 + col] = acc;
    }
    __syncthreads();
  }
  float* so = s_out + (size_t)vh * DR_DK * dv;
#pragma unroll
  for (int rr = 0; rr < DR_ROWS; ++rr) so[(size_t)(r0 + rr) * dv + c0 + col] = S[rr];
}

// out[i, vh * dv + e] = bf16(bf16(rms_norm(bf16(o)) * w) * silu(z)), z at proj[i, z_off + vh *
// dv + e]. grid (n, hv), block dv threads (a multiple of 32, <= 1024).
extern "C" __global__ void delta_out(const float* __restrict__ o, const bf16* __restrict__ proj, int pstride,
                                     int z_off, const bf16* __restrict__ w, float eps, int hv, int dv,
                                     bf16* __restrict__ out) {
  __shared__ float scratch[32];
  const int i = blockIdx.x, vh = blockIdx.y, e = threadIdx.x;
  const float x = rb(o[((size_t)i * hv + vh) * dv + e]);
  float s = x * x;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (e % 32 == 0) scratch[e / 32] = s;
  __syncthreads();
  float tot = 0.f;
  for (int k = 0; k < (int)blockDim.x / 32; ++k) tot += scratch[k];
  const float xn = rb(x * rsqrtf(tot / dv + eps) * __bfloat162float(w[e]));
  const float z = __bfloat162float(proj[(size_t)i * pstride + z_off + vh * dv + e]);
  const float g = z / (1.f + __expf(-z));
  out[(size_t)i * hv * dv + (size_t)vh * dv + e] = __float2bfloat16(xn * g);
}
