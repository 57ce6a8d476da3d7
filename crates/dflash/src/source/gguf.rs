//! GGUF model files (llama.cpp's single-file format) as a model source: metadata -> an
//! HF-style config (so one [`TargetConfig`] parser and one family table serve both formats),
//! HF tensor names -> GGUF tensor names, the Q/K row permutation of llama-converted files,
//! and the tokenizer / chat template / stop ids stored in the metadata.
//!
//! Where it sits: [`crate::source::Weights::open_gguf`] wraps a [`GgufFile`] so that family
//! loaders read `model.layers.{i}.self_attn.q_proj.weight` whatever the file format.

use crate::chat::ChatTemplate;
use crate::config::TargetConfig;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use serde_json::json;
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Architectures (`general.architecture`) this engine maps onto its families.
pub const GGUF_ARCHS: &[&str] = &["llama", "qwen2", "qwen3", "gemma3"];

/// An open GGUF file: parsed header and metadata; tensors are read on demand.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    /// `general.architecture`.
    pub arch: String,
    reader: Mutex<std::io::BufReader<std::fs::File>>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("arch", &self.arch)
            .field("tensors", &self.content.tensor_infos.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        // Our bounded reader: every count, size and offset is checked against the file.
        let content = super::gguf_header::read_content(path)?;
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let reader = std::io::BufReader::new(file);
        let mut g = Self {
            path: path.to_path_buf(),
            content,
            arch: String::new(),
            reader: Mutex::new(reader),
        };
        g.arch = g.req_str("general.architecture")?.to_string();
        Ok(g)
    }

    pub fn file_desc(&self) -> String {
        self.path.display().to_string()
    }

    fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        Error::config(self.file_desc(), key, msg)
    }

    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// `{arch}.{suffix}`, e.g. `llama.block_count`.
    pub fn arch_key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.meta(key) else {
            return Ok(None);
        };
        let x = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I8(x) if *x >= 0 => *x as u64,
            Value::I16(x) if *x >= 0 => *x as u64,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            // Per-layer arrays (head_count_kv in some files): accept when all equal.
            Value::Array(a) if !a.is_empty() => {
                let first = val_u64(&a[0]);
                if first.is_some() && a.iter().all(|x| val_u64(x) == first) {
                    first.unwrap()
                } else {
                    return Err(self.err(
                        key,
                        "per-layer values that differ between layers are not supported",
                    ));
                }
            }
            other => {
                return Err(self.err(
                    key,
                    format!("expected a non-negative integer, found {other:?}"),
                ))
            }
        };
        Ok(Some(x))
    }
    /// A token id (below 2^32).
    pub fn opt_token_id(&self, key: &str) -> Result<Option<u32>> {
        self.opt_u64(key)?
            .map(|x| u32::try_from(x).map_err(|_| self.err(key, format!("{x} is not a token id"))))
            .transpose()
    }
    pub fn req_u64(&self, key: &str) -> Result<u64> {
        self.opt_u64(key)?
            .ok_or_else(|| self.err(key, "missing (required)"))
    }
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        Ok(match self.meta(key) {
            None => None,
            Some(Value::F32(x)) => Some(*x as f64),
            Some(Value::F64(x)) => Some(*x),
            Some(v) => match val_u64(v) {
                Some(x) => Some(x as f64),
                None => return Err(self.err(key, format!("expected a number, found {v:?}"))),
            },
        })
    }
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        Ok(match self.meta(key) {
            None => None,
            Some(Value::String(s)) => Some(s.as_str()),
            Some(v) => return Err(self.err(key, format!("expected a string, found {v:?}"))),
        })
    }
    pub fn req_str(&self, key: &str) -> Result<&str> {
        self.opt_str(key)?
            .ok_or_else(|| self.err(key, "missing (required)"))
    }
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        Ok(match self.meta(key) {
            None => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => return Err(self.err(key, format!("expected a bool, found {v:?}"))),
        })
    }
    /// A string array (`tokenizer.ggml.tokens`, `.merges`).
    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        match self.meta(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.as_str()),
                    v => Err(self.err(key, format!("expected strings, found {v:?}"))),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.err(key, format!("expected an array, found {v:?}"))),
        }
    }
    pub fn opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        match self.meta(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::F32(x) => Ok(*x),
                    Value::F64(x) => Ok(*x as f32),
                    v => Err(self.err(key, format!("expected numbers, found {v:?}"))),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.err(key, format!("expected an array, found {v:?}"))),
        }
    }
    pub fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        match self.meta(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::Bool(b) => Ok(*b as i64),
                    Value::I32(x) => Ok(*x as i64),
                    Value::I64(x) => Ok(*x),
                    v => val_u64(v)
                        .map(|x| x as i64)
                        .ok_or_else(|| self.err(key, format!("expected integers, found {v:?}"))),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.err(key, format!("expected an array, found {v:?}"))),
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Shape in candle order (`[rows, cols]` = `[out, in]` for a weight).
    pub fn tensor_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.content
            .tensor_infos
            .get(name)
            .map(|t| t.shape.dims().to_vec())
    }

    pub fn tensor_dtype(&self, name: &str) -> Option<GgmlDType> {
        self.content.tensor_infos.get(name).map(|t| t.ggml_dtype)
    }

    /// Read one tensor into CPU memory as stored.
    pub fn tensor(&self, name: &str) -> Result<QTensor> {
        let mut r = self.reader.lock().expect("gguf reader poisoned");
        self.content
            .tensor(&mut *r, name, &Device::Cpu)
            .map_err(|e| Error::weights(self.file_desc(), format!("tensor `{name}`: {e}")))
    }

    /// An HF-style `config.json` value for this file's model (fields named as transformers
    /// names them), so that [`TargetConfig::from_value`] and the family table apply as-is.
    pub fn config_json(&self) -> Result<serde_json::Value> {
        let arch = self.arch.as_str();
        if !GGUF_ARCHS.contains(&arch) {
            return Err(Error::UnsupportedArch {
                model_type: format!("{arch} (general.architecture)"),
                file: self.file_desc(),
                supported: GGUF_ARCHS.join(", "),
            });
        }
        let k = |s: &str| self.arch_key(s);
        let hidden = self.req_u64(&k("embedding_length"))?;
        let heads = self.req_u64(&k("attention.head_count"))?;
        let kv_heads = self
            .opt_u64(&k("attention.head_count_kv"))?
            .unwrap_or(heads);
        let head_dim = self
            .opt_u64(&k("attention.key_length"))?
            .unwrap_or(hidden / heads.max(1));
        let layers = self.req_u64(&k("block_count"))?;
        if layers > crate::config::limits::MAX_LAYERS as u64 {
            return Err(self.err(
                &k("block_count"),
                format!(
                    "{layers} layers is more than this engine accepts ({})",
                    crate::config::limits::MAX_LAYERS
                ),
            ));
        }
        let embd = self.tensor_shape("token_embd.weight").ok_or_else(|| {
            Error::weights(self.file_desc(), "missing tensor `token_embd.weight`")
        })?;
        let [vocab, _] = embd[..] else {
            return Err(Error::weights(
                self.file_desc(),
                format!("tensor `token_embd.weight` has shape {embd:?}, expected [vocab, hidden]"),
            ));
        };
        let model_type = match arch {
            "gemma3" => "gemma3_text",
            a => a,
        };
        let mut c = json!({
            "model_type": model_type,
            "architectures": [format!("{arch} (GGUF)")],
            "hidden_size": hidden,
            "intermediate_size": self.req_u64(&k("feed_forward_length"))?,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "vocab_size": vocab,
            "rms_norm_eps": self.opt_f64(&k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
            "max_position_embeddings": self.opt_u64(&k("context_length"))?.unwrap_or(4096),
            "rope_theta": self.opt_f64(&k("rope.freq_base"))?.unwrap_or(10000.0),
            "tie_word_embeddings": !self.has_tensor("output.weight"),
            "attention_bias": self.has_tensor("blk.0.attn_q.bias"),
            "hidden_act": if arch == "gemma3" { "gelu_pytorch_tanh" } else { "silu" },
        });
        let o = c.as_object_mut().expect("object");
        if let Some(b) = self.opt_u64("tokenizer.ggml.bos_token_id")? {
            o.insert("bos_token_id".into(), json!(b));
        }
        if let Some(e) = self.opt_u64("tokenizer.ggml.eos_token_id")? {
            o.insert("eos_token_id".into(), json!(e));
        }
        if let Some(rot) = self.opt_u64(&k("rope.dimension_count"))? {
            if rot != head_dim {
                o.insert(
                    "partial_rotary_factor".into(),
                    json!(rot as f64 / head_dim as f64),
                );
            }
        }
        // RoPE scaling: llama3-style per-frequency factors are stored as a tensor.
        if self.has_tensor("rope_freqs.weight") {
            let f = self.tensor("rope_freqs.weight")?.dequantize(&Device::Cpu)?;
            let f: Vec<f32> = f.flatten_all()?.to_vec1()?;
            o.insert(
                "rope_scaling".into(),
                json!({"rope_type": "freq_factors", "factors": f}),
            );
        } else {
            match self.opt_str(&k("rope.scaling.type"))? {
                None | Some("none") => {}
                Some("linear") => {
                    let factor = self
                        .opt_f64(&k("rope.scaling.factor"))?
                        .ok_or_else(|| self.err(&k("rope.scaling.factor"), "missing"))?;
                    o.insert(
                        "rope_scaling".into(),
                        json!({"rope_type": "linear", "factor": factor}),
                    );
                }
                Some("yarn") => {
                    let factor = self
                        .opt_f64(&k("rope.scaling.factor"))?
                        .ok_or_else(|| self.err(&k("rope.scaling.factor"), "missing"))?;
                    let mut s = json!({"rope_type": "yarn", "factor": factor});
                    if let Some(x) = self.opt_u64(&k("rope.scaling.original_context_length"))? {
                        s["original_max_position_embeddings"] = json!(x);
                    }
                    for (gk, hk) in [
                        ("rope.scaling.yarn_beta_fast", "beta_fast"),
                        ("rope.scaling.yarn_beta_slow", "beta_slow"),
                    ] {
                        if let Some(x) = self.opt_f64(&k(gk))? {
                            s[hk] = json!(x);
                        }
                    }
                    o.insert("rope_scaling".into(), s);
                }
                Some(other) => {
                    return Err(self.err(
                        &k("rope.scaling.type"),
                        format!("unsupported rope scaling `{other}` (supported: linear, yarn)"),
                    ))
                }
            }
        }
        if arch == "gemma3" {
            // llama.cpp's gemma3 defaults: local rope base 10000, every 6th layer global,
            // attention scale head_dim^-0.5 except for the 27B (62 layers): (hidden/heads)^-0.5.
            let scalar = if layers == 62 {
                hidden / heads
            } else {
                head_dim
            };
            o.insert("query_pre_attn_scalar".into(), json!(scalar));
            o.insert(
                "rope_local_base_freq".into(),
                json!(self.opt_f64(&k("rope.freq_base_swa"))?.unwrap_or(10000.0)),
            );
            if let Some(c) = self.opt_f64(&k("final_logit_softcapping"))? {
                o.insert("final_logit_softcapping".into(), json!(c));
            }
            if let Some(w) = self.opt_u64(&k("attention.sliding_window"))? {
                let key = k("attention.sliding_window_pattern");
                let sliding: Vec<bool> = match self.meta(&key) {
                    Some(Value::Array(_)) => self
                        .opt_int_array(&key)?
                        .unwrap_or_default()
                        .into_iter()
                        .map(|x| x != 0)
                        .collect(),
                    _ => {
                        let n = self.opt_u64(&key)?.unwrap_or(6) as usize;
                        (0..layers as usize)
                            .map(|i| n == 0 || i % n < n - 1)
                            .collect()
                    }
                };
                if sliding.len() != layers as usize {
                    return Err(self.err(
                        &key,
                        format!("has {} entries for {layers} layers", sliding.len()),
                    ));
                }
                let types: Vec<&str> = sliding
                    .iter()
                    .map(|&s| {
                        if s {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        }
                    })
                    .collect();
                o.insert("sliding_window".into(), json!(w));
                o.insert("layer_types".into(), json!(types));
            }
        }
        Ok(c)
    }

    pub fn target_config(&self) -> Result<TargetConfig> {
        TargetConfig::from_value(&self.file_desc(), self.config_json()?)
    }

    /// Token strings (`tokenizer.ggml.tokens`).
    pub fn tokens(&self) -> Result<Vec<&str>> {
        self.opt_str_array("tokenizer.ggml.tokens")?.ok_or_else(|| {
            self.err(
                "tokenizer.ggml.tokens",
                "missing: the file has no tokenizer",
            )
        })
    }

    /// The tokenizer stored in the metadata (see [`crate::source::gguf_tokenizer`]).
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        crate::tokenizer::guarded(|| super::gguf_tokenizer::build(self)).map_err(|msg| {
            Error::Tokenizer {
                file: format!("{} (tokenizer.ggml.*)", self.file_desc()),
                msg,
            }
        })?
    }

    /// `tokenizer.chat_template`, compiled, with the BOS/EOS strings it may reference.
    /// None when the file carries no template (base models).
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>> {
        let Some(src) = self.opt_str("tokenizer.chat_template")? else {
            return Ok(None);
        };
        let tokens = self.tokens()?;
        let tok = |key: &str| -> Result<Option<String>> {
            Ok(self
                .opt_u64(key)?
                .and_then(|i| tokens.get(i as usize))
                .map(|s| s.to_string()))
        };
        let bos = tok("tokenizer.ggml.bos_token_id")?;
        let eos = tok("tokenizer.ggml.eos_token_id")?;
        ChatTemplate::new(
            src,
            bos,
            eos,
            format!("{} (tokenizer.chat_template)", self.file_desc()),
        )
        .map(Some)
    }

    /// End-of-generation ids as llama.cpp resolves them: `eos`, `eot`, `eom` ids from the
    /// metadata, plus control tokens whose text is a known end-of-turn marker.
    pub fn stop_token_ids(&self) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(x) = self.opt_token_id(key)? {
                ids.push(x);
            }
        }
        const EOG: &[&str] = &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|eom_id|>",
            "<EOT>",
            "_<EOT>",
            "<|end_of_text|>",
            "<｜end▁of▁sentence｜>",
        ];
        for (i, t) in self.tokens()?.iter().enumerate() {
            if EOG.contains(t) {
                ids.push(i as u32);
            }
        }
        let mut seen = std::collections::HashSet::new();
        ids.retain(|x| seen.insert(*x));
        Ok(ids)
    }
}

