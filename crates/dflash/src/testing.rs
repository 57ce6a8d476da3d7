//! Tiny random-weight models for tests, benchmarks and the no-download demo.
//!
//! Weights come from a seeded PRNG (splitmix64 + Box-Muller) so that the same seed gives the
//! same model on every machine and crate version. Files are written exactly like a Hugging
//! Face checkpoint (`config.json` + `model.safetensors`), so they go through the real loader.

pub mod hybrid;
pub use hybrid::TinyHybrid;

use crate::{Error, Result};
use candle_core::{Device, Tensor};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

/// The largest `|a - b|` over two tensors of one shape (f32 or any float dtype), for tests.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).and_then(|d| d.abs()).and_then(|d| d.flatten_all());
    d.and_then(|d| {
        d.to_dtype(candle_core::DType::F32)?
            .max(0)?
            .to_scalar::<f32>()
    })
    .expect("max_abs_diff: tensors of one shape")
}

pub use crate::rng::Rng;

/// A tensor builder with a seeded PRNG.
pub struct TensorFactory {
    pub rng: Rng,
    pub tensors: HashMap<String, Tensor>,
}

impl TensorFactory {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed),
            tensors: HashMap::new(),
        }
    }
    pub fn normal(&mut self, name: &str, shape: &[usize], std: f64) -> Result<()> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (self.rng.normal() * std) as f32).collect();
        self.tensors
            .insert(name.to_string(), Tensor::from_vec(v, shape, &Device::Cpu)?);
        Ok(())
    }
    /// Norm weights uniform in [lo, hi].
    pub fn uniform(&mut self, name: &str, shape: &[usize], lo: f64, hi: f64) -> Result<()> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| (lo + (hi - lo) * self.rng.uniform()) as f32)
            .collect();
        self.tensors
            .insert(name.to_string(), Tensor::from_vec(v, shape, &Device::Cpu)?);
        Ok(())
    }
    pub fn save(&self, path: &Path) -> Result<()> {
        candle_core::safetensors::save(&self.tensors, path)
            .map_err(|e| Error::weights(path.display().to_string(), e.to_string()))
    }
}

/// Shape of a tiny target.
#[derive(Debug, Clone)]
pub struct TinyTarget {
    /// `qwen3` or `llama`.
    pub model_type: String,
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub tied: bool,
    pub seed: u64,
    /// Extra config entries (rope scaling etc.).
    pub extra: Value,
    /// Multiply the LM-head rows of these tokens, making the model low-entropy (so that a
    /// draft sharing the head agrees often).
    pub dominant: Vec<(u32, f64)>,
    /// Zero the final norm: every logit is 0, so the target always picks token 0.
    pub zero_final_norm: bool,
    /// Zero the LM-head row of token 0 (and only that row).
    pub zero_head_row0: bool,
}

impl TinyTarget {
    pub fn qwen3(seed: u64) -> Self {
        Self {
            model_type: "qwen3".into(),
            vocab: 128,
            hidden: 64,
            intermediate: 128,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            tied: false,
            seed,
            extra: json!({}),
            dominant: vec![],
            zero_final_norm: false,
            zero_head_row0: false,
        }
    }
    /// Qwen2: q/k/v biases, no q/k norm.
    pub fn qwen2(seed: u64) -> Self {
        Self {
            model_type: "qwen2".into(),
            tied: true,
            ..Self::qwen3(seed)
        }
    }
    pub fn llama(seed: u64) -> Self {
        Self {
            model_type: "llama".into(),
            heads: 4,
            kv_heads: 1,
            head_dim: 16,
            tied: true,
            extra: json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
            ..Self::qwen3(seed)
        }
    }

    pub fn config(&self) -> Value {
        let mut c = json!({
            "model_type": self.model_type,
            "architectures": [match self.model_type.as_str() {
                "qwen3" => "Qwen3ForCausalLM",
                "qwen3_moe" => "Qwen3MoeForCausalLM",
                "qwen2" => "Qwen2ForCausalLM",
                _ => "LlamaForCausalLM",
            }],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 2048,
            "rope_theta": 10000.0,
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
        });
        if let (Some(o), Some(e)) = (c.as_object_mut(), self.extra.as_object()) {
            for (k, v) in e {
                o.insert(k.clone(), v.clone());
            }
        }
        c
    }

