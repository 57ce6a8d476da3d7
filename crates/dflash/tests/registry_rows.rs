//! Every registry row whose target family this build supports: (1) the published draft and
//! target config SHAPES (written here from the spec's tables) parse and validate, with the
//! published block size, mask id and taps; (2) a tiny random model with that family's shape
//! RATIOS (head_dim vs hidden, GQA ratio, tied head, rope type, MoE routing; layers and taps
//! scaled down) loads and decodes losslessly with a draft shaped the same way.

mod common;
use common::*;
use dflash::archs::LoadOptions;
use dflash::config::draft::DraftConfig;
use dflash::config::TargetConfig;
use dflash::draft::load_draft;
use dflash::engine::{Engine, Flow, GenerateRequest};
use dflash::registry::{family_supported, resolve_draft, DRAFT_REGISTRY};
use dflash::source::ModelSource;
use dflash::testing::{TinyDraft, TinyTarget};
use serde_json::{json, Value};

struct Row {
    target: &'static str,
    /// Published-shaped target config.json.
    target_config: Value,
    /// Published-shaped draft config.json.
    draft_config: Value,
    taps: Vec<usize>,
    mask: u32,
    block: usize,
    /// The tiny model with the same ratios, and its scaled taps.
    tiny: TinyTarget,
    tiny_taps: Vec<usize>,
}

