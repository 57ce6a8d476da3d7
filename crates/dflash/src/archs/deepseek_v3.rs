//! DeepSeek-V3 text models (`model_type: deepseek_v3`) and Kimi-K2.5 (`kimi_k25`, whose
//! `text_config` is a DeepSeek-V3 config, `model_type` `deepseek_v3` or `kimi_k2`).
//!
//! What differs from the dense decoder (transformers 5.17 `DeepseekV3ForCausalLM`):
//! - **multi-head latent attention**: queries from `q_proj`, or low-rank `q_a_proj` ->
//!   `q_a_layernorm` -> `q_b_proj` (`q_lora_rank`); one shared compressed row per position
//!   `kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]`, the latent
//!   normed by `kv_a_layernorm`, expanded per head by `kv_b_proj` into `k_nope`
//!   (`qk_nope_head_dim`) and `v` (`v_head_dim`); RoPE only on the rope dims, interleaved pairs
//!   when `rope_interleave` (default true); both small norms use eps 1e-6 as in transformers.
//!   Softmax scale `(nope + rope)^-0.5`, times `mscale^2` with
//!   `mscale = 0.1 * mscale_all_dim * ln(factor) + 1` when yarn sets `mscale_all_dim`.
//! - **cache**: the compressed row (normed latent + roped k_rope) per position, in a
//!   [`LayerCache::Latent`]; it truncates like any KV cache.
//! - **absorbed form** (as inference engines do): `kv_b_proj` is split per head into `W_UK`
//!   and `W_UV`; queries are mapped into latent space (`q_nope W_UK`), attention runs as MQA over
//!   the cached rows (keys = the whole row, values = its latent part), and the per-head latent
//!   outputs are mapped back by `W_UV` before `o_proj`. Mathematically equal to transformers'
//!   expand-then-attend form; per cached position it reads `kv_lora_rank + qk_rope_head_dim`
//!   values instead of `heads * (nope + rope + v)`.
//! - **MoE** after `first_k_dense_replace` dense layers: sigmoid router scores (router in
//!   f32), `e_score_correction_bias` added for the CHOICE only, grouped top-k (`n_group`
//!   groups scored by their two best experts, `topk_group` kept), weights = the chosen raw
//!   scores, normalized when `norm_topk_prob`, times `routed_scaling_factor`; plus
//!   `n_shared_experts` always-on shared experts.
//!
//! Tensor names: `model.*` (DeepSeek), `model.language_model.*` (Kimi-K2.5 saved by
//! transformers 5) or `language_model.model.*` (the published Kimi-K2.5 checkpoint); experts
//! per expert (`experts.{e}.gate_proj`) or stacked (`experts.gate_up_proj`).

use super::{
    checked_forward, ForwardOutput, LayerCache, Logits, TapRecorder, TargetCache, TargetInfo,
    TargetModel,
};
use crate::config::{Fields, RopeKind, TargetConfig};
use crate::nn::attention::sdpa;
use crate::nn::routing::{top_k_desc, Routes};
use crate::nn::{
    attention_mask, Activation, Embedding, GatedMlp, LatentCache, Linear, RmsNorm, Rope, SparseMoe,
};
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// transformers builds `q_a_layernorm` / `kv_a_layernorm` with the default eps, not
/// `rms_norm_eps`.
const LORA_NORM_EPS: f64 = 1e-6;

/// The DeepSeek-V3 settings beyond [`TargetConfig`].
#[derive(Debug, Clone)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub rope_interleave: bool,
    pub attention_bias: bool,
    /// Softmax scale, with the yarn `mscale_all_dim` correction.
    pub scale: f64,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f64,
    pub norm_topk_prob: bool,
    pub moe_intermediate_size: usize,
    pub first_k_dense_replace: usize,
}

/// The text config: the top level, or `text_config` (kimi_k25).
fn text_fields(cfg: &TargetConfig) -> Result<Fields<'_>> {
    let f = Fields::new(&cfg.file, &cfg.raw)?;
    Ok(match f.sub("text_config")? {
        Some(t) => t,
        None => f,
    })
}

/// yarn's `get_mscale` as transformers writes it.
fn yarn_mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * factor.ln() + 1.0
    }
}

