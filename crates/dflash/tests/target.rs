//! Target invariants on tiny random models of every dense family: incremental decoding ==
//! one full forward; truncate + re-forward == never having forwarded; taps mean "output of
//! decoder layer k".

mod common;
use common::*;
use dflash::archs::Logits;
use dflash::testing::TinyTarget;

fn families() -> Vec<TinyTarget> {
    let mut yarn = TinyTarget::qwen3(7);
    yarn.tied = true;
    yarn.extra = serde_json::json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}});
    vec![TinyTarget::qwen3(1), TinyTarget::llama(2), yarn]
}

#[test]
fn incremental_decoding_equals_full_forward() {
    for spec in families() {
        let dir = tempfile::tempdir().unwrap();
        spec.write(dir.path()).unwrap();
        let m = load(dir.path());
        let toks = ids(spec.seed, 40, spec.vocab);
        let mut c = m.new_cache(64).unwrap();
        let full = m
            .forward(&toks, 0, &mut c, &[], Logits::All)
            .unwrap()
            .logits
            .unwrap();
        // prefill 7, then one token at a time
        let mut c = m.new_cache(64).unwrap();
        let mut rows = vec![m
            .forward(&toks[..7], 0, &mut c, &[], Logits::All)
            .unwrap()
            .logits
            .unwrap()];
        for (i, t) in toks.iter().enumerate().skip(7) {
            rows.push(
                m.forward(&[*t], i, &mut c, &[], Logits::Last)
                    .unwrap()
                    .logits
                    .unwrap(),
            );
        }
        let inc = candle_core::Tensor::cat(&rows, 0).unwrap();
        let d = max_abs_diff(&full, &inc);
        assert!(
            d < 1e-4,
            "{}: incremental vs full max diff {d}",
            spec.model_type
        );
        // blocks of 1..16 after a truncate: forward garbage, truncate it, then the real block
        for q in 1..=16usize {
            let mut c = m.new_cache(64).unwrap();
            m.forward(&toks[..10], 0, &mut c, &[], Logits::None)
                .unwrap();
            let junk: Vec<u32> = toks[..q]
                .iter()
                .map(|t| (t + 1) % spec.vocab as u32)
                .collect();
            m.forward(&junk, 10, &mut c, &[], Logits::None).unwrap();
            c.truncate(10).unwrap();
            let out = m
                .forward(&toks[10..10 + q], 10, &mut c, &[], Logits::All)
                .unwrap()
                .logits
                .unwrap();
            let d = max_abs_diff(&out, &full.narrow(0, 10, q).unwrap());
            assert!(d < 1e-4, "{} block {q}: {d}", spec.model_type);
            assert_eq!(c.len(), 10 + q);
        }
    }
}

