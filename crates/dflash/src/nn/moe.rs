//! Mixture-of-experts feed-forward, one implementation for every MoE family: a [`Router`]
//! (how each row chooses its experts and their weights), the routed [`Experts`] (stacked
//! weights `[E, 2I, H]` / `[E, H, I]`, one activation), and an optional shared expert.
//!
//! | family | scoring | weights | experts | shared |
//! |---|---|---|---|---|
//! | qwen3_moe | softmax, top-k | renormalized iff `norm_topk_prob` | SwiGLU | - |
//! | qwen3_5_moe, qwen3_next | softmax, top-k | renormalized (qwen3_5_moe always) | SwiGLU | sigmoid-gated |
//! | gemma4 | softmax, top-k | renormalized, times a per-expert scale | GeGLU | - (a dense MLP beside it) |
//! | gpt_oss | top-k of the logits, softmax over them | as computed | clamped GLU with biases | - |
//! | deepseek_v3 / kimi | sigmoid, correction bias for the choice, grouped top-k | raw scores, renormalized, times `routed_scaling_factor` | SwiGLU | always on |
//!
//! The config side is one reader too ([`MoeConfig`]), with the family's defaults for absent
//! keys. Routing happens on the host from an f32 `[rows, experts]` copy; each selected expert
//! runs once on the rows routed to it and its weighted output is added back in expert order
//! (as transformers loops over experts). [`Experts::forward`] is the door a grouped expert
//! kernel plugs into.

use super::{Activation, GatedMlp, Linear, RmsNorm};
use crate::config::Fields;
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{DType, Tensor};

/// Indices of the `k` largest values, descending; ties go to the lower index (torch.topk).
pub fn top_k_desc(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// The MoE settings of a config, one reader for every family.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    /// Width of one routed expert.
    pub intermediate_size: usize,
    /// Width of the shared expert (0 = none).
    pub shared_intermediate_size: usize,
    pub norm_topk_prob: bool,
}

/// A family's defaults for absent MoE keys (None: the key is required).
#[derive(Debug, Clone, Copy, Default)]
pub struct MoeDefaults {
    pub num_experts: Option<usize>,
    pub top_k: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub shared_intermediate_size: Option<usize>,
    pub norm_topk_prob: bool,
}

impl MoeConfig {
    /// Read the expert count (`num_experts`, `num_local_experts` or `n_routed_experts`), the
    /// experts per token (`num_experts_per_tok`, `experts_per_token` or `top_k_experts`),
    /// `moe_intermediate_size`, `shared_expert_intermediate_size` and `norm_topk_prob` from
    /// the text config `f`, with `d` for absent keys. Errors name the field.
    pub fn parse(f: &Fields, d: MoeDefaults) -> Result<Self> {
        let first = |keys: &[&str]| -> Result<Option<(String, usize)>> {
            for k in keys {
                if let Some(x) = f.opt_usize(k)? {
                    return Ok(Some((k.to_string(), x)));
                }
            }
            Ok(None)
        };
        let need = |keys: &[&str], default: Option<usize>| -> Result<(String, usize)> {
            match (first(keys)?, default) {
                (Some(v), _) => Ok(v),
                (None, Some(x)) => Ok((keys[0].to_string(), x)),
                (None, None) => Err(f.err(keys[0], "missing (required for MoE layers)")),
            }
        };
        let (ek, num_experts) = need(
            &["num_experts", "num_local_experts", "n_routed_experts"],
            d.num_experts,
        )?;
        if num_experts == 0 {
            return Err(f.err(&ek, "must be > 0"));
        }
        let (kk, top_k) = need(
            &["num_experts_per_tok", "experts_per_token", "top_k_experts"],
            d.top_k,
        )?;
        if top_k == 0 || top_k > num_experts {
            return Err(f.err(
                &kk,
                format!("{top_k} experts per token of {num_experts}: need 1..={num_experts}"),
            ));
        }
        let (ik, intermediate_size) = need(&["moe_intermediate_size"], d.intermediate_size)?;
        if intermediate_size == 0 {
            return Err(f.err(&ik, "must be > 0"));
        }
        let shared_intermediate_size = match (
            f.opt_usize("shared_expert_intermediate_size")?,
            d.shared_intermediate_size,
        ) {
            (Some(0), Some(_)) => {
                return Err(f.err("shared_expert_intermediate_size", "must be > 0"))
            }
            (Some(x), _) => x,
            (None, x) => x.unwrap_or(0),
        };
        Ok(Self {
            num_experts,
            top_k,
            intermediate_size,
            shared_intermediate_size,
            norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(d.norm_topk_prob),
        })
    }

