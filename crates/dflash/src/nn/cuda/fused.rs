//! The kernels between the matmuls (`kernels/fused.cu`): residual add + RMSNorm, SwiGLU, and
//! the bf16 -> f32 widening of the LM head's logits.

use super::*;

struct AddRmsNorm {
    eps: f32,
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "dflash-add-rmsnorm"
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
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        rs: &CudaStorage,
        rl: &Layout,
        ds: &CudaStorage,
        dl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (n, h) = rl.shape().dims2()?;
        if dl.shape().dims2()? != (n, h) || wl.shape().dims1()? != h {
            candle_core::bail!(
                "dflash-add-rmsnorm: shapes {:?} {:?} {:?}",
                rl.shape(),
                dl.shape(),
                wl.shape()
            );
        }
        let dev = rs.device();
        let (r, d, w) = (
            view(rs, rl, "residual")?,
            view(ds, dl, "delta")?,
            view(ws, wl, "weight")?,
        );
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<bf16>(2 * n * h)? };
        let (sum, norm) = (out.slice(0..n * h), out.slice(n * h..2 * n * h));
        let func = dev.get_or_load_custom_func("add_rmsnorm_bf16", "dflash_fused", FUSED_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (block_for(h.min(1024)), 1, 1),
            shared_mem_bytes: 0,
        };
        let (h_i, eps) = (h as i32, self.eps);
        let mut b = func.builder();
        b.arg(&r);
        b.arg(&d);
        b.arg(&w);
        b.arg(&sum);
        b.arg(&norm);
        b.arg(&h_i);
        b.arg(&eps);
        // SAFETY: argument types match the kernel; shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        drop((sum, norm));
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((2, n, h)),
        ))
    }
}

/// `(res + delta, rms_norm(res + delta) * w)` for `[n, h]` rows in one kernel.
pub fn add_rms_norm(
    res: &Tensor,
    delta: &Tensor,
    w: &Tensor,
    eps: f32,
) -> candle_core::Result<Option<(Tensor, Tensor)>> {
    if !is_bf16_cuda(&[res, delta, w]) || res.rank() != 2 || res.dims() != delta.dims() {
        return Ok(None);
    }
    let out = res.apply_op3_no_bwd(delta, w, &AddRmsNorm { eps })?;
    Ok(Some((out.get(0)?, out.get(1)?)))
}

struct SwiGlu;

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "dflash-swiglu"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (n, two_i) = l.shape().dims2()?;
        let inter = two_i / 2;
        let dev = s.device();
        let gu = view(s, l, "gate/up")?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<bf16>(n * inter)? };
        let func = dev.get_or_load_custom_func("swiglu_bf16", "dflash_fused", FUSED_PTX)?;
        let total = (n * inter) as u32;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (i_i, n_i) = (inter as i32, n as i32);
        let mut b = func.builder();
        b.arg(&gu);
        b.arg(&out);
        b.arg(&i_i);
        b.arg(&n_i);
        // SAFETY: argument types match the kernel.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, inter)),
        ))
    }
}

/// `silu(gu[:, :I]) * gu[:, I:]` of a stacked gate/up output `[n, 2I]`.
pub fn swiglu(gu: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !is_bf16_cuda(&[gu]) || gu.rank() != 2 || gu.dim(1)? % 2 != 0 {
        return Ok(None);
    }
    Ok(Some(gu.apply_op1_no_bwd(&SwiGlu)?))
}

struct ToF32;

impl CustomOp1 for ToF32 {
    fn name(&self) -> &'static str {
        "dflash-bf16-to-f32"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        use candle_core::cuda_backend::cudarc::driver::DevicePtr;
        let n = l.shape().elem_count();
        let dev = s.device();
        let x = view(s, l, "bf16 values")?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<f32>(n.max(1))? };
        let stream = dev.cuda_stream();
        let aligned = {
            let (px, _g1) = x.device_ptr(&stream);
            let (po, _g2) = out.device_ptr(&stream);
            px % 16 == 0 && po % 16 == 0
        };
        let threads = if aligned { n.div_ceil(8) } else { n };
        let func = dev.get_or_load_custom_func("bf16_to_f32", "dflash_fused", FUSED_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_i, vec) = (n as i64, aligned as i32);
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&out);
        b.arg(&n_i);
        b.arg(&vec);
        // SAFETY: argument types match the kernel; the kernel reads and writes n values.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            l.shape().clone(),
        ))
    }
}

/// `x.to_dtype(F32)` of a contiguous bf16 tensor on the device (exact), in one vectorized
/// pass; None for anything else.
pub fn bf16_to_f32(x: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !is_bf16_cuda(&[x]) || x.elem_count() == 0 {
        return Ok(None);
    }
    Ok(Some(x.apply_op1_no_bwd(&ToF32)?))
}
