//! Qwen2 / Qwen2.5 (`model_type: qwen2`): the dense decoder with q/k/v biases
//! (`attention_bias` is implied by the architecture, not always written in its config) and
//! no q/k norm.

use super::decoder::{DecoderModel, DecoderSpec};
use super::TargetModel;
use crate::config::TargetConfig;
use crate::source::Weights;
use crate::Result;

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    // HF's Qwen2Attention always has q/k/v biases and none on o_proj.
    let mut cfg = cfg.clone();
    cfg.attention_bias = true;
    Ok(Box::new(DecoderModel::load(
        &cfg,
        w,
        DecoderSpec {
            qkv_bias_only: true,
            ..DecoderSpec::new("qwen2")
        },
    )?))
}
