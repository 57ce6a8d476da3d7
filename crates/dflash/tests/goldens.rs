//! Parity with HF transformers (independent reference): tiny random qwen3 / llama models
//! made by tools/goldens/make_target_goldens.py, with every position's logits and two
//! layers' hidden states (output_hidden_states[k + 1]) recorded in f32.

mod common;
use common::*;
use dflash::archs::Logits;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/targets")
        .join(name)
}

fn check(name: &str) {
    let dir = fixture(name);
    let g =
        candle_core::safetensors::load(dir.join("golden.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let taps: Vec<usize> = meta["taps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    let ids: Vec<u32> = g["input_ids"]
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect();
    let m = load(&dir);
    let mut c = m.new_cache(ids.len()).unwrap();
    let out = m.forward(&ids, 0, &mut c, &taps, Logits::All).unwrap();
    let d = max_abs_diff(&out.logits.unwrap(), &g["logits"]);
    assert!(d < 1e-4, "{name}: max abs logit error {d}");
    let h = g[&format!("hidden_{}", taps[0])].dim(1).unwrap();
    let t = out.taps.unwrap();
    for (slot, k) in taps.iter().enumerate() {
        let want = &g[&format!("hidden_{k}")];
        let got = t.narrow(1, slot * h, h).unwrap();
        let d = max_abs_diff(&got, want);
        assert!(d < 1e-4, "{name}: tap {k} max abs error {d}");
    }
    // Incremental decoding reproduces the golden too (prefill 20, then one at a time).
    let mut c = m.new_cache(ids.len()).unwrap();
    m.forward(&ids[..20], 0, &mut c, &[], Logits::None).unwrap();
    for (i, &t) in ids.iter().enumerate().skip(20) {
        let l = m
            .forward(&[t], i, &mut c, &[], Logits::Last)
            .unwrap()
            .logits
            .unwrap();
        let d = max_abs_diff(&l, &g["logits"].narrow(0, i, 1).unwrap());
        assert!(d < 1e-4, "{name}: position {i} incremental error {d}");
    }
}

#[test]
fn qwen3_matches_transformers() {
    check("qwen3");
}

#[test]
fn qwen3_yarn_tied_matches_transformers() {
    check("qwen3_yarn_tied");
}

#[test]
fn llama3_rope_matches_transformers() {
    check("llama3");
}

#[test]
fn llama_linear_rope_tied_bias_matches_transformers() {
    check("llama_linear_tied");
}

#[test]
fn qwen3_moe_matches_transformers() {
    check("qwen3_moe");
}

#[test]
fn qwen3_moe_unnormalized_sparse_step_tied_matches_transformers() {
    check("qwen3_moe_nonorm");
}

#[test]
fn gemma3_sliding_local_rope_softcap_matches_transformers() {
    check("gemma3");
}

#[test]
fn gpt_oss_sinks_sliding_yarn_moe_matches_transformers() {
    check("gpt_oss");
}

/// Experts stored as MXFP4 blocks/scales (transformers' own dequantization of the same file
/// gives the float experts of the golden bit for bit: tools/goldens/make_moe_mla_goldens.py).
#[test]
fn gpt_oss_mxfp4_experts_match_transformers() {
    check("gpt_oss_mxfp4");
}

#[test]
fn deepseek_v3_mla_q_lora_interleaved_yarn_mscale_grouped_routing_matches_transformers() {
    check("deepseek_v3");
}

#[test]
fn deepseek_v3_plain_q_tied_bias_ungrouped_matches_transformers() {
    check("deepseek_v3_plain");
}

/// Kimi-K2.5 layout: `text_config`, tensors under `language_model.model.` (as published),
/// vision tower tensors present and unused.
#[test]
fn kimi_k25_text_model_matches_transformers() {
    check("kimi_k25");
}
