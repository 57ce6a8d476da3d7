//! One generation's decode state ([`Sequence`]) and the steps of a cycle over it, and a set of
//! sequences decoded together ([`Batch`]).
//!
//! A cycle: **plan** (this cycle's block size: the adaptive policy, the tokens left, the room
//! in the cache) -> **propose** (the draft fills the block after the last committed token) ->
//! **verify** (the target's logits for every block row) -> **accept** (the target's choices up
//! to the first mismatch, the bonus token) -> **rollback** (the target cache cut to the
//! committed rows; the hybrids rebuild their recurrent state) -> **commit** (stop tokens, max
//! tokens, the caller's callback). [`Sequence::cycle`] runs them for one sequence;
//! [`Batch::step`] runs each step for every sequence of the batch, with one draft call and
//! one target verify for all of them.

use super::adaptive::{Acceptance, Reason, Want};
use super::{Engine, Flow, GenerateOutput, GenerateRequest, StepTrace};
use crate::archs::{BatchItem, ForwardOutput, Logits, TargetCache};
use crate::draft::{DraftCache, DraftModel};
use crate::sampling::Sampler;
use crate::stats::GenerationStats;
use crate::{Error, Result};
use candle_core::Tensor;
use std::time::Instant;

/// The decode state of one request.
pub struct Sequence<'e> {
    engine: &'e Engine,
    pub req: GenerateRequest,
    on_tokens: Box<dyn FnMut(&[u32]) -> Flow + 'e>,
    draft: Option<&'e DraftModel>,
    q_max: usize,
    capacity: usize,
    tcache: TargetCache,
    dcache: Option<DraftCache>,
    sampler: Sampler,
    stats: GenerationStats,
    steps: Option<Vec<StepTrace>>,
    /// Acceptance estimates (with a draft); `adaptive`: the policy picks each block size.
    acceptance: Option<Acceptance>,
    adaptive: bool,
    out: Vec<u32>,
    /// Taps of committed positions not yet given to the draft (concatenated at its next call).
    ctx_rows: Vec<Tensor>,
    /// Position of the last committed token (the next block's row 0).
    start: usize,
    last: u32,
    draft_tokens: usize,
    finish: Option<&'static str>,
    decode_t0: Instant,
    /// The first draft call (draft prefill) is not decode time.
    excluded_s: f64,
    first_draft: bool,
    /// The cycle in flight: its block (row 0 + proposals) and the draft's time.
    block: Vec<u32>,
    draft_s: Option<f64>,
    /// Prompt tokens already through the target (the prefill runs in chunks in a batch).
    prefilled: usize,
    created: Instant,
    /// Time spent in prefill forwards (for prefill tok/s).
    prefill_s: f64,
}

/// The target's choices for a verified block (up to the first mismatch) and its taps.
pub struct Verified {
    post: Vec<u32>,
    taps: Option<Tensor>,
}

/// Most prompt tokens a sequence prefills per batch step, so that a long prompt does not stall
/// the other sequences' decoding for its whole length (see [`prefill_rows`]).
pub const PREFILL_CHUNK: usize = 512;

/// Prompt tokens the prefill chunk starting at position `pos` takes. On a GPU always
/// [`PREFILL_CHUNK`] (its prefill rows' bits may depend on the chunk's row count, so the chunks
/// are fixed). On the CPU a chunk's cost grows with the context it attends to, and the server
/// can cancel or time out a request only between chunks: the chunk shrinks as the position
/// grows (384 rows at the start, ~150 at 1k, ~60 at 3.5k, at least 48) so that one chunk stays
/// under a second on the 2-core demo box (docs/perf.md, session 22). The CPU path gives a
/// row the same bits in any chunk (tests/batch.rs), and the rule depends on the position only,
/// so outputs do not depend on it.
pub fn prefill_rows(pos: usize, cuda: bool) -> usize {
    if cuda {
        PREFILL_CHUNK
    } else {
        (PREFILL_CHUNK * 1536 / (2048 + 3 * pos)).clamp(48, PREFILL_CHUNK * 3 / 4)
    }
}