    /// (experts, expert intermediate size) when layer `l` is a MoE layer (`num_experts` in
    /// `extra`, with `decoder_sparse_step` / `mlp_only_layers` as qwen3_moe reads them).
    fn moe_layer(&self, l: usize) -> Option<(usize, usize)> {
        let e = self.extra.get("num_experts")?.as_u64()? as usize;
        let mi = self.extra.get("moe_intermediate_size")?.as_u64()? as usize;
        let step = self
            .extra
            .get("decoder_sparse_step")
            .and_then(|x| x.as_u64())
            .unwrap_or(1)
            .max(1) as usize;
        let only: Vec<u64> = self
            .extra
            .get("mlp_only_layers")
            .and_then(|x| x.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
            .unwrap_or_default();
        (!only.contains(&(l as u64)) && (l + 1).is_multiple_of(step)).then_some((e, mi))
    }

    /// Write `config.json` + `model.safetensors` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut f = TensorFactory::new(self.seed);
        let (h, v, i, d) = (self.hidden, self.vocab, self.intermediate, self.head_dim);
        let std = 0.1;
        f.normal("model.embed_tokens.weight", &[v, h], 1.0)?;
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            f.uniform(&format!("{p}.input_layernorm.weight"), &[h], 0.5, 1.5)?;
            f.uniform(
                &format!("{p}.post_attention_layernorm.weight"),
                &[h],
                0.5,
                1.5,
            )?;
            f.normal(
                &format!("{p}.self_attn.q_proj.weight"),
                &[self.heads * d, h],
                std,
            )?;
            f.normal(
                &format!("{p}.self_attn.k_proj.weight"),
                &[self.kv_heads * d, h],
                std,
            )?;
            f.normal(
                &format!("{p}.self_attn.v_proj.weight"),
                &[self.kv_heads * d, h],
                std,
            )?;
            f.normal(
                &format!("{p}.self_attn.o_proj.weight"),
                &[h, self.heads * d],
                std,
            )?;
            if self.model_type == "qwen2" {
                for (n, rows) in [
                    ("q", self.heads * d),
                    ("k", self.kv_heads * d),
                    ("v", self.kv_heads * d),
                ] {
                    f.normal(&format!("{p}.self_attn.{n}_proj.bias"), &[rows], 0.5)?;
                }
            }
            if self.model_type.starts_with("qwen3") {
                f.uniform(&format!("{p}.self_attn.q_norm.weight"), &[d], 0.5, 1.5)?;
                f.uniform(&format!("{p}.self_attn.k_norm.weight"), &[d], 0.5, 1.5)?;
            }
            match self.moe_layer(l) {
                Some((experts, mi)) => {
                    f.normal(&format!("{p}.mlp.gate.weight"), &[experts, h], 0.5)?;
                    for e in 0..experts {
                        f.normal(
                            &format!("{p}.mlp.experts.{e}.gate_proj.weight"),
                            &[mi, h],
                            std,
                        )?;
                        f.normal(
                            &format!("{p}.mlp.experts.{e}.up_proj.weight"),
                            &[mi, h],
                            std,
                        )?;
                        f.normal(
                            &format!("{p}.mlp.experts.{e}.down_proj.weight"),
                            &[h, mi],
                            std,
                        )?;
                    }
                }
                None => {
                    f.normal(&format!("{p}.mlp.gate_proj.weight"), &[i, h], std)?;
                    f.normal(&format!("{p}.mlp.up_proj.weight"), &[i, h], std)?;
                    f.normal(&format!("{p}.mlp.down_proj.weight"), &[h, i], std)?;
                }
            }
        }
        if self.zero_final_norm {
            f.uniform("model.norm.weight", &[h], 0.0, 0.0)?;
        } else {
            f.uniform("model.norm.weight", &[h], 0.5, 1.5)?;
        }
        let head_name = if self.tied {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        if !self.tied {
            f.normal("lm_head.weight", &[v, h], 0.3)?;
        }
        if self.zero_head_row0 {
            let t = f.tensors[head_name].clone();
            let mut rows = t.to_vec2::<f32>()?;
            rows[0].iter_mut().for_each(|x| *x = 0.0);
            let flat: Vec<f32> = rows.into_iter().flatten().collect();
            f.tensors.insert(
                head_name.to_string(),
                Tensor::from_vec(flat, (v, h), &Device::Cpu)?,
            );
        }
        if !self.dominant.is_empty() {
            let t = f.tensors[head_name].clone();
            let mut rows = t.to_vec2::<f32>()?;
            for &(tok, scale) in &self.dominant {
                for x in rows[tok as usize].iter_mut() {
                    *x *= scale as f32;
                }
            }
            let flat: Vec<f32> = rows.into_iter().flatten().collect();
            f.tensors.insert(
                head_name.to_string(),
                Tensor::from_vec(flat, (v, h), &Device::Cpu)?,
            );
        }
        f.save(&dir.join("model.safetensors"))?;
        write_json(&dir.join("config.json"), &self.config())
    }
}

