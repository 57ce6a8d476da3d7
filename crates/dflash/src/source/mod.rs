//! Model sources: where a model's files are (a local directory in Hugging Face layout, a GGUF
//! file, or a hub repo id resolved through the HF cache) and memory-mapped weight loading.
//!
//! [`ModelSource`] is the one door to a checkpoint: its config ([`ModelSource::target_config`]),
//! weights ([`ModelSource::weights`]), tokenizer / chat template / stop ids
//! ([`ModelSource::chat_assets`]) and stored tensor sizes all come from it, and a GGUF file is
//! parsed once per source however many of them are asked for.
//!
//! Second step of the data flow: config -> **sources/loading** -> archs -> draft -> engine.

pub mod demo;
pub mod fp8;
pub mod gguf;
pub mod gguf_header;
pub mod gguf_tokenizer;
pub mod hub;
pub mod intq;
pub mod mlx;
pub mod mlx_write;
pub mod mxfp4;
pub mod weights;

pub use demo::demo_model_path;
pub use weights::{Split, Weights};

use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// A GGUF file parsed on first use and shared by every consumer of its source.
#[derive(Clone, Default)]
pub struct GgufCell(OnceLock<Arc<gguf::GgufFile>>);

impl std::fmt::Debug for GgufCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "GgufCell(parsed)"
        } else {
            "GgufCell(unparsed)"
        })
    }
}

/// What a model brings for chat: tokenizer, chat template, end-of-generation ids, and notes
/// on what was missing (for the user).
pub struct ChatAssets {
    pub tokenizer: Option<crate::tokenizer::Tokenizer>,
    pub template: Option<crate::chat::ChatTemplate>,
    pub stop_ids: Vec<u32>,
    pub notices: Vec<String>,
}

/// The files of one model, found on disk.
#[derive(Debug, Clone)]
pub struct ModelSource {
    /// What the user passed (`./dir`, `Org/Name`).
    pub spec: String,
    pub dir: PathBuf,
    pub config: PathBuf,
    /// Safetensors files holding the weights (one, or the shards of an index).
    pub weight_files: Vec<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
    /// A single-file GGUF model (then `config` and `weight_files` name that file too, and
    /// the tokenizer, chat template and stop ids come from its metadata).
    pub gguf: Option<PathBuf>,
    /// The GGUF file, parsed once.
    gguf_file: GgufCell,
}

impl ModelSource {
    /// Resolve a model reference: an existing local directory, or a hub repo id
    /// (`Org/Name[@revision]`) looked up in the HF cache (downloaded when a hub is reachable).
    pub fn resolve(spec: &str) -> Result<Self> {
        let p = Path::new(spec);
        if p.is_file()
            && p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            return Ok(Self::from_gguf(spec, p));
        }
        if p.is_dir() {
            return Self::from_dir(spec, p);
        }
        if p.exists() {
            return Err(Error::input(format!(
                "{spec}: is a file but not a .gguf file; pass a .gguf file or the model's directory (holding config.json and *.safetensors)"
            )));
        }
        if hub::looks_like_repo_id(spec) {
            let dir = hub::resolve(spec, &hub::HubOptions::from_env())?;
            return Self::from_dir(spec, &dir);
        }
        Err(Error::input(format!(
            "model `{spec}`: no such directory, and not a hub repo id of the form Org/Name"
        )))
    }

    /// The target config: `config.json`, or the GGUF metadata mapped onto it.
    pub fn target_config(&self) -> Result<crate::config::TargetConfig> {
        match self.gguf_file()? {
            Some(g) => g.target_config(),
            None => crate::config::TargetConfig::from_file(&self.config),
        }
    }

    /// The parsed GGUF file of a GGUF source (parsed on the first call, then shared).
    pub fn gguf_file(&self) -> Result<Option<Arc<gguf::GgufFile>>> {
        let Some(p) = &self.gguf else {
            return Ok(None);
        };
        if let Some(g) = self.gguf_file.0.get() {
            return Ok(Some(g.clone()));
        }
        let g = Arc::new(gguf::GgufFile::open(p)?);
        Ok(Some(self.gguf_file.0.get_or_init(|| g).clone()))
    }

    /// The weights, memory-mapped: a GGUF file's tensors (`keep_quant`: quantized matrices as
    /// stored), or the safetensors files with their MLX, FP8 or integer (AWQ / GPTQ /
    /// compressed-tensors) quantization (from
    /// `config.json`).
    pub fn weights(
        &self,
        dtype: candle_core::DType,
        device: &candle_core::Device,
        keep_quant: bool,
    ) -> Result<Weights> {
        if let Some(g) = self.gguf_file()? {
            return Weights::open_gguf(g, dtype, device, keep_quant);
        }
        let cfg = crate::config::read_json(&self.config)?;
        let file = self.config.display().to_string();
        let mlx = mlx::MlxQuant::from_config(&file, &cfg)?;
        let fp8 = fp8::Fp8Quant::from_config(&file, &cfg)?;
        let intq = intq::IntQuant::from_config(&file, &cfg)?;
        Ok(Weights::open(&self.weight_files, dtype, device)?
            .with_mlx_quant(mlx)
            .with_fp8_quant(fp8)
            .with_int_quant(intq))
    }

    /// Tokenizer, chat template and stop ids: from a GGUF file's metadata, else from
    /// `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` (the config's
    /// `eos_token_id`s when there is no tokenizer). A template that does not parse is a notice,
    /// not an error (raw prompts still work).
    pub fn chat_assets(&self, cfg: &crate::config::TargetConfig) -> Result<ChatAssets> {
        use crate::chat::ChatTemplate;
        use crate::tokenizer::{stop_token_ids_from_dir, Tokenizer};
        if let Some(g) = self.gguf_file()? {
            return Ok(ChatAssets {
                tokenizer: Some(g.tokenizer()?),
                template: g.chat_template()?,
                stop_ids: g.stop_token_ids()?,
                notices: vec![],
            });
        }
        let mut notices = vec![];
        let tokenizer = self
            .tokenizer
            .as_ref()
            .map(Tokenizer::from_file)
            .transpose()?;
        let template = match &self.tokenizer_config {
            Some(p) => match ChatTemplate::from_tokenizer_config(p) {
                Ok(t) => Some(t),
                Err(e) => {
                    notices.push(format!("no usable chat template: {e}"));
                    None
                }
            },
            None => None,
        };
        let stop_ids = match &tokenizer {
            Some(t) => stop_token_ids_from_dir(t, &self.dir)?,
            None => {
                let mut ids = cfg.eos_token_ids.clone();
                if let Some(g) = &self.generation_config {
                    let v = crate::config::read_json(g)?;
                    let name = g.display().to_string();
                    let f = crate::config::Fields::new(&name, &v)?;
                    ids.extend(f.opt_id_list("eos_token_id")?);
                }
                ids
            }
        };
        Ok(ChatAssets {
            tokenizer,
            template,
            stop_ids,
            notices,
        })
    }

    /// A local directory in Hugging Face layout.
    pub fn from_dir(spec: &str, dir: &Path) -> Result<Self> {
        let config = dir.join("config.json");
        if !config.is_file() {
            return Err(Error::input(format!(
                "{}: no config.json; a model directory needs config.json and model weights (*.safetensors)",
                dir.display()
            )));
        }
        let weight_files = find_weight_files(dir)?;
        let opt = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        Ok(ModelSource {
            spec: spec.to_string(),
            dir: dir.to_path_buf(),
            config,
            weight_files,
            tokenizer: opt("tokenizer.json"),
            tokenizer_config: opt("tokenizer_config.json"),
            generation_config: opt("generation_config.json"),
            gguf: None,
            gguf_file: GgufCell::default(),
        })
    }

    /// A single GGUF file.
    pub fn from_gguf(spec: &str, path: &Path) -> Self {
        ModelSource {
            spec: spec.to_string(),
            dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            config: path.to_path_buf(),
            weight_files: vec![path.to_path_buf()],
            tokenizer: None,
            tokenizer_config: None,
            generation_config: None,
            gguf: Some(path.to_path_buf()),
            gguf_file: GgufCell::default(),
        }
    }
}

