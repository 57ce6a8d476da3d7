//! The attention door: every family's attention goes through here, and this file alone
//! chooses how it runs.
//!
//! Model code says *what* an attention layer is ([`AttentionSpec`]: heads, scale, q/k norms,
//! an output gate, a value norm, values equal to the keys, KV shared with an earlier layer,
//! sinks) and *which keys a row sees* ([`Visibility`]: causal, sliding window, or the draft's
//! non-causal block). [`Attention::forward`] then picks one of three ways:
//!
//! | way | when | what |
//! |---|---|---|
//! | fused CUDA kernels | CUDA, bf16, stacked q/k/v dense weights, a head dim the kernel has | one projection, one K/V write (norm + RoPE in the kernel), one attention launch (two with split keys) that also applies sinks and the output gate |
//! | row by row | CPU, a causal block of 2..=[`ROW_WISE_MAX`] rows (a verify) | each row as a one-row decode step computes it, so a verify's logits equal the decode steps' bit for bit |
//! | portable | everything else | candle ops with an explicit additive mask ([`Masks`], built once per forward) |
//!
//! [`attend`] is the same choice for queries a family has already formed (MLA's absorbed
//! queries over its latent rows). Batch 1: queries are laid out `[kv_heads, n_rep * q_len,
//! head_dim]` so every query head of a group shares its K/V head without copying K/V.

use super::fused::{self, HeadSource};
use super::{KvCache, Linear, RmsNorm, Rope, RopeTables};
use crate::source::Weights;
use crate::Result;
use candle_core::{DType, Device, Tensor};
use std::cell::RefCell;

/// Blocks of at most this many rows (verify blocks; prompts are longer) run their attention
/// row by row on the CPU.
pub const ROW_WISE_MAX: usize = 32;

/// Which keys a query row sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Visibility {
    /// A key after the query's position is hidden.
    pub causal: bool,
    /// Sliding window: key j is visible to the query at position p iff j + window > p.
    pub window: Option<usize>,
}

impl Visibility {
    pub const CAUSAL: Visibility = Visibility {
        causal: true,
        window: None,
    };
    /// The draft's block rows: the whole context and the whole block.
    pub const FULL: Visibility = Visibility {
        causal: false,
        window: None,
    };
    pub fn sliding(window: usize) -> Self {
        Visibility {
            causal: true,
            window: Some(window),
        }
    }
    /// Whether the query at position `q` sees the key at position `k`: a causal layer hides
    /// later keys; a window hides keys `window` or more positions away (before the query, and
    /// after it too when the layer is not causal).
    pub fn sees(&self, q: usize, k: usize) -> bool {
        if self.causal && k > q {
            return false;
        }
        match self.window {
            Some(w) => k + w > q && k < q + w,
            None => true,
        }
    }
}

/// Shapes and options of one attention layer.
#[derive(Debug, Clone)]
pub struct AttentionSpec {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Biases on q/k/v.
    pub bias: bool,
    /// A bias on o_proj (llama with `attention_bias`; not qwen2).
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (qwen3, gemma, the DFlash draft, hybrids).
    pub qk_norm: bool,
    pub qk_norm_add_one: bool,
    pub eps: f64,
    /// Softmax scale (head_dim^-0.5 unless the family says otherwise).
    pub scale: f64,
    /// `q_proj` also produces an output gate per head (`[q_h | gate_h]` for each head in turn);
    /// the attention output is multiplied by `sigmoid(gate)` before `o_proj` (hybrid Qwen).
    pub output_gate: bool,
    /// A scale-less RMSNorm on every value head (gemma4).
    pub v_norm: bool,
    /// No `v_proj`: values are the raw key projection, before the k norm (gemma4 full layers
    /// with `attention_k_eq_v`).
    pub k_eq_v: bool,
    /// No K/V projections: the layer attends over the cache of an earlier layer, which has
    /// already appended this forward's rows (gemma4's KV-shared layers).
    pub shared_kv: bool,
}

impl AttentionSpec {
    /// Plain GQA attention: no gate, no value norm, own K/V.
    pub fn new(hidden: usize, heads: usize, kv_heads: usize, head_dim: usize, eps: f64) -> Self {
        Self {
            hidden,
            heads,
            kv_heads,
            head_dim,
            bias: false,
            o_bias: false,
            qk_norm: false,
            qk_norm_add_one: false,
            eps,
            scale: (head_dim as f64).powf(-0.5),
            output_gate: false,
            v_norm: false,
            k_eq_v: false,
            shared_kv: false,
        }
    }
    /// Parameters of the layer's projections, biases and q/k norms.
    pub fn params(&self) -> u64 {
        let (h, d) = (self.hidden as u64, self.head_dim as u64);
        let (qw, qd) = (self.q_width() as u64, (self.heads * self.head_dim) as u64);
        let kd = self.kv_width() as u64;
        let kv = match (self.shared_kv, self.k_eq_v) {
            (true, _) => 0,
            (false, true) => 1,
            (false, false) => 2,
        };
        let bias = |x: bool, n: u64| if x { n } else { 0 };
        h * qw
            + bias(self.bias, qw)
            + kv * (h * kd + bias(self.bias, kd))
            + qd * h
            + bias(self.o_bias, h)
            + if self.qk_norm {
                d * if self.shared_kv { 1 } else { 2 }
            } else {
                0
            }
    }

    /// Width of the q projection (queries, and gates when there is an output gate).
    fn q_width(&self) -> usize {
        self.heads * self.head_dim * if self.output_gate { 2 } else { 1 }
    }
    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// Where a layer's rows sit: the RoPE and tables of their positions, who they see, and the
/// forward's masks (built on first use).
#[derive(Clone, Copy)]
pub struct Site<'a> {
    pub rope: &'a Rope,
    pub tables: &'a RopeTables,
    pub vis: Visibility,
    pub masks: &'a Masks,
    /// The forward's positions live on the device (a CUDA graph step): only the fused
    /// kernels can run, reading them from there.
    pub step: Option<&'a fused::DeviceStep>,
    /// A convolution of `o_proj`'s output (a DFlash2 draft layer's `finish`), done with the
    /// projection (`nn::dyn_conv::project_then_conv`); one sequence's forward only.
    pub out_conv: Option<super::dyn_conv::ConvAfter<'a>>,
}

/// The joint buffers of a batch's caches, each checked to have room for its sequence's
/// `lens[k]` new rows.
fn joint_buffers(caches: &[&mut KvCache], lens: &[usize]) -> Result<Vec<Tensor>> {
    caches
        .iter()
        .zip(lens)
        .map(|(c, &n)| {
            c.check_room(n)?;
            c.joint().cloned().ok_or_else(|| {
                crate::Error::input("attention: a batched cache has no joint buffer")
            })
        })
        .collect()
}

