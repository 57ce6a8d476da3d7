//! The DFlash block-diffusion draft (spec section 2): one architecture for every published
//! draft. Conditioned on target hidden-state taps, it proposes a whole block in one pass.
//!
//! Fourth step of the data flow: config -> sources -> archs -> **draft** -> engine.
//!
//! Per call, given new context rows `ctx_in [S, K*H]` (taps of newly committed target
//! positions) and a block `[last token, MASK x ]` at positions `start .. start+Q`:
//! `ctx = hidden_norm(fc(ctx_in))` once; per layer, context K/V come from the layer's own
//! k/v projections (+ k_norm, RoPE at their absolute positions) and are cached; block rows
//! attend to all cached context plus the whole block (full layers: non-causal; sliding
//! layers: causal + window). The draft borrows the target's embedding and LM head.

pub mod dflash2;
pub mod graphs;
pub mod narrow;

use crate::archs::TargetModel;
use crate::config::draft::DraftConfig;
use crate::config::LayerType;
use crate::nn::{
    sdpa_blocks, Activation, Attention, AttentionSpec, GatedMlp, KvCache, Linear, Masks, RmsNorm,
    Rope, RopeTables, Site, Visibility,
};
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
pub use dflash2::{DynConv, Selector};

struct DraftLayer {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    mlp: GatedMlp,
    /// Which block rows see which keys (the layer type and `is_causal`).
    vis: Visibility,
    /// DFlash2: the convolutions around attention and the MLP.
    attn_conv: Option<DynConv>,
    mlp_conv: Option<DynConv>,
}

impl DraftLayer {
    /// The attention sublayer's input (convolved for DFlash2) and the kernel its output needs.
    fn pre_attn(&self, x: Tensor, block: usize) -> Result<(Tensor, Option<Tensor>)> {
        match &self.attn_conv {
            Some(c) => c.prepare(&x, block).map(|(x, d)| (x, Some(d))),
            None => Ok((x, None)),
        }
    }
    fn post_attn(&self, y: Tensor, d: Option<Tensor>, block: usize) -> Result<Tensor> {
        match (&self.attn_conv, d) {
            (Some(c), Some(d)) => c.finish(&y, &d, block),
            _ => Ok(y),
        }
    }
    /// The MLP on its normed input, between the DFlash2 convolutions (the finishing one with
    /// the down projection).
    fn mlp(&self, x: &Tensor, block: usize) -> Result<Tensor> {
        match &self.mlp_conv {
            Some(c) => {
                let (xc, d) = c.prepare(x, block)?;
                self.mlp.forward_then(&xc, Some(&c.after(&d, block)))
            }
            None => self.mlp.forward(x),
        }
    }
}

pub struct DraftModel {
    pub cfg: DraftConfig,
    /// Target layers tapped, in concatenation order (resolved against the target).
    pub taps: Vec<usize>,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DraftLayer>,
    norm: RmsNorm,
    rope: Rope,
    dtype: DType,
    device: Device,
    /// The draft's own (narrow) LM head (speculators); None = the target's.
    head: Option<Linear>,
    /// Draft id -> target id offsets (`d2t`): target = draft + d2t[draft].
    d2t: Option<Vec<i64>>,
    /// The draft's own copy of the embedding table, when the checkpoint carries one.
    embed: Option<Tensor>,
    /// Every layer's k/v rows stacked (CUDA only, see `fuse`): the new context rows'
    /// keys and values for all layers in one matmul, written per layer by the fused kernel.
    ctx_kv: Option<Linear>,
    /// DFlash2: the candidate selector that turns the logits into the proposal.
    selector: Option<Selector>,
    /// CUDA graphs of the block pass (`draft::graphs`).
    graphs: graphs::DraftGraphs,
}

/// One sequence's part of a segmented training forward
/// ([`DraftModel::forward_segments_rows`]): its context taps `[len, taps * hidden]` and the
/// anchors of its blocks.
pub struct BlockSegment<'a> {
    pub ctx: &'a Tensor,
    pub anchors: &'a [usize],
}

/// One sequence's part of a batched draft call ([`DraftModel::propose_batch`]).
pub struct DraftItem<'a> {
    /// New context rows (taps of the positions `cache.len() .. start`).
    pub ctx: Tensor,
    /// `[last token, MASK x (q-1)]`.
    pub block: &'a [u32],
    pub start: usize,
    pub cache: &'a mut DraftCache,
    /// The sequence's sampler: its logit adjustments steer the proposals (None: plain argmax).
    pub guide: Option<&'a crate::sampling::Sampler>,
}

/// The draft's per-sequence state: projected context K/V per layer. Block rows are never
/// kept, so a rejection needs no draft rollback.
pub struct DraftCache {
    layers: Vec<KvCache>,
}

