//! Own CUDA kernels (PTX built by build.rs from `kernels/*.cu`), wrapped as candle custom ops.
//! Only compiled with `--features cuda`; every entry point says when it does not apply, so the
//! caller falls back to the portable candle path.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaView;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, InplaceOp1, InplaceOp3,
    Layout, Shape, Storage, Tensor,
};
use half::bf16;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gemv.ptx"));
const FUSED_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
const MMA_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/mma.ptx"));

mod affine;
mod attention;
mod delta;
pub mod dflash2;
mod fp8;
mod fused;
pub mod graph;
mod matmul;
mod moe;
mod sampling;
mod train;

pub use affine::*;
pub use attention::*;
pub use delta::*;
pub use fp8::*;
pub use fused::*;
pub use matmul::*;
pub use moe::*;
pub use sampling::*;
pub use train::*;

// ---------------------------------------------------------------------------------------
// Fused kernels (kernels/fused.cu). Each wrapper returns None when its kernel does not apply
// (not CUDA, not bf16, a shape it does not handle), and the caller runs the candle path.

fn no_cpu(name: &str) -> candle_core::Result<(CpuStorage, Shape)> {
    candle_core::bail!("{name} is a CUDA kernel (the caller runs the portable path on CPU)")
}

/// The typed view of a contiguous operand.
fn view_of<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    let Some((o, e)) = l.contiguous_offsets() else {
        candle_core::bail!("dflash kernel: {what} must be contiguous");
    };
    Ok(s.as_cuda_slice::<T>()?.slice(o..e))
}

/// The bf16 view of a contiguous operand.
fn view<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> candle_core::Result<CudaView<'a, bf16>> {
    view_of(s, l, what)
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

/// Open CUDA device `ordinal` for dflash. Everything dflash launches goes to the device's one
/// stream, so cudarc's event tracking (two CUDA events created with every device buffer and
/// destroyed with it, recorded and waited on only once a second stream exists) is host time
/// spent for nothing on every tensor a forward makes; it is switched off before the first
/// buffer unless `DFLASH_CUDA_EVENTS=1` (switches). dflash never creates a second stream.
pub fn open_device(ordinal: usize) -> candle_core::Result<candle_core::Device> {
    let dev = candle_core::Device::new_cuda(ordinal)?;
    if !crate::switches::get().cuda_events {
        // SAFETY: one stream: no buffer is used on a stream other than the one that made it,
        // so no cross-stream synchronization is needed (the events' only purpose).
        unsafe { dev.as_cuda_device()?.disable_event_tracking() };
    }
    if crate::switches::get().cuda_pool_keep {
        // (a device without stream-ordered pools runs as before: said, not fatal)
        if let Err(e) = keep_pool(&dev) {
            tracing::warn!("{e}");
        }
    }
    Ok(dev)
}

/// cudarc allocates from the device's default memory pool (stream-ordered), whose release
/// threshold is 0: at every stream / event / context synchronization the pool hands all its
/// free memory back, so the next forward's buffers are mapped again. A batch step reads its
/// choices (a synchronization) and then allocates its activations anew, so every step paid
/// for fresh mappings. An unlimited threshold keeps freed memory in the pool for reuse (what
/// PyTorch's caching allocator does); memory in use by dflash's process then stays at its
/// high-water mark. Opt-in (`DFLASH_CUDA_POOL_KEEP=1`) until a GPU run measures it.
fn keep_pool(dev: &candle_core::Device) -> candle_core::Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let cuda = dev.as_cuda_device()?;
    let ordinal = cuda.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: a valid device handle and out-pointer; the attribute takes a u64 by pointer.
    let r = unsafe {
        let r = sys::cuDeviceGetDefaultMemPool(&mut pool, ordinal);
        if r != sys::CUresult::CUDA_SUCCESS {
            r
        } else {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
        }
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        candle_core::bail!(
            "CUDA memory pool release threshold not set ({r:?}): freed device memory is handed back at every synchronization (unset DFLASH_CUDA_POOL_KEEP to silence this)"
        );
    }
    Ok(())
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
