//! DFlash draft configs (spec section 5). The z-lab format is a Qwen3-style config plus
//! `block_size` (top level or in `dflash_config`), `dflash_config.mask_token_id`,
//! `dflash_config.target_layer_ids` and `num_target_layers`.

use super::{read_json, Fields, TargetConfig};
use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// Which checkpoint layout a draft uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftFormat {
    /// z-lab `DFlashDraftModel`: no embedding, no LM head; taps are layer outputs.
    ZLab,
    /// vllm-project/speculators `dflash`: `transformer_layer_config`, taps named as layer
    /// inputs (`aux_hidden_state_layer_ids` = z-lab ids + 1), optional narrow `lm_head` with
    /// `d2t`/`t2d` vocab maps, optional own `embed_tokens`.
    Speculators,
}

#[derive(Debug, Clone)]
pub struct DraftConfig {
    pub file: String,
    pub format: DraftFormat,
    /// Vocabulary of the draft's own LM head (speculators; a z-lab draft narrowed by
    /// `draft::narrow`); None = the target's.
    pub draft_vocab_size: Option<usize>,
    /// `speculators_config.verifier.name_or_path`: the target it was trained for.
    pub verifier: Option<String>,
    /// The draft's own transformer layers (hidden size, heads, rope, layer types...).
    pub layers: TargetConfig,
    pub block_size: usize,
    pub mask_token_id: u32,
    /// Target decoder layers tapped (0-based, output of the layer), in concatenation order.
    /// None until resolved against the target when the config does not list them.
    pub target_layer_ids: Option<Vec<usize>>,
    pub num_target_layers: Option<usize>,
    /// Multiplies the (raw) target embeddings of the block (`input_embedding_scale`, 1.0).
    pub input_embedding_scale: f64,
    /// Multiplies the draft logits (`output_multiplier`, 1.0).
    pub output_multiplier: f64,
    /// `cap * tanh(logits / cap)` on the draft logits when set.
    pub final_logit_softcapping: Option<f64>,
    /// `is_causal` (top level): when set, every draft layer's block rows are causal (true) or
    /// not (false); unset, only sliding layers are causal (the reference's rule).
    pub is_causal: Option<bool>,
    /// `DFlash2DraftModel`: the convolutions and the candidate selector.
    pub dflash2: Option<Dflash2Config>,
}

/// The keys `DFlash2DraftModel` adds (read from `dflash_config`, else the top level, as the
/// reference does). Every one sizes a module the checkpoint was trained with: none has a
/// default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dflash2Config {
    /// Taps of each grouped dynamic causal convolution (offsets 0..K over the block rows).
    pub conv_kernel_size: usize,
    /// Channels sharing one dynamic kernel value; divides hidden_size.
    pub conv_group_size: usize,
    /// Width of the selector's predecessor/successor codebooks.
    pub selector_rank: usize,
    /// Candidates per block row (the top-k of its logits).
    pub selector_top_k: usize,
}

/// Bounds on the DFlash2 keys (a typo that would allocate absurd modules is an error).
const MAX_CONV_KERNEL: usize = 64;
const MAX_SELECTOR_RANK: usize = 8192;
pub const MAX_SELECTOR_TOP_K: usize = 256;

/// Default taps for `n` draft layers over `l` target layers: n == 1 -> [l / 2], else
/// round(1 + i * (l - 4) / (n - 1)) for i in 0..n, rounding half to even.
pub fn default_taps(n: usize, l: usize) -> Vec<usize> {
    if n <= 1 {
        return vec![l / 2];
    }
    (0..n)
        .map(|i| {
            let x = 1.0 + i as f64 * (l as f64 - 4.0) / (n as f64 - 1.0);
            round_half_even(x).max(0.0) as usize
        })
        .collect()
}

fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

