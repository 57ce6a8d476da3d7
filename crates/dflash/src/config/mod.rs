//! Config parsing: `config.json` of a target model -> [`TargetConfig`].
//!
//! First step of the data flow (config -> sources/loading -> archs -> draft -> engine).
//! Tolerant of transformers 4 and 5 spellings (`rope_theta` + `rope_scaling` or
//! `rope_parameters`; `torch_dtype` or `dtype`; `head_dim` explicit or derived). Every error
//! names the file and the field.

pub mod draft;
pub mod rope;

pub use rope::{RopeConfig, RopeKind};

use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// Typed access to a JSON object with errors that name the file and field.
pub struct Fields<'a> {
    pub file: &'a str,
    pub obj: &'a serde_json::Map<String, Value>,
    /// Prefix for field names in errors (e.g. `dflash_config.`).
    pub prefix: String,
}

impl<'a> Fields<'a> {
    pub fn new(file: &'a str, v: &'a Value) -> Result<Self> {
        let obj = v
            .as_object()
            .ok_or_else(|| Error::config(file, "<root>", "expected a JSON object"))?;
        Ok(Self {
            file,
            obj,
            prefix: String::new(),
        })
    }
    pub fn sub(&self, key: &str) -> Result<Option<Fields<'a>>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(o)) => Ok(Some(Fields {
                file: self.file,
                obj: o,
                prefix: format!("{}{}.", self.prefix, key),
            })),
            Some(_) => Err(self.err(key, "expected an object")),
        }
    }
    pub fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        Error::config(self.file, format!("{}{}", self.prefix, key), msg)
    }
    pub fn has(&self, key: &str) -> bool {
        !matches!(self.obj.get(key), None | Some(Value::Null))
    }
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        match self.obj.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
                self.err(key, format!("expected a non-negative integer, found {v}"))
            }),
        }
    }
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(key, "missing (required)"))
    }
    /// A required positive integer.
    pub fn pos_usize(&self, key: &str) -> Result<usize> {
        let x = self.usize(key)?;
        if x == 0 {
            return Err(self.err(key, "must be > 0"));
        }
        Ok(x)
    }
    /// A positive integer, `default` when absent (an explicit 0 is an error).
    pub fn pos_usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.opt_usize(key)?.unwrap_or(default) {
            0 => Err(self.err(key, "must be > 0")),
            x => Ok(x),
        }
    }
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a number, found {v}"))),
        }
    }
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected true/false, found {v}"))),
        }
    }
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a string, found {v}"))),
        }
    }
    pub fn opt_usize_list(&self, key: &str) -> Result<Option<Vec<usize>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .map(|x| x as usize)
                        .ok_or_else(|| self.err(key, format!("expected integers, found {x}")))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.err(key, format!("expected a list of integers, found {v}"))),
        }
    }
    pub fn opt_str_list(&self, key: &str) -> Result<Option<Vec<String>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(String::from)
                        .ok_or_else(|| self.err(key, format!("expected strings, found {x}")))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.err(key, format!("expected a list of strings, found {v}"))),
        }
    }
    /// A token id (an integer below 2^32).
    pub fn opt_id(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a token id, found {v}"))),
        }
    }
    /// An id that may be an int or a list of ints (`eos_token_id`).
    pub fn opt_id_list(&self, key: &str) -> Result<Vec<u32>> {
        let id = |v: &Value| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| self.err(key, format!("expected a token id, found {v}")))
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(v @ Value::Number(_)) => Ok(vec![id(v)?]),
            Some(Value::Array(a)) => a.iter().map(id).collect(),
            Some(v) => Err(self.err(
                key,
                format!("expected a token id or a list of ids, found {v}"),
            )),
        }
    }
}

/// Upper bounds on the sizes a config may declare. Model files come from outside; these are
/// far above every published model (largest today: ~126 layers, hidden 25600, 262k vocab,
/// 10M positions) and low enough that no product of them overflows or asks for an
/// allocation before the weights themselves are checked against the files.
pub mod limits {
    pub const MAX_LAYERS: usize = 1024;
    pub const MAX_HIDDEN: usize = 1 << 17;
    pub const MAX_INTERMEDIATE: usize = 1 << 20;
    pub const MAX_HEADS: usize = 1024;
    pub const MAX_HEAD_DIM: usize = 4096;
    pub const MAX_VOCAB: usize = 1 << 24;
    pub const MAX_POSITIONS: usize = 1 << 26;
}

