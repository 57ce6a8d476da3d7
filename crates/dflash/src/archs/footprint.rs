//! How much memory a checkpoint needs, from its config's shapes alone (nothing is read but
//! `config.json`): the parameter count, the bytes of the checkpoint as published (bf16, or
//! MXFP4 / int4 experts where its `quantization_config` says so) and the bytes this engine holds
//! once loaded (every weight in the compute dtype: quantized experts are dequantized at load).
//!
//! `dflash models` prints these for the registry rows (from the published configs in
//! `registry::published_target_config`) next to this machine's memory.

use super::{deepseek_v3::MlaConfig, gpt_oss::GptOssConfig, qwen3_moe::moe_spec};
use crate::config::{Fields, TargetConfig};
use crate::Result;

/// Memory needs of one target checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Footprint {
    pub params: u64,
    /// Bytes of the weights as published; None when the quantization is not one we can size.
    pub stored_bytes: Option<u64>,
    /// Bytes of the loaded weights with bf16 compute (f32 compute, the CPU default: twice).
    pub loaded_bytes_bf16: u64,
    /// Target cache bytes per token of context with bf16 compute (KV or MLA latent rows).
    pub cache_bytes_per_token_bf16: u64,
}

/// Parameter counts split by how a checkpoint may store them.
#[derive(Default)]
struct Counts {
    /// Weights stored in the checkpoint's float dtype.
    plain: u64,
    /// Routed-expert matrices (the part MXFP4 / int4 checkpoints quantize).
    experts: u64,
}

/// How the checkpoint stores routed-expert matrices, in bytes per value.
fn expert_bytes_per_value(cfg: &TargetConfig, float_bytes: f64) -> Result<Option<f64>> {
    let top = Fields::new(&cfg.file, &cfg.raw)?;
    let q = match top.sub("quantization_config")? {
        Some(q) => Some(q),
        None => match top.sub("text_config")? {
            Some(t) => t.sub("quantization_config")?,
            None => None,
        },
    };
    let Some(q) = q else {
        return Ok(Some(float_bytes));
    };
    Ok(match q.opt_str("quant_method")? {
        // 16 bytes of e2m1 pairs + 1 scale byte per 32 values
        Some("mxfp4") => Some(17.0 / 32.0),
        // pack-quantized int groups with a bf16 scale per group (Kimi-K2.5: 4 bits, 32)
        Some("compressed-tensors") => {
            let mut found = None;
            if let Some(groups) = q.sub("config_groups")? {
                for name in groups.obj.keys() {
                    if let Some(wt) = groups
                        .sub(name)?
                        .and_then(|g| g.sub("weights").ok().flatten())
                    {
                        let bits = wt.opt_usize("num_bits")?.unwrap_or(4) as f64;
                        let group = wt.opt_usize("group_size")?.unwrap_or(32).max(1) as f64;
                        found = Some(bits / 8.0 + 2.0 / group);
                    }
                }
            }
            found
        }
        _ => None,
    })
}

fn float_bytes(cfg: &TargetConfig) -> f64 {
    match cfg.dtype.as_deref() {
        Some("float32") => 4.0,
        _ => 2.0,
    }
}

