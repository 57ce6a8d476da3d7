//! gpt-oss (`model_type: gpt_oss`, openai/gpt-oss-20b and -120b).
//!
//! What differs from the dense decoder (transformers 5.17 `GptOssForCausalLM`):
//! - attention with biases on q/k/v/o and **sinks**: a learned logit per head that joins every
//!   query's softmax as one extra column and is then dropped (`nn::sdpa_with_sinks`);
//! - sliding-window (`sliding_window`, 128) and full layers alternate as `layer_types` says
//!   (transformers' default when absent: even layers sliding, odd layers full);
//! - yarn RoPE (rotate-half) read from the config; `truncate: false` in the published configs;
//! - an MoE feed-forward on every layer: router `x W^T + b`, the top-k LOGITS are softmaxed
//!   (not all of them), experts with biases whose `gate_up` output interleaves gate (even
//!   columns) and up (odd columns); activation `(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)`
//!   with `g = min(gate, l)`, `l = swiglu_limit` (7.0);
//! - expert weights stored as MXFP4 (`*_blocks` / `*_scales`, the published checkpoints) or as
//!   floats in transformers' layout (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`). MXFP4
//!   experts are dequantized exactly at load (`source::mxfp4`; memory figures there).
//!
//! The harmony chat format needs nothing here: it comes from the checkpoint's
//! `chat_template.jinja` like every other template.

use super::{
    checked_forward, ForwardOutput, Logits, TapRecorder, TargetCache, TargetInfo, TargetModel,
};
#[cfg(test)]
use crate::config::RopeKind;
use crate::config::{Fields, LayerType, RopeConfig, TargetConfig};
use crate::nn::routing::{top_k_desc, Routes};
use crate::nn::{attention_mask, Attention, AttentionSpec, Embedding, Linear, RmsNorm, Rope};
use crate::source::mxfp4::{self, Packed};
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{DType, Tensor};

/// gpt-oss settings beyond [`TargetConfig`].
#[derive(Debug, Clone)]
pub struct GptOssConfig {
    pub num_experts: usize,
    pub top_k: usize,
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
        let f = Fields::new(&cfg.file, &cfg.raw)?;
        if let Some(q) = f.sub("quantization_config")? {
            match q.opt_str("quant_method")? {
                Some("mxfp4") => {}
                other => {
                    return Err(q.err(
                        "quant_method",
                        format!(
                            "`{}` is not supported for gpt_oss (supported: mxfp4 experts, or float weights)",
                            other.unwrap_or("unknown")
                        ),
                    ))
                }
            }
        }
        let num_experts = match f.opt_usize("num_local_experts")? {
            Some(n) => n,
            None => f.pos_usize("num_experts")?,
        };
        if num_experts == 0 {
            return Err(f.err("num_local_experts", "must be > 0"));
        }
        let top_k = match f.opt_usize("num_experts_per_tok")? {
            Some(k) => k,
            None => f.opt_usize("experts_per_token")?.unwrap_or(4),
        };
        if top_k == 0 || top_k > num_experts {
            return Err(f.err(
                "num_experts_per_tok",
                format!("{top_k} must be in 1..={num_experts} (num_local_experts)"),
            ));
        }
        // Layer types, window and rope defaults are transformers' (TargetConfig applies them).
        let sliding_window = cfg.sliding_window.unwrap_or(128);
        if sliding_window == 0 && cfg.layer_types.contains(&LayerType::Sliding) {
            return Err(f.err("sliding_window", "must be > 0"));
        }
        Ok(Self {
            num_experts,
            top_k,
            swiglu_limit: f.opt_f64("swiglu_limit")?.unwrap_or(7.0),
            sliding_window,
            layer_types: cfg.layer_types.clone(),
            attention_bias: f.opt_bool("attention_bias")?.unwrap_or(true),
            rope: cfg.rope.clone(),
        })
    }
}

/// One expert: `gate_up` rows de-interleaved at load (gate rows first, then up rows).
struct Expert {
    gate_up: Linear,
    down: Linear,
}

struct Moe {
    router: Linear,
    experts: Vec<Expert>,
    top_k: usize,
    inter: usize,
    limit: f64,
}

impl Moe {
    fn expert_forward(&self, e: &Expert, x: &Tensor) -> Result<Tensor> {
        let gu = e.gate_up.forward(x)?;
        let gate = gu.narrow(1, 0, self.inter)?.minimum(self.limit)?;
        let up = gu
            .narrow(1, self.inter, self.inter)?
            .clamp(-self.limit, self.limit)?;
        let glu = (&gate * candle_nn::ops::sigmoid(&(&gate * ALPHA)?)?)?;
        e.down.forward(&((up + 1.0)? * glu)?)
    }

    /// `x [n, hidden] -> [n, hidden]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let logits = self
            .router
            .forward(x)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let mut routes = Routes::new(self.experts.len());
        for (row, l) in logits.iter().enumerate() {
            // softmax over the top-k logits only
            let top = top_k_desc(l, self.top_k);
            let m = l[top[0]];
            let ex: Vec<f32> = top.iter().map(|&e| (l[e] - m).exp()).collect();
            let sum: f32 = ex.iter().sum();
            for (&e, w) in top.iter().zip(ex) {
                routes.push(row, e, w / sum);
            }
        }
        routes.dispatch(x, |e, xe| self.expert_forward(&self.experts[e], xe))
    }
}

