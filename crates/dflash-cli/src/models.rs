//! `dflash models`: the draft registry and the target families this build supports.

use anyhow::Result;
use dflash::archs::FAMILIES;
use dflash::registry::{family_supported, DraftFormat, DRAFT_REGISTRY};

pub fn run(json: bool) -> Result<()> {
    if json {
        let rows: Vec<serde_json::Value> = DRAFT_REGISTRY
            .iter()
            .map(|e| {
                serde_json::json!({
                    "target": e.target, "draft": e.draft, "family": e.family,
                    "block_size": e.block_size,
                    "format": match e.format { DraftFormat::ZLab => "z-lab", DraftFormat::Speculators => "speculators" },
                    "supported": family_supported(e.family), "note": e.note,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<22} {:<46} {:<12} {:<6} {:<12} supported",
        "target", "draft", "family", "block", "format"
    );
    for e in DRAFT_REGISTRY {
        let supported = if family_supported(e.family) {
            "yes".to_string()
        } else {
            format!("no: target family `{}` is not in this build", e.family)
        };
        println!(
            "{:<22} {:<46} {:<12} {:<6} {:<12} {}",
            e.target,
            e.draft,
            e.family,
            e.block_size.map_or("config".into(), |b| b.to_string()),
            match e.format {
                DraftFormat::ZLab => "z-lab",
                DraftFormat::Speculators => "speculators",
            },
            supported
        );
    }
    println!("\nfamily capabilities (taps, KV truncate, recurrent rollback, sliding window, shared KV, MoE, GGUF):");
    for f in FAMILIES {
        let c = f.caps;
        let b = |x: bool| if x { "yes" } else { "-" };
        println!(
            "  {:<10} {:<28} taps {} truncate {} rollback {} sliding {} shared-kv {} moe {} gguf {}",
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
