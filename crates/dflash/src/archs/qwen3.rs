//! Qwen3 (`model_type: qwen3`): the dense decoder with per-head q/k RMSNorm before RoPE.

use super::decoder::{self, DecoderSpec};
use super::stack::Plan;
use super::TargetModel;
use crate::config::TargetConfig;
use crate::source::Weights;
use crate::Result;

fn spec(cfg: &TargetConfig) -> DecoderSpec {
    DecoderSpec {
        qk_norm: true,
        ..DecoderSpec::new("qwen3", cfg)
    }
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(decoder::load(cfg, w, spec(cfg))?))
}

pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    spec(cfg).plan(cfg)
}
