//! MLX affine-quantized safetensors (the `mlx-community/*-4bit` layout): checked as stored,
//! dequantized at load or (CUDA) kept as stored.
//!
//! Part of the sources/loading step: [`super::Weights`] asks this module for every
//! `<module>.weight` of a safetensors checkpoint whose config carries an MLX `quantization`
//! entry (or whose tensor is packed `uint32`). A quantized module stores
//!
//! - `<module>.weight`: `uint32 [rows, in * bits / 32]`, the quantized values `q` of each row
//!   as one little-endian bit stream (value `i` in bits `i*bits .. (i+1)*bits`; for 2, 4 and
//!   8 bits that is `32 / bits` values per `u32`, low bits first; 3, 5 and 6 bits cross
//!   `u32` boundaries exactly as MLX packs them, 8 values per 3 or 5 bytes, 4 per 3 bytes);
//! - `<module>.scales`, `<module>.biases`: `[rows, in / group_size]` (bf16, f16 or f32);
//!
//! and the weight is `w = scale * q + bias` per group of `group_size` consecutive inputs.
//! `config.json` names `quantization: {group_size, bits[, mode: "affine"]}` (also spelled
//! `quantization_config`), with optional per-module entries (`"model.layers.0.mlp.gate_proj":
//! {group_size, bits}`, or `false` for a module kept in float). A module is quantized when
//! its `.scales` tensor is present, as in mlx-lm.
//!
//! The value is computed in f32 (`scale * q` is exact there for bf16/f16 scales, so this is
//! the MLX definition up to the single rounding of the add) and then cast to the compute
//! dtype. Memory trade-off: dequantized weights are held dense, i.e. 8x (f32) or 4x (bf16) the
//! 4-bit checkpoint; on CUDA with bf16 the 4- and 8-bit matrices are kept as stored instead
//! ([`load_stored`] -> `nn::AffineWeight`, see `source::Weights::linear`).

use crate::{Error, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::collections::BTreeMap;

/// Bit widths of MLX's affine mode.
pub const SUPPORTED_BITS: [usize; 6] = [2, 3, 4, 5, 6, 8];
/// Group sizes MLX's affine quantization produces.
pub const SUPPORTED_GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// Bits and group size of one quantized module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct AffineParams {
    pub bits: usize,
    pub group_size: usize,
}

impl std::fmt::Display for AffineParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-bit g{}", self.bits, self.group_size)
    }
}

/// The `quantization` entry of an MLX checkpoint's config.
#[derive(Debug, Clone)]
pub struct MlxQuant {
    file: String,
    /// `quantization` or `quantization_config`.
    key: String,
    default: Option<AffineParams>,
    /// Per-module entries: params, or None for a module kept in float (`false`).
    modules: BTreeMap<String, Option<AffineParams>>,
}

