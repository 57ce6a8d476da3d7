//! Gated DeltaNet: the linear-attention token mixer of the hybrid Qwen families (qwen3_5,
//! qwen3_5_moe, qwen3_next), with its conv and recurrent state in a [`RecurrentCache`].
//!
//! Per layer (transformers' `Qwen3_5GatedDeltaNet` / `Qwen3NextGatedDeltaNet`):
//! 1. one input projection to `[q | k | v]` (conv channels), `z` (output gate), `b`, `a`;
//! 2. a causal depthwise conv1d (kernel 4, no bias) over `[q | k | v]`, continuing from the
//!    cached window, then SiLU;
//! 3. q and k L2-normalized per key head (eps 1e-6 inside the rsqrt), q scaled by
//!    `k_dim^-0.5`; each key head serves `v_heads / k_heads` consecutive value heads;
//! 4. `beta = sigmoid(b)`, log decay `g = -exp(A_log) * softplus(a + dt_bias)`;
//! 5. the gated delta rule per value head, state `S [k_dim, v_dim]`:
//!    `S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q`,
//!    computed in chunks of up to [`DELTA_CHUNK`] rows (below);
//! 6. a gated RMSNorm per value head (`rms_norm(o) * w * silu(z)`, plain weight), out_proj.
//!
//! Chunked form (the WY/UT form of the delta rule, as in transformers' chunked fallback):
//! within a chunk of c rows starting from state S, with G the cumulative log decay,
//! `A_ij = beta_i (k_i . k_j) exp(G_i - G_j)` for j < i and `T = (I + A)^-1`:
//! `u = T (beta v)`, `w = T (beta exp(G) k)`, `delta = u - w S`,
//! `o = exp(G) q S + ((q k^T) * exp(G_i - G_j))_{j <= i} delta`, and the next state is
//! `exp(G_c) S + sum_i exp(G_c - G_i) k_i delta_i^T`. Each chunk is a handful of batched
//! matmuls over the heads; chunks run one after another, so memory is O(T) for a prompt of T
//! rows (never T x T) and time O(T c). `T` comes from a level-batched block inversion of the
//! unit lower-triangular `I + A` (log2 c levels of small matmuls; no sequential row loop and
//! no power series, which would overflow when keys are nearly parallel). Plain decoding is the
//! same code with c = 1 (no inversion).
//!
//! Every op is a candle tensor op on the layer's device (no host round trips); the recurrence
//! runs in f32 whatever the compute dtype, as transformers does.

use super::recurrent_cache::{DeltaChunk, WyChunk};
use super::{Activation, Linear, RecurrentCache};
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor, D};

/// Rows per chunk of the delta rule (transformers' default; a verify block always fits).
pub const DELTA_CHUNK: usize = 64;

/// How the input projections are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InProjLayout {
    /// qwen3_5 / qwen3_5_moe: `in_proj_qkv` (`[q all heads | k | v]`), `in_proj_z`,
    /// `in_proj_b`, `in_proj_a`.
    Split,
    /// qwen3_next: `in_proj_qkvz` grouped per key head (`[q, k, v x r, z x r]` for each of
    /// the key heads, r = value heads per key head) and `in_proj_ba` (`[b x r, a x r]` per
    /// key head). Rows are regrouped at load into the split order.
    Fused,
}

/// Shapes of one Gated DeltaNet layer.
#[derive(Debug, Clone)]
pub struct GatedDeltaSpec {
    pub hidden: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv_kernel: usize,
    pub eps: f64,
    /// Activation after the conv (config `hidden_act`).
    pub act: Activation,
    pub layout: InProjLayout,
}

impl GatedDeltaSpec {
    /// Channels of the conv: `[q | k | v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }
    /// Parameters of one layer: the input projections, conv taps, decay and bias vectors, the
    /// output norm and projection.
    pub fn params(&self) -> u64 {
        let (h, hv, dv) = (self.hidden as u64, self.v_heads as u64, self.v_dim as u64);
        let cd = self.conv_dim() as u64;
        (cd + hv * dv + 2 * hv) * h + cd * self.conv_kernel as u64 + 2 * hv + dv + hv * dv * h
    }

    /// A fresh (zero) cache for a layer of this shape.
    pub fn new_cache(&self, dtype: DType, device: &Device) -> Result<RecurrentCache> {
        RecurrentCache::new(
            self.conv_dim(),
            self.conv_kernel,
            self.v_heads,
            self.k_dim,
            self.v_dim,
            dtype,
            device,
        )
    }
}

