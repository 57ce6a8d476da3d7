//! Own CUDA kernels (PTX built by build.rs from `kernels/*.cu`), wrapped as candle custom ops.
//! Only compiled with `--features cuda`; every entry point says when it does not apply, so the
//! caller falls back to the portable candle path.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaView;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, InplaceOp3, Layout, Shape,
    Storage, Tensor,
};
use half::bf16;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gemv.ptx"));
const FUSED_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
const MMA_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/mma.ptx"));
/// Most rows of x one launch handles (the kernel keeps one accumulator per row).
pub const GEMV_MAX_ROWS: usize = 8;

/// Rows up to which `Linear::forward` takes the GEMV kernel instead of cuBLAS:
/// `DFLASH_GEMV_ROWS` (0..=8), default 1. Measured on the H200 at the Qwen3-8B shape (verify
/// forward, ms, GEMV up to 8 rows vs up to 1): Q=2 5.92 vs 5.86, Q=4 6.57 vs 5.91, Q=8 10.38
/// vs 6.09; Q=1 5.32 (GEMV) either way: past one row cuBLAS is as fast or faster.
fn gemv_rows() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("DFLASH_GEMV_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(1, |n: usize| n.min(GEMV_MAX_ROWS))
    })
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

struct RowMatmul(RowKernel);

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
        let kern = self.0;
        let (m, k) = xl.shape().dims2()?;
        let (n, k2) = wl.shape().dims2()?;
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
                let name = format!("{}_t{}", c.name, if m <= 8 { 1 } else { 2 });
                (
                    dev.get_or_load_custom_func(&name, "dflash_mma", MMA_PTX)?,
                    (n as u32).div_ceil(c.rows_per_block),
                    c.warps,
                )
            }
        };
        // SAFETY: every element is written by the kernel.
        let y = unsafe { dev.alloc::<bf16>(m * n)? };
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (32 * warps, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m_i, n_i, k_i) = (m as i32, n as i32, k as i32);
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&w);
        b.arg(&y);
        // gemv_bf16_m<M> has the row count in its name; gemm_bf16_t<T> takes it.
        if kern == RowKernel::Mma {
            b.arg(&m_i);
        }
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

/// `x [.., K] @ w[N, K]^T` with `kern` when it applies (CUDA, bf16, 1..=`max_rows` rows of x,
/// K a multiple of the kernel's, N > 0, contiguous); None otherwise.
fn row_matmul(
    x: &Tensor,
    w: &Tensor,
    kern: RowKernel,
    max_rows: usize,
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
    let y = x.reshape((m, k))?.apply_op2_no_bwd(w, &RowMatmul(kern))?;
    let mut out = dims.to_vec();
    *out.last_mut().expect("rank >= 1") = w.dim(0)?;
    Ok(Some(y.reshape(out)?))
}

