//! How much memory a checkpoint needs, from its config's shapes alone (nothing is read but
//! `config.json`): the parameter count and cache kinds from the family's plan, the bytes of the
//! checkpoint as published (bf16, or MXFP4 / int4 experts where its `quantization_config`
//! says so) and the bytes this engine holds once loaded (every weight in the compute dtype,
//! or, on CUDA, MXFP4 and 4-bit integer experts as stored).
//!
//! `dflash models` prints these for the registry rows (from the published configs in
//! `registry::published_target_config`) next to this machine's memory.

use crate::config::TargetConfig;
use crate::Result;

/// Memory needs of one target checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Footprint {
    pub params: u64,
    /// Bytes of the weights as published; None when the quantization is not one we can size.
    pub stored_bytes: Option<u64>,
    /// Bytes of the loaded weights with bf16 compute (f32 compute, the CPU default: twice).
    pub loaded_bytes_bf16: u64,
    /// Bytes dflash holds on CUDA with bf16 compute for the checkpoint as published: MXFP4
    /// experts (gpt-oss) stay as stored (`nn::mxfp4`), 4-bit integer experts (Kimi-K2.5) too
    /// with a bf16 bias beside each scale (`source::intq`), everything else as
    /// `loaded_bytes_bf16`.
    pub cuda_held_as_published: u64,
    /// Target cache bytes per token of context with bf16 compute (the KV rows of attention
    /// layers, the latent row of MLA layers; recurrent layers add none).
    pub cache_bytes_per_token_bf16: u64,
    /// Cache bytes that do not grow with the context (recurrent state of the hybrids).
    pub cache_fixed_bytes_bf16: u64,
    /// Routed-expert parameters (part of `params`).
    pub expert_params: u64,
    /// Of those, the ones a 4-bit affine checkpoint keeps as stored on CUDA (widths the
    /// affine MoE kernels take); the rest are dequantized to bf16 at load.
    pub affine_expert_params: u64,
    /// The token embedding table's parameters (part of `params`).
    pub embedding_params: u64,
    /// An untied LM head's parameters (part of `params`; 0 when tied to the embedding).
    pub head_params: u64,
}

/// A quantized checkpoint's storage as dflash keeps it on CUDA with bf16 compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaStorage {
    /// 4-bit affine (MLX 4-bit; GGUF Q4_0 / Q4_1 / Q4_K rewritten at load): a scale and bias
    /// per 32 weights, 5 bits a weight.
    Affine4,
    /// 8-bit affine (MLX 8-bit; GGUF Q8_0 / Q5_*): 9 bits a weight.
    Affine8,
    /// FP8 e4m3 with a scale per 128x128 block: a byte a weight.
    Fp8,
}

impl Footprint {
    /// Bytes of weights dflash holds on CUDA (bf16 compute) for a checkpoint of `storage`: the
    /// linear layers' matrices as stored; the routed experts as stored at 4 bits where the
    /// affine MoE kernels take their widths (MLX 4-bit `switch_mlp` stacks), else as bf16
    /// (dequantized at load); the embedding table as bf16; the LM head as stored for the
    /// affine formats (MLX quantizes it) and bf16 for FP8 (the published FP8 checkpoints keep
    /// it so). Norms and biases are counted with the linear layers.
    pub fn cuda_held_bytes(&self, storage: CudaStorage) -> u64 {
        let linear = self
            .params
            .saturating_sub(self.expert_params + self.embedding_params + self.head_params);
        let bf16 = 2 * (self.expert_params + self.embedding_params);
        match storage {
            CudaStorage::Affine4 => {
                (linear + self.head_params + self.affine_expert_params) * 5 / 8 + bf16
                    - 2 * self.affine_expert_params
            }
            CudaStorage::Affine8 => (linear + self.head_params) * 9 / 8 + bf16,
            CudaStorage::Fp8 => linear + 2 * self.head_params + bf16,
        }
    }
}

/// How the checkpoint stores routed-expert matrices, in bytes per value.
fn expert_bytes_per_value(cfg: &TargetConfig, float_bytes: f64) -> Result<Option<f64>> {
    let Some(q) = cfg.quantization()? else {
        return Ok(Some(float_bytes));
    };
    Ok(match q.opt_str("quant_method")? {
        // 16 bytes of e2m1 pairs + 1 scale byte per 32 values
        Some("mxfp4") => Some(17.0 / 32.0),
        // pack-quantized int groups with a bf16 scale per group (Kimi-K2.5: 4 bits, 32)
        Some("compressed-tensors") => {
            int_expert_scheme(cfg)?.map(|(bits, group)| bits as f64 / 8.0 + 2.0 / group as f64)
        }
        _ => None,
    })
}

