//! MLX affine-quantized weights kept as stored on the GPU (`w = s * q + b` per group of 32, 64
//! or 128 inputs; 4 or 8 bits; bf16 or f16 scales), behind [`super::Linear::Affine`].
//!
//! The bytes are the checkpoint's: each row's packed `u32` words are only permuted inside
//! blocks of 16 words (so that one 16-byte load gives a lane of the kernel its words for 4
//! chunks of 32 inputs at 4 bits, 2 at 8; see `kernels/affine.cu`), and a group's scale and
//! bias are stored side by side as one `u32`. 1..=16 rows (decode, verify, draft) multiply on
//! the tensor cores with the weights dequantized in registers, batch-invariant like the bf16
//! skinny GEMM; more rows (prefill) dequantize the matrix to bf16 and take the dense product.

use crate::Result;
use candle_core::{DType, Device, Tensor};

/// Quantized matrix `[n, k]` as the CUDA kernels take it.
#[derive(Debug, Clone)]
pub struct AffineWeight {
    /// `u32 [n, k * bits / 32]`: the stored words, permuted inside blocks of 16.
    pub q: Tensor,
    /// `u32 [n, k / group]`: scale (low half) and bias (high half), as stored.
    pub sb: Tensor,
    pub bits: usize,
    pub group: usize,
    pub n: usize,
    pub k: usize,
    /// Scales and biases are f16 (else bf16).
    pub f16: bool,
}

/// Chunks of 32 inputs per 16-byte load of one lane (8 inputs of each chunk).
fn chunks_per_load(bits: usize) -> usize {
    128 / (8 * bits)
}

/// The stored word index (within a row) of permuted index `i`: blocks of 16 words hold
/// `chunks_per_load` chunks; lane c's words for those chunks are contiguous after the
/// permutation (kernels/affine.cu, `affine_dequant`, does the same arithmetic).
fn stored_index(i: usize, bits: usize) -> usize {
    let (cpc, wpl, per) = (chunks_per_load(bits), bits / 4, 32 / bits);
    let (blk, p) = (i / 16, i % 16);
    let (c, rest) = (p / 4, p % 4);
    let ch = blk * cpc + rest / wpl;
    let e = rest % wpl;
    (ch * 32 + 8 * c + e * per) / per
}

impl AffineWeight {
    /// Whether the kernels take this shape and storage: 4 or 8 bits, groups of 32/64/128,
    /// bf16 or f16 scales, and rows whose words fill whole blocks of 16.
    pub fn supported(bits: usize, group: usize, k: usize, scale_dtype: DType) -> bool {
        matches!(bits, 4 | 8)
            && matches!(group, 32 | 64 | 128)
            && k.is_multiple_of(32 * chunks_per_load(bits))
            && k.is_multiple_of(group)
            && matches!(scale_dtype, DType::BF16 | DType::F16)
    }

    /// From a checkpoint's tensors: `packed` the little-endian bytes of the `u32` words
    /// (`n` rows of `k * bits / 8`), `scales` / `biases` `[n, k / group]` (bf16 or f16).
    pub fn from_stored(
        packed: &[u8],
        scales: &Tensor,
        biases: &Tensor,
        bits: usize,
        group: usize,
        n: usize,
        k: usize,
        device: &Device,
    ) -> Result<Self> {
        let sd = scales.dtype();
        if !Self::supported(bits, group, k, sd) || biases.dtype() != sd {
            return Err(crate::Error::input(format!(
                "affine weight: {bits}-bit, group {group}, {k} inputs, scales {sd:?} / biases {:?} are not kept as stored (4 or 8 bits, groups 32/64/128, inputs a multiple of {}, bf16 or f16 scales)",
                biases.dtype(),
                32 * chunks_per_load(bits)
            )));
        }
        let words = k * bits / 32;
        if packed.len() != n * words * 4 {
            return Err(crate::Error::input(format!(
                "affine weight: {} packed bytes for {n} rows of {words} words",
                packed.len()
            )));
        }
        let mut q = vec![0u32; n * words];
        for r in 0..n {
            let row = &packed[r * words * 4..(r + 1) * words * 4];
            for (i, out) in q[r * words..(r + 1) * words].iter_mut().enumerate() {
                let j = stored_index(i, bits) * 4;
                *out = u32::from_le_bytes([row[j], row[j + 1], row[j + 2], row[j + 3]]);
            }
        }
        let bits16 = |t: &Tensor| -> Result<Vec<u16>> {
            let t = t.flatten_all()?;
            Ok(match t.dtype() {
                DType::BF16 => t
                    .to_vec1::<half::bf16>()?
                    .iter()
                    .map(|v| v.to_bits())
                    .collect(),
                _ => t
                    .to_vec1::<half::f16>()?
                    .iter()
                    .map(|v| v.to_bits())
                    .collect(),
            })
        };
        let (s, b) = (bits16(scales)?, bits16(biases)?);
        let g = k / group;
        if s.len() != n * g || b.len() != n * g {
            return Err(crate::Error::input(format!(
                "affine weight: {} scales and {} biases for {n} rows of {g} groups",
                s.len(),
                b.len()
            )));
        }
        let sb: Vec<u32> = s
            .iter()
            .zip(&b)
            .map(|(&s, &b)| s as u32 | (b as u32) << 16)
            .collect();
        Ok(Self {
            q: Tensor::from_vec(q, (n, words), device)?,
            sb: Tensor::from_vec(sb, (n, g), device)?,
            bits,
            group,
            n,
            k,
            f16: sd == DType::F16,
        })
    }

