// dflash fused CUDA kernels for the decode / verify / draft steps (bf16 in and out, f32
// arithmetic). Compiled to PTX by build.rs with --features cuda; wrapped in src/nn/cuda.rs,
// which checks shapes, contiguity and alignment before launching.
//
// A decode step of a 36-layer model ran ~25 candle ops per layer, each costing ~6.5 us of
// host time, so the step was bound by launching, not by the GPU. These kernels replace the
// chains that sit between the matmuls:
//   add_rmsnorm  residual add + RMSNorm                          (2 ops -> 1)
//   swiglu       silu(gate) * up on the stacked gate/up output   (3 ops -> 1)
//   kv_write     k: per-head RMSNorm + RoPE, v: copy, both into the KV cache rows
//                (reshape/transpose/contiguous/norm/rope/slice_set: ~9 ops -> 1)
//   attn         q: per-head RMSNorm + RoPE + scale, then causal / sliding / full
//                attention over the cache with an online softmax, split over the keys
//                (flash-decoding) + attn_combine when there is more than one split
//                (mask upload, scale, 2 matmuls, softmax, transpose: ~7 ops -> 1 or 2)
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). Every thread gets the sum.
__device__ __forceinline__ float block_sum(float v, float* scratch /* [32] */) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nw ? scratch[lane] : 0.f;
  return warp_sum(t);
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// ---------------------------------------------------------------------------------------
// out_sum[r] = bf16(res[r] + delta[r]); out_norm[r] = bf16(out_sum[r] * rsqrt(mean(out_sum^2)
// + eps) * w). One block per row.
extern "C" __global__ void add_rmsnorm_bf16(const bf16* __restrict__ res, const bf16* __restrict__ delta,
                                            const bf16* __restrict__ w, bf16* __restrict__ out_sum,
                                            bf16* __restrict__ out_norm, int h, float eps) {
  __shared__ float scratch[32];
  const size_t row = blockIdx.x;
  const bf16* a = res + row * h;
  const bf16* b = delta + row * h;
  bf16* s = out_sum + row * h;
  float ss = 0.f;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    bf16 v = __float2bfloat16(__bfloat162float(a[c]) + __bfloat162float(b[c]));
    s[c] = v;
    float f = __bfloat162float(v);
    ss += f * f;
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / h + eps);
  bf16* o = out_norm + row * h;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    o[c] = __float2bfloat16(__bfloat162float(s[c]) * inv * __bfloat162float(w[c]));
  }
}

// out[r, j] = bf16(bf16(silu(gu[r, j])) * gu[r, inter + j]) (the rounding of candle's silu
// then mul). gu [n, 2 * inter], out [n, inter].
extern "C" __global__ void swiglu_bf16(const bf16* __restrict__ gu, bf16* __restrict__ out, int inter,
                                       int n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)inter * n) return;
  const size_t r = i / inter, j = i % inter;
  float g = __bfloat162float(gu[r * 2 * inter + j]);
  float u = __bfloat162float(gu[r * 2 * inter + inter + j]);
  float act = round_bf16(g / (1.f + __expf(-g)));
  out[i] = __float2bfloat16(act * u);
}

// One head row of D values from `src`, optionally RMS-normed (per head, weight w, rounded to
// bf16 as the unfused path does), then rotated (neox layout) on its first `rot` dims by the
// table row cs = [cos(rot/2) | sin(rot/2)]. Called by blockDim.x >= D threads; xs [D] shared;
// thread e < D returns element e (f32, not rounded), others return 0.
__device__ __forceinline__ float load_norm_rope(const bf16* __restrict__ src, const bf16* __restrict__ w,
                                                float eps, const bf16* __restrict__ cs, int rot, int d,
                                                float* xs, float* scratch) {
  const int e = threadIdx.x;
  float x = e < d ? __bfloat162float(src[e]) : 0.f;
  if (w != nullptr) {
    const float inv = rsqrtf(block_sum(x * x, scratch) / d + eps);
    if (e < d) x = round_bf16(x * inv * __bfloat162float(w[e]));
  }
  __syncthreads();
  if (e < d) xs[e] = x;
  __syncthreads();
  if (e < rot) {
    const int half = rot / 2;
    if (e < half) {
      x = xs[e] * __bfloat162float(cs[e]) - xs[e + half] * __bfloat162float(cs[half + e]);
    } else {
      x = xs[e] * __bfloat162float(cs[e - half]) + xs[e - half] * __bfloat162float(cs[e]);
    }
  }
  return x;
}

