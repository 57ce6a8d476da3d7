//! The dense decoder shared by the attention-only families (llama, qwen3, and later gemma3):
//! embeddings -> N x (norm, attention, residual, norm, gated MLP, residual) -> norm -> LM head.
//!
//! A family file builds a [`DecoderSpec`] from its config and calls [`DecoderModel::load`];
//! the differences between families are fields of the spec, not copies of this code.

use super::{
    checked_forward, ForwardOutput, Logits, TapRecorder, TargetCache, TargetInfo, TargetModel,
};
use crate::config::{LayerType, TargetConfig};
use crate::nn::fused::Visibility;
use crate::nn::{
    attention_mask, Activation, Attention, AttentionSpec, Embedding, GatedMlp, Linear, RmsNorm,
    Rope, SparseMoe,
};
use crate::source::Weights;
use crate::Result;
use candle_core::{DType, Tensor};

/// Blocks of at most this many rows (verify blocks; prompts are longer) run their attention
/// row by row on the CPU (`Attention::forward_rows`).
const ROW_WISE_MAX: usize = 32;

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
    pub sliding_rope: Option<crate::config::RopeConfig>,
    /// Sparse MoE feed-forward on the layers it names (qwen3_moe).
    pub moe: Option<MoeSpec>,
    /// `attention_bias` puts biases on q/k/v only, not on o_proj (qwen2).
    pub qkv_bias_only: bool,
}

/// Mixture-of-experts settings of a family.
#[derive(Debug, Clone)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub intermediate_size: usize,
    /// `true` for layers whose MLP is the MoE block.
    pub layers: Vec<bool>,
}

/// The feed-forward block of a layer.
enum Ffn {
    Dense(GatedMlp),
    Moe(SparseMoe),
}

impl Ffn {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Moe(m) => m.forward(x),
        }
    }
}

impl DecoderSpec {
    pub fn new(family: &'static str) -> Self {
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
            qkv_bias_only: false,
        }
    }
}

struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    /// Sandwich norms: (pre-feedforward, post-feedforward).
    ff_norms: Option<(RmsNorm, RmsNorm)>,
    mlp: Ffn,
    kind: LayerType,
}

pub struct DecoderModel {
    info: TargetInfo,
    embed_tokens: Embedding,
    embed_scale: Option<f64>,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    /// LM head shares the embedding table.
    tied: bool,
    rope_full: Rope,
    rope_sliding: Rope,
    sliding_window: Option<usize>,
    final_softcap: Option<f64>,
    kv_heads: usize,
    head_dim: usize,
}

