//! Tiny random hybrid targets (qwen3_5, qwen3_5_moe, qwen3_next) written as real Hugging Face
//! checkpoints (`config.json` + `model.safetensors`, transformers' tensor names), for the
//! lossless and rollback tests. Same PRNG as the dense [`super::TinyTarget`].

use super::{write_json, TensorFactory, TinyTarget};
use crate::{Error, Result};
use candle_core::{Device, Tensor};
use serde_json::{json, Value};
use std::path::Path;

/// Shape of a tiny hybrid target.
#[derive(Debug, Clone)]
pub struct TinyHybrid {
    /// `qwen3_5`, `qwen3_5_moe` or `qwen3_next`.
    pub family: &'static str,
    pub vocab: usize,
    pub hidden: usize,
    /// Dense MLP width (layers without experts).
    pub intermediate: usize,
    /// `full_attention` / `linear_attention` per layer.
    pub layer_types: Vec<&'static str>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub partial_rotary_factor: f64,
    pub lin_k_heads: usize,
    pub lin_v_heads: usize,
    pub lin_k_dim: usize,
    pub lin_v_dim: usize,
    pub conv_kernel: usize,
    /// MoE (qwen3_5_moe: every layer; qwen3_next: all but `mlp_only_layers`).
    pub experts: usize,
    pub top_k: usize,
    pub moe_intermediate: usize,
    pub shared_intermediate: usize,
    pub mlp_only_layers: Vec<usize>,
    pub tied: bool,
    /// `...ForConditionalGeneration` layout: config under `text_config`, tensors under
    /// `model.language_model.` (qwen3_5 / qwen3_5_moe, as published).
    pub multimodal: bool,
    pub seed: u64,
    /// Multiply the LM-head rows of these tokens (low entropy: a draft agrees more often).
    pub dominant: Vec<(u32, f64)>,
    /// Norm of one random direction added to every embedding row: the residual stream keeps
    /// it, so the final hidden state of every position (target and draft) leans that way.
    pub shared_direction: f64,
    /// LM-head rows that get `+ a * direction` (untied heads): these tokens compete for the
    /// argmax and the state decides between them, so a draft agrees often but not always.
    pub aligned: Vec<(u32, f64)>,
}

impl TinyHybrid {
    pub fn new(family: &'static str, seed: u64) -> Self {
        let (l, f) = ("linear_attention", "full_attention");
        Self {
            family,
            vocab: 96,
            hidden: 48,
            intermediate: 64,
            layer_types: vec![l, l, f, l, f],
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            partial_rotary_factor: 0.25,
            lin_k_heads: 2,
            lin_v_heads: if family == "qwen3_next" { 6 } else { 4 },
            lin_k_dim: 16,
            lin_v_dim: 8,
            conv_kernel: 4,
            experts: if family == "qwen3_5" { 0 } else { 4 },
            top_k: 2,
            moe_intermediate: 16,
            shared_intermediate: 24,
            mlp_only_layers: if family == "qwen3_next" {
                vec![1]
            } else {
                vec![]
            },
            tied: false,
            multimodal: family != "qwen3_next",
            seed,
            dominant: vec![],
            shared_direction: 0.0,
            aligned: vec![],
        }
    }

    pub fn layers(&self) -> usize {
        self.layer_types.len()
    }

    /// A dense stand-in with this target's hidden size, vocabulary and layer count, for
    /// [`super::TinyDraft::for_target`].
    pub fn as_tiny_target(&self) -> TinyTarget {
        TinyTarget {
            hidden: self.hidden,
            vocab: self.vocab,
            layers: self.layers(),
            ..TinyTarget::qwen3(self.seed)
        }
    }

    fn moe_layer(&self, l: usize) -> bool {
        self.experts > 0 && !self.mlp_only_layers.contains(&l)
    }

