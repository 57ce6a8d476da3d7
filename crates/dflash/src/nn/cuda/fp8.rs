//! FP8 block-scaled weights on the GPU (`kernels/fp8.cu`): the skinny tensor-core GEMM for
//! 1..=16 rows with the weights dequantized in registers (the bf16 GEMM's blocking, so bit for
//! bit its products on the dequantized weights, batch-invariant), and the whole-matrix
//! dequantization to bf16 for prefill-sized products.

use super::*;
use crate::nn::Fp8Weight;

const FP8_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fp8.ptx"));

struct Fp8Matmul {
    block: (usize, usize),
    f32_out: bool,
}

impl CustomOp3 for Fp8Matmul {
    fn name(&self) -> &'static str {
        "dflash-fp8-matmul"
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
        let (n, k2) = ql.shape().dims2()?;
        let (bn, bk) = self.block;
        if k2 != k
            || !Fp8Weight::supported(k, self.block)
            || sl.shape().dims2()? != (n.div_ceil(bn), k / bk)
        {
            candle_core::bail!(
                "{}: x [{m}, {k}], q [{n}, {k2}], scales {:?} with {bn}x{bk} blocks",
                self.name(),
                sl.shape()
            );
        }
        let (Some((xo, _)), Some((qo, _))) = (xl.contiguous_offsets(), ql.contiguous_offsets())
        else {
            candle_core::bail!("{}: inputs must be contiguous", self.name());
        };
        // 16-byte aligned x rows, 8-byte aligned weight rows (k % 32 == 0 keeps them so).
        if xo % 8 != 0 || qo % 8 != 0 {
            candle_core::bail!("{}: unaligned inputs", self.name());
        }
        let x = view(xs, xl, "x")?;
        let q = view_of::<u8>(qs, ql, "q")?;
        let s = view_of::<f32>(ss, sl, "scales")?;
        let dev = xs.device();
        let c = mma_config(n);
        let name = format!(
            "{}_t{}{}",
            c.name.replacen("gemm", "fp8", 1),
            if m <= 8 { 1 } else { 2 },
            if self.f32_out { "_f32" } else { "" }
        );
        let func = dev.get_or_load_custom_func(&name, "dflash_fp8", FP8_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(c.rows_per_block), 1, 1),
            block_dim: (32 * c.warps, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m_i, n_i, k_i, bn_i, bk_i) = (m as i32, n as i32, k as i32, bn as i32, bk as i32);
        macro_rules! launch {
            ($t:ty) => {{
                // SAFETY: every element is written by the kernel.
                let y = unsafe { dev.alloc::<$t>(m * n)? };
                let mut b = func.builder();
                b.arg(&x);
                b.arg(&q);
                b.arg(&s);
                b.arg(&y);
                b.arg(&m_i);
                b.arg(&n_i);
                b.arg(&k_i);
                b.arg(&bn_i);
                b.arg(&bk_i);
                // SAFETY: argument types match the kernel; shapes checked above.
                unsafe { b.launch(cfg) }.w()?;
                CudaStorage::wrap_cuda_slice(y, dev.clone())
            }};
        }
        let y = if self.f32_out {
            launch!(f32)
        } else {
            launch!(bf16)
        };
        Ok((y, Shape::from((m, n))))
    }
}

/// `x [.., K] @ w^T` for an FP8 weight with the skinny kernel (`f32_out`: the f32 of each bf16
/// value, for the LM head): CUDA, bf16 x, 1..=16 rows; None otherwise (the caller
/// dequantizes).
pub fn fp8_matmul(x: &Tensor, w: &Fp8Weight, f32_out: bool) -> candle_core::Result<Option<Tensor>> {
    if !x.device().is_cuda() || x.dtype() != DType::BF16 || !w.q.device().is_cuda() {
        return Ok(None);
    }
    let dims = x.dims();
    let k = *dims.last().unwrap_or(&0);
    let m: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    if m == 0 || m > MMA_MAX_ROWS || k != w.k || !x.is_contiguous() {
        return Ok(None);
    }
    let op = Fp8Matmul {
        block: w.block,
        f32_out,
    };
    let y = x.reshape((m, k))?.apply_op3_no_bwd(&w.q, &w.scales, &op)?;
    let mut out = dims.to_vec();
    *out.last_mut().expect("rank >= 1") = w.n;
    Ok(Some(y.reshape(out)?))
}

struct Fp8Dequant((usize, usize));

impl CustomOp2 for Fp8Dequant {
    fn name(&self) -> &'static str {
        "dflash-fp8-dequant"
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
        let (bn, bk) = self.0;
        let (n, k) = ql.shape().dims2()?;
        if !Fp8Weight::supported(k, self.0) || sl.shape().dims2()? != (n.div_ceil(bn), k / bk) {
            candle_core::bail!("{}: scales {:?} for [{n}, {k}]", self.name(), sl.shape());
        }
        let q = view_of::<u8>(qs, ql, "q")?;
        let s = view_of::<f32>(ss, sl, "scales")?;
        if ql.start_offset() % 4 != 0 {
            candle_core::bail!("{}: unaligned weight", self.name());
        }
        let dev = qs.device();
        let func = dev.get_or_load_custom_func("fp8_dequant", "dflash_fp8", FP8_PTX)?;
        // SAFETY: every element is written (one thread per 4 bytes writes their 4 values).
        let out = unsafe { dev.alloc::<bf16>(n * k)? };
        let cfg = LaunchConfig {
            grid_dim: (((n * k / 4) as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_i, k_i, bn_i, bk_i) = (n as i32, k as i32, bn as i32, bk as i32);
        let mut b = func.builder();
        b.arg(&q);
        b.arg(&s);
        b.arg(&out);
        b.arg(&n_i);
        b.arg(&k_i);
        b.arg(&bn_i);
        b.arg(&bk_i);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, k)),
        ))
    }
}

/// The FP8 weight as bf16 `[n, k]` on its CUDA device; None when it is not on one.
pub fn fp8_dequantize(w: &Fp8Weight) -> candle_core::Result<Option<Tensor>> {
    if !w.q.device().is_cuda() {
        return Ok(None);
    }
    Ok(Some(w.q.apply_op2_no_bwd(&w.scales, &Fp8Dequant(w.block))?))
}
