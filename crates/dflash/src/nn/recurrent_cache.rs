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
    /// The state after the chunk's first `j` rows (`1 <= j <= c`).
    pub fn state_after(&self, j: usize) -> Result<Tensor> {
        match self {
            DeltaChunk::Wy(c) => c.state_after(j),
            #[cfg(feature = "cuda")]
            DeltaChunk::Replay(c) => {
                let out = super::cuda::delta_rule(
                    &c.conv, &c.proj, &c.a_neg, &c.dt_bias, &c.s0, &c.layout, j, false,
                )?;
                match out {
                    Some((_, state)) => Ok(state),
                    None => Err(Error::input(
                        "recurrent state: the replay kernel declined the rows it computed",
                    )),
                }
            }
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
    /// Conv inputs `[kernel - 1 + c, conv_dim]`: the window before the chunk, then its rows.
    inputs: Tensor,
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
            inputs,
        });
        self.len = start + n;
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
        let u = self.undo.as_ref().expect("checked");
        let k1 = self.conv.dim(0)?;
        if len == u.start {
            self.conv = u.conv.clone();
            self.state = u.state.clone();
        } else {
            let j = len - u.chunk_start;
            self.conv = u.inputs.narrow(0, j, k1)?;
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

    /// Bytes held: the window and state plus what the last forward kept.
    pub fn bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        let mut b = t(&self.conv) + t(&self.state);
        if let Some(u) = &self.undo {
            b += u.chunk.bytes() + t(&u.inputs);
            // kept states are counted once each (they are shared tensors for a verify)
            b += t(&u.state);
        }
        b
    }
}
