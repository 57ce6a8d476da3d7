//! The decode loop (spec section 4), for plain decoding and DFlash speculative decoding.
//!
//! Last step of the data flow: config -> sources -> archs -> draft -> **engine**.
//!
//! ```text
//! prefill target on the prompt (with taps); first token = sample(last logits)
//! loop: block = [last, MASK x (q-1)]; draft fills block[1..]; target verifies the block
//!       (all-position logits + taps); a = leading matches; commit block[1..=a] + bonus;
//!       crop the target cache to start + a + 1; the draft gets the taps of rows 0..=a.
//! ```
//! With no draft or a block size of 1, the same loop is plain autoregressive decoding.

pub mod adaptive;

use crate::archs::{Logits, TargetCache, TargetModel};
use crate::draft::{DraftCache, DraftModel};
use crate::sampling::{argmax, Sampler, SamplingParams};
use crate::stats::GenerationStats;
use crate::{Error, Result};
use adaptive::{AdaptivePolicy, Reason};
use candle_core::Tensor;
use serde::Serialize;
use std::time::Instant;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// A generated stop token ends generation (it is kept in the output).
    pub stop_ids: Vec<u32>,
    /// Verify block size; None = the draft's; 1 = plain decoding. A given size is pinned
    /// (the adaptive policy does not change it).
    pub block_size: Option<usize>,
    /// Choose the block size per cycle from measured costs and acceptance (see `adaptive`).
    pub adaptive: bool,
    /// Record each cycle's block and acceptance.
    pub trace: bool,
}

impl GenerateRequest {
    pub fn new(prompt_ids: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt_ids,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop_ids: vec![],
            block_size: None,
            adaptive: true,
            trace: false,
        }
    }
}

/// One verify cycle, for `--trace`.
#[derive(Debug, Clone, Serialize)]
pub struct StepTrace {
    /// Position of the block's first row (the last committed token).
    pub start: usize,
    /// The ids verified: last committed token + the draft's proposals.
    pub block_ids: Vec<u32>,
    /// Draft tokens accepted (0..q-1).
    pub accepted: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct GenerateOutput {
    /// Generated ids, prompt excluded.
    pub output_ids: Vec<u32>,
    pub stats: GenerationStats,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<StepTrace>>,
}

/// What the token callback tells the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

pub struct Engine {
    pub target: Box<dyn TargetModel>,
    pub draft: Option<DraftModel>,
    /// Largest context (prompt + generated) a generation may reach.
    pub max_context: usize,
    /// The adaptive policy's cost and acceptance estimates, kept across generations (costs
    /// are a property of the machine and model; decayed acceptance follows the prompt).
    policy: std::sync::Mutex<Option<AdaptivePolicy>>,
}

impl Engine {
    pub fn new(target: Box<dyn TargetModel>, draft: Option<DraftModel>) -> Self {
        let max_context = target.info().max_position;
        Self {
            target,
            draft,
            max_context,
            policy: std::sync::Mutex::new(None),
        }
    }

    /// The block size a request will run with.
    pub fn block_size(&self, req: &GenerateRequest) -> usize {
        match (&self.draft, req.block_size) {
            (None, _) => 1,
            (Some(d), None) => d.block_size(),
            (Some(_), Some(b)) => b.max(1),
        }
    }

