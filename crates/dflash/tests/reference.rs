//! Parity with the authors' reference DFlash implementation (PyPI `dflash`, run by
//! tools/goldens/make_dflash_goldens.py and make_dflash2_goldens.py at temperature 0 in f32):
//! every verify cycle's block (last token + draft proposals: the argmax for DFlash, the
//! candidate selector's walk for DFlash2), its acceptance, the output, and the draft's logits.

mod common;
use common::*;
use dflash::archs::{LoadOptions, Logits};
use dflash::draft::load_draft;
use dflash::engine::{Engine, Flow, GenerateRequest};
use dflash::source::ModelSource;
use serde_json::Value;
use std::path::PathBuf;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check(case: &str) {
    check_in("dflash", case)
}

fn check_in(kind: &str, case: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(kind)
        .join(case);
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("trace.json")).unwrap()).unwrap();
    let g =
        candle_core::safetensors::load(dir.join("trace.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let tsrc = ModelSource::from_dir("target", &dir.join("target")).unwrap();
    let (tcfg, target) = dflash::archs::load_target(&tsrc, &LoadOptions::default()).unwrap();
    let dsrc = ModelSource::from_dir("draft", &dir.join("draft")).unwrap();
    // the float draft as stored (parity with the reference; on the CPU the draft's linears
    // would otherwise run at Q8_0)
    let stored = LoadOptions {
        keep_quant: true,
        ..Default::default()
    };
    let draft = load_draft(&dsrc, &tcfg, "target", &stored).unwrap();
    assert_eq!(
        draft.block_size() as u64,
        trace["block_size"].as_u64().unwrap(),
        "{case}: block size"
    );
    let prompt = ids(&trace["prompt_ids"]);

    // 1. The draft's first call, from the target's prefill taps.
    let mut tc = target.new_cache(prompt.len() + 64).unwrap();
    let pre = target
        .forward(&prompt, 0, &mut tc, &draft.taps, Logits::Last)
        .unwrap();
    let taps = pre.taps.unwrap();
    assert!(
        max_abs_diff(&taps, &g["target_ctx_prefill"]) < 1e-4,
        "{case}: prefill taps"
    );
    let first = trace["first_token"].as_u64().unwrap() as u32;
    let q = draft.block_size();
    let mut block = vec![draft.mask_token_id(); q];
    block[0] = first;
    let mut dc = draft.new_cache(prompt.len() + 64).unwrap();
    let rows = draft
        .forward_rows(target.as_ref(), &taps, &block, prompt.len(), &mut dc)
        .unwrap();
    let (proposal, dl) = draft
        .propose_from_rows(target.as_ref(), &rows, first)
        .unwrap();
    let d = max_abs_diff(&dl, &g["draft_logits_step0"]);
    assert!(d < 1e-4, "{case}: draft logits step 0 differ by {d}");
    if let Some(want) = g.get("draft_rows_step0") {
        let d = max_abs_diff(&rows, want);
        assert!(d < 1e-4, "{case}: draft rows step 0 differ by {d}");
        assert!(
            draft.selector().is_some(),
            "{case}: a DFlash2 draft has a selector"
        );
        assert_eq!(
            proposal,
            ids(&trace["steps"][0]["selector_path"]),
            "{case}: selector path of the first draft call"
        );
        // The selector is exercised: its path differs from the argmax somewhere in the trace.
        assert!(trace["selector_rows_overruling_argmax"].as_u64().unwrap() > 0);
    }
    assert_eq!(
        dc.len(),
        prompt.len(),
        "draft cache keeps only context rows"
    );

    // 2. The whole generation, cycle by cycle.
    let engine = Engine::new(target, Some(draft));
    let mut req = GenerateRequest::new(
        prompt.clone(),
        trace["max_new_tokens"].as_u64().unwrap() as usize,
    );
    req.trace = true;
    req.adaptive = false; // the reference runs the draft's block size every cycle
    let out = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
    assert_eq!(
        out.output_ids,
        ids(&trace["output_ids"]),
        "{case}: output ids"
    );
    assert_eq!(
        out.output_ids,
        ids(&trace["greedy_ids"]),
        "{case}: output == greedy"
    );
    let ours = out.steps.unwrap();
    let theirs = trace["steps"].as_array().unwrap();
    assert_eq!(ours.len(), theirs.len(), "{case}: number of cycles");
    for (i, (o, t)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(
            o.start as u64,
            t["start"].as_u64().unwrap(),
            "{case} step {i}: start"
        );
        assert_eq!(
            o.block_ids,
            ids(&t["block_ids"]),
            "{case} step {i}: block ids"
        );
        assert_eq!(
            o.accepted as u64,
            t["accepted"].as_u64().unwrap(),
            "{case} step {i}: accepted"
        );
    }
    let al: Vec<usize> = trace["acceptance_lengths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(
        out.stats.acceptance_lengths, al,
        "{case}: acceptance lengths"
    );

    // 3. A stop token inside an accepted run cuts the output right after it.
    if let Some(sv) = trace.get("stop_variant").filter(|v| !v.is_null()) {
        let mut req = req.clone();
        req.stop_ids = ids(&sv["stop_token_ids"]);
        let out = engine.generate(&req, &mut |_| Flow::Continue).unwrap();
        assert_eq!(
            out.output_ids,
            ids(&sv["expected_output_ids"]),
            "{case}: stop variant"
        );
        assert_eq!(out.stats.finish_reason, "stop");
        let al: Vec<usize> = sv["acceptance_lengths"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(
            out.stats.acceptance_lengths, al,
            "{case}: stop variant acceptance lengths"
        );
    }
}

#[test]
fn qwen3_target_block16_matches_reference() {
    check("qwen3_b16");
}

#[test]
fn llama3_target_block8_matches_reference() {
    check("llama3_b8");
}

#[test]
fn tied_target_sliding_draft_block4_matches_reference() {
    check("qwen3_tied_swa_b4");
}

#[test]
fn dflash2_qwen3_block16_kernel3_matches_reference() {
    check_in("dflash2", "d2_qwen3_b16_k3");
}

#[test]
fn dflash2_llama3_block8_kernel2_top_level_keys_matches_reference() {
    check_in("dflash2", "d2_llama3_b8_k2");
}

#[test]
fn dflash2_tied_noncausal_sliding_block8_kernel4_matches_reference() {
    check_in("dflash2", "d2_tied_swa_noncausal_b8_k4");
}

#[test]
fn dflash2_causal_sliding_block16_single_group_matches_reference() {
    check_in("dflash2", "d2_qwen3_causal_swa_b16_k2");
}