impl<'e> Sequence<'e> {
    /// Check the request, make the caches, prefill the prompt and commit the first token.
    pub fn start(
        engine: &'e Engine,
        req: GenerateRequest,
        on_tokens: Box<dyn FnMut(&[u32]) -> Flow + 'e>,
    ) -> Result<Self> {
        let mut s = Self::new(engine, req, on_tokens)?;
        let p = s.req.prompt_ids.len();
        let t0 = Instant::now();
        let taps = s.taps();
        let at = s.prefilled;
        let pre = engine.target.forward(
            &s.req.prompt_ids[at..],
            at,
            &mut s.tcache,
            taps,
            Logits::Last,
        )?;
        s.prefilled = p;
        s.after_prefill(pre, t0.elapsed().as_secs_f64())?;
        Ok(s)
    }

    /// Check the request and make the caches; the prompt is prefilled later
    /// ([`Self::start`] alone, or chunk by chunk in a [`Batch`]).
    pub fn new(
        engine: &'e Engine,
        req: GenerateRequest,
        on_tokens: Box<dyn FnMut(&[u32]) -> Flow + 'e>,
    ) -> Result<Self> {
        req.sampling.validate()?;
        let p = req.prompt_ids.len();
        if p == 0 {
            return Err(Error::input("empty prompt: nothing to condition on"));
        }
        if p >= engine.max_context {
            return Err(Error::input(format!(
                "context overflow: the prompt has {p} tokens, the context size is {}; shorten the prompt",
                engine.max_context
            )));
        }
        let (capacity, q_max, drafts) = engine.plan(&req);
        if q_max > 64 {
            return Err(Error::input(format!(
                "block size {q_max} is larger than 64"
            )));
        }
        let draft = engine.draft.as_ref().filter(|_| drafts);
        if let Some(&bad) = req
            .prompt_ids
            .iter()
            .find(|&&t| t as usize >= engine.target.info().vocab_size)
        {
            return Err(Error::input(format!(
                "token id {bad} out of range: vocab size is {}",
                engine.target.info().vocab_size
            )));
        }
        let target = engine.target.as_ref();
        let hit = match &engine.prefix {
            Some(pc) => pc
                .lock()
                .map_err(|_| Error::input("prefix cache lock poisoned"))?
                .lookup(&req.prompt_ids, capacity, draft.is_some())?,
            None => None,
        };
        let (tcache, dcache, prefilled, ctx_rows) = match hit {
            Some(h) => (h.tcache, h.dcache, h.len, h.pending.into_iter().collect()),
            None => (
                target.new_cache(capacity)?,
                draft.map(|d| d.new_cache(capacity)).transpose()?,
                0,
                Vec::new(),
            ),
        };
        let vocab = engine.target.info().vocab_size;
        if let Some(&(t, _)) = req
            .sampling
            .logit_bias
            .iter()
            .find(|(t, _)| *t as usize >= vocab)
        {
            return Err(Error::input(format!(
                "logit_bias: token id {t} out of range: vocab size is {vocab}"
            )));
        }
        let mut sampler = Sampler::for_prompt(req.sampling.clone(), &req.prompt_ids);
        if let Some(g) = &req.grammar {
            sampler = sampler.with_constraint(g.start()?);
        }
        let mut stats = GenerationStats {
            mode: if draft.is_some() { "dflash" } else { "plain" }.into(),
            block_size: q_max,
            prompt_tokens: p,
            cached_prompt_tokens: prefilled,
            ..Default::default()
        };
        let steps = req.trace.then(Vec::new);
        // Acceptance starts from the last finished generation's (same block size).
        let acceptance = draft.is_some().then(|| {
            engine
                .acceptance
                .lock()
                .ok()
                .and_then(|slot| slot.clone())
                .filter(|a| a.max_q() == q_max)
                .unwrap_or_else(|| Acceptance::new(q_max))
        });
        let adaptive = draft.is_some() && req.adaptive && req.block_size.is_none();
        stats.adaptive = adaptive;
        stats.q_histogram = vec![0; q_max + 1];

        Ok(Self {
            engine,
            req,
            on_tokens,
            draft,
            q_max,
            capacity,
            tcache,
            dcache,
            sampler,
            stats,
            steps,
            acceptance,
            adaptive,
            out: Vec::new(),
            ctx_rows,
            start: p,
            last: 0,
            draft_tokens: 0,
            finish: None,
            decode_t0: Instant::now(),
            excluded_s: 0.0,
            first_draft: true,
            block: Vec::new(),
            draft_s: None,
            prefilled,
            created: Instant::now(),
            prefill_s: 0.0,
        })
    }