/// The additive masks of one forward (`n` query rows at positions `start ..` over keys
/// `0 .. start + n`), one per visibility, built when a portable attention first asks.
pub struct Masks {
    n: usize,
    start: usize,
    dtype: DType,
    device: Device,
    built: RefCell<Vec<(Visibility, Option<Tensor>)>>,
}

impl Masks {
    pub fn new(n: usize, start: usize, dtype: DType, device: &Device) -> Self {
        Self {
            n,
            start,
            dtype,
            device: device.clone(),
            built: RefCell::new(Vec::new()),
        }
    }

    /// The mask for `vis` (None when nothing is hidden).
    pub fn get(&self, vis: Visibility) -> Result<Option<Tensor>> {
        if let Some((_, m)) = self.built.borrow().iter().find(|(v, _)| *v == vis) {
            return Ok(m.clone());
        }
        let m = attention_mask(
            self.n,
            self.start,
            self.start + self.n,
            vis.causal,
            vis.window,
            self.dtype,
            &self.device,
        )?;
        self.built.borrow_mut().push((vis, m.clone()));
        Ok(m)
    }
}

#[derive(Debug, Clone)]
pub struct Attention {
    /// `[q_width, hidden]`: queries (and gates, see [`AttentionSpec::output_gate`]).
    pub q_proj: Linear,
    /// None for KV-shared layers.
    pub k_proj: Option<Linear>,
    /// None for KV-shared layers and `k_eq_v`.
    pub v_proj: Option<Linear>,
    pub o_proj: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    /// The scale-less value norm ([`AttentionSpec::v_norm`]).
    pub v_norm: Option<RmsNorm>,
    pub spec: AttentionSpec,
    /// q, k and v (those that exist) stacked by [`Self::fuse`]: one matmul for all of them;
    /// the separate weights are then emptied.
    pub qkv: Option<Linear>,
    /// The k/v rows of `qkv` (a view of the same weight): keys and values without queries.
    pub kv: Option<Linear>,
    /// Attention sinks `[heads]` (gpt-oss): a learned logit per head joining the softmax.
    pub sinks: Option<Tensor>,
    /// A tensor-parallel rank's layer (its share of the heads; `spec` counts them): `o_proj`'s
    /// output is this rank's partial sum, all-reduced over the ranks.
    pub shard: Option<super::parallel::Shard>,
}

impl Attention {
    /// Load `{prefix}.{q,k,v,o}_proj` (those the spec has) and, with `qk_norm`,
    /// `{prefix}.{q,k}_norm`.
    ///
    /// In a tensor-parallel load (`w.shard()`) the layer keeps its rank's share of the query
    /// and key/value heads (q/k/v rows, o_proj columns; the returned spec counts that share)
    /// and all-reduces `o_proj`'s output.
    pub fn load(w: &Weights, prefix: &str, spec: AttentionSpec) -> Result<Self> {
        let h = spec.hidden;
        let (qd, kd) = (spec.heads * spec.head_dim, spec.kv_width());
        // (gated queries are head-major, `[heads, 2 head_dim]` rows, so a rank's rows are
        // whole heads with their gates; KV-shared layers read the owner's share of the heads)
        let shard = w.shard().cloned();
        let mut spec = spec;
        // key/value heads per rank: a share, or (fewer heads than ranks) the one head this
        // rank's queries read, replicated over the ranks that read it
        let mut kv_rows = None;
        if let Some(sh) = &shard {
            sh.check_divides(spec.heads, &format!("attention heads of `{prefix}`"))?;
            if spec.kv_heads < sh.world {
                if !sh.world.is_multiple_of(spec.kv_heads) {
                    return Err(crate::Error::input(format!(
                        "tensor parallel {}: the {} key/value heads of `{prefix}` can neither split over nor be replicated evenly on {} ranks",
                        sh.world, spec.kv_heads, sh.world
                    )));
                }
                let head = sh.rank * spec.kv_heads / sh.world;
                kv_rows = Some((head * spec.head_dim, spec.head_dim));
            } else {
                sh.check_divides(spec.kv_heads, &format!("key/value heads of `{prefix}`"))?;
            }
        }
        use crate::source::Split;
        let lin = |n: &str, i, o, b| {
            let name = format!("{prefix}.{n}");
            match (&shard, n, kv_rows) {
                (None, _, _) => w.linear(&name, i, o, b),
                (Some(_), "o_proj", _) => w.linear_split(&name, i, o, b, Split::In),
                (Some(_), "k_proj" | "v_proj", Some((at, len))) => {
                    w.linear_split(&name, i, o, b, Split::Rows(at, len))
                }
                (Some(_), _, _) => w.linear_split(&name, i, o, b, Split::Out),
            }
        };
        let norm = |n: &str| {
            RmsNorm::load(
                w,
                &format!("{prefix}.{n}.weight"),
                spec.head_dim,
                spec.eps,
                spec.qk_norm_add_one,
            )
        };
        let own_kv = !spec.shared_kv;
        Ok(Self {
            q_proj: lin("q_proj", h, spec.q_width(), spec.bias)?,
            k_proj: own_kv
                .then(|| lin("k_proj", h, kd, spec.bias))
                .transpose()?,
            v_proj: (own_kv && !spec.k_eq_v)
                .then(|| lin("v_proj", h, kd, spec.bias))
                .transpose()?,
            o_proj: lin("o_proj", qd, h, spec.o_bias)?,
            q_norm: spec.qk_norm.then(|| norm("q_norm")).transpose()?,
            k_norm: (spec.qk_norm && own_kv)
                .then(|| norm("k_norm"))
                .transpose()?,
            v_norm: (spec.v_norm && own_kv)
                .then(|| RmsNorm::unit(spec.head_dim, spec.eps, w.dtype, &w.device))
                .transpose()?,
            spec: {
                if let Some(sh) = &shard {
                    spec.heads /= sh.world;
                    spec.kv_heads = (spec.kv_heads / sh.world).max(1);
                }
                spec
            },
            qkv: None,
            kv: None,
            sinks: None,
            shard,
        })
    }

    /// Attention sinks, one logit per head of the whole layer (this rank's heads kept when
    /// sharded).
    pub fn set_sinks(&mut self, sinks: Tensor) -> Result<()> {
        self.sinks = Some(match &self.shard {
            Some(sh) => {
                let (at, n) = sh.range(sinks.dim(0)?);
                sinks.narrow(0, at, n)?.contiguous()?
            }
            None => sinks,
        });
        Ok(())
    }

