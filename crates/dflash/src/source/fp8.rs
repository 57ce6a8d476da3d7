//! FP8 block-quantized safetensors: `quantization_config: {quant_method: "fp8",
//! weight_block_size: [bn, bk]}` (the DeepSeek-V3 / Kimi / Qwen `-FP8` checkpoints). A matrix
//! `X.weight [N, K]` is stored as float8 e4m3 with `X.weight_scale_inv [ceil(N / bn), ceil(K /
//! bk)]` beside it (f32 or bf16), one scale per block, and its value is `fp8 * scale`; the rest
//! (embeddings, norms, modules the quantizer skipped) stays float. Part of `source/`: on CUDA
//! with bf16 compute the linear layers' matrices are kept as stored (`nn::Fp8Weight`, read by
//! [`load_stored`]); everything else is dequantized here at load to the compute dtype
//! ([`load_dequantized`]: the CPU, other dtypes, other reads such as MoE experts or MLA's
//! absorbed `kv_b_proj`, and column blocks the kernels do not take). Activations stay in the
//! compute dtype: `activation_scheme: "dynamic"` (per-token FP8 activations in the publishers'
//! engines) is accepted; a static scheme (`input_scale` tensors) is refused.

use crate::{Error, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

/// The FP8 quantization named by a checkpoint's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Quant {
    /// `weight_block_size`: (rows, columns) of a scale's block.
    pub block: (usize, usize),
}

impl Fp8Quant {
    /// The FP8 quantization of a `config.json` value (its `quantization_config`, or the one of
    /// `text_config`), None when it names another method or none. `file` names the config in
    /// errors.
    pub fn from_config(file: &str, cfg: &Value) -> Result<Option<Self>> {
        let Some((key, q)) = super::quantization_config(cfg) else {
            return Ok(None);
        };
        if q.get("quant_method").and_then(Value::as_str) != Some("fp8") {
            return Ok(None);
        }
        let field = |f: &str| format!("{key}.{f}");
        if let Some(fmt) = q.get("fmt") {
            if fmt.as_str() != Some("e4m3") {
                return Err(Error::config(
                    file,
                    field("fmt"),
                    format!("{fmt} is not supported: FP8 weights load as e4m3 only"),
                ));
            }
        }
        if let Some(s) = q.get("activation_scheme") {
            if s.as_str() != Some("dynamic") {
                return Err(Error::config(
                    file,
                    field("activation_scheme"),
                    format!(
                        "{s} is not supported: this build dequantizes FP8 weights and keeps activations in the compute dtype, which matches the \"dynamic\" scheme only (static input scales would be ignored)"
                    ),
                ));
            }
        }
        let block = q
            .get("weight_block_size")
            .and_then(Value::as_array)
            .and_then(|a| match a.as_slice() {
                [r, c] => Some((r.as_u64()? as usize, c.as_u64()? as usize)),
                _ => None,
            })
            .filter(|&(r, c)| r > 0 && c > 0)
            .ok_or_else(|| {
                Error::config(
                    file,
                    field("weight_block_size"),
                    format!(
                        "expected two positive block sizes [rows, columns] (e.g. [128, 128]), found {}",
                        q.get("weight_block_size").unwrap_or(&Value::Null)
                    ),
                )
            })?;
        Ok(Some(Self { block }))
    }
}

/// The value of an OCP FP8 E4M3 (`e4m3fn`) byte: 1 sign, 4 exponent (bias 7), 3 mantissa
/// bits; no infinities, `S.1111.111` is NaN; subnormals below exponent 1.
pub fn e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let v = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * v
}

/// An FP8 weight as stored: its e4m3 bytes (row-major `[n, k]`), the f32 block scales
/// `[ceil(n / bn), ceil(k / bk)]`, the block, and the tensors read.
pub struct Stored<'a> {
    /// Borrowed from the memory-mapped file (no copy).
    pub bytes: &'a [u8],
    pub scales: Tensor,
    pub block: (usize, usize),
    pub n: usize,
    pub k: usize,
    pub read: [String; 2],
}

