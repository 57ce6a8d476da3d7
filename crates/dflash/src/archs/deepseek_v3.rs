//! DeepSeek-V3 text models (`model_type: deepseek_v3`) and Kimi-K2.5 (`kimi_k25`, whose
//! `text_config` is a DeepSeek-V3 config, `model_type` `deepseek_v3` or `kimi_k2`).
//!
//! What differs from the dense decoder (transformers 5.17 `DeepseekV3ForCausalLM`):
//! - **multi-head latent attention**: queries from `q_proj`, or low-rank `q_a_proj` ->
//!   `q_a_layernorm` -> `q_b_proj` (`q_lora_rank`); one shared compressed row per position
//!   `kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]`, the latent
//!   normed by `kv_a_layernorm`, expanded per head by `kv_b_proj` into `k_nope`
//!   (`qk_nope_head_dim`) and `v` (`v_head_dim`); RoPE only on the rope dims, interleaved pairs
//!   when `rope_interleave` (default true); both small norms use eps 1e-6 as in transformers.
//!   Softmax scale `(nope + rope)^-0.5`, times `mscale^2` with
//!   `mscale = 0.1 * mscale_all_dim * ln(factor) + 1` when yarn sets `mscale_all_dim`.
//! - **cache**: the compressed row (normed latent + roped k_rope) per position, in a
//!   [`LayerCache::Latent`]; it truncates like any KV cache.
//! - **absorbed form** (`nn::LatentAttention`, as inference engines do).
//! - **MoE** after `first_k_dense_replace` dense layers: sigmoid router scores (router in
//!   f32), `e_score_correction_bias` added for the CHOICE only, grouped top-k (`n_group`
//!   groups scored by their two best experts, `topk_group` kept), weights = the chosen raw
//!   scores, normalized when `norm_topk_prob`, times `routed_scaling_factor`; plus
//!   `n_shared_experts` always-on shared experts.
//!
//! Tensor names: `model.*` (DeepSeek), `model.language_model.*` (Kimi-K2.5 saved by
//! transformers 5) or `language_model.model.*` (the published Kimi-K2.5 checkpoint); experts
//! per expert (`experts.{e}.gate_proj`) or stacked (`experts.gate_up_proj`).

use super::decoder::{embedding_params, lm_head, target_info, DecoderLayer, Ffn, Mixer};
use super::stack::{CacheKind, Head, Plan, Stack};
use super::TargetModel;
use crate::config::{RopeKind, TargetConfig};
use crate::nn::moe::{Experts, MoeConfig, Router, Scoring, SharedExpert};
use crate::nn::{
    Activation, GatedMlp, LatentAttention, Linear, MlaShape, QProj, RmsNorm, Rope, SparseMoe,
};
use crate::source::{Split, Weights};
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// transformers builds `q_a_layernorm` / `kv_a_layernorm` with the default eps, not
/// `rms_norm_eps`.
const LORA_NORM_EPS: f64 = 1e-6;

/// The DeepSeek-V3 settings beyond [`TargetConfig`].
#[derive(Debug, Clone)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub rope_interleave: bool,
    pub attention_bias: bool,
    /// Softmax scale, with the yarn `mscale_all_dim` correction.
    pub scale: f64,
    /// Routed experts (`n_routed_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    /// `norm_topk_prob`); the shared width is `n_shared_experts x moe_intermediate_size`.
    pub moe: MoeConfig,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f64,
    pub first_k_dense_replace: usize,
}

/// yarn's `get_mscale` as transformers writes it.
fn yarn_mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * factor.ln() + 1.0
    }
}

