//! The state of one recurrent (Gated DeltaNet) layer between forward passes, owned by the
//! engine through `LayerCache::Recurrent`, and its exact rollback.
//!
//! State: the causal conv window (the last `kernel - 1` conv inputs) and the delta-rule state
//! `S [v_heads, k_dim, v_dim]` (f32). A forward of n rows advances both by n.
//!
//! Rollback ("recompute from captured inputs"). A forward runs the delta rule in chunks
//! (`nn::gated_delta`); inside a chunk that starts from state `S_0`, the state after its row j
//! is, exactly,
//!
//! ```text
//! S_j = exp(G_j) S_0 + sum_{i <= j} exp(G_j - G_i) k_i delta_i^T
//! ```
//!
//! with `G` the cumulative log decay, `k` the normalized keys and `delta` the delta-rule
//! corrections the chunk computed anyway. So a forward keeps, for its LAST chunk, `S_0` (a
//! reference to the previous state tensor, no copy), `k`, `delta`, `G` (per head
//! `c x (k_dim + v_dim + 1)` floats) and the conv inputs of that chunk; `truncate(len)` then
//! rebuilds the state after the accepted rows with one small batched matmul per layer.
//!
//! Trade-off against the alternatives: keeping every per-position state of a Q-row verify
//! costs Q x `v_heads x k_dim x v_dim` floats per layer (Qwen3.5-9B, Q = 16: 16 x 2 MiB x 24
//! layers = 768 MiB) for an O(1) select; snapshot + replay keeps one state but re-runs the
//! accepted rows through the layer (projections included) on every partial acceptance. Here
//! memory is at most three states per layer (current, chunk start, forward start; they are
//! the same tensor for a verify) plus O(Q x (k_dim + v_dim)), and a rollback costs about one
//! `[k_dim x j] @ [j x v_dim]` matmul per head and layer; a full acceptance costs nothing.
//!
//! Reachable positions after a forward that started at `start`: `start` itself (restored from
//! the kept state: a failed forward is undone this way) and every position inside its last
//! chunk. A verify block (<= 64 rows) is always one chunk. Other positions are an error.
//!
//! On CUDA the device kernels keep the state in a ring of two slots (state and conv window
//! each): a forward reads one slot and writes the other, its record keeps the rows, and a
//! rollback replays the accepted rows from the slot read into the slot written (one launch,
//! the window with them). The addresses never change, so a CUDA graph of a decode or verify
//! forward replays with the cache (`archs::graphs`); the slot read is part of the graph's key.
//! A forward of the portable path (prompts) makes new tensors; the next device forward
//! copies them into a slot the rollback record does not hold.

use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// What one chunk of the delta rule leaves behind to rebuild the state after any of its rows:
/// the chunked (WY) form's corrections (the portable path), or, on CUDA, the rows themselves
/// to replay with the row-by-row kernel from the chunk's start state (so a rolled-back state
/// has exactly the bits the decode steps would have given it).
#[derive(Debug, Clone)]
pub enum DeltaChunk {
    Wy(WyChunk),
    #[cfg(feature = "cuda")]
    Replay(ReplayChunk),
}

/// The rows of a forward kept for a replay on the device.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
pub struct ReplayChunk {
    /// State at the chunk's start `[v_heads, k_dim, v_dim]` (f32).
    pub s0: Tensor,
    /// The conv outputs of its rows `[c, conv_dim]` and their input projections.
    pub conv: Tensor,
    pub proj: Tensor,
    pub a_neg: Tensor,
    pub dt_bias: Tensor,
    pub layout: super::cuda::DeltaLayout,
    /// The conv window at the chunk's start `[kernel - 1, conv_dim]` (a ring buffer).
    pub window0: Tensor,
}