impl DraftCache {
    /// A new cache of `capacity` positions with a copy of this one's first `len` context rows.
    pub fn fork(&self, len: usize, capacity: usize) -> Result<Self> {
        Ok(Self {
            layers: self
                .layers
                .iter()
                .map(|l| l.fork(len, capacity))
                .collect::<Result<_>>()?,
        })
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes()).sum()
    }

    /// Context positions held.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DraftModel {
    /// Stack each layer's q/k/v and gate/up weights into one linear each (inference; see
    /// `load_draft`).
    pub fn fuse(&mut self) -> Result<()> {
        for l in &mut self.layers {
            l.attn.fuse()?;
            l.mlp.fuse()?;
        }
        // Where the fused kernels run, one matmul projects the new context rows for every
        // layer (a copy of the k/v rows: ~2 x kv_heads x head_dim x hidden per layer, 84 MB
        // for a Qwen3-8B-shaped draft) instead of one small launch per layer.
        if self.device.is_cuda() && crate::nn::fused::allowed() {
            let kvs: Option<Vec<&Linear>> =
                self.layers.iter().map(|l| l.attn.kv.as_ref()).collect();
            if let Some(kvs) = kvs {
                self.ctx_kv = Linear::concat(&kvs)?;
            }
        }
        Ok(())
    }

    /// On the CPU, every dense linear requantized to Q8_0 for the int8 product (after
    /// [`Self::fuse`]: the stacked weights too; `DFLASH_DRAFT_Q8=0` keeps them float). The
    /// draft only proposes, so the output stays the target's; a Q8_0 weight is within half a
    /// step of 1/127 of its block's largest magnitude, which moves proposals rarely (the demo
    /// draft's acceptance in docs/perf.md). Returns how many were requantized.
    pub fn requantize_q8(&mut self) -> Result<usize> {
        let mut n = 0;
        let mut swap = |l: &mut Linear| -> Result<()> {
            if let Some(q) = l.to_q8()? {
                *l = q;
                n += 1;
            }
            Ok(())
        };
        // not `fc`: its input is the target's raw hidden states, whose outlier channels would
        // swamp the int8 activation blocks (and it runs on the few new context rows only)
        if let Some(h) = self.head.as_mut() {
            swap(h)?;
        }
        if let Some(c) = self.ctx_kv.as_mut() {
            swap(c)?;
        }
        for l in &mut self.layers {
            for lin in l.attn.linears_mut().chain(l.mlp.linears_mut()) {
                swap(lin)?;
            }
        }
        Ok(n)
    }

    /// Load a z-lab format draft (`fc`, `hidden_norm`, `layers.*`, `norm`). `taps` come from
    /// [`DraftConfig::validate_against`]. A checkpoint with tensors the model does not use is
    /// an error listing them.
    pub fn load(cfg: DraftConfig, taps: Vec<usize>, w: &Weights) -> Result<Self> {
        let c = &cfg.layers;
        let h = c.hidden_size;
        let k = taps.len();
        let eps = c.rms_norm_eps;
        let act = Activation::parse(&cfg.file, &c.hidden_act)?;
        let spec = AttentionSpec {
            bias: c.attention_bias,
            o_bias: c.attention_bias,
            qk_norm: true,
            ..AttentionSpec::new(
                h,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                eps,
            )
        };
        let fc = Linear::load(w, "fc", k * h, h, false).map_err(|e| match e {
            Error::Weights { file, msg } if msg.contains("has shape") => Error::Weights {
                file,
                msg: format!(
                    "{msg}: fc input width must be taps ({k}) x hidden ({h}) = {}",
                    k * h
                ),
            },
            e => e,
        })?;
        if let Some(i) = c.layer_types.iter().position(|&t| t == LayerType::Linear) {
            return Err(Error::config(
                &c.file,
                "layer_types",
                format!(
                    "draft layer {i} is linear_attention: DFlash draft layers are attention layers"
                ),
            ));
        }
        let d2 = cfg.dflash2;
        let conv = |p: String| -> Result<Option<DynConv>> {
            d2.map(|d| DynConv::load(w, &p, h, d.conv_kernel_size, d.conv_group_size))
                .transpose()
        };
        let mut layers = Vec::new();
        for i in 0..c.num_hidden_layers {
            let p = format!("layers.{i}");
            layers.push(DraftLayer {
                vis: layer_visibility(&cfg, c.layer_types[i]),
                attn_conv: conv(format!("{p}.attention_conv"))?,
                mlp_conv: conv(format!("{p}.mlp_conv"))?,
                input_norm: RmsNorm::load(
                    w,
                    &format!("{p}.input_layernorm.weight"),
                    h,
                    eps,
                    false,
                )?,
                attn: Attention::load(w, &format!("{p}.self_attn"), spec.clone())?,
                post_attn_norm: RmsNorm::load(
                    w,
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                    eps,
                    false,
                )?,
                mlp: GatedMlp::load(
                    w,
                    &format!("{p}.mlp"),
                    h,
                    c.intermediate_size,
                    c.mlp_bias,
                    act,
                )?,
            });
        }
        // Speculators checkpoints: optional own embedding, narrow head and vocab maps.
        let embed = match w.shape("embed_tokens.weight") {
            Some(sh) if sh.len() == 2 && sh[1] == h => {
                Some(w.get("embed_tokens.weight", (sh[0], h))?)
            }
            Some(sh) => {
                return Err(Error::weights(
                    cfg.file.clone(),
                    format!("embed_tokens.weight has shape {sh:?}, expected [vocab, {h}]"),
                ))
            }
            None => None,
        };
        let (head, d2t) = match w.shape("lm_head.weight") {
            Some(sh) => {
                let dv = cfg.draft_vocab_size.unwrap_or(sh[0]);
                let head = Linear::load(w, "lm_head", h, dv, false)?;
                let d2t = match w.shape("d2t") {
                    Some(_) => {
                        let t = w
                            .get_dtype("d2t", dv, DType::I64)?
                            .to_device(&Device::Cpu)?;
                        Some(t.to_vec1::<i64>()?)
                    }
                    None => None,
                };
                if w.shape("t2d").is_some() {
                    w.mark_used("t2d"); // the inverse map; d2t is all the engine needs
                }
                (Some(head), d2t)
            }
            None => (None, None),
        };
        let selector = match d2 {
            Some(d) => {
                if head.is_some() {
                    return Err(Error::weights(
                        cfg.file.clone(),
                        "a DFlash2 draft with its own lm_head is not supported (the selector's codebooks index target ids)",
                    ));
                }
                Some(Selector::load(
                    w,
                    h,
                    c.vocab_size,
                    d.selector_rank,
                    d.selector_top_k,
                )?)
            }
            None => None,
        };
        let model = Self {
            graphs: graphs::DraftGraphs::default(),
            selector,
            head,
            d2t,
            embed,
            ctx_kv: None,
            fc,
            hidden_norm: RmsNorm::load(w, "hidden_norm.weight", h, eps, false)?,
            norm: RmsNorm::load(w, "norm.weight", h, eps, false)?,
            rope: Rope::new(&c.rope, c.head_dim),
            layers,
            taps,
            dtype: w.dtype,
            device: w.device.clone(),
            cfg,
        };
        let unused = w.unused();
        if !unused.is_empty() {
            return Err(Error::weights(
                model.cfg.file.clone(),
                format!(
                    "{} tensors not used by the DFlash draft: {}",
                    unused.len(),
                    unused.join(", ")
                ),
            ));
        }
        Ok(model)
    }

    /// The tokens the draft can propose when its own head is narrower than the target's
    /// vocabulary (`d2t`: a speculators draft, or one narrowed by [`narrow`]); None: all.
    pub fn draft_vocab(&self) -> Option<usize> {
        self.d2t.as_ref().map(Vec::len)
    }

    /// "DFlash2" for a draft with convolutions and a selector, else "DFlash".
    pub fn arch_name(&self) -> &'static str {
        if self.selector.is_some() {
            "DFlash2"
        } else {
            "DFlash"
        }
    }

    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    /// Attention heads of a draft layer.
    pub fn num_heads(&self) -> usize {
        self.cfg.layers.num_attention_heads
    }
    pub fn mask_token_id(&self) -> u32 {
        self.cfg.mask_token_id
    }

    pub fn new_cache(&self, capacity: usize) -> Result<DraftCache> {
        let c = &self.cfg.layers;
        let layers = (0..self.layers.len())
            .map(|_| {
                KvCache::new(
                    c.num_key_value_heads,
                    c.head_dim,
                    capacity,
                    self.dtype,
                    &self.device,
                )
            })
            .collect::<Result<_>>()?;
        Ok(DraftCache { layers })
    }

    /// Greedy proposals for block rows 1..Q, as TARGET token ids (a narrow draft vocabulary
    /// is mapped through `d2t`). With a `guide` that adjusts logits (bias, penalties), each
    /// row's choice is the argmax of its logits adjusted as the target's will be at that
    /// position (the committed tokens and the proposals before it): see
    /// [`Self::guided_choices`].
    pub fn propose(
        &self,
        target: &dyn TargetModel,
        ctx_in: &Tensor,
        block: &[u32],
        start: usize,
        cache: &mut DraftCache,
        guide: Option<&crate::sampling::Sampler>,
    ) -> Result<Vec<u32>> {
        let (rows, logits) = self.rows_and_logits(target, ctx_in, block, start, cache)?;
        let ids = match (guide.filter(|g| g.adjusts()), &self.selector) {
            (Some(g), _) => self.guided_choices(&rows, &logits, block[0], g)?,
            (None, Some(s)) => s.walk(&rows, &logits, block[0])?,
            (None, None) => crate::sampling::argmax_rows(&logits)?,
        };
        Ok(self.to_target_ids(ids))
    }

    /// [`Self::forward_rows`] and the logits of those rows; on CUDA the block pass and the
    /// LM head replay as a graph where they can (`draft::graphs`).
    fn rows_and_logits(
        &self,
        target: &dyn TargetModel,
        ctx_in: &Tensor,
        block: &[u32],
        start: usize,
        cache: &mut DraftCache,
    ) -> Result<(Tensor, Tensor)> {
        self.write_context(ctx_in, block, start, cache)?;
        if let Some(out) = self.graphs.block(self, target, block, start, cache)? {
            return Ok(out);
        }
        let rows = self.block_rows_of(target, block, start, cache)?;
        let logits = self.logits(target, &rows, None)?;
        Ok((rows, logits))
    }

    /// What the draft's CUDA graphs did (warm-ups, captures, replays, why they are off).
    pub fn graph_report(&self) -> crate::archs::graphs::GraphReport {
        self.graphs.report()
    }

    /// A pass's inputs agree: the context rows end where the block starts, the block has two
    /// rows at least.
    fn check_pass(
        &self,
        ctx_in: &Tensor,
        block: &[u32],
        start: usize,
        cache: &DraftCache,
    ) -> Result<()> {
        let s = ctx_in.dim(0)?;
        let ctx_start = cache.len();
        if ctx_start + s != start {
            return Err(Error::input(format!(
                "draft: context rows cover positions {ctx_start}..{} but the block starts at {start}",
                ctx_start + s
            )));
        }
        if block.len() < 2 {
            return Err(Error::input("draft: a block needs at least 2 positions"));
        }
        Ok(())
    }

    /// A draft-vocabulary id as a target id (through `d2t` for a narrow head).
    fn target_id(&self, i: u32) -> u32 {
        match &self.d2t {
            Some(d2t) => (i as i64 + d2t[i as usize]) as u32,
            None => i,
        }
    }

    /// Draft-vocabulary ids as target ids.
    fn to_target_ids(&self, ids: Vec<u32>) -> Vec<u32> {
        match &self.d2t {
            Some(_) => ids.into_iter().map(|i| self.target_id(i)).collect(),
            None => ids,
        }
    }

    /// The draft-vocabulary index of a target token id (None: not in a narrow head; the
    /// head's target ids `i + d2t[i]` increase with i, so a binary search finds it).
    fn draft_index(&self, t: u32) -> Option<usize> {
        match &self.d2t {
            None => Some(t as usize),
            Some(d2t) => {
                let target_of = |i: usize| i as i64 + d2t[i];
                let (mut lo, mut hi) = (0usize, d2t.len());
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    if target_of(mid) < t as i64 {
                        lo = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                (lo < d2t.len() && target_of(lo) == t as i64).then_some(lo)
            }
        }
    }

    /// Proposals under the guide's logit adjustments (draft-vocabulary ids). Without a
    /// selector row j is adjusted for the history the target will see there (committed
    /// tokens + proposals 1..j) and its argmax taken, one row after another on the host. A
    /// DFlash2 selector walks logits adjusted for the committed tokens alone (its walk
    /// scores candidates jointly; the bias is exact, repeats inside the block are not
    /// penalized in its proposals: acceptance only, never the output).
    fn guided_choices(
        &self,
        rows: &Tensor,
        logits: &Tensor,
        anchor: u32,
        guide: &crate::sampling::Sampler,
    ) -> Result<Vec<u32>> {
        let mut host = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let index = |t: u32| self.draft_index(t);
        if let Some(s) = &self.selector {
            for r in host.iter_mut() {
                guide.adjusted(r, &[], index);
            }
            let (n, v) = (host.len(), host.first().map_or(0, Vec::len));
            let flat: Vec<f32> = host.into_iter().flatten().collect();
            let adj = Tensor::from_vec(flat, (n, v), logits.device())?.to_dtype(logits.dtype())?;
            return s.walk(rows, &adj, anchor);
        }
        let mut ids = Vec::with_capacity(host.len());
        let mut extra: Vec<u32> = Vec::with_capacity(host.len());
        for r in host.iter_mut() {
            guide.adjusted(r, &extra, index);
            let i = crate::sampling::argmax(r);
            ids.push(i);
            extra.push(self.target_id(i));
        }
        Ok(ids)
    }

    /// Proposals for several sequences (each item as [`Self::propose`] alone), in item order:
    /// on the CPU one pass for all of them ([`Self::forward_rows_batch`]) and the LM head once
    /// over every item's rows; elsewhere one call per item.
    pub fn propose_batch(
        &self,
        target: &dyn TargetModel,
        items: &mut [DraftItem],
    ) -> Result<Vec<Vec<u32>>> {
        if items.len() < 2 {
            return items
                .iter_mut()
                .map(|it| self.propose(target, &it.ctx, it.block, it.start, it.cache, it.guide))
                .collect();
        }
        let (x, spans) = self.forward_rows_batch(target, items)?;
        let picked: Vec<usize> = spans.iter().flat_map(|&(off, n)| off..off + n).collect();
        let all = crate::nn::gather_rows(&x, &picked)?;
        let logits = self.logits(target, &all, None)?;
        // Without a selector, every row's argmax at once (one download).
        let mut all_ids = match &self.selector {
            None => Some(crate::sampling::argmax_rows(&logits)?.into_iter()),
            Some(_) => None,
        };
        let mut out = Vec::with_capacity(items.len());
        let mut off = 0;
        for (it, &(_, n)) in items.iter().zip(&spans) {
            // this item's rows and logits (rows `off ..` of `all`, in item order)
            let (r, l) = (&all.narrow(0, off, n)?, logits.narrow(0, off, n)?);
            off += n;
            let plain: Option<Vec<u32>> = all_ids.as_mut().map(|a| a.by_ref().take(n).collect());
            let ids = match (it.guide.filter(|g| g.adjusts()), &self.selector, plain) {
                (Some(g), _, _) => self.guided_choices(r, &l, it.block[0], g)?,
                (None, Some(s), _) => s.walk(r, &l, it.block[0])?,
                (None, None, Some(p)) => p,
                (None, None, None) => {
                    return Err(Error::input("draft: no argmax taken without a selector"))
                }
            };
            out.push(self.to_target_ids(ids));
        }
        Ok(out)
    }

    /// [`Self::forward_rows`] for several sequences in one pass: their new context rows
    /// through `fc` at once, their blocks' rows back to back through every layer (the weights
    /// read once), each block attending over its own context cache; the DFlash2 convolutions
    /// within each block. Returns the final-normed rows of every block back to back and, per
    /// item, where its rows 1..Q sit among them (`(first row, count)`).
    pub fn forward_rows_batch(
        &self,
        target: &dyn TargetModel,
        items: &mut [DraftItem],
    ) -> Result<(Tensor, Vec<(usize, usize)>)> {
        let dev = &self.device;
        let mut ctx_lens = Vec::with_capacity(items.len());
        for it in items.iter() {
            self.check_pass(&it.ctx, it.block, it.start, it.cache)?;
            ctx_lens.push(it.ctx.dim(0)?);
        }
        let qs: Vec<usize> = items.iter().map(|it| it.block.len()).collect();
        let starts: Vec<usize> = items.iter().map(|it| it.start).collect();
        // Context rows of every item through fc + hidden_norm at once.
        let with_ctx: Vec<&Tensor> = items
            .iter()
            .filter(|it| it.ctx.dim(0).unwrap_or(0) > 0)
            .map(|it| &it.ctx)
            .collect();
        let ctx_all = match with_ctx.len() {
            0 => None,
            _ => {
                let c = Tensor::cat(&with_ctx, 0)?.to_dtype(self.dtype)?;
                Some(self.hidden_norm.forward(&self.fc.forward(&c)?)?)
            }
        };
        // Their keys/values of every layer in one stacked projection, where the draft has it.
        let ctx_kv_all = match (&self.ctx_kv, &ctx_all) {
            (Some(l), Some(c)) => Some(l.forward(c)?),
            _ => None,
        };
        let mut ctx = Vec::with_capacity(items.len());
        let mut ctx_kv = Vec::with_capacity(items.len());
        let mut off = 0;
        for &s in &ctx_lens {
            ctx.push(match (&ctx_all, s) {
                (Some(c), s) if s > 0 => Some(c.narrow(0, off, s)?),
                _ => None,
            });
            ctx_kv.push(match (&ctx_kv_all, s) {
                (Some(y), s) if s > 0 => Some(y.narrow(0, off, s)?),
                _ => None,
            });
            off += s;
        }
        // Every item's positions in one table each for the context rows and the blocks.
        let ctx_runs: Vec<(usize, usize)> = items
            .iter()
            .zip(&ctx_lens)
            .map(|(it, &s)| (it.cache.len(), s))
            .collect();
        let t_ctx = self.rope.tables_runs(&ctx_runs, dev, self.dtype)?;
        let blk_runs: Vec<(usize, usize)> =
            items.iter().map(|it| (it.start, it.block.len())).collect();
        let t_blk = self.rope.tables_runs(&blk_runs, dev, self.dtype)?;
        // The items with context rows (in order: their rows are ctx_all's, back to back).
        let with_rows: Vec<usize> = (0..items.len()).filter(|&k| ctx_lens[k] > 0).collect();
        let masks: Vec<Masks> = items
            .iter()
            .map(|it| Masks::new(it.block.len(), it.start, self.dtype, dev))
            .collect();
        let ids: Vec<u32> = items
            .iter()
            .flat_map(|it| it.block.iter().copied())
            .collect();
        let mut h = self.embed_block(target, &ids)?;
        let mut x = match self.layers.first() {
            Some(l) => l.input_norm.forward(&h)?,
            None => h.clone(),
        };
        // Per-block pieces of a row-concatenated tensor, each through `f`, back together.
        let per_block =
            |t: &Tensor, f: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>| -> Result<Tensor> {
                let mut parts = Vec::with_capacity(qs.len());
                let mut off = 0;
                for (k, &q) in qs.iter().enumerate() {
                    parts.push(f(k, &t.narrow(0, off, q)?)?);
                    off += q;
                }
                Ok(Tensor::cat(&parts, 0)?)
            };
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.attn;
            // Every item's context keys/values in one launch where the batched kernel runs.
            let batched = match &ctx_kv_all {
                Some(y) if with_rows.len() > 1 => {
                    let tables: Vec<&RopeTables> = with_rows.iter().map(|&k| &t_ctx[k]).collect();
                    let mut kvs: Vec<&mut KvCache> = items
                        .iter_mut()
                        .enumerate()
                        .filter(|(k, _)| ctx_lens[*k] > 0)
                        .map(|(_, it)| &mut it.cache.layers[i])
                        .collect();
                    a.write_keys_values_segments(y, i, &self.rope, &tables, &mut kvs)?
                }
                _ => false,
            };
            for (k, it) in items.iter_mut().enumerate() {
                if let (false, Some(c)) = (batched, &ctx[k]) {
                    let kv = &mut it.cache.layers[i];
                    let written = match &ctx_kv[k] {
                        Some(y) => a.write_keys_values_from(y, i, &self.rope, &t_ctx[k], kv)?,
                        None => false,
                    };
                    if !written {
                        a.append_keys_values(c, &self.rope, &t_ctx[k], kv)?;
                    }
                }
            }
            let (xa, dks) = match &layer.attn_conv {
                None => (x, None),
                Some(conv) => {
                    let mut dks = Vec::with_capacity(qs.len());
                    let xa = per_block(&x, &mut |_, xb| {
                        let (xc, d) = conv.prepare(xb, xb.dim(0)?)?;
                        dks.push(d);
                        Ok(xc)
                    })?;
                    (xa, Some(dks))
                }
            };
            let sites: Vec<Site> = (0..items.len())
                .map(|k| Site {
                    rope: &self.rope,
                    tables: &t_blk[k],
                    vis: layer.vis,
                    masks: &masks[k],
                    step: None,
                    out_conv: None,
                })
                .collect();
            let mut kvs: Vec<&mut KvCache> =
                items.iter_mut().map(|it| &mut it.cache.layers[i]).collect();
            let mut attn_out = a.forward_segments(&xa, &sites, &mut kvs)?;
            for (kv, &start) in kvs.into_iter().zip(&starts) {
                kv.truncate(start);
            }
            if let (Some(conv), Some(dks)) = (&layer.attn_conv, &dks) {
                attn_out = per_block(&attn_out, &mut |k, yb| conv.finish(yb, &dks[k], yb.dim(0)?))?;
            }
            let (h1, xm) = layer.post_attn_norm.add_forward(&h, &attn_out)?;
            let m = match &layer.mlp_conv {
                None => layer.mlp.forward(&xm)?,
                Some(_) => per_block(&xm, &mut |_, xb| layer.mlp(xb, xb.dim(0)?))?,
            };
            let next_norm = match self.layers.get(i + 1) {
                Some(nl) => &nl.input_norm,
                None => &self.norm,
            };
            (h, x) = next_norm.add_forward(&h1, &m)?;
        }
        let mut spans = Vec::with_capacity(qs.len());
        let mut off = 0;
        for &q in &qs {
            spans.push((off + 1, q - 1));
            off += q;
        }
        Ok((x, spans))
    }

    /// Draft logits for block rows 1..Q: `[Q-1, draft vocab]` f32 (the target's vocab unless
    /// the draft has its own narrow head).
    ///
    /// `ctx_in [S, K*H]` are the taps of the target positions `cache.len() .. start` (they
    /// are appended to the cache); `block` holds Q ids at positions `start .. start + Q`.
    pub fn forward(
        &self,
        target: &dyn TargetModel,
        ctx_in: &Tensor,
        block: &[u32],
        start: usize,
        cache: &mut DraftCache,
    ) -> Result<Tensor> {
        Ok(self.rows_and_logits(target, ctx_in, block, start, cache)?.1)
    }

    /// The proposal for block rows 1..Q from the draft's output rows: the selector's walk
    /// (DFlash2) or each row's argmax, with the logits it came from.
    pub fn propose_from_rows(
        &self,
        target: &dyn TargetModel,
        rows: &Tensor,
        anchor: u32,
    ) -> Result<(Vec<u32>, Tensor)> {
        let logits = self.logits(target, rows, None)?;
        let ids = match &self.selector {
            Some(s) => s.walk(rows, &logits, anchor)?,
            None => crate::sampling::argmax_rows(&logits)?,
        };
        Ok((ids, logits))
    }

    /// The selector (DFlash2 drafts).
    pub fn selector(&self) -> Option<&Selector> {
        self.selector.as_ref()
    }

    /// The draft's final-normed output for block rows 1..Q: `[Q-1, H]` (see [`Self::forward`]).
    pub fn forward_rows(
        &self,
        target: &dyn TargetModel,
        ctx_in: &Tensor,
        block: &[u32],
        start: usize,
        cache: &mut DraftCache,
    ) -> Result<Tensor> {
        self.write_context(ctx_in, block, start, cache)?;
        self.block_rows_of(target, block, start, cache)
    }

    /// [`Self::block_rows`] of host ids, positions on the host (the eager pass).
    fn block_rows_of(
        &self,
        target: &dyn TargetModel,
        block: &[u32],
        start: usize,
        cache: &mut DraftCache,
    ) -> Result<Tensor> {
        let ids = Tensor::from_slice(block, block.len(), &self.device)?;
        self.block_rows(target, &ids, start, None, cache)
    }

    /// The context part of a draft pass: new context rows `ctx_in [S, K*H]` (taps of the
    /// positions `cache.len() ..`, which must end where `block` starts) through `fc` and
    /// `hidden_norm`, then every layer's keys and values of them into `cache`. Nothing here
    /// depends on the block, so it runs before the block's layers (and outside a CUDA graph of
    /// them: its row count varies).
    fn write_context(
        &self,
        ctx_in: &Tensor,
        block: &[u32],
        start: usize,
        cache: &mut DraftCache,
    ) -> Result<()> {
        self.check_pass(ctx_in, block, start, cache)?;
        let s = ctx_in.dim(0)?;
        if s == 0 {
            return Ok(());
        }
        let dev = &self.device;
        let ctx_start = cache.len();
        let mut prof = crate::stats::SectionTimer::start("draft context", dev);
        let ctx = self
            .hidden_norm
            .forward(&self.fc.forward(&ctx_in.to_dtype(self.dtype)?)?)?;
        let t_ctx = self.rope.tables(ctx_start, s, dev, self.dtype)?;
        let ctx_kv = match &self.ctx_kv {
            Some(l) => Some(l.forward(&ctx)?),
            None => None,
        };
        prof.mark("fc+tables");
        for (i, (layer, kv)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let a = &layer.attn;
            let written = match &ctx_kv {
                Some(y) => a.write_keys_values_from(y, i, &self.rope, &t_ctx, kv)?,
                None => false,
            };
            if !written {
                a.append_keys_values(&ctx, &self.rope, &t_ctx, kv)?;
            }
        }
        prof.mark("ctx kv");
        prof.finish();
        Ok(())
    }

    /// The block part of a draft pass: the block `ids [Q]` at positions `start ..` (the cache
    /// holds the context up to `start`) through every layer, each block row attending over
    /// the cached context and the block (its keys and values dropped after the layer); the
    /// final-normed rows 1..Q. With `step` the positions live on the device (a CUDA graph of
    /// this pass, `draft::graphs`): the first position from the step, the rope rows from the
    /// by-position `table`.
    fn block_rows(
        &self,
        target: &dyn TargetModel,
        ids: &Tensor,
        start: usize,
        step: Option<(&crate::nn::fused::DeviceStep, &Tensor)>,
        cache: &mut DraftCache,
    ) -> Result<Tensor> {
        let q = ids.dim(0)?;
        let dev = &self.device;
        let mut prof = crate::stats::SectionTimer::start("draft", dev);
        let mut h = self.embed_ids(target, ids)?;
        let t_blk = match step {
            Some((_, table)) => crate::nn::RopeTables::by_position(table.clone(), q),
            None => self.rope.tables(start, q, dev, self.dtype)?,
        };
        // The block sees the whole context and the whole block (no causal mask) except in
        // sliding layers (causal + window) or where `is_causal` says otherwise; masks only if
        // a portable attention asks.
        let masks = Masks::new(q, start, self.dtype, dev);
        prof.mark("embed+tables");
        let mut x = match self.layers.first() {
            Some(l) => l.input_norm.forward(&h)?,
            None => h.clone(),
        };
        for (i, (layer, kv)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let a = &layer.attn;
            // The block's K/V go into the cache only for this call, then are dropped.
            let site = Site {
                rope: &self.rope,
                tables: &t_blk,
                vis: layer.vis,
                masks: &masks,
                step: step.map(|s| s.0),
                out_conv: None,
            };
            let (xa, dk) = layer.pre_attn(x, q)?;
            // DFlash2: the finishing convolution goes with o_proj (one launch on CUDA).
            let after = match (&layer.attn_conv, &dk) {
                (Some(c), Some(d)) => Some(c.after(d, q)),
                _ => None,
            };
            let attn_out = a.forward(
                &xa,
                &Site {
                    out_conv: after,
                    ..site
                },
                kv,
            )?;
            kv.truncate(start);
            prof.mark("attention");
            // Residual updates fused with the next norm: post-attention norm, then the
            // MLP's residual with the next layer's input norm (the final norm after the last).
            let (h1, xm) = layer.post_attn_norm.add_forward(&h, &attn_out)?;
            let m = layer.mlp(&xm, q)?;
            let next_norm = match self.layers.get(i + 1) {
                Some(nl) => &nl.input_norm,
                None => &self.norm,
            };
            (h, x) = next_norm.add_forward(&h1, &m)?;
            prof.mark("mlp");
        }
        prof.finish();
        // `x` is the final norm of every row; rows 1.. are the predictions.
        Ok(x.narrow(0, 1, q - 1)?)
    }

    /// The block's input rows: the embeddings of `ids` (the draft's own table, else the
    /// target's), times `input_embedding_scale`.
    fn embed_block(&self, target: &dyn TargetModel, ids: &[u32]) -> Result<Tensor> {
        self.embed_ids(target, &Tensor::from_slice(ids, ids.len(), &self.device)?)
    }

    /// [`Self::embed_block`] of ids already on the device.
    fn embed_ids(&self, target: &dyn TargetModel, ids: &Tensor) -> Result<Tensor> {
        let h = match &self.embed {
            Some(e) => e.index_select(ids, 0)?,
            None => target.embed(ids)?.to_dtype(self.dtype)?,
        };
        Ok(if self.cfg.input_embedding_scale != 1.0 {
            (h * self.cfg.input_embedding_scale)?
        } else {
            h
        })
    }

    /// [`Self::logits`] for callers outside the module (training).
    pub fn logits_with(
        &self,
        target: &dyn TargetModel,
        rows: &Tensor,
        head_t: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.logits(target, rows, head_t)
    }

    /// LM head on normalized rows, then the draft's output multiplier and softcapping.
    /// `head_t [hidden, vocab]`, when given, replaces the target's head by a dense copy of it
    /// (training: candle's quantized matmul has no backward).
    fn logits(
        &self,
        target: &dyn TargetModel,
        out: &Tensor,
        head_t: Option<&Tensor>,
    ) -> Result<Tensor> {
        let mut logits = match (&self.head, head_t) {
            (Some(head), _) => head.forward_f32(out)?,
            (None, Some(w)) => out.to_dtype(w.dtype())?.matmul(w)?.to_dtype(DType::F32)?,
            (None, None) => target.lm_head(&out.to_dtype(target.info().dtype)?)?,
        };
        if self.cfg.output_multiplier != 1.0 {
            logits = (logits * self.cfg.output_multiplier)?;
        }
        if let Some(c) = self.cfg.final_logit_softcapping {
            logits = ((logits / c)?.tanh()? * c)?;
        }
        Ok(logits)
    }

    /// Training forward: many blocks of ONE sequence in one pass, each exactly as
    /// [`Self::forward`] would see it at inference.
    ///
    /// `ctx_in [S, K*H]` are the taps of the sequence's positions `0..S`; block `b` holds
    /// `block_ids[b*q .. (b+1)*q]` (`[token at anchor, MASK x (q-1)]`) at positions
    /// `anchors[b] .. anchors[b] + q`. Block `b` sees the context rows strictly before its
    /// anchor (inference: the cache holds positions `< start`) and its own block, never
    /// another block: one attention with a block-sparse additive mask (each layer's
    /// visibility as at inference; DFlash2 convolutions stay inside each block). Returns
    /// logits for rows 1..q of every block, `[blocks * (q-1), vocab]` f32, block-major.
    /// `head_t` as in [`Self::logits`].
    pub fn forward_blocks(
        &self,
        target: &dyn TargetModel,
        ctx_in: &Tensor,
        anchors: &[usize],
        block_ids: &[u32],
        head_t: Option<&Tensor>,
    ) -> Result<Tensor> {
        let rows = self.forward_blocks_rows(target, ctx_in, anchors, block_ids)?;
        self.logits(target, &rows, head_t)
    }

    /// [`Self::forward_blocks`] up to the final norm: `[blocks * (q-1), H]`.
    pub fn forward_blocks_rows(
        &self,
        target: &dyn TargetModel,
        ctx_in: &Tensor,
        anchors: &[usize],
        block_ids: &[u32],
    ) -> Result<Tensor> {
        self.forward_segments_rows(
            target,
            &[BlockSegment {
                ctx: ctx_in,
                anchors,
            }],
            block_ids,
        )
    }

    /// [`Self::forward_blocks_rows`] for the blocks of several sequences in one forward (the
    /// trainer's batch on a GPU: one launch per op instead of one per sequence): their
    /// context rows side by side, every block seeing only its own sequence's context (the
    /// mask is block-diagonal), RoPE at each sequence's own positions. `block_ids` holds the
    /// blocks of every segment in order; the rows come back in that order. Each segment's
    /// rows equal what it gives alone.
    pub fn forward_segments_rows(
        &self,
        target: &dyn TargetModel,
        segs: &[BlockSegment<'_>],
        block_ids: &[u32],
    ) -> Result<Tensor> {
        let nb: usize = segs.iter().map(|s| s.anchors.len()).sum();
        if nb == 0 || !block_ids.len().is_multiple_of(nb) {
            return Err(Error::input(format!(
                "draft training: {} block ids for {nb} anchors",
                block_ids.len()
            )));
        }
        let q = block_ids.len() / nb;
        if q < 2 {
            return Err(Error::input("draft: a block needs at least 2 positions"));
        }
        // Each segment's context rows 0..s_i (rows past its last anchor are seen by no block),
        // placed at offset o_i of the joint context; every block with its segment's offset.
        let (mut parts, mut ctx_pos, mut blocks) = (vec![], vec![], vec![]);
        for seg in segs {
            let s = seg.anchors.iter().copied().max().unwrap_or(0);
            let s_all = seg.ctx.dim(0)?;
            if s > s_all {
                return Err(Error::input(format!(
                    "draft training: an anchor at {s} needs context rows 0..{s}, got {s_all}"
                )));
            }
            blocks.extend(seg.anchors.iter().map(|&a| (a, ctx_pos.len())));
            if s > 0 {
                parts.push(seg.ctx.narrow(0, 0, s)?);
                ctx_pos.extend(0..s);
            }
        }
        let s = ctx_pos.len();
        let dev = &self.device;
        let positions: Vec<usize> = blocks
            .iter()
            .flat_map(|&(a, _)| (a..a + q).collect::<Vec<_>>())
            .collect();
        let mut timer = crate::stats::SectionTimer::start("draft segments", dev);
        let mut h = self.embed_block(target, block_ids)?;
        let t_blk = self.rope.tables_at(&positions, dev, self.dtype)?;
        let ctx = if s > 0 {
            let c = Tensor::cat(&parts, 0)?.to_dtype(self.dtype)?;
            let t_ctx = self.rope.tables_at(&ctx_pos, dev, self.dtype)?;
            Some((self.hidden_norm.forward(&self.fc.forward(&c)?)?, t_ctx))
        } else {
            None
        };
        let idx = SegmentIndex::new(&blocks, &ctx_pos, q, dev)?;
        let mask_for = |vis: Visibility| idx.mask(vis, self.dtype);
        let mut masks: Vec<(Visibility, Tensor)> = Vec::new();
        for layer in &self.layers {
            if !masks.iter().any(|(v, _)| *v == layer.vis) {
                masks.push((layer.vis, mask_for(layer.vis)?));
            }
        }
        timer.mark("context + masks");
        for layer in &self.layers {
            let x = layer.input_norm.forward(&h)?;
            let (x, dk) = layer.pre_attn(x, q)?;
            let a = &layer.attn;
            let (qb, kb, vb) = a.queries_keys_values(&x, &self.rope, &t_blk)?;
            let kv_ctx = match &ctx {
                Some((c, t_ctx)) => Some(a.keys_values(c, &self.rope, t_ctx)?),
                None => None,
            };
            let mask = &masks
                .iter()
                .find(|(v, _)| *v == layer.vis)
                .expect("a mask per visibility")
                .1;
            let o = sdpa_blocks(
                &qb,
                kv_ctx.as_ref().map(|(k, v)| (k, v)),
                &kb,
                &vb,
                q,
                mask,
                a.spec.scale,
            )?;
            let attn = layer.post_attn(a.o_proj.forward(&o)?, dk, q)?;
            let (h1, xm) = layer.post_attn_norm.add_forward(&h, &attn)?;
            h = (&h1 + layer.mlp(&xm, q)?)?;
        }
        // Rows 1..q of every block.
        let rows = h
            .reshape((nb, q, h.dim(1)?))?
            .narrow(1, 1, q - 1)?
            .reshape((nb * (q - 1), h.dim(1)?))?;
        let out = self.norm.forward(&rows);
        timer.mark("layers");
        timer.finish();
        out
    }
}

