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
    /// `[heads, kv_lora, nope]`: maps a query's nope part into latent space (`q_nope W_UK`,
    /// stored as the per-head weight of a `[n, nope] -> [n, kv_lora]` product).
    pub w_uk_t: Tensor,
    /// `[heads, v, kv_lora]`: maps a head's latent output to its value space.
    pub w_uv: Tensor,
    pub o_proj: Linear,
    /// Per rank when tensor-parallel: `heads` counts this rank's share.
    pub shape: MlaShape,
    /// A tensor-parallel rank's layer: `o_proj`'s output all-reduced over the ranks.
    pub shard: Option<super::parallel::Shard>,
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
            w_uk_t: kv_b.narrow(1, 0, s.nope)?.transpose(1, 2)?.contiguous()?,
            w_uv: kv_b.narrow(1, s.nope, s.v_dim)?.contiguous()?,
            o_proj,
            shape,
            shard: None,
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
            + t(&self.w_uk_t)
            + t(&self.w_uv)
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
        let q_lat = per_head(&q_nope, &self.w_uk_t)?;
        let q_full = Tensor::cat(&[&q_lat, &q_rope], 2)?;
        // 4. MQA over the cached rows; values are the latent part
        let l = rows.dim(1)?;
        let o = match self.attend_device(&q_full, t, cache, l)? {
            Some(o) => o,
            None => {
                let props = Props {
                    scale: s.scale,
                    vis: Visibility::CAUSAL,
                    sinks: None,
                };
                // candle's CUDA matmul wants the value rows packed (a narrowed row is not)
                let values = rows.narrow(2, 0, s.kv_lora)?;
                let values = if values.device().is_cuda() {
                    values.contiguous()?
                } else {
                    values
                };
                attend(&q_full, &rows, &values, l - n, &props, masks)? // [n, heads*kv_lora]
            }
        };
        // 5. per-head latent -> value space, then o_proj
        let o = o
            .reshape((n, s.heads, s.kv_lora))?
            .transpose(0, 1)?
            .contiguous()?;
        let o = per_head(&o, &self.w_uv)?; // [heads, n, v]
        let o = o
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n, s.heads * s.v_dim))?;
        let y = self.o_proj.forward(&o)?;
        match &self.shard {
            Some(sh) => sh.all_reduce(&y),
            None => Ok(y),
        }
    }

    /// The latent attention kernel (CUDA, bf16, 512 + 64 dims, `nn::cuda::attention_latent`):
    /// `q_full [heads, n, width]` over the first `l` cached rows. None where it does not apply.
    #[cfg(feature = "cuda")]
    fn attend_device(
        &self,
        q_full: &Tensor,
        t: &RopeTables,
        cache: &LatentCache,
        l: usize,
    ) -> Result<Option<Tensor>> {
        let s = self.shape;
        let (Some(tables), true) = (
            &t.packed,
            super::fused::allowed_part(crate::switches::Part::Mla),
        ) else {
            return Ok(None);
        };
        if (s.kv_lora + s.rope, s.kv_lora) != super::cuda::LATENT_DIMS || q_full.track_op() {
            return Ok(None);
        }
        let (heads, n, w) = q_full.dims3()?;
        let src = q_full
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n, heads * w))?;
        let call = super::fused::AttentionCall {
            q: super::fused::HeadSource {
                offset: 0,
                head_stride: w,
                norm: None,
                eps: 0.0,
                rot: 0,
                unit_norm: false,
            },
            heads,
            scale: s.scale as f32,
            kv_len: l,
            q_pos0: l - n,
            vis: Visibility::CAUSAL,
            sinks: None,
            gate_offset: None,
        };
        Ok(super::cuda::attention_latent(
            &src,
            tables,
            cache.buffer(),
            s.kv_lora,
            &call,
        )?)
    }

    #[cfg(not(feature = "cuda"))]
    fn attend_device(
        &self,
        _: &Tensor,
        _: &RopeTables,
        _: &LatentCache,
        _: usize,
    ) -> Result<Option<Tensor>> {
        Ok(None)
    }
}

/// `x [heads, n, k] @ w [heads, m, k]^T` per head: `[heads, n, m]`; on CUDA in batch-invariant
/// mode through the batched skinny GEMM (a row's bits do not depend on the other rows).
fn per_head(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::fused::allowed_part(crate::switches::Part::Mla) && !x.track_op() {
        if let Some(y) = super::cuda::mma_batched(&x.contiguous()?, w)? {
            return Ok(y);
        }
    }
    Ok(x.matmul(&w.transpose(1, 2)?)?)
}