impl MlaConfig {
    pub fn parse(cfg: &TargetConfig) -> Result<Self> {
        let f = text_fields(cfg)?;
        // Absent keys take transformers' DeepseekV3Config defaults; `q_lora_rank: null` means
        // a plain q_proj.
        let q_lora_rank = match f.obj.get("q_lora_rank") {
            None => Some(1536),
            Some(_) => match f.opt_usize("q_lora_rank")? {
                Some(0) => return Err(f.err("q_lora_rank", "must be > 0 or null")),
                r => r,
            },
        };
        let dim = |key: &str, default: usize| -> Result<usize> {
            match f.opt_usize(key)?.unwrap_or(default) {
                0 => Err(f.err(key, "must be > 0")),
                d => Ok(d),
            }
        };
        let kv_lora_rank = dim("kv_lora_rank", 512)?;
        let qk_nope_head_dim = dim("qk_nope_head_dim", 128)?;
        let qk_rope_head_dim = dim("qk_rope_head_dim", 64)?;
        if qk_rope_head_dim % 2 != 0 {
            return Err(f.err(
                "qk_rope_head_dim",
                format!("{qk_rope_head_dim} must be even for RoPE"),
            ));
        }
        let v_head_dim = dim("v_head_dim", 128)?;
        if let Some(s) = f.opt_str("scoring_func")? {
            if s != "sigmoid" {
                return Err(f.err(
                    "scoring_func",
                    format!("`{s}` is not supported (deepseek_v3 routes with sigmoid scores)"),
                ));
            }
        }
        // Yarn's mscale_all_dim also scales the softmax (transformers' yarn_apply_mscale).
        let mut scale = ((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5);
        if let RopeKind::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } = cfg.rope.kind
        {
            if m != 0.0 {
                let ms = yarn_mscale(factor, m);
                scale *= ms * ms;
            }
        }
        let n_routed_experts = match f.opt_usize("n_routed_experts")? {
            Some(n) => n,
            None => f.opt_usize("num_local_experts")?.unwrap_or(256),
        };
        let top_k = f.opt_usize("num_experts_per_tok")?.unwrap_or(8);
        let with_default = |key: &str, default: usize| -> Result<usize> {
            Ok(match f.obj.get(key) {
                None => default,
                Some(_) => f.opt_usize(key)?.unwrap_or(1).max(1),
            })
        };
        let n_group = with_default("n_group", 8)?;
        let topk_group = with_default("topk_group", 4)?;
        let first_k_dense_replace = f.opt_usize("first_k_dense_replace")?.unwrap_or(3);
        if first_k_dense_replace < cfg.num_hidden_layers {
            if n_routed_experts == 0 || top_k == 0 || top_k > n_routed_experts {
                return Err(f.err(
                    "num_experts_per_tok",
                    format!("{top_k} must be in 1..={n_routed_experts} (n_routed_experts)"),
                ));
            }
            if n_routed_experts % n_group != 0 {
                return Err(f.err(
                    "n_group",
                    format!("{n_group} does not divide n_routed_experts {n_routed_experts}"),
                ));
            }
            if topk_group > n_group || top_k > topk_group * (n_routed_experts / n_group) {
                return Err(f.err(
                    "topk_group",
                    format!(
                        "{topk_group} groups of {} experts cannot hold {top_k} experts (n_group {n_group})",
                        n_routed_experts / n_group
                    ),
                ));
            }
        }
        Ok(Self {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            rope_interleave: f.opt_bool("rope_interleave")?.unwrap_or(true),
            attention_bias: cfg.attention_bias,
            scale,
            n_routed_experts,
            n_shared_experts: f.opt_usize("n_shared_experts")?.unwrap_or(1),
            top_k,
            n_group,
            topk_group,
            routed_scaling_factor: f.opt_f64("routed_scaling_factor")?.unwrap_or(2.5),
            norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(true),
            moe_intermediate_size: f.opt_usize("moe_intermediate_size")?.unwrap_or(2048),
            first_k_dense_replace,
        })
    }
}

