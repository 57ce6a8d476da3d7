//! Greedy decoding of a prompt with a GGUF target, printing ids and text (used to compare
//! with llama.cpp). `gguf_greedy FILE.gguf "prompt" [N] [--chat] [--keep-quant]`; with
//! `LAYER_SUMS=1` each layer's output over the prompt instead (sum, each row's first and last values), to
//! set beside `llama-eval-callback`'s `l_out-N` lines.

use dflash::archs::{load_target, LoadOptions, Logits};
use dflash::chat::ChatMessage;
use dflash::source::gguf::GgufFile;
use dflash::source::ModelSource;
use std::time::Instant;

fn main() -> dflash::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = std::path::PathBuf::from(&args[0]);
    let prompt = &args[1];
    let n: usize = args.get(2).and_then(|x| x.parse().ok()).unwrap_or(32);
    let chat = args.iter().any(|a| a == "--chat");
    let opts = LoadOptions {
        keep_quant: args.iter().any(|a| a == "--keep-quant"),
        ..Default::default()
    };
    let t0 = Instant::now();
    let (_, m) = load_target(&ModelSource::from_gguf("cli", &path), &opts)?;
    eprintln!(
        "loaded in {:.2}s: {:?}",
        t0.elapsed().as_secs_f64(),
        m.info().quantization
    );
    let g = GgufFile::open(&path)?;
    let tok = g.tokenizer()?;
    let text = if chat {
        let t = g.chat_template()?.expect("no chat template");
        t.render(
            &[ChatMessage::user(prompt.as_str())],
            true,
            None,
            &Default::default(),
        )?
    } else {
        prompt.clone()
    };
    let mut ids = tok.encode(&text, !chat)?;
    eprintln!("prompt ids {:?}", ids);
    let stops = g.stop_token_ids()?;
    if std::env::var_os("LAYER_SUMS").is_some() {
        // each layer's output over the prompt (llama-eval-callback's `l_out-N`: its sum and
        // row 0's first values), for a layer-by-layer comparison with llama.cpp
        let layers = m.info().num_layers;
        let all: Vec<usize> = (0..layers).collect();
        let mut c = m.new_cache(ids.len() + 1)?;
        let fw = m.forward(&ids, 0, &mut c, &all, Logits::Last)?;
        let taps = fw.taps.expect("taps");
        let h = taps.dim(1)? / layers;
        for l in 0..layers {
            let t = taps
                .narrow(1, l * h, h)?
                .to_dtype(candle_core::DType::F32)?;
            let sum: f32 = t.sum_all()?.to_scalar()?;
            println!("l_out-{l} sum {sum:.6}");
            for r in 0..t.dim(0)? {
                let v: Vec<f32> = t.get(r)?.to_vec1()?;
                println!("  row {r}: {:.4?} ... {:.4?}", &v[..3], &v[h - 3..]);
            }
        }
        return Ok(());
    }
    let mut c = m.new_cache(ids.len() + n + 1)?;
    let mut out = Vec::new();
    let t1 = Instant::now();
    let mut logits = m
        .forward(&ids, 0, &mut c, &[], Logits::Last)?
        .logits
        .unwrap();
    if std::env::var_os("TOP5").is_some() {
        let mut v: Vec<(f32, usize)> = logits
            .squeeze(0)?
            .to_vec1::<f32>()?
            .into_iter()
            .zip(0..)
            .collect();
        v.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap());
        eprintln!("top5 {:?}", &v[..5]);
    }
    for _ in 0..n {
        let next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
        out.push(next);
        if stops.contains(&next) {
            break;
        }
        ids.push(next);
        logits = m
            .forward(&[next], ids.len() - 1, &mut c, &[], Logits::Last)?
            .logits
            .unwrap();
    }
    let dt = t1.elapsed().as_secs_f64();
    println!("{:?}", out);
    println!("{}", tok.decode(&out, false)?);
    eprintln!("{:.1} tok/s (incl. prefill)", out.len() as f64 / dt);
    Ok(())
}