#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    /// `[q | k | v | z | b | a]` in one matmul.
    pub in_proj: Linear,
    /// Conv taps `[kernel, conv_dim]` (f32): tap j multiplies the input `kernel - 1 - j` rows
    /// back.
    conv_w: Tensor,
    /// `-exp(A_log)` `[1, v_heads]` (f32).
    a_neg: Tensor,
    /// `[1, v_heads]` (f32).
    dt_bias: Tensor,
    /// Gated RMSNorm weight `[v_dim]`.
    norm: Tensor,
    pub out_proj: Linear,
    /// Per rank when tensor-parallel: `k_heads` / `v_heads` count this rank's share.
    pub spec: GatedDeltaSpec,
    /// A tensor-parallel rank's layer (its share of the key heads and their value heads):
    /// `out_proj`'s output all-reduced over the ranks.
    pub shard: Option<super::parallel::Shard>,
}

/// How a checkpoint stores the depthwise conv1d weight (same bytes, only the shape differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvLayout {
    /// `[conv_dim, 1, kernel]`: PyTorch's `Conv1d` (Hugging Face checkpoints).
    Torch,
    /// `[conv_dim, kernel, 1]`: MLX's `Conv1d` (checkpoints converted by mlx-lm).
    Mlx,
}

impl GatedDeltaNet {
    /// Load `{prefix}.{in_proj_*, conv1d, A_log, dt_bias, norm, out_proj}`, the conv1d
    /// weight in the shape `conv` says.
    pub fn load(w: &Weights, prefix: &str, spec: GatedDeltaSpec, conv: ConvLayout) -> Result<Self> {
        let s = &spec;
        let (h, hk, hv, dk, dv) = (s.hidden, s.k_heads, s.v_heads, s.k_dim, s.v_dim);
        if hk == 0 || hv % hk != 0 {
            return Err(Error::input(format!(
                "{prefix}: linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}"
            )));
        }
        let r = hv / hk;
        let name = |n: &str| format!("{prefix}.{n}.weight");
        // tensor parallel: a rank's share of the key heads, with the value heads they serve
        // (every per-head piece is head-major: rows of q, k, v, z, b, a, conv channels, decay)
        // (fewer key heads than ranks: a rank's value heads and the one key head they read,
        // replicated over the ranks that read it)
        let shard = w.shard().cloned();
        let (k0, hk_l, v0, hv_l) = match &shard {
            Some(sh) if hk < sh.world && sh.world.is_multiple_of(hk) => {
                sh.check_divides(hv, &format!("linear-attention value heads of `{prefix}`"))?;
                let (v0, hv_l) = sh.range(hv);
                (v0 / r, 1, v0, hv_l)
            }
            Some(sh) => {
                sh.check_divides(hk, &format!("linear-attention key heads of `{prefix}`"))?;
                let (k0, hk_l) = sh.range(hk);
                (k0, hk_l, k0 * r, hk_l * r)
            }
            None => (0, hk, 0, hv),
        };
        // [q, k, v, z, b, a] rows (all heads, head-major within each); a tensor-parallel rank
        // of the split layout reads its own rows only (`mine` below then keeps them as they are)
        // (the fused layout groups a key head's rows with its value heads' rows: a rank reads
        // its own groups when it holds whole key heads, not a replicated one's share)
        let read_mine = shard.is_some()
            && (s.layout == InProjLayout::Split || (hk_l * r == hv_l && v0 == k0 * r));
        let rows = match s.layout {
            InProjLayout::Split if read_mine => {
                let (qkv, shape) = (name("in_proj_qkv"), (s.conv_dim(), h));
                let part = |at: usize, len: usize| w.get_part(&qkv, shape, 0, at, len);
                vec![
                    part(k0 * dk, hk_l * dk)?,
                    part(hk * dk + k0 * dk, hk_l * dk)?,
                    part(2 * hk * dk + v0 * dv, hv_l * dv)?,
                    w.get_part(&name("in_proj_z"), (hv * dv, h), 0, v0 * dv, hv_l * dv)?,
                    w.get_part(&name("in_proj_b"), (hv, h), 0, v0, hv_l)?,
                    w.get_part(&name("in_proj_a"), (hv, h), 0, v0, hv_l)?,
                ]
            }
            InProjLayout::Split => {
                let qkv = w.get(&name("in_proj_qkv"), (s.conv_dim(), h))?;
                vec![
                    qkv.narrow(0, 0, hk * dk)?,
                    qkv.narrow(0, hk * dk, hk * dk)?,
                    qkv.narrow(0, 2 * hk * dk, hv * dv)?,
                    w.get(&name("in_proj_z"), (hv * dv, h))?,
                    w.get(&name("in_proj_b"), (hv, h))?,
                    w.get(&name("in_proj_a"), (hv, h))?,
                ]
            }
            InProjLayout::Fused => {
                let per = 2 * dk + 2 * r * dv;
                // the key-head groups read: a rank's own, or all of them
                let (g0, gn) = if read_mine { (k0, hk_l) } else { (0, hk) };
                let groups = |n: &str, rows: usize| -> Result<Tensor> {
                    let shape = (hk * rows, h);
                    Ok(match read_mine {
                        true => w.get_part(&name(n), shape, 0, g0 * rows, gn * rows)?,
                        false => w.get(&name(n), shape)?,
                    }
                    .reshape((gn, rows, h))?)
                };
                let qkvz = groups("in_proj_qkvz", per)?;
                let ba = groups("in_proj_ba", 2 * r)?;
                // rows `off .. off + len` of every key-head group, groups in order
                let part = |t: &Tensor, off: usize, len: usize| -> Result<Tensor> {
                    Ok(t.narrow(1, off, len)?
                        .contiguous()?
                        .reshape((gn * len, h))?)
                };
                vec![
                    part(&qkvz, 0, dk)?,
                    part(&qkvz, dk, dk)?,
                    part(&qkvz, 2 * dk, r * dv)?,
                    part(&qkvz, 2 * dk + r * dv, r * dv)?,
                    part(&ba, 0, r)?,
                    part(&ba, r, r)?,
                ]
            }
        };
        let heads = |t: &Tensor, per: usize, first: usize, n: usize| -> Result<Tensor> {
            Ok(t.narrow(0, first * per, n * per)?)
        };
        let mine = if read_mine {
            rows
        } else {
            vec![
                heads(&rows[0], dk, k0, hk_l)?,
                heads(&rows[1], dk, k0, hk_l)?,
                heads(&rows[2], dv, v0, hv_l)?,
                heads(&rows[3], dv, v0, hv_l)?,
                heads(&rows[4], 1, v0, hv_l)?,
                heads(&rows[5], 1, v0, hv_l)?,
            ]
        };
        let in_proj = Linear::dense(Tensor::cat(&mine, 0)?, None);
        let k = s.conv_kernel;
        let conv_shape = match conv {
            ConvLayout::Torch => (s.conv_dim(), 1, k),
            ConvLayout::Mlx => (s.conv_dim(), k, 1),
        };
        let conv_all = w
            .get_dtype(&name("conv1d"), conv_shape, DType::F32)?
            .reshape((s.conv_dim(), k))?;
        let conv_w = Tensor::cat(
            &[
                heads(&conv_all, dk, k0, hk_l)?,
                heads(&conv_all.narrow(0, hk * dk, hk * dk)?, dk, k0, hk_l)?,
                heads(&conv_all.narrow(0, 2 * hk * dk, hv * dv)?, dv, v0, hv_l)?,
            ],
            0,
        )?
        .t()?
        .contiguous()?;
        let a_neg = heads(
            &w.get_dtype(&format!("{prefix}.A_log"), hv, DType::F32)?,
            1,
            v0,
            hv_l,
        )?
        .exp()?
        .neg()?
        .reshape((1, hv_l))?;
        let dt_bias = heads(
            &w.get_dtype(&format!("{prefix}.dt_bias"), hv, DType::F32)?,
            1,
            v0,
            hv_l,
        )?
        .reshape((1, hv_l))?;
        let out_proj = w.linear_split(
            &format!("{prefix}.out_proj"),
            hv * dv,
            h,
            false,
            crate::source::Split::In,
        )?;
        let mut spec = spec;
        spec.k_heads = hk_l;
        spec.v_heads = hv_l;
        Ok(Self {
            in_proj,
            conv_w,
            a_neg,
            dt_bias,
            norm: w.get(&name("norm"), dv)?,
            out_proj,
            spec,
            shard,
        })
    }

