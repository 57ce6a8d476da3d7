//! A linear layer whose weight is dense (any float dtype) or quantized (GGUF block types).

use crate::source::Weights;
use crate::Result;
use candle_core::quantized::QMatMul;
use candle_core::{DType, Module, Tensor};

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

    /// Load `{prefix}.weight [out, in]` (and `{prefix}.bias [out]` when `bias`): dense, or
    /// quantized for quantized GGUF weights (see [`Weights::linear`]).
    pub fn load(
        w: &Weights,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        w.linear(prefix, in_dim, out_dim, bias)
    }

    /// Several dense linears with the same input as one (weights stacked along the output
    /// dim, biases too): one matmul launch instead of several, and a longer GEMV. None when
    /// any part is quantized or the biases are mixed.
    pub fn concat(parts: &[&Linear]) -> Result<Option<Linear>> {
        let mut ws = Vec::new();
        let mut bs = Vec::new();
        for p in parts {
            match p {
                Linear::Dense { weight, bias } => {
                    ws.push(weight.clone());
                    if let Some(b) = bias {
                        bs.push(b.clone());
                    }
                }
                Linear::Quant { .. } => return Ok(None),
            }
        }
        if !bs.is_empty() && bs.len() != ws.len() {
            return Ok(None);
        }
        let weight = Tensor::cat(&ws, 0)?;
        let bias = if bs.is_empty() {
            None
        } else {
            Some(Tensor::cat(&bs, 0)?)
        };
        Ok(Some(Linear::Dense { weight, bias }))
    }

    /// Output rows `start .. start + len` of a dense linear as a linear of its own, sharing
    /// the weight (a view, no copy). None for quantized weights.
    pub fn rows(&self, start: usize, len: usize) -> Result<Option<Linear>> {
        match self {
            Linear::Dense { weight, bias } => Ok(Some(Linear::Dense {
                weight: weight.narrow(0, start, len)?,
                bias: bias.as_ref().map(|b| b.narrow(0, start, len)).transpose()?,
            })),
            Linear::Quant { .. } => Ok(None),
        }
    }

    /// A 0x0 dense stand-in for a linear whose weight moved into a fused one (frees it).
    pub fn emptied(&self) -> Result<Linear> {
        let (dtype, device) = match self {
            Linear::Dense { weight, .. } => (weight.dtype(), weight.device().clone()),
            Linear::Quant { .. } => (DType::F32, candle_core::Device::Cpu),
        };
        Ok(Linear::Dense {
            weight: Tensor::zeros((0, 0), dtype, &device)?,
            bias: None,
        })
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
            Linear::Dense { weight, bias } => {
                // CUDA, batch-invariant mode (`DFLASH_BATCH_INVARIANT=1`): 1..=16 rows through
                // the tensor-core skinny GEMM, whose bits for a row do not depend on the rows
                // beside it (a verify reproduces the decode steps). Otherwise the GEMV kernel
                // for one row and cuBLAS above it (faster, not batch-invariant).
                #[cfg(feature = "cuda")]
                if let Some(y) = super::cuda::mma(x, weight)? {
                    return Ok(match bias {
                        Some(b) => y.broadcast_add(b)?,
                        None => y,
                    });
                }
                #[cfg(feature = "cuda")]
                if let Some(y) = super::cuda::gemv(x, weight)? {
                    return Ok(match bias {
                        Some(b) => y.broadcast_add(b)?,
                        None => y,
                    });
                }
                (x.matmul(&weight.t()?)?, bias)
            }
            Linear::Quant { weight, bias, .. } => {
                // candle's quantized CPU kernels take f32 activations.
                let y = if x.dtype() == DType::F32 {
                    weight.forward(x)?
                } else {
                    weight
                        .forward(&x.to_dtype(DType::F32)?)?
                        .to_dtype(x.dtype())?
                };
                (y, bias)
            }
        };
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