    /// Parameters of one Qwen-layout MoE block of `hidden`: router, routed experts, and the
    /// shared expert with its gate when there is one.
    pub fn params(&self, hidden: usize) -> super::Params {
        let (h, e) = (hidden as u64, self.num_experts as u64);
        let shared = match self.shared_intermediate_size {
            0 => 0,
            s => GatedMlp::params(hidden, s, false) + h,
        };
        let experts = e * GatedMlp::params(hidden, self.intermediate_size, false);
        let affine = hidden.is_multiple_of(128) && self.intermediate_size.is_multiple_of(128);
        super::Params {
            plain: e * h + shared,
            experts,
            affine_experts: if affine { experts } else { 0 },
        }
    }

    /// Which of `layers` layers have the MoE block under `decoder_sparse_step` (every n-th
    /// layer, default 1) and `mlp_only_layers` (dense exceptions), as the Qwen MoE configs say.
    pub fn sparse_layers(f: &Fields, layers: usize) -> Result<Vec<bool>> {
        let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1);
        let mlp_only = f.opt_usize_list("mlp_only_layers")?.unwrap_or_default();
        Ok((0..layers)
            .map(|i| !mlp_only.contains(&i) && (i + 1) % step == 0)
            .collect())
    }
}

/// How a router turns its logits into choices.
#[derive(Debug, Clone)]
pub enum Scoring {
    /// Softmax over every expert, then the top k; renormalized to sum to one when asked.
    Softmax { renormalize: bool },
    /// The top k logits, softmaxed among themselves (gpt-oss).
    TopKSoftmax,
    /// Sigmoid scores; the choice adds `correction` and keeps the best `topk_group` of
    /// `n_group` groups (each scored by its two best); the weights are the chosen raw scores,
    /// renormalized when asked (deepseek_v3).
    SigmoidGrouped {
        correction: Vec<f32>,
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
    },
}

/// For each expert, the rows routed to it and their weights, in row order.
#[derive(Debug, Clone)]
pub struct Routes {
    pub per_expert: Vec<Vec<(u32, f32)>>,
}

impl Routes {
    pub fn new(num_experts: usize) -> Self {
        Self {
            per_expert: vec![vec![]; num_experts],
        }
    }
    pub fn push(&mut self, row: usize, expert: usize, weight: f32) {
        self.per_expert[expert].push((row as u32, weight));
    }
    /// Experts with at least one row (the union a block routes to).
    pub fn used(&self) -> usize {
        self.per_expert.iter().filter(|r| !r.is_empty()).count()
    }
}

#[derive(Debug, Clone)]
pub struct Router {
    /// `[E, H]` (with a bias for gpt-oss).
    pub proj: Linear,
    /// Multiply in f32 (deepseek_v3 routes in float32: the weight is loaded as f32).
    pub f32_input: bool,
    pub scoring: Scoring,
    pub top_k: usize,
    /// Multiplies every chosen weight (`routed_scaling_factor`; 1 otherwise).
    pub scale: f32,
    /// Per-expert multipliers of the chosen weights (gemma4).
    pub per_expert_scale: Option<Vec<f32>>,
    /// The correction bias and per-expert scales as f32 device tensors, made on the first
    /// device-side routing (the routing kernel reads them).
    pub device_tables: std::sync::OnceLock<(Option<Tensor>, Option<Tensor>)>,
}

impl Router {
    /// A plain `{name}` linear router.
    pub fn load(
        w: &Weights,
        name: &str,
        hidden: usize,
        experts: usize,
        bias: bool,
        scoring: Scoring,
        top_k: usize,
    ) -> Result<Self> {
        Ok(Self {
            proj: Linear::load(w, name, hidden, experts, bias)?,
            f32_input: false,
            scoring,
            top_k,
            scale: 1.0,
            per_expert_scale: None,
            device_tables: Default::default(),
        })
    }

    pub fn weight_bytes(&self) -> usize {
        self.proj.weight_bytes()
    }

