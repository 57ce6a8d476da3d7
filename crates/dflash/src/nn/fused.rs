//! The fused-kernel fast path, behind one switch.
//!
//! On CUDA in bf16 the decode / verify / draft steps launch a few hand-written kernels
//! (`kernels/fused.cu`, wrapped in `nn::cuda`) instead of chains of small candle ops: residual
//! add + RMSNorm, SwiGLU, the K/V cache write with per-head norm and RoPE, and attention over
//! the cache. Every function here returns `None` (or `false`) when its kernel does not apply:
//! another device or dtype, a shape the kernel does not handle, tensors tracked by autograd
//! (draft training needs the differentiable candle path), or `DFLASH_FUSED=0` in the
//! environment (to measure or rule out the kernels). The caller then runs the portable path,
//! which is the definition the kernels are tested against.

use crate::Result;
use candle_core::Tensor;

#[cfg(feature = "cuda")]
pub use super::cuda::{HeadSource, Visibility};

/// Where the heads sit in a projection output and how they are normed and rotated.
#[cfg(not(feature = "cuda"))]
#[derive(Clone)]
pub struct HeadSource {
    pub offset: usize,
    pub norm: Option<Tensor>,
    pub eps: f32,
    pub rot: usize,
}

/// Which keys a query row sees.
#[cfg(not(feature = "cuda"))]
#[derive(Clone, Copy, Debug)]
pub struct Visibility {
    pub causal: bool,
    pub window: Option<usize>,
}

/// False when `DFLASH_FUSED=0` (read once).
pub fn allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DFLASH_FUSED").map_or(true, |v| v != "0"))
}

/// Whether the fused path may run for these tensors (CUDA build, switch on, nothing tracked
/// by autograd, on a CUDA device).
fn usable(ts: &[&Tensor]) -> bool {
    cfg!(feature = "cuda") && allowed() && ts.iter().all(|t| t.device().is_cuda() && !t.track_op())
}

/// `(res + delta, rms_norm(res + delta) * w)`.
pub fn add_rms_norm(
    res: &Tensor,
    delta: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<Option<(Tensor, Tensor)>> {
    if !usable(&[res, delta, w]) {
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

/// `silu(gate) * up` of a stacked gate/up output `[n, 2I]`.
pub fn swiglu(gu: &Tensor) -> Result<Option<Tensor>> {
    if !usable(&[gu]) {
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

/// Write K/V rows `pos0 ..` of a joint cache `[2, kv_heads, cap, d]` from `src` (see
/// `nn::cuda::kv_write`). False when nothing was written.
pub fn kv_write(
    kv: &Tensor,
    src: &Tensor,
    tables: &Tensor,
    k: &HeadSource,
    v_offset: usize,
    pos0: usize,
) -> Result<bool> {
    if !usable(&[kv, src, tables]) {
        return Ok(false);
    }
    #[cfg(feature = "cuda")]
    {
        Ok(super::cuda::kv_write(kv, src, tables, k, v_offset, pos0)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k, v_offset, pos0);
        Ok(false)
    }
}

/// Whether [`attention`] handles this head dim (so a caller can decide before writing K/V).
pub fn attention_supports(head_dim: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        super::cuda::ATTN_HEAD_DIMS.contains(&head_dim)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = head_dim;
        false
    }
}

/// Attention of the query rows of `src` over the first `kv_len` rows of a joint cache (see
/// `nn::cuda::attention`).
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
) -> Result<Option<Tensor>> {
    if !usable(&[src, tables, kv]) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        Ok(super::cuda::attention(
            src, tables, kv, q, heads, scale, kv_len, q_pos0, vis,
        )?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, heads, scale, kv_len, q_pos0, vis);
        Ok(None)
    }
}
