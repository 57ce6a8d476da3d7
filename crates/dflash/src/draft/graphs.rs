//! CUDA graphs for the draft's block pass (on with the target's, `DFLASH_CUDA_GRAPHS`).
//!
//! A draft proposal is two parts (`DraftModel::write_context`, `DraftModel::block_rows`): the
//! new context rows' keys and values (a row count that changes every step: run eagerly, a few
//! launches) and the block of Q rows through every layer and the LM head (the same shapes every
//! step: ~10 launches a layer). The second is captured once per (draft cache, Q, key bound)
//! and replayed as [`crate::archs::graphs`] does the target's forwards: the block's ids and
//! first position live in device buffers written before each launch, the attention reads the
//! position from there and the rope rows from a by-position table. The block's keys and values
//! are dropped after each layer, so a replay leaves the cache's length as it was.
//!
//! Exactness: the graphed pass gives the eager one's bits (tests/fused_cuda.rs). A failed
//! capture switches the draft's graphs off with the reason ([`DraftGraphs::report`]).

use super::{DraftCache, DraftModel};
use crate::archs::graphs::GraphReport;
use crate::archs::TargetModel;
use crate::Result;
use candle_core::Tensor;

/// A draft's graphs (empty and never used without `--features cuda`).
#[derive(Default)]
pub struct DraftGraphs {
    #[cfg(feature = "cuda")]
    state: std::sync::Mutex<imp::State>,
}

