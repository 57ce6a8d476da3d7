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
pub mod prefix;
mod sequence;

pub use sequence::{prefill_rows, Batch, Sequence, PREFILL_CHUNK};

use crate::archs::{Logits, TargetModel};
use crate::draft::DraftModel;
use crate::sampling::{argmax, Sampler, SamplingParams};
use crate::stats::GenerationStats;
use crate::{Error, Result};
use adaptive::{Acceptance, Policy, Reason, Want};
use candle_core::Tensor;
use serde::Serialize;

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
    /// Structured output: every choice (draft proposals, verify rows, plain steps) masked by
    /// this grammar's state there (see `grammar`).
    pub grammar: Option<crate::grammar::Grammar>,
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
            grammar: None,
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
    /// The adaptive policy's cost estimates (per forward size: a property of the machine and
    /// model, shared by every generation and batch of this engine).
    policy: std::sync::Mutex<Policy>,
    /// The last finished generation's acceptance estimates: where the next one starts
    /// (decayed acceptance then follows its own prompt).
    acceptance: std::sync::Mutex<Option<Acceptance>>,
    /// Finished sequences' caches for prompts that start the same way (off unless enabled).
    prefix: Option<std::sync::Mutex<prefix::PrefixCache>>,
    /// Cache bytes (target per position, target fixed, draft per position), measured once.
    cache_sizes: std::sync::OnceLock<(u64, u64, u64)>,
}

impl Engine {
    pub fn new(target: Box<dyn TargetModel>, draft: Option<DraftModel>) -> Self {
        let max_context = target.info().max_position;
        // The verify cost curve's shape up to 1,024 rows (64 sequences of 16); flat beyond.
        let shape = (0..=1024).map(|r| target.verify_bytes(r)).collect();
        Self {
            target,
            draft,
            max_context,
            policy: std::sync::Mutex::new(Policy::new().with_verify_shape(shape)),
            acceptance: std::sync::Mutex::new(None),
            prefix: None,
            cache_sizes: Default::default(),
        }
    }

    /// The positions a generation of `req` allocates its caches for, its block size, and
    /// whether it drafts (the one rule [`Sequence::new`] and [`Self::request_cache_bytes`] use).
    pub(crate) fn plan(&self, req: &GenerateRequest) -> (usize, usize, bool) {
        let q_max = self.block_size(req);
        let drafts = self.draft.is_some() && q_max > 1;
        let capacity = req
            .prompt_ids
            .len()
            .saturating_add(req.max_tokens)
            .saturating_add(q_max)
            .min(self.max_context);
        (capacity, q_max, drafts)
    }

    /// The bytes of KV cache (and recurrent state) a generation of `req` holds while it runs,
    /// target and draft: measured from the caches themselves (a 1- and a 2-position cache of
    /// each, once), so it is what they allocate. The server admits requests by it.
    pub fn request_cache_bytes(&self, req: &GenerateRequest) -> Result<u64> {
        let (capacity, _, drafts) = self.plan(req);
        let sizes = match self.cache_sizes.get() {
            Some(s) => *s,
            None => {
                let t1 = self.target.new_cache(1)?.bytes() as u64;
                let t2 = self.target.new_cache(2)?.bytes() as u64;
                let d = match &self.draft {
                    Some(d) => (d.new_cache(2)?.bytes() - d.new_cache(1)?.bytes()) as u64,
                    None => 0,
                };
                let per = t2.saturating_sub(t1);
                *self
                    .cache_sizes
                    .get_or_init(|| (per, t1.saturating_sub(per), d))
            }
        };
        let (per, fixed, dper) = sizes;
        let draft = if drafts { dper * capacity as u64 } else { 0 };
        Ok(per * capacity as u64 + fixed + draft)
    }

    /// Keep finished sequences' caches (up to `bytes`) for later prompts that share a prefix.
    pub fn enable_prefix_cache(&mut self, bytes: usize) {
        self.prefix = (bytes > 0).then(|| std::sync::Mutex::new(prefix::PrefixCache::new(bytes)));
    }

    /// The prefix cache's counters (None when it is off).
    pub fn prefix_stats(&self) -> Option<prefix::PrefixStats> {
        self.prefix
            .as_ref()
            .and_then(|p| p.lock().ok().map(|p| p.stats))
    }

    /// The block size a request will run with.
    pub fn block_size(&self, req: &GenerateRequest) -> usize {
        match (&self.draft, req.block_size) {
            (None, _) => 1,
            (Some(d), None) => d.block_size(),
            (Some(_), Some(b)) => b.max(1),
        }
    }

    /// Every sequence's block size for the next cycle (the adaptive policy over the engine's
    /// cost estimates).
    fn choose_blocks(&self, wants: &[Want]) -> Vec<(usize, Reason)> {
        self.policy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .choose(wants)
    }

    /// Record the costs of a cycle of `seqs` sequences: a target forward of `rows` rows that
    /// took `verify_s` (until its choices were read), and the draft call of `rows` block rows
    /// and seconds, if one ran and its time is representative.
    fn observe_costs(&self, seqs: usize, rows: usize, verify_s: f64, draft: Option<(usize, f64)>) {
        let mut p = self
            .policy
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        p.observe_verify(seqs, rows, verify_s);
        if let Some((r, s)) = draft {
            p.observe_draft(seqs, r, s);
        }
    }

