//! Hybrid targets (qwen3_5, qwen3_5_moe, qwen3_next: Gated DeltaNet + gated attention):
//! 1. parity with transformers 5.17 (fixtures by tools/goldens/make_hybrid_goldens.py): prompt
//!    logits and taps, transformers' own cached decoding, and verify -> partial acceptance ->
//!    rollback -> more decoding, where every expected row is a fresh forward of the committed
//!    sequence;
//! 2. against our own full recomputation: the recurrent state after a rollback equals the
//!    state of a fresh run on the accepted prefix, chunked prefill in any split equals one
//!    prefill, impossible rollbacks are refused without changing the cache;
//! 3. the lossless DFlash invariant per family (greedy DFlash == greedy plain decoding),
//!    block sizes 2..16, adaptive on and off, stop tokens;
//! 4. the seven registry rows: published config shapes parse, their drafts validate, tiny
//!    models with the rows' shape ratios decode losslessly.

mod common;
use candle_core::{Device, Tensor};
use common::*;
use dflash::archs::{LayerCache, LoadOptions, Logits, TargetCache, TargetModel};
use dflash::config::draft::DraftConfig;
use dflash::config::TargetConfig;
use dflash::draft::load_draft;
use dflash::engine::{greedy_by_recompute, Engine, Flow, GenerateRequest};
use dflash::registry::{family_supported, resolve_draft, DRAFT_REGISTRY};
use dflash::source::ModelSource;
use dflash::testing::{Rng, TinyDraft, TinyHybrid};
use serde_json::{json, Value};

const HYBRID: [&str; 3] = ["qwen3_5", "qwen3_5_moe", "qwen3_next"];

/// `max |a - b| / max(1, max |b|)`: f32 rounding differences grow with the magnitudes.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let scale = b
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    max_abs_diff(a, b) / scale.max(1.0)
}

/// Largest relative difference between the recurrent layers (conv window and state) of two
/// caches; the KV layers must hold the same number of positions.
fn state_diff(a: &TargetCache, b: &TargetCache) -> f32 {
    let mut d = 0f32;
    let mut n = 0;
    for (x, y) in a.layers.iter().zip(&b.layers) {
        match (x, y) {
            (LayerCache::Recurrent(x), LayerCache::Recurrent(y)) => {
                assert_eq!(x.len(), y.len());
                d = d.max(rel_diff(x.state(), y.state()));
                d = d.max(rel_diff(x.conv(), y.conv()));
                n += 1;
            }
            (LayerCache::Kv(x), LayerCache::Kv(y)) => assert_eq!(x.len(), y.len()),
            _ => panic!("layer kinds differ"),
        }
    }
    assert!(n > 0, "no recurrent layers");
    d
}

fn logits(
    m: &dyn TargetModel,
    ids: &[u32],
    start: usize,
    c: &mut TargetCache,
    l: Logits,
) -> Tensor {
    m.forward(ids, start, c, &[], l).unwrap().logits.unwrap()
}