/// The (bits, group size) of a compressed-tensors checkpoint's integer weights (the last
/// config group that names them); None for other checkpoints.
fn int_expert_scheme(cfg: &TargetConfig) -> Result<Option<(usize, usize)>> {
    let Some(q) = cfg.quantization()? else {
        return Ok(None);
    };
    if q.opt_str("quant_method")? != Some("compressed-tensors") {
        return Ok(None);
    }
    let mut found = None;
    if let Some(groups) = q.sub("config_groups")? {
        for name in groups.obj.keys() {
            if let Some(wt) = groups
                .sub(name)?
                .and_then(|g| g.sub("weights").ok().flatten())
            {
                let bits = wt.opt_usize("num_bits")?.unwrap_or(4);
                let group = wt.opt_usize("group_size")?.unwrap_or(32).max(1);
                found = Some((bits, group));
            }
        }
    }
    Ok(found)
}

fn float_bytes(cfg: &TargetConfig) -> f64 {
    match cfg.dtype.as_deref() {
        Some("float32") => 4.0,
        _ => 2.0,
    }
}

/// The footprint of a target from its config: its family's plan (`archs::Family::plan`).
/// None for a `model_type` this build has no family for.
pub fn estimate(cfg: &TargetConfig) -> Result<Option<Footprint>> {
    let Some(fam) = super::FAMILIES
        .iter()
        .find(|f| f.model_types.contains(&cfg.model_type.as_str()))
    else {
        return Ok(None);
    };
    let plan = (fam.plan)(cfg)?;
    let fb = float_bytes(cfg);
    let c = plan.params;
    let stored = expert_bytes_per_value(cfg, fb)?
        .map(|eb| (c.plain as f64 * fb + c.experts as f64 * eb).round() as u64);
    let mxfp4 = match cfg.quantization()? {
        Some(q) => q.opt_str("quant_method")? == Some("mxfp4"),
        None => false,
    };
    let mx_held = (c.plain as f64 * 2.0 + c.experts as f64 * 17.0 / 32.0).round() as u64;
    // 4-bit integer experts stay as stored on CUDA (source/intq.rs -> the affine MoE kernels):
    // the packed values, a bf16 scale and a bf16 bias per group
    let int4_held = match int_expert_scheme(cfg)? {
        Some((4, group)) => Some(
            (c.plain as f64 * 2.0 + c.experts as f64 * (0.5 + 4.0 / group as f64)).round() as u64,
        ),
        _ => None,
    };
    Ok(Some(Footprint {
        params: c.total(),
        stored_bytes: stored,
        loaded_bytes_bf16: 2 * c.total(),
        cuda_held_as_published: match (mxfp4, int4_held) {
            (true, _) => mx_held,
            (false, Some(b)) => b,
            _ => 2 * c.total(),
        },
        cache_bytes_per_token_bf16: plan.cache_bytes_per_token(candle_core::DType::BF16),
        cache_fixed_bytes_bf16: plan.cache_fixed_bytes(candle_core::DType::BF16),
        expert_params: c.experts,
        affine_expert_params: c.affine_experts,
        embedding_params: (cfg.vocab_size * cfg.hidden_size) as u64,
        head_params: if cfg.tie_word_embeddings {
            0
        } else {
            (cfg.vocab_size * cfg.hidden_size) as u64
        },
    }))
}

/// This machine's memory from /proc/meminfo: (total, available) bytes; None elsewhere.
pub fn host_memory() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        s.lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse::<u64>()
            .ok()
            .map(|kb| kb * 1024)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}

