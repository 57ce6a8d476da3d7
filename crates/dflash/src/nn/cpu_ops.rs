//! The f32 work between and beside the CPU's int8 products, on candle's barrier pool and never
//! on rayon's: residual add + RMSNorm, RMSNorm and the gated activations (SwiGLU, GeGLU), which
//! `nn::fused` picks for f32 tensors on the CPU as it picks the CUDA kernels there; dense f32
//! products (`matmul_t`, from `Linear::forward`); the exp they and the CPU attention's softmax
//! share ([`glu`]); and the pool helper the CPU rope uses.
//!
//! Why: through candle each small piece is several ops (an add, a norm; a strided SiLU, a
//! strided product), each allocating and walking its tensor on the calling thread while the
//! barrier pool's worker spins, and candle sends norms of more than 32 rows, ropes of more than
//! one position and every f32 GEMM to rayon's pool, whose threads then fight that spinning
//! worker for the cores (on two cores, 19% of a verify block's samples were the worker
//! spinning; docs/perf.md, session 35). Here each piece is one pass, split over the barrier
//! pool when it is large enough to pay for the dispatch.
//!
//! Bits: the norms compute every value by candle's expressions in candle's order (the
//! sequential sum of squares, `x / m * w`), so they equal the portable path bit for bit. The
//! activations use an own vectorized exp, the same bits on the scalar, AVX2 and AVX-512 paths
//! and within a few ulp of f64 (not libm's). Every row's result here is independent of the
//! rows beside it, except `matmul_t`'s (gemm's, like candle's product, is not row-invariant).

use super::mlp::Activation;
use crate::Result;
use candle_core::{DType, Device, Layout, Storage, Tensor};

/// Below this many values a piece runs on the calling thread: the pool's dispatch would cost
/// more than the split saves.
const INLINE_MAX: usize = 1 << 13;

/// Run `f` over `0 .. items` (each item `per_item` values of work): inline when small, else
/// split over candle's barrier pool (never rayon's).
pub(crate) fn for_items(items: usize, per_item: usize, f: impl Fn(usize) + Sync) {
    if items <= 1 || items * per_item <= INLINE_MAX {
        (0..items).for_each(f);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(items, |r| r.for_each(&f));
    }
}

/// An output buffer written by several pool threads, each item its own disjoint span.
pub(crate) struct Out(*mut f32);
unsafe impl Sync for Out {}

/// `N` buffers of `len` values, each value written once by `fill` (through the [`Out`]s, from
/// any pool thread) and never read first: no zeroing pass.
///
/// # Safety
/// `fill` writes every one of the `len` values of every buffer.
pub(crate) unsafe fn written<const N: usize>(
    len: usize,
    fill: impl FnOnce([&Out; N]),
) -> [Vec<f32>; N] {
    let mut v: [Vec<f32>; N] = std::array::from_fn(|_| Vec::with_capacity(len));
    let outs: [Out; N] = std::array::from_fn(|i| Out(v[i].as_mut_ptr()));
    fill(std::array::from_fn(|i| &outs[i]));
    for b in &mut v {
        // SAFETY: the caller's contract (every value written)
        b.set_len(len);
    }
    v
}

impl Out {
    /// # Safety
    /// `[at, at + len)` is inside the buffer and no other item writes it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn span(&self, at: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }

    /// # Safety
    /// `at` is inside the buffer.
    unsafe fn at(&self, at: usize) -> *mut f32 {
        self.0.add(at)
    }
}

/// Whether `t` is a contiguous f32 CPU tensor outside autograd (what these loops take).
fn plain_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous() && !t.track_op()
}

/// The values of a tensor [`plain_f32`] accepted.
fn values<'a>(s: &'a Storage, l: &Layout, len: usize) -> Result<&'a [f32]> {
    match s {
        Storage::Cpu(c) => Ok(&c.as_slice::<f32>()?[l.start_offset()..l.start_offset() + len]),
        _ => Err(crate::Error::input("cpu ops: a tensor left the CPU")),
    }
}

/// One row of candle's `rms_norm`: the same expressions in the same order.
#[inline]
fn rms_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum2 = x.iter().map(|&v| v * v).sum::<f32>();
    let m = (sum2 / x.len() as f32 + eps).sqrt();
    for ((o, &v), &a) in out.iter_mut().zip(x).zip(w) {
        *o = v / m * a;
    }
}