// Write rows pos0 .. pos0 + n of the KV cache kv [2, kvh, cap, d] (keys then values) from
// src [n, src_stride]: keys at column k_off + h * d (normed with kw when given, roped with
// cs [n, rot]), values at v_off + h * d. grid (kvh, n), block: d rounded up to a warp.
extern "C" __global__ void kv_write_bf16(const bf16* __restrict__ src, int src_stride, int k_off, int v_off,
                                         const bf16* __restrict__ kw, float eps, const bf16* __restrict__ cs,
                                         int rot, bf16* __restrict__ kv, int kvh, long long cap, int pos0,
                                         int d) {
  __shared__ float scratch[32];
  extern __shared__ float xs[];
  const int h = blockIdx.x, i = blockIdx.y, e = threadIdx.x;
  const bf16* row = src + (size_t)i * src_stride;
  float k = load_norm_rope(row + k_off + h * d, kw, eps, cs + (size_t)i * rot, rot, d, xs, scratch);
  const size_t dst = ((size_t)h * cap + pos0 + i) * d;
  if (e < d) {
    kv[dst + e] = __float2bfloat16(k);
    kv[(size_t)kvh * cap * d + dst + e] = row[v_off + h * d + e];
  }
}

// Attention of query rows (q at columns q_off + head * D of src [n, src_stride], normed with
// qw when given, roped with cs, times scale) over keys 0 .. kv_len of the cache kv [2, kvh,
// cap, D]. Query row i sits at position q_pos0 + i; a key j is visible iff (!causal || j <=
// pos) && (window == 0 || j + window > pos). Head h reads KV head h / rep.
//
// grid (heads, n, splits): split s covers keys [s * chunk, (s + 1) * chunk). Block: NW warps;
// each warp takes 4 keys at a time (loads in flight together), lane l owns dims
// [l * D/32, (l + 1) * D/32) of q, k, v and the accumulator; online softmax per warp, merged
// across warps in shared memory. With one split the block writes the bf16 output row
// out[i, h * D ..]; otherwise (m, l, acc[D]) go to part[((h * n + i) * splits + s)] for
// attn_combine.
template <int D>
__device__ void attn_block(const bf16* __restrict__ src, int src_stride, int q_off, const bf16* __restrict__ qw,
                           float eps, const bf16* __restrict__ cs, int rot, float scale,
                           const bf16* __restrict__ kv, int kvh, long long cap, int kv_len, int rep,
                           int q_pos0, int causal, int window, int chunk, bf16* __restrict__ out,
                           float* __restrict__ part) {
  constexpr int E = D / 32;  // dims per lane
  constexpr int NW = 4;
  __shared__ float scratch[32];
  __shared__ float qs[D];
  __shared__ float wm[NW], wl[NW];
  __shared__ float wacc[NW][D];
  const int h = blockIdx.x, i = blockIdx.y, s = blockIdx.z;
  const int n = gridDim.y, splits = gridDim.z, heads = gridDim.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int pos = q_pos0 + i;

  // q: norm + rope by the first D threads (blockDim = 128 >= D for D <= 128; looped below
  // otherwise).
  if (D <= NW * 32) {
    float q = load_norm_rope(src + (size_t)i * src_stride + q_off + h * D, qw, eps, cs + (size_t)i * rot, rot,
                             D, qs, scratch);
    __syncthreads();
    if (threadIdx.x < D) qs[threadIdx.x] = q * scale;
  } else {
    // D = 256: two passes of 128 threads would need the norm over all D; do it directly.
    const bf16* qr = src + (size_t)i * src_stride + q_off + h * D;
    float ss = 0.f;
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
      float x = __bfloat162float(qr[e]);
      ss += x * x;
    }
    float inv = qw != nullptr ? rsqrtf(block_sum(ss, scratch) / D + eps) : 1.f;
    __syncthreads();
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
      float x = __bfloat162float(qr[e]);
      qs[e] = qw != nullptr ? round_bf16(x * inv * __bfloat162float(qw[e])) : x;
    }
    __syncthreads();
    constexpr int R = D / (NW * 32) > 0 ? D / (NW * 32) : 1;
    float r[R];
    const bf16* c = cs + (size_t)i * rot;
    const int half = rot / 2;
#pragma unroll
    for (int t = 0; t < R; ++t) {
      int e = threadIdx.x + t * NW * 32;
      float x = qs[e];
      if (e < half) x = qs[e] * __bfloat162float(c[e]) - qs[e + half] * __bfloat162float(c[half + e]);
      else if (e < rot) x = qs[e] * __bfloat162float(c[e - half]) + qs[e - half] * __bfloat162float(c[e]);
      r[t] = x;
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < R; ++t) qs[threadIdx.x + t * NW * 32] = r[t] * scale;
  }
  __syncthreads();

  float qv[E];
