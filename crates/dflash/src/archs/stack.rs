//! The forward toolkit every target family is written with, and the one generic
//! [`TargetModel`] over it.
//!
//! A family supplies layers (types implementing [`Layer`]: what one decoder layer computes,
//! written with the shared `nn` layers) and the pieces around them; [`Stack`] does the rest of
//! a forward, the same way for every family:
//!
//! ```text
//! ids -> embedding (x family scale) -> [prologue: per-forward inputs, e.g. gemma4's per-layer
//!     inputs] -> layer 0 .. N-1 on a Residual stream (taps recorded as layers end)
//!     -> final norm -> LM head -> softcap      (only the rows `Logits` asks for)
//! ```
//!
//! - [`Frame`]: what one forward shares across layers: positions, the RoPE tables of each of
//!   the model's ropes (built on first use), the masks per visibility (built on first use, only
//!   when a portable attention asks), the prologue's output, the section timer. It is the place
//!   a batch of sequences with their own positions will be described (today one sequence:
//!   `start`, `n`).
//! - [`Residual`]: the residual stream. `add` defers a layer's output and the next `norm` folds
//!   it in with the fused add + RMSNorm kernel where it runs; tapped layers are recorded when
//!   their output is folded, so taps cost no extra pass.
//! - [`Head`]: final norm, LM head, softcapping.
//! - [`CacheKind`] / [`Plan`]: the state a family keeps per cache slot, sized from the config
//!   alone: the memory plan, `doctor` and `dflash models` use the same plan the loader builds
//!   the caches from.

use super::{
    check_forward, checked_forward, BatchItem, ForwardOutput, LayerCache, Logits, TapRecorder,
    TargetCache, TargetInfo, TargetModel,
};
pub use crate::nn::Params;
use crate::nn::{
    ChunkMasks, Embedding, GatedDeltaSpec, KvCache, LatentCache, Linear, Masks, RecurrentCache,
    RmsNorm, Rope, RopeTables, Site, Visibility,
};
use crate::stats::SectionTimer;
use crate::Result;
use candle_core::{DType, Device, Tensor};
use std::cell::{OnceCell, RefCell};

/// What one forward shares across its layers.
pub struct Frame<'m> {
    /// Position of the first row.
    pub start: usize,
    /// Rows in this forward.
    pub n: usize,
    /// The token ids `[n]` (u32) on the model's device.
    pub ids: Tensor,
    pub device: Device,
    pub dtype: DType,
    ropes: &'m [Rope],
    tables: Vec<OnceCell<RopeTables>>,
    pub masks: Masks,
    chunk_masks: OnceCell<ChunkMasks>,
    /// The prologue's output (gemma4: per-layer inputs `[n, layers, dim]`).
    pub extra: Option<Tensor>,
    prof: RefCell<SectionTimer>,
    /// The positions live on the device (a CUDA graph step, `archs::graphs`): attention reads
    /// them from here and the rope rows by position from `position_tables` (one per rope).
    pub step: Option<crate::nn::fused::DeviceStep>,
    position_tables: Vec<Tensor>,
}

impl<'m> Frame<'m> {
    pub fn new(
        tokens: &[u32],
        start: usize,
        ropes: &'m [Rope],
        dtype: DType,
        device: &Device,
        what: &'static str,
    ) -> Result<Self> {
        let n = tokens.len();
        let ids = Tensor::from_slice(tokens, n, device)?;
        Ok(Self::build(
            ids,
            n,
            start,
            ropes,
            vec![],
            None,
            dtype,
            device,
            what,
        ))
    }

