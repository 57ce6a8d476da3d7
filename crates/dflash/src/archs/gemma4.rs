//! Gemma 4 text models (`model_type: gemma4_text`, and the text part of the multimodal
//! `gemma4` checkpoints, whose tensors live under `model.language_model.`).
//!
//! What differs from the dense decoder (transformers 5.17 `Gemma4TextModel`):
//! - norms are plain `x * w` RMSNorms (not Gemma 2/3's `1 + w`); sandwich norms around
//!   attention and MLP; per-head q/k norms and a scale-less v norm; attention scale 1.0;
//! - per-layer attention shapes: full-attention layers may use another head_dim and KV head
//!   count (`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads`), and with
//!   `attention_k_eq_v` they have no `v_proj` (values are the raw keys, before k_norm);
//! - sliding layers use a `default` rope, full layers a `proportional` one;
//! - KV sharing: the last `num_kv_shared_layers` layers have no K/V projections and attend
//!   over the cache of the last non-shared layer of the same type;
//! - per-layer inputs (PLE): a packed per-layer token embedding combined with a projection
//!   of the scaled input embedding, fed through a gate after each layer's MLP;
//! - an optional MoE block next to the dense MLP (router with its own norm and scales, experts
//!   stored as `[E, 2I, H]` / `[E, H, I]`), `layer_scalar` per layer, final logit softcapping.
//!
//! The attention (value norm, keys as values, shared KV) is `nn::Attention` through the one
//! attention door; the MoE block is `nn::SparseMoe`; the per-layer inputs are the stack's
//! prologue. This file holds the layer's wiring and the config.

use super::decoder::{embedding_params, lm_head, target_info};
use super::stack::{
    kv_slot, round_to, CacheKind, Frame, Head, Layer, Plan, Prologue, Residual, Stack,
};
use super::{TargetCache, TargetModel};
use crate::config::{Fields, LayerType, RopeConfig, RopeKind, TargetConfig};
use crate::nn::moe::{Experts, Router, RouterInput, Scoring};
use crate::nn::{
    tensor_bytes, Activation, Attention, AttentionSpec, Embedding, GatedMlp, Linear, RmsNorm, Rope,
    SparseMoe, Visibility,
};
use crate::source::Weights;
use crate::Result;
use candle_core::{DType, Tensor};
use serde_json::{json, Value};

/// Attention shape of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AttnShape {
    head_dim: usize,
    kv_heads: usize,
}

/// Everything gemma4-specific read from the config.
struct Gemma4Config {
    layer_types: Vec<LayerType>,
    shapes: Vec<AttnShape>,
    /// For each layer, the layer whose K/V it attends over (itself unless shared).
    kv_owner: Vec<usize>,
    sliding_window: usize,
    rope_full: RopeConfig,
    rope_sliding: RopeConfig,
    k_eq_v: bool,
    double_wide_mlp: bool,
    first_shared: usize,
    final_softcap: Option<f64>,
    ple_dim: usize,
    ple_vocab: usize,
    moe: Option<(usize, usize, usize)>, // (experts, top_k, intermediate)
    /// LM head = embedding table when the checkpoint has no `lm_head.weight`.
    tied: bool,
}

fn parse_rope(f: &Fields, params: Option<Fields>, ty: &str, max_pos: usize) -> Result<RopeConfig> {
    match params.as_ref().map(|p| p.sub(ty)).transpose()?.flatten() {
        Some(sub) => {
            let v = json!({ "rope_parameters": Value::Object(sub.obj.clone()) });
            let inner = Fields::new(f.file, &v)?;
            let mut r = RopeConfig::parse(&inner, max_pos).map_err(|e| {
                f.err(
                    &format!("rope_parameters.{ty}"),
                    format!("invalid rope parameters: {e}"),
                )
            })?;
            // transformers' gemma4 default rope ignores partial_rotary_factor.
            if r.kind == RopeKind::Default {
                r.partial_rotary_factor = 1.0;
            }
            Ok(r)
        }
        None if params.is_some() => Err(f.err(
            "rope_parameters",
            format!("has no `{ty}` entry, but layer_types has {ty} layers"),
        )),
        // transformers' defaults for gemma4
        None if ty == "sliding_attention" => Ok(RopeConfig {
            theta: 10_000.0,
            kind: RopeKind::Default,
            partial_rotary_factor: 1.0,
        }),
        None => Ok(RopeConfig {
            theta: 1_000_000.0,
            kind: RopeKind::Proportional { factor: 1.0 },
            partial_rotary_factor: 0.25,
        }),
    }
}

