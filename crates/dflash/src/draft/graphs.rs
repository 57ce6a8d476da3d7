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
            crate::archs::graphs::keyed::report_of(&self.state, imp::State::report)
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
            crate::archs::graphs::keyed::lock(&self.state, "draft graph")?
                .block(d, target, block, start, cache)
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
    use crate::archs::graphs::keyed::{Keyed, Names, Ran};
    use crate::archs::graphs::{BOUND_STEP, MAX_ROWS};
    use crate::nn::cuda::graph;
    use crate::nn::fused::DeviceStep;
    use candle_core::DType;

    #[derive(Clone, PartialEq, Eq)]
    struct Key {
        /// The cache's first layer buffer: its addresses are in the captured launches.
        cache: candle_core::TensorId,
        q: usize,
        bound: usize,
    }

    pub(super) struct State {
        /// Per key: the graph and what the captured pass returned (its own buffers).
        g: Keyed<Key, (graph::Graph, Tensor, Tensor)>,
    }

    impl Default for State {
        fn default() -> Self {
            Self {
                g: Keyed::new(Names {
                    owner: "the draft",
                    pass: "draft pass",
                }),
            }
        }
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
        pub(super) fn report(&self) -> GraphReport {
            self.g.report.clone()
        }

        pub(super) fn block(
            &mut self,
            d: &DraftModel,
            target: &dyn TargetModel,
            block: &[u32],
            start: usize,
            cache: &mut DraftCache,
        ) -> Result<Option<(Tensor, Tensor)>> {
            if self.g.report.off.is_some() {
                return Ok(None);
            }
            let q = block.len();
            let Some(cache_id) = first_layer(cache) else {
                return Ok(None);
            };
            for kv in &cache.layers {
                kv.check_room(q)?;
            }
            let capacity = cache.layers.first().map_or(0, |l| l.capacity());
            let key = Key {
                cache: cache_id,
                q,
                bound: (start + q).div_ceil(BOUND_STEP) * BOUND_STEP,
            };
            let bound = key.bound;
            let dev = d.device.clone();
            let Some(table) = self
                .g
                .position_tables(&[&d.rope], capacity, &dev, d.dtype)?
                .and_then(|t| t.into_iter().next())
            else {
                return Ok(None);
            };
            let at = self.g.entry(key, block, start, &dev)?;
            let e = self.g.get(at);
            if let Some((g, rows, logits)) = &e.captured {
                g.launch()?;
                let out = copied(rows, logits)?;
                self.g.report.replays += 1;
                return Ok(Some(out));
            }
            let step = DeviceStep {
                pos0: e.pos0.clone(),
                kv_bound: bound,
            };
            let ids = e.ids.clone();
            let ran = self.g.first_uses(at, &dev, || {
                let rows = d.block_rows(target, &ids, start, Some((&step, &table)), cache)?;
                let logits = d.logits(target, &rows, None)?;
                Ok((rows, logits))
            })?;
            match ran {
                Ran::Warm(out) => Ok(Some(out)),
                Ran::Off => {
                    // the block's rows leave the cache (each layer drops them; a failure may
                    // have left some)
                    for kv in cache.layers.iter_mut() {
                        kv.truncate(start);
                    }
                    Ok(None)
                }
                Ran::Captured((rows, logits), g) => {
                    g.launch()?;
                    let ret = copied(&rows, &logits)?;
                    self.g.get(at).captured = Some((g, rows, logits));
                    self.g.report.captures += 1;
                    Ok(Some(ret))
                }
            }
        }
    }
}
