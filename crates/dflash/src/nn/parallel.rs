//! Tensor parallelism: which part of a model one rank holds, and the collective that joins the
//! ranks' partial results.
//!
//! A sharded model runs one copy of the layer stack per rank, each holding a slice of every
//! layer (attention heads, MLP units): the column-parallel projections (q/k/v, gate/up) keep
//! their output rows `[rank * out / world, (rank + 1) * out / world)`, the row-parallel ones
//! (o, down) the matching input columns, so each rank's output is a partial sum and one
//! all-reduce after o and after down gives every rank the whole layer's output. Norms,
//! embeddings and the LM head are replicated. The residual stream is therefore the same on
//! every rank, and rank 0's logits are the model's.
//!
//! [`Comm`] is the all-reduce. Here it is in-process (ranks as threads of one process, the
//! sum in rank order so every rank gets the same bits, whatever the thread timing); a GPU
//! build puts NCCL behind the same door.

use crate::{Error, Result};
use candle_core::Tensor;
use std::sync::{Arc, Condvar, Mutex};

/// One rank's place in a tensor-parallel group.
#[derive(Clone)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
    pub comm: Arc<Comm>,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Shard({}/{})", self.rank, self.world)
    }
}

impl Shard {
    /// The ranks of a group of `world` ranks over one in-process communicator.
    pub fn group(world: usize) -> Vec<Shard> {
        let comm = Arc::new(Comm::new(world));
        (0..world)
            .map(|rank| Shard {
                rank,
                world,
                comm: comm.clone(),
            })
            .collect()
    }

    /// This rank's range of `n` units split evenly (`n` a multiple of the world size).
    pub fn range(&self, n: usize) -> (usize, usize) {
        let per = n / self.world;
        (self.rank * per, per)
    }

    /// Whether `n` units (`what`, e.g. "attention heads") split evenly; else an error saying so.
    pub fn check_divides(&self, n: usize, what: &str) -> Result<()> {
        if !n.is_multiple_of(self.world) {
            return Err(Error::input(format!(
                "tensor parallel {}: {n} {what} do not split over {} ranks (choose a tensor-parallel size that divides {n})",
                self.world, self.world
            )));
        }
        Ok(())
    }

    /// The sum of every rank's `x` (same shape on each), given to every rank.
    pub fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        self.comm.all_reduce(self.rank, x)
    }
}

/// An in-process all-reduce over `world` ranks (threads). Each call is one round: every rank
/// deposits its tensor, the last one to arrive sums them in rank order (0 + 1 + ...), and every
/// rank takes the same sum. Rounds follow one another: a rank arriving for the next round waits
/// until every rank has taken the previous one's result.
pub struct Comm {
    world: usize,
    state: Mutex<Round>,
    cv: Condvar,
}

struct Round {
    /// This round's number.
    gen: u64,
    parts: Vec<Option<Tensor>>,
    arrived: usize,
    /// The finished round's sum, and how many ranks have yet to take it.
    sum: Option<std::result::Result<Tensor, String>>,
    to_take: usize,
    /// Set when a rank gave up (its forward failed): every waiting and later call fails too,
    /// so no rank waits forever for a partner that will not come.
    broken: Option<String>,
}

impl Comm {
    pub fn new(world: usize) -> Self {
        Self {
            world,
            state: Mutex::new(Round {
                gen: 0,
                parts: vec![None; world],
                arrived: 0,
                sum: None,
                to_take: 0,
                broken: None,
            }),
            cv: Condvar::new(),
        }
    }