    /// Generate; `on_tokens` receives each batch of newly committed ids and may stop early.
    pub fn generate(
        &self,
        req: &GenerateRequest,
        on_tokens: &mut dyn FnMut(&[u32]) -> Flow,
    ) -> Result<GenerateOutput> {
        req.sampling.validate()?;
        let p = req.prompt_ids.len();
        if p == 0 {
            return Err(Error::input("empty prompt: nothing to condition on"));
        }
        if p >= self.max_context {
            return Err(Error::input(format!(
                "context overflow: the prompt has {p} tokens, the context size is {}; shorten the prompt",
                self.max_context
            )));
        }
        let q_max = self.block_size(req);
        if q_max > 64 {
            return Err(Error::input(format!(
                "block size {q_max} is larger than 64"
            )));
        }
        let draft = self.draft.as_ref().filter(|_| q_max > 1);
        let taps: &[usize] = draft.map_or(&[], |d| &d.taps);
        let capacity = p
            .saturating_add(req.max_tokens)
            .saturating_add(q_max)
            .min(self.max_context);
        let target = self.target.as_ref();
        let mut tcache: TargetCache = target.new_cache(capacity)?;
        let mut dcache: Option<DraftCache> = draft.map(|d| d.new_cache(capacity)).transpose()?;
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut stats = GenerationStats {
            mode: if draft.is_some() { "dflash" } else { "plain" }.into(),
            block_size: q_max,
            prompt_tokens: p,
            ..Default::default()
        };
        let mut steps = req.trace.then(Vec::new);
        // The estimates of earlier generations (same block size), else a fresh policy. The
        // slot is emptied while a generation runs, so concurrent ones start fresh.
        let mut policy = (draft.is_some() && req.adaptive && req.block_size.is_none()).then(|| {
            self.policy
                .lock()
                .ok()
                .and_then(|mut slot| slot.take())
                .filter(|p| p.max_q() == q_max)
                .unwrap_or_else(|| {
                    let shape = (0..=q_max).map(|q| self.target.verify_bytes(q)).collect();
                    AdaptivePolicy::new(q_max).with_verify_shape(shape)
                })
        });
        stats.adaptive = policy.is_some();
        stats.q_histogram = vec![0; q_max + 1];
        let mut out: Vec<u32> = Vec::new();

        // Prefill.
        let t0 = Instant::now();
        let pre = target.forward(&req.prompt_ids, 0, &mut tcache, taps, Logits::Last)?;
        let first = self.choose(&pre.logits.expect("prefill logits"), &mut sampler)?[0];
        let prefill_s = t0.elapsed().as_secs_f64();
        stats.ttft_ms = prefill_s * 1e3;
        stats.prefill_tok_s = p as f64 / prefill_s;
        // Taps of committed positions not yet given to the draft (concatenated at its next call).
        let mut ctx_rows: Vec<Tensor> = pre.taps.into_iter().collect();
        let mut start = p;
        let mut last = first;
        let mut draft_tokens = 0usize;
        let (_, mut finish) = self.commit(&[first], req, &mut out, on_tokens);

        let decode_t0 = Instant::now();
        let mut excluded_s = 0.0; // the first draft call (draft prefill) is not decode time
        let mut first_draft = true;
        while finish.is_none() {
            let room = capacity.saturating_sub(start);
            if room == 0 {
                finish = Some("context");
                break;
            }
            // Near the end the block shrinks to the tokens left + 1 rows (as the reference
            // does: the last row's proposal can still be accepted; commits are capped).
            let limit = q_max.min(req.max_tokens - out.len() + 1).min(room);
            let (q, reason) = match policy.as_mut() {
                Some(p) => p.choose(limit),
                None => (limit, Reason::Model),
            };
            stats.q_histogram[q] += 1;
            if policy.is_some() {
                *stats
                    .q_reasons
                    .entry(format!("{reason:?}").to_lowercase())
                    .or_default() += 1;
            }
            let mut draft_s = None;
            let mut block = vec![last];
            if let (Some(d), Some(dc), true) = (draft, dcache.as_mut(), q > 1) {
                let td = Instant::now();
                block.resize(q, d.mask_token_id());
                let ctx = match ctx_rows.len() {
                    1 => ctx_rows.pop().expect("one"),
                    _ => Tensor::cat(&std::mem::take(&mut ctx_rows), 0)?,
                };
                let props = d.propose(target, &ctx, &block, start, dc)?;
                block[1..].copy_from_slice(&props);
                let dt = td.elapsed().as_secs_f64();
                if first_draft {
                    excluded_s = dt;
                    first_draft = false;
                } else {
                    stats.draft_ms += dt * 1e3;
                    draft_s = Some(dt);
                }
            }
            let tv = Instant::now();
            let fw = target.forward(&block, start, &mut tcache, taps, Logits::All)?;
            let logits = fw.logits.expect("verify logits");
            // Target choices row by row; stop sampling at the first mismatch.
            let post = self.choose_until_mismatch(&logits, &block, &mut sampler)?;
            let a = post.len() - 1;
            let verify_s = tv.elapsed().as_secs_f64();
            stats.verify_ms += verify_s * 1e3;
            if let Some(p) = policy.as_mut() {
                p.observe(q, a, draft_s, verify_s);
            }
            let tr = Instant::now();
            tcache.truncate(start + a + 1)?;
            if a + 1 < q && tcache.has_recurrent() {
                // the rebuild runs on the device: wait for it so that the time is its own
                target.info().device.synchronize()?;
            }
            stats.rollback_ms += tr.elapsed().as_secs_f64() * 1e3;
            if let Some(t) = fw.taps {
                // Taps of the committed rows 0..=a become the draft's next context rows (a
                // single-token step without a draft call keeps accumulating them).
                ctx_rows.push(t.narrow(0, 0, a + 1)?);
            }
            if let Some(s) = steps.as_mut() {
                s.push(StepTrace {
                    start,
                    block_ids: block.clone(),
                    accepted: a,
                });
            }
            let mut commit: Vec<u32> = block[1..=a].to_vec();
            commit.push(post[a]);
            start += a + 1;
            last = post[a];
            let (pushed, f) = self.commit(&commit, req, &mut out, on_tokens);
            // Tokens committed this cycle: a + 1, less any cut by a stop token or max tokens.
            stats.acceptance_lengths.push(pushed);
            // Tokens cut after a stop were never committed: they do not count as drafted.
            draft_tokens += pushed.min(a);
            finish = f;
        }
        if let (Some(p), Ok(mut slot)) = (policy.take(), self.policy.lock()) {
            *slot = Some(p);
        }
        let decode_s = (decode_t0.elapsed().as_secs_f64() - excluded_s).max(1e-9);
        stats.generated_tokens = out.len();
        stats.decode_ms = decode_s * 1e3;
        stats.decode_tok_s = out.len().saturating_sub(1) as f64 / decode_s;
        stats.finish_reason = finish.unwrap_or("length").into();
        if draft.is_some() {
            let plain = stats.q_histogram.get(1).copied().unwrap_or(0);
            let total: usize = stats.q_histogram.iter().sum();
            if total > 0 && plain * 2 > total {
                stats.fallback_reason = Some(format!(
                    "adaptive policy ran {plain} of {total} cycles as plain decoding (speculation measured slower)"
                ));
            }
        }
        stats.finish(draft_tokens);
        Ok(GenerateOutput {
            output_ids: out,
            stats,
            steps,
        })
    }

