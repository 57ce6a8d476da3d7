//! Batched vs one-after-another decoding on one model (issue 23): N requests through
//! `Engine::generate_batch` and the same N through `Engine::generate` in turn, alternating
//! order over repeats; prints wall times, the ratio and whether every output matched.
//!
//! cargo run --release --example batch_speed -- [MODEL] [--draft DIR|none] [--n 4]
//!   [--max-tokens 64] [--repeat 3] [--block N]

use dflash::engine::{Flow, GenerateRequest};
use dflash::pipeline::{Pipeline, PipelineOptions};
use std::time::Instant;

fn main() -> dflash::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .map(|i| args[i + 1].clone())
    };
    let model = args.first().filter(|a| !a.starts_with("--")).cloned();
    let n: usize = get("--n").map_or(4, |v| v.parse().unwrap());
    let max: usize = get("--max-tokens").map_or(64, |v| v.parse().unwrap());
    let repeat: usize = get("--repeat").map_or(3, |v| v.parse().unwrap());
    let draft = get("--draft");
    let p = Pipeline::load(&PipelineOptions {
        model: dflash::pipeline::resolve_model_spec(model.as_deref())?,
        draft: draft.clone().filter(|d| d != "none"),
        no_draft: draft.as_deref() == Some("none"),
        ..Default::default()
    })?;
    let prompts = [
        "Write a Python function that returns the n-th Fibonacci number.",
        "Explain why the sky is blue in two sentences.",
        "List five prime numbers and say what makes them prime.",
        "What is the capital of France? Answer and then describe it briefly.",
        "Write a haiku about autumn leaves.",
        "How do I reverse a list in Python?",
        "Summarize the plot of Romeo and Juliet.",
        "What are the three states of matter?",
    ];
    let reqs: Vec<GenerateRequest> = (0..n)
        .map(|i| {
            let msgs = vec![dflash::chat::ChatMessage::user(prompts[i % prompts.len()])];
            let ids = p.encode_prompt(&msgs, true, None).unwrap();
            let mut r = GenerateRequest::new(ids, max);
            r.block_size = get("--block").map(|b| b.parse().unwrap());
            r.adaptive = r.block_size.is_none();
            r
        })
        .collect();
    let e = &p.engine;
    let (mut tb, mut ts) = (vec![], vec![]);
    let mut same = true;
    let mut tokens = 0;
    for rep in 0..repeat {
        let run_seq = || {
            let t = Instant::now();
            let o: Vec<Vec<u32>> = reqs
                .iter()
                .map(|r| e.generate(r, &mut |_| Flow::Continue).unwrap().output_ids)
                .collect();
            (t.elapsed().as_secs_f64(), o)
        };
        let run_batch = || {
            let t = Instant::now();
            let o: Vec<Vec<u32>> = e
                .generate_batch(&reqs, &mut |_, _| Flow::Continue)
                .into_iter()
                .map(|r| r.unwrap().output_ids)
                .collect();
            (t.elapsed().as_secs_f64(), o)
        };
        let ((s, os), (b, ob)) = if rep % 2 == 0 {
            let s = run_seq();
            (s, run_batch())
        } else {
            let b = run_batch();
            (run_seq(), b)
        };
        same &= os == ob;
        tokens = os.iter().map(|o| o.len()).sum();
        ts.push(s);
        tb.push(b);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (s, b) = (med(&mut ts), med(&mut tb));
    println!(
        "{n} requests x {max} tokens ({tokens} generated), draft {}: one after another {s:.2} s, batched {b:.2} s, ratio {:.2}; outputs equal: {same}",
        if e.draft.is_some() { "yes" } else { "no" },
        b / s
    );
    Ok(())
}
