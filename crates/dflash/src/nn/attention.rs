//! Grouped-query attention with optional per-head q/k RMSNorm, RoPE at absolute positions,
//! causal or sliding-window masks at an offset, and the engine-owned KV cache.
//!
//! Batch 1: queries are laid out `[kv_heads, n_rep * q_len, head_dim]` so that every query
//! head of a group shares its K/V head without copying K/V (`repeat_kv` is never needed).

use super::fused::{self, HeadSource, Visibility};
use super::{KvCache, Linear, RmsNorm, Rope, RopeTables};
use crate::source::Weights;
use crate::Result;
use candle_core::{DType, Device, Tensor};

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
    /// Per-head RMSNorm on q and k before RoPE (qwen3, gemma3, the DFlash draft).
    pub qk_norm: bool,
    pub qk_norm_add_one: bool,
    pub eps: f64,
    /// Softmax scale (head_dim^-0.5 unless the family says otherwise).
    pub scale: f64,
}

#[derive(Debug, Clone)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub spec: AttentionSpec,
    /// q, k and v stacked (see `fuse`): one matmul for the three in `forward`.
    pub qkv: Option<Linear>,
    /// The k/v rows of `qkv` (a view of the same weight): keys and values without queries.
    pub kv: Option<Linear>,
    /// Attention sinks `[heads]` (gpt-oss): a learned logit per head joining the softmax.
    pub sinks: Option<Tensor>,
}

impl Attention {
    /// Load `{prefix}.{q,k,v,o}_proj` and, with `qk_norm`, `{prefix}.{q,k}_norm`.
    pub fn load(w: &Weights, prefix: &str, spec: AttentionSpec) -> Result<Self> {
        let (h, qd, kd) = (
            spec.hidden,
            spec.heads * spec.head_dim,
            spec.kv_heads * spec.head_dim,
        );
        let lin = |n: &str, i, o, b| Linear::load(w, &format!("{prefix}.{n}"), i, o, b);
        let norm = |n: &str| {
            RmsNorm::load(
                w,
                &format!("{prefix}.{n}.weight"),
                spec.head_dim,
                spec.eps,
                spec.qk_norm_add_one,
            )
        };
        Ok(Self {
            q_proj: lin("q_proj", h, qd, spec.bias)?,
            k_proj: lin("k_proj", h, kd, spec.bias)?,
            v_proj: lin("v_proj", h, kd, spec.bias)?,
            o_proj: lin("o_proj", qd, h, spec.o_bias)?,
            q_norm: if spec.qk_norm {
                Some(norm("q_norm")?)
            } else {
                None
            },
            k_norm: if spec.qk_norm {
                Some(norm("k_norm")?)
            } else {
                None
            },
            spec,
            qkv: None,
            kv: None,
            sinks: None,
        })
    }

    /// Stack q/k/v into one linear for `forward` when [`Linear::concat`] can (dense, or
    /// quantized of one type on the CPU); the separate weights are dropped (memory does not
    /// grow), so `queries`/`keys_values` then use the fused one too.
    pub fn fuse(&mut self) -> Result<()> {
        if self.qkv.is_none() {
            if let Some(f) = Linear::concat(&[&self.q_proj, &self.k_proj, &self.v_proj])? {
                let qd = self.spec.heads * self.spec.head_dim;
                let kd = self.spec.kv_heads * self.spec.head_dim;
                self.q_proj = self.q_proj.emptied()?;
                self.k_proj = self.k_proj.emptied()?;
                self.v_proj = self.v_proj.emptied()?;
                self.kv = f.rows(qd, 2 * kd)?;
                self.qkv = Some(f);
            }
        }
        Ok(())
    }

