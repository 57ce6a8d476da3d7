//! What `DFlash2DraftModel` adds to the DFlash draft (the authors' `dflash` package,
//! dflash/model.py): per draft layer a grouped dynamic causal convolution around attention and
//! one around the MLP ([`DynConv`]), and a [`Selector`] that turns the draft's logits into the
//! block's proposal by a left-to-right walk over each row's top-k candidates.
//!
//! Convolution (`prepare` before the sublayer, `finish` after it): from the sublayer's normed
//! input `x`, `dynk = kernel_projection(x)` gives two dynamic kernels; `prepare` convolves `x`
//! with `base_kernel[0]` + the first, `finish` convolves the sublayer's output with
//! `base_kernel[1]` + the second (see [`crate::nn::dyn_conv`]). Only block rows are convolved:
//! the context K/V come from the taps as in DFlash.
//!
//! Selector: `candidates, unary = top_k(logits)` per row; `hp = hidden_projection(hidden)`; from
//! `prev = anchor` (block row 0, the last committed token), row p picks the candidate `c`
//! maximizing `unary[p, c] + sum_r pred[prev, r] * hp[p, r] * succ[c, r]` and that becomes
//! `prev`. At temperature 0 this path is the proposal the target verifies; at T > 0 the engine
//! verifies the same path by sample-and-compare (see `engine`).

use crate::nn::{dyn_conv, Linear};
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// One grouped dynamic causal convolution (`attention_conv` / `mlp_conv`).
#[derive(Debug, Clone)]
pub struct DynConv {
    /// `[2, K, H]`: the base kernels of `prepare` (0) and `finish` (1).
    base: [Tensor; 2],
    /// `H -> 2 * K * G`: both dynamic kernels from the sublayer's input.
    proj: Linear,
    kernel: usize,
    group: usize,
}

impl DynConv {
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        kernel: usize,
        group: usize,
    ) -> Result<Self> {
        let g = hidden / group;
        let name = format!("{prefix}.base_kernel");
        let base = w.get(&name, (2, kernel, hidden))?;
        let base = [base.get(0)?, base.get(1)?];
        let proj = Linear::load(
            w,
            &format!("{prefix}.kernel_projection"),
            hidden,
            2 * kernel * g,
            false,
        )?;
        Ok(Self {
            base,
            proj,
            kernel,
            group,
        })
    }

    /// Build from tensors (training: trainable variables). `base [2, K, H]`.
    pub fn from_parts(base: &Tensor, proj: Linear, group: usize) -> Result<Self> {
        let kernel = base.dim(1)?;
        Ok(Self {
            base: [base.get(0)?, base.get(1)?],
            proj,
            kernel,
            group,
        })
    }

    /// `x` (the sublayer's normed input, blocks of `block` rows) convolved, and the dynamic
    /// kernel that [`Self::finish`] applies to the sublayer's output.
    pub fn prepare(&self, x: &Tensor, block: usize) -> Result<(Tensor, Tensor)> {
        let kg = self.kernel * (x.dim(1)? / self.group);
        let (xc, d) =
            crate::nn::dyn_conv::project_and_conv(&self.proj, x, &self.base[0], self.group, block)?;
        Ok((xc, d.narrow(1, kg, kg)?))
    }

    pub fn finish(&self, y: &Tensor, d1: &Tensor, block: usize) -> Result<Tensor> {
        dyn_conv(y, d1, &self.base[1], self.group, block)
    }

    /// [`Self::finish`] as a convolution to apply with the sublayer's output projection
    /// (`nn::dyn_conv::project_then_conv`: one launch on CUDA).
    pub fn after<'a>(&'a self, d1: &'a Tensor, block: usize) -> crate::nn::dyn_conv::ConvAfter<'a> {
        crate::nn::dyn_conv::ConvAfter {
            dynk: d1,
            base: &self.base[1],
            group: self.group,
            block,
        }
    }

    pub fn weight_bytes(&self) -> usize {
        2 * crate::nn::tensor_bytes(&self.base[0]) + self.proj.weight_bytes()
    }
}

