//! The draft registry: which published DFlash draft serves which target (spec section 6), and
//! the rules that map a user's target name onto a row.
//!
//! Resolution: strip the org (`Org/Name` -> `Name`) or the directory path, lowercase, strip a
//! `meta-` prefix (Llama repos), then an exact key match, else the longest key `k` such that
//! the name starts with `k` followed by `-` or `_` (so `mlx-community/Qwen3.6-35B-A3B-4bit`
//! resolves to `Qwen3.6-35B-A3B`). No substring guessing.

use crate::archs::FAMILIES;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftFormat {
    /// `DFlashDraftModel` checkpoints (z-lab).
    ZLab,
    /// vllm-project/speculators `dflash` checkpoints.
    Speculators,
}

/// Which draft architecture a row's checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftArch {
    /// `DFlashDraftModel`.
    DFlash,
    /// `DFlash2DraftModel`: convolutional layers and a candidate selector.
    DFlash2,
}

impl DraftArch {
    pub fn name(self) -> &'static str {
        match self {
            DraftArch::DFlash => "DFlash",
            DraftArch::DFlash2 => "DFlash2",
        }
    }
}

impl DraftFormat {
    pub fn name(self) -> &'static str {
        match self {
            DraftFormat::ZLab => "z-lab",
            DraftFormat::Speculators => "speculators",
        }
    }
}

#[derive(Debug, Clone)]
pub struct DraftEntry {
    /// Target name as published (the registry key, compared case-insensitively).
    pub target: &'static str,
    /// Hub repo id of the draft.
    pub draft: &'static str,
    /// Target family (`model_type` of the target).
    pub family: &'static str,
    /// Expected block size (the draft's config is authoritative).
    pub block_size: Option<usize>,
    pub format: DraftFormat,
    pub arch: DraftArch,
    pub note: &'static str,
}

macro_rules! row {
    ($t:expr, $d:expr, $f:expr, $b:expr) => {
        DraftEntry {
            target: $t,
            draft: $d,
            family: $f,
            block_size: $b,
            format: DraftFormat::ZLab,
            arch: DraftArch::DFlash,
            note: "",
        }
    };
    ($t:expr, $d:expr, $f:expr, $b:expr, $fmt:expr, $n:expr) => {
        DraftEntry {
            target: $t,
            draft: $d,
            family: $f,
            block_size: $b,
            format: $fmt,
            arch: DraftArch::DFlash,
            note: $n,
        }
    };
    ($t:expr, $d:expr, $f:expr, $b:expr, $fmt:expr, $arch:expr, $n:expr) => {
        DraftEntry {
            target: $t,
            draft: $d,
            family: $f,
            block_size: $b,
            format: $fmt,
            arch: $arch,
            note: $n,
        }
    };
}

