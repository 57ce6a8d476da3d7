//! DFlash2 on the device (`kernels/dflash2.cu`): the grouped dynamic causal convolution, the
//! selector's per-row top-k and its walk. `nn::dyn_conv` and `draft::dflash2` decide when they
//! run.

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
        let func = dev.get_or_load_custom_func("top_k_warp", "dflash_dflash2", DFLASH2_PTX)?;
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

/// Per row of f32 `logits [n, V]` its `k` largest values and ids as the kernel leaves them:
/// `[2, n, k]` f32 (the values, then the ids as floats, exact below 2^24). None when the
/// kernel does not apply.
pub fn top_k_raw(logits: &Tensor, k: usize) -> crate::Result<Option<Tensor>> {
    let vocab = logits.dim(1)?;
    if !logit_rows_apply(logits)?
        || !logits.is_contiguous()
        || k > TOP_K_MAX
        || k > vocab
        || vocab >= 1 << 24
    {
        return Ok(None);
    }
    Ok(Some(logits.apply_op1_no_bwd(&TopK { k })?))
}

/// Per row of f32 `logits [n, V]` its `k` largest values and ids (`[n, k]` f32 and u32, on the
/// device; order as `draft::dflash2::top_k_row`). None when the kernel does not apply.
pub fn top_k(logits: &Tensor, k: usize) -> crate::Result<Option<(Tensor, Tensor)>> {
    let Some(out) = top_k_raw(logits, k)? else {
        return Ok(None);
    };
    let vals = out.get(0)?;
    let ids = out.get(1)?.to_dtype(DType::U32)?;
    Ok(Some((vals, ids)))
}

/// The selector's walk (`selector_pairs` then `selector_walk` in kernels/dflash2.cu) over
/// [`top_k_raw`]'s output: `hp [n, rank]` bf16, `pred` / `succ [vocab, rank]` bf16; the op's
/// output is the `[n]` u32 ids on the device.
struct Walk {
    hp: Tensor,
    pred: Tensor,
    succ: Tensor,
    anchor: u32,
}

impl CustomOp1 for Walk {
    fn name(&self) -> &'static str {
        "dflash-selector-walk"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (two, n, k) = l.shape().dims3()?;
        let (hn, rank) = self.hp.dims2()?;
        let (vocab, pr) = self.pred.dims2()?;
        if two != 2
            || hn != n
            || pr != rank
            || self.succ.dims2()? != (vocab, rank)
            || k > TOP_K_MAX
            || self.anchor as usize >= vocab
        {
            candle_core::bail!(
                "{}: candidates {:?} hidden {:?} codebooks {:?} {:?} anchor {}",
                self.name(),
                l.shape(),
                self.hp.shape(),
                self.pred.shape(),
                self.succ.shape(),
                self.anchor
            );
        }
        let Some((o1, o2)) = l.contiguous_offsets() else {
            candle_core::bail!("{}: candidates must be contiguous", self.name());
        };
        let tk = s.as_cuda_slice::<f32>()?.slice(o1..o2);
        let dev = s.device();
        let (hh, hp_, hs) = (
            Held::new(&self.hp),
            Held::new(&self.pred),
            Held::new(&self.succ),
        );
        let (hp, pred, succ) = (
            hh.view("projected hidden rows")?,
            hp_.view("predecessor codebook")?,
            hs.view("successor codebook")?,
        );
        // SAFETY: selector_pairs writes every entry the walk reads (row 0: i = 0 only), the
        // walk every element of out.
        let tab = unsafe { dev.alloc::<f32>(n * k * k)? };
        let out = unsafe { dev.alloc::<u32>(n)? };
        let pairs = dev.get_or_load_custom_func("selector_pairs", "dflash_dflash2", DFLASH2_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, k as u32, 1),
            block_dim: (32 * k as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (hp_stride, n_i, k_i, r_i, anchor) =
            (rank as i64, n as i32, k as i32, rank as i32, self.anchor);
        let mut b = pairs.builder();
        b.arg(&tk);
        b.arg(&hp);
        b.arg(&hp_stride);
        b.arg(&pred);
        b.arg(&succ);
        b.arg(&n_i);
        b.arg(&k_i);
        b.arg(&r_i);
        b.arg(&anchor);
        b.arg(&tab);
        // SAFETY: argument types match the kernel; shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        // The table in shared memory when it fits the default 48 KB.
        let smem = if n * k * k * 4 <= 48 * 1024 {
            n * k * k
        } else {
            0
        };
        let walk = dev.get_or_load_custom_func("selector_walk", "dflash_dflash2", DFLASH2_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: (smem * 4) as u32,
        };
        let smem_i = smem as i32;
        let mut b = walk.builder();
        b.arg(&tk);
        b.arg(&tab);
        b.arg(&n_i);
        b.arg(&k_i);
        b.arg(&smem_i);
        b.arg(&out);
        // SAFETY: argument types match the kernel.
        unsafe { b.launch(cfg) }.w()?;
        drop(tab);
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from(n),
        ))
    }
}

/// The walk's ids on the device (see [`Walk`]): `tk` from [`top_k_raw`], `hp [n, rank]`.
pub fn selector_walk(
    tk: &Tensor,
    hp: &Tensor,
    pred: &Tensor,
    succ: &Tensor,
    anchor: u32,
) -> crate::Result<Option<Tensor>> {
    if !is_bf16_cuda(&[hp, pred, succ]) || !tk.device().is_cuda() || tk.dtype() != DType::F32 {
        return Ok(None);
    }
    Ok(Some(tk.apply_op1_no_bwd(&Walk {
        hp: hp.clone(),
        pred: pred.clone(),
        succ: succ.clone(),
        anchor,
    })?))
}