struct Layer {
    input_norm: RmsNorm,
    /// With its `sinks` set.
    attn: Attention,
    post_attn_norm: RmsNorm,
    moe: Moe,
    kind: LayerType,
}

pub struct GptOssModel {
    info: TargetInfo,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    sliding_window: usize,
    kv_heads: usize,
    head_dim: usize,
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

fn linear_bytes(l: &Linear) -> usize {
    l.weight_bytes()
}

/// Row order that puts the even rows (gate) first, then the odd rows (up).
fn deinterleave_index(rows: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let idx: Vec<u32> = (0..rows as u32)
        .step_by(2)
        .chain((1..rows as u32).step_by(2))
        .collect();
    Ok(Tensor::from_vec(idx, rows, dev)?)
}

/// Where a layer's expert matrices come from.
enum ExpertWeights {
    /// Packed MXFP4, dequantized one expert at a time.
    Mxfp4 { gate_up: Packed, down: Packed },
    /// Floats in transformers' layout: `gate_up [E, H, 2I]`, `down [E, I, H]`.
    Float { gate_up: Tensor, down: Tensor },
}

impl ExpertWeights {
    /// Expert `i`: `gate_up [2I, H]` and `down [H, I]` as (out, in), compute dtype and device.
    fn expert(&self, i: usize, w: &Weights) -> Result<(Tensor, Tensor)> {
        Ok(match self {
            ExpertWeights::Mxfp4 { gate_up, down } => {
                let on = |t: Tensor| -> Result<Tensor> {
                    Ok(t.to_dtype(w.dtype)?.to_device(&w.device)?)
                };
                (on(gate_up.slice(i)?)?, on(down.slice(i)?)?)
            }
            ExpertWeights::Float { gate_up, down } => (
                gate_up.get(i)?.t()?.contiguous()?,
                down.get(i)?.t()?.contiguous()?,
            ),
        })
    }
}

/// The experts of layer `p` (`{p}.mlp.experts.*`), from MXFP4 or float tensors.
/// Returns the experts and whether they were MXFP4.
fn load_experts(
    w: &Weights,
    p: &str,
    e: usize,
    h: usize,
    inter: usize,
) -> Result<(Vec<Expert>, bool)> {
    let gu_name = format!("{p}.mlp.experts.gate_up_proj");
    let down_name = format!("{p}.mlp.experts.down_proj");
    let gu_bias = w.get(&format!("{gu_name}_bias"), (e, 2 * inter))?;
    let down_bias = w.get(&format!("{down_name}_bias"), (e, h))?;
    let perm = deinterleave_index(2 * inter, &w.device)?;
    let mxfp4 = mxfp4::is_mxfp4(w, &gu_name);
    let src = if mxfp4 {
        ExpertWeights::Mxfp4 {
            gate_up: Packed::load(w, &gu_name, &[e, 2 * inter], h)?,
            down: Packed::load(w, &down_name, &[e, h], inter)?,
        }
    } else {
        ExpertWeights::Float {
            gate_up: w.get(&gu_name, (e, h, 2 * inter))?,
            down: w.get(&down_name, (e, inter, h))?,
        }
    };
    let experts = (0..e)
        .map(|i| {
            let (gu, down) = src.expert(i, w)?;
            // gate (even rows) first, then up (odd rows)
            let gu = gu.index_select(&perm, 0)?;
            let gb = gu_bias.get(i)?.index_select(&perm, 0)?;
            Ok(Expert {
                gate_up: Linear::dense(gu, Some(gb)),
                down: Linear::dense(down, Some(down_bias.get(i)?.contiguous()?)),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((experts, mxfp4))
}

impl GptOssModel {
    pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Self> {
        if w.is_gguf() {
            return Err(Error::input(
                "gpt_oss from GGUF is not supported: use the safetensors checkpoint (openai/gpt-oss-*)",
            ));
        }
        let g = GptOssConfig::parse(cfg)?;
        let (h, v, inter) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let eps = cfg.rms_norm_eps;
        let norm = |name: &str| RmsNorm::load(w, name, h, eps, false);
        let spec = AttentionSpec {
            hidden: h,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            bias: g.attention_bias,
            o_bias: g.attention_bias,
            qk_norm: false,
            qk_norm_add_one: false,
            eps,
            scale: (cfg.head_dim as f64).powf(-0.5),
        };
        let embed_tokens = w.embedding("model.embed_tokens.weight", v, h)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let mut mxfp4_layers = 0;
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let (experts, mx) = load_experts(w, &p, g.num_experts, h, inter)?;
            mxfp4_layers += mx as usize;
            let mut attn = Attention::load(w, &format!("{p}.self_attn"), spec.clone())?;
            attn.sinks = Some(w.get(&format!("{p}.self_attn.sinks"), cfg.num_attention_heads)?);
            attn.fuse()?;
            layers.push(Layer {
                input_norm: norm(&format!("{p}.input_layernorm.weight"))?,
                attn,
                post_attn_norm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                moe: Moe {
                    router: Linear::load(w, &format!("{p}.mlp.router"), h, g.num_experts, true)?,
                    experts,
                    top_k: g.top_k,
                    inter,
                    limit: g.swiglu_limit,
                },
                kind: g.layer_types[i],
            });
        }
        let lm_head = match (cfg.tie_word_embeddings, w.contains("lm_head.weight")) {
            (true, false) => w.tied_head(&embed_tokens)?,
            _ => Linear::load(w, "lm_head", h, v, false)?,
        };
        let info = TargetInfo {
            family: "gpt_oss",
            model_type: cfg.model_type.clone(),
            num_layers: cfg.num_hidden_layers,
            hidden_size: h,
            vocab_size: v,
            max_position: cfg.max_position_embeddings,
            dtype: w.dtype,
            device: w.device.clone(),
            weight_bytes: 0,
            quantization: (mxfp4_layers > 0)
                .then(|| format!("MXFP4->{:?} x{}", w.dtype, 2 * mxfp4_layers)),
        };
        let mut m = Self {
            info,
            embed_tokens,
            norm: norm("model.norm.weight")?,
            layers,
            lm_head,
            rope: Rope::new(&g.rope, cfg.head_dim),
            sliding_window: g.sliding_window,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        };
        m.info.weight_bytes = m.weight_bytes();
        Ok(m)
    }

    fn weight_bytes(&self) -> usize {
        let mut b = self.embed_tokens.bytes() + tensor_bytes(&self.norm.weight);
        b += linear_bytes(&self.lm_head);
        for l in &self.layers {
            b += tensor_bytes(&l.input_norm.weight) + tensor_bytes(&l.post_attn_norm.weight);
            let a = &l.attn;
            b += a.sinks.as_ref().map_or(0, tensor_bytes);
            b += a.qkv.as_ref().map_or(0, linear_bytes);
            b += [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &l.moe.router]
                .iter()
                .map(|x| linear_bytes(x))
                .sum::<usize>();
            for e in &l.moe.experts {
                b += linear_bytes(&e.gate_up) + linear_bytes(&e.down);
            }
        }
        b
    }

    fn forward_inner(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        let n = tokens.len();
        let dev = &self.info.device;
        let dt = self.info.dtype;
        let ids = Tensor::from_slice(tokens, n, dev)?;
        let mut h = self.embed_tokens.forward(&ids)?;
        let tables = self.rope.tables(start, n, dev, dt)?;
        let k_len = start + n;
        let mask_full = if n > 1 {
            attention_mask(n, start, k_len, true, None, dt, dev)?
        } else {
            None
        };
        let mask_slide = if self.layers.iter().any(|l| l.kind == LayerType::Sliding) {
            attention_mask(n, start, k_len, true, Some(self.sliding_window), dt, dev)?
        } else {
            None
        };
        let mut tapped = TapRecorder::new(taps);
        for (i, layer) in self.layers.iter().enumerate() {
            let kv = cache.layers[i].kv_mut()?;
            let mask = match layer.kind {
                // (linear-attention layer types are refused for this family at load)
                LayerType::Full | LayerType::Linear => mask_full.as_ref(),
                LayerType::Sliding => mask_slide.as_ref(),
            };
            let x = layer.input_norm.forward(&h)?;
            // q/k/v with biases, rope, cache append, softmax with the sink column, o_proj
            let a = layer.attn.forward(&x, &self.rope, &tables, kv, mask)?;
            let h1 = (h + a)?;
            let m = layer.moe.forward(&layer.post_attn_norm.forward(&h1)?)?;
            h = (h1 + m)?;
            tapped.record(i, &h);
        }
        let taps_out = tapped.finish()?;
        let logits = logits
            .rows(&h)?
            .map(|r| self.lm_head(&self.norm.forward(&r)?))
            .transpose()?;
        Ok(ForwardOutput {
            logits,
            taps: taps_out,
        })
    }
}

impl TargetModel for GptOssModel {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn new_cache(&self, capacity: usize) -> Result<TargetCache> {
        TargetCache::uniform_kv(
            self.layers.len(),
            self.kv_heads,
            self.head_dim,
            capacity,
            self.info.dtype,
            &self.info.device,
        )
    }

    fn forward(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        checked_forward(
            tokens,
            start,
            cache,
            taps,
            self.layers.len(),
            self.info.vocab_size,
            |c| self.forward_inner(tokens, start, c, taps, logits),
        )
    }

    fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        self.embed_tokens.forward(tokens)
    }

    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(hidden)?.to_dtype(DType::F32)?)
    }
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(GptOssModel::load(cfg, w)?))
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
        assert_eq!((g.sliding_window, g.top_k, g.swiglu_limit), (128, 4, 7.0));
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
        assert_eq!(g.top_k, 2);
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