/// `x [.., K] @ w[N, K]^T` with the GEMV kernel when it applies (CUDA, bf16, at most
/// `DFLASH_GEMV_ROWS` rows (default 1), K % 8 == 0, contiguous); None otherwise.
pub fn gemv(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    row_matmul(x, w, RowKernel::Gemv, gemv_rows())
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

/// Batch-invariant mode (`DFLASH_BATCH_INVARIANT=1`): `Linear::forward` multiplies 1..=16
/// rows with the tensor-core skinny GEMM (kernels/mma.cu), whose bits for a row do not depend
/// on the rows beside it, so a 16-row verify reproduces the 1-row decode steps exactly and
/// greedy DFlash equals plain greedy decoding on the GPU too. Off by default: on the H200 its
/// decode step is ~3% slower than the GEMV kernel (1 row) and cuBLAS (2+ rows), which is
/// what runs otherwise (docs/perf.md, run 5); bf16 verify and decode logits then differ in
/// the last bits and near-ties can flip (spec: documented near-tie flips between 1-row and
/// Q-row kernels). The same opt-in as vLLM's and SGLang's batch-invariant modes.
pub fn batch_invariant() -> bool {
    use std::sync::atomic::Ordering;
    match BATCH_INVARIANT.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on =
                std::env::var("DFLASH_BATCH_INVARIANT").is_ok_and(|v| !v.is_empty() && v != "0");
            BATCH_INVARIANT.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// 0 = not decided yet (read the environment), 1 = off, 2 = on.
static BATCH_INVARIANT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Turn batch-invariant mode on or off for the process (overrides `DFLASH_BATCH_INVARIANT`);
/// set it before loading models, not while one is generating.
pub fn set_batch_invariant(on: bool) {
    BATCH_INVARIANT.store(if on { 2 } else { 1 }, std::sync::atomic::Ordering::Relaxed);
}

/// `x [.., K] @ w[N, K]^T` with the tensor-core skinny GEMM in batch-invariant mode
/// ([`batch_invariant`]) when it applies (CUDA, bf16, 1..=16 rows, K % 32 == 0, contiguous);
/// None otherwise.
pub fn mma(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !batch_invariant() {
        return Ok(None);
    }
    mma_forced(x, w)
}

/// The skinny GEMM whether or not batch-invariant mode is on (tests and the probe call it).
pub fn mma_forced(x: &Tensor, w: &Tensor) -> candle_core::Result<Option<Tensor>> {
    row_matmul(x, w, RowKernel::Mma, MMA_MAX_ROWS)
}

// ---------------------------------------------------------------------------------------
// Fused kernels (kernels/fused.cu). Each wrapper returns None when its kernel does not apply
// (not CUDA, not bf16, a shape it does not handle), and the caller runs the candle path.

fn no_cpu(name: &str) -> candle_core::Result<(CpuStorage, Shape)> {
    candle_core::bail!("{name} is a CUDA kernel (the caller runs the portable path on CPU)")
}

/// The bf16 view of a contiguous operand.
fn view<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> candle_core::Result<CudaView<'a, bf16>> {
    let Some((o, e)) = l.contiguous_offsets() else {
        candle_core::bail!("dflash fused kernel: {what} must be contiguous");
    };
    Ok(s.as_cuda_slice::<bf16>()?.slice(o..e))
}

fn is_bf16_cuda(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.device().is_cuda() && t.dtype() == DType::BF16 && t.is_contiguous())
}

/// A tensor held by an op (weights, tables), locked for reading while the op launches.
struct Held<'a>(candle_core::StorageRef<'a>, &'a Layout);

impl<'a> Held<'a> {
    fn new(t: &'a Tensor) -> Self {
        let (s, l) = t.storage_and_layout();
        Held(s, l)
    }
    fn view(&self, what: &str) -> candle_core::Result<CudaView<'_, bf16>> {
        match &*self.0 {
            Storage::Cuda(s) => view(s, self.1, what),
            _ => candle_core::bail!("dflash fused kernel: {what} is not on the CUDA device"),
        }
    }
}

fn block_for(d: usize) -> u32 {
    (d.div_ceil(32) * 32).clamp(32, 1024) as u32
}

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

/// Whether the row kernels below take `logits`: CUDA, f32, `[rows, vocab]`, non-empty, a
/// vocabulary an i32 index covers.
fn logit_rows_apply(logits: &Tensor) -> candle_core::Result<bool> {
    Ok(logits.device().is_cuda()
        && logits.dtype() == DType::F32
        && logits.rank() == 2
        && logits.elem_count() > 0
        && logits.dim(1)? <= i32::MAX as usize / 2)
}

/// `(rows, vocab, view)` of a contiguous f32 `[rows, vocab]` op input.
fn logit_rows<'a>(
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

/// Where the heads sit in a projection output and how they are normed and rotated.
#[derive(Clone)]
pub struct HeadSource {
    /// Column of head 0's first value in each row of the source.
    pub offset: usize,
    /// Per-head RMSNorm weight `[head_dim]`.
    pub norm: Option<Tensor>,
    pub eps: f32,
    /// Dims rotated by RoPE (the first `rot` of each head).
    pub rot: usize,
}

fn norm_arg<'a>(h: &'a Option<Held<'a>>) -> candle_core::Result<Option<CudaView<'a, bf16>>> {
    h.as_ref().map(|h| h.view("head norm weight")).transpose()
}

