//! Target families and the target-model interface the engine drives.
//!
//! Third step of the data flow: config -> sources/loading -> **archs** -> draft -> engine.
//! A family is chosen from `model_type` by an exact table ([`FAMILIES`]); each family file
//! maps config keys and tensor names onto shared layers (`nn/`).

pub mod decoder;
pub mod deepseek_v3;
pub mod footprint;
pub mod gemma3;
pub mod gemma4;
pub mod gpt_oss;
pub mod graphs;
pub mod hybrid;
pub mod llama;
pub mod parallel;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_5_moe;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod stack;

use crate::config::TargetConfig;
use crate::nn::{KvCache, LatentCache, RecurrentCache};
use crate::source::{ModelSource, Weights};
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (e.g. a draft-only prefill).
    None,
    /// Only the last position (prefill, plain decoding).
    Last,
    /// Every position (verify).
    All,
}

impl Logits {
    /// The final hidden rows the LM head must see: none, the last one, or all.
    pub fn rows(self, h: &Tensor) -> Result<Option<Tensor>> {
        if let Logits::None = self {
            return Ok(None);
        }
        let r = self.row_range(h.dim(0)?);
        Ok(Some(h.narrow(0, r.start, r.len())?))
    }

    /// Which of a forward's `n` rows [`Self::rows`] picks.
    pub fn row_range(self, n: usize) -> std::ops::Range<usize> {
        match self {
            Logits::None => 0..0,
            Logits::Last => n.saturating_sub(1)..n,
            Logits::All => 0..n,
        }
    }
}

/// What a target forward pass returns.
#[derive(Debug)]
pub struct ForwardOutput {
    /// `[rows, vocab]` f32: rows = 1 for [`Logits::Last`], all positions for [`Logits::All`].
    pub logits: Option<Tensor>,
    /// `[positions, taps.len() * hidden]` in the compute dtype, taps concatenated in the
    /// requested order; None when no taps were requested.
    pub taps: Option<Tensor>,
    /// In a batched forward, where `logits` sit among the logits of the whole batch (one
    /// tensor, every sequence's rows back to back): a batch-wide consumer takes them whole
    /// ([`crate::nn::rejoin`]) instead of concatenating the pieces again.
    pub logits_in_batch: Option<crate::nn::PartOf>,
}

/// Static facts about a loaded target.
#[derive(Debug, Clone)]
pub struct TargetInfo {
    pub family: &'static str,
    pub model_type: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub max_position: usize,
    pub dtype: DType,
    pub device: Device,
    /// Bytes of weights held.
    pub weight_bytes: usize,
    /// For quantized sources, what the load did per tensor type, e.g. GGUF
    /// `Q4_1->Q8_0 x210, Q8_0 x1` (requantized for fast CPU kernels) or `Q4_1 x210`
    /// (`keep_quant`), MLX `mlx affine 4-bit g64 x197; dequantized to f32`; None for float
    /// checkpoints.
    pub quantization: Option<String>,
}

/// The per-sequence state of a target, owned by the engine: one entry per layer.
pub struct TargetCache {
    pub layers: Vec<LayerCache>,
    len: usize,
    capacity: usize,
    /// A tensor-parallel model's caches of ranks 1.. (their shares of the heads; `layers` is
    /// rank 0's), kept in step with this one (`parallel::Sharded`).
    pub ranks: Vec<TargetCache>,
}

/// The state one layer keeps between forward passes.
pub enum LayerCache {
    /// Attention keys and values.
    Kv(KvCache),
    /// Conv window + recurrent state of a Gated DeltaNet layer, with what the last forward
    /// kept to roll back inside it (`nn::recurrent_cache`).
    Recurrent(RecurrentCache),
    /// Multi-head latent attention (deepseek_v3 / kimi_k25): one compressed row per position.
    Latent(LatentCache),
}

impl LayerCache {
    /// The KV cache of an attention layer; an error for other kinds of state.
    pub fn kv_mut(&mut self) -> Result<&mut KvCache> {
        match self {
            LayerCache::Kv(kv) => Ok(kv),
            _ => Err(Error::input("layer cache is not an attention KV cache")),
        }
    }
}

