//! Why a benchmark row failed, in the words a user acts on: the seed's matrix lost rows to a
//! gated repo, a missing repo, unsupported families and weights the loader did not understand.
//!
//! Classification goes by [`Error`] variant; inside a variant that covers several causes
//! (a hub failure is gated or not found; a weights failure is extra, missing or misshapen
//! tensors) the variant's own fields decide.

use crate::Error;
use serde::{Deserialize, Serialize};

/// The outcome of one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Baseline and DFlash measured.
    Ok,
    /// Only the baseline was measured: the row names no draft.
    NoDraft,
    /// A repo, directory or file does not exist (or is not in the cache while offline).
    NotFound,
    /// The hub refused access: a gated or private repo.
    Gated,
    /// The target's `model_type` is not a family this build implements.
    #[serde(rename = "unsupported_architecture")]
    UnsupportedArch,
    /// The checkpoint's tensors do not match the model (extra, missing or misshapen), or the
    /// draft does not fit the target.
    WeightMismatch,
    /// The device ran out of memory.
    OutOfMemory,
    /// Anything else (bad config, tokenizer, prompt, network).
    Error,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::NoDraft => "no draft",
            Status::NotFound => "not found",
            Status::Gated => "gated repo",
            Status::UnsupportedArch => "unsupported architecture",
            Status::WeightMismatch => "weight mismatch",
            Status::OutOfMemory => "out of memory",
            Status::Error => "error",
        }
    }
    /// Rows with a measured DFlash speedup.
    pub fn is_ok(self) -> bool {
        self == Status::Ok
    }
}

/// A classified failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub status: Status,
    /// One line: the cause (e.g. `4 extra params: d2t, embed_tokens.weight, lm_head.weight, t2d`).
    pub cause: String,
    /// The family for [`Status::UnsupportedArch`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub family: Option<String>,
    /// The tensors involved for [`Status::WeightMismatch`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensors: Option<Vec<String>>,
    /// The full error message.
    pub detail: String,
}

impl Failure {
    pub fn new(status: Status, cause: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            status,
            cause: cause.into(),
            family: None,
            tensors: None,
            detail: detail.into(),
        }
    }
}

/// The marker the draft loader writes before the list of tensors it did not use.
const UNUSED_MARKER: &str = " tensors not used by the DFlash draft: ";