/// `model.safetensors`, or the shards listed by `model.safetensors.index.json`, or (for
/// single-file drafts saved under other names) the only `*.safetensors` file.
fn find_weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v = crate::config::read_json(&index)?;
        let file = index.display().to_string();
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::config(&file, "weight_map", "missing or not an object"))?;
        let mut shards: Vec<String> = Vec::new();
        for (tensor, shard) in map {
            let s = shard.as_str().ok_or_else(|| {
                Error::config(
                    &file,
                    format!("weight_map.{tensor}"),
                    "expected a file name",
                )
            })?;
            if s.contains('/') || s.contains('\\') || s.starts_with('.') {
                return Err(Error::config(
                    &file,
                    format!("weight_map.{tensor}"),
                    format!("invalid shard name `{s}`"),
                ));
            }
            if !shards.iter().any(|x| x == s) {
                shards.push(s.to_string());
            }
        }
        shards.sort();
        let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
        for p in &paths {
            if !p.is_file() {
                return Err(Error::weights(
                    p.display().to_string(),
                    format!(
                        "shard listed in {} is missing; re-download the model",
                        index.display()
                    ),
                ));
            }
        }
        return Ok(paths);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(Error::weights(
            dir.display().to_string(),
            "no model.safetensors, model.safetensors.index.json or *.safetensors file",
        ));
    }
    Ok(found)
}

/// A checkpoint config's `quantization_config` (top level, or under `text_config` as
/// multimodal checkpoints put it) with the field path errors name; None when it has none.
pub(crate) fn quantization_config(
    cfg: &serde_json::Value,
) -> Option<(&'static str, &serde_json::Value)> {
    match (
        cfg.get("quantization_config"),
        cfg.get("text_config")
            .and_then(|t| t.get("quantization_config")),
    ) {
        (Some(q), _) => Some(("quantization_config", q)),
        (None, Some(q)) => Some(("text_config.quantization_config", q)),
        (None, None) => None,
    }
}

/// How a load treated `count` quantized tensors of one format, `kept` of them as stored:
/// `kept as stored`, `dequantized to bf16`, or `3 kept as stored, the rest dequantized to bf16`.
pub(crate) fn kept_or_dequantized(count: usize, kept: usize, dtype: candle_core::DType) -> String {
    match kept {
        0 => format!("dequantized to {}", dtype.as_str()),
        k if k == count => "kept as stored".to_string(),
        k => format!(
            "{k} kept as stored, the rest dequantized to {}",
            dtype.as_str()
        ),
    }
}