    /// Append committed ids, honouring stop tokens (cut after the first) and max tokens.
    fn commit(
        &self,
        ids: &[u32],
        req: &GenerateRequest,
        out: &mut Vec<u32>,
        on_tokens: &mut dyn FnMut(&[u32]) -> Flow,
    ) -> (usize, Option<&'static str>) {
        let mut n = 0;
        let mut finish = None;
        for &t in ids {
            if out.len() >= req.max_tokens {
                finish = Some("length");
                break;
            }
            out.push(t);
            n += 1;
            if req.stop_ids.contains(&t) {
                finish = Some("stop");
                break;
            }
        }
        if finish.is_none() && out.len() >= req.max_tokens {
            finish = Some("length");
        }
        if n > 0 && on_tokens(&out[out.len() - n..]) == Flow::Stop && finish.is_none() {
            finish = Some("cancelled");
        }
        (n, finish)
    }

    /// Target choice for every row of `logits [rows, vocab]`.
    fn choose(&self, logits: &Tensor, sampler: &mut Sampler) -> Result<Vec<u32>> {
        if let Some(ids) = crate::sampling::choose_rows_at_once(logits, sampler)? {
            sampler.skip(ids.len());
            return Ok(ids);
        }
        let rows = logits.to_vec2::<f32>()?;
        Ok(rows.iter().map(|r| sampler.sample(r)).collect())
    }

    /// Target choices `post[0..=a]` where `a` is the number of accepted draft tokens:
    /// `block[i] == post[i-1]` for i in 1..=a, and `post[a]` is the bonus token.
    fn choose_until_mismatch(
        &self,
        logits: &Tensor,
        block: &[u32],
        sampler: &mut Sampler,
    ) -> Result<Vec<u32>> {
        let q = block.len();
        // Every row chosen at once (greedy, or drawn on the device with the uniforms the host
        // would use in turn), else row by row on the host; either way only the rows up to the
        // first mismatch are kept, and only their uniforms drawn.
        let all = crate::sampling::choose_rows_at_once(logits, sampler)?;
        let rows = match all {
            Some(_) => Vec::new(),
            None => logits.to_vec2::<f32>()?,
        };
        let mut post = Vec::with_capacity(q);
        for i in 0..q {
            let t = match &all {
                Some(all) => all[i],
                None => sampler.sample(&rows[i]),
            };
            post.push(t);
            if i + 1 >= q || block[i + 1] != t {
                break;
            }
        }
        if all.is_some() {
            sampler.skip(post.len());
        }
        Ok(post)
    }
}

/// Greedy continuation by full recomputation (no cache reuse): the reference the tests
/// compare the engine against. O(n^2); for tiny models only.
pub fn greedy_by_recompute(target: &dyn TargetModel, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        let mut c = target.new_cache(seq.len())?;
        let out = target.forward(&seq, 0, &mut c, &[], Logits::Last)?;
        let row = out.logits.expect("logits").squeeze(0)?.to_vec1::<f32>()?;
        seq.push(argmax(&row));
    }
    Ok(seq[prompt.len()..].to_vec())
}
