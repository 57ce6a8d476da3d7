//! Token choice on the device: greedy argmax and plain temperature sampling of logit rows.

use super::*;

/// Whether the row kernels below take `logits`: CUDA, f32, `[rows, vocab]`, non-empty, a
/// vocabulary an i32 index covers.
pub(super) fn logit_rows_apply(logits: &Tensor) -> candle_core::Result<bool> {
    Ok(logits.device().is_cuda()
        && logits.dtype() == DType::F32
        && logits.rank() == 2
        && logits.elem_count() > 0
        && logits.dim(1)? <= i32::MAX as usize / 2)
}

/// `(rows, vocab, view)` of a contiguous f32 `[rows, vocab]` op input.
pub(super) fn logit_rows<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<(usize, usize, CudaView<'a, f32>)> {
    let (rows, vocab) = l.shape().dims2()?;
    let Some((o1, o2)) = l.contiguous_offsets() else {
        candle_core::bail!("{what}: logits must be contiguous");
    };
    Ok((rows, vocab, s.as_cuda_slice::<f32>()?.slice(o1..o2)))
}

struct ArgmaxRows;

/// Chunks per row for argmax_part: enough blocks for one row to spread over the GPU.
const ARGMAX_CHUNKS: usize = 64;

impl CustomOp1 for ArgmaxRows {
    fn name(&self) -> &'static str {
        "dflash-argmax-rows"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, vocab, x) = logit_rows(s, l, self.name())?;
        let dev = s.device();
        let chunks = ARGMAX_CHUNKS.min(vocab.max(1));
        let chunk = vocab.div_ceil(chunks);
        // SAFETY: argmax_part writes every partial, argmax_final every output.
        let pv = unsafe { dev.alloc::<f32>(rows * chunks)? };
        let pi = unsafe { dev.alloc::<i32>(rows * chunks)? };
        let out = unsafe { dev.alloc::<u32>(rows)? };
        let func = dev.get_or_load_custom_func("argmax_part_f32", "dflash_fused", FUSED_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (v_i, c_i, n_i) = (vocab as i32, chunk as i32, chunks as i32);
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&v_i);
        b.arg(&c_i);
        b.arg(&pv);
        b.arg(&pi);
        // SAFETY: argument types match the kernel; sizes checked above.
        unsafe { b.launch(cfg) }.w()?;
        let func = dev.get_or_load_custom_func("argmax_final", "dflash_fused", FUSED_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&pv);
        b.arg(&pi);
        b.arg(&n_i);
        b.arg(&out);
        // SAFETY: argument types match the kernel.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from(rows),
        ))
    }
}

/// Greedy choice of every row of f32 logits `[rows, vocab]` (u32 `[rows]` on the device):
/// the largest value, the lowest index among equal ones, as `sampling::argmax`. None when the
/// kernel does not apply (not CUDA, not f32, not 2-D, empty).
pub fn argmax_rows(logits: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !logit_rows_apply(logits)? {
        return Ok(None);
    }
    Ok(Some(logits.contiguous()?.apply_op1_no_bwd(&ArgmaxRows)?))
}

struct SampleRows {
    temperature: f32,
    uniforms: Vec<f64>,
}

impl CustomOp1 for SampleRows {
    fn name(&self) -> &'static str {
        "dflash-sample-rows"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, vocab, x) = logit_rows(s, l, self.name())?;
        if self.uniforms.len() != rows {
            candle_core::bail!(
                "{}: {} uniforms for {rows} rows",
                self.name(),
                self.uniforms.len()
            );
        }
        let dev = s.device();
        let u = dev.clone_htod(&self.uniforms)?;
        // SAFETY: the kernel writes every row's output.
        let out = unsafe { dev.alloc::<u32>(rows)? };
        let func = dev.get_or_load_custom_func("sample_rows_f32", "dflash_fused", FUSED_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let v_i = vocab as i32;
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&v_i);
        b.arg(&self.temperature);
        b.arg(&u);
        b.arg(&out);
        // SAFETY: argument types match the kernel; sizes checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from(rows),
        ))
    }
}

/// Plain temperature sampling of every row of f32 logits `[rows, vocab]` on the device (u32
/// `[rows]`), row i with `uniforms[i]` in [0, 1): the host sampler's rule (the first token in
/// token order whose cumulative weight `exp((x - max) / t)` exceeds `u * sum`). None when the
/// kernel does not apply (not CUDA, not f32, not 2-D, empty).
pub fn sample_rows(
    logits: &Tensor,
    temperature: f32,
    uniforms: &[f64],
) -> candle_core::Result<Option<Tensor>> {
    if !logit_rows_apply(logits)?
        || logits.dim(0)? != uniforms.len()
        || temperature.is_nan()
        || temperature <= 0.0
    {
        return Ok(None);
    }
    let op = SampleRows {
        temperature,
        uniforms: uniforms.to_vec(),
    };
    Ok(Some(logits.contiguous()?.apply_op1_no_bwd(&op)?))
}
