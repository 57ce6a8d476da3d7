//! Qwen3-Next / Qwen3-Coder-Next (`model_type: qwen3_next`): the hybrid decoder (`hybrid.rs`)
//! with the fused DeltaNet projections `in_proj_qkvz` / `in_proj_ba` (grouped per key head;
//! regrouped at load) and MoE blocks (routed top-k with `norm_topk_prob`, shared expert with
//! a sigmoid gate) on the layers selected by `decoder_sparse_step` and `mlp_only_layers`;
//! the other layers have a SwiGLU MLP of `intermediate_size`.

use super::hybrid::{moe_spec, text_fields, HybridModel, HybridSpec};
use super::TargetModel;
use crate::config::TargetConfig;
use crate::nn::InProjLayout;
use crate::source::Weights;
use crate::Result;

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    let f = text_fields(cfg)?;
    // transformers' Qwen3NextConfig defaults
    let experts = match f.opt_usize("num_experts")? {
        Some(n) => n,
        None => f.opt_usize("num_local_experts")?.unwrap_or(512),
    };
    let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1);
    let mlp_only = f.opt_usize_list("mlp_only_layers")?.unwrap_or_default();
    let layers: Vec<bool> = (0..cfg.num_hidden_layers)
        .map(|i| !mlp_only.contains(&i) && experts > 0 && (i + 1) % step == 0)
        .collect();
    let moe = if layers.iter().any(|&x| x) {
        let norm = f.opt_bool("norm_topk_prob")?.unwrap_or(true);
        Some(moe_spec(cfg, (512, 10, 512, 512), norm, layers)?)
    } else {
        None
    };
    let spec = HybridSpec {
        family: "qwen3_next",
        layout: InProjLayout::Fused,
        moe,
    };
    Ok(Box::new(HybridModel::load(cfg, w, spec)?))
}