    /// `out_proj`'s output, all-reduced over the ranks when tensor-parallel.
    fn project_out(&self, o: &Tensor) -> Result<Tensor> {
        let y = self.out_proj.forward(o)?;
        match &self.shard {
            Some(sh) => sh.all_reduce(&y),
            None => Ok(y),
        }
    }

    /// Bytes of weights held.
    pub fn weight_bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        let lin = |l: &Linear| l.weight_bytes();
        lin(&self.in_proj)
            + lin(&self.out_proj)
            + t(&self.conv_w)
            + t(&self.a_neg)
            + t(&self.dt_bias)
            + t(&self.norm)
    }

    /// `x [n, hidden]` at the positions after `cache`; advances the cache by n (at the end,
    /// so a failing call leaves it untouched). `masks` are the chunk masks of this forward.
    /// On CUDA (bf16, head dims 128, up to one chunk of rows: decode and verify) the conv, the
    /// row-by-row delta rule and the output norm run as three kernels (`kernels/delta.cu`);
    /// prompts and other devices take the chunked candle path below.
    pub fn forward(
        &self,
        x: &Tensor,
        cache: &mut RecurrentCache,
        masks: &ChunkMasks,
    ) -> Result<Tensor> {
        if let Some(out) = self.forward_device(x, cache)? {
            return Ok(out);
        }
        let s = &self.spec;
        let (n, dt) = (x.dim(0)?, x.dtype());
        let (hk, hv, dk, dv) = (s.k_heads, s.v_heads, s.k_dim, s.v_dim);
        let cd = s.conv_dim();
        let kern = s.conv_kernel;
        // 1. projections
        let proj = self.in_proj.forward(x)?;
        let mixed = proj.narrow(1, 0, cd)?;
        let z = proj.narrow(1, cd, hv * dv)?;
        let b = proj.narrow(1, cd + hv * dv, hv)?;
        let a = proj.narrow(1, cd + hv * dv + hv, hv)?;
        // 2. causal depthwise conv continuing from the cached window (accumulated in f32 and
        //    rounded once, as a conv kernel does), then the activation
        let inputs = Tensor::cat(&[cache.conv(), &mixed.contiguous()?], 0)?; // [k-1+n, cd]
        let inputs32 = inputs.to_dtype(DType::F32)?;
        let mut acc = inputs32
            .narrow(0, 0, n)?
            .broadcast_mul(&self.conv_w.narrow(0, 0, 1)?)?;
        for j in 1..kern {
            acc = (acc
                + inputs32
                    .narrow(0, j, n)?
                    .broadcast_mul(&self.conv_w.narrow(0, j, 1)?)?)?;
        }
        let conv = s.act.apply(&acc.to_dtype(dt)?)?;
        // 3. heads: q, k normalized per key head and shared by r value heads; [heads, n, d] f32
        let r = hv / hk;
        let qk = |off: usize, scale: f64| -> Result<Tensor> {
            let t = conv
                .narrow(1, off, hk * dk)?
                .reshape((n, hk, dk))?
                .to_dtype(DType::F32)?;
            let t = l2norm(&t)?;
            let t = if r > 1 {
                t.unsqueeze(2)?
                    .broadcast_as((n, hk, r, dk))?
                    .reshape((n, hv, dk))?
            } else {
                t
            };
            let t = t.transpose(0, 1)?.contiguous()?;
            Ok(if scale != 1.0 { (t * scale)? } else { t })
        };
        let q = qk(0, (dk as f64).powf(-0.5))?;
        let k = qk(hk * dk, 1.0)?;
        let v = conv
            .narrow(1, 2 * hk * dk, hv * dv)?
            .reshape((n, hv, dv))?
            .to_dtype(DType::F32)?
            .transpose(0, 1)?
            .contiguous()?;
        // 4. write strength and log decay, [v_heads, n] f32
        let beta = candle_nn::ops::sigmoid(&b.contiguous()?)?
            .to_dtype(DType::F32)?
            .t()?
            .contiguous()?;
        let g = softplus(&a.to_dtype(DType::F32)?.broadcast_add(&self.dt_bias)?)?
            .broadcast_mul(&self.a_neg)?
            .t()?
            .contiguous()?;
        // 5. the delta rule in chunks
        let (o, state, last, last_off) = delta_rule(&q, &k, &v, &g, &beta, cache.state(), masks)?;
        // 6. gated RMSNorm per value head, output projection
        let o = o.transpose(0, 1)?.to_dtype(dt)?.contiguous()?; // [n, hv, dv]
        let o = candle_nn::ops::rms_norm(&o, &self.norm, s.eps as f32)?;
        let gate =
            candle_nn::ops::silu(&z.contiguous()?.reshape((n, hv, dv))?.to_dtype(DType::F32)?)?;
        let o = (o.to_dtype(DType::F32)? * gate)?
            .to_dtype(dt)?
            .reshape((n, hv * dv))?;
        let out = self.project_out(&o)?;
        // Commit: new window = last k-1 inputs; undo = the last chunk and its conv inputs.
        // A multi-chunk call copies what it keeps so that the prompt's buffers can go.
        let c_last = last.rows()?;
        let keep =
            |t: Tensor| -> Result<Tensor> { Ok(if n > DELTA_CHUNK { t.copy()? } else { t }) };
        let window = keep(inputs.narrow(0, n, kern - 1)?)?;
        let tail = keep(inputs.narrow(0, last_off, kern - 1 + c_last)?)?;
        cache.commit(n, window, state, last_off, last, tail);
        Ok(out)
    }
}

