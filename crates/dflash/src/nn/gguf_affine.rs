//! GGUF blocks as affine weights ([`AffineWeight`]): the block types whose every weight is
//! `scale * u + bias` per block of 32 with an f16 scale and bias, rewritten at load into the
//! layout the affine CUDA kernels take (`kernels/affine.cu`), with the stored weights exactly.
//!
//! | GGUF type | stored weight | affine | u | scale | bias |
//! |---|---|---|---|---|---|
//! | Q4_0 | `d * (q - 8)`, q 4-bit | 4-bit g32 | q | d | -8 d |
//! | Q4_1 | `d * q + m`, q 4-bit | 4-bit g32 | q | d | m |
//! | Q8_0 | `d * q`, q int8 | 8-bit g32 | q + 128 | d | -128 d |
//! | Q5_0 | `d * (q - 16)`, q 5-bit | 8-bit g32 | q + 112 | d | -128 d |
//! | Q5_1 | `d * q + m`, q 5-bit | 8-bit g32 | q | d | m |
//!
//! Exactness: `d`, `m` are the stored f16 values; `-8 d` and `-128 d` are d times a power of two,
//! exact in f16 unless they overflow it (|d| > 8188 for Q4_0, > 511.75 for Q8_0 / Q5_0: the
//! matrix is then refused and stays on today's path). `scale * u + bias` in f32 then equals
//! the GGUF dequantization (`d * (q - 8)`, `d * q + m`, ... in f32) exactly: both products are
//! exact (an 11-bit mantissa times an 8-bit integer), and so is their difference (a multiple
//! of d's unit in the last place below 2^19 of them). The one visible difference is the sign
//! of a zero weight (`d * 8 - 8 d` is +0 where `d * 0` is -0 for a negative d). In the
//! kernel's own arithmetic (`s * sum(x * (u - 128)) + (b + 128 s) * sum(x)` at 8 bits) the
//! offset `b + 128 s` is exactly 0 for Q8_0 and Q5_0, so their products are `d * sum(x * q)`
//! as stored; Q5_1's offset `m + 128 d` and the 4-bit types' `b - 128 s` round in f32 as for
//! any MLX affine checkpoint.
//!
//! K-quants, not exactly: a Q4_K / Q5_K super-block of 256 holds f16 `d`, `dmin` and per
//! sub-block of 32 6-bit integers `sc`, `m`, with weights `d * sc * q - dmin * m` (q 4 or 5
//! bits). They map to 4-bit / 8-bit g32 with u = q, scale = f16(d * sc), bias = f16(-dmin *
//! m): the products are exact in f32 (11 x 6 bits) and then rounded to f16 (to nearest even),
//! an error of at most 2^-11 of |d * sc| and |dmin * m| (half an f16 ulp; below 2^-14, in
//! f16's subnormal range, at most 2^-25 absolute). Where the products fit f16 (d and dmin
//! with at most 5 significant bits, say) the weights are the stored ones exactly.
//!
//! Q5_0 / Q5_1 take 36 bytes a block of 32 in this form (22 / 24 stored), Q4_0 20 (18), Q4_1
//! 20 (20), Q8_0 36 (34), Q4_K 20 (18), Q5_K 36 (22). Q6_K (a scale per 16 values) does not
//! fit groups of 32 and is not mapped, nor are Q2_K, Q3_K, Q8_1.

use super::AffineWeight;
use crate::Result;
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use half::f16;

