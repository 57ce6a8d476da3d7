//! The adaptive block-size policy: before each cycle, choose the verify size q in
//! 1..=block_size that maximizes expected committed tokens per second; q = 1 is plain decoding.
//!
//! Online estimates, all decayed so a phase change is followed:
//! - cost of a verify of q rows and of a draft call of q rows (EWMA per q; unmeasured q are
//!   interpolated linearly between measured ones, extrapolated flat beyond them);
//! - acceptance per depth: `p[i]` = P(proposal i accepted | proposals 1..i-1 accepted),
//!   from decayed counts with a weak prior.
//! Expected tokens of a q-block: `E(q) = 1 + sum_{k=1}^{q-1} prod_{i<=k} p[i]`.
//! Speculation is probed periodically while plain decoding wins (a 2-row block; the interval
//! doubles from 8 to 128 plain steps), so a temporarily bad phase does not lock it off. The
//! estimates persist across the generations of one engine (see `Engine`).

use serde::Serialize;

/// Why a block size was chosen (counted in the stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Not enough measurements yet: run the full block (and one plain step) to learn costs.
    Warmup,
    /// The cost model says this q is fastest.
    Model,
    /// Plain decoding is expected faster; speculation is off until the next probe.
    PlainFaster,
    /// A periodic speculative probe while plain decoding was winning.
    Probe,
}

#[derive(Debug, Clone)]
struct Ewma {
    v: Vec<Option<f64>>,
    /// Where q sits on the cost curve (bytes a q-row verify reads: flat for dense targets,
    /// the union of experts for MoE ones); unmeasured q are interpolated along it. None:
    /// linear in q.
    shape: Option<Vec<f64>>,
}

impl Ewma {
    fn new(n: usize) -> Self {
        Self {
            v: vec![None; n + 1],
            shape: None,
        }
    }
    /// The coordinate of q that costs are interpolated in.
    fn x(&self, q: usize) -> f64 {
        match &self.shape {
            Some(s) => s[q],
            None => q as f64,
        }
    }
    fn observe(&mut self, q: usize, x: f64) {
        let a = 0.3;
        self.v[q] = Some(match self.v[q] {
            Some(old) => (1.0 - a) * old + a * x,
            None => x,
        });
    }
    /// Estimate at q from the measured points: linear interpolation between neighbours,
    /// linear extrapolation from the two nearest measured points beyond them (flat when only
    /// one point is known).
    fn at(&self, q: usize) -> Option<f64> {
        if let Some(x) = self.v[q] {
            return Some(x);
        }
        let below: Vec<(usize, f64)> = (1..q)
            .rev()
            .filter_map(|i| self.v[i].map(|x| (i, x)))
            .take(2)
            .collect();
        let above: Vec<(usize, f64)> = (q + 1..self.v.len())
            .filter_map(|i| self.v[i].map(|x| (i, x)))
            .take(2)
            .collect();
        let (xq, x) = (self.x(q), |i: usize| self.x(i));
        let line = |(i, a): (usize, f64), (j, b): (usize, f64)| {
            let (xi, xj) = (x(i), x(j));
            if (xj - xi).abs() < 1e-12 {
                (a + b) / 2.0
            } else {
                a + (b - a) * (xq - xi) / (xj - xi)
            }
        };
        match (below.as_slice(), above.as_slice()) {
            ([lo, ..], [hi, ..]) => Some(line(*lo, *hi)),
            ([hi, lo], []) => Some(line(*lo, *hi).max(hi.1)),
            ([only], []) | ([], [only]) => Some(only.1),
            ([], [lo, hi]) => Some(line(*lo, *hi).max(0.0)),
            _ => None,
        }
    }
}

/// Policy state for one generation.
#[derive(Debug, Clone)]
pub struct AdaptivePolicy {
    max_q: usize,
    verify: Ewma,
    draft: Ewma,
    /// Decayed (accepted, attempted) counts per depth 1..max_q-1.
    acc: Vec<(f64, f64)>,
    plain_streak: usize,
    probe_interval: usize,
    cycles: usize,
}

/// Block size of the warm-up cycle.
const WARMUP_Q: usize = 4;

/// Decay of the acceptance counts per observed cycle (a half-life of ~14 cycles).
const DECAY: f64 = 0.95;

impl AdaptivePolicy {
    pub fn new(max_q: usize) -> Self {
        Self {
            max_q,
            verify: Ewma::new(max_q),
            draft: Ewma::new(max_q),
            acc: vec![(0.0, 0.0); max_q],
            plain_streak: 0,
            probe_interval: 8,
            cycles: 0,
        }
    }

    pub fn max_q(&self) -> usize {
        self.max_q
    }

