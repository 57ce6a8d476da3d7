//! `dflash models`: the draft registry and the target families this build supports.

use anyhow::Result;
use dflash::archs::footprint::{estimate, host_memory, human_bytes, CudaStorage, Footprint};
use dflash::archs::FAMILIES;
use dflash::config::TargetConfig;
use dflash::registry::{family_supported, published_target_config, DraftEntry, DRAFT_REGISTRY};

/// The memory a row's published target checkpoint needs (None: shapes not recorded).
fn footprint(e: &DraftEntry) -> Option<Footprint> {
    let v = published_target_config(e.target)?;
    let cfg = TargetConfig::from_value(e.target, v).ok()?;
    estimate(&cfg).ok().flatten()
}

/// GPUs a row is sized against: one H200 and a 24 GB desktop card (bytes).
const GPUS: [(&str, u64); 2] = [("H200", 141_000_000_000), ("24 GB", 24_000_000_000)];
/// Context the GPU fit reserves cache for.
const FIT_CONTEXT: u64 = 8192;

/// Weight bytes at ~4.5 bits a weight (GGUF Q4_K_M / MLX 4-bit with group scales).
fn q4_bytes(f: &Footprint) -> u64 {
    f.params * 9 / 16
}

/// Whether weights of `bytes` plus the cache of [`FIT_CONTEXT`] tokens fit `gpu` bytes
/// (5% kept for activations and the runtime).
fn fits(f: &Footprint, bytes: u64, gpu: u64) -> bool {
    bytes + f.cache_fixed_bytes_bf16 + f.cache_bytes_per_token_bf16 * FIT_CONTEXT < gpu / 100 * 95
}

