//! Microbenchmarks of the hot pieces of a decode cycle, on a loaded model: target prefill,
//! verify forward at Q = 1, 4, 8, 16 (Q = 1 is a plain decode step), draft forward, KV
//! truncate, and token sampling. `dflash bench --micro` prints their table; docs/perf.md
//! quotes it.
//!
//! Each piece runs a few untimed warm-up iterations, then `iters` timed ones; the device is
//! synchronized before a timer stops (CUDA kernels run asynchronously).

use crate::archs::Logits;
use crate::pipeline::Pipeline;
use crate::rng::Rng;
use crate::sampling::{argmax, argmax_rows, Sampler, SamplingParams};
use crate::{Error, Result};
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct MicroOptions {
    /// Context positions in the cache before the timed pieces run.
    pub context: usize,
    /// Timed iterations per piece.
    pub iters: usize,
    /// Verify block sizes.
    pub qs: Vec<usize>,
    pub seed: u64,
}

impl Default for MicroOptions {
    fn default() -> Self {
        Self {
            context: 256,
            iters: 20,
            qs: vec![1, 4, 8, 16],
            seed: 0,
        }
    }
}

/// One timed piece.
#[derive(Debug, Clone, Serialize)]
pub struct MicroResult {
    pub name: String,
    /// Rows processed per call (block size, prompt length), if meaningful.
    pub rows: Option<usize>,
    pub iters: usize,
    pub median_us: f64,
    pub mean_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    /// median / rows.
    pub per_row_us: Option<f64>,
}

fn summarize(name: impl Into<String>, rows: Option<usize>, mut us: Vec<f64>) -> MicroResult {
    us.sort_by(|a, b| a.total_cmp(b));
    let median = super::median_sorted(&us);
    MicroResult {
        name: name.into(),
        rows,
        iters: us.len(),
        median_us: median,
        mean_us: us.iter().sum::<f64>() / us.len().max(1) as f64,
        min_us: us.first().copied().unwrap_or(0.0),
        max_us: us.last().copied().unwrap_or(0.0),
        per_row_us: rows.map(|r| median / r.max(1) as f64),
    }
}

const WARMUP: usize = 2;

/// CUDA: `step` (which only enqueues work) timed `WARMUP + n` times queued behind a busy
/// kernel, so its kernels run back to back: pushes `{label}: GPU only` (the step's own GPU
/// time) and `{label}: host enqueue` (the host's time to queue it). The wall time of the same
/// step minus its GPU time is what launching costs (docs/perf.md, run 5).
#[cfg(feature = "cuda")]
fn host_ahead_rows<T>(
    out: &mut Vec<MicroResult>,
    dev: &candle_core::Device,
    label: &str,
    rows: usize,
    n: usize,
    mut step: impl FnMut() -> Result<T>,
) -> Result<()> {
    let (mut gpu, mut host) = (Vec::new(), Vec::new());
    for i in 0..WARMUP + n {
        let (_, g, h) = crate::nn::cuda::gpu_time_host_ahead(dev, 30_000, &mut step)?;
        if i >= WARMUP {
            gpu.push(g * 1e3);
            host.push(h * 1e3);
        }
    }
    out.push(summarize(format!("{label}: GPU only"), Some(rows), gpu));
    out.push(summarize(
        format!("{label}: host enqueue"),
        Some(rows),
        host,
    ));
    Ok(())
}

