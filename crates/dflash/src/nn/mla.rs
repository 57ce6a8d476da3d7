//! Multi-head latent attention (DeepSeek-V3 / Kimi) in the absorbed form, over a
//! [`LatentCache`] of one compressed row per position.
//!
//! Queries come from `q_proj`, or low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`; one
//! shared compressed row per position `kv_a_proj_with_mqa(x) = [latent | k_rope]`, the latent
//! normed by `kv_a_layernorm`; `kv_b_proj` split per head into `W_UK` (keys' nope part) and
//! `W_UV` (values). Absorbed, as inference engines run it: the queries' nope part is mapped
//! into latent space (`q_nope W_UK`), attention runs as MQA over the cached rows (keys = the
//! whole row, values = its latent part, through the attention door `nn::attend`), and the
//! per-head latent outputs are mapped back by `W_UV` before `o_proj`. Mathematically equal to
//! transformers' expand-then-attend form; per cached position it reads `kv_lora_rank +
//! qk_rope_head_dim` values instead of `heads * (nope + rope + v)`.

use super::attention::{attend, Masks, Props, Visibility};
use super::{LatentCache, Linear, RmsNorm, Rope, RopeTables};
use crate::Result;
use candle_core::Tensor;

/// How the queries are projected.
#[derive(Debug, Clone)]
pub enum QProj {
    Plain(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

/// Shapes of one MLA layer.
#[derive(Debug, Clone, Copy)]
pub struct MlaShape {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
    pub kv_lora: usize,
    /// Softmax scale (with the yarn `mscale_all_dim` correction).
    pub scale: f64,
}

#[derive(Debug, Clone)]
pub struct LatentAttention {
    pub q: QProj,
    pub kv_a: Linear,
    pub kv_a_norm: RmsNorm,
    /// `[heads, nope, kv_lora]`: maps a query's nope part into latent space.
    pub w_uk: Tensor,
    /// `[heads, kv_lora, v]`: maps a head's latent output to its value space.
    pub w_uv_t: Tensor,
    pub o_proj: Linear,
    pub shape: MlaShape,
}

impl LatentAttention {
    /// Split `kv_b [heads * (nope + v), kv_lora]` into the absorbed matrices.
    pub fn new(
        q: QProj,
        kv_a: Linear,
        kv_a_norm: RmsNorm,
        kv_b: &Tensor,
        o_proj: Linear,
        shape: MlaShape,
    ) -> Result<Self> {
        let s = shape;
        let kv_b = kv_b.reshape((s.heads, s.nope + s.v_dim, s.kv_lora))?;
        Ok(Self {
            q,
            kv_a,
            kv_a_norm,
            w_uk: kv_b.narrow(1, 0, s.nope)?.contiguous()?,
            w_uv_t: kv_b
                .narrow(1, s.nope, s.v_dim)?
                .transpose(1, 2)?
                .contiguous()?,
            o_proj,
            shape,
        })
    }

    /// Width of a cached row.
    pub fn row_width(&self) -> usize {
        self.shape.kv_lora + self.shape.rope
    }

    pub fn weight_bytes(&self) -> usize {
        let t = super::tensor_bytes;
        let q = match &self.q {
            QProj::Plain(q) => q.weight_bytes(),
            QProj::LowRank { a, norm, b } => {
                a.weight_bytes() + norm.weight_bytes() + b.weight_bytes()
            }
        };
        q + self.kv_a.weight_bytes()
            + self.kv_a_norm.weight_bytes()
            + t(&self.w_uk)
            + t(&self.w_uv_t)
            + self.o_proj.weight_bytes()
    }

    /// Attention of `x [n, hidden]` at the positions of `t`, appending the compressed rows to
    /// `cache`.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
        masks: &Masks,
        cache: &mut LatentCache,
    ) -> Result<Tensor> {
        let s = self.shape;
        let n = x.dim(0)?;
        // 1. queries [heads, n, nope + rope]
        let q = match &self.q {
            QProj::Plain(q) => q.forward(x)?,
            QProj::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x)?)?)?,
        };
        let q = q.reshape((n, s.heads, s.nope + s.rope))?.transpose(0, 1)?;
        let q_nope = q.narrow(2, 0, s.nope)?.contiguous()?;
        let q_rope = rope.apply(&q.narrow(2, s.nope, s.rope)?.contiguous()?, t)?;
        // 2. the compressed row: normed latent | roped shared key part
        let kv = self.kv_a.forward(x)?;
        let latent = self.kv_a_norm.forward(&kv.narrow(1, 0, s.kv_lora)?)?;
        let k_rope = rope.apply(
            &kv.narrow(1, s.kv_lora, s.rope)?
                .contiguous()?
                .unsqueeze(0)?,
            t,
        )?;
        let row = Tensor::cat(&[&latent.unsqueeze(0)?, &k_rope], 2)?;
        let rows = cache.append(&row)?; // [1, L, kv_lora + rope]
                                        // 3. absorbed queries: q_nope W_UK per head, then the rope part: [heads, n, kv_lora + rope]
        let q_lat = q_nope.matmul(&self.w_uk)?;
        let q_full = Tensor::cat(&[&q_lat, &q_rope], 2)?;
        // 4. MQA over the cached rows; values are the latent part
        let props = Props {
            scale: s.scale,
            vis: Visibility::CAUSAL,
            sinks: None,
        };
        let l = rows.dim(1)?;
        let values = rows.narrow(2, 0, s.kv_lora)?;
        let o = attend(&q_full, &rows, &values, l - n, &props, masks)?; // [n, heads*kv_lora]
                                                                        // 5. per-head latent -> value space, then o_proj
        let o = o
            .reshape((n, s.heads, s.kv_lora))?
            .transpose(0, 1)?
            .contiguous()?
            .matmul(&self.w_uv_t)?; // [heads, n, v]
        let o = o
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n, s.heads * s.v_dim))?;
        self.o_proj.forward(&o)
    }
}
