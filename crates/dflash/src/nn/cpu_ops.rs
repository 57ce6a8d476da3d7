//! The small f32 pieces between the CPU products, in own loops: residual add + RMSNorm and
//! SwiGLU (`nn::fused` picks them for f32 tensors on the CPU, as it picks the CUDA kernels
//! there), and the pool helper the CPU rope shares.
//!
//! Why: through candle each of these is several ops (an add, a norm; a strided SiLU, a strided
//! product), each allocating and walking its tensor once on the calling thread while the
//! barrier pool's worker spins, and candle sends a norm of more than 32 rows to rayon's pool,
//! whose threads then fight that spinning worker for the cores. Here each is one pass, split
//! over the barrier pool when it is large enough to pay for the dispatch.
//!
//! Bits: every value is computed by the same expression, in the same order, as candle's op
//! (`rms_norm`'s sequential sum of squares and `x / m * w`; `silu(g) = g / (1 + exp(-g))` then
//! `* u`), so the results equal the portable path bit for bit (unit tests below), and a row
//! does not depend on the rows beside it.

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
struct Out(*mut f32);
unsafe impl Sync for Out {}
impl Out {
    /// # Safety
    /// `[at, at + len)` is inside the buffer and no other item writes it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn span(&self, at: usize, len: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
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
    let (mut s, mut o) = (vec![0f32; len], vec![0f32; len]);
    let (sp, op) = (Out(s.as_mut_ptr()), Out(o.as_mut_ptr()));
    for_items(len / n, n, |i| {
        let span = i * n..(i + 1) * n;
        // SAFETY: row i's span, written by this item only.
        let (si, oi) = unsafe { (sp.span(i * n, n), op.span(i * n, n)) };
        for ((x, &a), &b) in si.iter_mut().zip(&r[span.clone()]).zip(&d[span]) {
            *x = a + b;
        }
        rms_row(si, wv, eps, oi);
    });
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
    let mut o = vec![0f32; len];
    let op = Out(o.as_mut_ptr());
    for_items(len / n, n, |i| {
        // SAFETY: row i's span, written by this item only.
        rms_row(&xv[i * n..(i + 1) * n], wv, eps, unsafe {
            op.span(i * n, n)
        });
    });
    Ok(Some(Tensor::from_vec(o, x.shape().clone(), &Device::Cpu)?))
}

/// `silu(gate) * up` of a stacked gate/up output `[.., 2I]` -> `[.., I]` for f32 on the CPU.
pub fn swiglu(gu: &Tensor) -> Result<Option<Tensor>> {
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
    let mut o = vec![0f32; rows * i];
    let op = Out(o.as_mut_ptr());
    // items of at most 512 values, so one row of a wide MLP splits too
    let per_row = i.div_ceil(512);
    let chunk = i.div_ceil(per_row);
    for_items(rows * per_row, chunk, |item| {
        let (r, c) = (item / per_row, item % per_row * chunk);
        if c >= i {
            return;
        }
        let len = chunk.min(i - c);
        let row = &v[r * two_i..(r + 1) * two_i];
        let (g, u) = (&row[c..c + len], &row[i + c..i + c + len]);
        // SAFETY: this item's span of row r, written by it only.
        let out = unsafe { op.span(r * i + c, len) };
        for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    });
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

    /// SwiGLU equals candle's `silu(gate) * up` on the narrowed halves bit for bit, for one row,
    /// a verify block and a prompt (on the pool), and rows alone equal rows among others.
    #[test]
    fn swiglu_equals_candles_ops() {
        let dev = Device::Cpu;
        for (rows, i) in [(1, 1536), (16, 1536), (200, 640), (5, 100)] {
            let gu = (Tensor::randn(0f32, 1.0, (rows, 2 * i), &dev).unwrap() * 4.0).unwrap();
            let ours = swiglu(&gu).unwrap().unwrap();
            let g = gu.narrow(1, 0, i).unwrap();
            let u = gu.narrow(1, i, i).unwrap();
            let theirs = (candle_nn::ops::silu(&g).unwrap() * u).unwrap();
            assert_eq!(bits(&ours), bits(&theirs), "{rows} x {i}");
            let alone = swiglu(&gu.narrow(0, rows - 1, 1).unwrap().contiguous().unwrap())
                .unwrap()
                .unwrap();
            assert_eq!(bits(&alone), bits(&ours.narrow(0, rows - 1, 1).unwrap()));
        }
        let odd = Tensor::zeros((2, 7), DType::F32, &dev).unwrap();
        assert!(swiglu(&odd).unwrap().is_none());
    }
}
