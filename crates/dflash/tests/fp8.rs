//! FP8 block-quantized checkpoints (`source/fp8.rs`): a tiny target written as the publishers
//! lay FP8 out (float8 e4m3 matrices with a `_scale_inv` per block, `quantization_config:
//! {quant_method: "fp8", weight_block_size}`), by a quantizer written from the format
//! (tests/common/fp8.rs: candle's own e4m3 conversion, independent of the loader's decoder),
//! gives bit for bit the
//! logits of its dequantized twin (the same values as f32 safetensors); malformed files are
//! one-line errors naming the tensor or field.

mod common;
use candle_core::{DType, Device, Tensor};
use common::fp8::{quantize_dir, write_fp8};
use common::load_with;
use dflash::archs::{Logits, TargetModel};
use dflash::testing::{write_json, TinyTarget};
use std::collections::HashMap;
use std::path::Path;

/// Every position's logits, as f32 bits.
fn all_logits(m: &dyn TargetModel, toks: &[u32]) -> Vec<u32> {
    let mut c = m.new_cache(toks.len()).unwrap();
    let logits = m.forward(toks, 0, &mut c, &[], Logits::All).unwrap().logits;
    common::f32_bits(&logits.unwrap())
}

#[test]
fn fp8_checkpoint_gives_the_logits_of_its_dequantized_twin() {
    for (t, block, skip) in [
        (
            TinyTarget::qwen3(51),
            (16, 32),
            "model.layers.0.mlp.down_proj",
        ),
        (TinyTarget::llama(52), (128, 128), ""),
        (TinyTarget::qwen3(53), (24, 40), "model.layers.1.self_attn"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (fp8_dir, twin) = (dir.path().join("fp8"), dir.path().join("twin"));
        let n = write_fp8(
            &t,
            block,
            if skip.is_empty() { "-" } else { skip },
            &fp8_dir,
            &twin,
        );
        let q = load_with(&fp8_dir).unwrap();
        let f = load_with(&twin).unwrap();
        let info = q.info().quantization.clone().unwrap();
        assert_eq!(
            info,
            format!("fp8 e4m3 {}x{} x{n}; dequantized to f32", block.0, block.1)
        );
        assert_eq!(f.info().quantization, None);
        let toks: Vec<u32> = (0..20)
            .map(|i| (i * 7 + 3) as u32 % t.vocab as u32)
            .collect();
        let a = all_logits(q.as_ref(), &toks);
        assert_eq!(
            a,
            all_logits(f.as_ref(), &toks),
            "{} block {block:?}: logits differ from the dequantized twin",
            t.model_type
        );
        // and a close approximation of the float model it was made from
        t.write(&dir.path().join("orig")).unwrap();
        let o = all_logits(load_with(&dir.path().join("orig")).unwrap().as_ref(), &toks);
        let (a, o): (Vec<f32>, Vec<f32>) = (
            a.iter().map(|&b| f32::from_bits(b)).collect(),
            o.iter().map(|&b| f32::from_bits(b)).collect(),
        );
        let diff = a
            .iter()
            .zip(&o)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        let scale = o.iter().map(|x| x.abs()).fold(0f32, f32::max);
        assert!(
            diff / scale < 0.2,
            "{}: relative diff to the float model {}",
            t.model_type,
            diff / scale
        );
        assert!(diff > 0.0, "{}: FP8 changed nothing", t.model_type);
    }
}

/// Every family's fixture (tests/fixtures/targets: dense, MoE, MLA, the hybrids, Gemma, gpt-oss's
/// attention) as FP8 gives its dequantized twin's logits bit for bit.
#[test]
fn fp8_fixtures_of_every_family_load_as_their_twins() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/targets");
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    names.sort();
    let mut done = 0;
    for name in names {
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(root.join(&name).join("config.json")).unwrap(),
        )
        .unwrap();
        if cfg.get("quantization_config").is_some()
            || cfg.pointer("/text_config/quantization_config").is_some()
        {
            continue; // stored quantized already (gpt-oss MXFP4)
        }
        let dir = tempfile::tempdir().unwrap();
        let (fp8_dir, twin) = (dir.path().join("fp8"), dir.path().join("twin"));
        for d in [&fp8_dir, &twin] {
            std::fs::create_dir_all(d).unwrap();
            for f in ["config.json", "model.safetensors"] {
                std::fs::copy(root.join(&name).join(f), d.join(f)).unwrap();
            }
        }
        let n = quantize_dir((16, 32), "-", &fp8_dir, &twin);
        let q = load_with(&fp8_dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let f = load_with(&twin).unwrap_or_else(|e| panic!("{name} twin: {e}"));
        // (a multimodal fixture's vision matrices are quantized too, but not read)
        let report = q.info().quantization.clone();
        let read = report
            .as_deref()
            .and_then(|r| r.strip_prefix("fp8 e4m3 16x32 x"))
            .and_then(|r| r.split(';').next())
            .and_then(|c| c.parse::<usize>().ok());
        assert!(
            read.is_some_and(|c| c > 0 && c <= n),
            "{name}: {n} FP8 matrices, load report {report:?}"
        );
        let vocab = q.info().vocab_size as u32;
        let toks: Vec<u32> = (0..12).map(|i| (i * 5 + 1) % vocab).collect();
        assert_eq!(
            all_logits(q.as_ref(), &toks),
            all_logits(f.as_ref(), &toks),
            "{name}: logits differ from the dequantized twin"
        );
        done += 1;
    }
    assert!(done >= 15, "{done} fixtures");
}