impl Gemma4Config {
    fn parse(cfg: &TargetConfig) -> Result<Self> {
        let f = cfg.text()?;
        let n = cfg.num_hidden_layers;
        match f.opt_str("use_bidirectional_attention")? {
            // "vision" only changes the mask between image tokens; text is causal.
            None | Some("vision") => {}
            Some(other) => {
                return Err(f.err(
                    "use_bidirectional_attention",
                    format!("`{other}` is not supported (supported: null, \"vision\" for text-only input): dflash decodes causally"),
                ))
            }
        }
        // layer_types: explicit, or transformers' 5:1 sliding/full pattern; the last layer is
        // always full attention.
        let mut layer_types = match f.opt_str_list("layer_types")? {
            Some(_) => cfg.layer_types.clone(),
            None => (0..n)
                .map(|i| {
                    if (i + 1) % 6 == 0 {
                        LayerType::Full
                    } else {
                        LayerType::Sliding
                    }
                })
                .collect(),
        };
        layer_types[n - 1] = LayerType::Full;
        let sliding_window = f.opt_usize("sliding_window")?.unwrap_or(512);
        if sliding_window == 0 {
            return Err(f.err("sliding_window", "must be > 0"));
        }
        let k_eq_v = f.opt_bool("attention_k_eq_v")?.unwrap_or(false);
        // Per-layer attention shapes.
        let base = AttnShape {
            head_dim: cfg.head_dim,
            kv_heads: cfg.num_key_value_heads,
        };
        let mut shapes = vec![base; n];
        match f.sub("per_layer_config")? {
            Some(plc) => {
                for key in plc.obj.keys() {
                    let i: usize = key
                        .parse()
                        .map_err(|_| plc.err(key, "expected a layer index as key (e.g. \"5\")"))?;
                    if i >= n {
                        return Err(plc.err(
                            key,
                            format!("layer {i} out of range: num_hidden_layers is {n}"),
                        ));
                    }
                    let o = plc
                        .sub(key)?
                        .ok_or_else(|| plc.err(key, "expected an object"))?;
                    for k in o.obj.keys() {
                        if k != "head_dim" && k != "num_key_value_heads" {
                            return Err(o.err(
                                k,
                                "unsupported per-layer override (supported: head_dim, num_key_value_heads)",
                            ));
                        }
                    }
                    if let Some(d) = o.opt_usize("head_dim")? {
                        shapes[i].head_dim = d;
                    }
                    if let Some(h) = o.opt_usize("num_key_value_heads")? {
                        shapes[i].kv_heads = h;
                    }
                }
            }
            None => {
                let global_head_dim = f.opt_usize("global_head_dim")?.unwrap_or(512);
                let global_kv = if k_eq_v {
                    f.opt_usize("num_global_key_value_heads")?
                } else {
                    None
                };
                for (i, t) in layer_types.iter().enumerate() {
                    if *t == LayerType::Full {
                        shapes[i].head_dim = global_head_dim;
                        if let Some(h) = global_kv {
                            shapes[i].kv_heads = h;
                        }
                    }
                }
            }
        }
        for (i, s) in shapes.iter().enumerate() {
            if s.head_dim == 0 || s.head_dim % 2 != 0 {
                return Err(f.err(
                    "per_layer_config",
                    format!("layer {i}: head_dim {} must be even and > 0", s.head_dim),
                ));
            }
            if s.kv_heads == 0 || !cfg.num_attention_heads.is_multiple_of(s.kv_heads) {
                return Err(f.err(
                    "per_layer_config",
                    format!(
                        "layer {i}: num_key_value_heads {} must divide num_attention_heads {}",
                        s.kv_heads, cfg.num_attention_heads
                    ),
                ));
            }
        }
        // One rope table per layer type: every layer of a type must share its head_dim.
        for t in [LayerType::Full, LayerType::Sliding] {
            let dims: Vec<usize> = (0..n)
                .filter(|&i| layer_types[i] == t)
                .map(|i| shapes[i].head_dim)
                .collect();
            if dims.windows(2).any(|w| w[0] != w[1]) {
                return Err(f.err(
                    "per_layer_config",
                    format!("layers of type {t:?} have different head_dim values {dims:?} (one rope per layer type is supported)"),
                ));
            }
        }
        // KV sharing.
        let shared = f.opt_usize("num_kv_shared_layers")?.unwrap_or(0);
        if shared >= n {
            return Err(f.err(
                "num_kv_shared_layers",
                format!("{shared} must be < num_hidden_layers {n}"),
            ));
        }
        let first_shared = n - shared;
        let mut kv_owner: Vec<usize> = (0..n).collect();
        for i in first_shared..n {
            let owner = (0..first_shared)
                .rev()
                .find(|&j| layer_types[j] == layer_types[i])
                .ok_or_else(|| {
                    f.err(
                        "num_kv_shared_layers",
                        format!(
                            "shared layer {i} ({:?}) has no earlier non-shared layer of its type to share K/V with",
                            layer_types[i]
                        ),
                    )
                })?;
            if shapes[owner] != shapes[i] {
                return Err(f.err(
                    "per_layer_config",
                    format!("shared layer {i} and its K/V owner {owner} have different attention shapes"),
                ));
            }
            kv_owner[i] = owner;
        }
        // RoPE per layer type.
        let max_pos = cfg.max_position_embeddings;
        let params = f.sub("rope_parameters")?;
        if let Some(p) = &params {
            if p.has("rope_type") || p.has("rope_theta") {
                return Err(f.err(
                    "rope_parameters",
                    "gemma4 expects one entry per layer type (sliding_attention, full_attention)",
                ));
            }
        }
        let rope_full = parse_rope(&f, f.sub("rope_parameters")?, "full_attention", max_pos)?;
        let rope_sliding = parse_rope(&f, f.sub("rope_parameters")?, "sliding_attention", max_pos)?;
        let final_softcap = f.opt_f64("final_logit_softcapping")?.filter(|c| *c > 0.0);
        let ple_dim = f.opt_usize("hidden_size_per_layer_input")?.unwrap_or(256);
        let ple_vocab = f
            .opt_usize("vocab_size_per_layer_input")?
            .unwrap_or(262_144);
        let moe = if f.opt_bool("enable_moe_block")?.unwrap_or(false) {
            let need = |k: &str| -> Result<usize> {
                f.opt_usize(k)?
                    .filter(|&x| x > 0)
                    .ok_or_else(|| f.err(k, "missing or 0, but enable_moe_block is true"))
            };
            let (e, k, i) = (
                need("num_experts")?,
                need("top_k_experts")?,
                need("moe_intermediate_size")?,
            );
            if k > e {
                return Err(f.err("top_k_experts", format!("{k} > num_experts {e}")));
            }
            Some((e, k, i))
        } else {
            None
        };
        Ok(Self {
            layer_types,
            shapes,
            kv_owner,
            sliding_window,
            rope_full,
            rope_sliding,
            k_eq_v,
            double_wide_mlp: f.opt_bool("use_double_wide_mlp")?.unwrap_or(false),
            first_shared,
            final_softcap,
            ple_dim,
            ple_vocab,
            moe,
            // The multimodal wrapper's own flag wins (it owns the LM head); gemma4 ties by default.
            tied: match cfg.top()?.opt_bool("tie_word_embeddings")? {
                Some(t) => t,
                None => f.opt_bool("tie_word_embeddings")?.unwrap_or(true),
            },
        })
    }
}