/// `(res + delta, rms_norm(res + delta) * w)` over the last dim for f32 on the CPU; None where
/// it does not apply (another device or dtype, shapes that differ, autograd).
pub fn add_rms_norm(
    res: &Tensor,
    delta: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<Option<(Tensor, Tensor)>> {
    if res.dims() != delta.dims() || res.rank() == 0 {
        return Ok(None);
    }
    let n = res.dim(candle_core::D::Minus1)?;
    if w.dims() != [n] || n == 0 {
        return Ok(None);
    }
    if ![res, delta, w].into_iter().all(plain_f32) {
        return Ok(None);
    }
    let len = res.elem_count();
    let (rs, rl) = res.storage_and_layout();
    let (ds, dl) = delta.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (r, d, wv) = (
        values(&rs, rl, len)?,
        values(&ds, dl, len)?,
        values(&ws, wl, n)?,
    );
    // SAFETY: the rows 0 .. len / n cover both buffers
    let [s, o] = unsafe {
        written(len, |[sp, op]| {
            for_items(len / n, n, |i| {
                let span = i * n..(i + 1) * n;
                // SAFETY: row i's span, written by this item only.
                let (si, oi) = (sp.span(i * n, n), op.span(i * n, n));
                for ((x, &a), &b) in si.iter_mut().zip(&r[span.clone()]).zip(&d[span]) {
                    *x = a + b;
                }
                rms_row(si, wv, eps, oi);
            })
        })
    };
    let shape = res.shape().clone();
    Ok(Some((
        Tensor::from_vec(s, shape.clone(), &Device::Cpu)?,
        Tensor::from_vec(o, shape, &Device::Cpu)?,
    )))
}

/// `rms_norm(x) * w` over the last dim for f32 on the CPU (None where it does not apply).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Option<Tensor>> {
    let Some(&n) = x.dims().last() else {
        return Ok(None);
    };
    if w.dims() != [n] || n == 0 || ![x, w].into_iter().all(plain_f32) {
        return Ok(None);
    }
    let len = x.elem_count();
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (xv, wv) = (values(&xs, xl, len)?, values(&ws, wl, n)?);
    // SAFETY: the rows 0 .. len / n cover the buffer
    let [o] = unsafe {
        written(len, |[op]| {
            for_items(len / n, n, |i| {
                // SAFETY: row i's span, written by this item only.
                rms_row(&xv[i * n..(i + 1) * n], wv, eps, op.span(i * n, n));
            })
        })
    };
    Ok(Some(Tensor::from_vec(o, x.shape().clone(), &Device::Cpu)?))
}

/// Columns of a product each pool item computes (at least; the last takes the rest).
const MATMUL_COLS: usize = 64;