#[cfg(feature = "cuda")]
impl ReplayChunk {
    /// The state and conv window after the chunk's first `j >= 1` rows, replayed by the
    /// row-by-row kernel from the chunk's start into `state` and `window` (one launch).
    fn replay_into(&self, j: usize, state: &Tensor, window: &Tensor) -> Result<()> {
        let into = super::cuda::RuleInto {
            state,
            window_in: &self.window0,
            window_out: window,
        };
        let done = super::cuda::delta_rule_into(
            &self.conv,
            &self.proj,
            &self.a_neg,
            &self.dt_bias,
            &self.s0,
            &self.layout,
            j,
            false,
            into,
        )?;
        match done {
            Some(_) => Ok(()),
            None => Err(Error::input(
                "recurrent state: the replay kernel declined the rows it computed",
            )),
        }
    }
}

impl DeltaChunk {
    pub fn rows(&self) -> Result<usize> {
        match self {
            DeltaChunk::Wy(c) => c.rows(),
            #[cfg(feature = "cuda")]
            DeltaChunk::Replay(c) => Ok(c.conv.dim(0)?),
        }
    }
    /// The state at the chunk's start.
    pub fn s0(&self) -> &Tensor {
        match self {
            DeltaChunk::Wy(c) => &c.s0,
            #[cfg(feature = "cuda")]
            DeltaChunk::Replay(c) => &c.s0,
        }
    }
    /// The state after the chunk's first `j` rows (`1 <= j <= c`) as a new tensor: the
    /// portable path's chunks (a device chunk is replayed into its cache's ring instead).
    pub fn state_after(&self, j: usize) -> Result<Tensor> {
        match self {
            DeltaChunk::Wy(c) => c.state_after(j),
            #[cfg(feature = "cuda")]
            DeltaChunk::Replay(_) => Err(Error::input(
                "recurrent state: a device chunk is replayed into its cache's ring, not into a new state",
            )),
        }
    }
    fn bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        match self {
            DeltaChunk::Wy(c) => t(&c.k) + t(&c.delta) + t(&c.gcum),
            #[cfg(feature = "cuda")]
            DeltaChunk::Replay(c) => t(&c.conv) + t(&c.proj),
        }
    }
}

/// The chunked form's record (see the module docs).
#[derive(Debug, Clone)]
pub struct WyChunk {
    /// State at the chunk's start `[v_heads, k_dim, v_dim]` (f32).
    pub s0: Tensor,
    /// Normalized keys, one per value head `[v_heads, c, k_dim]` (f32).
    pub k: Tensor,
    /// Delta-rule corrections `[v_heads, c, v_dim]` (f32).
    pub delta: Tensor,
    /// Cumulative log decay inside the chunk `[v_heads, c]` (f32).
    pub gcum: Tensor,
}

impl WyChunk {
    pub fn rows(&self) -> Result<usize> {
        Ok(self.gcum.dim(1)?)
    }

    /// The state after the chunk's first `j` rows (`1 <= j <= c`).
    pub fn state_after(&self, j: usize) -> Result<Tensor> {
        let gj = self.gcum.narrow(1, j - 1, 1)?; // [h, 1]
        let w = gj
            .broadcast_sub(&self.gcum.narrow(1, 0, j)?)?
            .exp()?
            .unsqueeze(2)?; // [h, j, 1]: exp(G_j - G_i)
        let kd = self.k.narrow(1, 0, j)?.broadcast_mul(&w)?; // [h, j, dk]
        let upd = kd
            .transpose(1, 2)?
            .matmul(&self.delta.narrow(1, 0, j)?.contiguous()?)?; // [h, dk, dv]
        Ok(self.s0.broadcast_mul(&gj.exp()?.unsqueeze(2)?)?.add(&upd)?)
    }
}

/// What the last forward kept to undo itself (see the module docs).
#[derive(Debug, Clone)]
struct Undo {
    /// Position the forward started at, and the conv window and state there.
    start: usize,
    conv: Tensor,
    state: Tensor,
    /// Position of the last chunk's first row.
    chunk_start: usize,
    chunk: DeltaChunk,
    /// Conv inputs `[kernel - 1 + c, conv_dim]`: the window before the chunk, then its rows
    /// (None for a forward on the device ring: its rollback kernel reads them from the
    /// chunk's start window and projection).
    inputs: Option<Tensor>,
    /// The forward ran on the device ring from its slot `parity`: the start state and
    /// window are that slot's buffers.
    parity: Option<usize>,
}

