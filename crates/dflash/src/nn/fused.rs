//! The fused-kernel fast path, behind one switch.
//!
//! On CUDA in bf16 the decode / verify / draft steps launch a few hand-written kernels
//! (`kernels/fused.cu`, wrapped in `nn::cuda`) instead of chains of small candle ops: residual
//! add + RMSNorm, SwiGLU, the K/V cache write with per-head norm and RoPE, and attention over
//! the cache (sinks and an output gate included). Every function here returns `None` (or
//! `false`) when its kernel does not apply: another device or dtype, a shape the kernel does
//! not handle, tensors tracked by autograd (draft training needs the differentiable candle
//! path), or `DFLASH_FUSED=0` (the switchboard, to measure or rule out the kernels). The
//! caller then runs the portable path, which is the definition the kernels are tested against.
//!
//! On the CPU in f32 the norm and SwiGLU entries run `nn::cpu_ops`' loops instead (one pass
//! each, no rayon, bit for bit the portable path), under the same switches.

use super::attention::Visibility;
use crate::Result;
use candle_core::Tensor;

/// Where the heads sit in a projection output and how they are normed and rotated.
#[derive(Clone, Debug)]
pub struct HeadSource {
    /// Column of head 0's first value in each row of the source.
    pub offset: usize,
    /// Columns from one head to the next (head_dim, or 2 * head_dim when a gate follows each
    /// query head).
    pub head_stride: usize,
    /// Per-head RMSNorm weight `[head_dim]`.
    pub norm: Option<Tensor>,
    pub eps: f32,
    /// Dims rotated by RoPE (the first `rot` of each head; 0 = none).
    pub rot: usize,
    /// A scale-less RMSNorm (weight one) instead of `norm` (gemma4's values).
    pub unit_norm: bool,
}

/// One attention launch over a joint KV cache (see [`attention`]).
#[derive(Clone, Debug)]
pub struct AttentionCall {
    /// The queries in the projection output (normed + roped in the kernel).
    pub q: HeadSource,
    pub heads: usize,
    pub scale: f32,
    /// Keys `0 .. kv_len` of the cache are attended over.
    pub kv_len: usize,
    /// Position of query row 0.
    pub q_pos0: usize,
    pub vis: Visibility,
    /// `[heads]` logits joining each softmax (gpt-oss).
    pub sinks: Option<Tensor>,
    /// Column offset of head 0's output gate from the head's query (the output is multiplied
    /// by `sigmoid(gate)`; hybrid Qwen attention).
    pub gate_offset: Option<usize>,
}

/// False when `DFLASH_FUSED=0` (the switchboard, `crate::switches`).
pub fn allowed() -> bool {
    crate::switches::fused()
}

/// Whether the fused kernels of `part` may run (`DFLASH_FUSED`, `DFLASH_FUSED_OFF`).
pub fn allowed_part(part: crate::switches::Part) -> bool {
    crate::switches::fused_part(part)
}

/// Whether the fused path of `part` may run for these tensors (CUDA build, switches on,
/// nothing tracked by autograd, on a CUDA device).
fn usable(part: crate::switches::Part, ts: &[&Tensor]) -> bool {
    cfg!(feature = "cuda")
        && allowed_part(part)
        && ts.iter().all(|t| t.device().is_cuda() && !t.track_op())
}

/// `(res + delta, rms_norm(res + delta) * w)`.
pub fn add_rms_norm(
    res: &Tensor,
    delta: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<Option<(Tensor, Tensor)>> {
    if res.device().is_cpu() {
        return match allowed_part(crate::switches::Part::Norm) {
            true => super::cpu_ops::add_rms_norm(res, delta, w, eps),
            false => Ok(None),
        };
    }
    if !usable(crate::switches::Part::Norm, &[res, delta, w]) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        Ok(super::cuda::add_rms_norm(res, delta, w, eps)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = eps;
        Ok(None)
    }
}

/// `act(gate) * up` of a stacked gate/up output `[n, 2I]` (the CUDA kernel: SiLU only).
pub fn gated(gu: &Tensor, act: super::mlp::Activation) -> Result<Option<Tensor>> {
    if gu.device().is_cpu() {
        return match allowed_part(crate::switches::Part::Norm) {
            true => super::cpu_ops::gated(gu, act),
            false => Ok(None),
        };
    }
    if act != super::mlp::Activation::Silu || !usable(crate::switches::Part::Norm, &[gu]) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        Ok(super::cuda::swiglu(gu)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(None)
    }
}

/// Write K/V rows `pos0 ..` of a joint cache `[2, kv_heads, cap, d]` from `src`: keys from
/// `k` (normed + roped), values from `v` (optionally unit-normed). False when nothing was
/// written.
pub fn kv_write(
    kv: &Tensor,
    src: &Tensor,
    tables: &Tensor,
    k: &HeadSource,
    v: &HeadSource,
    pos0: usize,
) -> Result<bool> {
    if !usable(crate::switches::Part::Attention, &[kv, src, tables]) {
        return Ok(false);
    }
    #[cfg(feature = "cuda")]
    {
        Ok(super::cuda::kv_write(kv, src, tables, k, v, pos0)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k, v, pos0);
        Ok(false)
    }
}

/// Whether [`attention`] handles this head dim (so a caller can decide before writing K/V).
pub fn attention_supports(head_dim: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        allowed_part(crate::switches::Part::Attention)
            && super::cuda::ATTN_HEAD_DIMS.contains(&head_dim)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = head_dim;
        false
    }
}

