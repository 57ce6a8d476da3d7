//! The quantization policy: what a stored quantized matrix becomes on each device. Sources
//! (`source::Weights`) hand out matrices as stored; this module decides, in one place, which are
//! kept and which are requantized, and `Linear` then multiplies them.
//!
//! CPU: types without a fast multi-row kernel are requantized to Q8_0 at load (see
//! [`requant_target`]), except the Q4_0 / Q4_1 / Q5_0 matrices dflash's own int8 product
//! multiplies with their stored weights ([`cpu_target`]); `keep_quant` keeps everything as stored. CUDA: kept as stored;
//! with bf16 compute the Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 matrices the affine kernels take are
//! rewritten as affine weights with exactly the stored weights, Q4_K / Q5_K ones with their
//! scales rounded to f16 unless `keep_quant` ([`keeps_gguf_affine`], [`gguf_affine_type`],
//! [`crate::nn::gguf_affine`]: batch-invariant); those types at widths the affine kernels do
//! not take are dequantized to the compute dtype (dense: batch-invariant too) unless
//! `keep_quant`; the others (Q6_K, Q2_K, ...) go to candle's quantized CUDA kernels.

use crate::nn::gguf_affine::{self, GgufAffine};
use crate::nn::AffineWeight;
use crate::Result;
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device};
use std::sync::Arc;

/// Whether MLX affine-quantized matrices stay as stored ([`crate::nn::AffineWeight`]): on
/// CUDA with bf16 compute, where the affine kernels multiply them (4 or 8 bits; other widths,
/// the embedding table and MoE experts are dequantized at load). On the CPU they are
/// dequantized (no CPU affine product yet).
pub fn keeps_affine(device: &Device, dtype: DType) -> bool {
    cfg!(feature = "cuda") && device.is_cuda() && dtype == DType::BF16
}

/// Whether MXFP4 expert stacks (gpt-oss) stay as stored ([`crate::nn::Mxfp4Stack`]): on CUDA
/// with bf16 compute, where the MoE kernels dequantize them in registers, at widths those
/// kernels take (hidden and expert width multiples of 32). Elsewhere they are dequantized
/// exactly at load.
pub fn keeps_mxfp4(device: &Device, dtype: DType, hidden: usize, inter: usize) -> bool {
    keeps_affine(device, dtype) && hidden.is_multiple_of(32) && inter.is_multiple_of(32)
}

/// The quantized type a CPU matmul weight of type `dt` is converted to at load, or None to
/// keep it. candle's CPU kernels process many rows at once (verify blocks) only for Q8_0,
/// Q4K and Q6K; the other types fall back to per-row dot products (a 16-row product then
/// costs 15-20x one row). Q8_0 was chosen over Q4K by `examples/qmatmul_bench.rs`: as fast
/// for 1 and 16 rows, always applicable (Q4K needs rows that are multiples of 256), and
/// near-lossless on 4/5-bit sources (Q4K would re-round them).
///
/// Q6K goes to Q8_0 here, for exactness rather than speed: candle multiplies one row by a Q6K
/// matrix with its compact-weight GEMV and several rows with its repacked tile kernel, which
/// round differently, so a verify's logits would differ from the decode steps' (0.64-0.70 on
/// Gemma-3-270M Q4_K_M, docs/perf.md) and greedy DFlash could drift from plain decoding. Q8_0
/// and Q4K take the same kernel for one row and for many. Where dflash's own int8 product
/// runs ([`cpu_target`]), Q6K at widths of whole super-blocks keeps its stored weights instead
/// (row-invariant like every kind of that product).
pub fn requant_target(dt: GgmlDType) -> Option<GgmlDType> {
    use GgmlDType::*;
    match dt {
        F32 | F16 | BF16 | Q8_0 | Q4K => None,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_1 | Q2K | Q3K | Q5K | Q6K | Q8K => Some(Q8_0),
    }
}

/// What a stored GGUF matrix of width `cols` becomes on the CPU: [`requant_target`], except
/// the Q4_0 / Q4_1 / Q5_0 / Q6_K matrices whose stored weights dflash's own int8 product
/// multiplies ([`crate::nn::q8::keeps_as_stored`]): Q4 at 0.56-0.63 bytes a weight instead of
/// Q8_0's 1.06, Q5_0 and Q6_K exactly (requantizing them to Q8_0 re-rounds every weight).
pub fn cpu_target(dt: GgmlDType, cols: usize) -> Option<GgmlDType> {
    if crate::nn::q8::keeps_as_stored(dt, cols) {
        None
    } else {
        requant_target(dt)
    }
}

