//! Q8_0 matrices on the CPU with our own product: `x [m, k] f32 @ w [n, k]^T` where `w` is
//! stored as Q8_0 (blocks of 32 int8 weights with one scale), the GGUF type every slow CPU
//! block type is requantized to at load.
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

/// A Q8_0 weight `[rows, cols]`: int8 quants row-major, one f32 scale per 32 of them.
#[derive(Debug, Clone)]
pub struct Q8Matrix {
    rows: usize,
    cols: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
}

impl Q8Matrix {
    /// From a CPU Q8_0 tensor `[rows, cols]`; None for any other type or device.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        if q.dtype() != GgmlDType::Q8_0 || !q.device().is_cpu() {
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
        if data.len() != blocks * (2 + QK) {
            return Ok(None);
        }
        let mut qs = Vec::with_capacity(rows * cols);
        let mut d = Vec::with_capacity(blocks);
        for b in data.chunks_exact(2 + QK) {
            d.push(f16::from_le_bytes([b[0], b[1]]).to_f32());
            qs.extend(b[2..].iter().map(|&v| v as i8));
        }
        Ok(Some(Self { rows, cols, qs, d }))
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held (quants and f32 scales).
    pub fn bytes(&self) -> usize {
        self.qs.len() + self.d.len() * 4
    }

    /// Whether candle would multiply this shape with its per-block dot (rows not a multiple
    /// of 256), where this product is 2-3x faster; for multiples of 256 candle's tiled kernel
    /// wins (`examples/q8_bench.rs`, docs/perf.md) and the caller keeps candle's.
    pub fn preferred_for(cols: usize) -> bool {
        cols % 256 != 0 && cols % QK == 0
    }

