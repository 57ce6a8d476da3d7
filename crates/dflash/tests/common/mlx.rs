//! An MLX affine quantizer written from MLX's definition (mlx/backend/cpu/quantized.cpp,
//! `quantize`; checked against MLX itself in tests/mlx.rs on the fixture that
//! tools/mlx-fixtures/make_fixtures.py records), and a writer of tiny checkpoints in the
//! mlx-community layout. Independent of the engine's loader (source/mlx.rs).

use candle_core::{DType, Device, Tensor};
use dflash::testing::{write_json, TinyTarget};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

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
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `v` rounded to `dt` (as MLX stores scales and biases in the weight's dtype), in f32.
pub fn round_to(v: &[f32], dt: DType) -> Vec<f32> {
    Tensor::new(v, &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
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

    fn params(&self, module: &str) -> Option<(usize, usize)> {
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
) -> (HashMap<String, Tensor>, HashMap<String, Tensor>, usize) {
    let (mut mlx, mut deq): (HashMap<String, Tensor>, HashMap<String, Tensor>) = Default::default();
    let mut n = 0;
    for (name, w) in float {
        let module = name
            .strip_suffix(".weight")
            .filter(|_| matches!(w.rank(), 2 | 3));
        let cols = *w.dims().last().unwrap();
        let params = module
            .and_then(|m| layout.params(m))
            .filter(|&(_, group)| cols % group == 0);
        let Some((bits, group)) = params else {
            mlx.insert(name.clone(), w.clone());
            deq.insert(name.clone(), w.clone());
            continue;
        };
        let module = module.unwrap();
        let lead = &w.dims()[..w.rank() - 1];
        let with_last = |last: usize| [lead, &[last]].concat();
        let a = quantize(
            &w.flatten_all().unwrap().to_vec1().unwrap(),
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
            Tensor::from_vec(v, gshape.as_slice(), &Device::Cpu)
                .unwrap()
                .to_dtype(layout.scale_dtype)
                .unwrap()
        };
        mlx.insert(
            name.clone(),
            Tensor::from_vec(pack(&a.q, bits), with_last(cols * bits / 32), &Device::Cpu).unwrap(),
        );
        mlx.insert(format!("{module}.scales"), side(s));
        mlx.insert(format!("{module}.biases"), side(b));
        deq.insert(
            name.clone(),
            Tensor::from_vec(d, w.dims(), &Device::Cpu).unwrap(),
        );
        n += 1;
    }
    (mlx, deq, n)
}

/// Write `t` in the MLX layout into `dir` and, into `twin`, the same model as float
/// safetensors holding exactly the dequantized weights. Returns the number of quantized
/// tensors.
pub fn write_mlx(t: &TinyTarget, layout: &Layout, dir: &Path, twin: &Path) -> usize {
    t.write(twin).unwrap();
    let float =
        candle_core::safetensors::load(twin.join("model.safetensors"), &Device::Cpu).unwrap();
    let (mlx, deq, n) = quantize_checkpoint(&float, layout);
    std::fs::create_dir_all(dir).unwrap();
    candle_core::safetensors::save(&mlx, dir.join("model.safetensors")).unwrap();
    candle_core::safetensors::save(&deq, twin.join("model.safetensors")).unwrap();
    let mut cfg = t.config();
    cfg[layout.key] = layout.config_entry();
    write_json(&dir.join("config.json"), &cfg).unwrap();
    n
}

/// The projections of a Qwen MoE expert, as both layouts name them.
const EXPERT_PROJS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// A float checkpoint's per-expert tensors (`{p}.experts.{e}.{proj}.weight`) stacked per
/// projection as mlx-lm's sanitize writes them (`{p}.switch_mlp.{proj}.weight [E, ..]`).
pub fn to_switch_mlp(float: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    let mut stacks: HashMap<String, Vec<(usize, Tensor)>> = HashMap::new();
    for (name, t) in float {
        let split = name.split_once(".experts.").and_then(|(p, rest)| {
            let (e, proj) = rest.split_once('.')?;
            let proj = proj.strip_suffix(".weight")?;
            EXPERT_PROJS
                .contains(&proj)
                .then(|| (p, e.parse::<usize>().ok(), proj))
        });
        match split {
            Some((p, Some(e), proj)) => stacks
                .entry(format!("{p}.switch_mlp.{proj}.weight"))
                .or_default()
                .push((e, t.clone())),
            _ => {
                out.insert(name.clone(), t.clone());
            }
        }
    }
    for (name, mut v) in stacks {
        v.sort_by_key(|(e, _)| *e);
        let ts: Vec<Tensor> = v.into_iter().map(|(_, t)| t).collect();
        out.insert(name, Tensor::stack(&ts, 0).unwrap());
    }
    out
}

/// The inverse of [`to_switch_mlp`]: stacks split into per-expert tensors.
pub fn from_switch_mlp(t: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    for (name, w) in t {
        match name.split_once(".switch_mlp.") {
            Some((p, proj)) => {
                for e in 0..w.dim(0).unwrap() {
                    out.insert(format!("{p}.experts.{e}.{proj}"), w.get(e).unwrap());
                }
            }
            None => {
                out.insert(name.clone(), w.clone());
            }
        }
    }
    out
}

/// [`write_mlx`] for a MoE target: the MLX checkpoint holds the experts as mlx-lm's
/// `switch_mlp` stacks (quantized as 3-D tensors), the twin the dequantized weights per
/// expert in the Hugging Face layout.
pub fn write_mlx_moe(t: &TinyTarget, layout: &Layout, dir: &Path, twin: &Path) -> usize {
    t.write(twin).unwrap();
    let float =
        candle_core::safetensors::load(twin.join("model.safetensors"), &Device::Cpu).unwrap();
    let (mlx, deq, n) = quantize_checkpoint(&to_switch_mlp(&float), layout);
    std::fs::create_dir_all(dir).unwrap();
    candle_core::safetensors::save(&mlx, dir.join("model.safetensors")).unwrap();
    candle_core::safetensors::save(&from_switch_mlp(&deq), twin.join("model.safetensors")).unwrap();
    let mut cfg = t.config();
    cfg[layout.key] = layout.config_entry();
    write_json(&dir.join("config.json"), &cfg).unwrap();
    n
}

/// A qwen3_moe of hidden 128 with 4 experts of width 128 (every in-width takes groups of 32,
/// 64 and 128; the layer-1 MLP dense) and mlx-lm's layout for it: `bits` / `group` for every
/// matrix, the routers (`mlp.gate`) at 8 bits g64 as mlx-lm's qwen3_moe `quant_predicate`.
pub fn qwen3_moe_128(seed: u64, bits: usize, group: usize) -> (TinyTarget, Layout) {
    let t = TinyTarget {
        model_type: "qwen3_moe".into(),
        hidden: 128,
        intermediate: 256,
        extra: json!({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "norm_topk_prob": true, "mlp_only_layers": [1]}),
        ..TinyTarget::qwen3(seed)
    };
    let mut layout = Layout::new(bits, group);
    for l in (0..t.layers).filter(|&l| l != 1) {
        let m: &'static str = Box::leak(format!("model.layers.{l}.mlp.gate").into_boxed_str());
        layout.modules.push((m, Some((8, 64))));
    }
    (t, layout)
}

/// The modules mlx-lm's Qwen3.5 / Qwen3-Next `quant_predicate` quantizes at 8 bits g64 (the
/// routers and the shared experts' gates; name suffixes).
const HYBRID_8BIT: [&str; 2] = ["mlp.gate", "shared_expert_gate"];

/// The 1-D norms mlx-lm's Qwen3.5 / Qwen3-Next `sanitize` stores as `1 + w` (name suffixes;
/// the DeltaNet's `linear_attn.norm` is not among them).
pub const SHIFTED_NORMS: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// mlx-lm's name for a tensor of a Hugging Face hybrid checkpoint, `None` for one it drops
/// (vision tower, `mtp.*`). Qwen3.5 (`qwen3_5.py` / `qwen3_5_moe.py` `Model.sanitize`):
/// `model.language_model.` becomes `language_model.model.`, other names get `language_model.`
/// in front; Qwen3-Next (`qwen3_next.py`) keeps the names.
pub fn mlx_lm_hybrid_name(name: &str, qwen3_5: bool) -> Option<String> {
    if name.starts_with("vision_tower") || name.starts_with("model.visual") || name.contains("mtp.")
    {
        return None;
    }
    if !qwen3_5 {
        return Some(name.to_string());
    }
    Some(match name.strip_prefix("model.language_model") {
        Some(rest) => format!("language_model.model{rest}"),
        None if name.starts_with("language_model.") => name.to_string(),
        None => format!("language_model.{name}"),
    })
}

/// A Hugging Face hybrid checkpoint (`src`: config.json and an f32 model.safetensors of
/// qwen3_5 / qwen3_5_moe / qwen3_5_text / qwen3_next) converted as `mlx_lm.convert -q` does:
/// `sanitize` (renames, vision and `mtp.*` dropped, a tied head dropped, conv1d `[C, 1, K]` ->
/// `[C, K, 1]`, the [`SHIFTED_NORMS`] + 1 in f32, per-expert tensors stacked into
/// `switch_mlp`), then every matrix whose input width the group size divides quantized at
/// `bits` / `group`, the routers and shared-expert gates at 8 bits g64 (per-module entries);
/// the config keeps the Hugging Face structure plus `quantization` (and its copy
/// `quantization_config`), without `vision_config`. Writes that to `mlx_dir` and, to `twin`,
/// the source checkpoint with each quantized matrix replaced by its dequantized values
/// (names, stacking, conv1d and zero-centred norms as in the source). Returns the number
/// of quantized tensors and the converted tensors before quantization.
///
/// Where this goes beyond mlx-lm: its qwen3_5_moe `sanitize` splits transformers' fused
/// `experts.gate_up_proj` (rows `:I` gate, `I:` up) and does not stack per-expert tensors,
/// which the fixtures hold (transformers writes them per expert): stacking those gives the
/// same `switch_mlp` tensors. Its qwen3_next `sanitize` stacks every layer's experts, so
/// does not take `mlp_only_layers` (the fixture's dense layer 1): only MoE layers are
/// stacked here.
pub fn convert_hybrid_like_mlx_lm(
    src: &Path,
    bits: usize,
    group: usize,
    mlx_dir: &Path,
    twin: &Path,
) -> (usize, HashMap<String, Tensor>) {
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let model_type = cfg["model_type"].as_str().unwrap();
    let qwen3_5 = model_type.starts_with("qwen3_5");
    assert!(qwen3_5 || model_type == "qwen3_next", "{model_type}");
    let text = cfg.get("text_config").unwrap_or(&cfg);
    let tied = text["tie_word_embeddings"].as_bool().unwrap_or(false)
        || cfg["tie_word_embeddings"].as_bool().unwrap_or(false);
    let hf = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut renamed: HashMap<String, Tensor> = HashMap::new();
    for (name, t) in &hf {
        assert_eq!(t.dtype(), DType::F32, "{name}");
        if tied && name == "lm_head.weight" {
            continue;
        }
        if let Some(n) = mlx_lm_hybrid_name(name, qwen3_5) {
            renamed.insert(n, t.clone());
        }
    }
    // qwen3_5: the norms shift when some conv1d is unsanitized; qwen3_next: when sanitize
    // runs at all (per-expert tensors present), which for a source checkpoint means always
    let unsanitized = renamed
        .iter()
        .any(|(k, v)| k.contains("conv1d.weight") && *v.dims().last().unwrap() != 1);
    assert!(
        unsanitized,
        "{}: not a Hugging Face checkpoint",
        src.display()
    );
    let mut sanitized: HashMap<String, Tensor> = HashMap::new();
    for (k, v) in to_switch_mlp(&renamed) {
        let v = if k.contains("conv1d.weight") && *v.dims().last().unwrap() != 1 {
            v.transpose(1, 2).unwrap().contiguous().unwrap() // moveaxis(2, 1)
        } else if v.rank() == 1 && SHIFTED_NORMS.iter().any(|s| k.ends_with(s)) {
            let plus: Vec<f32> = v
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x + 1.0)
                .collect();
            Tensor::new(plus, &Device::Cpu).unwrap()
        } else {
            v
        };
        sanitized.insert(k, v);
    }
    let mut layout = Layout::new(bits, group);
    let mut names: Vec<&String> = sanitized.keys().collect();
    names.sort();
    for k in names {
        if let Some(m) = k.strip_suffix(".weight") {
            if HYBRID_8BIT.iter().any(|s| m.ends_with(s)) {
                layout
                    .modules
                    .push((Box::leak(m.to_string().into_boxed_str()), Some((8, 64))));
            }
        }
    }
    let (mlx, deq, n) = quantize_checkpoint(&sanitized, &layout);
    std::fs::create_dir_all(mlx_dir).unwrap();
    candle_core::safetensors::save(&mlx, mlx_dir.join("model.safetensors")).unwrap();
    let mut mcfg = cfg.clone();
    mcfg.as_object_mut().unwrap().remove("vision_config");
    let mut q = layout.config_entry();
    q["mode"] = json!("affine");
    mcfg["quantization"] = q.clone();
    mcfg["quantization_config"] = q;
    write_json(&mlx_dir.join("config.json"), &mcfg).unwrap();
    // the twin: the source with its matrices (experts per expert again) dequantized
    let deq = from_switch_mlp(&deq);
    let mut tw = HashMap::new();
    for (name, t) in &hf {
        let v = match mlx_lm_hybrid_name(name, qwen3_5) {
            Some(m) if t.rank() >= 2 && !name.contains("conv1d.weight") => deq
                .get(&m)
                .unwrap_or_else(|| panic!("{name}: no `{m}` in the converted checkpoint"))
                .clone(),
            _ => t.clone(),
        };
        tw.insert(name.clone(), v);
    }
    std::fs::create_dir_all(twin).unwrap();
    candle_core::safetensors::save(&tw, twin.join("model.safetensors")).unwrap();
    std::fs::copy(src.join("config.json"), twin.join("config.json")).unwrap();
    (n, sanitized)
}
