//! Integer group-quantized safetensors: AutoAWQ (GEMM packing), GPTQ (zero points as
//! `checkpoint_format` `gptq` or `gptq_v2` store them) and compressed-tensors
//! `pack-quantized` (symmetric; what llm-compressor writes for W4A16 and Kimi-K2.5 publishes).
//!
//! Each is a weight `w = s * (q - z)` per group of `group_size` consecutive inputs of a row,
//! with integers `q` of 4 (or 8) bits, so each is rewritten here, once at load, into the MLX
//! affine layout of [`super::mlx`] (`u32` words of `q` packed along the inputs, low bits
//! first; a scale and a bias per group, `b = -s * z`): the same dequantization and the same
//! CUDA kernels ([`crate::nn::AffineWeight`]) then serve every format. What the formats store:
//!
//! - AWQ (`quant_method: "awq"`, `version: "gemm"`): `qweight i32 [in, out / 8]` packed along
//!   the *outputs* in AutoAWQ's order (nibble `i` of a word holds output `8w + [0,2,4,6,1,3,5,7][i]`),
//!   `qzeros i32 [in / g, out / 8]` packed the same way, `scales f16 [in / g, out]`.
//! - GPTQ (`quant_method: "gptq"`): `qweight i32 [in * bits / 32, out]` packed along the inputs
//!   (value `k` of a column in word `k / (32 / bits)`, low bits first), `qzeros
//!   i32 [in / g, out * bits / 32]` packed along the outputs, `scales f16 [in / g, out]`,
//!   `g_idx i32 [in]` (the group of each input). The `gptq` (v1) format stores each zero point
//!   less one (AutoGPTQ's convention), `gptq_v2` stores it as is. A `g_idx` that is not
//!   `k / g` (act-order without the static groups) cannot be a contiguous group and is refused.
//! - compressed-tensors (`quant_method: "compressed-tensors"`, `format: "pack-quantized"`):
//!   `weight_packed i32 [out, in * bits / 32]` packed along the inputs, each value stored as
//!   `q + 2^(bits-1)` (so the symmetric `z` is `2^(bits-1)`), `weight_scale [out, in / g]`,
//!   `weight_shape [2]`. Only symmetric, weight-only, `group` strategy schemes are taken.
//!
//! Scales keep their stored dtype; biases are computed in f32 (exact: `z` has at most 9
//! bits, a bf16/f16 scale 11), so the f32 dequantization is exactly `s * (q - z)`. Kept as
//! stored on CUDA the bias is rounded to the scale's dtype: exact for the symmetric formats
//! (`z` a power of two), within one rounding of the bias for AWQ / GPTQ zero points.

use super::mlx::{AffineParams, Stored};
use crate::{Error, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::borrow::Cow;

/// How the integers are packed and where the zero points come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Awq,
    /// `zero_offset`: added to each stored zero point (1 for the `gptq` v1 format).
    Gptq {
        zero_offset: u32,
    },
    PackQuantized,
}

/// The integer quantization named by a checkpoint's `quantization_config`.
#[derive(Debug, Clone)]
pub struct IntQuant {
    file: String,
    key: String,
    pub method: Method,
    pub params: AffineParams,
}

const GROUPS: [usize; 3] = [32, 64, 128];

