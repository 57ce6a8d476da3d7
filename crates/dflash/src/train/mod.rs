//! Training a DFlash draft (`dflash train`) on the engine's own target and draft code.
//!
//! Beside the data flow: the target ([`crate::archs`]) produces taps and labels; the draft
//! ([`crate::draft::DraftModel`]) is built by its normal loader on tensors that are candle
//! `Var`s ([`Weights::from_tensors`]), so training runs the very forward inference runs
//! ([`DraftModel::forward_blocks`] is the many-blocks form of [`DraftModel::forward`], and a
//! test checks they agree). Checkpoints are z-lab format and load with `dflash generate
//! --draft DIR` unchanged.
//!
//! Recipe (spec, issue 9): per sequence, anchors among response positions; a block
//! `[token at anchor, MASK x (B-1)]` at positions `anchor..anchor+B` sees the context taps
//! strictly before its anchor and its own block; loss = cross-entropy at block rows 1..B-1
//! against the target's tokens, weighted by `exp(-(k-1)/gamma)`; AdamW, linear warm-up then
//! cosine decay, global grad-norm clipping; target embedding and LM head frozen.
//!
//! DFlash2 (`--arch dflash2`): the same draft plus the convolutions (initialized as the
//! identity: base kernel 1 at offset 0, 0 elsewhere, dynamic kernels near 0, so training
//! starts from a DFlash draft) and the candidate selector, trained jointly: the selector's loss
//! is the cross-entropy of its walk scores over each row's top-k candidates (of the detached
//! draft logits) with the target's token as the label where it is a candidate, teacher-forced
//! (the predecessor is the target's previous token), weighted like the draft's loss and added
//! with weight `selector_loss_alpha`.

pub mod adamw;
pub mod data;

use crate::archs::{BatchItem, ForwardOutput, Logits, TargetModel};
use crate::config::draft::{default_taps, Dflash2Config, DraftConfig};
use crate::config::TargetConfig;
use crate::draft::{BlockSegment, DraftModel};
use crate::rng::Rng;
use crate::source::Weights;
use crate::{Error, Result};
use adamw::AdamW;
use candle_core::{DType, Device, Tensor, Var, D};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::Path;

/// Hyper-parameters of a training run.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Draft decoder layers (1..=5 usual).
    pub draft_layers: usize,
    pub block_size: usize,
    /// Target layers tapped; None = `auto` (see [`auto_taps`]).
    pub taps: Option<Vec<usize>>,
    /// Token whose (frozen, target) embedding marks the positions to fill.
    pub mask_token_id: u32,
    /// Draft MLP width; None = the target's.
    pub intermediate_size: Option<usize>,
    pub steps: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps (then cosine decay to `lr * min_lr_ratio`).
    pub warmup: usize,
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    /// Global gradient-norm clip (0 = none).
    pub clip: f64,
    /// Loss decay over block rows; None = 7 * block_size / 16.
    pub gamma: Option<f64>,
    pub seed: u64,
    /// Blocks per optimizer step (over several sequences).
    pub batch_blocks: usize,
    /// Blocks drawn from one sequence (one forward) per step.
    pub blocks_per_seq: usize,
    /// Dtype of the trainable weights and the draft compute.
    pub dtype: DType,
    /// Train a DFlash2 draft with these convolution and selector sizes.
    pub dflash2: Option<Dflash2Config>,
    /// Weight of the selector's loss (DFlash2).
    pub selector_loss_alpha: f64,
    /// Attention-score elements of a layer up to which sequences share one draft forward;
    /// None = the device's default ([`PACK_SCORES`] on CUDA, none on the CPU). Same loss
    /// either way, up to the float order of the sums.
    pub pack_scores: Option<usize>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            draft_layers: 1,
            block_size: 16,
            taps: None,
            mask_token_id: 0,
            intermediate_size: None,
            steps: 1000,
            lr: 6e-4,
            warmup: 50,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            clip: 1.0,
            gamma: None,
            seed: 0,
            batch_blocks: 64,
            blocks_per_seq: 16,
            dtype: DType::F32,
            dflash2: None,
            selector_loss_alpha: 1.0,
            pack_scores: None,
        }
    }
}

impl TrainOptions {
    pub fn gamma(&self) -> f64 {
        self.gamma.unwrap_or(7.0 * self.block_size as f64 / 16.0)
    }
    /// Learning rate at `step` (0-based): linear warm-up, then cosine to `lr * min_lr_ratio`.
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = (self.steps.saturating_sub(self.warmup)).max(1) as f64;
        let t = ((step - self.warmup) as f64 / span).min(1.0);
        let min = self.lr * self.min_lr_ratio;
        min + 0.5 * (self.lr - min) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

/// `--taps auto`: five layers spread over the target (the z-lab rule for five), as every
/// published z-lab draft taps five layers; fewer for targets under five layers.
pub fn auto_taps(target_layers: usize) -> Vec<usize> {
    if target_layers <= 5 {
        return (0..target_layers).collect();
    }
    default_taps(5, target_layers)
}

/// The z-lab `config.json` of a draft for `target` with these options.
pub fn draft_config_json(target: &TargetConfig, opts: &TrainOptions, taps: &[usize]) -> Value {
    let dtype = match opts.dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let mut v = json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": opts.block_size,
        "dflash_config": {
            "mask_token_id": opts.mask_token_id,
            "target_layer_ids": taps,
            "block_size": opts.block_size,
        },
        "num_target_layers": target.num_hidden_layers,
        "hidden_size": target.hidden_size,
        "intermediate_size": opts.intermediate_size.unwrap_or(target.intermediate_size),
        "num_hidden_layers": opts.draft_layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope.theta,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": false,
        "attention_bias": false,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "trained_by": "dflash train",
    });
    if let Some(d) = &opts.dflash2 {
        v["architectures"] = json!(["DFlash2DraftModel"]);
        let dc = &mut v["dflash_config"];
        dc["conv_kernel_size"] = json!(d.conv_kernel_size);
        dc["conv_group_size"] = json!(d.conv_group_size);
        dc["selector_rank"] = json!(d.selector_rank);
        dc["selector_top_k"] = json!(d.selector_top_k);
    }
    v
}

/// How a trainable tensor starts.
#[derive(Clone, Copy)]
enum Init {
    /// N(0, 0.02).
    Normal,
    Ones,
    /// A convolution's base kernel `[2, K, H]`: 1 at offset 0, 0 at the others (the identity).
    IdentityKernel,
}

/// One training sequence after the target pass: its taps and the target's token at every
/// position.
#[derive(Clone)]
pub struct Example {
    /// Token ids (prompt + response).
    pub ids: Vec<u32>,
    /// `[len, taps * hidden]` on the device (target compute dtype).
    pub taps: Tensor,
    /// `labels[p]` = the target's token at position p (p >= 1).
    pub labels: Vec<u32>,
    /// First position that may be an anchor (the first response token).
    pub response_start: usize,
}

impl Example {
    /// Anchors a in `response_start ..= len - 2` (each has at least one label).
    pub fn anchor_range(&self) -> std::ops::Range<usize> {
        self.response_start..self.ids.len().saturating_sub(1)
    }
}

