//! The hybrid decoder shared by qwen3_5, qwen3_5_moe and qwen3_next: most layers mix tokens
//! with a Gated DeltaNet (`nn::gated_delta`, recurrent state in `LayerCache::Recurrent`), every
//! few layers with gated full attention (`nn::gated_attention`, `LayerCache::Kv`); the layer
//! schedule comes from the config (`layer_types`, else `full_attention_interval`).
//!
//! ```text
//! embed -> N x [ h += mixer(norm(h)) ; h += ffn(norm(h)) ]  (tap k = h after layer k)
//!       -> norm -> lm_head
//! ```
//! Norms are zero-centred RMSNorms (`x * (1 + w)`, folded into w at load) for the layer, final
//! and q/k norms; the DeltaNet's output norm is a plain gated RMSNorm. The feed-forward is a
//! SwiGLU MLP or a MoE block: softmax top-k routed experts plus a shared expert scaled by
//! `sigmoid(shared_expert_gate(x))`.
//!
//! Family files (`qwen3_5.rs`, `qwen3_5_moe.rs`, `qwen3_next.rs`) choose the input-projection
//! layout of the DeltaNet and the MoE layers; the rest is here. Tensor names are read under
//! `model.language_model.` (the published `...ForConditionalGeneration` checkpoints, vision
//! tower and `mtp.*` ignored) or `model.` (text-only `...ForCausalLM` checkpoints).

use super::{
    checked_forward, Capabilities, ForwardOutput, LayerCache, Logits, TapRecorder, TargetCache,
    TargetInfo, TargetModel,
};
use crate::config::{Fields, LayerType, RopeConfig, TargetConfig};
use crate::nn::{
    attention_mask, Activation, AttentionSpec, ChunkMasks, Embedding, GatedAttention,
    GatedDeltaNet, GatedDeltaSpec, GatedMlp, InProjLayout, KvCache, Linear, RecurrentCache,
    RmsNorm, Rope, SparseMoe,
};
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{DType, Tensor};

/// Longest run of rows one pass through the layer stack takes; longer inputs (prompts) go
/// through in pieces (a multiple of the delta rule's chunk).
pub const PREFILL_PIECE: usize = 512;

/// Capabilities of the hybrid families (`archs::FAMILIES`).
pub const fn caps(moe: bool) -> Capabilities {
    Capabilities {
        taps: true,
        kv_truncate: true,
        recurrent_rollback: true,
        sliding_window: false,
        shared_kv: false,
        moe,
        gguf: false,
    }
}

/// What a family file decides.
#[derive(Debug, Clone)]
pub struct HybridSpec {
    pub family: &'static str,
    pub layout: InProjLayout,
    pub moe: Option<MoeSpec>,
}

/// Routed + shared experts, and which layers have them.
#[derive(Debug, Clone)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub intermediate_size: usize,
    pub shared_intermediate_size: usize,
    /// `true` for layers whose feed-forward is the MoE block.
    pub layers: Vec<bool>,
}

/// The fields of the config (or of its `text_config`).
pub fn text_fields(cfg: &TargetConfig) -> Result<Fields<'_>> {
    let f = Fields::new(&cfg.file, &cfg.raw)?;
    Ok(match f.sub("text_config")? {
        Some(t) => t,
        None => f,
    })
}

/// Read the MoE block settings (`num_experts` or `num_local_experts`, `num_experts_per_tok`,
/// `moe_intermediate_size`, `shared_expert_intermediate_size`), with transformers' defaults
/// for the family where the config omits a key. `layers[i]` says which layers have it.
pub fn moe_spec(
    cfg: &TargetConfig,
    defaults: (usize, usize, usize, usize),
    norm_topk_prob: bool,
    layers: Vec<bool>,
) -> Result<MoeSpec> {
    let f = text_fields(cfg)?;
    let (d_experts, d_top_k, d_inter, d_shared) = defaults;
    let num_experts = match f.opt_usize("num_experts")? {
        Some(n) => n,
        None => f.opt_usize("num_local_experts")?.unwrap_or(d_experts),
    };
    let top_k = f.opt_usize("num_experts_per_tok")?.unwrap_or(d_top_k);
    if num_experts == 0 || top_k == 0 || top_k > num_experts {
        return Err(f.err(
            "num_experts_per_tok",
            format!("{top_k} experts per token of {num_experts}: need 1..=num_experts"),
        ));
    }
    let pos = |key: &str, d: usize| -> Result<usize> {
        match f.opt_usize(key)?.unwrap_or(d) {
            0 => Err(f.err(key, "must be > 0")),
            x => Ok(x),
        }
    };
    Ok(MoeSpec {
        num_experts,
        top_k,
        norm_topk_prob,
        intermediate_size: pos("moe_intermediate_size", d_inter)?,
        shared_intermediate_size: pos("shared_expert_intermediate_size", d_shared)?,
        layers,
    })
}