/// `name` as stored when it is an FP8 weight (float8 e4m3 with `name_scale_inv` beside it);
/// None for an ordinary tensor. `shape` is the logical shape the model expects; `desc` names
/// the checkpoint in errors.
pub fn load_stored<'a>(
    st: &'a MmapedSafetensors,
    quant: Option<&Fp8Quant>,
    name: &str,
    shape: &[usize],
    desc: &str,
) -> Result<Option<Stored<'a>>> {
    let Ok(view) = st.get(name) else {
        return Ok(None); // the caller reports the missing tensor
    };
    let scale_name = format!("{name}_scale_inv");
    let is_fp8 = DType::try_from(view.dtype()).ok() == Some(DType::F8E4M3);
    let scale = st.get(&scale_name).ok();
    let err = |msg: String| Error::weights(desc, msg);
    match (is_fp8, &scale) {
        (false, None) => return Ok(None),
        (false, Some(_)) => {
            return Err(err(format!(
                "tensor `{name}` has dtype {:?} but `{scale_name}` exists: an FP8 weight must be stored as F8_E4M3",
                view.dtype()
            )))
        }
        (true, None) => {
            return Err(err(format!(
                "tensor `{scale_name}` is missing: `{name}` is float8 (F8_E4M3) and needs its block scales"
            )))
        }
        (true, Some(_)) => {}
    }
    let Some(quant) = quant else {
        return Err(err(format!(
            "`{name}` is float8 with `{scale_name}`, but config.json has no `quantization_config: {{quant_method: \"fp8\", weight_block_size: [..]}}` (use the config.json that came with the checkpoint)"
        )));
    };
    let [n, k] = shape else {
        return Err(err(format!(
            "tensor `{name}` is float8, but the model reads it as {shape:?}: FP8 blocks are for matrices"
        )));
    };
    if view.shape() != shape {
        return Err(err(format!(
            "tensor `{name}`: shape {:?}, expected {shape:?}",
            view.shape()
        )));
    }
    let (bn, bk) = quant.block;
    let (sn, sk) = (n.div_ceil(bn), k.div_ceil(bk));
    let scales = st
        .load(&scale_name, &Device::Cpu)
        .map_err(|e| err(format!("tensor `{scale_name}`: {e}")))?;
    if scales.dims() != [sn, sk] {
        return Err(err(format!(
            "tensor `{scale_name}`: shape {:?}, expected [{sn}, {sk}] (one scale per {bn}x{bk} block of `{name}` {shape:?}, config weight_block_size)",
            scales.dims()
        )));
    }
    Ok(Some(Stored {
        bytes: view.data(),
        scales: scales.to_dtype(DType::F32)?,
        block: quant.block,
        n: *n,
        k: *k,
        read: [name.to_string(), scale_name],
    }))
}

/// An FP8 weight dequantized at load: the f32 values and the tensors read.
pub struct Dequantized {
    pub tensor: Tensor,
    pub read: [String; 2],
}

/// `name` dequantized to f32 on the CPU when it is an FP8 weight ([`load_stored`]); None for
/// an ordinary tensor.
pub fn load_dequantized(
    st: &MmapedSafetensors,
    quant: Option<&Fp8Quant>,
    name: &str,
    shape: &[usize],
    desc: &str,
) -> Result<Option<Dequantized>> {
    let Some(s) = load_stored(st, quant, name, shape, desc)? else {
        return Ok(None);
    };
    Ok(Some(Dequantized {
        tensor: Tensor::from_vec(s.dequantize()?, (s.n, s.k), &Device::Cpu)?,
        read: s.read,
    }))
}

impl Stored<'_> {
    /// The values `f32(e4m3) * scale`, row-major.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let scales = self.scales.flatten_all()?.to_vec1::<f32>()?;
        Ok(dequantize(self.bytes, &scales, self.block, self.n, self.k))
    }
}