/// How labels are made from the target pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Labels {
    /// The sequence is the target's own output: labels are its tokens.
    Sequence,
    /// The target's argmax after each position (a reference text relabelled).
    Argmax,
}

impl Labels {
    /// The logits a target pass must return for these labels.
    fn logits(self) -> Logits {
        match self {
            Labels::Sequence => Logits::None,
            Labels::Argmax => Logits::All,
        }
    }
}

/// Rows a batch of target passes takes at most ([`make_examples_batch`]; one longer sequence
/// still runs alone).
const PASS_ROWS: usize = 4096;
/// Sequences a batch of target passes takes at most.
const PASS_SEQS: usize = 32;

/// Target passes (taps, and logits when relabelling) over several sequences in one batched
/// forward ([`TargetModel::forward_batch`]: every layer's weights read once for all of them),
/// each made into an [`Example`] as its own pass would make it (batched == alone).
pub fn make_examples_batch(
    target: &dyn TargetModel,
    taps: &[usize],
    seqs: &[&data::Sequence],
    labels: Labels,
) -> Result<Vec<Example>> {
    for s in seqs {
        check_sequence(s.ids.len(), s.response_start)?;
    }
    let mut caches = seqs
        .iter()
        .map(|s| target.new_cache(s.ids.len()))
        .collect::<Result<Vec<_>>>()?;
    let mut items: Vec<BatchItem> = seqs
        .iter()
        .zip(caches.iter_mut())
        .map(|(s, cache)| BatchItem {
            tokens: &s.ids,
            start: 0,
            cache,
            logits: labels.logits(),
        })
        .collect();
    let outs = target.forward_batch(&mut items, taps)?;
    seqs.iter()
        .zip(outs)
        .map(|(s, out)| example_from(out?, s.ids.clone(), s.response_start, labels))
        .collect()
}

fn check_sequence(n: usize, response_start: usize) -> Result<()> {
    if n < 2 || response_start >= n {
        return Err(Error::input(format!(
            "training sequence of {n} tokens has no response tokens after position {response_start}"
        )));
    }
    Ok(())
}

fn example_from(
    out: ForwardOutput,
    ids: Vec<u32>,
    response_start: usize,
    labels: Labels,
) -> Result<Example> {
    let n = ids.len();
    let t = out
        .taps
        .ok_or_else(|| Error::input("target returned no taps"))?;
    let labels = match labels {
        Labels::Sequence => ids.clone(),
        Labels::Argmax => {
            let l = out
                .logits
                .ok_or_else(|| Error::input("target returned no logits"))?;
            let am = l.argmax(D::Minus1)?.to_vec1::<u32>()?;
            // labels[p] = the target's choice after position p - 1.
            std::iter::once(ids[0])
                .chain(am[..n - 1].iter().copied())
                .collect()
        }
    };
    Ok(Example {
        ids,
        // its own allocation: the forward's taps are views into the batch's one tensor, so an
        // example kept past its batch-mates (the pool's streamed window) would keep the whole
        // batch's rows alive while the pool's budget counted its own rows (session 47: the
        // device filled over ~2,000 steps and ran out of memory)
        taps: t.force_contiguous()?,
        labels,
        response_start,
    })
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy)]
pub struct StepStats {
    pub loss: f64,
    /// Weighted-loss label positions in the step.
    pub tokens: usize,
    pub grad_norm: f64,
    pub lr: f64,
    /// Top-1 accuracy of block row 1 (the first proposed token).
    pub acc1: f64,
}

/// Attention-score elements of one layer up to which the trainer packs sequences into one
/// draft forward on CUDA (2^28: 1 GiB of f32 scores a layer).
pub const PACK_SCORES: usize = 1 << 28;

/// Consecutive runs of `parts` (each a sequence's (block rows, context rows)) that share one
/// forward: a run grows while `heads x rows x (context + block)` of the whole run (a layer's
/// scores: every row over the joint context and its own block's `block` keys, `sdpa_blocks`)
/// stays within `limit`; every part is in exactly one run, a part alone even when it passes
/// the limit.
pub fn pack_runs(
    parts: &[(usize, usize)],
    heads: usize,
    block: usize,
    limit: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut runs = vec![];
    let (mut start, mut n, mut s) = (0, 0, 0);
    for (i, &(rows, ctx)) in parts.iter().enumerate() {
        let (n1, s1) = (n + rows, s + ctx);
        if i > start && heads.saturating_mul(n1).saturating_mul(s1 + block) > limit {
            runs.push(start..i);
            (start, n, s) = (i, rows, ctx);
        } else {
            (n, s) = (n1, s1);
        }
    }
    if start < parts.len() {
        runs.push(start..parts.len());
    }
    runs
}

/// The `dflash train` flags that make a draft's config (named when a checkpoint's differs).
const DRAFT_FLAGS: &str =
    "(--draft-layers, --block-size, --taps, --mask-token, --intermediate-size, --arch)";

/// A draft in training: its variables, the draft model built on them, the optimizer.
pub struct Trainer {
    pub opts: TrainOptions,
    pub config: Value,
    pub taps: Vec<usize>,
    vars: Vec<(String, Var)>,
    draft: DraftModel,
    opt: AdamW,
    /// The target's LM head as a dense `[hidden, vocab]` matrix (frozen).
    head_t: Tensor,
    rng: Rng,
    step: usize,
    device: Device,
}