/// Hybrid-specific hyper-parameters, with transformers' defaults for absent keys.
#[derive(Debug, Clone)]
pub struct HybridConfig {
    /// `Full` (gated attention) or `Linear` (Gated DeltaNet) per layer.
    pub layer_types: Vec<LayerType>,
    pub head_dim: usize,
    pub rope: RopeConfig,
    pub delta: GatedDeltaSpec,
}

impl HybridConfig {
    pub fn parse(cfg: &TargetConfig, layout: InProjLayout) -> Result<Self> {
        let f = text_fields(cfg)?;
        let n = cfg.num_hidden_layers;
        let layer_types = if f.has("layer_types") {
            if let Some(i) = cfg
                .layer_types
                .iter()
                .position(|&t| t == LayerType::Sliding)
            {
                return Err(f.err(
                    "layer_types",
                    format!("layer {i} is sliding_attention; hybrid Qwen layers are full_attention or linear_attention"),
                ));
            }
            cfg.layer_types.clone()
        } else {
            let every = f.opt_usize("full_attention_interval")?.unwrap_or(4);
            if every == 0 {
                return Err(f.err("full_attention_interval", "must be > 0"));
            }
            (0..n)
                .map(|i| {
                    if (i + 1) % every == 0 {
                        LayerType::Full
                    } else {
                        LayerType::Linear
                    }
                })
                .collect()
        };
        // transformers' config classes default head_dim to 256 and the rotary fraction to 0.25
        let head_dim = f.opt_usize("head_dim")?.unwrap_or(256);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(f.err("head_dim", format!("{head_dim} must be even and > 0")));
        }
        let mut rope = cfg.rope.clone();
        let explicit = f.has("partial_rotary_factor")
            || f.sub("rope_parameters")?
                .is_some_and(|p| p.has("partial_rotary_factor"));
        if !explicit {
            rope.partial_rotary_factor = 0.25;
        }
        let pos = |key: &str, d: usize| -> Result<usize> {
            match f.opt_usize(key)?.unwrap_or(d) {
                0 => Err(f.err(key, "must be > 0")),
                x => Ok(x),
            }
        };
        let k_heads = pos("linear_num_key_heads", 16)?;
        let v_heads = pos("linear_num_value_heads", 32)?;
        if v_heads % k_heads != 0 {
            return Err(f.err(
                "linear_num_value_heads",
                format!("{v_heads} is not a multiple of linear_num_key_heads {k_heads}"),
            ));
        }
        let conv_kernel = pos("linear_conv_kernel_dim", 4)?;
        let delta = GatedDeltaSpec {
            hidden: cfg.hidden_size,
            k_heads,
            v_heads,
            k_dim: pos("linear_key_head_dim", 128)?,
            v_dim: pos("linear_value_head_dim", 128)?,
            conv_kernel,
            eps: cfg.rms_norm_eps,
            act: Activation::parse(&cfg.file, &cfg.hidden_act)?,
            layout,
        };
        Ok(Self {
            layer_types,
            head_dim,
            rope,
            delta,
        })
    }
}

/// Routed experts plus a gated shared expert.
struct SharedMoe {
    routed: SparseMoe,
    shared: GatedMlp,
    /// `[1, hidden]`: the shared expert's output is scaled by `sigmoid(gate(x))`.
    shared_gate: Linear,
}

impl SharedMoe {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let routed = self.routed.forward(x)?;
        let gate = candle_nn::ops::sigmoid(&self.shared_gate.forward(x)?)?;
        let shared = self.shared.forward(x)?.broadcast_mul(&gate)?;
        Ok((routed + shared)?)
    }
}

enum Mixer {
    Attention(GatedAttention),
    Delta(GatedDeltaNet),
}

enum Ffn {
    Dense(GatedMlp),
    Moe(SharedMoe),
}

impl Ffn {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Moe(m) => m.forward(x),
        }
    }
}

struct Layer {
    input_norm: RmsNorm,
    mixer: Mixer,
    post_norm: RmsNorm,
    ffn: Ffn,
}

pub struct HybridModel {
    info: TargetInfo,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    kv_heads: usize,
    head_dim: usize,
    delta: GatedDeltaSpec,
    has_attention: bool,
    has_delta: bool,
}

