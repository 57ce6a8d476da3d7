//! The prefix cache on one model (issue 23 acceptance 3): a first turn of `--prompt-len`
//! random ids, then a second turn = the first's prompt + its answer + `--extra` new ids; the
//! second turn's TTFT from the cache against the first's, and its output against a cold run
//! (the cache off), greedy, plain and (with `--draft`) DFlash.
//!
//! cargo run --release [--features cuda] --example prefix_ttft -- --model DIR [--draft DIR]
//!   [--device cuda] [--dtype bf16] [--prompt-len 2000] [--max-tokens 64] [--extra 40]

use dflash::engine::{Flow, GenerateRequest};
use dflash::pipeline::{Pipeline, PipelineOptions};

fn main() -> dflash::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let num = |k: &str, d: usize| get(k).map_or(d, |v| v.parse().expect(k));
    let (plen, max, extra) = (
        num("--prompt-len", 2000),
        num("--max-tokens", 64),
        num("--extra", 40),
    );
    let mut p = Pipeline::load(&PipelineOptions {
        model: get("--model").expect("--model DIR"),
        draft: get("--draft"),
        no_draft: get("--draft").is_none(),
        device: get("--device"),
        dtype: get("--dtype"),
        max_context: Some(plen + 2 * max + extra + 64),
        ..Default::default()
    })?;
    let vocab = p.target_config.vocab_size as u64;
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut rand_ids = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % (vocab - 1)) as u32
            })
            .collect()
    };
    let first = rand_ids(plen);
    let more = rand_ids(extra);
    let mut modes = vec![("plain", Some(1usize))];
    if p.engine.draft.is_some() {
        modes.push(("dflash", None));
    }
    println!("| mode | turn 1 prompt | turn 1 TTFT ms | turn 2 prompt | cached | turn 2 TTFT ms | ratio | cold turn 2 TTFT ms | same output as cold |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for (name, block) in modes {
        let req = |ids: Vec<u32>| {
            let mut r = GenerateRequest::new(ids, max);
            r.block_size = block;
            r.adaptive = block.is_none();
            r
        };
        let run = |p: &Pipeline, r: &GenerateRequest| p.engine.generate(r, &mut |_| Flow::Continue);
        // cold: warm-up, turn 1, turn 2
        p.engine.enable_prefix_cache(0);
        let r1 = req(first.clone());
        run(&p, &r1)?;
        let o1 = run(&p, &r1)?;
        let mut ids2 = first.clone();
        ids2.extend_from_slice(&o1.output_ids);
        ids2.extend_from_slice(&more);
        let r2 = req(ids2);
        let cold = run(&p, &r2)?;
        // with the cache: turn 1 fills it, turn 2 starts from it
        p.engine.enable_prefix_cache(8 << 30);
        let w1 = run(&p, &r1)?;
        let w2 = run(&p, &r2)?;
        println!(
            "| {name} | {} | {:.1} | {} | {} | {:.1} | {:.3} | {:.1} | {} |",
            r1.prompt_ids.len(),
            w1.stats.ttft_ms,
            r2.prompt_ids.len(),
            w2.stats.cached_prompt_tokens,
            w2.stats.ttft_ms,
            w2.stats.ttft_ms / w1.stats.ttft_ms,
            cold.stats.ttft_ms,
            w2.output_ids == cold.output_ids && w1.output_ids == o1.output_ids
        );
    }
    Ok(())
}