impl Trainer {
    /// A freshly initialized draft for `target` (seeded: linear weights N(0, 0.02), norms 1).
    pub fn new(
        target: &dyn TargetModel,
        target_cfg: &TargetConfig,
        opts: TrainOptions,
    ) -> Result<Self> {
        let taps = opts
            .taps
            .clone()
            .unwrap_or_else(|| auto_taps(target_cfg.num_hidden_layers));
        let config = draft_config_json(target_cfg, &opts, &taps);
        let dcfg = DraftConfig::from_value("(draft in training)", config.clone())?;
        let taps = dcfg.validate_against(target_cfg, &target_cfg.file)?;
        let device = target.info().device.clone();
        let c = &dcfg.layers;
        let (h, k, d) = (c.hidden_size, taps.len(), c.head_dim);
        let (qd, kd, i) = (
            c.num_attention_heads * d,
            c.num_key_value_heads * d,
            c.intermediate_size,
        );
        let mut shapes: Vec<(String, Vec<usize>, Init)> = vec![
            ("fc.weight".into(), vec![h, k * h], Init::Normal),
            ("hidden_norm.weight".into(), vec![h], Init::Ones),
            ("norm.weight".into(), vec![h], Init::Ones),
        ];
        for l in 0..c.num_hidden_layers {
            let p = format!("layers.{l}");
            for (n, s, norm) in [
                ("input_layernorm", vec![h], true),
                ("post_attention_layernorm", vec![h], true),
                ("self_attn.q_proj", vec![qd, h], false),
                ("self_attn.k_proj", vec![kd, h], false),
                ("self_attn.v_proj", vec![kd, h], false),
                ("self_attn.o_proj", vec![h, qd], false),
                ("self_attn.q_norm", vec![d], true),
                ("self_attn.k_norm", vec![d], true),
                ("mlp.gate_proj", vec![i, h], false),
                ("mlp.up_proj", vec![i, h], false),
                ("mlp.down_proj", vec![h, i], false),
            ] {
                let init = if norm { Init::Ones } else { Init::Normal };
                shapes.push((format!("{p}.{n}.weight"), s, init));
            }
            if let Some(d2) = &dcfg.dflash2 {
                let (kk, g) = (d2.conv_kernel_size, h / d2.conv_group_size);
                for conv in ["attention_conv", "mlp_conv"] {
                    shapes.push((
                        format!("{p}.{conv}.base_kernel"),
                        vec![2, kk, h],
                        Init::IdentityKernel,
                    ));
                    shapes.push((
                        format!("{p}.{conv}.kernel_projection.weight"),
                        vec![2 * kk * g, h],
                        Init::Normal,
                    ));
                }
            }
        }
        if let Some(d2) = &dcfg.dflash2 {
            let (v, r) = (c.vocab_size, d2.selector_rank);
            for (n, s) in [
                ("candidate_selector.predecessor_codebook.weight", vec![v, r]),
                ("candidate_selector.successor_codebook.weight", vec![v, r]),
                ("candidate_selector.hidden_projection.weight", vec![r, h]),
            ] {
                shapes.push((n.into(), s, Init::Normal));
            }
        }
        // The frozen LM head, dense: head(I) = W^T. (A quantized head has no backward in
        // candle; this copy is exact for float heads, and the dequantized weights otherwise.)
        let eye = Tensor::eye(h, target.info().dtype, &device)?;
        let head_t = target.lm_head(&eye)?.to_dtype(opts.dtype)?.detach();
        // The final norm starts at 1 / (mean LM-head row norm), so that initial logits have
        // about unit scale (with 1, real heads give logits in the tens: loss ~70 at step 0).
        let row_norm = head_t
            .to_dtype(DType::F32)?
            .sqr()?
            .sum(0)?
            .sqrt()?
            .mean_all()?
            .to_scalar::<f32>()?;
        let out_norm = if row_norm.is_finite() && row_norm > 0.0 {
            1.0 / row_norm
        } else {
            1.0
        };
        let mut rng = Rng::new(opts.seed);
        let mut vars = Vec::new();
        for (name, shape, init) in shapes {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = match init {
                _ if name == "norm.weight" => vec![out_norm; n],
                Init::Ones => vec![1.0; n],
                Init::Normal => (0..n).map(|_| (rng.normal() * 0.02) as f32).collect(),
                Init::IdentityKernel => {
                    let (kk, hh) = (shape[1], shape[2]);
                    (0..n)
                        .map(|i| if (i / hh) % kk == 0 { 1.0 } else { 0.0 })
                        .collect()
                }
            };
            let t = Tensor::from_vec(v, shape, &device)?.to_dtype(opts.dtype)?;
            vars.push((name, Var::from_tensor(&t)?));
        }
        let tensors: BTreeMap<String, Tensor> = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let w = Weights::from_tensors(tensors, opts.dtype, &device);
        let draft = DraftModel::load(dcfg, taps.clone(), &w)?;
        let opt = AdamW::new(&vars, opts.lr, opts.weight_decay)?;
        Ok(Self {
            opts,
            config,
            taps,
            vars,
            draft,
            opt,
            head_t,
            rng,
            step: 0,
            device,
        })
    }

    /// The draft being trained (its weights are the live variables).
    pub fn draft(&self) -> &DraftModel {
        &self.draft
    }

    /// The frozen LM head used for training logits, `[hidden, vocab]`.
    pub fn head_t(&self) -> &Tensor {
        &self.head_t
    }