    pub fn config(&self) -> Value {
        // text-only configs say `qwen3_5_text` / `qwen3_5_moe_text` too
        let text_type = match self.family {
            "qwen3_next" => "qwen3_next".to_string(),
            f => format!("{f}_text"),
        };
        let mut t = json!({
            "model_type": text_type,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers(),
            "layer_types": self.layer_types,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.lin_k_heads,
            "linear_num_value_heads": self.lin_v_heads,
            "linear_key_head_dim": self.lin_k_dim,
            "linear_value_head_dim": self.lin_v_dim,
            "linear_conv_kernel_dim": self.conv_kernel,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": self.partial_rotary_factor},
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "eos_token_id": 2,
        });
        if self.family != "qwen3_5_moe" {
            t["intermediate_size"] = json!(self.intermediate);
        }
        if self.experts > 0 {
            t["num_experts"] = json!(self.experts);
            t["num_experts_per_tok"] = json!(self.top_k);
            t["moe_intermediate_size"] = json!(self.moe_intermediate);
            t["shared_expert_intermediate_size"] = json!(self.shared_intermediate);
        }
        if self.family == "qwen3_next" {
            t["norm_topk_prob"] = json!(true);
            t["decoder_sparse_step"] = json!(1);
            t["mlp_only_layers"] = json!(self.mlp_only_layers);
            t["architectures"] = json!(["Qwen3NextForCausalLM"]);
            return t;
        }
        if !self.multimodal {
            t["architectures"] = json!([if self.family == "qwen3_5" {
                "Qwen3_5ForCausalLM"
            } else {
                "Qwen3_5MoeForCausalLM"
            }]);
            return t;
        }
        json!({
            "model_type": self.family,
            "architectures": [if self.family == "qwen3_5" {
                "Qwen3_5ForConditionalGeneration"
            } else {
                "Qwen3_5MoeForConditionalGeneration"
            }],
            "text_config": t,
            "tie_word_embeddings": self.tied,
        })
    }

