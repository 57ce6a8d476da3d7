//! Aggregate and per-request decoding speed at several concurrencies, in one run (issue 23
//! acceptance 1): for each concurrency c, c requests of random prompt ids go through
//! `Engine::generate_batch` together; prints a table of aggregate tok/s, per-request tok/s and
//! their ratios to concurrency 1, for plain decoding (block 1) and DFlash, and whether the
//! batched greedy outputs equal each request's output alone (`--check`).
//!
//! cargo run --release [--features cuda] --example concurrency -- --model DIR [--draft DIR]
//!   [--device cuda] [--dtype bf16] [--concurrency 1,8,32] [--max-tokens 128] [--prompt-len 128]
//!   [--temperature 1.0] [--block 16] [--check]

use dflash::engine::{Flow, GenerateRequest};
use dflash::pipeline::{Pipeline, PipelineOptions};
use dflash::sampling::SamplingParams;
use std::time::Instant;

fn main() -> dflash::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let num = |k: &str, d: f64| get(k).map_or(d, |v| v.parse().expect(k));
    let conc: Vec<usize> = get("--concurrency")
        .unwrap_or_else(|| "1,8,32".into())
        .split(',')
        .map(|c| c.parse().expect("--concurrency: a list of integers"))
        .collect();
    let max = num("--max-tokens", 128.0) as usize;
    let plen = num("--prompt-len", 128.0) as usize;
    let temp = num("--temperature", 1.0);
    let p = Pipeline::load(&PipelineOptions {
        model: get("--model").expect("--model DIR"),
        draft: get("--draft"),
        no_draft: get("--draft").is_none(),
        device: get("--device"),
        dtype: get("--dtype"),
        max_context: Some(plen + max + 64),
        ..Default::default()
    })?;
    let e = &p.engine;
    let vocab = p.target_config.vocab_size as u64;
    let only = get("--modes");
    let want = |m: &str| only.as_deref().is_none_or(|o| o.split(',').any(|x| x == m));
    let mut modes = vec![];
    if want("plain") {
        modes.push(("plain", Some(1usize)));
    }
    if e.draft.is_some() && want("dflash") {
        modes.push((
            "dflash",
            get("--block").map(|b| b.parse().expect("--block")),
        ));
    }
    let reqs = |c: usize, block: Option<usize>, temp: f64| -> Vec<GenerateRequest> {
        (0..c)
            .map(|i| {
                // a fixed pseudo-random prompt per request index
                let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 + 1);
                let ids = (0..plen)
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        (s % (vocab - 1)) as u32
                    })
                    .collect();
                let mut r = GenerateRequest::new(ids, max);
                r.block_size = block;
                r.adaptive = block.is_none();
                if temp > 0.0 {
                    r.sampling = SamplingParams {
                        temperature: temp as f32,
                        top_k: 0,
                        top_p: 1.0,
                        min_p: 0.0,
                        seed: 17 + i as u64,
                        ..Default::default()
                    };
                }
                r
            })
            .collect()
    };
    // warm up (kernels, allocator)
    for (_, block) in &modes {
        let _ = e.generate_batch(&reqs(2, *block, temp), &mut |_, _| Flow::Continue);
    }
    println!("| mode | concurrency | aggregate tok/s | x c=1 | per-request tok/s | x c=1 | tau | TTFT ms (mean) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, block) in &modes {
        let mut base: Option<(f64, f64)> = None;
        for &c in &conc {
            let rs = reqs(c, *block, temp);
            let t = Instant::now();
            let outs: Vec<_> = e
                .generate_batch(&rs, &mut |_, _| Flow::Continue)
                .into_iter()
                .collect::<dflash::Result<Vec<_>>>()?;
            let wall = t.elapsed().as_secs_f64();
            let tokens: usize = outs.iter().map(|o| o.output_ids.len()).sum();
            let agg = tokens as f64 / wall;
            // per request: its tokens over its own time from submission to its end
            let per: f64 = outs
                .iter()
                .map(|o| {
                    let s = &o.stats;
                    o.output_ids.len() as f64 / ((s.ttft_ms + s.decode_ms) / 1e3).max(1e-9)
                })
                .sum::<f64>()
                / c as f64;
            let tau = outs.iter().map(|o| o.stats.tau).sum::<f64>() / c as f64;
            let ttft = outs.iter().map(|o| o.stats.ttft_ms).sum::<f64>() / c as f64;
            if args.iter().any(|a| a == "--reasons") {
                let s = &outs[0].stats;
                eprintln!(
                    "{name} c={c}: q histogram {:?} reasons {:?}",
                    s.q_histogram, s.q_reasons
                );
            }
            let (a1, p1) = *base.get_or_insert((agg, per));
            println!(
                "| {name} | {c} | {agg:.1} | {:.2} | {per:.1} | {:.2} | {tau:.2} | {ttft:.1} |",
                agg / a1,
                per / p1
            );
        }
    }
    if args.iter().any(|a| a == "--check") {
        let c = *conc.iter().max().unwrap_or(&8).min(&8);
        for (name, block) in &modes {
            let rs = reqs(c, *block, 0.0);
            let batched: Vec<Vec<u32>> = e
                .generate_batch(&rs, &mut |_, _| Flow::Continue)
                .into_iter()
                .map(|o| o.map(|o| o.output_ids))
                .collect::<dflash::Result<_>>()?;
            let mut same = 0;
            for (r, b) in rs.iter().zip(&batched) {
                same += (e.generate(r, &mut |_| Flow::Continue)?.output_ids == *b) as usize;
            }
            println!(
                "{name}: greedy at concurrency {c}: {same} of {c} outputs equal their run alone"
            );
        }
    }
    // the switches in force (as `dflash bench` records them), e.g. `attn_mma=auto`
    let sw: Vec<String> = dflash::switches::describe()
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    println!("\nswitches: {}", sw.join(" "));
    Ok(())
}