fn check_golden(name: &str, family: &str) {
    let dir = fixture(name);
    let gold = Golden::load(&dir);
    let (g, meta, taps, ids) = (&gold.t, &gold.meta, gold.taps.clone(), gold.ids.clone());
    let t = ids.len();
    let m = load(&dir);
    assert_eq!(m.info().family, family);
    let cap = t + 32;

    // 1. one full forward: logits and taps
    let mut c = m.new_cache(cap).unwrap();
    let out = m.forward(&ids, 0, &mut c, &taps, Logits::All).unwrap();
    let d = max_abs_diff(&out.logits.unwrap(), &g["logits"]);
    assert!(d < 1e-4, "{name}: max abs logit error {d}");
    let h = g[&format!("hidden_{}", taps[0])].dim(1).unwrap();
    let tp = out.taps.unwrap();
    for (slot, k) in taps.iter().enumerate() {
        let d = max_abs_diff(
            &tp.narrow(1, slot * h, h).unwrap(),
            &g[&format!("hidden_{k}")],
        );
        assert!(d < 1e-4, "{name}: tap {k} max abs error {d}");
    }

    // 2. cached decoding token by token (transformers' recurrent single-token path)
    let p0 = meta["P0"].as_u64().unwrap() as usize;
    let mut c = m.new_cache(cap).unwrap();
    m.forward(&ids[..p0], 0, &mut c, &[], Logits::None).unwrap();
    for i in p0..t {
        let l = logits(m.as_ref(), &ids[i..=i], i, &mut c, Logits::Last);
        let want = g["decode_logits"].narrow(0, i - p0, 1).unwrap();
        let d = max_abs_diff(&l, &want);
        assert!(
            d < 1e-4,
            "{name}: cached decoding at position {i}: error {d}"
        );
    }

    // 3. verify, partial acceptance, rollback, more decoding
    let scenarios = meta["rollback"].as_array().unwrap();
    for (s, sc) in scenarios.iter().enumerate() {
        let p = sc["prefix"].as_u64().unwrap() as usize;
        let a = sc["accepted"].as_u64().unwrap() as usize;
        let vids = u32s(&g[&format!("verify_ids_{s}")]);
        let aids = u32s(&g[&format!("after_ids_{s}")]);
        let mut c = m.new_cache(cap).unwrap();
        m.forward(&ids[..p], 0, &mut c, &[], Logits::None).unwrap();
        let vl = logits(m.as_ref(), &vids, p, &mut c, Logits::All);
        let d = max_abs_diff(&vl, &g[&format!("verify_logits_{s}")]);
        assert!(d < 1e-4, "{name} scenario {s}: verify logits error {d}");
        c.truncate(p + a + 1).unwrap();
        assert_eq!(c.len(), p + a + 1);
        // our own full recompute of the accepted prefix: same states
        let mut fresh = m.new_cache(cap).unwrap();
        let mut prefix = ids[..p].to_vec();
        prefix.extend_from_slice(&vids[..=a]);
        m.forward(&prefix, 0, &mut fresh, &[], Logits::None)
            .unwrap();
        let d = state_diff(&c, &fresh);
        assert!(
            d < 1e-5,
            "{name} scenario {s}: state after rollback vs fresh prefix run: {d}"
        );
        // more decoding after the rollback: one token at a time in even scenarios, as one
        // block in odd ones
        let start = p + a + 1;
        let got = if s % 2 == 0 {
            let rows: Vec<Tensor> = aids
                .iter()
                .enumerate()
                .map(|(i, &tok)| logits(m.as_ref(), &[tok], start + i, &mut c, Logits::Last))
                .collect();
            Tensor::cat(&rows, 0).unwrap()
        } else {
            logits(m.as_ref(), &aids, start, &mut c, Logits::All)
        };
        let d = max_abs_diff(&got, &g[&format!("after_logits_{s}")]);
        assert!(
            d < 1e-4,
            "{name} scenario {s}: decoding after rollback: error {d}"
        );
        // and against our own recompute of the whole committed sequence
        let mut all = prefix.clone();
        all.extend_from_slice(&aids);
        let mut fresh = m.new_cache(cap).unwrap();
        let l = logits(m.as_ref(), &all, 0, &mut fresh, Logits::All);
        let d = max_abs_diff(&got, &l.narrow(0, start, aids.len()).unwrap());
        assert!(d < 1e-4, "{name} scenario {s}: vs own full recompute: {d}");
    }
}

#[test]
fn qwen3_5_conditional_generation_layout_matches_transformers() {
    check_golden("qwen3_5", "qwen3_5");
}

#[test]
fn qwen3_5_text_tied_interval_schedule_matches_transformers() {
    check_golden("qwen3_5_text_tied", "qwen3_5");
}

#[test]
fn qwen3_5_moe_matches_transformers() {
    check_golden("qwen3_5_moe", "qwen3_5_moe");
}

#[test]
fn qwen3_next_fused_projections_matches_transformers() {
    check_golden("qwen3_next", "qwen3_next");
}

fn tiny(family: &'static str, seed: u64) -> (tempfile::TempDir, Box<dyn TargetModel>) {
    let t = TinyHybrid::new(family, seed);
    let dir = tempfile::tempdir().unwrap();
    t.write(dir.path()).unwrap();
    let m = load(dir.path());
    (dir, m)
}