    /// The frames of a batch of forwards (one per `(tokens, start)`), their inputs made at
    /// once: one upload of every id (returned whole, each frame's ids a view of it) and per
    /// rope one table of every position ([`Rope::tables_runs`]), which the batched kernels
    /// read whole. Each frame is what [`Self::new`] makes for its sequence.
    pub fn batch(
        items: &[(&[u32], usize)],
        ropes: &'m [Rope],
        dtype: DType,
        device: &Device,
        what: &'static str,
    ) -> Result<(Vec<Self>, Tensor)> {
        let all: Vec<u32> = items.iter().flat_map(|(t, _)| t.iter().copied()).collect();
        let ids = Tensor::from_vec(
            all,
            items.iter().map(|(t, _)| t.len()).sum::<usize>(),
            device,
        )?;
        let runs: Vec<(usize, usize)> = items.iter().map(|&(t, s)| (s, t.len())).collect();
        let mut tables = ropes
            .iter()
            .map(|r| Ok(r.tables_runs(&runs, device, dtype)?.into_iter()))
            .collect::<Result<Vec<_>>>()?;
        let mut frames = Vec::with_capacity(items.len());
        let mut off = 0;
        for &(t, start) in items {
            let n = t.len();
            let f = Self::build(
                ids.narrow(0, off, n)?,
                n,
                start,
                ropes,
                vec![],
                None,
                dtype,
                device,
                what,
            );
            for (cell, per_rope) in f.tables.iter().zip(tables.iter_mut()) {
                if let Some(t) = per_rope.next() {
                    let _ = cell.set(t);
                }
            }
            frames.push(f);
            off += n;
        }
        Ok((frames, ids))
    }

    /// A forward whose inputs live on the device, so that a CUDA graph of it can be replayed
    /// at other positions: the ids `[n]` (u32), `step` (the first position, the key bound)
    /// and, per rope of the model, its table by position (`Rope::position_table`). `start` is
    /// this run's position (the host's bookkeeping).
    #[allow(clippy::too_many_arguments)]
    pub fn on_device(
        ids: Tensor,
        start: usize,
        ropes: &'m [Rope],
        position_tables: Vec<Tensor>,
        step: crate::nn::fused::DeviceStep,
        dtype: DType,
        device: &Device,
        what: &'static str,
    ) -> Result<Self> {
        let n = ids.dim(0)?;
        if position_tables.len() != ropes.len() {
            return Err(crate::Error::input(format!(
                "graph step: {} position tables for {} ropes",
                position_tables.len(),
                ropes.len()
            )));
        }
        Ok(Self::build(
            ids,
            n,
            start,
            ropes,
            position_tables,
            Some(step),
            dtype,
            device,
            what,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        ids: Tensor,
        n: usize,
        start: usize,
        ropes: &'m [Rope],
        position_tables: Vec<Tensor>,
        step: Option<crate::nn::fused::DeviceStep>,
        dtype: DType,
        device: &Device,
        what: &'static str,
    ) -> Self {
        Self {
            start,
            n,
            ids,
            device: device.clone(),
            dtype,
            ropes,
            tables: ropes.iter().map(|_| OnceCell::new()).collect(),
            masks: Masks::new(n, start, dtype, device),
            chunk_masks: OnceCell::new(),
            extra: None,
            prof: RefCell::new(SectionTimer::start(what, device)),
            step,
            position_tables,
        }
    }

    /// The tables of the model's rope `r` for this forward's positions.
    pub fn tables(&self, r: usize) -> Result<&RopeTables> {
        if let Some(t) = self.tables[r].get() {
            return Ok(t);
        }
        let t = match self.step {
            Some(_) => RopeTables::by_position(self.position_tables[r].clone(), self.n),
            None => self.ropes[r].tables(self.start, self.n, &self.device, self.dtype)?,
        };
        Ok(self.tables[r].get_or_init(|| t))
    }

    /// The model's rope `r`.
    pub fn rope(&self, r: usize) -> &Rope {
        &self.ropes[r]
    }

    /// The Gated DeltaNet chunk masks of this forward (built once, shared by its layers).
    pub fn chunk_masks(&self) -> Result<&ChunkMasks> {
        if let Some(m) = self.chunk_masks.get() {
            return Ok(m);
        }
        if self.step.is_some() {
            return Err(crate::Error::input(
                "a Gated DeltaNet layer ran in a CUDA graph step (its state is not replayable); run with DFLASH_CUDA_GRAPHS=0 and report this",
            ));
        }
        let m = ChunkMasks::new(self.n, &self.device)?;
        Ok(self.chunk_masks.get_or_init(|| m))
    }

    /// Where attention with rope `r` and visibility `vis` runs in this forward.
    pub fn site(&self, r: usize, vis: Visibility) -> Result<Site<'_>> {
        Ok(Site {
            rope: &self.ropes[r],
            tables: self.tables(r)?,
            vis,
            masks: &self.masks,
            step: self.step.as_ref(),
            out_conv: None,
        })
    }

    /// Close a profiling section (`DFLASH_PROFILE`; nothing otherwise).
    pub fn mark(&self, label: &'static str) {
        self.prof.borrow_mut().mark(label);
    }

    fn finish(self) {
        self.prof.into_inner().finish();
    }
}

/// The residual stream of one forward, with the taps it yields.
pub struct Residual<'t> {
    h: Tensor,
    /// A layer output not yet added (the next norm adds it in the same kernel).
    pending: Option<Tensor>,
    /// The layer whose output is `h + pending`, when it is tapped.
    tap_at: Option<usize>,
    taps: TapRecorder<'t>,
}