/// What a stored GGUF matrix became ([`place`]).
#[derive(Debug)]
pub enum Placed {
    /// A float type: the caller loads it dense.
    Float,
    /// A quantized matrix for candle's kernels (CUDA) or dflash's / candle's CPU products.
    Quant(QMatMul),
    /// Rewritten as an affine weight with exactly the stored weights (CUDA, bf16 compute:
    /// [`keeps_gguf_affine`]), for [`crate::nn::Linear::Affine`].
    Affine(AffineWeight),
}

/// Whether GGUF matrices of the types [`gguf_affine`] maps ([`gguf_affine_type`], at widths
/// the kernels take) become affine weights: where MLX affine ones stay as stored
/// ([`keeps_affine`]: CUDA with bf16 compute). candle's quantized CUDA kernels are not
/// batch-invariant (a verify row's bits differ from a decode step's); the affine kernels are.
pub fn keeps_gguf_affine(device: &Device, dtype: DType) -> bool {
    keeps_affine(device, dtype)
}

/// Whether a GGUF matrix of type `dt` becomes an affine weight where [`keeps_gguf_affine`]
/// holds (and the kernels take its width): Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 always (exactly the
/// stored weights); Q4_K and Q5_K, whose scales and mins are then rounded to f16, unless
/// `keep_quant` (which keeps them for candle's kernels, exact but not batch-invariant).
pub fn gguf_affine_type(dt: GgmlDType, keep_quant: bool) -> bool {
    gguf_affine::affine_bits(dt).is_some() && (gguf_affine::exact(dt) || !keep_quant)
}

/// Place a stored quantized matrix on `device` per the policy above; `note` gets one line per
/// matrix (`Q4_1->Q8_0`, `Q8_0`, `Q4_0->affine 4-bit g32`, `F16`) for the load report.
pub fn place(
    q: Arc<QTensor>,
    device: &Device,
    dtype: DType,
    keep_quant: bool,
    note: &mut dyn FnMut(String),
) -> Result<Placed> {
    place_as(
        q,
        device,
        keeps_gguf_affine(device, dtype),
        keep_quant,
        note,
    )
}

