//! MLX affine-quantized weights on the GPU (`kernels/affine.cu`): the skinny tensor-core GEMM
//! for 1..=16 rows, dequantized in registers (batch-invariant), and the whole-matrix
//! dequantization to bf16 for prefill-sized products.

use super::*;
use crate::nn::AffineWeight;

const AFFINE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/affine.ptx"));

/// The kernel and blocking for N output rows: `(name, weight rows per block, warps)`.
/// 4 bits with bf16 scales (MLX) take the dequantizing kernels (`affd_*`, kernels/affine.cu's
/// DEQ path): 8 warps split K below 512 tiles of 16 rows, else a warp a tile. Other storage
/// keeps the bf16 skinny GEMM's choice (`mma_config`) with kernels/affine.cu's names (the
/// 16-warp narrow blocking has no affine form: those weights take the 8-warp one). The choice
/// depends on N and the storage only, never on the rows of x (batch invariance).
fn config(n: usize, bits: usize, f16: bool) -> (&'static str, u32, u32) {
    if bits == 4 && !f16 {
        return match n.div_ceil(16) < 512 {
            true => ("affd_w8", 16, 8),
            false => ("affd_w1", 64, 4),
        };
    }
    let c = mma_config(n);
    match c.name {
        "gemm_w16u2" | "gemm_w8u2" => ("aff_w8", 16, 8),
        "gemm_w1u4" => ("aff_w1", c.rows_per_block, c.warps),
        _ => ("aff_w4n2", c.rows_per_block, c.warps),
    }
}

struct AffineMatmul {
    bits: usize,
    group: usize,
    f16: bool,
}

impl AffineMatmul {
    /// The storage part of a kernel's name: `b<bits>_<bf16|f16>`, with `_g<group>` for the
    /// GEMM (kernels/affine.cu's `AFF1` / `DEQ`).
    fn suffix(&self, with_group: bool) -> String {
        let st = if self.f16 { "f16" } else { "bf16" };
        match with_group {
            true => format!("b{}_g{}_{st}", self.bits, self.group),
            false => format!("b{}_{st}", self.bits),
        }
    }
}

impl CustomOp3 for AffineMatmul {
    fn name(&self) -> &'static str {
        "dflash-affine-matmul"
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
        xs: &CudaStorage,
        xl: &Layout,
        qs: &CudaStorage,
        ql: &Layout,
        ss: &CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, words) = ql.shape().dims2()?;
        let (n2, groups) = sl.shape().dims2()?;
        if words * 32 != k * self.bits || n2 != n || groups * self.group != k {
            candle_core::bail!(
                "{}: x [{m}, {k}], q [{n}, {words}], scales [{n2}, {groups}] at {} bits, group {}",
                self.name(),
                self.bits,
                self.group
            );
        }
        let Some((xo, _)) = xl.contiguous_offsets() else {
            candle_core::bail!("{}: x must be contiguous", self.name());
        };
        let Some((qo, _)) = ql.contiguous_offsets() else {
            candle_core::bail!("{}: q must be contiguous", self.name());
        };
        if xo % 8 != 0 || qo % 4 != 0 {
            candle_core::bail!("{}: unaligned inputs", self.name());
        }
        let x = view(xs, xl, "x")?;
        let q = view_of::<u32>(qs, ql, "q")?;
        let sb = view_of::<u32>(ss, sl, "scales")?;
        let dev = xs.device();
        let (base, rows_per_block, warps) = config(n, self.bits, self.f16);
        let name = format!(
            "{base}_{}_t{}",
            self.suffix(true),
            if m <= 8 { 1 } else { 2 }
        );
        let func = dev.get_or_load_custom_func(&name, "dflash_affine", AFFINE_PTX)?;
        // SAFETY: every element is written by the kernel.
        let y = unsafe { dev.alloc::<bf16>(m * n)? };
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(rows_per_block), 1, 1),
            block_dim: (32 * warps, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m_i, n_i, k_i) = (m as i32, n as i32, k as i32);
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&q);
        b.arg(&sb);
        b.arg(&y);
        b.arg(&m_i);
        b.arg(&n_i);
        b.arg(&k_i);
        // SAFETY: argument types match the kernel; shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            Shape::from((m, n)),
        ))
    }
}

/// `x [.., K] @ w^T` for an affine weight with the skinny kernel: CUDA, bf16 x, 1..=16 rows;
/// None otherwise (the caller dequantizes).
pub fn affine_matmul(x: &Tensor, w: &AffineWeight) -> candle_core::Result<Option<Tensor>> {
    if !x.device().is_cuda() || x.dtype() != DType::BF16 || !w.q.device().is_cuda() {
        return Ok(None);
    }
    let dims = x.dims();
    let k = *dims.last().unwrap_or(&0);
    let m: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    if m == 0 || m > MMA_MAX_ROWS || k != w.k || !x.is_contiguous() {
        return Ok(None);
    }
    let op = AffineMatmul {
        bits: w.bits,
        group: w.group,
        f16: w.f16,
    };
    let y = x.reshape((m, k))?.apply_op3_no_bwd(&w.q, &w.sb, &op)?;
    let mut out = dims.to_vec();
    *out.last_mut().expect("rank >= 1") = w.n;
    Ok(Some(y.reshape(out)?))
}

struct AffineDequant(AffineMatmul);

impl CustomOp2 for AffineDequant {
    fn name(&self) -> &'static str {
        "dflash-affine-dequant"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }

    fn cuda_fwd(
        &self,
        qs: &CudaStorage,
        ql: &Layout,
        ss: &CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let a = &self.0;
        let (n, words) = ql.shape().dims2()?;
        let k = words * 32 / a.bits;
        if sl.shape().dims2()? != (n, k / a.group) {
            candle_core::bail!("{}: scales {:?} for [{n}, {k}]", self.name(), sl.shape());
        }
        let q = view_of::<u32>(qs, ql, "q")?;
        let sb = view_of::<u32>(ss, sl, "scales")?;
        let dev = qs.device();
        let func = dev.get_or_load_custom_func(
            &format!("affine_dequant_{}", a.suffix(false)),
            "dflash_affine",
            AFFINE_PTX,
        )?;
        // SAFETY: every element is written (one thread per stored word writes its values).
        let out = unsafe { dev.alloc::<bf16>(n * k)? };
        let total = (n * words) as u32;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_i, k_i, g_i) = (n as i32, k as i32, a.group as i32);
        let mut b = func.builder();
        b.arg(&q);
        b.arg(&sb);
        b.arg(&out);
        b.arg(&n_i);
        b.arg(&k_i);
        b.arg(&g_i);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, k)),
        ))
    }
}

/// The affine weight as bf16 `[n, k]` on its CUDA device; None when it is not on one.
pub fn affine_dequantize(w: &AffineWeight) -> candle_core::Result<Option<Tensor>> {
    if !w.q.device().is_cuda() {
        return Ok(None);
    }
    let op = AffineDequant(AffineMatmul {
        bits: w.bits,
        group: w.group,
        f16: w.f16,
    });
    Ok(Some(w.q.apply_op2_no_bwd(&w.sb, &op)?))
}