    /// `o_proj` over the attention output `o` (all-reduced over the ranks when sharded).
    fn o_proj_forward(&self, o: &Tensor) -> Result<Tensor> {
        let y = self.o_proj.forward(o)?;
        match &self.shard {
            Some(sh) => sh.all_reduce(&y),
            None => Ok(y),
        }
    }

    /// Stack q/k/v into one linear when [`Linear::concat`] can (dense, or quantized of one
    /// type on the CPU); the separate weights are dropped, so memory does not grow.
    pub fn fuse(&mut self) -> Result<()> {
        if self.qkv.is_some() {
            return Ok(());
        }
        let mut parts = vec![&self.q_proj];
        parts.extend(self.k_proj.as_ref());
        parts.extend(self.v_proj.as_ref());
        if parts.len() == 1 {
            return Ok(());
        }
        if let Some(f) = Linear::concat(&parts)? {
            let qw = self.spec.q_width();
            let kv_rows = f.out_features() - qw;
            self.kv = f.rows(qw, kv_rows)?;
            self.q_proj = self.q_proj.emptied()?;
            self.k_proj = self.k_proj.as_ref().map(|l| l.emptied()).transpose()?;
            self.v_proj = self.v_proj.as_ref().map(|l| l.emptied()).transpose()?;
            self.qkv = Some(f);
        }
        Ok(())
    }