impl MlaConfig {
    pub fn parse(cfg: &TargetConfig) -> Result<Self> {
        let f = cfg.text()?;
        // Absent keys take transformers' DeepseekV3Config defaults; `q_lora_rank: null` means
        // a plain q_proj.
        let q_lora_rank = match f.obj.get("q_lora_rank") {
            None => Some(1536),
            Some(_) => match f.opt_usize("q_lora_rank")? {
                Some(0) => return Err(f.err("q_lora_rank", "must be > 0 or null")),
                r => r,
            },
        };
        let kv_lora_rank = f.pos_usize_or("kv_lora_rank", 512)?;
        let qk_nope_head_dim = f.pos_usize_or("qk_nope_head_dim", 128)?;
        let qk_rope_head_dim = f.pos_usize_or("qk_rope_head_dim", 64)?;
        if qk_rope_head_dim % 2 != 0 {
            return Err(f.err(
                "qk_rope_head_dim",
                format!("{qk_rope_head_dim} must be even for RoPE"),
            ));
        }
        let v_head_dim = f.pos_usize_or("v_head_dim", 128)?;
        if let Some(s) = f.opt_str("scoring_func")? {
            if s != "sigmoid" {
                return Err(f.err(
                    "scoring_func",
                    format!("`{s}` is not supported (deepseek_v3 routes with sigmoid scores)"),
                ));
            }
        }
        // Yarn's mscale_all_dim also scales the softmax (transformers' yarn_apply_mscale).
        let mut scale = ((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5);
        if let RopeKind::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } = cfg.rope.kind
        {
            if m != 0.0 {
                let ms = yarn_mscale(factor, m);
                scale *= ms * ms;
            }
        }
        let moe_intermediate_size = f.opt_usize("moe_intermediate_size")?.unwrap_or(2048);
        let n_shared_experts = f.opt_usize("n_shared_experts")?.unwrap_or(1);
        let n_routed_experts = match f.opt_usize("n_routed_experts")? {
            Some(n) => n,
            None => f.opt_usize("num_local_experts")?.unwrap_or(256),
        };
        let top_k = f.opt_usize("num_experts_per_tok")?.unwrap_or(8);
        let with_default = |key: &str, default: usize| -> Result<usize> {
            Ok(match f.obj.get(key) {
                None => default,
                Some(_) => f.opt_usize(key)?.unwrap_or(1).max(1),
            })
        };
        let n_group = with_default("n_group", 8)?;
        let topk_group = with_default("topk_group", 4)?;
        let first_k_dense_replace = f.opt_usize("first_k_dense_replace")?.unwrap_or(3);
        if first_k_dense_replace < cfg.num_hidden_layers {
            if n_routed_experts == 0 || top_k == 0 || top_k > n_routed_experts {
                return Err(f.err(
                    "num_experts_per_tok",
                    format!("{top_k} must be in 1..={n_routed_experts} (n_routed_experts)"),
                ));
            }
            if n_routed_experts % n_group != 0 {
                return Err(f.err(
                    "n_group",
                    format!("{n_group} does not divide n_routed_experts {n_routed_experts}"),
                ));
            }
            if topk_group > n_group || top_k > topk_group * (n_routed_experts / n_group) {
                return Err(f.err(
                    "topk_group",
                    format!(
                        "{topk_group} groups of {} experts cannot hold {top_k} experts (n_group {n_group})",
                        n_routed_experts / n_group
                    ),
                ));
            }
        }
        Ok(Self {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            rope_interleave: f.opt_bool("rope_interleave")?.unwrap_or(true),
            attention_bias: cfg.attention_bias,
            scale,
            moe: MoeConfig {
                num_experts: n_routed_experts,
                top_k,
                intermediate_size: moe_intermediate_size,
                shared_intermediate_size: n_shared_experts * moe_intermediate_size,
                norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(true),
            },
            n_group,
            topk_group,
            routed_scaling_factor: f.opt_f64("routed_scaling_factor")?.unwrap_or(2.5),
            first_k_dense_replace,
        })
    }
}

/// Float, FP8 (source/fp8.rs) and integer group-quantized checkpoints (source/intq.rs: the
/// published Kimi-K2.5's int4 routed experts, compressed-tensors pack-quantized); any other
/// method is refused with what its weights would take dequantized.
fn refuse_quantized(cfg: &TargetConfig) -> Result<()> {
    let Some(q) = cfg.quantization()? else {
        return Ok(());
    };
    let method = q.opt_str("quant_method")?.unwrap_or("unknown");
    if matches!(method, "fp8" | "compressed-tensors" | "awq" | "gptq") {
        return Ok(());
    }
    let need = super::footprint::estimate(cfg)
        .ok()
        .flatten()
        .map(|f| {
            format!(
                "; dequantized, its weights would take {} at bf16",
                super::footprint::human_bytes(f.loaded_bytes_bf16)
            )
        })
        .unwrap_or_default();
    Err(q.err(
        "quant_method",
        format!(
            "`{method}` checkpoints are not supported for deepseek_v3 / kimi_k25 (this build loads bf16/f16/f32 weights){need}"
        ),
    ))
}

/// Where the text model's tensors live: `(prefix of embed/layers/norm, name of the LM head)`.
fn tensor_prefix(w: &Weights) -> Result<(&'static str, &'static str)> {
    for (p, head) in [
        ("model", "lm_head.weight"),
        ("model.language_model", "lm_head.weight"),
        ("language_model.model", "language_model.lm_head.weight"),
    ] {
        if w.contains(&format!("{p}.embed_tokens.weight")) {
            return Ok((p, head));
        }
    }
    Err(Error::weights(
        "checkpoint",
        "no `model.embed_tokens.weight`, `model.language_model.embed_tokens.weight` or \
         `language_model.model.embed_tokens.weight`: not a DeepSeek-V3 / Kimi-K2.5 checkpoint",
    ))
}