/// The device ring (CUDA): two state and two conv-window buffers made once per cache. A
/// forward on the device reads slot `cur` and writes the other, so its reads and writes have
/// the same addresses every time (a CUDA graph replays them), and the slot it read stays
/// intact for the rollback until the forward after it.
#[derive(Debug, Clone)]
struct Ring {
    state: [Tensor; 2],
    window: [Tensor; 2],
    cur: usize,
}

/// The buffers of a forward on the device ring ([`RecurrentCache::ring_io`]).
#[derive(Debug, Clone)]
pub struct RingIo {
    pub state_in: Tensor,
    pub window_in: Tensor,
    pub state_out: Tensor,
    pub window_out: Tensor,
    /// The slot read.
    pub parity: usize,
}

/// Conv window + delta-rule state of one layer, with rollback inside the last forward.
#[derive(Debug, Clone)]
pub struct RecurrentCache {
    len: usize,
    /// `[kernel - 1, conv_dim]` in the compute dtype.
    conv: Tensor,
    /// `[v_heads, k_dim, v_dim]` f32.
    state: Tensor,
    undo: Option<Undo>,
    ring: Option<Ring>,
}

impl RecurrentCache {
    /// Zero state (what transformers starts from) for a layer with these shapes.
    pub fn new(
        conv_dim: usize,
        kernel: usize,
        v_heads: usize,
        k_dim: usize,
        v_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            len: 0,
            conv: Tensor::zeros((kernel - 1, conv_dim), dtype, device)?,
            state: Tensor::zeros((v_heads, k_dim, v_dim), DType::F32, device)?,
            undo: None,
            ring: None,
        })
    }

    /// A copy of the state after all positions consumed (its own tensors), with nothing to
    /// roll back: where another sequence continues from this one's end.
    pub fn fork(&self) -> Result<Self> {
        Ok(Self {
            len: self.len,
            conv: self.conv.copy()?,
            state: self.state.copy()?,
            undo: None,
            ring: None,
        })
    }

    /// Positions consumed.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The last `kernel - 1` conv inputs `[kernel - 1, conv_dim]`.
    pub fn conv(&self) -> &Tensor {
        &self.conv
    }
    /// The delta-rule state `[v_heads, k_dim, v_dim]` (f32).
    pub fn state(&self) -> &Tensor {
        &self.state
    }

    /// Record a forward of `n` rows: the new conv window and state, and what rolls it back:
    /// its last chunk (starting `chunk_offset` rows into the forward) and that chunk's conv
    /// `inputs` (`[kernel - 1 + c, conv_dim]`).
    pub fn commit(
        &mut self,
        n: usize,
        conv: Tensor,
        state: Tensor,
        chunk_offset: usize,
        chunk: DeltaChunk,
        inputs: Tensor,
    ) {
        let start = self.len;
        let old_conv = std::mem::replace(&mut self.conv, conv);
        let old_state = std::mem::replace(&mut self.state, state);
        self.undo = Some(Undo {
            start,
            conv: old_conv,
            state: old_state,
            chunk_start: start + chunk_offset,
            chunk,
            inputs: Some(inputs),
            parity: None,
        });
        self.len = start + n;
    }

    /// The buffers for a forward on the device ring: it reads the state and window of the
    /// current slot and writes the other's ([`Self::settle`] first; None off CUDA).
    pub fn ring_io(&mut self) -> Result<Option<RingIo>> {
        let Some(a) = self.settle()? else {
            return Ok(None);
        };
        let Some(r) = &self.ring else {
            return Ok(None);
        };
        let b = 1 - a;
        Ok(Some(RingIo {
            state_in: r.state[a].clone(),
            window_in: r.window[a].clone(),
            state_out: r.state[b].clone(),
            window_out: r.window[b].clone(),
            parity: a,
        }))
    }

    /// Put the state on the device ring and return the slot a forward reads next (None off
    /// CUDA). The ring is made on first use, and a state that is not in the ring (after a
    /// forward of the portable path) is copied into a slot the rollback record does not hold.
    /// Run it before capturing a CUDA graph: a capture must find the cache settled.
    pub fn settle(&mut self) -> Result<Option<usize>> {
        if !self.state.device().is_cuda() {
            return Ok(None);
        }
        if self.ring.is_none() {
            let dev = self.state.device();
            let zs = || Tensor::zeros(self.state.shape(), self.state.dtype(), dev);
            let zw = || Tensor::zeros(self.conv.shape(), self.conv.dtype(), dev);
            self.ring = Some(Ring {
                state: [zs()?, zs()?],
                window: [zw()?, zw()?],
                cur: 0,
            });
        }
        if !self.settled() {
            let held = |t: &Tensor| {
                self.undo.as_ref().is_some_and(|u| {
                    u.state.id() == t.id() || u.conv.id() == t.id() || u.chunk.s0().id() == t.id()
                })
            };
            let ring = self.ring.as_ref().expect("made above");
            let slot = match (0..2).find(|&k| !held(&ring.state[k]) && !held(&ring.window[k])) {
                Some(k) => k,
                None => {
                    return Err(Error::input(
                        "recurrent state: both ring slots are held by the rollback record",
                    ))
                }
            };
            ring.state[slot].slice_set(&self.state.contiguous()?, 0, 0)?;
            ring.window[slot].slice_set(&self.conv.contiguous()?, 0, 0)?;
            let (st, wi) = (ring.state[slot].clone(), ring.window[slot].clone());
            self.state = st;
            self.conv = wi;
            if let Some(r) = &mut self.ring {
                r.cur = slot;
            }
        }
        Ok(self.ring.as_ref().map(|r| r.cur))
    }

    /// Whether the state and window are the current ring slot's (a forward on the ring then
    /// copies nothing first); false without a ring.
    fn settled(&self) -> bool {
        self.ring.as_ref().is_some_and(|r| {
            r.state[r.cur].id() == self.state.id() && r.window[r.cur].id() == self.conv.id()
        })
    }

    /// Record a forward of `n` rows on the device ring that read slot `io.parity` (from
    /// [`Self::ring_io`]) and wrote the other: the other slot becomes the state, and `chunk`
    /// (its rows, from the read slot) what rolls it back.
    #[cfg(feature = "cuda")]
    pub fn commit_ring(&mut self, n: usize, parity: usize, chunk: ReplayChunk) -> Result<()> {
        let Some(r) = &mut self.ring else {
            return Err(Error::input(
                "recurrent state: a ring forward committed to a cache without a ring",
            ));
        };
        if r.cur != parity {
            return Err(Error::input(format!(
                "recurrent state: a forward read ring slot {parity} but the cache is at slot {}",
                r.cur
            )));
        }
        let start = self.len;
        r.cur = 1 - parity;
        self.state = r.state[r.cur].clone();
        self.conv = r.window[r.cur].clone();
        self.undo = Some(Undo {
            start,
            conv: r.window[parity].clone(),
            state: r.state[parity].clone(),
            chunk_start: start,
            chunk: DeltaChunk::Replay(chunk),
            inputs: None,
            parity: Some(parity),
        });
        self.len = start + n;
        Ok(())
    }

    /// The rollback record of the last forward when it ran on the ring (what a CUDA graph's
    /// replay commits again: the same buffers every time).
    #[cfg(feature = "cuda")]
    pub fn ring_chunk(&self) -> Option<(usize, ReplayChunk)> {
        let u = self.undo.as_ref()?;
        match (&u.chunk, u.parity) {
            (DeltaChunk::Replay(c), Some(p)) => Some((p, c.clone())),
            _ => None,
        }
    }

    /// After a forward that ran in several steps from the state `before`: make `before`'s
    /// position (the forward's start) the one `truncate` restores, keeping the last chunk.
    pub fn undo_from(&mut self, before: &RecurrentCache) {
        if let Some(u) = &mut self.undo {
            u.start = before.len;
            u.conv = before.conv.clone();
            u.state = before.state.clone();
        }
    }

    /// Whether [`truncate`](Self::truncate) to `len` would succeed.
    pub fn check_truncate(&self, len: usize) -> Result<()> {
        if len == self.len {
            return Ok(());
        }
        if len > self.len {
            return Err(Error::input(format!(
                "recurrent state holds {} positions, cannot move forward to {len}",
                self.len
            )));
        }
        match &self.undo {
            Some(u) if len == u.start || len >= u.chunk_start => Ok(()),
            Some(u) => Err(Error::input(format!(
                "recurrent state cannot roll back to position {len}: the last forward keeps positions {} and {}..={}",
                u.start, u.chunk_start, self.len
            ))),
            None => Err(Error::input(format!(
                "recurrent state cannot roll back to position {len}: nothing kept before {}",
                self.len
            ))),
        }
    }

    /// Drop every position at or after `len`: the conv window and state become those after
    /// exactly `len` positions (see the module docs for which positions are reachable).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.check_truncate(len)?;
        if len == self.len {
            return Ok(());
        }
        let Some(u) = self.undo.as_ref() else {
            return Err(Error::input("recurrent state: nothing kept to roll back"));
        };
        let k1 = self.conv.dim(0)?;
        if len == u.start {
            self.conv = u.conv.clone();
            self.state = u.state.clone();
            if let (Some(p), Some(r)) = (u.parity, &mut self.ring) {
                r.cur = p;
            }
        } else if let Some(p) = u.parity {
            self.rollback_ring(len - u.chunk_start, p)?;
        } else {
            let j = len - u.chunk_start;
            let Some(inputs) = &u.inputs else {
                return Err(Error::input(
                    "recurrent state: the rollback record lost its conv inputs",
                ));
            };
            self.conv = inputs.narrow(0, j, k1)?;
            self.state = if j == 0 {
                u.chunk.s0().clone()
            } else {
                u.chunk.state_after(j)?
            };
        }
        // The undo record still describes the same forward: later rollbacks inside it work.
        self.len = len;
        Ok(())
    }

    /// The state after `j >= 1` rows of a ring forward that read slot `p`: the rows replayed
    /// from that slot into the other (which the forward had written), the conv window with
    /// them, in one launch.
    #[cfg(feature = "cuda")]
    fn rollback_ring(&mut self, j: usize, p: usize) -> Result<()> {
        let (Some(u), Some(r)) = (&self.undo, &mut self.ring) else {
            return Err(Error::input(
                "recurrent state: a ring rollback without a ring",
            ));
        };
        let DeltaChunk::Replay(c) = &u.chunk else {
            return Err(Error::input(
                "recurrent state: a ring forward kept a record of the portable path",
            ));
        };
        let d = 1 - p;
        c.replay_into(j, &r.state[d], &r.window[d])?;
        r.cur = d;
        self.state = r.state[d].clone();
        self.conv = r.window[d].clone();
        Ok(())
    }

    #[cfg(not(feature = "cuda"))]
    fn rollback_ring(&mut self, _: usize, _: usize) -> Result<()> {
        Err(Error::input(
            "recurrent state: a ring rollback without CUDA",
        ))
    }

    /// Bytes held: the window and state (both ring slots where there is a ring) plus what the
    /// last forward kept.
    pub fn bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        let mut b = match &self.ring {
            Some(r) => 2 * (t(&r.state[0]) + t(&r.window[0])),
            None => t(&self.conv) + t(&self.state),
        };
        if let Some(u) = &self.undo {
            b += u.chunk.bytes() + u.inputs.as_ref().map_or(0, t);
            // kept states are counted once each (they are shared tensors for a verify; a
            // ring forward's is the other slot)
            if u.parity.is_none() {
                b += t(&u.state);
            }
        }
        b
    }
}
