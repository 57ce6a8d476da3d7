//! Integer group-quantized safetensors (AutoAWQ GEMM, GPTQ v1 / v2, compressed-tensors
//! pack-quantized): a checkpoint of a tiny target in each layout, written by
//! tests/common/intq.rs from the published packers' definitions, gives exactly the logits of
//! its float twin holding the dequantized weights `s * (q - z)` (on the CPU, where the loader
//! dequantizes to f32); malformed ones fail with one-line errors naming the tensor or field.

mod common;
use candle_core::{DType, Device, Tensor};
use common::intq::{write_int, Format, Scheme};
use common::*;
use dflash::testing::TinyTarget;
use std::collections::HashMap;

#[test]
fn int_checkpoints_give_the_logits_of_their_dequantized_twin() {
    let gptq = |v2, sym| Format::Gptq { v2, sym };
    let cases = [
        (
            qwen3_128(81),
            Scheme::new(Format::Awq, 4, 128),
            "awq 4-bit g128 x28",
        ),
        (
            TinyTarget::llama(82),
            Scheme::new(Format::Awq, 4, 32),
            "awq 4-bit g32 x28",
        ),
        (
            TinyTarget::qwen3(83),
            Scheme::new(gptq(false, true), 4, 64),
            "gptq 4-bit g64 x28",
        ),
        (
            TinyTarget::qwen3(84),
            Scheme::new(gptq(false, false), 4, 32),
            "gptq 4-bit g32 x28",
        ),
        (
            qwen3_128(85),
            Scheme::new(gptq(true, false), 8, 128),
            "gptq_v2 8-bit g128 x28",
        ),
        (
            TinyTarget::qwen3(86),
            Scheme::new(Format::PackQuantized, 4, 32),
            "compressed-tensors pack-quantized 4-bit g32 x28",
        ),
        (
            TinyTarget::qwen2(87),
            Scheme::new(Format::PackQuantized, 8, 64),
            "compressed-tensors pack-quantized 8-bit g64 x28",
        ),
    ];
    for (t, scheme, report) in cases {
        let dir = tempfile::tempdir().unwrap();
        let (q_dir, twin) = (dir.path().join("q"), dir.path().join("twin"));
        let n = write_int(&t, &scheme, &q_dir, &twin);
        assert_eq!(n, 28, "{scheme:?}", scheme = scheme.format);
        let q = load_with(&q_dir).unwrap();
        let f = load_with(&twin).unwrap();
        let info = q.info().quantization.clone().unwrap();
        assert_eq!(info, format!("{report}; dequantized to f32"));
        assert_eq!(q.info().weight_bytes, f.info().weight_bytes);
        let toks = ids(t.seed, 24, t.vocab);
        let (a, b) = (all_logits(q.as_ref(), &toks), all_logits(f.as_ref(), &toks));
        assert!(
            f32_bits(&a) == f32_bits(&b),
            "{report}: logits differ from the twin's (max |diff| {})",
            max_abs_diff(&a, &b)
        );
        // and the quantized model approximates the float one it was made from
        t.write(&dir.path().join("orig")).unwrap();
        let o = all_logits(load(&dir.path().join("orig")).as_ref(), &toks);
        let rel = max_abs_diff(&a, &o) / max_abs_diff(&o, &o.zeros_like().unwrap());
        assert!(
            rel < 0.5,
            "{report}: relative diff to the float model {rel}"
        );
        eprintln!("ok {report}: rel diff to float {rel:.3}");
    }
}

/// MoE checkpoints with integer experts as published per expert (compressed-tensors, 4-bit
/// g32, the routers in float): a tiny qwen3_moe with every expert projection quantized, and
/// the transformers-made kimi_k25 fixture (its quantization_config under `text_config`, as
/// Kimi-K2.5 publishes it) with its routed experts' gate/up projections quantized (their
/// down projections are 16 wide, under a group) give exactly their twin's logits.
#[test]
fn int4_moe_experts_give_the_logits_of_their_dequantized_twin() {
    use common::intq::quantize_dir;
    let scheme = Scheme::new(Format::PackQuantized, 4, 32);
    let dir = tempfile::tempdir().unwrap();
    let (q_dir, twin) = (dir.path().join("q"), dir.path().join("twin"));
    let (t, _) = common::mlx::qwen3_moe_128(88, 4, 32);
    let n = write_int(&t, &scheme, &q_dir, &twin);
    let toks = ids(5, 20, t.vocab);
    let cases: Vec<(std::path::PathBuf, std::path::PathBuf, usize, Vec<u32>)> = {
        let kimi = common::fixture("kimi_k25");
        let (kq, ktwin) = (dir.path().join("kq"), dir.path().join("ktwin"));
        let experts = |name: &str, w: &Tensor| {
            w.rank() == 2
                && name.contains(".mlp.experts.")
                && (name.ends_with("gate_proj.weight") || name.ends_with("up_proj.weight"))
        };
        let kn = quantize_dir(&kimi, &scheme, &experts, true, &kq, &ktwin);
        assert_eq!(kn, 2 * 2 * 8, "2 MoE layers x 8 experts x gate/up");
        vec![(q_dir, twin, n, toks), (kq, ktwin, kn, ids(6, 20, 256))]
    };
    for (q_dir, twin, n, toks) in cases {
        let q = load_with(&q_dir).unwrap();
        let f = load_with(&twin).unwrap();
        let info = q.info().quantization.clone().unwrap();
        assert_eq!(
            info,
            format!("compressed-tensors pack-quantized 4-bit g32 x{n}; dequantized to f32")
        );
        let (a, b) = (all_logits(q.as_ref(), &toks), all_logits(f.as_ref(), &toks));
        assert!(
            f32_bits(&a) == f32_bits(&b),
            "{info}: logits differ from the twin's (max |diff| {})",
            max_abs_diff(&a, &b)
        );
        eprintln!("ok {} ({info})", q.info().family);
    }
}