impl IntQuant {
    /// The integer quantization of a `config.json` value (`quantization_config`, top level or
    /// under `text_config`); None when it names another method or none. Unsupported variants
    /// of these methods are errors naming the field.
    pub fn from_config(file: &str, cfg: &Value) -> Result<Option<Self>> {
        let Some((key, q)) = super::quantization_config(cfg) else {
            return Ok(None);
        };
        let field = |f: &str| format!("{key}.{f}");
        let err = |f: &str, msg: String| Error::config(file, field(f), msg);
        let int = |obj: &Value, f: &str, path: &str| -> Result<Option<i64>> {
            match obj.get(f) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_i64().map(Some).ok_or_else(|| {
                    Error::config(file, field(path), format!("expected an integer, found {v}"))
                }),
            }
        };
        let group = |g: Option<i64>, path: &str| -> Result<usize> {
            match g {
                Some(g) if g > 0 && GROUPS.contains(&(g as usize)) => Ok(g as usize),
                Some(g) => Err(err(
                    path,
                    format!("{g} is not supported: integer-quantized weights load with groups of 32, 64 or 128 inputs (per-column scales, group size -1, are not)"),
                )),
                None => Err(err(path, "missing".into())),
            }
        };
        let bits_of = |b: Option<i64>, path: &str, allowed: &[usize]| -> Result<usize> {
            let b = b.ok_or_else(|| err(path, "missing".into()))?;
            if b > 0 && allowed.contains(&(b as usize)) {
                Ok(b as usize)
            } else {
                Err(err(
                    path,
                    format!("{b}-bit weights are not supported (supported: {allowed:?} bits)"),
                ))
            }
        };
        let method = q.get("quant_method").and_then(Value::as_str);
        let (method, bits, group_size) = match method {
            Some("awq") => {
                let version = q.get("version").and_then(Value::as_str).unwrap_or("gemm");
                if !version.eq_ignore_ascii_case("gemm") {
                    return Err(err(
                        "version",
                        format!("\"{version}\" is not supported: AWQ checkpoints load in AutoAWQ's GEMM packing (\"gemm\") only"),
                    ));
                }
                if q.get("zero_point").and_then(Value::as_bool) == Some(false) {
                    return Err(err(
                        "zero_point",
                        "false is not supported: AWQ weights load with zero points (qzeros)".into(),
                    ));
                }
                let bits = bits_of(
                    int(q, "bits", "bits")?.or(int(q, "w_bit", "w_bit")?),
                    "bits",
                    &[4],
                )?;
                let g =
                    int(q, "group_size", "group_size")?.or(int(q, "q_group_size", "q_group_size")?);
                (Method::Awq, bits, group(g, "group_size")?)
            }
            Some("gptq") => {
                let zero_offset = match q.get("checkpoint_format").and_then(Value::as_str) {
                    None | Some("gptq") => 1,
                    Some("gptq_v2") => 0,
                    Some(other) => {
                        return Err(err(
                            "checkpoint_format",
                            format!("\"{other}\" is not supported: GPTQ checkpoints load in the \"gptq\" and \"gptq_v2\" formats"),
                        ))
                    }
                };
                let bits = bits_of(int(q, "bits", "bits")?, "bits", &[4, 8])?;
                (
                    Method::Gptq { zero_offset },
                    bits,
                    group(int(q, "group_size", "group_size")?, "group_size")?,
                )
            }
            Some("compressed-tensors") => {
                let (bits, g) = pack_quantized_scheme(file, key, q)?;
                (Method::PackQuantized, bits, g)
            }
            _ => return Ok(None),
        };
        Ok(Some(Self {
            file: file.to_string(),
            key: key.to_string(),
            method,
            params: AffineParams { bits, group_size },
        }))
    }

    /// `awq 4-bit g128` style name for the load report.
    pub fn describe(&self) -> String {
        let m = match self.method {
            Method::Awq => "awq",
            Method::Gptq { zero_offset: 1 } => "gptq",
            Method::Gptq { .. } => "gptq_v2",
            Method::PackQuantized => "compressed-tensors pack-quantized",
        };
        format!("{m} {}", self.params)
    }

    /// The stored tensor whose presence marks `module` as quantized.
    fn marker(&self, module: &str) -> String {
        match self.method {
            Method::Awq | Method::Gptq { .. } => format!("{module}.qweight"),
            Method::PackQuantized => format!("{module}.weight_packed"),
        }
    }
}

