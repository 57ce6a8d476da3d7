//! The speculators draft format: config fields (taps shifted by one, verifier), a narrow draft
//! vocabulary with its own head and d2t/t2d maps, lossless decoding, and the mapping of
//! proposals to target ids checked against an equivalent full-vocabulary draft.

mod common;
use common::*;
use dflash::archs::{LoadOptions, Logits};
use dflash::config::draft::{DraftConfig, DraftFormat};
use dflash::draft::load_draft;
use dflash::engine::{Engine, Flow, GenerateRequest};
use dflash::source::ModelSource;
use dflash::testing::{Rng, TinyDraft, TinyTarget};

#[test]
fn speculators_draft_maps_to_target_ids_and_is_lossless() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = TinyTarget::qwen3(61);
    t.tied = false;
    t.write(&dir.path().join("t")).unwrap();
    let d = TinyDraft::for_target(&t, 2, vec![0, 2], 8, 62);
    // narrow vocabulary: 40 target ids, shuffled; head rows = the target head's rows
    let mut rng = Rng::new(5);
    let mut ids: Vec<u32> = (0..t.vocab as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let map: Vec<u32> = ids[..40].to_vec();
    let st = candle_core::safetensors::load(
        dir.path().join("t/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let idx = candle_core::Tensor::new(map.as_slice(), &candle_core::Device::Cpu).unwrap();
    let rows = st["lm_head.weight"].index_select(&idx, 0).unwrap();
    d.write_speculators(
        &dir.path().join("spec"),
        t.vocab,
        &map,
        &rows,
        "Org/tiny-target",
    )
    .unwrap();
    d.write(&dir.path().join("zlab"), t.vocab).unwrap();

    let cfg = DraftConfig::from_file(&dir.path().join("spec/config.json")).unwrap();
    assert_eq!(cfg.format, DraftFormat::Speculators);
    assert_eq!(
        cfg.target_layer_ids,
        Some(vec![0, 2]),
        "aux ids are layer inputs: shifted by one"
    );
    assert_eq!(cfg.verifier.as_deref(), Some("Org/tiny-target"));
    assert_eq!(cfg.draft_vocab_size, Some(40));

    let lo = LoadOptions::default();
    let (tcfg, target) = dflash::archs::load_target(
        &ModelSource::from_dir("t", &dir.path().join("t")).unwrap(),
        &lo,
    )
    .unwrap();
    let spec = load_draft(
        &ModelSource::from_dir("s", &dir.path().join("spec")).unwrap(),
        &tcfg,
        "t",
        &lo,
    )
    .unwrap();
    let zlab = load_draft(
        &ModelSource::from_dir("z", &dir.path().join("zlab")).unwrap(),
        &tcfg,
        "t",
        &lo,
    )
    .unwrap();

    // Proposals: the narrow draft's choice == the full draft's argmax restricted to the map.
    let prompt = ids_of(7, 15, t.vocab);
    let mut c = target.new_cache(64).unwrap();
    let taps = target
        .forward(&prompt, 0, &mut c, &spec.taps, Logits::Last)
        .unwrap()
        .taps
        .unwrap();
    let mut block = vec![spec.mask_token_id(); 8];
    block[0] = 3;
    let mut dc = spec.new_cache(64).unwrap();
    let got = spec
        .propose(target.as_ref(), &taps, &block, prompt.len(), &mut dc, None)
        .unwrap();
    let mut dz = zlab.new_cache(64).unwrap();
    let full = zlab
        .forward(target.as_ref(), &taps, &block, prompt.len(), &mut dz)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let want: Vec<u32> = full
        .iter()
        .map(|row| {
            *map.iter()
                .max_by(|&&a, &&b| row[a as usize].total_cmp(&row[b as usize]))
                .unwrap()
        })
        .collect();
    assert_eq!(got, want);
    assert!(got.iter().all(|g| map.contains(g)));

    // Lossless with the narrow draft.
    let e = Engine::new(target, Some(spec));
    for (seed, max) in [(1u64, 30usize), (2, 17), (3, 41)] {
        let p = ids_of(seed, 5 + seed as usize * 4, t.vocab);
        let mut r = GenerateRequest::new(p.clone(), max);
        let spec_out = e.generate(&r, &mut |_| Flow::Continue).unwrap();
        r.block_size = Some(1);
        assert_eq!(
            spec_out.output_ids,
            e.generate(&r, &mut |_| Flow::Continue).unwrap().output_ids
        );
    }
}

#[test]
fn speculators_errors_name_fields_and_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let t = TinyTarget::qwen3(71);
    t.write(&dir.path().join("t")).unwrap();
    let d = TinyDraft::for_target(&t, 1, vec![1], 4, 72);
    let map: Vec<u32> = (0..10).collect();
    let rows = candle_core::Tensor::zeros(
        (10, t.hidden),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    d.write_speculators(&dir.path().join("s"), t.vocab, &map, &rows, "x/y")
        .unwrap();
    let path = dir.path().join("s/config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v["aux_hidden_state_layer_ids"] = serde_json::json!([0, 2]);
    let e = DraftConfig::from_value("s.json", v.clone())
        .unwrap_err()
        .to_string();
    assert!(e.contains("aux_hidden_state_layer_ids"), "{e}");
    v["aux_hidden_state_layer_ids"] = serde_json::json!([2]);
    v["speculators_model_type"] = "eagle3".into();
    let e = DraftConfig::from_value("s.json", v)
        .unwrap_err()
        .to_string();
    assert!(e.contains("eagle3"), "{e}");
    // a tensor the draft does not use -> error listing it
    let st = dir.path().join("s/model.safetensors");
    let mut tensors = candle_core::safetensors::load(&st, &candle_core::Device::Cpu).unwrap();
    tensors.insert("layers.0.mystery.weight".into(), rows.clone());
    candle_core::safetensors::save(&tensors, &st).unwrap();
    let lo = LoadOptions::default();
    let (tcfg, _) = dflash::archs::load_target(
        &ModelSource::from_dir("t", &dir.path().join("t")).unwrap(),
        &lo,
    )
    .unwrap();
    let e = load_draft(
        &ModelSource::from_dir("s", &dir.path().join("s")).unwrap(),
        &tcfg,
        "t",
        &lo,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("1 tensors not used") && e.contains("layers.0.mystery.weight"),
        "{e}"
    );
}

fn ids_of(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    ids(seed, n, vocab)
}

/// A z-lab draft narrowed to a few target tokens (`draft::narrow`, the frequency-ranked
/// vocabulary of examples/narrow_draft): it proposes only those tokens, and decoding stays
/// lossless (common::check_narrowed_draft; on CUDA in tests/fused_cuda.rs).
#[test]
fn narrowed_draft_proposes_only_its_tokens_and_stays_lossless() {
    check_narrowed_draft(&LoadOptions::default());
}