    /// Every linear it holds (the stacked ones included).
    pub fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        [&mut self.q_proj, &mut self.o_proj]
            .into_iter()
            .chain(self.k_proj.as_mut())
            .chain(self.v_proj.as_mut())
            .chain(self.qkv.as_mut())
            .chain(self.kv.as_mut())
    }

    /// Bytes of weights held (the stacked copy included, the emptied parts at 0).
    pub fn weight_bytes(&self) -> usize {
        let lin = |l: &Option<Linear>| l.as_ref().map_or(0, Linear::weight_bytes);
        let norm = |n: &Option<RmsNorm>| n.as_ref().map_or(0, RmsNorm::weight_bytes);
        self.q_proj.weight_bytes()
            + lin(&self.k_proj)
            + lin(&self.v_proj)
            + self.o_proj.weight_bytes()
            + lin(&self.qkv)
            + norm(&self.q_norm)
            + norm(&self.k_norm)
            + self.sinks.as_ref().map_or(0, super::tensor_bytes)
    }

    /// Columns of the stacked projection: (keys, values); values at the keys' columns for
    /// `k_eq_v`.
    fn kv_columns(&self) -> (usize, usize) {
        let qw = self.spec.q_width();
        let kd = self.spec.kv_width();
        (qw, if self.spec.k_eq_v { qw } else { qw + kd })
    }

    /// q (with gates), k and v projections of `x [n, hidden]` (k/v None for shared layers;
    /// v = k for `k_eq_v`).
    fn project(&self, x: &Tensor) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let (qw, kd) = (self.spec.q_width(), self.spec.kv_width());
        if let Some(f) = &self.qkv {
            let y = f.forward(x)?;
            let q = y.narrow(1, 0, qw)?;
            let (kc, vc) = self.kv_columns();
            let kv = (!self.spec.shared_kv)
                .then(|| -> Result<(Tensor, Tensor)> {
                    Ok((y.narrow(1, kc, kd)?, y.narrow(1, vc, kd)?))
                })
                .transpose()?;
            return Ok((q, kv));
        }
        let q = self.q_proj.forward(x)?;
        let kv = match &self.k_proj {
            None => None,
            Some(kp) => {
                let k = kp.forward(x)?;
                let v = match &self.v_proj {
                    Some(vp) => vp.forward(x)?,
                    None => k.clone(),
                };
                Some((k, v))
            }
        };
        Ok((q, kv))
    }

    /// Split a q projection `[n, q_width]` into queries `[n, heads * d]` and gates.
    fn split_gate(&self, q: Tensor) -> Result<(Tensor, Option<Tensor>)> {
        if !self.spec.output_gate {
            return Ok((q, None));
        }
        let n = q.dim(0)?;
        let (heads, d) = (self.spec.heads, self.spec.head_dim);
        let qg = q.reshape((n, heads, 2 * d))?;
        let gate = qg.narrow(2, d, d)?.contiguous()?.reshape((n, heads * d))?;
        let q = qg.narrow(2, 0, d)?.contiguous()?.reshape((n, heads * d))?;
        Ok((q, Some(gate)))
    }

    /// Queries for `x [n, hidden]`: projected, normed, roped: `[heads, n, head_dim]`.
    pub fn queries(&self, x: &Tensor, rope: &Rope, t: &RopeTables) -> Result<Tensor> {
        let (q, _) = self.project(x)?;
        let (q, _) = self.split_gate(q)?;
        self.finish_queries(q, rope, t)
    }

    fn finish_queries(&self, q: Tensor, rope: &Rope, t: &RopeTables) -> Result<Tensor> {
        let n = q.dim(0)?;
        let q = q.reshape((n, self.spec.heads, self.spec.head_dim))?;
        let q = match &self.q_norm {
            Some(norm) => norm.forward(&q)?,
            None => q,
        };
        rope.apply(&q.transpose(0, 1)?.contiguous()?, t)
    }

    /// Keys and values for `x [n, hidden]`: `[kv_heads, n, head_dim]` each (keys normed and
    /// roped, values normed when the spec says so).
    pub fn keys_values(&self, x: &Tensor, rope: &Rope, t: &RopeTables) -> Result<(Tensor, Tensor)> {
        let (k, v) = match (&self.kv, &self.qkv) {
            (Some(kv), _) => {
                let y = kv.forward(x)?;
                let kd = self.spec.kv_width();
                let vc = if self.spec.k_eq_v { 0 } else { kd };
                (y.narrow(1, 0, kd)?, y.narrow(1, vc, kd)?)
            }
            _ => self.project(x)?.1.ok_or_else(|| {
                crate::Error::input("attention: a KV-shared layer has no keys of its own")
            })?,
        };
        self.finish_keys_values(k, v, rope, t)
    }

    /// Queries, keys and values of `x [n, hidden]` from one projection:
    /// `[heads, n, d]`, `[kv_heads, n, d]`, `[kv_heads, n, d]` (draft training).
    pub fn queries_keys_values(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, kv) = self.project(x)?;
        let (q, _) = self.split_gate(q)?;
        let q = self.finish_queries(q, rope, t)?;
        let (k, v) = kv.ok_or_else(|| {
            crate::Error::input("attention: a KV-shared layer has no keys of its own")
        })?;
        let (k, v) = self.finish_keys_values(k, v, rope, t)?;
        Ok((q, k, v))
    }

    fn finish_keys_values(
        &self,
        k: Tensor,
        v: Tensor,
        rope: &Rope,
        t: &RopeTables,
    ) -> Result<(Tensor, Tensor)> {
        let n = k.dim(0)?;
        let (kvh, d) = (self.spec.kv_heads, self.spec.head_dim);
        let k = k.reshape((n, kvh, d))?;
        let k = match &self.k_norm {
            Some(norm) => norm.forward(&k)?,
            None => k,
        };
        let k = rope.apply(&k.transpose(0, 1)?.contiguous()?, t)?;
        let v = v.reshape((n, kvh, d))?;
        let v = match &self.v_norm {
            Some(norm) => norm.forward(&v)?,
            None => v,
        };
        Ok((k, v.transpose(0, 1)?.contiguous()?))
    }

    /// The fused kernels' view of this layer's heads: where they sit in a projection output
    /// whose first column is `offset`, and their norm.
    fn head_source(&self, offset: usize, norm: &Option<RmsNorm>, rope: &Rope) -> HeadSource {
        HeadSource {
            offset,
            head_stride: self.spec.head_dim,
            norm: norm.as_ref().map(|n| n.weight.clone()),
            eps: norm.as_ref().map_or(self.spec.eps as f32, |n| n.eps),
            rot: rope.rotary_dim,
            unit_norm: false,
        }
    }

    /// The value columns as the K/V write kernel takes them.
    fn value_source(&self, offset: usize) -> HeadSource {
        HeadSource {
            offset,
            head_stride: self.spec.head_dim,
            norm: None,
            eps: self.spec.eps as f32,
            rot: 0,
            unit_norm: self.spec.v_norm,
        }
    }

    /// Whether the fused path can run for this layer at all (stacked q/k/v, or a q projection
    /// alone for KV-shared layers, dense; a joint cache; a head dim the kernel has; packed
    /// tables); the kernels then check device, dtype and shapes.
    fn fusable(&self, cache: &KvCache, t: &RopeTables) -> bool {
        self.fusable_layer() && cache.joint().is_some() && t.packed.is_some()
    }

    /// The layer's part of [`Self::fusable`]: its projections and head dim.
    fn fusable_layer(&self) -> bool {
        let proj_ok = self.qkv.is_some() || (self.spec.shared_kv && self.q_proj.is_dense());
        proj_ok && fused::attention_supports(self.spec.head_dim)
    }

    /// Whether a forward with its positions on the device (a CUDA graph step, see
    /// [`Site::step`]) can run this layer: the fused kernels take it (its projections are
    /// stacked, its head dim is one the kernel has; its cache, made from the same head dim
    /// for keys and values, has the joint buffer they write).
    pub fn runs_device_steps(&self) -> bool {
        self.fusable_layer()
    }

    /// Write the keys/values of already projected rows `y` (k at `kc`, v at `vc`) into the
    /// cache with the fused kernel. False (nothing written) when it does not apply.
    fn write_kv_fused(
        &self,
        y: &Tensor,
        kc: usize,
        vc: usize,
        rope: &Rope,
        t: &RopeTables,
        cache: &mut KvCache,
    ) -> Result<bool> {
        let Some(packed) = &t.packed else {
            return Ok(false);
        };
        let k = self.head_source(kc, &self.k_norm, rope);
        let v = self.value_source(vc);
        let n = y.dim(0)?;
        cache.append_in_place(n, |kv, pos0| fused::kv_write(kv, y, packed, &k, &v, pos0))
    }

    /// Append the keys/values of `x [n, hidden]` (positions of `t`) to `cache`, with the fused
    /// kernel when it applies (the draft's context rows).
    pub fn append_keys_values(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
        cache: &mut KvCache,
    ) -> Result<()> {
        if let (true, Some(kvl)) = (self.fusable(cache, t), &self.kv) {
            let y = kvl.forward(x)?;
            let vc = if self.spec.k_eq_v {
                0
            } else {
                self.spec.kv_width()
            };
            if self.write_kv_fused(&y, 0, vc, rope, t, cache)? {
                return Ok(());
            }
        }
        let (k, v) = self.keys_values(x, rope, t)?;
        cache.append(&k, &v)?;
        Ok(())
    }

    /// Write this layer's keys/values for new rows from `y`, a projection of those rows by
    /// every layer's k/v weights stacked (`[n, layers * 2 * kv_heads * head_dim]`; this layer
    /// is block `layer`; the draft's context rows). True when the fused kernel wrote them;
    /// false (nothing written) when it does not apply.
    pub fn write_keys_values_from(
        &self,
        y: &Tensor,
        layer: usize,
        rope: &Rope,
        t: &RopeTables,
        cache: &mut KvCache,
    ) -> Result<bool> {
        if self.spec.k_eq_v || self.spec.shared_kv || !self.fusable(cache, t) {
            return Ok(false);
        }
        let kd = self.spec.kv_width();
        self.write_kv_fused(y, layer * 2 * kd, layer * 2 * kd + kd, rope, t, cache)
    }

    /// [`Self::write_keys_values_from`] for several sequences at once: `y` holds their new rows
    /// back to back (`tables[k]` the positions of sequence k's rows, which go to `caches[k]`
    /// from its length on), written by one launch. False (nothing written) when the batched
    /// kernel does not apply.
    pub fn write_keys_values_segments(
        &self,
        y: &Tensor,
        layer: usize,
        rope: &Rope,
        tables: &[&RopeTables],
        caches: &mut [&mut KvCache],
    ) -> Result<bool> {
        if self.spec.k_eq_v
            || self.spec.shared_kv
            || caches.is_empty()
            || tables.len() != caches.len()
            || caches.iter().zip(tables).any(|(c, t)| !self.fusable(c, t))
        {
            return Ok(false);
        }
        let Some(packed) = RopeTables::joint_packed(tables)? else {
            return Ok(false);
        };
        let lens: Vec<usize> = tables.iter().map(|t| t.len()).collect();
        let kd = self.spec.kv_width();
        let cols = (layer * 2 * kd, layer * 2 * kd + kd);
        Ok(self
            .write_segments(y, cols, rope, &packed, caches, &lens)?
            .is_some())
    }

    /// Several sequences' keys and values in one launch: `y` holds their rows back to back
    /// (keys from column `cols.0`, values from `cols.1`; `tables` their positions), sequence
    /// k's `lens[k]` rows go to `caches[k]` from its length on. Returns each cache's joint
    /// buffer with its length before the write (the batched attention's segments), or None
    /// (nothing written) when the kernel does not apply.
    fn write_segments(
        &self,
        y: &Tensor,
        cols: (usize, usize),
        rope: &Rope,
        tables: &Tensor,
        caches: &mut [&mut KvCache],
        lens: &[usize],
    ) -> Result<Option<Vec<(Tensor, usize)>>> {
        let joints = joint_buffers(caches, lens)?;
        let pos0: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        let segs: Vec<fused::Segment> = joints
            .iter()
            .zip(&pos0)
            .zip(lens)
            .map(|((kv, &pos0), &n)| fused::Segment { kv, pos0, n })
            .collect();
        let k = self.head_source(cols.0, &self.k_norm, rope);
        let v = self.value_source(cols.1);
        if !fused::kv_write_segments(y, tables, &k, &v, &segs, None)? {
            return Ok(None);
        }
        drop(segs);
        for (c, &n) in caches.iter_mut().zip(lens) {
            c.append_in_place(n, |_, _| Ok(true))?;
        }
        Ok(Some(joints.into_iter().zip(pos0).collect()))
    }

    /// Self-attention of `x [n, hidden]` at the positions of `at.tables`: appends this layer's
    /// K/V to `cache` (KV-shared layers read it as the owner left it) and attends over
    /// everything cached, as `at.vis` allows. The one entry point of every family's attention
    /// layers and the draft's; see the module docs for how it runs.
    pub fn forward(&self, x: &Tensor, at: &Site, cache: &mut KvCache) -> Result<Tensor> {
        if let Some(step) = at.step {
            return self.forward_device_step(x, at, step, cache);
        }
        if let Some(o) = self.forward_fused(x, at, cache)? {
            return Ok(o);
        }
        let n = x.dim(0)?;
        let (q, kv) = self.project(x)?;
        let (q, gate) = self.split_gate(q)?;
        let q = self.finish_queries(q, at.rope, at.tables)?;
        let (k, v) = match kv {
            Some((k, v)) => {
                let (k, v) = self.finish_keys_values(k, v, at.rope, at.tables)?;
                cache.append(&k, &v)?
            }
            None => cache.view()?,
        };
        let q_start = k.dim(1)? - n;
        let props = Props {
            scale: self.spec.scale,
            vis: at.vis,
            sinks: self.sinks.as_ref(),
        };
        let o = attend(&q, &k, &v, q_start, &props, at.masks)?;
        let o = match gate {
            Some(g) => (o * candle_nn::ops::sigmoid(&g)?)?,
            None => o,
        };
        self.project_out(&o, at)
    }

    /// `o_proj` of the attention output, with the site's convolution after it if it has one.
    fn project_out(&self, o: &Tensor, at: &Site) -> Result<Tensor> {
        match &at.out_conv {
            Some(c) => super::dyn_conv::project_then_conv(&self.o_proj, o, c),
            None => self.o_proj_forward(o),
        }
    }

    /// Several sequences at once: `x` holds their rows back to back (segment k's rows after
    /// segment k-1's), `sites[k]` and `caches[k]` are segment k's. The projections run once
    /// over all rows (the weights are read once); each segment's keys and values go to its own
    /// cache and its queries attend over it, exactly as [`Self::forward`] alone. Where the fused
    /// kernels run (CUDA) each segment takes [`Self::forward`] (batching them is the next
    /// step for the GPU).
    pub fn forward_segments(
        &self,
        x: &Tensor,
        sites: &[Site],
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let lens: Vec<usize> = sites.iter().map(|s| s.tables.len()).collect();
        let total: usize = lens.iter().sum();
        if total != x.dim(0)? || caches.len() != sites.len() {
            return Err(crate::Error::input(format!(
                "attention: {} rows for segments of {lens:?} rows",
                x.dim(0)?
            )));
        }
        if sites.iter().any(|s| s.out_conv.is_some()) {
            return Err(crate::Error::input(
                "attention: a convolution after o_proj is for one sequence's forward, not a batch of segments",
            ));
        }
        if let Some(o) = self.forward_segments_fused(x, sites, caches, &lens)? {
            return Ok(o);
        }
        if !x.device().is_cpu() || self.spec.shared_kv {
            let mut parts = Vec::with_capacity(sites.len());
            let mut off = 0;
            for ((site, cache), n) in sites.iter().zip(caches.iter_mut()).zip(&lens) {
                parts.push(self.forward(&x.narrow(0, off, *n)?, site, cache)?);
                off += n;
            }
            return Ok(Tensor::cat(&parts, 0)?);
        }
        let (q_all, kv_all) = self.project(x)?;
        let mut outs = Vec::with_capacity(sites.len());
        let mut gates = Vec::with_capacity(sites.len());
        let mut off = 0;
        for ((at, cache), &n) in sites.iter().zip(caches.iter_mut()).zip(&lens) {
            let (q, gate) = self.split_gate(q_all.narrow(0, off, n)?)?;
            let q = self.finish_queries(q, at.rope, at.tables)?;
            let (k, v) = match &kv_all {
                Some((k, v)) => {
                    let (k, v) = self.finish_keys_values(
                        k.narrow(0, off, n)?,
                        v.narrow(0, off, n)?,
                        at.rope,
                        at.tables,
                    )?;
                    cache.append(&k, &v)?
                }
                None => cache.view()?,
            };
            let q_start = k.dim(1)? - n;
            let props = Props {
                scale: self.spec.scale,
                vis: at.vis,
                sinks: self.sinks.as_ref(),
            };
            outs.push(attend(&q, &k, &v, q_start, &props, at.masks)?);
            gates.push(gate);
            off += n;
        }
        let o = Tensor::cat(&outs, 0)?;
        let o = match gates.into_iter().collect::<Option<Vec<Tensor>>>() {
            Some(g) if !g.is_empty() => (o * candle_nn::ops::sigmoid(&Tensor::cat(&g, 0)?)?)?,
            _ => o,
        };
        self.o_proj_forward(&o)
    }

    /// [`Self::forward`] of a forward whose positions live on the device (`step`; a CUDA
    /// graph replays it at later positions): the batched kernels with one segment, reading
    /// the first position from `step.pos0` and the rope rows from the by-position table.
    /// They give the bits the one-sequence kernels give (tests/fused_cuda.rs). Anything else
    /// cannot run such a forward, so where they do not apply this is an error, not a
    /// fallback.
    fn forward_device_step(
        &self,
        x: &Tensor,
        at: &Site,
        step: &fused::DeviceStep,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let declined = || {
            crate::Error::input(format!(
                "attention (heads {}, head dim {}): the fused kernels declined a CUDA graph step; run with DFLASH_CUDA_GRAPHS=0 and report this",
                self.spec.heads, self.spec.head_dim
            ))
        };
        let Some(table) = at.tables.packed.as_ref().filter(|_| at.tables.by_position) else {
            return Err(declined());
        };
        if !self.fusable(cache, at.tables) {
            return Err(declined());
        }
        let y = match &self.qkv {
            Some(f) => f.forward(x)?,
            None => self.q_proj.forward(x)?,
        };
        let n = y.dim(0)?;
        let joint = cache.joint().cloned().ok_or_else(declined)?;
        let pos0 = if self.spec.shared_kv {
            cache.len().checked_sub(n).ok_or_else(|| {
                crate::Error::input("attention: a KV-shared layer ran before its owner")
            })?
        } else {
            cache.check_room(n)?;
            cache.len()
        };
        let segs = [fused::Segment {
            kv: &joint,
            pos0,
            n,
        }];
        if !self.spec.shared_kv {
            let (kc, vc) = self.kv_columns();
            let k = self.head_source(kc, &self.k_norm, at.rope);
            let v = self.value_source(vc);
            if !fused::kv_write_segments(&y, table, &k, &v, &segs, Some(step))? {
                return Err(declined());
            }
            cache.append_in_place(n, |_, _| Ok(true))?;
        }
        let call = self.fused_call(at, 0, 0);
        match fused::attention_segments(&y, table, &segs, &call, Some(step))? {
            Some(o) => self.project_out(&o, at),
            None => {
                if !self.spec.shared_kv {
                    cache.truncate(pos0);
                }
                Err(declined())
            }
        }
    }

    /// [`Self::forward`] through the fused kernels: one projection, one K/V write, one
    /// attention launch (two with split keys), sinks and the output gate inside it. None when
    /// they do not apply (nothing changed).
    fn forward_fused(&self, x: &Tensor, at: &Site, cache: &mut KvCache) -> Result<Option<Tensor>> {
        if !self.fusable(cache, at.tables) {
            return Ok(None);
        }
        let y = match &self.qkv {
            Some(f) => f.forward(x)?,
            None => self.q_proj.forward(x)?,
        };
        match self.attend_fused(&y, at, cache)? {
            Some(o) => Ok(Some(self.project_out(&o, at)?)),
            None => Ok(None),
        }
    }

    /// [`Self::forward_segments`] through the fused kernels: the q/k/v projection once over
    /// every segment's rows, then each segment's K/V write and attention over its own cache,
    /// then `o_proj` once. None when the fused kernels do not apply to every segment.
    fn forward_segments_fused(
        &self,
        x: &Tensor,
        sites: &[Site],
        caches: &mut [&mut KvCache],
        lens: &[usize],
    ) -> Result<Option<Tensor>> {
        if x.device().is_cpu()
            || sites.len() < 2
            || !sites
                .iter()
                .zip(caches.iter())
                .all(|(at, c)| at.tables.packed.is_some() && self.fusable(c, at.tables))
        {
            return Ok(None);
        }
        let y = match &self.qkv {
            Some(f) => f.forward(x)?,
            None => self.q_proj.forward(x)?,
        };
        if !self.spec.shared_kv {
            if let Some(o) = self.attend_fused_one_launch(&y, sites, caches, lens)? {
                return Ok(Some(self.o_proj_forward(&o)?));
            }
        }
        let mut outs = Vec::with_capacity(sites.len());
        let mut off = 0;
        for ((at, cache), &n) in sites.iter().zip(caches.iter_mut()).zip(lens) {
            match self.attend_fused(&y.narrow(0, off, n)?, at, cache)? {
                Some(o) => outs.push(o),
                None => {
                    return Err(crate::Error::input(
                        "fused attention declined one segment of a batch it was set up for; run with DFLASH_FUSED=0 and report this",
                    ))
                }
            }
            off += n;
        }
        Ok(Some(self.o_proj_forward(&Tensor::cat(&outs, 0)?)?))
    }

    /// Every segment's K/V write in one launch and their attention in one more (each segment's
    /// rows over its own cache): the attention output before `o_proj`, or None (nothing
    /// written) when the batched kernels do not apply.
    fn attend_fused_one_launch(
        &self,
        y: &Tensor,
        sites: &[Site],
        caches: &mut [&mut KvCache],
        lens: &[usize],
    ) -> Result<Option<Tensor>> {
        let at = &sites[0];
        if sites.iter().any(|s| s.vis != at.vis) {
            return Ok(None);
        }
        let parts: Vec<&RopeTables> = sites.iter().map(|s| s.tables).collect();
        let Some(tables) = RopeTables::joint_packed(&parts)? else {
            return Ok(None);
        };
        let Some(written) =
            self.write_segments(y, self.kv_columns(), at.rope, &tables, caches, lens)?
        else {
            return Ok(None);
        };
        let segs: Vec<fused::Segment> = written
            .iter()
            .zip(lens)
            .map(|((kv, pos0), &n)| fused::Segment { kv, pos0: *pos0, n })
            .collect();
        // kv_len / q_pos0 are per segment in a batched call
        let call = self.fused_call(at, 0, 0);
        match fused::attention_segments(y, &tables, &segs, &call, None)? {
            Some(o) => Ok(Some(o)),
            None => {
                // The kernel checks what `fusable` and the write checked: a bug, not an input.
                for (c, (_, p)) in caches.iter_mut().zip(&written) {
                    c.truncate(*p);
                }
                Err(crate::Error::input(format!(
                    "batched fused attention declined a layer it was set up for (heads {}, head_dim {}); run with DFLASH_FUSED=0 and report this",
                    self.spec.heads, self.spec.head_dim
                )))
            }
        }
    }

    /// The fused attention kernel's description of this layer's queries at `at` (an output
    /// gate after each query head where the layer has one), over keys `0 .. kv_len` with row
    /// 0 at `q_pos0`.
    fn fused_call(&self, at: &Site, kv_len: usize, q_pos0: usize) -> fused::AttentionCall {
        let mut q = self.head_source(0, &self.q_norm, at.rope);
        let gate = self.spec.output_gate.then(|| {
            q.head_stride = 2 * self.spec.head_dim;
            self.spec.head_dim
        });
        fused::AttentionCall {
            q,
            heads: self.spec.heads,
            scale: self.spec.scale as f32,
            kv_len,
            q_pos0,
            vis: at.vis,
            sinks: self.sinks.clone(),
            gate_offset: gate,
        }
    }

    /// The fused K/V write and attention of rows already projected by the stacked q/k/v (or
    /// q-only, KV-shared) weights: `y [n, ...]`; the attention output before `o_proj`.
    fn attend_fused(&self, y: &Tensor, at: &Site, cache: &mut KvCache) -> Result<Option<Tensor>> {
        let Some(packed) = &at.tables.packed else {
            return Ok(None);
        };
        let n = y.dim(0)?;
        let pos0 = if self.spec.shared_kv {
            // The owner appended this forward's rows already.
            cache.len().checked_sub(n).ok_or_else(|| {
                crate::Error::input("attention: a KV-shared layer ran before its owner")
            })?
        } else {
            let (kc, vc) = self.kv_columns();
            let pos0 = cache.len();
            if !self.write_kv_fused(y, kc, vc, at.rope, at.tables, cache)? {
                return Ok(None);
            }
            pos0
        };
        let joint = cache.joint().expect("fusable checked the joint buffer");
        let o = fused::attention(y, packed, joint, &self.fused_call(at, pos0 + n, pos0))?;
        match o {
            Some(o) => Ok(Some(o)),
            None => {
                // The kernel declined after the K/V write (it checks the same conditions as
                // `fusable`, so this is a bug, not an input): undo the write and say so.
                if !self.spec.shared_kv {
                    cache.truncate(pos0);
                }
                Err(crate::Error::input(format!(
                    "fused attention declined a layer it was set up for (heads {}, head_dim {}); run with DFLASH_FUSED=0 and report this",
                    self.spec.heads, self.spec.head_dim
                )))
            }
        }
    }
}