/// Caches and parameters of a gemma4 config.
pub fn plan(cfg: &TargetConfig) -> Result<Plan> {
    let g = Gemma4Config::parse(cfg)?;
    let (h, nl) = (cfg.hidden_size as u64, cfg.num_hidden_layers);
    let mut p = embedding_params(cfg, g.tied);
    let mut caches = vec![];
    if g.ple_dim > 0 {
        let d = g.ple_dim as u64;
        p.plain += g.ple_vocab as u64 * nl as u64 * d + h * nl as u64 * d + d;
    }
    for i in 0..nl {
        let shared = g.kv_owner[i] != i;
        if !shared {
            caches.push(CacheKind::Kv {
                kv_heads: g.shapes[i].kv_heads,
                head_dim: g.shapes[i].head_dim,
            });
        }
        p.plain += 4 * h + 1 + g.attention(cfg, i).params();
        p.plain += GatedMlp::params(cfg.hidden_size, g.mlp_width(cfg, i), false);
        if let Some((e, _, mi)) = g.moe {
            let e = e as u64;
            p.plain += e * h + h + e + 3 * h;
            p.experts += e * GatedMlp::params(cfg.hidden_size, mi, false);
        }
        if g.ple_dim > 0 {
            p.plain += 2 * h * g.ple_dim as u64 + h;
        }
    }
    Ok(Plan { caches, params: p })
}

