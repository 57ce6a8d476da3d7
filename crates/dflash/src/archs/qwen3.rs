//! Qwen3 (`model_type: qwen3`): the dense decoder with per-head q/k RMSNorm before RoPE.

use super::decoder::{DecoderModel, DecoderSpec};
use super::TargetModel;
use crate::config::TargetConfig;
use crate::source::Weights;
use crate::Result;

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    let spec = DecoderSpec {
        qk_norm: true,
        ..DecoderSpec::new("qwen3")
    };
    Ok(Box::new(DecoderModel::load(cfg, w, spec)?))
}
