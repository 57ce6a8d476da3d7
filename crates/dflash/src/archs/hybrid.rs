//! The hybrid decoder shared by qwen3_5, qwen3_5_moe and qwen3_next: most layers mix tokens
//! with a Gated DeltaNet (`nn::gated_delta`, recurrent state in `LayerCache::Recurrent`), every
//! few layers with gated full attention (`nn::Attention` with an output gate, `LayerCache::Kv`);
//! the layer schedule comes from the config (`layer_types`, else `full_attention_interval`).
//! Layers are `decoder::DecoderLayer`s; what is hybrid is which mixer each layer gets.
//!
//! ```text
//! embed -> N x [ h += mixer(norm(h)) ; h += ffn(norm(h)) ]  (tap k = h after layer k)
//!       -> norm -> lm_head
//! ```
//! Norms are zero-centred RMSNorms (`x * (1 + w)`, folded into w at load; mlx-lm's converted
//! checkpoints store `1 + w`) for the layer, final and q/k norms; the DeltaNet's output norm
//! is a plain gated RMSNorm. The feed-forward is a SwiGLU MLP or a MoE block: softmax top-k
//! routed experts plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`.
//!
//! Family files (`qwen3_5.rs`, `qwen3_5_moe.rs`, `qwen3_next.rs`) choose the input-projection
//! layout of the DeltaNet and the MoE layers; the rest is here. Tensor names are read under
//! `model.language_model.` (the published `...ForConditionalGeneration` checkpoints, vision
//! tower and `mtp.*` ignored), `language_model.model.` (head `language_model.lm_head`: the
//! Qwen3.5 / 3.6 checkpoints mlx-lm converts) or `model.` (text-only `...ForCausalLM`
//! checkpoints, and Qwen3-Next in either layout).
//!
//! mlx-lm's conversion (`sanitize` in mlx_lm/models/qwen3_5.py, qwen3_next.py) also reshapes
//! the conv1d weights `[C, 1, K]` to `[C, K, 1]` and stores the zero-centred norms (layer,
//! final, q/k; not the DeltaNet's) as the plain `1 + w`. As mlx-lm itself does, the conv1d
//! shape tells the two layouts apart ([`CheckpointLayout::detect`]); experts in its
//! `switch_mlp` stacks and its quantized matrices are read by `nn::moe` and `source::mlx`.

use super::decoder::{embedding_params, gqa, lm_head, target_info, DecoderLayer, Ffn, Mixer};
use super::stack::{CacheKind, Head, Plan, Stack};
use super::{Capabilities, TargetModel};
use crate::config::{LayerType, RopeConfig, TargetConfig};
use crate::nn::gated_delta::ConvLayout;
use crate::nn::moe::MoeConfig;
use crate::nn::{
    Activation, Attention, AttentionSpec, GatedDeltaNet, GatedDeltaSpec, GatedMlp, InProjLayout,
    RmsNorm, Rope, Visibility,
};
use crate::source::Weights;
use crate::{Error, Result};

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
    /// The MoE block and which layers have it.
    pub moe: Option<(MoeConfig, Vec<bool>)>,
    /// Renormalize the top-k routing weights.
    pub renormalize: bool,
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
        let f = cfg.text()?;
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
        let k_heads = f.pos_usize_or("linear_num_key_heads", 16)?;
        let v_heads = f.pos_usize_or("linear_num_value_heads", 32)?;
        if v_heads % k_heads != 0 {
            return Err(f.err(
                "linear_num_value_heads",
                format!("{v_heads} is not a multiple of linear_num_key_heads {k_heads}"),
            ));
        }
        let conv_kernel = f.pos_usize_or("linear_conv_kernel_dim", 4)?;
        let delta = GatedDeltaSpec {
            hidden: cfg.hidden_size,
            k_heads,
            v_heads,
            k_dim: f.pos_usize_or("linear_key_head_dim", 128)?,
            v_dim: f.pos_usize_or("linear_value_head_dim", 128)?,
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

/// The attention layers' spec.
fn attention_spec(cfg: &TargetConfig, hc: &HybridConfig) -> AttentionSpec {
    AttentionSpec {
        bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        qk_norm: true,
        qk_norm_add_one: true,
        output_gate: true,
        ..gqa(cfg, hc.head_dim)
    }
}

/// Tied: the text config's flag, or a composite config's top-level one.
fn tied(cfg: &TargetConfig) -> Result<bool> {
    Ok(cfg.tie_word_embeddings || cfg.top()?.opt_bool("tie_word_embeddings")?.unwrap_or(false))
}

/// The caches and parameters of a hybrid config.
pub fn plan(cfg: &TargetConfig, spec: &HybridSpec) -> Result<Plan> {
    let hc = HybridConfig::parse(cfg, spec.layout)?;
    let h = cfg.hidden_size as u64;
    let mut p = embedding_params(cfg, tied(cfg)?);
    let attn = attention_spec(cfg, &hc);
    let mut caches = Vec::with_capacity(cfg.num_hidden_layers);
    for (i, t) in hc.layer_types.iter().enumerate() {
        p.plain += 2 * h;
        match t {
            LayerType::Linear => {
                p.plain += hc.delta.params();
                caches.push(CacheKind::Recurrent(hc.delta.clone()));
            }
            _ => {
                p.plain += attn.params();
                caches.push(CacheKind::Kv {
                    kv_heads: cfg.num_key_value_heads,
                    head_dim: hc.head_dim,
                });
            }
        }
        match &spec.moe {
            Some((m, layers)) if layers[i] => p += m.params(cfg.hidden_size),
            _ => p.plain += GatedMlp::params(cfg.hidden_size, cfg.intermediate_size, false),
        }
    }
    Ok(Plan { caches, params: p })
}

/// Where a checkpoint keeps the decoder and which convention its tensors follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointLayout {
    /// Prefix of the decoder's tensors: `model.language_model.`, `language_model.model.`
    /// or `model.`.
    pub prefix: &'static str,
    /// The head's module: `lm_head` or (mlx-lm's composite) `language_model.lm_head`.
    pub head: &'static str,
    /// The conv1d weights' shape; `ConvLayout::Mlx` also means the layer, final and q/k norms
    /// are stored as the plain `1 + w` (mlx-lm adds the one when, and only when, it
    /// reshapes the conv1d weights).
    pub conv: ConvLayout,
}