/// Writes `t` (a dense, untied target) to `dir` as a scripted bigram model: after token `a` it
/// picks `b`, for each `(a, b, logit)` of `script` (several `b` after one `a` are ranked by
/// their logits; every other token gets logit 0). How: the attention and MLP outputs are
/// zero, so each position's last hidden state is its token's embedding; the embedding of
/// each `a` is one-hot (one dimension per distinct `a`, at most `t.hidden`), the final norm
/// is 1 and the LM-head column of that dimension holds the `b`s' logits. The checkpoint goes
/// through the real loader and forward like any other, so a test can make a server emit an
/// exact text (a tool call) through the real tokenizer, template and parser.
pub fn write_scripted(t: &TinyTarget, dir: &Path, script: &[(u32, u32, f32)]) -> Result<()> {
    if t.tied || t.extra.get("num_experts").is_some() {
        return Err(Error::input(
            "write_scripted: the target must be dense with an untied lm_head",
        ));
    }
    t.write(dir)?;
    let path = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let (h, v) = (t.hidden, t.vocab);
    for l in 0..t.layers {
        for n in ["self_attn.o_proj", "mlp.down_proj"] {
            let k = format!("model.layers.{l}.{n}.weight");
            let z = w[&k].zeros_like()?;
            w.insert(k, z);
        }
    }
    w.insert(
        "model.norm.weight".into(),
        Tensor::ones(h, candle_core::DType::F32, &Device::Cpu)?,
    );
    let mut emb = w["model.embed_tokens.weight"].to_vec2::<f32>()?;
    let mut head = w["lm_head.weight"].to_vec2::<f32>()?;
    let mut dims: Vec<u32> = Vec::new();
    for &(a, _, _) in script {
        if !dims.contains(&a) {
            dims.push(a);
        }
    }
    if dims.len() > h
        || script
            .iter()
            .any(|&(a, b, _)| a as usize >= v || b as usize >= v)
    {
        return Err(Error::input(format!(
            "write_scripted: at most {h} distinct tokens to follow, all below {v}"
        )));
    }
    // RMSNorm of a one-hot row: sqrt(hidden) in its dimension
    let norm = (h as f32).sqrt();
    for (d, &a) in dims.iter().enumerate() {
        emb[a as usize] = (0..h).map(|j| if j == d { 1.0 } else { 0.0 }).collect();
        head.iter_mut().for_each(|row| row[d] = 0.0);
    }
    for &(a, b, logit) in script {
        let d = dims.iter().position(|&x| x == a).expect("listed");
        head[b as usize][d] = logit / norm;
    }
    let flat = |m: Vec<Vec<f32>>| -> Result<Tensor> {
        let rows = m.len();
        let cols = m[0].len();
        Ok(Tensor::from_vec(
            m.into_iter().flatten().collect::<Vec<f32>>(),
            (rows, cols),
            &Device::Cpu,
        )?)
    };
    w.insert("model.embed_tokens.weight".into(), flat(emb)?);
    w.insert("lm_head.weight".into(), flat(head)?);
    candle_core::safetensors::save(&w, &path)?;
    Ok(())
}