    /// Router logits `[n, E]` f32.
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.projected(x)?.to_dtype(DType::F32)?)
    }

    /// Router logits `[n, E]` in the projection's dtype (the device routing reads bf16 as it
    /// is: the f32 cast is exact, so the choices are the same).
    pub fn projected(&self, x: &Tensor) -> Result<Tensor> {
        Ok(if self.f32_input {
            self.proj.forward(&x.to_dtype(DType::F32)?)?
        } else {
            self.proj.forward(x)?
        })
    }

    /// One row's choices `(expert, weight)` from its logits.
    pub fn choose(&self, l: &[f32]) -> Vec<(usize, f32)> {
        let mut out: Vec<(usize, f32)> = match &self.scoring {
            Scoring::Softmax { renormalize } => {
                let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let ex: Vec<f32> = l.iter().map(|&x| (x - m).exp()).collect();
                let z: f32 = ex.iter().sum();
                let p: Vec<f32> = ex.iter().map(|&e| e / z).collect();
                let top = top_k_desc(&p, self.top_k);
                let sum: f32 = top.iter().map(|&e| p[e]).sum();
                top.into_iter()
                    .map(|e| (e, if *renormalize { p[e] / sum } else { p[e] }))
                    .collect()
            }
            Scoring::TopKSoftmax => {
                let top = top_k_desc(l, self.top_k);
                let m = l[top[0]];
                let ex: Vec<f32> = top.iter().map(|&e| (l[e] - m).exp()).collect();
                let sum: f32 = ex.iter().sum();
                top.into_iter().zip(ex).map(|(e, x)| (e, x / sum)).collect()
            }
            Scoring::SigmoidGrouped {
                correction,
                n_group,
                topk_group,
                renormalize,
            } => {
                let s: Vec<f32> = l.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
                let choice: Vec<f32> = s.iter().zip(correction).map(|(a, b)| a + b).collect();
                let per_group = choice.len() / n_group;
                // groups scored by the sum of their two best choice scores
                let group_scores: Vec<f32> = choice
                    .chunks(per_group)
                    .map(|g| top_k_desc(g, 2).iter().map(|&i| g[i]).sum())
                    .collect();
                let groups = top_k_desc(&group_scores, *topk_group);
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
                let top = top_k_desc(&masked, self.top_k);
                let denom = if *renormalize {
                    top.iter().map(|&i| s[i]).sum::<f32>() + 1e-20
                } else {
                    1.0
                };
                top.into_iter().map(|i| (i, s[i] / denom)).collect()
            }
        };
        for (e, wt) in &mut out {
            if let Some(s) = &self.per_expert_scale {
                *wt *= s[*e];
            }
            *wt *= self.scale;
        }
        out
    }

    /// Route the rows of `x [n, hidden]`.
    pub fn route(&self, x: &Tensor) -> Result<Routes> {
        let logits = self.logits(x)?.to_vec2::<f32>()?;
        let e = self.proj.out_features();
        let mut routes = Routes::new(e);
        for (row, l) in logits.iter().enumerate() {
            for (expert, wt) in self.choose(l) {
                routes.push(row, expert, wt);
            }
        }
        Ok(routes)
    }
}

/// The activation of a routed expert's gate/up pair.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertAct {
    /// `act(gate) * up` (SwiGLU with silu, GeGLU with gelu-tanh).
    Glu(Activation),
    /// gpt-oss: `(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)` with `g = min(gate, l)`.
    ClampedGlu { limit: f64, alpha: f64 },
}

/// A stack of expert matrices `[E, rows, k]` as held: floats, MXFP4 codes and scales kept as
/// stored (gpt-oss on CUDA; [`super::mxfp4`]), or MLX affine 4-bit kept as stored (MLX Qwen
/// MoE checkpoints on CUDA; [`crate::source::Weights::mlx_expert_stack`]).
#[derive(Debug, Clone)]
pub enum ExpertMatrix {
    Float(Tensor),
    Mxfp4(super::mxfp4::Mxfp4Stack),
    /// The `E * rows` rows of all experts as one affine matrix `[E * rows, k]`.
    Affine {
        w: std::sync::Arc<super::AffineWeight>,
        experts: usize,
    },
}

impl From<Tensor> for ExpertMatrix {
    fn from(t: Tensor) -> Self {
        Self::Float(t)
    }
}

impl ExpertMatrix {
    /// `(E, rows, k)`.
    pub fn dims(&self) -> candle_core::Result<(usize, usize, usize)> {
        Ok(match self {
            Self::Float(t) => t.dims3()?,
            Self::Mxfp4(m) => m.dims(),
            Self::Affine { w, experts } => (*experts, w.n / experts, w.k),
        })
    }

    pub fn bytes(&self) -> usize {
        match self {
            Self::Float(t) => super::tensor_bytes(t),
            Self::Mxfp4(m) => m.bytes(),
            Self::Affine { w, .. } => w.bytes(),
        }
    }

    /// Expert `e`'s matrix `[rows, k]` in a float dtype (MXFP4: dequantized, exactly, to bf16;
    /// affine: dequantized to bf16 as the dense affine weights are for prefill).
    pub fn expert(&self, e: usize) -> Result<Tensor> {
        match self {
            Self::Float(t) => Ok(t.get(e)?),
            Self::Mxfp4(m) => m.dequantize(e),
            Self::Affine { w, experts } => {
                let rows = w.n / experts;
                w.rows(e * rows, rows)?.dequantize(DType::BF16)
            }
        }
    }
}