/// The values `f32(e4m3) * scale` of a row-major `[n, k]` e4m3 matrix with scales
/// `[ceil(n / bn), ceil(k / bk)]` (row-major): the load-time dequantization, and the reference
/// the GPU kernels reproduce (`nn::Fp8Weight`).
pub fn dequantize(
    bytes: &[u8],
    scales: &[f32],
    block: (usize, usize),
    n: usize,
    k: usize,
) -> Vec<f32> {
    let (bn, bk) = block;
    let sk = k.div_ceil(bk);
    let mut out = Vec::with_capacity(n * k);
    for r in 0..n {
        let row = &bytes[r * k..(r + 1) * k];
        let srow = &scales[(r / bn) * sk..(r / bn + 1) * sk];
        out.extend(
            row.iter()
                .enumerate()
                .map(|(c, &b)| e4m3_value(b) * srow[c / bk]),
        );
    }
    out
}

/// The load report's part for FP8: `fp8 e4m3 128x128 x197; dequantized to bf16`, or with
/// `kept` of them kept as stored (CUDA): `fp8 e4m3 128x128 x197; 190 kept as stored, the rest
/// dequantized to bf16`.
pub fn report(quant: Option<&Fp8Quant>, count: usize, kept: usize, dtype: DType) -> Option<String> {
    let q = quant.filter(|_| count > 0)?;
    let how = super::kept_or_dequantized(count, kept, dtype);
    Some(format!(
        "fp8 e4m3 {}x{} x{count}; {how}",
        q.block.0, q.block.1
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_values_follow_the_format() {
        assert_eq!(e4m3_value(0x00), 0.0);
        assert_eq!(e4m3_value(0x80), -0.0);
        assert_eq!(e4m3_value(0x38), 1.0); // exponent 7, mantissa 0
        assert_eq!(e4m3_value(0x7e), 448.0); // the largest finite value
        assert_eq!(e4m3_value(0xfe), -448.0);
        assert_eq!(e4m3_value(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(e4m3_value(0x08), 2f32.powi(-6)); // the smallest normal
        assert!(e4m3_value(0x7f).is_nan() && e4m3_value(0xff).is_nan());
        // every byte against candle's own F8E4M3 conversion (the float8 crate)
        let all: Vec<u8> = (0..=255u8).collect();
        let theirs = Tensor::from_raw_buffer(&all, DType::F8E4M3, &[256], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for b in 0..=255u8 {
            let theirs = theirs[b as usize];
            let ours = e4m3_value(b);
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "byte {b:#04x}: {ours} vs {theirs}"
            );
        }
    }

    #[test]
    fn config_errors_name_the_field() {
        let ok = serde_json::json!({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [128, 64]}});
        assert_eq!(
            Fp8Quant::from_config("c.json", &ok).unwrap(),
            Some(Fp8Quant { block: (128, 64) })
        );
        let nested = serde_json::json!({"text_config": {"quantization_config":
            {"quant_method": "fp8", "weight_block_size": [128, 128]}}});
        assert!(Fp8Quant::from_config("c.json", &nested).unwrap().is_some());
        let other = serde_json::json!({"quantization_config": {"quant_method": "mxfp4"}});
        assert_eq!(Fp8Quant::from_config("c.json", &other).unwrap(), None);
        for (q, field) in [
            (
                serde_json::json!({"quant_method": "fp8"}),
                "weight_block_size",
            ),
            (
                serde_json::json!({"quant_method": "fp8", "weight_block_size": [128]}),
                "weight_block_size",
            ),
            (
                serde_json::json!({"quant_method": "fp8", "weight_block_size": [0, 128]}),
                "weight_block_size",
            ),
            (
                serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}),
                "fmt",
            ),
            (
                serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}),
                "activation_scheme",
            ),
        ] {
            let e =
                Fp8Quant::from_config("c.json", &serde_json::json!({ "quantization_config": q }))
                    .unwrap_err()
                    .to_string();
            assert!(
                e.contains("c.json") && e.contains(&format!("quantization_config.{field}")),
                "{e}"
            );
        }
    }
}