/// Float checkpoints only: the published Kimi-K2.5 (int4 routed experts, compressed-tensors)
/// and DeepSeek-V3 (fp8 blocks) checkpoints are refused with what they would need.
fn refuse_quantized(cfg: &TargetConfig) -> Result<()> {
    let top = Fields::new(&cfg.file, &cfg.raw)?;
    let q = match top.sub("quantization_config")? {
        Some(q) => Some(q),
        None => match top.sub("text_config")? {
            Some(t) => t.sub("quantization_config")?,
            None => None,
        },
    };
    let Some(q) = q else { return Ok(()) };
    let method = q.opt_str("quant_method")?.unwrap_or("unknown");
    let need = super::footprint::estimate(cfg)
        .ok()
        .flatten()
        .map(|f| {
            format!(
                "; dequantized, its weights would take {} at bf16",
                super::footprint::human_bytes(f.loaded_bytes_bf16)
            )
        })
        .unwrap_or_default();
    Err(q.err(
        "quant_method",
        format!(
            "`{method}` checkpoints are not supported for deepseek_v3 / kimi_k25 (this build loads bf16/f16/f32 weights){need}"
        ),
    ))
}

/// Where the text model's tensors live: `(prefix of embed/layers/norm, name of the LM head)`.
fn tensor_prefix(w: &Weights) -> Result<(&'static str, &'static str)> {
    for (p, head) in [
        ("model", "lm_head.weight"),
        ("model.language_model", "lm_head.weight"),
        ("language_model.model", "language_model.lm_head.weight"),
    ] {
        if w.contains(&format!("{p}.embed_tokens.weight")) {
            return Ok((p, head));
        }
    }
    Err(Error::weights(
        "checkpoint",
        "no `model.embed_tokens.weight`, `model.language_model.embed_tokens.weight` or \
         `language_model.model.embed_tokens.weight`: not a DeepSeek-V3 / Kimi-K2.5 checkpoint",
    ))
}

/// Reorder the rows of a dense linear layer.
fn permute_rows(l: Linear, idx: &Tensor) -> Result<Linear> {
    match l {
        Linear::Dense { weight, bias } => Ok(Linear::Dense {
            weight: weight.index_select(idx, 0)?,
            bias: bias.map(|b| b.index_select(idx, 0)).transpose()?,
        }),
        Linear::Quant { .. } | Linear::Q8 { .. } => Err(Error::input(
            "deepseek_v3: quantized projections cannot be re-laid out for interleaved RoPE",
        )),
    }
}

/// Row order turning `blocks` blocks of `width` rows, whose last `rope` rows are interleaved
/// RoPE pairs `(x0, x1), (x2, x3), ..`, into rotate-half order (evens, then odds). transformers'
/// interleaved RoPE returns exactly the rotate-half RoPE of that reordering, so the loader
/// permutes the producing weights once and the shared rotate-half [`Rope`] does the rest.
fn rope_deinterleave_index(
    blocks: usize,
    width: usize,
    rope: usize,
    dev: &Device,
) -> Result<Tensor> {
    let pass = width - rope;
    let mut idx = Vec::with_capacity(blocks * width);
    for b in 0..blocks {
        let base = (b * width) as u32;
        idx.extend((0..pass as u32).map(|j| base + j));
        idx.extend((0..rope as u32).step_by(2).map(|j| base + pass as u32 + j));
        idx.extend((1..rope as u32).step_by(2).map(|j| base + pass as u32 + j));
    }
    Ok(Tensor::from_vec(idx, blocks * width, dev)?)
}

