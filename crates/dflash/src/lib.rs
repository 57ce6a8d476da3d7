//! dflash: an inference engine for DFlash speculative decoding.
pub mod chat;
pub mod error;
pub mod tokenizer;
pub use error::{Error, Result};