/// The (bits, group size) of a compressed-tensors `pack-quantized` config: every config group
/// symmetric int weights with the `group` strategy, one bit width and group size, and no
/// activation quantization.
fn pack_quantized_scheme(file: &str, key: &str, q: &Value) -> Result<(usize, usize)> {
    let err = |f: &str, msg: String| Error::config(file, format!("{key}.{f}"), msg);
    let top_format = q.get("format").and_then(Value::as_str);
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .filter(|g| !g.is_empty())
        .ok_or_else(|| {
            err(
                "config_groups",
                "missing or empty: a compressed-tensors config names its schemes there".into(),
            )
        })?;
    let mut found: Option<(usize, usize, String)> = None;
    for (name, g) in groups {
        let at = |f: &str| format!("config_groups.{name}.{f}");
        let format = g.get("format").and_then(Value::as_str).or(top_format);
        if format != Some("pack-quantized") {
            return Err(err(
                &if g.get("format").is_some() { at("format") } else { "format".into() },
                format!(
                    "{} is not supported: compressed-tensors checkpoints load in the \"pack-quantized\" format (int4/int8 weights, W4A16 / W8A16); FP8 ones use quant_method \"fp8\"",
                    format.map_or("a missing format".to_string(), |f| format!("\"{f}\""))
                ),
            ));
        }
        if g.get("input_activations").is_some_and(|a| !a.is_null()) {
            return Err(err(
                &at("input_activations"),
                "is set: quantized activations are not supported (weight-only schemes load)".into(),
            ));
        }
        let w = g
            .get("weights")
            .filter(|w| w.is_object())
            .ok_or_else(|| err(&at("weights"), "missing".into()))?;
        let s = |f: &str| w.get(f).and_then(Value::as_str);
        if s("type").unwrap_or("int") != "int" {
            return Err(err(
                &at("weights.type"),
                format!(
                    "\"{}\" is not supported: integer weights load",
                    s("type").unwrap_or("")
                ),
            ));
        }
        if w.get("symmetric").and_then(Value::as_bool) != Some(true) {
            return Err(err(
                &at("weights.symmetric"),
                "must be true: asymmetric pack-quantized weights (zero points) are not supported"
                    .into(),
            ));
        }
        if s("strategy") != Some("group") {
            return Err(err(
                &at("weights.strategy"),
                format!(
                    "{} is not supported: pack-quantized weights load with the \"group\" strategy",
                    w.get("strategy").unwrap_or(&Value::Null)
                ),
            ));
        }
        let bits = w.get("num_bits").and_then(Value::as_u64).unwrap_or(0) as usize;
        if !matches!(bits, 4 | 8) {
            return Err(err(
                &at("weights.num_bits"),
                format!(
                    "{} is not supported (4 or 8 bits)",
                    w.get("num_bits").unwrap_or(&Value::Null)
                ),
            ));
        }
        let gs = w.get("group_size").and_then(Value::as_u64).unwrap_or(0) as usize;
        if !GROUPS.contains(&gs) {
            return Err(err(
                &at("weights.group_size"),
                format!(
                    "{} is not supported: groups of 32, 64 or 128 inputs",
                    w.get("group_size").unwrap_or(&Value::Null)
                ),
            ));
        }
        match &found {
            Some((b, g0, first)) if (*b, *g0) != (bits, gs) => {
                return Err(err(
                    &at("weights"),
                    format!("{bits}-bit g{gs} differs from config_groups.{first} ({b}-bit g{g0}): one scheme per checkpoint is supported"),
                ))
            }
            Some(_) => {}
            None => found = Some((bits, gs, name.clone())),
        }
    }
    let (bits, gs, _) = found.expect("config_groups is not empty");
    Ok((bits, gs))
}

/// Whether `module` carries integer-quantized tensors (an AWQ/GPTQ `qweight` or a
/// compressed-tensors `weight_packed`), whatever the config says.
fn stored_marker(st: &MmapedSafetensors, module: &str) -> Option<String> {
    ["qweight", "weight_packed"]
        .iter()
        .map(|s| format!("{module}.{s}"))
        .find(|n| st.get(n).is_ok())
}

/// Whether `name` (`<module>.weight`) is stored integer-quantized.
pub fn is_quantized(st: &MmapedSafetensors, name: &str) -> bool {
    name.strip_suffix(".weight")
        .is_some_and(|m| stored_marker(st, m).is_some())
}

