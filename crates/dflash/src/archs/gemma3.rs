//! Gemma 3 text models (`model_type: gemma3_text`, or `gemma3` with a `text_config`): the
//! dense decoder with sandwich norms (post-attention, pre/post-feedforward), q/k RMSNorm,
//! `(1 + w)` norm weights in HF checkpoints (GGUF files store `1 + w`), embeddings scaled
//! by sqrt(hidden), GELU-tanh MLP, softmax scale `query_pre_attn_scalar^-0.5`, sliding
//! layers with their own RoPE base (`rope_local_base_freq`) between global layers (whose
//! RoPE may be linearly scaled), and final logit softcapping when configured.

use super::decoder::{self, DecoderSpec};
use super::stack::Plan;
use super::TargetModel;
use crate::config::{LayerType, RopeConfig, RopeKind, TargetConfig};
use crate::source::Weights;
use crate::Result;

/// The spec of a gemma3 config. `gguf`: llama.cpp's converter stores norm weights as `1 + w`
/// (HF stores `w`).
fn spec(cfg: &TargetConfig, gguf: bool) -> Result<DecoderSpec> {
    let f = cfg.text()?;
    // Gemma 3 ties its head to the embeddings unless the config says otherwise.
    let tied = f.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    // Older configs give the layer pattern as `sliding_window_pattern` (every n-th layer
    // global); HF's default is 6.
    let mut layer_types = cfg.layer_types.clone();
    if !f.has("layer_types") && cfg.sliding_window.is_some() {
        let n = f.opt_usize("sliding_window_pattern")?.unwrap_or(6);
        layer_types = (0..cfg.num_hidden_layers)
            .map(|i| {
                if n == 0 || (i + 1) % n != 0 {
                    LayerType::Sliding
                } else {
                    LayerType::Full
                }
            })
            .collect();
    }
    let local_theta = match f
        .sub("rope_parameters")?
        .and_then(|p| p.sub("sliding_attention").ok().flatten())
    {
        Some(p) => p.opt_f64("rope_theta")?,
        None => None,
    }
    .or(f.opt_f64("rope_local_base_freq")?)
    .unwrap_or(10000.0);
    let scalar = f
        .opt_f64("query_pre_attn_scalar")?
        .unwrap_or(cfg.head_dim as f64);
    Ok(DecoderSpec {
        qk_norm: true,
        norm_add_one: !gguf,
        sandwich_norms: true,
        embed_scale: Some((cfg.hidden_size as f64).sqrt()),
        final_softcap: f.opt_f64("final_logit_softcapping")?,
        attn_scale: Some(scalar.powf(-0.5)),
        sliding_rope: Some(RopeConfig {
            theta: local_theta,
            kind: RopeKind::Default,
            partial_rotary_factor: cfg.rope.partial_rotary_factor,
        }),
        tied,
        layer_types,
        ..DecoderSpec::new("gemma3", cfg)
    })
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(decoder::load(cfg, w, spec(cfg, w.is_gguf())?)?))
}

pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    spec(cfg, false)?.plan(cfg)
}