#[test]
fn rollback_to_every_accepted_length_equals_a_fresh_prefix_run() {
    for (fi, family) in HYBRID.into_iter().enumerate() {
        let (_d, m) = tiny(family, 40 + fi as u64);
        let v = m.info().vocab_size;
        let prompt = ids(fi as u64, 23, v);
        let block = ids(100 + fi as u64, 16, v);
        for a in 0..16 {
            let mut c = m.new_cache(64).unwrap();
            m.forward(&prompt, 0, &mut c, &[], Logits::Last).unwrap();
            m.forward(&block, 23, &mut c, &[0], Logits::All).unwrap();
            c.truncate(23 + a + 1).unwrap();
            let mut seq = prompt.clone();
            seq.extend_from_slice(&block[..=a]);
            let mut fresh = m.new_cache(64).unwrap();
            m.forward(&seq, 0, &mut fresh, &[], Logits::None).unwrap();
            let d = state_diff(&c, &fresh);
            assert!(d < 1e-5, "{family} a {a}: state {d}");
            // the next step from the rolled-back cache equals the fresh one
            let next = ids(7, 1, v);
            let x = logits(m.as_ref(), &next, seq.len(), &mut c, Logits::Last);
            let y = logits(m.as_ref(), &next, seq.len(), &mut fresh, Logits::Last);
            assert!(rel_diff(&x, &y) < 1e-5, "{family} a {a}");
        }
    }
}

#[test]
fn chunked_prefill_in_any_split_equals_one_prefill() {
    for (fi, family) in HYBRID.into_iter().enumerate() {
        let (_d, m) = tiny(family, 60 + fi as u64);
        let v = m.info().vocab_size;
        let prompt = ids(9 + fi as u64, 300, v); // 5 chunks of the delta rule
        let mut one = m.new_cache(320).unwrap();
        let whole = m
            .forward(&prompt, 0, &mut one, &[1, 3], Logits::All)
            .unwrap();
        for split in [vec![1, 63, 64, 65, 107], vec![150, 150], vec![299, 1]] {
            let mut c = m.new_cache(320).unwrap();
            let mut at = 0;
            for n in split {
                let o = m
                    .forward(&prompt[at..at + n], at, &mut c, &[1, 3], Logits::All)
                    .unwrap();
                let d = rel_diff(
                    &o.logits.unwrap(),
                    &whole.logits.as_ref().unwrap().narrow(0, at, n).unwrap(),
                );
                assert!(d < 1e-4, "{family} rows {at}..{}: {d}", at + n);
                let d = rel_diff(
                    &o.taps.unwrap(),
                    &whole.taps.as_ref().unwrap().narrow(0, at, n).unwrap(),
                );
                assert!(d < 1e-4, "{family} taps {at}..{}: {d}", at + n);
                at += n;
            }
            assert!(state_diff(&c, &one) < 1e-5, "{family}");
        }
    }
}

#[test]
fn long_prompt_in_pieces_equals_token_steps_and_undoes_as_one_forward() {
    // 1100 rows: three passes of the layer stack (PREFILL_PIECE = 512) inside one forward
    let (_d, m) = tiny("qwen3_next", 83);
    let v = m.info().vocab_size;
    let prompt = ids(5, 1100, v);
    let mut one = m.new_cache(1200).unwrap();
    let out = m
        .forward(&prompt, 0, &mut one, &[0, 4], Logits::All)
        .unwrap();
    let (l, t) = (out.logits.unwrap(), out.taps.unwrap());
    assert_eq!(l.dims(), &[1100, v]);
    assert_eq!(t.dim(0).unwrap(), 1100);
    // the same rows from a split that crosses the piece boundaries elsewhere
    let mut c = m.new_cache(1200).unwrap();
    let a = m
        .forward(&prompt[..700], 0, &mut c, &[0, 4], Logits::All)
        .unwrap();
    let b = m
        .forward(&prompt[700..], 700, &mut c, &[0, 4], Logits::Last)
        .unwrap();
    assert!(rel_diff(&a.logits.unwrap(), &l.narrow(0, 0, 700).unwrap()) < 1e-4);
    assert!(rel_diff(&a.taps.unwrap(), &t.narrow(0, 0, 700).unwrap()) < 1e-4);
    assert!(rel_diff(&b.logits.unwrap(), &l.narrow(0, 1099, 1).unwrap()) < 1e-4);
    assert!(state_diff(&c, &one) < 1e-5);
    // the last 30 rows by single-token steps
    let mut s = m.new_cache(1200).unwrap();
    m.forward(&prompt[..1070], 0, &mut s, &[], Logits::None)
        .unwrap();
    for i in 1070..1100 {
        let x = logits(m.as_ref(), &prompt[i..=i], i, &mut s, Logits::Last);
        assert!(rel_diff(&x, &l.narrow(0, i, 1).unwrap()) < 1e-4, "row {i}");
    }
    // a forward is undone as one step: 400 rows after 700, then 1000 rows (two pieces)
    // after 100
    let mut before = m.new_cache(1200).unwrap();
    m.forward(&prompt[..700], 0, &mut before, &[], Logits::None)
        .unwrap();
    c.truncate(700).unwrap();
    assert_eq!(state_diff(&c, &before), 0.0);
    let mut d = m.new_cache(1200).unwrap();
    m.forward(&prompt[..100], 0, &mut d, &[], Logits::None)
        .unwrap();
    m.forward(&prompt[100..], 100, &mut d, &[], Logits::None)
        .unwrap();
    d.truncate(100).unwrap();
    let mut e = m.new_cache(1200).unwrap();
    m.forward(&prompt[..100], 0, &mut e, &[], Logits::None)
        .unwrap();
    assert_eq!(state_diff(&d, &e), 0.0);
}

