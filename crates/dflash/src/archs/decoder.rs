//! The decoder layer every family but gemma4 is made of, and the dense decoder families over
//! it (llama, qwen2, qwen3, qwen3_moe, gemma3):
//!
//! ```text
//! h += mixer(norm(h))   [sandwich: h += post_norm(mixer(norm(h)))]
//! h += ffn(norm(h))     [sandwich: h += post_ff(ffn(pre_ff(h)))]
//! ```
//!
//! The mixer is attention (`nn::Attention`, through the one attention door), multi-head latent
//! attention (`nn::LatentAttention`) or a Gated DeltaNet (`nn::GatedDeltaNet`); the
//! feed-forward a gated MLP or a MoE block (`nn::SparseMoe`). Family files build these from
//! their configs (`hybrid.rs`, `gpt_oss.rs`, `deepseek_v3.rs`); the dense families differ only
//! by a [`DecoderSpec`] (`qwen3.rs` is a few lines).

use super::stack::{kv_slot, CacheKind, Frame, Head, Layer, Params, Plan, Residual, Stack};
use super::{LayerCache, TargetCache, TargetInfo};
use crate::config::{LayerType, RopeConfig, TargetConfig};
use crate::nn::moe::{MoeConfig, MoeDefaults};
use crate::nn::{
    Activation, Attention, AttentionSpec, GatedDeltaNet, GatedMlp, LatentAttention, Linear,
    RmsNorm, Rope, SparseMoe, Visibility,
};
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::Tensor;

/// How a layer mixes tokens.
pub enum Mixer {
    /// Attention with rope `rope` of the model, rows seeing what `vis` allows.
    Attention {
        attn: Attention,
        rope: usize,
        vis: Visibility,
    },
    /// Multi-head latent attention with rope `rope`.
    Latent { attn: LatentAttention, rope: usize },
    /// A Gated DeltaNet (recurrent state).
    Delta(GatedDeltaNet),
}

/// The feed-forward block of a layer.
pub enum Ffn {
    Dense(GatedMlp),
    Moe(SparseMoe),
}

impl Ffn {
    /// Layer `i`'s feed-forward at `{p}.mlp` of a Qwen-style checkpoint: the routed experts
    /// where `moe` marks the layer (`renormalize`: the top-k weights divided by their sum),
    /// else the dense gated MLP of `intermediate` units (gate/up fused). `file` names the
    /// config in the error for a dense layer without `intermediate_size`.
    #[allow(clippy::too_many_arguments)]
    pub fn load_qwen(
        w: &Weights,
        p: &str,
        i: usize,
        hidden: usize,
        moe: Option<&(MoeConfig, Vec<bool>)>,
        renormalize: bool,
        intermediate: usize,
        bias: bool,
        act: Activation,
        file: &str,
    ) -> Result<Self> {
        let mlp = format!("{p}.mlp");
        Ok(match moe {
            Some((m, layers)) if layers[i] => {
                Ffn::Moe(SparseMoe::load_qwen(w, &mlp, hidden, m, renormalize, act)?)
            }
            _ => {
                if intermediate == 0 {
                    return Err(Error::config(
                        file,
                        "intermediate_size",
                        format!("missing, and layer {i} has a dense MLP"),
                    ));
                }
                let mut m = GatedMlp::load(w, &mlp, hidden, intermediate, bias, act)?;
                m.fuse()?;
                Ffn::Dense(m)
            }
        })
    }

    /// Bytes a forward of `rows` rows reads (see `SparseMoe::read_bytes`).
    pub fn read_bytes(&self, rows: usize) -> f64 {
        match self {
            Ffn::Dense(m) => m.weight_bytes() as f64,
            Ffn::Moe(m) => m.read_bytes(rows),
        }
    }
    pub fn forward(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Moe(m) => m.forward(x),
        }
    }
    pub fn weight_bytes(&self) -> usize {
        match self {
            Ffn::Dense(m) => m.weight_bytes(),
            Ffn::Moe(m) => m.weight_bytes(),
        }
    }
}

pub struct DecoderLayer {
    pub input_norm: RmsNorm,
    pub mixer: Mixer,
    /// After the mixer: the norm before the feed-forward, or (sandwich) the norm of the
    /// mixer's output.
    pub post_norm: RmsNorm,
    /// Gemma-style sandwich norms: (pre-feedforward, post-feedforward).
    pub sandwich: Option<(RmsNorm, RmsNorm)>,
    pub ffn: Ffn,
    /// This layer's cache slot.
    pub slot: usize,
    pub family: &'static str,
}

