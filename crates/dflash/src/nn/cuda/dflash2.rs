//! DFlash2 on the device (`kernels/dflash2.cu`): the grouped dynamic causal convolution and
//! the selector's per-row top-k. `nn::dyn_conv` and `draft::dflash2` decide when they run.

use super::sampling::{logit_rows, logit_rows_apply};
use super::*;

const DFLASH2_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/dflash2.ptx"));

/// Candidates per row the top-k kernel keeps (`TK_MAX`).
pub const TOP_K_MAX: usize = 32;

struct DynConv {
    dynk: Tensor,
    base: Tensor,
    group: usize,
    block: usize,
}

impl CustomOp1 for DynConv {
    fn name(&self) -> &'static str {
        "dflash-dyn-conv"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (n, h) = l.shape().dims2()?;
        let (k, hb) = self.base.dims2()?;
        let g = h / self.group;
        let dl = self.dynk.layout();
        if hb != h || self.dynk.dims2()? != (n, k * g) || dl.stride()[1] != 1 {
            candle_core::bail!(
                "dflash-dyn-conv: x {:?} dynamic {:?} base {:?}",
                l.shape(),
                self.dynk.shape(),
                self.base.shape()
            );
        }
        let dev = s.device();
        let x = view(s, l, "conv input")?;
        let hb_ = Held::new(&self.base);
        let base = hb_.view("conv base kernel")?;
        let hd = Held::new(&self.dynk);
        let dyn_all = match &*hd.0 {
            Storage::Cuda(ds) => ds.as_cuda_slice::<bf16>()?,
            _ => candle_core::bail!("dflash-dyn-conv: dynamic kernel is not on the device"),
        };
        let start = dl.start_offset();
        let dyn_v = dyn_all.slice(start..);
        let stride = dl.stride()[0] as i64;
        // SAFETY: one thread per output element.
        let out = unsafe { dev.alloc::<bf16>(n * h)? };
        let func = dev.get_or_load_custom_func("dyn_conv", "dflash_dflash2", DFLASH2_PTX)?;
        let total = (n * h) as u32;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_i, h_i, k_i, g_i, b_i) = (
            n as i32,
            h as i32,
            k as i32,
            self.group as i32,
            self.block as i32,
        );
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&dyn_v);
        b.arg(&stride);
        b.arg(&base);
        b.arg(&n_i);
        b.arg(&h_i);
        b.arg(&k_i);
        b.arg(&g_i);
        b.arg(&b_i);
        b.arg(&out);
        // SAFETY: argument types match the kernel; shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, h)),
        ))
    }
}

/// The convolution of `nn::dyn_conv` (shapes checked there): bf16 `x [n, h]`, `dynk [n, K*G]`
/// (a column slice of the projection is fine: rows of unit column stride), `base [K, h]`.
/// None when the kernel does not apply (not bf16 CUDA).
pub fn dyn_conv(
    x: &Tensor,
    dynk: &Tensor,
    base: &Tensor,
    group: usize,
    block: usize,
) -> crate::Result<Option<Tensor>> {
    if !is_bf16_cuda(&[x, base])
        || dynk.dtype() != DType::BF16
        || !dynk.device().is_cuda()
        || dynk.rank() != 2
        || dynk.layout().stride()[1] != 1
    {
        return Ok(None);
    }
    Ok(Some(x.apply_op1_no_bwd(&DynConv {
        dynk: dynk.clone(),
        base: base.clone(),
        group,
        block,
    })?))
}

struct TopK {
    k: usize,
}

impl CustomOp1 for TopK {
    fn name(&self) -> &'static str {
        "dflash-top-k-rows"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, vocab, x) = logit_rows(s, l, self.name())?;
        let k = self.k;
        if k == 0 || k > TOP_K_MAX || k > vocab {
            candle_core::bail!("{}: k {k} for {vocab} columns", self.name());
        }
        let dev = s.device();
        let func = dev.get_or_load_custom_func("top_k_part", "dflash_dflash2", DFLASH2_PTX)?;
        // Stage one: each row in parts of ~4096 logits (32 per thread), so a verify-sized
        // block fills the GPU instead of one block per row; stage two merges the parts.
        let parts = vocab.div_ceil(4096).clamp(1, 64);
        let chunk = vocab.div_ceil(parts);
        let stage = |src: &CudaView<f32>,
                     has_ids: bool,
                     ids_off: usize,
                     len: usize,
                     stride: usize,
                     chunk: usize,
                     parts: usize|
         -> candle_core::Result<
            candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
        > {
            // SAFETY: the kernel writes every output element.
            let out = unsafe { dev.alloc::<f32>(rows * parts * 2 * k)? };
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, parts as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let ids = src.slice(ids_off..);
            let (h_i, len_i, stride_i, chunk_i, k_i) = (
                has_ids as i32,
                len as i32,
                stride as i64,
                chunk as i32,
                k as i32,
            );
            let mut b = func.builder();
            b.arg(src);
            b.arg(&ids);
            b.arg(&h_i);
            b.arg(&len_i);
            b.arg(&stride_i);
            b.arg(&chunk_i);
            b.arg(&k_i);
            b.arg(&out);
            // SAFETY: argument types match the kernel; sizes checked above.
            unsafe { b.launch(cfg) }.w()?;
            Ok(out)
        };
        let one = stage(&x, false, 0, vocab, vocab, chunk, parts)?;
        let out = if parts == 1 {
            one
        } else {
            let v = one.slice(0..);
            let m = parts * k;
            stage(&v, true, rows * m, m, m, m, 1)?
        };
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((2, rows, k)),
        ))
    }
}

/// Per row of f32 `logits [n, V]` its `k` largest values and ids (`[n, k]` f32 and u32, on the
/// device; order as `draft::dflash2::top_k_row`). None when the kernel does not apply.
pub fn top_k(logits: &Tensor, k: usize) -> crate::Result<Option<(Tensor, Tensor)>> {
    let vocab = logits.dim(1)?;
    if !logit_rows_apply(logits)?
        || !logits.is_contiguous()
        || k > TOP_K_MAX
        || k > vocab
        || vocab >= 1 << 24
    {
        return Ok(None);
    }
    // [2, n, k]: the values, then the ids (as f32, exact below 2^24)
    let out = logits.apply_op1_no_bwd(&TopK { k })?;
    let vals = out.get(0)?;
    let ids = out.get(1)?.to_dtype(DType::U32)?;
    Ok(Some((vals, ids)))
}