    /// Bytes held (the checkpoint's packed words, scales and biases).
    pub fn bytes(&self) -> usize {
        4 * (self.q.elem_count() + self.sb.elem_count())
    }

    /// The weights as f32 `[n, k]` on the host, from the permuted layout (tests and the
    /// portable fallback): `s * q + b`, as the checkpoint's dequantization.
    pub fn dequantize_host(&self) -> Result<Vec<f32>> {
        let q = self.q.flatten_all()?.to_vec1::<u32>()?;
        let sb = self.sb.flatten_all()?.to_vec1::<u32>()?;
        let (words, g, per) = (self.k * self.bits / 32, self.k / self.group, 32 / self.bits);
        let half = |h: u16| -> f32 {
            if self.f16 {
                half::f16::from_bits(h).to_f32()
            } else {
                half::bf16::from_bits(h).to_f32()
            }
        };
        let mask = (1u32 << self.bits) - 1;
        let mut out = vec![0f32; self.n * self.k];
        for r in 0..self.n {
            for i in 0..words {
                let w = q[r * words + i];
                let k0 = stored_index(i, self.bits) * per;
                let p = sb[r * g + k0 / self.group];
                let (s, b) = (half(p as u16), half((p >> 16) as u16));
                for j in 0..per {
                    let v = ((w >> (self.bits * j)) & mask) as f32;
                    out[r * self.k + k0 + j] = s * v + b;
                }
            }
        }
        Ok(out)
    }

    /// The same weights at 8 bits: each 4-bit value becomes a byte, scales and biases are
    /// unchanged, so `s * q + b` is exactly the same (itself at 8 bits).
    pub fn widened(&self) -> Result<AffineWeight> {
        if self.bits == 8 {
            return Ok(self.clone());
        }
        let q = self.q.flatten_all()?.to_vec1::<u32>()?;
        let (n, k, words) = (self.n, self.k, self.k * self.bits / 32);
        let per = 32 / self.bits;
        let mask = (1u32 << self.bits) - 1;
        let mut values = vec![0u8; n * k];
        for r in 0..n {
            for i in 0..words {
                let (w, k0) = (q[r * words + i], stored_index(i, self.bits) * per);
                for j in 0..per {
                    values[r * k + k0 + j] = ((w >> (self.bits * j)) & mask) as u8;
                }
            }
        }
        let words8 = k / 4;
        let mut q8 = vec![0u32; n * words8];
        for r in 0..n {
            for (i, out) in q8[r * words8..(r + 1) * words8].iter_mut().enumerate() {
                let j = r * k + stored_index(i, 8) * 4;
                *out = u32::from_le_bytes([values[j], values[j + 1], values[j + 2], values[j + 3]]);
            }
        }
        Ok(AffineWeight {
            q: Tensor::from_vec(q8, (n, words8), self.q.device())?,
            bits: 8,
            ..self.clone()
        })
    }