impl DecoderModel {
    /// Load HF tensor names (`model.embed_tokens`, `model.layers.{i}.…`, `model.norm`, `lm_head`).
    pub fn load(cfg: &TargetConfig, w: &Weights, spec: DecoderSpec) -> Result<Self> {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let act = Activation::parse(&cfg.file, &cfg.hidden_act)?;
        let embed_tokens = w.embedding("model.embed_tokens.weight", v, h)?;
        let eps = cfg.rms_norm_eps;
        let norm = |name: &str, dim| RmsNorm::load(w, name, dim, eps, spec.norm_add_one);
        let attn_spec = AttentionSpec {
            hidden: h,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            bias: cfg.attention_bias,
            o_bias: cfg.attention_bias && !spec.qkv_bias_only,
            qk_norm: spec.qk_norm,
            qk_norm_add_one: spec.norm_add_one,
            eps,
            scale: spec.attn_scale.unwrap_or((cfg.head_dim as f64).powf(-0.5)),
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let ff_norms = if spec.sandwich_norms {
                Some((
                    norm(&format!("{p}.pre_feedforward_layernorm.weight"), h)?,
                    norm(&format!("{p}.post_feedforward_layernorm.weight"), h)?,
                ))
            } else {
                None
            };
            // One matmul for q/k/v and one for gate/up (dense, or quantized of one type on the CPU).
            let mut attn = Attention::load(w, &format!("{p}.self_attn"), attn_spec.clone())?;
            attn.fuse()?;
            layers.push(Layer {
                input_norm: norm(&format!("{p}.input_layernorm.weight"), h)?,
                attn,
                post_attn_norm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
                ff_norms,
                mlp: match &spec.moe {
                    Some(m) if m.layers[i] => Ffn::Moe(SparseMoe::load(
                        w,
                        &format!("{p}.mlp"),
                        h,
                        m.intermediate_size,
                        m.num_experts,
                        m.top_k,
                        m.norm_topk_prob,
                        act,
                    )?),
                    _ => Ffn::Dense({
                        let mut m = GatedMlp::load(
                            w,
                            &format!("{p}.mlp"),
                            h,
                            cfg.intermediate_size,
                            cfg.mlp_bias,
                            act,
                        )?;
                        m.fuse()?;
                        m
                    }),
                },
                kind: cfg.layer_types[i],
            });
        }
        // Tied checkpoints may still carry a copy of the head; prefer it when present.
        let (lm_head, tied) = match (cfg.tie_word_embeddings, w.contains("lm_head.weight")) {
            (true, false) => (w.tied_head(&embed_tokens)?, true),
            _ => (Linear::load(w, "lm_head", h, v, false)?, false),
        };
        let rope_full = Rope::new(&cfg.rope, cfg.head_dim);
        let rope_sliding = Rope::new(
            spec.sliding_rope.as_ref().unwrap_or(&cfg.rope),
            cfg.head_dim,
        );
        let info = TargetInfo {
            family: spec.family,
            model_type: cfg.model_type.clone(),
            num_layers: cfg.num_hidden_layers,
            hidden_size: h,
            vocab_size: v,
            max_position: cfg.max_position_embeddings,
            dtype: w.dtype,
            device: w.device.clone(),
            weight_bytes: 0,
            quantization: w.quant_report(),
        };
        let mut m = Self {
            info,
            embed_tokens,
            embed_scale: spec.embed_scale,
            norm: norm("model.norm.weight", h)?,
            layers,
            lm_head,
            tied,
            rope_full,
            rope_sliding,
            sliding_window: cfg.sliding_window,
            final_softcap: spec.final_softcap,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        };
        m.info.weight_bytes = m.weight_bytes();
        Ok(m)
    }