    /// Several matrices of one width stacked along the rows (bit-exact: rows are independent).
    pub fn stack(parts: &[&Q8Matrix]) -> Option<Q8Matrix> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        Some(Q8Matrix {
            rows: parts.iter().map(|p| p.rows).sum(),
            cols,
            qs: parts.iter().flat_map(|p| p.qs.iter().copied()).collect(),
            d: parts.iter().flat_map(|p| p.d.iter().copied()).collect(),
        })
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
        let (xq, xd) = quantize_rows(&xv, k);
        let n = self.rows;
        let mut out = vec![0f32; m * n];
        let out_ptr = out.as_mut_ptr() as usize;
        let kb = k / QK;
        let simd = simd_available();
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(4), |range| {
            let out = out_ptr as *mut f32;
            for g in range {
                let r0 = g * 4;
                let nr = (n - r0).min(4);
                for r in 0..m {
                    let (xr, dr) = (&xq[r * k..(r + 1) * k], &xd[r * kb..]);
                    let acc = dot_rows(simd, self, r0, nr, xr, dr);
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

/// ggml's Q8_0 rule per block of 32: `d = amax / 127`, `q = round(x / d)`, `d` rounded to f16.
fn quantize_rows(x: &[f32], k: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; x.len()];
    let mut d = Vec::with_capacity(x.len() / QK);
    for (xs, qs) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)) {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let dd = amax / 127.0;
        let id = if dd != 0.0 { 1.0 / dd } else { 0.0 };
        for (o, v) in qs.iter_mut().zip(xs) {
            *o = (v * id).round() as i8;
        }
        d.push(f16::from_f32(dd).to_f32());
    }
    debug_assert_eq!(x.len() % k, 0);
    (q, d)
}

/// Up to 4 consecutive weight rows from `r0` against one quantized activation row; `simd`
/// from [`simd_available`].
fn dot_rows(simd: bool, w: &Q8Matrix, r0: usize, nr: usize, xq: &[i8], xd: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` says the CPU has the features; slices are in bounds.
        return unsafe { x86::dot_rows_vnni(w, r0, nr, xq, xd) };
    }
    let _ = simd;
    dot_rows_scalar(w, r0, nr, xq, xd)
}

/// Per block: exact int32 sum of the 32 products, then `acc += (dw * dx) * sum` over eight
/// lanes (block j's sum spread as the SIMD path spreads it), lanes summed at the end, so the
/// scalar and SIMD paths give the same bits.
fn dot_rows_scalar(w: &Q8Matrix, r0: usize, nr: usize, xq: &[i8], xd: &[f32]) -> [f32; 4] {
    let k = w.cols;
    let kb = k / QK;
    let mut out = [0f32; 4];
    for (j, o) in out.iter_mut().enumerate().take(nr) {
        let row = r0 + j;
        let wq = &w.qs[row * k..(row + 1) * k];
        let wd = &w.d[row * kb..(row + 1) * kb];
        let mut acc = [0f32; 8];
        for b in 0..kb {
            let s = wd[b] * xd[b];
            for (l, a) in acc.iter_mut().enumerate() {
                let mut lane = 0i32;
                for t in 0..4 {
                    let i = b * QK + l * 4 + t;
                    lane += wq[i] as i32 * xq[i] as i32;
                }
                *a = (lane as f32).mul_add(s, *a);
            }
        }
        *o = hsum8(&acc);
    }
    out
}

/// The 8 lanes summed in the order of the SIMD path's horizontal sum.
fn hsum8(a: &[f32; 8]) -> f32 {
    let h = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let q = [h[0] + h[2], h[1] + h[3]];
    q[0] + q[1]
}

/// Whether the AVX-512 VNNI path runs (checked once; `DFLASH_Q8_SCALAR=1` forces the scalar
/// path, which gives the same bits).
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            std::env::var("DFLASH_Q8_SCALAR").map_or(true, |v| v != "1")
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
    use super::{hsum8, Q8Matrix, QK};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX-512 VNNI/VL/BW and FMA; `r0 + nr <= w.rows`, `xq.len() ==
    /// w.cols`, `xd.len() >= w.cols / 32`.
    #[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx2,fma")]
    pub unsafe fn dot_rows_vnni(
        w: &Q8Matrix,
        r0: usize,
        nr: usize,
        xq: &[i8],
        xd: &[f32],
    ) -> [f32; 4] {
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
                let wp = w.qs.as_ptr().add(row * k + b * QK);
                let wv = _mm256_loadu_si256(wp as *const __m256i);
                // |w| as u8 times x with w's sign: the int8 products, four per i32 lane.
                let aw = _mm256_sign_epi8(wv, wv);
                let sx = _mm256_sign_epi8(x, wv);
                let s32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
                let s = _mm256_set1_ps(*w.d.get_unchecked(row * kb + b) * *xd.get_unchecked(b));
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
            assert!(Q8Matrix::preferred_for(cols));
            let q = q8_weight(rows, cols);
            let ours = Q8Matrix::from_qtensor(&q).unwrap().expect("Q8_0 on CPU");
            let candle = candle_core::quantized::QMatMul::from_qtensor(q).unwrap();
            let x = Tensor::randn(0f32, 1.0, (16, cols), &Device::Cpu).unwrap();
            let got = ours.forward(&x).unwrap();
            let want = candle_core::Module::forward(&candle, &x).unwrap();
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
                "{rows}x{cols}: {diff} vs scale {scale}"
            );
            let all = got.to_vec2::<f32>().unwrap();
            for r in [0, 5, 15] {
                let one = ours
                    .forward(&x.narrow(0, r, 1).unwrap())
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                assert!(one[0] == all[r], "{rows}x{cols}: row {r} alone differs");
            }
            // scalar path == SIMD path, bit for bit
            let xv = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (xq, xd) = quantize_rows(&xv, cols);
            let kb = cols / QK;
            for r0 in (0..rows).step_by(4) {
                let nr = (rows - r0).min(4);
                let a = dot_rows_scalar(&ours, r0, nr, &xq[..cols], &xd[..kb]);
                let b = dot_rows(simd_available(), &ours, r0, nr, &xq[..cols], &xd[..kb]);
                assert_eq!(a, b, "{rows}x{cols} rows {r0}..");
            }
        }
    }
}