    /// q, k, v projections of `x [n, hidden]`: `[n, heads*d]`, `[n, kvh*d]`, `[n, kvh*d]`.
    fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        match &self.qkv {
            Some(f) => {
                let y = f.forward(x)?;
                let (qd, kd) = (
                    self.spec.heads * self.spec.head_dim,
                    self.spec.kv_heads * self.spec.head_dim,
                );
                Ok((
                    y.narrow(1, 0, qd)?,
                    y.narrow(1, qd, kd)?,
                    y.narrow(1, qd + kd, kd)?,
                ))
            }
            None => Ok((
                self.q_proj.forward(x)?,
                self.k_proj.forward(x)?,
                self.v_proj.forward(x)?,
            )),
        }
    }

    /// Queries for `x [n, hidden]`: projected, normed, roped: `[heads, n, head_dim]`.
    pub fn queries(&self, x: &Tensor, rope: &Rope, t: &RopeTables) -> Result<Tensor> {
        let q = match &self.qkv {
            Some(_) => self.project(x)?.0,
            None => self.q_proj.forward(x)?,
        };
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

    /// Keys and values for `x [n, hidden]`: `[kv_heads, n, head_dim]` each (keys normed, roped).
    pub fn keys_values(&self, x: &Tensor, rope: &Rope, t: &RopeTables) -> Result<(Tensor, Tensor)> {
        let (k, v) = self.project_kv(x)?;
        self.finish_keys_values(k, v, rope, t)
    }

    /// k and v projections only (`[n, kvh*d]` each), without computing queries.
    fn project_kv(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        match (&self.kv, &self.qkv) {
            (Some(kv), _) => {
                let y = kv.forward(x)?;
                let kd = self.spec.kv_heads * self.spec.head_dim;
                Ok((y.narrow(1, 0, kd)?, y.narrow(1, kd, kd)?))
            }
            (None, Some(_)) => {
                let (_, k, v) = self.project(x)?;
                Ok((k, v))
            }
            (None, None) => Ok((self.k_proj.forward(x)?, self.v_proj.forward(x)?)),
        }
    }

    /// Queries, keys and values of `x [n, hidden]` from one projection:
    /// `[heads, n, d]`, `[kv_heads, n, d]`, `[kv_heads, n, d]`.
    pub fn queries_keys_values(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = self.project(x)?;
        let q = self.finish_queries(q, rope, t)?;
        let (k, v) = self.finish_keys_values(k, v, rope, t)?;
        Ok((q, k, v))
    }

    /// The fused kernels' view of this layer's heads: where they sit in a projection output
    /// whose first column is `offset`, and their norm.
    fn head_source(&self, offset: usize, norm: &Option<RmsNorm>, rope: &Rope) -> HeadSource {
        HeadSource {
            offset,
            norm: norm.as_ref().map(|n| n.weight.clone()),
            eps: norm.as_ref().map_or(0.0, |n| n.eps),
            rot: rope.rotary_dim,
        }
    }

    /// Whether the fused path can run for this layer at all (dense stacked q/k/v, no sinks, a
    /// joint cache, a head dim the kernel handles, packed tables); the kernels then check
    /// device, dtype and shapes.
    fn fusable(&self, cache: &KvCache, t: &RopeTables) -> bool {
        self.qkv.is_some()
            && self.sinks.is_none()
            && cache.joint().is_some()
            && t.packed.is_some()
            && fused::attention_supports(self.spec.head_dim)
    }

    /// Append the keys/values of `x [n, hidden]` (positions of `t`) to `cache`, with the fused
    /// kernel when it applies.
    pub fn append_keys_values(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
        cache: &mut KvCache,
    ) -> Result<()> {
        if let (true, Some(kvl), Some(packed)) = (self.fusable(cache, t), &self.kv, &t.packed) {
            let y = kvl.forward(x)?;
            let kd = self.spec.kv_heads * self.spec.head_dim;
            let k = self.head_source(0, &self.k_norm, rope);
            let n = x.dim(0)?;
            if cache.append_in_place(n, |kv, pos0| fused::kv_write(kv, &y, packed, &k, kd, pos0))? {
                return Ok(());
            }
        }
        let (k, v) = self.keys_values(x, rope, t)?;
        cache.append(&k, &v)?;
        Ok(())
    }

    /// [`Self::forward`] for a short causal block (a verify) computed row by row, each row
    /// exactly as a one-row decode step at its position computes it: the keys up to its own
    /// position and the same mask (none for full layers, the window's for sliding ones). The
    /// matmul kernels pick their blocking (and so their summation order) by shape, so one
    /// `[rep * n, d] x [d, L]` product does not round like n `[rep, d] x [d, L_i]` products;
    /// after activation quantization (GGUF weights) those last-bit differences grow into
    /// logit differences that flip greedy choices. Row by row, a verify's logits equal the
    /// plain decoding steps' (tested in `tests/lossless.rs`), so greedy DFlash output equals
    /// greedy plain decoding without relying on near-ties being rare.
    pub fn forward_rows(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
        cache: &mut KvCache,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let (q, k, v) = self.queries_keys_values(x, rope, t)?;
        let start = cache.len();
        let (k, v) = cache.append(&k, &v)?;
        let n = x.dim(0)?;
        let mut rows = Vec::with_capacity(n);
        for i in 0..n {
            let len = start + i + 1;
            let mask = match window {
                Some(_) => attention_mask(1, start + i, len, true, window, q.dtype(), q.device())?,
                None => None,
            };
            let qi = q.narrow(1, i, 1)?.contiguous()?;
            rows.push(sdpa_with_sinks(
                &qi,
                &k.narrow(1, 0, len)?,
                &v.narrow(1, 0, len)?,
                mask.as_ref(),
                self.spec.scale,
                self.sinks.as_ref(),
            )?);
        }
        self.o_proj.forward(&Tensor::cat(&rows, 0)?)
    }

    /// Write this layer's keys/values for new rows from `y`, a projection of those rows by
    /// every layer's k/v weights stacked (`[n, layers * 2 * kv_heads * head_dim]`; this layer
    /// is block `layer`). True when the fused kernel wrote them; false (nothing written)
    /// when it does not apply.
    pub fn write_keys_values_from(
        &self,
        y: &Tensor,
        layer: usize,
        rope: &Rope,
        t: &RopeTables,
        cache: &mut KvCache,
    ) -> Result<bool> {
        let Some(packed) = &t.packed else {
            return Ok(false);
        };
        if !self.fusable(cache, t) {
            return Ok(false);
        }
        let kd = self.spec.kv_heads * self.spec.head_dim;
        let k = self.head_source(layer * 2 * kd, &self.k_norm, rope);
        let n = y.dim(0)?;
        cache.append_in_place(n, |kv, pos0| {
            fused::kv_write(kv, y, packed, &k, layer * 2 * kd + kd, pos0)
        })
    }

    /// [`Self::forward`] through the fused kernels: one projection, one K/V write, one
    /// attention launch (two with split keys). None when they do not apply (nothing changed);
    /// the caller then runs `forward` with an explicit mask.
    pub fn forward_fused(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
        cache: &mut KvCache,
        vis: Visibility,
    ) -> Result<Option<Tensor>> {
        let (Some(qkv), Some(packed)) = (&self.qkv, &t.packed) else {
            return Ok(None);
        };
        if !self.fusable(cache, t) {
            return Ok(None);
        }
        let n = x.dim(0)?;
        let (qd, kd) = (
            self.spec.heads * self.spec.head_dim,
            self.spec.kv_heads * self.spec.head_dim,
        );
        let y = qkv.forward(x)?;
        let k = self.head_source(qd, &self.k_norm, rope);
        let pos0 = cache.len();
        if !cache.append_in_place(n, |kv, p| fused::kv_write(kv, &y, packed, &k, qd + kd, p))? {
            return Ok(None);
        }
        let q = self.head_source(0, &self.q_norm, rope);
        let joint = cache
            .joint()
            .expect("append_in_place wrote the joint buffer");
        let o = fused::attention(
            &y,
            packed,
            joint,
            &q,
            self.spec.heads,
            self.spec.scale as f32,
            pos0 + n,
            pos0,
            vis,
        )?;
        match o {
            Some(o) => Ok(Some(self.o_proj.forward(&o)?)),
            None => {
                // The kernel declined after the K/V write (it checks the same conditions as
                // `fusable`, so this is a bug, not an input): undo the write and say so.
                cache.truncate(pos0);
                Err(crate::Error::input(format!(
                    "fused attention declined a layer it was set up for (heads {}, head_dim {}); run with DFLASH_FUSED=0 and report this",
                    self.spec.heads, self.spec.head_dim
                )))
            }
        }
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
        let v = v.reshape((n, kvh, d))?.transpose(0, 1)?.contiguous()?;
        Ok((k, v))
    }

    /// Self-attention of `x [n, hidden]` whose rows sit at the positions of `t`, appending its
    /// K/V to `cache` and attending over everything cached. `mask [n, cache_len + n]` or None.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
        cache: &mut KvCache,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (q, k, v) = self.queries_keys_values(x, rope, t)?;
        let (k, v) = cache.append(&k, &v)?;
        let o = sdpa_with_sinks(&q, &k, &v, mask, self.spec.scale, self.sinks.as_ref())?;
        self.o_proj.forward(&o)
    }
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
    let o = probs.matmul(v)?; // [kvh, rep*n, vd]
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
    let mut any = false;
    let mut m = vec![0f32; n * k_len];
    for i in 0..n {
        let qp = q_start + i;
        for kp in 0..k_len {
            let hidden = (causal && kp > qp) || window.is_some_and(|w| kp + w <= qp);
            if hidden {
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