/// A qwen3 in FP8 layout, then `edit` applied to its tensors and config; the load error.
fn load_error(
    edit_tensors: impl FnOnce(&mut HashMap<String, Tensor>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (fp8_dir, twin) = (dir.path().join("fp8"), dir.path().join("twin"));
    write_fp8(&TinyTarget::qwen3(5), (16, 32), "-", &fp8_dir, &twin);
    let st = fp8_dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
    edit_tensors(&mut t);
    candle_core::safetensors::save(&t, &st).unwrap();
    let cfg_path = fp8_dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    edit_config(&mut cfg);
    write_json(&cfg_path, &cfg).unwrap();
    match load_with(&fp8_dir) {
        Ok(_) => panic!("a malformed checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

const W: &str = "model.layers.0.self_attn.q_proj.weight";

fn expect(msg: &str, parts: &[&str]) {
    eprintln!("{msg}");
    assert!(!msg.contains('\n'), "one line: {msg}");
    for p in parts {
        assert!(msg.contains(p), "error lacks `{p}`: {msg}");
    }
}

#[test]
fn malformed_fp8_checkpoints_name_the_tensor_or_field() {
    let none = |_: &mut serde_json::Value| {};
    let keep = |_: &mut HashMap<String, Tensor>| {};
    let scale = format!("{W}_scale_inv");
    // the block scales missing
    let e = load_error(|t| drop(t.remove(&scale)), none);
    expect(&e, &[&scale, "missing"]);
    // scales of the wrong shape (one block row short)
    let e = load_error(
        |t| {
            let s = t[&scale].clone();
            let short = s.narrow(0, 0, s.dim(0).unwrap() - 1).unwrap();
            t.insert(scale.clone(), short);
        },
        none,
    );
    expect(&e, &[&scale, "expected", "weight_block_size"]);
    // a float weight with scales beside it
    let e = load_error(
        |t| {
            let w = t[W].to_dtype(DType::F32).unwrap();
            t.insert(W.to_string(), w);
        },
        none,
    );
    expect(&e, &[W, "F8_E4M3", &scale]);
    // float8 weights but no quantization_config
    let e = load_error(keep, |c| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    expect(&e, &["quantization_config", "fp8"]);
    // a block size the config cannot give
    let e = load_error(keep, |c| {
        c["quantization_config"]["weight_block_size"] = serde_json::json!([128]);
    });
    expect(
        &e,
        &["config.json", "quantization_config.weight_block_size"],
    );
    // the config's block size disagrees with the stored scales
    let e = load_error(keep, |c| {
        c["quantization_config"]["weight_block_size"] = serde_json::json!([32, 32]);
    });
    expect(&e, &["_scale_inv", "expected"]);
}