impl<'t> Residual<'t> {
    pub fn new(h: Tensor, taps: &'t [usize]) -> Self {
        Self {
            h,
            pending: None,
            tap_at: None,
            taps: TapRecorder::new(taps),
        }
    }

    fn folded(&mut self, h: Tensor) {
        self.h = h;
        if let Some(layer) = self.tap_at.take() {
            self.taps.record(layer, &self.h);
        }
    }

    /// `norm(h + pending)`: the pending output is added and normed in one kernel where it
    /// can (`RmsNorm::add_forward`).
    pub fn norm(&mut self, n: &RmsNorm) -> Result<Tensor> {
        match self.pending.take() {
            Some(d) => {
                let (h, x) = n.add_forward(&self.h, &d)?;
                self.folded(h);
                Ok(x)
            }
            None => n.forward(&self.h),
        }
    }

    /// Add a layer's output to the stream (deferred to the next norm or settle).
    pub fn add(&mut self, delta: Tensor) -> Result<()> {
        if self.pending.is_some() {
            self.settle()?;
        }
        self.pending = Some(delta);
        Ok(())
    }

    /// The stream with everything added.
    pub fn settle(&mut self) -> Result<&Tensor> {
        if let Some(d) = self.pending.take() {
            let h = (&self.h + d)?;
            self.folded(h);
        }
        Ok(&self.h)
    }

    /// Replace the (settled) stream.
    pub fn replace(&mut self, h: Tensor) {
        debug_assert!(self.pending.is_none());
        self.h = h;
    }

    /// Multiply the stream by `s` (broadcast; gemma4's `layer_scalar`).
    pub fn scale(&mut self, s: &Tensor) -> Result<()> {
        let h = self.settle()?.broadcast_mul(s)?;
        self.h = h;
        Ok(())
    }

    /// Layer `layer` ended: its output is the stream once its pending part is added.
    pub fn end_layer(&mut self, layer: usize) {
        if !self.taps.wants(layer) {
            return;
        }
        if self.pending.is_some() {
            self.tap_at = Some(layer);
        } else {
            self.taps.record(layer, &self.h);
        }
    }

    /// The final stream and the taps `[n, taps * hidden]`.
    pub fn finish(mut self) -> Result<(Tensor, Option<Tensor>)> {
        self.settle()?;
        let taps = self.taps.finish()?;
        Ok((self.h, taps))
    }
}

/// Final norm, LM head and logit softcapping.
pub struct Head {
    pub norm: RmsNorm,
    pub linear: Linear,
    pub softcap: Option<f64>,
    /// The head is the embedding table itself (its bytes are counted once).
    pub shares_table: bool,
}

