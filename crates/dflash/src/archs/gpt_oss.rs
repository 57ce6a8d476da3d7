//! gpt-oss (`model_type: gpt_oss`, openai/gpt-oss-20b and -120b).
//!
//! What differs from the dense decoder (transformers 5.17 `GptOssForCausalLM`):
//! - attention with biases on q/k/v/o and **sinks**: a learned logit per head that joins every
//!   query's softmax as one extra column and is then dropped (the attention door takes them);
//! - sliding-window (`sliding_window`, 128) and full layers alternate as `layer_types` says
//!   (transformers' default when absent: even layers sliding, odd layers full);
//! - yarn RoPE (rotate-half) read from the config; `truncate: false` in the published configs;
//! - an MoE feed-forward on every layer: router `x W^T + b`, the top-k LOGITS are softmaxed
//!   (not all of them), experts with biases whose `gate_up` output interleaves gate (even
//!   columns) and up (odd columns; de-interleaved at load); activation
//!   `(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)` with `g = min(gate, l)`,
//!   `l = swiglu_limit` (7.0);
//! - expert weights stored as MXFP4 (`*_blocks` / `*_scales`, the published checkpoints) or as
//!   floats in transformers' layout (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`). MXFP4
//!   experts stay as stored on CUDA with bf16 compute (`nn::mxfp4`, dequantized in the MoE
//!   kernels' registers) and are dequantized exactly at load elsewhere (`source::mxfp4`;
//!   memory figures there).
//!
//! The harmony chat format needs nothing here: it comes from the checkpoint's
//! `chat_template.jinja` like every other template.

use super::decoder::{embedding_params, gqa, lm_head, target_info, DecoderLayer, Ffn, Mixer};
use super::stack::{CacheKind, Head, Plan, Stack};
use super::TargetModel;
#[cfg(test)]
use crate::config::RopeKind;
use crate::config::{LayerType, RopeConfig, TargetConfig};
use crate::nn::moe::{ExpertAct, ExpertMatrix, Experts, MoeConfig, MoeDefaults, Router, Scoring};
use crate::nn::{Attention, AttentionSpec, Mxfp4Stack, RmsNorm, Rope, SparseMoe, Visibility};
use crate::source::mxfp4::{self, Packed};
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::Tensor;

/// gpt-oss settings beyond [`TargetConfig`].
#[derive(Debug, Clone)]
pub struct GptOssConfig {
    pub moe: MoeConfig,
    pub swiglu_limit: f64,
    pub sliding_window: usize,
    pub layer_types: Vec<LayerType>,
    pub attention_bias: bool,
    pub rope: RopeConfig,
}

/// The expert activation's fixed slope (transformers' `GptOssExperts.alpha`).
const ALPHA: f64 = 1.702;

impl GptOssConfig {
    pub fn parse(cfg: &TargetConfig) -> Result<Self> {
        let f = cfg.text()?;
        if let Some(q) = cfg.quantization()? {
            match q.opt_str("quant_method")? {
                // fp8: block-quantized matrices, dequantized at load (source/fp8.rs)
                Some("mxfp4") | Some("fp8") => {}
                other => {
                    return Err(q.err(
                        "quant_method",
                        format!(
                            "`{}` is not supported for gpt_oss (supported: mxfp4 experts, fp8 blocks, or float weights)",
                            other.unwrap_or("unknown")
                        ),
                    ))
                }
            }
        }
        // The experts are `intermediate_size` wide; 4 per token unless the config says.
        let moe = MoeConfig::parse(
            &f,
            MoeDefaults {
                top_k: Some(4),
                intermediate_size: Some(cfg.intermediate_size),
                ..MoeDefaults::default()
            },
        )?;
        // Layer types, window and rope defaults are transformers' (TargetConfig applies them).
        let sliding_window = cfg.sliding_window.unwrap_or(128);
        if sliding_window == 0 && cfg.layer_types.contains(&LayerType::Sliding) {
            return Err(f.err("sliding_window", "must be > 0"));
        }
        Ok(Self {
            moe,
            swiglu_limit: f.opt_f64("swiglu_limit")?.unwrap_or(7.0),
            sliding_window,
            layer_types: cfg.layer_types.clone(),
            attention_bias: f.opt_bool("attention_bias")?.unwrap_or(true),
            rope: cfg.rope.clone(),
        })
    }

    fn attention(&self, cfg: &TargetConfig) -> AttentionSpec {
        AttentionSpec {
            bias: self.attention_bias,
            o_bias: self.attention_bias,
            ..gqa(cfg, cfg.head_dim)
        }
    }
}

