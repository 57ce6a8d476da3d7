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

use super::{
    checked_forward, ForwardOutput, LayerCache, Logits, TapRecorder, TargetCache, TargetInfo,
    TargetModel,
};
use crate::config::{Fields, LayerType, RopeConfig, RopeKind, TargetConfig};
use crate::nn::attention::sdpa;
use crate::nn::{attention_mask, Activation, GatedMlp, KvCache, Linear, RmsNorm, Rope, RopeTables};
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

/// The text config: the top level, or `text_config` of a multimodal config.
fn text_fields<'a>(cfg: &'a TargetConfig) -> Result<Fields<'a>> {
    let f = Fields::new(&cfg.file, &cfg.raw)?;
    Ok(match f.sub("text_config")? {
        Some(t) => t,
        None => f,
    })
}

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
        let f = text_fields(cfg)?;
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
            tied: match Fields::new(&cfg.file, &cfg.raw)?.opt_bool("tie_word_embeddings")? {
                Some(t) => t,
                None => f.opt_bool("tie_word_embeddings")?.unwrap_or(true),
            },
        })
    }
}

/// An RMSNorm without a learned scale (`with_scale=False`).
fn plain_norm(dim: usize, eps: f64, dtype: DType, device: &Device) -> Result<RmsNorm> {
    Ok(RmsNorm {
        weight: Tensor::ones(dim, dtype, device)?,
        eps: eps as f32,
    })
}

/// K/V projections of a non-shared layer.
struct KvProj {
    k_proj: Linear,
    /// None with `attention_k_eq_v` on full layers: values are the raw key projection.
    v_proj: Option<Linear>,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
}

struct Attn {
    q_proj: Linear,
    q_norm: RmsNorm,
    /// None for KV-shared layers.
    kv: Option<KvProj>,
    o_proj: Linear,
    heads: usize,
    shape: AttnShape,
}

impl Attn {
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        t: &RopeTables,
        kv: &mut KvCache,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let (d, kvh) = (self.shape.head_dim, self.shape.kv_heads);
        let q = self.q_proj.forward(x)?.reshape((n, self.heads, d))?;
        let q = self.q_norm.forward(&q)?;
        let q = rope.apply(&q.transpose(0, 1)?.contiguous()?, t)?;
        let (k, v) = match &self.kv {
            Some(p) => {
                let k_raw = p.k_proj.forward(x)?.reshape((n, kvh, d))?;
                let v_raw = match &p.v_proj {
                    Some(vp) => vp.forward(x)?.reshape((n, kvh, d))?,
                    None => k_raw.clone(),
                };
                let k = p.k_norm.forward(&k_raw)?;
                let k = rope.apply(&k.transpose(0, 1)?.contiguous()?, t)?;
                let v = p.v_norm.forward(&v_raw)?.transpose(0, 1)?.contiguous()?;
                kv.append(&k, &v)?
            }
            // The owner layer (earlier in this pass) already appended this block.
            None => kv.view()?,
        };
        let o = sdpa(&q, &k, &v, mask, 1.0)?;
        self.o_proj.forward(&o)
    }
}

/// The MoE block that runs next to the dense MLP.
struct Moe {
    router_norm: RmsNorm,
    router_scale: Tensor,
    router_root: f64,
    router_proj: Linear,
    per_expert_scale: Vec<f32>,
    /// `[E, 2I, H]`
    gate_up: Tensor,
    /// `[E, H, I]`
    down: Tensor,
    top_k: usize,
    inter: usize,
    act: Activation,
    pre_ff_norm_2: RmsNorm,
    post_ff_norm_1: RmsNorm,
    post_ff_norm_2: RmsNorm,
}