#[test]
fn undo_a_whole_forward_and_refuse_unreachable_positions() {
    let (_d, m) = tiny("qwen3_5", 81);
    let v = m.info().vocab_size;
    let prompt = ids(1, 150, v);
    let mut c = m.new_cache(200).unwrap();
    m.forward(&prompt[..100], 0, &mut c, &[], Logits::None)
        .unwrap();
    let mut before = m.new_cache(200).unwrap();
    m.forward(&prompt[..100], 0, &mut before, &[], Logits::None)
        .unwrap();
    // a forward of 50 rows is undone exactly (what a failed forward does)
    m.forward(&prompt[100..], 100, &mut c, &[], Logits::None)
        .unwrap();
    c.truncate(100).unwrap();
    assert_eq!(state_diff(&c, &before), 0.0);
    // positions before the last forward cannot be reached: refused, nothing changed
    m.forward(&prompt[100..], 100, &mut c, &[], Logits::None)
        .unwrap();
    let err = c.truncate(90).unwrap_err().to_string();
    assert!(err.contains("cannot roll back to position 90"), "{err}");
    assert_eq!(c.len(), 150);
    let mut full = m.new_cache(200).unwrap();
    m.forward(&prompt, 0, &mut full, &[], Logits::None).unwrap();
    assert!(state_diff(&c, &full) < 1e-5);
    // a forward that fails its checks leaves the cache untouched
    assert!(m
        .forward(&[v as u32], 150, &mut c, &[], Logits::Last)
        .is_err());
    assert_eq!(c.len(), 150);
    assert!(state_diff(&c, &full) < 1e-5);
}

fn engine_for(t: &TinyHybrid, d: &TinyDraft) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    t.write(&dir.path().join("t")).unwrap();
    d.write(&dir.path().join("d"), t.vocab).unwrap();
    let lo = LoadOptions::default();
    let (cfg, target) = dflash::archs::load_target(
        &ModelSource::from_dir("t", &dir.path().join("t")).unwrap(),
        &lo,
    )
    .unwrap();
    let draft = load_draft(
        &ModelSource::from_dir("d", &dir.path().join("d")).unwrap(),
        &cfg,
        "t",
        &lo,
    )
    .unwrap();
    (dir, Engine::new(target, Some(draft)))
}

fn generate(
    e: &Engine,
    prompt: &[u32],
    max: usize,
    block: Option<usize>,
    stop: &[u32],
) -> dflash::engine::GenerateOutput {
    let mut r = GenerateRequest::new(prompt.to_vec(), max);
    r.block_size = block;
    r.adaptive = block.is_none();
    r.stop_ids = stop.to_vec();
    e.generate(&r, &mut |_| Flow::Continue).unwrap()
}

/// What a batch of lossless generations exercised.
#[derive(Default)]
struct Seen {
    generations: usize,
    lengths: std::collections::BTreeSet<usize>,
    /// Cycles that accepted some but not all draft tokens (a rollback inside the verify).
    partial: usize,
}