/// A GPTQ (v1, symmetric, 4-bit g32) llama checkpoint with one edit to its tensors or config:
/// the load's error.
fn load_error(
    format: Format,
    edit_tensors: impl FnOnce(&mut HashMap<String, Tensor>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (q_dir, twin) = (dir.path().join("q"), dir.path().join("twin"));
    write_int(
        &TinyTarget::llama(3),
        &Scheme::new(format, 4, 32),
        &q_dir,
        &twin,
    );
    let st = q_dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
    edit_tensors(&mut t);
    candle_core::safetensors::save(&t, &st).unwrap();
    let cfg_path = q_dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    edit_config(&mut cfg);
    dflash::testing::write_json(&cfg_path, &cfg).unwrap();
    match load_with(&q_dir) {
        Ok(_) => panic!("a malformed checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

const Q: &str = "model.layers.0.self_attn.q_proj";

fn expect(msg: &str, parts: &[&str]) {
    eprintln!("{msg}");
    assert!(!msg.contains('\n'), "not one line: {msg}");
    for p in parts {
        assert!(msg.contains(p), "error lacks `{p}`: {msg}");
    }
}

#[test]
fn malformed_int_checkpoints_name_the_tensor_or_field() {
    let gptq = Format::Gptq {
        v2: false,
        sym: true,
    };
    let none = |_: &mut serde_json::Value| {};
    let keep = |_: &mut HashMap<String, Tensor>| {};
    // truncated packed tensor: a row of words short
    let e = load_error(
        gptq,
        |t| {
            let w = t[&format!("{Q}.qweight")].clone();
            let rows = w.dim(0).unwrap();
            t.insert(format!("{Q}.qweight"), w.narrow(0, 0, rows - 1).unwrap());
        },
        none,
    );
    expect(&e, &[&format!("{Q}.qweight"), "expected [8, 64]"]);
    // scales of the wrong shape
    let e = load_error(
        Format::Awq,
        |t| {
            let s = t[&format!("{Q}.scales")].clone();
            t.insert(format!("{Q}.scales"), s.narrow(1, 0, 32).unwrap());
        },
        none,
    );
    expect(&e, &[&format!("{Q}.scales"), "[2, 32]", "expected [2, 64]"]);
    // a missing zero-point tensor
    let e = load_error(
        Format::Awq,
        |t| {
            t.remove(&format!("{Q}.qzeros"));
        },
        none,
    );
    expect(&e, &["missing tensor", &format!("{Q}.qzeros")]);
    // packed integers stored as floats
    let e = load_error(
        Format::PackQuantized,
        |t| {
            let w = t[&format!("{Q}.weight_packed")]
                .to_dtype(DType::F32)
                .unwrap();
            t.insert(format!("{Q}.weight_packed"), w);
        },
        none,
    );
    expect(&e, &[&format!("{Q}.weight_packed"), "expected I32"]);
    // weight_shape disagreeing with the model
    let e = load_error(
        Format::PackQuantized,
        |t| {
            let s = Tensor::from_vec(vec![64i64, 32], 2, &Device::Cpu).unwrap();
            t.insert(format!("{Q}.weight_shape"), s);
        },
        none,
    );
    expect(&e, &[&format!("{Q}.weight_shape"), "[64, 32]", "[64, 64]"]);
    // act-order g_idx: not contiguous groups
    let e = load_error(
        gptq,
        |t| {
            let v: Vec<i32> = (0..64).map(|k| ((k + 1) % 64 / 32)).collect();
            t.insert(
                format!("{Q}.g_idx"),
                Tensor::from_vec(v, 64, &Device::Cpu).unwrap(),
            );
        },
        none,
    );
    expect(&e, &[&format!("{Q}.g_idx"), "act-order", "desc_act"]);
    // an unknown group size
    let e = load_error(gptq, keep, |c| {
        c["quantization_config"]["group_size"] = 48.into()
    });
    expect(&e, &["config.json", "quantization_config.group_size", "48"]);
    // packed tensors without a config that says how
    let e = load_error(gptq, keep, |c| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    expect(&e, &[&format!("{Q}.qweight"), "no `quantization_config`"]);
    // a config of one method over the tensors of another
    let e = load_error(Format::PackQuantized, keep, |c| {
        c["quantization_config"] =
            serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 32});
    });
    expect(
        &e,
        &[&format!("{Q}.weight_packed"), "awq 4-bit g32", "expected"],
    );
    // an unknown quant method stays refused by name
    let e = load_error(gptq, keep, |c| {
        c["quantization_config"] = serde_json::json!({"quant_method": "bitsandbytes"});
    });
    expect(
        &e,
        &[
            "quantization_config.quant_method",
            "bitsandbytes",
            "not supported",
        ],
    );
}
