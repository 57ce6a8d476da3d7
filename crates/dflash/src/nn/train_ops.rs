//! Fused operations with a backward, for training (f32): the attention's masked softmax and the
//! weighted cross-entropy of the LM head's logits. Each replaces a chain of candle ops (max,
//! subtract, exp, sum, divide, and their backwards: an equality mask for the max, broadcast
//! products) that each read and write the whole `[rows, columns]` matrix; on an H100 those
//! chains were ~80% of a draft training step's GPU time (session 46's ncu, docs/perf.md). One
//! pass computes the result, one the gradient. CPU: row loops (what the tests compare with the
//! candle chain); CUDA: `kernels/train.cu`. Callers use them for f32 tensors (training) and keep
//! the candle chain for other dtypes ([`applies`]).

use crate::Result;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

/// Whether the fused training ops take these tensors (f32, on the CPU or a CUDA device).
pub fn applies(x: &Tensor) -> bool {
    x.dtype() == DType::F32 && (x.device().is_cpu() || x.device().is_cuda())
}

/// `softmax(x + mask)` over the last dim, differentiable in `x`. `x [.., n, L]` (any leading
/// dims, contiguous after this call), `mask [n, L]` additive (0 / -inf), not differentiated:
/// row `r` of `x` (flattened to `[R, L]`) takes mask row `r % n`. Without a mask, plain softmax.
pub fn masked_softmax(x: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let l = x.dim(candle_core::D::Minus1)?;
    let x = x.contiguous()?;
    let mask = match mask {
        Some(m) => m.to_dtype(DType::F32)?.contiguous()?,
        None => Tensor::zeros((1, l), DType::F32, x.device())?,
    };
    let (n, ml) = match mask.dims() {
        &[n, ml] => (n, ml),
        d => {
            return Err(crate::Error::input(format!(
                "masked softmax: mask {d:?} for scores {:?} (want [n, L])",
                x.dims()
            )))
        }
    };
    let rows = x.elem_count() / l.max(1);
    if ml != l || n == 0 || rows % n != 0 {
        return Err(crate::Error::input(format!(
            "masked softmax: mask {:?} does not fit scores {:?}",
            mask.dims(),
            x.dims()
        )));
    }
    Ok(x.apply_op2(&mask, MaskedSoftmax)?)
}

/// Per row `w[r] * (logsumexp(logits[r]) - logits[r, labels[r]])`, `[m]`, differentiable in
/// `logits [m, V]` (f32); `labels [m]` u32, `w [m]` f32 (rows of weight 0 contribute 0).
pub fn weighted_xent(logits: &Tensor, labels: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, _) = logits.dims2()?;
    if labels.dims1()? != m || w.dims1()? != m || labels.dtype() != DType::U32 {
        return Err(crate::Error::input(format!(
            "weighted cross-entropy: logits {:?}, labels {:?} {:?}, weights {:?}",
            logits.dims(),
            labels.dims(),
            labels.dtype(),
            w.dims()
        )));
    }
    Ok(logits.contiguous()?.apply_op3(
        &labels.contiguous()?,
        &w.to_dtype(DType::F32)?.contiguous()?,
        Xent,
    )?)
}

/// RMSNorm of the last dim, `x * rsqrt(mean(x^2) + eps) * w`, differentiable in `x` and `w`
/// (f32; `x [.., h]`, `w [h]`): one pass forward, one backward (candle's `rms_norm_slow` is
/// ~7 ops forward and twice that backward, through broadcasting kernels).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let h = x.dim(candle_core::D::Minus1)?;
    if w.dims1()? != h {
        return Err(crate::Error::input(format!(
            "rms norm: weight {:?} for rows of {h}",
            w.dims()
        )));
    }
    Ok(x.contiguous()?
        .apply_op2(&w.contiguous()?, RmsNormOp { eps })?)
}