/// Which keys a draft layer's block rows see (the reference's rule): causal where `is_causal`
/// says so, else only in sliding layers; a sliding layer's window when the config gives one
/// (both sides of a non-causal row).
pub fn layer_visibility(cfg: &DraftConfig, kind: LayerType) -> Visibility {
    let sliding = kind == LayerType::Sliding;
    Visibility {
        causal: cfg.is_causal.unwrap_or(sliding),
        window: if sliding {
            cfg.layers.sliding_window
        } else {
            None
        },
    }
}

/// Row and column positions of a packed draft forward ([`DraftModel::forward_segments_rows`]),
/// from which each layer's additive mask is built on the device: O(rows + columns) from the
/// host instead of the `[rows, columns]` matrix (at the trainer's packing on a GPU, 2,048 rows
/// by ~4,500 columns: ~80 ms a step of host loops and copies). The columns are the joint
/// context's, then a row's own block's `q` keys ([`sdpa_blocks`]).
struct SegmentIndex {
    /// Per row `[n, 1]`: its position, the joint context columns its segment's context
    /// takes before its anchor (`lo..hi`), its offset in its block.
    row_pos: Tensor,
    row_lo: Tensor,
    row_hi: Tensor,
    row_off: Tensor,
    /// Per context column `[1, s]`: its position and index (None without context).
    ctx: Option<(Tensor, Tensor)>,
    /// `[1, q]`: 0 .. q, the block's key offsets.
    own: Tensor,
}