    /// Trainable parameters.
    pub fn num_params(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Draw anchors (distinct, seeded) from one example.
    fn anchors(&mut self, ex: &Example, n: usize) -> Vec<usize> {
        let r = ex.anchor_range();
        let mut all: Vec<usize> = r.collect();
        // Partial Fisher-Yates.
        let n = n.min(all.len());
        for i in 0..n {
            let j = i + self.rng.below(all.len() - i);
            all.swap(i, j);
        }
        all.truncate(n);
        all.sort_unstable();
        all
    }

    /// Weighted cross-entropy terms of the blocks at `anchors` of each example, in one draft
    /// forward ([`DraftModel::forward_segments_rows`]): (sum of w * -log p, sum of w,
    /// labelled positions, row-1 hits, row-1 count).
    fn seq_loss(
        &self,
        target: &dyn TargetModel,
        items: &[(&Example, &[usize])],
    ) -> Result<(Tensor, f64, usize, usize, usize)> {
        let q = self.opts.block_size;
        let gamma = self.opts.gamma();
        let mask = self.opts.mask_token_id;
        let nb: usize = items.iter().map(|(_, a)| a.len()).sum();
        let mut block_ids = Vec::with_capacity(nb * q);
        let mut labels = Vec::with_capacity(nb * (q - 1));
        let mut weights = Vec::with_capacity(nb * (q - 1));
        for (ex, anchors) in items {
            let n = ex.ids.len();
            for &a in anchors.iter() {
                block_ids.push(ex.ids[a]);
                block_ids.extend(std::iter::repeat_n(mask, q - 1));
                for k in 1..q {
                    if a + k < n {
                        labels.push(ex.labels[a + k]);
                        weights.push((-((k - 1) as f64) / gamma).exp() as f32);
                    } else {
                        labels.push(0);
                        weights.push(0.0);
                    }
                }
            }
        }
        let segs: Vec<BlockSegment<'_>> = items
            .iter()
            .map(|(ex, anchors)| BlockSegment {
                ctx: &ex.taps,
                anchors,
            })
            .collect();
        let rows = self
            .draft
            .forward_segments_rows(target, &segs, &block_ids)?;
        let logits = self.draft.logits_with(target, &rows, Some(&self.head_t))?;
        let m = labels.len();
        let wsum: f64 = weights.iter().map(|&w| w as f64).sum();
        let count = weights.iter().filter(|&&w| w > 0.0).count();
        // Row-1 accuracy: the argmax of each block's first row only (over every row it was
        // ~2.7 ms of a 512-block step's ~170 on an H100, session 51's ncu).
        let first: Vec<u32> = (0..nb).map(|b| (b * (q - 1)) as u32).collect();
        let first = Tensor::from_vec(first, nb, &self.device)?;
        let pred = logits
            .detach()
            .index_select(&first, 0)?
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?;
        let (mut hit, mut tot) = (0, 0);
        for (b, &p) in pred.iter().enumerate() {
            let r = b * (q - 1);
            if weights[r] > 0.0 {
                tot += 1;
                hit += usize::from(p == labels[r]);
            }
        }
        let vocab = logits.dim(1)?;
        if let Some(&bad) = labels.iter().find(|&&l| l as usize >= vocab) {
            return Err(Error::input(format!(
                "draft training: label {bad} is past the head's {vocab} rows (a sequence of another tokenizer?)"
            )));
        }
        let lab = Tensor::from_vec(labels.clone(), m, &self.device)?;
        let w = Tensor::from_vec(weights.clone(), m, &self.device)?;
        let mut nll = match crate::nn::train_ops::applies(&logits) {
            // one pass forward, one backward (the log-softmax chain's were ~10% of a GPU step)
            true => crate::nn::train_ops::weighted_xent(&logits, &lab, &w)?.sum_all()?,
            false => {
                let lp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
                let picked = lp.gather(&lab.reshape((m, 1))?, 1)?.squeeze(1)?;
                (picked * w)?.sum_all()?.neg()?
            }
        };
        if let Some(sel) = self.draft.selector() {
            // The predecessor of row k is the token before it: the anchor's (the block's
            // first id) for row 1.
            let prev: Vec<u32> = block_ids
                .iter()
                .step_by(q)
                .enumerate()
                .flat_map(|(b, &first)| {
                    let labels = &labels;
                    (1..q).map(move |k| {
                        if k == 1 {
                            first
                        } else {
                            labels[b * (q - 1) + k - 2]
                        }
                    })
                })
                .collect();
            let (cand, pos) =
                crate::draft::dflash2::label_candidates(&logits.detach(), sel.top_k, &labels)?;
            let scores = sel.train_scores(&rows, &logits, &cand, &prev)?;
            // Rows whose label is a candidate, with the draft's weights.
            let (mut idx, mut at, mut sw) = (Vec::new(), Vec::new(), Vec::new());
            for r in 0..m {
                if let (Some(j), true) = (pos[r], weights[r] > 0.0) {
                    idx.push(r as u32);
                    at.push(j as u32);
                    sw.push(weights[r] * self.opts.selector_loss_alpha as f32);
                }
            }
            if !idx.is_empty() {
                let n_sel = idx.len();
                let rows_t = Tensor::from_vec(idx, n_sel, &self.device)?;
                let lps =
                    candle_nn::ops::log_softmax(&scores.index_select(&rows_t, 0)?, D::Minus1)?;
                let at = Tensor::from_vec(at, (n_sel, 1), &self.device)?;
                let sw = Tensor::from_vec(sw, n_sel, &self.device)?;
                let sel_nll = (lps.gather(&at, 1)?.squeeze(1)? * sw)?.sum_all()?.neg()?;
                nll = (nll + sel_nll)?;
            }
        }
        Ok((nll, wsum, count, hit, tot))
    }

    /// The drawn examples split into runs that share one draft forward ([`pack_runs`] at
    /// `opts.pack_scores`, by default [`PACK_SCORES`] on CUDA, where the step is launch-bound:
    /// session 43's H100 took 0.2 s a step of 8 sequences one by one; 0 on the CPU, where the
    /// time is arithmetic and a joint context multiplies the attention's).
    fn forward_groups(&self, drawn: &[(Example, Vec<usize>)]) -> Vec<std::ops::Range<usize>> {
        let limit = self
            .opts
            .pack_scores
            .unwrap_or(match self.device.is_cuda() {
                true => PACK_SCORES,
                false => 0,
            });
        let q = self.opts.block_size;
        let parts: Vec<(usize, usize)> = drawn
            .iter()
            .map(|(_, a)| (a.len() * q, a.iter().copied().max().unwrap_or(0)))
            .collect();
        pack_runs(&parts, self.draft.num_heads(), q, limit)
    }

    /// One optimizer step on `batch_blocks` blocks drawn from random examples of `pool`.
    pub fn step(&mut self, target: &dyn TargetModel, pool: &mut ExamplePool) -> Result<StepStats> {
        let per = self.opts.blocks_per_seq.max(1);
        let mut left = self.opts.batch_blocks.max(1);
        // DFLASH_PROFILE: where a step's time goes (target passes made while drawing, the
        // draft forward with the loss, the backward, clipping and the optimizer)
        let mut timer = crate::stats::SectionTimer::start("train step", &self.device);
        // DFLASH_PROFILE=ncu-train: the 6th and 7th steps of the process under the profiler
        static STEPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let _ncu = crate::stats::profiled_steps(crate::switches::Profile::NcuTrain, &STEPS, 5..7);
        let mut drawn = Vec::new();
        while left > 0 {
            let ex = pool.draw(target, &mut self.rng)?;
            let anchors = self.anchors(&ex, per.min(left));
            left -= anchors.len();
            drawn.push((ex, anchors));
        }
        timer.mark("draw");
        let mut parts = Vec::new();
        let (mut wsum, mut tokens, mut hit, mut tot) = (0.0, 0, 0, 0);
        for group in self.forward_groups(&drawn) {
            let items: Vec<(&Example, &[usize])> = drawn[group]
                .iter()
                .map(|(ex, a)| (ex, a.as_slice()))
                .collect();
            let (nll, w, c, h, t) = self.seq_loss(target, &items)?;
            parts.push(nll);
            wsum += w;
            tokens += c;
            hit += h;
            tot += t;
        }
        let total = parts
            .iter()
            .skip(1)
            .try_fold(parts[0].clone(), |a, b| a + b)?;
        let loss = (total / wsum.max(1e-9))?;
        timer.mark("forward");
        let mut grads = loss.backward()?;
        timer.mark("backward");
        // Global gradient-norm clipping (the per-parameter sums stay on the device: one read).
        let mut sums = vec![];
        for (_, v) in &self.vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                sums.push(g.to_dtype(DType::F32)?.sqr()?.sum_all()?);
            }
        }
        let sq = match sums.is_empty() {
            true => 0.0,
            false => Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f32>()? as f64,
        };
        let norm = sq.sqrt();
        if self.opts.clip > 0.0 && norm > self.opts.clip {
            let s = self.opts.clip / norm;
            for (_, v) in &self.vars {
                if let Some(g) = grads.get(v.as_tensor()) {
                    let g = (g * s)?;
                    grads.insert(v.as_tensor(), g);
                }
            }
        }
        timer.mark("clip");
        let lr = self.opts.lr_at(self.step);
        self.opt.lr = lr;
        self.opt.step(&grads)?;
        timer.mark("optimizer");
        timer.finish();
        self.step += 1;
        let loss = loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        if !loss.is_finite() {
            return Err(Error::input(format!(
                "training diverged at step {}: loss {loss} (lower --lr)",
                self.step
            )));
        }
        Ok(StepStats {
            loss,
            tokens,
            grad_norm: norm,
            lr,
            acc1: hit as f64 / tot.max(1) as f64,
        })
    }

    /// Mean weighted loss over `blocks` blocks per example (no update), for a held-out check.
    pub fn eval_loss(
        &mut self,
        target: &dyn TargetModel,
        examples: &[Example],
        blocks: usize,
    ) -> Result<f64> {
        let (mut nll, mut w) = (0f64, 0f64);
        for ex in examples {
            if ex.anchor_range().is_empty() {
                continue;
            }
            let anchors = self.anchors(ex, blocks);
            let (l, ws, ..) = self.seq_loss(target, &[(ex, &anchors)])?;
            nll += l.detach().to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
            w += ws;
        }
        Ok(nll / w.max(1e-9))
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// Write what [`Trainer::resume`] needs into `dir`: `resume.safetensors` (the f32
    /// parameters and the optimizer's moments) and `resume.json` (step, schedule, sampler
    /// state, the draft's config).
    pub fn save_state(&self, dir: &Path, pool: &ExamplePool) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        self.opt.save(&dir.join("resume.safetensors"))?;
        crate::testing::write_json(
            &dir.join("resume.json"),
            &json!({
                "step": self.step,
                "steps": self.opts.steps,
                "warmup": self.opts.warmup,
                "optimizer_t": self.opt.t,
                "rng": self.rng.state().to_string(),
                "pool_position": pool.position(),
                "config": self.config,
            }),
        )
    }

    /// Start from the weights of a draft this trainer's flags would make (`dir/config.json` and
    /// `dir/model.safetensors` as [`Trainer::save`] writes them, at any float dtype): e.g. an
    /// earlier session's returned draft, trained further on new data. Unlike
    /// [`Trainer::resume`], the optimizer, step and schedule start fresh.
    pub fn init_from(&mut self, dir: &Path) -> Result<()> {
        let f = dir.join("config.json");
        let text = std::fs::read_to_string(&f).map_err(|e| Error::io(&f, e))?;
        let mut cfg: Value = serde_json::from_str(&text)
            .map_err(|e| Error::input(format!("{}: {e}", f.display())))?;
        // an MLX-quantized draft (`quantize_draft`, as models/ holds them) starts from its
        // dequantized weights: lossy at its bits, the same draft otherwise
        let quantized = cfg.get("quantization").is_some();
        // a narrowed draft (`draft::narrow`, as models/ holds them): its own head over the
        // frequent tokens is made from the target's after training, not trained; the body
        // starts from it, and the head is left out (narrow the trained draft again)
        let narrowed = cfg.get("draft_vocab_size").is_some();
        let head_of_its_own =
            |n: &str| narrowed && (n == "d2t" || n.starts_with("lm_head.") || n == "t2d");
        // saved at another dtype than this run trains in: the same draft
        if let Some(o) = cfg.as_object_mut() {
            o.remove("quantization");
            o.remove("draft_vocab_size");
            o.insert("torch_dtype".into(), self.config["torch_dtype"].clone());
        }
        if cfg != self.config {
            return Err(Error::input(format!(
                "{}: the draft's config differs from this run's: train with the flags it was trained with {DRAFT_FLAGS}",
                f.display()
            )));
        }
        if quantized {
            let src = crate::source::ModelSource::from_dir(&dir.display().to_string(), dir)?;
            let w = src.weights(DType::F32, &Device::Cpu, false)?;
            for (n, v) in &self.vars {
                v.set(
                    &w.get(n, v.shape())?
                        .to_dtype(v.dtype())?
                        .to_device(&self.device)?,
                )?;
            }
            if let Some(n) = w.unused().into_iter().find(|n| !head_of_its_own(n)) {
                return Err(Error::weights(
                    src.weight_files[0].display().to_string(),
                    format!("tensor {n} is not a parameter of this draft"),
                ));
            }
            return Ok(());
        }
        let st = dir.join("model.safetensors");
        let mut saved = candle_core::safetensors::load(&st, &Device::Cpu)
            .map_err(|e| Error::weights(st.display().to_string(), e.to_string()))?;
        for (n, v) in &self.vars {
            let t = saved.remove(n).ok_or_else(|| {
                Error::weights(st.display().to_string(), format!("no tensor {n}"))
            })?;
            if t.dims() != v.dims() {
                return Err(Error::weights(
                    st.display().to_string(),
                    format!("{n} is {:?}, this draft's is {:?}", t.dims(), v.dims()),
                ));
            }
            v.set(&t.to_dtype(v.dtype())?.to_device(&self.device)?)?;
        }
        if let Some(n) = saved.keys().find(|n| !head_of_its_own(n)) {
            return Err(Error::weights(
                st.display().to_string(),
                format!("tensor {n} is not a parameter of this draft"),
            ));
        }
        Ok(())
    }

    /// Continue from [`Trainer::save_state`]'s files in `dir`: parameters, moments, step,
    /// schedule and sampler state. The draft's config must be the one this trainer was built
    /// with (same flags); the schedule (`opts.steps`, `opts.warmup`) is the checkpoint's, so a
    /// run whose first call fitted it to a time limit keeps that fit (and its learning rate)
    /// in every later call. Returns the example pool's position to continue from
    /// ([`ExamplePool::start_at`]).
    pub fn resume(&mut self, dir: &Path) -> Result<usize> {
        let f = dir.join("resume.json");
        let text = std::fs::read_to_string(&f).map_err(|e| Error::io(&f, e))?;
        let st: Value = serde_json::from_str(&text)
            .map_err(|e| Error::input(format!("{}: {e}", f.display())))?;
        let bad = |what: &str| {
            Error::input(format!(
                "{}: {what} (written by `dflash train`'s checkpoints; resume from such a directory)",
                f.display()
            ))
        };
        if st["config"] != self.config {
            return Err(Error::input(format!(
                "{}: the checkpoint's draft config differs from this run's: resume with the flags it was trained with {DRAFT_FLAGS}",
                f.display()
            )));
        }
        let step = st["step"].as_u64().ok_or_else(|| bad("no step"))? as usize;
        let t = st["optimizer_t"]
            .as_u64()
            .ok_or_else(|| bad("no optimizer_t"))? as usize;
        let rng: u64 = st["rng"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| bad("no rng"))?;
        let steps = st["steps"].as_u64().ok_or_else(|| bad("no steps"))? as usize;
        let warmup = st["warmup"].as_u64().ok_or_else(|| bad("no warmup"))? as usize;
        self.opt.load(&dir.join("resume.safetensors"))?;
        self.opt.t = t;
        self.step = step;
        self.opts.steps = steps;
        self.opts.warmup = warmup;
        self.rng = Rng::from_state(rng);
        Ok(st["pool_position"].as_u64().unwrap_or(0) as usize)
    }

    /// Write `config.json` + `model.safetensors` (weights in `dtype`) into `dir`.
    pub fn save(&self, dir: &Path, dtype: DType) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut tensors = HashMap::new();
        for (n, v) in &self.vars {
            tensors.insert(
                n.clone(),
                v.as_tensor()
                    .detach()
                    .to_dtype(dtype)?
                    .to_device(&Device::Cpu)?,
            );
        }
        let st = dir.join("model.safetensors");
        candle_core::safetensors::save(&tensors, &st)
            .map_err(|e| Error::weights(st.display().to_string(), e.to_string()))?;
        let mut cfg = self.config.clone();
        cfg["torch_dtype"] = json!(match dtype {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            _ => "float32",
        });
        crate::testing::write_json(&dir.join("config.json"), &cfg)
    }
}