/// Time the pieces on `p` (its draft, if loaded).
pub fn run_micro(p: &Pipeline, o: &MicroOptions) -> Result<Vec<MicroResult>> {
    let target = p.engine.target.as_ref();
    let info = target.info().clone();
    let dev = info.device.clone();
    let sync = || dev.synchronize().map_err(Error::from);
    let draft = p.engine.draft.as_ref();
    let taps: Vec<usize> = draft.map(|d| d.taps.clone()).unwrap_or_default();
    let qmax =
        o.qs.iter()
            .copied()
            .max()
            .unwrap_or(1)
            .max(draft.map_or(1, |d| d.block_size()));
    let n = o.iters.max(1);
    // The draft's proposal is timed at its block size and at each smaller --micro-q of 2 or
    // more (the blocks the adaptive policy runs); at the block size twice on CUDA (wall, then
    // host-ahead). One context row per call.
    let draft_qs: Vec<usize> = draft.map_or(vec![], |d| {
        let b = d.block_size();
        std::iter::once(b)
            .chain(o.qs.iter().copied().filter(|&q| q >= 2 && q < b))
            .collect()
    });
    let cap = o.context + (draft_qs.len() + 1) * (WARMUP + n) + 2 * qmax + 2;
    if cap > p.engine.max_context {
        return Err(Error::input(format!(
            "--micro: context {} + iterations needs {cap} positions, the model has {}",
            o.context, p.engine.max_context
        )));
    }
    let mut rng = Rng::new(o.seed);
    let vocab = info.vocab_size;
    let mut ids = |k: usize| -> Vec<u32> { (0..k).map(|_| rng.below(vocab) as u32).collect() };
    let ctx_ids = ids(o.context.max(1));
    let ctx = ctx_ids.len();
    let mut out = Vec::new();

    // Prefill of the context (timed once per iteration on a fresh cache): in one forward, and
    // (where that is more than one chunk) in the engine's prefill chunks
    // (`engine::prefill_rows`: what a served prompt costs).
    let cuda = dev.is_cuda();
    let chunked = crate::engine::prefill_rows(0, cuda) < ctx;
    for (name, engine_chunks) in [("prefill", false), ("prefill (engine chunks)", true)] {
        if engine_chunks && !chunked {
            continue;
        }
        let mut us = Vec::new();
        for i in 0..(1 + n.min(5)) {
            let mut c = target.new_cache(cap)?;
            let t = Instant::now();
            let mut pos = 0;
            while pos < ctx {
                let k = if engine_chunks {
                    crate::engine::prefill_rows(pos, cuda).min(ctx - pos)
                } else {
                    ctx
                };
                let last = if pos + k == ctx {
                    Logits::Last
                } else {
                    Logits::None
                };
                target.forward(&ctx_ids[pos..pos + k], pos, &mut c, &taps, last)?;
                pos += k;
            }
            sync()?;
            if i > 0 {
                us.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        out.push(summarize(name, Some(ctx), us));
    }

    let mut cache = target.new_cache(cap)?;
    let pre = target.forward(&ctx_ids, 0, &mut cache, &taps, Logits::Last)?;
    sync()?;

    // Verify forward: Q rows at the end of the context, all-position logits + taps, then the
    // cache is cropped back.
    for &q in &o.qs {
        let mut us = Vec::new();
        for i in 0..WARMUP + n {
            let block = ids(q);
            let _collect = (i >= WARMUP)
                .then(|| crate::stats::profiler_range(crate::switches::Profile::Ncu))
                .flatten();
            let t = Instant::now();
            let fw = target.forward(&block, ctx, &mut cache, &taps, Logits::All)?;
            // What the engine does with a greedy verify: a choice per row, copied to the host.
            let _ = fw.logits.map(|l| argmax_rows(&l)).transpose()?;
            sync()?;
            let dt = t.elapsed().as_secs_f64() * 1e6;
            cache.truncate(ctx)?;
            if i >= WARMUP {
                us.push(dt);
            }
        }
        out.push(summarize(format!("verify forward Q={q}"), Some(q), us));
        // CUDA: the same step queued behind a busy kernel, so its kernels run back to back:
        // the GPU's own time for the step, and the host's time to enqueue it. The wall time
        // above minus the GPU time is what launching costs (docs/perf.md, run 5).
        #[cfg(feature = "cuda")]
        if dev.is_cuda() && (q == 1 || q == qmax) {
            host_ahead_rows(&mut out, &dev, &format!("verify Q={q}"), q, n, || {
                cache.truncate(ctx)?;
                let fw = target.forward(&ids(q), ctx, &mut cache, &taps, Logits::All)?;
                fw.logits
                    .map(|l| crate::sampling::argmax_rows_tensor(&l))
                    .transpose()
            })?;
            cache.truncate(ctx)?;
        }
    }

    // KV truncate after a 16-row verify.
    let mut us = Vec::new();
    for i in 0..WARMUP + n {
        let block = ids(16.min(cap - ctx));
        target.forward(&block, ctx, &mut cache, &taps, Logits::Last)?;
        sync()?;
        let t = Instant::now();
        cache.truncate(ctx)?;
        sync()?;
        if i >= WARMUP {
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    out.push(summarize("KV truncate (16 rows)", None, us));

    // Draft forward: the first call takes the whole context (untimed, as in the engine);
    // each timed call adds one context row, like a cycle that accepted nothing.
    if let (Some(d), Some(ctx_taps)) = (draft, pre.taps.as_ref()) {
        let q = d.block_size();
        let mut dc = d.new_cache(cap)?;
        let mut block = vec![ids(1)[0]];
        block.resize(q, d.mask_token_id());
        d.forward(target, ctx_taps, &block, ctx, &mut dc)?;
        let row = ctx_taps.narrow(0, ctx - 1, 1)?;
        for &dq in &draft_qs {
            let mut us = Vec::new();
            let mut block = block[..dq].to_vec();
            for i in 0..WARMUP + n {
                let start = dc.len() + 1;
                block[0] = ids(1)[0];
                let _collect = (i >= WARMUP && dq == q)
                    .then(|| crate::stats::profiler_range(crate::switches::Profile::NcuDraft))
                    .flatten();
                let t = Instant::now();
                // The whole proposal: the argmax, or a DFlash2 draft's selector walk.
                let _props: Vec<u32> = d.propose(target, &row, &block, start, &mut dc, None)?;
                let dt = t.elapsed().as_secs_f64() * 1e6;
                if i >= WARMUP {
                    us.push(dt);
                }
            }
            out.push(summarize(format!("draft forward Q={dq}"), Some(dq), us));
        }
        // (The selector's walk reads its scores on the host: no host-ahead timing for DFlash2.)
        #[cfg(feature = "cuda")]
        if dev.is_cuda() && d.selector().is_none() {
            host_ahead_rows(&mut out, &dev, &format!("draft Q={q}"), q, n, || {
                let start = dc.len() + 1;
                block[0] = ids(1)[0];
                let logits = d.forward(target, &row, &block, start, &mut dc)?;
                crate::sampling::argmax_rows_tensor(&logits)
            })?;
        }
    }

    // Sampling one row of `vocab` logits on the host.
    let mut rng = Rng::new(o.seed ^ 1);
    let row: Vec<f32> = (0..vocab).map(|_| (rng.normal() * 3.0) as f32).collect();
    let reps = 200;
    let time_per_call = |f: &mut dyn FnMut()| -> Vec<f64> {
        (0..WARMUP + n)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..reps {
                    f();
                }
                t.elapsed().as_secs_f64() * 1e6 / reps as f64
            })
            .skip(WARMUP)
            .collect()
    };
    let mut sink = 0u32;
    let us = time_per_call(&mut || sink ^= argmax(&row));
    out.push(summarize(
        format!("sampling greedy (vocab {vocab})"),
        None,
        us,
    ));
    // plain temperature (no filters): what a T > 0 verify row costs on the host
    let mut plain = Sampler::new(SamplingParams {
        temperature: 1.0,
        seed: o.seed,
        ..Default::default()
    });
    let us = time_per_call(&mut || sink ^= plain.sample(&row));
    out.push(summarize(format!("sampling T=1 (vocab {vocab})"), None, us));
    let mut sampler = Sampler::new(SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        top_k: 0,
        min_p: 0.0,
        seed: o.seed,
        ..Default::default()
    });
    let us = time_per_call(&mut || sink ^= sampler.sample(&row));
    out.push(summarize(
        format!("sampling T=0.7 top-p 0.9 (vocab {vocab})"),
        None,
        us,
    ));
    std::hint::black_box(sink);
    Ok(out)
}

/// The results as a markdown table.
pub fn micro_markdown(results: &[MicroResult]) -> String {
    let mut s = String::from(
        "| Piece | Rows | Iters | Median us | Mean us | Min us | Max us | us/row |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in results {
        s += &format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} |\n",
            r.name,
            r.rows.map_or("-".into(), |x| x.to_string()),
            r.iters,
            r.median_us,
            r.mean_us,
            r.min_us,
            r.max_us,
            r.per_row_us.map_or("-".into(), |x| format!("{x:.1}"))
        );
    }
    s
}