/// The routed experts, stacked.
#[derive(Debug, Clone)]
pub struct Experts {
    /// `[E, 2I, H]`: each expert's gate rows, then its up rows.
    pub gate_up: ExpertMatrix,
    /// `[E, 2I]`
    pub gate_up_bias: Option<Tensor>,
    /// `[E, H, I]`
    pub down: ExpertMatrix,
    /// `[E, H]`
    pub down_bias: Option<Tensor>,
    pub act: ExpertAct,
    pub inter: usize,
    /// Expert parallelism: this tensor-parallel rank holds experts `[first, first + count)`
    /// only (the stacks above), computes those the rows route to, and the block all-reduces
    /// the partial sums ([`Self::keep_rank`]).
    pub rank: Option<(super::parallel::Shard, usize)>,
}

impl Experts {
    /// In a tensor-parallel load (`w.shard()`), keep this rank's experts only: a contiguous
    /// share of the `E` experts by index (expert parallelism; the routing stays whole on every
    /// rank, so it is exact). Float stacks (the CPU's); experts kept quantized on a GPU are not
    /// split yet.
    pub fn keep_rank(mut self, w: &Weights) -> Result<Self> {
        let Some(sh) = w.shard().cloned() else {
            return Ok(self);
        };
        let (first, n) = Self::rank_share(w, self.count())?;
        let narrow = |m: &ExpertMatrix| -> Result<ExpertMatrix> {
            match m {
                ExpertMatrix::Float(t) => Ok(t.narrow(0, first, n)?.contiguous()?.into()),
                _ => Err(Error::input(
                    "tensor parallel: experts kept quantized are not split yet (run them without --tensor-parallel)",
                )),
            }
        };
        self.gate_up = narrow(&self.gate_up)?;
        self.down = narrow(&self.down)?;
        let rows = |b: &Option<Tensor>| -> Result<Option<Tensor>> {
            Ok(match b {
                Some(b) => Some(b.narrow(0, first, n)?.contiguous()?),
                None => None,
            })
        };
        self.gate_up_bias = rows(&self.gate_up_bias)?;
        self.down_bias = rows(&self.down_bias)?;
        self.rank = Some((sh, first));
        Ok(self)
    }

    /// This rank's share `(first, count)` of `e` routed experts in a tensor-parallel load:
    /// `[rank E / N, (rank + 1) E / N)`, uneven when N does not divide E; all of them otherwise.
    pub fn rank_share(w: &Weights, e: usize) -> Result<(usize, usize)> {
        let Some(sh) = w.shard() else {
            return Ok((0, e));
        };
        if e < sh.world {
            return Err(Error::input(format!(
                "tensor parallel {}: {e} routed experts are fewer than the ranks (choose a tensor-parallel size of at most {e})",
                sh.world
            )));
        }
        let first = sh.rank * e / sh.world;
        Ok((first, (sh.rank + 1) * e / sh.world - first))
    }