impl HybridModel {
    pub fn load(cfg: &TargetConfig, w: &Weights, spec: HybridSpec) -> Result<Self> {
        let hc = HybridConfig::parse(cfg, spec.layout)?;
        let (h, v, eps) = (cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps);
        let act = Activation::parse(&cfg.file, &cfg.hidden_act)?;
        let pre = if w.contains("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        };
        let embed_tokens = w.embedding(&format!("{pre}embed_tokens.weight"), v, h)?;
        let norm = |name: &str, dim| RmsNorm::load(w, name, dim, eps, true);
        let attn_spec = AttentionSpec {
            hidden: h,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: hc.head_dim,
            bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            qk_norm: true,
            qk_norm_add_one: true,
            eps,
            scale: (hc.head_dim as f64).powf(-0.5),
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("{pre}layers.{i}");
            let mixer = match hc.layer_types[i] {
                LayerType::Linear => Mixer::Delta(GatedDeltaNet::load(
                    w,
                    &format!("{p}.linear_attn"),
                    hc.delta.clone(),
                )?),
                _ => Mixer::Attention(GatedAttention::load(
                    w,
                    &format!("{p}.self_attn"),
                    attn_spec.clone(),
                )?),
            };
            let ffn = match &spec.moe {
                Some(m) if m.layers[i] => Ffn::Moe(SharedMoe {
                    routed: SparseMoe::load(
                        w,
                        &format!("{p}.mlp"),
                        h,
                        m.intermediate_size,
                        m.num_experts,
                        m.top_k,
                        m.norm_topk_prob,
                        act,
                    )?,
                    shared: GatedMlp::load(
                        w,
                        &format!("{p}.mlp.shared_expert"),
                        h,
                        m.shared_intermediate_size,
                        false,
                        act,
                    )?,
                    shared_gate: Linear::load(
                        w,
                        &format!("{p}.mlp.shared_expert_gate"),
                        h,
                        1,
                        false,
                    )?,
                }),
                _ => {
                    if cfg.intermediate_size == 0 {
                        return Err(Error::config(
                            &cfg.file,
                            "intermediate_size",
                            format!("missing, and layer {i} has a dense MLP"),
                        ));
                    }
                    Ffn::Dense(GatedMlp::load(
                        w,
                        &format!("{p}.mlp"),
                        h,
                        cfg.intermediate_size,
                        false,
                        act,
                    )?)
                }
            };
            layers.push(Layer {
                input_norm: norm(&format!("{p}.input_layernorm.weight"), h)?,
                mixer,
                post_norm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
                ffn,
            });
        }
        // Tied checkpoints have no head; composite configs may say so only at the top level.
        let top_tied = Fields::new(&cfg.file, &cfg.raw)?
            .opt_bool("tie_word_embeddings")?
            .unwrap_or(false);
        let lm_head = if !w.contains("lm_head.weight") && (cfg.tie_word_embeddings || top_tied) {
            w.tied_head(&embed_tokens)?
        } else {
            Linear::load(w, "lm_head", h, v, false)?
        };
        let has_attention = hc.layer_types.iter().any(|&t| t != LayerType::Linear);
        let has_delta = hc.layer_types.contains(&LayerType::Linear);
        let mut m = Self {
            info: TargetInfo {
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
            },
            embed_tokens,
            layers,
            norm: norm(&format!("{pre}norm.weight"), h)?,
            lm_head,
            rope: Rope::new(&hc.rope, hc.head_dim),
            kv_heads: cfg.num_key_value_heads,
            head_dim: hc.head_dim,
            delta: hc.delta,
            has_attention,
            has_delta,
        };
        m.info.weight_bytes = m.weight_bytes();
        Ok(m)
    }

    fn weight_bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        let lin = |l: &Linear| l.weight_bytes();
        let mlp = |m: &GatedMlp| lin(&m.gate) + lin(&m.up) + lin(&m.down);
        let mut b = self.embed_tokens.bytes() + t(&self.norm.weight) + lin(&self.lm_head);
        for l in &self.layers {
            b += t(&l.input_norm.weight) + t(&l.post_norm.weight);
            b += match &l.mixer {
                Mixer::Attention(a) => {
                    lin(&a.q_proj)
                        + lin(&a.k_proj)
                        + lin(&a.v_proj)
                        + lin(&a.o_proj)
                        + t(&a.q_norm.weight)
                        + t(&a.k_norm.weight)
                }
                Mixer::Delta(d) => d.weight_bytes(),
            };
            b += match &l.ffn {
                Ffn::Dense(m) => mlp(m),
                Ffn::Moe(m) => {
                    lin(&m.routed.router)
                        + m.routed.experts.iter().map(mlp).sum::<usize>()
                        + mlp(&m.shared)
                        + lin(&m.shared_gate)
                }
            };
        }
        b
    }