/// `x [.., k] @ w^T` for a dense f32 weight `w [n, k]` on the CPU, with gemm (candle's f32
/// GEMM) run single-threaded on column ranges split over the barrier pool, never on rayon's
/// pool (candle's matmul would, beside the barrier pool's spinning worker). The split depends
/// on `w` alone (`n`, and the pool's size), so every call of a weight, one row or many, takes
/// the same column ranges. None where it does not apply (another device or dtype, a
/// non-contiguous operand, autograd).
pub fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    if w.rank() != 2 || ![x, w].into_iter().all(plain_f32) {
        return Ok(None);
    }
    let (n, k) = w.dims2()?;
    if x.dims().last() != Some(&k) || n == 0 || k == 0 {
        return Ok(None);
    }
    let m = x.elem_count() / k;
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank >= 1") = n;
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (xv, wv) = (values(&xs, xl, m * k)?, values(&ws, wl, n * k)?);
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    // ranges of whole MATMUL_COLS blocks, a few per thread (balance), none empty
    let blocks = n.div_ceil(MATMUL_COLS);
    let parts = blocks.min(4 * threads).max(1);
    let per = blocks.div_ceil(parts) * MATMUL_COLS;
    let parts = n.div_ceil(per);
    let run = |op: &Out, p: usize| {
        let (a, len) = (p * per, per.min(n - p * per));
        // SAFETY: columns a..a + len of every row of `o` (m x n), written by this part only;
        // x is m x k and w's rows a..a + len are k long, as the strides say.
        unsafe {
            gemm::gemm(
                m,
                len,
                k,
                op.at(a),
                1,
                n as isize,
                false,
                xv.as_ptr(),
                1,
                k as isize,
                wv.as_ptr().add(a * k),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    };
    // SAFETY: the parts cover columns 0..n of rows 0..m.
    let [o] = unsafe {
        written(m * n, |[op]| {
            if m == 0 || parts == 1 {
                (0..parts).for_each(|p| run(op, p));
            } else {
                candle_core::utils::barrier_pool()
                    .execute_chunked(parts, |r| r.for_each(|p| run(op, p)));
            }
        })
    };
    Ok(Some(Tensor::from_vec(o, dims, &Device::Cpu)?))
}

/// `act(gate) * up` of a stacked gate/up output `[.., 2I]` -> `[.., I]` for f32 on the CPU,
/// with a vectorized exp ([`glu`]: within a few ulp of the f64 value; not candle's libm bits).
pub fn gated(gu: &Tensor, act: Activation) -> Result<Option<Tensor>> {
    let Some(&two_i) = gu.dims().last() else {
        return Ok(None);
    };
    if two_i % 2 != 0 || two_i == 0 {
        return Ok(None);
    }
    let i = two_i / 2;
    let mut dims = gu.dims().to_vec();
    *dims.last_mut().expect("rank >= 1") = i;
    if !plain_f32(gu) {
        return Ok(None);
    }
    let (gs, gl) = gu.storage_and_layout();
    let v = values(&gs, gl, gu.elem_count())?;
    let rows = v.len() / two_i;
    let simd = super::q8::simd_level();
    // items of at most 512 values, so one row of a wide MLP splits too
    let per_row = i.div_ceil(512);
    let chunk = i.div_ceil(per_row);
    // SAFETY: the items cover every row's i values (per_row * chunk >= i)
    let [o] = unsafe {
        written(rows * i, |[op]| {
            for_items(rows * per_row, chunk, |item| {
                let (r, c) = (item / per_row, item % per_row * chunk);
                if c >= i {
                    return;
                }
                let len = chunk.min(i - c);
                let row = &v[r * two_i..(r + 1) * two_i];
                let (g, u) = (&row[c..c + len], &row[i + c..i + c + len]);
                // SAFETY: this item's span of row r, written by it only.
                glu::act_mul(simd, act, g, u, op.span(r * i + c, len));
            })
        })
    };
    Ok(Some(Tensor::from_vec(o, dims, &Device::Cpu)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// Residual add + RMSNorm (and the norm alone) equal candle's add then `rms_norm` bit for
    /// bit, inline and on the pool (a prompt's rows), and a row alone equals the row among
    /// others.
    #[test]
    fn add_rms_norm_equals_candles_ops() {
        let dev = Device::Cpu;
        for (rows, n) in [(1, 576), (16, 576), (40, 576), (300, 640), (3, 64)] {
            let res = (Tensor::randn(0f32, 3.0, (rows, n), &dev).unwrap() * 10.0).unwrap();
            let delta = Tensor::randn(0f32, 1.0, (rows, n), &dev).unwrap();
            let w = Tensor::randn(1f32, 0.3, n, &dev).unwrap();
            let (s, o) = add_rms_norm(&res, &delta, &w, 1e-5).unwrap().unwrap();
            let s_ref = (&res + &delta).unwrap();
            let o_ref = candle_nn::ops::rms_norm(&s_ref, &w, 1e-5).unwrap();
            assert_eq!(bits(&s), bits(&s_ref), "sum, {rows} x {n}");
            assert_eq!(bits(&o), bits(&o_ref), "norm, {rows} x {n}");
            let last = rows - 1;
            let (_, alone) = add_rms_norm(
                &res.narrow(0, last, 1).unwrap().contiguous().unwrap(),
                &delta.narrow(0, last, 1).unwrap().contiguous().unwrap(),
                &w,
                1e-5,
            )
            .unwrap()
            .unwrap();
            assert_eq!(bits(&alone), bits(&o.narrow(0, last, 1).unwrap()));
        }
        let x = Tensor::randn(0f32, 2.0, (300, 576), &dev).unwrap();
        let w = Tensor::randn(1f32, 0.3, 576, &dev).unwrap();
        let o = rms_norm(&x, &w, 1e-6).unwrap().unwrap();
        assert_eq!(
            bits(&o),
            bits(&candle_nn::ops::rms_norm(&x, &w, 1e-6).unwrap())
        );
        // 3-dim input, and the declines: another dtype, mismatched shapes
        let x = Tensor::randn(0f32, 1.0, (2, 5, 64), &dev).unwrap();
        let w = Tensor::ones(64, DType::F32, &dev).unwrap();
        let (_, o) = add_rms_norm(&x, &x, &w, 1e-6).unwrap().unwrap();
        let o_ref = candle_nn::ops::rms_norm(&(&x + &x).unwrap(), &w, 1e-6).unwrap();
        assert_eq!(bits(&o), bits(&o_ref));
        let xb = x.to_dtype(DType::BF16).unwrap();
        assert!(add_rms_norm(&xb, &xb, &w, 1e-6).unwrap().is_none());
        assert!(add_rms_norm(&x, &x.narrow(1, 0, 4).unwrap(), &w, 1e-6)
            .unwrap()
            .is_none());
    }

    /// The pool-split product equals candle's matmul within float error and repeats its bits
    /// call after call (gemm, like candle's product, is not row-invariant: a row alone and
    /// among 16 may differ in the last bits, as with candle's own matmul).
    #[test]
    fn matmul_t_matches_candle() {
        let dev = Device::Cpu;
        for (m, n, k) in [
            (1, 576, 576),
            (16, 1536, 576),
            (16, 49152, 64),
            (7, 100, 30),
            (300, 640, 576),
        ] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let w = Tensor::randn(0f32, 0.1, (n, k), &dev).unwrap();
            let ours = matmul_t(&x, &w).unwrap().unwrap();
            let theirs = x.matmul(&w.t().unwrap()).unwrap();
            let d = crate::testing::max_abs_diff(&ours, &theirs);
            assert!(d < 1e-4, "{m}x{n}x{k}: {d}");
            assert_eq!(
                bits(&ours),
                bits(&matmul_t(&x, &w).unwrap().unwrap()),
                "{m}x{n}x{k} again"
            );
        }
        let x3 = Tensor::randn(0f32, 1.0, (2, 3, 64), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (128, 64), &dev).unwrap();
        assert_eq!(matmul_t(&x3, &w).unwrap().unwrap().dims(), [2, 3, 128]);
        assert!(matmul_t(&x3, &w.t().unwrap()).unwrap().is_none());
    }

    /// SwiGLU and GeGLU equal candle's `act(gate) * up` within float error, for one row, a
    /// verify block and a prompt (on the pool); rows alone equal rows among others.
    #[test]
    fn gated_matches_candles_ops() {
        let dev = Device::Cpu;
        for act in [Activation::Silu, Activation::GeluTanh] {
            for (rows, i) in [(1, 1536), (16, 2048), (200, 640), (5, 100)] {
                let gu = (Tensor::randn(0f32, 1.0, (rows, 2 * i), &dev).unwrap() * 4.0).unwrap();
                let ours = gated(&gu, act).unwrap().unwrap();
                let g = gu.narrow(1, 0, i).unwrap();
                let u = gu.narrow(1, i, i).unwrap();
                let theirs = (act.apply(&g).unwrap() * u).unwrap();
                let d = crate::testing::max_abs_diff(&ours, &theirs);
                // |g u| reaches ~16^2 here; a few ulp of that
                assert!(d < 1e-4, "{act:?} {rows} x {i}: {d}");
                let last = gu.narrow(0, rows - 1, 1).unwrap().contiguous().unwrap();
                let alone = gated(&last, act).unwrap().unwrap();
                assert_eq!(bits(&alone), bits(&ours.narrow(0, rows - 1, 1).unwrap()));
            }
        }
        let odd = Tensor::zeros((2, 7), DType::F32, &dev).unwrap();
        assert!(gated(&odd, Activation::Silu).unwrap().is_none());
    }
}

/// The gated activations times the up projection, `act(g) * u`, vectorized, both as
/// `g / (1 + exp(x))`: SiLU with `x = -g`, the tanh GELU with `x = -2z` (the exact rewrite of
/// `0.5 g (1 + tanh z)`, without its cancellation where `tanh z` is near -1). candle computes
/// them one value at a time with libm (`expf`; `tanhf`, an `expm1f` inside), which was ~6% of
/// a SmolLM2 verify block's thread time and ~14% of a Gemma prompt's on two cores. exp here is
/// a Cody-Waite reduction with a degree-7 polynomial, every step one IEEE operation (fma where
/// written), so the scalar reference and the AVX2 / AVX-512 forms give the same bits and a row
/// does not depend on the rows beside it. Error: within a few ulp of the f64 value plus what
/// exp makes of its argument's own f32 rounding (tested).
pub(crate) mod glu {
    use crate::nn::mlp::Activation;
    use crate::nn::q8::Simd;

    /// `-2 sqrt(2 / pi)`, and the cubic term's coefficient.
    #[allow(clippy::excessive_precision)]
    const K1: f32 = -1.595_769_121_605_730_7;
    const K3: f32 = 0.044715;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    #[allow(clippy::excessive_precision)]
    const LN2_HI: f32 = 0.693_359_375;
    const LN2_LO: f32 = -2.121_944_4e-4;
    /// exp's argument is clamped here: below, `2^n` stays a normal f32 and the positive tail
    /// comes out as `g`; above, n reaches 128 from x ~ 88.4 on, whose `2^n` bits are +inf, so
    /// the far negative tail is `g / inf = -0` (the exact value is below 1e-37 |g|).
    const LO: f32 = -87.0;
    const HI: f32 = 89.0;
    const C: [f32; 6] = [
        1.0 / 5040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
    ];

    /// The reference: one value (`GELU`: the tanh GELU, else SiLU).
    #[inline(always)]
    pub(crate) fn act_one<const GELU: bool>(g: f32) -> f32 {
        let x = if GELU {
            K1 * g * (g * g).mul_add(K3, 1.0)
        } else {
            -g
        };
        g / (1.0 + exp_one(x))
    }

    /// `exp(x)`, the reference of the vector forms (`x86::exp8`, `x86::exp16`): x clamped to
    /// [-87, 89] (below: a normal result; above: +inf from x ~ 88.4), then the reduction and
    /// polynomial, each step one IEEE operation.
    #[inline(always)]
    pub(crate) fn exp_one(x: f32) -> f32 {
        // not `clamp`: a NaN becomes LO here as in the SIMD forms' max / min
        #[allow(clippy::manual_clamp)]
        let x = x.max(LO).min(HI);
        let n = (x * LOG2E).round_ties_even();
        let r = n.mul_add(-LN2_HI, x);
        let r = n.mul_add(-LN2_LO, r);
        let mut p = C[0];
        for c in &C[1..] {
            p = p.mul_add(r, *c);
        }
        let p = p.mul_add(r, 1.0).mul_add(r, 1.0);
        p * f32::from_bits(((n as i32 + 127) as u32) << 23)
    }

    /// `out[i] = act(g[i]) * u[i]` on the given path (every path gives the same bits).
    pub(crate) fn act_mul(simd: Simd, act: Activation, g: &[f32], u: &[f32], out: &mut [f32]) {
        match act {
            Activation::Silu => run::<false>(simd, g, u, out),
            Activation::GeluTanh => run::<true>(simd, g, u, out),
        }
    }

    fn run<const GELU: bool>(simd: Simd, g: &[f32], u: &[f32], out: &mut [f32]) {
        let done = match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level is one the CPU has (q8::simd_level / simd_levels).
            Simd::Avx512 => unsafe { x86::act_mul_avx512::<GELU>(g, u, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Simd::Avx2 => unsafe { x86::act_mul_avx2::<GELU>(g, u, out) },
            _ => 0,
        };
        for ((o, &g), &u) in out[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
            *o = act_one::<GELU>(g) * u;
        }
    }

    /// `out[i] = exp((x[i] - m) / t)` where `x[i]` is finite, else 0 ([`exp_one`]'s bits on
    /// every path): sampling's weights at temperature `t` (libm's `expf` one value at a time was
    /// most of a 49,152-token row's ~0.2 ms).
    pub(crate) fn exp_weights(simd: Simd, x: &[f32], m: f32, t: f32, out: &mut [f32]) {
        let done = match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level is one the CPU has (q8::simd_level / simd_levels).
            Simd::Avx512 => unsafe { x86::exp_weights_avx512(x, m, t, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Simd::Avx2 => unsafe { x86::exp_weights_avx2(x, m, t, out) },
            _ => 0,
        };
        for (o, &v) in out[done..].iter_mut().zip(&x[done..]) {
            *o = match v.is_finite() {
                true => exp_one((v - m) / t),
                false => 0.0,
            };
        }
    }

    #[cfg(target_arch = "x86_64")]
    pub(crate) mod x86 {
        use super::*;
        use std::arch::x86_64::*;

        /// The values `0 .. k` (whole registers) of [`super::exp_weights`] with AVX-512;
        /// returns k.
        ///
        /// # Safety
        /// AVX-512 F and FMA.
        #[target_feature(enable = "avx512f,fma")]
        pub unsafe fn exp_weights_avx512(x: &[f32], m: f32, t: f32, out: &mut [f32]) -> usize {
            let n = x.len().min(out.len()) / 16 * 16;
            let (mv, tv) = (_mm512_set1_ps(m), _mm512_set1_ps(t));
            let inf = _mm512_set1_ps(f32::INFINITY);
            for i in (0..n).step_by(16) {
                let v = _mm512_loadu_ps(x.as_ptr().add(i));
                let e = exp16(_mm512_div_ps(_mm512_sub_ps(v, mv), tv));
                let finite = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(v), inf);
                let e = _mm512_maskz_mov_ps(finite, e);
                _mm512_storeu_ps(out.as_mut_ptr().add(i), e);
            }
            n
        }

        /// [`exp_weights_avx512`] with AVX2 + FMA (8 lanes).
        ///
        /// # Safety
        /// AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn exp_weights_avx2(x: &[f32], m: f32, t: f32, out: &mut [f32]) -> usize {
            let n = x.len().min(out.len()) / 8 * 8;
            let (mv, tv) = (_mm256_set1_ps(m), _mm256_set1_ps(t));
            let inf = _mm256_set1_ps(f32::INFINITY);
            let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            for i in (0..n).step_by(8) {
                let v = _mm256_loadu_ps(x.as_ptr().add(i));
                let e = exp8(_mm256_div_ps(_mm256_sub_ps(v, mv), tv));
                let finite = _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_and_ps(v, abs), inf);
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_and_ps(e, finite));
            }
            n
        }

        /// [`super::exp_one`] on 16 lanes.
        ///
        /// # Safety
        /// AVX-512 F and FMA.
        #[inline]
        #[target_feature(enable = "avx512f,fma")]
        pub unsafe fn exp16(x: __m512) -> __m512 {
            let s = |v: f32| _mm512_set1_ps(v);
            let x = _mm512_min_ps(_mm512_max_ps(x, s(LO)), s(HI));
            let nf = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(x, s(LOG2E)),
            );
            let r = _mm512_fmadd_ps(nf, s(-LN2_HI), x);
            let r = _mm512_fmadd_ps(nf, s(-LN2_LO), r);
            let mut p = s(C[0]);
            for c in &C[1..] {
                p = _mm512_fmadd_ps(p, r, s(*c));
            }
            let p = _mm512_fmadd_ps(_mm512_fmadd_ps(p, r, s(1.0)), r, s(1.0));
            let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(nf),
                _mm512_set1_epi32(127),
            ));
            _mm512_mul_ps(p, _mm512_castsi512_ps(bits))
        }

        /// [`super::exp_one`] on 8 lanes.
        ///
        /// # Safety
        /// AVX2 and FMA.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn exp8(x: __m256) -> __m256 {
            let s = |v: f32| _mm256_set1_ps(v);
            let x = _mm256_min_ps(_mm256_max_ps(x, s(LO)), s(HI));
            let nf = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, s(LOG2E)),
            );
            let r = _mm256_fmadd_ps(nf, s(-LN2_HI), x);
            let r = _mm256_fmadd_ps(nf, s(-LN2_LO), r);
            let mut p = s(C[0]);
            for c in &C[1..] {
                p = _mm256_fmadd_ps(p, r, s(*c));
            }
            let p = _mm256_fmadd_ps(_mm256_fmadd_ps(p, r, s(1.0)), r, s(1.0));
            let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(nf),
                _mm256_set1_epi32(127),
            ));
            _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
        }

        /// The values `0 .. k` (whole registers) of [`super::act_mul`] with AVX-512; returns k.
        ///
        /// # Safety
        /// AVX-512 F and FMA.
        #[target_feature(enable = "avx512f,fma")]
        pub unsafe fn act_mul_avx512<const GELU: bool>(
            g: &[f32],
            u: &[f32],
            out: &mut [f32],
        ) -> usize {
            let n = g.len().min(u.len()).min(out.len()) / 16 * 16;
            let s = |v: f32| _mm512_set1_ps(v);
            for i in (0..n).step_by(16) {
                let gv = _mm512_loadu_ps(g.as_ptr().add(i));
                let x = if GELU {
                    let t = _mm512_fmadd_ps(_mm512_mul_ps(gv, gv), s(K3), s(1.0));
                    _mm512_mul_ps(_mm512_mul_ps(s(K1), gv), t)
                } else {
                    _mm512_xor_ps(gv, s(-0.0))
                };
                let e = exp16(x);
                let y = _mm512_div_ps(gv, _mm512_add_ps(s(1.0), e));
                let y = _mm512_mul_ps(y, _mm512_loadu_ps(u.as_ptr().add(i)));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), y);
            }
            n
        }

        /// [`act_mul_avx512`] with AVX2 + FMA (8 lanes).
        ///
        /// # Safety
        /// AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn act_mul_avx2<const GELU: bool>(
            g: &[f32],
            u: &[f32],
            out: &mut [f32],
        ) -> usize {
            let n = g.len().min(u.len()).min(out.len()) / 8 * 8;
            let s = |v: f32| _mm256_set1_ps(v);
            for i in (0..n).step_by(8) {
                let gv = _mm256_loadu_ps(g.as_ptr().add(i));
                let x = if GELU {
                    let t = _mm256_fmadd_ps(_mm256_mul_ps(gv, gv), s(K3), s(1.0));
                    _mm256_mul_ps(_mm256_mul_ps(s(K1), gv), t)
                } else {
                    _mm256_xor_ps(gv, s(-0.0))
                };
                let e = exp8(x);
                let y = _mm256_div_ps(gv, _mm256_add_ps(s(1.0), e));
                let y = _mm256_mul_ps(y, _mm256_loadu_ps(u.as_ptr().add(i)));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), y);
            }
            n
        }
    }
}

