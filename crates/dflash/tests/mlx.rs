//! MLX affine-quantized safetensors (the mlx-community layout): the loader's dequantization
//! is bit-exact against MLX itself (fixture recorded with the `mlx` package by
//! tools/mlx-fixtures/make_fixtures.py) and against this test's own quantizer
//! (tests/common/mlx.rs, which reproduces MLX's `quantize`); an MLX checkpoint of a tiny
//! qwen3 / llama gives exactly the logits of its float twin holding the dequantized weights;
//! malformed checkpoints fail with errors naming the tensor or config field.

mod common;
use candle_core::{DType, Device, Tensor};
use common::mlx::{
    dequantize, pack, quantize, qwen3_moe_128, round_to, write_mlx, write_mlx_moe, Layout,
};
use common::*;
use dflash::archs::{load_target, LoadOptions};
use dflash::source::mlx::MlxQuant;
use dflash::source::{ModelSource, Weights};
use dflash::testing::{Rng, TinyTarget};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/mlx/affine.safetensors"
);

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `(prefix, bits, group)` of every fixture entry (`b4_g64`, `b4_g64_bf16`, ...).
fn fixture_entries() -> Vec<(String, usize, usize)> {
    let t = candle_core::safetensors::load(FIXTURE, &Device::Cpu).unwrap();
    let mut v: Vec<(String, usize, usize)> = t
        .keys()
        .filter_map(|k| k.strip_suffix(".input"))
        .map(|p| {
            let mut it = p.split('_');
            let bits = it.next().unwrap()[1..].parse().unwrap();
            let group = it.next().unwrap()[1..].parse().unwrap();
            (p.to_string(), bits, group)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn loader_dequantizes_mlx_fixtures_bit_exactly() {
    let entries = fixture_entries();
    // 18 (bits, group) pairs in f32, plus bf16 / f16 scales for 4 and 8 bits
    assert_eq!(entries.len(), 22, "{entries:?}");
    let mut q = serde_json::Map::new();
    for (p, bits, group) in &entries {
        q.insert(p.clone(), json!({"bits": bits, "group_size": group}));
    }
    let cfg = json!({ "quantization": q });
    let quant = MlxQuant::from_config("fixture", &cfg).unwrap();
    let w = Weights::open(&[PathBuf::from(FIXTURE)], DType::F32, &Device::Cpu)
        .unwrap()
        .with_mlx_quant(quant);
    let raw = candle_core::safetensors::load(FIXTURE, &Device::Cpu).unwrap();
    for (p, bits, group) in &entries {
        let got = w.get(&format!("{p}.weight"), (3, 256)).unwrap();
        let want = f32s(&raw[&format!("{p}.dequantized")]);
        assert_eq!(
            bits_of(&f32s(&got)),
            bits_of(&want),
            "{p}: loader vs mx.dequantize ({bits}-bit g{group})"
        );
        // the logical shape, not the packed one
        assert_eq!(w.shape(&format!("{p}.weight")), Some(vec![3, 256]));
        // quantization is lossy but bounded: the input is within ~1.5 steps of its value
        let input = f32s(&raw[&format!("{p}.input")]);
        let scales = f32s(&raw[&format!("{p}.scales")]);
        for (i, (x, y)) in input.iter().zip(&want).enumerate() {
            let step = scales[i / group].abs();
            assert!(
                (x - y).abs() <= 1.5 * step + 1e-6,
                "{p}[{i}]: {x} -> {y}, step {step}"
            );
        }
    }
    let report = w.quant_report().unwrap();
    assert!(report.starts_with("mlx affine 2-bit g32 x1,"), "{report}");
    assert!(report.contains("4-bit g64 x3"), "{report}");
    assert!(report.ends_with("; dequantized to f32"), "{report}");
}

#[test]
fn test_quantizer_reproduces_mlx() {
    // The quantizer the other tests use produces MLX's packed words, scales and biases.
    let raw = candle_core::safetensors::load(FIXTURE, &Device::Cpu).unwrap();
    for (p, bits, group) in fixture_entries() {
        let input = &raw[&format!("{p}.input")];
        let dt = input.dtype();
        let a = quantize(&f32s(input), 256, bits, group);
        let words = raw[&format!("{p}.weight")]
            .flatten_all()
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        assert_eq!(pack(&a.q, bits), words, "{p}: packed words");
        let (s, b) = (round_to(&a.scales, dt), round_to(&a.biases, dt));
        assert_eq!(
            bits_of(&s),
            bits_of(&f32s(&raw[&format!("{p}.scales")])),
            "{p}: scales"
        );
        assert_eq!(
            bits_of(&b),
            bits_of(&f32s(&raw[&format!("{p}.biases")])),
            "{p}: biases"
        );
        assert_eq!(
            bits_of(&dequantize(&a.q, &s, &b, group)),
            bits_of(&f32s(&raw[&format!("{p}.dequantized")])),
            "{p}: dequantized"
        );
    }
}

#[test]
fn packing_follows_mlx_bit_order() {
    // Known answers from MLX's layout, independent of both packers: values 0, 1, 2, ...
    // fill each u32 from its low bits (4 bits: 0x76543210); 3 bits form one bit stream
    // across words (value i at bits 3i..3i+3).
    let q: Vec<u32> = (0..32).map(|i| i % 16).collect();
    assert_eq!(
        pack(&q, 4),
        vec![0x7654_3210, 0xFEDC_BA98, 0x7654_3210, 0xFEDC_BA98]
    );
    let q: Vec<u32> = (0..32).map(|i| i % 8).collect();
    let words = pack(&q, 3);
    assert_eq!(words.len(), 3);
    let stream = words
        .iter()
        .enumerate()
        .fold(0u128, |acc, (i, &w)| acc | (w as u128) << (32 * i));
    for (i, &v) in q.iter().enumerate() {
        assert_eq!((stream >> (3 * i)) & 7, v as u128, "value {i}");
    }
}

/// One matrix in MLX layout as module `m` of a fresh safetensors file.
fn write_matrix(
    dir: &Path,
    w: &[f32],
    rows: usize,
    cols: usize,
    bits: usize,
    group: usize,
    dt: DType,
) -> Vec<f32> {
    let a = quantize(w, cols, bits, group);
    let (s, b) = (round_to(&a.scales, dt), round_to(&a.biases, dt));
    let side = |v: &[f32]| {
        Tensor::from_vec(v.to_vec(), (rows, cols / group), &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
    };
    let mut t = HashMap::new();
    t.insert(
        "m.weight".to_string(),
        Tensor::from_vec(pack(&a.q, bits), (rows, cols * bits / 32), &Device::Cpu).unwrap(),
    );
    t.insert("m.scales".to_string(), side(&s));
    t.insert("m.biases".to_string(), side(&b));
    candle_core::safetensors::save(&t, dir.join("m.safetensors")).unwrap();
    dequantize(&a.q, &s, &b, group)
}

#[test]
fn dequantized_weights_equal_the_mlx_formula() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::new(7);
    let (rows, cols) = (5, 384);
    let mut case = 0;
    for bits in [2, 3, 4, 5, 6, 8] {
        for group in [32, 64, 128] {
            case += 1;
            let dt = [DType::BF16, DType::F16, DType::F32][case % 3];
            let mut w: Vec<f32> = (0..rows * cols)
                .map(|_| (rng.normal() * 0.05) as f32)
                .collect();
            w[..group].iter_mut().for_each(|x| *x = -0.25); // constant group
            w[cols + 7] = 3.0; // outlier
            let want = write_matrix(dir.path(), &w, rows, cols, bits, group, dt);
            let cfg = json!({"quantization": {"bits": bits, "group_size": group}});
            let quant = MlxQuant::from_config("cfg", &cfg).unwrap();
            for compute in [DType::F32, DType::BF16] {
                let wts = Weights::open(&[dir.path().join("m.safetensors")], compute, &Device::Cpu)
                    .unwrap()
                    .with_mlx_quant(quant.clone());
                let got = wts.get("m.weight", (rows, cols)).unwrap();
                assert_eq!(got.dtype(), compute);
                let want_c = round_to(&want, compute);
                assert_eq!(
                    bits_of(&f32s(&got)),
                    bits_of(&want_c),
                    "{bits}-bit g{group}, scales {dt:?}, compute {compute:?}"
                );
                assert!(wts.unused().is_empty(), "{:?}", wts.unused());
                assert_eq!(
                    wts.quant_report().unwrap(),
                    format!(
                        "mlx affine {bits}-bit g{group} x1; dequantized to {}",
                        format!("{compute:?}").to_lowercase()
                    )
                );
            }
            // the constant group comes back exactly
            assert!(want[..group].iter().all(|&x| x == -0.25));
        }
    }
}

#[test]
fn mlx_checkpoint_gives_the_logits_of_its_dequantized_twin() {
    let mut mixed_q = Layout::new(4, 64);
    mixed_q.modules = vec![
        ("model.layers.1.self_attn.q_proj", Some((8, 32))),
        ("model.layers.0.mlp.down_proj", None),
        ("model.embed_tokens", Some((6, 128))),
        ("lm_head", Some((3, 128))),
    ];
    let mut mixed_l = Layout::new(4, 32);
    mixed_l.modules = vec![
        ("model.layers.0.mlp.gate_proj", Some((2, 64))),
        ("model.layers.1.self_attn.o_proj", None),
    ];
    let mut spelled = Layout::new(4, 64);
    spelled.key = "quantization_config";
    spelled.scale_dtype = DType::F16;
    let mut f32_scales = Layout::new(5, 32);
    f32_scales.scale_dtype = DType::F32;
    let cases = [
        (
            qwen3_128(41),
            mixed_q,
            "mlx affine 3-bit g128 x1, 4-bit g64 x26, 6-bit g128 x1, 8-bit g32 x1;",
        ),
        (
            TinyTarget::llama(42),
            mixed_l,
            "mlx affine 2-bit g64 x1, 4-bit g32 x27;",
        ),
        (qwen3_128(43), Layout::new(8, 128), "8-bit g128 x30"),
        (TinyTarget::llama(44), spelled, "4-bit g64 x29"),
        (TinyTarget::qwen3(45), f32_scales, "5-bit g32 x30"),
    ];
    for (t, layout, report) in cases {
        let dir = tempfile::tempdir().unwrap();
        let (mlx_dir, twin) = (dir.path().join("mlx"), dir.path().join("twin"));
        let n = write_mlx(&t, &layout, &mlx_dir, &twin);
        let q = load_with(&mlx_dir).unwrap();
        let f = load_with(&twin).unwrap();
        let info = q.info().quantization.clone().unwrap();
        assert!(info.contains(report), "{}: {info}", t.model_type);
        assert!(info.ends_with("; dequantized to f32"), "{info}");
        let counted: usize = info
            .split([',', ';'])
            .filter_map(|p| p.trim().rsplit_once(" x"))
            .map(|(_, k)| k.parse::<usize>().unwrap())
            .sum();
        assert_eq!(counted, n, "{info}");
        assert_eq!(f.info().quantization, None);
        assert_eq!(q.info().family, f.info().family);
        assert_eq!(q.info().weight_bytes, f.info().weight_bytes);
        let toks = ids(t.seed, 24, t.vocab);
        let (a, b) = (all_logits(q.as_ref(), &toks), all_logits(f.as_ref(), &toks));
        assert_eq!(
            bits_of(&f32s(&a)),
            bits_of(&f32s(&b)),
            "{}: logits differ",
            t.model_type
        );
        // and the quantized model is a close approximation of the original float one
        t.write(&dir.path().join("orig")).unwrap();
        let o = all_logits(load(&dir.path().join("orig")).as_ref(), &toks);
        let rel = max_abs_diff(&a, &o) / max_abs_diff(&o, &o.zeros_like().unwrap());
        assert!(
            rel < 0.5,
            "{}: relative diff to the float model {rel}",
            t.model_type
        );
    }
}

/// A MoE checkpoint as mlx-lm writes it (the experts stacked per projection under
/// `mlp.switch_mlp`, quantized as 3-D tensors; the routers at 8 bits) gives exactly the
/// logits of its twin holding the dequantized weights per expert in the Hugging Face layout.
#[test]
fn mlx_moe_checkpoint_gives_the_logits_of_its_dequantized_twin() {
    for (bits, group, seed) in [(4, 64, 47), (4, 32, 48), (8, 128, 49)] {
        let (t, layout) = qwen3_moe_128(seed, bits, group);
        let dir = tempfile::tempdir().unwrap();
        let (mlx_dir, twin) = (dir.path().join("mlx"), dir.path().join("twin"));
        let n = write_mlx_moe(&t, &layout, &mlx_dir, &twin);
        let names = candle_core::safetensors::load(mlx_dir.join("model.safetensors"), &Device::Cpu)
            .unwrap();
        assert!(names.contains_key("model.layers.0.mlp.switch_mlp.down_proj.scales"));
        assert!(!names.keys().any(|k| k.contains(".experts.")));
        let q = load_with(&mlx_dir).unwrap();
        let f = load_with(&twin).unwrap();
        let info = q.info().quantization.clone().unwrap();
        // three routers at 8 bits g64; 3 MoE layers x 3 stacks among the rest
        assert!(info.contains("8-bit g64 x3"), "{info}");
        let counted: usize = info
            .split([',', ';'])
            .filter_map(|p| p.trim().rsplit_once(" x"))
            .map(|(_, k)| k.parse::<usize>().unwrap())
            .sum();
        assert_eq!(counted, n, "{info}");
        assert_eq!(q.info().weight_bytes, f.info().weight_bytes);
        let toks = ids(t.seed, 24, t.vocab);
        let (a, b) = (all_logits(q.as_ref(), &toks), all_logits(f.as_ref(), &toks));
        assert_eq!(
            bits_of(&f32s(&a)),
            bits_of(&f32s(&b)),
            "{bits}-bit g{group}: logits differ from the dequantized twin's"
        );
    }
}

// ---- malformed checkpoints ----------------------------------------------------------------

/// A 4-bit g32 llama in MLX layout, then `edit` applied to its tensors and config; the
/// load error message.
fn load_error(
    edit_tensors: impl FnOnce(&mut HashMap<String, Tensor>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (mlx_dir, twin) = (dir.path().join("mlx"), dir.path().join("twin"));
    write_mlx(&TinyTarget::llama(3), &Layout::new(4, 32), &mlx_dir, &twin);
    let st = mlx_dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
    edit_tensors(&mut t);
    candle_core::safetensors::save(&t, &st).unwrap();
    let cfg_path = mlx_dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    edit_config(&mut cfg);
    dflash::testing::write_json(&cfg_path, &cfg).unwrap();
    match load_with(&mlx_dir) {
        Ok(_) => panic!("a malformed checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

const Q: &str = "model.layers.0.self_attn.q_proj";

fn expect(msg: &str, parts: &[&str]) {
    eprintln!("{msg}");
    for p in parts {
        assert!(msg.contains(p), "error lacks `{p}`: {msg}");
    }
}

#[test]
fn malformed_mlx_checkpoints_name_the_tensor_or_field() {
    let none = |_: &mut serde_json::Value| {};
    let keep = |_: &mut HashMap<String, Tensor>| {};
    // wrong packed shape: a column short
    let e = load_error(
        |t| {
            let w = t[&format!("{Q}.weight")].clone();
            let cols = w.dim(1).unwrap();
            t.insert(format!("{Q}.weight"), w.narrow(1, 0, cols - 1).unwrap());
        },
        none,
    );
    expect(
        &e,
        &[
            &format!("{Q}.weight"),
            "packed shape [64, 7]",
            "expected [64, 8]",
        ],
    );
    // missing scales / biases
    let e = load_error(
        |t| {
            t.remove(&format!("{Q}.scales"));
        },
        none,
    );
    expect(&e, &[&format!("{Q}.scales"), "missing"]);
    let e = load_error(
        |t| {
            t.remove(&format!("{Q}.biases"));
        },
        none,
    );
    expect(&e, &[&format!("{Q}.biases"), "missing"]);
    // scales of the wrong shape
    let e = load_error(
        |t| {
            let s = t[&format!("{Q}.scales")].narrow(1, 0, 1).unwrap();
            t.insert(format!("{Q}.scales"), s);
        },
        none,
    );
    expect(&e, &[&format!("{Q}.scales"), "[64, 1]", "expected [64, 2]"]);
    // unsupported bits, unsupported group size, a group size not dividing an in-dimension
    let e = load_error(keep, |c| c["quantization"]["bits"] = json!(7));
    expect(&e, &["quantization.bits", "7-bit", "2, 3, 4, 5, 6, 8"]);
    let e = load_error(keep, |c| c["quantization"]["group_size"] = json!(48));
    expect(&e, &["quantization.group_size", "48"]);
    let e = load_error(keep, |c| c["quantization"]["group_size"] = json!(128));
    expect(
        &e,
        &[
            "quantization.group_size",
            "does not divide the input dimension 64",
            "model.embed_tokens.weight",
        ],
    );
    // ... also for a per-module entry, which the error names
    let e = load_error(keep, |c| {
        c["quantization"][Q] = json!({"bits": 4, "group_size": 128})
    });
    expect(
        &e,
        &[
            &format!("quantization.{Q}.group_size"),
            "does not divide the input dimension 64",
        ],
    );
    // packed weights without a quantization entry
    let e = load_error(keep, |c| {
        c.as_object_mut().unwrap().remove("quantization");
    });
    expect(&e, &["model.embed_tokens.weight", "no `quantization"]);
    // config says float, checkpoint is quantized
    let e = load_error(keep, |c| c["quantization"][Q] = json!(false));
    expect(
        &e,
        &[
            &format!("quantization.{Q}"),
            "false",
            &format!("{Q}.scales"),
        ],
    );
    // scales beside a float weight
    let e = load_error(
        |t| {
            t.insert(
                format!("{Q}.weight"),
                Tensor::zeros((64, 64), DType::F32, &Device::Cpu).unwrap(),
            );
        },
        none,
    );
    expect(&e, &[&format!("{Q}.weight"), "packed uint32"]);
    // other modes and other formats
    let e = load_error(keep, |c| c["quantization"]["mode"] = json!("mxfp4"));
    expect(&e, &["quantization.mode", "mxfp4", "affine"]);
    let e = load_error(keep, |c| {
        let o = c.as_object_mut().unwrap();
        o.remove("quantization");
        o.insert(
            "quantization_config".into(),
            json!({"quant_method": "bitsandbytes", "load_in_4bit": true}),
        );
    });
    expect(&e, &["quantization_config.quant_method", "bitsandbytes"]);
}

#[test]
fn mlx_quantized_draft_proposes_like_its_dequantized_twin() {
    // A DFlash draft converted to MLX 4-bit loads the same weights as its float twin: the
    // engine's output and every cycle's acceptance length are the same.
    use common::mlx::quantize_checkpoint;
    use dflash::engine::{Engine, Flow, GenerateRequest};
    use dflash::testing::TinyDraft;
    let mut t = TinyTarget::qwen3(61);
    t.dominant = vec![(3, 4.0), (7, 3.0)];
    let d = TinyDraft::for_target(&t, 2, vec![0, 2], 8, 62);
    let dir = tempfile::tempdir().unwrap();
    t.write(&dir.path().join("t")).unwrap();
    let (ddir, twin) = (dir.path().join("d"), dir.path().join("twin"));
    d.write(&twin, t.vocab).unwrap();
    let float =
        candle_core::safetensors::load(twin.join("model.safetensors"), &Device::Cpu).unwrap();
    let (mlx, deq, n) = quantize_checkpoint(&float, &Layout::new(4, 32));
    assert_eq!(n, 1 + 2 * 7, "fc and every layer's linears");
    std::fs::create_dir_all(&ddir).unwrap();
    candle_core::safetensors::save(&mlx, ddir.join("model.safetensors")).unwrap();
    candle_core::safetensors::save(&deq, twin.join("model.safetensors")).unwrap();
    let mut cfg = d.config(t.vocab);
    cfg["quantization"] = Layout::new(4, 32).config_entry();
    dflash::testing::write_json(&ddir.join("config.json"), &cfg).unwrap();
    let engine = |draft_dir: &Path| {
        let tsrc = ModelSource::from_dir("t", &dir.path().join("t")).unwrap();
        let (cfg, target) = load_target(&tsrc, &LoadOptions::default()).unwrap();
        let dsrc = ModelSource::from_dir("d", draft_dir).unwrap();
        let draft = dflash::draft::load_draft(&dsrc, &cfg, "t", &LoadOptions::default()).unwrap();
        Engine::new(target, Some(draft))
    };
    let (a, b) = (engine(&ddir), engine(&twin));
    let mut accepted = 0;
    for case in 0..6 {
        let mut r = GenerateRequest::new(ids(70 + case, 5 + 3 * case as usize, t.vocab - 1), 24);
        r.block_size = Some(8);
        let x = a.generate(&r, &mut |_| Flow::Continue).unwrap();
        let y = b.generate(&r, &mut |_| Flow::Continue).unwrap();
        assert_eq!(x.output_ids, y.output_ids);
        assert_eq!(
            x.stats.acceptance_lengths, y.stats.acceptance_lengths,
            "case {case}"
        );
        accepted += x
            .stats
            .acceptance_lengths
            .iter()
            .filter(|&&l| l > 1)
            .count();
    }
    assert!(
        accepted > 0,
        "the draft never got a token accepted: the comparison is empty"
    );
}

/// Qwen3.5 / Qwen3.6 (dense, MoE, text-only tied) and Qwen3-Next checkpoints as mlx-lm
/// converts them (`common::mlx::convert_hybrid_like_mlx_lm`: `language_model.model.` names,
/// conv1d `[C, K, 1]`, the layer / final / q-k norms stored as `1 + w`, experts in
/// `switch_mlp` stacks, quantized with the routers and shared-expert gates at 8 bits g64)
/// give exactly the logits of their twin in the Hugging Face layout holding the dequantized
/// weights (norms zero-centred, as the source has them).
#[test]
fn mlx_lm_hybrid_checkpoint_gives_the_logits_of_its_dequantized_twin() {
    use common::mlx::{convert_hybrid_like_mlx_lm, mlx_lm_hybrid_name, SHIFTED_NORMS};
    use dflash::nn::RmsNorm;
    let cases = [
        ("qwen3_5", 4, 32),
        ("qwen3_5", 8, 64),
        ("qwen3_5_moe", 4, 32),
        ("qwen3_5_moe", 3, 64),
        ("qwen3_next", 4, 32),
        ("qwen3_next", 6, 64),
        ("qwen3_5_text_tied", 5, 32),
    ];
    for (name, bits, group) in cases {
        let case = format!("{name} {bits}-bit g{group}");
        let src = fixture(name);
        let dir = tempfile::tempdir().unwrap();
        let (mlx_dir, twin) = (dir.path().join("mlx"), dir.path().join("twin"));
        let (n, sanitized) = convert_hybrid_like_mlx_lm(&src, bits, group, &mlx_dir, &twin);
        let stored =
            candle_core::safetensors::load(mlx_dir.join("model.safetensors"), &Device::Cpu)
                .unwrap();
        let qwen3_5 = name != "qwen3_next";
        let pre = if qwen3_5 {
            "language_model.model."
        } else {
            "model."
        };
        let conv = format!("{pre}layers.0.linear_attn.conv1d.weight");
        assert_eq!(stored[&conv].dims()[1..], [4, 1], "{case}");
        assert!(
            !stored.keys().any(|k| k.starts_with("model.language_model")
                || k.contains("visual")
                || k.contains(".experts.")),
            "{case}"
        );
        if qwen3_5 && name != "qwen3_5_text_tied" {
            assert!(
                stored.contains_key("language_model.lm_head.scales"),
                "{case}"
            );
        }

        // the loader's `1 + w` (in f32) of a zero-centred norm is bit for bit mlx-lm's
        let hf =
            candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
        let to_map = |m: &HashMap<String, Tensor>| m.clone().into_iter().collect();
        let (wh, wm) = (
            Weights::from_tensors(to_map(&hf), DType::F32, &Device::Cpu),
            Weights::from_tensors(to_map(&sanitized), DType::F32, &Device::Cpu),
        );
        let mut shifted = 0;
        for (k, t) in &hf {
            if t.rank() != 1 || !SHIFTED_NORMS.iter().any(|s| k.ends_with(s)) {
                continue;
            }
            let m = mlx_lm_hybrid_name(k, qwen3_5).unwrap();
            let d = t.dim(0).unwrap();
            let a = RmsNorm::load(&wh, k, d, 1e-6, true).unwrap().weight;
            let b = RmsNorm::load(&wm, &m, d, 1e-6, false).unwrap().weight;
            assert_eq!(bits_of(&f32s(&a)), bits_of(&f32s(&b)), "{case}: {k}");
            assert_ne!(bits_of(&f32s(t)), bits_of(&f32s(&b)), "{case}: {k}");
            shifted += 1;
        }
        assert!(shifted >= 5, "{case}: {shifted} shifted norms");

        let q = load_with(&mlx_dir).unwrap();
        let f = load_with(&twin).unwrap();
        let info = q.info().quantization.clone().unwrap();
        let gates = sanitized
            .keys()
            .filter(|k| k.ends_with("mlp.gate.weight") || k.ends_with("shared_expert_gate.weight"))
            .count();
        if gates > 0 {
            assert!(
                info.contains(&format!("8-bit g64 x{gates}")),
                "{case}: {info}"
            );
        }
        let counted: usize = info
            .split([',', ';'])
            .filter_map(|p| p.trim().rsplit_once(" x"))
            .map(|(_, k)| k.parse::<usize>().unwrap())
            .sum();
        assert_eq!(counted, n, "{case}: {info}");
        assert_eq!(f.info().quantization, None);
        assert_eq!(q.info().family, f.info().family);
        assert_eq!(q.info().weight_bytes, f.info().weight_bytes, "{case}");
        let toks = ids(bits as u64 * 100 + group as u64, 24, 256);
        let (a, b) = (all_logits(q.as_ref(), &toks), all_logits(f.as_ref(), &toks));
        assert_eq!(
            bits_of(&f32s(&a)),
            bits_of(&f32s(&b)),
            "{case}: logits differ from the dequantized twin's"
        );
        // and the quantized model approximates the source
        let o = all_logits(load(&src).as_ref(), &toks);
        let rel = max_abs_diff(&a, &o) / max_abs_diff(&o, &o.zeros_like().unwrap());
        eprintln!("{case}: {n} quantized ({info}); relative diff to the source {rel}");
        // (the fixtures' matrices, sd 0.12 at width 64, make 3- to 5-bit noise comparable
        // to the logits themselves; from 6 bits on the model stays close)
        if bits >= 6 {
            assert!(rel < 0.5, "{case}: relative diff to the source {rel}");
        }
    }
}

/// A checkpoint whose conv1d weights mix the Hugging Face `[C, 1, K]` and mlx-lm's
/// `[C, K, 1]` shapes (so whether its norms hold `w` or `1 + w` is unknown) is refused.
#[test]
fn hybrid_checkpoint_mixing_conv1d_layouts_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mlx_dir, twin) = (dir.path().join("mlx"), dir.path().join("twin"));
    common::mlx::convert_hybrid_like_mlx_lm(&fixture("qwen3_5"), 4, 32, &mlx_dir, &twin);
    let st = mlx_dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
    let c2 = "language_model.model.layers.2.linear_attn.conv1d.weight";
    let back = t[c2].transpose(1, 2).unwrap().contiguous().unwrap();
    t.insert(c2.to_string(), back);
    candle_core::safetensors::save(&t, &st).unwrap();
    let e = match load_with(&mlx_dir) {
        Ok(_) => panic!("a checkpoint mixing conv1d layouts loaded"),
        Err(e) => e.to_string(),
    };
    expect(
        &e,
        &[
            "language_model.model.layers.0.linear_attn.conv1d.weight` is [128, 4, 1]",
            &format!("`{c2}` is [128, 1, 4]"),
            "mix the Hugging Face and mlx-lm layouts",
        ],
    );
}
