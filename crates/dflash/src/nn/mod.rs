//! Shared layers, written once and used by every target family and by the draft:
//! linear (dense or quantized), RMSNorm, RoPE, attention with a croppable KV cache, gated MLP;
//! for the hybrid families, gated attention and the Gated DeltaNet with its recurrent cache.
//!
//! Activations are 2-D `[tokens, features]` (batch 1): the engine decodes one sequence.
//! Every layer reports the bytes of weights it holds (`weight_bytes`), fused copies included,
//! so a family's sizing is the sum of its layers'.

pub mod affine;
pub mod attention;
pub mod cpu_attention;
pub mod cpu_ops;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dyn_conv;
pub mod embedding;
pub mod fp8;
pub mod fused;
pub mod gated_delta;
pub mod gguf_affine;
pub mod kv_cache;
pub mod latent_cache;
pub mod linear;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod mxfp4;
pub mod norm;
pub mod parallel;
pub mod q8;
pub mod quant;
pub mod recurrent_cache;
pub mod rope;

pub use affine::AffineWeight;
pub use attention::{
    attend, attention_mask, sdpa, sdpa_with_sinks, Attention, AttentionSpec, Masks, Props, Site,
    Visibility,
};
pub use dyn_conv::dyn_conv;
pub use embedding::Embedding;
pub use fp8::Fp8Weight;
pub use gated_delta::{ChunkMasks, GatedDeltaNet, GatedDeltaSpec, InProjLayout};
pub use kv_cache::KvCache;
pub use latent_cache::LatentCache;
pub use linear::Linear;
pub use mla::{LatentAttention, MlaShape, QProj};
pub use mlp::{Activation, GatedMlp};
pub use moe::{ExpertMatrix, Experts, MoeConfig, Router, SparseMoe};
pub use mxfp4::Mxfp4Stack;
pub use norm::RmsNorm;
pub use recurrent_cache::RecurrentCache;
pub use rope::{Rope, RopeTables};

/// Bytes of a tensor's elements.
pub fn tensor_bytes(t: &candle_core::Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Parameters of a model or layer by how a checkpoint may store them (sizing from a config).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Params {
    /// Weights stored in the checkpoint's float dtype.
    pub plain: u64,
    /// Routed-expert matrices (what MXFP4 / int4 checkpoints quantize).
    pub experts: u64,
    /// Of `experts`, those whose widths the affine MoE kernels take (`nn::moe::ExpertMatrix::
    /// Affine`: in-widths multiples of 128), so that a 4-bit MLX checkpoint keeps them as
    /// stored on CUDA.
    pub affine_experts: u64,
}

impl Params {
    pub fn total(&self) -> u64 {
        self.plain + self.experts
    }
}

impl std::ops::AddAssign for Params {
    fn add_assign(&mut self, o: Params) {
        self.plain += o.plain;
        self.experts += o.experts;
        self.affine_experts += o.affine_experts;
    }
}

/// Rows `rows` of `t [n, ..]` in that order, in one op: `t` itself when they are all its rows
/// in order, a view when they are consecutive, else one gather (one upload of the indices)
/// instead of a copy per piece.
pub fn gather_rows(t: &candle_core::Tensor, rows: &[usize]) -> crate::Result<candle_core::Tensor> {
    let n = t.dim(0)?;
    if let Some(&r) = rows.iter().find(|&&r| r >= n) {
        return Err(crate::Error::input(format!(
            "gather_rows: row {r} of a tensor of {n} rows"
        )));
    }
    let consecutive = rows.windows(2).all(|w| w[1] == w[0] + 1);
    Ok(match rows.first() {
        Some(&first) if consecutive => {
            if first == 0 && rows.len() == n {
                t.clone()
            } else {
                t.narrow(0, first, rows.len())?
            }
        }
        _ => {
            let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let idx = candle_core::Tensor::from_vec(idx, rows.len(), t.device())?;
            t.index_select(&idx, 0)?
        }
    })
}