/// Caches and parameters of a gpt-oss config.
pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    let g = GptOssConfig::parse(cfg)?;
    let (h, l) = (cfg.hidden_size as u64, cfg.num_hidden_layers as u64);
    let (e, i) = (g.moe.num_experts as u64, g.moe.intermediate_size as u64);
    let heads = cfg.num_attention_heads as u64;
    let mut p = embedding_params(cfg, cfg.tie_word_embeddings);
    // attention (+ sinks), norms, router (+ bias), expert biases
    p.plain += l * (g.attention(cfg).params() + heads + 2 * h + e * h + e);
    p.plain += l * e * (2 * i + h);
    p.experts += l * e * 3 * i * h;
    Ok(Plan {
        caches: vec![
            CacheKind::Kv {
                kv_heads: cfg.num_key_value_heads,
                head_dim: cfg.head_dim,
            };
            cfg.num_hidden_layers
        ],
        params: p,
    })
}

/// Row order that puts the even rows (gate) first, then the odd rows (up).
fn deinterleave_order(rows: usize) -> Vec<usize> {
    (0..rows).step_by(2).chain((1..rows).step_by(2)).collect()
}

/// How a layer's experts were stored and are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    Float,
    /// MXFP4, dequantized at load.
    Dequantized,
    /// MXFP4 kept as stored ([`crate::nn::quant::keeps_mxfp4`]).
    Kept,
}