/// Greedy DFlash == greedy plain decoding on a family: `cases` prompts x (8 pinned block sizes
/// + the adaptive policy) generations.
fn lossless(e: &Engine, vocab: usize, seed: u64, cases: usize, what: &str, seen: &mut Seen) {
    let mut rng = Rng::new(seed);
    for case in 0..cases {
        let plen = 1 + rng.below(40);
        let prompt = ids(seed * 1000 + case as u64, plen, vocab - 1);
        let max = 4 + rng.below(36);
        let plain = generate(e, &prompt, max, Some(1), &[]);
        assert_eq!(plain.stats.mode, "plain");
        let stop = if case % 3 == 0 {
            vec![plain.output_ids[max / 2]]
        } else {
            vec![]
        };
        let expect: Vec<u32> = match stop.first() {
            Some(s) => {
                let cut = plain.output_ids.iter().position(|x| x == s).unwrap();
                plain.output_ids[..=cut].to_vec()
            }
            None => plain.output_ids.clone(),
        };
        for block in [
            Some(2),
            Some(3),
            Some(4),
            Some(5),
            Some(7),
            Some(8),
            Some(12),
            Some(16),
            None,
        ] {
            let out = generate(e, &prompt, max, block, &stop);
            assert_eq!(
                out.output_ids, expect,
                "{what} case {case} prompt {plen} max {max} block {block:?}"
            );
            assert_eq!(out.stats.mode, "dflash");
            assert_eq!(out.stats.adaptive, block.is_none());
            let steps = &out.stats.acceptance_lengths;
            seen.lengths.extend(steps.iter().copied());
            // (the last cycle may be cut by max tokens or a stop: not counted)
            let q = block.unwrap_or(16);
            seen.partial += steps[..steps.len().saturating_sub(1)]
                .iter()
                .filter(|&&l| l > 1 && l < q)
                .count();
            seen.generations += 1;
        }
    }
}

/// Tiny hybrid targets with a mix of acceptance (the draft shares the target's embedding and
/// head): k = 0, 1: every embedding leans one way and a few head rows are aligned with it, so
/// those tokens compete and the recurrent state decides (long and partial acceptances);
/// k = 2: a few dominant head rows only (mostly rejections, rich outputs). Drafts have a
/// sliding and a full layer.
fn pair(family: &'static str, seed: u64, k: usize) -> (TinyHybrid, TinyDraft) {
    let mut t = TinyHybrid::new(family, seed);
    match k {
        0 => (t.shared_direction, t.aligned) = (4.0, vec![(3, 6.0), (7, 5.8)]),
        1 => (t.shared_direction, t.aligned) = (4.0, vec![(3, 6.0), (7, 5.9), (11, 5.8)]),
        _ => t.dominant = vec![(3, 3.0), (7, 2.5), (11, 2.0)],
    }
    let mut d = TinyDraft::for_target(&t.as_tiny_target(), 2, vec![0, 2, 4], 16, seed + 1);
    d.layer_types = Some(vec!["sliding_attention", "full_attention"]);
    d.sliding_window = 6;
    (t, d)
}

fn lossless_family(family: &'static str, seed: u64) {
    let mut seen = Seen::default();
    for k in 0..3 {
        let (t, d) = pair(family, seed + 10 * k as u64, k);
        let (_dir, e) = engine_for(&t, &d);
        lossless(&e, t.vocab, seed + k as u64, 4, family, &mut seen);
        // DFlash equals full recomputation (no cache reuse at all) too
        let prompt = ids(seed + k as u64, 17, t.vocab);
        let out = generate(&e, &prompt, 24, Some(16), &[]);
        assert_eq!(
            out.output_ids,
            greedy_by_recompute(e.target.as_ref(), &prompt, 24).unwrap(),
            "{family} pair {k}"
        );
    }
    assert!(
        seen.generations >= 100,
        "{family}: {} generations",
        seen.generations
    );
    // real acceptance, not only rejections: many lengths, long runs, partial acceptances
    let l = &seen.lengths;
    assert!(
        l.len() >= 8 && l.contains(&1) && l.contains(&16),
        "{family}: acceptance lengths {l:?}"
    );
    assert!(
        seen.partial >= 10,
        "{family}: only {} partial acceptances",
        seen.partial
    );
}

#[test]
fn lossless_qwen3_5() {
    lossless_family("qwen3_5", 500);
}

#[test]
fn lossless_qwen3_5_moe() {
    lossless_family("qwen3_5_moe", 510);
}

#[test]
fn lossless_qwen3_next() {
    lossless_family("qwen3_next", 520);
}

/// A published-shape text config of a hybrid target (the seven registry rows).
struct Row {
    target: &'static str,
    config: Value,
    layers: usize,
    /// Published taps when the spec lists them, else the default rule over `layers`.
    taps: Vec<usize>,
    /// Tiny model with the same ratios (GQA, value heads per key head, tied head, MoE).
    tiny: TinyHybrid,
}

fn qwen35_text(
    hidden: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    vheads: usize,
    extra: Value,
) -> Value {
    let mut t = json!({"model_type": "qwen3_5_text", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": vheads, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "vocab_size": 248320, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": true}});
    for (k, v) in extra.as_object().unwrap() {
        t[k] = v.clone();
    }
    t
}