impl GatedDeltaNet {
    /// Whether a forward whose positions live on the device (a CUDA graph step) can run this
    /// layer: the device kernels take its shapes (key and value head dims 128, SiLU) and are
    /// not switched off. Such a forward takes [`Self::forward_step`].
    pub fn runs_device_steps(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            let s = &self.spec;
            super::fused::allowed_part(crate::switches::Part::Delta)
                && s.k_dim == super::cuda::DELTA_HEAD_DIM
                && s.v_dim == super::cuda::DELTA_HEAD_DIM
                && s.act == Activation::Silu
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// [`Self::forward`] of a CUDA graph step (at most one chunk of rows): the device kernels
    /// on the cache's ring, never the portable path (it cannot be replayed), so where they
    /// do not apply this is an error.
    pub fn forward_step(&self, x: &Tensor, cache: &mut RecurrentCache) -> Result<Tensor> {
        match self.forward_device(x, cache)? {
            Some(out) => Ok(out),
            None => Err(crate::Error::input(format!(
                "Gated DeltaNet ({} value heads): the device kernels declined a CUDA graph step; run with DFLASH_CUDA_GRAPHS=0 and report this",
                self.spec.v_heads
            ))),
        }
    }

    /// [`Self::forward`] through the device kernels, or None where they do not apply.
    #[cfg(feature = "cuda")]
    fn forward_device(&self, x: &Tensor, cache: &mut RecurrentCache) -> Result<Option<Tensor>> {
        use super::cuda::{DeltaLayout, DELTA_HEAD_DIM};
        use super::recurrent_cache::ReplayChunk;
        let s = &self.spec;
        let n = x.dim(0)?;
        let ok = super::fused::allowed_part(crate::switches::Part::Delta)
            && x.device().is_cuda()
            && x.dtype() == DType::BF16
            && !x.track_op()
            && n <= DELTA_CHUNK
            && s.k_dim == DELTA_HEAD_DIM
            && s.v_dim == DELTA_HEAD_DIM
            && s.act == Activation::Silu;
        if !ok {
            return Ok(None);
        }
        let (hv, dv, cd) = (s.v_heads, s.v_dim, s.conv_dim());
        let layout = DeltaLayout {
            k_heads: s.k_heads,
            v_heads: hv,
            v_dim: dv,
            z_off: cd,
            b_off: cd + hv * dv,
            a_off: cd + hv * dv + hv,
        };
        // 1. projections, 2. conv over [window | rows] + SiLU (the window from the cache's
        //    device ring: the same buffers every step, so a CUDA graph replays this)
        let proj = self.in_proj.forward(x)?.contiguous()?;
        let Some(io) = cache.ring_io()? else {
            return Ok(None);
        };
        let Some(conv) = super::cuda::delta_conv(&io.window_in, &proj, &self.conv_w)? else {
            return Ok(None);
        };
        // 3.-5. norms, gates and the rule, row by row from the ring's state; the new state
        //    and conv window go to the ring's other slot
        let into = super::cuda::RuleInto {
            state: &io.state_out,
            window_in: &io.window_in,
            window_out: &io.window_out,
        };
        let Some(Some(o)) = super::cuda::delta_rule_into(
            &conv,
            &proj,
            &self.a_neg,
            &self.dt_bias,
            &io.state_in,
            &layout,
            n,
            true,
            into,
        )?
        else {
            return Ok(None);
        };
        // 6. gated RMSNorm per value head, output projection
        let Some(y) = super::cuda::delta_out(&o, &proj, &self.norm, s.eps as f32, layout.z_off)?
        else {
            return Ok(None);
        };
        let out = self.project_out(&y)?;
        let chunk = ReplayChunk {
            s0: io.state_in.clone(),
            conv,
            proj,
            a_neg: self.a_neg.clone(),
            dt_bias: self.dt_bias.clone(),
            layout,
            window0: io.window_in.clone(),
        };
        cache.commit_ring(n, io.parity, chunk)?;
        Ok(Some(out))
    }

    #[cfg(not(feature = "cuda"))]
    fn forward_device(&self, _: &Tensor, _: &mut RecurrentCache) -> Result<Option<Tensor>> {
        Ok(None)
    }
}

/// `x * rsqrt(sum(x^2) + 1e-6)` over the last dimension (the FLA / transformers l2norm).
fn l2norm(x: &Tensor) -> Result<Tensor> {
    let ss = x.sqr()?.sum_keepdim(D::Minus1)?;
    Ok(x.broadcast_mul(&(ss + 1e-6)?.sqrt()?.recip()?)?)
}

/// `log(1 + exp(x))`, stable for large |x|: `max(x, 0) + log(1 + exp(-|x|))`.
fn softplus(x: &Tensor) -> Result<Tensor> {
    let pos = x.relu()?;
    let tail = ((x.abs()?.neg()?.exp()? + 1.0)?).log()?;
    Ok((pos + tail)?)
}

/// Constant masks for the chunk sizes of one forward, built once and shared by every layer.
pub struct ChunkMasks {
    full: Option<ChunkMask>,
    last: Option<ChunkMask>,
}

/// Masks for one chunk size c.
struct ChunkMask {
    c: usize,
    /// `[c, c]` ones on and above the diagonal: `g @ upper` is the cumulative sum.
    upper: Tensor,
    /// `[c, c]` 0 on and below the diagonal, -inf above (before exp).
    neg_inf_above: Tensor,
    /// `[c, c]` ones strictly below the diagonal.
    strict_lower: Tensor,
    /// For the block inversion: c rounded up to a power of two, and per level the indices of
    /// the diagonal blocks in a `[np * np]` grid.
    padded: usize,
    diag_idx: Vec<Tensor>,
}

impl ChunkMask {
    fn new(c: usize, device: &Device) -> Result<Self> {
        let mut upper = vec![0f32; c * c];
        let mut neg = vec![0f32; c * c];
        let mut lower = vec![0f32; c * c];
        for i in 0..c {
            for j in 0..c {
                if j >= i {
                    upper[i * c + j] = 1.0;
                }
                if j > i {
                    neg[i * c + j] = f32::NEG_INFINITY;
                }
                if j < i {
                    lower[i * c + j] = 1.0;
                }
            }
        }
        let t = |v: Vec<f32>| Tensor::from_vec(v, (c, c), device);
        let padded = c.next_power_of_two();
        let mut diag_idx = vec![];
        let mut b = 1;
        while b < padded {
            let np = padded / (2 * b);
            let idx: Vec<u32> = (0..np).map(|p| (p * np + p) as u32).collect();
            diag_idx.push(Tensor::from_vec(idx, np, device)?);
            b *= 2;
        }
        Ok(Self {
            c,
            upper: t(upper)?,
            neg_inf_above: t(neg)?,
            strict_lower: t(lower)?,
            padded,
            diag_idx,
        })
    }
}

impl ChunkMasks {
    /// Masks for a forward of `n` rows (chunks of [`DELTA_CHUNK`], the last one shorter).
    pub fn new(n: usize, device: &Device) -> Result<Self> {
        let full = if n >= DELTA_CHUNK {
            Some(ChunkMask::new(DELTA_CHUNK, device)?)
        } else {
            None
        };
        let rem = n % DELTA_CHUNK;
        let last = if rem > 1 {
            Some(ChunkMask::new(rem, device)?)
        } else {
            None
        };
        Ok(Self { full, last })
    }