/// The experts of layer `p` (`{p}.mlp.experts.*`), from MXFP4 or float tensors, stacked as
/// `Experts` wants them (gate rows, then up rows). Returns them and how they are held.
fn load_experts(w: &Weights, p: &str, g: &GptOssConfig, h: usize) -> Result<(Experts, Stored)> {
    let (e, inter) = (g.moe.num_experts, g.moe.intermediate_size);
    let gu_name = format!("{p}.mlp.experts.gate_up_proj");
    let down_name = format!("{p}.mlp.experts.down_proj");
    let gu_bias = w.get(&format!("{gu_name}_bias"), (e, 2 * inter))?;
    let down_bias = w.get(&format!("{down_name}_bias"), (e, h))?;
    let order = deinterleave_order(2 * inter);
    let perm = Tensor::from_vec(
        order.iter().map(|&r| r as u32).collect::<Vec<_>>(),
        2 * inter,
        &w.device,
    )?;
    let mx = mxfp4::is_mxfp4(w, &gu_name);
    let (gate_up, down, stored) = if mx
        && crate::nn::quant::keeps_mxfp4(&w.device, w.dtype, h, inter)
    {
        // kept as stored: the codes with gate rows first, then up rows, as the floats below
        let (gc, gs) = Packed::load(w, &gu_name, &[e, 2 * inter], h)?.into_bytes(Some(&order));
        let (dc, ds) = Packed::load(w, &down_name, &[e, h], inter)?.into_bytes(None);
        (
            ExpertMatrix::Mxfp4(Mxfp4Stack::new(
                &gu_name,
                gc,
                gs,
                (e, 2 * inter, h),
                &w.device,
            )?),
            ExpertMatrix::Mxfp4(Mxfp4Stack::new(
                &down_name,
                dc,
                ds,
                (e, h, inter),
                &w.device,
            )?),
            Stored::Kept,
        )
    } else if mx {
        // as (out, in): gate_up [E, 2I, H] (interleaved rows), down [E, H, I]
        let on = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(w.dtype)?.to_device(&w.device)?) };
        let gu = Packed::load(w, &gu_name, &[e, 2 * inter], h)?;
        let dn = Packed::load(w, &down_name, &[e, h], inter)?;
        let (mut gus, mut dns) = (Vec::with_capacity(e), Vec::with_capacity(e));
        for x in 0..e {
            gus.push(on(gu.slice(x)?)?);
            dns.push(on(dn.slice(x)?)?);
        }
        (
            Tensor::stack(&gus, 0)?.index_select(&perm, 1)?.into(),
            Tensor::stack(&dns, 0)?.into(),
            Stored::Dequantized,
        )
    } else {
        (
            w.get(&gu_name, (e, h, 2 * inter))?
                .transpose(1, 2)?
                .contiguous()?
                .index_select(&perm, 1)?
                .into(),
            w.get(&down_name, (e, inter, h))?
                .transpose(1, 2)?
                .contiguous()?
                .into(),
            Stored::Float,
        )
    };
    Ok((
        Experts {
            gate_up,
            gate_up_bias: Some(gu_bias.index_select(&perm, 1)?),
            down,
            down_bias: Some(down_bias),
            act: ExpertAct::ClampedGlu {
                limit: g.swiglu_limit,
                alpha: ALPHA,
            },
            inter,
            rank: None,
        }
        .keep_rank(w)?,
        stored,
    ))
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    if w.is_gguf() {
        return Err(Error::input(
            "gpt_oss from GGUF is not supported: use the safetensors checkpoint (openai/gpt-oss-*)",
        ));
    }
    let g = GptOssConfig::parse(cfg)?;
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let eps = cfg.rms_norm_eps;
    let norm = |name: &str| RmsNorm::load(w, name, h, eps, false);
    let spec = g.attention(cfg);
    let embed = w.embedding("model.embed_tokens.weight", v, h)?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    let (mut deq_layers, mut kept_layers) = (0, 0);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let (experts, stored) = load_experts(w, &p, &g, h)?;
        deq_layers += (stored == Stored::Dequantized) as usize;
        kept_layers += (stored == Stored::Kept) as usize;
        let mut attn = Attention::load(w, &format!("{p}.self_attn"), spec.clone())?;
        attn.set_sinks(w.get(&format!("{p}.self_attn.sinks"), cfg.num_attention_heads)?)?;
        attn.fuse()?;
        let vis = match g.layer_types[i] {
            LayerType::Sliding => Visibility::sliding(g.sliding_window),
            // (linear-attention layer types are refused for this family at load)
            LayerType::Full | LayerType::Linear => Visibility::CAUSAL,
        };
        let router = Router::load(
            w,
            &format!("{p}.mlp.router"),
            h,
            g.moe.num_experts,
            true,
            Scoring::TopKSoftmax,
            g.moe.top_k,
        )?;
        layers.push(DecoderLayer {
            input_norm: norm(&format!("{p}.input_layernorm.weight"))?,
            mixer: Mixer::Attention { attn, rope: 0, vis },
            post_norm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
            sandwich: None,
            ffn: Ffn::Moe(SparseMoe {
                router,
                experts,
                shared: None,
            }),
            slot: i,
            family: "gpt_oss",
        });
    }
    let head = Head::new(
        norm("model.norm.weight")?,
        lm_head(w, "lm_head", &embed, cfg.tie_word_embeddings, h, v)?,
        None,
        &embed,
    );
    let mut info = target_info(cfg, w, "gpt_oss");
    let mxfp4 = match (deq_layers, kept_layers) {
        (0, 0) => None,
        (d, 0) => Some(format!("MXFP4->{:?} x{}", w.dtype, 2 * d)),
        (0, k) => Some(format!("MXFP4 x{}; kept as stored", 2 * k)),
        (d, k) => Some(format!(
            "MXFP4 x{} kept as stored, MXFP4->{:?} x{}",
            2 * k,
            w.dtype,
            2 * d
        )),
    };
    info.quantization = match (mxfp4, info.quantization.take()) {
        (Some(a), Some(b)) => Some(format!("{a}; {b}")),
        (a, b) => a.or(b),
    };
    let ropes = vec![Rope::new(&g.rope, cfg.head_dim)];
    let m = Stack::new(info, embed, ropes, layers, head, plan(cfg)?.caches);
    Ok(Box::new(m.finish_load()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(extra: serde_json::Value) -> TargetConfig {
        let mut v = json!({"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 100, "num_local_experts": 4});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        TargetConfig::from_value("config.json", v).unwrap()
    }

    #[test]
    fn defaults_follow_transformers() {
        let g = GptOssConfig::parse(&cfg(json!({}))).unwrap();
        assert_eq!(
            g.layer_types,
            vec![
                LayerType::Sliding,
                LayerType::Full,
                LayerType::Sliding,
                LayerType::Full
            ]
        );
        assert_eq!(
            (g.sliding_window, g.moe.top_k, g.swiglu_limit),
            (128, 4, 7.0)
        );
        assert!(g.attention_bias);
        assert_eq!(g.rope.theta, 150_000.0);
        assert!(
            matches!(g.rope.kind, RopeKind::Yarn { factor, truncate: false, .. } if factor == 32.0)
        );
    }

    #[test]
    fn published_config_spelling() {
        // openai/gpt-oss-20b: rope_scaling yarn with truncate false, experts_per_token.
        let g = GptOssConfig::parse(&cfg(json!({"experts_per_token": 2, "num_experts_per_tok": 2,
            "rope_theta": 150000, "sliding_window": 128,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": false, "original_max_position_embeddings": 4096},
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]})))
        .unwrap();
        assert_eq!(g.moe.top_k, 2);
        let (_, attn) = g.rope.inv_freq(64);
        assert!((attn as f64 - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-6);
        let e = GptOssConfig::parse(&cfg(json!({"num_experts_per_tok": 5})))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("num_experts_per_tok") && e.contains("config.json"),
            "{e}"
        );
    }
}