/// [`super::sdpa_blocks`] for training, differentiable in `q`, the context's `kc / vc` and the
/// blocks' `kb / vb` through one op: the forward runs detached (scores `[kvh, rep * n, s +
/// block]` from one product against the context keys padded with `block` zero rows, the blocks'
/// own scores written into those columns in place, the fused masked softmax, one product
/// against the values padded alike plus the blocks' own), and the backward is written out
/// (dP = G V^T with the blocks' part set in place, dS by the fused softmax backward, dQ = dS K,
/// dK = dS^T Q, dV = P^T G), so the scores, probabilities and their gradients are each made
/// once, outside the autograd graph. Returns `[kvh, rep * n, vd]` (heads of a group adjacent).
pub(crate) fn block_attention(
    q: &Tensor,
    ctx: Option<(&Tensor, &Tensor)>,
    kb: &Tensor,
    vb: &Tensor,
    lay: super::attention::BlockLayout,
    mask: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let (kvh, rep, nb) = (lay.kvh, lay.rep, lay.nb);
    let (block, vd, dev) = (n / nb, vb.dim(2)?, q.device());
    let s = ctx.map_or(Ok(0), |(k, _)| k.dim(1))?;
    let qs = (q.detach() * scale)?
        .reshape((kvh, rep * n, d))?
        .contiguous()?;
    let kbb = kb.detach().reshape((kvh * nb, block, d))?;
    let vbb = vb.detach().reshape((kvh * nb, block, vd))?;
    let pad = |t: Option<&Tensor>, w: usize| -> Result<Tensor> {
        let z = Tensor::zeros((kvh, block, w), DType::F32, dev)?;
        Ok(match t {
            Some(t) => Tensor::cat(&[&t.detach().to_dtype(DType::F32)?, &z], 1)?,
            None => z,
        })
    };
    let (kpad, vpad) = (pad(ctx.map(|c| c.0), d)?, pad(ctx.map(|c| c.1), vd)?);
    let scores = qs.matmul(&kpad.t()?)?;
    let own = lay.row_major(
        &lay.block_major(&qs, block, d)?.matmul(&kbb.t()?)?,
        block,
        block,
    )?;
    scores.slice_set(&own, 2, s)?;
    let p = masked_softmax(&scores.reshape((kvh * rep, n, s + block))?, Some(mask))?.reshape((
        kvh,
        rep * n,
        s + block,
    ))?;
    let pb = lay.block_major(&p.narrow(2, s, block)?.contiguous()?, block, block)?;
    let out = (p.matmul(&vpad)? + lay.row_major(&pb.matmul(&vbb)?, block, vd)?)?;
    let (k_all, v_all) = match ctx {
        Some((kc, vc)) => (Tensor::cat(&[kc, kb], 1)?, Tensor::cat(&[vc, vb], 1)?),
        None => (kb.clone(), vb.clone()),
    };
    let op = BlockAttention {
        lay,
        dims: (heads, n, d, vd, s, block),
        scale,
        qs,
        kpad,
        vpad,
        kbb,
        vbb,
        p,
        pb,
        out: out.contiguous()?,
    };
    Ok(q.apply_op3_arc(&k_all, &v_all, std::sync::Arc::new(Box::new(op)))?)
}

/// The saved state of one [`block_attention`] (detached tensors; `out` is what the forward
/// hands the graph).
struct BlockAttention {
    lay: super::attention::BlockLayout,
    /// heads, n, d, vd, s, block
    dims: (usize, usize, usize, usize, usize, usize),
    scale: f64,
    /// the scaled queries `[kvh, rep * n, d]`
    qs: Tensor,
    /// the context's keys / values and `block` zero rows, `[kvh, s + block, d | vd]`
    kpad: Tensor,
    vpad: Tensor,
    /// the blocks' keys / values `[kvh * nb, block, d | vd]`
    kbb: Tensor,
    vbb: Tensor,
    /// probabilities `[kvh, rep * n, s + block]`, and their blocks' columns in block layout
    p: Tensor,
    pb: Tensor,
    out: Tensor,
}