pub fn run(json: bool) -> Result<()> {
    if json {
        let rows: Vec<serde_json::Value> = DRAFT_REGISTRY
            .iter()
            .map(|e| {
                serde_json::json!({
                    "target": e.target, "draft": e.draft, "family": e.family,
                    "block_size": e.block_size,
                    "format": e.format.name(), "arch": e.arch.name(),
                    "supported": family_supported(e.family), "note": e.note,
                    "memory": footprint(e).map(|f| serde_json::json!({
                        "params": f.params, "checkpoint_bytes": f.stored_bytes,
                        "loaded_bytes_bf16": f.loaded_bytes_bf16,
                        "cuda_held_as_published": f.cuda_held_as_published,
                        "loaded_bytes_f32": 2 * f.loaded_bytes_bf16,
                        "cache_bytes_per_token_bf16": f.cache_bytes_per_token_bf16,
                        "fits_in_ram_bf16": host_memory().map(|(total, _)| f.loaded_bytes_bf16 < total),
                        "q4_bytes": q4_bytes(&f),
                        "cuda_held_bytes": {
                            "affine_4bit": f.cuda_held_bytes(CudaStorage::Affine4),
                            "affine_8bit": f.cuda_held_bytes(CudaStorage::Affine8),
                            "fp8": f.cuda_held_bytes(CudaStorage::Fp8),
                        },
                        "gpu_fit": GPUS.iter().map(|(name, b)| serde_json::json!({
                            "gpu": name, "context": FIT_CONTEXT,
                            "bf16": fits(&f, f.loaded_bytes_bf16, *b),
                            "as_published": f.stored_bytes.map(|s| fits(&f, s, *b)),
                            "cuda_as_published": fits(&f, f.cuda_held_as_published, *b),
                            "q4": fits(&f, q4_bytes(&f), *b),
                            "cuda_affine_4bit": fits(&f, f.cuda_held_bytes(CudaStorage::Affine4), *b),
                            "cuda_affine_8bit": fits(&f, f.cuda_held_bytes(CudaStorage::Affine8), *b),
                            "cuda_fp8": fits(&f, f.cuda_held_bytes(CudaStorage::Fp8), *b),
                        })).collect::<Vec<_>>(),
                    })),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<22} {:<46} {:<12} {:<6} {:<20} supported",
        "target", "draft", "family", "block", "format"
    );
    for e in DRAFT_REGISTRY {
        let supported = if family_supported(e.family) {
            if e.note.is_empty() {
                "yes".to_string()
            } else {
                format!("yes ({})", e.note)
            }
        } else {
            format!("no: target family `{}` is not in this build", e.family)
        };
        println!(
            "{:<22} {:<46} {:<12} {:<6} {:<20} {}",
            e.target,
            e.draft,
            e.family,
            e.block_size.map_or("config".into(), |b| b.to_string()),
            format!("{} {}", e.format.name(), e.arch.name()),
            supported
        );
    }
    let host = host_memory();
    println!(
        "\nmemory: published checkpoint -> weights loaded with bf16 compute (f32, the CPU default, doubles it); {}",
        match host {
            Some((total, avail)) => format!(
                "this machine has {} RAM ({} available)",
                human_bytes(total),
                human_bytes(avail)
            ),
            None => "this machine's memory is unknown".into(),
        }
    );
    for e in DRAFT_REGISTRY {
        let Some(f) = footprint(e) else {
            println!(
                "  {:<22} ? (published shapes not recorded in this build)",
                e.target
            );
            continue;
        };
        let params = if f.params >= 1_000_000_000_000 {
            format!("{:.2} T", f.params as f64 / 1e12)
        } else {
            format!("{:.1} B", f.params as f64 / 1e9)
        };
        let fits = match host {
            Some((total, _)) if f.loaded_bytes_bf16 >= total => format!(
                "does not fit: needs {} at bf16, this machine has {}",
                human_bytes(f.loaded_bytes_bf16),
                human_bytes(total)
            ),
            Some(_) => "fits in RAM at bf16".into(),
            None => String::new(),
        };
        let cuda = if f.cuda_held_as_published != f.loaded_bytes_bf16 {
            format!(" (CUDA {})", human_bytes(f.cuda_held_as_published))
        } else {
            String::new()
        };
        println!(
            "  {:<22} {:>7} params  {:>9} -> {:>9}{cuda}  + {} per 1k tokens of context  {}",
            e.target,
            params,
            f.stored_bytes.map_or("?".into(), human_bytes),
            human_bytes(f.loaded_bytes_bf16),
            human_bytes(f.cache_bytes_per_token_bf16 * 1000),
            fits
        );
    }
    println!(
        "\nGPU fit (weights + {FIT_CONTEXT} tokens of cache in 95% of the card): bf16 / as published / a ~4.5-bit checkpoint (Q4_K_M, MLX 4-bit g64: the file) / as dflash holds 4-bit, 8-bit and FP8 checkpoints on CUDA today.\nOn CUDA with bf16, the linear layers stay as stored: GGUF Q4_0/Q4_1/Q4_K/Q8_0/Q5_0/Q5_1/Q5_K matrices become affine weights (a scale and bias per 32: 5 / 9 bits a weight), MLX 4/8-bit stays as stored, FP8 stays e4m3 (its LM head bf16); gpt-oss's MXFP4 experts stay as stored (so the as-published column is what dflash holds for those rows), and so do MLX 4-bit expert stacks whose widths are multiples of 128 (the Qwen MoE rows); the embedding table and the other routed experts (MLX 8-bit, GGUF, FP8, int4) are dequantized to bf16, so those MoE rows need about their bf16 size."
    );
    let yn = |b: bool| if b { "yes" } else { "no" };
    for e in DRAFT_REGISTRY {
        let Some(f) = footprint(e) else { continue };
        let cells: Vec<String> = GPUS
            .iter()
            .map(|(name, b)| {
                format!(
                    "{name}: {} / {} / {} / {} {} {}",
                    yn(fits(&f, f.loaded_bytes_bf16, *b)),
                    f.stored_bytes.map_or("?", |s| yn(fits(&f, s, *b))),
                    yn(fits(&f, q4_bytes(&f), *b)),
                    yn(fits(&f, f.cuda_held_bytes(CudaStorage::Affine4), *b)),
                    yn(fits(&f, f.cuda_held_bytes(CudaStorage::Affine8), *b)),
                    yn(fits(&f, f.cuda_held_bytes(CudaStorage::Fp8), *b))
                )
            })
            .collect();
        println!("  {:<22} {}", e.target, cells.join("   "));
    }
    println!("\nfamily capabilities (taps, KV truncate, recurrent rollback, sliding window, shared KV, MoE, GGUF):");
    for f in FAMILIES {
        let c = f.caps;
        let b = |x: bool| if x { "yes" } else { "-" };
        println!(
            "  {:<12} {:<32} taps {} truncate {} rollback {} sliding {} shared-kv {} moe {} gguf {}",
            f.name,
            f.model_types.join(", "),
            b(c.taps),
            b(c.kv_truncate),
            b(c.recurrent_rollback),
            b(c.sliding_window),
            b(c.shared_kv),
            b(c.moe),
            b(c.gguf)
        );
    }
    let n = DRAFT_REGISTRY
        .iter()
        .filter(|e| family_supported(e.family))
        .count();
    println!(
        "\n{n} of {} rows supported. Target families in this build: {}",
        DRAFT_REGISTRY.len(),
        FAMILIES
            .iter()
            .map(|f| f.model_types.join("/"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
