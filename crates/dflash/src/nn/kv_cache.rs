//! A preallocated, in-place KV cache for one attention layer with O(1) truncation.
//!
//! Keys and values live in `[kv_heads, capacity, head_dim]` buffers; appending writes rows
//! `len .. len + n` in place; `truncate(n)` only moves the length. Readers get views of the
//! first `len` rows, so nothing is copied per step. When keys and values have the same width
//! both live in one `[2, kv_heads, capacity, head_dim]` tensor (`joint`), which the fused CUDA
//! kernels write and read in one launch; `k` and `v` are views of it.

use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};

#[derive(Debug, Clone)]
pub struct KvCache {
    k: Tensor,
    v: Tensor,
    joint: Option<Tensor>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    pub fn new(
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::with_dims(kv_heads, head_dim, head_dim, capacity, dtype, device)
    }

    /// Keys and values of different widths (MLA-style caches).
    pub fn with_dims(
        kv_heads: usize,
        k_dim: usize,
        v_dim: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let (k, v, joint) = if k_dim == v_dim {
            let joint = Tensor::zeros((2, kv_heads, capacity, k_dim), dtype, device)?;
            (joint.get(0)?, joint.get(1)?, Some(joint))
        } else {
            (
                Tensor::zeros((kv_heads, capacity, k_dim), dtype, device)?,
                Tensor::zeros((kv_heads, capacity, v_dim), dtype, device)?,
                None,
            )
        };
        Ok(Self {
            k,
            v,
            joint,
            len: 0,
            capacity,
        })
    }

    /// A new cache of `capacity` positions holding a copy of this one's first `len` rows
    /// (a prefix another sequence starts from).
    pub fn fork(&self, len: usize, capacity: usize) -> Result<Self> {
        if len > self.len || len > capacity {
            return Err(Error::input(format!(
                "kv cache fork: {len} rows of {} (capacity {capacity})",
                self.len
            )));
        }
        let (kvh, kd, vd) = (self.k.dim(0)?, self.k.dim(2)?, self.v.dim(2)?);
        let mut c = Self::with_dims(kvh, kd, vd, capacity, self.k.dtype(), self.k.device())?;
        if len > 0 {
            c.append(&self.k.narrow(1, 0, len)?, &self.v.narrow(1, 0, len)?)?;
        }
        Ok(c)
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Append `k [kv_heads, n, k_dim]`, `v [kv_heads, n, v_dim]`; return views of all rows.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = k.dim(1)?;
        self.check_room(n)?;
        self.k.slice_set(&k.contiguous()?, 1, self.len)?;
        self.v.slice_set(&v.contiguous()?, 1, self.len)?;
        self.len += n;
        Ok((
            self.k.narrow(1, 0, self.len)?,
            self.v.narrow(1, 0, self.len)?,
        ))
    }

    /// The joint `[2, kv_heads, capacity, d]` buffer (keys, values) when they share a width.
    pub fn joint(&self) -> Option<&Tensor> {
        self.joint.as_ref()
    }

    /// Append `n` rows written in place by `write(joint, first_row)` (the fused kernels). The
    /// rows count as cached only when `write` says it wrote them; false (nothing appended)
    /// when there is no joint buffer or `write` declined.
    pub fn append_in_place(
        &mut self,
        n: usize,
        write: impl FnOnce(&Tensor, usize) -> Result<bool>,
    ) -> Result<bool> {
        self.check_room(n)?;
        let Some(joint) = &self.joint else {
            return Ok(false);
        };
        if !write(joint, self.len)? {
            return Ok(false);
        }
        self.len += n;
        Ok(true)
    }

    /// An error when `n` more rows do not fit.
    pub fn check_room(&self, n: usize) -> Result<()> {
        if self.len + n > self.capacity {
            return Err(Error::input(format!(
                "context overflow: {} cached + {n} new positions exceed the KV cache capacity {}; raise the context size or shorten the prompt",
                self.len, self.capacity
            )));
        }
        Ok(())
    }

    /// Views of the cached rows.
    pub fn view(&self) -> Result<(Tensor, Tensor)> {
        Ok((
            self.k.narrow(1, 0, self.len)?,
            self.v.narrow(1, 0, self.len)?,
        ))
    }

    /// Forget every row at or after `len`. O(1).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn bytes(&self) -> usize {
        (self.k.elem_count() + self.v.elem_count()) * self.k.dtype().size_in_bytes()
    }
}
