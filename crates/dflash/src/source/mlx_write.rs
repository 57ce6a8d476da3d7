//! Writing MLX affine-quantized checkpoints: MLX's `quantize` written from its definition
//! (mlx/backend/cpu/quantized.cpp; bit-exact against MLX itself on the fixture that
//! tools/mlx-fixtures/make_fixtures.py records, tests/mlx.rs), its packing, and the
//! conversion of a float checkpoint's tensors into the mlx-community layout. The other side
//! of [`super::mlx`] (the loader), written independently of it; used by the tests' tiny
//! checkpoints and by `examples/quantize_draft.rs` (the demo draft stored at 8 bits).

use crate::Result;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::collections::HashMap;

/// Quantized values and the f32 scales / biases as MLX computes them (before the cast to
/// the stored dtype).
pub struct Affine {
    pub q: Vec<u32>,
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

/// MLX's affine quantization of a row-major matrix with `cols % group == 0`, per group:
/// the edge value of larger magnitude (min or max) is represented exactly (`bias = edge`,
/// `scale = edge / q0` with `q0 = rint(edge / s)`, `s = ±max((max - min) / (2^bits - 1),
/// 1e-7)` signed towards the other end), unless `q0` rounds to 0 (then bias 0, scale `s`);
/// `q = clamp(rint((w - bias) / scale), 0, 2^bits - 1)`, rint rounding ties to even.
pub fn quantize(w: &[f32], cols: usize, bits: usize, group: usize) -> Affine {
    assert_eq!(cols % group, 0);
    let n_bins = ((1u32 << bits) - 1) as f32;
    let eps = 1e-7f32;
    let (mut q, mut scales, mut biases) = (vec![], vec![], vec![]);
    for g in w.chunks(group) {
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for &x in g {
            hi = hi.max(x);
            lo = lo.min(x);
        }
        let mask = lo.abs() > hi.abs();
        let mut scale = ((hi - lo) / n_bins).max(eps);
        if !mask {
            scale = -scale;
        }
        let edge = if mask { lo } else { hi };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0.0f32;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        for &x in g {
            q.push(((x - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u32);
        }
        scales.push(scale);
        biases.push(bias);
    }
    Affine { q, scales, biases }
}

/// Pack like MLX: for 2, 4, 8 bits `32 / bits` values per u32, the first in the low bits;
/// for 3 and 5 bits 8 values per 3 or 5 bytes, for 6 bits 4 values per 3 bytes, again
/// first value in the low bits. Rows must hold a multiple of 32 values.
pub fn pack(q: &[u32], bits: usize) -> Vec<u32> {
    let (per, bytes) = match bits {
        3 | 5 => (8, bits),
        6 => (4, 3),
        _ => (32 / bits, 4),
    };
    let mut out = Vec::new();
    for chunk in q.chunks(per) {
        let mut acc = 0u64;
        for (k, &v) in chunk.iter().enumerate() {
            assert!(v < (1 << bits));
            acc |= (v as u64) << (k * bits);
        }
        out.extend_from_slice(&acc.to_le_bytes()[..bytes]);
    }
    out.chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("rows of 32k values make whole words")))
        .collect()
}

/// `v` rounded to `dt` (as MLX stores scales and biases in the weight's dtype), in f32.
pub fn round_to(v: &[f32], dt: DType) -> Vec<f32> {
    let r = || -> candle_core::Result<Vec<f32>> {
        Tensor::new(v, &Device::Cpu)?
            .to_dtype(dt)?
            .to_dtype(DType::F32)?
            .to_vec1()
    };
    r().expect("a host f32 vector converts to any float dtype")
}

/// `w = scale * q + bias` per group, in f32.
pub fn dequantize(q: &[u32], scales: &[f32], biases: &[f32], group: usize) -> Vec<f32> {
    q.iter()
        .enumerate()
        .map(|(i, &x)| scales[i / group] * x as f32 + biases[i / group])
        .collect()
}

/// The MLX layout of a checkpoint: default bits / group size, per-module overrides
/// (`None` = kept in float, written as `false`), the stored dtype of scales and biases, and
/// the config key (`quantization` or `quantization_config`).
#[derive(Clone)]
pub struct Layout {
    pub bits: usize,
    pub group: usize,
    pub modules: Vec<(&'static str, Option<(usize, usize)>)>,
    pub scale_dtype: DType,
    pub key: &'static str,
}

impl Layout {
    pub fn new(bits: usize, group: usize) -> Self {
        Self {
            bits,
            group,
            modules: vec![],
            scale_dtype: DType::BF16,
            key: "quantization",
        }
    }

    pub fn params(&self, module: &str) -> Option<(usize, usize)> {
        match self.modules.iter().find(|(m, _)| *m == module) {
            Some((_, p)) => *p,
            None => Some((self.bits, self.group)),
        }
    }

    pub fn config_entry(&self) -> Value {
        let mut q = json!({"group_size": self.group, "bits": self.bits});
        for (m, p) in &self.modules {
            q[*m] = match p {
                Some((bits, group)) => json!({"group_size": group, "bits": bits}),
                None => json!(false),
            };
        }
        q
    }
}

/// The tensors of a float checkpoint in the MLX layout (every 2-D `.weight`, and 3-D expert
/// stack, quantized unless its module is kept in float or, as mlx-lm does, its input width
/// is not a multiple of the group size), and the same checkpoint holding exactly the
/// dequantized weights in f32; plus the number of quantized tensors.
pub fn quantize_checkpoint(
    float: &HashMap<String, Tensor>,
    layout: &Layout,
) -> Result<(HashMap<String, Tensor>, HashMap<String, Tensor>, usize)> {
    let (mut mlx, mut deq): (HashMap<String, Tensor>, HashMap<String, Tensor>) = Default::default();
    let mut n = 0;
    for (name, w) in float {
        let module = name
            .strip_suffix(".weight")
            .filter(|_| matches!(w.rank(), 2 | 3));
        let cols = w.dims().last().copied().unwrap_or(0);
        let params = module
            .and_then(|m| Some((m, layout.params(m)?)))
            .filter(|&(_, (_, group))| cols % group == 0);
        let Some((module, (bits, group))) = params else {
            mlx.insert(name.clone(), w.clone());
            deq.insert(name.clone(), w.clone());
            continue;
        };
        let lead = &w.dims()[..w.rank() - 1];
        let with_last = |last: usize| [lead, &[last]].concat();
        let a = quantize(
            &w.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            cols,
            bits,
            group,
        );
        let (s, b) = (
            round_to(&a.scales, layout.scale_dtype),
            round_to(&a.biases, layout.scale_dtype),
        );
        let d = dequantize(&a.q, &s, &b, group);
        let gshape = with_last(cols / group);
        let side = |v: Vec<f32>| {
            Tensor::from_vec(v, gshape.as_slice(), &Device::Cpu)?.to_dtype(layout.scale_dtype)
        };
        mlx.insert(
            name.clone(),
            Tensor::from_vec(pack(&a.q, bits), with_last(cols * bits / 32), &Device::Cpu)?,
        );
        mlx.insert(format!("{module}.scales"), side(s)?);
        mlx.insert(format!("{module}.biases"), side(b)?);
        deq.insert(name.clone(), Tensor::from_vec(d, w.dims(), &Device::Cpu)?);
        n += 1;
    }
    Ok((mlx, deq, n))
}