fn zlab_draft(
    hidden: usize,
    heads: usize,
    kv: usize,
    head_dim: usize,
    inter: usize,
    taps: &[usize],
    l: usize,
    rope: Value,
) -> Value {
    let mut v = json!({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": taps},
        "num_target_layers": l, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 5,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": false,
        "attention_bias": false, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "layer_types": vec!["full_attention"; 5]
    });
    for (k, x) in rope.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn rows() -> Vec<Row> {
    let qwen_rope = json!({"rope_theta": 1000000.0});
    let mut q4 = TinyTarget::qwen3(501);
    (
        q4.hidden,
        q4.heads,
        q4.kv_heads,
        q4.head_dim,
        q4.layers,
        q4.tied,
    ) = (40, 8, 2, 16, 9, true);
    let mut q8 = TinyTarget::qwen3(502);
    (
        q8.hidden,
        q8.heads,
        q8.kv_heads,
        q8.head_dim,
        q8.layers,
        q8.tied,
    ) = (64, 8, 2, 8, 9, false);
    let mut ll = TinyTarget::llama(503);
    (
        ll.hidden,
        ll.heads,
        ll.kv_heads,
        ll.head_dim,
        ll.layers,
        ll.tied,
    ) = (64, 8, 2, 8, 8, false);
    ll.extra = json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}});
    let mut coder = TinyTarget::qwen3(504);
    coder.model_type = "qwen3_moe".into();
    (
        coder.hidden,
        coder.heads,
        coder.kv_heads,
        coder.head_dim,
        coder.layers,
    ) = (32, 8, 1, 16, 12);
    coder.extra = json!({"num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": true,
        "moe_intermediate_size": 12, "decoder_sparse_step": 1, "mlp_only_layers": []});
    vec![
        Row {
            target: "Qwen/Qwen3-4B",
            target_config: json!({"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
                "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "vocab_size": 151936, "tie_word_embeddings": true, "rope_theta": 1000000.0, "max_position_embeddings": 40960}),
            draft_config: zlab_draft(
                2560,
                32,
                8,
                128,
                9728,
                &[1, 9, 17, 25, 33],
                36,
                qwen_rope.clone(),
            ),
            taps: vec![1, 9, 17, 25, 33],
            mask: 151669,
            block: 16,
            tiny: q4,
            tiny_taps: vec![0, 2, 4, 6, 8],
        },
        Row {
            target: "Qwen/Qwen3-8B",
            target_config: json!({"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
                "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "vocab_size": 151936, "tie_word_embeddings": false, "rope_theta": 1000000.0, "max_position_embeddings": 40960}),
            draft_config: zlab_draft(
                4096,
                32,
                8,
                128,
                12288,
                &[1, 9, 17, 25, 33],
                36,
                qwen_rope.clone(),
            ),
            taps: vec![1, 9, 17, 25, 33],
            mask: 151669,
            block: 16,
            tiny: q8,
            tiny_taps: vec![0, 2, 4, 6, 8],
        },
        Row {
            target: "Qwen/Qwen3-Coder-30B-A3B-Instruct",
            target_config: json!({"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
                "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "vocab_size": 151936, "rope_theta": 10000000.0, "max_position_embeddings": 262144}),
            // taps not listed: the default rule over 48 layers
            draft_config: {
                let mut d = zlab_draft(
                    2048,
                    32,
                    4,
                    128,
                    6144,
                    &[],
                    48,
                    json!({"rope_theta": 10000000.0}),
                );
                d["dflash_config"]
                    .as_object_mut()
                    .unwrap()
                    .remove("target_layer_ids");
                d
            },
            taps: vec![1, 12, 23, 34, 45],
            mask: 151669,
            block: 16,
            tiny: coder,
            tiny_taps: vec![0, 3, 6, 8, 11],
        },
        Row {
            target: "meta-llama/Meta-Llama-3.1-8B-Instruct",
            target_config: json!({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                "rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3",
                "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
            draft_config: {
                let mut d = zlab_draft(
                    4096,
                    32,
                    8,
                    128,
                    14336,
                    &[1, 8, 15, 22, 29],
                    32,
                    json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
                );
                d["vocab_size"] = 128256.into();
                d["dflash_config"]["mask_token_id"] = 128002.into();
                d
            },
            taps: vec![1, 8, 15, 22, 29],
            mask: 128002,
            block: 16,
            tiny: ll,
            tiny_taps: vec![0, 2, 4, 5, 7],
        },
    ]
}

#[test]
fn every_supported_registry_row_has_a_shape_test() {
    let rows = rows();
    for e in DRAFT_REGISTRY.iter().filter(|e| family_supported(e.family)) {
        if e.family == "gemma4" {
            continue; // gemma4_speculator_row below
        }
        if ["qwen3_5", "qwen3_5_moe", "qwen3_next"].contains(&e.family) {
            continue; // tests/hybrid.rs: hybrid_registry_rows_are_supported_and_lossless
        }
        if matches!(e.family, "gpt_oss" | "kimi_k25") {
            continue; // moe_mla_rows_* below
        }
        assert!(
            rows.iter()
                .any(|r| resolve_draft(r.target).map(|x| x.target) == Some(e.target)),
            "no shape test for {}",
            e.target
        );
    }
}

#[test]
fn published_config_shapes_parse_and_validate() {
    for r in rows() {
        let entry = resolve_draft(r.target).unwrap();
        let t = TargetConfig::from_value("target.json", r.target_config.clone()).unwrap();
        assert_eq!(t.model_type, entry.family);
        let d = DraftConfig::from_value("draft.json", r.draft_config.clone()).unwrap();
        assert_eq!(d.block_size, r.block, "{}", r.target);
        assert_eq!(Some(d.block_size), entry.block_size.or(Some(d.block_size)));
        assert_eq!(d.mask_token_id, r.mask);
        assert_eq!(
            d.validate_against(&t, r.target).unwrap(),
            r.taps,
            "{}",
            r.target
        );
    }
}

#[test]
fn tiny_models_with_the_rows_shape_ratios_are_lossless() {
    for r in rows() {
        let dir = tempfile::tempdir().unwrap();
        r.tiny.write(&dir.path().join("t")).unwrap();
        let mut d = TinyDraft::for_target(&r.tiny, 2, r.tiny_taps.clone(), 16, 9);
        d.heads = r.tiny.heads;
        d.kv_heads = r.tiny.kv_heads;
        d.head_dim = r.tiny.head_dim;
        d.write(&dir.path().join("d"), r.tiny.vocab).unwrap();
        let lo = LoadOptions::default();
        let (cfg, target) = dflash::archs::load_target(
            &ModelSource::from_dir("t", &dir.path().join("t")).unwrap(),
            &lo,
        )
        .unwrap();
        assert_eq!(cfg.model_type, resolve_draft(r.target).unwrap().family);
        let draft = load_draft(
            &ModelSource::from_dir("d", &dir.path().join("d")).unwrap(),
            &cfg,
            "t",
            &lo,
        )
        .unwrap();
        let e = Engine::new(target, Some(draft));
        for seed in 0..3u64 {
            let p = ids(seed, 3 + 7 * seed as usize, r.tiny.vocab);
            let mut req = GenerateRequest::new(p, 24);
            let a = e.generate(&req, &mut |_| Flow::Continue).unwrap();
            req.block_size = Some(1);
            let b = e.generate(&req, &mut |_| Flow::Continue).unwrap();
            assert_eq!(a.output_ids, b.output_ids, "{} seed {seed}", r.target);
            assert_eq!(a.stats.mode, "dflash");
        }
    }
}

/// The Gemma-4-31B-it row: a speculators-format draft (RedHatAI). The published shape (spec
/// section 5: 60 target layers, z-lab taps [1,12,23,35,46,57] -> aux ids +1, mask 4) parses;
/// a tiny gemma4 target (the transformers golden fixture) with a speculators draft of the same
/// layout decodes losslessly.
#[test]
fn gemma4_speculator_row() {
    let entry = resolve_draft("google/gemma-4-31B-it").unwrap();
    assert_eq!(entry.format, dflash::registry::DraftFormat::Speculators);
    let published = json!({
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": {"model_type": "llama", "hidden_size": 5376, "intermediate_size": 21504,
            "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
            "vocab_size": 262144, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 262144},
        "aux_hidden_state_layer_ids": [2, 13, 24, 36, 47, 58], "mask_token_id": 4, "block_size": 16,
        "draft_vocab_size": 32000, "target_hidden_size": 5376,
        "speculators_config": {"algorithm": "dflash", "verifier": {"name_or_path": "google/gemma-4-31B-it"}}
    });
    let d = DraftConfig::from_value("speculator.json", published).unwrap();
    assert_eq!(d.target_layer_ids, Some(vec![1, 12, 23, 35, 46, 57]));
    assert_eq!(
        (d.mask_token_id, d.block_size, d.draft_vocab_size),
        (4, 16, Some(32000))
    );
    assert_eq!(d.verifier.as_deref(), Some("google/gemma-4-31B-it"));

    let fx =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/targets/gemma4");
    let lo = LoadOptions::default();
    let (cfg, target) =
        dflash::archs::load_target(&ModelSource::from_dir("gemma4", &fx).unwrap(), &lo).unwrap();
    assert_eq!(cfg.model_type, "gemma4_text");
    let tiny = TinyTarget {
        hidden: cfg.hidden_size,
        vocab: cfg.vocab_size,
        layers: cfg.num_hidden_layers,
        ..TinyTarget::qwen3(1)
    };
    let mut dr = TinyDraft::for_target(&tiny, 2, vec![0, 2, 4], 8, 77);
    dr.mask_token_id = 4;
    let dir = tempfile::tempdir().unwrap();
    let map: Vec<u32> = (0..64).map(|i| (i * 4) as u32).collect();
    let st =
        candle_core::safetensors::load(fx.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let idx = candle_core::Tensor::new(map.as_slice(), &candle_core::Device::Cpu).unwrap();
    let rows = st["model.embed_tokens.weight"]
        .index_select(&idx, 0)
        .unwrap(); // tied head rows
    dr.write_speculators(
        dir.path(),
        cfg.vocab_size,
        &map,
        &rows,
        "google/gemma-4-31B-it",
    )
    .unwrap();
    let draft = load_draft(
        &ModelSource::from_dir("d", dir.path()).unwrap(),
        &cfg,
        "gemma4",
        &lo,
    )
    .unwrap();
    let e = Engine::new(target, Some(draft));
    for seed in 0..3u64 {
        let p = ids(seed, 4 + 5 * seed as usize, cfg.vocab_size);
        let mut req = GenerateRequest::new(p, 20);
        req.adaptive = false;
        let a = e.generate(&req, &mut |_| Flow::Continue).unwrap();
        req.block_size = Some(1);
        let b = e.generate(&req, &mut |_| Flow::Continue).unwrap();
        assert_eq!(a.output_ids, b.output_ids, "seed {seed}");
        assert_eq!(a.stats.mode, "dflash");
        assert!(a.output_ids.iter().all(|&t| (t as usize) < cfg.vocab_size));
    }
}

/// The gpt-oss and Kimi-K2.5 rows, published shapes. Target configs as published
/// (openai/gpt-oss-20b, -120b; moonshotai/Kimi-K2.5, whose text model sits in `text_config`).
/// Draft configs: z-lab/gpt-oss-20b-DFlash says `model_type: gpt_oss` with no rope keys and no
/// `layer_types`, so transformers' GptOssConfig defaults apply (yarn factor 32, alternating
/// sliding/full layers); z-lab/gpt-oss-120b-DFlash: block 10, taps [1,9,17,25,33] over 36
/// layers; z-lab/Kimi-K2.5-DFlash: qwen3 layers, yarn factor 64 with mscale = mscale_all_dim =
/// 1, so its rope attention factor is exactly 1.0 (transformers' rule). Draft fields that no
/// public source states (Kimi draft heads / intermediate size) are marked "assumed".
fn moe_mla_published() -> Vec<(&'static str, Value, Value, Vec<usize>, u32, usize)> {
    let gpt_oss_target = |layers: usize, experts: usize| {
        json!({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": true,
            "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": layers,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
            "num_local_experts": experts, "num_experts_per_tok": 4, "experts_per_token": 4,
            "sliding_window": 128, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
            "max_position_embeddings": 131072, "initial_context_length": 4096, "rope_theta": 150000,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": false, "original_max_position_embeddings": 4096},
            "layer_types": (0..layers).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" })
                .collect::<Vec<_>>(),
            "quantization_config": {"quant_method": "mxfp4"}})
    };
    let gpt_oss_draft = |taps: &[usize], l: usize, block: usize| {
        json!({"architectures": ["DFlashDraftModel"], "model_type": "gpt_oss", "attention_bias": true,
            "block_size": block, "dflash_config": {"mask_token_id": 200000, "target_layer_ids": taps},
            "num_target_layers": l, "hidden_size": 2880, "intermediate_size": 7680, "num_hidden_layers": 8,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
            "rope_theta": 150000, "max_position_embeddings": 131072, "vocab_size": 201088,
            "hidden_act": "silu", "dtype": "bfloat16"})
    };
    let kimi_target = json!({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "tie_word_embeddings": false,
        "text_config": {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
            "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": true, "routed_scaling_factor": 2.827,
            "vocab_size": 163840, "rope_theta": 50000.0, "max_position_embeddings": 262144,
            "rope_scaling": {"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}}});
    let kimi_draft = json!({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
        "dflash_config": {"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]},
        "num_target_layers": 61, "hidden_size": 7168, "num_hidden_layers": 6, "vocab_size": 163840,
        // assumed: not stated by a public source we could read
        "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "rope_theta": 50000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}});
    vec![
        (
            "openai/gpt-oss-20b",
            gpt_oss_target(24, 32),
            gpt_oss_draft(&[1, 6, 11, 16, 21], 24, 8),
            vec![1, 6, 11, 16, 21],
            200000,
            8,
        ),
        (
            "openai/gpt-oss-120b",
            gpt_oss_target(36, 128),
            gpt_oss_draft(&[1, 9, 17, 25, 33], 36, 10),
            vec![1, 9, 17, 25, 33],
            200000,
            10,
        ),
        (
            "moonshotai/Kimi-K2.5",
            kimi_target,
            kimi_draft,
            vec![1, 12, 24, 35, 47, 58],
            163838,
            8,
        ),
    ]
}

#[test]
fn moe_mla_rows_published_configs() {
    use dflash::config::{LayerType, RopeKind};
    for (target, tc, dc, taps, mask, block) in moe_mla_published() {
        let entry = resolve_draft(target).unwrap();
        assert!(family_supported(entry.family), "{target}");
        let t = TargetConfig::from_value("target.json", tc).unwrap();
        let fam = dflash::archs::family_for(&t).unwrap();
        assert!(fam.model_types.contains(&entry.family), "{target}");
        let d = DraftConfig::from_value("draft.json", dc).unwrap();
        assert_eq!((d.block_size, d.mask_token_id), (block, mask), "{target}");
        assert_eq!(
            entry.block_size,
            Some(block),
            "{target}: registry block size"
        );
        assert_eq!(d.validate_against(&t, target).unwrap(), taps, "{target}");
        // the draft's rope: yarn, read from the config (or gpt-oss's config defaults)
        let RopeKind::Yarn { factor, .. } = d.layers.rope.kind else {
            panic!("{target}: draft rope is not yarn: {:?}", d.layers.rope)
        };
        let (_, attn) = d.layers.rope.inv_freq(d.layers.head_dim);
        if entry.family == "kimi_k25" {
            assert_eq!(factor, 64.0);
            assert_eq!(attn, 1.0, "Kimi draft attention factor");
        } else {
            assert_eq!(factor, 32.0);
            assert!((attn as f64 - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-6);
            // gpt-oss defaults: even draft layers slide over 128 tokens
            assert_eq!(d.layers.layer_types[0], LayerType::Sliding);
            assert_eq!(d.layers.layer_types[1], LayerType::Full);
            assert_eq!(d.layers.sliding_window, Some(128));
            assert!(d.layers.attention_bias);
        }
    }
}

/// Lossless DFlash for the gpt_oss (float and MXFP4 experts), deepseek_v3 and kimi_k25 golden
/// fixtures with block-8 yarn drafts shaped like the published ones (a gpt_oss-typed draft
/// with q/k/v/o biases and config defaults, window 8; a qwen3 draft with Kimi's yarn). The
/// targets' LM heads get a few boosted rows so that the draft often agrees and partial
/// acceptances (hence cache rollbacks) happen.
#[test]
fn moe_mla_rows_are_lossless_with_block8_yarn_drafts() {
    use candle_core::{Device, Tensor};
    let lo = LoadOptions::default();
    for (fixture, head_name, kimi_style) in [
        ("gpt_oss", "lm_head.weight", false),
        ("gpt_oss_mxfp4", "lm_head.weight", false),
        ("deepseek_v3", "lm_head.weight", true),
        ("kimi_k25", "language_model.lm_head.weight", true),
    ] {
        let fx = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/targets")
            .join(fixture);
        let dir = tempfile::tempdir().unwrap();
        let tdir = dir.path().join("t");
        std::fs::create_dir_all(&tdir).unwrap();
        std::fs::copy(fx.join("config.json"), tdir.join("config.json")).unwrap();
        let mut st =
            candle_core::safetensors::load(fx.join("model.safetensors"), &Device::Cpu).unwrap();
        let head = &st[head_name];
        let boost: Vec<f32> = (0..head.dim(0).unwrap())
            .map(|r| if r % 37 == 5 { 3.0 } else { 1.0 })
            .collect();
        let boost = Tensor::from_vec(boost, (head.dim(0).unwrap(), 1), &Device::Cpu).unwrap();
        let boosted = head.broadcast_mul(&boost).unwrap();
        st.insert(head_name.to_string(), boosted);
        candle_core::safetensors::save(&st, tdir.join("model.safetensors")).unwrap();
        let (cfg, target) =
            dflash::archs::load_target(&ModelSource::from_dir("t", &tdir).unwrap(), &lo).unwrap();
        let tiny = TinyTarget {
            hidden: cfg.hidden_size,
            vocab: cfg.vocab_size,
            layers: cfg.num_hidden_layers,
            ..TinyTarget::qwen3(1)
        };
        let taps: Vec<usize> = (0..cfg.num_hidden_layers).collect();
        let mut dr = TinyDraft::for_target(&tiny, 2, taps, 8, 91);
        let ddir = dir.path().join("d");
        dr.mask_token_id = (cfg.vocab_size - 1) as u32;
        dr.write(&ddir, cfg.vocab_size).unwrap();
        let mut dc = dr.config(cfg.vocab_size);
        if kimi_style {
            dc["rope_theta"] = json!(50000.0);
            dc["rope_scaling"] = json!({"rope_type": "yarn", "factor": 64.0, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096});
        } else {
            // gpt_oss-typed draft: attention biases, rope and layer types from the defaults
            dc["model_type"] = json!("gpt_oss");
            dc["attention_bias"] = json!(true);
            dc["sliding_window"] = json!(8);
            dc["rope_theta"] = json!(150000);
            let mut w =
                candle_core::safetensors::load(ddir.join("model.safetensors"), &Device::Cpu)
                    .unwrap();
            let mut f = dflash::testing::TensorFactory::new(7);
            for l in 0..dr.layers {
                for (p, n) in [
                    ("q_proj", dr.heads * dr.head_dim),
                    ("k_proj", dr.kv_heads * dr.head_dim),
                    ("v_proj", dr.kv_heads * dr.head_dim),
                    ("o_proj", dr.hidden),
                ] {
                    f.normal(&format!("layers.{l}.self_attn.{p}.bias"), &[n], 0.05)
                        .unwrap();
                }
            }
            w.extend(f.tensors);
            candle_core::safetensors::save(&w, ddir.join("model.safetensors")).unwrap();
        }
        dflash::testing::write_json(&ddir.join("config.json"), &dc).unwrap();
        let draft =
            load_draft(&ModelSource::from_dir("d", &ddir).unwrap(), &cfg, "t", &lo).unwrap();
        let e = Engine::new(target, Some(draft));
        let mut accepted = 0;
        for seed in 0..4u64 {
            let p = ids(seed, 5 + 9 * seed as usize, cfg.vocab_size);
            let mut req = GenerateRequest::new(p, 40);
            req.adaptive = false;
            let a = e.generate(&req, &mut |_| Flow::Continue).unwrap();
            req.block_size = Some(1);
            let b = e.generate(&req, &mut |_| Flow::Continue).unwrap();
            assert_eq!(a.output_ids, b.output_ids, "{fixture} seed {seed}");
            assert_eq!((a.stats.mode.as_str(), a.stats.block_size), ("dflash", 8));
            accepted += a
                .stats
                .acceptance_lengths
                .iter()
                .filter(|&&l| l > 1 && l < 8)
                .count();
        }
        assert!(accepted > 0, "{fixture}: no partial acceptance exercised");
    }
}