fn val_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::U16(x) => Some(*x as u64),
        Value::U32(x) => Some(*x as u64),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

/// The GGUF name of an HF tensor name, per llama.cpp's tensor-name table for the supported
/// architectures. None for names that have no GGUF counterpart.
pub fn gguf_name(arch: &str, hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?; // suffix: weight | bias
    let gemma = arch == "gemma3";
    let g = match module {
        "input_layernorm" => "attn_norm",
        // Gemma's sandwich: post-attention norm on the attention output, then the
        // pre-feedforward norm (llama.cpp's ffn_norm) and the post-feedforward norm.
        "post_attention_layernorm" if gemma => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// Row order of llama.cpp's converter for Q/K of `llama` files: within each head of `d` rows,
/// HF row `half * d/2 + j` is stored at row `2 * j + half` (pairs for interleaved RoPE).
/// Returns, for each stored row, the HF row it holds.
pub fn gguf_qk_row_source(rows: usize, heads: usize) -> Vec<usize> {
    let d = rows / heads;
    let mut src = vec![0; rows];
    for h in 0..heads {
        for j in 0..d / 2 {
            for half in 0..2 {
                src[h * d + 2 * j + half] = h * d + half * (d / 2) + j;
            }
        }
    }
    src
}

/// Undo the converter's Q/K permutation on a tensor whose first dimension is the rows
/// (a weight `[rows, in]` or a bias `[rows]`): whole rows move, so quantized blocks (which
/// run along a row) move intact and the result is exact for every type.
pub fn unpermute_qk(t: &QTensor, heads: usize) -> Result<QTensor> {
    let dims = t.shape().dims().to_vec();
    let rows = dims[0];
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(Error::input(format!(
            "cannot un-permute {rows} rows into {heads} heads of even size"
        )));
    }
    let data = t.data()?;
    let row_bytes = data.len() / rows;
    let mut out = vec![0u8; data.len()];
    for (stored, hf) in gguf_qk_row_source(rows, heads).into_iter().enumerate() {
        out[hf * row_bytes..(hf + 1) * row_bytes]
            .copy_from_slice(&data[stored * row_bytes..(stored + 1) * row_bytes]);
    }
    let storage = QStorage::from_data(Cow::Owned(out), &Device::Cpu, t.dtype())?;
    Ok(QTensor::new(storage, dims)?)
}

/// The inverse of [`unpermute_qk`] (what llama.cpp's converter does); used by tests that
/// write llama GGUF files.
pub fn permute_qk(t: &QTensor, heads: usize) -> Result<QTensor> {
    let dims = t.shape().dims().to_vec();
    let rows = dims[0];
    let data = t.data()?;
    let row_bytes = data.len() / rows;
    let mut out = vec![0u8; data.len()];
    for (stored, hf) in gguf_qk_row_source(rows, heads).into_iter().enumerate() {
        out[stored * row_bytes..(stored + 1) * row_bytes]
            .copy_from_slice(&data[hf * row_bytes..(hf + 1) * row_bytes]);
    }
    let storage = QStorage::from_data(Cow::Owned(out), &Device::Cpu, t.dtype())?;
    Ok(QTensor::new(storage, dims)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    #[test]
    fn names_follow_llama_cpp() {
        let n = |a, h| gguf_name(a, h).unwrap();
        assert_eq!(
            n("llama", "model.layers.3.self_attn.q_proj.weight"),
            "blk.3.attn_q.weight"
        );
        assert_eq!(
            n("qwen2", "model.layers.0.self_attn.k_proj.bias"),
            "blk.0.attn_k.bias"
        );
        assert_eq!(
            n("llama", "model.layers.1.post_attention_layernorm.weight"),
            "blk.1.ffn_norm.weight"
        );
        assert_eq!(
            n("gemma3", "model.layers.1.post_attention_layernorm.weight"),
            "blk.1.post_attention_norm.weight"
        );
        assert_eq!(
            n("gemma3", "model.layers.1.pre_feedforward_layernorm.weight"),
            "blk.1.ffn_norm.weight"
        );
        assert_eq!(
            n("gemma3", "model.layers.1.post_feedforward_layernorm.weight"),
            "blk.1.post_ffw_norm.weight"
        );
        assert_eq!(n("qwen3", "lm_head.weight"), "output.weight");
        assert!(gguf_name("llama", "model.layers.x.mlp.up_proj.weight").is_none());
    }

    /// The permutation written the way llama.cpp's converter writes it
    /// (`reshape(heads, 2, d/2, in).swapaxes(1, 2)`), on a float tensor.
    #[test]
    fn qk_permutation_matches_converter_and_round_trips() {
        let (heads, d, inp) = (3usize, 8usize, 64usize);
        let rows = heads * d;
        let hf: Vec<f32> = (0..rows * inp).map(|i| i as f32).collect();
        let t = Tensor::from_vec(hf.clone(), (rows, inp), &Device::Cpu).unwrap();
        let conv = t
            .reshape((heads, 2, d / 2, inp))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((rows, inp))
            .unwrap();
        for dt in [GgmlDType::F32, GgmlDType::Q8_0, GgmlDType::Q4_1] {
            let q = QTensor::quantize(&t, dt).unwrap();
            let p = permute_qk(&q, heads).unwrap();
            let want = QTensor::quantize(&conv, dt).unwrap();
            assert_eq!(p.data().unwrap(), want.data().unwrap(), "{dt:?}");
            let back = unpermute_qk(&p, heads).unwrap();
            assert_eq!(back.data().unwrap(), q.data().unwrap(), "{dt:?}");
        }
        // a bias vector
        let b = Tensor::arange(0f32, rows as f32, &Device::Cpu).unwrap();
        let q = QTensor::quantize(&b, GgmlDType::F32).unwrap();
        let back = unpermute_qk(&permute_qk(&q, heads).unwrap(), heads).unwrap();
        assert_eq!(
            back.dequantize(&Device::Cpu)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            b.to_vec1::<f32>().unwrap()
        );
    }
}
