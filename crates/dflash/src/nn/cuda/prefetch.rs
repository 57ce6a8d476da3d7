//! Weights of a coming projection brought into L2 ahead of it (`kernels/fused.cu`
//! `l2_prefetch`), on a side stream, so they stream in while the kernels in between (norms,
//! K/V write, attention, routing: latency-bound, DRAM idle) run. A MoE layer at hidden 2048
//! spends ~30 us of its ~88 us in such kernels (docs/perf.md, session 28).
//!
//! The side stream forks from the device's stream at the call (an event recorded there, waited
//! on by the side stream), so the prefetch starts once everything enqueued before it has run
//! and never delays what comes after: inside a CUDA graph capture it becomes a branch beside
//! the main chain, joined back before the capture ends ([`join_capture`], called by
//! `graph::capture`). A prefetch only warms the cache: no result depends on whether or when it
//! runs. Off unless `DFLASH_TRY=prefetch` ([`crate::switches::Trial::Prefetch`]).

use super::*;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, DevicePtr};
use candle_core::cuda_backend::CudaDevice;
use std::sync::{Arc, Mutex};

/// One device's side stream and its two events.
struct Side {
    device: candle_core::cuda_backend::DeviceId,
    stream: Arc<CudaStream>,
    /// Recorded on the device's stream at each fork.
    fork: CudaEvent,
    /// Recorded on the side stream after each prefetch.
    done: CudaEvent,
    /// A prefetch was enqueued during the current capture (so the capture must join it).
    in_capture: bool,
}

// SAFETY: the stream and events are used under the mutex only.
unsafe impl Send for Side {}

static SIDES: Mutex<Vec<Side>> = Mutex::new(Vec::new());

fn side_of<'a>(sides: &'a mut Vec<Side>, cuda: &CudaDevice) -> candle_core::Result<&'a mut Side> {
    let id = cuda.id();
    if let Some(i) = sides.iter().position(|s| s.device == id) {
        return Ok(&mut sides[i]);
    }
    let main = cuda.cuda_stream();
    let ctx = main.context().clone();
    sides.push(Side {
        device: id,
        stream: ctx.new_stream().w()?,
        fork: ctx.new_event(None).w()?,
        done: ctx.new_event(None).w()?,
        in_capture: false,
    });
    Ok(sides.last_mut().expect("just pushed"))
}

/// Prefetch `w`'s bytes into L2 on the side stream (nothing when it is not a CUDA tensor or the
/// trial is off).
pub fn prefetch_l2(w: &Tensor) -> candle_core::Result<()> {
    if !crate::switches::trial(crate::switches::Trial::Prefetch) || !w.device().is_cuda() {
        return Ok(());
    }
    let candle_core::Device::Cuda(cuda) = w.device() else {
        return Ok(());
    };
    let (s, l) = w.storage_and_layout();
    let Storage::Cuda(cs) = &*s else {
        return Ok(());
    };
    let Some((o, e)) = l.contiguous_offsets() else {
        return Ok(());
    };
    let main = cuda.cuda_stream();
    fn raw<T>(cs: &CudaStorage, o: usize, e: usize, st: &CudaStream) -> candle_core::Result<u64>
    where
        T: candle_core::cuda_backend::CudaDType,
    {
        Ok(cs.as_cuda_slice::<T>()?.slice(o..e).device_ptr(st).0)
    }
    let ptr = match w.dtype() {
        DType::BF16 => raw::<bf16>(cs, o, e, &main)?,
        DType::F32 => raw::<f32>(cs, o, e, &main)?,
        DType::U8 => raw::<u8>(cs, o, e, &main)?,
        DType::U32 => raw::<u32>(cs, o, e, &main)?,
        _ => return Ok(()),
    };
    let bytes = (e - o) * w.dtype().size_in_bytes();
    // 16-byte aligned start, whole 16-byte units (the instruction's rule).
    let lead = (16 - ptr % 16) % 16;
    let bytes = (bytes as u64).saturating_sub(lead) & !15;
    if bytes == 0 {
        return Ok(());
    }
    let ptr = ptr + lead;
    let func = cuda.get_or_load_custom_func("l2_prefetch", "dflash_fused", FUSED_PTX)?;
    let mut sides = SIDES
        .lock()
        .map_err(|_| candle_core::Error::Msg("prefetch: poisoned".into()))?;
    let side = side_of(&mut sides, cuda)?;
    side.fork.record(&main).w()?;
    side.stream.wait(&side.fork).w()?;
    let pieces = bytes.div_ceil(4096);
    let cfg = LaunchConfig {
        grid_dim: (pieces.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = side.stream.launch_builder(&func);
    b.arg(&ptr);
    b.arg(&bytes);
    // SAFETY: l2_prefetch(const char*, unsigned long long): an address inside w's buffer and a
    // byte count that stays inside it; the kernel only issues prefetches.
    unsafe { b.launch(cfg) }.w()?;
    side.done.record(&side.stream).w()?;
    if graph::capturing(cuda) {
        side.in_capture = true;
    }
    Ok(())
}

/// Before a capture on `cuda` ends: the device's stream waits for the side stream's last
/// prefetch of this capture (a capture must rejoin every stream it forked).
pub fn join_capture(cuda: &CudaDevice) -> candle_core::Result<()> {
    let mut sides = SIDES
        .lock()
        .map_err(|_| candle_core::Error::Msg("prefetch: poisoned".into()))?;
    let id = cuda.id();
    if let Some(side) = sides.iter_mut().find(|s| s.device == id && s.in_capture) {
        cuda.cuda_stream().wait(&side.done).w()?;
        side.in_capture = false;
    }
    Ok(())
}