/// How training sequences get their responses (see [`data`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataMode {
    /// The target's own responses, generated by the engine.
    SelfGenerated,
    /// The dataset's reference responses, relabelled by the target's argmax.
    Relabel,
}

impl DataMode {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "self" => Ok(DataMode::SelfGenerated),
            "relabel" => Ok(DataMode::Relabel),
            o => Err(Error::input(format!(
                "--data {o}: expected self or relabel"
            ))),
        }
    }
    pub fn labels(self) -> Labels {
        match self {
            DataMode::SelfGenerated => Labels::Sequence,
            DataMode::Relabel => Labels::Argmax,
        }
    }
}

/// How to turn records into sequences.
#[derive(Debug, Clone)]
pub struct SequenceOptions {
    pub mode: DataMode,
    /// Longest sequence (prompt + response), tokens.
    pub max_seq: usize,
    /// `self`: tokens generated per prompt.
    pub max_new: usize,
    /// `self`: sampling temperature (0 = greedy), seeded per prompt.
    pub temperature: f32,
    pub seed: u64,
    /// Format prompts with the chat template (when the model has one).
    pub chat_template: bool,
    /// `self`: responses generated together, at most this many at once with continuous
    /// admission (one [`crate::engine::Engine::generate_queue_gated`] over every prompt: one
    /// target pass a step for all in flight, the next prompt admitted as one finishes, so
    /// short answers do not leave the batch idle behind a long one); each is what it would be
    /// alone (its own seeded sampler). 1 = one at a time.
    pub gen_batch: usize,
    /// `(k, n)`: only the records whose index is k modulo n (the k-th of n processes sharing
    /// the work; record i keeps seed `seed + i`, so the shards' sequences together are the
    /// unsharded run's). `(0, 1)`: all.
    pub shard: (usize, usize),
}