    fn weight_bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        let lin = |l: &Linear| l.weight_bytes();
        let mut b = self.embed_tokens.bytes() + t(&self.norm.weight);
        // A quantized table used as the head is shared; a requantized copy is not.
        if !self.tied || matches!(self.embed_tokens, Embedding::Quant { .. }) {
            b += lin(&self.lm_head);
        }
        for l in &self.layers {
            let mut lins = vec![
                &l.attn.q_proj,
                &l.attn.k_proj,
                &l.attn.v_proj,
                &l.attn.o_proj,
            ];
            match &l.mlp {
                Ffn::Dense(m) => lins.extend([&m.gate, &m.up, &m.down]),
                Ffn::Moe(m) => {
                    lins.push(&m.router);
                    for e in &m.experts {
                        lins.extend([&e.gate, &e.up, &e.down]);
                    }
                }
            }
            b += lins.iter().map(|x| lin(x)).sum::<usize>();
        }
        b
    }

    /// Final norm, LM head, softcapping.
    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let l = self.lm_head(&self.norm.forward(h)?)?;
        Ok(match self.final_softcap {
            Some(c) => ((l / c)?.tanh()? * c)?,
            None => l,
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
        let mut h = self.embed(&ids)?;
        if let Some(s) = self.embed_scale {
            // HF multiplies by the scale cast to the compute dtype.
            let s = match dt {
                DType::BF16 => half::bf16::from_f64(s).to_f64(),
                DType::F16 => half::f16::from_f64(s).to_f64(),
                _ => s as f32 as f64,
            };
            h = (h * s)?;
        }
        let t_full = self.rope_full.tables(start, n, dev, dt)?;
        // Sliding-layer tables and mask only when the model has sliding layers (this runs
        // every decode step; the mask scan is O(context)).
        let sliding = self.layers.iter().any(|l| l.kind == LayerType::Sliding);
        let t_slide = if sliding {
            Some(self.rope_sliding.tables(start, n, dev, dt)?)
        } else {
            None
        };
        // Masks are built only for layers the fused attention does not take (it applies
        // causality and the window itself); the sliding scan is O(context) per step.
        let k_len = start + n;
        let mut mask_full: Option<Option<Tensor>> = None;
        let mut mask_slide: Option<Option<Tensor>> = None;
        let mut tapped = TapRecorder::new(taps);
        let mut prof = crate::stats::SectionTimer::start("target", dev);
        let mut x = match self.layers.first() {
            Some(l) => l.input_norm.forward(&h)?,
            None => h.clone(),
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let kv = cache.layers[i].kv_mut()?;
            let (rope, tables, window) = match layer.kind {
                // (linear_attention layers are refused at load: `archs::load_target`)
                LayerType::Full | LayerType::Linear => (&self.rope_full, &t_full, None),
                LayerType::Sliding => (
                    &self.rope_sliding,
                    t_slide
                        .as_ref()
                        .expect("sliding tables exist when a layer is sliding"),
                    self.sliding_window,
                ),
            };
            let vis = Visibility {
                causal: true,
                window,
            };
            let a = match layer.attn.forward_fused(&x, rope, tables, kv, vis)? {
                Some(a) => a,
                // A verify-sized block on the CPU: row by row, bit-equal to decode steps.
                None if dev.is_cpu() && n > 1 && n <= ROW_WISE_MAX => {
                    layer.attn.forward_rows(&x, rope, tables, kv, window)?
                }
                None => {
                    let slot = if window.is_some() {
                        &mut mask_slide
                    } else {
                        &mut mask_full
                    };
                    if slot.is_none() {
                        *slot = Some(if n > 1 || window.is_some() {
                            attention_mask(n, start, k_len, true, window, dt, dev)?
                        } else {
                            None
                        });
                    }
                    let mask = slot.as_ref().and_then(|m| m.as_ref());
                    layer.attn.forward(&x, rope, tables, kv, mask)?
                }
            };
            prof.mark("attention");
            let next = self.layers.get(i + 1);
            match &layer.ff_norms {
                None => {
                    let (h1, xn) = layer.post_attn_norm.add_forward(&h, &a)?;
                    let m = layer.mlp.forward(&xn)?;
                    // The residual add of this layer and the next layer's input norm.
                    match next {
                        Some(nl) => (h, x) = nl.input_norm.add_forward(&h1, &m)?,
                        None => h = (h1 + m)?,
                    }
                }
                Some((pre_ff, post_ff)) => {
                    let h1 = (h + layer.post_attn_norm.forward(&a)?)?;
                    let m = layer.mlp.forward(&pre_ff.forward(&h1)?)?;
                    h = (h1 + post_ff.forward(&m)?)?;
                    if let Some(nl) = next {
                        x = nl.input_norm.forward(&h)?;
                    }
                }
            }
            tapped.record(i, &h);
            prof.mark("mlp");
        }
        let taps_out = tapped.finish()?;
        let logits = logits.rows(&h)?.map(|r| self.logits(&r)).transpose()?;
        prof.mark("head");
        prof.finish();
        Ok(ForwardOutput {
            logits,
            taps: taps_out,
        })
    }
}

impl TargetModel for DecoderModel {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn new_cache(&self, capacity: usize) -> Result<TargetCache> {
        TargetCache::uniform_kv(
            self.layers.len(),
            self.kv_heads,
            self.head_dim,
            capacity,
            self.info.dtype,
            &self.info.device,
        )
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