    /// Load `{prefix}.experts` without biases, either per expert
    /// (`{prefix}.experts.{e}.{gate,up,down}_proj.weight`, the checkpoint layout), stacked
    /// (`{prefix}.experts.gate_up_proj [E, 2I, H]`, `{prefix}.experts.down_proj [E, H, I]`,
    /// transformers 5's in-memory layout) or stacked per projection as mlx-lm writes them
    /// (`{prefix}.switch_mlp.{gate,up,down}_proj.weight`, `[E, I, H]` / `[E, H, I]`, usually
    /// MLX-quantized: kept as stored where [`Weights::mlx_expert_stack`] takes them).
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        experts: usize,
        act: Activation,
    ) -> Result<Self> {
        let stacked = format!("{prefix}.experts.gate_up_proj");
        let switch = format!("{prefix}.switch_mlp");
        let (gate, up, down_name) = (
            format!("{switch}.gate_proj.weight"),
            format!("{switch}.up_proj.weight"),
            format!("{switch}.down_proj.weight"),
        );
        // A tensor-parallel rank reads its own experts only where they are float (the stacks
        // kept quantized load whole and `keep_rank` refuses them).
        let (first, n) = Self::rank_share(w, experts)?;
        let part = |name: &str, shape: (usize, usize, usize)| w.get_part(name, shape, 0, first, n);
        let (gate_up, down, mine): (ExpertMatrix, ExpertMatrix, bool) = if w.contains(&stacked) {
            (
                part(&stacked, (experts, 2 * inter, hidden))?.into(),
                part(
                    &format!("{prefix}.experts.down_proj"),
                    (experts, hidden, inter),
                )?
                .into(),
                true,
            )
        } else if w.contains(&gate) {
            // kept as stored only all three (the device kernels take one storage per layer)
            let keep = w.mlx_keeps_stack(&gate, (experts, inter, hidden))?
                && w.mlx_keeps_stack(&up, (experts, inter, hidden))?
                && w.mlx_keeps_stack(&down_name, (experts, hidden, inter))?;
            if keep {
                let affine = |w| ExpertMatrix::Affine {
                    w: std::sync::Arc::new(w),
                    experts,
                };
                (
                    affine(w.mlx_expert_stack(&[&gate, &up], (experts, inter, hidden))?),
                    affine(w.mlx_expert_stack(&[&down_name], (experts, hidden, inter))?),
                    false,
                )
            } else {
                let g = part(&gate, (experts, inter, hidden))?;
                let u = part(&up, (experts, inter, hidden))?;
                (
                    Tensor::cat(&[&g, &u], 1)?.into(),
                    part(&down_name, (experts, hidden, inter))?.into(),
                    true,
                )
            }
        } else if let Some((gu, dn)) = Self::int_stacks(w, prefix, hidden, inter, experts)? {
            (gu, dn, false)
        } else {
            let (mut gu, mut dn) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for e in first..first + n {
                let p = format!("{prefix}.experts.{e}");
                let g = w.get(&format!("{p}.gate_proj.weight"), (inter, hidden))?;
                let u = w.get(&format!("{p}.up_proj.weight"), (inter, hidden))?;
                gu.push(Tensor::cat(&[&g, &u], 0)?);
                dn.push(w.get(&format!("{p}.down_proj.weight"), (hidden, inter))?);
            }
            (
                Tensor::stack(&gu, 0)?.into(),
                Tensor::stack(&dn, 0)?.into(),
                true,
            )
        };
        let all = Self {
            gate_up,
            gate_up_bias: None,
            down,
            down_bias: None,
            act: ExpertAct::Glu(act),
            inter,
            rank: None,
        };
        match (mine, w.shard()) {
            // already this rank's experts only
            (true, Some(sh)) => Ok(Self {
                rank: Some((sh.clone(), first)),
                ..all
            }),
            _ => all.keep_rank(w),
        }
    }

    /// Per-expert integer-quantized matrices kept as stored
    /// ([`Weights::int_expert_stack`]): all three projections of every expert, or None (then
    /// loaded dense).
    fn int_stacks(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        experts: usize,
    ) -> Result<Option<(ExpertMatrix, ExpertMatrix)>> {
        let names = |projs: &[&str]| -> Vec<String> {
            (0..experts)
                .flat_map(|e| {
                    projs
                        .iter()
                        .map(move |p| format!("{prefix}.experts.{e}.{p}.weight"))
                })
                .collect()
        };
        let (gu, dn) = (names(&["gate_proj", "up_proj"]), names(&["down_proj"]));
        // one storage per layer (the device kernels take one): all three kept, or none
        if !(w.int_keeps_stack(&gu, (inter, hidden))? && w.int_keeps_stack(&dn, (hidden, inter))?) {
            return Ok(None);
        }
        let gu = w.int_expert_stack(&gu, (inter, hidden))?;
        let dn = w.int_expert_stack(&dn, (hidden, inter))?;
        let affine = |w| ExpertMatrix::Affine {
            w: std::sync::Arc::new(w),
            experts,
        };
        Ok(Some((affine(gu), affine(dn))))
    }

    pub fn count(&self) -> usize {
        self.gate_up.dims().map_or(0, |d| d.0)
    }

    pub fn weight_bytes(&self) -> usize {
        let t = super::tensor_bytes;
        self.gate_up.bytes()
            + self.down.bytes()
            + self.gate_up_bias.as_ref().map_or(0, t)
            + self.down_bias.as_ref().map_or(0, t)
    }

    /// Expert `e` on its rows `x [m, hidden]` -> `[m, hidden]`.
    pub fn expert(&self, e: usize, x: &Tensor) -> Result<Tensor> {
        let mut gu = x.matmul(&self.gate_up.expert(e)?.t()?)?;
        if let Some(b) = &self.gate_up_bias {
            gu = gu.broadcast_add(&b.get(e)?)?;
        }
        let i = self.inter;
        let (g, u) = (gu.narrow(1, 0, i)?, gu.narrow(1, i, i)?);
        let h = match self.act {
            ExpertAct::Glu(a) => (a.apply(&g)? * u)?,
            ExpertAct::ClampedGlu { limit, alpha } => {
                let g = g.minimum(limit)?;
                let u = u.clamp(-limit, limit)?;
                let glu = (&g * candle_nn::ops::sigmoid(&(&g * alpha)?)?)?;
                ((u + 1.0)? * glu)?
            }
        };
        let mut y = h.matmul(&self.down.expert(e)?.t()?)?;
        if let Some(b) = &self.down_bias {
            y = y.broadcast_add(&b.get(e)?)?;
        }
        Ok(y)
    }

    /// `sum_e weight(row, e) * expert(e, x[rows of e])` for `x [n, hidden]`, experts taken in
    /// index order.
    /// (Expert parallelism: this rank's experts only, a partial sum; see [`Self::keep_rank`].)
    pub fn forward(&self, x: &Tensor, routes: &Routes) -> Result<Tensor> {
        let n = x.dim(0)?;
        let mut out = x.zeros_like()?;
        let (first, held) = match &self.rank {
            Some((_, first)) => (*first, self.count()),
            None => (0, routes.per_expert.len()),
        };
        for (e, rows) in routes.per_expert.iter().enumerate() {
            if rows.is_empty() || e < first || e >= first + held {
                continue;
            }
            let e = e - first;
            let wts: Vec<f32> = rows.iter().map(|r| r.1).collect();
            let wts = Tensor::from_vec(wts, (rows.len(), 1), x.device())?.to_dtype(x.dtype())?;
            // Rows are pushed in order, so all n of them means exactly 0..n.
            if rows.len() == n {
                out = (out + self.expert(e, x)?.broadcast_mul(&wts)?)?;
            } else {
                let ids: Vec<u32> = rows.iter().map(|r| r.0).collect();
                let ids = Tensor::from_vec(ids, rows.len(), x.device())?;
                let ye = self
                    .expert(e, &x.index_select(&ids, 0)?)?
                    .broadcast_mul(&wts)?;
                out = out.index_add(&ids, &ye, 0)?;
            }
        }
        Ok(out)
    }
}

