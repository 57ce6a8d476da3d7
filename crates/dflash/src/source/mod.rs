//! Model sources: where a model's files are (a local directory in Hugging Face layout, or a
//! hub repo id resolved through the HF cache) and memory-mapped weight loading.
//!
//! Second step of the data flow: config -> **sources/loading** -> archs -> draft -> engine.

pub mod demo;
pub mod gguf;
pub mod gguf_header;
pub mod gguf_tokenizer;
pub mod hub;
pub mod mlx;
pub mod mxfp4;
pub mod weights;

pub use demo::demo_model_path;
pub use weights::Weights;

use crate::{Error, Result};
use std::path::{Path, PathBuf};

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
        match &self.gguf {
            Some(p) => gguf::GgufFile::open(p)?.target_config(),
            None => crate::config::TargetConfig::from_file(&self.config),
        }
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
