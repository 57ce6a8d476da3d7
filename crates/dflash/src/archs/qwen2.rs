//! Qwen2 / Qwen2.5 (`model_type: qwen2`): the dense decoder with q/k/v biases
//! (`attention_bias` is implied by the architecture, not always written in its config), none
//! on o_proj, and no q/k norm.

use super::decoder::{self, DecoderSpec};
use super::stack::Plan;
use super::TargetModel;
use crate::config::TargetConfig;
use crate::source::Weights;
use crate::Result;

fn spec(cfg: &TargetConfig) -> DecoderSpec {
    // HF's Qwen2Attention always has q/k/v biases and none on o_proj.
    DecoderSpec {
        qkv_bias: true,
        o_bias: false,
        ..DecoderSpec::new("qwen2", cfg)
    }
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(decoder::load(cfg, w, spec(cfg))?))
}

pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    spec(cfg).plan(cfg)
}