/// `12.3 GB` (decimal units, as model cards state sizes).
pub fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e12 {
        format!("{:.2} TB", b / 1e12)
    } else if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else {
        format!("{:.0} MB", b / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{published_target_config, DRAFT_REGISTRY};

    fn of(target: &str) -> Footprint {
        let v = published_target_config(target).unwrap();
        estimate(&TargetConfig::from_value("c", v).unwrap())
            .unwrap()
            .unwrap()
    }

    fn near(x: u64, want: f64, rel: f64) -> bool {
        ((x as f64 - want) / want).abs() < rel
    }

    /// Parameter counts and checkpoint sizes as the model cards / hub repos state them.
    #[test]
    fn published_sizes() {
        let cases: &[(&str, f64, Option<f64>)] = &[
            ("Qwen3-4B", 4.02e9, Some(8.05e9)),
            ("Qwen3-8B", 8.19e9, Some(16.4e9)),
            ("Qwen3-Coder-30B-A3B", 30.5e9, Some(61.1e9)),
            ("Llama-3.1-8B-Instruct", 8.03e9, Some(16.1e9)),
            ("gpt-oss-20b", 20.9e9, Some(13.8e9)),
            ("gpt-oss-120b", 116.8e9, Some(65.3e9)),
            // moonshotai/Kimi-K2.5: 554.3 GiB on the hub, vision tower included
            ("Kimi-K2.5", 1.03e12, Some(554.3 * 1.073_741_824e9)),
            // Text models only (the model cards' totals add the vision tower and the MTP
            // layer): counts from the published shapes, worked out independently of this code
            // (a script over the same configs); cards say 4B, 9B, 27B, 35B, 122B, 80B, 30.7B.
            ("Qwen3.5-4B", 4.21e9, None),
            ("Qwen3.5-9B", 8.95e9, None),
            ("Qwen3.5-27B", 26.90e9, None),
            ("Qwen3.6-27B", 26.90e9, None),
            ("Qwen3.5-35B-A3B", 34.66e9, None),
            ("Qwen3.6-35B-A3B", 34.66e9, None),
            ("Qwen3.5-122B-A10B", 122.11e9, None),
            ("Qwen3-Coder-Next", 79.67e9, None),
            ("Gemma-4-31B-it", 30.70e9, None),
        ];
        for &(t, params, stored) in cases {
            let f = of(t);
            assert!(near(f.params, params, 0.01), "{t}: {} params", f.params);
            assert_eq!(f.loaded_bytes_bf16, 2 * f.params);
            if let Some(s) = stored {
                assert!(
                    near(f.stored_bytes.unwrap(), s, 0.01),
                    "{t}: {:?}",
                    f.stored_bytes
                );
            }
        }
        // MLA caches a 576-wide row per layer: 61 * 576 * 2 bytes per token
        assert_eq!(of("Kimi-K2.5").cache_bytes_per_token_bf16, 61 * 576 * 2);
        assert_eq!(
            of("gpt-oss-20b").cache_bytes_per_token_bf16,
            24 * 2 * 8 * 64 * 2
        );
        // hybrids: only the attention layers grow with the context (Qwen3.5-9B: 8 of 32
        // layers, 4 KV heads of 256); the DeltaNet layers hold a fixed state (24 layers of
        // 32 x 128 x 128 f32 plus a 3-row conv window of 8192 channels in bf16)
        let q9 = of("Qwen3.5-9B");
        assert_eq!(q9.cache_bytes_per_token_bf16, 8 * 2 * 4 * 256 * 2);
        assert_eq!(
            q9.cache_fixed_bytes_bf16,
            24 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
        );
        // held on CUDA: Qwen3-8B (dense, untied head of 151,936 x 4,096): the matrices at
        // 5 / 9 / 8 bits, the embedding in bf16, the head as stored (affine) or bf16 (FP8)
        let q8 = of("Qwen3-8B");
        let table = 151_936u64 * 4096;
        assert_eq!(
            (q8.embedding_params, q8.head_params, q8.expert_params),
            (table, table, 0)
        );
        let lin = q8.params - 2 * table;
        assert_eq!(
            q8.cuda_held_bytes(CudaStorage::Affine4),
            (lin + table) * 5 / 8 + 2 * table
        );
        assert_eq!(q8.cuda_held_bytes(CudaStorage::Fp8), lin + 4 * table);
        // MoE: 4-bit experts stay as stored where the affine MoE kernels take their widths, so
        // Qwen3.5-122B-A10B at 4 bits holds ~5 bits a weight: about its checkpoint, one H200;
        // at 8 bits the experts are dequantized to bf16
        let big = of("Qwen3.5-122B-A10B");
        assert!(big.expert_params > 110_000_000_000, "{}", big.expert_params);
        assert_eq!(big.affine_expert_params, big.expert_params);
        let held = big.cuda_held_bytes(CudaStorage::Affine4);
        assert!(held < 80_000_000_000 && held > big.params / 2, "{held}");
        assert!(big.cuda_held_bytes(CudaStorage::Affine8) > 2 * big.expert_params);
        // gpt-oss's experts (2,880 wide) are not taken by the affine MoE kernels
        assert_eq!(of("gpt-oss-20b").affine_expert_params, 0);
        // gpt-oss keeps its MXFP4 experts as stored on CUDA: the 120b holds its checkpoint's
        // ~65 GB there (a bf16 load would be ~234 GB)
        let oss = of("gpt-oss-120b");
        assert_eq!(Some(oss.cuda_held_as_published), oss.stored_bytes);
        assert!(oss.cuda_held_as_published < 70_000_000_000);
        assert_eq!(q8.cuda_held_as_published, q8.loaded_bytes_bf16);
        // Kimi-K2.5's int4 experts stay as stored on CUDA (a bf16 bias beside each scale: 5
        // bits a weight at groups of 32), the rest bf16: ~0.65 TB instead of ~2 TB
        let kimi = of("Kimi-K2.5");
        let rest = kimi.params - kimi.expert_params;
        assert_eq!(
            kimi.cuda_held_as_published,
            rest * 2 + (kimi.expert_params as f64 * 0.625).round() as u64
        );
        assert!(kimi.cuda_held_as_published < kimi.loaded_bytes_bf16 / 3);
        // every row of the registry has a recorded config and is sized
        for e in DRAFT_REGISTRY {
            let v = published_target_config(e.target).unwrap_or_else(|| panic!("{}", e.target));
            let c = TargetConfig::from_value("c", v).unwrap();
            assert!(estimate(&c).unwrap().is_some(), "{}", e.target);
        }
    }
}