pub fn write_json(path: &Path, v: &Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v).expect("json"))
        .map_err(|e| Error::io(path, e))
}

/// Shape of a tiny z-lab format DFlash draft for a given target.
#[derive(Debug, Clone)]
pub struct TinyDraft {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub mask_token_id: u32,
    pub target_layer_ids: Vec<usize>,
    pub num_target_layers: usize,
    /// `layer_types` entries (None = all full attention) and the window.
    pub layer_types: Option<Vec<&'static str>>,
    pub sliding_window: usize,
    pub seed: u64,
    /// Zero the final norm: the draft then always proposes token 0.
    pub zero_final_norm: bool,
    /// Write a `DFlash2DraftModel` (convolutions + candidate selector) with these keys.
    pub dflash2: Option<crate::config::draft::Dflash2Config>,
    /// `is_causal` in the config (None: absent).
    pub is_causal: Option<bool>,
}

impl TinyDraft {
    /// A draft for `t` with `layers` layers tapping `taps`.
    pub fn for_target(
        t: &TinyTarget,
        layers: usize,
        taps: Vec<usize>,
        block_size: usize,
        seed: u64,
    ) -> Self {
        Self {
            hidden: t.hidden,
            intermediate: 96,
            layers,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            block_size,
            mask_token_id: (t.vocab - 1) as u32,
            target_layer_ids: taps,
            num_target_layers: t.layers,
            layer_types: None,
            sliding_window: 8,
            seed,
            zero_final_norm: false,
            dflash2: None,
            is_causal: None,
        }
    }

    /// This draft as a DFlash2 draft: kernel `k`, channel groups of `group`, codebooks of
    /// `rank`, `top_k` candidates per row.
    pub fn dflash2(mut self, k: usize, group: usize, rank: usize, top_k: usize) -> Self {
        self.dflash2 = Some(crate::config::draft::Dflash2Config {
            conv_kernel_size: k,
            conv_group_size: group,
            selector_rank: rank,
            selector_top_k: top_k,
        });
        self
    }

