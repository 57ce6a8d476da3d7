//! Write an untrained (random) z-lab DFlash draft that fits a target of the given shape:
//! `cargo run --release --example random_draft -- DIR HIDDEN VOCAB TARGET_LAYERS [DRAFT_LAYERS] [BLOCK]`
//! e.g. for the demo model SmolLM2-135M-Instruct: `DIR 576 49152 30`.
//! Its proposals are essentially never accepted: it measures the cost side of DFlash
//! (a useless draft) and exercises the whole pipeline on a real target.

use dflash::config::draft::default_taps;
use dflash::testing::{TinyDraft, TinyTarget};
use std::path::PathBuf;

fn main() -> dflash::Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: usize| a.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let dir = PathBuf::from(a.first().map_or("random-draft", |s| s.as_str()));
    let (hidden, vocab, layers) = (num(1, 576), num(2, 49152), num(3, 30));
    let draft_layers = num(4, 1);
    let block = num(5, 16);
    let mut t = TinyTarget::qwen3(1);
    (t.hidden, t.vocab, t.layers) = (hidden, vocab, layers);
    let taps = default_taps(draft_layers.max(3), layers);
    let mut d = TinyDraft::for_target(&t, draft_layers, taps, block, 7);
    // heads of 64 dims, GQA 3:1 (SmolLM2's attention shape)
    d.head_dim = 64;
    d.heads = (hidden / 64).max(1);
    d.kv_heads = if d.heads.is_multiple_of(3) {
        d.heads / 3
    } else {
        1
    };
    d.intermediate = hidden * 2;
    d.write(&dir, vocab)?;
    println!("{}", dir.display());
    Ok(())
}