    fn get(&self, c: usize) -> Result<&ChunkMask> {
        [&self.full, &self.last]
            .into_iter()
            .flatten()
            .find(|m| m.c == c)
            .ok_or_else(|| Error::input(format!("gated delta rule: no chunk mask for {c} rows")))
    }
}

/// The delta rule over `n` rows in chunks. `q, k [h, n, dk]`, `v [h, n, dv]`, `g, beta [h, n]`
/// (f32), `s0 [h, dk, dv]`. Returns the outputs `[h, n, dv]`, the final state, the last chunk
/// (for rollback) and its row offset.
fn delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    s0: &Tensor,
    masks: &ChunkMasks,
) -> Result<(Tensor, Tensor, DeltaChunk, usize)> {
    let n = q.dim(1)?;
    let mut s = s0.clone();
    let mut outs = Vec::with_capacity(n.div_ceil(DELTA_CHUNK));
    let mut last = None;
    let mut r = 0;
    while r < n {
        let c = DELTA_CHUNK.min(n - r);
        let part = |t: &Tensor| -> Result<Tensor> {
            Ok(if c == n {
                t.clone()
            } else {
                t.narrow(1, r, c)?.contiguous()?
            })
        };
        let mask = if c > 1 { Some(masks.get(c)?) } else { None };
        let (o, chunk) = delta_chunk(
            &part(q)?,
            &part(k)?,
            &part(v)?,
            &part(g)?,
            &part(beta)?,
            &s,
            mask,
        )?;
        s = chunk.state_after(c)?;
        outs.push(o);
        last = Some((chunk, r));
        r += c;
    }
    let out = if outs.len() == 1 {
        outs.pop().expect("one chunk")
    } else {
        Tensor::cat(&outs, 1)?
    };
    let (chunk, off) = last.ok_or_else(|| Error::input("gated delta rule: no rows"))?;
    Ok((out, s, chunk, off))
}