/// Reorder the rows of a dense (or FP8: a scale per row then) linear layer.
fn permute_rows(l: Linear, idx: &Tensor) -> Result<Linear> {
    match l {
        Linear::Dense { weight, bias } => Ok(Linear::Dense {
            weight: weight.index_select(idx, 0)?,
            bias: bias.map(|b| b.index_select(idx, 0)).transpose()?,
        }),
        Linear::Fp8 { weight, bias } => Ok(Linear::Fp8 {
            weight: std::sync::Arc::new(weight.select_rows(idx)?),
            bias: bias.map(|b| b.index_select(idx, 0)).transpose()?,
        }),
        Linear::Quant { .. } | Linear::Q8 { .. } | Linear::Affine { .. } => Err(Error::input(
            "deepseek_v3: quantized projections cannot be re-laid out for interleaved RoPE",
        )),
    }
}

/// Row order turning `blocks` blocks of `width` rows, whose last `rope` rows are interleaved
/// RoPE pairs `(x0, x1), (x2, x3), ..`, into rotate-half order (evens, then odds). transformers'
/// interleaved RoPE returns exactly the rotate-half RoPE of that reordering, so the loader
/// permutes the producing weights once and the shared rotate-half [`Rope`] does the rest.
fn rope_deinterleave_index(
    blocks: usize,
    width: usize,
    rope: usize,
    dev: &Device,
) -> Result<Tensor> {
    let pass = width - rope;
    let mut idx = Vec::with_capacity(blocks * width);
    for b in 0..blocks {
        let base = (b * width) as u32;
        idx.extend((0..pass as u32).map(|j| base + j));
        idx.extend((0..rope as u32).step_by(2).map(|j| base + pass as u32 + j));
        idx.extend((1..rope as u32).step_by(2).map(|j| base + pass as u32 + j));
    }
    Ok(Tensor::from_vec(idx, blocks * width, dev)?)
}

impl MlaConfig {
    fn shape(&self, heads: usize) -> MlaShape {
        MlaShape {
            heads,
            nope: self.qk_nope_head_dim,
            rope: self.qk_rope_head_dim,
            v_dim: self.v_head_dim,
            kv_lora: self.kv_lora_rank,
            scale: self.scale,
        }
    }
}