/// The candidate selector (`candidate_selector.*`).
#[derive(Debug, Clone)]
pub struct Selector {
    /// `[vocab, rank]` each.
    pred: Tensor,
    succ: Tensor,
    /// `H -> rank`.
    proj: Linear,
    pub top_k: usize,
}

/// A codebook under either name the published checkpoints use (`...codebook` or
/// `...codebook.weight`: the reference maps the first onto the second when loading).
fn codebook(w: &Weights, name: &str, vocab: usize, rank: usize) -> Result<Tensor> {
    let plain = format!("candidate_selector.{name}");
    let dotted = format!("{plain}.weight");
    let pick = match (w.shape(&plain), w.shape(&dotted)) {
        (Some(_), Some(_)) => {
            return Err(Error::weights(
                w.file_desc(),
                format!("both {plain} and {dotted} are present: keep one"),
            ))
        }
        (Some(_), None) => plain,
        (None, Some(_)) => dotted,
        (None, None) => {
            return Err(Error::weights(
                w.file_desc(),
                format!("{dotted} is missing (a DFlash2 draft carries the selector's codebooks)"),
            ))
        }
    };
    w.get(&pick, (vocab, rank))
}

impl Selector {
    pub fn load(
        w: &Weights,
        hidden: usize,
        vocab: usize,
        rank: usize,
        top_k: usize,
    ) -> Result<Self> {
        Ok(Self {
            pred: codebook(w, "predecessor_codebook", vocab, rank)?,
            succ: codebook(w, "successor_codebook", vocab, rank)?,
            proj: Linear::load(
                w,
                "candidate_selector.hidden_projection",
                hidden,
                rank,
                false,
            )?,
            top_k,
        })
    }

    pub fn from_parts(pred: Tensor, succ: Tensor, proj: Linear, top_k: usize) -> Self {
        Self {
            pred,
            succ,
            proj,
            top_k,
        }
    }

    pub fn weight_bytes(&self) -> usize {
        crate::nn::tensor_bytes(&self.pred)
            + crate::nn::tensor_bytes(&self.succ)
            + self.proj.weight_bytes()
    }

    /// The greedy walk: one id per row of `hidden [n, H]` (the draft's final-normed rows) with
    /// `logits [n, V]` f32, starting from `anchor`.
    pub fn walk(&self, hidden: &Tensor, logits: &Tensor, anchor: u32) -> Result<Vec<u32>> {
        #[cfg(feature = "cuda")]
        if logits.device().is_cuda()
            && crate::nn::fused::allowed_part(crate::switches::Part::Dflash2)
        {
            if let Some(ids) = self.walk_on_device(hidden, logits, anchor)? {
                return Ok(ids);
            }
        }
        let s = self.scores(hidden, logits, anchor)?;
        Ok(s.path())
    }

    /// The walk on the device after the top-k (`selector_pairs`, `selector_walk`): the same
    /// scores as [`Self::scores`] (summed in another order, so a near-tie may pick the other
    /// candidate: a proposal, never the output) and one download of the ids. None where the
    /// kernels do not apply.
    #[cfg(feature = "cuda")]
    fn walk_on_device(
        &self,
        hidden: &Tensor,
        logits: &Tensor,
        anchor: u32,
    ) -> Result<Option<Vec<u32>>> {
        use crate::nn::cuda::dflash2 as k;
        if anchor as usize >= self.pred.dim(0)? {
            return Ok(None);
        }
        let Some(tk) = k::top_k_raw(logits, self.top_k)? else {
            return Ok(None);
        };
        let hp = self.proj.forward(hidden)?;
        let hp = if hp.is_contiguous() {
            hp
        } else {
            hp.contiguous()?
        };
        match k::selector_walk(&tk, &hp, &self.pred, &self.succ, anchor)? {
            Some(ids) => Ok(Some(ids.to_vec1::<u32>()?)),
            None => Ok(None),
        }
    }

