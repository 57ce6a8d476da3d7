//! FP8 (e4m3) block-scaled weights kept as stored on the GPU (`w = e4m3 * s` per `bn x bk`
//! block: the DeepSeek-V3 / Kimi / Qwen `-FP8` checkpoints, `source/fp8.rs` reads them), behind
//! [`super::Linear::Fp8`]. The bytes are the checkpoint's, row-major; the scales f32. 1..=16 rows
//! (decode, verify, draft) multiply on the tensor cores with each weight dequantized in
//! registers to exactly the value the load-time dequantization gives (`kernels/fp8.cu`), with
//! the bf16 skinny GEMM's blocking, so the products are bit for bit the bf16 kernel's on the
//! dequantized weights (batch-invariant like it); more rows (prefill) dequantize the matrix to
//! bf16 and take the dense product.

use crate::Result;
use candle_core::{DType, Device, Tensor};

/// An FP8 matrix `[n, k]` as the CUDA kernels take it.
#[derive(Debug, Clone)]
pub struct Fp8Weight {
    /// `u8 [n, k]`: the e4m3 bytes as stored.
    pub q: Tensor,
    /// `f32 [ceil(n / bn), k / bk]`: the block scales (`weight_scale_inv`).
    pub scales: Tensor,
    /// Rows and columns a scale covers.
    pub block: (usize, usize),
    pub n: usize,
    pub k: usize,
}

impl Fp8Weight {
    /// Whether the kernels take this shape and block: inputs a multiple of 32 and a scale
    /// column a whole number of 32-wide chunks (`bk % 32 == 0`, `k % bk == 0`).
    pub fn supported(k: usize, block: (usize, usize)) -> bool {
        let (bn, bk) = block;
        bn > 0 && bk > 0 && bk.is_multiple_of(32) && k.is_multiple_of(bk)
    }

    /// From a checkpoint's tensors: `bytes` the e4m3 matrix (`n * k` bytes, row-major) and
    /// `scales` `[ceil(n / bn), k / bk]` (any float dtype; kept as f32).
    pub fn from_stored(
        bytes: &[u8],
        scales: &Tensor,
        block: (usize, usize),
        n: usize,
        k: usize,
        device: &Device,
    ) -> Result<Self> {
        let (bn, bk) = block;
        if !Self::supported(k, block) {
            return Err(crate::Error::input(format!(
                "fp8 weight [{n}, {k}] with {bn}x{bk} blocks is not kept as stored (inputs a multiple of the block's columns, which must be a multiple of 32)"
            )));
        }
        if bytes.len() != n * k {
            return Err(crate::Error::input(format!(
                "fp8 weight: {} bytes for [{n}, {k}]",
                bytes.len()
            )));
        }
        if scales.dims() != [n.div_ceil(bn), k / bk] {
            return Err(crate::Error::input(format!(
                "fp8 weight [{n}, {k}]: scales {:?}, expected [{}, {}]",
                scales.dims(),
                n.div_ceil(bn),
                k / bk
            )));
        }
        Ok(Self {
            q: Tensor::from_slice(bytes, (n, k), device)?,
            scales: scales.to_dtype(DType::F32)?.to_device(device)?,
            block,
            n,
            k,
        })
    }

    /// Bytes held (the checkpoint's e4m3 bytes and the f32 scales).
    pub fn bytes(&self) -> usize {
        self.q.elem_count() + 4 * self.scales.elem_count()
    }

    /// The weights as f32 `[n, k]` on the host: `f32(e4m3) * s`, the load-time dequantization's
    /// values (tests and the portable fallback).
    pub fn dequantize_host(&self) -> Result<Vec<f32>> {
        let q = self.q.flatten_all()?.to_vec1::<u8>()?;
        let s = self.scales.flatten_all()?.to_vec1::<f32>()?;
        Ok(crate::source::fp8::dequantize(
            &q, &s, self.block, self.n, self.k,
        ))
    }

    /// The same weights with one scale row per weight row (`bn = 1`): exactly the same values;
    /// parts whose rows do not fill their last block stack this way.
    fn per_row(&self) -> Result<Fp8Weight> {
        let idx: Vec<u32> = (0..self.n).map(|r| (r / self.block.0) as u32).collect();
        let idx = Tensor::from_vec(idx, self.n, self.scales.device())?;
        Ok(Fp8Weight {
            scales: self.scales.index_select(&idx, 0)?,
            block: (1, self.block.1),
            ..self.clone()
        })
    }

    /// Rows in the order of `idx` (`u32 [n]`), each with its own scale row.
    pub fn select_rows(&self, idx: &Tensor) -> Result<Fp8Weight> {
        let w = self.per_row()?;
        let idx = idx.to_device(w.q.device())?;
        Ok(Fp8Weight {
            q: w.q.index_select(&idx, 0)?,
            scales: w.scales.index_select(&idx, 0)?,
            n: idx.elem_count(),
            ..w
        })
    }

