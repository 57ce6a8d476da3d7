//! dflash: an inference engine for DFlash speculative decoding.
//!
//! Data flow (one module per step):
//! [`config`] -> [`source`] (files, weights) -> [`archs`] (target families over shared
//! [`nn`] layers) -> [`draft`] (the block-diffusion draft) -> [`engine`] (decode loop) ->
//! [`sampling`] / [`stats`]. Text in and out: [`tokenizer`], [`chat`]. Draft training:
//! [`train`].
pub mod archs;
pub mod bench;
pub mod chat;
pub mod config;
pub mod draft;
pub mod engine;
pub mod error;
pub mod grammar;
pub mod memory;
pub mod nn;
pub mod pipeline;
pub mod registry;
pub mod rng;
pub mod sampling;
pub mod source;
pub mod stats;
pub mod switches;
pub mod testing;
pub mod tokenizer;
pub mod train;

pub use error::{Error, Result};