/// The always-on expert of the Qwen hybrid and DeepSeek MoE blocks.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    pub mlp: GatedMlp,
    /// `[1, hidden]`: the output is scaled by `sigmoid(gate(x))` (Qwen); None = unscaled.
    pub gate: Option<Linear>,
}

impl SharedExpert {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.mlp.forward(x)?;
        Ok(match &self.gate {
            Some(g) => y.broadcast_mul(&candle_nn::ops::sigmoid(&g.forward(x)?)?)?,
            None => y,
        })
    }
    fn weight_bytes(&self) -> usize {
        self.mlp.weight_bytes() + self.gate.as_ref().map_or(0, Linear::weight_bytes)
    }
}

#[derive(Debug, Clone)]
pub struct SparseMoe {
    pub router: Router,
    pub experts: Experts,
    pub shared: Option<SharedExpert>,
}

impl SparseMoe {
    /// The Qwen layout under `{prefix}`: router `{prefix}.gate`, experts, and (when `c` has a
    /// shared width) `{prefix}.shared_expert` with its gate `{prefix}.shared_expert_gate`.
    pub fn load_qwen(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        c: &MoeConfig,
        renormalize: bool,
        act: Activation,
    ) -> Result<Self> {
        let shared = if c.shared_intermediate_size > 0 {
            let mut mlp = GatedMlp::load_whole(
                w,
                &format!("{prefix}.shared_expert"),
                hidden,
                c.shared_intermediate_size,
                false,
                act,
            )?;
            mlp.fuse()?;
            Some(SharedExpert {
                mlp,
                gate: Some(Linear::load(
                    w,
                    &format!("{prefix}.shared_expert_gate"),
                    hidden,
                    1,
                    false,
                )?),
            })
        } else {
            None
        };
        Ok(Self {
            router: Router::load(
                w,
                &format!("{prefix}.gate"),
                hidden,
                c.num_experts,
                false,
                Scoring::Softmax { renormalize },
                c.top_k,
            )?,
            experts: Experts::load(w, prefix, hidden, c.intermediate_size, c.num_experts, act)?,
            shared,
        })
    }

    pub fn weight_bytes(&self) -> usize {
        self.router.weight_bytes()
            + self.experts.weight_bytes()
            + self.shared.as_ref().map_or(0, SharedExpert::weight_bytes)
    }

    /// Bytes a forward of `rows` rows reads: everything but the routed experts, and of those
    /// the expected union under uniform routing, `E (1 - (1 - k/E)^rows)`.
    pub fn read_bytes(&self, rows: usize) -> f64 {
        let e = self.experts.count() as f64;
        let k = self.router.top_k as f64;
        let union = e * (1.0 - (1.0 - k / e).powi(rows.max(1) as i32));
        let per = self.experts.weight_bytes() as f64 / e;
        (self.weight_bytes() - self.experts.weight_bytes()) as f64 + union * per
    }

    /// `x [n, hidden] -> [n, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_routed(x, x)
    }

    /// Routed by `router_x`, computed on `x` (gemma4 routes on its own normed input). On CUDA
    /// (bf16, up to 16 rows) routing and the chosen experts run on the device in one op
    /// (`kernels/moe.cu`: each expert the rows route to is read once); elsewhere routing is
    /// on the host and each chosen expert runs on its rows ([`Experts::forward`]).
    pub fn forward_routed(&self, router_x: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (y, shared_in) = match self.forward_device(router_x, x)? {
            Some(y) => y,
            None => {
                let routes = self.router.route(router_x)?;
                let y = self.experts.forward(x, &routes)?;
                let y = match &self.experts.rank {
                    Some((sh, _)) => sh.all_reduce(&y)?,
                    None => y,
                };
                (y, false)
            }
        };
        Ok(match &self.shared {
            Some(s) if !shared_in => (y + s.forward(x)?)?,
            _ => y,
        })
    }
}

