//! CUDA graphs for a [`Stack`]'s decode and verify forwards (on by default on CUDA;
//! `DFLASH_CUDA_GRAPHS=0` runs them eagerly).
//!
//! A MoE decode step launches ~15 kernels a layer, and through candle each launch costs the
//! host ~10 us: at hidden 2048 the host, not the GPU, sets the step's time (docs/perf.md,
//! session 22: 1.1-1.9 ms to enqueue 12 layers whose kernels take 1.3 ms). A graph replays
//! the whole forward with one launch.
//!
//! A forward of `n <= 16` rows whose every layer is [`Layer::graph_safe`] runs "on the
//! device": its token ids and first position are written into device buffers owned by the
//! graph entry, the attention kernels read the position from there and the rope rows from a
//! table by position (`Frame::on_device`, `nn::fused::DeviceStep`), so the same launches are
//! right at every position. Entries are keyed by the cache (its buffers' addresses are in the
//! launches), the row count, the logits and taps asked for, and the key bound (the attention
//! splits, in steps of [`BOUND_STEP`] positions). The first forward of a key runs eagerly in
//! that form (it fills the parameter caches the capture needs), the second is captured and
//! launched, later ones only write the inputs and launch. What a replay returns is copied
//! out of the graph's buffers (the next replay reuses them).
//!
//! Gated DeltaNet layers replay too: their state lives in the cache's device ring
//! (`nn::recurrent_cache`), a forward reads one slot and writes the other, so the key also
//! holds the slot each recurrent layer reads, and a replay commits the rollback record the
//! capture left (the graph's own buffers, rewritten by every replay).
//!
//! Exactness: the on-device forward gives the bits of the ordinary one
//! (`tests/fused_cuda.rs`: graphs vs eager, greedy DFlash == plain with graphs). If a capture
//! fails (some kernel on the path needs the host), graphs are switched off for the model, the
//! reason is kept ([`Graphs::report`], `dflash bench`) and the forward runs eagerly.

use super::stack::{Layer, Stack};
use super::{ForwardOutput, Logits, TargetCache};
use crate::Result;

/// The key bound's step: a graph covers the positions up to the next multiple of this (its
/// attention launches cover that many keys; chunks past a row's keys are empty).
pub const BOUND_STEP: usize = 256;

/// Most rows a graphed forward has (decode, verify and draft-sized blocks).
pub const MAX_ROWS: usize = 16;

/// What the graphs of a model did, for reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraphReport {
    /// Forwards run on the device form eagerly (the first of each key).
    pub warmups: u64,
    pub captures: u64,
    pub replays: u64,
    /// Why graphs are off for this model (the first capture that failed), if they are.
    pub off: Option<String>,
}

/// A model's graphs (empty and never used without `--features cuda`).
#[derive(Default)]
pub struct Graphs {
    #[cfg(feature = "cuda")]
    state: std::sync::Mutex<imp::State>,
}

impl Graphs {
    pub fn report(&self) -> GraphReport {
        #[cfg(feature = "cuda")]
        {
            keyed::report_of(&self.state, imp::State::report)
        }
        #[cfg(not(feature = "cuda"))]
        {
            GraphReport::default()
        }
    }