impl DecoderLayer {
    /// The mixer over several sequences' rows (`x` back to back, frame by frame): attention
    /// with its projections over all rows and each sequence over its own cache; the latent and
    /// recurrent mixers one sequence at a time.
    fn mix_batch(
        &self,
        x: &Tensor,
        frames: &[Frame],
        caches: &mut [&mut TargetCache],
    ) -> Result<Tensor> {
        if let Mixer::Attention { attn, rope, vis } = &self.mixer {
            let mut sites = Vec::with_capacity(frames.len());
            for f in frames {
                sites.push(f.site(*rope, *vis)?);
            }
            let mut kvs = Vec::with_capacity(caches.len());
            for c in caches.iter_mut() {
                kvs.push(kv_slot(c, self.slot, self.family)?);
            }
            return attn.forward_segments(x, &sites, &mut kvs);
        }
        let mut parts = Vec::with_capacity(frames.len());
        let mut off = 0;
        for (f, c) in frames.iter().zip(caches.iter_mut()) {
            parts.push(self.mix(&x.narrow(0, off, f.n)?, f, c)?);
            off += f.n;
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The mixer of one sequence.
    fn mix(&self, x: &Tensor, f: &Frame, cache: &mut TargetCache) -> Result<Tensor> {
        Ok(match &self.mixer {
            Mixer::Attention { attn, rope, vis } => {
                let kv = kv_slot(cache, self.slot, self.family)?;
                attn.forward(x, &f.site(*rope, *vis)?, kv)?
            }
            Mixer::Latent { attn, rope } => match cache.layers.get_mut(self.slot) {
                Some(LayerCache::Latent(lc)) => {
                    attn.forward(x, f.rope(*rope), f.tables(*rope)?, &f.masks, lc)?
                }
                _ => return Err(wrong_cache(self.family, self.slot, "latent")),
            },
            Mixer::Delta(d) => match cache.layers.get_mut(self.slot) {
                Some(LayerCache::Recurrent(rc)) if f.step.is_some() => d.forward_step(x, rc)?,
                Some(LayerCache::Recurrent(rc)) => d.forward(x, rc, f.chunk_masks()?)?,
                _ => return Err(wrong_cache(self.family, self.slot, "recurrent")),
            },
        })
    }

    /// After the mixer: the residual add, the feed-forward (over all rows of the pass).
    fn finish_layer(&self, r: &mut Residual, a: Tensor) -> Result<()> {
        match &self.sandwich {
            None => {
                r.add(a)?;
                let x = r.norm(&self.post_norm)?;
                r.add(self.ffn.forward(&x)?)?;
            }
            Some((pre_ff, post_ff)) => {
                r.add(self.post_norm.forward(&a)?)?;
                let x = r.norm(pre_ff)?;
                let m = self.ffn.forward(&x)?;
                r.add(post_ff.forward(&m)?)?;
            }
        }
        Ok(())
    }
}

impl Layer for DecoderLayer {
    fn forward(&self, r: &mut Residual, f: &Frame, cache: &mut TargetCache) -> Result<()> {
        let x = r.norm(&self.input_norm)?;
        let a = self.mix(&x, f, cache)?;
        f.mark("attention");
        self.finish_layer(r, a)?;
        f.mark("mlp");
        Ok(())
    }

    fn forward_batch(
        &self,
        r: &mut Residual,
        frames: &[Frame],
        caches: &mut [&mut TargetCache],
    ) -> Result<()> {
        let x = r.norm(&self.input_norm)?;
        let a = self.mix_batch(&x, frames, caches)?;
        if let Some(f) = frames.first() {
            f.mark("attention");
        }
        self.finish_layer(r, a)?;
        if let Some(f) = frames.first() {
            f.mark("mlp");
        }
        Ok(())
    }

    fn read_bytes(&self, rows: usize) -> f64 {
        (self.weight_bytes() - self.ffn.weight_bytes()) as f64 + self.ffn.read_bytes(rows)
    }

    /// Attention layers that the fused kernels take and Gated DeltaNet layers that the device
    /// kernels take (on the cache's ring) replay, whatever the feed-forward; MLA (its latent
    /// kernels take the position as an argument) does not yet.
    fn graph_safe(&self) -> bool {
        match &self.mixer {
            Mixer::Attention { attn, .. } => attn.runs_device_steps(),
            Mixer::Delta(d) => d.runs_device_steps(),
            Mixer::Latent { .. } => false,
        }
    }

    fn cache_kind(&self) -> Option<(usize, CacheKind)> {
        let kind = match &self.mixer {
            Mixer::Attention { attn, .. } if !attn.spec.shared_kv => CacheKind::Kv {
                kv_heads: attn.spec.kv_heads,
                head_dim: attn.spec.head_dim,
            },
            Mixer::Delta(d) => CacheKind::Recurrent(d.spec.clone()),
            _ => return None,
        };
        Some((self.slot, kind))
    }

    fn weight_bytes(&self) -> usize {
        let mixer = match &self.mixer {
            Mixer::Attention { attn, .. } => attn.weight_bytes(),
            Mixer::Latent { attn, .. } => attn.weight_bytes(),
            Mixer::Delta(d) => d.weight_bytes(),
        };
        let sandwich = self
            .sandwich
            .as_ref()
            .map_or(0, |(a, b)| a.weight_bytes() + b.weight_bytes());
        self.input_norm.weight_bytes()
            + mixer
            + self.post_norm.weight_bytes()
            + sandwich
            + self.ffn.weight_bytes()
    }
}

fn wrong_cache(family: &str, slot: usize, want: &str) -> Error {
    Error::input(format!(
        "{family}: cache slot {slot} is not a {want} cache (the cache was made by another model)"
    ))
}

/// What distinguishes one dense family from another.
#[derive(Debug, Clone)]
pub struct DecoderSpec {
    pub family: &'static str,
    /// Per-head q/k RMSNorm before RoPE.
    pub qk_norm: bool,
    /// Norm weights stored as `w` of `x * (1 + w)` (HF Gemma).
    pub norm_add_one: bool,
    /// Gemma-style sandwich norms (post-attention, pre/post-feedforward).
    pub sandwich_norms: bool,
    /// Embedding output multiplied by this (Gemma: sqrt(hidden)).
    pub embed_scale: Option<f64>,
    /// Final logits softcapping `cap * tanh(x / cap)`.
    pub final_softcap: Option<f64>,
    /// Softmax scale; None = head_dim^-0.5.
    pub attn_scale: Option<f64>,
    /// RoPE for sliding layers when it differs from the global one (Gemma 3 local base).
    pub sliding_rope: Option<RopeConfig>,
    /// Sparse MoE feed-forward on the layers marked true (qwen3_moe).
    pub moe: Option<(MoeConfig, Vec<bool>)>,
    /// Biases on q/k/v (`attention_bias`, or implied by the family).
    pub qkv_bias: bool,
    /// A bias on o_proj too.
    pub o_bias: bool,
    /// The LM head is the embedding table (unless the checkpoint carries a head anyway).
    pub tied: bool,
    pub layer_types: Vec<LayerType>,
}

impl DecoderSpec {
    /// The defaults a config gives: no q/k norm, biases as `attention_bias`, ties as
    /// `tie_word_embeddings`, the config's layer types.
    pub fn new(family: &'static str, cfg: &TargetConfig) -> Self {
        Self {
            family,
            qk_norm: false,
            norm_add_one: false,
            sandwich_norms: false,
            embed_scale: None,
            final_softcap: None,
            attn_scale: None,
            sliding_rope: None,
            moe: None,
            qkv_bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            tied: cfg.tie_word_embeddings,
            layer_types: cfg.layer_types.clone(),
        }
    }

    fn attention(&self, cfg: &TargetConfig) -> AttentionSpec {
        AttentionSpec {
            bias: self.qkv_bias,
            o_bias: self.o_bias,
            qk_norm: self.qk_norm,
            qk_norm_add_one: self.norm_add_one,
            scale: self.attn_scale.unwrap_or((cfg.head_dim as f64).powf(-0.5)),
            ..gqa(cfg, cfg.head_dim)
        }
    }

    /// The sizing of this spec's model (`archs::Family::plan`).
    pub fn plan(&self, cfg: &TargetConfig) -> Result<Plan> {
        let (h, n) = (cfg.hidden_size as u64, cfg.num_hidden_layers);
        let mut p = embedding_params(cfg, self.tied);
        let attn = self.attention(cfg).params();
        for i in 0..n {
            p.plain += attn + h * if self.sandwich_norms { 4 } else { 2 };
            match &self.moe {
                Some((m, layers)) if layers[i] => {
                    let q = m.params(cfg.hidden_size);
                    p.plain += q.plain;
                    p.experts += q.experts;
                    p.affine_experts += q.affine_experts;
                }
                _ => {
                    p.plain +=
                        GatedMlp::params(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
                }
            }
        }
        Ok(Plan {
            caches: vec![
                CacheKind::Kv {
                    kv_heads: cfg.num_key_value_heads,
                    head_dim: cfg.head_dim,
                };
                n
            ],
            params: p,
        })
    }
}

/// Plain GQA attention of `cfg`'s shape with heads of `head_dim` (families set the rest).
pub fn gqa(cfg: &TargetConfig, head_dim: usize) -> AttentionSpec {
    AttentionSpec::new(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        head_dim,
        cfg.rms_norm_eps,
    )
}

/// Embedding, final norm and (untied) LM head parameters.
pub fn embedding_params(cfg: &TargetConfig, tied: bool) -> Params {
    let (h, v) = (cfg.hidden_size as u64, cfg.vocab_size as u64);
    Params {
        plain: v * h + h + if tied { 0 } else { v * h },
        experts: 0,
        affine_experts: 0,
    }
}

/// The LM head: `lm_head` when the checkpoint has one, else the embedding table when tied.
pub fn lm_head(
    w: &Weights,
    name: &str,
    embed: &crate::nn::Embedding,
    tied: bool,
    hidden: usize,
    vocab: usize,
) -> Result<Linear> {
    if tied && !w.contains(&format!("{name}.weight")) {
        w.tied_head(embed)
    } else {
        Linear::load(w, name, hidden, vocab, false)
    }
}

/// The facts every loaded target reports.
pub fn target_info(cfg: &TargetConfig, w: &Weights, family: &'static str) -> TargetInfo {
    TargetInfo {
        family,
        model_type: cfg.model_type.clone(),
        num_layers: cfg.num_hidden_layers,
        hidden_size: cfg.hidden_size,
        vocab_size: cfg.vocab_size,
        max_position: cfg.max_position_embeddings,
        dtype: w.dtype,
        device: w.device.clone(),
        weight_bytes: 0,
        quantization: w.quant_report(),
    }
}

/// Load a dense decoder: HF tensor names (`model.embed_tokens`, `model.layers.{i}.…`,
/// `model.norm`, `lm_head`).
pub fn load(cfg: &TargetConfig, w: &Weights, spec: DecoderSpec) -> Result<Stack<DecoderLayer>> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let act = Activation::parse(&cfg.file, &cfg.hidden_act)?;
    let embed = w.embedding("model.embed_tokens.weight", v, h)?;
    let eps = cfg.rms_norm_eps;
    let norm = |name: &str| RmsNorm::load(w, name, h, eps, spec.norm_add_one);
    let attn_spec = spec.attention(cfg);
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        // One matmul for q/k/v and one for gate/up (dense, or quantized of one type on the CPU).
        let mut attn = Attention::load(w, &format!("{p}.self_attn"), attn_spec.clone())?;
        attn.fuse()?;
        let (rope, vis) = match spec.layer_types[i] {
            LayerType::Sliding => (
                1,
                Visibility::sliding(cfg.sliding_window.ok_or_else(|| {
                    Error::config(&cfg.file, "sliding_window", "missing for sliding layers")
                })?),
            ),
            // (linear_attention layers are refused at load: `archs::family_for`)
            LayerType::Full | LayerType::Linear => (0, Visibility::CAUSAL),
        };
        let renorm = spec.moe.as_ref().is_some_and(|(m, _)| m.norm_topk_prob);
        let ffn = Ffn::load_qwen(
            w,
            &p,
            i,
            h,
            spec.moe.as_ref(),
            renorm,
            cfg.intermediate_size,
            cfg.mlp_bias,
            act,
            &cfg.file,
        )?;
        let sandwich = if spec.sandwich_norms {
            Some((
                norm(&format!("{p}.pre_feedforward_layernorm.weight"))?,
                norm(&format!("{p}.post_feedforward_layernorm.weight"))?,
            ))
        } else {
            None
        };
        layers.push(DecoderLayer {
            input_norm: norm(&format!("{p}.input_layernorm.weight"))?,
            mixer: Mixer::Attention { attn, rope, vis },
            post_norm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
            sandwich,
            ffn,
            slot: i,
            family: spec.family,
        });
    }
    let head = Head::new(
        norm("model.norm.weight")?,
        lm_head(w, "lm_head", &embed, spec.tied, h, v)?,
        spec.final_softcap,
        &embed,
    );
    let ropes = vec![
        Rope::new(&cfg.rope, cfg.head_dim),
        Rope::new(
            spec.sliding_rope.as_ref().unwrap_or(&cfg.rope),
            cfg.head_dim,
        ),
    ];
    let info = target_info(cfg, w, spec.family);
    let mut m = Stack::new(info, embed, ropes, layers, head, spec.plan(cfg)?.caches);
    m.embed_scale = spec.embed_scale.map(|s| super::stack::round_to(s, w.dtype));
    Ok(m.finish_load())
}

/// The MoE settings of a Qwen MoE decoder config (`qwen3_moe`): no defaults, the sparse
/// layers from `decoder_sparse_step` / `mlp_only_layers`.
pub fn qwen_moe(cfg: &TargetConfig) -> Result<(MoeConfig, Vec<bool>)> {
    let f = cfg.text()?;
    let m = MoeConfig::parse(&f, MoeDefaults::default())?;
    Ok((m, MoeConfig::sparse_layers(&f, cfg.num_hidden_layers)?))
}