fn wrap(family: &str, text: Value, tied: bool) -> Value {
    json!({"model_type": family, "architectures": [if family == "qwen3_5" {"Qwen3_5ForConditionalGeneration"} else {"Qwen3_5MoeForConditionalGeneration"}],
        "text_config": text, "tie_word_embeddings": tied, "vision_config": {"depth": 27}})
}

fn rows() -> Vec<Row> {
    let moe = json!({"model_type": "qwen3_5_moe_text", "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512});
    let tiny = |family: &'static str, seed, heads, kv, kh, vh, tied| {
        let mut t = TinyHybrid::new(family, seed);
        (t.heads, t.kv_heads, t.lin_k_heads, t.lin_v_heads, t.tied) = (heads, kv, kh, vh, tied);
        t.layer_types = [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ]
        .repeat(2);
        t.dominant = vec![(3, 3.0), (7, 2.5)];
        t
    };
    let default_taps = |l: usize| dflash::config::draft::default_taps(5, l);
    vec![
        Row {
            target: "Qwen/Qwen3.5-4B",
            config: wrap(
                "qwen3_5",
                qwen35_text(
                    2560,
                    32,
                    16,
                    4,
                    32,
                    json!({"intermediate_size": 9216, "tie_word_embeddings": true}),
                ),
                true,
            ),
            layers: 32,
            taps: default_taps(32),
            tiny: tiny("qwen3_5", 601, 4, 1, 2, 4, true),
        },
        Row {
            target: "Qwen/Qwen3.5-9B",
            config: wrap(
                "qwen3_5",
                qwen35_text(4096, 32, 16, 4, 32, json!({"intermediate_size": 12288})),
                false,
            ),
            layers: 32,
            taps: default_taps(32),
            tiny: tiny("qwen3_5", 602, 4, 1, 2, 4, false),
        },
        Row {
            target: "Qwen/Qwen3.5-27B",
            config: wrap(
                "qwen3_5",
                qwen35_text(5120, 64, 24, 4, 48, json!({"intermediate_size": 17408})),
                false,
            ),
            layers: 64,
            taps: vec![1, 16, 31, 46, 61],
            tiny: tiny("qwen3_5", 603, 6, 1, 2, 6, false),
        },
        Row {
            target: "Qwen/Qwen3.6-27B",
            config: wrap(
                "qwen3_5",
                qwen35_text(5120, 64, 24, 4, 48, json!({"intermediate_size": 17408})),
                false,
            ),
            layers: 64,
            taps: vec![1, 16, 31, 46, 61],
            tiny: tiny("qwen3_5", 604, 6, 1, 2, 6, false),
        },
        // The DFlash2 row (its target's shapes assumed Qwen3.5-27B's: see the registry).
        Row {
            target: "Qwen/Qwen3.8-27B",
            config: wrap(
                "qwen3_5",
                qwen35_text(5120, 64, 24, 4, 48, json!({"intermediate_size": 17408})),
                false,
            ),
            layers: 64,
            taps: vec![5, 19, 33, 47, 61],
            tiny: tiny("qwen3_5", 609, 6, 1, 2, 6, false),
        },
        Row {
            target: "Qwen/Qwen3.5-35B-A3B",
            config: wrap(
                "qwen3_5_moe",
                qwen35_text(2048, 40, 16, 2, 32, moe.clone()),
                false,
            ),
            layers: 40,
            taps: vec![1, 10, 19, 28, 37],
            tiny: tiny("qwen3_5_moe", 605, 4, 1, 2, 4, false),
        },
        Row {
            target: "Qwen/Qwen3.6-35B-A3B",
            config: wrap(
                "qwen3_5_moe",
                qwen35_text(2048, 40, 16, 2, 32, moe.clone()),
                false,
            ),
            layers: 40,
            taps: vec![1, 10, 19, 28, 37],
            tiny: tiny("qwen3_5_moe", 606, 4, 1, 2, 4, false),
        },
        Row {
            target: "Qwen/Qwen3.5-122B-A10B",
            config: wrap(
                "qwen3_5_moe",
                qwen35_text(3072, 48, 32, 2, 64, {
                    let mut m = moe.clone();
                    m["moe_intermediate_size"] = 1024.into();
                    m["shared_expert_intermediate_size"] = 1024.into();
                    m
                }),
                false,
            ),
            layers: 48,
            taps: default_taps(48),
            tiny: tiny("qwen3_5_moe", 607, 8, 1, 2, 8, false),
        },
        Row {
            target: "Qwen/Qwen3-Coder-Next",
            config: json!({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                "head_dim": 256, "intermediate_size": 5120, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                "full_attention_interval": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
                "vocab_size": 151936, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "rope_theta": 5000000,
                "partial_rotary_factor": 0.25, "tie_word_embeddings": false}),
            layers: 48,
            taps: default_taps(48),
            tiny: tiny("qwen3_next", 608, 4, 1, 2, 4, false),
        },
    ]
}

#[test]
fn hybrid_registry_rows_are_supported_and_lossless() {
    let rows = rows();
    // every hybrid row of the registry is here, and `dflash models` lists it as supported
    let hybrid_rows: Vec<_> = DRAFT_REGISTRY
        .iter()
        .filter(|e| HYBRID.contains(&e.family))
        .collect();
    assert_eq!(hybrid_rows.len(), 9);
    for e in &hybrid_rows {
        assert!(family_supported(e.family), "{}", e.target);
        assert!(
            rows.iter()
                .any(|r| resolve_draft(r.target).map(|x| x.target) == Some(e.target)),
            "{}",
            e.target
        );
    }
    for r in rows {
        let entry = resolve_draft(r.target).unwrap();
        let cfg = TargetConfig::from_value("config.json", r.config.clone()).unwrap();
        assert_eq!(
            dflash::archs::family_for(&cfg).unwrap().name,
            entry.family,
            "{}",
            r.target
        );
        let hc = dflash::archs::hybrid::HybridConfig::parse(&cfg, dflash::nn::InProjLayout::Split)
            .unwrap();
        // the 3:1 schedule: every 4th layer is full attention
        assert_eq!(hc.layer_types.len(), r.layers);
        assert!(hc
            .layer_types
            .iter()
            .enumerate()
            .all(|(i, &t)| (t == dflash::config::LayerType::Full) == ((i + 1) % 4 == 0)));
        assert_eq!(hc.rope.rotary_dim(hc.head_dim), 64, "{}", r.target);
        let mut draft = json!({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
            "dflash_config": {"mask_token_id": 248070, "target_layer_ids": r.taps}, "num_target_layers": r.layers,
            "hidden_size": cfg.hidden_size, "intermediate_size": 3 * cfg.hidden_size, "num_hidden_layers": 5,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": 262144, "rope_theta": 10000000});
        if entry.family == "qwen3_next" {
            draft["dflash_config"]["mask_token_id"] = 151669.into();
        }
        let dflash2 = entry.arch == dflash::registry::DraftArch::DFlash2;
        if dflash2 {
            // z-lab/Qwen3.8-27B-DFlash2's config.json as quoted publicly (the fields read).
            draft = json!({"architectures": ["DFlash2DraftModel"], "attention_bias": false, "is_causal": false,
                "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2,
                    "mask_token_id": 248070, "selector_rank": 256, "selector_top_k": 16,
                    "target_layer_ids": [5, 19, 33, 47, 61]},
                "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 17408,
                "layer_types": (vec!["sliding_attention"; 5]), "num_attention_heads": 32, "num_hidden_layers": 5,
                "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "model_type": "qwen3",
                "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"}, "sliding_window": 2048,
                "tie_word_embeddings": false, "use_sliding_window": true, "vocab_size": 248320});
        }
        let d = DraftConfig::from_value("draft.json", draft).unwrap();
        assert_eq!(
            d.validate_against(&cfg, r.target).unwrap(),
            r.taps,
            "{}",
            r.target
        );
        assert_eq!(Some(d.block_size), entry.block_size);
        assert_eq!(d.dflash2.is_some(), dflash2, "{}", r.target);

        // the tiny model with the row's ratios decodes losslessly
        let t = &r.tiny;
        let mut dr = TinyDraft::for_target(&t.as_tiny_target(), 2, vec![0, 3, 6], 16, 9);
        dr.heads = t.heads;
        dr.kv_heads = t.kv_heads;
        if dflash2 {
            dr = dr.dflash2(2, 16, 16, 16);
            dr.block_size = 8;
            dr.layer_types = Some(vec!["sliding_attention"; 2]);
            dr.is_causal = Some(false);
        }
        let (_dir, e) = engine_for(t, &dr);
        assert_eq!(e.target.info().family, entry.family);
        let mut seen = Seen::default();
        lossless(&e, t.vocab, 700, 1, r.target, &mut seen);
        assert_eq!(seen.generations, 9);
    }
}

#[test]
fn bf16_compute_stays_close_to_f32_and_rolls_back() {
    // bf16 changes the projections, the conv and attention; the recurrence stays f32.
    for name in ["qwen3_5", "qwen3_5_moe", "qwen3_next"] {
        let src = ModelSource::from_dir("t", &fixture(name)).unwrap();
        let f32m = dflash::archs::load_target(&src, &LoadOptions::default())
            .unwrap()
            .1;
        let lo = LoadOptions {
            dtype: candle_core::DType::BF16,
            ..LoadOptions::default()
        };
        let bf = dflash::archs::load_target(&src, &lo).unwrap().1;
        let p = ids(9, 12, 256);
        let mut a = f32m.new_cache(32).unwrap();
        let mut b = bf.new_cache(32).unwrap();
        let la = logits(f32m.as_ref(), &p, 0, &mut a, Logits::All);
        let lb = logits(bf.as_ref(), &p, 0, &mut b, Logits::All);
        let scale = la
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let d = max_abs_diff(&la, &lb);
        // relative to the logit range, as for the dense families (transformers' own bf16
        // differs from its f32 by 2-7% of the range on these fixtures)
        assert!(
            d / scale < 0.12,
            "{name}: bf16 vs f32 logits {d} of {scale}"
        );
        // verify 8 rows, keep 3, then compare with a fresh bf16 run on the kept prefix
        let blk = ids(4, 8, 256);
        bf.forward(&blk, 12, &mut b, &[], Logits::All).unwrap();
        b.truncate(15).unwrap();
        let mut seq = p.clone();
        seq.extend_from_slice(&blk[..3]);
        let mut fresh = bf.new_cache(32).unwrap();
        bf.forward(&seq, 0, &mut fresh, &[], Logits::None).unwrap();
        let d = state_diff(&b, &fresh);
        assert!(d < 1e-2, "{name}: bf16 rollback state {d}");
    }
}

#[test]
fn config_errors_name_the_file_and_field() {
    let base = || TinyHybrid::new("qwen3_next", 1).config();
    let parse = |v: Value| TargetConfig::from_value("config.json", v);
    // a recurrent layer in a family without recurrent layers
    let mut c = base();
    c["model_type"] = "qwen3".into();
    c["intermediate_size"] = 64.into();
    let e = match dflash::archs::family_for(&parse(c).unwrap()) {
        Err(e) => e.to_string(),
        Ok(f) => panic!("accepted by {}", f.name),
    };
    assert!(
        e.contains("layer_types") && e.contains("linear_attention") && e.contains("qwen3"),
        "{e}"
    );
    // value heads must be a multiple of key heads
    let mut c = base();
    c["linear_num_value_heads"] = 5.into();
    let cfg = parse(c).unwrap();
    let e = dflash::archs::hybrid::HybridConfig::parse(&cfg, dflash::nn::InProjLayout::Fused)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json") && e.contains("linear_num_value_heads"),
        "{e}"
    );
    // sliding layers do not exist in these families
    let mut c = base();
    c["layer_types"][0] = "sliding_attention".into();
    c["sliding_window"] = 8.into();
    let cfg = parse(c).unwrap();
    let e = dflash::archs::hybrid::HybridConfig::parse(&cfg, dflash::nn::InProjLayout::Fused)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layer_types") && e.contains("sliding_attention"),
        "{e}"
    );
    // an unknown layer kind
    let mut c = base();
    c["layer_types"][0] = "mamba2".into();
    let e = parse(c).unwrap_err().to_string();
    assert!(e.contains("layer_types") && e.contains("mamba2"), "{e}");
    // a MoE-only text config has no intermediate_size; a dense one must
    let mut c = TinyHybrid::new("qwen3_5", 1).config();
    c["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("intermediate_size");
    let e = parse(c).unwrap_err().to_string();
    assert!(e.contains("text_config.intermediate_size"), "{e}");
    // a tensor missing from the checkpoint is named
    let t = TinyHybrid::new("qwen3_5", 2);
    let dir = tempfile::tempdir().unwrap();
    t.write(dir.path()).unwrap();
    let st = dir.path().join("model.safetensors");
    let mut w = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
    w.remove("model.language_model.layers.0.linear_attn.A_log");
    candle_core::safetensors::save(&w, &st).unwrap();
    let src = ModelSource::from_dir("t", dir.path()).unwrap();
    let e = match dflash::archs::load_target(&src, &LoadOptions::default()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("loaded without A_log"),
    };
    assert!(
        e.contains("model.language_model.layers.0.linear_attn.A_log"),
        "{e}"
    );
}
