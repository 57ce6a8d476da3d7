//! CUDA graphs: one forward's launches captured once and replayed (`archs::graphs` decides
//! which forwards and keeps the graphs). A replay costs one launch on the host where the
//! forward costs one per kernel (~10 us each through candle: a MoE decode step of 12 layers
//! enqueued in 1.1-1.9 ms against 1.3 ms of GPU time, docs/perf.md session 22).
//!
//! What makes a forward replayable is the caller's business: every input that changes between
//! steps (token ids, positions) must live in device buffers that are written before each
//! launch (`write_u32` / `write_i64`), and every kernel must read them from there
//! (`DevStep`). What this module guarantees: a capture that fails for any reason (a host copy,
//! an upload the warm-up run did not make, a host sync) ends the capture and returns the error
//! with nothing left half-captured; the intermediate buffers of the captured forward belong to
//! the graph (freed and reallocated at the same addresses by every replay:
//! `AUTO_FREE_ON_LAUNCH`), so what a forward returns is valid until the next replay of the same
//! graph only.

use super::*;
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::cuda_backend::CudaDevice;

/// Whether `dev`'s stream is being captured into a graph.
pub fn capturing(dev: &CudaDevice) -> bool {
    matches!(
        dev.cuda_stream().capture_status(),
        Ok(st) if st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    )
}

/// Whether graphs can be captured on `dev` at all: cudarc's per-buffer events off (dflash's
/// default, `open_device`: with them every allocation records and waits on events, which a
/// capture cannot mix with work outside it).
pub fn supported(dev: &candle_core::Device) -> bool {
    dev.as_cuda_device().is_ok_and(|d| !d.is_event_tracking())
}

/// An instantiated graph.
pub struct Graph(CudaGraph);

// SAFETY: a graph is used by one thread at a time: `archs::graphs` keeps it behind a mutex
// (CUDA requires calls on one graph object to be serialized, nothing more).
unsafe impl Send for Graph {}

impl Graph {
    /// Replay on the stream it was captured from.
    pub fn launch(&self) -> candle_core::Result<()> {
        self.0.launch().w()
    }
}

/// Run `f` with `dev`'s stream in capture mode and instantiate what it enqueued. candle's
/// parameter cache is on during the capture (a kernel's shape parameters are then served from
/// device copies made by the warm-up run; a miss fails the capture instead of capturing a
/// host copy). Nothing runs on the GPU: the caller launches the graph. On any error the
/// capture is ended and its graph dropped.
pub fn capture<T>(
    dev: &candle_core::Device,
    f: impl FnOnce() -> crate::Result<T>,
) -> crate::Result<(T, Graph)> {
    let cuda = dev.as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let _cache = cuda.enable_cuda_graph_htod_cache();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .w()?;
    let out = f();
    let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
    // End the capture whatever happened (an invalidated capture reports its error here).
    let graph = stream.end_capture(flags).w();
    let out = out?;
    match graph? {
        Some(g) => Ok((out, Graph(g))),
        None => Err(crate::Error::input(
            "CUDA graph capture recorded nothing (the forward enqueued no work)",
        )),
    }
}

/// Turn candle's parameter cache on for the warm-up run before a capture (so the capture
/// finds every shape parameter the forward uploads).
pub fn param_cache(dev: &candle_core::Device) -> crate::Result<impl Sized> {
    Ok(dev.as_cuda_device()?.enable_cuda_graph_htod_cache())
}

/// Overwrite a device tensor's values in place from the host (stream-ordered: after the work
/// already queued, before the work queued next).
struct WriteHost<T: candle_core::cuda_backend::CudaDType>(Vec<T>);

impl<T> InplaceOp1 for WriteHost<T>
where
    T: candle_core::cuda_backend::CudaDType
        + candle_core::cuda_backend::cudarc::driver::DeviceRepr
        + Clone
        + Send
        + Sync,
{
    fn name(&self) -> &'static str {
        "dflash-write-host"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("dflash-write-host writes a CUDA tensor")
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let Some((o, e)) = l.contiguous_offsets() else {
            candle_core::bail!("dflash-write-host: the tensor must be contiguous");
        };
        if e - o != self.0.len() {
            candle_core::bail!(
                "dflash-write-host: {} values for a tensor of {}",
                self.0.len(),
                e - o
            );
        }
        let stream = s.device().cuda_stream();
        let mut dst = s.as_cuda_slice_mut::<T>()?.slice_mut(o..e);
        // cudarc's copy, not candle's (which serves uploads from its parameter cache while
        // that is on).
        stream.memcpy_htod(&self.0, &mut dst).w()
    }
}

/// `t` (u32, contiguous, on the device) := `v`.
pub fn write_u32(t: &Tensor, v: &[u32]) -> crate::Result<()> {
    Ok(t.inplace_op1(&WriteHost(v.to_vec()))?)
}

/// `t` (i64, contiguous, on the device) := `v`.
pub fn write_i64(t: &Tensor, v: &[i64]) -> crate::Result<()> {
    Ok(t.inplace_op1(&WriteHost(v.to_vec()))?)
}