impl Head {
    /// `linear` is the embedding table's own tensor when the model ties them.
    pub fn new(norm: RmsNorm, linear: Linear, softcap: Option<f64>, embed: &Embedding) -> Self {
        let shares_table = match (&linear, embed) {
            (Linear::Dense { weight, .. }, Embedding::Dense(t)) => weight.id() == t.id(),
            _ => false,
        };
        Self {
            norm,
            linear,
            softcap,
            shares_table,
        }
    }

    /// The projection alone on normed rows: `[n, vocab]` f32.
    pub fn project(&self, normed: &Tensor) -> Result<Tensor> {
        self.linear.forward_f32(normed)
    }

    /// Logits `[n, vocab]` f32 of final hidden rows.
    pub fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let l = self.project(&self.norm.forward(h)?)?;
        Ok(match self.softcap {
            Some(c) => ((l / c)?.tanh()? * c)?,
            None => l,
        })
    }

    pub fn weight_bytes(&self) -> usize {
        self.norm.weight_bytes()
            + if self.shares_table {
                0
            } else {
                self.linear.weight_bytes()
            }
    }
}

/// What one decoder layer computes. `forward` reads and extends the residual stream (its
/// cache slot, its rope and visibility are the layer's own business) and marks profiling
/// sections on the frame.
pub trait Layer: Send + Sync {
    fn forward(&self, r: &mut Residual, f: &Frame, cache: &mut TargetCache) -> Result<()>;
    /// Several sequences in one pass: `r` holds their rows back to back (frame k's rows after
    /// frame k-1's), `caches[k]` is frame k's cache. The default runs each sequence alone;
    /// a layer that batches runs its weights once over all rows.
    fn forward_batch(
        &self,
        r: &mut Residual,
        frames: &[Frame],
        caches: &mut [&mut TargetCache],
    ) -> Result<()> {
        let h = r.settle()?.clone();
        let mut parts = Vec::with_capacity(frames.len());
        let mut off = 0;
        for (f, c) in frames.iter().zip(caches.iter_mut()) {
            let mut sub = Residual::new(h.narrow(0, off, f.n)?, &[]);
            self.forward(&mut sub, f, c)?;
            parts.push(sub.settle()?.clone());
            off += f.n;
        }
        r.replace(Tensor::cat(&parts, 0)?);
        Ok(())
    }
    /// Whether a forward of this layer can be captured into a CUDA graph and replayed at
    /// other positions (`archs::graphs`): everything it reads that changes between steps
    /// comes from the frame's device step (attention through `nn::Attention`), and it keeps
    /// no state but KV rows written in place. Default: no.
    fn graph_safe(&self) -> bool {
        false
    }
    /// `(cache slot, what it holds)` for the layer as loaded (a tensor-parallel rank's share
    /// of the heads); None: the plan's slot as it is (or no slot of its own).
    fn cache_kind(&self) -> Option<(usize, CacheKind)> {
        None
    }
    /// Bytes of weights held (fused copies included).
    fn weight_bytes(&self) -> usize;
    /// Bytes of weights a forward of `rows` rows reads: all of them, but for a MoE block only
    /// the expected union of experts the rows route to.
    fn read_bytes(&self, rows: usize) -> f64 {
        let _ = rows;
        self.weight_bytes() as f64
    }
}

/// Per-forward inputs computed once from the ids and the scaled embeddings, for every layer
/// (gemma4's per-layer inputs); they land in [`Frame::extra`].
pub trait Prologue: Send + Sync {
    fn inputs(&self, f: &Frame, embedded: &Tensor) -> Result<Tensor>;
    fn weight_bytes(&self) -> usize;
}