/// The logical `[out, in]` shape of the integer-quantized `name` (`<module>.weight`) from its
/// packed tensor's stored shape; None when it is not stored so.
pub fn logical_shape(
    st: &MmapedSafetensors,
    quant: Option<&IntQuant>,
    name: &str,
) -> Option<Vec<usize>> {
    let quant = quant?;
    let v = st.get(&quant.marker(name.strip_suffix(".weight")?)).ok()?;
    let per = 32 / quant.params.bits;
    match (quant.method, v.shape()) {
        (Method::PackQuantized, &[out, w]) => Some(vec![out, w * per]),
        (Method::Gptq { .. }, &[w, out]) => Some(vec![out, w * per]),
        (Method::Awq, &[inp, w]) => Some(vec![w * 8, inp]),
        _ => None,
    }
}

/// `name` (`<module>.weight`, logical `shape [out, in]`) rewritten into the MLX affine layout
/// when the checkpoint stores it integer-quantized; None when it is an ordinary tensor.
pub fn load_stored<'a>(
    st: &'a MmapedSafetensors,
    quant: Option<&IntQuant>,
    name: &str,
    shape: &[usize],
    desc: &str,
) -> Result<Option<Stored<'a>>> {
    let Some(module) = name.strip_suffix(".weight") else {
        return Ok(None);
    };
    let Some(found) = stored_marker(st, module) else {
        return Ok(None);
    };
    let err = |msg: String| Error::weights(desc, msg);
    let Some(quant) = quant else {
        return Err(err(format!(
            "`{found}` is integer-quantized, but config.json has no `quantization_config` with quant_method \"awq\", \"gptq\" or \"compressed-tensors\" (use the config.json that came with the checkpoint)"
        )));
    };
    let marker = quant.marker(module);
    if found != marker {
        return Err(err(format!(
            "tensor `{found}` does not belong to {} ({}: expected `{marker}`)",
            quant.describe(),
            quant.key
        )));
    }
    let &[out, inp] = shape else {
        return Err(err(format!(
            "tensor `{name}`: integer-quantized weights are matrices, the model expects shape {shape:?}"
        )));
    };
    let AffineParams {
        bits,
        group_size: g,
    } = quant.params;
    if inp % g != 0 || out % (32 / bits) != 0 && quant.method != Method::PackQuantized {
        return Err(Error::config(
            &quant.file,
            format!("{}.group_size", quant.key),
            format!("group size {g} does not divide the input width {inp} of `{name}` (shape {shape:?}), or its {out} outputs do not fill whole words"),
        ));
    }
    let per = 32 / bits;
    let mask = (1u32 << bits) - 1;
    let groups = inp / g;
    let words_in = inp / per;
    // an i32 tensor's words, shape-checked
    let words = |n: &str, want: &[usize]| -> Result<&'a [u8]> {
        let v = st.get(n).map_err(|_| {
            err(format!(
                "missing tensor `{n}` (expected shape {want:?}) beside `{marker}`"
            ))
        })?;
        if DType::try_from(v.dtype()).ok() != Some(DType::I32) {
            return Err(err(format!(
                "tensor `{n}` has dtype {:?}, expected I32 (packed integers)",
                v.dtype()
            )));
        }
        if v.shape() != want {
            return Err(err(format!(
                "tensor `{n}` has shape {:?}, expected {want:?} ({} of `{name}` [{out}, {inp}] at {bits} bits, groups of {g})",
                v.shape(),
                quant.describe()
            )));
        }
        Ok(v.data())
    };
    let floats = |n: &str, want: &[usize]| -> Result<Tensor> {
        let v = st.get(n).map_err(|_| {
            err(format!(
                "missing tensor `{n}` (expected shape {want:?}) beside `{marker}`"
            ))
        })?;
        if v.shape() != want {
            return Err(err(format!(
                "tensor `{n}` has shape {:?}, expected {want:?} (one per group of {g} inputs of `{name}` [{out}, {inp}])",
                v.shape()
            )));
        }
        let t = st
            .load(n, &Device::Cpu)
            .map_err(|e| err(format!("tensor `{n}`: {e}")))?;
        if !matches!(t.dtype(), DType::BF16 | DType::F16 | DType::F32) {
            return Err(err(format!(
                "tensor `{n}` has dtype {:?}, expected bf16, f16 or f32",
                t.dtype()
            )));
        }
        Ok(t)
    };
    let word = |b: &[u8], i: usize| {
        u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
    };
    let f32s = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let mut read = vec![marker.clone()];
    let (packed, scales, zeros): (Cow<'a, [u8]>, Tensor, Vec<f32>) = match quant.method {
        Method::PackQuantized => {
            let packed = words(&marker, &[out, words_in])?;
            let sname = format!("{module}.weight_scale");
            let scales = floats(&sname, &[out, groups])?;
            read.push(sname);
            let shape_name = format!("{module}.weight_shape");
            if let Ok(v) = st.get(&shape_name) {
                let t = st
                    .load(&shape_name, &Device::Cpu)
                    .map_err(|e| err(format!("tensor `{shape_name}`: {e}")))?;
                let dims: Vec<i64> = t.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?;
                if dims != [out as i64, inp as i64] {
                    return Err(err(format!(
                        "tensor `{shape_name}` says {dims:?}, but the model expects `{name}` of shape [{out}, {inp}] (shape {:?} stored)",
                        v.shape()
                    )));
                }
                read.push(shape_name);
            }
            let z = (1u32 << (bits - 1)) as f32;
            (Cow::Borrowed(packed), scales, vec![z; out * groups])
        }
        Method::Gptq { zero_offset } => {
            let qw = words(&marker, &[words_in, out])?;
            let zname = format!("{module}.qzeros");
            let qz = words(&zname, &[groups, out / per])?;
            let sname = format!("{module}.scales");
            let s = floats(&sname, &[groups, out])?;
            read.extend([zname, sname]);
            let gname = format!("{module}.g_idx");
            if let Ok(v) = st.get(&gname) {
                if v.shape() != [inp] {
                    return Err(err(format!(
                        "tensor `{gname}` has shape {:?}, expected [{inp}]",
                        v.shape()
                    )));
                }
                let t = st
                    .load(&gname, &Device::Cpu)
                    .map_err(|e| err(format!("tensor `{gname}`: {e}")))?;
                let idx: Vec<i64> = t.to_dtype(DType::I64)?.to_vec1()?;
                if let Some(k) = (0..inp).find(|&k| idx[k] != (k / g) as i64) {
                    return Err(err(format!(
                        "tensor `{gname}` puts input {k} in group {}, not {}: act-order (desc_act) GPTQ weights without static groups are not supported (quantize with static_groups, or desc_act false)",
                        idx[k],
                        k / g
                    )));
                }
                read.push(gname);
            }
            // the words of column n along the inputs are the MLX row n as stored
            let mut packed = Vec::with_capacity(out * words_in * 4);
            for n in 0..out {
                for w in 0..words_in {
                    packed.extend_from_slice(&qw[4 * (w * out + n)..4 * (w * out + n) + 4]);
                }
            }
            let mut zeros = vec![0f32; out * groups];
            for gi in 0..groups {
                for n in 0..out {
                    let v = (word(qz, gi * (out / per) + n / per) >> (bits * (n % per))) & mask;
                    zeros[n * groups + gi] = (v + zero_offset) as f32;
                }
            }
            (Cow::Owned(packed), s.t()?.contiguous()?, zeros)
        }
        Method::Awq => {
            // output n of a word of 8 sits in nibble AWQ_NIBBLE[n % 8]
            const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];
            let qw = words(&marker, &[inp, out / 8])?;
            let zname = format!("{module}.qzeros");
            let qz = words(&zname, &[groups, out / 8])?;
            let sname = format!("{module}.scales");
            let s = floats(&sname, &[groups, out])?;
            read.extend([zname, sname]);
            let nib = |b: &[u8], row: usize, n: usize| {
                (word(b, row * (out / 8) + n / 8) >> (4 * AWQ_NIBBLE[n % 8])) & 15
            };
            let mut q = vec![0u32; out * words_in];
            for k in 0..inp {
                for n in 0..out {
                    q[n * words_in + k / 8] |= nib(qw, k, n) << (4 * (k % 8));
                }
            }
            let mut zeros = vec![0f32; out * groups];
            for gi in 0..groups {
                for n in 0..out {
                    zeros[n * groups + gi] = nib(qz, gi, n) as f32;
                }
            }
            let packed = q.iter().flat_map(|w| w.to_le_bytes()).collect();
            (Cow::Owned(packed), s.t()?.contiguous()?, zeros)
        }
    };
    // b = -s z in f32: exact (z < 2^9, s of at most 24 significant bits... bf16/f16 have 8/11)
    let s = f32s(&scales)?;
    let biases: Vec<f32> = s.iter().zip(&zeros).map(|(s, z)| -s * z).collect();
    Ok(Some(Stored {
        packed,
        scales,
        biases: Tensor::from_vec(biases, (out, groups), &Device::Cpu)?,
        params: quant.params,
        rows: out,
        cols: inp,
        read,
    }))
}

