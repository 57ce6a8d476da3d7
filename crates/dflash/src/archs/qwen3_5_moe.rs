//! Qwen3.5 / Qwen3.6 MoE (`model_type: qwen3_5_moe`, text config `qwen3_5_moe_text`): the
//! hybrid decoder (`hybrid.rs`) with split DeltaNet projections and a MoE block in every layer:
//! softmax router, top-k experts always renormalized (transformers' `Qwen3VLMoeTextTopKRouter`
//! has no `norm_topk_prob` switch), plus a shared expert gated by `sigmoid(shared_expert_gate)`.

use super::hybrid::{self, HybridSpec};
use super::stack::Plan;
use super::TargetModel;
use crate::config::TargetConfig;
use crate::nn::moe::{MoeConfig, MoeDefaults};
use crate::nn::InProjLayout;
use crate::source::Weights;
use crate::Result;

fn spec(cfg: &TargetConfig) -> Result<HybridSpec> {
    // transformers' Qwen3_5MoeTextConfig defaults: 256 experts, 8 per token, 512, 512
    let defaults = MoeDefaults {
        num_experts: Some(256),
        top_k: Some(8),
        intermediate_size: Some(512),
        shared_intermediate_size: Some(512),
        norm_topk_prob: true,
    };
    let m = MoeConfig::parse(&cfg.text()?, defaults)?;
    Ok(HybridSpec {
        family: "qwen3_5_moe",
        layout: InProjLayout::Split,
        moe: Some((m, vec![true; cfg.num_hidden_layers])),
        renormalize: true,
    })
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    hybrid::load(cfg, w, spec(cfg)?)
}

pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    hybrid::plan(cfg, &spec(cfg)?)
}
