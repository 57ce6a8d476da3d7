//! The Gated DeltaNet of decode and verify blocks on the device (`kernels/delta.cu`): conv,
//! the row-by-row delta rule (also the rollback's replay) and the gated output norm.
//! `nn::gated_delta` decides when they run.

use super::*;

const DELTA_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/delta.ptx"));

/// Key and value head dim the rule kernel is built for.
pub const DELTA_HEAD_DIM: usize = 128;

/// Where a layer's pieces sit in its input projection, and its head counts.
#[derive(Clone, Debug)]
pub struct DeltaLayout {
    pub k_heads: usize,
    pub v_heads: usize,
    pub v_dim: usize,
    /// Columns of the projection: z (output gate), b (write strength), a (decay).
    pub z_off: usize,
    pub b_off: usize,
    pub a_off: usize,
}

fn f32_slice<'a>(h: &'a Held<'a>, what: &str) -> candle_core::Result<CudaView<'a, f32>> {
    match &*h.0 {
        Storage::Cuda(s) => {
            let Some((o, e)) = h.1.contiguous_offsets() else {
                candle_core::bail!("dflash delta: {what} must be contiguous");
            };
            Ok(s.as_cuda_slice::<f32>()?.slice(o..e))
        }
        _ => candle_core::bail!("dflash delta: {what} is not on the CUDA device"),
    }
}

struct Conv {
    proj: Tensor,
    w: Tensor,
    /// Columns of `proj` the conv reads (its first `cd`).
    cd: usize,
}

impl CustomOp1 for Conv {
    fn name(&self) -> &'static str {
        "dflash-delta-conv"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (k1, cd) = l.shape().dims2()?;
        let (k, cd2) = self.w.dims2()?;
        let (n, pstride) = self.proj.dims2()?;
        if cd2 != cd || cd != self.cd || k != k1 + 1 || pstride < cd || n == 0 {
            candle_core::bail!(
                "dflash-delta-conv: window {:?} taps {:?} projection {:?}",
                l.shape(),
                self.w.shape(),
                self.proj.shape()
            );
        }
        let dev = s.device();
        let window = view(s, l, "conv window")?;
        let (hp, hw) = (Held::new(&self.proj), Held::new(&self.w));
        let proj = hp.view("projection")?;
        let w = f32_slice(&hw, "conv taps")?;
        // SAFETY: one thread per output element.
        let out = unsafe { dev.alloc::<bf16>(n * cd)? };
        let func = dev.get_or_load_custom_func("delta_conv", "dflash_delta", DELTA_PTX)?;
        let total = (n * cd) as u32;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ps_i, k_i, cd_i, n_i) = (pstride as i32, k as i32, cd as i32, n as i32);
        let mut b = func.builder();
        b.arg(&window);
        b.arg(&proj);
        b.arg(&ps_i);
        b.arg(&w);
        b.arg(&k_i);
        b.arg(&cd_i);
        b.arg(&n_i);
        b.arg(&out);
        // SAFETY: argument types match the kernel; shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, cd)),
        ))
    }
}

/// `silu(conv)` of the new rows: the conv inputs are the cached `window [K - 1, cd]` bf16, then
/// the first `cd` columns of `proj [n, pstride]` (the rows' input projection); `w [K, cd]` f32
/// taps. `[n, cd]`; None when the kernel does not apply.
pub fn delta_conv(
    window: &Tensor,
    proj: &Tensor,
    w: &Tensor,
) -> candle_core::Result<Option<Tensor>> {
    if !is_bf16_cuda(&[window, proj])
        || w.dtype() != DType::F32
        || !w.is_contiguous()
        || !window.is_contiguous()
        || !proj.is_contiguous()
        || window.rank() != 2
    {
        return Ok(None);
    }
    let cd = window.dim(1)?;
    Ok(Some(window.apply_op1_no_bwd(&Conv {
        proj: proj.clone(),
        w: w.clone(),
        cd,
    })?))
}

struct Rule {
    proj: Tensor,
    a_neg: Tensor,
    dt_bias: Tensor,
    s_in: Tensor,
    layout: DeltaLayout,
    /// Rows to run (the conv rows' first `rows`); with `outputs` false only the final state
    /// and window are produced (a rollback's replay).
    rows: usize,
    outputs: bool,
    /// Where the final state, and the conv window after the rows, go (see [`RuleInto`]).
    state_out: Tensor,
    window_in: Tensor,
    window_out: Tensor,
}