    /// Everything the walk needs, computed on the logits' device with one download at the
    /// end: the candidates and their unary scores, the first row's pair scores against the
    /// anchor, and for every later row the pair scores from each candidate of the row before
    /// (`[n-1, k, k]`).
    pub fn scores(&self, hidden: &Tensor, logits: &Tensor, anchor: u32) -> Result<WalkScores> {
        let n = hidden.dim(0)?;
        let k = self.top_k;
        let dev = hidden.device().clone();
        let (unary, cand) = top_k(logits, k)?;
        let cand_flat = cand.flatten_all()?;
        // W[p, j, r] = succ[cand[p, j], r] * hp[p, r]
        let hp = self.proj.forward(hidden)?.to_dtype(DType::F32)?;
        let rank = hp.dim(1)?;
        let succ = self
            .succ
            .index_select(&cand_flat, 0)?
            .to_dtype(DType::F32)?
            .reshape((n, k, rank))?;
        let w = succ.broadcast_mul(&hp.reshape((n, 1, rank))?)?;
        // Predecessors: the anchor for row 0, every candidate of row p - 1 for row p.
        let anchor_t = Tensor::from_slice(&[anchor], 1, &dev)?;
        let prev = if n > 1 {
            Tensor::cat(&[&anchor_t, &cand_flat.narrow(0, 0, (n - 1) * k)?], 0)?
        } else {
            anchor_t
        };
        let pred = self.pred.index_select(&prev, 0)?.to_dtype(DType::F32)?;
        let first = w
            .get(0)?
            .matmul(&pred.narrow(0, 0, 1)?.t()?)?
            .flatten_all()?;
        let mut parts = vec![unary.flatten_all()?, cand_flat.to_dtype(DType::F32)?, first];
        if n > 1 {
            let p = pred.narrow(0, 1, (n - 1) * k)?.reshape((n - 1, k, rank))?;
            let wt = w.narrow(0, 1, n - 1)?.transpose(1, 2)?.contiguous()?;
            parts.push(p.matmul(&wt)?.flatten_all()?);
        }
        // One download (ids below 2^24 are exact in f32).
        let all = Tensor::cat(&parts, 0)?.to_vec1::<f32>()?;
        let (u, rest) = all.split_at(n * k);
        let (c, rest) = rest.split_at(n * k);
        let (f, t) = rest.split_at(k);
        Ok(WalkScores {
            n,
            k,
            unary: u.to_vec(),
            cand: c.iter().map(|&x| x as u32).collect(),
            first: f.to_vec(),
            trans: t.to_vec(),
        })
    }
}

impl Selector {
    /// Training: the walk scores `[M, k]` of rows `hidden [M, H]` over the candidates `cand`
    /// (`[M * k]`, row-major) after the given predecessors `prev [M]` (teacher forcing), as
    /// differentiable tensors: `logits[r, cand] + sum_r pred[prev] * hp * succ[cand]`.
    pub fn train_scores(
        &self,
        hidden: &Tensor,
        logits: &Tensor,
        cand: &[u32],
        prev: &[u32],
    ) -> Result<Tensor> {
        let (m, k) = (prev.len(), self.top_k);
        let dev = hidden.device();
        let cand_t = Tensor::from_slice(cand, (m, k), dev)?;
        let unary = logits.gather(&cand_t, 1)?;
        let hp = self.proj.forward(hidden)?.to_dtype(DType::F32)?;
        let rank = hp.dim(1)?;
        let succ = self
            .succ
            .index_select(&cand_t.flatten_all()?, 0)?
            .to_dtype(DType::F32)?
            .reshape((m, k, rank))?;
        let pred = self
            .pred
            .index_select(&Tensor::from_slice(prev, m, dev)?, 0)?
            .to_dtype(DType::F32)?;
        let ph = (pred * hp)?.reshape((m, 1, rank))?;
        let pair = succ.broadcast_mul(&ph)?.sum(2)?;
        Ok((unary.to_dtype(DType::F32)? + pair)?)
    }
}