impl TargetCache {
    pub fn new(layers: Vec<LayerCache>, capacity: usize) -> Self {
        Self {
            layers,
            len: 0,
            capacity,
            ranks: Vec::new(),
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Drop every position at or after `len` (after a partial acceptance). O(1) for KV layers;
    /// recurrent layers rebuild their state after exactly `len` positions (one small matmul
    /// per layer, nothing when the whole verify block was accepted). All layers are checked
    /// before any changes, so an impossible rollback leaves the cache as it was.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::input(format!(
                "cannot truncate a cache of {} positions to {len}",
                self.len
            )));
        }
        for c in std::iter::once(&*self).chain(&self.ranks) {
            for l in &c.layers {
                if let LayerCache::Recurrent(r) = l {
                    r.check_truncate(len)?;
                }
            }
        }
        for c in &mut self.ranks {
            c.truncate(len)?;
        }
        for l in &mut self.layers {
            match l {
                LayerCache::Kv(kv) => kv.truncate(len),
                LayerCache::Recurrent(r) => r.truncate(len)?,
                LayerCache::Latent(c) => c.truncate(len),
            }
        }
        self.len = len;
        Ok(())
    }
    /// Longest prefix of this cache another sequence can start from, given it shares `m`
    /// positions: `m` when every layer can cut there (attention and latent rows can; a
    /// recurrent state exists only after all positions), else 0.
    pub fn reusable(&self, m: usize) -> usize {
        let m = m.min(self.len);
        if self.has_recurrent() && m != self.len {
            0
        } else {
            m
        }
    }

    /// A new cache of `capacity` positions starting with a copy of this one's first `len`
    /// positions (see [`Self::reusable`]).
    pub fn fork(&self, len: usize, capacity: usize) -> Result<Self> {
        if self.reusable(len) != len || len > capacity {
            return Err(Error::input(format!(
                "cannot fork {len} of {} cached positions (capacity {capacity})",
                self.len
            )));
        }
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerCache::Kv(kv) => LayerCache::Kv(kv.fork(len, capacity)?),
                    LayerCache::Latent(c) => LayerCache::Latent(c.fork(len, capacity)?),
                    LayerCache::Recurrent(r) => LayerCache::Recurrent(r.fork()?),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            len,
            capacity,
            ranks: self
                .ranks
                .iter()
                .map(|c| c.fork(len, capacity))
                .collect::<Result<_>>()?,
        })
    }

    /// Whether some layer keeps recurrent state (its rollback does work on the device).
    pub fn has_recurrent(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l, LayerCache::Recurrent(_)))
    }
    /// Called by the model after a forward of `n` positions.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }
    /// Bytes held, every rank's included.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Kv(kv) => kv.bytes(),
                LayerCache::Recurrent(r) => r.bytes(),
                LayerCache::Latent(c) => c.bytes(),
            })
            .sum::<usize>()
            + self.ranks.iter().map(TargetCache::bytes).sum::<usize>()
    }
}

/// The interface every target family implements. The engine calls nothing else.
/// One sequence's part of a batched forward ([`TargetModel::forward_batch`]).
pub struct BatchItem<'a> {
    pub tokens: &'a [u32],
    /// Position of the first token (must equal `cache.len()`).
    pub start: usize,
    pub cache: &'a mut TargetCache,
    pub logits: Logits,
}

pub trait TargetModel: Send + Sync {
    fn info(&self) -> &TargetInfo;

    /// A fresh cache able to hold `capacity` positions.
    fn new_cache(&self, capacity: usize) -> Result<TargetCache>;

    /// Run `tokens` at positions `start ..` (`start` must equal `cache.len()`), appending them
    /// to the cache. `taps` are 0-based decoder layer indices whose OUTPUT (the residual stream
    /// after the layer's MLP add, before the final norm) is returned, concatenated in order.
    fn forward(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput>;

    /// Raw rows of the token embedding table `[n, hidden]` (no family embedding scale: the
    /// draft applies its own `input_embedding_scale`, as the reference does).
    fn embed(&self, tokens: &Tensor) -> Result<Tensor>;

    /// The LM head projection alone on already-normalized hidden states:
    /// `[n, hidden] -> [n, vocab]` f32 (no softcapping: the draft applies its own).
    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor>;

    /// Several sequences in one forward: each item's tokens at its positions, over its own
    /// cache, with the same taps; outputs in item order, each as [`Self::forward`] gives it
    /// alone. The default runs the items one after another; families that batch run every
    /// layer's weights once over all items' rows.
    ///
    /// The outer error is a failure of the shared pass (every item's cache is back at its
    /// start); an item's own bad input (a token outside the vocabulary, a cache overflow) is
    /// its inner error and the others still run.
    fn forward_batch(
        &self,
        items: &mut [BatchItem],
        taps: &[usize],
    ) -> Result<Vec<Result<ForwardOutput>>> {
        Ok(items
            .iter_mut()
            .map(|it| self.forward(it.tokens, it.start, it.cache, taps, it.logits))
            .collect())
    }

    /// Bytes of weights a forward of `rows` rows reads (MoE: the expected union of the
    /// experts the rows route to); the adaptive policy shapes its cost estimates with it.
    fn verify_bytes(&self, rows: usize) -> f64 {
        let _ = rows;
        self.info().weight_bytes as f64
    }

    /// What the model's CUDA graphs did (`archs::graphs`; all zero where none run).
    fn graph_report(&self) -> graphs::GraphReport {
        graphs::GraphReport::default()
    }
}

/// Collects the outputs of the tapped layers during one forward, in the requested order.
pub struct TapRecorder<'a> {
    layers: &'a [usize],
    got: Vec<Option<Tensor>>,
}