/// Attention of the query rows of `src` over the first `call.kv_len` rows of a joint cache
/// (see `nn::cuda::attention`).
pub fn attention(
    src: &Tensor,
    tables: &Tensor,
    kv: &Tensor,
    call: &AttentionCall,
) -> Result<Option<Tensor>> {
    if !usable(crate::switches::Part::Attention, &[src, tables, kv]) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        Ok(super::cuda::attention(src, tables, kv, call)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = call;
        Ok(None)
    }
}

/// One sequence of a batched K/V write / attention (see [`kv_write_segments`]).
pub struct Segment<'a> {
    /// Its joint cache `[2, kv_heads, cap, d]`.
    pub kv: &'a Tensor,
    /// Position of its first row (the cache length before the write).
    pub pos0: usize,
    pub n: usize,
}

/// A forward whose positions live on the device, so that a CUDA graph of it can be replayed
/// at later positions (`archs::graphs`): `pos0 [segments]` (i64) holds each segment's first
/// position, the rope tables are indexed by absolute position, and attention covers
/// `kv_bound` keys (at least every segment's `pos0 + n`; the chunks past a segment's keys
/// are empty).
#[derive(Clone, Debug)]
pub struct DeviceStep {
    pub pos0: Tensor,
    pub kv_bound: usize,
}

#[cfg(feature = "cuda")]
fn cuda_step(step: Option<&DeviceStep>) -> Option<super::cuda::DevStep> {
    step.map(|s| super::cuda::DevStep {
        pos0: s.pos0.clone(),
        kv_bound: s.kv_bound,
    })
}

#[cfg(feature = "cuda")]
fn cuda_segments(segs: &[Segment]) -> Vec<super::cuda::Segment> {
    segs.iter()
        .map(|s| super::cuda::Segment {
            kv: s.kv.clone(),
            pos0: s.pos0,
            n: s.n,
        })
        .collect()
}

/// [`kv_write`] for several sequences in one launch: `src` and `tables` hold the segments'
/// rows back to back (with `step`: `tables` by absolute position, positions on the device);
/// each segment's rows go to its own cache. False when nothing was written.
pub fn kv_write_segments(
    src: &Tensor,
    tables: &Tensor,
    k: &HeadSource,
    v: &HeadSource,
    segs: &[Segment],
    step: Option<&DeviceStep>,
) -> Result<bool> {
    if !usable(crate::switches::Part::Attention, &[src, tables]) {
        return Ok(false);
    }
    #[cfg(feature = "cuda")]
    {
        Ok(super::cuda::kv_write_segments(
            src,
            tables,
            k,
            v,
            &cuda_segments(segs),
            cuda_step(step).as_ref(),
        )?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k, v, segs, step);
        Ok(false)
    }
}

/// [`attention`] for several sequences in one launch: each segment's query rows over its own
/// cache (`pos0 + n` rows, already written); `call.kv_len` / `call.q_pos0` are per segment
/// and ignored. None when the kernel does not apply.
pub fn attention_segments(
    src: &Tensor,
    tables: &Tensor,
    segs: &[Segment],
    call: &AttentionCall,
    step: Option<&DeviceStep>,
) -> Result<Option<Tensor>> {
    if !usable(crate::switches::Part::Attention, &[src, tables]) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        Ok(super::cuda::attention_segments(
            src,
            tables,
            &cuda_segments(segs),
            call,
            cuda_step(step).as_ref(),
        )?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (segs, call, step);
        Ok(None)
    }
}