impl Default for SequenceOptions {
    fn default() -> Self {
        SequenceOptions {
            mode: DataMode::SelfGenerated,
            max_seq: 1024,
            max_new: 256,
            temperature: 0.0,
            seed: 0,
            chat_template: true,
            gen_batch: 1,
            shard: (0, 1),
        }
    }
}

/// Sequences for `records` with the pipeline's target, tokenizer and chat template. Records
/// that cannot make a sequence (no reference in `relabel` mode, a prompt longer than
/// `max_seq`, an empty response) are skipped and counted in the returned notes. `progress`
/// is called with (records done, total) before each record (`relabel`) or before each
/// prompt is admitted to the generation queue (`self`) and returns false to stop early (a
/// time budget: no more prompts are admitted, the answers in flight finish). Record `i`'s
/// response is sampled with seed `seed + i` whatever `gen_batch`.
pub fn build_sequences(
    p: &crate::pipeline::Pipeline,
    records: &[data::Record],
    o: &SequenceOptions,
    progress: &mut dyn FnMut(usize, usize) -> bool,
) -> Result<(Vec<data::Sequence>, Vec<String>)> {
    let (k, shards) = o.shard;
    if shards == 0 || k >= shards {
        return Err(Error::input(format!(
            "shard {k} of {shards}: want 0 <= k < n (--gen-shard K/N)"
        )));
    }
    let mine = |i: usize| i % shards == k;
    let (mut out, mut no_ref, mut too_long, mut empty) = (Vec::new(), 0, 0, 0);
    let mut push = |prompt: Vec<u32>, response: Vec<u32>| {
        if response.is_empty() {
            empty += 1;
            return;
        }
        let response_start = prompt.len();
        let mut ids = prompt;
        ids.extend(response);
        out.push(data::Sequence {
            ids,
            response_start,
        });
    };
    // the record's prompt ids, None when it has none or they leave no room for an answer
    let mut prompt_of = |r: &data::Record| -> Result<Option<Vec<u32>>> {
        let Some(prompt) = p.prompt_record_ids(&r.prompt, o.chat_template, None)? else {
            return Ok(None);
        };
        if prompt.is_empty() || prompt.len() + 2 > o.max_seq {
            too_long += 1;
            return Ok(None);
        }
        Ok(Some(prompt))
    };
    let n = records.len();
    let mut i = 0;
    match o.mode {
        DataMode::Relabel => {
            while i < n {
                if !progress(i, n) {
                    break;
                }
                let (j, r) = (i, &records[i]);
                i += 1;
                if !mine(j) {
                    continue;
                }
                let Some(prompt) = prompt_of(r)? else {
                    continue;
                };
                let Some(reference) = &r.reference else {
                    no_ref += 1;
                    continue;
                };
                let tok = p.tokenizer.as_ref().ok_or_else(|| {
                    Error::input("--data relabel needs a tokenizer to encode the reference texts")
                })?;
                let mut ids = tok.encode(reference, false)?;
                ids.truncate(o.max_seq - prompt.len());
                push(prompt, ids);
            }
        }
        DataMode::SelfGenerated => {
            // every usable prompt first, then one queue: the next prompt is admitted as an
            // answer finishes, so the batch stays full until the budget or the records end
            // (groups drained between them cost ~20% more steps on the demo's answers)
            let mut prompts = Vec::new();
            for (j, r) in records.iter().enumerate().filter(|(j, _)| mine(*j)) {
                if let Some(prompt) = prompt_of(r)? {
                    prompts.push((j, prompt));
                }
            }
            let outs = generate_gated(
                p,
                &prompts,
                o.temperature,
                o.seed,
                o.gen_batch,
                |len| o.max_new.min(o.max_seq - len),
                &mut |k| progress(prompts[k].0, n),
            );
            i = n;
            for ((j, prompt), r) in prompts.iter().zip(outs) {
                match r {
                    Some(r) => push(prompt.clone(), r?.output_ids),
                    None => {
                        i = *j;
                        break;
                    }
                }
            }
        }
    }
    progress(i, n);
    let mut notes = vec![];
    if i < n {
        notes.push(format!(
            "stopped after {i} of {} records (time budget)",
            records.len()
        ));
    }
    if no_ref > 0 {
        notes.push(format!("{no_ref} records without a reference response skipped (relabel needs one; use --data self)"));
    }
    if too_long > 0 {
        notes.push(format!("{too_long} prompts longer than --max-seq skipped"));
    }
    if empty > 0 {
        notes.push(format!("{empty} empty responses skipped"));
    }
    Ok((out, notes))
}

/// Plain decoding of `prompts` (record index, ids) with the pipeline's engine in one queue, at
/// most `in_flight` at once (one target pass a step for all of them; the next admitted as one
/// finishes), record `j` sampled with seed `seed + j` and given `max_new(prompt length)`
/// tokens; each output is what it would be alone. `admit(k)` is asked before prompt `k` is
/// admitted: after the first false none is, and those never admitted come back as None.
fn generate_gated(
    p: &crate::pipeline::Pipeline,
    prompts: &[(usize, Vec<u32>)],
    temperature: f32,
    seed: u64,
    in_flight: usize,
    max_new: impl Fn(usize) -> usize,
    admit: &mut dyn FnMut(usize) -> bool,
) -> Vec<Option<Result<crate::engine::GenerateOutput>>> {
    use crate::engine::{Flow, GenerateRequest};
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .map(|(j, prompt)| {
            let mut req = GenerateRequest::new(prompt.clone(), max_new(prompt.len()));
            req.stop_ids = p.stop_ids.clone();
            req.block_size = Some(1);
            req.adaptive = false;
            req.sampling.temperature = temperature;
            req.sampling.seed = seed.wrapping_add(*j as u64);
            req
        })
        .collect();
    p.engine
        .generate_queue_gated(&reqs, in_flight.max(1), &mut |_, _| Flow::Continue, admit)
}

