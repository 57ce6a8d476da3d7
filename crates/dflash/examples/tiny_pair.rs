//! Write a tiny random target + DFlash draft pair (no download needed) for `dflash bench`
//! demos: `cargo run --example tiny_pair -- DIR [hidden] [layers] [vocab] [agree]`.
//!
//! The target's LM head favours a few tokens, so the draft (sharing the target's embeddings
//! and head) agrees now and then. With `agree`, both final norms are zeroed: the target
//! always picks token 0 and the draft always proposes it, so every draft token is accepted
//! (tau = block size): the upper bound of what DFlash can gain on this machine.

use dflash::testing::{TinyDraft, TinyTarget};
use std::path::PathBuf;

fn main() -> dflash::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(args.first().map_or("tiny-pair", |s| s.as_str()));
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let mut t = TinyTarget::qwen3(11);
    t.hidden = num(1, 64);
    t.layers = num(2, 4);
    t.vocab = num(3, 128);
    t.intermediate = 2 * t.hidden;
    t.dominant = vec![(3, 4.0), (7, 3.0)];
    let mut d = TinyDraft::for_target(&t, 1, vec![1, t.layers - 1], 16, 12);
    d.intermediate = t.hidden * 3 / 2;
    if args.get(4).is_some_and(|a| a == "agree") {
        t.zero_final_norm = true;
        d.zero_final_norm = true;
    }
    t.write(&dir.join("target"))?;
    d.write(&dir.join("draft"), t.vocab)?;
    println!("{}/target {}/draft", dir.display(), dir.display());
    Ok(())
}