/// What [`attend`] needs besides the tensors.
pub struct Props<'a> {
    pub scale: f64,
    pub vis: Visibility,
    /// `[heads]` logits joining every row's softmax (gpt-oss).
    pub sinks: Option<&'a Tensor>,
}

/// Attention of ready queries `q [heads, n, d]` (row i at position `q_start + i`) over keys
/// and values `k [kv_heads, L, dk]`, `v [kv_heads, L, dv]` (positions `0 .. L`, views allowed):
/// `[n, heads * dv]`. A causal verify-sized block runs row by row (each row exactly as its
/// one-row decode step) on the CPU, and on other devices in batch-invariant mode (there this
/// path runs only where the fused kernels decline: head dims without a kernel, or
/// `DFLASH_FUSED=0`; cuBLAS picks its blocking by shape, so one block-sized product does not
/// round like the decode steps' products); anything else as one masked product.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_start: usize,
    p: &Props,
    masks: &Masks,
) -> Result<Tensor> {
    if let Some(o) = super::cpu_attention::attend(q, k, v, q_start, p)? {
        return Ok(o);
    }
    let n = q.dim(1)?;
    let row_wise = q.device().is_cpu() || crate::switches::batch_invariant();
    if row_wise && p.vis.causal && n > 1 && n <= ROW_WISE_MAX {
        return attend_rows(q, k, v, q_start, p);
    }
    let mask = if n > 1 || p.vis.window.is_some() {
        masks.get(p.vis)?
    } else {
        None
    };
    sdpa_with_sinks(q, k, v, mask.as_ref(), p.scale, p.sinks)
}