/// The 16 target/draft pairs of the seed's registry, then the published DFlash2 drafts.
pub const DRAFT_REGISTRY: &[DraftEntry] = &[
    row!("Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash", "qwen3_5", Some(16)),
    row!("Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash", "qwen3_5", Some(16)),
    row!(
        "Qwen3.5-27B",
        "z-lab/Qwen3.5-27B-DFlash",
        "qwen3_5",
        Some(16)
    ),
    row!(
        "Qwen3.5-35B-A3B",
        "z-lab/Qwen3.5-35B-A3B-DFlash",
        "qwen3_5_moe",
        Some(16)
    ),
    row!(
        "Qwen3.5-122B-A10B",
        "z-lab/Qwen3.5-122B-A10B-DFlash",
        "qwen3_5_moe",
        Some(16)
    ),
    row!(
        "Qwen3.6-27B",
        "z-lab/Qwen3.6-27B-DFlash",
        "qwen3_5",
        Some(16),
        DraftFormat::ZLab,
        "gated repo: accept the license and set HF_TOKEN"
    ),
    row!(
        "Qwen3.6-35B-A3B",
        "z-lab/Qwen3.6-35B-A3B-DFlash",
        "qwen3_5_moe",
        Some(16)
    ),
    row!("Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "qwen3", Some(16)),
    row!("Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "qwen3", Some(16)),
    row!(
        "Qwen3-Coder-30B-A3B",
        "z-lab/Qwen3-Coder-30B-A3B-DFlash",
        "qwen3_moe",
        Some(16)
    ),
    row!(
        "Qwen3-Coder-Next",
        "z-lab/Qwen3-Coder-Next-DFlash",
        "qwen3_next",
        Some(16)
    ),
    row!(
        "Kimi-K2.5",
        "z-lab/Kimi-K2.5-DFlash",
        "kimi_k25",
        Some(8),
        DraftFormat::ZLab,
        "int4 experts (compressed-tensors) load, kept as stored on CUDA; ~0.6 TB: beyond one GPU"
    ),
    row!(
        "Llama-3.1-8B-Instruct",
        "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        "llama",
        None
    ),
    row!(
        "gpt-oss-20b",
        "z-lab/gpt-oss-20b-DFlash",
        "gpt_oss",
        Some(8)
    ),
    // The published draft config says block_size 10 (taps [1,9,17,25,33] over 36 layers).
    row!(
        "gpt-oss-120b",
        "z-lab/gpt-oss-120b-DFlash",
        "gpt_oss",
        Some(10)
    ),
    row!(
        "Gemma-4-31B-it",
        "RedHatAI/gemma-4-31B-it-speculator.dflash",
        "gemma4",
        None,
        DraftFormat::Speculators,
        "speculators format (narrow draft vocab, d2t/t2d)"
    ),
    // DFlash2 (z-lab, 2026-10): config.json as quoted in public tests: block 8, 5 sliding
    // (2048, non-causal) layers over taps [5,19,33,47,61] of 64, kernel 2, group 16, rank 256,
    // top-16. The target's own config was not seen: its shapes (5120 wide, 64 layers, 16
    // attention layers with 4 KV heads of 256, vocab 248320) match Qwen3.5-27B, whose family is
    // assumed.
    row!(
        "Qwen3.8-27B",
        "z-lab/Qwen3.8-27B-DFlash2",
        "qwen3_5",
        Some(8),
        DraftFormat::ZLab,
        DraftArch::DFlash2,
        "target architecture assumed Qwen3.5's (shapes match; config not seen)"
    ),
];

/// Rows of the seed's registry (the first 16 of [`DRAFT_REGISTRY`]).
pub const SEED_ROWS: usize = 16;

/// The published target `config.json` of a registry row, reduced to the fields that size it
/// (for `dflash models`' memory figures; see [`crate::archs::footprint`]). None for rows whose
/// shapes are not recorded here.
pub fn published_target_config(target: &str) -> Option<serde_json::Value> {
    use serde_json::json;
    let qwen3 = |h: u64, i: u64, tied: bool| {
        json!({"model_type": "qwen3", "hidden_size": h, "intermediate_size": i, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": tied, "torch_dtype": "bfloat16"})
    };
    let gpt_oss = |layers: u64, experts: u64| {
        json!({"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "vocab_size": 201088, "num_local_experts": experts, "num_experts_per_tok": 4,
            "attention_bias": true, "sliding_window": 128, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "mxfp4"}})
    };
    // Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`): the published `layer_types` list is three
    // Gated DeltaNet layers, then one gated-attention layer (`full_attention_interval` 4).
    let hybrid_layer_types = |n: u64| -> Vec<&'static str> {
        (0..n)
            .map(|i| {
                if (i + 1) % 4 == 0 {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect()
    };
    // Text model only: the published checkpoints also hold a 27-block vision tower (depth 27,
    // width 1152, ~0.45 G parameters) and one MTP layer (`mtp.*`), both in bf16. Shared by all
    // Qwen3.5 / 3.6 rows (transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig; the model cards'
    // "Model Overview"): head_dim 256, 16 QK linear heads of 128, conv kernel 4, rotary 0.25.
    let qwen3_5_text = |layers: u64, heads: u64, kv: u64, v_heads: u64, tied: bool| {
        json!({"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 256, "vocab_size": 248320, "tie_word_embeddings": tied,
            "full_attention_interval": 4, "layer_types": hybrid_layer_types(layers),
            "attn_output_gate": true, "partial_rotary_factor": 0.25,
            "linear_num_key_heads": 16, "linear_num_value_heads": v_heads, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
            "dtype": "bfloat16"})
    };
    let qwen3_5 = |h: u64, i: u64, layers: u64, heads: u64, v_heads: u64, tied: bool| {
        let mut t = qwen3_5_text(layers, heads, 4, v_heads, tied);
        t["model_type"] = json!("qwen3_5_text");
        t["hidden_size"] = json!(h);
        t["intermediate_size"] = json!(i);
        json!({"model_type": "qwen3_5", "tie_word_embeddings": tied, "text_config": t})
    };
    // Every layer is MoE (256 experts, 8 routed + 1 shared); the published MoE text_config has no
    // dense `intermediate_size` (not confirmed for 122B-A10B: it sizes nothing either way).
    let qwen3_5_moe = |h: u64, layers: u64, heads: u64, v_heads: u64, moe_i: u64| {
        let mut t = qwen3_5_text(layers, heads, 2, v_heads, false);
        t["model_type"] = json!("qwen3_5_moe_text");
        t["hidden_size"] = json!(h);
        t["num_experts"] = json!(256);
        t["num_experts_per_tok"] = json!(8);
        t["moe_intermediate_size"] = json!(moe_i);
        t["shared_expert_intermediate_size"] = json!(moe_i);
        json!({"model_type": "qwen3_5_moe", "tie_word_embeddings": false, "text_config": t})
    };
    Some(match target {
        "Qwen3-4B" => qwen3(2560, 9728, true),
        "Qwen3-8B" => qwen3(4096, 12288, false),
        "Qwen3-Coder-30B-A3B" => json!({"model_type": "qwen3_moe", "hidden_size": 2048,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16"}),
        "Llama-3.1-8B-Instruct" => json!({"model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16"}),
        "gpt-oss-20b" => gpt_oss(24, 32),
        "gpt-oss-120b" => gpt_oss(36, 128),
        // text model only (the vision tower adds about 0.4 G parameters); routed experts are
        // int4 (compressed-tensors pack-quantized, group 32) in the published checkpoint
        "Kimi-K2.5" => json!({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2",
            "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
            "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 1, "topk_group": 1,
            "vocab_size": 163840, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32,
                    "type": "int", "symmetric": true, "strategy": "group"}}}}}}),
        // Qwen/Qwen3.5-4B: 2560 / 9216 / 32 layers, 16 Q + 4 KV heads, 32 V linear heads, tied
        // (model card overview; full text_config copy in a third-party test fixture; the
        // Qwen3_5TextConfig docstring). No copy of the official config.json itself was found.
        "Qwen3.5-4B" => qwen3_5(2560, 9216, 32, 16, 32, true),
        // Qwen/Qwen3.5-9B: equals transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B style").
        // tie_word_embeddings false: not seen in a config copy; inferred from the 19.3 GB bf16
        // checkpoint (tied would be ~17.3 GB) and the class default.
        "Qwen3.5-9B" => qwen3_5(4096, 12288, 32, 16, 32, false),
        // Qwen/Qwen3.5-27B (NVIDIA-NeMo/Megatron-Bridge tests/unit_tests/models/qwen_vl/
        // test_qwen35_vl_bridge.py; THUDM/slime scripts/models/qwen3.5-27B.sh; model card)
        "Qwen3.5-27B" => qwen3_5(5120, 17408, 64, 24, 48, false),
        // Qwen/Qwen3.5-35B-A3B (THUDM/slime scripts/models/qwen3.5-35B-A3B.sh; transformers'
        // Qwen3_5MoeTextConfig defaults, docstring checkpoint Qwen/Qwen3.5-35B-A3B)
        "Qwen3.5-35B-A3B" => qwen3_5_moe(2048, 40, 16, 32, 512),
        // Qwen/Qwen3.5-122B-A10B: 3072 / 48 layers, 32 Q + 2 KV heads, 64 V linear heads, expert
        // and shared-expert width 1024 (model card; third-party configs). No copy of the official
        // config.json found; the shapes reproduce its published 250.17 GB bf16 checkpoint exactly.
        "Qwen3.5-122B-A10B" => qwen3_5_moe(3072, 48, 32, 64, 1024),
        // Qwen3.6 checkpoints keep the Qwen3.5 architecture and model_type (transformers docs);
        // Qwen/Qwen3.6-27B's card gives the same shape as Qwen3.5-27B, and its
        // model.safetensors.index.json total_size is 55.56 GB.
        "Qwen3.6-27B" => qwen3_5(5120, 17408, 64, 24, 48, false),
        // Qwen/Qwen3.8-27B: not seen; public notes give 27.8 B params, 64 text layers, 16
        // attention layers with 4 KV heads of 256, and its DFlash2 draft says 5120 wide with
        // vocab 248320: Qwen3.5-27B's shape (assumed, with its family).
        "Qwen3.8-27B" => qwen3_5(5120, 17408, 64, 24, 48, false),
        // Qwen/Qwen3.6-35B-A3B: same topology as Qwen3.5-35B-A3B (its model card; THUDM/slime
        // scripts/models/qwen36-35B-A3B.sh sources the 3.5 script)
        "Qwen3.6-35B-A3B" => qwen3_5_moe(2048, 40, 16, 32, 512),
        // Qwen/Qwen3-Coder-Next, built on Qwen3-Next-80B-A3B: card gives 80B total / 3B active,
        // 2048 / 48 layers, 16 Q + 2 KV heads of 256, 32 V + 16 QK linear heads of 128, 512
        // experts (10 routed + 1 shared) of 512. The fields the card does not state are
        // Qwen3-Next-80B-A3B's config (NVIDIA-NeMo/Megatron-Bridge tests/unit_tests/models/
        // qwen/test_qwen3_next_bridge.py fixture); not confirmed for the Coder checkpoint itself.
        // Text only; the checkpoint also carries one MTP layer (`mtp.*`).
        "Qwen3-Coder-Next" => json!({"model_type": "qwen3_next", "hidden_size": 2048,
            // unconfirmed for Coder-Next (Qwen3-Next-80B-A3B's value); unused, every layer is MoE
            "intermediate_size": 5120,
            "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256,
            "vocab_size": 151936, // Qwen3-Next-80B-A3B's; not seen in a Coder-Next config copy
            "tie_word_embeddings": false, "full_attention_interval": 4, "partial_rotary_factor": 0.25,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
            "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": true,
            "torch_dtype": "bfloat16"}), // bf16 confirmed; the key's spelling (vs `dtype`) is not
        // google/gemma-4-31B-it, text model only (the ~550 M vision encoder, 27 blocks, is not
        // recorded). Card: 30.7 B parameters, 60 layers, sliding window 1024, 262K vocab; the
        // attention shapes (16 sliding KV heads of 256, 4 global KV heads of 512 with K = V) from
        // THUDM/slime scripts/models/gemma4-31B.sh and several third-party copies of the
        // text_config. 5 sliding layers then 1 full, the last layer full.
        "Gemma-4-31B-it" => {
            let layer_types: Vec<&str> = (0..60)
                .map(|i| {
                    if (i + 1) % 6 == 0 {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    }
                })
                .collect();
            json!({"model_type": "gemma4", "tie_word_embeddings": true, "text_config": {
                "model_type": "gemma4_text", "hidden_size": 5376, "intermediate_size": 21504,
                "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 16,
                "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
                "attention_k_eq_v": true, "sliding_window": 1024, "layer_types": layer_types,
                "num_kv_shared_layers": 0,
                // no per-layer embeddings; copies disagree on 0 vs null (both mean none)
                "hidden_size_per_layer_input": 0,
                "vocab_size_per_layer_input": 262144, "enable_moe_block": false,
                "use_double_wide_mlp": false, "final_logit_softcapping": 30.0,
                "vocab_size": 262144, "tie_word_embeddings": true, "dtype": "bfloat16"}})
        }
        _ => return None,
    })
}

/// The name part of a target reference: the last path component, lowercased, without a
/// `meta-` prefix.
pub fn normalize_target_name(spec: &str) -> String {
    let base = spec
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(spec);
    let base = base.split('@').next().unwrap_or(base).to_lowercase();
    base.strip_prefix("meta-").map(String::from).unwrap_or(base)
}

/// The registry row for a target reference (`Org/Name`, a path, or a name), if any.
pub fn resolve_draft(target: &str) -> Option<&'static DraftEntry> {
    let name = normalize_target_name(target);
    if let Some(e) = DRAFT_REGISTRY
        .iter()
        .find(|e| e.target.to_lowercase() == name)
    {
        return Some(e);
    }
    DRAFT_REGISTRY
        .iter()
        .filter(|e| {
            let k = e.target.to_lowercase();
            name.len() > k.len()
                && name.starts_with(&k)
                && matches!(name.as_bytes()[k.len()], b'-' | b'_')
        })
        .max_by_key(|e| e.target.len())
}

/// Whether this build can load the entry's target family.
pub fn family_supported(family: &str) -> bool {
    FAMILIES.iter().any(|f| f.model_types.contains(&family))
}

/// The supported targets, for an error message.
pub fn registry_targets() -> String {
    DRAFT_REGISTRY
        .iter()
        .map(|e| e.target)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_seed_rows_then_dflash2_rows_with_unique_keys() {
        assert_eq!(DRAFT_REGISTRY.len(), SEED_ROWS + 1);
        assert!(DRAFT_REGISTRY[..SEED_ROWS]
            .iter()
            .all(|e| e.arch == DraftArch::DFlash));
        assert!(DRAFT_REGISTRY[SEED_ROWS..]
            .iter()
            .all(|e| e.arch == DraftArch::DFlash2 && e.block_size.is_some()));
        let mut keys: Vec<String> = DRAFT_REGISTRY
            .iter()
            .map(|e| e.target.to_lowercase())
            .collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), DRAFT_REGISTRY.len());
    }

    #[test]
    fn resolution_table() {
        let cases: &[(&str, Option<&str>)] = &[
            ("Qwen/Qwen3.5-4B", Some("z-lab/Qwen3.5-4B-DFlash")),
            ("Qwen/Qwen3.5-9B", Some("z-lab/Qwen3.5-9B-DFlash")),
            ("Qwen/Qwen3.5-27B", Some("z-lab/Qwen3.5-27B-DFlash")),
            ("Qwen/Qwen3.5-35B-A3B", Some("z-lab/Qwen3.5-35B-A3B-DFlash")),
            (
                "Qwen/Qwen3.5-122B-A10B",
                Some("z-lab/Qwen3.5-122B-A10B-DFlash"),
            ),
            ("Qwen/Qwen3.6-27B", Some("z-lab/Qwen3.6-27B-DFlash")),
            ("Qwen/Qwen3.8-27B", Some("z-lab/Qwen3.8-27B-DFlash2")),
            (
                "mlx-community/Qwen3.8-27B-4bit",
                Some("z-lab/Qwen3.8-27B-DFlash2"),
            ),
            ("Qwen/Qwen3.6-35B-A3B", Some("z-lab/Qwen3.6-35B-A3B-DFlash")),
            ("Qwen/Qwen3-4B", Some("z-lab/Qwen3-4B-DFlash-b16")),
            ("Qwen/Qwen3-8B", Some("z-lab/Qwen3-8B-DFlash-b16")),
            (
                "Qwen/Qwen3-Coder-30B-A3B-Instruct",
                Some("z-lab/Qwen3-Coder-30B-A3B-DFlash"),
            ),
            (
                "Qwen/Qwen3-Coder-Next",
                Some("z-lab/Qwen3-Coder-Next-DFlash"),
            ),
            ("moonshotai/Kimi-K2.5", Some("z-lab/Kimi-K2.5-DFlash")),
            (
                "meta-llama/Llama-3.1-8B-Instruct",
                Some("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
            ),
            ("openai/gpt-oss-20b", Some("z-lab/gpt-oss-20b-DFlash")),
            ("openai/gpt-oss-120b", Some("z-lab/gpt-oss-120b-DFlash")),
            (
                "google/gemma-4-31B-it",
                Some("RedHatAI/gemma-4-31B-it-speculator.dflash"),
            ),
            // tricky names
            (
                "mlx-community/Qwen3.6-35B-A3B-4bit",
                Some("z-lab/Qwen3.6-35B-A3B-DFlash"),
            ),
            (
                "meta-llama/Meta-Llama-3.1-8B-Instruct",
                Some("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
            ),
            ("unsloth/Qwen3-8B-GGUF", Some("z-lab/Qwen3-8B-DFlash-b16")),
            ("/models/qwen3-4b_awq/", Some("z-lab/Qwen3-4B-DFlash-b16")),
            ("Qwen/Qwen3-8B@main", Some("z-lab/Qwen3-8B-DFlash-b16")),
            // the longest key wins: Qwen3.5-35B-A3B is not Qwen3.5-3...
            (
                "mlx-community/Qwen3.5-35B-A3B-8bit",
                Some("z-lab/Qwen3.5-35B-A3B-DFlash"),
            ),
            // no match: no substring guessing
            ("Qwen/Qwen3-80B", None),
            ("Qwen/Qwen3-8Bx", None),
            ("HuggingFaceTB/SmolLM2-135M-Instruct", None),
            ("my-Qwen3-8B", None),
        ];
        for (name, want) in cases {
            assert_eq!(resolve_draft(name).map(|e| e.draft), *want, "{name}");
        }
    }
}
