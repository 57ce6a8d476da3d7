//! MXFP4 (OCP microscaling FP4) weights, as gpt-oss checkpoints store their MoE experts:
//! `{name}_blocks` (uint8 `[..., rows, cols / 32, 16]`, two 4-bit e2m1 codes per byte, the low
//! nibble first) and `{name}_scales` (uint8 `[..., rows, cols / 32]`, one e8m0 power-of-two
//! exponent per 32 values, bias 127). Value = e2m1(code) * 2^(scale - 127).
//!
//! The loader dequantizes EXACTLY at load (every MXFP4 value is representable in f32 and in
//! bf16: at most 2 significant bits times a power of two) and computes in the compute dtype.
//! Memory: MXFP4 holds 4.25 bits per value; dequantized experts take 16 bits (bf16, 3.8x) or
//! 32 bits (f32, 7.5x). gpt-oss-20b's 19.1 G expert values: 10.2 GB stored -> 38.2 GB bf16;
//! gpt-oss-120b's 114.7 G: 60.9 GB -> 229 GB bf16. `dflash models` prints these figures.

use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// The 16 e2m1 values by code (sign bit 3, two exponent bits, one mantissa bit).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// 2^(s - 127) as f32, exactly (s = 0 is the subnormal 2^-127); None for 255 (NaN in e8m0).
pub fn e8m0(s: u8) -> Option<f32> {
    match s {
        0 => Some(f32::from_bits(0x0040_0000)),
        255 => None,
        s => Some(f32::from_bits((s as u32) << 23)),
    }
}

/// Dequantize groups of 32 values: `blocks` holds 16 bytes per group, `scales` one byte per
/// group. Returns `32 * scales.len()` values in order, or the index of a NaN (255) scale.
pub fn dequantize(blocks: &[u8], scales: &[u8]) -> std::result::Result<Vec<f32>, String> {
    if blocks.len() != 16 * scales.len() {
        return Err(format!(
            "{} block bytes for {} scales (expected 16 bytes per scale)",
            blocks.len(),
            scales.len()
        ));
    }
    let mut out = Vec::with_capacity(32 * scales.len());
    for (g, (&s, bytes)) in scales.iter().zip(blocks.chunks_exact(16)).enumerate() {
        let m = e8m0(s).ok_or_else(|| format!("scale {g} is 255 (NaN in e8m0)"))?;
        for &b in bytes {
            out.push(E2M1[(b & 0x0F) as usize] * m);
            out.push(E2M1[(b >> 4) as usize] * m);
        }
    }
    Ok(out)
}

/// True when the checkpoint stores `{name}` as MXFP4 (`{name}_blocks` present).
pub fn is_mxfp4(w: &Weights, name: &str) -> bool {
    w.contains(&format!("{name}_blocks"))
}

/// A packed MXFP4 tensor read from a checkpoint (`{name}_blocks` / `{name}_scales`),
/// logically `[lead..., cols]`; slices along the first dim are dequantized on demand so a
/// loader holds one expert in f32 at a time.
pub struct Packed {
    name: String,
    blocks: Vec<u8>,
    scales: Vec<u8>,
    lead: Vec<usize>,
    cols: usize,
}

impl Packed {
    /// Read `{name}_blocks [lead..., cols/32, 16]` and `{name}_scales [lead..., cols/32]`
    /// (both uint8), checking names, shapes and dtypes.
    pub fn load(w: &Weights, name: &str, lead: &[usize], cols: usize) -> Result<Self> {
        let bname = format!("{name}_blocks");
        let sname = format!("{name}_scales");
        if !cols.is_multiple_of(32) || lead.is_empty() {
            return Err(Error::weights(
                &bname,
                format!("MXFP4 rows of {cols} values are not a multiple of 32"),
            ));
        }
        let g = cols / 32;
        let mut bshape = lead.to_vec();
        bshape.extend([g, 16]);
        let mut sshape = lead.to_vec();
        sshape.push(g);
        let blocks = w.get_raw(&bname, bshape)?;
        let scales = w.get_raw(&sname, sshape)?;
        for (n, t) in [(&bname, &blocks), (&sname, &scales)] {
            if t.dtype() != DType::U8 {
                return Err(Error::weights(
                    n,
                    format!("MXFP4 tensor stored as {:?}, expected uint8", t.dtype()),
                ));
            }
        }
        Ok(Self {
            name: name.to_string(),
            blocks: blocks.flatten_all()?.to_vec1::<u8>()?,
            scales: scales.flatten_all()?.to_vec1::<u8>()?,
            lead: lead.to_vec(),
            cols,
        })
    }