impl<'a> TapRecorder<'a> {
    pub fn new(layers: &'a [usize]) -> Self {
        Self {
            layers,
            got: vec![None; layers.len()],
        }
    }
    /// Whether layer `layer`'s output is tapped.
    pub fn wants(&self, layer: usize) -> bool {
        self.layers.contains(&layer)
    }
    /// `h` is the output of decoder layer `layer`.
    pub fn record(&mut self, layer: usize, h: &Tensor) {
        for (slot, &t) in self.layers.iter().enumerate() {
            if t == layer {
                self.got[slot] = Some(h.clone());
            }
        }
    }
    /// `[positions, taps * hidden]`, or None when no taps were requested.
    pub fn finish(self) -> Result<Option<Tensor>> {
        if self.layers.is_empty() {
            return Ok(None);
        }
        let parts = self
            .got
            .into_iter()
            .zip(self.layers)
            .map(|(t, l)| t.ok_or_else(|| Error::input(format!("tap layer {l} was not reached"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Tensor::cat(&parts, 1)?))
    }
}

/// The checks every family makes before a forward (`tokens` < `vocab_limit`, taps < `layers`,
/// `start` == cached length, capacity), then `run`; on success the cache advances, on failure
/// it is cropped back to `start` (layers that had appended forget the partial step).
pub fn checked_forward(
    tokens: &[u32],
    start: usize,
    cache: &mut TargetCache,
    taps: &[usize],
    layers: usize,
    vocab_limit: usize,
    run: impl FnOnce(&mut TargetCache) -> Result<ForwardOutput>,
) -> Result<ForwardOutput> {
    check_forward(tokens, start, cache, taps, layers, vocab_limit)?;
    match run(cache) {
        Ok(out) => {
            cache.advance(tokens.len());
            Ok(out)
        }
        Err(e) => {
            cache.truncate(start).ok();
            Err(e)
        }
    }
}

/// The input checks of [`checked_forward`].
pub fn check_forward(
    tokens: &[u32],
    start: usize,
    cache: &TargetCache,
    taps: &[usize],
    layers: usize,
    vocab_limit: usize,
) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::input("forward: no tokens"));
    }
    if start != cache.len() {
        return Err(Error::input(format!(
            "forward: start position {start} != cached length {}",
            cache.len()
        )));
    }
    if let Some(&bad) = taps.iter().find(|&&t| t >= layers) {
        return Err(Error::input(format!(
            "tap layer {bad} out of range: the target has {layers} layers"
        )));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab_limit) {
        return Err(Error::input(format!(
            "token id {bad} out of range: vocab size is {vocab_limit}"
        )));
    }
    if start + tokens.len() > cache.capacity() {
        return Err(Error::input(format!(
            "context overflow: {start} cached + {} new positions exceed the context size {}",
            tokens.len(),
            cache.capacity()
        )));
    }
    Ok(())
}

/// Options for loading a target.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub dtype: DType,
    pub device: Device,
    /// Weights as stored: GGUF matrices keep their stored type instead of requantizing types
    /// without a fast multi-row CPU kernel (see [`crate::nn::quant::requant_target`]), and a
    /// float draft stays float on the CPU (no Q8_0, [`crate::draft::DraftModel::requantize_q8`]).
    pub keep_quant: bool,
    /// Tensor-parallel ranks (1: the whole model in one copy; see [`parallel::Sharded`]).
    pub tensor_parallel: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            device: Device::Cpu,
            keep_quant: false,
            tensor_parallel: 1,
        }
    }
}

/// A family: its `model_type` names, its loader, its sizing and what it can do.
pub struct Family {
    pub name: &'static str,
    pub model_types: &'static [&'static str],
    pub load: fn(&TargetConfig, &Weights) -> Result<Box<dyn TargetModel>>,
    /// Caches and parameter counts from the config alone (the memory plan, `doctor` and
    /// `dflash models` use it; the loader builds its caches from the same plan).
    pub plan: fn(&TargetConfig) -> Result<stack::Plan>,
    pub caps: Capabilities,
}

/// What a family's targets can do and what state they keep (docs/architecture.md's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Capabilities {
    /// Hidden-state taps (output of any decoder layer).
    pub taps: bool,
    /// Attention KV cache, cropped in O(1) after a partial acceptance.
    pub kv_truncate: bool,
    /// Recurrent / conv state that must be rolled back to the last accepted token.
    pub recurrent_rollback: bool,
    /// Sliding-window attention layers.
    pub sliding_window: bool,
    /// Layers that reuse another layer's K/V.
    pub shared_kv: bool,
    /// Mixture-of-experts feed-forward.
    pub moe: bool,
    /// Loads from GGUF as well as safetensors.
    pub gguf: bool,
}