impl BlockAttention {
    /// A copy of the forward's result in `storage`'s backend.
    fn result<S>(
        &self,
        pick: impl Fn(&candle_core::Storage) -> Option<&S>,
    ) -> candle_core::Result<(S, Shape)>
    where
        S: candle_core::backend::BackendStorage,
    {
        let (st, l) = self.out.storage_and_layout();
        match pick(&st) {
            Some(st) if l.is_contiguous() && l.start_offset() == 0 => {
                Ok((st.try_clone(l)?, l.shape().clone()))
            }
            _ => candle_core::bail!("block attention: the result is not where its inputs are"),
        }
    }
}

impl CustomOp3 for BlockAttention {
    fn name(&self) -> &'static str {
        "dflash-block-attention"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.result(|s| match s {
            candle_core::Storage::Cpu(c) => Some(c),
            _ => None,
        })
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.result(|s| match s {
            candle_core::Storage::Cuda(c) => Some(c),
            _ => None,
        })
    }
    fn bwd(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lay = self.lay;
        let (heads, n, d, vd, s, block) = self.dims;
        let kvh = lay.kvh;
        let g = grad.to_dtype(DType::F32)?.contiguous()?;
        let gb = lay
            .block_major(&g, block, vd)
            .map_err(candle_core::Error::wrap)?;
        // dP: the context's columns (the padded values make the blocks' columns 0), then the
        // blocks' own written over those
        let dp = g.matmul(&self.vpad.t()?)?;
        let dp_own = lay
            .row_major(&gb.matmul(&self.vbb.t()?)?, block, block)
            .map_err(candle_core::Error::wrap)?;
        dp.slice_set(&dp_own, 2, s)?;
        let ds = self.p.apply_op2_no_bwd(&dp, &SoftmaxBwd)?;
        drop(dp);
        let dsb = lay
            .block_major(&ds.narrow(2, s, block)?.contiguous()?, block, block)
            .map_err(candle_core::Error::wrap)?;
        let dq_own = lay
            .row_major(&dsb.matmul(&self.kbb)?, block, d)
            .map_err(candle_core::Error::wrap)?;
        let dq = ((ds.matmul(&self.kpad)? + dq_own)? * self.scale)?.reshape((heads, n, d))?;
        let qb = lay
            .block_major(&self.qs, block, d)
            .map_err(candle_core::Error::wrap)?;
        let dkb = dsb.t()?.matmul(&qb)?.reshape((kvh, n, d))?;
        let dvb = self.pb.t()?.matmul(&gb)?.reshape((kvh, n, vd))?;
        let (dk, dv) = match s {
            0 => (dkb, dvb),
            _ => {
                let dkc = ds.t()?.matmul(&self.qs)?.narrow(1, 0, s)?;
                let dvc = self.p.t()?.matmul(&g)?.narrow(1, 0, s)?;
                (
                    Tensor::cat(&[&dkc, &dkb], 1)?,
                    Tensor::cat(&[&dvc, &dvb], 1)?,
                )
            }
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The elements of a contiguous CPU operand.
fn elems<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    let Some((o, e)) = l.contiguous_offsets() else {
        candle_core::bail!("dflash training op: {what} must be contiguous");
    };
    Ok(&s.as_slice::<T>()?[o..e])
}

/// Row `r`'s softmax of `x + m` into `y`.
fn softmax_row(x: &[f32], m: &[f32], y: &mut [f32]) {
    let max = x
        .iter()
        .zip(m)
        .map(|(a, b)| a + b)
        .fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f64;
    for ((o, a), b) in y.iter_mut().zip(x).zip(m) {
        *o = (a + b - max).exp();
        s += *o as f64;
    }
    let inv = (1.0 / s) as f32;
    y.iter_mut().for_each(|v| *v *= inv);
}

/// (max, sum of exp(x - max)) of a row (summed in f64: a 49,152-wide row summed in f32 one
/// term after another drifts by ~1e-5 relative, more than the GPU's tree sum).
fn lse_parts(x: &[f32]) -> (f32, f32) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = x.iter().map(|v| (v - max).exp() as f64).sum();
    (max, s as f32)
}