/// Training: each row's top-k candidates of `logits [M, V]` (`[M * k]`) and where its label
/// sits among them (None: not a candidate).
pub fn label_candidates(
    logits: &Tensor,
    k: usize,
    labels: &[u32],
) -> Result<(Vec<u32>, Vec<Option<usize>>)> {
    let (_, cand) = top_k(logits, k)?;
    let cand: Vec<u32> = cand.flatten_all()?.to_vec1()?;
    let pos = labels
        .iter()
        .enumerate()
        .map(|(r, l)| cand[r * k..(r + 1) * k].iter().position(|c| c == l))
        .collect();
    Ok((cand, pos))
}

/// The selector's scores for one block (host memory).
#[derive(Debug, Clone)]
pub struct WalkScores {
    pub n: usize,
    pub k: usize,
    /// `[n, k]` row-major: logits of the candidates, and their ids.
    pub unary: Vec<f32>,
    pub cand: Vec<u32>,
    /// `[k]`: row 0's pair score of each candidate after the anchor.
    pub first: Vec<f32>,
    /// `[n-1, k, k]`: row p's pair score of candidate j after candidate i of row p - 1.
    pub trans: Vec<f32>,
}

impl WalkScores {
    /// Row p's total score of each candidate given the index chosen at row p - 1.
    pub fn row(&self, p: usize, prev: Option<usize>) -> Vec<f32> {
        let k = self.k;
        (0..k)
            .map(|j| {
                let pair = match (p, prev) {
                    (0, _) | (_, None) => self.first[j],
                    (_, Some(i)) => self.trans[((p - 1) * k + i) * k + j],
                };
                self.unary[p * k + j] + pair
            })
            .collect()
    }

    /// Candidate index chosen per row (ties: the lower index).
    pub fn indices(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.n);
        let mut prev = None;
        for p in 0..self.n {
            let row = self.row(p, prev);
            let mut best = 0;
            for (j, &s) in row.iter().enumerate() {
                if s > row[best] {
                    best = j;
                }
            }
            out.push(best);
            prev = Some(best);
        }
        out
    }

    pub fn path(&self) -> Vec<u32> {
        self.indices()
            .iter()
            .enumerate()
            .map(|(p, &j)| self.cand[p * self.k + j])
            .collect()
    }
}