impl MlxQuant {
    /// The MLX quantization described by a `config.json` value, None when it has none.
    /// A `quantization_config` with a `quant_method` (AWQ, GPTQ, FP8, bitsandbytes, ...) is
    /// another format: that is an error naming it rather than loading its tensors as floats.
    pub fn from_config(file: &str, cfg: &Value) -> Result<Option<Self>> {
        let (key, q) = match (cfg.get("quantization"), cfg.get("quantization_config")) {
            (Some(q), _) => ("quantization", q),
            (None, Some(q)) => {
                if let Some(m) = q.get("quant_method") {
                    // gpt-oss's MXFP4 experts are the gpt_oss family's own format
                    // (source/mxfp4.rs; that loader refuses any other method).
                    if m.as_str() == Some("mxfp4")
                        && cfg.get("model_type").and_then(Value::as_str) == Some("gpt_oss")
                    {
                        return Ok(None);
                    }
                    // FP8 block-quantized weights: source/fp8.rs; integer groups: source/intq.rs
                    if matches!(
                        m.as_str(),
                        Some("fp8" | "awq" | "gptq" | "compressed-tensors")
                    ) {
                        return Ok(None);
                    }
                    return Err(Error::config(
                        file,
                        "quantization_config.quant_method",
                        format!(
                            "{m} is not supported; this build loads float safetensors, MLX affine-quantized safetensors (`quantization: {{group_size, bits}}`), FP8 block-quantized safetensors (`quant_method: \"fp8\"`), AWQ / GPTQ / compressed-tensors pack-quantized integer weights and GGUF files"
                        ),
                    ));
                }
                ("quantization_config", q)
            }
            (None, None) => return Ok(None),
        };
        if q.is_null() {
            return Ok(None);
        }
        let obj = q.as_object().ok_or_else(|| {
            Error::config(
                file,
                key,
                format!("expected an object {{group_size, bits}}, found {q}"),
            )
        })?;
        let has_default = obj.contains_key("bits") || obj.contains_key("group_size");
        let default = if has_default {
            Some(parse_params(file, key, q)?)
        } else {
            None
        };
        let mut modules = BTreeMap::new();
        for (k, v) in obj {
            if matches!(k.as_str(), "bits" | "group_size" | "mode") {
                continue;
            }
            let field = format!("{key}.{k}");
            let p = match v {
                Value::Bool(false) => None,
                Value::Bool(true) => Some(default.ok_or_else(|| {
                    Error::config(
                        file,
                        &field,
                        format!("`true`, but `{key}` has no default group_size and bits"),
                    )
                })?),
                Value::Object(_) => Some(parse_params(file, &field, v)?),
                // other scalars (e.g. a quantization library's bookkeeping) are not modules
                _ => continue,
            };
            modules.insert(k.clone(), p);
        }
        if default.is_none() && modules.is_empty() {
            return Err(Error::config(
                file,
                key,
                "has neither group_size/bits nor per-module entries",
            ));
        }
        if obj.contains_key("mode") && !has_default {
            parse_mode(file, key, q)?;
        }
        Ok(Some(Self {
            file: file.to_string(),
            key: key.to_string(),
            default,
            modules,
        }))
    }

    /// The parameters of `module` (e.g. `model.layers.0.mlp.gate_proj`): its own entry, else
    /// the default; Ok(None) when the config keeps it in float.
    pub fn params_for(&self, module: &str) -> Result<Option<AffineParams>> {
        match self.modules.get(module) {
            Some(p) => Ok(*p),
            None => self.default.map(Some).ok_or_else(|| {
                Error::config(
                    &self.file,
                    &self.key,
                    format!("no group_size/bits for the quantized module `{module}` (no default and no `{module}` entry)"),
                )
            }),
        }
    }

    /// The config field that gives `module` its parameters (for errors).
    fn field_for(&self, module: &str) -> String {
        if self.modules.contains_key(module) {
            format!("{}.{module}", self.key)
        } else {
            self.key.clone()
        }
    }

    /// The default parameters (`quantization.{bits, group_size}`), if any.
    pub fn default_params(&self) -> Option<AffineParams> {
        self.default
    }
}

fn parse_mode(file: &str, key: &str, v: &Value) -> Result<()> {
    match v.get("mode") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) if m == "affine" => Ok(()),
        Some(m) => Err(Error::config(
            file,
            format!("{key}.mode"),
            format!("{m} is not supported; only MLX's `affine` mode is (scales and biases)"),
        )),
    }
}

fn parse_params(file: &str, key: &str, v: &Value) -> Result<AffineParams> {
    parse_mode(file, key, v)?;
    let int = |name: &str| -> Result<usize> {
        let field = format!("{key}.{name}");
        match v.get(name) {
            None => Err(Error::config(file, &field, "missing")),
            Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
                Error::config(file, &field, format!("expected an integer, found {x}"))
            }),
        }
    };
    let bits = int("bits")?;
    if !SUPPORTED_BITS.contains(&bits) {
        return Err(Error::config(
            file,
            format!("{key}.bits"),
            format!("{bits}-bit MLX affine quantization is not supported (supported: 2, 3, 4, 5, 6, 8 bits)"),
        ));
    }
    let group_size = int("group_size")?;
    if !SUPPORTED_GROUP_SIZES.contains(&group_size) {
        return Err(Error::config(
            file,
            format!("{key}.group_size"),
            format!("{group_size} is not an MLX affine group size (32, 64 or 128)"),
        ));
    }
    Ok(AffineParams { bits, group_size })
}