/// The footprint of a target from its config, for the families whose shapes are known here
/// (None for the others).
pub fn estimate(cfg: &TargetConfig) -> Result<Option<Footprint>> {
    let (h, v, l) = (
        cfg.hidden_size as u64,
        cfg.vocab_size as u64,
        cfg.num_hidden_layers as u64,
    );
    let mut c = Counts {
        plain: v * h + h + if cfg.tie_word_embeddings { 0 } else { v * h },
        experts: 0,
    };
    let (heads, kv, hd) = (
        cfg.num_attention_heads as u64,
        cfg.num_key_value_heads as u64,
        cfg.head_dim as u64,
    );
    let gqa = |bias: bool, o_bias: bool| {
        let qd = heads * hd;
        let kd = kv * hd;
        h * qd
            + 2 * h * kd
            + qd * h
            + if bias { qd + 2 * kd } else { 0 }
            + if o_bias { h } else { 0 }
    };
    let cache_per_token = match cfg.model_type.as_str() {
        "qwen3" | "llama" | "qwen2" | "qwen3_moe" => {
            let qk_norm = matches!(cfg.model_type.as_str(), "qwen3" | "qwen3_moe");
            let bias = cfg.attention_bias || cfg.model_type == "qwen2";
            let moe = if cfg.model_type == "qwen3_moe" {
                Some(moe_spec(cfg)?)
            } else {
                None
            };
            for i in 0..cfg.num_hidden_layers {
                c.plain += 2 * h + gqa(bias, cfg.attention_bias && cfg.model_type != "qwen2");
                c.plain += if qk_norm { 2 * hd } else { 0 };
                match &moe {
                    Some(m) if m.layers[i] => {
                        let e = m.num_experts as u64;
                        c.plain += e * h;
                        c.experts += e * 3 * h * m.intermediate_size as u64;
                    }
                    _ => c.plain += 3 * h * cfg.intermediate_size as u64,
                }
            }
            l * 2 * kv * hd * 2
        }
        "gpt_oss" => {
            let g = GptOssConfig::parse(cfg)?;
            let (e, i) = (g.num_experts as u64, cfg.intermediate_size as u64);
            // attention (+ sinks), norms, router (+ bias), expert biases
            c.plain += l * (gqa(g.attention_bias, g.attention_bias) + heads + 2 * h + e * h + e);
            c.plain += l * e * (2 * i + h);
            c.experts += l * e * (2 * i * h + i * h);
            l * 2 * kv * hd * 2
        }
        "deepseek_v3" | "kimi_k2" | "kimi_k25" => {
            let m = MlaConfig::parse(cfg)?;
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
            for i in 0..cfg.num_hidden_layers {
                c.plain += 2 * h + attn;
                if i < m.first_k_dense_replace {
                    c.plain += 3 * h * cfg.intermediate_size as u64;
                } else {
                    let (e, mi) = (m.n_routed_experts as u64, m.moe_intermediate_size as u64);
                    c.plain += e * h + e + 3 * h * mi * m.n_shared_experts as u64;
                    c.experts += e * 3 * h * mi;
                }
            }
            l * (kvr + rope) * 2
        }
        _ => return Ok(None),
    };
    let fb = float_bytes(cfg);
    let stored = expert_bytes_per_value(cfg, fb)?
        .map(|eb| (c.plain as f64 * fb + c.experts as f64 * eb).round() as u64);
    let params = c.plain + c.experts;
    Ok(Some(Footprint {
        params,
        stored_bytes: stored,
        loaded_bytes_bf16: 2 * params,
        cache_bytes_per_token_bf16: cache_per_token,
    }))
}

/// This machine's memory from /proc/meminfo: (total, available) bytes; None elsewhere.
pub fn host_memory() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        s.lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse::<u64>()
            .ok()
            .map(|kb| kb * 1024)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}

/// `12.3 GB` (decimal units, as model cards state sizes).
pub fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e12 {
        format!("{:.2} TB", b / 1e12)
    } else if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else {
        format!("{:.0} MB", b / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{published_target_config, DRAFT_REGISTRY};

    fn of(target: &str) -> Footprint {
        let v = published_target_config(target).unwrap();
        estimate(&TargetConfig::from_value("c", v).unwrap())
            .unwrap()
            .unwrap()
    }

    fn near(x: u64, want: f64, rel: f64) -> bool {
        ((x as f64 - want) / want).abs() < rel
    }

    /// Parameter counts and checkpoint sizes as the model cards / hub repos state them.
    #[test]
    fn published_sizes() {
        let cases: &[(&str, f64, Option<f64>)] = &[
            ("Qwen3-4B", 4.02e9, Some(8.05e9)),
            ("Qwen3-8B", 8.19e9, Some(16.4e9)),
            ("Qwen3-Coder-30B-A3B", 30.5e9, Some(61.1e9)),
            ("Llama-3.1-8B-Instruct", 8.03e9, Some(16.1e9)),
            ("gpt-oss-20b", 20.9e9, Some(13.8e9)),
            ("gpt-oss-120b", 116.8e9, Some(65.3e9)),
            // moonshotai/Kimi-K2.5: 554.3 GiB on the hub, vision tower included
            ("Kimi-K2.5", 1.03e12, Some(554.3 * 1.073_741_824e9)),
        ];
        for &(t, params, stored) in cases {
            let f = of(t);
            assert!(near(f.params, params, 0.01), "{t}: {} params", f.params);
            assert_eq!(f.loaded_bytes_bf16, 2 * f.params);
            if let Some(s) = stored {
                assert!(
                    near(f.stored_bytes.unwrap(), s, 0.01),
                    "{t}: {:?}",
                    f.stored_bytes
                );
            }
        }
        // MLA caches a 576-wide row per layer: 61 * 576 * 2 bytes per token
        assert_eq!(of("Kimi-K2.5").cache_bytes_per_token_bf16, 61 * 576 * 2);
        assert_eq!(
            of("gpt-oss-20b").cache_bytes_per_token_bf16,
            24 * 2 * 8 * 64 * 2
        );
        // every row with a recorded config is sized
        for e in DRAFT_REGISTRY {
            if let Some(v) = published_target_config(e.target) {
                let c = TargetConfig::from_value("c", v).unwrap();
                assert!(estimate(&c).unwrap().is_some(), "{}", e.target);
            }
        }
    }
}
