//! Llama 2/3.x (`model_type: llama`): the dense decoder without q/k norm; llama3 / linear /
//! yarn RoPE scaling comes from the config; tied or untied embeddings.

use super::decoder::{self, DecoderSpec};
use super::stack::Plan;
use super::TargetModel;
use crate::config::TargetConfig;
use crate::source::Weights;
use crate::Result;

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(decoder::load(
        cfg,
        w,
        DecoderSpec::new("llama", cfg),
    )?))
}

pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    DecoderSpec::new("llama", cfg).plan(cfg)
}