/// `packed`: rows of `cols * bits / 8` bytes (the little-endian bytes of the `u32` words);
/// `scales`, `biases`: `rows * cols / group_size` values. Returns `rows * cols` weights.
/// The caller has checked the sizes.
fn dequantize(
    packed: &[u8],
    scales: &[f32],
    biases: &[f32],
    rows: usize,
    cols: usize,
    p: AffineParams,
) -> Vec<f32> {
    let bits = p.bits;
    let row_bytes = cols * bits / 8;
    let groups = cols / p.group_size;
    let mask = (1u32 << bits) - 1;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let row = &packed[r * row_bytes..(r + 1) * row_bytes];
        for g in 0..groups {
            let (s, b) = (scales[r * groups + g], biases[r * groups + g]);
            for i in g * p.group_size..(g + 1) * p.group_size {
                let bit = i * bits;
                let (byte, shift) = (bit / 8, bit % 8);
                let mut word = row[byte] as u32;
                if shift + bits > 8 {
                    word |= (row[byte + 1] as u32) << 8;
                }
                let q = (word >> shift) & mask;
                out.push(s * q as f32 + b);
            }
        }
    }
    out
}

/// What [`load_dequantized`] did, for the load report.
pub struct Dequantized {
    pub tensor: Tensor,
    pub params: AffineParams,
    /// The stored tensors it read (`.weight`, `.scales`, `.biases`).
    pub read: Vec<String>,
}

/// An MLX-quantized weight as stored, checked: the packed bytes (the little-endian bytes of
/// the `u32` words, rows of `cols * bits / 8`), its scales and biases as stored (bf16, f16 or
/// f32, `[rows.., cols / group_size]`, on the CPU).
pub struct Stored<'a> {
    /// Borrowed from the memory-mapped file (no copy), or repacked ([`super::intq`]).
    pub packed: std::borrow::Cow<'a, [u8]>,
    pub scales: Tensor,
    pub biases: Tensor,
    pub params: AffineParams,
    pub rows: usize,
    pub cols: usize,
    /// The stored tensors it was read from.
    pub read: Vec<String>,
}

impl Stored<'_> {
    /// The weights `[rows * cols]` in f32, `s * q + b`.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let f = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        };
        Ok(dequantize(
            &self.packed,
            &f(&self.scales)?,
            &f(&self.biases)?,
            self.rows,
            self.cols,
            self.params,
        ))
    }
}

/// `name` dequantized to f32 on the CPU when it is an MLX-quantized weight; None when it
/// is an ordinary tensor (no `.scales` beside it, not packed). `shape` is the logical
/// (dequantized) shape the model expects; `desc` names the checkpoint in errors.
pub fn load_dequantized(
    st: &MmapedSafetensors,
    quant: Option<&MlxQuant>,
    name: &str,
    shape: &[usize],
    desc: &str,
) -> Result<Option<Dequantized>> {
    let Some(s) = load_stored(st, quant, name, shape, desc)? else {
        return Ok(None);
    };
    let values = s.dequantize()?;
    Ok(Some(Dequantized {
        tensor: Tensor::from_vec(values, shape, &Device::Cpu)?,
        params: s.params,
        read: s.read,
    }))
}

