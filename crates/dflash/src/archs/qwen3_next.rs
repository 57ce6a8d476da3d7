//! Qwen3-Next / Qwen3-Coder-Next (`model_type: qwen3_next`): the hybrid decoder (`hybrid.rs`)
//! with the fused DeltaNet projections `in_proj_qkvz` / `in_proj_ba` (grouped per key head;
//! regrouped at load) and MoE blocks (routed top-k with `norm_topk_prob`, shared expert with
//! a sigmoid gate) on the layers selected by `decoder_sparse_step` and `mlp_only_layers`;
//! the other layers have a SwiGLU MLP of `intermediate_size`.

use super::hybrid::{self, HybridSpec};
use super::stack::Plan;
use super::TargetModel;
use crate::config::TargetConfig;
use crate::nn::moe::{MoeConfig, MoeDefaults};
use crate::nn::InProjLayout;
use crate::source::Weights;
use crate::Result;

fn spec(cfg: &TargetConfig) -> Result<HybridSpec> {
    let f = cfg.text()?;
    // transformers' Qwen3NextConfig defaults
    let defaults = MoeDefaults {
        num_experts: Some(512),
        top_k: Some(10),
        intermediate_size: Some(512),
        shared_intermediate_size: Some(512),
        norm_topk_prob: true,
    };
    // `num_experts: 0` means no MoE layers at all (a dense Qwen3-Next).
    if f.opt_usize("num_experts")? == Some(0) {
        return Ok(HybridSpec {
            family: "qwen3_next",
            layout: InProjLayout::Fused,
            moe: None,
            renormalize: true,
        });
    }
    let m = MoeConfig::parse(&f, defaults)?;
    let layers = MoeConfig::sparse_layers(&f, cfg.num_hidden_layers)?;
    let renormalize = m.norm_topk_prob;
    Ok(HybridSpec {
        family: "qwen3_next",
        layout: InProjLayout::Fused,
        moe: layers.iter().any(|&x| x).then_some((m, layers)),
        renormalize,
    })
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    hybrid::load(cfg, w, spec(cfg)?)
}

pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    hybrid::plan(cfg, &spec(cfg)?)
}
