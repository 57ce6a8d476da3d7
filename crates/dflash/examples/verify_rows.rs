//! Does a target's logit row depend on how many rows the forward computes? Greedy-decode a
//! chat prompt with 1-row steps; at every position also run a 2-row forward (the token and a
//! dummy follower) from the same cache state and compare its first row with the 1-row step:
//! max |diff| and whether the argmax agrees. A DFlash verify relies on them being equal.
//! `verify_rows FILE.gguf "prompt" [N] [--keep-quant]`.

use dflash::archs::{load_target, LoadOptions, Logits};
use dflash::chat::ChatMessage;
use dflash::source::gguf::GgufFile;
use dflash::source::ModelSource;

fn main() -> dflash::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = std::path::PathBuf::from(&args[0]);
    let n: usize = args.get(2).and_then(|x| x.parse().ok()).unwrap_or(64);
    let opts = LoadOptions {
        keep_quant: args.iter().any(|a| a == "--keep-quant"),
        ..Default::default()
    };
    let (_, m) = load_target(&ModelSource::from_gguf("cli", &path), &opts)?;
    let g = GgufFile::open(&path)?;
    let tok = g.tokenizer()?;
    // chat models: the rendered conversation; base models: the raw prompt
    let ids = match g.chat_template()? {
        Some(t) => tok.encode(
            &t.render(
                &[ChatMessage::user(args[1].as_str())],
                true,
                None,
                &Default::default(),
            )?,
            false,
        )?,
        None => tok.encode(&args[1], true)?,
    };
    let mut c = m.new_cache(ids.len() + n + 4)?;
    let last = m
        .forward(&ids, 0, &mut c, &[], Logits::Last)?
        .logits
        .unwrap();
    let argmax = |l: &candle_core::Tensor| -> dflash::Result<(u32, Vec<f32>)> {
        let v = l.flatten_all()?.to_vec1::<f32>()?;
        let i = v
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        Ok((i, v))
    };
    let (mut next, _) = argmax(&last)?;
    let mut pos = ids.len();
    let (mut worst, mut flips) = (0f32, 0usize);
    for step in 0..n {
        // two rows first (then dropped), then the one-row step that decoding keeps
        let two = m
            .forward(&[next, next], pos, &mut c, &[], Logits::All)?
            .logits
            .unwrap();
        c.truncate(pos)?;
        let one = m
            .forward(&[next], pos, &mut c, &[], Logits::Last)?
            .logits
            .unwrap();
        let (a1, v1) = argmax(&one)?;
        let (a2, v2) = argmax(&two.get(0)?)?;
        let d = v1
            .iter()
            .zip(&v2)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        worst = worst.max(d);
        if a1 != a2 {
            flips += 1;
            let mut s = v1.clone();
            s.sort_by(|a, b| b.total_cmp(a));
            println!("step {step} pos {pos}: argmax 1-row {a1} vs 2-row {a2}, max diff {d:.3e}, top-2 gap {:.3e}", s[0] - s[1]);
        }
        next = a1;
        pos += 1;
    }
    println!("{n} steps: max |logit diff| {worst:.3e}, argmax flips {flips}");
    Ok(())
}