    pub fn world(&self) -> usize {
        self.world
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Round> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Mark the group broken (a rank's forward failed before reaching its next all-reduce):
    /// the ranks waiting in, or later arriving at, an all-reduce get this error.
    pub fn abort(&self, why: &str) {
        let mut s = self.lock();
        if s.broken.is_none() {
            s.broken = Some(why.to_string());
        }
        self.cv.notify_all();
    }

    /// Make the group usable again after every rank has returned from a failed forward.
    pub fn reset(&self) {
        let mut s = self.lock();
        s.parts.iter_mut().for_each(|p| *p = None);
        s.arrived = 0;
        s.sum = None;
        s.to_take = 0;
        s.broken = None;
        s.gen += 1;
    }

    pub fn all_reduce(&self, rank: usize, x: &Tensor) -> Result<Tensor> {
        if self.world == 1 {
            return Ok(x.clone());
        }
        let broken = |why: &str| Error::input(format!("tensor parallel: {why}"));
        let mut s = self.lock();
        // wait until the previous round's sum has been taken by every rank
        while s.to_take > 0 && s.broken.is_none() {
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        if let Some(why) = &s.broken {
            return Err(broken(why));
        }
        if s.parts[rank].is_some() {
            return Err(broken(&format!("rank {rank} joined one all-reduce twice")));
        }
        s.parts[rank] = Some(x.clone());
        s.arrived += 1;
        let gen = s.gen;
        if s.arrived == self.world {
            let parts: Vec<Tensor> = s
                .parts
                .iter_mut()
                .map(|p| p.take().expect("every part"))
                .collect();
            let mut acc = Ok(parts[0].clone());
            for p in &parts[1..] {
                acc = acc.and_then(|a: Tensor| a.add(p));
            }
            s.sum = Some(acc.map_err(|e| e.to_string()));
            s.arrived = 0;
            s.to_take = self.world;
            s.gen += 1;
            self.cv.notify_all();
        } else {
            while s.gen == gen && s.broken.is_none() {
                s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            if s.gen == gen {
                let why = s.broken.clone().unwrap_or_default();
                return Err(broken(&why));
            }
        }
        let sum = s.sum.clone().expect("the finished round's sum");
        s.to_take -= 1;
        if s.to_take == 0 {
            s.sum = None;
            self.cv.notify_all();
        }
        sum.map_err(|e| broken(&format!("all-reduce: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Every rank gets the rank-order sum, bit for bit the same on each, over many rounds.
    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        for world in [1usize, 2, 3, 4] {
            let group = Shard::group(world);
            let out: Vec<Vec<Vec<f32>>> = std::thread::scope(|sc| {
                let hs: Vec<_> = group
                    .iter()
                    .map(|sh| {
                        sc.spawn(move || {
                            (0..50)
                                .map(|round| {
                                    let v: Vec<f32> = (0..7)
                                        .map(|i| {
                                            0.1 * (sh.rank + 1) as f32
                                                + (round * 7 + i) as f32 * 1e-3
                                        })
                                        .collect();
                                    let t = Tensor::from_vec(v, 7, &Device::Cpu).unwrap();
                                    sh.all_reduce(&t).unwrap().to_vec1::<f32>().unwrap()
                                })
                                .collect()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for round in 0..50 {
                let want: Vec<f32> = (0..7)
                    .map(|i| {
                        (0..world)
                            .map(|r| 0.1 * (r + 1) as f32 + (round * 7 + i) as f32 * 1e-3)
                            .reduce(|a, b| a + b)
                            .unwrap()
                    })
                    .collect();
                for (r, o) in out.iter().enumerate() {
                    assert_eq!(o[round], want, "world {world} rank {r} round {round}");
                }
            }
        }
    }

    /// A rank that fails aborts the group: the others' all-reduce returns an error instead of
    /// waiting forever; after a reset the group works again.
    #[test]
    fn an_aborted_group_fails_its_waiters_then_resets() {
        let group = Shard::group(2);
        let t = Tensor::ones(3, candle_core::DType::F32, &Device::Cpu).unwrap();
        std::thread::scope(|sc| {
            let waiter = sc.spawn(|| group[0].all_reduce(&t));
            std::thread::sleep(std::time::Duration::from_millis(20));
            group[1].comm.abort("rank 1: a bad token");
            let e = waiter.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("rank 1: a bad token"), "{e}");
        });
        group[0].comm.reset();
        let sums: Vec<Vec<f32>> = std::thread::scope(|sc| {
            let hs: Vec<_> = group
                .iter()
                .map(|sh| sc.spawn(|| sh.all_reduce(&t).unwrap().to_vec1::<f32>().unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(sums, vec![vec![2.0; 3]; 2]);
    }

    #[test]
    fn uneven_splits_are_refused_with_the_count() {
        let g = Shard::group(4);
        assert_eq!(g[2].range(8), (4, 2));
        let e = g[0]
            .check_divides(6, "attention heads")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("6 attention heads") && e.contains("4 ranks"),
            "{e}"
        );
    }
}