/// What [`synth_prompts`] makes.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// User turns to sample (fewer come back: unfinished and repeated ones are dropped).
    pub count: usize,
    /// Text each user turn starts with, cycled over the turns (`"Write a Python function"`
    /// steers the model toward code questions); empty: none.
    pub steers: Vec<String>,
    /// Longest user turn, tokens (a turn that has not ended by then is dropped).
    pub max_new: usize,
    pub temperature: f32,
    /// Turn `i` is sampled with seed `seed + i`.
    pub seed: u64,
    /// Turns sampled together (as [`SequenceOptions::gen_batch`]).
    pub gen_batch: usize,
}

/// User turns written by the target itself, for `--data self` when the prompt files are too
/// few or too far from where the draft will serve (the Magpie recipe: the chat template
/// rendered up to where the user's text goes is the prompt, so the model samples what a
/// user would ask, and ends the turn with its end-of-turn token). Each returned record's
/// prompt text is the steer plus the sampled turn; the answers are then made as for any
/// prompt file. `progress(done, count)` is called before each turn is admitted to the
/// generation queue and returns false to stop early (a time budget).
/// Needs a chat template that places the user's text verbatim.
pub fn synth_prompts(
    p: &crate::pipeline::Pipeline,
    o: &SynthOptions,
    progress: &mut dyn FnMut(usize, usize) -> bool,
) -> Result<(Vec<data::Record>, Vec<String>)> {
    const MARK: &str = "DFLASH_SYNTH_USER_TEXT";
    let (Some(tok), Some(template)) = (p.tokenizer.as_ref(), p.template.as_ref()) else {
        return Err(Error::input(format!(
            "--synth-prompts needs the model's tokenizer and chat template; {} has {}",
            p.model_name,
            if p.tokenizer.is_none() {
                "no tokenizer"
            } else {
                "no chat template"
            }
        )));
    };
    let text = template.render(
        &[crate::chat::ChatMessage::user(MARK)],
        false,
        Some(false),
        &Default::default(),
    )?;
    let Some(at) = text.find(MARK) else {
        return Err(Error::input(format!(
            "--synth-prompts: the chat template of {} does not place the user's text verbatim",
            p.model_name
        )));
    };
    let head = &text[..at];
    let steers: Vec<&str> = match o.steers.is_empty() {
        true => vec![""],
        false => o.steers.iter().map(|s| s.as_str()).collect(),
    };
    let heads = steers
        .iter()
        .map(|s| tok.encode(&format!("{head}{s}"), false))
        .collect::<Result<Vec<_>>>()?;
    let (mut out, mut seen) = (Vec::new(), std::collections::HashSet::new());
    let (mut unfinished, mut repeated) = (0, 0);
    let prompts: Vec<(usize, Vec<u32>)> = (0..o.count)
        .map(|j| (j, heads[j % heads.len()].clone()))
        .collect();
    let outs = generate_gated(
        p,
        &prompts,
        o.temperature,
        o.seed,
        o.gen_batch,
        |_| o.max_new,
        &mut |k| progress(k, o.count),
    );
    let mut i = o.count;
    for (j, r) in outs.into_iter().enumerate() {
        let Some(r) = r else {
            i = j;
            break;
        };
        let r = r?;
        if r.stats.finish_reason != "stop" {
            unfinished += 1;
            continue;
        }
        let turn = format!(
            "{}{}",
            steers[j % steers.len()],
            tok.decode(&r.output_ids, true)?
        );
        let turn = turn.trim();
        if turn.is_empty() || !seen.insert(turn.to_string()) {
            repeated += 1;
            continue;
        }
        out.push(data::Record {
            prompt: crate::bench::prompts::Prompt {
                id: format!("synth-{j}"),
                text: Some(turn.to_string()),
                prompt_ids: None,
                earlier: vec![],
            },
            reference: None,
        });
    }
    progress(i, o.count);
    let notes = vec![format!(
        "{} user turns sampled from the target ({} of {} asked{}): {unfinished} unfinished after {} tokens and {repeated} empty or repeated dropped",
        out.len(),
        i,
        o.count,
        if i < o.count { ", stopped by the time budget" } else { "" },
        o.max_new
    )];
    Ok((out, notes))
}

/// Target passes over `seqs` (taps + labels), all of them (the held-out check's few).
pub fn make_examples(
    target: &dyn TargetModel,
    taps: &[usize],
    seqs: &[data::Sequence],
    mode: DataMode,
) -> Result<Vec<Example>> {
    let mut out = Vec::with_capacity(seqs.len());
    let mut at = 0;
    while at < seqs.len() {
        let batch = pass_batch(seqs[at..].iter());
        out.extend(make_examples_batch(target, taps, &batch, mode.labels())?);
        at += batch.len();
    }
    Ok(out)
}

/// The leading sequences of `seqs` that one batch of target passes takes: up to
/// [`PASS_SEQS`] of them within [`PASS_ROWS`] rows (at least one).
fn pass_batch<'a>(seqs: impl Iterator<Item = &'a data::Sequence>) -> Vec<&'a data::Sequence> {
    let mut rows = 0;
    let mut batch = Vec::new();
    for s in seqs.take(PASS_SEQS) {
        if !batch.is_empty() && rows + s.ids.len() > PASS_ROWS {
            break;
        }
        rows += s.ids.len();
        batch.push(s);
    }
    batch
}

/// The training examples of a run: sequences whose target passes (taps and labels) are made
/// on demand and held on the device up to a byte budget. When every sequence fits, each pass
/// is made once and kept (the whole set resident). When not, the pool holds a window: each
/// step draws examples uniformly from it, and an example leaves after `reuse` draws (about as
/// often as the whole run would draw a sequence if all fitted), replaced by the next sequence
/// of a seeded shuffle. So a sequence costs one target pass per visit, not per draw, and the
/// run sees every sequence in turn, however large the set.
pub struct ExamplePool {
    seqs: Vec<data::Sequence>,
    taps: Vec<usize>,
    labels: Labels,
    budget: u64,
    reuse: usize,
    /// Load order (a seeded shuffle of `seqs`), cycled; `next` is the next to load.
    order: Vec<usize>,
    next: usize,
    /// (example, draws so far)
    window: Vec<(Example, usize)>,
    /// Passes made ahead in a batch, next in load order, not yet in the window.
    ready: VecDeque<Example>,
    bytes: u64,
    /// Target passes made.
    pub passes: usize,
}