#pragma unroll
  for (int t = 0; t < E; ++t) qv[t] = qs[lane * E + t];

  const int g = h / rep;
  const bf16* kbase = kv + (size_t)g * cap * D;
  const bf16* vbase = kv + ((size_t)kvh * cap + (size_t)g * cap) * D;
  int j0 = s * chunk;
  int j1 = min(kv_len, j0 + chunk);
  if (causal) j1 = min(j1, pos + 1);
  if (window > 0) j0 = max(j0, pos - window + 1);

  float m = -INFINITY, l = 0.f, acc[E];
#pragma unroll
  for (int t = 0; t < E; ++t) acc[t] = 0.f;

  for (int jb = j0 + warp * 4; jb < j1; jb += NW * 4) {
    float sc[4];
    float vv[4][E];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = jb + u;
      float dot = 0.f;
      if (j < j1) {
        const bf16* kr = kbase + (size_t)j * D + lane * E;
        const bf16* vr = vbase + (size_t)j * D + lane * E;
#pragma unroll
        for (int t = 0; t < E; ++t) {
          dot = fmaf(qv[t], __bfloat162float(kr[t]), dot);
          vv[u][t] = __bfloat162float(vr[t]);
        }
      } else {
#pragma unroll
        for (int t = 0; t < E; ++t) vv[u][t] = 0.f;
      }
      sc[u] = dot;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      sc[u] = warp_sum(sc[u]);
      if (jb + u >= j1) sc[u] = -INFINITY;
    }
    float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
    float mn = fmaxf(m, mx);  // finite: key jb < j1 is visible
    float corr = __expf(m - mn);
    l *= corr;
#pragma unroll
    for (int t = 0; t < E; ++t) acc[t] *= corr;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      float p = __expf(sc[u] - mn);
      l += p;
#pragma unroll
      for (int t = 0; t < E; ++t) acc[t] = fmaf(p, vv[u][t], acc[t]);
    }
    m = mn;
  }

  // Merge the warps.
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
#pragma unroll
  for (int t = 0; t < E; ++t) wacc[warp][lane * E + t] = acc[t];
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < NW; ++w) M = fmaxf(M, wm[w]);
  float L = 0.f;
  float f[NW];
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    f[w] = wm[w] == -INFINITY ? 0.f : __expf(wm[w] - M);
    L += wl[w] * f[w];
  }
  const size_t pidx = ((size_t)h * n + i) * splits + s;
  for (int e = threadIdx.x; e < D; e += blockDim.x) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) a += wacc[w][e] * f[w];
    if (splits == 1) {
      out[(size_t)i * heads * D + (size_t)h * D + e] = __float2bfloat16(L > 0.f ? a / L : 0.f);
    } else {
      part[pidx * (D + 2) + 2 + e] = a;
    }
  }
  if (splits > 1 && threadIdx.x == 0) {
    part[pidx * (D + 2)] = M;
    part[pidx * (D + 2) + 1] = L;
  }
}

#define ATTN(D)                                                                                          \
  extern "C" __global__ void __launch_bounds__(128) attn_bf16_d##D(                                       \
      const bf16* src, int src_stride, int q_off, const bf16* qw, float eps, const bf16* cs, int rot,        \
      float scale, const bf16* kv, int kvh, long long cap, int kv_len, int rep, int q_pos0, int causal,   \
      int window, int chunk, bf16* out, float* part) {                                                    \
    attn_block<D>(src, src_stride, q_off, qw, eps, cs, rot, scale, kv, kvh, cap, kv_len, rep, q_pos0,     \
                  causal, window, chunk, out, part);                                                      \
  }
ATTN(64)
ATTN(128)
ATTN(256)

// Merge the splits of attn: grid (heads, n), block d threads (rounded up to a warp).
extern "C" __global__ void attn_combine_bf16(const float* __restrict__ part, bf16* __restrict__ out, int splits,
                                             int d) {
  const int h = blockIdx.x, i = blockIdx.y, heads = gridDim.x, n = gridDim.y;
  const int e = threadIdx.x;
  const float* p = part + ((size_t)h * n + i) * splits * (d + 2);
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, p[s * (d + 2)]);
  float L = 0.f, a = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float ms = p[s * (d + 2)];
    if (ms == -INFINITY) continue;
    const float f = __expf(ms - M);
    L += p[s * (d + 2) + 1] * f;
    if (e < d) a += p[s * (d + 2) + 2 + e] * f;
  }
  if (e < d) out[(size_t)i * heads * d + (size_t)h * d + e] = __float2bfloat16(L > 0.f ? a / L : 0.f);
}

// A single-thread busy wait of `cycles` SM clocks: the micro bench queues a step behind it to
// time the step's kernels with the host out of the way (nn::cuda::gpu_time_host_ahead).
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

