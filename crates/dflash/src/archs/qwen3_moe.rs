//! Qwen3-MoE (`model_type: qwen3_moe`): the qwen3 decoder with a sparse MoE feed-forward
//! (softmax router, top-k experts, `norm_topk_prob`) on the layers selected by
//! `decoder_sparse_step` and `mlp_only_layers`; no shared expert.

use super::decoder::{DecoderModel, DecoderSpec, MoeSpec};
use super::TargetModel;
use crate::config::{Fields, TargetConfig};
use crate::source::Weights;
use crate::Result;

pub fn moe_spec(cfg: &TargetConfig) -> Result<MoeSpec> {
    let f = Fields::new(&cfg.file, &cfg.raw)?;
    let f = match f.sub("text_config")? {
        Some(t) => t,
        None => f,
    };
    // transformers 5 writes `num_local_experts`; checkpoints on the hub say `num_experts`.
    let num_experts = match f.opt_usize("num_experts")? {
        Some(n) => n,
        None => f.pos_usize("num_local_experts")?,
    };
    if num_experts == 0 {
        return Err(f.err("num_experts", "must be > 0"));
    }
    let top_k = f.pos_usize("num_experts_per_tok")?;
    if top_k > num_experts {
        return Err(f.err(
            "num_experts_per_tok",
            format!("{top_k} > num_experts {num_experts}"),
        ));
    }
    let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1);
    let mlp_only = f.opt_usize_list("mlp_only_layers")?.unwrap_or_default();
    let layers = (0..cfg.num_hidden_layers)
        .map(|i| !mlp_only.contains(&i) && (i + 1) % step == 0)
        .collect();
    Ok(MoeSpec {
        num_experts,
        top_k,
        norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(false),
        intermediate_size: f.pos_usize("moe_intermediate_size")?,
        layers,
    })
}

pub fn load(cfg: &TargetConfig, w: &Weights) -> Result<Box<dyn TargetModel>> {
    let spec = DecoderSpec {
        qk_norm: true,
        moe: Some(moe_spec(cfg)?),
        ..DecoderSpec::new("qwen3_moe")
    };
    Ok(Box::new(DecoderModel::load(cfg, w, spec)?))
}