/// Greedy choice over a row: the largest value's index, the lowest among equal ones, NaNs never
/// chosen, 0 when no value beats -inf (`sampling::argmax`'s rule). Vectorized as the row's max
/// (a lane takes a value only when it is greater, so NaNs stay out) and then the first
/// position holding it: one value at a time it was ~40 us a 49,152-token row on this CPU, 0.64
/// ms of a 16-row verify (candle's argmax the same).
pub(crate) mod argmax {
    use crate::nn::q8::Simd;

    /// The row's largest value, NaNs skipped (-inf when none is larger).
    pub(crate) fn max(simd: Simd, row: &[f32]) -> f32 {
        let (m, i) = match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level is one the CPU has (q8::simd_level / simd_levels).
            Simd::Avx512 => unsafe { x86::max_avx512(row) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Simd::Avx2 => unsafe { x86::max_avx2(row) },
            _ => (f32::NEG_INFINITY, 0),
        };
        row[i..].iter().fold(m, |m, &v| if v > m { v } else { m })
    }

    /// See the module doc.
    pub(crate) fn argmax(simd: Simd, row: &[f32]) -> u32 {
        let m = max(simd, row);
        if m <= f32::NEG_INFINITY {
            return 0;
        }
        let at = match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Simd::Avx512 => unsafe { x86::find_avx512(row, m) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Simd::Avx2 => unsafe { x86::find_avx2(row, m) },
            _ => row.iter().position(|&v| v == m),
        };
        at.unwrap_or(0) as u32
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        /// The max of whole registers of `row` (NaNs skipped) and where they end.
        ///
        /// # Safety
        /// AVX-512 F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn max_avx512(row: &[f32]) -> (f32, usize) {
            let n = row.len() / 16 * 16;
            let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
            for i in (0..n).step_by(16) {
                let v = _mm512_loadu_ps(row.as_ptr().add(i));
                let gt = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, acc);
                acc = _mm512_mask_mov_ps(acc, gt, v);
            }
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
            let m = lanes
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
            (m, n)
        }

        /// The first index holding `m` (a number), if any.
        ///
        /// # Safety
        /// AVX-512 F.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn find_avx512(row: &[f32], m: f32) -> Option<usize> {
            let n = row.len() / 16 * 16;
            let mv = _mm512_set1_ps(m);
            for i in (0..n).step_by(16) {
                let eq = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_loadu_ps(row.as_ptr().add(i)), mv);
                if eq != 0 {
                    return Some(i + eq.trailing_zeros() as usize);
                }
            }
            row[n..].iter().position(|&v| v == m).map(|j| n + j)
        }

        /// [`max_avx512`] on 8 lanes.
        ///
        /// # Safety
        /// AVX2.
        #[target_feature(enable = "avx2")]
        pub unsafe fn max_avx2(row: &[f32]) -> (f32, usize) {
            let n = row.len() / 8 * 8;
            let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
            for i in (0..n).step_by(8) {
                let v = _mm256_loadu_ps(row.as_ptr().add(i));
                let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(v, acc);
                acc = _mm256_blendv_ps(acc, v, gt);
            }
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
            let m = lanes
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
            (m, n)
        }

        /// [`find_avx512`] on 8 lanes.
        ///
        /// # Safety
        /// AVX2.
        #[target_feature(enable = "avx2")]
        pub unsafe fn find_avx2(row: &[f32], m: f32) -> Option<usize> {
            let n = row.len() / 8 * 8;
            let mv = _mm256_set1_ps(m);
            for i in (0..n).step_by(8) {
                let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_loadu_ps(row.as_ptr().add(i)), mv);
                let bits = _mm256_movemask_ps(eq);
                if bits != 0 {
                    return Some(i + bits.trailing_zeros() as usize);
                }
            }
            row[n..].iter().position(|&v| v == m).map(|j| n + j)
        }
    }

    #[cfg(test)]
    mod tests {
        use super::{argmax, max};
        use crate::nn::q8::{simd_levels, Simd};

        /// `sampling::argmax`'s rule, one value at a time (the reference).
        fn reference(row: &[f32]) -> u32 {
            let (mut best, mut bv) = (0usize, f32::NEG_INFINITY);
            for (i, &v) in row.iter().enumerate() {
                if v > bv {
                    bv = v;
                    best = i;
                }
            }
            best as u32
        }

        /// Every path picks the reference's index: ties (the first wins, +0 / -0 too), NaNs,
        /// infinities, rows of only -inf or NaN, empty rows, maxima in a register or the tail.
        #[test]
        fn every_path_picks_the_first_largest() {
            let mut rng = crate::rng::Rng::new(7);
            let mut rows: Vec<Vec<f32>> = Vec::new();
            for len in [0usize, 1, 7, 8, 15, 16, 17, 31, 100, 49_152, 49_157] {
                let r: Vec<f32> = (0..len)
                    .map(|_| (rng.uniform() as f32 * 8.0).floor())
                    .collect();
                rows.push(r.clone()); // many ties
                let mut r2 = r.clone();
                if len > 3 {
                    r2[len / 2] = f32::NAN;
                    r2[len - 1] = 100.0; // in the tail
                }
                rows.push(r2);
                let mut r3 = vec![f32::NEG_INFINITY; len];
                if len > 5 {
                    r3[5] = f32::NAN;
                }
                rows.push(r3);
                rows.push(vec![f32::NAN; len]);
                let mut r4 = vec![-0.0f32; len];
                if len > 2 {
                    r4[2] = 0.0;
                }
                rows.push(r4);
                let mut r5: Vec<f32> = (0..len).map(|_| rng.uniform() as f32 - 2.0).collect();
                if len > 10 {
                    r5[9] = f32::INFINITY;
                    r5[10] = f32::INFINITY;
                }
                rows.push(r5);
            }
            for row in &rows {
                let want = reference(row);
                let top = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                for simd in simd_levels().into_iter().chain([Simd::Scalar]) {
                    assert_eq!(argmax(simd, row), want, "{simd:?}, {} values", row.len());
                    assert_eq!(max(simd, row), top, "{simd:?}, {} values", row.len());
                }
            }
        }
    }
}