enum QProj {
    Plain(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

struct Mla {
    q: QProj,
    kv_a: Linear,
    kv_a_norm: RmsNorm,
    /// `[heads, nope, kv_lora]`: maps a query's nope part into latent space.
    w_uk: Tensor,
    /// `[heads, kv_lora, v]`: maps a head's latent output to its value space.
    w_uv_t: Tensor,
    o_proj: Linear,
    /// Kept for the weight count only (absorbed into `w_uk` / `w_uv_t`).
    kv_b_bytes: usize,
}

struct Moe {
    /// `[experts, hidden]` f32 (transformers routes in float32).
    router: Tensor,
    /// `[experts]` f32, added to the scores for the choice only.
    correction_bias: Vec<f32>,
    experts: Vec<GatedMlp>,
    shared: Option<GatedMlp>,
}

enum Ffn {
    Dense(GatedMlp),
    Moe(Moe),
}

struct Layer {
    input_norm: RmsNorm,
    attn: Mla,
    post_attn_norm: RmsNorm,
    ffn: Ffn,
}

pub struct DeepseekV3Model {
    info: TargetInfo,
    c: MlaConfig,
    heads: usize,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

fn linear_bytes(l: &Linear) -> usize {
    l.weight_bytes()
}

fn mlp_bytes(m: &GatedMlp) -> usize {
    linear_bytes(&m.gate)
        + linear_bytes(&m.up)
        + linear_bytes(&m.down)
        + m.gate_up.as_ref().map_or(0, linear_bytes)
}

impl DeepseekV3Model {
    pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Self> {
        if w.is_gguf() {
            return Err(Error::input(
                "deepseek_v3 / kimi_k25 from GGUF is not supported: use the safetensors checkpoint",
            ));
        }
        let c = MlaConfig::parse(cfg)?;
        refuse_quantized(cfg)?;
        let (h, v, heads) = (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads);
        let (nope, rope_d, vd, kvr) = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let qk = nope + rope_d;
        let act = Activation::parse(&cfg.file, &cfg.hidden_act)?;
        let (base, head_name) = tensor_prefix(w)?;
        let dev = &w.device;
        let eps = cfg.rms_norm_eps;
        let q_perm = rope_deinterleave_index(heads, qk, rope_d, dev)?;
        let kv_perm = rope_deinterleave_index(1, kvr + rope_d, rope_d, dev)?;
        let embed_tokens = w.embedding(&format!("{base}.embed_tokens.weight"), v, h)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("{base}.layers.{i}");
            let a = format!("{p}.self_attn");
            let lin = |n: &str, i, o, b| Linear::load(w, &format!("{a}.{n}"), i, o, b);
            let interleave = |l: Linear, idx: &Tensor| {
                if c.rope_interleave {
                    permute_rows(l, idx)
                } else {
                    Ok(l)
                }
            };
            let q = match c.q_lora_rank {
                None => QProj::Plain(interleave(lin("q_proj", h, heads * qk, false)?, &q_perm)?),
                Some(r) => QProj::LowRank {
                    a: lin("q_a_proj", h, r, c.attention_bias)?,
                    norm: RmsNorm::load(
                        w,
                        &format!("{a}.q_a_layernorm.weight"),
                        r,
                        LORA_NORM_EPS,
                        false,
                    )?,
                    b: interleave(lin("q_b_proj", r, heads * qk, false)?, &q_perm)?,
                },
            };
            let kv_a = interleave(
                lin("kv_a_proj_with_mqa", h, kvr + rope_d, c.attention_bias)?,
                &kv_perm,
            )?;
            let kv_b = w
                .get(&format!("{a}.kv_b_proj.weight"), (heads * (nope + vd), kvr))?
                .reshape((heads, nope + vd, kvr))?;
            let attn = Mla {
                q,
                kv_a,
                kv_a_norm: RmsNorm::load(
                    w,
                    &format!("{a}.kv_a_layernorm.weight"),
                    kvr,
                    LORA_NORM_EPS,
                    false,
                )?,
                w_uk: kv_b.narrow(1, 0, nope)?.contiguous()?,
                w_uv_t: kv_b.narrow(1, nope, vd)?.transpose(1, 2)?.contiguous()?,
                o_proj: lin("o_proj", heads * vd, h, c.attention_bias)?,
                kv_b_bytes: tensor_bytes(&kv_b),
            };
            let ffn = if i < c.first_k_dense_replace {
                let mut m =
                    GatedMlp::load(w, &format!("{p}.mlp"), h, cfg.intermediate_size, false, act)?;
                m.fuse()?;
                Ffn::Dense(m)
            } else {
                let e = c.n_routed_experts;
                let mi = c.moe_intermediate_size;
                if mi == 0 {
                    return Err(Error::config(
                        &cfg.file,
                        "moe_intermediate_size",
                        "missing (required for MoE layers)",
                    ));
                }
                // Experts in either checkpoint layout (the router copy it loads is unused).
                let sparse =
                    SparseMoe::load(w, &format!("{p}.mlp"), h, mi, e, c.top_k, false, act)?;
                let router = w.get_dtype(&format!("{p}.mlp.gate.weight"), (e, h), DType::F32)?;
                let correction_bias = w
                    .get_dtype(
                        &format!("{p}.mlp.gate.e_score_correction_bias"),
                        e,
                        DType::F32,
                    )?
                    .to_vec1::<f32>()?;
                let shared = if c.n_shared_experts > 0 {
                    let mut m = GatedMlp::load(
                        w,
                        &format!("{p}.mlp.shared_experts"),
                        h,
                        mi * c.n_shared_experts,
                        false,
                        act,
                    )?;
                    m.fuse()?;
                    Some(m)
                } else {
                    None
                };
                Ffn::Moe(Moe {
                    router,
                    correction_bias,
                    experts: sparse.experts,
                    shared,
                })
            };
            layers.push(Layer {
                input_norm: RmsNorm::load(
                    w,
                    &format!("{p}.input_layernorm.weight"),
                    h,
                    eps,
                    false,
                )?,
                attn,
                post_attn_norm: RmsNorm::load(
                    w,
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                    eps,
                    false,
                )?,
                ffn,
            });
        }
        let lm_head = match (cfg.tie_word_embeddings, w.contains(head_name)) {
            (true, false) => w.tied_head(&embed_tokens)?,
            _ => Linear::load(w, head_name.trim_end_matches(".weight"), h, v, false)?,
        };
        let info = TargetInfo {
            family: "deepseek_v3",
            model_type: cfg.model_type.clone(),
            num_layers: cfg.num_hidden_layers,
            hidden_size: h,
            vocab_size: v,
            max_position: cfg.max_position_embeddings,
            dtype: w.dtype,
            device: w.device.clone(),
            weight_bytes: 0,
            quantization: None,
        };
        let mut m = Self {
            info,
            heads,
            embed_tokens,
            norm: RmsNorm::load(w, &format!("{base}.norm.weight"), h, eps, false)?,
            layers,
            lm_head,
            rope: Rope::new(&cfg.rope, rope_d),
            c,
        };
        m.info.weight_bytes = m.weight_bytes();
        Ok(m)
    }

    fn weight_bytes(&self) -> usize {
        let mut b = self.embed_tokens.bytes() + tensor_bytes(&self.norm.weight);
        b += linear_bytes(&self.lm_head);
        for l in &self.layers {
            b += tensor_bytes(&l.input_norm.weight) + tensor_bytes(&l.post_attn_norm.weight);
            let a = &l.attn;
            b += match &a.q {
                QProj::Plain(q) => linear_bytes(q),
                QProj::LowRank { a, norm, b } => {
                    linear_bytes(a) + tensor_bytes(&norm.weight) + linear_bytes(b)
                }
            };
            b += linear_bytes(&a.kv_a) + tensor_bytes(&a.kv_a_norm.weight);
            b += a.kv_b_bytes + linear_bytes(&a.o_proj);
            b += match &l.ffn {
                Ffn::Dense(m) => mlp_bytes(m),
                Ffn::Moe(m) => {
                    tensor_bytes(&m.router)
                        + m.experts.iter().map(mlp_bytes).sum::<usize>()
                        + m.shared.as_ref().map_or(0, mlp_bytes)
                }
            };
        }
        b
    }

    /// Multi-head latent attention of `x [n, hidden]` at the positions of `t`, appending the
    /// compressed rows to `cache`.
    fn attention(
        &self,
        a: &Mla,
        x: &Tensor,
        t: &crate::nn::RopeTables,
        cache: &mut LatentCache,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let c = &self.c;
        let n = x.dim(0)?;
        let (nope, rd, kvr, vd) = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.kv_lora_rank,
            c.v_head_dim,
        );
        // 1. queries [heads, n, nope + rope]
        let q = match &a.q {
            QProj::Plain(q) => q.forward(x)?,
            QProj::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x)?)?)?,
        };
        let q = q.reshape((n, self.heads, nope + rd))?.transpose(0, 1)?;
        let q_nope = q.narrow(2, 0, nope)?.contiguous()?;
        let q_rope = self.rope.apply(&q.narrow(2, nope, rd)?.contiguous()?, t)?;
        // 2. the compressed row: normed latent | roped shared key part
        let kv = a.kv_a.forward(x)?;
        let latent = a.kv_a_norm.forward(&kv.narrow(1, 0, kvr)?)?;
        let k_rope = self
            .rope
            .apply(&kv.narrow(1, kvr, rd)?.contiguous()?.unsqueeze(0)?, t)?;
        let row = Tensor::cat(&[&latent.unsqueeze(0)?, &k_rope], 2)?;
        let rows = cache.append(&row)?; // [1, L, kvr + rd]
                                        // 3. absorbed queries: q_nope W_UK per head, then the rope part: [heads, n, kvr + rd]
        let q_lat = q_nope.matmul(&a.w_uk)?;
        let q_full = Tensor::cat(&[&q_lat, &q_rope], 2)?;
        // 4. MQA over the cached rows; values are the latent part
        let o = sdpa(&q_full, &rows, &rows.narrow(2, 0, kvr)?, mask, c.scale)?; // [n, heads*kvr]
                                                                                // 5. per-head latent -> value space, then o_proj
        let o = o
            .reshape((n, self.heads, kvr))?
            .transpose(0, 1)?
            .contiguous()?
            .matmul(&a.w_uv_t)?; // [heads, n, vd]
        let o = o
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n, self.heads * vd))?;
        a.o_proj.forward(&o)
    }

    fn moe(&self, m: &Moe, x: &Tensor) -> Result<Tensor> {
        let c = &self.c;
        let logits = x.to_dtype(DType::F32)?.matmul(&m.router.t()?)?;
        let scores = candle_nn::ops::sigmoid(&logits)?.to_vec2::<f32>()?;
        let e = c.n_routed_experts;
        let per_group = e / c.n_group;
        let mut routes = Routes::new(e);
        for (row, s) in scores.iter().enumerate() {
            let choice: Vec<f32> = s
                .iter()
                .zip(&m.correction_bias)
                .map(|(a, b)| a + b)
                .collect();
            // groups scored by the sum of their two best choice scores
            let group_scores: Vec<f32> = choice
                .chunks(per_group)
                .map(|g| top_k_desc(g, 2).iter().map(|&i| g[i]).sum())
                .collect();
            let groups = top_k_desc(&group_scores, c.topk_group);
            let masked: Vec<f32> = choice
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    if groups.contains(&(i / per_group)) {
                        v
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let top = top_k_desc(&masked, c.top_k);
            let denom = if c.norm_topk_prob {
                top.iter().map(|&i| s[i]).sum::<f32>() + 1e-20
            } else {
                1.0
            };
            for &i in &top {
                routes.push(row, i, s[i] / denom * c.routed_scaling_factor as f32);
            }
        }
        let routed = routes.dispatch(x, |i, xe| m.experts[i].forward(xe))?;
        Ok(match &m.shared {
            Some(s) => (routed + s.forward(x)?)?,
            None => routed,
        })
    }

    fn forward_inner(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        let n = tokens.len();
        let dev = &self.info.device;
        let dt = self.info.dtype;
        let ids = Tensor::from_slice(tokens, n, dev)?;
        let mut h = self.embed_tokens.forward(&ids)?;
        let tables = self.rope.tables(start, n, dev, dt)?;
        let mask = if n > 1 {
            attention_mask(n, start, start + n, true, None, dt, dev)?
        } else {
            None
        };
        let mut tapped = TapRecorder::new(taps);
        for (i, layer) in self.layers.iter().enumerate() {
            let LayerCache::Latent(lc) = &mut cache.layers[i] else {
                return Err(Error::input(
                    "deepseek_v3: cache layer is not a latent cache",
                ));
            };
            let x = layer.input_norm.forward(&h)?;
            let a = self.attention(&layer.attn, &x, &tables, lc, mask.as_ref())?;
            let h1 = (h + a)?;
            let x = layer.post_attn_norm.forward(&h1)?;
            let m = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&x)?,
                Ffn::Moe(moe) => self.moe(moe, &x)?,
            };
            h = (h1 + m)?;
            tapped.record(i, &h);
        }
        let taps_out = tapped.finish()?;
        let logits = logits
            .rows(&h)?
            .map(|r| self.lm_head(&self.norm.forward(&r)?))
            .transpose()?;
        Ok(ForwardOutput {
            logits,
            taps: taps_out,
        })
    }
}