    /// Write `config.json` + `model.safetensors` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut f = TensorFactory::new(self.seed);
        let (h, v, d) = (self.hidden, self.vocab, self.head_dim);
        let pre = if self.multimodal {
            "model.language_model."
        } else {
            "model."
        };
        let std = 0.12;
        // zero-centred RMSNorm weights: (1 + w) in [0.5, 1.5]
        let znorm = |f: &mut TensorFactory, name: &str, n: usize| f.uniform(name, &[n], -0.5, 0.5);
        f.normal(&format!("{pre}embed_tokens.weight"), &[v, h], 0.3)?;
        let mut direction: Vec<f64> = (0..h).map(|_| f.rng.normal()).collect();
        let norm = direction.iter().map(|x| x * x).sum::<f64>().sqrt();
        direction.iter_mut().for_each(|x| *x /= norm);
        if self.shared_direction != 0.0 {
            let name = format!("{pre}embed_tokens.weight");
            let mut rows = f.tensors[&name].to_vec2::<f32>()?;
            for r in rows.iter_mut() {
                for (x, d) in r.iter_mut().zip(&direction) {
                    *x += (self.shared_direction * d) as f32;
                }
            }
            let flat: Vec<f32> = rows.into_iter().flatten().collect();
            f.tensors
                .insert(name, Tensor::from_vec(flat, (v, h), &Device::Cpu)?);
        }
        let (hk, hv, dk, dv) = (
            self.lin_k_heads,
            self.lin_v_heads,
            self.lin_k_dim,
            self.lin_v_dim,
        );
        let conv_dim = 2 * hk * dk + hv * dv;
        for (l, kind) in self.layer_types.iter().enumerate() {
            let p = format!("{pre}layers.{l}");
            znorm(&mut f, &format!("{p}.input_layernorm.weight"), h)?;
            znorm(&mut f, &format!("{p}.post_attention_layernorm.weight"), h)?;
            if *kind == "full_attention" {
                let a = format!("{p}.self_attn");
                f.normal(&format!("{a}.q_proj.weight"), &[2 * self.heads * d, h], std)?;
                f.normal(&format!("{a}.k_proj.weight"), &[self.kv_heads * d, h], std)?;
                f.normal(&format!("{a}.v_proj.weight"), &[self.kv_heads * d, h], std)?;
                f.normal(&format!("{a}.o_proj.weight"), &[h, self.heads * d], std)?;
                znorm(&mut f, &format!("{a}.q_norm.weight"), d)?;
                znorm(&mut f, &format!("{a}.k_norm.weight"), d)?;
            } else {
                let a = format!("{p}.linear_attn");
                if self.family == "qwen3_next" {
                    let r = hv / hk;
                    f.normal(
                        &format!("{a}.in_proj_qkvz.weight"),
                        &[hk * (2 * dk + 2 * r * dv), h],
                        std,
                    )?;
                    f.normal(&format!("{a}.in_proj_ba.weight"), &[hk * 2 * r, h], std)?;
                } else {
                    f.normal(&format!("{a}.in_proj_qkv.weight"), &[conv_dim, h], std)?;
                    f.normal(&format!("{a}.in_proj_z.weight"), &[hv * dv, h], std)?;
                    f.normal(&format!("{a}.in_proj_b.weight"), &[hv, h], std)?;
                    f.normal(&format!("{a}.in_proj_a.weight"), &[hv, h], std)?;
                }
                f.normal(
                    &format!("{a}.conv1d.weight"),
                    &[conv_dim, 1, self.conv_kernel],
                    0.3,
                )?;
                // A in [0.05, 2]: slow and fast decays
                let a_log: Vec<f32> = (0..hv)
                    .map(|_| ((0.05 + 1.95 * f.rng.uniform()) as f32).ln())
                    .collect();
                f.tensors.insert(
                    format!("{a}.A_log"),
                    Tensor::from_vec(a_log, hv, &Device::Cpu)?,
                );
                f.normal(&format!("{a}.dt_bias"), &[hv], 0.5)?;
                f.uniform(&format!("{a}.norm.weight"), &[dv], 0.5, 1.5)?;
                f.normal(&format!("{a}.out_proj.weight"), &[h, hv * dv], std)?;
            }
            let m = format!("{p}.mlp");
            if self.moe_layer(l) {
                let mi = self.moe_intermediate;
                f.normal(&format!("{m}.gate.weight"), &[self.experts, h], 0.5)?;
                for e in 0..self.experts {
                    f.normal(&format!("{m}.experts.{e}.gate_proj.weight"), &[mi, h], std)?;
                    f.normal(&format!("{m}.experts.{e}.up_proj.weight"), &[mi, h], std)?;
                    f.normal(&format!("{m}.experts.{e}.down_proj.weight"), &[h, mi], std)?;
                }
                let si = self.shared_intermediate;
                f.normal(
                    &format!("{m}.shared_expert.gate_proj.weight"),
                    &[si, h],
                    std,
                )?;
                f.normal(&format!("{m}.shared_expert.up_proj.weight"), &[si, h], std)?;
                f.normal(
                    &format!("{m}.shared_expert.down_proj.weight"),
                    &[h, si],
                    std,
                )?;
                f.normal(&format!("{m}.shared_expert_gate.weight"), &[1, h], 0.3)?;
            } else {
                let i = self.intermediate;
                f.normal(&format!("{m}.gate_proj.weight"), &[i, h], std)?;
                f.normal(&format!("{m}.up_proj.weight"), &[i, h], std)?;
                f.normal(&format!("{m}.down_proj.weight"), &[h, i], std)?;
            }
        }
        znorm(&mut f, &format!("{pre}norm.weight"), h)?;
        let head = if self.tied {
            format!("{pre}embed_tokens.weight")
        } else {
            f.normal("lm_head.weight", &[v, h], 0.3)?;
            "lm_head.weight".to_string()
        };
        if !self.dominant.is_empty() || !self.aligned.is_empty() {
            let mut rows = f.tensors[&head].to_vec2::<f32>()?;
            for &(tok, scale) in &self.dominant {
                rows[tok as usize]
                    .iter_mut()
                    .for_each(|x| *x *= scale as f32);
            }
            for &(tok, a) in &self.aligned {
                for (x, d) in rows[tok as usize].iter_mut().zip(&direction) {
                    *x += (a * d) as f32;
                }
            }
            let flat: Vec<f32> = rows.into_iter().flatten().collect();
            f.tensors
                .insert(head, Tensor::from_vec(flat, (v, h), &Device::Cpu)?);
        }
        f.save(&dir.join("model.safetensors"))?;
        write_json(&dir.join("config.json"), &self.config())
    }
}
