//! Row matmuls for the few-row products of decode, verify and draft steps: the GEMV kernel
//! (`kernels/gemv.cu`) and the tensor-core skinny GEMM (`kernels/mma.cu`, batch-invariant).

use super::*;

/// Most rows of x one launch handles (the kernel keeps one accumulator per row).
pub use crate::switches::GEMV_MAX_ROWS;

/// Rows up to which `Linear::forward` takes the GEMV kernel instead of cuBLAS when
/// batch-invariant mode is off (`DFLASH_GEMV_ROWS`, default 1). Measured on the H200 at the
/// Qwen3-8B shape (verify forward, ms, GEMV up to 8 rows vs up to 1): Q=2 5.92 vs 5.86, Q=4
/// 6.57 vs 5.91, Q=8 10.38 vs 6.09; Q=1 5.32 (GEMV) either way: past one row cuBLAS is as
/// fast or faster.
fn gemv_rows() -> usize {
    crate::switches::get().gemv_rows
}
const WARPS_PER_BLOCK: u32 = 8;

/// The two row-matmul kernels: `x [m, k] @ w [n, k]^T` for a few rows of x, bf16.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowKernel {
    /// kernels/gemv.cu: one warp per weight row, 1..=GEMV_MAX_ROWS rows, K % 8 == 0.
    Gemv,
    /// kernels/mma.cu: tensor cores, 1..=MMA_MAX_ROWS rows, K % 32 == 0, batch-invariant.
    Mma,
}

impl RowKernel {
    fn max_rows(self) -> usize {
        match self {
            RowKernel::Gemv => GEMV_MAX_ROWS,
            RowKernel::Mma => MMA_MAX_ROWS,
        }
    }
    fn k_multiple(self) -> usize {
        match self {
            RowKernel::Gemv => 8,
            RowKernel::Mma => 32,
        }
    }
}

/// A row matmul; `f32_out`: the skinny GEMM writes f32 (each value the f32 of its bf16
/// rounding: what a bf16 output cast to f32 holds) for the LM head's logits.
struct RowMatmul(RowKernel, bool);