    /// Whether prompt tokens are still to go through the target.
    pub fn prefilling(&self) -> bool {
        self.prefilled < self.req.prompt_ids.len()
    }

    /// The next prefill chunk: its tokens, start position and whether it is the last one.
    fn prefill_chunk(&self) -> (&[u32], usize, bool) {
        let p = self.req.prompt_ids.len();
        let cuda = self.engine.target.info().device.is_cuda();
        let end = (self.prefilled + prefill_rows(self.prefilled, cuda)).min(p);
        (
            &self.req.prompt_ids[self.prefilled..end],
            self.prefilled,
            end == p,
        )
    }

    /// A prefill chunk went through: its taps are the draft's context; after the last one,
    /// the first token is chosen and committed.
    fn after_prefill_chunk(&mut self, fw: ForwardOutput, n: usize, secs: f64) -> Result<()> {
        self.prefilled += n;
        self.prefill_s += secs;
        if self.prefilling() {
            self.ctx_rows.extend(fw.taps);
            return Ok(());
        }
        self.after_prefill(fw, 0.0)
    }

    fn after_prefill(&mut self, pre: ForwardOutput, secs: f64) -> Result<()> {
        self.prefill_s += secs;
        let first = Engine::choose(&pre.logits.expect("prefill logits"), &mut self.sampler)?[0];
        self.ctx_rows.extend(pre.taps);
        let p = self.req.prompt_ids.len();
        self.stats.ttft_ms = self.created.elapsed().as_secs_f64() * 1e3;
        self.stats.prefill_tok_s = p as f64 / self.prefill_s.max(1e-9);
        self.last = first;
        self.block = vec![first];
        let (_, finish) = Engine::commit(&[first], &self.req, &mut self.out, &mut *self.on_tokens);
        self.sampler.commit(&[first]);
        self.finish = finish;
        self.decode_t0 = Instant::now();
        self.grammar_ok()
    }

    /// An internal failure of the grammar engine ends the generation with it (never a
    /// silently unconstrained output).
    fn grammar_ok(&self) -> Result<()> {
        match self.sampler.constraint().and_then(|c| c.error()) {
            Some(e) => Err(Error::input(e)),
            None => Ok(()),
        }
    }

    /// Bytes its caches hold (target and draft; what [`Engine::request_cache_bytes`] predicts).
    pub fn cache_bytes(&self) -> u64 {
        (self.tcache.bytes() + self.dcache.as_ref().map_or(0, |d| d.bytes())) as u64
    }

    pub fn is_done(&self) -> bool {
        self.finish.is_some()
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.out.len()
    }