impl SparseMoe {
    /// The routed experts on the device, or None where the kernels do not apply; with
    /// whether the shared expert is in it ([`Self::shared_call`]).
    #[cfg(feature = "cuda")]
    fn forward_device(&self, router_x: &Tensor, x: &Tensor) -> Result<Option<(Tensor, bool)>> {
        use super::cuda::{ActMode, MoeCall, RouteMode};
        if !super::fused::allowed_part(crate::switches::Part::Moe)
            || self.experts.rank.is_some()
            || !x.device().is_cuda()
            || x.track_op()
            || x.dim(0)? > super::cuda::MOE_MAX_ROWS
        {
            return Ok(None);
        }
        let r = &self.router;
        let dev = x.device();
        let (corr, pe) = match r.device_tables.get() {
            Some(t) => t,
            None => {
                let up = |v: &[f32]| Tensor::from_slice(v, v.len(), dev);
                let corr = match &r.scoring {
                    Scoring::SigmoidGrouped { correction, .. } => Some(up(correction)?),
                    _ => None,
                };
                let pe = r.per_expert_scale.as_deref().map(up).transpose()?;
                r.device_tables.get_or_init(|| (corr, pe))
            }
        };
        let mode = match &r.scoring {
            Scoring::Softmax { renormalize } => RouteMode::Softmax {
                renormalize: *renormalize,
            },
            Scoring::TopKSoftmax => RouteMode::TopKSoftmax,
            Scoring::SigmoidGrouped {
                n_group,
                topk_group,
                renormalize,
                ..
            } => RouteMode::SigmoidGrouped {
                correction: corr.clone().expect("made with the tables"),
                n_group: *n_group,
                topk_group: *topk_group,
                renormalize: *renormalize,
            },
        };
        let e = &self.experts;
        let act = match e.act {
            ExpertAct::Glu(Activation::Silu) => ActMode::Silu,
            ExpertAct::Glu(Activation::GeluTanh) => ActMode::GeluTanh,
            ExpertAct::ClampedGlu { limit, alpha } => ActMode::ClampedGlu {
                limit: limit as f32,
                alpha: alpha as f32,
            },
        };
        let call = MoeCall {
            mode,
            top_k: r.top_k,
            per_expert_scale: pe.clone(),
            scale: r.scale,
            gate_up: e.gate_up.clone(),
            gate_up_bias: e.gate_up_bias.clone(),
            down: e.down.clone(),
            down_bias: e.down_bias.clone(),
            inter: e.inter,
            act,
            shared: self.shared_call(x.dim(1)?)?,
        };
        let with_shared = call.shared.is_some();
        // the kernel reads the router's output in its own dtype (no cast launch)
        let logits = r.projected(router_x)?;
        Ok(super::cuda::moe(x, &logits, &call)?.map(|y| (y, with_shared)))
    }

    /// The shared expert as one more slot of the device launches (its gate's sigmoid in the
    /// routing launch, its output in the combine: 4-8% off a Qwen3.5-35B-A3B / Qwen3-Next
    /// step on the H200, docs/perf.md session 30), where it
    /// has the routed experts' width and activation, its weights are dense bf16 without bias
    /// (gate/up stacked) and the tensor-core kernels run.
    #[cfg(feature = "cuda")]
    fn shared_call(&self, hidden: usize) -> Result<Option<super::cuda::SharedCall>> {
        let Some(s) = &self.shared else {
            return Ok(None);
        };
        let e = &self.experts;
        let dense = |l: &Linear| match l {
            Linear::Dense { weight, bias: None } if weight.dtype() == DType::BF16 => {
                Some(weight.clone())
            }
            _ => None,
        };
        let act_ok = matches!(
            (e.act, s.mlp.act),
            (ExpertAct::Glu(a), b) if a == b
        );
        // (the MXFP4 kernels take no shared expert: it runs as its own MLP then)
        let float = matches!(e.gate_up, ExpertMatrix::Float(_));
        if !act_ok || !float || !super::cuda::mma_widths(hidden, e.inter) {
            return Ok(None);
        }
        let (Some(gate_up), Some(down)) =
            (s.mlp.gate_up.as_ref().and_then(dense), dense(&s.mlp.down))
        else {
            return Ok(None);
        };
        if gate_up.dims() != [2 * e.inter, hidden] || down.dims() != [hidden, e.inter] {
            return Ok(None);
        }
        let gate = match &s.gate {
            None => None,
            Some(g) => match dense(g) {
                Some(w) if w.dims() == [1, hidden] => Some(w.reshape(hidden)?),
                _ => return Ok(None),
            },
        };
        Ok(Some(super::cuda::SharedCall {
            gate_up,
            down,
            gate,
        }))
    }

