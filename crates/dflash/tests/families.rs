//! Every family end to end on the CPU on small random models with their drafts
//! (`DFLASH_FAMILY_MODELS`: made by `tools/gpu-bench/families.py build --small`; skipped when
//! unset, as in CI): greedy DFlash equals plain decoding with the family's draft, block sizes 2,
//! 8 and 16. (Bit-for-bit verify == decode needs row-invariant products: the quantized CPU
//! path has them, candle's f32 GEMM does not; `tests/fused_cuda.rs` checks it on the GPU.)

mod common;

use dflash::archs::{load_target, LoadOptions};
use dflash::draft::load_draft;
use dflash::engine::Engine;
use dflash::source::ModelSource;

#[test]
fn every_family_on_small_models() {
    let Some(dirs) = common::family_models() else {
        eprintln!("DFLASH_FAMILY_MODELS not set; skipped");
        return;
    };
    let opts = LoadOptions::default();
    let only = std::env::var("FAMILY").ok();
    for dir in &dirs {
        if only.as_deref().is_some_and(|f| !dir.ends_with(f)) {
            continue;
        }
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let tsrc = ModelSource::from_dir("t", &dir.join("target")).unwrap();
        let (cfg, target) = load_target(&tsrc, &opts).unwrap();
        let vocab = target.info().vocab_size.min(1000);
        let dsrc = ModelSource::from_dir("d", &dir.join("draft")).unwrap();
        let draft = load_draft(&dsrc, &cfg, "t", &opts).unwrap();
        let engine = Engine::new(target, Some(draft));
        let n = common::assert_greedy_dflash_equals_plain(&engine, vocab, &[2, 8, 16], &name);
        eprintln!("ok {name}: {n} generations greedy DFlash == plain");
    }
}