struct MaskedSoftmax;

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "dflash-masked-softmax"
    }
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ms: &CpuStorage,
        ml: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, m) = (
            elems::<f32>(xs, xl, "scores")?,
            elems::<f32>(ms, ml, "mask")?,
        );
        let (n, l) = ml.shape().dims2()?;
        let mut y = vec![0f32; x.len()];
        for (r, (xr, yr)) in x.chunks(l).zip(y.chunks_mut(l)).enumerate() {
            softmax_row(xr, &m[(r % n) * l..(r % n + 1) * l], yr);
        }
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ms: &candle_core::CudaStorage,
        ml: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (n, l) = ml.shape().dims2()?;
        let y = super::cuda::masked_softmax_f32(xs, xl, ms, ml, n, l)?;
        Ok((y, xl.shape().clone()))
    }
    fn bwd(
        &self,
        _x: &Tensor,
        _mask: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = y.apply_op2_no_bwd(&dy.contiguous()?, &SoftmaxBwd)?;
        Ok((Some(dx), None))
    }
}

/// `y * (dy - sum(y * dy))` per row (no backward of its own).
struct SoftmaxBwd;

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "dflash-softmax-bwd"
    }
    fn cpu_fwd(
        &self,
        ys: &CpuStorage,
        yl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (y, g) = (
            elems::<f32>(ys, yl, "softmax")?,
            elems::<f32>(gs, gl, "gradient")?,
        );
        let l = yl.shape().dims().last().copied().unwrap_or(1).max(1);
        let mut dx = vec![0f32; y.len()];
        for ((yr, gr), dr) in y.chunks(l).zip(g.chunks(l)).zip(dx.chunks_mut(l)) {
            let dot = yr.iter().zip(gr).map(|(a, b)| (a * b) as f64).sum::<f64>() as f32;
            for ((d, a), b) in dr.iter_mut().zip(yr).zip(gr) {
                *d = a * (b - dot);
            }
        }
        Ok((CpuStorage::F32(dx), yl.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ys: &candle_core::CudaStorage,
        yl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let l = yl.shape().dims().last().copied().unwrap_or(1).max(1);
        let dx = super::cuda::softmax_bwd_f32(ys, yl, gs, gl, l)?;
        Ok((dx, yl.shape().clone()))
    }
}

struct Xent;

impl CustomOp3 for Xent {
    fn name(&self) -> &'static str {
        "dflash-weighted-xent"
    }
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ls: &CpuStorage,
        ll: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, lab, w) = (
            elems::<f32>(xs, xl, "logits")?,
            elems::<u32>(ls, ll, "labels")?,
            elems::<f32>(ws, wl, "weights")?,
        );
        let (m, v) = xl.shape().dims2()?;
        let mut out = vec![0f32; m];
        for r in 0..m {
            if w[r] == 0.0 {
                continue;
            }
            let xr = &x[r * v..(r + 1) * v];
            let (max, s) = lse_parts(xr);
            out[r] = w[r] * (max + s.ln() - xr[lab[r] as usize]);
        }
        Ok((CpuStorage::F32(out), Shape::from(m)))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ls: &candle_core::CudaStorage,
        ll: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (m, v) = xl.shape().dims2()?;
        let out = super::cuda::xent_fwd_f32(xs, xl, ls, ll, ws, wl, m, v)?;
        Ok((out, Shape::from(m)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        labels: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = (grad * w)?.contiguous()?;
        let dx = x.apply_op3_no_bwd(labels, &g, &XentBwd)?;
        Ok((Some(dx), None, None))
    }
}

/// `g[r] * (softmax(x[r]) - onehot(labels[r]))` (no backward of its own).
struct XentBwd;