    /// Generate; `on_tokens` receives each batch of newly committed ids and may stop early.
    pub fn generate(
        &self,
        req: &GenerateRequest,
        on_tokens: &mut dyn FnMut(&[u32]) -> Flow,
    ) -> Result<GenerateOutput> {
        let mut s = Sequence::start(self, req.clone(), Box::new(on_tokens))?;
        while !s.is_done() {
            s.cycle()?;
        }
        Ok(s.finish())
    }

    /// Generate for several requests together: every cycle, one draft call and one target
    /// verify serve all sequences still running (each with its own block size, positions,
    /// acceptance, rollback and stop); a sequence leaves the batch when it finishes.
    /// `on_tokens(i, ids)` receives request `i`'s newly committed ids. Each request's output
    /// is what it gets alone (its sampler, policy and caches are its own). A request that
    /// fails (bad input) fails alone: its slot holds the error.
    pub fn generate_batch(
        &self,
        reqs: &[GenerateRequest],
        on_tokens: &mut dyn FnMut(usize, &[u32]) -> Flow,
    ) -> Vec<Result<GenerateOutput>> {
        self.generate_queue(reqs, reqs.len(), on_tokens)
    }

    /// [`Engine::generate_batch`] with at most `in_flight` requests in the batch: the requests
    /// are admitted in order, the next one as soon as a running one finishes (continuous
    /// batching, as a server under steady load runs), so the batch stays full until the queue
    /// is empty. A request's time (TTFT, latency) counts from its admission.
    pub fn generate_queue(
        &self,
        reqs: &[GenerateRequest],
        in_flight: usize,
        on_tokens: &mut dyn FnMut(usize, &[u32]) -> Flow,
    ) -> Vec<Result<GenerateOutput>> {
        self.generate_queue_gated(reqs, in_flight, on_tokens, &mut |_| true)
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::input("request was never run"))))
            .collect()
    }

    /// [`Engine::generate_queue`] asking `admit(i)` before admitting request `i`: after the
    /// first false none is admitted (those running finish), and the requests never admitted
    /// come back as None. A time budget over a long queue stops it without cutting answers.
    pub fn generate_queue_gated(
        &self,
        reqs: &[GenerateRequest],
        in_flight: usize,
        on_tokens: &mut dyn FnMut(usize, &[u32]) -> Flow,
        admit: &mut dyn FnMut(usize) -> bool,
    ) -> Vec<Option<Result<GenerateOutput>>> {
        let cb = std::cell::RefCell::new(on_tokens);
        let mut results: Vec<Option<Result<GenerateOutput>>> =
            (0..reqs.len()).map(|_| None).collect();
        let mut batch = Batch::new(self);
        let (mut next, mut open) = (0, true);
        loop {
            while open && batch.len() < in_flight.max(1) && next < reqs.len() {
                if !admit(next) {
                    open = false;
                    break;
                }
                let (i, cb) = (next, &cb);
                next += 1;
                let f: Box<dyn FnMut(&[u32]) -> Flow + '_> =
                    Box::new(move |ids: &[u32]| (cb.borrow_mut())(i, ids));
                match Sequence::new(self, reqs[i].clone(), f) {
                    Ok(s) => batch.push(i, s),
                    Err(e) => results[i] = Some(Err(e)),
                }
            }
            if batch.is_empty() {
                break;
            }
            for (i, r) in batch.step() {
                results[i] = Some(r);
            }
        }
        results
    }

    /// Append committed ids, honouring stop tokens (cut after the first) and max tokens.
    fn commit(
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
    fn choose(logits: &Tensor, sampler: &mut Sampler) -> Result<Vec<u32>> {
        if let Some(ids) = crate::sampling::choose_rows_at_once(logits, sampler)? {
            sampler.skip(ids.len());
            return Ok(ids);
        }
        let mut rows = logits.to_vec2::<f32>()?;
        Ok(rows
            .iter_mut()
            .map(|r| sampler.sample_after(r, &[]))
            .collect())
    }

    /// Target choices `post[0..=a]` where `a` is the number of accepted draft tokens:
    /// `block[i] == post[i-1]` for i in 1..=a, and `post[a]` is the bonus token.
    /// `at_once`: the rows' choices when the caller made them already
    /// ([`crate::sampling::choose_rows_at_once_many`] for a batch).
    fn choose_until_mismatch(
        logits: &Tensor,
        block: &[u32],
        sampler: &mut Sampler,
        at_once: Option<Vec<u32>>,
    ) -> Result<Vec<u32>> {
        let q = block.len();
        // Every row chosen at once (greedy, or drawn on the device with the uniforms the host
        // would use in turn), else row by row on the host; either way only the rows up to the
        // first mismatch are kept, and only their uniforms drawn.
        // With logit adjustments row i is adjusted for the history plain decoding would have
        // there: the committed tokens and the proposals block[1..=i] (sampling's docs).
        let all = match at_once {
            Some(ids) => Some(ids),
            None => crate::sampling::choose_rows_at_once(logits, sampler)?,
        };
        let mut rows = match all {
            Some(_) => Vec::new(),
            None => logits.to_vec2::<f32>()?,
        };
        let mut post = Vec::with_capacity(q);
        for i in 0..q {
            let t = match &all {
                Some(all) => all[i],
                None => sampler.sample_after(&mut rows[i], &block[1..=i]),
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