/// What [`from_gguf`] made of a matrix.
#[derive(Debug)]
pub enum GgufAffine {
    /// Rewritten as an affine weight (exactly the stored weights where [`exact`]).
    Kept(AffineWeight),
    /// A block type this module does not map.
    NotMapped,
    /// A mapped type the kernels cannot take here (the reason, for the load report).
    Refused(&'static str),
}

/// The affine width a GGUF block type maps to, None for types that are not mapped.
pub fn affine_bits(dt: GgmlDType) -> Option<usize> {
    match dt {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q4K => Some(4),
        GgmlDType::Q8_0 | GgmlDType::Q5_0 | GgmlDType::Q5_1 | GgmlDType::Q5K => Some(8),
        _ => None,
    }
}

/// Whether the affine form of `dt` holds exactly the stored weights (all mapped types but the
/// K-quants, whose scales and mins are rounded to f16).
pub fn exact(dt: GgmlDType) -> bool {
    !matches!(dt, GgmlDType::Q4K | GgmlDType::Q5K)
}

/// Bytes an `[n, k]` matrix of `dt` takes as an affine weight (packed words + one f16 scale
/// and bias per 32 inputs), None when it is not mapped at this width. (A refusal for a scale
/// out of f16 range is only known from the data.)
pub fn kept_bytes(dt: GgmlDType, n: usize, k: usize) -> Option<u64> {
    let bits = affine_bits(dt)?;
    if !AffineWeight::supported(bits, 32, k, candle_core::DType::F16) {
        return None;
    }
    Some(n as u64 * (k as u64 / 32) * (32 * bits as u64 / 8 + 4))
}

fn half_at(b: &[u8], at: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// `f * d` in f16 when that is exact (no overflow), else None.
fn times(d: f16, f: f32) -> Option<f16> {
    let v = d.to_f32() * f;
    let h = f16::from_f32(v);
    (h.is_finite() && h.to_f32() == v).then_some(h)
}

/// The 5-bit values of a Q5 block: low nibbles in `qs`, fifth bits in `qh` (value j's at
/// bit j; value j + 16 in the high nibble of `qs[j]`).
fn q5(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    std::array::from_fn(|i| {
        let nib = if i < 16 { qs[i] & 0xF } else { qs[i - 16] >> 4 };
        nib | (((h >> i) & 1) as u8) << 4
    })
}

/// The 4-bit values of a Q4 block: value j the low nibble of `qs[j]`, j + 16 its high one.
fn q4(qs: &[u8]) -> [u8; 32] {
    std::array::from_fn(|i| if i < 16 { qs[i] & 0xF } else { qs[i - 16] >> 4 })
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a K-quant block's 12 scale bytes
/// (llama.cpp's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `v` rounded to f16 (to nearest, ties to even), None when it overflows.
fn round16(v: f32) -> Option<f16> {
    Some(f16::from_f32(v)).filter(|h| h.is_finite())
}

/// Rewrite the stored blocks of an `[n, k]` GGUF matrix (`data`: `n` rows of `k / 32` blocks
/// of `dt`, or `k / 256` super-blocks for the K-quants) as an [`AffineWeight`] on `device`,
/// see the module docs.
pub fn from_gguf(
    dt: GgmlDType,
    data: &[u8],
    n: usize,
    k: usize,
    device: &Device,
) -> Result<GgufAffine> {
    let Some(bits) = affine_bits(dt) else {
        return Ok(GgufAffine::NotMapped);
    };
    if !AffineWeight::supported(bits, 32, k, candle_core::DType::F16)
        || !k.is_multiple_of(dt.block_size())
    {
        return Ok(GgufAffine::Refused(if bits == 4 {
            "width not a multiple of 128"
        } else {
            "width not a multiple of 64"
        }));
    }
    let bsize = dt.type_size();
    let blocks = n * (k / dt.block_size());
    if data.len() != blocks * bsize {
        return Err(crate::Error::input(format!(
            "GGUF {dt:?} matrix [{n}, {k}]: {} bytes, expected {} ({blocks} blocks of {bsize})",
            data.len(),
            blocks * bsize
        )));
    }
    let groups = n * (k / 32);
    let mut packed = Vec::with_capacity(groups * 32 * bits / 8);
    let mut scales = Vec::with_capacity(groups);
    let mut biases = Vec::with_capacity(groups);
    // one group of 32: its values, scale and bias (None: not finite in f16)
    let mut push = |u: [u8; 32], s: Option<f16>, b: Option<f16>| -> bool {
        let (Some(s), Some(b)) = (s, b) else {
            return false;
        };
        if !s.is_finite() || !b.is_finite() {
            return false;
        }
        scales.push(s);
        biases.push(b);
        if bits == 4 {
            // value i at bits 4 * (i % 8) of word i / 8
            for w in u.chunks_exact(8) {
                let word = w
                    .iter()
                    .enumerate()
                    .fold(0u32, |acc, (j, &v)| acc | (v as u32) << (4 * j));
                packed.extend_from_slice(&word.to_le_bytes());
            }
        } else {
            packed.extend_from_slice(&u);
        }
        true
    };
    for b in data.chunks_exact(bsize) {
        let d = half_at(b, 0);
        let ok = match dt {
            GgmlDType::Q4_0 => push(q4(&b[2..18]), Some(d), times(d, -8.0)),
            GgmlDType::Q4_1 => push(q4(&b[4..20]), Some(d), Some(half_at(b, 2))),
            GgmlDType::Q8_0 => push(
                std::array::from_fn(|i| (b[2 + i] as i8 as i16 + 128) as u8),
                Some(d),
                times(d, -128.0),
            ),
            GgmlDType::Q5_0 => push(
                q5(&b[2..6], &b[6..22]).map(|q| q + 112),
                Some(d),
                times(d, -128.0),
            ),
            GgmlDType::Q5_1 => push(q5(&b[4..8], &b[8..24]), Some(d), Some(half_at(b, 2))),
            GgmlDType::Q4K | GgmlDType::Q5K => {
                // d, dmin, 12 scale bytes, [Q5K: 32 bytes of fifth bits], 128 bytes of nibbles:
                // sub-block 2c the low nibbles of bytes 32c.., 2c + 1 their high nibbles
                let (d, dmin) = (d.to_f32(), half_at(b, 2).to_f32());
                let five = dt == GgmlDType::Q5K;
                let qs = if five { 48 } else { 16 };
                (0..8).all(|j| {
                    let (sc, m) = scale_min_k4(j, &b[4..16]);
                    let u = std::array::from_fn(|i| {
                        let byte = b[qs + 32 * (j / 2) + i];
                        let nib = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
                        if five {
                            nib | ((b[16 + i] >> j) & 1) << 4
                        } else {
                            nib
                        }
                    });
                    push(u, round16(d * sc as f32), round16(-(dmin * m as f32)))
                })
            }
            _ => unreachable!("affine_bits maps only the types above"),
        };
        if !ok {
            return Ok(GgufAffine::Refused("scale out of f16 range"));
        }
    }
    let side = |v: Vec<f16>| Tensor::from_vec(v, (n, k / 32), &Device::Cpu);
    Ok(GgufAffine::Kept(AffineWeight::from_stored(
        &packed,
        &side(scales)?,
        &side(biases)?,
        bits,
        32,
        n,
        k,
        device,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{QStorage, QTensor};
    use std::borrow::Cow;

    fn kept(r: GgufAffine) -> AffineWeight {
        match r {
            GgufAffine::Kept(w) => w,
            other => panic!("expected an affine weight, got {other:?}"),
        }
    }

    /// candle's GGUF dequantization of the same bytes.
    fn candle_dequant(dt: GgmlDType, data: &[u8], n: usize, k: usize) -> Vec<f32> {
        let s = QStorage::from_data(Cow::Borrowed(data), &Device::Cpu, dt).unwrap();
        QTensor::new(s, (n, k))
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    /// f16 values a block's d (and m) take: ordinary ones of both signs, the extremes the
    /// mapping still takes, subnormals, zeros.
    fn edge_halves(dt: GgmlDType) -> Vec<f16> {
        let dmax = match dt {
            GgmlDType::Q4_0 => 8188.0,
            GgmlDType::Q8_0 | GgmlDType::Q5_0 => 511.75,
            _ => 65504.0,
        };
        let mut v = vec![
            f16::from_f32(dmax),
            f16::from_f32(-dmax),
            f16::from_bits(0x0001), // smallest subnormal
            f16::from_bits(0x8001),
            f16::from_bits(0x03ff), // largest subnormal
            f16::from_bits(0x0400), // smallest normal
            f16::ZERO,
            f16::NEG_ZERO,
            f16::from_f32(1.0),
            f16::from_f32(-0.000_123),
        ];
        v.retain(|h| h.is_finite());
        v
    }

    /// `n * k / 32` random blocks of `dt`: every third block's d from the edge values in turn
    /// (the first one's the largest the mapping takes), every other block's m too, the others
    /// ordinary; quant bytes random, the first block's q all at the maximum, the last's at the minimum.
    fn blocks(dt: GgmlDType, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut rng = crate::rng::Rng::new(seed);
        let edges = edge_halves(dt);
        let bsize = dt.type_size();
        let mut out = Vec::new();
        for i in 0..n * k / 32 {
            let mut b: Vec<u8> = (0..bsize).map(|_| (rng.uniform() * 256.0) as u8).collect();
            let mut half = |edge: bool| {
                if edge {
                    edges[(i / 3) % edges.len()]
                } else {
                    f16::from_f64((rng.uniform() - 0.5) * 0.2)
                }
            };
            let d = half(i % 3 == 0);
            b[0..2].copy_from_slice(&d.to_bits().to_le_bytes());
            if matches!(dt, GgmlDType::Q4_1 | GgmlDType::Q5_1) {
                let m = half(i % 2 == 0);
                b[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
            }
            out.extend(b);
        }
        // q at its extremes in a whole block: all bits set, all clear
        let last = out.len() - bsize;
        let q_at = if matches!(dt, GgmlDType::Q4_1 | GgmlDType::Q5_1) {
            4
        } else {
            2
        };
        let (hi, lo) = if dt == GgmlDType::Q8_0 {
            (0x7f, 0x80)
        } else {
            (0xff, 0)
        };
        out[q_at..bsize].fill(hi);
        out[last + q_at..].fill(lo);
        out
    }

    /// For every mapped type and a few shapes, the affine weight dequantizes (`s * u + b` in
    /// f32, the kernels' layout) to exactly candle's dequantization of the same GGUF bytes,
    /// edge values of d / m and q included; only the sign of a zero may differ.
    #[test]
    fn mapped_blocks_dequantize_exactly_like_gguf() {
        use GgmlDType::*;
        for (i, dt) in [Q4_0, Q4_1, Q8_0, Q5_0, Q5_1].into_iter().enumerate() {
            let shapes: &[(usize, usize)] = if affine_bits(dt) == Some(4) {
                &[(1, 128), (3, 256), (7, 640)]
            } else {
                &[(1, 64), (3, 192), (5, 512)]
            };
            for (j, &(n, k)) in shapes.iter().enumerate() {
                let data = blocks(dt, n, k, (10 * i + j) as u64);
                let want = candle_dequant(dt, &data, n, k);
                let w = kept(from_gguf(dt, &data, n, k, &Device::Cpu).unwrap());
                assert_eq!(
                    (w.bits, w.group, w.n, w.k, w.f16),
                    (affine_bits(dt).unwrap(), 32, n, k, true)
                );
                assert_eq!(w.bytes() as u64, kept_bytes(dt, n, k).unwrap());
                let got = w.dequantize_host().unwrap();
                let mut zero_signs = 0;
                for (e, (g, x)) in got.iter().zip(&want).enumerate() {
                    if g.to_bits() != x.to_bits() {
                        assert!(
                            *g == 0.0 && *x == 0.0,
                            "{dt:?} [{n}, {k}] element {e}: {g:e} vs GGUF {x:e}"
                        );
                        zero_signs += 1;
                    }
                }
                // the test reaches the edge values (not all zero, both extremes of q)
                assert!(
                    want.iter().any(|v| v.abs() > 1000.0),
                    "{dt:?}: no large weights"
                );
                assert!(
                    zero_signs < got.len() / 4,
                    "{dt:?}: {zero_signs} signed zeros"
                );
            }
        }
    }

    /// `n * k / 256` random K-quant super-blocks (Q4_K / Q5_K); d and dmin from `half`.
    fn k_blocks(
        dt: GgmlDType,
        n: usize,
        k: usize,
        rng: &mut crate::rng::Rng,
        half: &mut dyn FnMut(&mut crate::rng::Rng) -> f16,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..n * k / 256 {
            let mut b: Vec<u8> = (0..dt.type_size())
                .map(|_| (rng.uniform() * 256.0) as u8)
                .collect();
            let (d, dmin) = (half(rng), half(rng));
            b[0..2].copy_from_slice(&d.to_bits().to_le_bytes());
            b[2..4].copy_from_slice(&dmin.to_bits().to_le_bytes());
            out.extend(b);
        }
        out
    }

    /// Q4_K / Q5_K: where d * sc and dmin * m fit f16 (d, dmin with at most 5 significant
    /// bits, normal products), the affine weight dequantizes to exactly candle's weights; for
    /// any d, dmin within the stated rounding: |error| <= 2^-11 (|d| 63 qmax + |dmin| 63).
    #[test]
    fn k_quants_map_with_f16_rounded_scales() {
        let mut rng = crate::rng::Rng::new(21);
        for dt in [GgmlDType::Q4K, GgmlDType::Q5K] {
            assert!(!exact(dt));
            let qmax = if dt == GgmlDType::Q4K { 15.0 } else { 31.0 };
            for &(n, k) in &[(1usize, 256usize), (3, 512), (2, 1024)] {
                // exact: a 5-bit integer times 2^e, products at least 2^-14
                let mut short = |r: &mut crate::rng::Rng| {
                    let m = 1 + r.below(31) as i32;
                    let e = -12 - r.below(4) as i32;
                    let sign = if r.uniform() < 0.5 { -1.0 } else { 1.0 };
                    f16::from_f32(sign * m as f32 * 2f32.powi(e))
                };
                let data = k_blocks(dt, n, k, &mut rng, &mut short);
                let want = candle_dequant(dt, &data, n, k);
                let w = kept(from_gguf(dt, &data, n, k, &Device::Cpu).unwrap());
                assert_eq!(w.bits, affine_bits(dt).unwrap());
                assert_eq!(w.bytes() as u64, kept_bytes(dt, n, k).unwrap());
                let got = w.dequantize_host().unwrap();
                for (e, (g, x)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g == x,
                        "{dt:?} [{n}, {k}] exact scales, element {e}: {g:e} vs {x:e}"
                    );
                }
                // any d, dmin: within the rounding bound, per super-block
                let mut any = |r: &mut crate::rng::Rng| f16::from_f64((r.uniform() - 0.5) * 0.02);
                let data = k_blocks(dt, n, k, &mut rng, &mut any);
                let want = candle_dequant(dt, &data, n, k);
                let got = kept(from_gguf(dt, &data, n, k, &Device::Cpu).unwrap())
                    .dequantize_host()
                    .unwrap();
                let (mut rounded, bsize) = (0, dt.type_size());
                for (e, (g, x)) in got.iter().zip(&want).enumerate() {
                    let b = &data[e / 256 * bsize..];
                    let (d, dmin) = (half_at(b, 0).to_f32().abs(), half_at(b, 2).to_f32().abs());
                    let bound = (d * 63.0 * qmax + dmin * 63.0) * 2f32.powi(-11) + 2f32.powi(-24);
                    assert!((g - x).abs() <= bound, "{dt:?} element {e}: {g:e} vs {x:e}");
                    rounded += (g != x) as usize;
                }
                assert!(rounded > 0, "{dt:?}: the random scales never rounded");
            }
        }
        // a product beyond f16 is refused
        let mut big = |_: &mut crate::rng::Rng| f16::from_f32(60000.0);
        let data = k_blocks(GgmlDType::Q4K, 1, 256, &mut rng, &mut big);
        assert!(matches!(
            from_gguf(GgmlDType::Q4K, &data, 1, 256, &Device::Cpu).unwrap(),
            GgufAffine::Refused("scale out of f16 range")
        ));
    }

    /// The packing is MLX's: 4-bit value i at bits 4 * (i % 8) of word i / 8, 8-bit value i
    /// at byte i; checked on one Q4_0 block with values 0..16 and one Q8_0 block.
    #[test]
    fn packing_follows_the_affine_layout() {
        let mut b = vec![0u8; 18 * 4];
        b[0..2].copy_from_slice(&f16::ONE.to_bits().to_le_bytes());
        for j in 0..16 {
            // value j = j, value j + 16 = 15 - j
            b[2 + j] = j as u8 | ((15 - j as u8) << 4);
        }
        let w = kept(from_gguf(GgmlDType::Q4_0, &b, 1, 128, &Device::Cpu).unwrap());
        let v = w.dequantize_host().unwrap();
        let want: Vec<f32> = (0..32)
            .map(|i| {
                if i < 16 {
                    i as f32 - 8.0
                } else {
                    7.0 - (i - 16) as f32
                }
            })
            .collect();
        assert_eq!(&v[..32], &want[..]);
        // the remaining blocks: d = 0
        assert!(v[32..].iter().all(|&x| x == 0.0));
    }

    /// What is not mapped falls back cleanly: a derived bias beyond f16 (Q4_0 d = 8192, Q8_0 /
    /// Q5_0 d = 512), non-finite d or m, widths the kernels do not take, other block types;
    /// a byte count that does not match the shape is an error naming it.
    #[test]
    fn unmappable_matrices_are_refused() {
        use GgmlDType::*;
        let refused = |r: GgufAffine| match r {
            GgufAffine::Refused(why) => why,
            other => panic!("expected a refusal, got {other:?}"),
        };
        for (dt, d) in [
            (Q4_0, 8192.0),
            (Q4_0, -8192.0),
            (Q8_0, 512.0),
            (Q5_0, -512.0),
            (Q4_1, f32::INFINITY),
            (Q5_1, f32::NAN),
        ] {
            let k = if affine_bits(dt) == Some(4) { 128 } else { 64 };
            let mut data = blocks(dt, 2, k, 7);
            let at = dt.type_size() * 3; // the fourth block
            data[at..at + 2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            let why = refused(from_gguf(dt, &data, 2, k, &Device::Cpu).unwrap());
            assert_eq!(why, "scale out of f16 range", "{dt:?} d = {d}");
        }
        let mut data = blocks(Q5_1, 1, 64, 8);
        data[2..4].copy_from_slice(&f16::NEG_INFINITY.to_bits().to_le_bytes());
        assert_eq!(
            refused(from_gguf(Q5_1, &data, 1, 64, &Device::Cpu).unwrap()),
            "scale out of f16 range"
        );
        // widths: 4-bit needs multiples of 128, 8-bit of 64
        for (dt, k) in [(Q4_0, 96), (Q4_1, 64), (Q8_0, 96), (Q5_0, 32)] {
            let data = blocks(dt, 2, k, 9);
            assert!(refused(from_gguf(dt, &data, 2, k, &Device::Cpu).unwrap()).starts_with("width"));
            assert_eq!(kept_bytes(dt, 2, k), None);
        }
        for dt in [Q2K, Q3K, Q6K, Q8_1, F16] {
            let data = vec![0u8; dt.type_size() * 256 / dt.block_size()];
            assert!(matches!(
                from_gguf(dt, &data, 1, 256, &Device::Cpu).unwrap(),
                GgufAffine::NotMapped
            ));
        }
        let e = from_gguf(Q8_0, &[0; 33], 1, 64, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("Q8_0 matrix [1, 64]: 33 bytes, expected 68"),
            "{e}"
        );
    }
}
