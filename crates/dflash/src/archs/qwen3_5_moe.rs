//! Qwen3.5 / Qwen3.6 MoE (`model_type: qwen3_5_moe`, text config `qwen3_5_moe_text`): the
//! hybrid decoder (`hybrid.rs`) with split DeltaNet projections and a MoE block in every layer:
//! softmax router, top-k experts always renormalized (transformers' `Qwen3VLMoeTextTopKRouter`
//! has no `norm_topk_prob` switch), plus a shared expert gated by `sigmoid(shared_expert_gate)`.

use super::hybrid::{moe_spec, HybridModel, HybridSpec};
use super::TargetModel;
use crate::config::TargetConfig;
use crate::nn::InProjLayout;
use crate::source::Weights;
use crate::Result;

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    // transformers' Qwen3_5MoeTextConfig defaults: 256 experts, 8 per token, 512, 512
    let moe = moe_spec(
        cfg,
        (256, 8, 512, 512),
        true,
        vec![true; cfg.num_hidden_layers],
    )?;
    let spec = HybridSpec {
        family: "qwen3_5_moe",
        layout: InProjLayout::Split,
        moe: Some(moe),
    };
    Ok(Box::new(HybridModel::load(cfg, w, spec)?))
}