    /// The taps the target returns for this sequence's draft.
    fn taps(&self) -> &'e [usize] {
        self.draft.map_or(&[], |d| &d.taps)
    }

    /// Plan, first half: the most rows this cycle may verify (the block size, the tokens left
    /// + 1, the room in the cache), or None when the sequence runs no cycle (done, still
    /// prefilling, or the cache is full: then it ends).
    pub fn limit(&mut self) -> Option<usize> {
        if self.finish.is_some() || self.prefilling() {
            return None;
        }
        let room = self.capacity.saturating_sub(self.start);
        if room == 0 {
            self.finish = Some("context");
            return None;
        }
        // Near the end the block shrinks to the tokens left + 1 rows (as the reference
        // does: the last row's proposal can still be accepted; commits are capped).
        Some(
            self.q_max
                .min(self.req.max_tokens - self.out.len() + 1)
                .min(room),
        )
    }

    /// What the adaptive policy is asked for this sequence, given its [`Self::limit`].
    pub fn want(&self, limit: usize) -> Want<'_> {
        Want {
            acceptance: self.acceptance.as_ref(),
            adaptive: self.adaptive,
            limit,
        }
    }

    /// Plan, second half: this cycle's block is `q` rows (row 0 the last committed token,
    /// the rest the mask for the draft to fill).
    pub fn set_block(&mut self, q: usize, reason: Reason) {
        self.stats.q_histogram[q] += 1;
        if self.adaptive {
            *self
                .stats
                .q_reasons
                .entry(format!("{reason:?}").to_lowercase())
                .or_default() += 1;
        }
        self.block = vec![self.last];
        self.block
            .resize(q, self.draft.map_or(0, |d| d.mask_token_id()));
        self.draft_s = None;
    }

    /// Whether this cycle asks the draft for proposals.
    pub fn wants_draft(&self) -> bool {
        self.draft.is_some() && self.block.len() > 1
    }

    /// Propose: the draft fills the block (batch 1).
    pub fn propose(&mut self) -> Result<()> {
        let (Some(d), true) = (self.draft, self.wants_draft()) else {
            return Ok(());
        };
        let td = Instant::now();
        let ctx = self.take_context()?;
        let dc = self.dcache.as_mut().expect("a draft has a cache");
        let props = d.propose(
            self.engine.target.as_ref(),
            &ctx,
            &self.block,
            self.start,
            dc,
            Some(&self.sampler),
        )?;
        self.set_proposal(&props, td.elapsed().as_secs_f64());
        Ok(())
    }

    /// The draft's pending context rows, as one tensor.
    fn take_context(&mut self) -> Result<Tensor> {
        Ok(match self.ctx_rows.len() {
            1 => self.ctx_rows.pop().expect("one"),
            _ => Tensor::cat(&std::mem::take(&mut self.ctx_rows), 0)?,
        })
    }

    /// The draft's proposals for block rows 1.., and the time the draft call took.
    fn set_proposal(&mut self, props: &[u32], dt: f64) {
        self.block[1..].copy_from_slice(props);
        if self.first_draft {
            self.excluded_s = dt;
            self.first_draft = false;
        } else {
            self.stats.draft_ms += dt * 1e3;
            self.draft_s = Some(dt);
        }
    }

    /// Verify (batch 1): the target's logits for every block row.
    pub fn verify(&mut self) -> Result<ForwardOutput> {
        let taps = self.taps();
        self.engine
            .target
            .forward(&self.block, self.start, &mut self.tcache, taps, Logits::All)
    }

    /// Accept, first half: the target's choices row by row up to the first mismatch (the
    /// last one is the bonus token). This reads the verify's result to the host, so on a GPU
    /// it is where the cycle waits for the verify.
    /// `at_once`: the rows' choices, when the batch made them for every sequence together.
    pub fn choose(&mut self, fw: ForwardOutput, at_once: Option<Vec<u32>>) -> Result<Verified> {
        let logits = fw.logits.as_ref().expect("verify logits");
        let post = Engine::choose_until_mismatch(logits, &self.block, &mut self.sampler, at_once)?;
        Ok(Verified {
            post,
            taps: fw.taps,
        })
    }

    /// Accept, second half, then roll back and commit: the cache cut to the committed rows,
    /// the committed rows' taps kept for the draft, the tokens handed to the callback.
    /// `verify_s`: the verify's time, until its choices were read.
    pub fn accept(&mut self, v: Verified, verify_s: f64) -> Result<()> {
        let Verified { post, taps } = v;
        let a = post.len() - 1;
        let q = self.block.len();
        self.stats.verify_ms += verify_s * 1e3;
        if let Some(acc) = self.acceptance.as_mut() {
            acc.observe(q, a);
        }
        // Rollback.
        let tr = Instant::now();
        self.tcache.truncate(self.start + a + 1)?;
        if a + 1 < q && self.tcache.has_recurrent() {
            // the rebuild runs on the device: wait for it so that the time is its own
            self.engine.target.info().device.synchronize()?;
        }
        self.stats.rollback_ms += tr.elapsed().as_secs_f64() * 1e3;
        if let Some(t) = taps {
            // Taps of the committed rows 0..=a become the draft's next context rows (a
            // single-token step without a draft call keeps accumulating them).
            self.ctx_rows.push(t.narrow(0, 0, a + 1)?);
        }
        if let Some(s) = self.steps.as_mut() {
            s.push(StepTrace {
                start: self.start,
                block_ids: self.block.clone(),
                accepted: a,
            });
        }
        // Commit.
        let mut commit: Vec<u32> = self.block[1..=a].to_vec();
        commit.push(post[a]);
        self.start += a + 1;
        self.last = post[a];
        let (pushed, f) = Engine::commit(&commit, &self.req, &mut self.out, &mut *self.on_tokens);
        self.sampler.commit(&commit[..pushed]);
        // Tokens committed this cycle: a + 1, less any cut by a stop token or max tokens.
        self.stats.acceptance_lengths.push(pushed);
        // Tokens cut after a stop were never committed: they do not count as drafted.
        self.draft_tokens += pushed.min(a);
        self.finish = f;
        self.grammar_ok()
    }

    /// One whole cycle for this sequence alone.
    pub fn cycle(&mut self) -> Result<()> {
        let Some(limit) = self.limit() else {
            return Ok(());
        };
        let (q, reason) = self.engine.choose_blocks(&[self.want(limit)])[0];
        self.set_block(q, reason);
        self.propose()?;
        let tv = Instant::now();
        let fw = self.verify()?;
        let v = self.choose(fw, None)?;
        let verify_s = tv.elapsed().as_secs_f64();
        self.engine
            .observe_costs(1, q, verify_s, self.draft_s.map(|d| (q, d)));
        self.accept(v, verify_s)
    }

    /// End the generation: its output and statistics (the adaptive estimates go back to the
    /// engine for the next generation).
    pub fn finish(mut self) -> GenerateOutput {
        if let (Some(a), Ok(mut slot)) = (self.acceptance.take(), self.engine.acceptance.lock()) {
            *slot = Some(a);
        }
        // Keep the caches for later prompts that start the same way (a failure to keep them
        // only costs a later prefill).
        if let (Some(pc), false) = (&self.engine.prefix, self.prefilling()) {
            let mut ids = self.req.prompt_ids.clone();
            ids.extend_from_slice(&self.out);
            let pending = match self.ctx_rows.len() {
                0 => None,
                1 => self.ctx_rows.pop(),
                _ => Tensor::cat(&self.ctx_rows, 0).ok(),
            };
            if let Ok(mut pc) = pc.lock() {
                if let Err(e) = pc.insert(&ids, &self.tcache, self.dcache.as_ref(), pending) {
                    tracing::debug!("prefix cache: not kept: {e}");
                }
            }
        }
        let mut stats = self.stats;
        let decode_s = (self.decode_t0.elapsed().as_secs_f64() - self.excluded_s).max(1e-9);
        stats.generated_tokens = self.out.len();
        stats.decode_ms = decode_s * 1e3;
        stats.decode_tok_s = self.out.len().saturating_sub(1) as f64 / decode_s;
        stats.finish_reason = self.finish.unwrap_or("length").into();
        if let Some(c) = self.sampler.constraint() {
            let (t, n) = c.mask_cost();
            stats.grammar_masks = n;
            stats.grammar_mask_ms = t.as_secs_f64() * 1e3;
        }
        if self.draft.is_some() {
            let plain = stats.q_histogram.get(1).copied().unwrap_or(0);
            let total: usize = stats.q_histogram.iter().sum();
            if total > 0 && plain * 2 > total {
                stats.fallback_reason = Some(format!(
                    "adaptive policy ran {plain} of {total} cycles as plain decoding (speculation measured slower)"
                ));
            }
        }
        stats.finish(self.draft_tokens);
        GenerateOutput {
            output_ids: self.out,
            stats,
            steps: self.steps,
        }
    }
}

