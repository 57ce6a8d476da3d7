//! Parity with HF transformers (independent reference): tiny random qwen3 / llama models
//! made by tools/goldens/make_target_goldens.py, with every position's logits and two
//! layers' hidden states (output_hidden_states[k + 1]) recorded in f32.

mod common;
use common::*;
use dflash::archs::Logits;

fn check(name: &str) {
    let dir = fixture(name);
    let g = Golden::load(&dir);
    let ids = &g.ids;
    let m = load(&dir);
    let mut c = m.new_cache(ids.len()).unwrap();
    let out = m.forward(ids, 0, &mut c, &g.taps, Logits::All).unwrap();
    let d = max_abs_diff(&out.logits.unwrap(), &g.t["logits"]);
    assert!(d < 1e-4, "{name}: max abs logit error {d}");
    g.assert_taps(name, &out.taps.unwrap(), &g.taps, 0, |_| 1e-4);
    // Incremental decoding reproduces the golden too (prefill 20, then one at a time).
    let mut c = m.new_cache(ids.len()).unwrap();
    m.forward(&ids[..20], 0, &mut c, &[], Logits::None).unwrap();
    assert_token_by_token(name, m.as_ref(), &g, &mut c, 20);
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

/// After a verify-style rollback (forward garbage, truncate), re-forwarding the real tokens
/// reproduces the golden: the KV cache (gpt_oss, sliding and full layers) and the MLA latent
/// cache (deepseek_v3, kimi_k25) forget the cropped rows.
#[test]
fn rollback_then_reforward_matches_the_golden() {
    for name in ["gpt_oss", "deepseek_v3", "kimi_k25"] {
        let dir = fixture(name);
        let g = Golden::load(&dir);
        let ids = &g.ids;
        let m = load(&dir);
        let mut c = m.new_cache(ids.len() + 8).unwrap();
        m.forward(&ids[..25], 0, &mut c, &[], Logits::None).unwrap();
        let garbage: Vec<u32> = ids[3..11].iter().rev().copied().collect();
        m.forward(&garbage, 25, &mut c, &[], Logits::All).unwrap();
        c.truncate(25).unwrap();
        let l = m
            .forward(&ids[25..], 25, &mut c, &[], Logits::All)
            .unwrap()
            .logits
            .unwrap();
        let d = max_abs_diff(&l, &g.logits(25, ids.len() - 25));
        assert!(d < 1e-4, "{name}: after rollback, max abs logit error {d}");
    }
}

/// The Kimi-K2.5 fixture rewritten in the layout transformers 5 keeps in memory (and other
/// exporters write): `model.language_model.*`, `lm_head.weight`, experts stacked as
/// `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`: same logits.
#[test]
fn kimi_k25_other_tensor_layout_loads_the_same_model() {
    use candle_core::Tensor;
    let src = fixture("kimi_k25");
    let st =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let experts = cfg["text_config"]["n_routed_experts"].as_u64().unwrap() as usize;
    let mut out = std::collections::HashMap::new();
    for (k, v) in &st {
        let k = k
            .replace("language_model.model.", "model.language_model.")
            .replace("language_model.lm_head.", "lm_head.");
        if k.contains(".mlp.experts.") {
            continue;
        }
        out.insert(k, v.clone());
    }
    let layers = cfg["text_config"]["num_hidden_layers"].as_u64().unwrap() as usize;
    for l in 1..layers {
        let p = format!("language_model.model.layers.{l}.mlp.experts");
        let get = |e: usize, n: &str| st[&format!("{p}.{e}.{n}.weight")].clone();
        let gu: Vec<Tensor> = (0..experts)
            .map(|e| Tensor::cat(&[get(e, "gate_proj"), get(e, "up_proj")], 0).unwrap())
            .collect();
        let down: Vec<Tensor> = (0..experts).map(|e| get(e, "down_proj")).collect();
        let q = format!("model.language_model.layers.{l}.mlp.experts");
        out.insert(format!("{q}.gate_up_proj"), Tensor::stack(&gu, 0).unwrap());
        out.insert(format!("{q}.down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    candle_core::safetensors::save(&out, dir.path().join("model.safetensors")).unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let g = Golden::load(&src);
    let ids = &g.ids;
    let m = load(dir.path());
    let mut c = m.new_cache(ids.len()).unwrap();
    let l = m
        .forward(ids, 0, &mut c, &[], Logits::All)
        .unwrap()
        .logits
        .unwrap();
    let d = max_abs_diff(&l, &g.t["logits"]);
    assert!(d < 1e-4, "max abs logit error {d}");
}