/// [`attend`] for a short causal block computed row by row, each row exactly as a one-row
/// decode step at its position computes it: the keys up to its own position and the same mask
/// (none for full layers, the window's for sliding ones). The matmul kernels pick their
/// blocking (and so their summation order) by shape, so one `[rep * n, d] x [d, L]` product
/// does not round like n `[rep, d] x [d, L_i]` products; after activation quantization (GGUF
/// weights) those last-bit differences grow into logit differences that flip greedy choices.
/// Row by row, a verify's logits equal the plain decoding steps' (tested in
/// `tests/lossless.rs`), so greedy DFlash output equals greedy plain decoding without relying
/// on near-ties being rare.
fn attend_rows(q: &Tensor, k: &Tensor, v: &Tensor, q_start: usize, p: &Props) -> Result<Tensor> {
    let n = q.dim(1)?;
    let mut rows = Vec::with_capacity(n);
    for i in 0..n {
        let len = q_start + i + 1;
        let mask = match p.vis.window {
            Some(_) => attention_mask(
                1,
                q_start + i,
                len,
                true,
                p.vis.window,
                q.dtype(),
                q.device(),
            )?,
            None => None,
        };
        let qi = q.narrow(1, i, 1)?.contiguous()?;
        rows.push(sdpa_with_sinks(
            &qi,
            &k.narrow(1, 0, len)?,
            &v.narrow(1, 0, len)?,
            mask.as_ref(),
            p.scale,
            p.sinks,
        )?);
    }
    Ok(Tensor::cat(&rows, 0)?)
}