    /// Run the forward through a graph when one applies; None when the caller runs it eagerly
    /// (graphs off, a shape or layer they do not cover, or a capture that just failed).
    pub fn forward<L: Layer>(
        &self,
        m: &Stack<L>,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<Option<ForwardOutput>> {
        #[cfg(feature = "cuda")]
        {
            if !imp::eligible(m, tokens.len(), cache) {
                return Ok(None);
            }
            keyed::lock(&self.state, "graph")?.forward(m, tokens, start, cache, taps, logits)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (m, tokens, start, cache, taps, logits);
            Ok(None)
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::keyed::{Keyed, Names, Ran};
    use super::*;
    use crate::archs::{check_forward, LayerCache};
    use crate::nn::cuda::graph;
    use crate::nn::fused::DeviceStep;
    use candle_core::DType;

    #[derive(Clone, PartialEq, Eq)]
    struct Key {
        /// The cache's first KV buffer: its addresses are in the captured launches.
        cache: candle_core::TensorId,
        n: usize,
        logits: Logits,
        taps: Vec<usize>,
        bound: usize,
        /// Each recurrent layer's ring slot read (the captured launches read and write fixed
        /// slots; a forward flips them).
        parity: Vec<usize>,
    }

    struct Captured {
        graph: graph::Graph,
        /// What the captured forward returned: the graph's own buffers.
        out: ForwardOutput,
        /// Cache slots the forward appends `n` rows to.
        advanced: Vec<usize>,
        /// Recurrent slots: the ring slot read and the rollback record every replay leaves
        /// (the graph's own buffers).
        recurrent: Vec<(usize, usize, crate::nn::recurrent_cache::ReplayChunk)>,
    }

    pub(super) struct State {
        g: Keyed<Key, Captured>,
    }

    impl Default for State {
        fn default() -> Self {
            Self {
                g: Keyed::new(Names {
                    owner: "this model",
                    pass: "forward",
                }),
            }
        }
    }

    /// Whether a forward of `n` rows of `m` over `cache` can be graphed at all.
    pub(super) fn eligible<L: Layer>(m: &Stack<L>, n: usize, cache: &TargetCache) -> bool {
        crate::switches::cuda_graphs()
            && (1..=MAX_ROWS).contains(&n)
            && m.info.dtype == DType::BF16
            && graph::supported(&m.info.device)
            && crate::nn::fused::allowed_part(crate::switches::Part::Attention)
            && !crate::stats::SectionTimer::enabled()
            && m.layers.iter().all(|l| l.graph_safe())
            && first_kv(cache).is_some()
    }

    fn first_kv(cache: &TargetCache) -> Option<candle_core::TensorId> {
        cache.layers.iter().find_map(|l| match l {
            LayerCache::Kv(kv) => kv.joint().map(|j| j.id()),
            _ => None,
        })
    }

    fn slot_lens(cache: &TargetCache) -> Vec<usize> {
        cache
            .layers
            .iter()
            .map(|l| match l {
                LayerCache::Kv(kv) => kv.len(),
                LayerCache::Latent(c) => c.len(),
                LayerCache::Recurrent(r) => r.len(),
            })
            .collect()
    }

    /// What a failed forward must give back: every slot's length, and the recurrent slots'
    /// state records (cheap: their tensors are shared; a ring forward wrote only the slot
    /// the record does not hold).
    struct Before {
        lens: Vec<usize>,
        recurrent: Vec<Option<crate::nn::RecurrentCache>>,
    }

    fn before(cache: &TargetCache) -> Before {
        Before {
            lens: slot_lens(cache),
            recurrent: cache
                .layers
                .iter()
                .map(|l| match l {
                    LayerCache::Recurrent(r) => Some(r.clone()),
                    _ => None,
                })
                .collect(),
        }
    }

    fn restore(cache: &mut TargetCache, b: &Before) {
        for ((l, &len), rec) in cache.layers.iter_mut().zip(&b.lens).zip(&b.recurrent) {
            match (l, rec) {
                (LayerCache::Kv(kv), _) => kv.truncate(len),
                (LayerCache::Latent(c), _) => c.truncate(len),
                (LayerCache::Recurrent(r), Some(rec)) => *r = rec.clone(),
                (LayerCache::Recurrent(_), None) => {}
            }
        }
    }

    /// Every recurrent slot on its device ring (copied there after a forward of the portable
    /// path), and the ring slot each reads next.
    fn settle(cache: &mut TargetCache) -> Result<Option<Vec<usize>>> {
        let mut parity = vec![];
        for l in cache.layers.iter_mut() {
            if let LayerCache::Recurrent(r) = l {
                match r.settle()? {
                    Some(p) => parity.push(p),
                    None => return Ok(None),
                }
            }
        }
        Ok(Some(parity))
    }

    fn copied(out: &ForwardOutput) -> Result<ForwardOutput> {
        Ok(ForwardOutput {
            logits: out.logits.as_ref().map(|t| t.copy()).transpose()?,
            taps: out.taps.as_ref().map(|t| t.copy()).transpose()?,
            logits_in_batch: None,
        })
    }

    impl State {
        pub(super) fn report(&self) -> GraphReport {
            self.g.report.clone()
        }

        pub(super) fn forward<L: Layer>(
            &mut self,
            m: &Stack<L>,
            tokens: &[u32],
            start: usize,
            cache: &mut TargetCache,
            taps: &[usize],
            logits: Logits,
        ) -> Result<Option<ForwardOutput>> {
            if self.g.report.off.is_some() {
                return Ok(None);
            }
            check_forward(tokens, start, cache, taps, m.layers.len(), m.vocab_limit)?;
            let n = tokens.len();
            let dev = m.info.device.clone();
            let Some(cache_id) = first_kv(cache) else {
                return Ok(None);
            };
            let Some(parity) = settle(cache)? else {
                return Ok(None);
            };
            let key = Key {
                cache: cache_id,
                n,
                logits,
                taps: taps.to_vec(),
                bound: (start + n).div_ceil(BOUND_STEP) * BOUND_STEP,
                parity,
            };
            let bound = key.bound;
            let ropes: Vec<&crate::nn::Rope> = m.ropes.iter().collect();
            let Some(tables) =
                self.g
                    .position_tables(&ropes, cache.capacity(), &dev, m.info.dtype)?
            else {
                return Ok(None);
            };
            let at = self.g.entry(key, tokens, start, &dev)?;
            let e = self.g.get(at);
            if let Some(c) = &e.captured {
                c.graph.launch()?;
                for &slot in &c.advanced {
                    if let LayerCache::Kv(kv) = &mut cache.layers[slot] {
                        kv.append_in_place(n, |_, _| Ok(true))?;
                    }
                }
                for (slot, parity, chunk) in &c.recurrent {
                    if let LayerCache::Recurrent(r) = &mut cache.layers[*slot] {
                        r.commit_ring(n, *parity, chunk.clone())?;
                    }
                }
                cache.advance(n);
                let out = copied(&c.out)?;
                self.g.report.replays += 1;
                return Ok(Some(out));
            }
            let step = DeviceStep {
                pos0: e.pos0.clone(),
                kv_bound: bound,
            };
            let ids = e.ids.clone();
            let before = before(cache);
            // The first forward of this key runs eagerly in the on-device form: it makes every
            // upload the capture will ask for (candle's shape parameters, the attention
            // metadata tables); the second is captured. If either fails (a kernel declined the
            // form, a capture needed the host), graphs go off for the model and the caller
            // runs the ordinary forward.
            let ran = self.g.first_uses(at, &dev, || {
                let f = super::super::stack::Frame::on_device(
                    ids,
                    start,
                    &m.ropes,
                    tables,
                    step,
                    m.info.dtype,
                    &dev,
                    "target",
                )?;
                m.run_frame(f, cache, taps, logits)
            })?;
            match ran {
                Ran::Warm(out) => {
                    cache.advance(n);
                    Ok(Some(out))
                }
                Ran::Off => {
                    // (A failed capture ran nothing: the cache holds what it held before.)
                    restore(cache, &before);
                    Ok(None)
                }
                Ran::Captured(out, g) => {
                    let after = slot_lens(cache);
                    let (mut advanced, mut recurrent) = (vec![], vec![]);
                    for (slot, (&b, &a)) in before.lens.iter().zip(&after).enumerate() {
                        let kept = match &cache.layers[slot] {
                            LayerCache::Recurrent(r) => match r.ring_chunk() {
                                Some((p, c)) if a == b + n => {
                                    recurrent.push((slot, p, c));
                                    true
                                }
                                _ => false,
                            },
                            _ if a == b + n => {
                                advanced.push(slot);
                                true
                            }
                            _ => a == b,
                        };
                        if !kept {
                            restore(cache, &before);
                            return Err(crate::Error::input(format!(
                                "CUDA graph capture: cache slot {slot} went from {b} to {a} rows in a forward of {n}"
                            )));
                        }
                    }
                    g.launch()?;
                    cache.advance(n);
                    let ret = copied(&out)?;
                    self.g.get(at).captured = Some(Captured {
                        graph: g,
                        out,
                        advanced,
                        recurrent,
                    });
                    self.g.report.captures += 1;
                    Ok(Some(ret))
                }
            }
        }
    }
}

/// What the target's graphs and the draft's share: graphs by key, each entry's input buffers
/// (token ids, first position), its warm-up and capture, least recently used dropped first;
/// the rope tables by position; the report.
#[cfg(feature = "cuda")]
pub(crate) mod keyed {
    use super::{GraphReport, BOUND_STEP};
    use crate::nn::cuda::graph;
    use crate::nn::Rope;
    use crate::Result;
    use candle_core::{DType, Device, Tensor};

    /// Graphs kept per model (least recently used dropped first).
    const MAX_ENTRIES: usize = 16;

    /// The report of a model's or a draft's graph state (`report` reads it from the state).
    pub(crate) fn report_of<S>(
        state: &std::sync::Mutex<S>,
        report: impl FnOnce(&S) -> GraphReport,
    ) -> GraphReport {
        match state.lock() {
            Ok(s) => report(&s),
            Err(_) => GraphReport {
                off: Some("graph state poisoned by a panic".into()),
                ..Default::default()
            },
        }
    }

    /// The graph state locked for a run; `what` names it in the error after a panic.
    pub(crate) fn lock<'a, S>(
        state: &'a std::sync::Mutex<S>,
        what: &str,
    ) -> Result<std::sync::MutexGuard<'a, S>> {
        state.lock().map_err(|_| {
            crate::Error::input(format!(
                "{what} state poisoned by an earlier panic; run with DFLASH_CUDA_GRAPHS=0"
            ))
        })
    }

    /// Who the graphs belong to and what one run is called (for the reasons reported).
    pub(crate) struct Names {
        pub owner: &'static str,
        pub pass: &'static str,
    }

    pub(crate) struct Entry<K, C> {
        key: K,
        used: u64,
        /// The token ids `[n]` (u32) and the first position `[1]` (i64) the graph reads.
        pub ids: Tensor,
        pub pos0: Tensor,
        warm: bool,
        pub captured: Option<C>,
    }

    /// How an entry's run went ([`Keyed::first_uses`]).
    pub(crate) enum Ran<T> {
        /// Its first use, run eagerly in the on-device form.
        Warm(T),
        /// Its second: captured (nothing ran yet: the caller launches the graph).
        Captured(T, graph::Graph),
        /// It failed and graphs are off now; the caller puts its cache back and runs eagerly.
        Off,
    }

    pub(crate) struct Keyed<K, C> {
        pub report: GraphReport,
        names: Names,
        entries: Vec<Entry<K, C>>,
        clock: u64,
        /// The position tables (one per rope) and their rows.
        tables: Option<(usize, Vec<Tensor>)>,
    }

    impl<K: PartialEq, C> Keyed<K, C> {
        pub fn new(names: Names) -> Self {
            Self {
                report: GraphReport::default(),
                names,
                entries: vec![],
                clock: 0,
                tables: None,
            }
        }

        /// The ropes' tables by position covering every key bound a cache of `capacity`
        /// positions reaches (made once per size); None when a rope has no packed table.
        pub fn position_tables(
            &mut self,
            ropes: &[&Rope],
            capacity: usize,
            dev: &Device,
            dtype: DType,
        ) -> Result<Option<Vec<Tensor>>> {
            let rows = capacity.div_ceil(BOUND_STEP).max(1) * BOUND_STEP;
            if self.tables.as_ref().map(|t| t.0) != Some(rows) {
                let mut ts = Vec::with_capacity(ropes.len());
                for r in ropes {
                    match r.position_table(rows, dev, dtype)? {
                        Some(t) => ts.push(t),
                        None => return Ok(None),
                    }
                }
                self.tables = Some((rows, ts));
            }
            Ok(self.tables.as_ref().map(|t| t.1.clone()))
        }

        /// The index of `key`'s entry (made, with buffers for `ids.len()` rows, when new), its
        /// buffers holding `ids` and `start`.
        pub fn entry(&mut self, key: K, ids: &[u32], start: usize, dev: &Device) -> Result<usize> {
            self.clock += 1;
            let at = match self.entries.iter().position(|e| e.key == key) {
                Some(i) => i,
                None => {
                    if self.entries.len() >= MAX_ENTRIES {
                        let lru = (0..self.entries.len())
                            .min_by_key(|&i| self.entries[i].used)
                            .unwrap_or(0);
                        self.entries.swap_remove(lru);
                    }
                    self.entries.push(Entry {
                        key,
                        used: 0,
                        ids: Tensor::zeros(ids.len(), DType::U32, dev)?,
                        pos0: Tensor::zeros(1, DType::I64, dev)?,
                        warm: false,
                        captured: None,
                    });
                    self.entries.len() - 1
                }
            };
            let e = &mut self.entries[at];
            e.used = self.clock;
            graph::write_u32(&e.ids, ids)?;
            graph::write_i64(&e.pos0, &[start as i64])?;
            Ok(at)
        }

        pub fn get(&mut self, at: usize) -> &mut Entry<K, C> {
            &mut self.entries[at]
        }

        /// An entry's first uses: the first runs `f` eagerly in the on-device form (filling
        /// the parameter caches the capture needs), the second captures it. A failure of
        /// either switches graphs off with the reason.
        pub fn first_uses<T>(
            &mut self,
            at: usize,
            dev: &Device,
            f: impl FnOnce() -> Result<T>,
        ) -> Result<Ran<T>> {
            if !self.entries[at].warm {
                let warmed = {
                    let _cache = graph::param_cache(dev)?;
                    f()
                };
                return Ok(match warmed {
                    Ok(out) => {
                        self.entries[at].warm = true;
                        self.report.warmups += 1;
                        Ran::Warm(out)
                    }
                    Err(err) => {
                        let why = format!("the on-device {} failed: {err}", self.names.pass);
                        self.switch_off(why);
                        Ran::Off
                    }
                });
            }
            Ok(match graph::capture(dev, f) {
                Ok((out, g)) => Ran::Captured(out, g),
                Err(err) => {
                    self.switch_off(format!("capture failed: {err}"));
                    Ran::Off
                }
            })
        }

        /// Graphs off from now on, and why (reported).
        fn switch_off(&mut self, why: String) {
            tracing::warn!("CUDA graphs off for {}: {why}", self.names.owner);
            self.report.off = Some(why);
            self.entries.clear();
        }
    }
}