impl Moe {
    /// Expert output for `resid [n, H]` (the residual stream before the MLP), before
    /// `post_feedforward_layernorm_2`.
    fn experts(&self, resid: &Tensor) -> Result<Tensor> {
        let (n, h) = resid.dims2()?;
        let dev = resid.device();
        let dt = resid.dtype();
        let r = self.router_norm.forward(resid)?;
        let r = (r.broadcast_mul(&self.router_scale)? * self.router_root)?;
        let scores = self.router_proj.forward(&r)?.to_dtype(DType::F32)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_vec2::<f32>()?;
        let e_count = self.per_expert_scale.len();
        let mut routes: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); e_count];
        for (tok, row) in probs.iter().enumerate() {
            let mut idx: Vec<usize> = (0..e_count).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let top = &idx[..self.top_k];
            let sum: f32 = top.iter().map(|&e| row[e]).sum();
            for &e in top {
                routes[e].0.push(tok as u32);
                routes[e].1.push(row[e] / sum * self.per_expert_scale[e]);
            }
        }
        let x = self.pre_ff_norm_2.forward(resid)?;
        let mut out = Tensor::zeros((n, h), dt, dev)?;
        for (e, (toks, ws)) in routes.into_iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let m = toks.len();
            let idx = Tensor::from_vec(toks, m, dev)?;
            let w = Tensor::from_vec(ws, (m, 1), dev)?.to_dtype(dt)?;
            let xs = x.index_select(&idx, 0)?;
            let gu = xs.matmul(&self.gate_up.get(e)?.t()?)?; // [m, 2I]
            let g = self.act.apply(&gu.narrow(1, 0, self.inter)?)?;
            let u = gu.narrow(1, self.inter, self.inter)?;
            let y = (g * u)?.matmul(&self.down.get(e)?.t()?)?; // [m, H]
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        Ok(out)
    }
}

/// The per-layer-input branch of one layer.
struct PleLayer {
    gate: Linear,
    proj: Linear,
    post_norm: RmsNorm,
}

/// The model-level per-layer-input tables.
struct Ple {
    embed: Tensor,
    embed_scale: Tensor,
    model_proj: Linear,
    model_proj_scale: f64,
    proj_norm: RmsNorm,
    dim: usize,
}

struct Layer {
    input_norm: RmsNorm,
    attn: Attn,
    post_attn_norm: RmsNorm,
    pre_ff_norm: RmsNorm,
    post_ff_norm: RmsNorm,
    mlp: GatedMlp,
    moe: Option<Moe>,
    ple: Option<PleLayer>,
    layer_scalar: Tensor,
    kind: LayerType,
    /// Index into the cache's layers of the K/V this layer appends to or reads.
    cache_slot: usize,
}

pub struct Gemma4Model {
    info: TargetInfo,
    embed_tokens: Tensor,
    /// sqrt(hidden) in the compute dtype (as transformers casts it), shape [1].
    embed_scale: Tensor,
    ple: Option<Ple>,
    ple_vocab: usize,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope_full: Rope,
    rope_sliding: Rope,
    sliding_window: usize,
    final_softcap: Option<f64>,
    act: Activation,
    /// Shapes of the caches, one per non-shared layer.
    cache_shapes: Vec<AttnShape>,
}