impl CustomOp1 for Rule {
    fn name(&self) -> &'static str {
        "dflash-delta-rule"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let lo = &self.layout;
        let (crows, cd) = l.shape().dims2()?;
        let (prows, pstride) = self.proj.dims2()?;
        let d = DELTA_HEAD_DIM;
        let state_shape = (lo.v_heads, d, lo.v_dim);
        let (wi, wo) = (&self.window_in, &self.window_out);
        let ok = self.rows <= crows
            && self.rows <= prows
            && cd == 2 * lo.k_heads * d + lo.v_heads * lo.v_dim
            && lo.v_dim == d
            && lo.v_heads % lo.k_heads == 0
            && self.s_in.dims3()? == state_shape
            && lo.a_off + lo.v_heads <= pstride
            && lo.b_off + lo.v_heads <= pstride
            && self.state_out.dims3()? == state_shape
            && self.state_out.is_contiguous()
            && wi.dims2()? == wo.dims2()?
            && wi.dim(1)? == cd
            && wi.is_contiguous()
            && wo.is_contiguous()
            && pstride >= cd;
        if !ok {
            candle_core::bail!(
                "dflash-delta-rule: conv {:?} proj {:?} state {:?} rows {}",
                l.shape(),
                self.proj.shape(),
                self.s_in.shape(),
                self.rows
            );
        }
        let dev = s.device();
        let conv = view(s, l, "conv rows")?;
        let hp = Held::new(&self.proj);
        let proj = hp.view("projection")?;
        let (ha, hd, hs) = (
            Held::new(&self.a_neg),
            Held::new(&self.dt_bias),
            Held::new(&self.s_in),
        );
        let (a_neg, dt_bias, s_in) = (
            f32_slice(&ha, "decay")?,
            f32_slice(&hd, "dt bias")?,
            f32_slice(&hs, "state")?,
        );
        let (hso, hwi, hwo) = (Held::new(&self.state_out), Held::new(wi), Held::new(wo));
        let (s_out, w_in, w_out) = (
            f32_slice(&hso, "state destination")?,
            hwi.view("conv window")?,
            hwo.view("conv window destination")?,
        );
        // The outputs [rows, hv, dv] if any (one element at least: the op returns a buffer).
        let outs = if self.outputs {
            self.rows * lo.v_heads * lo.v_dim
        } else {
            0
        };
        let len = outs.max(1);
        // SAFETY: the kernel writes every output (and every state and window element).
        let buf = unsafe { dev.alloc::<f32>(len)? };
        let func = dev.get_or_load_custom_func("delta_rule", "dflash_delta", DELTA_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (lo.v_heads as u32, (lo.v_dim / 32) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let i = |x: usize| x as i32;
        let (cd_i, ps_i, b_off, a_off, hk, hv, dv, n, k) = (
            i(cd),
            i(pstride),
            i(lo.b_off),
            i(lo.a_off),
            i(lo.k_heads),
            i(lo.v_heads),
            i(lo.v_dim),
            i(self.rows),
            i(wi.dim(0)? + 1),
        );
        let o_view = buf.slice(0..outs);
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&conv);
        b.arg(&cd_i);
        b.arg(&proj);
        b.arg(&ps_i);
        b.arg(&b_off);
        b.arg(&a_off);
        b.arg(&a_neg);
        b.arg(&dt_bias);
        b.arg(&hk);
        b.arg(&hv);
        b.arg(&dv);
        b.arg(&n);
        b.arg(&s_in);
        // The ring's buffers are written through their device pointers: outputs of the op
        // besides the buffer it returns (the caller owns them and reads them after the op).
        b.arg(&s_out);
        if self.outputs {
            b.arg(&o_view);
        } else {
            b.arg(&null);
        }
        b.arg(&w_in);
        b.arg(&k);
        b.arg(&w_out);
        // SAFETY: argument types match the kernel; shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        drop((o_view, s_out, w_in, w_out));
        Ok((
            CudaStorage::wrap_cuda_slice(buf, dev.clone()),
            Shape::from(len),
        ))
    }
}

/// Where a forward of the device ring (`RecurrentCache`) puts its results: the final state
/// into `state` (`[hv, 128, dv]` f32, not `s_in`), and the conv window after the rows into
/// `window_out` (`[K - 1, cd]` bf16): the conv inputs after the rows, over `window_in` (the
/// window before them) and the projection's first `cd` columns.
pub struct RuleInto<'a> {
    pub state: &'a Tensor,
    pub window_in: &'a Tensor,
    pub window_out: &'a Tensor,
}