impl DraftConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let v = read_json(path)?;
        Self::from_value(&path.display().to_string(), v)
    }

    pub fn from_value(file: &str, v: Value) -> Result<Self> {
        let f = Fields::new(file, &v)?;
        if f.has("transformer_layer_config") || f.has("speculators_model_type") {
            return Self::from_speculators(file, &f);
        }
        let dc = f.sub("dflash_config")?;
        let block_size = match dc.as_ref().map(|d| d.opt_usize("block_size")).transpose()?.flatten() {
            Some(b) => b,
            None => f.opt_usize("block_size")?.ok_or_else(|| {
                f.err("block_size", "missing (looked at the top level and in dflash_config); a DFlash draft must say its block size")
            })?,
        };
        if !(1..=64).contains(&block_size) {
            return Err(f.err("block_size", format!("{block_size} is out of range 1..=64")));
        }
        let mask_token_id = match dc
            .as_ref()
            .map(|d| d.opt_id("mask_token_id"))
            .transpose()?
            .flatten()
        {
            Some(m) => m,
            None => f.opt_id("mask_token_id")?.ok_or_else(|| {
                f.err(
                    "dflash_config.mask_token_id",
                    "missing: a DFlash draft needs the id of its mask token",
                )
            })?,
        };
        let target_layer_ids = match dc
            .as_ref()
            .map(|d| d.opt_usize_list("target_layer_ids"))
            .transpose()?
            .flatten()
        {
            Some(t) => Some(t),
            None => f.opt_usize_list("target_layer_ids")?,
        };
        if let Some(t) = &target_layer_ids {
            if t.is_empty() {
                return Err(f.err("dflash_config.target_layer_ids", "is empty"));
            }
        }
        let num_target_layers = f
            .opt_usize("num_target_layers")?
            .map(|n| f.bounded("num_target_layers", n, super::limits::MAX_LAYERS))
            .transpose()?;
        let archs = f.opt_str_list("architectures")?.unwrap_or_default();
        if let Some(a) = archs
            .iter()
            .find(|a| !matches!(a.as_str(), "DFlashDraftModel" | "DFlash2DraftModel"))
        {
            return Err(f.err(
                "architectures",
                format!(
                    "`{a}` is not a DFlash draft; supported: DFlashDraftModel, DFlash2DraftModel"
                ),
            ));
        }
        let is_dflash2 = archs.iter().any(|a| a == "DFlash2DraftModel");
        // Every DFlash value: dflash_config first, then the top level.
        let num = |key: &str| -> Result<Option<f64>> {
            match dc.as_ref().map(|d| d.opt_f64(key)).transpose()?.flatten() {
                Some(x) => Ok(Some(x)),
                None => f.opt_f64(key),
            }
        };
        let input_embedding_scale = num("input_embedding_scale")?.unwrap_or(1.0);
        let output_multiplier = num("output_multiplier")?.unwrap_or(1.0);
        let final_logit_softcapping = num("final_logit_softcapping")?.filter(|c| *c > 0.0);
        let layers = TargetConfig::from_value(file, v.clone())?;
        let dflash2 = if is_dflash2 {
            let key = |name: &str, max: usize| -> Result<usize> {
                let v = match dc
                    .as_ref()
                    .map(|d| d.opt_usize(name))
                    .transpose()?
                    .flatten()
                {
                    Some(x) => Some(x),
                    None => f.opt_usize(name)?,
                };
                let v = v.ok_or_else(|| {
                    f.err(
                        &format!("dflash_config.{name}"),
                        "missing: a DFlash2DraftModel config must give it (looked in dflash_config and at the top level)",
                    )
                })?;
                if v == 0 || v > max {
                    return Err(f.err(
                        &format!("dflash_config.{name}"),
                        format!("{v} is out of range 1..={max}"),
                    ));
                }
                Ok(v)
            };
            let d = Dflash2Config {
                conv_kernel_size: key("conv_kernel_size", MAX_CONV_KERNEL)?,
                conv_group_size: key("conv_group_size", layers.hidden_size.max(1))?,
                selector_rank: key("selector_rank", MAX_SELECTOR_RANK)?,
                selector_top_k: key("selector_top_k", MAX_SELECTOR_TOP_K.min(layers.vocab_size))?,
            };
            if layers.hidden_size % d.conv_group_size != 0 {
                return Err(f.err(
                    "dflash_config.conv_group_size",
                    format!(
                        "{} does not divide hidden_size {}",
                        d.conv_group_size, layers.hidden_size
                    ),
                ));
            }
            Some(d)
        } else {
            None
        };
        Ok(DraftConfig {
            file: file.to_string(),
            format: DraftFormat::ZLab,
            draft_vocab_size: f
                .opt_usize("draft_vocab_size")?
                .map(|n| f.bounded("draft_vocab_size", n, super::limits::MAX_VOCAB))
                .transpose()?,
            verifier: None,
            layers,
            block_size,
            mask_token_id,
            target_layer_ids,
            num_target_layers,
            input_embedding_scale,
            output_multiplier,
            final_logit_softcapping,
            is_causal: f.opt_bool("is_causal")?,
            dflash2,
        })
    }

    /// The speculators layout (spec section 5).
    fn from_speculators(file: &str, f: &Fields) -> Result<Self> {
        if let Some(t) = f.opt_str("speculators_model_type")? {
            if t == "dflash2" {
                return Err(f.err(
                    "speculators_model_type",
                    "speculators-format DFlash2 checkpoints are not supported yet; the z-lab format (architectures: [\"DFlash2DraftModel\"]) is",
                ));
            }
            if t != "dflash" {
                return Err(f.err(
                    "speculators_model_type",
                    format!("`{t}` is not a DFlash speculator (expected \"dflash\")"),
                ));
            }
        }
        let tl = f.get("transformer_layer_config").ok_or_else(|| {
            f.err(
                "transformer_layer_config",
                "missing (required by the speculators format)",
            )
        })?;
        let mut tl = tl.clone();
        // The layer config may omit the vocabulary; it is the target's (checked at load).
        if tl.get("vocab_size").is_none() {
            tl["vocab_size"] = f
                .get("target_vocab_size")
                .cloned()
                .unwrap_or(Value::from(1u64));
        }
        let layers = TargetConfig::from_value(&format!("{file} (transformer_layer_config)"), tl)?;
        let spec = f.sub("speculators_config")?;
        let num = |key: &str| -> Result<Option<usize>> {
            match f.opt_usize(key)? {
                Some(x) => Ok(Some(x)),
                None => spec
                    .as_ref()
                    .map(|s| s.opt_usize(key))
                    .transpose()
                    .map(|x| x.flatten()),
            }
        };
        let block_size = num("block_size")?.ok_or_else(|| {
            f.err(
                "block_size",
                "missing (speculators DFlash configs carry it)",
            )
        })?;
        if !(1..=64).contains(&block_size) {
            return Err(f.err("block_size", format!("{block_size} is out of range 1..=64")));
        }
        let mask_token_id = num("mask_token_id")?
            .ok_or_else(|| f.err("mask_token_id", "missing"))
            .and_then(|m| {
                u32::try_from(m)
                    .map_err(|_| f.err("mask_token_id", format!("{m} is not a token id")))
            })?;
        let aux = f
            .opt_usize_list("aux_hidden_state_layer_ids")?
            .ok_or_else(|| {
                f.err(
                    "aux_hidden_state_layer_ids",
                    "missing (the target layers the draft reads)",
                )
            })?;
        if aux.is_empty() || aux.contains(&0) {
            return Err(f.err(
                "aux_hidden_state_layer_ids",
                "must be non-empty and >= 1 (they name layer INPUTS; 0 would be the embeddings)",
            ));
        }
        let verifier = match &spec {
            Some(s) => match s.sub("verifier")? {
                Some(v) => v.opt_str("name_or_path")?.map(String::from),
                None => None,
            },
            None => None,
        };
        Ok(DraftConfig {
            file: file.to_string(),
            format: DraftFormat::Speculators,
            draft_vocab_size: f
                .opt_usize("draft_vocab_size")?
                .map(|n| f.bounded("draft_vocab_size", n, super::limits::MAX_VOCAB))
                .transpose()?,
            verifier,
            layers,
            block_size,
            mask_token_id,
            target_layer_ids: Some(aux.iter().map(|a| a - 1).collect()),
            num_target_layers: None,
            input_embedding_scale: f.opt_f64("input_embedding_scale")?.unwrap_or(1.0),
            output_multiplier: f.opt_f64("output_multiplier")?.unwrap_or(1.0),
            final_logit_softcapping: f.opt_f64("final_logit_softcapping")?.filter(|c| *c > 0.0),
            is_causal: f.opt_bool("is_causal")?,
            dflash2: None,
        })
    }

    /// The taps to use with a target of `target_layers` layers.
    pub fn taps(&self, target_layers: usize) -> Vec<usize> {
        match &self.target_layer_ids {
            Some(t) => t.clone(),
            None => default_taps(
                self.layers.num_hidden_layers,
                self.num_target_layers.unwrap_or(target_layers),
            ),
        }
    }

    /// Check the draft against a target; every mismatch names both values.
    pub fn validate_against(&self, target: &TargetConfig, target_name: &str) -> Result<Vec<usize>> {
        let mm = |msg: String| Error::Mismatch {
            draft: self.file.clone(),
            target: target_name.to_string(),
            msg,
        };
        if self.layers.hidden_size != target.hidden_size {
            return Err(mm(format!(
                "draft hidden_size {} != target hidden_size {}",
                self.layers.hidden_size, target.hidden_size
            )));
        }
        if let Some(n) = self.num_target_layers {
            if n != target.num_hidden_layers {
                return Err(mm(format!(
                    "draft num_target_layers {n} != target num_hidden_layers {}",
                    target.num_hidden_layers
                )));
            }
        }
        let taps = self.taps(target.num_hidden_layers);
        if let Some(&t) = taps.iter().find(|&&t| t >= target.num_hidden_layers) {
            return Err(mm(format!(
                "tap layer {t} >= target num_hidden_layers {}",
                target.num_hidden_layers
            )));
        }
        if self.dflash2.is_some() && self.layers.vocab_size != target.vocab_size {
            return Err(mm(format!(
                "DFlash2 draft vocab_size {} != target vocab_size {} (the selector's codebooks are indexed by target token ids)",
                self.layers.vocab_size, target.vocab_size
            )));
        }
        if self.mask_token_id as usize >= target.vocab_size {
            return Err(mm(format!(
                "mask_token_id {} >= target vocab_size {}",
                self.mask_token_id, target.vocab_size
            )));
        }
        Ok(taps)
    }
}