/// `name` as stored when it is an MLX-quantized weight (checked against the config and the
/// logical `shape`); None when it is an ordinary tensor.
pub fn load_stored<'a>(
    st: &'a MmapedSafetensors,
    quant: Option<&MlxQuant>,
    name: &str,
    shape: &[usize],
    desc: &str,
) -> Result<Option<Stored<'a>>> {
    let Some(module) = name.strip_suffix(".weight") else {
        return Ok(None);
    };
    let Ok(view) = st.get(name) else {
        return Ok(None); // the caller reports the missing tensor
    };
    let (scales_name, biases_name) = (format!("{module}.scales"), format!("{module}.biases"));
    let has_scales = st.get(&scales_name).is_ok();
    let packed_shape = view.shape().to_vec();
    let err = |msg: String| Error::weights(desc, msg);
    let packed = DType::try_from(view.dtype()).ok() == Some(DType::U32);
    if !packed && !has_scales {
        return Ok(None); // a float tensor (mlx-lm leaves some modules unquantized)
    }
    if !packed {
        return Err(err(format!(
            "tensor `{name}` has dtype {:?} but `{scales_name}` exists: an MLX-quantized weight must be packed uint32",
            view.dtype()
        )));
    }
    if !has_scales {
        return Err(err(format!(
            "tensor `{scales_name}` is missing: `{name}` is packed uint32 (MLX-quantized) and needs `{scales_name}` and `{biases_name}`"
        )));
    }
    if st.get(&biases_name).is_err() {
        return Err(err(format!(
            "tensor `{biases_name}` is missing: the MLX affine weight `{name}` needs `{scales_name}` and `{biases_name}`"
        )));
    }
    let Some(quant) = quant else {
        return Err(err(format!(
            "`{name}` is MLX-quantized (packed uint32 with `{scales_name}`), but config.json has no `quantization: {{group_size, bits}}` entry (use the config.json that came with the MLX conversion)"
        )));
    };
    let params = quant.params_for(module)?.ok_or_else(|| {
        Error::config(
            &quant.file,
            format!("{}.{module}", quant.key),
            format!("is `false` (module kept in float), but the checkpoint has `{scales_name}`"),
        )
    })?;
    let Some((&cols, lead)) = shape.split_last() else {
        return Err(err(format!(
            "tensor `{name}`: a quantized weight cannot be a scalar"
        )));
    };
    let rows: usize = lead.iter().product();
    if cols % params.group_size != 0 {
        return Err(Error::config(
            &quant.file,
            format!("{}.group_size", quant.field_for(module)),
            format!(
                "group size {} does not divide the input dimension {cols} of `{name}` (shape {shape:?})",
                params.group_size
            ),
        ));
    }
    let mut want_packed = lead.to_vec();
    want_packed.push(cols * params.bits / 32);
    if packed_shape != want_packed {
        return Err(err(format!(
            "tensor `{name}` has packed shape {packed_shape:?}, expected {want_packed:?} (logical shape {shape:?} at {params}: {cols} values x {} bits / 32 per row)",
            params.bits
        )));
    }
    let mut want_groups = lead.to_vec();
    want_groups.push(cols / params.group_size);
    let side = |n: &str| -> Result<Tensor> {
        let t = st
            .load(n, &Device::Cpu)
            .map_err(|e| err(format!("tensor `{n}`: {e}")))?;
        if !matches!(t.dtype(), DType::BF16 | DType::F16 | DType::F32) {
            return Err(err(format!(
                "tensor `{n}` has dtype {:?}, expected bf16, f16 or f32",
                t.dtype()
            )));
        }
        if t.dims() != want_groups.as_slice() {
            return Err(err(format!(
                "tensor `{n}` has shape {:?}, expected {want_groups:?} (one per group of {} inputs of `{name}`)",
                t.dims(),
                params.group_size
            )));
        }
        Ok(t)
    };
    let scales = side(&scales_name)?;
    let biases = side(&biases_name)?;
    // the u32 words as stored (little-endian) are the bit stream `dequantize` reads
    Ok(Some(Stored {
        packed: std::borrow::Cow::Borrowed(view.data()),
        scales,
        biases,
        params,
        rows,
        cols,
        read: vec![name.to_string(), scales_name, biases_name],
    }))
}

/// The logical shape of an MLX-packed `name` given its stored shape, when the checkpoint
/// has `.scales` for it and the config gives its bits; None otherwise.
pub fn logical_shape(
    st: &MmapedSafetensors,
    quant: Option<&MlxQuant>,
    name: &str,
    stored: &[usize],
) -> Option<Vec<usize>> {
    let module = name.strip_suffix(".weight")?;
    st.get(&format!("{module}.scales")).ok()?;
    let p = quant?.params_for(module).ok()??;
    let (&last, lead) = stored.split_last()?;
    let mut v = lead.to_vec();
    v.push(last * 32 / p.bits);
    Some(v)
}

/// `mlx affine 4-bit g64 x196, 8-bit g64 x1; dequantized to f32` from per-params counts
/// (`kept` of them kept as stored: `...; 190 kept as stored, the rest dequantized to bf16`).
pub fn report(counts: &BTreeMap<AffineParams, usize>, kept: usize, dtype: DType) -> Option<String> {
    if counts.is_empty() {
        return None;
    }
    let parts: Vec<String> = counts.iter().map(|(p, n)| format!("{p} x{n}")).collect();
    let what = super::kept_or_dequantized(counts.values().sum(), kept, dtype);
    Some(format!("mlx affine {}; {what}", parts.join(", ")))
}