    pub fn config(&self, vocab: usize) -> Value {
        let mut c = json!({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids},
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 2048,
            "vocab_size": vocab,
            "tie_word_embeddings": false,
            "hidden_act": "silu",
        });
        if let Some(lt) = &self.layer_types {
            c["layer_types"] = json!(lt);
            c["sliding_window"] = json!(self.sliding_window);
            c["use_sliding_window"] = json!(true);
        }
        if let Some(ic) = self.is_causal {
            c["is_causal"] = json!(ic);
        }
        if let Some(d) = &self.dflash2 {
            c["architectures"] = json!(["DFlash2DraftModel"]);
            let dc = c["dflash_config"].as_object_mut().expect("dflash_config");
            dc.insert("conv_kernel_size".into(), json!(d.conv_kernel_size));
            dc.insert("conv_group_size".into(), json!(d.conv_group_size));
            dc.insert("selector_rank".into(), json!(d.selector_rank));
            dc.insert("selector_top_k".into(), json!(d.selector_top_k));
        }
        c
    }

    pub fn write(&self, dir: &Path, vocab: usize) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut f = TensorFactory::new(self.seed);
        let (h, i, d) = (self.hidden, self.intermediate, self.head_dim);
        let k = self.target_layer_ids.len();
        f.normal("fc.weight", &[h, k * h], 0.1)?;
        f.uniform("hidden_norm.weight", &[h], 0.5, 1.5)?;
        let (lo, hi) = if self.zero_final_norm {
            (0.0, 0.0)
        } else {
            (0.5, 1.5)
        };
        f.uniform("norm.weight", &[h], lo, hi)?;

        for l in 0..self.layers {
            let p = format!("layers.{l}");
            f.uniform(&format!("{p}.input_layernorm.weight"), &[h], 0.5, 1.5)?;
            f.uniform(
                &format!("{p}.post_attention_layernorm.weight"),
                &[h],
                0.5,
                1.5,
            )?;
            f.normal(
                &format!("{p}.self_attn.q_proj.weight"),
                &[self.heads * d, h],
                0.1,
            )?;
            f.normal(
                &format!("{p}.self_attn.k_proj.weight"),
                &[self.kv_heads * d, h],
                0.1,
            )?;
            f.normal(
                &format!("{p}.self_attn.v_proj.weight"),
                &[self.kv_heads * d, h],
                0.1,
            )?;
            f.normal(
                &format!("{p}.self_attn.o_proj.weight"),
                &[h, self.heads * d],
                0.1,
            )?;
            f.uniform(&format!("{p}.self_attn.q_norm.weight"), &[d], 0.5, 1.5)?;
            f.uniform(&format!("{p}.self_attn.k_norm.weight"), &[d], 0.5, 1.5)?;
            f.normal(&format!("{p}.mlp.gate_proj.weight"), &[i, h], 0.1)?;
            f.normal(&format!("{p}.mlp.up_proj.weight"), &[i, h], 0.1)?;
            f.normal(&format!("{p}.mlp.down_proj.weight"), &[h, i], 0.1)?;
            if let Some(d2) = &self.dflash2 {
                let (kk, g) = (d2.conv_kernel_size, h / d2.conv_group_size);
                for conv in ["attention_conv", "mlp_conv"] {
                    f.normal(&format!("{p}.{conv}.base_kernel"), &[2, kk, h], 0.5)?;
                    f.normal(
                        &format!("{p}.{conv}.kernel_projection.weight"),
                        &[2 * kk * g, h],
                        0.1,
                    )?;
                }
            }
        }
        if let Some(d2) = &self.dflash2 {
            // Codebooks large enough that the walk overrules the argmax on some rows.
            let r = d2.selector_rank;
            f.normal("candidate_selector.predecessor_codebook", &[vocab, r], 0.6)?;
            f.normal(
                "candidate_selector.successor_codebook.weight",
                &[vocab, r],
                0.6,
            )?;
            f.normal("candidate_selector.hidden_projection.weight", &[r, h], 0.3)?;
        }
        f.save(&dir.join("model.safetensors"))?;
        write_json(&dir.join("config.json"), &self.config(vocab))
    }
}

impl TinyDraft {
    /// Write the same draft in the vllm-project/speculators layout: `transformer_layer_config`,
    /// `aux_hidden_state_layer_ids` (= taps + 1), and a narrow vocabulary of `draft_vocab`
    /// target ids `map[i]` with its own `lm_head` (rows `head_rows[i]`), `d2t` and `t2d`.
    pub fn write_speculators(
        &self,
        dir: &Path,
        target_vocab: usize,
        map: &[u32],
        head_rows: &Tensor,
        verifier: &str,
    ) -> Result<()> {
        self.write(dir, target_vocab)?;
        let st = dir.join("model.safetensors");
        let mut tensors = candle_core::safetensors::load(&st, &Device::Cpu)?;
        let dv = map.len();
        tensors.insert("lm_head.weight".into(), head_rows.clone());
        let d2t = crate::draft::narrow::d2t_offsets(map);
        tensors.insert("d2t".into(), Tensor::from_vec(d2t, dv, &Device::Cpu)?);
        let mut t2d = vec![0u8; target_vocab];
        map.iter().for_each(|&t| t2d[t as usize] = 1);
        tensors.insert(
            "t2d".into(),
            Tensor::from_vec(t2d, target_vocab, &Device::Cpu)?,
        );
        candle_core::safetensors::save(&tensors, &st)
            .map_err(|e| Error::weights(st.display().to_string(), e.to_string()))?;
        let mut layer = self.config(target_vocab);
        let o = layer.as_object_mut().expect("object");
        for k in [
            "block_size",
            "dflash_config",
            "num_target_layers",
            "architectures",
        ] {
            o.remove(k);
        }
        o.insert("model_type".into(), json!("llama"));
        let cfg = json!({
            "speculators_model_type": "dflash",
            "architectures": ["DFlashSpeculator"],
            "transformer_layer_config": layer,
            "aux_hidden_state_layer_ids": self.target_layer_ids.iter().map(|t| t + 1).collect::<Vec<_>>(),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "draft_vocab_size": dv,
            "target_hidden_size": self.hidden,
            "speculators_config": {"algorithm": "dflash", "verifier": {"name_or_path": verifier}},
        });
        write_json(&dir.join("config.json"), &cfg)
    }
}

