//! Errors of the engine. Every variant carries the context a user needs to act on it:
//! the file, field or tensor involved, what was expected, what was found.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A config file is malformed or a field is missing / out of range.
    #[error("{file}: field `{field}`: {msg}")]
    Config {
        file: String,
        field: String,
        msg: String,
    },

    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Model weights are missing, truncated, of the wrong shape or dtype.
    #[error("weights {file}: {msg}")]
    Weights { file: String, msg: String },

    /// The config names an architecture this build does not support.
    #[error("unsupported architecture `{model_type}` in {file}; supported: {supported}")]
    UnsupportedArch {
        model_type: String,
        file: String,
        supported: String,
    },

    /// A model reference (path or hub repo id) could not be resolved.
    #[error("model `{repo}`: {cause}; {hint}")]
    Hub {
        repo: String,
        cause: String,
        hint: String,
    },

    /// Tokenizer loading, encoding or decoding failed.
    #[error("tokenizer {file}: {msg}")]
    Tokenizer { file: String, msg: String },

    /// The chat template could not be parsed or rendered.
    #[error("chat template ({file}): {msg}")]
    Template { file: String, msg: String },

    /// A target and a draft do not fit together.
    #[error("draft {draft} does not fit target {target}: {msg}")]
    Mismatch {
        draft: String,
        target: String,
        msg: String,
    },

    /// Bad generation input (empty prompt, context overflow, invalid sampling values).
    #[error("{0}")]
    Input(String),

    /// An error inside the tensor library.
    #[error("tensor op: {0}")]
    Candle(#[from] candle_core::Error),
}

impl Error {
    pub fn config(
        file: impl Into<String>,
        field: impl Into<String>,
        msg: impl Into<String>,
    ) -> Self {
        Error::Config {
            file: file.into(),
            field: field.into(),
            msg: msg.into(),
        }
    }
    pub fn weights(file: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Weights {
            file: file.into(),
            msg: msg.into(),
        }
    }
    pub fn input(msg: impl Into<String>) -> Self {
        Error::Input(msg.into())
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// An allocation failed (CUDA_ERROR_OUT_OF_MEMORY, Metal, host, or an I/O error of that
    /// kind): candle reports these only as text inside its error.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::Candle(c) => {
                let l = c.to_string().to_ascii_lowercase();
                l.contains("out of memory") || l.contains("out_of_memory")
            }
            Error::Io { source, .. } => source.kind() == std::io::ErrorKind::OutOfMemory,
            _ => false,
        }
    }
}
