//! `dflash bench --concurrency` as an example binary (the GPU scripts of tools/gpu-bench that
//! predate the bench flag call it): the same table and check (`dflash::bench::concurrency`).
//!
//! cargo run --release [--features cuda] --example concurrency -- --model DIR [--draft DIR]
//!   [--device cuda] [--dtype bf16] [--concurrency 1,8,32] [--max-tokens 128] [--prompt-len 128]
//!   [--temperature 1.0] [--block 16] [--check]

use dflash::bench::concurrency::{concurrency_markdown, run_concurrency, ConcurrencyOptions};
use dflash::pipeline::{Pipeline, PipelineOptions};
use dflash::Error;

fn main() -> dflash::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let num = |k: &str, d: f64| -> dflash::Result<f64> {
        get(k).map_or(Ok(d), |v| {
            v.parse()
                .map_err(|_| Error::input(format!("{k}: not a number: {v}")))
        })
    };
    let levels = get("--concurrency")
        .unwrap_or_else(|| "1,8,32".into())
        .split(',')
        .map(|c| {
            c.parse()
                .map_err(|_| Error::input("--concurrency: a list of integers"))
        })
        .collect::<dflash::Result<Vec<usize>>>()?;
    let o = ConcurrencyOptions {
        levels,
        prompt_len: num("--prompt-len", 128.0)? as usize,
        max_tokens: num("--max-tokens", 128.0)? as usize,
        temperature: num("--temperature", 1.0)? as f32,
        block: match get("--block") {
            Some(b) => Some(
                b.parse()
                    .map_err(|_| Error::input(format!("--block: not a block size: {b}")))?,
            ),
            None => None,
        },
        check: args.iter().any(|a| a == "--check"),
    };
    let model = get("--model").ok_or_else(|| Error::input("--model DIR is required"))?;
    let p = Pipeline::load(&PipelineOptions {
        model,
        draft: get("--draft"),
        no_draft: get("--draft").is_none(),
        device: get("--device"),
        dtype: get("--dtype"),
        max_context: Some(o.prompt_len + o.max_tokens + 64),
        ..Default::default()
    })?;
    print!("{}", concurrency_markdown(&run_concurrency(&p, &o)?));
    Ok(())
}