/// The state a cache slot keeps.
#[derive(Debug, Clone)]
pub enum CacheKind {
    /// Attention keys and values: `kv_heads x head_dim` each per position.
    Kv { kv_heads: usize, head_dim: usize },
    /// MLA: one compressed row of `width` values per position.
    Latent { width: usize },
    /// A Gated DeltaNet layer: a conv window and a recurrent state, whatever the context.
    Recurrent(GatedDeltaSpec),
}

impl CacheKind {
    /// Bytes this slot grows by per position of context (`elem` bytes per value).
    pub fn bytes_per_token(&self, elem: u64) -> u64 {
        match self {
            CacheKind::Kv { kv_heads, head_dim } => 2 * (*kv_heads * *head_dim) as u64 * elem,
            CacheKind::Latent { width } => *width as u64 * elem,
            CacheKind::Recurrent(_) => 0,
        }
    }

    /// Bytes held whatever the context: the conv window (compute dtype) and the f32 state of
    /// a recurrent layer (a forward's rollback record adds about one more state while it is
    /// kept).
    pub fn fixed_bytes(&self, elem: u64) -> u64 {
        match self {
            CacheKind::Recurrent(s) => {
                let conv = (s.conv_kernel.saturating_sub(1) * s.conv_dim()) as u64 * elem;
                conv + (s.v_heads * s.k_dim * s.v_dim) as u64 * 4
            }
            _ => 0,
        }
    }

    pub fn new_cache(&self, capacity: usize, dtype: DType, device: &Device) -> Result<LayerCache> {
        Ok(match self {
            CacheKind::Kv { kv_heads, head_dim } => {
                LayerCache::Kv(KvCache::new(*kv_heads, *head_dim, capacity, dtype, device)?)
            }
            CacheKind::Latent { width } => {
                LayerCache::Latent(LatentCache::new(*width, capacity, dtype, device)?)
            }
            CacheKind::Recurrent(s) => LayerCache::Recurrent(s.new_cache(dtype, device)?),
        })
    }
}

/// A family's sizing of one config, from the config alone.
#[derive(Debug, Clone)]
pub struct Plan {
    /// One entry per cache slot, in the order of `TargetCache::layers`.
    pub caches: Vec<CacheKind>,
    pub params: Params,
}

impl Plan {
    /// Cache bytes per position of context with `dtype` compute.
    pub fn cache_bytes_per_token(&self, dtype: DType) -> u64 {
        let e = dtype.size_in_bytes() as u64;
        self.caches.iter().map(|c| c.bytes_per_token(e)).sum()
    }
    /// Cache bytes that do not grow with the context (recurrent state).
    pub fn cache_fixed_bytes(&self, dtype: DType) -> u64 {
        let e = dtype.size_in_bytes() as u64;
        self.caches.iter().map(|c| c.fixed_bytes(e)).sum()
    }
}

/// A target model: embedding, layers, head, over the toolkit above.
pub struct Stack<L> {
    pub info: TargetInfo,
    pub embed: Embedding,
    /// Multiplies the embedding rows (Gemma: sqrt(hidden)), already rounded to the compute
    /// dtype as transformers casts it.
    pub embed_scale: Option<f64>,
    /// The model's ropes (layers name theirs by index).
    pub ropes: Vec<Rope>,
    pub layers: Vec<L>,
    pub head: Head,
    /// The cache slots (`Plan::caches`).
    pub caches: Vec<CacheKind>,
    /// Token ids must be below this (the vocabulary, or a smaller per-layer-input table).
    pub vocab_limit: usize,
    /// Inputs longer than this run through the stack in pieces (the hybrids: attention masks
    /// and scores stay `piece x context`); None = one pass.
    pub piece: Option<usize>,
    pub prologue: Option<Box<dyn Prologue>>,
    /// Its CUDA graphs (`archs::graphs`).
    pub graphs: super::graphs::Graphs,
}

/// `x` rounded to `dtype` (how transformers multiplies by a python float cast to the weights'
/// dtype).
pub fn round_to(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        DType::F16 => half::f16::from_f64(x).to_f64(),
        _ => x as f32 as f64,
    }
}