impl CheckpointLayout {
    /// The layout of `w`: the prefix from where the embedding is; mlx-lm's conversion from
    /// the conv1d weights, `[C, K, 1]` rather than `[C, 1, K]` (mlx-lm's own test, in its
    /// `sanitize`). A checkpoint whose DeltaNet layers disagree is refused; one without a
    /// telling conv1d (no DeltaNet layer, or a kernel of 1) is read as Hugging Face's.
    pub fn detect(w: &Weights, hc: &HybridConfig) -> Result<Self> {
        let (prefix, head) = if w.contains("model.language_model.embed_tokens.weight") {
            ("model.language_model.", "lm_head")
        } else if w.contains("language_model.model.embed_tokens.weight") {
            ("language_model.model.", "language_model.lm_head")
        } else {
            ("model.", "lm_head")
        };
        let k = hc.delta.conv_kernel;
        let mut seen: Option<(ConvLayout, String, Vec<usize>)> = None;
        for (i, _) in hc
            .layer_types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == LayerType::Linear)
        {
            let name = format!("{prefix}layers.{i}.linear_attn.conv1d.weight");
            let Some(shape) = w.shape(&name) else {
                continue; // GatedDeltaNet::load reports it missing
            };
            let conv = match shape[..] {
                [_, 1, kk] if kk == k && k != 1 => ConvLayout::Torch,
                [_, kk, 1] if kk == k && k != 1 => ConvLayout::Mlx,
                _ => continue, // ... or malformed
            };
            match &seen {
                None => seen = Some((conv, name, shape)),
                Some((first, fname, fshape)) if *first != conv => {
                    return Err(Error::weights(
                        w.file_desc(),
                        format!(
                            "`{fname}` is {fshape:?} ({}) but `{name}` is {shape:?} ({}): the conv1d weights mix the Hugging Face and mlx-lm layouts",
                            describe(*first),
                            describe(conv)
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(Self {
            prefix,
            head,
            conv: seen.map_or(ConvLayout::Torch, |s| s.0),
        })
    }

    /// The layer, final and q/k norms are stored zero-centred (`x * (1 + w)`).
    pub fn norm_add_one(&self) -> bool {
        self.conv == ConvLayout::Torch
    }
}

fn describe(c: ConvLayout) -> &'static str {
    match c {
        ConvLayout::Torch => "[C, 1, K], Hugging Face",
        ConvLayout::Mlx => "[C, K, 1], mlx-lm",
    }
}

pub fn load(cfg: &TargetConfig, w: &Weights, spec: HybridSpec) -> Result<Box<dyn TargetModel>> {
    let hc = HybridConfig::parse(cfg, spec.layout)?;
    let (h, v, eps) = (cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps);
    let act = Activation::parse(&cfg.file, &cfg.hidden_act)?;
    let layout = CheckpointLayout::detect(w, &hc)?;
    let pre = layout.prefix;
    let embed = w.embedding(&format!("{pre}embed_tokens.weight"), v, h)?;
    let norm = |name: &str, dim| RmsNorm::load(w, name, dim, eps, layout.norm_add_one());
    let attn_spec = AttentionSpec {
        qk_norm_add_one: layout.norm_add_one(),
        ..attention_spec(cfg, &hc)
    };
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("{pre}layers.{i}");
        let mixer = match hc.layer_types[i] {
            LayerType::Linear => Mixer::Delta(GatedDeltaNet::load(
                w,
                &format!("{p}.linear_attn"),
                hc.delta.clone(),
                layout.conv,
            )?),
            _ => {
                let mut attn = Attention::load(w, &format!("{p}.self_attn"), attn_spec.clone())?;
                attn.fuse()?;
                Mixer::Attention {
                    attn,
                    rope: 0,
                    vis: Visibility::CAUSAL,
                }
            }
        };
        let ffn = Ffn::load_qwen(
            w,
            &p,
            i,
            h,
            spec.moe.as_ref(),
            spec.renormalize,
            cfg.intermediate_size,
            false,
            act,
            &cfg.file,
        )?;
        layers.push(DecoderLayer {
            input_norm: norm(&format!("{p}.input_layernorm.weight"), h)?,
            mixer,
            post_norm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            sandwich: None,
            ffn,
            slot: i,
            family: spec.family,
        });
    }
    // Tied checkpoints have no head; composite configs may say so only at the top level.
    let head = Head::new(
        norm(&format!("{pre}norm.weight"), h)?,
        lm_head(w, layout.head, &embed, tied(cfg)?, h, v)?,
        None,
        &embed,
    );
    let info = target_info(cfg, w, spec.family);
    let ropes = vec![Rope::new(&hc.rope, hc.head_dim)];
    let mut m = Stack::new(info, embed, ropes, layers, head, plan(cfg, &spec)?.caches);
    m.piece = Some(PREFILL_PIECE);
    Ok(Box::new(m.finish_load()))
}