fn scalar(x: f64, dtype: DType, device: &Device) -> Result<Tensor> {
    // transformers keeps these as float32 tensors cast to the weight dtype.
    Ok(Tensor::new(&[x as f32], device)?.to_dtype(dtype)?)
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

fn linear_bytes(l: &Linear) -> usize {
    l.weight_bytes()
}

impl Gemma4Model {
    pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Self> {
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
        let mut bytes = 0usize;
        let embed_tokens = w.get(&format!("{pre}embed_tokens.weight"), (v, h))?;
        bytes += tensor_bytes(&embed_tokens);
        let norm = |name: &str, dim: usize| RmsNorm::load(w, name, dim, eps, false);
        let lin = |name: &str, i: usize, o: usize, b: bool| Linear::load(w, name, i, o, b);
        let ple = if g.ple_dim > 0 {
            let p = g.ple_dim;
            let embed = w.get(
                &format!("{pre}embed_tokens_per_layer.weight"),
                (g.ple_vocab, nl * p),
            )?;
            let model_proj = lin(
                &format!("{pre}per_layer_model_projection"),
                h,
                nl * p,
                false,
            )?;
            bytes += tensor_bytes(&embed) + linear_bytes(&model_proj);
            Some(Ple {
                embed,
                embed_scale: scalar((p as f64).sqrt(), dt, &dev)?,
                model_proj,
                model_proj_scale: (h as f64).powf(-0.5),
                proj_norm: norm(&format!("{pre}per_layer_projection_norm.weight"), p)?,
                dim: p,
            })
        } else {
            None
        };
        let bias = cfg.attention_bias;
        let heads = cfg.num_attention_heads;
        let mut layers = Vec::with_capacity(nl);
        let mut cache_shapes = vec![];
        let mut slot_of = vec![usize::MAX; nl];
        for i in 0..nl {
            let p = format!("{pre}layers.{i}");
            let a = format!("{p}.self_attn");
            let shape = g.shapes[i];
            let (d, kvh) = (shape.head_dim, shape.kv_heads);
            let shared = g.kv_owner[i] != i;
            let kv = if shared {
                None
            } else {
                let k_eq_v = g.k_eq_v && g.layer_types[i] == LayerType::Full;
                let k_proj = lin(&format!("{a}.k_proj"), h, kvh * d, bias)?;
                let v_proj = if k_eq_v {
                    None
                } else {
                    Some(lin(&format!("{a}.v_proj"), h, kvh * d, bias)?)
                };
                bytes += linear_bytes(&k_proj) + v_proj.as_ref().map_or(0, linear_bytes);
                Some(KvProj {
                    k_proj,
                    v_proj,
                    k_norm: norm(&format!("{a}.k_norm.weight"), d)?,
                    v_norm: plain_norm(d, eps, dt, &dev)?,
                })
            };
            let cache_slot = if shared {
                slot_of[g.kv_owner[i]]
            } else {
                cache_shapes.push(shape);
                cache_shapes.len() - 1
            };
            slot_of[i] = cache_slot;
            let attn = Attn {
                q_proj: lin(&format!("{a}.q_proj"), h, heads * d, bias)?,
                q_norm: norm(&format!("{a}.q_norm.weight"), d)?,
                kv,
                o_proj: lin(&format!("{a}.o_proj"), heads * d, h, bias)?,
                heads,
                shape,
            };
            bytes += linear_bytes(&attn.q_proj) + linear_bytes(&attn.o_proj);
            // MLP: doubled width on KV-shared layers with use_double_wide_mlp.
            let wide = g.double_wide_mlp && i >= g.first_shared && g.first_shared > 0;
            let inter = cfg.intermediate_size * if wide { 2 } else { 1 };
            let mlp = GatedMlp::load(w, &format!("{p}.mlp"), h, inter, false, act)?;
            bytes += linear_bytes(&mlp.gate) + linear_bytes(&mlp.up) + linear_bytes(&mlp.down);
            let moe = match g.moe {
                None => None,
                Some((e, k, mi)) => {
                    let gate_up = w.get(&format!("{p}.experts.gate_up_proj"), (e, 2 * mi, h))?;
                    let down = w.get(&format!("{p}.experts.down_proj"), (e, h, mi))?;
                    let router_proj = lin(&format!("{p}.router.proj"), h, e, false)?;
                    bytes +=
                        tensor_bytes(&gate_up) + tensor_bytes(&down) + linear_bytes(&router_proj);
                    Some(Moe {
                        router_norm: plain_norm(h, eps, dt, &dev)?,
                        router_scale: w.get(&format!("{p}.router.scale"), h)?,
                        router_root: (h as f64).powf(-0.5),
                        router_proj,
                        per_expert_scale: w
                            .get_dtype(&format!("{p}.router.per_expert_scale"), e, DType::F32)?
                            .to_vec1::<f32>()?,
                        gate_up,
                        down,
                        top_k: k,
                        inter: mi,
                        act,
                        pre_ff_norm_2: norm(&format!("{p}.pre_feedforward_layernorm_2.weight"), h)?,
                        post_ff_norm_1: norm(
                            &format!("{p}.post_feedforward_layernorm_1.weight"),
                            h,
                        )?,
                        post_ff_norm_2: norm(
                            &format!("{p}.post_feedforward_layernorm_2.weight"),
                            h,
                        )?,
                    })
                }
            };
            let ple_layer = match &ple {
                None => None,
                Some(pl) => {
                    let gate = lin(&format!("{p}.per_layer_input_gate"), h, pl.dim, false)?;
                    let proj = lin(&format!("{p}.per_layer_projection"), pl.dim, h, false)?;
                    bytes += linear_bytes(&gate) + linear_bytes(&proj);
                    Some(PleLayer {
                        gate,
                        proj,
                        post_norm: norm(&format!("{p}.post_per_layer_input_norm.weight"), h)?,
                    })
                }
            };
            let layer_scalar = match w.get_opt(&format!("{p}.layer_scalar"), 1)? {
                Some(s) => s,
                None => Tensor::ones(1, dt, &dev)?,
            };
            layers.push(Layer {
                input_norm: norm(&format!("{p}.input_layernorm.weight"), h)?,
                attn,
                post_attn_norm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
                pre_ff_norm: norm(&format!("{p}.pre_feedforward_layernorm.weight"), h)?,
                post_ff_norm: norm(&format!("{p}.post_feedforward_layernorm.weight"), h)?,
                mlp,
                moe,
                ple: ple_layer,
                layer_scalar,
                kind: g.layer_types[i],
                cache_slot,
            });
        }
        let lm_head = if w.contains("lm_head.weight") {
            let l = lin("lm_head", h, v, false)?;
            bytes += linear_bytes(&l);
            l
        } else if g.tied {
            Linear::dense(embed_tokens.clone(), None)
        } else {
            lin("lm_head", h, v, false)?
        };
        let full_dim = (0..nl)
            .find(|&i| g.layer_types[i] == LayerType::Full)
            .map_or(cfg.head_dim, |i| g.shapes[i].head_dim);
        let slide_dim = (0..nl)
            .find(|&i| g.layer_types[i] == LayerType::Sliding)
            .map_or(cfg.head_dim, |i| g.shapes[i].head_dim);
        let info = TargetInfo {
            family: "gemma4",
            model_type: cfg.model_type.clone(),
            num_layers: nl,
            hidden_size: h,
            vocab_size: v,
            max_position: cfg.max_position_embeddings,
            dtype: dt,
            device: dev.clone(),
            weight_bytes: 0,
            quantization: w.quant_report(),
        };
        let norm_w = norm(&format!("{pre}norm.weight"), h)?;
        let mut m = Self {
            info,
            embed_tokens,
            embed_scale: scalar((h as f64).sqrt(), dt, &dev)?,
            ple,
            ple_vocab: g.ple_vocab,
            layers,
            norm: norm_w,
            lm_head,
            rope_full: Rope::new(&g.rope_full, full_dim),
            rope_sliding: Rope::new(&g.rope_sliding, slide_dim),
            sliding_window: g.sliding_window,
            final_softcap: g.final_softcap,
            act,
            cache_shapes,
        };
        m.info.weight_bytes = bytes;
        Ok(m)
    }

    /// Per-layer inputs `[n, layers, ple_dim]` for token ids and their scaled embeddings.
    fn per_layer_inputs(&self, ple: &Ple, ids: &Tensor, emb: &Tensor) -> Result<Tensor> {
        let n = ids.dim(0)?;
        let nl = self.layers.len();
        let tok = ple
            .embed
            .index_select(ids, 0)?
            .broadcast_mul(&ple.embed_scale)?
            .reshape((n, nl, ple.dim))?;
        let proj =
            (ple.model_proj.forward(emb)? * ple.model_proj_scale)?.reshape((n, nl, ple.dim))?;
        let proj = ple.proj_norm.forward(&proj)?;
        Ok(((proj + tok)? * 2f64.powf(-0.5))?)
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
        let mut h = self.embed(&ids)?.broadcast_mul(&self.embed_scale)?;
        let ple = match &self.ple {
            Some(p) => Some(self.per_layer_inputs(p, &ids, &h)?),
            None => None,
        };
        let t_full = self.rope_full.tables(start, n, dev, dt)?;
        let t_slide = self.rope_sliding.tables(start, n, dev, dt)?;
        let k_len = start + n;
        let mask_full = if n > 1 {
            attention_mask(n, start, k_len, true, None, dt, dev)?
        } else {
            None
        };
        let mask_slide = attention_mask(n, start, k_len, true, Some(self.sliding_window), dt, dev)?;
        let mut tapped = TapRecorder::new(taps);
        for (i, layer) in self.layers.iter().enumerate() {
            #[allow(unreachable_patterns)]
            let kv = match &mut cache.layers[layer.cache_slot] {
                LayerCache::Kv(kv) => kv,
                _ => return Err(Error::input("gemma4: cache layer is not a KV cache")),
            };
            let (rope, tables, mask): (&Rope, &RopeTables, Option<&Tensor>) = match layer.kind {
                LayerType::Sliding => (&self.rope_sliding, &t_slide, mask_slide.as_ref()),
                // (linear_attention layers are refused at load: `archs::load_target`)
                LayerType::Full | LayerType::Linear => {
                    (&self.rope_full, &t_full, mask_full.as_ref())
                }
            };
            let x = layer.input_norm.forward(&h)?;
            let a = layer.attn.forward(&x, rope, tables, kv, mask)?;
            let h1 = (h + layer.post_attn_norm.forward(&a)?)?;
            let mut m = layer.mlp.forward(&layer.pre_ff_norm.forward(&h1)?)?;
            if let Some(moe) = &layer.moe {
                let e = moe.post_ff_norm_2.forward(&moe.experts(&h1)?)?;
                m = (moe.post_ff_norm_1.forward(&m)? + e)?;
            }
            let mut h2 = (&h1 + layer.post_ff_norm.forward(&m)?)?;
            if let (Some(pl), Some(inputs)) = (&layer.ple, &ple) {
                let pin = inputs.narrow(1, i, 1)?.squeeze(1)?;
                let gz = self.act.apply(&pl.gate.forward(&h2)?)?;
                let y = pl.proj.forward(&(gz * pin)?)?;
                h2 = (&h2 + pl.post_norm.forward(&y)?)?;
            }
            h = h2.broadcast_mul(&layer.layer_scalar)?;
            tapped.record(i, &h);
        }
        let taps_out = tapped.finish()?;
        let logits = logits.rows(&h)?.map(|r| self.logits(&r)).transpose()?;
        Ok(ForwardOutput {
            logits,
            taps: taps_out,
        })
    }
}

impl TargetModel for Gemma4Model {
    fn info(&self) -> &TargetInfo {
        &self.info
    }

    fn new_cache(&self, capacity: usize) -> Result<TargetCache> {
        let layers = self
            .cache_shapes
            .iter()
            .map(|s| {
                Ok(LayerCache::Kv(KvCache::new(
                    s.kv_heads,
                    s.head_dim,
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
        let limit = if self.ple.is_some() {
            self.info.vocab_size.min(self.ple_vocab)
        } else {
            self.info.vocab_size
        };
        checked_forward(tokens, start, cache, taps, self.layers.len(), limit, |c| {
            self.forward_inner(tokens, start, c, taps, logits)
        })
    }

    fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        Ok(self.embed_tokens.index_select(tokens, 0)?)
    }

    fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(hidden)?.to_dtype(DType::F32)?)
    }
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    Ok(Box::new(Gemma4Model::load(cfg, w)?))
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