    /// Interpolate unmeasured verify costs along `bytes[q]`, the bytes a q-row verify reads
    /// (`TargetModel::verify_bytes`, q = 0..=max_q): for a MoE target a verify's cost grows
    /// with the union of experts its rows route to (steeply at first, then flattening), which
    /// a straight line between two measured sizes underestimates for the sizes between them
    /// (so mid-sized blocks would look cheaper than they are).
    /// A flat curve (a dense target: every row reads the same weights) keeps the straight
    /// line in q.
    pub fn with_verify_shape(mut self, bytes: Vec<f64>) -> Self {
        let lo = bytes.iter().skip(1).copied().fold(f64::INFINITY, f64::min);
        let hi = bytes.iter().skip(1).copied().fold(0.0, f64::max);
        let grows = bytes.windows(2).skip(1).all(|w| w[1] >= w[0]) && hi > lo * 1.01;
        if bytes.len() == self.max_q + 1 && bytes.iter().all(|b| b.is_finite()) && grows {
            self.verify.shape = Some(bytes);
        }
        self
    }

    /// Conditional acceptance at depth i (1-based), with a weak prior of 0.5.
    pub fn p(&self, i: usize) -> f64 {
        let (a, n) = self.acc[i];
        (a + 0.5) / (n + 1.0)
    }

    /// Expected committed tokens of a q-block.
    pub fn expected_tokens(&self, q: usize) -> f64 {
        let mut e = 1.0;
        let mut run = 1.0;
        for i in 1..q {
            run *= self.p(i);
            e += run;
        }
        e
    }

    /// Expected tokens per second of a q-block, if its costs are known.
    pub fn rate(&self, q: usize) -> Option<f64> {
        let v = self.verify.at(q)?;
        let d = if q > 1 { self.draft.at(q)? } else { 0.0 };
        Some(self.expected_tokens(q) / (v + d).max(1e-9))
    }