impl CustomOp3 for XentBwd {
    fn name(&self) -> &'static str {
        "dflash-weighted-xent-bwd"
    }
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ls: &CpuStorage,
        ll: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, lab, g) = (
            elems::<f32>(xs, xl, "logits")?,
            elems::<u32>(ls, ll, "labels")?,
            elems::<f32>(gs, gl, "gradient")?,
        );
        let (m, v) = xl.shape().dims2()?;
        let mut dx = vec![0f32; m * v];
        for r in 0..m {
            if g[r] == 0.0 {
                continue;
            }
            let xr = &x[r * v..(r + 1) * v];
            let (max, s) = lse_parts(xr);
            let inv = 1.0 / s;
            for (j, d) in dx[r * v..(r + 1) * v].iter_mut().enumerate() {
                let p = (xr[j] - max).exp() * inv;
                *d = g[r] * (p - f32::from(j == lab[r] as usize));
            }
        }
        Ok((CpuStorage::F32(dx), xl.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ls: &candle_core::CudaStorage,
        ll: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (m, v) = xl.shape().dims2()?;
        let dx = super::cuda::xent_bwd_f32(xs, xl, ls, ll, gs, gl, m, v)?;
        Ok((dx, xl.shape().clone()))
    }
}

struct RmsNormOp {
    eps: f32,
}

