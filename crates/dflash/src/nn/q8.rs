//! Quantized matrices on the CPU with our own product: `x [m, k] f32 @ w [n, k]^T` where `w`
//! is Q8_0 (blocks of 32 int8 weights with one scale; the GGUF type slow CPU block types are
//! requantized to at load) or Q4 (Q4_0 / Q4_1 kept as stored: 32 4-bit weights with a scale and
//! a minimum, ~1/3 fewer bytes per token than their Q8_0 requantization), times activations
//! quantized to 8 bits per block of 32.
//!
//! Why not candle's: for rows whose length is not a multiple of 256 (SmolLM2: 576) candle
//! multiplies Q8_0 matrices with a per-block AVX2 dot that converts both f16 scales on every
//! block and quantizes activations with scalar code; a profile of the demo put ~60% of a
//! decode step there (docs/perf.md). Here the scales are converted to f32 once at load, the
//! activation is quantized once per call with the same rule as ggml (`d = amax / 127`, `q =
//! round(x / d)`, `d` kept as f16), and the int8 products go through AVX-512 VNNI
//! (`vpdpbusd`) where the CPU has it, four weight rows per pass.
//!
//! Batch invariance: a row of the output is computed by the same code, in the same order,
//! whatever the number of rows of x, so a verify's logits equal the decode steps' bit for bit
//! (what greedy DFlash relies on).

use crate::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::f16;

const QK: usize = 32;

/// The weights of a [`QMatrix`], row-major, one f32 scale (and minimum) per block of 32.
#[derive(Debug, Clone)]
enum Quants {
    /// Q8_0: `w = q * d`, q int8.
    Q8 { qs: Vec<i8>, d: Vec<f32> },
    /// Q4_1 (and Q4_0, whose `(q - 8) * d` is `q * d + m` with `m = -8 d`): `w = q * d + m`,
    /// q in 0..16, two per byte as ggml packs them (byte j: element j in the low nibble,
    /// element j + 16 in the high one).
    Q4 {
        qs: Vec<u8>,
        d: Vec<f32>,
        m: Vec<f32>,
        /// Q4_1: the activation's `d * sum(q)` rounded to f16, as ggml's Q8_1 stores it (what
        /// llama.cpp and candle multiply Q4_1 by); Q4_0 (ggml sums `(q - 8) * x` exactly):
        /// kept in f32.
        s16: bool,
    },
}

impl Quants {
    /// Append `other`'s rows; None when the kinds (or Q4 flavours) differ.
    fn extend(&mut self, other: &Quants) -> Option<()> {
        match (self, other) {
            (Quants::Q8 { qs, d }, Quants::Q8 { qs: q2, d: d2 }) => {
                qs.extend_from_slice(q2);
                d.extend_from_slice(d2);
            }
            (
                Quants::Q4 { qs, d, m, s16 },
                Quants::Q4 {
                    qs: q2,
                    d: d2,
                    m: m2,
                    s16: s2,
                },
            ) if s16 == s2 => {
                qs.extend_from_slice(q2);
                d.extend_from_slice(d2);
                m.extend_from_slice(m2);
            }
            _ => return None,
        }
        Some(())
    }
}

/// A quantized weight `[rows, cols]` multiplied by dflash's own int8 product.
#[derive(Debug, Clone)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    w: Quants,
}