    #[cfg(not(feature = "cuda"))]
    fn forward_device(&self, _: &Tensor, _: &Tensor) -> Result<Option<(Tensor, bool)>> {
        Ok(None)
    }
}

/// A norm on the router's input (gemma4: `norm(x) * scale * hidden^-0.5`).
#[derive(Debug, Clone)]
pub struct RouterInput {
    pub norm: RmsNorm,
    pub scale: Tensor,
    pub root: f64,
}

impl RouterInput {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok((self.norm.forward(x)?.broadcast_mul(&self.scale)? * self.root)?)
    }
}

/// An error for a MoE layer that a config does not describe.
pub fn missing_moe(file: &str, layer: usize) -> Error {
    Error::config(
        file,
        "num_experts",
        format!("layer {layer} is a MoE layer but the config has no MoE settings"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn top_k_order_and_ties() {
        assert_eq!(top_k_desc(&[0.1, 0.5, 0.5, -1.0, 0.7], 3), vec![4, 1, 2]);
        assert_eq!(top_k_desc(&[1.0, 2.0], 5), vec![1, 0]);
    }

    fn router(scoring: Scoring, top_k: usize) -> Router {
        let w = Tensor::zeros((4, 2), DType::F32, &Device::Cpu).unwrap();
        Router {
            proj: Linear::dense(w, None),
            f32_input: false,
            scoring,
            top_k,
            scale: 1.0,
            per_expert_scale: None,
            device_tables: Default::default(),
        }
    }

    #[test]
    fn scorings_choose_as_the_families_do() {
        let l = [1.0f32, 3.0, 2.0, 0.0];
        // softmax over all, top 2, renormalized: e^3 / (e^3 + e^2), e^2 / (e^3 + e^2)
        let c = router(Scoring::Softmax { renormalize: true }, 2).choose(&l);
        assert_eq!(c.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        let want = 1.0 / (1.0 + (-1f32).exp());
        assert!((c[0].1 - want).abs() < 1e-6 && (c[0].1 + c[1].1 - 1.0).abs() < 1e-6);
        // not renormalized: the full-softmax probabilities
        let c = router(Scoring::Softmax { renormalize: false }, 2).choose(&l);
        let z: f32 = l.iter().map(|x| x.exp()).sum();
        assert!((c[0].1 - 3f32.exp() / z).abs() < 1e-6);
        // top-k logits then softmax equals the renormalized softmax
        let t = router(Scoring::TopKSoftmax, 2).choose(&l);
        assert!((t[0].1 - want).abs() < 1e-6);
        // grouped sigmoid: the correction picks, the raw score weighs
        let mut r = router(
            Scoring::SigmoidGrouped {
                correction: vec![10.0, 0.0, 0.0, 0.0],
                n_group: 2,
                topk_group: 1,
                renormalize: false,
            },
            1,
        );
        r.scale = 2.0;
        let g = r.choose(&l);
        assert_eq!(g[0].0, 0);
        assert!((g[0].1 - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn dispatch_weights_and_scatters() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &dev).unwrap();
        // expert 0: gate = up = identity rows -> silu(x) * x then identity down
        let eye = Tensor::new(&[[1f32, 0.], [0., 1.]], &dev).unwrap();
        let one = Tensor::cat(&[&eye, &eye], 0).unwrap();
        let gu = Tensor::stack(&[one.clone(), one], 0).unwrap();
        let down = Tensor::stack(&[eye.clone(), (eye.clone() * 2.0).unwrap()], 0).unwrap();
        let ex = Experts {
            gate_up: gu.into(),
            gate_up_bias: None,
            down: down.into(),
            down_bias: None,
            act: ExpertAct::Glu(Activation::Silu),
            inter: 2,
            rank: None,
        };
        let mut r = Routes::new(2);
        r.push(0, 0, 0.5);
        r.push(2, 0, 1.0);
        r.push(1, 1, 1.0);
        assert_eq!(r.used(), 2);
        let y = ex.forward(&x, &r).unwrap().to_vec2::<f32>().unwrap();
        let f = |v: f32| v * v / (1.0 + (-v).exp());
        let want = [
            [0.5 * f(1.), 0.5 * f(2.)],
            [2. * f(3.), 2. * f(4.)],
            [f(5.), f(6.)],
        ];
        for (a, b) in y.iter().zip(want) {
            for (p, q) in a.iter().zip(b) {
                assert!((p - q).abs() < 1e-5, "{y:?}");
            }
        }
    }
}