impl Fields<'_> {
    /// `x` (the value of `key`) if it is at most `max`, else an error naming the bound.
    pub fn bounded(&self, key: &str, x: usize, max: usize) -> Result<usize> {
        if x > max {
            return Err(self.err(
                key,
                format!("{x} is larger than this engine accepts ({max}); the config is corrupt or not a supported model"),
            ));
        }
        Ok(x)
    }
}

/// Read and parse a JSON file, with errors naming the file.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| {
        Error::config(
            path.display().to_string(),
            "<root>",
            format!("invalid JSON: {e}"),
        )
    })
}

/// The token mixer of a layer: the kind of attention it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    Full,
    Sliding,
    /// `linear_attention` (legacy `mamba`): a recurrent mixer (Gated DeltaNet in the hybrid
    /// Qwen families) with a conv state and a recurrent state instead of a KV cache. Only
    /// families with recurrent layers accept it (`archs::load_target` checks).
    Linear,
}

impl LayerType {
    pub fn parse(f: &Fields, key: &str, s: &str) -> Result<Self> {
        match s {
            "full_attention" | "attention" => Ok(LayerType::Full),
            "sliding_attention" => Ok(LayerType::Sliding),
            "linear_attention" | "mamba" => Ok(LayerType::Linear),
            other => Err(f.err(
                key,
                format!(
                    "unknown layer type `{other}` (expected full_attention, sliding_attention or linear_attention)"
                ),
            )),
        }
    }
}

/// Hyper-parameters of a decoder-only target model, family-independent part.
#[derive(Debug, Clone)]
pub struct TargetConfig {
    pub file: String,
    pub model_type: String,
    pub architectures: Vec<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub hidden_act: String,
    pub rope: RopeConfig,
    /// Checkpoint dtype as declared (`torch_dtype` / `dtype`), if any.
    pub dtype: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub sliding_window: Option<usize>,
    pub layer_types: Vec<LayerType>,
    /// The raw JSON for family-specific fields.
    pub raw: Value,
}