impl Gemma4Config {
    fn attention(&self, cfg: &TargetConfig, i: usize) -> AttentionSpec {
        let s = self.shapes[i];
        AttentionSpec {
            bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            qk_norm: true,
            scale: 1.0,
            v_norm: true,
            k_eq_v: self.k_eq_v && self.layer_types[i] == LayerType::Full,
            shared_kv: self.kv_owner[i] != i,
            ..AttentionSpec::new(
                cfg.hidden_size,
                cfg.num_attention_heads,
                s.kv_heads,
                s.head_dim,
                cfg.rms_norm_eps,
            )
        }
    }

    /// The MLP width of layer i: doubled on KV-shared layers with `use_double_wide_mlp`.
    fn mlp_width(&self, cfg: &TargetConfig, i: usize) -> usize {
        let wide = self.double_wide_mlp && i >= self.first_shared && self.first_shared > 0;
        cfg.intermediate_size * if wide { 2 } else { 1 }
    }
}

/// The MoE block that runs next to the dense MLP.
struct Moe {
    moe: SparseMoe,
    router_input: RouterInput,
    pre_ff_norm_2: RmsNorm,
    post_ff_norm_1: RmsNorm,
    post_ff_norm_2: RmsNorm,
}

/// The per-layer-input branch of one layer.
struct PleLayer {
    gate: Linear,
    proj: Linear,
    post_norm: RmsNorm,
}

/// The model-level per-layer-input tables (the stack's prologue).
struct Ple {
    embed: Tensor,
    embed_scale: f64,
    model_proj: Linear,
    model_proj_scale: f64,
    proj_norm: RmsNorm,
    dim: usize,
    layers: usize,
}

impl Prologue for Ple {
    /// Per-layer inputs `[n, layers, ple_dim]` for the token ids and their scaled embeddings.
    fn inputs(&self, f: &Frame, emb: &Tensor) -> Result<Tensor> {
        let n = f.n;
        let tok = (self.embed.index_select(&f.ids, 0)? * self.embed_scale)?.reshape((
            n,
            self.layers,
            self.dim,
        ))?;
        let proj = (self.model_proj.forward(emb)? * self.model_proj_scale)?.reshape((
            n,
            self.layers,
            self.dim,
        ))?;
        let proj = self.proj_norm.forward(&proj)?;
        Ok(((proj + tok)? * 2f64.powf(-0.5))?)
    }
    fn weight_bytes(&self) -> usize {
        tensor_bytes(&self.embed) + self.model_proj.weight_bytes() + self.proj_norm.weight_bytes()
    }
}

struct Gemma4Layer {
    index: usize,
    input_norm: RmsNorm,
    attn: Attention,
    rope: usize,
    vis: Visibility,
    post_attn_norm: RmsNorm,
    pre_ff_norm: RmsNorm,
    post_ff_norm: RmsNorm,
    mlp: GatedMlp,
    moe: Option<Moe>,
    ple: Option<PleLayer>,
    act: Activation,
    layer_scalar: Tensor,
    /// The cache slot this layer appends to or (KV-shared) reads.
    slot: usize,
}