/// Per row of `logits [n, V]` (f32) its `k` largest values and their ids, largest first (equal
/// values: the lower id first): `[n, k]` f32 and u32 tensors on the logits' device. The CUDA
/// kernel where it runs (k <= 32), else on the host.
pub fn top_k(logits: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    let (n, v) = logits.dims2()?;
    if k == 0 || k > v {
        return Err(Error::input(format!("top_k: k {k} for {v} columns")));
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() && crate::nn::fused::allowed_part(crate::switches::Part::Dflash2) {
        if let Some(r) = crate::nn::cuda::dflash2::top_k(logits, k)? {
            return Ok(r);
        }
    }
    let rows: Vec<Vec<f32>> = logits
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .to_vec2()?;
    let mut vals = Vec::with_capacity(n * k);
    let mut ids = Vec::with_capacity(n * k);
    for row in &rows {
        let (rv, ri) = top_k_row(row, k);
        vals.extend(rv);
        ids.extend(ri);
    }
    let dev = logits.device();
    Ok((
        Tensor::from_vec(vals, (n, k), dev)?,
        Tensor::from_vec(ids, (n, k), dev)?,
    ))
}

/// [`top_k`] of one host row. NaN sorts below everything.
pub fn top_k_row(row: &[f32], k: usize) -> (Vec<f32>, Vec<u32>) {
    let key = |i: u32| {
        let x = row[i as usize];
        if x.is_nan() {
            f32::NEG_INFINITY
        } else {
            x
        }
    };
    // Larger value first, then lower id.
    let cmp = |a: &u32, b: &u32| key(*b).total_cmp(&key(*a)).then(a.cmp(b));
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable_by(cmp);
    (idx.iter().map(|&i| key(i)).collect(), idx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_row_is_the_largest_in_order_with_ties_by_id() {
        let row = [0.5f32, 3.0, -1.0, 3.0, 2.0, f32::NAN, 7.0];
        let (v, i) = top_k_row(&row, 4);
        assert_eq!(i, vec![6, 1, 3, 4]);
        assert_eq!(v, vec![7.0, 3.0, 3.0, 2.0]);
        let (_, all) = top_k_row(&row, row.len());
        assert_eq!(all, vec![6, 1, 3, 4, 0, 2, 5]);
    }

    /// The walk on hand-made scores: row 1's choice follows the transition from row 0's.
    #[test]
    fn walk_follows_the_chosen_predecessor() {
        let s = WalkScores {
            n: 2,
            k: 2,
            unary: vec![1.0, 0.0, 0.0, 0.0],
            cand: vec![10, 11, 20, 21],
            first: vec![0.0, 0.5],
            // after cand 0 of row 0: prefer j=1; after cand 1: prefer j=0
            trans: vec![0.0, 1.0, 1.0, 0.0],
        };
        assert_eq!(s.path(), vec![10, 21]);
        let s2 = WalkScores {
            first: vec![0.0, 2.0],
            ..s
        };
        assert_eq!(s2.path(), vec![11, 20]);
    }

    /// The matmul form of the scores equals the reference's per-step sum
    /// `unary + sum_r pred[prev] * hp * succ[c]`, walked step by step.
    #[test]
    fn scores_equal_the_step_by_step_sum() {
        let dev = Device::Cpu;
        let (n, h, v, r, k) = (5, 8, 40, 6, 4);
        let pred = Tensor::randn(0f32, 1.0, (v, r), &dev).unwrap();
        let succ = Tensor::randn(0f32, 1.0, (v, r), &dev).unwrap();
        let pw = Tensor::randn(0f32, 1.0, (r, h), &dev).unwrap();
        let sel = Selector::from_parts(
            pred.clone(),
            succ.clone(),
            Linear::dense(pw.clone(), None),
            k,
        );
        let hidden = Tensor::randn(0f32, 1.0, (n, h), &dev).unwrap();
        let logits = (Tensor::randn(0f32, 1.0, (n, v), &dev).unwrap() * 3.0).unwrap();
        let anchor = 7u32;
        let path = sel.walk(&hidden, &logits, anchor).unwrap();

        let hp: Vec<Vec<f32>> = hidden.matmul(&pw.t().unwrap()).unwrap().to_vec2().unwrap();
        let pred: Vec<Vec<f32>> = pred.to_vec2().unwrap();
        let succ: Vec<Vec<f32>> = succ.to_vec2().unwrap();
        let lg: Vec<Vec<f32>> = logits.to_vec2().unwrap();
        let mut prev = anchor as usize;
        let mut want = Vec::new();
        for p in 0..n {
            let (uv, ui) = top_k_row(&lg[p], k);
            let mut best = (f32::NEG_INFINITY, 0u32);
            for (j, &c) in ui.iter().enumerate() {
                let s: f32 = uv[j]
                    + (0..r)
                        .map(|q| pred[prev][q] * hp[p][q] * succ[c as usize][q])
                        .sum::<f32>();
                if s > best.0 {
                    best = (s, c);
                }
            }
            want.push(best.1);
            prev = best.1 as usize;
        }
        assert_eq!(path, want);
    }
}