impl<L: Layer> Stack<L> {
    /// A model of `layers` over `caches`, with no embedding scale, the whole vocabulary, one
    /// pass per forward and no prologue (set those fields after, then [`Self::finish_load`]).
    pub fn new(
        info: TargetInfo,
        embed: Embedding,
        ropes: Vec<Rope>,
        layers: Vec<L>,
        head: Head,
        caches: Vec<CacheKind>,
    ) -> Self {
        Self {
            vocab_limit: info.vocab_size,
            info,
            embed,
            embed_scale: None,
            ropes,
            layers,
            head,
            caches,
            piece: None,
            prologue: None,
            graphs: Default::default(),
        }
    }

    /// Fill `info.weight_bytes` from what the model holds.
    pub fn finish_load(mut self) -> Self {
        self.info.weight_bytes = self.weight_bytes();
        // cache slots sized by the layers as loaded (a tensor-parallel rank holds its share
        // of the heads; the config's plan counts them all)
        for l in &self.layers {
            if let Some((slot, kind)) = l.cache_kind() {
                if let Some(c) = self.caches.get_mut(slot) {
                    *c = kind;
                }
            }
        }
        self
    }

    pub fn weight_bytes(&self) -> usize {
        self.embed.bytes()
            + self.head.weight_bytes()
            + self.layers.iter().map(Layer::weight_bytes).sum::<usize>()
            + self.prologue.as_ref().map_or(0, |p| p.weight_bytes())
    }

    fn forward_pass(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        let f = Frame::new(
            tokens,
            start,
            &self.ropes,
            self.info.dtype,
            &self.info.device,
            "target",
        )?;
        self.run_frame(f, cache, taps, logits)
    }

    /// One forward of the frame's rows: embedding, prologue, every layer, head. The KV slots
    /// advance; the cache's own length is the caller's (`checked_forward`).
    pub(crate) fn run_frame(
        &self,
        mut f: Frame,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        let mut h = self.embed.forward(&f.ids)?;
        if let Some(s) = self.embed_scale {
            h = (h * s)?;
        }
        if let Some(p) = &self.prologue {
            f.extra = Some(p.inputs(&f, &h)?);
        }
        let mut r = Residual::new(h, taps);
        for (i, layer) in self.layers.iter().enumerate() {
            layer.forward(&mut r, &f, cache)?;
            r.end_layer(i);
        }
        let (h, taps_out) = r.finish()?;
        let logits = logits.rows(&h)?.map(|x| self.head.logits(&x)).transpose()?;
        f.mark("head");
        f.finish();
        Ok(ForwardOutput {
            logits,
            taps: taps_out,
            logits_in_batch: None,
        })
    }

