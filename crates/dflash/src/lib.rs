//! dflash: an inference engine for DFlash speculative decoding.
pub mod chat;
pub mod error;
pub mod source;
pub mod tokenizer;
pub use error::{Error, Result};