/// What was loaded integer-quantized, for the load report: `awq 4-bit g128 x196; dequantized
/// to f32` (`kept` of them kept as stored).
pub fn report(quant: Option<&IntQuant>, count: usize, kept: usize, dtype: DType) -> Option<String> {
    let q = quant.filter(|_| count > 0)?;
    let what = super::kept_or_dequantized(count, kept, dtype);
    Some(format!("{} x{count}; {what}", q.describe()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(q: Value) -> Result<Option<IntQuant>> {
        IntQuant::from_config("config.json", &json!({ "quantization_config": q }))
    }

    #[test]
    fn configs_of_each_method_parse() {
        let awq = parse(json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM", "zero_point": true}))
            .unwrap()
            .unwrap();
        assert_eq!(
            (awq.method, awq.params.bits, awq.params.group_size),
            (Method::Awq, 4, 128)
        );
        let gptq = parse(json!({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": false, "sym": true}))
            .unwrap()
            .unwrap();
        assert_eq!(gptq.method, Method::Gptq { zero_offset: 1 });
        assert_eq!(gptq.describe(), "gptq 8-bit g32");
        let v2 = parse(json!({"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "gptq_v2"}))
            .unwrap()
            .unwrap();
        assert_eq!(v2.method, Method::Gptq { zero_offset: 0 });
        let ct = parse(json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
            "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32}}}}))
        .unwrap()
        .unwrap();
        assert_eq!(
            (ct.method, ct.params.bits, ct.params.group_size),
            (Method::PackQuantized, 4, 32)
        );
        assert!(parse(json!({"quant_method": "fp8"})).unwrap().is_none());
        assert!(IntQuant::from_config("c", &json!({})).unwrap().is_none());
    }

    #[test]
    fn unsupported_variants_name_the_field() {
        let cases = [
            (
                json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}),
                "quantization_config.version",
                "GEMM packing",
            ),
            (
                json!({"quant_method": "awq", "bits": 3, "group_size": 128}),
                "quantization_config.bits",
                "3-bit",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": -1}),
                "quantization_config.group_size",
                "-1",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": 96}),
                "quantization_config.group_size",
                "96",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}),
                "checkpoint_format",
                "marlin",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {}}}}),
                "quantization_config.format",
                "float-quantized",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights":
                {"num_bits": 4, "type": "int", "symmetric": false, "strategy": "group", "group_size": 32}}}}),
                "config_groups.g.weights.symmetric",
                "asymmetric",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights":
                {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "channel"}}}}),
                "weights.strategy",
                "channel",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
                "input_activations": {"num_bits": 8}, "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32}}}}),
                "input_activations",
                "weight-only",
            ),
        ];
        for (q, field, what) in cases {
            let e = parse(q.clone()).unwrap_err().to_string();
            assert!(
                e.contains(field) && e.contains(what) && !e.contains('\n'),
                "{q}: {e}"
            );
        }
    }
}