    /// Checked items in one pass: their rows back to back through every layer (each layer's
    /// weights read once), each sequence's attention over its own cache; the LM head once for
    /// the rows every item asks logits for. The caches are advanced by the caller.
    fn forward_together(
        &self,
        items: &mut [&mut BatchItem],
        taps: &[usize],
    ) -> Result<Vec<ForwardOutput>> {
        let runs: Vec<(&[u32], usize)> = items.iter().map(|it| (it.tokens, it.start)).collect();
        let (mut frames, ids) = Frame::batch(
            &runs,
            &self.ropes,
            self.info.dtype,
            &self.info.device,
            "target",
        )?;
        let mut h = self.embed.forward(&ids)?;
        if let Some(s) = self.embed_scale {
            h = (h * s)?;
        }
        let mut rows = Vec::with_capacity(frames.len());
        let mut off = 0;
        for f in &frames {
            rows.push((off, f.n));
            off += f.n;
        }
        if let Some(p) = &self.prologue {
            for (f, &(off, n)) in frames.iter_mut().zip(&rows) {
                f.extra = Some(p.inputs(f, &h.narrow(0, off, n)?)?);
            }
        }
        let mut caches: Vec<&mut TargetCache> = items.iter_mut().map(|it| &mut *it.cache).collect();
        let mut r = Residual::new(h, taps);
        for (i, layer) in self.layers.iter().enumerate() {
            layer.forward_batch(&mut r, &frames, &mut caches)?;
            r.end_layer(i);
        }
        let (h, taps_out) = r.finish()?;
        // The head once, over the rows asked for (gathered in one op).
        let mut picked = Vec::new();
        let mut counts = Vec::with_capacity(items.len());
        for (it, &(off, n)) in items.iter().zip(&rows) {
            let want = it.logits.row_range(n);
            counts.push(want.len());
            picked.extend(want.map(|r| off + r));
        }
        let logits = match picked.len() {
            0 => None,
            _ => Some(self.head.logits(&crate::nn::gather_rows(&h, &picked)?)?),
        };
        let mut at = 0;
        let mut outs = Vec::with_capacity(items.len());
        for (&(off, n), &c) in rows.iter().zip(&counts) {
            let (l, part) = match &logits {
                Some(l) if c > 0 => (
                    Some(l.narrow(0, at, c)?),
                    Some(crate::nn::PartOf {
                        whole: l.clone(),
                        first: at,
                    }),
                ),
                _ => (None, None),
            };
            at += c;
            let t = taps_out.as_ref().map(|t| t.narrow(0, off, n)).transpose()?;
            outs.push(ForwardOutput {
                logits: l,
                taps: t,
                logits_in_batch: part,
            });
        }
        if let Some(f) = frames.first() {
            f.mark("head");
        }
        for f in frames {
            f.finish();
        }
        Ok(outs)
    }

    /// A long input runs through the whole stack in pieces of `self.piece` rows. The forward
    /// stays one step for the cache: a failing piece restores the recurrent layers to the
    /// forward's start (KV layers are cropped by `checked_forward`), and after success the
    /// forward's start stays reachable by `truncate`, as for a one-piece forward.
    fn forward_pieces(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        let n = tokens.len();
        let piece = match self.piece {
            Some(p) if n > p => p,
            _ => return self.forward_pass(tokens, start, cache, taps, logits),
        };
        let before: Vec<Option<RecurrentCache>> = cache
            .layers
            .iter()
            .map(|l| match l {
                LayerCache::Recurrent(r) => Some(r.clone()),
                LayerCache::Kv(_) | LayerCache::Latent(_) => None,
            })
            .collect();
        let mut run = || -> Result<ForwardOutput> {
            let (mut rows, mut tapped) = (vec![], vec![]);
            let mut at = 0;
            while at < n {
                let m = piece.min(n - at);
                let want = match logits {
                    Logits::All => Logits::All,
                    Logits::Last if at + m == n => Logits::Last,
                    _ => Logits::None,
                };
                let out = self.forward_pass(&tokens[at..at + m], start + at, cache, taps, want)?;
                rows.extend(out.logits);
                tapped.extend(out.taps);
                at += m;
            }
            let cat = |v: Vec<Tensor>| -> Result<Option<Tensor>> {
                Ok(match v.len() {
                    0 => None,
                    _ => Some(Tensor::cat(&v, 0)?),
                })
            };
            Ok(ForwardOutput {
                logits: cat(rows)?,
                taps: cat(tapped)?,
                logits_in_batch: None,
            })
        };
        let out = run();
        for (l, b) in cache.layers.iter_mut().zip(before) {
            if let (LayerCache::Recurrent(r), Some(b)) = (l, b) {
                match &out {
                    Err(_) => *r = b,
                    Ok(_) => r.undo_from(&b),
                }
            }
        }
        out
    }
}

impl<L: Layer> TargetModel for Stack<L> {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn new_cache(&self, capacity: usize) -> Result<TargetCache> {
        let layers = self
            .caches
            .iter()
            .map(|c| c.new_cache(capacity, self.info.dtype, &self.info.device))
            .collect::<Result<Vec<_>>>()?;
        Ok(TargetCache::new(layers, capacity))
    }