struct KvWrite {
    k: HeadSource,
    v_offset: usize,
    kv_heads: usize,
    head_dim: usize,
    pos0: usize,
}

impl InplaceOp3 for KvWrite {
    fn name(&self) -> &'static str {
        "dflash-kv-write"
    }
    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!(
            "dflash-kv-write is a CUDA kernel (the caller appends with candle on CPU)"
        )
    }
    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dl: &Layout,
        ss: &CudaStorage,
        sl: &Layout,
        cs: &CudaStorage,
        cl: &Layout,
    ) -> candle_core::Result<()> {
        let (n, stride) = sl.shape().dims2()?;
        let (two, kvh, cap, d) = dl.shape().dims4()?;
        let (d_ok, cs_ok) = (
            d == self.head_dim && two == 2 && kvh == self.kv_heads,
            cl.shape().dims2()? == (n, self.k.rot),
        );
        if !d_ok || !cs_ok || self.pos0 + n > cap {
            candle_core::bail!(
                "dflash-kv-write: src {:?} tables {:?} cache {:?} at {}",
                sl.shape(),
                cl.shape(),
                dl.shape(),
                self.pos0
            );
        }
        let dev = dst.device().clone();
        let src = view(ss, sl, "projection")?;
        let tab = view(cs, cl, "rope tables")?;
        let held = self.k.norm.as_ref().map(Held::new);
        let kw = norm_arg(&held)?;
        let Some((o, e)) = dl.contiguous_offsets() else {
            candle_core::bail!("dflash-kv-write: cache must be contiguous");
        };
        let mut kv = dst.as_cuda_slice_mut::<bf16>()?.slice_mut(o..e);
        let func = dev.get_or_load_custom_func("kv_write_bf16", "dflash_fused", FUSED_PTX)?;
        let threads = block_for(d);
        let cfg = LaunchConfig {
            grid_dim: (kvh as u32, n as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: (d * 4) as u32,
        };
        let (stride_i, k_off, v_off) = (stride as i32, self.k.offset as i32, self.v_offset as i32);
        let (eps, rot, kvh_i, cap_i, pos_i, d_i) = (
            self.k.eps,
            self.k.rot as i32,
            kvh as i32,
            cap as i64,
            self.pos0 as i32,
            d as i32,
        );
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&stride_i);
        b.arg(&k_off);
        b.arg(&v_off);
        match &kw {
            Some(w) => b.arg(w),
            None => b.arg(&null),
        };
        b.arg(&eps);
        b.arg(&tab);
        b.arg(&rot);
        b.arg(&mut kv);
        b.arg(&kvh_i);
        b.arg(&cap_i);
        b.arg(&pos_i);
        b.arg(&d_i);
        // SAFETY: argument types match the kernel; shapes and bounds checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// Write rows `pos0 .. pos0 + n` of a joint KV cache `kv [2, kv_heads, cap, head_dim]` from a
/// projection output `src [n, ..]`: keys normed + roped from `k`, values copied from column
/// `v_offset`. `tables [n, rot]` is the packed `cos | sin` of the rows' positions. Returns
/// false (nothing written) when the kernel does not apply.
pub fn kv_write(
    kv: &Tensor,
    src: &Tensor,
    tables: &Tensor,
    k: &HeadSource,
    v_offset: usize,
    pos0: usize,
) -> candle_core::Result<bool> {
    let mut ts = vec![kv, src, tables];
    if let Some(w) = &k.norm {
        ts.push(w);
    }
    if !is_bf16_cuda(&ts) || kv.rank() != 4 || src.rank() != 2 {
        return Ok(false);
    }
    let (_, kv_heads, _, head_dim) = kv.dims4()?;
    if head_dim > 1024 || k.rot > head_dim || k.rot % 2 != 0 {
        return Ok(false);
    }
    let op = KvWrite {
        k: k.clone(),
        v_offset,
        kv_heads,
        head_dim,
        pos0,
    };
    kv.inplace_op3(src, tables, &op)?;
    Ok(true)
}

/// Head dims the attention kernel is built for.
pub const ATTN_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Which keys a query row sees.
#[derive(Clone, Copy, Debug)]
pub struct Visibility {
    pub causal: bool,
    /// Sliding window: key j is visible to the query at position p iff j + window > p.
    pub window: Option<usize>,
}

/// Keys per attention block (see `Attend::cuda_fwd`). 64 is what the row-dependent rule it
/// replaced chose at the benchmark's shape (32 heads, context 128, 1 or 16 rows).
const ATTN_CHUNK: usize = 64;

struct Attend {
    q: HeadSource,
    heads: usize,
    scale: f32,
    kv_len: usize,
    q_pos0: usize,
    vis: Visibility,
}

impl CustomOp3 for Attend {
    fn name(&self) -> &'static str {
        "dflash-attention"
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
        ss: &CudaStorage,
        sl: &Layout,
        cs: &CudaStorage,
        cl: &Layout,
        ks: &CudaStorage,
        kl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (n, stride) = sl.shape().dims2()?;
        let (two, kvh, cap, d) = kl.shape().dims4()?;
        let heads = self.heads;
        let ok = two == 2
            && ATTN_HEAD_DIMS.contains(&d)
            && heads % kvh == 0
            && self.kv_len <= cap
            && self.kv_len > 0
            && cl.shape().dims2()? == (n, self.q.rot)
            && self.q.offset + heads * d <= stride;
        if !ok {
            candle_core::bail!(
                "dflash-attention: src {:?} tables {:?} cache {:?} heads {heads} len {}",
                sl.shape(),
                cl.shape(),
                kl.shape(),
                self.kv_len
            );
        }
        let dev = ss.device();
        let src = view(ss, sl, "projection")?;
        let tab = view(cs, cl, "rope tables")?;
        let kv = view(ks, kl, "kv cache")?;
        let held = self.q.norm.as_ref().map(Held::new);
        let qw = norm_arg(&held)?;
        // Keys split into fixed chunks of ATTN_CHUNK from position 0, one block each, merged by
        // attn_combine. Fixed, so that a query row's arithmetic (which keys each block and
        // warp sums, in which order) depends on its position only, not on how many rows the
        // call has or how long the cache is: a verify reproduces the decode steps bit for bit
        // (with one split the kernel writes a / L itself, which is what the combine computes
        // from one non-empty split).
        let rows = heads * n;
        let chunk = ATTN_CHUNK;
        let splits = self.kv_len.div_ceil(chunk);
        // SAFETY: every element is written (by attn with one split, else by attn_combine).
        let out = unsafe { dev.alloc::<bf16>(n * heads * d)? };
        let part = unsafe {
            dev.alloc::<f32>(if splits > 1 {
                rows * splits * (d + 2)
            } else {
                1
            })?
        };
        let func =
            dev.get_or_load_custom_func(&format!("attn_bf16_d{d}"), "dflash_fused", FUSED_PTX)?;
        // One block per (KV head, key chunk, group of (row, head) pairs): kernels/fused.cu's ATTN.
        let pairs_per_block = if d > 128 { 4 } else { 8 };
        let groups = (n * (heads / kvh)).div_ceil(pairs_per_block);
        let cfg = LaunchConfig {
            grid_dim: (kvh as u32, splits as u32, groups as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (stride_i, q_off, eps, rot, scale) = (
            stride as i32,
            self.q.offset as i32,
            self.q.eps,
            self.q.rot as i32,
            self.scale,
        );
        let (kvh_i, cap_i, len_i, rep_i, pos_i) = (
            kvh as i32,
            cap as i64,
            self.kv_len as i32,
            (heads / kvh) as i32,
            self.q_pos0 as i32,
        );
        let (causal, window, chunk_i) = (
            self.vis.causal as i32,
            self.vis.window.unwrap_or(0).min(i32::MAX as usize) as i32,
            chunk as i32,
        );
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&stride_i);
        b.arg(&q_off);
        match &qw {
            Some(w) => b.arg(w),
            None => b.arg(&null),
        };
        b.arg(&eps);
        b.arg(&tab);
        b.arg(&rot);
        b.arg(&scale);
        b.arg(&kv);
        b.arg(&kvh_i);
        b.arg(&cap_i);
        b.arg(&len_i);
        b.arg(&rep_i);
        b.arg(&pos_i);
        b.arg(&causal);
        b.arg(&window);
        b.arg(&chunk_i);
        let n_i = n as i32;
        b.arg(&n_i);
        b.arg(&out);
        b.arg(&part);
        // SAFETY: argument types match the kernel; shapes and bounds checked above.
        unsafe { b.launch(cfg) }.w()?;
        if splits > 1 {
            let func =
                dev.get_or_load_custom_func("attn_combine_bf16", "dflash_fused", FUSED_PTX)?;
            let cfg = LaunchConfig {
                grid_dim: (heads as u32, n as u32, 1),
                block_dim: (block_for(d), 1, 1),
                shared_mem_bytes: 0,
            };
            let (splits_i, d_i) = (splits as i32, d as i32);
            let mut b = func.builder();
            b.arg(&part);
            b.arg(&out);
            b.arg(&splits_i);
            b.arg(&d_i);
            // SAFETY: argument types match the kernel.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, heads * d)),
        ))
    }
}