/// Scaled dot-product attention. `q [heads, n, d]`, `k/v [kv_heads, L, d]` (views allowed),
/// `mask [n, L]` additive (0 / -inf). Returns `[n, heads * d]`.
pub fn sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    sdpa_with_sinks(q, k, v, mask, scale, None)
}

/// [`sdpa`] with optional attention sinks (gpt-oss): `sinks [heads]` is a learned logit per
/// head that joins every query's softmax as one extra column and is then dropped, so the
/// probabilities over the real keys sum to less than one.
pub fn sdpa_with_sinks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    sinks: Option<&Tensor>,
) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let (kvh, l, _) = k.dims3()?;
    let rep = heads / kvh;
    let vd = v.dim(2)?;
    // [heads, n, d] -> [kv_heads, rep * n, d]: heads of a group are adjacent.
    let q = (q * scale)?.reshape((kvh, rep * n, d))?;
    let scores = q.matmul(&k.t()?)?; // [kvh, rep*n, L]
    let scores = match mask {
        Some(m) => scores
            .reshape((kvh, rep, n, l))?
            .broadcast_add(m)?
            .reshape((kvh, rep * n, l))?,
        None => scores,
    };
    // The fused softmax has no backward; training (tracked scores) takes the composite one.
    let softmax = |x: &Tensor| -> Result<Tensor> {
        Ok(if x.track_op() {
            candle_nn::ops::softmax(x, candle_core::D::Minus1)?
        } else {
            candle_nn::ops::softmax_last_dim(x)?
        })
    };
    let probs = match sinks {
        None => softmax(&scores)?,
        Some(s) => {
            // [heads] -> [kvh, rep * n, 1]: each query row of head h gets sink h.
            let col = s
                .to_dtype(scores.dtype())?
                .reshape((kvh, rep, 1, 1))?
                .broadcast_as((kvh, rep, n, 1))?
                .reshape((kvh, rep * n, 1))?;
            let all = softmax(&Tensor::cat(&[&scores, &col], 2)?)?;
            all.narrow(2, 0, l)?.contiguous()?
        }
    };
    heads_out(probs.matmul(v)?, heads, n, vd)
}