impl TargetConfig {
    /// The fields of the language model: `text_config` of a multimodal config (errors then
    /// name `text_config.<key>`), else the top level. Families read their own keys here; this
    /// is the one place that knows where they live.
    pub fn text(&self) -> Result<Fields<'_>> {
        let top = self.top()?;
        Ok(top.sub("text_config")?.unwrap_or(top))
    }

    /// The top-level fields (a multimodal wrapper's own keys, e.g. its `tie_word_embeddings`).
    pub fn top(&self) -> Result<Fields<'_>> {
        Fields::new(&self.file, &self.raw)
    }

    /// `quantization_config` at the top level or in the text config.
    pub fn quantization(&self) -> Result<Option<Fields<'_>>> {
        match self.top()?.sub("quantization_config")? {
            Some(q) => Ok(Some(q)),
            None => self.text()?.sub("quantization_config"),
        }
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let v = read_json(path)?;
        Self::from_value(&path.display().to_string(), v)
    }

    pub fn from_value(file: &str, v: Value) -> Result<Self> {
        // Multimodal configs (e.g. gemma3 / qwen3_5 VL) nest the language model.
        let f = Fields::new(file, &v)?;
        let text = f.sub("text_config")?;
        let f = match &text {
            Some(t) => Fields {
                file,
                obj: t.obj,
                prefix: "text_config.".into(),
            },
            None => f,
        };
        let model_type = f
            .opt_str("model_type")?
            .ok_or_else(|| f.err("model_type", "missing (required to pick the model family)"))?
            .to_string();
        use limits::*;
        let hidden_size = f.bounded("hidden_size", f.pos_usize("hidden_size")?, MAX_HIDDEN)?;
        let num_attention_heads = f.bounded(
            "num_attention_heads",
            f.pos_usize("num_attention_heads")?,
            MAX_HEADS,
        )?;
        let num_key_value_heads = f
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "{num_key_value_heads} must divide num_attention_heads = {num_attention_heads}"
                ),
            ));
        }
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) if d > 0 => f.bounded("head_dim", d, MAX_HEAD_DIM)?,
            Some(_) => return Err(f.err("head_dim", "must be > 0")),
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(f.err(
                        "head_dim",
                        format!("missing, and hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}"),
                    ));
                }
                f.bounded("head_dim", hidden_size / num_attention_heads, MAX_HEAD_DIM)?
            }
        };
        if head_dim % 2 != 0 {
            return Err(f.err("head_dim", format!("{head_dim} must be even for RoPE")));
        }
        let num_hidden_layers = f.bounded(
            "num_hidden_layers",
            f.pos_usize("num_hidden_layers")?,
            MAX_LAYERS,
        )?;
        let max_position_embeddings = f.bounded(
            "max_position_embeddings",
            f.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            MAX_POSITIONS,
        )?;
        let rope = RopeConfig::parse(&f, max_position_embeddings)?;
        let sliding_window = f
            .opt_usize("sliding_window")?
            .map(|w| f.bounded("sliding_window", w, MAX_POSITIONS))
            .transpose()?;
        let layer_types = match f.opt_str_list("layer_types")? {
            Some(l) => {
                if l.len() != num_hidden_layers {
                    return Err(f.err(
                        "layer_types",
                        format!(
                            "has {} entries, num_hidden_layers is {num_hidden_layers}",
                            l.len()
                        ),
                    ));
                }
                l.iter()
                    .map(|s| LayerType::parse(&f, "layer_types", s))
                    .collect::<Result<_>>()?
            }
            None => vec![LayerType::Full; num_hidden_layers],
        };
        let (rope, layer_types, sliding_window) = if model_type == "gpt_oss" {
            gpt_oss_defaults(&f, rope, layer_types, sliding_window)?
        } else {
            (rope, layer_types, sliding_window)
        };
        if layer_types.contains(&LayerType::Sliding) && sliding_window.is_none() {
            return Err(f.err(
                "sliding_window",
                "missing, but layer_types has sliding_attention layers",
            ));
        }
        let dtype = match f.opt_str("dtype")? {
            Some(d) => Some(d.to_string()),
            None => f.opt_str("torch_dtype")?.map(String::from),
        };
        let rms_norm_eps = f
            .opt_f64("rms_norm_eps")?
            .or(f.opt_f64("layer_norm_eps")?)
            .or(f.opt_f64("norm_eps")?)
            .unwrap_or(1e-6);
        let cfg = TargetConfig {
            file: file.to_string(),
            architectures: f.opt_str_list("architectures")?.unwrap_or_default(),
            // MoE-only configs (qwen3_5_moe) have no dense MLP width: 0 = none.
            intermediate_size: if !f.has("intermediate_size") && f.has("moe_intermediate_size") {
                0
            } else {
                f.bounded(
                    "intermediate_size",
                    f.pos_usize("intermediate_size")?,
                    MAX_INTERMEDIATE,
                )?
            },
            vocab_size: f.bounded("vocab_size", f.pos_usize("vocab_size")?, MAX_VOCAB)?,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: f.opt_bool("attention_bias")?.unwrap_or(false),
            mlp_bias: f.opt_bool("mlp_bias")?.unwrap_or(false),
            hidden_act: f
                .opt_str("hidden_act")?
                .or(f.opt_str("hidden_activation")?)
                .unwrap_or("silu")
                .to_string(),
            bos_token_id: f.opt_id("bos_token_id")?,
            eos_token_ids: f.opt_id_list("eos_token_id")?,
            model_type,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            max_position_embeddings,
            rope,
            dtype,
            sliding_window,
            layer_types,
            raw: v.clone(),
        };
        Ok(cfg)
    }
}

/// transformers' `GptOssConfig.__post_init__` defaults, for gpt-oss targets and for DFlash
/// drafts whose config says `model_type: gpt_oss` (z-lab's gpt-oss drafts): absent
/// `layer_types` alternate sliding (even layers) and full attention with `sliding_window` 128,
/// and absent rope settings mean yarn (factor 32, original 4096, beta 32/1, no truncation) over
/// `rope_theta` (default 150000).
fn gpt_oss_defaults(
    f: &Fields,
    rope: RopeConfig,
    layer_types: Vec<LayerType>,
    sliding_window: Option<usize>,
) -> Result<(RopeConfig, Vec<LayerType>, Option<usize>)> {
    let layer_types = if f.has("layer_types") {
        layer_types
    } else {
        (0..layer_types.len())
            .map(|i| {
                if i % 2 == 0 {
                    LayerType::Sliding
                } else {
                    LayerType::Full
                }
            })
            .collect()
    };
    let rope = if f.has("rope_parameters") || f.has("rope_scaling") {
        rope
    } else {
        RopeConfig {
            theta: f.opt_f64("rope_theta")?.unwrap_or(150_000.0),
            kind: RopeKind::Yarn {
                factor: 32.0,
                original_max_position: 4096.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: None,
                mscale_all_dim: None,
                attention_factor: None,
                truncate: false,
            },
            partial_rotary_factor: 1.0,
        }
    };
    Ok((rope, layer_types, sliding_window.or(Some(128))))
}

#[cfg(test)]
mod tests;
