//! dflash: an inference engine for DFlash speculative decoding.
pub mod error;
pub use error::{Error, Result};