/// The delta rule over the first `rows` rows of `conv [n, cd]` (the conv outputs) from state
/// `s_in [hv, 128, dv]` f32, with the gates of `proj`, the final state and conv window into
/// `into`: the outputs `[rows, hv, dv]` f32 (None when `outputs` is false: a rollback's
/// replay), or None when the kernel does not apply (not CUDA, not bf16, head dims other than
/// 128).
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_into(
    conv: &Tensor,
    proj: &Tensor,
    a_neg: &Tensor,
    dt_bias: &Tensor,
    s_in: &Tensor,
    layout: &DeltaLayout,
    rows: usize,
    outputs: bool,
    into: RuleInto,
) -> candle_core::Result<Option<Option<Tensor>>> {
    if !is_bf16_cuda(&[conv, proj, into.window_in, into.window_out])
        || layout.v_dim != DELTA_HEAD_DIM
        || [s_in, a_neg, dt_bias, into.state]
            .iter()
            .any(|t| t.dtype() != DType::F32)
        || rows == 0
    {
        return Ok(None);
    }
    let op = Rule {
        proj: proj.clone(),
        a_neg: a_neg.contiguous()?,
        dt_bias: dt_bias.contiguous()?,
        s_in: s_in.contiguous()?,
        layout: layout.clone(),
        rows,
        outputs,
        state_out: into.state.clone(),
        window_in: into.window_in.clone(),
        window_out: into.window_out.clone(),
    };
    let buf = conv.apply_op1_no_bwd(&op)?;
    let (hv, dv) = (layout.v_heads, layout.v_dim);
    let o = outputs
        .then(|| buf.narrow(0, 0, rows * hv * dv)?.reshape((rows, hv, dv)))
        .transpose()?;
    Ok(Some(o))
}

struct Out {
    proj: Tensor,
    w: Tensor,
    eps: f32,
    z_off: usize,
}

impl CustomOp1 for Out {
    fn name(&self) -> &'static str {
        "dflash-delta-out"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (n, hv, dv) = l.shape().dims3()?;
        let (pn, pstride) = self.proj.dims2()?;
        if pn != n
            || self.w.dims1()? != dv
            || dv % 32 != 0
            || dv > 1024
            || self.z_off + hv * dv > pstride
        {
            candle_core::bail!(
                "dflash-delta-out: o {:?} proj {:?}",
                l.shape(),
                self.proj.shape()
            );
        }
        let dev = s.device();
        let Some((o1, o2)) = l.contiguous_offsets() else {
            candle_core::bail!("dflash-delta-out: outputs must be contiguous");
        };
        let o = s.as_cuda_slice::<f32>()?.slice(o1..o2);
        let (hp, hw) = (Held::new(&self.proj), Held::new(&self.w));
        let (proj, w) = (hp.view("projection")?, hw.view("norm weight")?);
        // SAFETY: one thread per output element.
        let out = unsafe { dev.alloc::<bf16>(n * hv * dv)? };
        let func = dev.get_or_load_custom_func("delta_out", "dflash_delta", DELTA_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, hv as u32, 1),
            block_dim: (dv as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ps_i, z_i, hv_i, dv_i, eps) = (
            pstride as i32,
            self.z_off as i32,
            hv as i32,
            dv as i32,
            self.eps,
        );
        let mut b = func.builder();
        b.arg(&o);
        b.arg(&proj);
        b.arg(&ps_i);
        b.arg(&z_i);
        b.arg(&w);
        b.arg(&eps);
        b.arg(&hv_i);
        b.arg(&dv_i);
        b.arg(&out);
        // SAFETY: argument types match the kernel; shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, hv * dv)),
        ))
    }
}

/// `rms_norm(o) * w * silu(z)` per value head: `o [n, hv, dv]` f32, z in `proj` at `z_off`;
/// `[n, hv * dv]` bf16. None when the kernel does not apply.
pub fn delta_out(
    o: &Tensor,
    proj: &Tensor,
    w: &Tensor,
    eps: f32,
    z_off: usize,
) -> candle_core::Result<Option<Tensor>> {
    if !is_bf16_cuda(&[proj, w]) || o.dtype() != DType::F32 || !o.is_contiguous() {
        return Ok(None);
    }
    let op = Out {
        proj: proj.clone(),
        w: w.clone(),
        eps,
        z_off,
    };
    Ok(Some(o.apply_op1_no_bwd(&op)?))
}
