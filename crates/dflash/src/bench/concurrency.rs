//! Decoding speed at several concurrencies in one run (`dflash bench --concurrency 1,8,32`,
//! issue 23): for each level c, requests of fixed pseudo-random prompt ids go through
//! `Engine::generate_queue` with at most c at once (the next admitted as one finishes, as a
//! server under steady load batches them), `rounds * c` requests a level and at least the first
//! min(8, the highest level) at every level (so level 1 is those requests one after another),
//! plain decoding (block 1) and DFlash (the given block, else the adaptive policy); per level
//! the aggregate tok/s (all tokens / wall time), the mean per-request tok/s (a request's
//! tokens / its own time from admission to its end), both also
//! as ratios to the first level, tau, mean TTFT and the p50 / p99 request latency. With `check`
//! every mode also runs greedy at min(8, the highest level) and counts the batched outputs
//! equal to each request's output alone.

use crate::engine::{Flow, GenerateRequest};
use crate::pipeline::Pipeline;
use crate::sampling::SamplingParams;
use crate::{Error, Result};
use serde::Serialize;
use std::time::Instant;

/// What to run.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrencyOptions {
    /// Concurrency levels, in order; ratios are against the first.
    pub levels: Vec<usize>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// 0 = greedy; otherwise each request its own seed.
    pub temperature: f32,
    /// DFlash block size; None = the adaptive policy.
    pub block: Option<usize>,
    /// Also check greedy batched == alone.
    pub check: bool,
    /// Run plain decoding (DFlash runs whenever the pipeline has a draft).
    pub plain: bool,
    /// Requests a level serves per slot: level c serves max(min(8, highest level), rounds * c)
    /// requests, at most c at once.
    pub rounds: usize,
}

/// One (mode, level) row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrencyRow {
    pub mode: &'static str,
    pub concurrency: usize,
    /// Requests served (max(min(8, highest level), rounds * c), at most c at once).
    pub requests: usize,
    pub aggregate_tok_s: f64,
    pub aggregate_x: f64,
    pub per_request_tok_s: f64,
    pub per_request_x: f64,
    pub tau: f64,
    pub ttft_ms: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
}

/// The greedy check of one mode.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrencyCheck {
    pub mode: &'static str,
    pub concurrency: usize,
    pub equal: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ConcurrencyResult {
    pub rows: Vec<ConcurrencyRow>,
    pub checks: Vec<ConcurrencyCheck>,
}

/// Request `i` of a level: a fixed pseudo-random prompt (xorshift from the index).
fn request(
    i: usize,
    o: &ConcurrencyOptions,
    vocab: u64,
    block: Option<usize>,
    temperature: f32,
) -> GenerateRequest {
    let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 + 1);
    let ids = (0..o.prompt_len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % (vocab - 1)) as u32
        })
        .collect();
    let mut r = GenerateRequest::new(ids, o.max_tokens);
    r.block_size = block;
    r.adaptive = block.is_none();
    if temperature > 0.0 {
        r.sampling = SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 17 + i as u64,
            ..Default::default()
        };
    }
    r
}