const fn caps(sliding_window: bool, shared_kv: bool, moe: bool, gguf: bool) -> Capabilities {
    Capabilities {
        taps: true,
        kv_truncate: true,
        recurrent_rollback: false,
        sliding_window,
        shared_kv,
        moe,
        gguf,
    }
}

/// The family registry: exact `model_type` matches only.
pub const FAMILIES: &[Family] = &[
    Family {
        name: "qwen3",
        model_types: &["qwen3"],
        load: qwen3::load,
        plan: qwen3::plan,
        caps: caps(true, false, false, true),
    },
    Family {
        name: "qwen3_moe",
        model_types: &["qwen3_moe"],
        load: qwen3_moe::load,
        plan: qwen3_moe::plan,
        caps: caps(false, false, true, false),
    },
    Family {
        name: "llama",
        model_types: &["llama"],
        load: llama::load,
        plan: llama::plan,
        caps: caps(true, false, false, true),
    },
    Family {
        name: "qwen2",
        model_types: &["qwen2"],
        load: qwen2::load,
        plan: qwen2::plan,
        caps: caps(true, false, false, true),
    },
    Family {
        name: "gemma3",
        model_types: &["gemma3_text", "gemma3"],
        load: gemma3::load,
        plan: gemma3::plan,
        caps: caps(true, false, false, true),
    },
    Family {
        name: "gemma4",
        model_types: &["gemma4_text", "gemma4"],
        load: gemma4::load,
        plan: gemma4::plan,
        caps: caps(true, true, true, false),
    },
    Family {
        name: "qwen3_5",
        model_types: &["qwen3_5", "qwen3_5_text"],
        load: qwen3_5::load,
        plan: qwen3_5::plan,
        caps: hybrid::caps(false),
    },
    Family {
        name: "qwen3_5_moe",
        model_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
        load: qwen3_5_moe::load,
        plan: qwen3_5_moe::plan,
        caps: hybrid::caps(true),
    },
    Family {
        name: "qwen3_next",
        model_types: &["qwen3_next"],
        load: qwen3_next::load,
        plan: qwen3_next::plan,
        caps: hybrid::caps(true),
    },
    Family {
        name: "gpt_oss",
        model_types: &["gpt_oss"],
        load: gpt_oss::load,
        plan: gpt_oss::plan,
        caps: caps(true, false, true, false),
    },
    Family {
        name: "deepseek_v3",
        model_types: &["deepseek_v3", "kimi_k2", "kimi_k25"],
        load: deepseek_v3::load,
        plan: deepseek_v3::plan,
        caps: caps(false, false, true, false),
    },
];

pub fn supported_model_types() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.model_types.iter().copied())
        .collect()
}

pub fn family_for(cfg: &TargetConfig) -> Result<&'static Family> {
    let fam = FAMILIES
        .iter()
        .find(|f| f.model_types.contains(&cfg.model_type.as_str()))
        .ok_or_else(|| Error::UnsupportedArch {
            model_type: cfg.model_type.clone(),
            file: cfg.file.clone(),
            supported: supported_model_types().join(", "),
        })?;
    // Recurrent (linear_attention) layers only in families that implement them.
    if !fam.caps.recurrent_rollback {
        if let Some(i) = cfg
            .layer_types
            .iter()
            .position(|&t| t == crate::config::LayerType::Linear)
        {
            return Err(Error::config(
                &cfg.file,
                "layer_types",
                format!(
                    "layer {i} is linear_attention, but family {} has no recurrent layers",
                    fam.name
                ),
            ));
        }
    }
    Ok(fam)
}

/// Load a target model from a resolved source (a safetensors directory or a GGUF file).
pub fn load_target(
    src: &ModelSource,
    opts: &LoadOptions,
) -> Result<(TargetConfig, Box<dyn TargetModel>)> {
    let cfg = src.target_config()?;
    let fam = family_for(&cfg)?;
    if opts.tensor_parallel > 1 {
        let model = parallel::Sharded::load(opts.tensor_parallel, |shard| {
            let w = src
                .weights(opts.dtype, &opts.device, opts.keep_quant)?
                .with_shard(Some(shard));
            (fam.load)(&cfg, &w)
        })?;
        return Ok((cfg, Box::new(model)));
    }
    let w = src.weights(opts.dtype, &opts.device, opts.keep_quant)?;
    let model = (fam.load)(&cfg, &w)?;
    Ok((cfg, model))
}