/// Attention of the `n` query rows of `src [n, ..]` (heads at `q`, normed + roped + scaled in
/// the kernel; row i at position `q_pos0 + i`) over the first `kv_len` rows of the joint
/// cache `kv [2, kv_heads, cap, head_dim]`. Returns `[n, heads * head_dim]`, or None when the
/// kernel does not apply.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    src: &Tensor,
    tables: &Tensor,
    kv: &Tensor,
    q: &HeadSource,
    heads: usize,
    scale: f32,
    kv_len: usize,
    q_pos0: usize,
    vis: Visibility,
) -> candle_core::Result<Option<Tensor>> {
    let mut ts = vec![src, tables, kv];
    if let Some(w) = &q.norm {
        ts.push(w);
    }
    if !is_bf16_cuda(&ts) || kv.rank() != 4 || src.rank() != 2 {
        return Ok(None);
    }
    let (_, kvh, _, d) = kv.dims4()?;
    if !ATTN_HEAD_DIMS.contains(&d)
        || heads % kvh != 0
        || q.rot > d
        || q.rot % 2 != 0
        || kv_len == 0
    {
        return Ok(None);
    }
    let op = Attend {
        q: q.clone(),
        heads,
        scale,
        kv_len,
        q_pos0,
        vis,
    };
    Ok(Some(src.apply_op3_no_bwd(tables, kv, &op)?))
}