    /// Several matrices with the same inputs as one (rows stacked), None when their storage
    /// differs. Parts of 4 and 8 bits (a mixed-precision MLX recipe, GGUF q/k/v of a 4-bit
    /// and an 8-bit type) stack at 8 bits ([`Self::widened`], exact), so that q/k/v still
    /// form one weight (the fused attention path takes only that).
    pub fn concat(parts: &[&AffineWeight]) -> Result<Option<AffineWeight>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if parts
            .iter()
            .any(|p| (p.group, p.k, p.f16) != (first.group, first.k, first.f16))
        {
            return Ok(None);
        }
        let widened: Vec<AffineWeight>;
        let parts: Vec<&AffineWeight> = if parts.iter().all(|p| p.bits == first.bits) {
            parts.to_vec()
        } else {
            if !Self::supported(8, first.group, first.k, DType::F16) {
                return Ok(None);
            }
            widened = parts.iter().map(|p| p.widened()).collect::<Result<_>>()?;
            widened.iter().collect()
        };
        let qs: Vec<&Tensor> = parts.iter().map(|p| &p.q).collect();
        let sbs: Vec<&Tensor> = parts.iter().map(|p| &p.sb).collect();
        Ok(Some(AffineWeight {
            q: Tensor::cat(&qs, 0)?,
            sb: Tensor::cat(&sbs, 0)?,
            n: parts.iter().map(|p| p.n).sum(),
            ..parts[0].clone()
        }))
    }

    /// Rows `start .. start + len` (views).
    pub fn rows(&self, start: usize, len: usize) -> Result<AffineWeight> {
        Ok(AffineWeight {
            q: self.q.narrow(0, start, len)?,
            sb: self.sb.narrow(0, start, len)?,
            n: len,
            ..self.clone()
        })
    }

    /// `x [.., k] -> [.., n]` in x's dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(y) = super::cuda::affine_matmul(x, self)? {
            return Ok(y);
        }
        let w = self.dequantize(x.dtype())?;
        Ok(x.broadcast_matmul(&w.t()?)?)
    }

    /// The weights `[n, k]` in `dtype` on their device (on CUDA by the kernel for bf16).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if dtype == DType::BF16 {
            if let Some(w) = super::cuda::affine_dequantize(self)? {
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

    /// The permuted layout dequantizes to exactly the checkpoint's weights (the MLX bit
    /// stream: value i at bit i * bits), for 4 and 8 bits, every group size, bf16 and f16.
    #[test]
    fn permuted_layout_dequantizes_like_the_checkpoint() {
        let mut rng = crate::rng::Rng::new(3);
        for bits in [4usize, 8] {
            for group in [32usize, 64, 128] {
                for dt in [DType::BF16, DType::F16] {
                    let (n, k) = (5, 256);
                    let packed: Vec<u8> = (0..n * k * bits / 8)
                        .map(|_| (rng.uniform() * 256.0) as u8)
                        .collect();
                    let g = k / group;
                    let side = |rng: &mut crate::rng::Rng, scale: f64| {
                        let v: Vec<f32> = (0..n * g)
                            .map(|_| ((rng.uniform() - 0.5) * scale) as f32)
                            .collect();
                        Tensor::from_vec(v, (n, g), &Device::Cpu)
                            .unwrap()
                            .to_dtype(dt)
                            .unwrap()
                    };
                    let (s, b) = (side(&mut rng, 0.1), side(&mut rng, 1.0));
                    let w =
                        AffineWeight::from_stored(&packed, &s, &b, bits, group, n, k, &Device::Cpu)
                            .unwrap();
                    let got = w.dequantize_host().unwrap();
                    let sf = s.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                    let bf = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                    let (sf, bf) = (sf.to_vec1::<f32>().unwrap(), bf.to_vec1::<f32>().unwrap());
                    for r in 0..n {
                        for i in 0..k {
                            let bit = i * bits;
                            let byte = packed[r * k * bits / 8 + bit / 8] as u32;
                            let q = (byte >> (bit % 8)) & ((1 << bits) - 1);
                            let want = sf[r * g + i / group] * q as f32 + bf[r * g + i / group];
                            assert_eq!(
                                got[r * k + i],
                                want,
                                "{bits}-bit g{group} {dt:?} [{r}, {i}]"
                            );
                        }
                    }
                    // stacked rows and row views keep the layout
                    let two = AffineWeight::concat(&[&w, &w]).unwrap().unwrap();
                    assert_eq!(two.n, 2 * n);
                    let back = two.rows(n, n).unwrap().dequantize_host().unwrap();
                    assert_eq!(back, got);
                }
            }
        }
        // 4 and 8 bits stack at 8 bits, exactly
        let mut part = |bits: usize, n: usize| {
            let k = 256;
            let packed: Vec<u8> = (0..n * k * bits / 8)
                .map(|_| (rng.uniform() * 256.0) as u8)
                .collect();
            let side = |rng: &mut crate::rng::Rng| {
                let v: Vec<f32> = (0..n * k / 32)
                    .map(|_| (rng.uniform() - 0.5) as f32)
                    .collect();
                Tensor::from_vec(v, (n, k / 32), &Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F16)
                    .unwrap()
            };
            let (s, b) = (side(&mut rng), side(&mut rng));
            AffineWeight::from_stored(&packed, &s, &b, bits, 32, n, k, &Device::Cpu).unwrap()
        };
        let (a, b, c) = (part(4, 6), part(8, 3), part(4, 2));
        let wide = a.widened().unwrap();
        assert_eq!(
            (wide.bits, wide.bytes()),
            (8, a.bytes() + a.q.elem_count() * 4)
        );
        assert_eq!(
            wide.dequantize_host().unwrap(),
            a.dequantize_host().unwrap()
        );
        let abc = AffineWeight::concat(&[&a, &b, &c]).unwrap().unwrap();
        assert_eq!((abc.bits, abc.n), (8, 11));
        let mut want = a.dequantize_host().unwrap();
        want.extend(b.dequantize_host().unwrap());
        want.extend(c.dequantize_host().unwrap());
        assert_eq!(abc.dequantize_host().unwrap(), want);
        // shapes the kernels do not take are refused with the reason
        let s = Tensor::zeros((1, 2), DType::F32, &Device::Cpu).unwrap();
        let e = AffineWeight::from_stored(&[0; 64], &s, &s, 4, 64, 1, 128, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bf16 or f16 scales"), "{e}");
    }
}
