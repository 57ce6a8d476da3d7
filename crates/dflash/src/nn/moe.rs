//! Sparse mixture-of-experts feed-forward: softmax router over E experts, top-k per token,
//! optional renormalization of the k weights (`norm_topk_prob`), gated-MLP experts.
//!
//! Routing happens on the host (a `[tokens, E]` copy); each selected expert runs once on the
//! rows routed to it and its weighted output is scattered back with `index_add`.

use super::{Activation, GatedMlp, Linear};
use crate::source::Weights;
use crate::Result;
use candle_core::{DType, Tensor};

#[derive(Debug, Clone)]
pub struct SparseMoe {
    pub router: Linear,
    pub experts: Vec<GatedMlp>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

impl SparseMoe {
    /// Load `{prefix}.gate.weight [E, H]` and the experts, either per expert
    /// (`{prefix}.experts.{e}.{gate,up,down}_proj.weight`, the checkpoint layout) or stacked
    /// (`{prefix}.experts.gate_up_proj [E, 2I, H]`, `{prefix}.experts.down_proj [E, H, I]`,
    /// transformers 5's in-memory layout).
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        num_experts: usize,
        top_k: usize,
        norm_topk_prob: bool,
        act: Activation,
    ) -> Result<Self> {
        let router = Linear::load(w, &format!("{prefix}.gate"), hidden, num_experts, false)?;
        let stacked = format!("{prefix}.experts.gate_up_proj");
        let experts = if w.contains(&stacked) {
            let gu = w.get(&stacked, (num_experts, 2 * inter, hidden))?;
            let down = w.get(
                &format!("{prefix}.experts.down_proj"),
                (num_experts, hidden, inter),
            )?;
            (0..num_experts)
                .map(|e| {
                    let g = gu.get(e)?;
                    Ok(GatedMlp {
                        gate: Linear::dense(g.narrow(0, 0, inter)?.contiguous()?, None),
                        up: Linear::dense(g.narrow(0, inter, inter)?.contiguous()?, None),
                        down: Linear::dense(down.get(e)?.contiguous()?, None),
                        act,
                        gate_up: None,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..num_experts)
                .map(|e| {
                    GatedMlp::load(
                        w,
                        &format!("{prefix}.experts.{e}"),
                        hidden,
                        inter,
                        false,
                        act,
                    )
                })
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Self {
            router,
            experts,
            top_k,
            norm_topk_prob,
        })
    }

    /// `x [n, hidden] -> [n, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let probs =
            candle_nn::ops::softmax_last_dim(&self.router.forward(x)?.to_dtype(DType::F32)?)?;
        let probs = probs.to_vec2::<f32>()?;
        // per expert: (row, weight)
        let mut routed: Vec<Vec<(u32, f32)>> = vec![vec![]; self.experts.len()];
        for (row, p) in probs.iter().enumerate() {
            let mut idx: Vec<usize> = (0..p.len()).collect();
            // descending probability, ties -> lower expert id (torch.topk order)
            idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            idx.truncate(self.top_k);
            let sum: f32 = idx.iter().map(|&e| p[e]).sum();
            for &e in &idx {
                let wgt = if self.norm_topk_prob {
                    p[e] / sum
                } else {
                    p[e]
                };
                routed[e].push((row as u32, wgt));
            }
        }
        let mut out = x.zeros_like()?;
        for (e, rows) in routed.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let ids: Vec<u32> = rows.iter().map(|r| r.0).collect();
            let wts: Vec<f32> = rows.iter().map(|r| r.1).collect();
            let ids = Tensor::from_vec(ids, rows.len(), x.device())?;
            let wts = Tensor::from_vec(wts, (rows.len(), 1), x.device())?.to_dtype(x.dtype())?;
            let xe = if rows.len() == n && n == 1 {
                x.clone()
            } else {
                x.index_select(&ids, 0)?
            };
            let ye = self.experts[e].forward(&xe)?.broadcast_mul(&wts)?;
            out = out.index_add(&ids, &ye, 0)?;
        }
        Ok(out)
    }
}