impl TargetModel for DeepseekV3Model {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn new_cache(&self, capacity: usize) -> Result<TargetCache> {
        let width = self.c.kv_lora_rank + self.c.qk_rope_head_dim;
        let layers = (0..self.layers.len())
            .map(|_| {
                Ok(LayerCache::Latent(LatentCache::new(
                    width,
                    capacity,
                    self.info.dtype,
                    &self.info.device,
                )?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(TargetCache::new(layers, capacity))
    }

    fn forward(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        checked_forward(
            tokens,
            start,
            cache,
            taps,
            self.layers.len(),
            self.info.vocab_size,
            |c| self.forward_inner(tokens, start, c, taps, logits),
        )
    }

    fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        self.embed_tokens.forward(tokens)
    }

    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(hidden)?.to_dtype(DType::F32)?)
    }
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(DeepseekV3Model::load(cfg, w)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Kimi-K2.5's published text_config (the fields the model reads).
    fn kimi_k25() -> serde_json::Value {
        json!({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
            "tie_word_embeddings": false,
            "text_config": {"model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
                "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1,
                "num_experts_per_tok": 8, "first_k_dense_replace": 1, "q_lora_rank": 1536,
                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                "norm_topk_prob": true, "routed_scaling_factor": 2.827, "vocab_size": 163840,
                "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 262144,
                "rope_scaling": {"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
                "tie_word_embeddings": false}})
    }

    #[test]
    fn kimi_text_config_and_yarn_mscale() {
        let cfg = TargetConfig::from_value("config.json", kimi_k25()).unwrap();
        assert_eq!(cfg.model_type, "kimi_k2");
        let c = MlaConfig::parse(&cfg).unwrap();
        assert_eq!(
            (c.q_lora_rank, c.kv_lora_rank, c.v_head_dim),
            (Some(1536), 512, 128)
        );
        assert!(c.rope_interleave);
        // softmax scale: 192^-0.5 * (0.1 ln 64 + 1)^2; rope cos/sin factor: mscale/mscale_all_dim = 1
        let ms = 0.1 * 64f64.ln() + 1.0;
        assert!((c.scale - 192f64.powf(-0.5) * ms * ms).abs() < 1e-12);
        let (inv, attn) = cfg.rope.inv_freq(64);
        assert_eq!(inv.len(), 32);
        assert_eq!(attn, 1.0);
        assert_eq!(c.routed_scaling_factor, 2.827);
    }

    #[test]
    fn bad_routing_config_is_named() {
        let mut v = kimi_k25();
        v["text_config"]["n_group"] = json!(5);
        let cfg = TargetConfig::from_value("config.json", v).unwrap();
        let e = MlaConfig::parse(&cfg).unwrap_err().to_string();
        assert!(e.contains("text_config.n_group"), "{e}");
        let mut v = kimi_k25();
        v["text_config"]["scoring_func"] = json!("softmax");
        let cfg = TargetConfig::from_value("config.json", v).unwrap();
        let e = MlaConfig::parse(&cfg).unwrap_err().to_string();
        assert!(e.contains("scoring_func"), "{e}");
    }

    #[test]
    fn published_int4_checkpoint_is_refused_with_its_size() {
        let mut v = kimi_k25();
        v["text_config"]["quantization_config"] = json!({"quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32}}}});
        let cfg = TargetConfig::from_value("config.json", v).unwrap();
        let e = refuse_quantized(&cfg).unwrap_err().to_string();
        assert!(
            e.contains("text_config.quantization_config.quant_method")
                && e.contains("compressed-tensors")
                && e.contains("TB at bf16"),
            "{e}"
        );
        let cfg = TargetConfig::from_value("config.json", kimi_k25()).unwrap();
        assert!(refuse_quantized(&cfg).is_ok());
    }

    #[test]
    fn deinterleave_index_layout() {
        let idx = rope_deinterleave_index(2, 5, 4, &Device::Cpu).unwrap();
        assert_eq!(
            idx.to_vec1::<u32>().unwrap(),
            vec![0, 1, 3, 2, 4, 5, 6, 8, 7, 9]
        );
    }
}
