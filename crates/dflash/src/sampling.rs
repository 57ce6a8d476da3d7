//! Token choice from target logits: greedy, or a sample from the temperature / top-k /
//! top-p / min-p processed distribution with a seeded PRNG.
//!
//! The draft is always greedy; the target samples. In the speculative loop a draft token is
//! accepted iff it equals the target's own sample at that position (sample-and-compare), so
//! every committed token is a true sample of the target distribution: lossless at any T.
//!
//! Logit adjustments (OpenAI `logit_bias`, `presence_penalty`, `frequency_penalty`, and the
//! `repetition_penalty` of HF / vLLM) change the target distribution itself, so they must be
//! applied exactly where plain decoding would: verify row i sees the history plain decoding
//! would have had at that position, i.e. the committed tokens plus the block's proposals
//! before it ([`Sampler::adjusted`]'s `extra`); if the proposals are accepted that history is
//! the true one, and if not the row is discarded. The draft's greedy proposals see the same
//! adjustment, or a biased-away token would keep being proposed and rejected.

use crate::rng::Rng;
use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    pub seed: u64,
    /// Added to the logits of these tokens (OpenAI `logit_bias`, each in [-100, 100]).
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted from the logit of every token generated so far (0 = off; in [-2, 2]).
    pub presence_penalty: f32,
    /// Times the number of times each token was generated so far (0 = off; in [-2, 2]).
    pub frequency_penalty: f32,
    /// HF / vLLM: the logit of every token of the prompt or the output so far divided by it
    /// where positive, multiplied where negative (1 = off; > 0).
    pub repetition_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
    /// Reject values no sampler can honour, naming the field.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::input(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::input(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::input(format!(
                "min_p must be in [0, 1], got {}",
                self.min_p
            )));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(Error::input(format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(Error::input(format!(
                "repetition_penalty must be a finite number > 0 (1 = off), got {}",
                self.repetition_penalty
            )));
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(Error::input(format!(
                "logit_bias of token {t} must be in [-100, 100], got {b}"
            )));
        }
        Ok(())
    }

    /// Whether any logit adjustment is on (bias or penalties).
    pub fn adjusts(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }
}

/// The token history the penalties read: how often each token was generated, and (for the
/// repetition penalty) the prompt's tokens.
#[derive(Debug, Clone, Default)]
struct History {
    counts: std::collections::HashMap<u32, u32>,
    prompt: std::collections::HashSet<u32>,
}

/// Greedy choice of every row of f32 `logits [rows, vocab]`, as [`argmax`] on each row (the
/// largest value, the lowest index among equal ones): on CUDA with our own kernel (candle's
/// argmax gives a 152k-word row to one block: tens of us), on the CPU vectorized, elsewhere
/// with candle's.
pub fn argmax_rows(logits: &candle_core::Tensor) -> crate::Result<Vec<u32>> {
    Ok(argmax_rows_tensor(logits)?.to_vec1::<u32>()?)
}

/// [`argmax_rows`] left where the logits are (u32 `[rows]`, no copy, no sync).
pub fn argmax_rows_tensor(logits: &candle_core::Tensor) -> crate::Result<candle_core::Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(ids) = crate::nn::cuda::argmax_rows(logits)? {
        return Ok(ids);
    }
    if let (true, candle_core::DType::F32, Ok((rows, vocab))) =
        (logits.device().is_cpu(), logits.dtype(), logits.dims2())
    {
        // the rows where they are, each by the vectorized [`argmax`] (candle's is one value
        // at a time: ~40 us a 49,152-token row)
        let (st, l) = logits.storage_and_layout();
        if let (candle_core::Storage::Cpu(c), Some((o, e))) = (&*st, l.contiguous_offsets()) {
            let v = &c.as_slice::<f32>()?[o..e];
            let ids: Vec<u32> = (0..rows)
                .map(|r| argmax(&v[r * vocab..(r + 1) * vocab]))
                .collect();
            return Ok(candle_core::Tensor::from_vec(ids, rows, logits.device())?);
        }
    }
    Ok(logits.argmax(candle_core::D::Minus1)?)
}