    /// Several matrices with the same inputs as one (rows stacked), None when their column
    /// blocks differ. Where a part's rows end inside a block, every part takes a scale per row.
    pub fn concat(parts: &[&Fp8Weight]) -> Result<Option<Fp8Weight>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if parts
            .iter()
            .any(|p| (p.k, p.block.1) != (first.k, first.block.1))
        {
            return Ok(None);
        }
        let aligned = parts.iter().all(|p| p.block.0 == first.block.0)
            && parts[..parts.len() - 1]
                .iter()
                .all(|p| p.n.is_multiple_of(p.block.0));
        let expanded: Vec<Fp8Weight>;
        let parts: Vec<&Fp8Weight> = if aligned {
            parts.to_vec()
        } else {
            expanded = parts.iter().map(|p| p.per_row()).collect::<Result<_>>()?;
            expanded.iter().collect()
        };
        let qs: Vec<&Tensor> = parts.iter().map(|p| &p.q).collect();
        let ss: Vec<&Tensor> = parts.iter().map(|p| &p.scales).collect();
        Ok(Some(Fp8Weight {
            q: Tensor::cat(&qs, 0)?,
            scales: Tensor::cat(&ss, 0)?,
            n: parts.iter().map(|p| p.n).sum(),
            ..parts[0].clone()
        }))
    }

    /// Rows `start .. start + len`, None where `start` is not on a scale row's boundary.
    pub fn rows(&self, start: usize, len: usize) -> Result<Option<Fp8Weight>> {
        let bn = self.block.0;
        if !start.is_multiple_of(bn) {
            return Ok(None);
        }
        Ok(Some(Fp8Weight {
            q: self.q.narrow(0, start, len)?,
            scales: self.scales.narrow(0, start / bn, len.div_ceil(bn))?,
            n: len,
            ..self.clone()
        }))
    }

    /// `x [.., k] -> [.., n]` in x's dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(y) = super::cuda::fp8_matmul(x, self, false)? {
            return Ok(y);
        }
        let w = self.dequantize(x.dtype())?;
        Ok(x.broadcast_matmul(&w.t()?)?)
    }

    /// `x [.., k] -> [.., n]` as f32 (the LM head's logits: each value the f32 of its bf16).
    pub fn forward_f32(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(y) = super::cuda::fp8_matmul(x, self, true)? {
            return Ok(y);
        }
        Ok(self.forward(x)?.to_dtype(DType::F32)?)
    }

    /// The weights `[n, k]` in `dtype` on their device (on CUDA by the kernel for bf16).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if dtype == DType::BF16 {
            if let Some(w) = super::cuda::fp8_dequantize(self)? {
                return Ok(w);
            }
        }
        let v = self.dequantize_host()?;
        Ok(Tensor::from_vec(v, (self.n, self.k), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(self.q.device())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weight(n: usize, k: usize, block: (usize, usize), seed: u8) -> Fp8Weight {
        // every byte but the NaN codes, scales of different magnitudes
        let bytes: Vec<u8> = (0..n * k)
            .map(|i| ((i * 37 + seed as usize) % 256) as u8)
            .map(|b| if b & 0x7f == 0x7f { 0x11 } else { b })
            .collect();
        let (sn, sk) = (n.div_ceil(block.0), k / block.1);
        let s: Vec<f32> = (0..sn * sk).map(|i| 0.001 * (i + 1) as f32).collect();
        let scales = Tensor::from_vec(s, (sn, sk), &Device::Cpu).unwrap();
        Fp8Weight::from_stored(&bytes, &scales, block, n, k, &Device::Cpu).unwrap()
    }

    /// Stacking keeps every value: block-aligned parts cat their scales, others take a scale
    /// per row; `rows` gives the parts back.
    #[test]
    fn concat_and_rows_keep_the_values() {
        for (block, ns) in [((16, 32), [32usize, 48, 16]), ((16, 64), [24, 40, 8])] {
            let parts: Vec<Fp8Weight> = ns
                .iter()
                .enumerate()
                .map(|(i, &n)| weight(n, 128, block, i as u8))
                .collect();
            let refs: Vec<&Fp8Weight> = parts.iter().collect();
            let all = Fp8Weight::concat(&refs).unwrap().unwrap();
            let want: Vec<f32> = parts
                .iter()
                .flat_map(|p| p.dequantize_host().unwrap())
                .collect();
            assert_eq!(all.dequantize_host().unwrap(), want, "{block:?} {ns:?}");
            assert_eq!(all.n, ns.iter().sum::<usize>());
            let aligned = ns[..2].iter().all(|n| n % block.0 == 0);
            assert_eq!(all.block.0, if aligned { block.0 } else { 1 });
            let r = all.rows(ns[0], ns[1]).unwrap().unwrap();
            assert_eq!(
                r.dequantize_host().unwrap(),
                parts[1].dequantize_host().unwrap()
            );
        }
        // different column blocks do not stack
        let (a, b) = (weight(16, 128, (16, 32), 0), weight(16, 128, (16, 64), 1));
        assert!(Fp8Weight::concat(&[&a, &b]).unwrap().is_none());
    }

    #[test]
    fn unsupported_blocks_and_bad_shapes_are_errors() {
        let s = Tensor::ones((1, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(!Fp8Weight::supported(128, (128, 16)));
        assert!(!Fp8Weight::supported(96, (128, 64)));
        let e = Fp8Weight::from_stored(&[0; 16 * 128], &s, (128, 48), 16, 128, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("128x48"), "{e}");
        let e = Fp8Weight::from_stored(&[0; 16 * 128], &s, (128, 64), 16, 128, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("scales [1, 4], expected [1, 2]"), "{e}");
    }
}