/// Sequences decoded together: each cycle runs every step for all of them, the draft once
/// for all sequences that propose and the target once for all blocks.
pub struct Batch<'e> {
    engine: &'e Engine,
    seqs: Vec<(usize, Sequence<'e>)>,
}

impl<'e> Batch<'e> {
    pub fn new(engine: &'e Engine) -> Self {
        Self {
            engine,
            seqs: Vec::new(),
        }
    }

    /// Add a started sequence under the caller's id (it joins at the next step).
    pub fn push(&mut self, id: usize, s: Sequence<'e>) {
        self.seqs.push((id, s));
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Take the sequence with the caller's `id` out of the batch (a cancelled request), if it
    /// is there.
    pub fn take(&mut self, id: usize) -> Option<Sequence<'e>> {
        let k = self.seqs.iter().position(|(i, _)| *i == id)?;
        Some(self.seqs.remove(k).1)
    }

    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Under `DFLASH_PROFILE=ncu-batch`: the profiler's collection around this step when it is
    /// the 11th or 12th step of 8 or more sequences in the process (see `stats::profiler_range`).
    fn profiled_step(&self) -> Option<Box<dyn std::any::Any>> {
        static BIG_STEPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        if self.seqs.len() < 8 {
            return None;
        }
        crate::stats::profiled_steps(crate::switches::Profile::NcuBatch, &BIG_STEPS, 10..12)
    }

