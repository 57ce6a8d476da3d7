//! Gated full attention of the hybrid Qwen families (transformers' `Qwen3NextAttention`,
//! `Qwen3_5Attention`): `q_proj` produces, per head, the query and an output gate
//! (`[q_h (head_dim) | gate_h (head_dim)]` for each head in turn); q/k RMSNorm per head
//! before RoPE (partial rotary through [`Rope`]); GQA over the engine's KV cache; the
//! attention output is multiplied by `sigmoid(gate)` before `o_proj`.

use super::attention::sdpa;
use super::{AttentionSpec, KvCache, Linear, RmsNorm, Rope, RopeTables};
use crate::source::Weights;
use crate::Result;
use candle_core::Tensor;

#[derive(Debug, Clone)]
pub struct GatedAttention {
    /// `[heads * head_dim * 2, hidden]`: query and gate interleaved per head.
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: RmsNorm,
    pub k_norm: RmsNorm,
    pub spec: AttentionSpec,
}

impl GatedAttention {
    /// Load `{prefix}.{q,k,v,o}_proj` and `{prefix}.{q,k}_norm` (`spec.qk_norm` is implied).
    pub fn load(w: &Weights, prefix: &str, spec: AttentionSpec) -> Result<Self> {
        let (h, d) = (spec.hidden, spec.head_dim);
        let (qd, kd) = (spec.heads * d, spec.kv_heads * d);
        let lin = |n: &str, i, o, b| Linear::load(w, &format!("{prefix}.{n}"), i, o, b);
        let norm = |n: &str| {
            RmsNorm::load(
                w,
                &format!("{prefix}.{n}.weight"),
                d,
                spec.eps,
                spec.qk_norm_add_one,
            )
        };
        Ok(Self {
            q_proj: lin("q_proj", h, 2 * qd, spec.bias)?,
            k_proj: lin("k_proj", h, kd, spec.bias)?,
            v_proj: lin("v_proj", h, kd, spec.bias)?,
            o_proj: lin("o_proj", qd, h, spec.o_bias)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            spec,
        })
    }

    /// Self-attention of `x [n, hidden]` at the positions of `t`, appending K/V to `cache`.
    /// `mask [n, cache_len + n]` or None.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
        cache: &mut KvCache,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let (heads, kvh, d) = (self.spec.heads, self.spec.kv_heads, self.spec.head_dim);
        // 1. query and gate, per head
        let qg = self.q_proj.forward(x)?.reshape((n, heads, 2 * d))?;
        let gate = qg.narrow(2, d, d)?.contiguous()?.reshape((n, heads * d))?;
        // 2. q/k norm per head, then RoPE on the rotary part
        let q = self.q_norm.forward(&qg.narrow(2, 0, d)?)?;
        let q = rope.apply(&q.transpose(0, 1)?.contiguous()?, t)?;
        let k = self
            .k_norm
            .forward(&self.k_proj.forward(x)?.reshape((n, kvh, d))?)?;
        let k = rope.apply(&k.transpose(0, 1)?.contiguous()?, t)?;
        let v = self
            .v_proj
            .forward(x)?
            .reshape((n, kvh, d))?
            .transpose(0, 1)?
            .contiguous()?;
        // 3. attention over the cache, 4. output gate, 5. output projection
        let (k, v) = cache.append(&k, &v)?;
        let o = sdpa(&q, &k, &v, mask, self.spec.scale)?;
        let o = (o * candle_nn::ops::sigmoid(&gate)?)?;
        self.o_proj.forward(&o)
    }
}