/// Attention of `nb` blocks of `block` rows each over a shared context and their own block:
/// `q [heads, n, d]` (n = nb * block), context `kc/vc [kv_heads, s, d]` (views allowed; s may
/// be 0: `None`), the blocks' own keys and values `kb/vb [kv_heads, n, d]`; row r of block b
/// sees context columns and the keys of block b only, as `mask [n, s + block]` says (0 / -inf:
/// context columns first, then the block's `block` keys in order). Scores are `[.., s + block]`
/// wide, not `[.., s + n]` as with all blocks' keys side by side (of which a row sees `block`):
/// draft training's packed forward, where n is thousands of rows. Returns `[n, heads * vd]`.
/// In training (tracked f32 inputs) the attention is one op with its own backward
/// ([`super::train_ops::block_attention`]): the `[.., s + block]` scores never enter the
/// autograd graph, where each of their ~8 nodes a layer cost a zero-filled gradient, an add
/// and copies (~80 ms of a 512-block step on an H100, session 51).
#[allow(clippy::too_many_arguments)]
pub fn sdpa_blocks(
    q: &Tensor,
    ctx: Option<(&Tensor, &Tensor)>,
    kb: &Tensor,
    vb: &Tensor,
    block: usize,
    mask: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    sdpa_blocks_with(q, ctx, kb, vb, block, mask, scale, true)
}

/// [`sdpa_blocks`]; `fused_backward` false keeps tracked inputs on the composite ops (the
/// reference the fused op's gradients are tested against).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sdpa_blocks_with(
    q: &Tensor,
    ctx: Option<(&Tensor, &Tensor)>,
    kb: &Tensor,
    vb: &Tensor,
    block: usize,
    mask: &Tensor,
    scale: f64,
    fused_backward: bool,
) -> Result<Tensor> {
    let (heads, n, d) = q.dims3()?;
    let kvh = kb.dim(0)?;
    let (rep, nb, vd) = (heads / kvh, n / block, vb.dim(2)?);
    if n % block != 0 || kb.dims() != [kvh, n, d] || vb.dims()[..2] != [kvh, n] {
        return Err(crate::Error::input(format!(
            "block attention: q {:?}, block keys {:?}, values {:?}, block {block}",
            q.dims(),
            kb.dims(),
            vb.dims()
        )));
    }
    let lay = BlockLayout { kvh, rep, nb };
    if fused_backward && q.track_op() && super::train_ops::applies(q) {
        // training: one op with its own backward (the scores never enter the autograd graph)
        let o = super::train_ops::block_attention(q, ctx, kb, vb, lay, mask, scale)?;
        return heads_out(o, heads, n, vd);
    }
    let q = (q * scale)?.reshape((kvh, rep * n, d))?;
    let own = lay
        .block_major(&q, block, d)?
        .matmul(&kb.reshape((kvh * nb, block, d))?.t()?)?; // [kvh * nb, rep * block, block]
    let own = lay.row_major(&own, block, block)?; // [kvh, rep * n, block]
    let s = ctx.map_or(Ok(0), |(k, _)| k.dim(1))?;
    let scores = match ctx {
        Some((kc, _)) => Tensor::cat(&[&q.matmul(&kc.t()?)?, &own], 2)?,
        None => own,
    };
    let probs = if scores.track_op() && super::train_ops::applies(&scores) {
        super::train_ops::masked_softmax(&scores.reshape((kvh * rep, n, s + block))?, Some(mask))?
            .reshape((kvh, rep * n, s + block))?
    } else {
        let m = scores
            .reshape((kvh, rep, n, s + block))?
            .broadcast_add(mask)?
            .reshape((kvh, rep * n, s + block))?;
        match m.track_op() {
            true => candle_nn::ops::softmax(&m, candle_core::D::Minus1)?,
            false => candle_nn::ops::softmax_last_dim(&m)?,
        }
    };
    let p_own = lay.block_major(&probs.narrow(2, s, block)?.contiguous()?, block, block)?;
    let o_own = p_own.matmul(&vb.reshape((kvh * nb, block, vd))?)?; // [kvh * nb, rep * block, vd]
    let mut o = lay.row_major(&o_own, block, vd)?;
    if let Some((_, vc)) = ctx {
        o = (o + probs.narrow(2, 0, s)?.contiguous()?.matmul(vc)?)?;
    }
    heads_out(o, heads, n, vd)
}

/// How [`sdpa_blocks`] groups its rows: `kv_heads` groups of `rep` query heads (adjacent), `nb`
/// blocks of rows. `[kvh, rep * n, y]` (n = nb * block rows, head-major within a group) <->
/// `[kvh * nb, rep * block, y]` (a block's rows of every head of its group together).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockLayout {
    pub kvh: usize,
    pub rep: usize,
    pub nb: usize,
}

impl BlockLayout {
    /// `[kvh, rep * nb * x, y]` -> `[kvh * nb, rep * x, y]`.
    pub fn block_major(&self, t: &Tensor, x: usize, y: usize) -> Result<Tensor> {
        let (kvh, rep, nb) = (self.kvh, self.rep, self.nb);
        Ok(t.reshape((kvh, rep, nb, x, y))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((kvh * nb, rep * x, y))?)
    }

    /// `[kvh * nb, rep * x, y]` -> `[kvh, rep * nb * x, y]`.
    pub fn row_major(&self, t: &Tensor, x: usize, y: usize) -> Result<Tensor> {
        let (kvh, rep, nb) = (self.kvh, self.rep, self.nb);
        Ok(t.reshape((kvh, nb, rep, x, y))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((kvh, rep * nb * x, y))?)
    }
}

/// `[kvh, rep * n, vd]` attention outputs (heads of a group adjacent) as `[n, heads * vd]`.
fn heads_out(o: Tensor, heads: usize, n: usize, vd: usize) -> Result<Tensor> {
    Ok(o.reshape((heads, n, vd))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((n, heads * vd))?)
}

/// Additive mask for `n` queries at positions `q_start ..` over keys at positions `0 .. k_len`.
/// `causal`: a key after the query is hidden. `window`: a key is visible iff
/// `q - window < k` (sliding attention). Returns None when nothing is masked.
pub fn attention_mask(
    n: usize,
    q_start: usize,
    k_len: usize,
    causal: bool,
    window: Option<usize>,
    dtype: DType,
    device: &Device,
) -> Result<Option<Tensor>> {
    let vis = Visibility { causal, window };
    let mut any = false;
    let mut m = vec![0f32; n * k_len];
    for i in 0..n {
        let qp = q_start + i;
        for kp in 0..k_len {
            if !vis.sees(qp, kp) {
                m[i * k_len + kp] = f32::NEG_INFINITY;
                any = true;
            }
        }
    }
    if !any {
        return Ok(None);
    }
    Ok(Some(
        Tensor::from_vec(m, (n, k_len), device)?.to_dtype(dtype)?,
    ))
}