/// Classify an engine error. `role` says which model was being loaded ("target", "draft").
pub fn classify(e: &Error, role: &str) -> Failure {
    let detail = e.to_string();
    match e {
        Error::UnsupportedArch {
            model_type,
            supported,
            ..
        } => Failure {
            family: Some(model_type.clone()),
            ..Failure::new(
                Status::UnsupportedArch,
                format!("{role}: unsupported architecture `{model_type}` (supported: {supported})"),
                detail,
            )
        },
        Error::Hub { repo, cause, .. } => {
            // The hub resolver words its causes by HTTP status (401/403: gated or private;
            // 404 or a cache miss offline: not found).
            let gated = cause.contains("HTTP 401") || cause.contains("HTTP 403");
            let repo_missing = cause.contains("RepositoryNotFound")
                || cause.contains("repository not found")
                || cause.contains("HTTP 404")
                || cause.contains("not in the Hugging Face cache");
            let status = if gated && !cause.contains("repository not found") {
                Status::Gated
            } else if repo_missing || cause.contains("malformed") {
                Status::NotFound
            } else {
                Status::Error
            };
            Failure::new(status, format!("{role} `{repo}`: {cause}"), detail)
        }
        Error::Weights { file, msg } => {
            if let Some((count, names)) = msg.split_once(UNUSED_MARKER) {
                let tensors: Vec<String> = names.split(", ").map(str::to_string).collect();
                let n = count.trim().parse().unwrap_or(tensors.len());
                let mut sorted = tensors.clone();
                sorted.sort();
                Failure {
                    tensors: Some(sorted.clone()),
                    ..Failure::new(
                        Status::WeightMismatch,
                        format!("{role}: {n} extra params: {}", sorted.join(", ")),
                        detail,
                    )
                }
            } else if let Some(name) = backticked(msg)
                .filter(|_| msg.starts_with("missing tensor") || msg.contains("has shape"))
            {
                Failure {
                    tensors: Some(vec![name.to_string()]),
                    ..Failure::new(Status::WeightMismatch, format!("{role}: {msg}"), detail)
                }
            } else if msg.contains("is missing") || msg.starts_with("no model.safetensors") {
                Failure::new(Status::NotFound, format!("{role} {file}: {msg}"), detail)
            } else {
                Failure::new(Status::WeightMismatch, format!("{role}: {msg}"), detail)
            }
        }
        Error::Mismatch { msg, .. } => Failure::new(
            Status::WeightMismatch,
            format!("draft does not fit the target: {msg}"),
            detail,
        ),
        Error::Io { path, source } => {
            let status = match source.kind() {
                std::io::ErrorKind::NotFound => Status::NotFound,
                std::io::ErrorKind::OutOfMemory => Status::OutOfMemory,
                _ => Status::Error,
            };
            Failure::new(
                status,
                format!("{role}: {}: {source}", path.display()),
                detail,
            )
        }
        Error::Candle(c) => {
            if e.is_out_of_memory() {
                Failure::new(
                    Status::OutOfMemory,
                    format!("{role}: out of memory"),
                    detail,
                )
            } else {
                Failure::new(Status::Error, format!("{role}: tensor op: {c}"), detail)
            }
        }
        // The loader's memory check (crate::memory) refused the model.
        Error::Input(m) if m.starts_with("not enough memory") => {
            Failure::new(Status::OutOfMemory, format!("{role}: {m}"), detail)
        }
        Error::Config { .. }
        | Error::Tokenizer { .. }
        | Error::Template { .. }
        | Error::Input(_) => Failure::new(Status::Error, format!("{role}: {detail}"), detail),
    }
}

/// The first `name` in backticks.
fn backticked(s: &str) -> Option<&str> {
    let a = s.find('`')? + 1;
    let b = s[a..].find('`')? + a;
    Some(&s[a..b])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unused_tensors_are_listed_and_counted() {
        let e = Error::weights(
            "d/config.json",
            "4 tensors not used by the DFlash draft: t2d, d2t, lm_head.weight, embed_tokens.weight",
        );
        let f = classify(&e, "draft");
        assert_eq!(f.status, Status::WeightMismatch);
        assert_eq!(
            f.cause,
            "draft: 4 extra params: d2t, embed_tokens.weight, lm_head.weight, t2d"
        );
        assert_eq!(f.tensors.unwrap().len(), 4);
    }

    #[test]
    fn variants_map_to_statuses() {
        let unsupported = Error::UnsupportedArch {
            model_type: "mamba9".into(),
            file: "c.json".into(),
            supported: "qwen3, llama".into(),
        };
        let f = classify(&unsupported, "target");
        assert_eq!(f.status, Status::UnsupportedArch);
        assert_eq!(f.family.as_deref(), Some("mamba9"));
        let hub = |cause: &str| Error::Hub {
            repo: "a/b".into(),
            cause: cause.into(),
            hint: "h".into(),
        };
        let gated = "access denied (HTTP 401): the repo is gated or private";
        assert_eq!(classify(&hub(gated), "t").status, Status::Gated);
        let missing = "repository not found on https://huggingface.co (HTTP 401)";
        assert_eq!(classify(&hub(missing), "t").status, Status::NotFound);
        let offline = "not in the Hugging Face cache (/x) and offline mode is on";
        assert_eq!(classify(&hub(offline), "t").status, Status::NotFound);
        let missing_tensor = Error::weights("f", "missing tensor `fc.weight` (expected shape [2])");
        let f = classify(&missing_tensor, "draft");
        assert_eq!(f.status, Status::WeightMismatch);
        assert_eq!(f.tensors.unwrap(), vec!["fc.weight".to_string()]);
        let oom = Error::Candle(candle_core::Error::Msg("CUDA_ERROR_OUT_OF_MEMORY".into()));
        assert_eq!(classify(&oom, "t").status, Status::OutOfMemory);
    }
}
