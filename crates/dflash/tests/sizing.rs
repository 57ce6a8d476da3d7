//! Sizing is the family's: the weights a loaded model reports (what `doctor` prints) match the
//! checkpoint, and the cache its plan describes (what the memory plan and `dflash models` use)
//! is the cache `new_cache` builds, for every family's fixture.

mod common;

use dflash::archs::family_for;
use dflash::source::weights::read_safetensors_header;
use std::path::Path;

fn fixtures() -> Vec<std::path::PathBuf> {
    let root = common::fixture("");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("model.safetensors").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// Values the checkpoint's language model holds (the vision towers and projectors of the
/// multimodal layouts are not loaded): f32 tensors (the fixtures' float dtype), MXFP4 packs
/// counted as the values they unpack to (two per `*_blocks` byte; the `*_scales` bytes are
/// not values). Loaded in f32 on the CPU, each takes 4 bytes.
fn checkpoint_values(dir: &Path) -> u64 {
    let not_text = [
        "vision",
        "visual",
        "mm_projector",
        "multi_modal_projector",
        "mtp.",
    ];
    read_safetensors_header(&dir.join("model.safetensors"))
        .unwrap()
        .iter()
        .filter(|t| !not_text.iter().any(|x| t.name.contains(x)))
        .map(|t| {
            if t.name.ends_with("_blocks") {
                2 * t.bytes
            } else if t.name.ends_with("_scales") {
                0
            } else {
                assert_eq!(t.dtype, "F32", "{}", t.name);
                t.bytes / 4
            }
        })
        .sum()
}

#[test]
fn loaded_weights_match_the_checkpoint_for_every_family() {
    let dirs = fixtures();
    let mut families = std::collections::BTreeSet::new();
    for dir in &dirs {
        let m = common::load(dir);
        let info = m.info();
        families.insert(info.family);
        let want = 4.0 * checkpoint_values(dir) as f64;
        let got = info.weight_bytes as f64;
        assert!(
            (got - want).abs() / want <= 0.02,
            "{}: {} reports {got} bytes of weights, the checkpoint holds {want}",
            dir.display(),
            info.family
        );
    }
    // every family that has a golden fixture was checked
    for f in [
        "qwen3",
        "llama",
        "qwen3_moe",
        "gemma3",
        "gemma4",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "gpt_oss",
        "deepseek_v3",
    ] {
        assert!(families.contains(f), "no fixture of family {f}");
    }
}

#[test]
fn planned_cache_is_the_cache_every_family_builds() {
    for dir in fixtures() {
        let src = dflash::source::ModelSource::from_dir("t", &dir).unwrap();
        let cfg = src.target_config().unwrap();
        let plan = (family_for(&cfg).unwrap().plan)(&cfg).unwrap();
        let m = common::load(&dir);
        let dt = m.info().dtype;
        let (per_token, fixed) = (plan.cache_bytes_per_token(dt), plan.cache_fixed_bytes(dt));
        for cap in [16usize, 48] {
            let c = m.new_cache(cap).unwrap();
            assert_eq!(c.layers.len(), plan.caches.len(), "{}", dir.display());
            assert_eq!(
                c.bytes() as u64,
                per_token * cap as u64 + fixed,
                "{}: cache of {cap} positions",
                dir.display()
            );
        }
        // the plan's parameter count is the checkpoint's
        let params = plan.params.total() as f64;
        let want = checkpoint_values(&dir) as f64;
        assert!(
            (params - want).abs() / want <= 0.02,
            "{}: plan counts {params} parameters, the checkpoint holds {want}",
            dir.display()
        );
    }
}