impl SegmentIndex {
    /// `blocks`: each block's (anchor, offset of its segment's context in the joint context);
    /// `ctx_pos`: every joint context row's position; `q`: block size.
    fn new(blocks: &[(usize, usize)], ctx_pos: &[usize], q: usize, dev: &Device) -> Result<Self> {
        let (s, n) = (ctx_pos.len(), blocks.len() * q);
        let (mut row_pos, mut row_lo, mut row_hi, mut row_off) =
            (vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        for (b, &(a, off)) in blocks.iter().enumerate() {
            for i in 0..q {
                let r = b * q + i;
                row_pos[r] = (a + i) as f32;
                row_lo[r] = off as f32;
                row_hi[r] = (off + a) as f32;
                row_off[r] = i as f32;
            }
        }
        let rows = |v: Vec<f32>| Tensor::from_vec(v, (n, 1), dev);
        let ctx = match s {
            0 => None,
            _ => Some((
                Tensor::from_vec(ctx_pos.iter().map(|&p| p as f32).collect(), (1, s), dev)?,
                Tensor::from_vec((0..s).map(|c| c as f32).collect(), (1, s), dev)?,
            )),
        };
        Ok(Self {
            row_pos: rows(row_pos)?,
            row_lo: rows(row_lo)?,
            row_hi: rows(row_hi)?,
            row_off: rows(row_off)?,
            ctx,
            own: Tensor::from_vec((0..q).map(|j| j as f32).collect(), (1, q), dev)?,
        })
    }

    /// The additive mask `[n, s + q]` (0 visible, -inf hidden) for a layer of `vis`: a row sees
    /// its segment's context before its anchor and its own block's keys, where `vis` lets it
    /// ([`Visibility::sees`]: causal, window).
    fn mask(&self, vis: Visibility, dtype: DType) -> Result<Tensor> {
        let f = |t: Tensor| t.to_dtype(DType::F32);
        // `col` and `row` as positions (or, for the block's keys, offsets in the block)
        let visible = |mut seen: Tensor, col: &Tensor, row: &Tensor| -> Result<Tensor> {
            if vis.causal {
                seen = (seen * f(col.broadcast_le(row)?)?)?;
            }
            if let Some(w) = vis.window {
                let w = w as f64;
                seen = (seen * f((col + w)?.broadcast_gt(row)?)?)?;
                seen = (seen * f(col.broadcast_lt(&(row + w)?)?)?)?;
            }
            Ok(seen)
        };
        let all = Tensor::ones(
            (self.row_off.dim(0)?, self.own.dim(1)?),
            DType::F32,
            self.own.device(),
        )?;
        let own = visible(all, &self.own, &self.row_off)?;
        let seen = match &self.ctx {
            Some((col_pos, col_idx)) => {
                let in_ctx = (f(col_idx.broadcast_ge(&self.row_lo)?)?
                    * f(col_idx.broadcast_lt(&self.row_hi)?)?)?;
                Tensor::cat(&[&visible(in_ctx, col_pos, &self.row_pos)?, &own], 1)?
            }
            None => own,
        };
        let zero = seen.zeros_like()?;
        let hidden = Tensor::full(f32::NEG_INFINITY, seen.shape(), seen.device())?;
        Ok(seen.ne(0f32)?.where_cond(&zero, &hidden)?.to_dtype(dtype)?)
    }
}

/// Resolve, validate against the target and load a draft.
pub fn load_draft(
    src: &crate::source::ModelSource,
    target: &crate::config::TargetConfig,
    target_name: &str,
    opts: &crate::archs::LoadOptions,
) -> Result<DraftModel> {
    let cfg = DraftConfig::from_file(&src.config)?;
    let taps = cfg.validate_against(target, target_name)?;
    // Drafts stay at the compute dtype (a quantized draft drops acceptance in other engines);
    // an MLX-quantized draft checkpoint is dequantized at load.
    let w = src.weights(opts.dtype, &opts.device, false)?;
    let mut d = DraftModel::load(cfg, taps, &w)?;
    // Inference only: stacked gate/up weights (one matmul). Not in `DraftModel::load`, which
    // the trainer builds on trainable Vars: a stacked copy would not follow their updates.
    d.fuse()?;
    // the draft's linears at int8 on the CPU, unless weights are to stay as stored
    if crate::switches::get().draft_q8 && !opts.keep_quant {
        d.requantize_q8()?;
    }
    if let Some(d2t) = &d.d2t {
        if let Some((i, _)) = d2t
            .iter()
            .enumerate()
            .find(|(i, &o)| *i as i64 + o < 0 || (*i as i64 + o) as usize >= target.vocab_size)
        {
            return Err(Error::Mismatch {
                draft: d.cfg.file.clone(),
                target: target_name.to_string(),
                msg: format!(
                    "d2t maps draft id {i} outside the target vocabulary ({})",
                    target.vocab_size
                ),
            });
        }
    }
    Ok(d)
}