/// [`place`] with the affine choice given (`affine`: [`keeps_gguf_affine`]).
fn place_as(
    q: Arc<QTensor>,
    device: &Device,
    affine: bool,
    keep_quant: bool,
    note: &mut dyn FnMut(String),
) -> Result<Placed> {
    let dt = q.dtype();
    if matches!(dt, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
        note(format!("{dt:?}"));
        return Ok(Placed::Float);
    }
    // why a mapped type stays on the quantized path, for the report
    let mut refused = None;
    if affine && gguf_affine_type(dt, keep_quant) {
        if let [n, k] = *q.shape().dims() {
            match gguf_affine::from_gguf(dt, &q.data()?, n, k, device)? {
                GgufAffine::Kept(w) => {
                    let rounded = match gguf_affine::exact(dt) {
                        true => "",
                        false => " (scales rounded to f16)",
                    };
                    note(format!("{dt:?}->affine {}-bit g32{rounded}", w.bits));
                    return Ok(Placed::Affine(w));
                }
                GgufAffine::Refused(why) => refused = Some(why),
                GgufAffine::NotMapped => {}
            }
        }
    }
    // A mapped type the affine kernels refuse (a width they do not take: SmolLM2's 576) is
    // dequantized to the compute dtype rather than left to candle's quantized CUDA kernels,
    // which are not batch-invariant (a 16-row verify then differs from decode steps: greedy
    // DFlash != plain decoding) and slow at a batch's rows (session 43: 135M Q4_1 on an H100
    // decoded ~150 tok/s and generated ~260 tok/s at 128 sequences). `keep_quant` keeps them.
    if let (Some(why), false) = (&refused, keep_quant) {
        note(format!("{dt:?}->dense (not affine: {why})"));
        return Ok(Placed::Float);
    }
    let target = if keep_quant || !device.is_cpu() {
        None
    } else {
        cpu_target(dt, q.shape().dims().last().copied().unwrap_or(0))
    };
    let q = match target {
        Some(t) => {
            note(format!("{dt:?}->{t:?}"));
            Arc::new(QTensor::quantize(&q.dequantize(&Device::Cpu)?, t)?)
        }
        None => {
            match refused {
                Some(why) => note(format!("{dt:?} (not affine: {why})")),
                None => note(format!("{dt:?}")),
            }
            q
        }
    };
    let q = if device.is_cpu() {
        q
    } else {
        let storage = QStorage::from_data(q.data()?, device, q.dtype())?;
        Arc::new(QTensor::new(storage, q.shape().clone())?)
    };
    Ok(Placed::Quant(QMatMul::from_arc(q)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    fn stored(dt: GgmlDType, n: usize, k: usize) -> Arc<QTensor> {
        let w = Tensor::rand(-1f32, 1f32, (n, k), &Device::Cpu).unwrap();
        Arc::new(QTensor::quantize(&w, dt).unwrap())
    }

    fn placed(q: Arc<QTensor>, affine: bool, keep_quant: bool) -> (Placed, Vec<String>) {
        let mut notes = vec![];
        let p = place_as(q, &Device::Cpu, affine, keep_quant, &mut |n| notes.push(n)).unwrap();
        (p, notes)
    }

    /// Where GGUF matrices become affine weights (the CUDA bf16 choice, forced here on the
    /// CPU), each exactly mapped type at a width the kernels take does, with its note and the
    /// stored weights, whatever `keep_quant`; K-quants unless `keep_quant`, noted as rounded;
    /// a width the kernels do not take stays quantized and the note says why; other types
    /// and float types are untouched. Without the choice (the CPU) nothing is affine.
    #[test]
    fn gguf_affine_policy() {
        use GgmlDType::*;
        for (dt, k, note) in [
            (Q4_0, 256, "Q4_0->affine 4-bit g32"),
            (Q4_1, 128, "Q4_1->affine 4-bit g32"),
            (Q8_0, 64, "Q8_0->affine 8-bit g32"),
            (Q5_0, 192, "Q5_0->affine 8-bit g32"),
            (Q5_1, 64, "Q5_1->affine 8-bit g32"),
        ] {
            for keep in [false, true] {
                let q = stored(dt, 4, k);
                let want = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
                let (p, notes) = placed(q, true, keep);
                let Placed::Affine(w) = p else {
                    panic!("{dt:?}: {p:?}")
                };
                assert_eq!(notes, [note]);
                assert_eq!(w.dequantize_host().unwrap(), want.to_vec1::<f32>().unwrap());
            }
            // the CPU policy (affine off) is today's: kept or requantized, never affine
            let (p, _) = placed(stored(dt, 4, k), false, false);
            assert!(matches!(p, Placed::Quant(_)), "{dt:?} on the CPU: {p:?}");
        }
        // K-quants: affine with rounded scales, or for candle's kernels under keep_quant
        for (dt, note) in [
            (Q4K, "Q4K->affine 4-bit g32 (scales rounded to f16)"),
            (Q5K, "Q5K->affine 8-bit g32 (scales rounded to f16)"),
        ] {
            let (p, notes) = placed(stored(dt, 4, 512), true, false);
            assert!(matches!(p, Placed::Affine(_)), "{dt:?}: {p:?}");
            assert_eq!(notes, [note]);
            let (p, notes) = placed(stored(dt, 4, 512), true, true);
            assert!(matches!(p, Placed::Quant(_)), "{dt:?} keep_quant: {p:?}");
            assert_eq!(notes, [format!("{dt:?}")]);
        }
        // a width the affine kernels refuse: dense (batch-invariant kernels), or candle's
        // kernels under keep_quant
        let (p, notes) = placed(stored(Q4_0, 4, 96), true, true);
        assert!(matches!(p, Placed::Quant(_)), "{p:?}");
        assert_eq!(notes, ["Q4_0 (not affine: width not a multiple of 128)"]);
        let (p, notes) = placed(stored(Q4_1, 4, 576), true, false);
        assert!(matches!(p, Placed::Float), "{p:?}");
        assert_eq!(
            notes,
            ["Q4_1->dense (not affine: width not a multiple of 128)"]
        );
        let (p, notes) = placed(stored(Q6K, 4, 256), true, true);
        assert!(matches!(p, Placed::Quant(_)), "{p:?}");
        assert_eq!(notes, ["Q6K"]);
        let (p, notes) = placed(stored(F16, 4, 256), true, true);
        assert!(matches!(p, Placed::Float), "{p:?}");
        assert_eq!(notes, ["F16"]);
        assert!(!keeps_gguf_affine(&Device::Cpu, DType::BF16));
    }
}