/// One chunk of c rows from state `s` (module docs). `mask` is None for c == 1.
fn delta_chunk(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    s: &Tensor,
    mask: Option<&ChunkMask>,
) -> Result<(Tensor, DeltaChunk)> {
    let bcol = beta.unsqueeze(2)?;
    let kb = k.broadcast_mul(&bcol)?; // beta k
    let vb = v.broadcast_mul(&bcol)?; // beta v
    let (gcum, out_intra_decay, u, w) = match mask {
        None => {
            // c == 1: G = g, T = I, the intra-chunk decay is exp(0) = 1.
            let eg = g.exp()?.unsqueeze(2)?;
            let w = kb.broadcast_mul(&eg)?;
            (g.clone(), None, vb, w)
        }
        Some(m) => {
            let gcum = g.broadcast_matmul(&m.upper)?; // [h, c] cumulative sums
            let eg = gcum.exp()?.unsqueeze(2)?;
            // exp(G_i - G_j) for j <= i, 0 above the diagonal
            let decay = gcum
                .unsqueeze(2)?
                .broadcast_sub(&gcum.unsqueeze(1)?)?
                .broadcast_add(&m.neg_inf_above)?
                .exp()?;
            let a = kb
                .matmul(&k.t()?)?
                .mul(&decay)?
                .broadcast_mul(&m.strict_lower)?;
            let t = unit_lower_inverse(&a, m)?;
            let u = t.matmul(&vb)?;
            let w = t.matmul(&kb.broadcast_mul(&eg)?)?;
            (gcum, Some((decay, eg)), u, w)
        }
    };
    let delta = (u - w.matmul(s)?)?; // [h, c, dv]
    let out = match out_intra_decay {
        None => {
            let eg = gcum.exp()?.unsqueeze(2)?;
            let qk = (q * k)?.sum_keepdim(2)?; // [h, 1, 1]
            (q.broadcast_mul(&eg)?.matmul(s)? + delta.broadcast_mul(&qk)?)?
        }
        Some((decay, eg)) => {
            let attn = q.matmul(&k.t()?)?.mul(&decay)?;
            (q.broadcast_mul(&eg)?.matmul(s)? + attn.matmul(&delta)?)?
        }
    };
    Ok((
        out,
        DeltaChunk::Wy(WyChunk {
            s0: s.clone(),
            k: k.clone(),
            delta,
            gcum,
        }),
    ))
}