    fn forward(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        if cache.layers.len() != self.caches.len() {
            return Err(crate::Error::input(format!(
                "{}: the cache has {} slots, this model needs {} (it was made by another model)",
                self.info.family,
                cache.layers.len(),
                self.caches.len()
            )));
        }
        if let Some(out) = self
            .graphs
            .forward(self, tokens, start, cache, taps, logits)?
        {
            return Ok(out);
        }
        checked_forward(
            tokens,
            start,
            cache,
            taps,
            self.layers.len(),
            self.vocab_limit,
            |c| self.forward_pieces(tokens, start, c, taps, logits),
        )
    }

    fn graph_report(&self) -> super::graphs::GraphReport {
        self.graphs.report()
    }

    fn forward_batch(
        &self,
        items: &mut [BatchItem],
        taps: &[usize],
    ) -> Result<Vec<Result<ForwardOutput>>> {
        let mut out: Vec<Option<Result<ForwardOutput>>> = (0..items.len()).map(|_| None).collect();
        let mut ok = Vec::new();
        for (k, it) in items.iter().enumerate() {
            let checked = if it.cache.layers.len() != self.caches.len() {
                Err(crate::Error::input(format!(
                    "{}: the cache has {} slots, this model needs {} (it was made by another model)",
                    self.info.family,
                    it.cache.layers.len(),
                    self.caches.len()
                )))
            } else {
                check_forward(
                    it.tokens,
                    it.start,
                    it.cache,
                    taps,
                    self.layers.len(),
                    self.vocab_limit,
                )
            };
            match checked {
                Ok(()) => ok.push(k),
                Err(e) => out[k] = Some(Err(e)),
            }
        }
        // One sequence, or inputs the stack runs in pieces (long prefills of the hybrids):
        // each alone.
        let alone = ok.len() <= 1
            || self
                .piece
                .is_some_and(|p| ok.iter().any(|&k| items[k].tokens.len() > p));
        if alone {
            for &k in &ok {
                let it = &mut items[k];
                out[k] = Some(self.forward(it.tokens, it.start, it.cache, taps, it.logits));
            }
        } else {
            let mut sel: Vec<&mut BatchItem> = items
                .iter_mut()
                .enumerate()
                .filter(|(k, _)| ok.contains(k))
                .map(|(_, it)| it)
                .collect();
            let starts: Vec<usize> = sel.iter().map(|it| it.start).collect();
            match self.forward_together(&mut sel, taps) {
                Ok(outs) => {
                    for ((it, &k), o) in sel.iter_mut().zip(&ok).zip(outs) {
                        it.cache.advance(it.tokens.len());
                        out[k] = Some(Ok(o));
                    }
                }
                Err(e) => {
                    for (it, s) in sel.iter_mut().zip(starts) {
                        it.cache.truncate(s).ok();
                    }
                    return Err(e);
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|o| o.expect("every item answered"))
            .collect())
    }

    fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        self.embed.forward(tokens)
    }

    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.head.project(hidden)
    }

    fn verify_bytes(&self, rows: usize) -> f64 {
        (self.head.weight_bytes() + self.prologue.as_ref().map_or(0, |p| p.weight_bytes())) as f64
            + self.layers.iter().map(|l| l.read_bytes(rows)).sum::<f64>()
    }
}

/// The KV cache of slot `slot`, or an error naming the family (a cache made by another model).
pub fn kv_slot<'c>(
    cache: &'c mut TargetCache,
    slot: usize,
    family: &str,
) -> Result<&'c mut KvCache> {
    match cache.layers.get_mut(slot) {
        Some(LayerCache::Kv(kv)) => Ok(kv),
        _ => Err(crate::Error::input(format!(
            "{family}: cache slot {slot} is not an attention KV cache (the cache was made by another model)"
        ))),
    }
}