impl QMatrix {
    /// From a CPU Q8_0, Q4_0 or Q4_1 tensor `[rows, cols]`; None for any other type or
    /// device.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        let block = match q.dtype() {
            GgmlDType::Q8_0 => 2 + QK,
            GgmlDType::Q4_0 => 2 + QK / 2,
            GgmlDType::Q4_1 => 4 + QK / 2,
            _ => return Ok(None),
        };
        if !q.device().is_cpu() {
            return Ok(None);
        }
        let Ok((rows, cols)) = q.shape().dims2() else {
            return Ok(None);
        };
        if cols % QK != 0 {
            return Ok(None);
        }
        let data = q.data()?;
        let blocks = rows * cols / QK;
        if data.len() != blocks * block {
            return Ok(None);
        }
        let h = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
        let w = match q.dtype() {
            GgmlDType::Q8_0 => {
                let mut qs = Vec::with_capacity(rows * cols);
                let mut d = Vec::with_capacity(blocks);
                for b in data.chunks_exact(block) {
                    d.push(h(b, 0));
                    qs.extend(b[2..].iter().map(|&v| v as i8));
                }
                Quants::Q8 { qs, d }
            }
            dt => {
                let q41 = dt == GgmlDType::Q4_1;
                let mut qs = Vec::with_capacity(rows * cols / 2);
                let (mut d, mut m) = (Vec::with_capacity(blocks), Vec::with_capacity(blocks));
                for b in data.chunks_exact(block) {
                    let dd = h(b, 0);
                    d.push(dd);
                    // -8 * d is exact in f32 (d is an f16 value).
                    m.push(if q41 { h(b, 2) } else { -8.0 * dd });
                    qs.extend_from_slice(&b[if q41 { 4 } else { 2 }..]);
                }
                Quants::Q4 { qs, d, m, s16: q41 }
            }
        };
        Ok(Some(Self { rows, cols, w }))
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held (quants, f32 scales and minimums).
    pub fn bytes(&self) -> usize {
        match &self.w {
            Quants::Q8 { qs, d } => qs.len() + d.len() * 4,
            Quants::Q4 { qs, d, m, .. } => qs.len() + (d.len() + m.len()) * 4,
        }
    }

    /// Whether candle would multiply this shape with its per-block dot (rows not a multiple
    /// of 256), where this product is 2-3x faster; for multiples of 256 candle's tiled kernel
    /// wins (`examples/q8_bench.rs`, docs/perf.md) and the caller keeps candle's.
    pub fn preferred_for(cols: usize) -> bool {
        cols % 256 != 0 && cols % QK == 0
    }

    /// Several matrices of one width and kind stacked along the rows (bit-exact: rows are
    /// independent); None when they differ.
    pub fn stack(parts: &[&QMatrix]) -> Option<QMatrix> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let mut w = parts[0].w.clone();
        for p in &parts[1..] {
            w.extend(&p.w)?;
        }
        Some(QMatrix {
            rows: parts.iter().map(|p| p.rows).sum(),
            cols,
            w,
        })
    }

    /// The activation block sums `d * sum(q)` as this matrix multiplies them: rounded to f16
    /// for Q4_1 (as ggml's Q8_1 stores them, what llama.cpp and candle multiply Q4_1 by).
    fn round_sums(&self, s: &mut [f32]) {
        if let Quants::Q4 { s16: true, .. } = self.w {
            for v in s {
                *v = f16::from_f32(*v).to_f32();
            }
        }
    }

    /// `x [.., cols]` (any float dtype, CPU) -> `[.., rows]` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let k = *dims.last().unwrap_or(&0);
        if k != self.cols {
            return Err(crate::Error::input(format!(
                "q8 matmul: input width {k}, weight width {}",
                self.cols
            )));
        }
        let xv = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let m = xv.len() / k.max(1);
        let (xq, xd, mut xs) = quantize_rows(&xv, k);
        self.round_sums(&mut xs);
        let n = self.rows;
        let mut out = vec![0f32; m * n];
        let out_ptr = out.as_mut_ptr() as usize;
        let kb = k / QK;
        let simd = simd_available();
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(4), |range| {
            let out = out_ptr as *mut f32;
            // Q4 with several rows of x: a group's 4 weight rows unpacked to one byte a weight
            // once for all of them (with one or two rows, unpacking in registers is faster).
            // The same bytes reach the same products either way: the bits do not change.
            let mut unpacked = Vec::new();
            let pre = m >= 4;
            for g in range {
                let r0 = g * 4;
                let nr = (n - r0).min(4);
                if pre {
                    unpack_q4(self, r0, nr, &mut unpacked);
                }
                let u = pre.then_some(unpacked.as_slice());
                for r in 0..m {
                    let x = QRow {
                        q: &xq[r * k..(r + 1) * k],
                        d: &xd[r * kb..(r + 1) * kb],
                        s: &xs[r * kb..(r + 1) * kb],
                    };
                    let acc = dot_rows(simd, self, r0, nr, &x, u);
                    for (j, v) in acc.iter().take(nr).enumerate() {
                        // SAFETY: each (r, r0 + j) is written by exactly one chunk.
                        unsafe { *out.add(r * n + r0 + j) = *v };
                    }
                }
            }
        });
        let mut od = dims;
        *od.last_mut().expect("rank >= 1") = n;
        Ok(Tensor::from_vec(out, od, &Device::Cpu)?)
    }
}