#[cfg(test)]
mod glu_tests {
    use super::glu::{act_mul, act_one, exp_weights};
    use crate::nn::mlp::Activation;
    use crate::nn::q8::{simd_levels, Simd};

    /// The exp argument each activation is `g / (1 + exp(x))` of, in f64: SiLU `-g`; the tanh
    /// GELU `-2z`, transformers' `0.5 g (1 + tanh z)` rewritten without the cancellation that
    /// makes f64's `1 + tanh z` 0 in the negative tail.
    fn argument(gelu: bool, g: f32) -> f64 {
        let g = g as f64;
        match gelu {
            true => -2.0 * (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g),
            false => -g,
        }
    }

    /// Within 8 half-ulps of the f64 value plus what exp makes of the f32 roundings of its
    /// argument x (|x| relative epsilons each: the condition of the tails), 1e-35 absolute in
    /// the far negative tail where exp ends in +inf; and every SIMD path gives the scalar
    /// reference's bits; over a dense sweep of [-30, 30], the extremes and zeros.
    #[test]
    fn activations_are_accurate_and_the_same_on_every_path() {
        let mut g: Vec<f32> = (-600_000..=600_000).map(|i| i as f32 * 5e-5).collect();
        g.extend([0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, 8.0, -8.0, 3e4, -3e4]);
        g.extend([f32::MAX, f32::MIN]);
        g.extend((0..1000).map(|i| f32::from_bits(0x3000_0000 + i * 0x9_1234)));
        let eps = f32::EPSILON as f64 / 2.0;
        for (gelu, act) in [(false, Activation::Silu), (true, Activation::GeluTanh)] {
            let mut worst = 0f64;
            for &v in &g {
                let ours = if gelu {
                    act_one::<true>(v)
                } else {
                    act_one::<false>(v)
                };
                let x = argument(gelu, v);
                let want = v as f64 / (1.0 + x.exp());
                let err = (ours as f64 - want).abs();
                let rounding = if gelu { 4.0 * x.abs() } else { 0.0 };
                let bound = (8.0 + rounding) * eps * want.abs() + 1e-35;
                assert!(err <= bound, "{act:?}({v:e}) = {ours:e}, want {want:e}");
                if v.abs() <= 4.0 && want != 0.0 {
                    worst = worst.max(err / (eps * want.abs()));
                }
            }
            eprintln!("{act:?} on [-4, 4]: at most {worst:.1} half-ulps from the f64 value");
            let u: Vec<f32> = (0..g.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
            let mut want = vec![0f32; g.len()];
            act_mul(Simd::Scalar, act, &g, &u, &mut want);
            for simd in simd_levels() {
                let mut got = vec![0f32; g.len()];
                act_mul(simd, act, &g, &u, &mut got);
                let bad = got
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(
                    bad.is_none(),
                    "{act:?} {simd:?}: differs at {:?}",
                    bad.map(|i| g[i])
                );
            }
        }
    }

    /// Sampling's weights: exp((x - m) / t) within 8 half-ulps of the f64 value (plus the
    /// argument's own rounding), exactly 0 for infinite and NaN logits, and the scalar
    /// reference's bits on every SIMD path (lengths that leave a tail included).
    #[test]
    fn exp_weights_are_accurate_and_the_same_on_every_path() {
        let mut x: Vec<f32> = (0..49_157)
            .map(|i| ((i * 7919) % 20_011) as f32 * 1e-3 - 15.0)
            .collect();
        x[3] = f32::NEG_INFINITY;
        x[40] = f32::INFINITY;
        x[41] = f32::NAN;
        x[100] = -1e30;
        let (m, t) = (5.5f32, 0.7f32);
        let mut want = vec![0f32; x.len()];
        exp_weights(Simd::Scalar, &x, m, t, &mut want);
        let eps = f32::EPSILON as f64 / 2.0;
        for (&v, &w) in x.iter().zip(&want) {
            if !v.is_finite() {
                assert_eq!(w.to_bits(), 0, "exp weight of {v}");
                continue;
            }
            let arg = ((v - m) / t) as f64;
            let exact = arg.max(-87.0).exp();
            let bound = (8.0 + 2.0 * arg.abs()) * eps * exact;
            assert!(
                (w as f64 - exact).abs() <= bound,
                "exp(({v} - {m}) / {t}) = {w:e}, want {exact:e}"
            );
        }
        for simd in simd_levels() {
            for len in [x.len(), 23] {
                let mut got = vec![1f32; len];
                exp_weights(simd, &x[..len], m, t, &mut got);
                let bad = got
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(
                    bad.is_none(),
                    "{simd:?}: differs at {:?}",
                    bad.map(|i| x[i])
                );
            }
        }
    }
}
