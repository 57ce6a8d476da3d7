//! Qwen3.5 / Qwen3.6 dense (`model_type: qwen3_5`, text config `qwen3_5_text`): the hybrid
//! decoder (`hybrid.rs`) with split DeltaNet projections (`in_proj_qkv`, `in_proj_z`,
//! `in_proj_b`, `in_proj_a`) and a SwiGLU MLP in every layer. Published checkpoints are
//! `Qwen3_5ForConditionalGeneration` (text under `text_config`, tensors under
//! `model.language_model.`); the vision tower is not loaded (text-only decoding, where the
//! multimodal rope reduces to ordinary rope over the rotary part).

use super::hybrid::{self, HybridSpec};
use super::stack::Plan;
use super::TargetModel;
use crate::config::TargetConfig;
use crate::nn::InProjLayout;
use crate::source::Weights;
use crate::Result;

fn spec() -> HybridSpec {
    HybridSpec {
        family: "qwen3_5",
        layout: InProjLayout::Split,
        moe: None,
        renormalize: true,
    }
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    hybrid::load(cfg, w, spec())
}

pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    hybrid::plan(cfg, &spec())
}