/// The `q`-quantile (nearest rank) of `xs`.
fn quantile(xs: &mut [f64], q: f64) -> f64 {
    xs.sort_by(f64::total_cmp);
    let k = ((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len().max(1));
    xs.get(k - 1).copied().unwrap_or(0.0)
}

/// Run the table (and the check) on a loaded pipeline.
pub fn run_concurrency(p: &Pipeline, o: &ConcurrencyOptions) -> Result<ConcurrencyResult> {
    if o.levels.is_empty() || o.levels.contains(&0) {
        return Err(Error::input(
            "--concurrency: give one or more levels of at least 1, e.g. 1,8,32",
        ));
    }
    if o.prompt_len == 0 || o.max_tokens == 0 {
        return Err(Error::input(
            "--concurrency needs --concurrency-prompt-len and --max-tokens of at least 1",
        ));
    }
    let e = &p.engine;
    let vocab = p.target_config.vocab_size as u64;
    let mut modes: Vec<(&'static str, Option<usize>)> = vec![];
    if o.plain {
        modes.push(("plain", Some(1)));
    }
    if e.draft.is_some() {
        modes.push(("dflash", o.block));
    }
    if modes.is_empty() {
        return Err(Error::input(
            "--concurrency: no mode to run (plain is off and no --draft is loaded)",
        ));
    }
    let batch = |n: usize, block: Option<usize>, t: f32| -> Vec<GenerateRequest> {
        (0..n).map(|i| request(i, o, vocab, block, t)).collect()
    };
    // warm up (kernels, allocator, graphs)
    for &(_, block) in &modes {
        for r in e.generate_batch(&batch(2, block, o.temperature), &mut |_, _| Flow::Continue) {
            r?;
        }
    }
    // Level c serves max(k, rounds * c) requests with at most c in flight, the next admitted
    // as one finishes (continuous batching: the batch stays full until the queue drains,
    // instead of a closed batch whose last, least accepted requests run nearly alone), and
    // every level serves at least the first k: concurrency 1 is those requests one after
    // another, so its figures do not rest on one prompt's acceptance.
    let k = o.levels.iter().copied().max().unwrap_or(1).min(8);
    let mut rows = vec![];
    for &(mode, block) in &modes {
        let mut base: Option<(f64, f64)> = None;
        for &c in &o.levels {
            let reqs = batch(k.max(o.rounds.max(1) * c), block, o.temperature);
            let t = Instant::now();
            let outs = e
                .generate_queue(&reqs, c, &mut |_, _| Flow::Continue)
                .into_iter()
                .collect::<Result<Vec<_>>>()?;
            let wall = t.elapsed().as_secs_f64();
            let n = outs.len();
            let tokens: usize = outs.iter().map(|o| o.output_ids.len()).sum();
            let agg = tokens as f64 / wall.max(1e-9);
            let mut lat: Vec<f64> = outs
                .iter()
                .map(|o| o.stats.ttft_ms + o.stats.decode_ms)
                .collect();
            let per = outs
                .iter()
                .zip(&lat)
                .map(|(o, ms)| o.output_ids.len() as f64 / (ms / 1e3).max(1e-9))
                .sum::<f64>()
                / n as f64;
            let mean = |f: &dyn Fn(&crate::stats::GenerationStats) -> f64| {
                outs.iter().map(|o| f(&o.stats)).sum::<f64>() / n as f64
            };
            let (a1, p1) = *base.get_or_insert((agg, per));
            rows.push(ConcurrencyRow {
                mode,
                concurrency: c,
                requests: n,
                aggregate_tok_s: agg,
                aggregate_x: agg / a1,
                per_request_tok_s: per,
                per_request_x: per / p1,
                tau: mean(&|s| s.tau),
                ttft_ms: mean(&|s| s.ttft_ms),
                latency_p50_ms: quantile(&mut lat, 0.5),
                latency_p99_ms: quantile(&mut lat, 0.99),
            });
        }
    }
    let mut checks = vec![];
    if o.check {
        let c = o.levels.iter().copied().max().unwrap_or(8).min(8);
        for &(mode, block) in &modes {
            let rs = batch(c, block, 0.0);
            let batched = e
                .generate_batch(&rs, &mut |_, _| Flow::Continue)
                .into_iter()
                .collect::<Result<Vec<_>>>()?;
            let mut equal = 0;
            for (r, b) in rs.iter().zip(&batched) {
                equal +=
                    (e.generate(r, &mut |_| Flow::Continue)?.output_ids == b.output_ids) as usize;
            }
            checks.push(ConcurrencyCheck {
                mode,
                concurrency: c,
                equal,
            });
        }
    }
    Ok(ConcurrencyResult { rows, checks })
}

/// The table, the check lines and the switches in force (as `bench` records them).
pub fn concurrency_markdown(r: &ConcurrencyResult) -> String {
    let mut s = String::from(
        "| mode | concurrency | requests | aggregate tok/s | x first | per-request tok/s | x first | tau | TTFT ms (mean) | latency p50 / p99 ms |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for w in &r.rows {
        s += &format!(
            "| {} | {} | {} | {:.1} | {:.2} | {:.1} | {:.2} | {:.2} | {:.1} | {:.0} / {:.0} |\n",
            w.mode,
            w.concurrency,
            w.requests,
            w.aggregate_tok_s,
            w.aggregate_x,
            w.per_request_tok_s,
            w.per_request_x,
            w.tau,
            w.ttft_ms,
            w.latency_p50_ms,
            w.latency_p99_ms
        );
    }
    for c in &r.checks {
        s += &format!(
            "\n{}: greedy at concurrency {}: {} of {} outputs equal their run alone",
            c.mode, c.concurrency, c.equal, c.concurrency
        );
    }
    let sw: Vec<String> = crate::switches::describe()
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    s += &format!("\n\nswitches: {}\n", sw.join(" "));
    s
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn nearest_rank_quantiles() {
        let mut xs = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(quantile(&mut xs, 0.5), 3.0);
        assert_eq!(quantile(&mut xs, 0.99), 5.0);
        assert_eq!(quantile(&mut xs, 0.0), 1.0);
        assert_eq!(quantile(&mut [7.0], 0.99), 7.0);
    }
}
