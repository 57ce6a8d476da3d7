//! config.json of a target and of a draft (z-lab and speculators layouts): bytes -> JSON ->
//! `TargetConfig` / `DraftConfig`, RoPE frequencies, the family loader and the draft loader
//! over small fixed checkpoints (the tests' qwen3_tied_swa_b4 fixture), so that every size a
//! config declares meets the code that allocates from it.
#![no_main]
use dflash::archs::family_for;
use dflash::config::draft::DraftConfig;
use dflash::config::TargetConfig;
use dflash::draft::DraftModel;
use dflash::source::Weights;
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../crates/dflash/tests/fixtures/dflash/qwen3_tied_swa_b4")
        .join(rel)
}

fn weights(rel: &str) -> Weights {
    Weights::open(
        &[fixture(rel)],
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .expect("fixture weights")
}

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(c) = TargetConfig::from_value("config.json", v.clone()) {
        let _ = c.rope.inv_freq(c.head_dim);
        if let Ok(fam) = family_for(&c) {
            let _ = (fam.load)(&c, &weights("target/model.safetensors"));
        }
    }
    if let Ok(d) = DraftConfig::from_value("config.json", v) {
        let _ = d.layers.rope.inv_freq(d.layers.head_dim);
        let target = TargetConfig::from_file(&fixture("target/config.json")).expect("target");
        if let Ok(taps) = d.validate_against(&target, "target") {
            let _ = DraftModel::load(d, taps, &weights("draft/model.safetensors"));
        }
    }
});