#[test]
fn last_layer_tap_is_pre_norm_residual() {
    // lm_head(norm(tap of the last layer)) must equal the logits: the tap is the residual
    // stream after the last MLP add, before the final norm.
    for spec in families() {
        let dir = tempfile::tempdir().unwrap();
        spec.write(dir.path()).unwrap();
        let m = load(dir.path());
        let toks = ids(3, 12, spec.vocab);
        let mut c = m.new_cache(32).unwrap();
        let last = spec.layers - 1;
        let out = m.forward(&toks, 0, &mut c, &[last], Logits::All).unwrap();
        let tap = out.taps.unwrap();
        assert_eq!(tap.dims(), &[12, spec.hidden]);
        // Final norm from the checkpoint
        let st = candle_core::safetensors::load(
            dir.path().join("model.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let w = &st["model.norm.weight"];
        let normed = candle_nn::ops::rms_norm(&tap, w, 1e-6).unwrap();
        let d = max_abs_diff(&m.lm_head(&normed).unwrap(), &out.logits.unwrap());
        assert!(d < 1e-4, "{}: {d}", spec.model_type);
    }
}

#[test]
fn tap_k_is_output_of_layer_k() {
    // A copy of the model cut to k+1 layers has tap k as its last hidden state.
    let spec = TinyTarget::qwen3(11);
    let dir = tempfile::tempdir().unwrap();
    spec.write(dir.path()).unwrap();
    let m = load(dir.path());
    let toks = ids(4, 9, spec.vocab);
    let mut c = m.new_cache(16).unwrap();
    let taps = [2usize, 0, 1];
    let out = m
        .forward(&toks, 0, &mut c, &taps, Logits::None)
        .unwrap()
        .taps
        .unwrap();
    assert_eq!(out.dims(), &[9, 3 * spec.hidden]);
    for (slot, &k) in taps.iter().enumerate() {
        let cut = tempfile::tempdir().unwrap();
        std::fs::copy(
            dir.path().join("model.safetensors"),
            cut.path().join("model.safetensors"),
        )
        .unwrap();
        let mut cfg = spec.config();
        cfg["num_hidden_layers"] = (k + 1).into();
        dflash::testing::write_json(&cut.path().join("config.json"), &cfg).unwrap();
        let mc = load(cut.path());
        let mut c2 = mc.new_cache(16).unwrap();
        let want = mc
            .forward(&toks, 0, &mut c2, &[k], Logits::None)
            .unwrap()
            .taps
            .unwrap();
        let got = out.narrow(1, slot * spec.hidden, spec.hidden).unwrap();
        assert!(max_abs_diff(&got, &want) < 1e-5, "tap {k}");
        // and it is NOT the output of the previous layer (the test can tell them apart)
        if k > 0 {
            let prev = out
                .narrow(
                    1,
                    taps.iter().position(|&t| t == k - 1).unwrap() * spec.hidden,
                    spec.hidden,
                )
                .unwrap();
            assert!(max_abs_diff(&got, &prev) > 1e-2);
        }
    }
}

#[test]
fn forward_errors_are_reported_not_panics() {
    let spec = TinyTarget::qwen3(5);
    let dir = tempfile::tempdir().unwrap();
    spec.write(dir.path()).unwrap();
    let m = load(dir.path());
    let mut c = m.new_cache(8).unwrap();
    let e = m
        .forward(&[1, 2, 3], 0, &mut c, &[9], Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("tap layer 9"), "{e}");
    let e = m
        .forward(&[1, 999], 0, &mut c, &[], Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("token id 999"), "{e}");
    let e = m
        .forward(&[1; 9], 0, &mut c, &[], Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("context overflow"), "{e}");
    let e = m
        .forward(&[1], 3, &mut c, &[], Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(e.contains("start position 3"), "{e}");
    assert_eq!(c.len(), 0);
}

#[test]
fn sharded_checkpoint_with_index_loads_like_a_single_file() {
    let spec = TinyTarget::qwen3(13);
    let dir = tempfile::tempdir().unwrap();
    spec.write(dir.path()).unwrap();
    let single = load(dir.path());
    // split into two shards + model.safetensors.index.json, as save_pretrained does
    let st = candle_core::safetensors::load(
        dir.path().join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let shard_dir = tempfile::tempdir().unwrap();
    let mut names: Vec<&String> = st.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let m: std::collections::HashMap<String, candle_core::Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), st[*n].clone()))
            .collect();
        candle_core::safetensors::save(&m, shard_dir.path().join(file)).unwrap();
        for n in part.iter() {
            map.insert((*n).clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        shard_dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    std::fs::copy(
        dir.path().join("config.json"),
        shard_dir.path().join("config.json"),
    )
    .unwrap();
    let src = dflash::source::ModelSource::from_dir("sharded", shard_dir.path()).unwrap();
    assert_eq!(src.weight_files.len(), 2);
    let sharded = load(shard_dir.path());
    let toks = ids(8, 10, spec.vocab);
    let mut c1 = single.new_cache(16).unwrap();
    let mut c2 = sharded.new_cache(16).unwrap();
    let l1 = single
        .forward(&toks, 0, &mut c1, &[], Logits::All)
        .unwrap()
        .logits
        .unwrap();
    let l2 = sharded
        .forward(&toks, 0, &mut c2, &[], Logits::All)
        .unwrap()
        .logits
        .unwrap();
    assert_eq!(max_abs_diff(&l1, &l2), 0.0);
    // a shard listed in the index but missing is a clear error
    std::fs::remove_file(shard_dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = dflash::source::ModelSource::from_dir("sharded", shard_dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn bf16_and_f16_compute_stay_close_to_f32() {
    let dir =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/targets/qwen3");
    let src = dflash::source::ModelSource::from_dir("t", &dir).unwrap();
    let toks = ids(9, 12, 256);
    let run = |dt| {
        let opts = dflash::archs::LoadOptions {
            dtype: dt,
            ..Default::default()
        };
        let m = dflash::archs::load_target(&src, &opts).unwrap().1;
        let mut c = m.new_cache(16).unwrap();
        m.forward(&toks, 0, &mut c, &[], Logits::All)
            .unwrap()
            .logits
            .unwrap()
    };
    let f32l = run(candle_core::DType::F32);
    let scale = f32l
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    for dt in [candle_core::DType::BF16, candle_core::DType::F16] {
        let d = max_abs_diff(&run(dt), &f32l);
        // relative to the logit range: bf16 keeps 8 bits of mantissa
        assert!(d / scale < 0.08, "{dt:?}: max diff {d} of {scale}");
    }
}
