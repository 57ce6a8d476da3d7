//! The quantization policy: what a stored quantized matrix becomes on each device. Sources
//! (`source::Weights`) hand out matrices as stored; this module decides, in one place, which are
//! kept and which are requantized, and `Linear` then multiplies them.
//!
//! CPU: types without a fast multi-row kernel are requantized to Q8_0 at load (see
//! [`requant_target`]), except the Q4_0 / Q4_1 / Q5_0 matrices dflash's own int8 product
//! multiplies with their stored weights ([`cpu_target`]); `keep_quant` keeps everything as stored. CUDA: kept as stored
//! (candle's quantized CUDA kernels).

use crate::Result;
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::Device;
use std::sync::Arc;

/// Whether MLX affine-quantized matrices stay as stored ([`crate::nn::AffineWeight`]): on
/// CUDA with bf16 compute, where the affine kernels multiply them (4 or 8 bits; other widths,
/// the embedding table and MoE experts are dequantized at load). On the CPU they are
/// dequantized (no CPU affine product yet).
pub fn keeps_affine(device: &Device, dtype: candle_core::DType) -> bool {
    cfg!(feature = "cuda") && device.is_cuda() && dtype == candle_core::DType::BF16
}

/// The quantized type a CPU matmul weight of type `dt` is converted to at load, or None to
/// keep it. candle's CPU kernels process many rows at once (verify blocks) only for Q8_0,
/// Q4K and Q6K; the other types fall back to per-row dot products (a 16-row product then
/// costs 15-20x one row). Q8_0 was chosen over Q4K by `examples/qmatmul_bench.rs`: as fast
/// for 1 and 16 rows, always applicable (Q4K needs rows that are multiples of 256), and
/// near-lossless on 4/5-bit sources (Q4K would re-round them).
///
/// Q6K goes to Q8_0 too, for exactness rather than speed: candle multiplies one row by a Q6K
/// matrix with its compact-weight GEMV and several rows with its repacked tile kernel, which
/// round differently, so a verify's logits would differ from the decode steps' (0.64-0.70 on
/// Gemma-3-270M Q4_K_M, docs/perf.md) and greedy DFlash could drift from plain decoding. Q8_0
/// and Q4K take the same kernel for one row and for many. Q6K tensors are a small share of
/// the usual K-quant mixes (9.7 of 247 MB in Gemma-3-270M Q4_K_M); `--keep-quant` keeps them.
pub fn requant_target(dt: GgmlDType) -> Option<GgmlDType> {
    use GgmlDType::*;
    match dt {
        F32 | F16 | BF16 | Q8_0 | Q4K => None,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_1 | Q2K | Q3K | Q5K | Q6K | Q8K => Some(Q8_0),
    }
}

/// What a stored GGUF matrix of width `cols` becomes on the CPU: [`requant_target`], except
/// the Q4_0 / Q4_1 / Q5_0 matrices whose stored weights dflash's own int8 product multiplies
/// ([`crate::nn::q8::keeps_as_stored`]): Q4 at 0.56-0.63 bytes a weight instead of Q8_0's
/// 1.06, Q5_0 exactly (requantizing it to Q8_0 re-rounds every weight).
pub fn cpu_target(dt: GgmlDType, cols: usize) -> Option<GgmlDType> {
    if crate::nn::q8::keeps_as_stored(dt, cols) {
        None
    } else {
        requant_target(dt)
    }
}

/// Place a stored quantized matrix on `device` per the policy above; `note` gets one line per
/// matrix (`Q4_1->Q8_0`, `Q8_0`, `F16`) for the load report. None for float types.
pub fn place(
    q: Arc<QTensor>,
    device: &Device,
    keep_quant: bool,
    note: &mut dyn FnMut(String),
) -> Result<Option<QMatMul>> {
    let dt = q.dtype();
    if matches!(dt, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
        note(format!("{dt:?}"));
        return Ok(None);
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
            note(format!("{dt:?}"));
            q
        }
    };
    let q = if device.is_cpu() {
        q
    } else {
        let storage = QStorage::from_data(q.data()?, device, q.dtype())?;
        Arc::new(QTensor::new(storage, q.shape().clone())?)
    };
    Ok(Some(QMatMul::from_arc(q)?))
}
