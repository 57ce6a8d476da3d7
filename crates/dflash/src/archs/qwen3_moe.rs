//! Qwen3-MoE (`model_type: qwen3_moe`): the qwen3 decoder with a sparse MoE feed-forward
//! (softmax router, top-k experts, `norm_topk_prob`) on the layers selected by
//! `decoder_sparse_step` and `mlp_only_layers`; no shared expert.

use super::decoder::{self, DecoderSpec};
use super::stack::Plan;
use super::TargetModel;
use crate::config::TargetConfig;
use crate::source::Weights;
use crate::Result;

fn spec(cfg: &TargetConfig) -> Result<DecoderSpec> {
    Ok(DecoderSpec {
        qk_norm: true,
        moe: Some(decoder::qwen_moe(cfg)?),
        ..DecoderSpec::new("qwen3_moe", cfg)
    })
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(decoder::load(cfg, w, spec(cfg)?)?))
}

pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    spec(cfg)?.plan(cfg)
}
