//! Give a DFlash draft its own narrow LM head over the K target tokens most frequent in
//! training sequences' responses (`dflash::draft::narrow`): it proposes only those tokens
//! and its head costs K / vocab of the full one.
//!
//! cargo run --release --example narrow_draft -- DRAFT_DIR TARGET SEQUENCES[,..] K OUT_DIR
//!   SEQUENCES: `dflash train` sequence files (jsonl). A draft quantized by
//!   examples/quantize_draft gets its head quantized the same way.

use dflash::draft::narrow;
use dflash::source::ModelSource;
use std::path::PathBuf;

fn main() -> dflash::Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let [draft, target, seqs, k, out] = a.as_slice() else {
        return Err(dflash::Error::input(
            "usage: narrow_draft DRAFT_DIR TARGET SEQUENCES[,..] K OUT_DIR",
        ));
    };
    let k: usize = k
        .parse()
        .map_err(|_| dflash::Error::input(format!("K `{k}` is not a number")))?;
    let src = ModelSource::resolve(target)?;
    let vocab = src.target_config()?.vocab_size;
    let mut all = vec![];
    for f in seqs.split(',') {
        all.extend(dflash::train::data::read_sequences(&PathBuf::from(f))?);
    }
    let (counts, tokens) = narrow::response_counts(&all, vocab);
    let share =
        narrow::narrow_to_frequent(&PathBuf::from(draft), &src, &counts, k, &PathBuf::from(out))?;
    println!(
        "{out}: the {k} most frequent of {vocab} tokens cover {:.2}% of {tokens} response tokens in {} sequences",
        100.0 * share,
        all.len()
    );
    Ok(())
}