    /// Index `i` of the first dim, dequantized: f32 on the CPU, `[lead[1..]..., cols]`.
    pub fn slice(&self, i: usize) -> Result<Tensor> {
        let per: usize = self.lead[1..].iter().product::<usize>() * (self.cols / 32);
        if i >= self.lead[0] {
            return Err(Error::input(format!(
                "{}: index {i} out of range {}",
                self.name, self.lead[0]
            )));
        }
        let vals = dequantize(
            &self.blocks[i * per * 16..(i + 1) * per * 16],
            &self.scales[i * per..(i + 1) * per],
        )
        .map_err(|e| Error::weights(format!("{}_scales", self.name), e))?;
        let mut shape = self.lead[1..].to_vec();
        shape.push(self.cols);
        Ok(Tensor::from_vec(vals, shape, &Device::Cpu)?)
    }

    /// The whole tensor, dequantized: f32 on the CPU, `[lead..., cols]`.
    pub fn all(&self) -> Result<Tensor> {
        let parts = (0..self.lead[0])
            .map(|i| self.slice(i)?.unsqueeze(0).map_err(Into::into))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The codes and scales as stored, the rows (the second leading dim of a 2-dim lead) of
    /// each first index taken in `order` when given: `(codes, scales)`.
    pub fn into_bytes(self, order: Option<&[usize]>) -> (Vec<u8>, Vec<u8>) {
        let Some(order) = order.filter(|_| self.lead.len() == 2) else {
            return (self.blocks, self.scales);
        };
        let (outer, rows) = (self.lead[0], self.lead[1]);
        let (cb, sb) = (self.cols / 2, self.cols / 32);
        let (mut codes, mut scales) = (
            Vec::with_capacity(self.blocks.len()),
            Vec::with_capacity(self.scales.len()),
        );
        for e in 0..outer {
            for &r in order {
                let row = e * rows + r;
                codes.extend_from_slice(&self.blocks[row * cb..(row + 1) * cb]);
                scales.extend_from_slice(&self.scales[row * sb..(row + 1) * sb]);
            }
        }
        (codes, scales)
    }

    /// Bytes of the packed data (as stored).
    pub fn stored_bytes(&self) -> usize {
        self.blocks.len() + self.scales.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pack (code, scale) groups the way the format defines them (independent of `dequantize`).
    fn pack(codes: &[u8], scales: &[u8]) -> Vec<u8> {
        assert_eq!(codes.len(), 32 * scales.len());
        codes.chunks_exact(2).map(|p| p[0] | (p[1] << 4)).collect()
    }

    /// The value of a code, written from the e2m1 definition: sign, 2-bit exponent (bias 1),
    /// 1-bit mantissa; exponent 0 is subnormal (0 or 0.5).
    fn e2m1_def(code: u8) -> f64 {
        let sign = if code & 8 != 0 { -1.0 } else { 1.0 };
        let e = ((code >> 1) & 3) as i32;
        let m = (code & 1) as f64;
        sign * if e == 0 {
            m * 0.5
        } else {
            (1.0 + m / 2.0) * 2f64.powi(e - 1)
        }
    }

    #[test]
    fn table_matches_the_e2m1_definition() {
        for c in 0..16u8 {
            assert_eq!(E2M1[c as usize] as f64, e2m1_def(c), "code {c}");
            assert_eq!(
                E2M1[c as usize].is_sign_negative(),
                c & 8 != 0,
                "sign of {c}"
            );
        }
    }

    #[test]
    fn packed_known_values_dequantize_bit_exactly() {
        // Every code in both nibble positions, with scales across the whole e8m0 range
        // (subnormal 2^-127, 2^-126, 1, 2^10, 2^127 overflowing to inf for codes >= 2).
        let scales = [0u8, 1, 127, 137, 254, 120];
        let mut codes = vec![];
        for g in 0..scales.len() {
            for j in 0..32u8 {
                codes.push(((j + g as u8 * 5) * 7) % 16);
            }
        }
        let blocks = pack(&codes, &scales);
        let got = dequantize(&blocks, &scales).unwrap();
        for (i, (&c, &v)) in codes.iter().zip(&got).enumerate() {
            let want = e2m1_def(c) * 2f64.powi(scales[i / 32] as i32 - 127);
            let want = want as f32; // exact, or inf past f32's range
            assert_eq!(v.to_bits(), want.to_bits(), "value {i}: code {c}");
        }
        // bf16 keeps every finite value exactly too.
        for &v in got.iter().filter(|v| v.is_finite()) {
            assert_eq!(half::bf16::from_f32(v).to_f32().to_bits(), v.to_bits());
        }
        assert!(dequantize(&blocks, &[0u8, 1, 127, 137, 254, 255]).is_err());
        assert!(dequantize(&blocks[1..], &scales).is_err());
    }

    #[test]
    fn load_checks_names_shapes_and_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let codes: Vec<u8> = (0..2 * 3 * 64).map(|i| (i * 11 % 16) as u8).collect();
        let scales: Vec<u8> = (0..2 * 3 * 2).map(|i| 120 + i as u8).collect();
        let blocks = pack(&codes, &scales);
        let dev = Device::Cpu;
        let mut m = std::collections::HashMap::new();
        m.insert(
            "w_blocks".to_string(),
            Tensor::from_vec(blocks, (2, 3, 2, 16), &dev).unwrap(),
        );
        m.insert(
            "w_scales".to_string(),
            Tensor::from_vec(scales.clone(), (2, 3, 2), &dev).unwrap(),
        );
        m.insert(
            "f_blocks".to_string(),
            Tensor::zeros((2, 3, 2, 16), DType::F32, &dev).unwrap(),
        );
        m.insert(
            "f_scales".to_string(),
            Tensor::from_vec(scales.clone(), (2, 3, 2), &dev).unwrap(),
        );
        let p = dir.path().join("m.safetensors");
        candle_core::safetensors::save(&m, &p).unwrap();
        let w = Weights::open(&[p], DType::F32, &dev).unwrap();
        assert!(is_mxfp4(&w, "w") && !is_mxfp4(&w, "x"));
        let packed = Packed::load(&w, "w", &[2, 3], 64).unwrap();
        assert_eq!(packed.stored_bytes(), 2 * 3 * 2 * 17);
        let t = packed.all().unwrap();
        assert_eq!(t.dims(), &[2, 3, 64]);
        let s1 = packed.slice(1).unwrap();
        assert_eq!(
            s1.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            t.get(1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        );
        assert!(packed.slice(2).is_err());
        let flat = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, (&c, v)) in codes.iter().zip(flat).enumerate() {
            let want = (e2m1_def(c) * 2f64.powi(scales[i / 32] as i32 - 127)) as f32;
            assert_eq!(v.to_bits(), want.to_bits());
        }
        let err = |name: &str, cols| {
            Packed::load(&w, name, &[2, 3], cols)
                .err()
                .unwrap()
                .to_string()
        };
        let e = err("w", 32);
        assert!(e.contains("w_blocks") && e.contains("shape"), "{e}");
        let e = err("f", 64);
        assert!(e.contains("expected uint8"), "{e}");
        let e = err("w", 60);
        assert!(e.contains("multiple of 32"), "{e}");
    }
}