/// One activation row quantized per block of 32: quants, scales, and `d * sum(q)` per block
/// (what a Q4 weight's minimum multiplies; see [`QMatrix::round_sums`]).
struct QRow<'a> {
    q: &'a [i8],
    d: &'a [f32],
    s: &'a [f32],
}

/// ggml's Q8_0 rule per block of 32: `d = amax / 127`, `q = round(x / d)`, `d` rounded to f16;
/// also `d * sum(q)` per block (ggml's Q8_1 `s`).
fn quantize_rows(x: &[f32], k: usize) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
    let mut q = vec![0i8; x.len()];
    let mut d = Vec::with_capacity(x.len() / QK);
    let mut s = Vec::with_capacity(x.len() / QK);
    for (xs, qs) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)) {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let dd = amax / 127.0;
        let id = if dd != 0.0 { 1.0 / dd } else { 0.0 };
        let mut sum = 0i32;
        for (o, v) in qs.iter_mut().zip(xs) {
            *o = (v * id).round() as i8;
            sum += *o as i32;
        }
        let dd = f16::from_f32(dd).to_f32();
        d.push(dd);
        s.push(dd * sum as f32);
    }
    debug_assert_eq!(x.len() % k, 0);
    (q, d, s)
}

/// Up to 4 consecutive weight rows from `r0` against one quantized activation row; `simd`
/// from [`simd_available`].
/// `u`: for Q4 weights, the rows `r0..r0 + nr` as [`unpack_q4`] left them, or None to unpack
/// on the fly.
fn dot_rows(simd: bool, w: &QMatrix, r0: usize, nr: usize, x: &QRow, u: Option<&[u8]>) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` says the CPU has the features; slices are in bounds.
        return unsafe {
            match &w.w {
                Quants::Q8 { .. } => x86::dot_rows_vnni(w, r0, nr, x),
                Quants::Q4 { .. } => x86::dot_rows_q4_vnni(w, r0, nr, x, u),
            }
        };
    }
    let _ = simd;
    dot_rows_scalar(w, r0, nr, x, u)
}

/// Q4 weights: rows `r0..r0 + nr` unpacked into `u` (row-major, one byte a weight, in element
/// order); nothing for Q8.
fn unpack_q4(w: &QMatrix, r0: usize, nr: usize, u: &mut Vec<u8>) {
    let Quants::Q4 { qs, .. } = &w.w else {
        return;
    };
    let k = w.cols;
    u.resize(nr * k, 0);
    let packed = &qs[r0 * k / 2..(r0 + nr) * k / 2];
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        // SAFETY: the CPU has AVX2 (implied by the VNNI check); `u` holds 2 bytes per packed one.
        unsafe { x86::unpack_q4(packed, u) };
        return;
    }
    for (src, dst) in packed.chunks_exact(QK / 2).zip(u.chunks_exact_mut(QK)) {
        let (lo, hi) = dst.split_at_mut(QK / 2);
        for ((l, h), &byte) in lo.iter_mut().zip(hi.iter_mut()).zip(src) {
            *l = byte & 15;
            *h = byte >> 4;
        }
    }
}

/// Per block: exact int32 sums of the products, four weights per lane (block j's sum spread
/// over eight lanes as the SIMD path spreads it), then `acc += (dw * dx) * sum`; a Q4 weight's
/// minimum adds `m * (dx * sum(qx))` to a separate per-row sum, in block order. Lanes summed at
/// the end, then the minimum's sum added, so the scalar and SIMD paths give the same bits.
fn dot_rows_scalar(w: &QMatrix, r0: usize, nr: usize, x: &QRow, u: Option<&[u8]>) -> [f32; 4] {
    let k = w.cols;
    let kb = k / QK;
    let mut out = [0f32; 4];
    for (j, o) in out.iter_mut().enumerate().take(nr) {
        let row = r0 + j;
        let mut acc = [0f32; 8];
        let mut macc = 0f32;
        for b in 0..kb {
            let mut wq = [0i32; QK];
            let s = match &w.w {
                Quants::Q8 { qs, d } => {
                    for (i, v) in wq.iter_mut().enumerate() {
                        *v = qs[row * k + b * QK + i] as i32;
                    }
                    d[row * kb + b]
                }
                Quants::Q4 { qs, d, m, .. } => {
                    match u {
                        Some(u) => {
                            for (i, v) in wq.iter_mut().enumerate() {
                                *v = u[j * k + b * QK + i] as i32;
                            }
                        }
                        None => {
                            let blk = &qs[(row * kb + b) * (QK / 2)..][..QK / 2];
                            for (i, &byte) in blk.iter().enumerate() {
                                wq[i] = (byte & 15) as i32;
                                wq[i + QK / 2] = (byte >> 4) as i32;
                            }
                        }
                    }
                    macc = m[row * kb + b].mul_add(x.s[b], macc);
                    d[row * kb + b]
                }
            };
            let s = s * x.d[b];
            for (l, a) in acc.iter_mut().enumerate() {
                let mut lane = 0i32;
                for t in 0..4 {
                    let i = l * 4 + t;
                    lane += wq[i] * x.q[b * QK + i] as i32;
                }
                *a = (lane as f32).mul_add(s, *a);
            }
        }
        *o = hsum8(&acc) + macc;
    }
    out
}

/// The 8 lanes summed in the order of the SIMD path's horizontal sum.
fn hsum8(a: &[f32; 8]) -> f32 {
    let h = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let q = [h[0] + h[2], h[1] + h[3]];
    q[0] + q[1]
}

/// Whether a GGUF matrix of type `dt` and width `cols` stays Q4 on the CPU (multiplied by
/// [`QMatrix`] as stored) instead of being requantized to Q8_0: Q4_0 / Q4_1, a width this
/// product is preferred for ([`QMatrix::preferred_for`]), the VNNI path available (the
/// scalar one is a reference, not a fast path), and neither `DFLASH_Q8=0` nor `DFLASH_Q4=0`.
pub fn keeps_q4(dt: GgmlDType, cols: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    matches!(dt, GgmlDType::Q4_0 | GgmlDType::Q4_1)
        && QMatrix::preferred_for(cols)
        && enabled()
        && *ON.get_or_init(|| simd_available() && crate::switches::get().q4)
}

/// Whether `Linear` uses this product at all (`DFLASH_Q8=0` keeps candle's for every type).
pub fn enabled() -> bool {
    crate::switches::get().q8
}

/// Bytes a kept Q4 block of 32 weights takes in a [`QMatrix`]: 16 of quants, an f32 scale and
/// an f32 minimum (what `memory::weight_bytes` estimates with).
pub const Q4_BLOCK_BYTES: usize = QK / 2 + 8;

/// Whether the AVX-512 VNNI path runs (checked once; `DFLASH_Q8_SCALAR=1` forces the scalar
/// path, which gives the same bits).
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            !crate::switches::get().q8_scalar
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{hsum8, QMatrix, QRow, Quants, QK};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX-512 VNNI/VL/BW and FMA; `w` is Q8; `r0 + nr <= w.rows`,
    /// `x.q.len() == w.cols`, `x.d.len() >= w.cols / 32`.
    #[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx2,fma")]
    pub unsafe fn dot_rows_vnni(w: &QMatrix, r0: usize, nr: usize, x: &QRow) -> [f32; 4] {
        let Quants::Q8 { qs, d } = &w.w else {
            unreachable!("dot_rows dispatches on the kind")
        };
        let (xq, xd) = (x.q, x.d);
        let k = w.cols;
        let kb = k / QK;
        let mut acc = [_mm256_setzero_ps(); 4];
        let xp = xq.as_ptr();
        for b in 0..kb {
            let x = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
            for j in 0..4 {
                if j >= nr {
                    break;
                }
                let row = r0 + j;
                let wp = qs.as_ptr().add(row * k + b * QK);
                let wv = _mm256_loadu_si256(wp as *const __m256i);
                // |w| as u8 times x with w's sign: the int8 products, four per i32 lane.
                let aw = _mm256_sign_epi8(wv, wv);
                let sx = _mm256_sign_epi8(x, wv);
                let s32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
                let s = _mm256_set1_ps(*d.get_unchecked(row * kb + b) * *xd.get_unchecked(b));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), s, acc[j]);
            }
        }
        let mut out = [0f32; 4];
        for j in 0..nr {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[j]);
            out[j] = hsum8(&lanes);
        }
        out
    }

    /// [`super::unpack_q4`]'s loop, 16 packed bytes (one block) at a time.
    ///
    /// # Safety
    /// AVX2; `u.len() >= 2 * packed.len()`, `packed.len() % 16 == 0`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn unpack_q4(packed: &[u8], u: &mut [u8]) {
        let lo = _mm_set1_epi8(0x0f);
        for b in 0..packed.len() / (QK / 2) {
            let p = _mm_loadu_si128(packed.as_ptr().add(b * (QK / 2)) as *const __m128i);
            let wl = _mm_and_si128(p, lo);
            let wh = _mm_and_si128(_mm_srli_epi16(p, 4), lo);
            _mm256_storeu_si256(
                u.as_mut_ptr().add(b * QK) as *mut __m256i,
                _mm256_set_m128i(wh, wl),
            );
        }
    }

    /// Q4 weights, unpacked in registers or taken from `u` (rows `r0..r0 + nr`, one u8 a
    /// weight), times the int8 activations with `vpdpbusd` (u8 x i8, no sign trick needed);
    /// the minimum's term per block as in the scalar path.
    ///
    /// # Safety
    /// As [`dot_rows_vnni`], with `w` Q4, `x.s.len() >= w.cols / 32` and `u.len() >= nr *
    /// w.cols`.
    #[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx2,fma")]
    pub unsafe fn dot_rows_q4_vnni(
        w: &QMatrix,
        r0: usize,
        nr: usize,
        x: &QRow,
        u: Option<&[u8]>,
    ) -> [f32; 4] {
        let Quants::Q4 { qs, d, m, .. } = &w.w else {
            unreachable!("dot_rows dispatches on the kind")
        };
        let k = w.cols;
        let kb = k / QK;
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut macc = [0f32; 4];
        let lo = _mm_set1_epi8(0x0f);
        let xp = x.q.as_ptr();
        for b in 0..kb {
            let xv = _mm256_loadu_si256(xp.add(b * QK) as *const __m256i);
            let dx = *x.d.get_unchecked(b);
            let sx = *x.s.get_unchecked(b);
            for j in 0..4 {
                if j >= nr {
                    break;
                }
                let blk = (r0 + j) * kb + b;
                let wv = match u {
                    Some(u) => _mm256_loadu_si256(u.as_ptr().add(j * k + b * QK) as *const __m256i),
                    None => {
                        // Low nibbles are elements 0..16, high ones 16..32.
                        let p = _mm_loadu_si128(qs.as_ptr().add(blk * (QK / 2)) as *const __m128i);
                        let wl = _mm_and_si128(p, lo);
                        let wh = _mm_and_si128(_mm_srli_epi16(p, 4), lo);
                        _mm256_set_m128i(wh, wl)
                    }
                };
                let s32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
                let s = _mm256_set1_ps(*d.get_unchecked(blk) * dx);
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), s, acc[j]);
                macc[j] = m.get_unchecked(blk).mul_add(sx, macc[j]);
            }
        }
        let mut out = [0f32; 4];
        for j in 0..nr {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[j]);
            out[j] = hsum8(&lanes) + macc[j];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q8_weight(rows: usize, cols: usize) -> QTensor {
        let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()
    }

    /// Against candle's own Q8_0 product on the widths this kernel is used for (not a
    /// multiple of 256: there candle quantizes activations to Q8_0 the same way; for
    /// multiples of 256 its tiled kernel uses Q8_K activations): equal up to f32 summation
    /// order; the scalar and VNNI paths give the same bits; a row of x gives the same bits
    /// alone and among 16 rows.
    #[test]
    fn q8_product_matches_candle_and_is_row_invariant() {
        for (rows, cols) in [(49, 576), (64, 1504), (7, 32), (33, 640)] {
            assert!(QMatrix::preferred_for(cols));
            let q = q8_weight(rows, cols);
            let ours = QMatrix::from_qtensor(&q).unwrap().expect("Q8_0 on CPU");
            let x = Tensor::randn(0f32, 1.0, (16, cols), &Device::Cpu).unwrap();
            assert_matches_candle(&ours, q, &x, &[0, 5, 15], &format!("{rows}x{cols}"));
        }
    }

    /// `ours` against candle's product with the same quantized weights `q` on `x [16, cols]`:
    /// within 1e-5 of the output scale; the rows `alone` give the same bits multiplied alone
    /// as among the 16; the scalar and SIMD paths give the same bits. Returns the 16 rows.
    fn assert_matches_candle(
        ours: &QMatrix,
        q: QTensor,
        x: &Tensor,
        alone: &[usize],
        label: &str,
    ) -> Vec<Vec<f32>> {
        let got = ours.forward(x).unwrap();
        let candle = candle_core::quantized::QMatMul::from_qtensor(q).unwrap();
        let want = candle_core::Module::forward(&candle, x).unwrap();
        let max_abs = |t: &Tensor| {
            t.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let diff = max_abs(&(&got - &want).unwrap());
        let scale = max_abs(&want);
        assert!(
            diff <= 1e-5 * scale.max(1.0),
            "{label}: {diff} vs scale {scale}"
        );
        let all = got.to_vec2::<f32>().unwrap();
        for &r in alone {
            let one = ours
                .forward(&x.narrow(0, r, 1).unwrap())
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            assert!(one[0] == all[r], "{label}: row {r} alone differs");
        }
        assert_scalar_equals_simd(ours, x);
        all
    }

    /// The scalar and SIMD paths give the same bits for every group of 4 rows.
    fn assert_scalar_equals_simd(w: &QMatrix, x: &Tensor) {
        let (rows, cols) = (w.rows, w.cols);
        let xv = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (xq, xd, mut xs) = quantize_rows(&xv, cols);
        w.round_sums(&mut xs);
        let kb = cols / QK;
        let row = QRow {
            q: &xq[..cols],
            d: &xd[..kb],
            s: &xs[..kb],
        };
        let mut u = Vec::new();
        for r0 in (0..rows).step_by(4) {
            let nr = (rows - r0).min(4);
            unpack_q4(w, r0, nr, &mut u);
            let a = dot_rows_scalar(w, r0, nr, &row, None);
            for uu in [None, Some(u.as_slice())] {
                assert_eq!(
                    a,
                    dot_rows_scalar(w, r0, nr, &row, uu),
                    "{rows}x{cols} rows {r0}.."
                );
                let b = dot_rows(simd_available(), w, r0, nr, &row, uu);
                assert_eq!(a, b, "{rows}x{cols} rows {r0}..");
            }
        }
    }

    /// Q4_0 and Q4_1 weights kept as stored: against candle's product with the same quantized
    /// weights (its Q4 kernels quantize activations to Q8 per block of 32 too, and for Q4_1
    /// round each block's `d * sum(q)` to f16 as we do: equal up to summation order), row
    /// invariance, scalar == SIMD, stacking, and ~1/3 fewer bytes than the Q8_0 requantization.
    #[test]
    fn q4_product_matches_candle_and_is_row_invariant() {
        for dt in [GgmlDType::Q4_0, GgmlDType::Q4_1] {
            for (rows, cols) in [(49, 576), (8, 1504), (5, 32)] {
                let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&w, dt).unwrap();
                let ours = QMatrix::from_qtensor(&q).unwrap().expect("Q4 on CPU");
                let q8 = QMatrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q8_0).unwrap())
                    .unwrap()
                    .unwrap();
                assert!(
                    ours.bytes() * 3 < q8.bytes() * 2 + 1,
                    "{dt:?} {rows}x{cols}"
                );
                let x = Tensor::randn(0f32, 1.0, (16, cols), &Device::Cpu).unwrap();
                let all = assert_matches_candle(
                    &ours,
                    q,
                    &x,
                    &[0, 7, 15],
                    &format!("{dt:?} {rows}x{cols}"),
                );
                // Stacked with itself: the rows repeat, bit for bit; a Q8 part does not stack.
                let st = QMatrix::stack(&[&ours, &ours]).unwrap();
                let both = st.forward(&x).unwrap().to_vec2::<f32>().unwrap();
                assert!(both
                    .iter()
                    .zip(&all)
                    .all(|(b, a)| b[..rows] == a[..] && b[rows..] == a[..]));
                assert!(QMatrix::stack(&[&ours, &q8]).is_none());
            }
        }
    }
}