impl DraftGraphs {
    pub fn report(&self) -> GraphReport {
        #[cfg(feature = "cuda")]
        {
            match self.state.lock() {
                Ok(s) => s.report.clone(),
                Err(_) => GraphReport {
                    off: Some("graph state poisoned by a panic".into()),
                    ..Default::default()
                },
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            GraphReport::default()
        }
    }

    /// The block pass of `block` at `start` (the cache holds the context up to `start`)
    /// through a graph: its final-normed rows 1..Q and their logits, or None when the caller
    /// runs it eagerly (graphs off, a shape they do not cover, a capture that just failed).
    pub fn block(
        &self,
        d: &DraftModel,
        target: &dyn TargetModel,
        block: &[u32],
        start: usize,
        cache: &mut DraftCache,
    ) -> Result<Option<(Tensor, Tensor)>> {
        #[cfg(feature = "cuda")]
        {
            if !imp::eligible(d, block.len(), cache) {
                return Ok(None);
            }
            let mut st = self.state.lock().map_err(|_| {
                crate::Error::input(
                    "draft graph state poisoned by an earlier panic; run with DFLASH_CUDA_GRAPHS=0",
                )
            })?;
            st.block(d, target, block, start, cache)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (d, target, block, start, cache);
            Ok(None)
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::archs::graphs::{BOUND_STEP, MAX_ROWS};
    use crate::nn::cuda::graph;
    use crate::nn::fused::DeviceStep;
    use candle_core::DType;

    /// Graphs kept per draft (least recently used dropped first).
    const MAX_ENTRIES: usize = 16;

    #[derive(Clone, PartialEq, Eq)]
    struct Key {
        /// The cache's first layer buffer: its addresses are in the captured launches.
        cache: candle_core::TensorId,
        q: usize,
        bound: usize,
    }

    struct Entry {
        key: Key,
        used: u64,
        ids: Tensor,
        pos0: Tensor,
        warm: bool,
        /// The graph and what the captured pass returned (its own buffers).
        captured: Option<(graph::Graph, Tensor, Tensor)>,
    }

    #[derive(Default)]
    pub(super) struct State {
        pub(super) report: GraphReport,
        /// The rope's table by position, and its rows.
        table: Option<(usize, Tensor)>,
        entries: Vec<Entry>,
        clock: u64,
    }

    pub(super) fn eligible(d: &DraftModel, q: usize, cache: &DraftCache) -> bool {
        crate::switches::cuda_graphs()
            && (2..=MAX_ROWS).contains(&q)
            && d.dtype == DType::BF16
            && graph::supported(&d.device)
            && crate::nn::fused::allowed_part(crate::switches::Part::Attention)
            && !crate::stats::SectionTimer::enabled()
            && d.layers.iter().all(|l| l.attn.runs_device_steps())
            && first_layer(cache).is_some()
    }

    fn first_layer(cache: &DraftCache) -> Option<candle_core::TensorId> {
        cache.layers.first().and_then(|l| l.joint().map(|j| j.id()))
    }

    fn copied(rows: &Tensor, logits: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((rows.copy()?, logits.copy()?))
    }

    impl State {
        pub(super) fn block(
            &mut self,
            d: &DraftModel,
            target: &dyn TargetModel,
            block: &[u32],
            start: usize,
            cache: &mut DraftCache,
        ) -> Result<Option<(Tensor, Tensor)>> {
            if self.report.off.is_some() {
                return Ok(None);
            }
            let q = block.len();
            let Some(cache_id) = first_layer(cache) else {
                return Ok(None);
            };
            if cache.len() != start {
                return Err(crate::Error::input(format!(
                    "draft: the cache holds {} positions but the block starts at {start}",
                    cache.len()
                )));
            }
            for kv in &cache.layers {
                kv.check_room(q)?;
            }
            let capacity = cache.layers.first().map_or(0, |l| l.capacity());
            let key = Key {
                cache: cache_id,
                q,
                bound: (start + q).div_ceil(BOUND_STEP) * BOUND_STEP,
            };
            let dev = d.device.clone();
            let rows = capacity.div_ceil(BOUND_STEP).max(1) * BOUND_STEP;
            if self.table.as_ref().map(|t| t.0) != Some(rows) {
                match d.rope.position_table(rows, &dev, d.dtype)? {
                    Some(t) => self.table = Some((rows, t)),
                    None => return Ok(None),
                }
            }
            let table = match &self.table {
                Some((_, t)) => t.clone(),
                None => return Ok(None),
            };
            self.clock += 1;
            let clock = self.clock;
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
                        key: key.clone(),
                        used: clock,
                        ids: Tensor::zeros(q, DType::U32, &dev)?,
                        pos0: Tensor::zeros(1, DType::I64, &dev)?,
                        warm: false,
                        captured: None,
                    });
                    self.entries.len() - 1
                }
            };
            let e = &mut self.entries[at];
            e.used = clock;
            graph::write_u32(&e.ids, block)?;
            graph::write_i64(&e.pos0, &[start as i64])?;
            if let Some((g, rows, logits)) = &e.captured {
                g.launch()?;
                self.report.replays += 1;
                return Ok(Some(copied(rows, logits)?));
            }
            let step = DeviceStep {
                pos0: e.pos0.clone(),
                kv_bound: key.bound,
            };
            let (ids, warm) = (e.ids.clone(), e.warm);
            let run = |cache: &mut DraftCache| -> Result<(Tensor, Tensor)> {
                let rows = d.block_rows(target, &ids, start, Some((&step, &table)), cache)?;
                let logits = d.logits(target, &rows, None)?;
                Ok((rows, logits))
            };
            // Whatever happens, the block's rows leave the cache (each layer drops them).
            let restore = |cache: &mut DraftCache| {
                for kv in cache.layers.iter_mut() {
                    kv.truncate(start);
                }
            };
            if !warm {
                // The first pass of this key, eagerly in the on-device form (it makes every
                // upload the capture will ask for); if that form cannot run, graphs go off.
                let warmed = {
                    let _cache = graph::param_cache(&dev)?;
                    run(cache)
                };
                return match warmed {
                    Ok(out) => {
                        self.entries[at].warm = true;
                        self.report.warmups += 1;
                        Ok(Some(out))
                    }
                    Err(err) => {
                        restore(cache);
                        self.switch_off(format!("the on-device draft pass failed: {err}"));
                        Ok(None)
                    }
                };
            }
            match graph::capture(&dev, || run(cache)) {
                Ok(((rows, logits), g)) => {
                    g.launch()?;
                    let ret = copied(&rows, &logits)?;
                    self.entries[at].captured = Some((g, rows, logits));
                    self.report.captures += 1;
                    Ok(Some(ret))
                }
                Err(err) => {
                    restore(cache);
                    self.switch_off(format!("capture failed: {err}"));
                    Ok(None)
                }
            }
        }

        fn switch_off(&mut self, why: String) {
            tracing::warn!("CUDA graphs off for the draft: {why}");
            self.report.off = Some(why);
            self.entries.clear();
        }
    }
}
