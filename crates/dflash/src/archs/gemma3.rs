//! Gemma 3 text models (`model_type: gemma3_text`, or `gemma3` with a `text_config`): the
//! dense decoder with sandwich norms (post-attention, pre/post-feedforward), q/k RMSNorm,
//! `(1 + w)` norm weights in HF checkpoints (GGUF files store `1 + w`), embeddings scaled
//! by sqrt(hidden), GELU-tanh MLP, softmax scale `query_pre_attn_scalar^-0.5`, sliding
//! layers with their own RoPE base (`rope_local_base_freq`) between global layers (whose
//! RoPE may be linearly scaled), and final logit softcapping when configured.

use super::decoder::{DecoderModel, DecoderSpec};
use super::TargetModel;
use crate::config::{Fields, LayerType, RopeConfig, RopeKind, TargetConfig};
use crate::source::Weights;
use crate::Result;

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    let root = Fields::new(&cfg.file, &cfg.raw)?;
    let f = match root.sub("text_config")? {
        Some(t) => t,
        None => root,
    };
    let mut cfg = cfg.clone();
    // Gemma 3 ties its head to the embeddings unless the config says otherwise.
    if !f.has("tie_word_embeddings") {
        cfg.tie_word_embeddings = true;
    }
    // Older configs give the layer pattern as `sliding_window_pattern` (every n-th layer
    // global); HF's default is 6.
    if !f.has("layer_types") {
        let n = f.opt_usize("sliding_window_pattern")?.unwrap_or(6);
        if cfg.sliding_window.is_some() {
            cfg.layer_types = (0..cfg.num_hidden_layers)
                .map(|i| {
                    if n == 0 || (i + 1) % n != 0 {
                        LayerType::Sliding
                    } else {
                        LayerType::Full
                    }
                })
                .collect();
        }
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
    let spec = DecoderSpec {
        qk_norm: true,
        // HF stores w of x * (1 + w); llama.cpp's converter stores 1 + w.
        norm_add_one: !w.is_gguf(),
        sandwich_norms: true,
        embed_scale: Some((cfg.hidden_size as f64).sqrt()),
        final_softcap: f.opt_f64("final_logit_softcapping")?,
        attn_scale: Some(scalar.powf(-0.5)),
        sliding_rope: Some(RopeConfig {
            theta: local_theta,
            kind: RopeKind::Default,
            partial_rotary_factor: cfg.rope.partial_rotary_factor,
        }),
        ..DecoderSpec::new("gemma3")
    };
    Ok(Box::new(DecoderModel::load(&cfg, w, spec)?))
}