impl CustomOp2 for RowMatmul {
    fn name(&self) -> &'static str {
        match self.0 {
            RowKernel::Gemv => "dflash-gemv-bf16",
            RowKernel::Mma => "dflash-mma-bf16",
        }
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
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (kern, f32_out) = (self.0, self.1);
        if f32_out && kern != RowKernel::Mma {
            candle_core::bail!("{}: f32 output is the skinny GEMM's only", self.name());
        }
        // [m, k] x [n, k], or a batch of them: [b, m, k] x [b, n, k] (the skinny GEMM only)
        let (batch, m, k) = match xl.shape().rank() {
            3 => xl.shape().dims3()?,
            _ => {
                let (m, k) = xl.shape().dims2()?;
                (1, m, k)
            }
        };
        let (wb, n, k2) = match wl.shape().rank() {
            3 => wl.shape().dims3()?,
            _ => {
                let (n, k) = wl.shape().dims2()?;
                (1, n, k)
            }
        };
        if wb != batch || (batch > 1 && kern != RowKernel::Mma) {
            candle_core::bail!(
                "{}: batch {batch} x [.., {m}, {k}] w [{wb}, {n}, {k2}]",
                self.name()
            );
        }
        if k != k2 || m == 0 || m > kern.max_rows() || n == 0 || k % kern.k_multiple() != 0 {
            candle_core::bail!("{}: x [{m}, {k}] w [{n}, {k2}] not supported", self.name());
        }
        let (Some((xo, _)), Some((wo, _))) = (xl.contiguous_offsets(), wl.contiguous_offsets())
        else {
            candle_core::bail!("{}: inputs must be contiguous", self.name());
        };
        // 16-byte aligned rows: the base allocation is; the offsets must keep it.
        if xo % 8 != 0 || wo % 8 != 0 {
            candle_core::bail!("{}: unaligned input offsets", self.name());
        }
        let (x, w) = (view(xs, xl, "x")?, view(ws, wl, "w")?);
        let dev = xs.device();
        let (func, grid, warps) = match kern {
            RowKernel::Gemv => (
                dev.get_or_load_custom_func(&format!("gemv_bf16_m{m}"), "dflash_gemv", PTX)?,
                (n as u32).div_ceil(WARPS_PER_BLOCK),
                WARPS_PER_BLOCK,
            ),
            RowKernel::Mma => {
                let c = mma_config(n);
                let name = format!(
                    "{}_t{}{}",
                    c.name,
                    if m <= 8 { 1 } else { 2 },
                    if f32_out { "_f32" } else { "" }
                );
                (
                    dev.get_or_load_custom_func(&name, "dflash_mma", MMA_PTX)?,
                    (n as u32).div_ceil(c.rows_per_block),
                    c.warps,
                )
            }
        };
        // SAFETY: every element is written by the kernel.
        let (y32, y16) = if f32_out {
            (Some(unsafe { dev.alloc::<f32>(batch * m * n)? }), None)
        } else {
            (None, Some(unsafe { dev.alloc::<bf16>(batch * m * n)? }))
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, batch as u32, 1),
            block_dim: (32 * warps, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m_i, n_i, k_i) = (m as i32, n as i32, k as i32);
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&w);
        match (&y32, &y16) {
            (Some(y), _) => b.arg(y),
            (_, Some(y)) => b.arg(y),
            _ => unreachable!("one output is allocated above"),
        };
        // gemv_bf16_m<M> has the row count in its name; gemm_bf16_t<T> takes it.
        if kern == RowKernel::Mma {
            b.arg(&m_i);
        }
        b.arg(&n_i);
        b.arg(&k_i);
        // SAFETY: argument types match the kernel's signature; sizes checked above.
        unsafe { b.launch(cfg) }.w()?;
        let shape = if xl.shape().rank() == 3 {
            Shape::from((batch, m, n))
        } else {
            Shape::from((m, n))
        };
        let y = match (y32, y16) {
            (Some(y), _) => CudaStorage::wrap_cuda_slice(y, dev.clone()),
            (_, Some(y)) => CudaStorage::wrap_cuda_slice(y, dev.clone()),
            _ => unreachable!("one output is allocated above"),
        };
        Ok((y, shape))
    }
}

/// `x [.., K] @ w[N, K]^T` with `kern` when it applies (CUDA, bf16, 1..=`max_rows` rows of x,
/// K a multiple of the kernel's, N > 0, contiguous); None otherwise.
fn row_matmul(
    x: &Tensor,
    w: &Tensor,
    kern: RowKernel,
    max_rows: usize,
    f32_out: bool,
) -> candle_core::Result<Option<Tensor>> {
    if !x.device().is_cuda() || x.dtype() != DType::BF16 || w.dtype() != DType::BF16 {
        return Ok(None);
    }
    let dims = x.dims();
    let k = *dims.last().unwrap_or(&0);
    let m: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    if m == 0 || m > max_rows.min(kern.max_rows()) || k % kern.k_multiple() != 0 {
        return Ok(None);
    }
    if w.rank() != 2 || w.dim(1)? != k || w.dim(0)? == 0 {
        return Ok(None);
    }
    if !x.is_contiguous() || !w.is_contiguous() {
        return Ok(None);
    }
    let y = x
        .reshape((m, k))?
        .apply_op2_no_bwd(w, &RowMatmul(kern, f32_out))?;
    let mut out = dims.to_vec();
    *out.last_mut().expect("rank >= 1") = w.dim(0)?;
    Ok(Some(y.reshape(out)?))
}

/// `x [.., K] @ w[N, K]^T` with the GEMV kernel when it applies (CUDA, bf16, at most
/// `DFLASH_GEMV_ROWS` rows (default 1), K % 8 == 0, contiguous); None otherwise.
pub fn gemv(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    row_matmul(x, w, RowKernel::Gemv, gemv_rows(), false)
}

/// Most rows of x the tensor-core skinny GEMM handles (two 8-row tiles of the mma's B operand).
pub const MMA_MAX_ROWS: usize = 16;

