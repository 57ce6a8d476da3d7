//! Shared layers, written once and used by every target family and by the draft:
//! linear (dense or quantized), RMSNorm, RoPE, attention with a croppable KV cache, gated MLP;
//! for the hybrid families, gated attention and the Gated DeltaNet with its recurrent cache.
//!
//! Activations are 2-D `[tokens, features]` (batch 1): the engine decodes one sequence.

pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod embedding;
pub mod fused;
pub mod gated_attention;
pub mod gated_delta;
pub mod kv_cache;
pub mod latent_cache;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod q8;
pub mod recurrent_cache;
pub mod rope;
pub mod routing;

pub use attention::{attention_mask, sdpa_with_sinks, Attention, AttentionSpec};
pub use embedding::Embedding;
pub use gated_attention::GatedAttention;
pub use gated_delta::{ChunkMasks, GatedDeltaNet, GatedDeltaSpec, InProjLayout};
pub use kv_cache::KvCache;
pub use latent_cache::LatentCache;
pub use linear::Linear;
pub use mlp::{Activation, GatedMlp};
pub use moe::SparseMoe;
pub use norm::RmsNorm;
pub use recurrent_cache::RecurrentCache;
pub use rope::{Rope, RopeTables};