/// Convert the checkpoint [`TinyTarget::write`] put in `dir` into `dir/model.gguf` the way
/// llama.cpp's converter does (GGUF names, metadata, llama Q/K rows permuted), with every
/// 2-D weight stored as `dtype` (norms and biases stay f32).
pub fn write_gguf(
    t: &TinyTarget,
    dir: &Path,
    dtype: candle_core::quantized::GgmlDType,
) -> Result<std::path::PathBuf> {
    write_gguf_with(t, dir, |_| dtype)
}

/// [`write_gguf`] with a type per 2-D weight, chosen from its HF name (mixed files like
/// llama.cpp's Q4_K_M).
pub fn write_gguf_with(
    t: &TinyTarget,
    dir: &Path,
    dtype: impl Fn(&str) -> candle_core::quantized::GgmlDType,
) -> Result<std::path::PathBuf> {
    use crate::source::gguf::{gguf_name, permute_qk};
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let st = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    let arch = t.model_type.as_str();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&String> = st.keys().collect();
    names.sort();
    for name in names {
        let w = &st[name];
        let gname = gguf_name(arch, name)
            .ok_or_else(|| Error::input(format!("no GGUF name for {name}")))?;
        let ty = if w.rank() == 2 {
            dtype(name)
        } else {
            GgmlDType::F32
        };
        let mut q = QTensor::quantize(w, ty)?;
        if arch == "llama" && gname.contains(".attn_q.") {
            q = permute_qk(&q, t.heads)?;
        } else if arch == "llama" && gname.contains(".attn_k.") {
            q = permute_qk(&q, t.kv_heads)?;
        }
        tensors.push((gname, q));
    }
    let cfg = t.config();
    // llama3 rope scaling is stored as per-frequency divisors (`rope_freqs.weight`).
    let rope = crate::config::TargetConfig::from_value("tiny", cfg.clone())?.rope;
    if rope.kind != crate::config::RopeKind::Default {
        let plain = crate::config::RopeConfig {
            kind: crate::config::RopeKind::Default,
            ..rope.clone()
        };
        let (p, _) = plain.inv_freq(t.head_dim);
        let (s, _) = rope.inv_freq(t.head_dim);
        let f: Vec<f32> = p.iter().zip(&s).map(|(a, b)| a / b).collect();
        let n = f.len();
        let ft = Tensor::from_vec(f, n, &Device::Cpu)?;
        tensors.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(&ft, GgmlDType::F32)?,
        ));
    }
    use gguf_file::Value as V;
    let k = |s: &str| format!("{arch}.{s}");
    let theta = cfg["rope_theta"].as_f64().unwrap_or(10000.0) as f32;
    let meta: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        (k("embedding_length"), V::U32(t.hidden as u32)),
        (k("block_count"), V::U32(t.layers as u32)),
        (k("feed_forward_length"), V::U32(t.intermediate as u32)),
        (k("attention.head_count"), V::U32(t.heads as u32)),
        (k("attention.head_count_kv"), V::U32(t.kv_heads as u32)),
        (k("attention.key_length"), V::U32(t.head_dim as u32)),
        (k("attention.value_length"), V::U32(t.head_dim as u32)),
        (k("attention.layer_norm_rms_epsilon"), V::F32(1e-6)),
        (k("context_length"), V::U32(2048)),
        (k("rope.freq_base"), V::F32(theta)),
        ("tokenizer.ggml.bos_token_id".into(), V::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), V::U32(2)),
    ];
    let path = dir.join("model.gguf");
    let mut f = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
    let meta_ref: Vec<(&str, &V)> = meta.iter().map(|(a, b)| (a.as_str(), b)).collect();
    let t_ref: Vec<(&str, &QTensor)> = tensors.iter().map(|(a, b)| (a.as_str(), b)).collect();
    gguf_file::write(&mut f, &meta_ref, &t_ref)?;
    Ok(path)
}