impl ExamplePool {
    /// A pool over the `seqs` that can anchor a block (the others are dropped); `budget` bytes
    /// of taps on the device; `reuse` draws before an example leaves a window that cannot
    /// hold them all (see [`ExamplePool::reuse_for`]).
    pub fn new(
        seqs: Vec<data::Sequence>,
        taps: &[usize],
        labels: Labels,
        budget: u64,
        reuse: usize,
        seed: u64,
    ) -> Result<Self> {
        let seqs: Vec<_> = seqs
            .into_iter()
            .filter(|s| s.ids.len() >= s.response_start + 2)
            .collect();
        if seqs.is_empty() {
            return Err(Error::input(
                "no training sequence has a response token to anchor a block on",
            ));
        }
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        let mut rng = Rng::new(seed ^ 0x5eed_9001);
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        Ok(ExamplePool {
            seqs,
            taps: taps.to_vec(),
            labels,
            budget,
            reuse: reuse.max(1),
            order,
            next: 0,
            window: Vec::new(),
            ready: VecDeque::new(),
            bytes: 0,
            passes: 0,
        })
    }

    /// Draws per example that a run of `steps` steps of `opts`' batch would make on average
    /// over `n` sequences if all were resident (at least 1).
    pub fn reuse_for(opts: &TrainOptions, steps: usize, n: usize) -> usize {
        let per = opts.blocks_per_seq.max(1);
        let draws = opts.batch_blocks.max(1).div_ceil(per);
        ((steps * draws) as f64 / n.max(1) as f64).round().max(1.0) as usize
    }

    /// Change the draws before an example leaves (a run's step count was cut).
    pub fn set_reuse(&mut self, reuse: usize) {
        self.reuse = reuse.max(1);
    }

    /// Where in its load order the pool's window begins (for a resumed run to go on from
    /// there: [`ExamplePool::start_at`]).
    pub fn position(&self) -> usize {
        self.next
            .saturating_sub(self.window.len() + self.ready.len())
    }

    /// Begin loading at `position` of the load order (before [`ExamplePool::fill`]).
    pub fn start_at(&mut self, position: usize) {
        self.next = position;
    }

    /// Sequences in the pool (those that can anchor a block).
    pub fn len(&self) -> usize {
        self.seqs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
    /// Examples on the device now, and their bytes.
    pub fn resident(&self) -> (usize, u64) {
        (self.window.len(), self.bytes)
    }
    fn all_resident(&self) -> bool {
        self.window.len() == self.seqs.len()
    }

    /// The next example in load order: made ahead with up to `ahead - 1` more in one batched
    /// target forward ([`make_examples_batch`]; a batch does not wrap past the end of the
    /// load order, so a pool that holds every sequence makes each pass once).
    fn load_next(&mut self, target: &dyn TargetModel, ahead: usize) -> Result<Example> {
        if self.ready.is_empty() {
            let n = self.order.len();
            let at = self.next % n;
            let want = ahead.clamp(1, n - at);
            let batch = pass_batch(self.order[at..at + want].iter().map(|&i| &self.seqs[i]));
            let made = make_examples_batch(target, &self.taps, &batch, self.labels)?;
            self.next += made.len();
            self.passes += made.len();
            self.ready.extend(made);
        }
        Ok(self
            .ready
            .pop_front()
            .expect("a batch makes at least one example"))
    }

    fn example_bytes(ex: &Example) -> u64 {
        (ex.taps.elem_count() * ex.taps.dtype().size_in_bytes()) as u64
    }

    /// Make target passes until the budget is used or every sequence is resident (at least
    /// one); `progress(loaded, of)` after each.
    pub fn fill(
        &mut self,
        target: &dyn TargetModel,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<()> {
        while !self.all_resident() && (self.window.is_empty() || self.bytes < self.budget) {
            let ahead = self.seqs.len() - self.window.len();
            let ex = self.load_next(target, ahead)?;
            self.bytes += Self::example_bytes(&ex);
            self.window.push((ex, 0));
            progress(self.window.len(), self.seqs.len());
        }
        Ok(())
    }

    /// The token ids of the examples on the device now (window order; for checks and logs).
    pub fn resident_ids(&self) -> Vec<&[u32]> {
        self.window
            .iter()
            .map(|(ex, _)| ex.ids.as_slice())
            .collect()
    }

    /// Hold at most `budget` bytes of taps from now on (a step ran out of device memory with
    /// the window the budget allowed): the examples at the window's end leave it (one stays,
    /// however large), and so do the passes made ahead, which go back into the load order.
    /// When the window held every sequence, those that left are the last loaded and the load
    /// order goes back to the first of them: they are the next loaded, and the pool then runs
    /// as one filled to `budget` from the start. Returns how many examples left, or None when
    /// the window holds one example only.
    pub fn shrink(&mut self, budget: u64) -> Option<usize> {
        if self.window.len() < 2 {
            return None;
        }
        let all = self.all_resident();
        // the passes made ahead go back into the load order
        self.next -= self.ready.len();
        self.ready.clear();
        let mut left = 0;
        while self.window.len() > 1 && self.bytes > budget {
            let (ex, _) = self.window.pop().expect("more than one example");
            self.bytes -= Self::example_bytes(&ex);
            left += 1;
        }
        // a window that held every sequence holds them in load order (nothing was replaced),
        // so the examples that left are the last `left` loaded: load them next. (A streaming
        // window's order is the draws'; those that left come again in the next cycle.)
        if all {
            self.next -= left;
        }
        self.budget = budget;
        Some(left)
    }

    /// One example drawn uniformly from the window with `rng`; it is replaced by the next
    /// sequence once drawn `reuse` times (unless every sequence is resident).
    fn draw(&mut self, target: &dyn TargetModel, rng: &mut Rng) -> Result<Example> {
        if self.window.is_empty() {
            self.fill(target, &mut |_, _| {})?;
        }
        let i = rng.below(self.window.len());
        let slot = &mut self.window[i];
        slot.1 += 1;
        let ex = slot.0.clone();
        if slot.1 >= self.reuse && !self.all_resident() {
            // replacements made a quarter of the window ahead at most
            let ahead = self.window.len() / 4;
            let new = self.load_next(target, ahead)?;
            self.bytes = self.bytes - Self::example_bytes(&ex) + Self::example_bytes(&new);
            self.window[i] = (new, 0);
        }
        Ok(ex)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs cover every part once, in order; limit 0 gives one part a run, no limit one run,
    /// and a limit in between splits where the joint scores would pass it.
    #[test]
    fn pack_runs_split_at_the_score_limit() {
        let parts = [(32, 100), (32, 60), (32, 200), (16, 10)];
        assert_eq!(pack_runs(&parts, 2, 16, 0), vec![0..1, 1..2, 2..3, 3..4]);
        assert_eq!(pack_runs(&parts, 2, 16, usize::MAX), vec![0..4]);
        // 2 x 64 x (160 + 16) = 22,528 fits 25,000; adding the third: 2 x 96 x (360 + 16) =
        // 72,192 does not; the third and fourth: 2 x 48 x (210 + 16) = 21,696 fit
        assert_eq!(pack_runs(&parts, 2, 16, 25_000), vec![0..2, 2..4]);
        // the block's keys count: at 22,000 the first two (22,528) no longer fit
        assert_eq!(pack_runs(&parts, 2, 16, 22_000), vec![0..1, 1..2, 2..4]);
        // a part over the limit alone still runs
        assert_eq!(pack_runs(&parts[2..3], 2, 16, 1), vec![0..1]);
        assert!(pack_runs(&[], 2, 16, 10).is_empty());
    }
}