// ---------------------------------------------------------------------------------------
// Timing helper for the micro bench: how long a piece of work takes on the GPU when the host
// is not what it waits for.

/// Run `issue` (which must only enqueue work, no host syncs) behind a `spin_us` busy kernel, so
/// the host has queued everything before the GPU starts on it. Returns its result, the GPU
/// time from the end of the spin to the end of the work (ms) and the host time `issue` took
/// (ms). When the GPU time is well below the usual synchronized wall time, the step is bound
/// by launching (host) rather than by the kernels.
pub fn gpu_time_host_ahead<T>(
    dev: &candle_core::Device,
    spin_us: u32,
    issue: impl FnOnce() -> crate::Result<T>,
) -> crate::Result<(T, f64, f64)> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let cuda = dev.as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let func = cuda.get_or_load_custom_func("spin", "dflash_fused", FUSED_PTX)?;
    // ~2 GHz SM clock: cycles = 2000 per us (the spin only has to outlast the host's enqueue).
    let cycles = spin_us as i64 * 2000;
    let mut b = func.builder();
    b.arg(&cycles);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: spin(long long) takes one i64.
    unsafe { b.launch(cfg) }.w()?;
    let ev = |s: &candle_core::cuda_backend::cudarc::driver::CudaStream| {
        s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()
    };
    let start = ev(&stream)?;
    let t = std::time::Instant::now();
    let out = issue()?;
    let host_ms = t.elapsed().as_secs_f64() * 1e3;
    let end = ev(&stream)?;
    let gpu_ms = start.elapsed_ms(&end).w()? as f64;
    Ok((out, gpu_ms, host_ms))
}
