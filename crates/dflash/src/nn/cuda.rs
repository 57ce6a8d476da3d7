//! Own CUDA kernels (PTX built by build.rs from `kernels/*.cu`), wrapped as candle custom ops.
//! Only compiled with `--features cuda`; every entry point says when it does not apply, so the
//! caller falls back to the portable candle path.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, DType, Layout, Shape, Tensor};
use half::bf16;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gemv.ptx"));
/// Most rows of x one launch handles (the kernel keeps one accumulator per row).
pub const GEMV_MAX_ROWS: usize = 8;
const WARPS_PER_BLOCK: u32 = 8;

struct Gemv;

impl CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "dflash-gemv-bf16"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("dflash-gemv-bf16 is a CUDA kernel (the caller uses matmul on CPU)")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, k2) = wl.shape().dims2()?;
        if k != k2 || m == 0 || m > GEMV_MAX_ROWS || k % 8 != 0 {
            candle_core::bail!("dflash-gemv-bf16: x [{m}, {k}] w [{n}, {k2}] not supported");
        }
        let (Some((xo, xe)), Some((wo, we))) = (xl.contiguous_offsets(), wl.contiguous_offsets())
        else {
            candle_core::bail!("dflash-gemv-bf16: inputs must be contiguous");
        };
        // 16-byte aligned rows: the base allocation is; the offsets must keep it.
        if xo % 8 != 0 || wo % 8 != 0 {
            candle_core::bail!("dflash-gemv-bf16: unaligned input offsets");
        }
        let dev = xs.device();
        let x = xs.as_cuda_slice::<bf16>()?.slice(xo..xe);
        let w = ws.as_cuda_slice::<bf16>()?.slice(wo..we);
        let func = dev.get_or_load_custom_func(&format!("gemv_bf16_m{m}"), "dflash_gemv", PTX)?;
        // SAFETY: every element is written by the kernel.
        let y = unsafe { dev.alloc::<bf16>(m * n)? };
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(WARPS_PER_BLOCK), 1, 1),
            block_dim: (32 * WARPS_PER_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_i, k_i) = (n as i32, k as i32);
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&w);
        b.arg(&y);
        b.arg(&n_i);
        b.arg(&k_i);
        // SAFETY: argument types match the kernel's signature; sizes checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            Shape::from((m, n)),
        ))
    }
}

/// `x [.., K] @ w[N, K]^T` with the GEMV kernel when it applies (CUDA, bf16, at most
/// `GEMV_MAX_ROWS` rows, K % 8 == 0, contiguous); None otherwise.
pub fn gemv(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !x.device().is_cuda() || x.dtype() != DType::BF16 || w.dtype() != DType::BF16 {
        return Ok(None);
    }
    let dims = x.dims();
    let k = *dims.last().unwrap_or(&0);
    let m: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    if m == 0 || m > GEMV_MAX_ROWS || k % 8 != 0 || w.rank() != 2 || w.dim(1)? != k {
        return Ok(None);
    }
    if !x.is_contiguous() || !w.is_contiguous() {
        return Ok(None);
    }
    let y = x.reshape((m, k))?.apply_op2_no_bwd(w, &Gemv)?;
    let mut out = dims.to_vec();
    *out.last_mut().expect("rank >= 1") = w.dim(0)?;
    Ok(Some(y.reshape(out)?))
}
