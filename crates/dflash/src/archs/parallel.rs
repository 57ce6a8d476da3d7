//! A tensor-parallel target: one copy of the family's layer stack per rank, each loaded with
//! its rank's share of the split layers (`nn::parallel`: attention heads, dense MLP units),
//! run together on every forward and joined by the all-reduces inside those layers. The
//! engine sees one [`TargetModel`]: rank 0's logits and taps are the model's; each rank keeps
//! its own share of the KV cache (`TargetCache::ranks`).
//!
//! What splits today: attention heads (key/value heads replicated when there are fewer of them
//! than ranks; gated and KV-shared attention too; latent attention's heads, its compressed
//! row and cache whole on every rank), Gated DeltaNet mixers by key heads with their value
//! heads (conv channels, decay and recurrent state per rank; one key head replicated when
//! there are fewer than ranks), dense gated MLP units, and routed experts
//! (expert parallelism: an even share of the experts a rank, the routing whole on every rank,
//! the block's output all-reduced); dense and GGUF weights (whole blocks); ranks as threads of
//! one CPU process. The rest (shared experts, norms,
//! the embedding and the LM head) is loaded whole on every rank and computed there, so the
//! output is still the model's; the load report states each
//! rank's share. NCCL ranks on GPUs plug in behind `nn::parallel::Comm` (issue 28).

use super::{BatchItem, ForwardOutput, Logits, TargetCache, TargetInfo, TargetModel};
use crate::nn::parallel::Shard;
use crate::{Error, Result};
use candle_core::Tensor;

pub struct Sharded {
    ranks: Vec<Box<dyn TargetModel>>,
    shards: Vec<Shard>,
    info: TargetInfo,
}

impl Sharded {
    /// `load(shard)` loads the model for one rank (the family's loader over sharded weights).
    pub fn load(
        world: usize,
        load: impl Fn(Shard) -> Result<Box<dyn TargetModel>>,
    ) -> Result<Self> {
        if world < 2 {
            return Err(Error::input(format!(
                "tensor parallel: {world} ranks (use 2 or more, or load the model whole)"
            )));
        }
        let shards = Shard::group(world);
        let ranks = shards
            .iter()
            .map(|s| load(s.clone()))
            .collect::<Result<Vec<_>>>()?;
        let mut info = ranks[0].info().clone();
        if !info.device.is_cpu() {
            return Err(Error::input(
                "tensor parallel runs on the CPU only so far (ranks as threads); CUDA ranks need NCCL, not built yet (issue 28)",
            ));
        }
        let per_rank: Vec<usize> = ranks.iter().map(|r| r.info().weight_bytes).collect();
        info.weight_bytes = per_rank.iter().sum();
        let note = format!(
            "tensor parallel {world}: {:.1} MB of weights a rank (attention and linear-attention heads, dense MLP units and routed experts split; the rest whole on every rank)",
            per_rank[0] as f64 / 1e6
        );
        info.quantization = Some(match info.quantization.take() {
            Some(q) => format!("{q}; {note}"),
            None => note,
        });
        Ok(Self {
            ranks,
            shards,
            info,
        })
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// Run `f(rank, model)` on every rank at once (rank 0 on this thread): a rank that fails
    /// aborts the group so no other waits in an all-reduce for it; the group is reset once all
    /// have returned. Rank 0's result, or the first error.
    fn on_all<T: Send>(
        &self,
        f: impl Fn(usize, &dyn TargetModel) -> Result<T> + Sync,
    ) -> Result<T> {
        let comm = &self.shards[0].comm;
        let run = |r: usize| {
            let out = f(r, self.ranks[r].as_ref());
            if let Err(e) = &out {
                comm.abort(&format!("rank {r}: {e}"));
            }
            out
        };
        let (first, rest) = std::thread::scope(|sc| {
            let hs: Vec<_> = (1..self.world())
                .map(|r| sc.spawn(move || run(r)))
                .collect();
            let first = run(0);
            let rest: Vec<Result<T>> = hs
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::input("tensor parallel: a rank panicked")))
                })
                .collect();
            (first, rest)
        });
        let failed = first.is_err() || rest.iter().any(|r| r.is_err());
        if failed {
            comm.reset();
        }
        match (first, rest.into_iter().find_map(|r| r.err())) {
            (Err(e), _) => Err(e),
            (Ok(_), Some(e)) => Err(e),
            (Ok(v), None) => Ok(v),
        }
    }
}

/// Each item's rank caches, taken out for the forward (ranks 1.. as `[rank - 1][item]`).
fn take_rank_caches(items: &mut [BatchItem], world: usize) -> Result<Vec<Vec<TargetCache>>> {
    let mut by_rank: Vec<Vec<TargetCache>> = (1..world).map(|_| Vec::new()).collect();
    for it in items.iter_mut() {
        if it.cache.ranks.len() != world - 1 {
            return Err(Error::input(format!(
                "tensor parallel {world}: a cache with {} rank caches (it was made by another model)",
                it.cache.ranks.len()
            )));
        }
    }
    for it in items.iter_mut() {
        for (r, c) in std::mem::take(&mut it.cache.ranks).into_iter().enumerate() {
            by_rank[r].push(c);
        }
    }
    Ok(by_rank)
}

impl TargetModel for Sharded {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn new_cache(&self, capacity: usize) -> Result<TargetCache> {
        let mut c = self.ranks[0].new_cache(capacity)?;
        c.ranks = self.ranks[1..]
            .iter()
            .map(|r| r.new_cache(capacity))
            .collect::<Result<_>>()?;
        Ok(c)
    }

    fn forward(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        // one item of a batch: each rank's Stack runs a lone item as its plain forward
        let mut items = [BatchItem {
            tokens,
            start,
            cache,
            logits,
        }];
        self.forward_batch(&mut items, taps)?
            .pop()
            .expect("one output for one item")
    }

    fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        self.ranks[0].embed(tokens)
    }

    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.ranks[0].lm_head(hidden)
    }

    fn forward_batch(
        &self,
        items: &mut [BatchItem],
        taps: &[usize],
    ) -> Result<Vec<Result<ForwardOutput>>> {
        let world = self.world();
        let mut by_rank = take_rank_caches(items, world)?;
        let out = {
            let rank0 = std::sync::Mutex::new(&mut *items);
            let others: Vec<std::sync::Mutex<Vec<BatchItem>>> = by_rank
                .iter_mut()
                .map(|caches| {
                    std::sync::Mutex::new(
                        rank0
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .iter()
                            .zip(caches.iter_mut())
                            .map(|(it, c)| BatchItem {
                                tokens: it.tokens,
                                start: it.start,
                                cache: c,
                                logits: Logits::None,
                            })
                            .collect(),
                    )
                })
                .collect();
            self.on_all(|r, m| {
                if r == 0 {
                    let mut its = rank0.lock().unwrap_or_else(|p| p.into_inner());
                    m.forward_batch(&mut its, taps)
                } else {
                    let mut its = others[r - 1].lock().unwrap_or_else(|p| p.into_inner());
                    m.forward_batch(&mut its, &[])
                }
            })
        };
        for (k, it) in items.iter_mut().enumerate() {
            it.cache.ranks = by_rank
                .iter_mut()
                .map(|v| std::mem::replace(&mut v[k], TargetCache::new(vec![], 0)))
                .collect();
        }
        out
    }

    fn verify_bytes(&self, rows: usize) -> f64 {
        self.ranks[0].verify_bytes(rows)
    }

    fn graph_report(&self) -> super::graphs::GraphReport {
        self.ranks[0].graph_report()
    }
}
