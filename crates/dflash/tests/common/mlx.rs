//! Tiny checkpoints in the mlx-community layout, written with the library's MLX quantizer
//! (`dflash::source::mlx_write`: MLX's `quantize` from its definition, checked against MLX
//! itself in tests/mlx.rs on the fixture that tools/mlx-fixtures/make_fixtures.py records).
//! Independent of the engine's loader (source/mlx.rs).

use candle_core::{DType, Device, Tensor};
use dflash::testing::{write_json, TinyTarget};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

#[allow(unused_imports)] // each test crate uses some
pub use dflash::source::mlx_write::{dequantize, pack, quantize, round_to, Layout};

/// [`dflash::source::mlx_write::quantize_checkpoint`] for tests (panics on error).
pub fn quantize_checkpoint(
    float: &HashMap<String, Tensor>,
    layout: &Layout,
) -> (HashMap<String, Tensor>, HashMap<String, Tensor>, usize) {
    dflash::source::mlx_write::quantize_checkpoint(float, layout).unwrap()
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
