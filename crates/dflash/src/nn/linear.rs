//! A linear layer whose weight is dense (any float dtype) or quantized (GGUF block types).

use crate::source::Weights;
use crate::Result;
use candle_core::quantized::QMatMul;
use candle_core::{Module, Tensor};

#[derive(Debug, Clone)]
pub enum Linear {
    /// `weight [out, in]` in the compute dtype.
    Dense {
        weight: Tensor,
        bias: Option<Tensor>,
    },
    /// A quantized weight; input and output stay in the compute dtype.
    Quant {
        weight: QMatMul,
        bias: Option<Tensor>,
        out_features: usize,
    },
}

impl Linear {
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear::Dense { weight, bias }
    }

    /// Load `{prefix}.weight [out, in]` (and `{prefix}.bias [out]` when `bias`).
    pub fn load(
        w: &Weights,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = w.get(&format!("{prefix}.weight"), (out_dim, in_dim))?;
        let bias = if bias {
            Some(w.get(&format!("{prefix}.bias"), out_dim)?)
        } else {
            None
        };
        Ok(Linear::Dense { weight, bias })
    }

    pub fn out_features(&self) -> usize {
        match self {
            Linear::Dense { weight, .. } => weight.dims()[0],
            Linear::Quant { out_features, .. } => *out_features,
        }
    }

    /// `x [n, in] -> [n, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (y, bias) = match self {
            Linear::Dense { weight, bias } => (x.matmul(&weight.t()?)?, bias),
            Linear::Quant { weight, bias, .. } => (weight.forward(x)?, bias),
        };
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