impl Layer for Gemma4Layer {
    fn forward(&self, r: &mut Residual, f: &Frame, cache: &mut TargetCache) -> Result<()> {
        let x = r.norm(&self.input_norm)?;
        let kv = kv_slot(cache, self.slot, "gemma4")?;
        let a = self.attn.forward(&x, &f.site(self.rope, self.vis)?, kv)?;
        f.mark("attention");
        r.add(self.post_attn_norm.forward(&a)?)?;
        let x = r.norm(&self.pre_ff_norm)?;
        let mut m = self.mlp.forward(&x)?;
        if let Some(moe) = &self.moe {
            let h1 = r.settle()?;
            let e = moe.moe.forward_routed(
                &moe.router_input.forward(h1)?,
                &moe.pre_ff_norm_2.forward(h1)?,
            )?;
            m = (moe.post_ff_norm_1.forward(&m)? + moe.post_ff_norm_2.forward(&e)?)?;
        }
        r.add(self.post_ff_norm.forward(&m)?)?;
        if let (Some(pl), Some(inputs)) = (&self.ple, &f.extra) {
            let h2 = r.settle()?;
            let pin = inputs.narrow(1, self.index, 1)?.squeeze(1)?;
            let gz = self.act.apply(&pl.gate.forward(h2)?)?;
            let y = pl.proj.forward(&(gz * pin)?)?;
            r.add(pl.post_norm.forward(&y)?)?;
        }
        r.scale(&self.layer_scalar)?;
        f.mark("mlp");
        Ok(())
    }

    fn read_bytes(&self, rows: usize) -> f64 {
        let moe = self.moe.as_ref().map_or(0.0, |m| {
            m.moe.weight_bytes() as f64 - m.moe.read_bytes(rows)
        });
        self.weight_bytes() as f64 - moe
    }

    fn cache_kind(&self) -> Option<(usize, CacheKind)> {
        (!self.attn.spec.shared_kv).then(|| {
            let s = &self.attn.spec;
            let kind = CacheKind::Kv {
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
            };
            (self.slot, kind)
        })
    }

