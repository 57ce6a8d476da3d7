//! A preallocated cache of one row per position (multi-head latent attention, DeepSeek-V3 /
//! Kimi): the compressed KV latent after its norm, followed by the roped shared key part.
//!
//! Same contract as [`super::KvCache`]: rows are written in place at `len ..`, readers get a
//! view of the first `len` rows, and `truncate(n)` only moves the length (O(1) rollback).

use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};

#[derive(Debug, Clone)]
pub struct LatentCache {
    /// `[1, capacity, width]`: a single "KV head" so attention reads it like an MQA cache.
    rows: Tensor,
    len: usize,
    capacity: usize,
}

impl LatentCache {
    pub fn new(width: usize, capacity: usize, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self {
            rows: Tensor::zeros((1, capacity, width), dtype, device)?,
            len: 0,
            capacity,
        })
    }

    /// A new cache of `capacity` positions holding a copy of this one's first `len` rows.
    pub fn fork(&self, len: usize, capacity: usize) -> Result<Self> {
        if len > self.len || len > capacity {
            return Err(Error::input(format!(
                "latent cache fork: {len} rows of {} (capacity {capacity})",
                self.len
            )));
        }
        let mut c = Self::new(
            self.rows.dim(2)?,
            capacity,
            self.rows.dtype(),
            self.rows.device(),
        )?;
        if len > 0 {
            c.append(&self.rows.get(0)?.narrow(0, 0, len)?)?;
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

    /// Append `rows [1, n, width]`; return a view of all cached rows `[1, len, width]`.
    pub fn append(&mut self, rows: &Tensor) -> Result<Tensor> {
        let n = rows.dim(1)?;
        if self.len + n > self.capacity {
            return Err(Error::input(format!(
                "context overflow: {} cached + {n} new positions exceed the latent cache capacity {}; raise the context size or shorten the prompt",
                self.len, self.capacity
            )));
        }
        self.rows.slice_set(&rows.contiguous()?, 1, self.len)?;
        self.len += n;
        self.view()
    }

    /// The whole buffer `[1, capacity, width]` (the latent attention kernel reads its rows).
    pub fn buffer(&self) -> &Tensor {
        &self.rows
    }

    /// View of the cached rows `[1, len, width]`.
    pub fn view(&self) -> Result<Tensor> {
        Ok(self.rows.narrow(1, 0, self.len)?)
    }

    /// Forget every row at or after `len`. O(1).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn bytes(&self) -> usize {
        self.rows.elem_count() * self.rows.dtype().size_in_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_view_truncate() {
        let dev = Device::Cpu;
        let mut c = LatentCache::new(3, 4, DType::F32, &dev).unwrap();
        let a = Tensor::new(&[[[1f32, 2., 3.], [4., 5., 6.]]], &dev).unwrap();
        assert_eq!(c.append(&a).unwrap().dims(), &[1, 2, 3]);
        c.truncate(1);
        let b = Tensor::new(&[[[7f32, 8., 9.]]], &dev).unwrap();
        let v = c.append(&b).unwrap();
        assert_eq!(
            v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![1., 2., 3., 7., 8., 9.]
        );
        let too_many = Tensor::zeros((1, 3, 3), DType::F32, &dev).unwrap();
        assert!(c.append(&too_many).is_err());
        assert_eq!(c.len(), 2);
    }
}