    /// The block size for the next cycle (`limit` = what the end of generation allows).
    pub fn choose(&mut self, limit: usize) -> (usize, Reason) {
        let limit = limit.min(self.max_q).max(1);
        if limit == 1 {
            return (1, Reason::Model);
        }
        // Warm-up: one small block (a first cost and acceptance point; a full block can cost
        // several plain steps on a CPU), then one plain step (its cost).
        if self.verify.v.iter().skip(2).all(|x| x.is_none()) {
            return (limit.min(WARMUP_Q), Reason::Warmup);
        }
        if self.verify.v[1].is_none() {
            return (1, Reason::Warmup);
        }
        let best = (2..=limit)
            .filter_map(|q| self.rate(q).map(|r| (q, r)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let plain = self.rate(1).unwrap_or(0.0);
        match best {
            Some((q, r)) if r > plain => {
                self.plain_streak = 0;
                self.probe_interval = 8;
                (q, Reason::Model)
            }
            _ => {
                self.plain_streak += 1;
                if self.plain_streak >= self.probe_interval {
                    self.plain_streak = 0;
                    self.probe_interval = (self.probe_interval * 2).min(128);
                    // the cheapest probe (one draft token) refreshes the first acceptance depth,
                    // the one that decides whether speculation can pay at all
                    (2, Reason::Probe)
                } else {
                    (1, Reason::PlainFaster)
                }
            }
        }
    }

    /// Record a cycle: q rows verified, `accepted` draft tokens, measured times (seconds).
    /// `draft_s` is None for a plain step or a draft call whose time is not representative
    /// (the first one also prefills the draft's context).
    pub fn observe(&mut self, q: usize, accepted: usize, draft_s: Option<f64>, verify_s: f64) {
        self.cycles += 1;
        self.verify.observe(q, verify_s);
        if let Some(d) = draft_s {
            self.draft.observe(q, d);
        }
        if q > 1 {
            for x in self.acc.iter_mut() {
                x.0 *= DECAY;
                x.1 *= DECAY;
            }
            // depths 1..=accepted were accepted; depth accepted+1 (if verified) was rejected
            for i in 1..q {
                if i <= accepted {
                    self.acc[i].0 += 1.0;
                    self.acc[i].1 += 1.0;
                } else {
                    self.acc[i].1 += 1.0;
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A MoE-like cost curve (the union of 8 of 128 experts per row, 40% of the step dense):
    /// with a plain step and a 16-row verify measured, a 4-row verify is estimated along the
    /// curve; the straight line between them underestimates it.
    #[test]
    fn verify_costs_follow_the_target_shape() {
        let union = |q: usize| 128.0 * (1.0 - (1.0 - 8.0 / 128.0f64).powi(q as i32));
        let bytes: Vec<f64> = (0..=16)
            .map(|q| 0.4 + 0.6 * union(q.max(1)) / 8.0)
            .collect();
        let cost = |q: usize| 1e-3 * bytes[q];
        let mut shaped = AdaptivePolicy::new(16).with_verify_shape(bytes.clone());
        let mut linear = AdaptivePolicy::new(16);
        for p in [&mut shaped, &mut linear] {
            p.observe(1, 0, None, cost(1));
            p.observe(16, 3, Some(2e-4), cost(16));
            for _ in 0..40 {
                // accepted 3 of 15: ~p 0.75 at the first depths
                p.observe(16, 3, Some(2e-4), cost(16));
            }
        }
        let est = |p: &AdaptivePolicy, q| p.verify.at(q).unwrap();
        // a dense target's flat curve keeps the line
        assert!(AdaptivePolicy::new(16)
            .with_verify_shape(vec![5.0; 17])
            .verify
            .shape
            .is_none());
        assert!((est(&shaped, 4) - cost(4)).abs() < 1e-9, "on the curve");
        assert!(
            est(&linear, 4) < cost(4),
            "the line underestimates the steep start"
        );
        assert!((est(&shaped, 16) - cost(16)).abs() < 1e-12);
    }

    /// Simulate `n` cycles: verify cost `v(q)`, draft cost `d(q)`, and an acceptance process
    /// where each proposal is accepted with probability `acc` (deterministic pseudo-random).
    fn simulate(
        p: &mut AdaptivePolicy,
        n: usize,
        v: impl Fn(usize) -> f64,
        d: impl Fn(usize) -> f64,
        acc: f64,
        seed: u64,
    ) -> Vec<usize> {
        let mut rng = crate::testing::Rng::new(seed);
        let mut qs = vec![];
        for _ in 0..n {
            let (q, _) = p.choose(64);
            let mut a = 0;
            while a + 1 < q && rng.uniform() < acc {
                a += 1;
            }
            p.observe(q, a, (q > 1).then(|| d(q)), v(q));
            qs.push(q);
        }
        qs
    }

    #[test]
    fn cheap_verify_and_high_acceptance_give_large_blocks() {
        let mut p = AdaptivePolicy::new(16);
        // GPU-like: a 16-row verify costs 1.1x one row; draft 0.1x
        let qs = simulate(
            &mut p,
            200,
            |q| 1.0 + 0.1 * (q as f64 - 1.0) / 15.0,
            |_| 0.1,
            0.9,
            1,
        );
        let tail = &qs[100..];
        assert!(tail.iter().all(|&q| q >= 12), "{tail:?}");
    }

    #[test]
    fn expensive_verify_or_useless_draft_gives_plain_decoding() {
        // 2-core CPU: a 16-row verify costs ~5x one row; acceptance moderate
        let mut p = AdaptivePolicy::new(16);
        let qs = simulate(
            &mut p,
            300,
            |q| 1.0 + 4.0 * (q as f64 - 1.0) / 15.0,
            |q| 0.3 + 0.02 * q as f64,
            0.3,
            2,
        );
        let plain = qs[100..].iter().filter(|&&q| q == 1).count();
        assert!(plain as f64 > 0.9 * 200.0, "plain {plain} of 200");
        // cheap verify but a useless draft (acceptance 0)
        let mut p = AdaptivePolicy::new(16);
        let qs = simulate(
            &mut p,
            300,
            |q| 1.0 + 0.1 * q as f64 / 16.0,
            |_| 0.1,
            0.0,
            3,
        );
        let plain = qs[100..].iter().filter(|&&q| q == 1).count();
        assert!(plain as f64 > 0.9 * 200.0, "plain {plain} of 200");
        // and it keeps probing, with growing intervals
        let probes = qs[100..].iter().filter(|&&q| q > 1).count();
        assert!(probes >= 2, "probes {probes}");
    }

    #[test]
    fn follows_a_phase_change_both_ways() {
        let mut p = AdaptivePolicy::new(16);
        let v = |q: usize| 1.0 + 0.5 * (q as f64 - 1.0) / 15.0;
        let qs = simulate(&mut p, 150, v, |_| 0.1, 0.9, 4);
        assert!(qs[100..].iter().all(|&q| q > 4), "phase 1 {:?}", &qs[100..]);
        let qs = simulate(&mut p, 300, v, |_| 0.1, 0.0, 5);
        assert!(
            qs[200..].iter().filter(|&&q| q == 1).count() > 90,
            "phase 2 {:?}",
            &qs[200..]
        );
        // acceptance comes back: a probe notices and speculation resumes
        let qs = simulate(&mut p, 300, v, |_| 0.1, 0.9, 6);
        assert!(
            qs[200..].iter().filter(|&&q| q > 4).count() > 90,
            "phase 3 {:?}",
            &qs[200..]
        );
    }

    #[test]
    fn expected_tokens_follow_the_acceptance_chain() {
        let mut p = AdaptivePolicy::new(4);
        for _ in 0..200 {
            p.observe(4, 3, Some(0.1), 1.0); // always full acceptance
        }
        // decayed counts (~20 effective cycles) plus the weak prior keep it just under 4
        assert!(
            p.expected_tokens(4) > 3.8 && p.expected_tokens(4) <= 4.0,
            "{}",
            p.expected_tokens(4)
        );
        let mut p = AdaptivePolicy::new(4);
        for _ in 0..200 {
            p.observe(4, 0, Some(0.1), 1.0);
        }
        assert!(p.expected_tokens(4) < 1.05);
    }
}