    /// One cycle for every sequence; returns the ones that ended (and leave the batch), with
    /// their outputs or errors.
    pub fn step(&mut self) -> Vec<(usize, Result<GenerateOutput>)> {
        let mut failed: Vec<(usize, Error)> = Vec::new();
        let _ncu = self.profiled_step();
        let mut prof =
            crate::stats::SectionTimer::start("batch step", &self.engine.target.info().device);
        // Plan: one choice of block sizes for the whole batch.
        let limits: Vec<Option<usize>> = self.seqs.iter_mut().map(|(_, s)| s.limit()).collect();
        let active: Vec<bool> = limits.iter().map(Option::is_some).collect();
        let choice = {
            let wants: Vec<Want> = self
                .seqs
                .iter()
                .zip(&limits)
                .filter_map(|((_, s), l)| l.map(|l| s.want(l)))
                .collect();
            self.engine.choose_blocks(&wants)
        };
        let mut choice = choice.into_iter();
        for ((_, s), l) in self.seqs.iter_mut().zip(&limits) {
            if l.is_some() {
                let (q, reason) = choice.next().expect("a choice per active sequence");
                s.set_block(q, reason);
            }
        }
        prof.mark("plan");
        // Propose: one draft call for every sequence that asks.
        let mut draft_cost = None;
        if let Some(d) = self.engine.draft.as_ref() {
            let target = self.engine.target.as_ref();
            let mut idx = Vec::new();
            let mut items = Vec::new();
            let td = Instant::now();
            for (k, (_, s)) in self.seqs.iter_mut().enumerate() {
                if !active[k] || !s.wants_draft() {
                    continue;
                }
                match s.take_context() {
                    Ok(ctx) => {
                        idx.push(k);
                        let Sequence {
                            block,
                            start,
                            dcache,
                            sampler,
                            ..
                        } = s;
                        items.push(crate::draft::DraftItem {
                            ctx,
                            block: block.as_slice(),
                            start: *start,
                            cache: dcache.as_mut().expect("a draft has a cache"),
                            guide: Some(&*sampler),
                        });
                    }
                    Err(e) => failed.push((k, e)),
                }
            }
            if !items.is_empty() {
                let r = d.propose_batch(target, &mut items);
                drop(items);
                let dt = td.elapsed().as_secs_f64();
                // a sequence's first call also prefills the draft's context: not a cost sample
                if idx.iter().all(|&k| !self.seqs[k].1.first_draft) {
                    let rows = idx.iter().map(|&k| self.seqs[k].1.block.len()).sum();
                    draft_cost = Some((rows, dt));
                }
                match r {
                    Ok(props) => {
                        for (k, p) in idx.iter().zip(props) {
                            self.seqs[*k].1.set_proposal(&p, dt);
                        }
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        failed.extend(idx.iter().map(|&k| (k, Error::input(msg.clone()))));
                    }
                }
            }
        }
        prof.mark("propose");
        // Prefill: one target forward for the next prompt chunk of every sequence still
        // prefilling (apart from the verify below, so that the adaptive policies see the
        // verify's cost alone).
        let taps: &[usize] = self.engine.draft.as_ref().map_or(&[], |d| &d.taps);
        let mut idx = Vec::new();
        let mut lens = Vec::new();
        let mut items = Vec::new();
        for (k, (_, s)) in self.seqs.iter_mut().enumerate() {
            if !s.prefilling() || s.finish.is_some() || failed.iter().any(|(f, _)| *f == k) {
                continue;
            }
            let (tokens, start, last) = s.prefill_chunk();
            let n = tokens.len();
            idx.push(k);
            lens.push(n);
            let Sequence { req, tcache, .. } = s;
            items.push(BatchItem {
                tokens: &req.prompt_ids[start..start + n],
                start,
                cache: tcache,
                logits: if last { Logits::Last } else { Logits::None },
            });
        }
        if !items.is_empty() {
            let tp = Instant::now();
            let r = self.engine.target.forward_batch(&mut items, taps);
            drop(items);
            let secs = tp.elapsed().as_secs_f64();
            match r {
                Ok(outs) => {
                    for ((k, fw), n) in idx.iter().zip(outs).zip(&lens) {
                        let s = &mut self.seqs[*k].1;
                        if let Err(e) = fw.and_then(|fw| s.after_prefill_chunk(fw, *n, secs)) {
                            failed.push((*k, e));
                        }
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    failed.extend(idx.iter().map(|&k| (k, Error::input(msg.clone()))));
                }
            }
        }
        prof.mark("prefill");
        // Verify: one target forward for every block.
        let mut idx = Vec::new();
        let mut items = Vec::new();
        for (k, (_, s)) in self.seqs.iter_mut().enumerate() {
            if !active[k] || failed.iter().any(|(f, _)| *f == k) {
                continue;
            }
            idx.push(k);
            let Sequence {
                block,
                start,
                tcache,
                ..
            } = s;
            items.push(BatchItem {
                tokens: block.as_slice(),
                start: *start,
                cache: tcache,
                logits: Logits::All,
            });
        }
        if !items.is_empty() {
            let tv = Instant::now();
            let r = self.engine.target.forward_batch(&mut items, taps);
            drop(items);
            prof.mark("verify forward");
            match r {
                Ok(outs) => {
                    // Every sequence's choices first (one launch and one read for all the
                    // sequences that choose alike on the device; the first read waits for the
                    // forward), then the verify's time, then accept, roll back and commit.
                    let at_once = {
                        let parts: Vec<(&Tensor, Option<&crate::nn::PartOf>, &Sampler)> = idx
                            .iter()
                            .zip(&outs)
                            .filter_map(|(k, fw)| {
                                let fw = fw.as_ref().ok()?;
                                let l = fw.logits.as_ref()?;
                                Some((l, fw.logits_in_batch.as_ref(), &self.seqs[*k].1.sampler))
                            })
                            .collect();
                        match crate::sampling::choose_rows_at_once_many(&parts) {
                            Ok(ids) if parts.len() == idx.len() => ids,
                            _ => vec![None; idx.len()],
                        }
                    };
                    let mut chosen = Vec::with_capacity(idx.len());
                    let mut rows = 0;
                    for ((k, fw), ids) in idx.iter().zip(outs).zip(at_once) {
                        let s = &mut self.seqs[*k].1;
                        rows += s.block.len();
                        match fw.and_then(|fw| s.choose(fw, ids)) {
                            Ok(v) => chosen.push((*k, v)),
                            Err(e) => failed.push((*k, e)),
                        }
                    }
                    let verify_s = tv.elapsed().as_secs_f64();
                    let seqs = active.iter().filter(|&&a| a).count();
                    self.engine.observe_costs(seqs, rows, verify_s, draft_cost);
                    for (k, v) in chosen {
                        if let Err(e) = self.seqs[k].1.accept(v, verify_s) {
                            failed.push((k, e));
                        }
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    failed.extend(idx.iter().map(|&k| (k, Error::input(msg.clone()))));
                }
            }
        }
        prof.mark("accept");
        prof.finish();
        // Leave: finished and failed sequences.
        let mut ended = Vec::new();
        let mut k = 0;
        let mut i = 0;
        while i < self.seqs.len() {
            let fail = failed.iter().position(|(f, _)| *f == k);
            if fail.is_some() || self.seqs[i].1.is_done() {
                let (id, s) = self.seqs.remove(i);
                match fail {
                    Some(j) => {
                        let (_, e) = failed.swap_remove(j);
                        ended.push((id, Err(e)));
                    }
                    None => ended.push((id, Ok(s.finish()))),
                }
            } else {
                i += 1;
            }
            k += 1;
        }
        ended
    }
}
