use super::draft::{default_taps, DraftConfig};
use super::*;
use serde_json::json;

fn base() -> serde_json::Value {
    json!({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100})
}

#[test]
fn head_dim_explicit_or_derived_and_dtype_spellings() {
    let c = TargetConfig::from_value("c.json", base()).unwrap();
    assert_eq!(c.head_dim, 16);
    assert_eq!(
        c.rope,
        RopeConfig {
            theta: 10000.0,
            kind: RopeKind::Default,
            partial_rotary_factor: 1.0
        }
    );
    let mut v = base();
    v["head_dim"] = 32.into();
    v["torch_dtype"] = "bfloat16".into();
    let c = TargetConfig::from_value("c.json", v.clone()).unwrap();
    assert_eq!((c.head_dim, c.dtype.as_deref()), (32, Some("bfloat16")));
    v["dtype"] = "float16".into();
    assert_eq!(
        TargetConfig::from_value("c.json", v)
            .unwrap()
            .dtype
            .as_deref(),
        Some("float16")
    );
}

#[test]
fn both_rope_spellings_agree() {
    let mut v4 = base();
    v4["rope_theta"] = 500000.0.into();
    v4["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let mut v5 = base();
    v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let a = TargetConfig::from_value("a", v4).unwrap().rope;
    let b = TargetConfig::from_value("b", v5).unwrap().rope;
    assert_eq!(a, b);
    assert!(matches!(a.kind, RopeKind::Llama3 { factor, .. } if factor == 8.0));
    // old `type` key
    let mut v = base();
    v["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    assert_eq!(
        TargetConfig::from_value("c", v).unwrap().rope.kind,
        RopeKind::Linear { factor: 2.0 }
    );
}

#[test]
fn llama3_frequencies_follow_the_three_bands() {
    let mut v = base();
    v["head_dim"] = 128.into();
    v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let c = TargetConfig::from_value("c", v).unwrap();
    let (inv, scale) = c.rope.inv_freq(128);
    let (plain, _) = RopeConfig {
        kind: RopeKind::Default,
        ..c.rope.clone()
    }
    .inv_freq(128);
    assert_eq!(scale, 1.0);
    assert_eq!(inv[0], plain[0]); // high frequency: unchanged
    assert!((inv[63] - plain[63] / 8.0).abs() < 1e-12); // low frequency: divided by factor
    let mid = inv
        .iter()
        .zip(&plain)
        .filter(|(a, b)| **a < **b && **a > **b / 8.0)
        .count();
    assert!(mid > 0, "some medium band frequencies are interpolated");
}

#[test]
fn yarn_attention_factor_rules() {
    let mut v = base();
    v["max_position_embeddings"] = 4096.into();
    v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    let c = TargetConfig::from_value("c", v.clone()).unwrap();
    let (_, s) = c.rope.inv_freq(16);
    assert!((s as f64 - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-6);
    // mscale == mscale_all_dim -> 1.0 (the Kimi draft's case)
    v["rope_scaling"] =
        json!({"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0});
    let (_, s) = TargetConfig::from_value("c", v.clone())
        .unwrap()
        .rope
        .inv_freq(16);
    assert_eq!(s, 1.0);
    // explicit attention_factor wins
    v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.5});
    let (_, s) = TargetConfig::from_value("c", v).unwrap().rope.inv_freq(16);
    assert_eq!(s, 0.5);
}

#[test]
fn errors_name_file_and_field() {
    let mut v = base();
    v.as_object_mut().unwrap().remove("hidden_size");
    let e = TargetConfig::from_value("m/config.json", v)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("m/config.json") && e.contains("hidden_size") && e.contains("missing"),
        "{e}"
    );
    let mut v = base();
    v["num_key_value_heads"] = 3.into();
    let e = TargetConfig::from_value("c", v).unwrap_err().to_string();
    assert!(e.contains("num_key_value_heads"), "{e}");
    let mut v = base();
    v["vocab_size"] = "many".into();
    let e = TargetConfig::from_value("c", v).unwrap_err().to_string();
    assert!(e.contains("vocab_size") && e.contains("integer"), "{e}");
    let mut v = base();
    v["rope_scaling"] = json!({"rope_type": "yarn"});
    let e = TargetConfig::from_value("c", v).unwrap_err().to_string();
    assert!(e.contains("rope_scaling.factor"), "{e}");
    let mut v = base();
    v["rope_scaling"] = json!({"rope_type": "longrope2", "factor": 2.0});
    let e = TargetConfig::from_value("c", v).unwrap_err().to_string();
    assert!(e.contains("rope_type") && e.contains("longrope2"), "{e}");
    let mut v = base();
    v["layer_types"] = json!(["full_attention"]);
    let e = TargetConfig::from_value("c", v).unwrap_err().to_string();
    assert!(e.contains("layer_types"), "{e}");
    let e = TargetConfig::from_value("c", json!([1, 2]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("JSON object"), "{e}");
}

#[test]
fn default_taps_round_half_to_even() {
    assert_eq!(default_taps(1, 36), vec![18]);
    assert_eq!(default_taps(5, 36), vec![1, 9, 17, 25, 33]);
    assert_eq!(default_taps(5, 32), vec![1, 8, 15, 22, 29]);
    assert_eq!(default_taps(5, 64), vec![1, 16, 31, 46, 61]);
    assert_eq!(default_taps(5, 40), vec![1, 10, 19, 28, 37]);
    // 1 + 1*(6-4)/(4-1)... a .5 case: n=3, L=7 -> 1, 2.5 -> 2, 4
    assert_eq!(default_taps(3, 7), vec![1, 2, 4]);
    // n=3, L=9 -> 1, 3.5 -> 4, 6
    assert_eq!(default_taps(3, 9), vec![1, 4, 6]);
}

#[test]
fn draft_config_block_size_locations() {
    let mut v = base();
    v["dflash_config"] = json!({"mask_token_id": 5, "target_layer_ids": [1, 3], "block_size": 8});
    v["block_size"] = 16.into();
    let d = DraftConfig::from_value("d", v.clone()).unwrap();
    assert_eq!(
        (d.block_size, d.mask_token_id),
        (8, 5),
        "dflash_config.block_size takes precedence"
    );
    v["dflash_config"] = json!({"mask_token_id": 5});
    let d = DraftConfig::from_value("d", v.clone()).unwrap();
    assert_eq!(d.block_size, 16);
    assert_eq!(d.taps(36), vec![1, 33]);
    v.as_object_mut().unwrap().remove("block_size");
    let e = DraftConfig::from_value("d", v.clone())
        .unwrap_err()
        .to_string();
    assert!(e.contains("block_size"), "{e}");
    v["block_size"] = 4.into();
    v["dflash_config"] = json!({});
    let e = DraftConfig::from_value("d", v).unwrap_err().to_string();
    assert!(e.contains("mask_token_id"), "{e}");
}

#[test]
fn draft_validation_names_both_values() {
    let mut v = base();
    v["dflash_config"] = json!({"mask_token_id": 99, "target_layer_ids": [1, 7]});
    v["block_size"] = 4.into();
    let d = DraftConfig::from_value("d.json", v).unwrap();
    let mut t = base();
    t["num_hidden_layers"] = 4.into();
    let t = TargetConfig::from_value("t.json", t).unwrap();
    let e = d.validate_against(&t, "T").unwrap_err().to_string();
    assert!(e.contains("tap layer 7") && e.contains("4"), "{e}");
    let mut t2 = t.clone();
    t2.num_hidden_layers = 8;
    t2.vocab_size = 50;
    let e = d.validate_against(&t2, "T").unwrap_err().to_string();
    assert!(
        e.contains("mask_token_id 99") && e.contains("vocab_size 50"),
        "{e}"
    );
    t2.vocab_size = 100;
    t2.hidden_size = 32;
    let e = d.validate_against(&t2, "T").unwrap_err().to_string();
    assert!(
        e.contains("hidden_size 64") && e.contains("hidden_size 32"),
        "{e}"
    );
}

#[test]
fn dflash2_keys_from_either_place_with_clear_errors() {
    let mut v = base();
    v["architectures"] = json!(["DFlash2DraftModel"]);
    v["block_size"] = 8.into();
    v["is_causal"] = false.into();
    v["dflash_config"] = json!({"mask_token_id": 5, "conv_kernel_size": 2, "conv_group_size": 16,
                               "selector_rank": 32, "selector_top_k": 16});
    let d = DraftConfig::from_value("d.json", v.clone()).unwrap();
    let want = super::draft::Dflash2Config {
        conv_kernel_size: 2,
        conv_group_size: 16,
        selector_rank: 32,
        selector_top_k: 16,
    };
    assert_eq!(d.dflash2, Some(want));
    assert_eq!(d.is_causal, Some(false));
    // The top level when dflash_config lacks them (dflash_config wins when both do).
    let mut top = v.clone();
    top["dflash_config"] = json!({"mask_token_id": 5, "selector_top_k": 16});
    top["conv_kernel_size"] = 2.into();
    top["conv_group_size"] = 16.into();
    top["selector_rank"] = 32.into();
    top["selector_top_k"] = 99.into();
    assert_eq!(
        DraftConfig::from_value("d.json", top).unwrap().dflash2,
        Some(want)
    );
    // A DFlashDraftModel ignores them; no is_causal key leaves the reference's default.
    let mut v1 = base();
    v1["block_size"] = 8.into();
    v1["dflash_config"] = json!({"mask_token_id": 5});
    let d1 = DraftConfig::from_value("d.json", v1).unwrap();
    assert_eq!((d1.dflash2, d1.is_causal), (None, None));
    let err = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut x = v.clone();
        edit(&mut x);
        DraftConfig::from_value("d.json", x)
            .unwrap_err()
            .to_string()
    };
    let e = err(&|x| {
        x["dflash_config"]
            .as_object_mut()
            .unwrap()
            .remove("selector_rank");
    });
    assert!(
        e.contains("d.json") && e.contains("dflash_config.selector_rank") && e.contains("missing"),
        "{e}"
    );
    let e = err(&|x| x["dflash_config"]["conv_group_size"] = 24.into());
    assert!(
        e.contains("conv_group_size") && e.contains("does not divide hidden_size 64"),
        "{e}"
    );
    let e = err(&|x| x["dflash_config"]["conv_kernel_size"] = 0.into());
    assert!(
        e.contains("conv_kernel_size") && e.contains("out of range"),
        "{e}"
    );
    let e = err(&|x| x["dflash_config"]["selector_top_k"] = 101.into());
    assert!(e.contains("selector_top_k") && e.contains("1..=100"), "{e}");
    let e = err(&|x| x["architectures"] = json!(["EagleDraftModel"]));
    assert!(
        e.contains("EagleDraftModel") && e.contains("DFlash2DraftModel"),
        "{e}"
    );
    // The selector's codebooks are indexed by target ids: the vocabularies must agree.
    let d = DraftConfig::from_value("d.json", v.clone()).unwrap();
    let mut t = base();
    t["vocab_size"] = 120.into();
    let t = TargetConfig::from_value("t.json", t).unwrap();
    let e = d.validate_against(&t, "T").unwrap_err().to_string();
    assert!(e.contains("vocab_size 100") && e.contains("120"), "{e}");
}

#[test]
fn positive_fields_take_their_default_and_refuse_zero() {
    let v = json!({"a": 3, "z": 0, "neg": -1});
    let f = Fields::new("c.json", &v).unwrap();
    assert_eq!(f.pos_usize_or("a", 7).unwrap(), 3);
    assert_eq!(f.pos_usize_or("missing", 7).unwrap(), 7);
    let e = f.pos_usize_or("z", 7).unwrap_err().to_string();
    assert!(
        e.contains("c.json") && e.contains("z") && e.contains("must be > 0"),
        "{e}"
    );
    assert!(f.pos_usize_or("neg", 7).is_err());
    assert!(f.pos_usize_or("missing", 0).is_err());
}