    /// A long input (a prompt) runs through the whole stack in pieces of [`PREFILL_PIECE`]
    /// rows, so attention masks and scores are `piece x context`, not `T x T`. The forward
    /// stays one step for the cache: a failing piece restores the recurrent layers to the
    /// forward's start (KV layers are cropped by `checked_forward`), and after success the
    /// forward's start stays reachable by `truncate`, as for a one-piece forward.
    fn forward_pieces(
        &self,
        tokens: &[u32],
        start: usize,
        cache: &mut TargetCache,
        taps: &[usize],
        logits: Logits,
    ) -> Result<ForwardOutput> {
        let n = tokens.len();
        if n <= PREFILL_PIECE {
            return self.forward_inner(tokens, start, cache, taps, logits);
        }
        let before: Vec<Option<RecurrentCache>> = cache
            .layers
            .iter()
            .map(|l| match l {
                LayerCache::Recurrent(r) => Some(r.clone()),
                LayerCache::Kv(_) | LayerCache::Latent(_) => None,
            })
            .collect();
        let mut run = || -> Result<ForwardOutput> {
            let (mut rows, mut tapped) = (vec![], vec![]);
            let mut at = 0;
            while at < n {
                let m = PREFILL_PIECE.min(n - at);
                let want = match logits {
                    Logits::All => Logits::All,
                    Logits::Last if at + m == n => Logits::Last,
                    _ => Logits::None,
                };
                let out = self.forward_inner(&tokens[at..at + m], start + at, cache, taps, want)?;
                rows.extend(out.logits);
                tapped.extend(out.taps);
                at += m;
            }
            let cat = |v: Vec<Tensor>| -> Result<Option<Tensor>> {
                Ok(match v.len() {
                    0 => None,
                    _ => Some(Tensor::cat(&v, 0)?),
                })
            };
            Ok(ForwardOutput {
                logits: cat(rows)?,
                taps: cat(tapped)?,
            })
        };
        let out = run();
        for (l, b) in cache.layers.iter_mut().zip(before) {
            if let (LayerCache::Recurrent(r), Some(b)) = (l, b) {
                match &out {
                    Err(_) => *r = b,
                    Ok(_) => r.undo_from(&b),
                }
            }
        }
        out
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
        let (dev, dt) = (&self.info.device, self.info.dtype);
        let ids = Tensor::from_slice(tokens, n, dev)?;
        let mut h = self.embed_tokens.forward(&ids)?;
        let tables = if self.has_attention {
            Some(self.rope.tables(start, n, dev, dt)?)
        } else {
            None
        };
        let mask = if self.has_attention && n > 1 {
            attention_mask(n, start, start + n, true, None, dt, dev)?
        } else {
            None
        };
        let masks = if self.has_delta {
            Some(ChunkMasks::new(n, dev)?)
        } else {
            None
        };
        let mut tapped = TapRecorder::new(taps);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = layer.input_norm.forward(&h)?;
            let a = match (&layer.mixer, &mut cache.layers[i], &tables, &masks) {
                (Mixer::Attention(att), LayerCache::Kv(kv), Some(t), _) => {
                    att.forward(&x, &self.rope, t, kv, mask.as_ref())?
                }
                (Mixer::Delta(d), LayerCache::Recurrent(rc), _, Some(m)) => d.forward(&x, rc, m)?,
                _ => {
                    return Err(Error::input(format!(
                        "{}: layer {i}: the cache was not made by this model",
                        self.info.family
                    )))
                }
            };
            let h1 = (h + a)?;
            h = (&h1 + layer.ffn.forward(&layer.post_norm.forward(&h1)?)?)?;
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

impl TargetModel for HybridModel {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn new_cache(&self, capacity: usize) -> Result<TargetCache> {
        let (dt, dev) = (self.info.dtype, &self.info.device);
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l.mixer {
                    Mixer::Attention(_) => LayerCache::Kv(KvCache::new(
                        self.kv_heads,
                        self.head_dim,
                        capacity,
                        dt,
                        dev,
                    )?),
                    Mixer::Delta(_) => LayerCache::Recurrent(self.delta.new_cache(dt, dev)?),
                })
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
            |c| self.forward_pieces(tokens, start, c, taps, logits),
        )
    }

    fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        self.embed_tokens.forward(tokens)
    }

    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(hidden)?.to_dtype(DType::F32)?)
    }
}