/// `(I + A)^-1` for a strictly lower-triangular `a [h, c, c]`, by block inversion batched per
/// level: with the diagonal blocks of size b inverted, each pair
/// `[[M11, 0], [A21, M22]]` has the inverse `[[M11^-1, 0], [-M22^-1 A21 M11^-1, M22^-1]]`.
fn unit_lower_inverse(a: &Tensor, m: &ChunkMask) -> Result<Tensor> {
    let (h, c, _) = a.dims3()?;
    let cp = m.padded;
    let a = if cp != c {
        a.pad_with_zeros(1, 0, cp - c)?
            .pad_with_zeros(2, 0, cp - c)?
    } else {
        a.clone()
    };
    // inverses of the diagonal blocks of size b: [h, cp / b, b, b]
    let mut inv = Tensor::ones((h, cp, 1, 1), a.dtype(), a.device())?;
    let mut b = 1;
    for idx in &m.diag_idx {
        let np = cp / (2 * b);
        // A21 of each diagonal 2b x 2b block: rows (2p+1)b.., cols 2pb..
        let a21 = a
            .reshape((h, np, 2 * b, np, 2 * b))?
            .narrow(2, b, b)?
            .narrow(4, 0, b)?
            .permute((0, 1, 3, 2, 4))?
            .contiguous()?
            .reshape((h, np * np, b, b))?
            .index_select(idx, 1)?; // [h, np, b, b]
        let pairs = inv.reshape((h, np, 2, b, b))?;
        let i11 = pairs.narrow(2, 0, 1)?.squeeze(2)?.contiguous()?;
        let i22 = pairs.narrow(2, 1, 1)?.squeeze(2)?.contiguous()?;
        let x21 = i22.matmul(&a21)?.matmul(&i11)?.neg()?;
        let top = Tensor::cat(&[&i11, &i11.zeros_like()?], 3)?;
        let bottom = Tensor::cat(&[&x21, &i22], 3)?;
        inv = Tensor::cat(&[&top, &bottom], 2)?; // [h, np, 2b, 2b]
        b *= 2;
    }
    let inv = inv.reshape((h, cp, cp))?;
    Ok(if cp != c {
        inv.narrow(1, 0, c)?.narrow(2, 0, c)?.contiguous()?
    } else {
        inv
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sequential recurrence (transformers' `torch_recurrent_gated_delta_rule`), as the
    /// reference for the chunked form.
    fn sequential(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        s0: &Tensor,
    ) -> (Tensor, Tensor) {
        let n = q.dim(1).unwrap();
        let mut s = s0.clone();
        let mut outs = vec![];
        for t in 0..n {
            let qt = q.narrow(1, t, 1).unwrap(); // [h,1,dk]
            let kt = k.narrow(1, t, 1).unwrap();
            let vt = v.narrow(1, t, 1).unwrap(); // [h,1,dv]
            let gt = g
                .narrow(1, t, 1)
                .unwrap()
                .exp()
                .unwrap()
                .unsqueeze(2)
                .unwrap();
            let bt = beta.narrow(1, t, 1).unwrap().unsqueeze(2).unwrap();
            s = s.broadcast_mul(&gt).unwrap();
            let mem = kt.matmul(&s).unwrap(); // [h,1,dv]
            let d = (vt - mem).unwrap().broadcast_mul(&bt).unwrap();
            s = (s + kt.transpose(1, 2).unwrap().matmul(&d).unwrap()).unwrap();
            outs.push(qt.matmul(&s).unwrap());
        }
        (Tensor::cat(&outs, 1).unwrap(), s)
    }

    fn rand(r: &mut crate::rng::Rng, shape: &[usize], scale: f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (r.normal() * scale) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    use crate::testing::max_abs_diff as maxdiff;

    #[test]
    fn chunked_equals_sequential_and_rollback_equals_prefix() {
        let mut r = crate::rng::Rng::new(3);
        let (h, dk, dv) = (3, 8, 5);
        for n in [1usize, 2, 5, 16, 64, 65, 150] {
            let q = l2norm(&rand(&mut r, &[h, n, dk], 1.0)).unwrap();
            let k = l2norm(&rand(&mut r, &[h, n, dk], 1.0)).unwrap();
            let v = rand(&mut r, &[h, n, dv], 1.0);
            let g = (rand(&mut r, &[h, n], 1.0).abs().unwrap() * -0.3).unwrap();
            let beta = candle_nn::ops::sigmoid(&rand(&mut r, &[h, n], 1.0)).unwrap();
            let s0 = rand(&mut r, &[h, dk, dv], 0.5);
            let masks = ChunkMasks::new(n, &Device::Cpu).unwrap();
            let (o, s, last, off) = delta_rule(&q, &k, &v, &g, &beta, &s0, &masks).unwrap();
            let (o_ref, s_ref) = sequential(&q, &k, &v, &g, &beta, &s0);
            assert!(
                maxdiff(&o, &o_ref) < 1e-4,
                "n {n}: out {}",
                maxdiff(&o, &o_ref)
            );
            assert!(maxdiff(&s, &s_ref) < 1e-4, "n {n}: state");
            // the state after any row of the last chunk equals the sequential prefix state
            for j in 1..=last.rows().unwrap() {
                let p = off + j;
                let (_, sp) = sequential(
                    &q.narrow(1, 0, p).unwrap(),
                    &k.narrow(1, 0, p).unwrap(),
                    &v.narrow(1, 0, p).unwrap(),
                    &g.narrow(1, 0, p).unwrap(),
                    &beta.narrow(1, 0, p).unwrap(),
                    &s0,
                );
                let d = maxdiff(&last.state_after(j).unwrap(), &sp);
                assert!(d < 1e-4, "n {n} prefix {p}: {d}");
            }
        }
    }

    #[test]
    fn block_inverse_of_nearly_parallel_keys() {
        // beta ~ 1, identical keys, no decay: A = strictly lower ones, whose power series
        // has binomial-size terms; the inverse is bidiagonal (1, -1).
        for c in [2usize, 3, 7, 16, 64] {
            let m = ChunkMask::new(c, &Device::Cpu).unwrap();
            let a = m.strict_lower.unsqueeze(0).unwrap();
            let t = unit_lower_inverse(&a, &m).unwrap().squeeze(0).unwrap();
            let v = t.to_vec2::<f32>().unwrap();
            for i in 0..c {
                for j in 0..c {
                    let want = if i == j {
                        1.0
                    } else if i == j + 1 {
                        -1.0
                    } else {
                        0.0
                    };
                    assert_eq!(v[i][j], want, "c {c} ({i},{j})");
                }
            }
        }
    }
}