/// Caches and parameters of a DeepSeek-V3 / Kimi config.
pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    let m = MlaConfig::parse(cfg)?;
    let h = cfg.hidden_size as u64;
    let heads = cfg.num_attention_heads as u64;
    let (nope, rope, vd, kvr) = (
        m.qk_nope_head_dim as u64,
        m.qk_rope_head_dim as u64,
        m.v_head_dim as u64,
        m.kv_lora_rank as u64,
    );
    let b = m.attention_bias as u64;
    let q = match m.q_lora_rank.map(|r| r as u64) {
        Some(r) => h * r + b * r + r + r * heads * (nope + rope),
        None => h * heads * (nope + rope),
    };
    let attn = q
        + h * (kvr + rope)
        + b * (kvr + rope)
        + kvr
        + kvr * heads * (nope + vd)
        + heads * vd * h
        + b * h;
    let mut p = embedding_params(cfg, cfg.tie_word_embeddings);
    for i in 0..cfg.num_hidden_layers {
        p.plain += 2 * h + attn;
        if i < m.first_k_dense_replace {
            p.plain += GatedMlp::params(cfg.hidden_size, cfg.intermediate_size, false);
        } else {
            let q = m.moe.params(cfg.hidden_size);
            // no shared-expert gate; the correction bias
            p.plain += q.plain - h + m.moe.num_experts as u64;
            p.experts += q.experts;
            p.affine_experts += q.affine_experts;
        }
    }
    let width = m.kv_lora_rank + m.qk_rope_head_dim;
    Ok(Plan {
        caches: vec![CacheKind::Latent { width }; cfg.num_hidden_layers],
        params: p,
    })
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    if w.is_gguf() {
        return Err(Error::input(
            "deepseek_v3 / kimi_k25 from GGUF is not supported: use the safetensors checkpoint",
        ));
    }
    let c = MlaConfig::parse(cfg)?;
    refuse_quantized(cfg)?;
    let (h, v, heads) = (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads);
    let (nope, rope_d, vd, kvr) = (
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
        c.kv_lora_rank,
    );
    let qk = nope + rope_d;
    let act = Activation::parse(&cfg.file, &cfg.hidden_act)?;
    let (base, head_name) = tensor_prefix(w)?;
    let dev = &w.device;
    let eps = cfg.rms_norm_eps;
    // tensor parallel: a rank's share of the heads (q / q_b rows, kv_b rows, o_proj columns,
    // all head-major); the compressed row (q_a, kv_a, the latent cache) whole on every rank
    let shard = w.shard().cloned();
    if let Some(sh) = &shard {
        sh.check_divides(heads, "attention heads")?;
    }
    let (rank, world) = shard.as_ref().map_or((0, 1), |s| (s.rank, s.world));
    let lh = heads / world;
    let q_perm = rope_deinterleave_index(lh, qk, rope_d, dev)?;
    let kv_perm = rope_deinterleave_index(1, kvr + rope_d, rope_d, dev)?;
    let embed = w.embedding(&format!("{base}.embed_tokens.weight"), v, h)?;
    let norm = |name: &str, dim: usize, eps: f64| RmsNorm::load(w, name, dim, eps, false);
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("{base}.layers.{i}");
        let a = format!("{p}.self_attn");
        let lin = |n: &str, i, o, b| Linear::load(w, &format!("{a}.{n}"), i, o, b);
        let split = |n: &str, i, o, b, part| w.linear_split(&format!("{a}.{n}"), i, o, b, part);
        let interleave = |l: Linear, idx: &Tensor| {
            if c.rope_interleave {
                permute_rows(l, idx)
            } else {
                Ok(l)
            }
        };
        let q = match c.q_lora_rank {
            None => QProj::Plain(interleave(
                split("q_proj", h, heads * qk, false, Split::Out)?,
                &q_perm,
            )?),
            Some(r) => QProj::LowRank {
                a: lin("q_a_proj", h, r, c.attention_bias)?,
                norm: norm(&format!("{a}.q_a_layernorm.weight"), r, LORA_NORM_EPS)?,
                b: interleave(
                    split("q_b_proj", r, heads * qk, false, Split::Out)?,
                    &q_perm,
                )?,
            },
        };
        let kv_a = interleave(
            lin("kv_a_proj_with_mqa", h, kvr + rope_d, c.attention_bias)?,
            &kv_perm,
        )?;
        let kv_b = w.get_part(
            &format!("{a}.kv_b_proj.weight"),
            (heads * (nope + vd), kvr),
            0,
            rank * lh * (nope + vd),
            lh * (nope + vd),
        )?;
        let mut attn = LatentAttention::new(
            q,
            kv_a,
            norm(&format!("{a}.kv_a_layernorm.weight"), kvr, LORA_NORM_EPS)?,
            &kv_b,
            split("o_proj", heads * vd, h, c.attention_bias, Split::In)?,
            c.shape(lh),
        )?;
        attn.shard = shard.clone();
        let ffn = if i < c.first_k_dense_replace {
            let mut m =
                GatedMlp::load(w, &format!("{p}.mlp"), h, cfg.intermediate_size, false, act)?;
            m.fuse()?;
            Ffn::Dense(m)
        } else {
            let mc = &c.moe;
            let e = mc.num_experts;
            // transformers routes in float32
            let router = Router {
                proj: Linear::dense(
                    w.get_dtype(&format!("{p}.mlp.gate.weight"), (e, h), DType::F32)?,
                    None,
                ),
                f32_input: true,
                scoring: Scoring::SigmoidGrouped {
                    correction: w
                        .get_dtype(
                            &format!("{p}.mlp.gate.e_score_correction_bias"),
                            e,
                            DType::F32,
                        )?
                        .to_vec1::<f32>()?,
                    n_group: c.n_group,
                    topk_group: c.topk_group,
                    renormalize: mc.norm_topk_prob,
                },
                top_k: mc.top_k,
                scale: c.routed_scaling_factor as f32,
                per_expert_scale: None,
                device_tables: Default::default(),
            };
            let shared = if mc.shared_intermediate_size > 0 {
                let mut m = GatedMlp::load_whole(
                    w,
                    &format!("{p}.mlp.shared_experts"),
                    h,
                    mc.shared_intermediate_size,
                    false,
                    act,
                )?;
                m.fuse()?;
                Some(SharedExpert { mlp: m, gate: None })
            } else {
                None
            };
            Ffn::Moe(SparseMoe {
                router,
                experts: Experts::load(w, &format!("{p}.mlp"), h, mc.intermediate_size, e, act)?,
                shared,
            })
        };
        layers.push(DecoderLayer {
            input_norm: norm(&format!("{p}.input_layernorm.weight"), h, eps)?,
            mixer: Mixer::Latent { attn, rope: 0 },
            post_norm: norm(&format!("{p}.post_attention_layernorm.weight"), h, eps)?,
            sandwich: None,
            ffn,
            slot: i,
            family: "deepseek_v3",
        });
    }
    let head = Head::new(
        norm(&format!("{base}.norm.weight"), h, eps)?,
        lm_head(
            w,
            head_name.trim_end_matches(".weight"),
            &embed,
            cfg.tie_word_embeddings,
            h,
            v,
        )?,
        None,
        &embed,
    );
    let info = target_info(cfg, w, "deepseek_v3");
    let ropes = vec![Rope::new(&cfg.rope, rope_d)];
    let m = Stack::new(info, embed, ropes, layers, head, plan(cfg)?.caches);
    Ok(Box::new(m.finish_load()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Kimi-K2.5's published text_config (the fields the model reads).
    fn kimi_k25() -> serde_json::Value {
        json!({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
            "tie_word_embeddings": false,
            "text_config": {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
                "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1,
                "num_experts_per_tok": 8, "first_k_dense_replace": 1, "q_lora_rank": 1536,
                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                "norm_topk_prob": true, "routed_scaling_factor": 2.827, "vocab_size": 163840,
                "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 262144,
                "rope_scaling": {"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
                "tie_word_embeddings": false}})
    }

    #[test]
    fn kimi_text_config_and_yarn_mscale() {
        let cfg = TargetConfig::from_value("config.json", kimi_k25()).unwrap();
        assert_eq!(cfg.model_type, "kimi_k2");
        let c = MlaConfig::parse(&cfg).unwrap();
        assert_eq!(
            (c.q_lora_rank, c.kv_lora_rank, c.v_head_dim),
            (Some(1536), 512, 128)
        );
        assert!(c.rope_interleave);
        // softmax scale: 192^-0.5 * (0.1 ln 64 + 1)^2; rope cos/sin factor: mscale/mscale_all_dim = 1
        let ms = 0.1 * 64f64.ln() + 1.0;
        assert!((c.scale - 192f64.powf(-0.5) * ms * ms).abs() < 1e-12);
        let (inv, attn) = cfg.rope.inv_freq(64);
        assert_eq!(inv.len(), 32);
        assert_eq!(attn, 1.0);
        assert_eq!(c.routed_scaling_factor, 2.827);
    }

    #[test]
    fn bad_routing_config_is_named() {
        let mut v = kimi_k25();
        v["text_config"]["n_group"] = json!(5);
        let cfg = TargetConfig::from_value("config.json", v).unwrap();
        let e = MlaConfig::parse(&cfg).unwrap_err().to_string();
        assert!(e.contains("text_config.n_group"), "{e}");
        let mut v = kimi_k25();
        v["text_config"]["scoring_func"] = json!("softmax");
        let cfg = TargetConfig::from_value("config.json", v).unwrap();
        let e = MlaConfig::parse(&cfg).unwrap_err().to_string();
        assert!(e.contains("scoring_func"), "{e}");
    }

    #[test]
    fn published_int4_checkpoint_passes_and_other_methods_are_refused_with_their_size() {
        let mut v = kimi_k25();
        v["text_config"]["quantization_config"] = json!({"quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32}}}});
        let cfg = TargetConfig::from_value("config.json", v.clone()).unwrap();
        assert!(refuse_quantized(&cfg).is_ok());
        v["text_config"]["quantization_config"] = json!({"quant_method": "bitsandbytes"});
        let cfg = TargetConfig::from_value("config.json", v).unwrap();
        let e = refuse_quantized(&cfg).unwrap_err().to_string();
        assert!(
            e.contains("text_config.quantization_config.quant_method")
                && e.contains("bitsandbytes")
                && e.contains("TB at bf16"),
            "{e}"
        );
        let cfg = TargetConfig::from_value("config.json", kimi_k25()).unwrap();
        assert!(refuse_quantized(&cfg).is_ok());
    }

    #[test]
    fn deinterleave_index_layout() {
        let idx = rope_deinterleave_index(2, 5, 4, &Device::Cpu).unwrap();
        assert_eq!(
            idx.to_vec1::<u32>().unwrap(),
            vec![0, 1, 3, 2, 4, 5, 6, 8, 7, 9]
        );
    }
}