    fn weight_bytes(&self) -> usize {
        let norms = [
            &self.input_norm,
            &self.post_attn_norm,
            &self.pre_ff_norm,
            &self.post_ff_norm,
        ]
        .iter()
        .map(|n| n.weight_bytes())
        .sum::<usize>();
        let moe = self.moe.as_ref().map_or(0, |m| {
            m.moe.weight_bytes()
                + m.router_input.norm.weight_bytes()
                + tensor_bytes(&m.router_input.scale)
                + m.pre_ff_norm_2.weight_bytes()
                + m.post_ff_norm_1.weight_bytes()
                + m.post_ff_norm_2.weight_bytes()
        });
        let ple = self.ple.as_ref().map_or(0, |p| {
            p.gate.weight_bytes() + p.proj.weight_bytes() + p.post_norm.weight_bytes()
        });
        norms
            + self.attn.weight_bytes()
            + self.mlp.weight_bytes()
            + moe
            + ple
            + tensor_bytes(&self.layer_scalar)
    }
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    let g = Gemma4Config::parse(cfg)?;
    let (h, v, nl) = (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers);
    let (dt, dev) = (w.dtype, w.device.clone());
    let eps = cfg.rms_norm_eps;
    let act = Activation::parse(&cfg.file, &cfg.hidden_act)?;
    let pre = if w.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    };
    let embed = Embedding::Dense(w.get(&format!("{pre}embed_tokens.weight"), (v, h))?);
    let norm = |name: &str, dim: usize| RmsNorm::load(w, name, dim, eps, false);
    let lin = |name: &str, i: usize, o: usize, b: bool| Linear::load(w, name, i, o, b);
    // transformers keeps these scales as float32 tensors cast to the weight dtype.
    let ple = if g.ple_dim > 0 {
        let p = g.ple_dim;
        Some(Ple {
            embed: w.get(
                &format!("{pre}embed_tokens_per_layer.weight"),
                (g.ple_vocab, nl * p),
            )?,
            embed_scale: round_to((p as f64).sqrt(), dt),
            model_proj: lin(
                &format!("{pre}per_layer_model_projection"),
                h,
                nl * p,
                false,
            )?,
            model_proj_scale: (h as f64).powf(-0.5),
            proj_norm: norm(&format!("{pre}per_layer_projection_norm.weight"), p)?,
            dim: p,
            layers: nl,
        })
    } else {
        None
    };
    let mut layers = Vec::with_capacity(nl);
    let mut slot_of = vec![usize::MAX; nl];
    let mut slots = 0;
    for i in 0..nl {
        let p = format!("{pre}layers.{i}");
        let mut attn = Attention::load(w, &format!("{p}.self_attn"), g.attention(cfg, i))?;
        attn.fuse()?;
        let slot = if g.kv_owner[i] != i {
            slot_of[g.kv_owner[i]]
        } else {
            slots += 1;
            slots - 1
        };
        slot_of[i] = slot;
        let (rope, vis) = match g.layer_types[i] {
            LayerType::Sliding => (1, Visibility::sliding(g.sliding_window)),
            // (linear_attention layers are refused at load: `archs::family_for`)
            LayerType::Full | LayerType::Linear => (0, Visibility::CAUSAL),
        };
        let mut mlp = GatedMlp::load(w, &format!("{p}.mlp"), h, g.mlp_width(cfg, i), false, act)?;
        mlp.fuse()?;
        let moe = match g.moe {
            None => None,
            Some((e, k, mi)) => Some(Moe {
                moe: SparseMoe {
                    router: Router {
                        per_expert_scale: Some(
                            w.get_dtype(&format!("{p}.router.per_expert_scale"), e, DType::F32)?
                                .to_vec1::<f32>()?,
                        ),
                        ..Router::load(
                            w,
                            &format!("{p}.router.proj"),
                            h,
                            e,
                            false,
                            Scoring::Softmax { renormalize: true },
                            k,
                        )?
                    },
                    experts: Experts::load(w, &p, h, mi, e, act)?,
                    shared: None,
                },
                router_input: RouterInput {
                    norm: RmsNorm::unit(h, eps, dt, &dev)?,
                    scale: w.get(&format!("{p}.router.scale"), h)?,
                    root: (h as f64).powf(-0.5),
                },
                pre_ff_norm_2: norm(&format!("{p}.pre_feedforward_layernorm_2.weight"), h)?,
                post_ff_norm_1: norm(&format!("{p}.post_feedforward_layernorm_1.weight"), h)?,
                post_ff_norm_2: norm(&format!("{p}.post_feedforward_layernorm_2.weight"), h)?,
            }),
        };
        let ple_layer = match &ple {
            None => None,
            Some(pl) => Some(PleLayer {
                gate: lin(&format!("{p}.per_layer_input_gate"), h, pl.dim, false)?,
                proj: lin(&format!("{p}.per_layer_projection"), pl.dim, h, false)?,
                post_norm: norm(&format!("{p}.post_per_layer_input_norm.weight"), h)?,
            }),
        };
        let layer_scalar = match w.get_opt(&format!("{p}.layer_scalar"), 1)? {
            Some(s) => s,
            None => Tensor::ones(1, dt, &dev)?,
        };
        layers.push(Gemma4Layer {
            index: i,
            input_norm: norm(&format!("{p}.input_layernorm.weight"), h)?,
            attn,
            rope,
            vis,
            post_attn_norm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            pre_ff_norm: norm(&format!("{p}.pre_feedforward_layernorm.weight"), h)?,
            post_ff_norm: norm(&format!("{p}.post_feedforward_layernorm.weight"), h)?,
            mlp,
            moe,
            ple: ple_layer,
            act,
            layer_scalar,
            slot,
        });
    }
    let head = Head::new(
        norm(&format!("{pre}norm.weight"), h)?,
        lm_head(w, "lm_head", &embed, g.tied, h, v)?,
        g.final_softcap,
        &embed,
    );
    let full_dim = (0..nl)
        .find(|&i| g.layer_types[i] == LayerType::Full)
        .map_or(cfg.head_dim, |i| g.shapes[i].head_dim);
    let slide_dim = (0..nl)
        .find(|&i| g.layer_types[i] == LayerType::Sliding)
        .map_or(cfg.head_dim, |i| g.shapes[i].head_dim);
    let mut info = target_info(cfg, w, "gemma4");
    info.num_layers = nl;
    let vocab_limit = if ple.is_some() { v.min(g.ple_vocab) } else { v };
    let ropes = vec![
        Rope::new(&g.rope_full, full_dim),
        Rope::new(&g.rope_sliding, slide_dim),
    ];
    let mut m = Stack::new(info, embed, ropes, layers, head, plan(cfg)?.caches);
    m.embed_scale = Some(round_to((h as f64).sqrt(), dt));
    m.vocab_limit = vocab_limit;
    m.prologue = ple.map(|p| Box::new(p) as Box<dyn Prologue>);
    Ok(Box::new(m.finish_load()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: Value) -> TargetConfig {
        let mut v = json!({
            "model_type": "gemma4_text",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 256,
            "hidden_activation": "gelu_pytorch_tanh",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        TargetConfig::from_value("config.json", v).unwrap()
    }

    #[test]
    fn defaults_follow_transformers_post_init() {
        // No layer_types / rope_parameters / per_layer_config: 5:1 pattern, the global head
        // shape from global_head_dim (+ num_global_key_value_heads with attention_k_eq_v).
        let g = Gemma4Config::parse(&cfg(json!({
            "num_hidden_layers": 12,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": true,
            "num_kv_shared_layers": 2,
        })))
        .unwrap();
        let full: Vec<usize> = (0..12)
            .filter(|&i| g.layer_types[i] == LayerType::Full)
            .collect();
        assert_eq!(full, vec![5, 11]);
        assert_eq!(g.shapes[11], g.shapes[5]);
        assert_eq!(
            g.shapes[5],
            AttnShape {
                head_dim: 32,
                kv_heads: 1
            }
        );
        assert_eq!(
            g.shapes[0],
            AttnShape {
                head_dim: 16,
                kv_heads: 2
            }
        );
        assert_eq!(g.kv_owner, vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 5]);
        assert_eq!(g.rope_full.kind, RopeKind::Proportional { factor: 1.0 });
        assert_eq!(g.rope_full.theta, 1e6);
        assert_eq!(g.rope_sliding.kind, RopeKind::Default);
        assert_eq!(g.sliding_window, 512);
        assert!(g.tied);
        // without attention_k_eq_v the global KV head count is not overridden
        let g = Gemma4Config::parse(&cfg(json!({
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
        })))
        .unwrap();
        assert_eq!(
            g.shapes[5],
            AttnShape {
                head_dim: 32,
                kv_heads: 2
            }
        );
    }

    #[test]
    fn shared_layer_needs_an_owner_of_its_type() {
        // layers 0..3 sliding, 4 full, 5 full(forced): sharing 2 leaves no full owner.
        let e = Gemma4Config::parse(&cfg(json!({
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                            "sliding_attention", "full_attention", "full_attention"],
            "sliding_window": 4,
            "num_kv_shared_layers": 2,
        })))
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("num_kv_shared_layers"), "{e}");
    }

    #[test]
    fn proportional_rope_pads_with_identity_frequencies() {
        let r = RopeConfig {
            theta: 1e6,
            kind: RopeKind::Proportional { factor: 1.0 },
            partial_rotary_factor: 0.25,
        };
        let (inv, scale) = r.inv_freq(32);
        assert_eq!(scale, 1.0);
        assert_eq!(inv.len(), 16);
        for (i, f) in inv.iter().enumerate() {
            let want = if i < 4 {
                1.0 / 1e6f32.powf((2 * i) as f32 / 32.0)
            } else {
                0.0
            };
            assert_eq!(*f, want, "{i}");
        }
    }
}