/// One compiled blocking of kernels/mma.cu (see the GEMM(...) lines there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaConfig {
    /// Kernel name without the `_t1` / `_t2` suffix.
    pub name: &'static str,
    /// Weight rows per block: 16 x TN x (BW / W).
    pub rows_per_block: u32,
    /// Warps per block (BW).
    pub warps: u32,
}

/// The skinny GEMM's blocking for a weight of `n` rows: picked from the weight's shape
/// only, never from the number of rows of x, which is what makes the kernel batch-invariant.
/// Chosen from the H200 measurements of `tools/gpu-bench/skinny` (docs/perf.md, run 5): narrow
/// weights need K split over 8 warps to fill the GPU; gate+up-sized ones (1k-4k tiles of 16
/// rows) go fastest with one warp per tile and 4 chunks in flight; the rest (K/V stacks,
/// LM heads) with 4 warps per tile of 32 rows.
pub fn mma_config(n: usize) -> MmaConfig {
    let tiles = n.div_ceil(16);
    if tiles < 512 {
        MmaConfig {
            name: "gemm_w8u2",
            rows_per_block: 16,
            warps: 8,
        }
    } else if (1024..4096).contains(&tiles) {
        MmaConfig {
            name: "gemm_w1u4",
            rows_per_block: 64,
            warps: 4,
        }
    } else {
        MmaConfig {
            name: "gemm_w4u2n2",
            rows_per_block: 32,
            warps: 4,
        }
    }
}

/// Batch-invariant mode (the switchboard's, on by default): `Linear::forward` multiplies
/// 1..=16 rows with the tensor-core skinny GEMM (kernels/mma.cu), whose bits for a row do not
/// depend on the rows beside it, so a 16-row verify reproduces the 1-row decode steps exactly
/// and greedy DFlash equals plain greedy decoding on the GPU too. `DFLASH_BATCH_INVARIANT=0`
/// takes the GEMV kernel (1 row) and cuBLAS (2+ rows) instead: ~3-5% faster per step on the
/// H200 (docs/perf.md, run 5), but bf16 verify and decode logits then differ in the last bits
/// and near-ties can flip (spec: documented near-tie flips between 1-row and Q-row kernels).
pub use crate::switches::{batch_invariant, set_batch_invariant};

/// `x [.., K] @ w[N, K]^T` with the tensor-core skinny GEMM in batch-invariant mode
/// ([`batch_invariant`]) when it applies (CUDA, bf16, 1..=16 rows, K % 32 == 0, contiguous);
/// None otherwise.
pub fn mma(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !batch_invariant() {
        return Ok(None);
    }
    mma_forced(x, w)
}

/// A batch of skinny products `x [b, m, K] @ w [b, N, K]^T -> [b, m, N]` (1..=16 rows each)
/// with the batch-invariant tensor-core kernel, when batch-invariant mode is on and it applies
/// (CUDA, bf16, K % 32 == 0, contiguous); None otherwise. MLA's absorbed per-head products.
pub fn mma_batched(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !batch_invariant()
        || !x.device().is_cuda()
        || x.dtype() != DType::BF16
        || w.dtype() != DType::BF16
        || x.rank() != 3
        || w.rank() != 3
        || !x.is_contiguous()
        || !w.is_contiguous()
    {
        return Ok(None);
    }
    let (b, m, k) = x.dims3()?;
    let (wb, n, k2) = w.dims3()?;
    if b != wb || k != k2 || m == 0 || m > MMA_MAX_ROWS || k % 32 != 0 || n == 0 {
        return Ok(None);
    }
    Ok(Some(
        x.apply_op2_no_bwd(w, &RowMatmul(RowKernel::Mma, false))?,
    ))
}

/// The skinny GEMM whether or not batch-invariant mode is on (tests and the probe call it).
pub fn mma_forced(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    row_matmul(x, w, RowKernel::Mma, MMA_MAX_ROWS, false)
}

/// [`mma`] with f32 output, each value the f32 of the bf16 that [`mma`] writes (bit for bit
/// `mma(x, w)?.to_dtype(F32)`, one launch instead of two): the LM head's logits.
pub fn mma_f32(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !batch_invariant() {
        return Ok(None);
    }
    row_matmul(x, w, RowKernel::Mma, MMA_MAX_ROWS, true)
}