/// Every row's choice at once where that is possible: greedy ([`argmax_rows`]), or plain
/// temperature sampling on the device ([`sample_rows_on_device`]). The sampler is not advanced:
/// the caller [`Sampler::skip`]s the rows it keeps. None: sample row by row on the host.
pub fn choose_rows_at_once(
    logits: &candle_core::Tensor,
    sampler: &Sampler,
) -> crate::Result<Option<Vec<u32>>> {
    if sampler.adjusts() {
        return Ok(None);
    }
    if sampler.params.is_greedy() {
        return Ok(Some(argmax_rows(logits)?));
    }
    sample_rows_on_device(logits, sampler)
}

/// [`choose_rows_at_once`] for several sequences at once (a batch's verify rows): the
/// sequences that choose the same way on the device (greedy, or plain temperature sampling at
/// one temperature) get one launch and one read-back together instead of one each, the rows'
/// logits concatenated and each row with its own sequence's uniforms. Every row's choice is the
/// one [`choose_rows_at_once`] makes for its sequence alone (each row is chosen from its own
/// logits and uniform). `None` for a sequence that has no choice at once (CPU, adjusted logits,
/// top-k / top-p / min-p): the caller chooses its rows as it would alone.
pub fn choose_rows_at_once_many(
    parts: &[(&candle_core::Tensor, Option<&crate::nn::PartOf>, &Sampler)],
) -> crate::Result<Vec<Option<Vec<u32>>>> {
    let mut out: Vec<Option<Vec<u32>>> = vec![None; parts.len()];
    // groups of parts by how they choose: greedy (None) or a temperature's bits
    let mut groups: Vec<(Option<u32>, Vec<usize>)> = Vec::new();
    for (i, (logits, _, sampler)) in parts.iter().enumerate() {
        let key = if sampler.adjusts() || !logits.device().is_cuda() || logits.rank() != 2 {
            continue;
        } else if sampler.params.is_greedy() {
            None
        } else if sampler.is_plain_temperature() {
            Some(sampler.params.temperature.to_bits())
        } else {
            continue;
        };
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    for (key, idx) in groups {
        let vocab = parts[idx[0]].0.dim(1)?;
        if idx.len() == 1 || idx.iter().any(|&i| parts[i].0.dim(1).ok() != Some(vocab)) {
            for i in idx {
                out[i] = choose_rows_at_once(parts[i].0, parts[i].2)?;
            }
            continue;
        }
        // The batch's logits as they are when the group is the whole batch, in order.
        let rows: Vec<_> = idx.iter().map(|&i| (parts[i].0, parts[i].1)).collect();
        let all = crate::nn::rejoin(&rows)?;
        let ids = match key {
            None => Some(argmax_rows(&all)?),
            Some(_) => {
                let u: Vec<f64> = idx
                    .iter()
                    .flat_map(|&i| parts[i].2.peek_uniforms(parts[i].0.dim(0).unwrap_or(0)))
                    .collect();
                sample_rows_with(&all, parts[idx[0]].2, &u)?
            }
        };
        let Some(ids) = ids else {
            for i in idx {
                out[i] = choose_rows_at_once(parts[i].0, parts[i].2)?;
            }
            continue;
        };
        let mut at = 0;
        for i in idx {
            let n = parts[i].0.dim(0)?;
            out[i] = Some(ids[at..at + n].to_vec());
            at += n;
        }
    }
    Ok(out)
}

/// Every row of f32 `logits [rows, vocab]` sampled on the device with plain temperature
/// sampling, row i with the sampler's i-th next uniform, as [`Sampler::sample`] would draw it
/// on the host (the same rule; sums grouped differently, so a draw can differ only when the
/// uniform falls within rounding of a boundary between two tokens). Does not advance the
/// sampler: the caller [`Sampler::skip`]s the rows it uses, so the random stream stays the one
/// plain decoding consumes. None when it does not apply (CPU, top-k / top-p / min-p, greedy):
/// the caller copies the logits to the host and samples there.
pub fn sample_rows_on_device(
    logits: &candle_core::Tensor,
    sampler: &Sampler,
) -> crate::Result<Option<Vec<u32>>> {
    if sampler.is_plain_temperature() && logits.rank() == 2 {
        return sample_rows_with(logits, sampler, &sampler.peek_uniforms(logits.dim(0)?));
    }
    Ok(None)
}

/// Rows of `logits` drawn on the device at `sampler`'s temperature, row i with `u[i]`.
fn sample_rows_with(
    logits: &candle_core::Tensor,
    sampler: &Sampler,
    u: &[f64],
) -> crate::Result<Option<Vec<u32>>> {
    #[cfg(feature = "cuda")]
    {
        let t = sampler.params.temperature.max(1e-6);
        if let Some(ids) = crate::nn::cuda::sample_rows(logits, t, u)? {
            return Ok(Some(ids.to_vec1::<u32>()?));
        }
    }
    let _ = (logits, sampler, u);
    Ok(None)
}

/// The largest value's index, the lowest among equal ones (NaNs never chosen; 0 when no value
/// beats -inf), vectorized on the CPU (`nn::cpu_ops::argmax`).
pub fn argmax(row: &[f32]) -> u32 {
    crate::nn::cpu_ops::argmax::argmax(crate::nn::q8::simd_level(), row)
}

pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
    /// Present when the params adjust logits.
    history: Option<History>,
    /// Structured output: the grammar state (masks every row it adjusts).
    constraint: Option<crate::grammar::Constraint>,
    /// Plain temperature sampling's weights of the last row (reused: one exp a logit).
    weights: Vec<f32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        let history = params.adjusts().then(History::default);
        Self {
            params,
            rng,
            history,
            constraint: None,
            weights: Vec::new(),
        }
    }

    /// Constrain every choice to `c`'s grammar (structured output).
    pub fn with_constraint(mut self, c: crate::grammar::Constraint) -> Self {
        self.constraint = Some(c);
        self
    }

    pub fn constraint(&self) -> Option<&crate::grammar::Constraint> {
        self.constraint.as_ref()
    }

    /// A sampler for a generation from `prompt` (the repetition penalty reads its tokens).
    pub fn for_prompt(params: SamplingParams, prompt: &[u32]) -> Self {
        let mut s = Self::new(params);
        if let Some(h) = s.history.as_mut() {
            if s.params.repetition_penalty != 1.0 {
                h.prompt = prompt.iter().copied().collect();
            }
        }
        s
    }

    /// Whether rows must be adjusted before the choice (bias, penalties or a grammar on): then
    /// they are chosen on the host, row by row, never by the device's all-rows-at-once paths.
    pub fn adjusts(&self) -> bool {
        self.history.is_some() || self.constraint.is_some()
    }

    /// Count committed output tokens (the penalties' history; the grammar's state).
    pub fn commit(&mut self, tokens: &[u32]) {
        if let Some(h) = self.history.as_mut() {
            for &t in tokens {
                *h.counts.entry(t).or_default() += 1;
            }
        }
        if let Some(c) = &self.constraint {
            c.commit(tokens);
        }
    }

    /// Adjust one row of logits in place as plain decoding would after the committed tokens
    /// followed by `extra` (a block's proposals before this row). `index` maps a target token
    /// id to its place in `row` (None: not in this vocabulary; the identity for the target's
    /// own logits, the inverse of a narrow draft head's map for the draft's).
    /// Order (as vLLM's): the bias, then the repetition penalty, then frequency and presence;
    /// then the grammar's mask (tokens it forbids at -inf).
    pub fn adjusted(&self, row: &mut [f32], extra: &[u32], index: impl Fn(u32) -> Option<usize>) {
        self.penalized(row, extra, &index);
        if let Some(c) = &self.constraint {
            c.mask_row(row, extra, Some(&index));
        }
    }

    /// [`Self::adjusted`] for a row indexed by target token id.
    fn adjusted_target(&self, row: &mut [f32], extra: &[u32]) {
        self.penalized(row, extra, &|t| Some(t as usize));
        if let Some(c) = &self.constraint {
            c.mask_row(row, extra, None);
        }
    }

    /// The bias and the penalties of [`Self::adjusted`].
    fn penalized(&self, row: &mut [f32], extra: &[u32], index: &dyn Fn(u32) -> Option<usize>) {
        let Some(h) = &self.history else { return };
        let p = &self.params;
        for &(t, b) in &p.logit_bias {
            if let Some(l) = index(t).and_then(|i| row.get_mut(i)) {
                *l += b;
            }
        }
        let mut extra_counts: std::collections::HashMap<u32, u32> = Default::default();
        for &t in extra {
            *extra_counts.entry(t).or_default() += 1;
        }
        let count = |t: u32| {
            h.counts.get(&t).copied().unwrap_or(0) + extra_counts.get(&t).copied().unwrap_or(0)
        };
        // every token seen once: the generated ones, then the block's new ones, then the
        // prompt's not generated (each adjustment reads only its own token)
        let seen = h
            .counts
            .keys()
            .chain(extra_counts.keys().filter(|t| !h.counts.contains_key(t)))
            .chain(
                h.prompt
                    .iter()
                    .filter(|t| !h.counts.contains_key(t) && !extra_counts.contains_key(t)),
            )
            .copied();
        for t in seen {
            let Some(l) = index(t).and_then(|i| row.get_mut(i)) else {
                continue;
            };
            let r = p.repetition_penalty;
            if r != 1.0 {
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
            let c = count(t);
            if c > 0 {
                *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
    }

    /// [`Self::adjusted`] on a row of the target's vocabulary, then [`Self::sample`].
    pub fn sample_after(&mut self, row: &mut [f32], extra: &[u32]) -> u32 {
        self.adjusted_target(row, extra);
        self.sample(row)
    }

    /// The processed distribution as (token, probability) pairs, probabilities summing to 1,
    /// sorted by descending probability.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        let t = p.temperature.max(1e-6);
        let simd = crate::nn::q8::simd_level();
        let maxl = crate::nn::cpu_ops::argmax::max(simd, logits);
        let mut w = vec![0f32; logits.len()];
        crate::nn::cpu_ops::glu::exp_weights(simd, logits, maxl, t, &mut w);
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .zip(w)
            .enumerate()
            .filter(|(_, (l, _))| l.is_finite())
            .map(|(i, (_, w))| (i as u32, w))
            .collect();
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, |a, b| b.1.total_cmp(&a.1));
            cand.truncate(p.top_k);
        }
        // Descending probability, ties by token id: a total order, so a partial selection
        // of the first k gives exactly the first k of a full sort.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let total: f32 = cand.iter().map(|c| c.1).sum();
        if p.top_p < 1.0 {
            // Candidates of weight >= tau come first in the order, before every other: when
            // they hold the nucleus's mass (with the margin below), the nucleus is among them
            // and the rest are dropped in one pass (the largest weight is 1, exp(0)).
            let mut tau = 1e-4f32;
            while tau > 0.0 && cand.len() > 64 {
                let mass: f32 = cand.iter().filter(|c| c.1 >= tau).map(|c| c.1).sum();
                if mass >= p.top_p * total * 1.001 {
                    cand.retain(|c| c.1 >= tau);
                    break;
                }
                tau = if tau > 1e-20 { tau * 1e-4 } else { 0.0 };
            }
            // The nucleus is usually a few tokens out of a large vocabulary: select and sort
            // a growing head (O(V) each) instead of sorting all V entries.
            let mut k = 64.min(cand.len());
            loop {
                if k < cand.len() {
                    cand.select_nth_unstable_by(k - 1, order);
                }
                cand[..k].sort_by(order);
                let head: f32 = cand[..k].iter().map(|c| c.1).sum();
                // (a 0.1% margin keeps f32 summation order from moving the cut past k)
                if k == cand.len() || head >= p.top_p * total * 1.001 {
                    break;
                }
                k = (k * 8).min(cand.len());
            }
        } else {
            cand.sort_by(order);
        }
        for c in cand.iter_mut() {
            c.1 /= total;
        }
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                cum += c.1;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let thr = cand[0].1 * p.min_p;
            cand.retain(|c| c.1 >= thr);
        }
        let total: f32 = cand.iter().map(|c| c.1).sum();
        for c in cand.iter_mut() {
            c.1 /= total;
        }
        cand
    }

    /// Plain temperature sampling (no top-k, top-p or min-p): what the device sampler
    /// ([`sample_rows_on_device`]) implements.
    pub fn is_plain_temperature(&self) -> bool {
        let p = &self.params;
        !p.is_greedy() && p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0
    }

    /// The next `n` uniforms [`Self::sample`] would draw, without drawing them.
    pub fn peek_uniforms(&self, n: usize) -> Vec<f64> {
        let mut r = self.rng.clone();
        (0..n).map(|_| r.uniform()).collect()
    }

    /// Draw `n` uniforms, as `n` calls of [`Self::sample`] would.
    pub fn skip(&mut self, n: usize) {
        if self.params.is_greedy() {
            return; // greedy choices draw nothing
        }
        for _ in 0..n {
            self.rng.uniform();
        }
    }

    /// Choose the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let p = &self.params;
        if p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0 {
            // Plain temperature sampling: in token order, no sort of the vocabulary (a
            // 248k-entry sort per row dominated T > 0 verify steps on the GPU); each weight's
            // exp once (vectorized, `cpu_ops::glu::exp_weights`), kept for the scan (libm's exps
            // were most of a 49,152-token row's ~235 us on this CPU).
            let t = p.temperature.max(1e-6);
            let simd = crate::nn::q8::simd_level();
            let maxl = crate::nn::cpu_ops::argmax::max(simd, logits);
            let mut w = std::mem::take(&mut self.weights);
            w.resize(logits.len(), 0.0);
            crate::nn::cpu_ops::glu::exp_weights(simd, logits, maxl, t, &mut w);
            let total: f64 = w.iter().map(|&x| x as f64).sum();
            let target = self.rng.uniform() * total;
            let mut cum = 0.0f64;
            let mut last = 0u32;
            let mut chosen = None;
            for (i, &wi) in w.iter().enumerate() {
                let wi = wi as f64;
                if wi > 0.0 {
                    cum += wi;
                    last = i as u32;
                    if target < cum {
                        chosen = Some(i as u32);
                        break;
                    }
                }
            }
            self.weights = w;
            return chosen.unwrap_or(last);
        }
        let dist = self.distribution(logits);
        let u = self.rng.uniform() as f32;
        let mut cum = 0.0;
        for &(tok, pr) in &dist {
            cum += pr;
            if u < cum {
                return tok;
            }
        }
        dist.last().map(|d| d.0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peeked_uniforms_are_the_ones_drawn_next() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 9,
            ..Default::default()
        });
        let u = s.peek_uniforms(4);
        assert_eq!(u, s.peek_uniforms(4), "peeking does not draw");
        for k in 0..4 {
            assert_eq!(s.peek_uniforms(1)[0], u[k]);
            s.skip(1);
        }
        assert!(s.is_plain_temperature());
        s.params.top_p = 0.9;
        assert!(!s.is_plain_temperature());
    }

    #[test]
    fn greedy_takes_first_max() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.5, 0.1, 2.0]), 2);
    }

    #[test]
    fn filters_compose() {
        let logits = [2.0f32, 1.0, 0.0, -1.0, -2.0];
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 3,
            ..Default::default()
        });
        let d = s.distribution(&logits);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert!((d.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
        // softmax of [2,1,0] = [.665, .245, .090]: top_p 0.8 keeps two
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.8,
            ..Default::default()
        });
        assert_eq!(s.distribution(&logits).len(), 2);
        // min_p 0.3: keep p >= 0.3 * p_max
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.3,
            ..Default::default()
        });
        let d = s.distribution(&logits);
        assert_eq!(d.len(), 2, "{d:?}");
        // low temperature sharpens
        let s = Sampler::new(SamplingParams {
            temperature: 0.1,
            ..Default::default()
        });
        assert!(s.distribution(&logits)[0].1 > 0.99);
    }

    #[test]
    fn sampling_is_seeded_and_follows_the_distribution() {
        let logits = [1.0f32, 0.0, 0.5, -0.5];
        let params = SamplingParams {
            temperature: 0.8,
            seed: 42,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        let mut s = Sampler::new(params.clone());
        let n = 40_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.sample(&logits) as usize] += 1;
        }
        for (tok, p) in s.distribution(&logits) {
            let f = counts[tok as usize] as f32 / n as f32;
            assert!((f - p).abs() < 0.015, "token {tok}: freq {f} vs p {p}");
        }
    }

    #[test]
    fn invalid_params_are_named() {
        let e = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("top_p"));
        let e = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("temperature"));
    }

    /// The partial selection for top-p gives exactly what a full sort gives.
    #[test]
    fn top_p_partial_selection_equals_full_sort() {
        let mut rng = crate::rng::Rng::new(5);
        for (case, &(v, scale, top_p)) in [
            (50_000usize, 3.0f32, 0.9f32),
            (50_000, 12.0, 0.5),
            (3000, 0.2, 0.95),
            (100, 1.0, 0.3),
        ]
        .iter()
        .enumerate()
        {
            let logits: Vec<f32> = (0..v)
                .map(|_| (rng.uniform() as f32 - 0.5) * 2.0 * scale)
                .collect();
            let params = SamplingParams {
                temperature: 0.8,
                top_p,
                ..Default::default()
            };
            let got = Sampler::new(params.clone()).distribution(&logits);
            // Naive reference: full sort, then the nucleus.
            let maxl = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut all: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, ((l - maxl) / 0.8).exp()))
                .collect();
            all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let total: f32 = all.iter().map(|c| c.1).sum();
            let mut cum = 0.0;
            let mut keep = all.len();
            for (i, c) in all.iter().enumerate() {
                cum += c.1 / total;
                if cum >= top_p {
                    keep = i + 1;
                    break;
                }
            }
            all.truncate(keep);
            let ids: Vec<u32> = got.iter().map(|c| c.0).collect();
            let want: Vec<u32> = all.iter().map(|c| c.0).collect();
            assert_eq!(ids, want, "case {case}: nucleus differs");
        }
    }

    #[test]
    fn adjustments_follow_their_definitions() {
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 2.0,
            logit_bias: vec![(4, 10.0), (1, -1.0)],
            ..Default::default()
        };
        let mut s = Sampler::for_prompt(p, &[2]);
        s.commit(&[1, 3, 3]);
        let mut row = vec![1.0f32, 4.0, 3.0, -2.0, 0.0, 1.0];
        // token 5 proposed earlier in the block: counted as generated once
        s.adjusted(&mut row, &[5], |t| Some(t as usize));
        // 0: untouched; 1: bias -1 -> 3, / 2 -> 1.5, - 0.25 - 0.5 -> 0.75; 2: prompt -> / 2;
        // 3: (-2) * 2 - 0.5 - 0.5 = -5; 4: bias 10, not seen; 5: / 2 - 0.75 = -0.25
        assert_eq!(row, vec![1.0, 0.75, 1.5, -5.0, 10.0, -0.25]);
        // the same row through a narrow map that lacks token 3 and moves 4 to index 0
        let mut row = vec![0.0f32, 4.0];
        s.adjusted(&mut row, &[], |t| match t {
            4 => Some(0),
            1 => Some(1),
            _ => None,
        });
        assert_eq!(row, vec![10.0, 0.75]);
        // neutral params adjust nothing and keep the device paths
        let n = Sampler::new(SamplingParams::default());
        assert!(!n.adjusts());
        let mut row = vec![1.0f32, 2.0];
        n.adjusted(&mut row, &[0, 1], |t| Some(t as usize));
        assert_eq!(row, vec![1.0, 2.0]);
    }

    #[test]
    fn adjustment_bounds_are_named() {
        let bad = |p: SamplingParams| p.validate().unwrap_err().to_string();
        let e = bad(SamplingParams {
            presence_penalty: 2.5,
            ..Default::default()
        });
        assert!(e.contains("presence_penalty"), "{e}");
        let e = bad(SamplingParams {
            frequency_penalty: f32::NAN,
            ..Default::default()
        });
        assert!(e.contains("frequency_penalty"), "{e}");
        let e = bad(SamplingParams {
            repetition_penalty: 0.0,
            ..Default::default()
        });
        assert!(e.contains("repetition_penalty"), "{e}");
        let e = bad(SamplingParams {
            logit_bias: vec![(3, 101.0)],
            ..Default::default()
        });
        assert!(e.contains("logit_bias of token 3"), "{e}");
    }
}