/// Row `r`'s 1 / rms.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| (v * v) as f64).sum::<f64>() / x.len().max(1) as f64;
    (1.0 / (ms + eps as f64).sqrt()) as f32
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "dflash-rms-norm"
    }
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w) = (
            elems::<f32>(xs, xl, "input")?,
            elems::<f32>(ws, wl, "weight")?,
        );
        let h = w.len().max(1);
        let mut y = vec![0f32; x.len()];
        for (xr, yr) in x.chunks(h).zip(y.chunks_mut(h)) {
            let inv = inv_rms(xr, self.eps);
            for ((o, a), b) in yr.iter_mut().zip(xr).zip(w) {
                *o = a * inv * b;
            }
        }
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::rms_norm_f32(xs, xl, ws, wl, self.eps)?;
        Ok((y, xl.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let both = x.apply_op3_no_bwd(w, &dy.contiguous()?, &RmsNormBwd { eps: self.eps })?;
        let h = w.dim(0)?;
        let dx = both.get(0)?.reshape(x.shape())?;
        let dw = both.get(1)?.reshape(((), h))?.sum(0)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// The RMSNorm's backward: `[2, rows, h]`, the input's gradient and the per-row terms of the
/// weight's (summed over rows by the caller).
struct RmsNormBwd {
    eps: f32,
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "dflash-rms-norm-bwd"
    }
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w, g) = (
            elems::<f32>(xs, xl, "input")?,
            elems::<f32>(ws, wl, "weight")?,
            elems::<f32>(gs, gl, "gradient")?,
        );
        let h = w.len().max(1);
        let rows = x.len() / h;
        let mut out = vec![0f32; 2 * x.len()];
        let (dx, dw) = out.split_at_mut(x.len());
        for r in 0..rows {
            let (xr, gr) = (&x[r * h..(r + 1) * h], &g[r * h..(r + 1) * h]);
            let inv = inv_rms(xr, self.eps);
            let dot = xr
                .iter()
                .zip(gr)
                .zip(w)
                .map(|((a, b), c)| (a * b * c) as f64)
                .sum::<f64>() as f32
                / h as f32;
            for j in 0..h {
                dx[r * h + j] = inv * (gr[j] * w[j] - xr[j] * inv * inv * dot);
                dw[r * h + j] = gr[j] * xr[j] * inv;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((2, rows, h))))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let h = wl.shape().elem_count().max(1);
        let rows = xl.shape().elem_count() / h;
        let out = super::cuda::rms_norm_bwd_f32(xs, xl, ws, wl, gs, gl, self.eps)?;
        Ok((out, Shape::from((2, rows, h))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::max_abs_diff as max_diff;
    use candle_core::{Device, Var, D};

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = crate::rng::Rng::new(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (rng.uniform() as f32 - 0.5) * 6.0).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The training block attention's result and gradients (queries, context keys / values
    /// given as a strided view, the blocks' keys / values) equal candle's autograd through the
    /// composite ops (products, cat, the fused masked softmax, narrows), with a context and
    /// without one.
    #[test]
    fn block_attention_matches_the_composite_gradients() {
        use crate::nn::attention::sdpa_blocks_with;
        let (heads, kvh, block, nb, d, vd) = (6, 2, 4, 3, 8, 5);
        let n = block * nb;
        for (s, seed) in [(7usize, 10u64), (0, 20)] {
            let q = Var::from_tensor(&rand(&[heads, n, d], seed)).unwrap();
            let kc = Var::from_tensor(&rand(&[s, kvh, d], seed + 1)).unwrap();
            let vc = Var::from_tensor(&rand(&[s, kvh, vd], seed + 2)).unwrap();
            let kb = Var::from_tensor(&rand(&[kvh, n, d], seed + 3)).unwrap();
            let vb = Var::from_tensor(&rand(&[kvh, n, vd], seed + 4)).unwrap();
            // row r sees the context up to (r * 5) % (s + 1) and its block's keys up to r % block
            let mask: Vec<f32> = (0..n * (s + block))
                .map(|i| {
                    let (r, c) = (i / (s + block), i % (s + block));
                    let seen = match c < s {
                        true => c < (r * 5) % (s + 1),
                        false => c - s <= r % block,
                    };
                    if seen {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let mask = Tensor::from_vec(mask, (n, s + block), &Device::Cpu).unwrap();
            let w = rand(&[n, heads * vd], seed + 5);
            let run = |fused: bool| {
                let (kt, vt) = (
                    kc.as_tensor().transpose(0, 1).unwrap(),
                    vc.as_tensor().transpose(0, 1).unwrap(),
                );
                let ctx = (s > 0).then_some((&kt, &vt));
                let o = sdpa_blocks_with(q.as_tensor(), ctx, &kb, &vb, block, &mask, 0.35, fused)
                    .unwrap();
                let g = (&o * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let grads: Vec<Tensor> = [&q, &kc, &vc, &kb, &vb]
                    .iter()
                    .filter(|v| v.elem_count() > 0)
                    .map(|v| g.get(v.as_tensor()).unwrap().clone())
                    .collect();
                (o, grads)
            };
            let ((of, gf), (oc, gc)) = (run(true), run(false));
            assert!(
                max_diff(&of, &oc) < 1e-5,
                "s {s}: result off by {}",
                max_diff(&of, &oc)
            );
            assert_eq!(gf.len(), gc.len());
            for (i, (a, b)) in gf.iter().zip(&gc).enumerate() {
                assert_eq!(a.dims(), b.dims());
                let scale = max_diff(b, &b.zeros_like().unwrap());
                assert!(scale > 1e-3, "s {s}: gradient {i} is zero");
                assert!(
                    max_diff(a, b) < 1e-4 * scale.max(1.0),
                    "s {s}: gradient {i} off by {} (scale {scale})",
                    max_diff(a, b)
                );
            }
        }
    }

    /// The fused masked softmax and its gradient equal candle's chain (broadcast add, softmax)
    /// on a block-sparse mask shared by several head groups.
    #[test]
    fn masked_softmax_matches_the_candle_chain() {
        let (g, n, l) = (3, 5, 9);
        let x = Var::from_tensor(&rand(&[g, n, l], 1)).unwrap();
        let mask: Vec<f32> = (0..n * l)
            .map(|i| match (i / l + i % l) % 3 == 0 && i % l != i / l {
                true => f32::NEG_INFINITY,
                false => 0.0,
            })
            .collect();
        let mask = Tensor::from_vec(mask, (n, l), &Device::Cpu).unwrap();
        // a weighting of the outputs, so the gradient is not the trivial zero of sum(softmax)
        let c = rand(&[g, n, l], 2);
        let fused = masked_softmax(x.as_tensor(), Some(&mask)).unwrap();
        let chain =
            candle_nn::ops::softmax(&x.as_tensor().broadcast_add(&mask).unwrap(), D::Minus1)
                .unwrap();
        assert!(max_diff(&fused, &chain) < 1e-6);
        let gf = (&fused * &c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gc = (&chain * &c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (a, b) = (gf.get(&x).unwrap(), gc.get(&x).unwrap());
        assert!(max_diff(a, b) < 1e-5, "gradient off by {}", max_diff(a, b));
        assert!(max_diff(b, &b.zeros_like().unwrap()) > 1e-3);
        // no mask: plain softmax
        let plain = masked_softmax(x.as_tensor(), None).unwrap();
        let want = candle_nn::ops::softmax(x.as_tensor(), D::Minus1).unwrap();
        assert!(max_diff(&plain, &want) < 1e-6);
        // a mask of another width is refused
        let bad = Tensor::zeros((n, l + 1), DType::F32, &Device::Cpu).unwrap();
        assert!(masked_softmax(x.as_tensor(), Some(&bad)).is_err());
    }

    /// The fused weighted cross-entropy and its gradient equal log_softmax + gather + weights.
    #[test]
    fn weighted_xent_matches_the_candle_chain() {
        let (m, v) = (7, 33);
        let x = Var::from_tensor(&rand(&[m, v], 3)).unwrap();
        let labels: Vec<u32> = (0..m as u32).map(|r| (r * 5 + 2) % v as u32).collect();
        let w: Vec<f32> = (0..m)
            .map(|r| if r == 4 { 0.0 } else { 1.0 / (1 + r) as f32 })
            .collect();
        let lab = Tensor::from_vec(labels.clone(), m, &Device::Cpu).unwrap();
        let wt = Tensor::from_vec(w, m, &Device::Cpu).unwrap();
        let fused = weighted_xent(x.as_tensor(), &lab, &wt).unwrap();
        let lp = candle_nn::ops::log_softmax(x.as_tensor(), D::Minus1).unwrap();
        let picked = lp
            .gather(&lab.reshape((m, 1)).unwrap(), 1)
            .unwrap()
            .squeeze(1)
            .unwrap();
        let chain = (picked * &wt).unwrap().neg().unwrap();
        assert!(max_diff(&fused, &chain) < 1e-5);
        let gf = fused.sum_all().unwrap().backward().unwrap();
        let gc = chain.sum_all().unwrap().backward().unwrap();
        let (a, b) = (gf.get(&x).unwrap(), gc.get(&x).unwrap());
        assert!(max_diff(a, b) < 1e-6, "gradient off by {}", max_diff(a, b));
        // the zero-weight row has no gradient; the others do
        let row4 = a.get(4).unwrap();
        assert_eq!(max_diff(&row4, &row4.zeros_like().unwrap()), 0.0);
        assert!(max_diff(b, &b.zeros_like().unwrap()) > 1e-3);
        // labels of another length are refused
        let short = Tensor::from_vec(vec![0u32; m - 1], m - 1, &Device::Cpu).unwrap();
        assert!(weighted_xent(x.as_tensor(), &short, &wt).is_err());
    }

    /// The fused RMSNorm and its gradients (input and weight) equal candle's `rms_norm_slow`,
    /// on rows given as `[n, heads, d]` (per-head norms) too.
    #[test]
    fn rms_norm_matches_the_candle_chain() {
        for shape in [vec![6, 16], vec![5, 3, 8]] {
            let h = *shape.last().unwrap();
            let x = Var::from_tensor(&rand(&shape, 4)).unwrap();
            let w = Var::from_tensor(&(rand(&[h], 5) + 1.0).unwrap()).unwrap();
            let c = rand(&shape, 6);
            let fused = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            let chain = candle_nn::ops::rms_norm_slow(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            assert!(max_diff(&fused, &chain) < 1e-5, "{shape:?}");
            let gf = (&fused * &c)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let gc = (&chain * &c)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for (v, what) in [(&x, "input"), (&w, "weight")] {
                let (a, b) = (gf.get(v).unwrap(), gc.get(v).unwrap());
                assert!(
                    max_diff(a, b) < 1e-4,
                    "{shape:?} {what}: {}",
                    max_diff(a, b)
                );
                assert!(max_diff(b, &b.zeros_like().unwrap()) > 1e-3);
            }
        }
        let x = rand(&[2, 8], 7);
        assert!(rms_norm(&x, &rand(&[7], 8), 1e-5).is_err());
    }
}
