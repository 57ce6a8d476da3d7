//! Mixture-of-experts plumbing shared by the families whose routers differ (gpt-oss: top-k
//! logits then softmax, with a router bias; deepseek_v3: sigmoid scores, grouped top-k and a
//! correction bias): per-row choices -> per-expert row lists -> one batched call per selected
//! expert, weighted and scattered back with `index_add`.
//!
//! Routing happens on the host from an f32 `[rows, experts]` copy (batch 1: a handful of rows).

use crate::Result;
use candle_core::Tensor;

/// Indices of the `k` largest values, descending; ties go to the lower index (torch.topk).
pub fn top_k_desc(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
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

    /// `sum_e weight(row, e) * expert(e, x[rows of e])` for `x [n, hidden]`, experts taken in
    /// index order (as transformers loops over them).
    pub fn dispatch(
        &self,
        x: &Tensor,
        expert: impl Fn(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let mut out = x.zeros_like()?;
        for (e, rows) in self.per_expert.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let wts: Vec<f32> = rows.iter().map(|r| r.1).collect();
            let wts = Tensor::from_vec(wts, (rows.len(), 1), x.device())?.to_dtype(x.dtype())?;
            // Rows are pushed in order, so all n of them means exactly 0..n.
            if rows.len() == n {
                let ye = expert(e, x)?.broadcast_mul(&wts)?;
                out = (out + ye)?;
            } else {
                let ids: Vec<u32> = rows.iter().map(|r| r.0).collect();
                let ids = Tensor::from_vec(ids, rows.len(), x.device())?;
                let ye = expert(e, &x.index_select(&ids, 0)?)?.broadcast_mul(&wts)?;
                out = out.index_add(&ids, &ye, 0)?;
            }
        }
        Ok(out)
    }
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

    #[test]
    fn dispatch_weights_and_scatters() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &dev).unwrap();
        let mut r = Routes::new(2);
        r.push(0, 0, 0.5);
        r.push(2, 0, 2.0);
        for row in 0..3 {
            r.push(row, 1, 1.0);
        }
        // expert 0 doubles, expert 1 negates
        let y = r
            .dispatch(&x, |e, xe| Ok(if e == 0 { (xe * 2.0)? } else { xe.neg()? }))
            .unwrap();
        assert_eq!(
            y.to_vec2::<f32>().unwrap(),
            vec![vec![0., 0.], vec![-3., -4.], vec![15., 18.]]
        );
    }
}
