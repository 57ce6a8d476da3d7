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
/// rounding: what a bf16 output cast to f32 holds) for the LM head's logits; an [`Epilogue`]:
/// the skinny GEMM does a DFlash2 convolution with its product.
struct RowMatmul(RowKernel, bool, Option<Epilogue>);

/// A DFlash2 convolution (`nn::dyn_conv`) done by the skinny GEMM with its product.
#[derive(Clone)]
enum Epilogue {
    /// The product convolved over its rows: only that is stored ([`mma_conv`]).
    Finish(ConvEpilogue),
    /// The product is the kernel projection of x, and x is convolved with its preparing half:
    /// both are stored ([`mma_kconv`]).
    Prepare(ConvPrepare),
}

/// The preparing convolution of a DFlash2 layer's input x `[m, h]` with the first half of its
/// kernel projection: `base [K, h]` (the base kernel), channel groups of `group`, blocks of
/// `block` rows.
#[derive(Clone)]
pub struct ConvPrepare {
    pub base: Tensor,
    pub group: usize,
    pub block: usize,
}

/// The DFlash2 finishing convolution (`nn::dyn_conv`) of a product, applied in the skinny
/// GEMM's epilogue: `dynk [m, K*G]` (rows of unit column stride: a column slice of the kernel
/// projection is fine), `base [K, n]`, channel groups of `group`, blocks of `block` rows.
#[derive(Clone)]
pub struct ConvEpilogue {
    pub dynk: Tensor,
    pub base: Tensor,
    pub group: usize,
    pub block: usize,
}

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
        let (kern, f32_out, epi) = (self.0, self.1, self.2.as_ref());
        if (f32_out || epi.is_some()) && kern != RowKernel::Mma {
            candle_core::bail!(
                "{}: f32 output and the convolutions are the skinny GEMM's only",
                self.name()
            );
        }
        if f32_out && epi.is_some() {
            candle_core::bail!("{}: the convolving epilogues write bf16", self.name());
        }
        let (conv, prep) = match epi {
            Some(Epilogue::Finish(c)) => (Some(c), None),
            Some(Epilogue::Prepare(p)) => (None, Some(p)),
            None => (None, None),
        };
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
                if conv.is_some() && !c.staged {
                    candle_core::bail!("{}: {} has no convolving epilogue", self.name(), c.name);
                }
                if prep.is_some() && !c.one_tile {
                    candle_core::bail!("{}: {} has no preparing epilogue", self.name(), c.name);
                }
                let name = format!(
                    "{}_t{}{}",
                    c.name,
                    if m <= 8 { 1 } else { 2 },
                    match (f32_out, epi) {
                        (true, _) => "_f32",
                        (_, Some(Epilogue::Finish(_))) => "_conv",
                        (_, Some(Epilogue::Prepare(_))) => "_kconv",
                        (_, None) => "",
                    }
                );
                (
                    dev.get_or_load_custom_func(&name, "dflash_mma", MMA_PTX)?,
                    (n as u32).div_ceil(c.rows_per_block),
                    c.warps,
                )
            }
        };
        // The preparing form writes the convolved x [m, k] then the projection [m, n] into one
        // buffer (split by `mma_kconv`).
        let prep_args = match prep {
            Some(p) => Some(prepare_args(p, batch, m, n, k)?),
            None => None,
        };
        let len = batch * m * n + if prep.is_some() { m * k } else { 0 };
        // SAFETY: every element is written by the kernel.
        let (y32, y16) = if f32_out {
            (Some(unsafe { dev.alloc::<f32>(len)? }), None)
        } else {
            (None, Some(unsafe { dev.alloc::<bf16>(len)? }))
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, batch as u32, 1),
            block_dim: (32 * warps, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m_i, n_i, k_i) = (m as i32, n as i32, k as i32);
        let stream = dev.cuda_stream();
        // The preparing form's two outputs in y16 (raw device pointers; the guard keeps y16
        // borrowed while launching).
        let (prep_ptrs, prep_guard) = match (&prep_args, &y16) {
            (Some(_), Some(y)) => {
                use candle_core::cuda_backend::cudarc::driver::DevicePtr;
                let (p, g) = y.device_ptr(&stream);
                (Some((p + (m * k * 2) as u64, p)), Some(g))
            }
            _ => (None, None),
        };
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&w);
        match (&y32, &y16, &prep_ptrs) {
            (_, _, Some((y, _))) => b.arg(y),
            (Some(y), _, _) => b.arg(y),
            (_, Some(y), _) => b.arg(y),
            _ => unreachable!("one output is allocated above"),
        };
        // gemv_bf16_m<M> has the row count in its name; gemm_bf16_t<T> takes it.
        if kern == RowKernel::Mma {
            b.arg(&m_i);
        }
        b.arg(&n_i);
        b.arg(&k_i);
        // The convolution's operands, held (locked for reading) while launching.
        let args = match conv {
            Some(cv) => Some(conv_args(cv, batch, m, n)?),
            None => None,
        };
        let hd = conv.map(|cv| Held::new(&cv.dynk));
        let hb = conv.map(|cv| Held::new(&cv.base));
        let dyn_v = match (&hd, conv) {
            (Some(h), Some(cv)) => match &*h.0 {
                Storage::Cuda(ds) => Some(
                    ds.as_cuda_slice::<bf16>()?
                        .slice(cv.dynk.layout().start_offset()..),
                ),
                _ => candle_core::bail!("{}: the dynamic kernel is not on the device", self.name()),
            },
            _ => None,
        };
        let base_v = match &hb {
            Some(h) => Some(h.view("conv base kernel")?),
            None => None,
        };
        if let (Some(d), Some(bv), Some((stride, ck, group, block))) = (&dyn_v, &base_v, &args) {
            b.arg(d);
            b.arg(stride);
            b.arg(bv);
            b.arg(ck);
            b.arg(group);
            b.arg(block);
        }
        let hp = prep.map(|p| Held::new(&p.base));
        let pbase_v = match &hp {
            Some(h) => Some(h.view("conv base kernel")?),
            None => None,
        };
        if let (Some((_, xc)), Some(bv), Some((ck, group, block))) =
            (&prep_ptrs, &pbase_v, &prep_args)
        {
            b.arg(xc);
            b.arg(bv);
            b.arg(ck);
            b.arg(group);
            b.arg(block);
        }
        // SAFETY: argument types match the kernel's signature; sizes checked above.
        unsafe { b.launch(cfg) }.w()?;
        drop(prep_guard);
        let shape = if prep.is_some() {
            Shape::from(len)
        } else if xl.shape().rank() == 3 {
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

/// Checks a preparing epilogue against a kernel projection of `m` rows of x `[m, k]` into `n`
/// columns; gives (K, group, block) as the kernel takes them.
fn prepare_args(
    p: &ConvPrepare,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> candle_core::Result<(i32, i32, i32)> {
    let (ck, hb) = p.base.dims2()?;
    let g = k / p.group.max(1);
    if batch != 1
        || p.group == 0
        || g * p.group != k
        || hb != k
        || ck == 0
        || 16 % ck != 0
        || (ck * g) % 16 != 0
        || n != 2 * ck * g
        || p.block == 0
        || m % p.block != 0
        || p.base.dtype() != DType::BF16
        || !p.base.is_contiguous()
        // the kernel's shared slabs (skinny.cuh, kconv_prefetch): at most 256 channels a
        // block, in 16-byte pieces from 16-byte aligned rows
        || p.group > 16
        || (16 / ck * p.group) % 8 != 0
        || p.base.layout().start_offset() % 8 != 0
    {
        candle_core::bail!(
            "dflash-mma-bf16: preparing convolution of x [{m}, {k}] with a kernel projection of {n} columns, base {:?} group {} block {}",
            p.base.shape(),
            p.group,
            p.block
        );
    }
    Ok((ck as i32, p.group as i32, p.block as i32))
}

/// Checks a convolving epilogue against a product of `m` rows and `n` columns (`n` is the
/// convolution's channels); gives the dynamic kernel's row stride and (K, group, block) as
/// the kernel takes them.
fn conv_args(
    cv: &ConvEpilogue,
    batch: usize,
    m: usize,
    n: usize,
) -> candle_core::Result<(i64, i32, i32, i32)> {
    let (ck, hb) = cv.base.dims2()?;
    let dl = cv.dynk.layout();
    let g = n / cv.group.max(1);
    if batch != 1
        || cv.group == 0
        || g * cv.group != n
        || hb != n
        || cv.block == 0
        || m % cv.block != 0
        || cv.dynk.dims2()? != (m, ck * g)
        || dl.stride()[1] != 1
        || cv.dynk.dtype() != DType::BF16
        || cv.base.dtype() != DType::BF16
        || !cv.base.is_contiguous()
        || !cv.dynk.device().is_cuda()
    {
        candle_core::bail!(
            "dflash-mma-bf16: convolution of a [{m}, {n}] product with dynamic {:?} base {:?} group {} block {}",
            cv.dynk.shape(),
            cv.base.shape(),
            cv.group,
            cv.block
        );
    }
    Ok((
        dl.stride()[0] as i64,
        ck as i32,
        cv.group as i32,
        cv.block as i32,
    ))
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
        .apply_op2_no_bwd(w, &RowMatmul(kern, f32_out, None))?;
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

/// Weights of at most this many tiles of 16 rows take 16 warps a tile (`tools/gpu-bench/skinny`,
/// session 26: a 64-tile weight 7.8 -> 6.2 us at one row, 9.1 -> 7.7 at 16; a 128-tile o_proj
/// 8.9 -> 8.2; a 32-tile router 5.1 -> 4.2; the DFlash2 draft step, session 31, docs/perf.md).
const NARROW16_TILES: usize = 128;

/// One compiled blocking of kernels/mma.cu (see the GEMM(...) lines there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaConfig {
    /// Kernel name without the `_t1` / `_t2` suffix.
    pub name: &'static str,
    /// Weight rows per block: 16 x TN x (BW / W).
    pub rows_per_block: u32,
    /// Warps per block (BW).
    pub warps: u32,
    /// Its warps split K and sum a tile in shared memory (W > 1): the blockings with a
    /// convolving epilogue (`_conv` forms, [`mma_conv`]).
    pub staged: bool,
    /// One tile of 16 weight rows a block (W = BW, TN = 1): the blockings with a preparing
    /// epilogue (`_kconv` forms, [`mma_kconv`]).
    pub one_tile: bool,
}

/// The skinny GEMM's blocking for a weight of `n` rows: picked from the weight's shape
/// only, never from the number of rows of x, which is what makes the kernel batch-invariant.
/// Chosen from the H200 measurements of `tools/gpu-bench/skinny` (docs/perf.md, run 5 and
/// sessions 26 and 31): narrow weights need K split over many warps to fill the GPU (16 up to
/// [`NARROW16_TILES`] tiles of 16 rows, 8 up to 512); gate+up-sized ones (1k-4k tiles) go
/// fastest with one warp per tile and 4 chunks in flight; the rest (K/V stacks, LM heads) with
/// 4 warps per tile of 32 rows.
pub fn mma_config(n: usize) -> MmaConfig {
    let tiles = n.div_ceil(16);
    if tiles <= NARROW16_TILES {
        MmaConfig {
            name: "gemm_w16u2",
            rows_per_block: 16,
            warps: 16,
            staged: true,
            one_tile: true,
        }
    } else if tiles < 512 {
        MmaConfig {
            name: "gemm_w8u2",
            rows_per_block: 16,
            warps: 8,
            staged: true,
            one_tile: true,
        }
    } else if (1024..4096).contains(&tiles) {
        MmaConfig {
            name: "gemm_w1u4",
            rows_per_block: 64,
            warps: 4,
            staged: false,
            one_tile: false,
        }
    } else {
        MmaConfig {
            name: "gemm_w4u2n2",
            rows_per_block: 32,
            warps: 4,
            staged: true,
            one_tile: false,
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
    Ok(Some(x.apply_op2_no_bwd(
        w,
        &RowMatmul(RowKernel::Mma, false, None),
    )?))
}

/// The skinny GEMM whether or not batch-invariant mode is on (tests and the probe call it).
pub fn mma_forced(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    row_matmul(x, w, RowKernel::Mma, MMA_MAX_ROWS, false)
}

/// `((m, k), n)` of a product `x [m, k] @ w [n, k]^T` that the skinny GEMM's epilogue forms
/// take (batch-invariant mode, CUDA, bf16, 2-D contiguous operands, 1..=16 rows, K % 32 == 0);
/// None otherwise.
fn skinny_2d(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<((usize, usize), usize)>> {
    if !batch_invariant()
        || !x.device().is_cuda()
        || x.dtype() != DType::BF16
        || w.dtype() != DType::BF16
        || x.rank() != 2
        || w.rank() != 2
        || !x.is_contiguous()
        || !w.is_contiguous()
    {
        return Ok(None);
    }
    let (m, k) = x.dims2()?;
    let (n, k2) = w.dims2()?;
    if k != k2 || m == 0 || m > MMA_MAX_ROWS || k % 32 != 0 || n == 0 {
        return Ok(None);
    }
    Ok(Some(((m, k), n)))
}

/// `dyn_conv(x @ w^T, ...)` (the DFlash2 finishing convolution of a product, `nn::dyn_conv`)
/// in one launch: the skinny GEMM rounds its product to bf16 as [`mma`] stores it and
/// convolves that over the rows in its epilogue, with the convolution kernel's arithmetic
/// (kernels/dyn_conv.cuh), so the bits are those of [`mma`] then `nn::dyn_conv`'s kernel. Batch-
/// invariant mode only (the product is [`mma`]'s), CUDA, bf16, 1..=16 rows in whole blocks, a
/// weight whose blocking sums in shared memory ([`MmaConfig::staged`]); None otherwise.
pub fn mma_conv(
    x: &Tensor,
    w: &Tensor,
    conv: &ConvEpilogue,
) -> candle_core::Result<Option<Tensor>> {
    let Some((_, n)) = skinny_2d(x, w)? else {
        return Ok(None);
    };
    if !mma_config(n).staged {
        return Ok(None);
    }
    Ok(Some(x.apply_op2_no_bwd(
        w,
        &RowMatmul(RowKernel::Mma, false, Some(Epilogue::Finish(conv.clone()))),
    )?))
}

/// The kernel projection `dynk = x @ w^T` of a DFlash2 convolution (`w [2 K G, h]`: the
/// preparing half's columns, then the finishing half's) and the preparing convolution of x
/// with its first half, `dyn_conv(x, dynk[:, ..K G], base, group, block)`, in one launch: the
/// skinny GEMM's blocks gather each group's K offsets into one tile and convolve x over its
/// channels in the epilogue, with the convolution kernel's arithmetic, so both outputs have
/// the bits of [`mma`] and `nn::dyn_conv`'s kernel. Gives `(convolved x [m, h], dynk [m, 2 K
/// G])`. Batch-invariant mode only, CUDA, bf16, 1..=16 rows in whole blocks, K dividing 16,
/// K G a multiple of 16, a blocking of one tile a block ([`MmaConfig::one_tile`]); None
/// otherwise.
pub fn mma_kconv(
    x: &Tensor,
    w: &Tensor,
    prep: &ConvPrepare,
) -> candle_core::Result<Option<(Tensor, Tensor)>> {
    let Some(((m, k), n)) = skinny_2d(x, w)? else {
        return Ok(None);
    };
    let ck = prep.base.dim(0)?;
    let g = k / prep.group.max(1);
    if !mma_config(n).one_tile
        || ck == 0
        || 16 % ck != 0
        || (ck * g) % 16 != 0
        // the epilogue's shared copy of x and the base kernel over a block's channels
        // (kernels/skinny.cuh, kconv_prefetch): at most 256 channels in 16-byte pieces
        || prep.group > 16
        || (16 / ck * prep.group) % 8 != 0
        || prep.base.layout().start_offset() % 8 != 0
    {
        return Ok(None);
    }
    let out = x.apply_op2_no_bwd(
        w,
        &RowMatmul(RowKernel::Mma, false, Some(Epilogue::Prepare(prep.clone()))),
    )?;
    Ok(Some((
        out.narrow(0, 0, m * k)?.reshape((m, k))?,
        out.narrow(0, m * k, m * n)?.reshape((m, n))?,
    )))
}

/// [`mma`] with f32 output, each value the f32 of the bf16 that [`mma`] writes (bit for bit
/// `mma(x, w)?.to_dtype(F32)`, one launch instead of two): the LM head's logits.
pub fn mma_f32(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !batch_invariant() {
        return Ok(None);
    }
    row_matmul(x, w, RowKernel::Mma, MMA_MAX_ROWS, true)
}