/// A tiny chat model in `dir` that answers every turn with `turn`: a scripted bigram target
/// ([`write_scripted`]) over a byte-level tokenizer (token b < 255 is byte b, 255 `<eos>`,
/// the end of turn) with the template `<|role|>content<eos>...` (`<|assistant|>` for the
/// generation prompt). After any byte of `after` (e.g. the template's `>`, or a steer's last
/// byte) it writes `turn`'s bytes, then `<eos>`; `turn`'s bytes must be distinct and not in
/// `after`. For tests of what a model writes at its chat template (`train::synth_prompts`).
pub fn write_turn_target(dir: &Path, after: &[u8], turn: &str) -> Result<TinyTarget> {
    let mut t = TinyTarget::qwen3(5);
    t.vocab = 256;
    let b: Vec<u32> = turn.bytes().map(u32::from).collect();
    let mut script: Vec<(u32, u32, f32)> =
        after.iter().map(|&a| (u32::from(a), b[0], 30.0)).collect();
    script.extend(b.windows(2).map(|w| (w[0], w[1], 30.0)));
    script.push((*b.last().expect("a turn"), 255, 30.0));
    write_scripted(&t, dir, &script)?;
    write_json(&dir.join("tokenizer.json"), &byte_tokenizer_json(&[]))?;
    let template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<eos>{% endfor %}\
                    {% if add_generation_prompt %}<|assistant|>{% endif %}";
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"chat_template": template, "eos_token": "<eos>"}),
    )?;
    Ok(t)
}

/// GPT-2's byte-to-character table (the byte-level pre-tokenizer's alphabet): printable
/// Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order.
pub fn byte_chars() -> [char; 256] {
    let self_mapped = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    std::array::from_fn(|b| {
        if self_mapped(b as u8) {
            b as u8 as char
        } else {
            next += 1;
            char::from_u32(next - 1).expect("a valid char")
        }
    })
}

/// A byte-level BPE tokenizer (GPT-2 / Qwen style) from its vocabulary (symbols of
/// [`byte_chars`]), merges and special tokens `(id, content)`.
pub fn bpe_tokenizer(
    vocab: serde_json::Map<String, Value>,
    merges: &[&str],
    specials: &[(u32, &str)],
) -> crate::tokenizer::Tokenizer {
    let json = bpe_tokenizer_json(vocab, merges, specials);
    crate::tokenizer::Tokenizer::from_bytes(json.to_string().as_bytes(), "byte_level.json")
        .expect("the test tokenizer parses")
}

/// The `tokenizer.json` of [`bpe_tokenizer`] (to write beside a tiny checkpoint).
pub fn bpe_tokenizer_json(
    vocab: serde_json::Map<String, Value>,
    merges: &[&str],
    specials: &[(u32, &str)],
) -> Value {
    let added: Vec<Value> = specials
        .iter()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab, "merges": merges}
    })
}

/// A byte-level tokenizer for tests: token b < 255 is byte b, token 255 `<eos>` (special;
/// byte 0xFF never occurs in UTF-8 text), tokens 256.. the given multi-byte words; no merges
/// (what structured output reads is the vocabulary). Vocabulary size 256 + `words.len()`.
pub fn byte_tokenizer(words: &[&str]) -> crate::tokenizer::Tokenizer {
    let json = byte_tokenizer_json(words);
    crate::tokenizer::Tokenizer::from_bytes(json.to_string().as_bytes(), "byte_level.json")
        .expect("the test tokenizer parses")
}

/// The `tokenizer.json` of [`byte_tokenizer`].
pub fn byte_tokenizer_json(words: &[&str]) -> Value {
    let ch = byte_chars();
    let mut vocab = serde_json::Map::new();
    for b in 0..255u8 {
        vocab.insert(ch[b as usize].to_string(), (b as u32).into());
    }
    vocab.insert("<eos>".into(), 255.into());
    for (i, w) in words.iter().enumerate() {
        let s: String = w.bytes().map(|b| ch[b as usize]).collect();
        vocab.insert(s, (256 + i as u32).into());
    }
    bpe_tokenizer_json(vocab, &[], &[(255, "<eos>")])
}
