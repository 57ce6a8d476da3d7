//! RMSNorm. Gemma-style `(1 + w)` weights are folded into `w` at load time, so the forward
//! pass is the same for every family.

use crate::source::Weights;
use crate::Result;
use candle_core::Tensor;

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f32,
}

impl RmsNorm {
    /// Load `{name}` of shape `[dim]`; `add_one` for HF Gemma checkpoints that store `w`
    /// of an `x * (1 + w)` norm.
    pub fn load(w: &Weights, name: &str, dim: usize, eps: f64, add_one: bool) -> Result<Self> {
        let mut weight = w.get(name, dim)?;
        if add_one {
            weight = (weight + 1.0)?;
        }
        Ok(Self {
            weight,
            eps: eps as f32,
        })
    }

    /// A norm without a learned scale (`with_scale=False`): a weight of ones.
    pub fn unit(
        dim: usize,
        eps: f64,
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> Result<Self> {
        Ok(Self {
            weight: Tensor::ones(dim, dtype, device)?,
            eps: eps as f32,
        })
    }

    pub fn weight_bytes(&self) -> usize {
        super::tensor_bytes(&self.weight)
    }

    /// `(res + delta, norm(res + delta))`: the residual update and the next norm, fused into
    /// one kernel where it can run (see `nn::fused`).
    pub fn add_forward(&self, res: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor)> {
        if let Some(r) = super::fused::add_rms_norm(res, delta, &self.weight, self.eps)? {
            return Ok(r);
        }
        let sum = (res + delta)?;
        let normed = self.forward(&sum)?;
        Ok((sum, normed))
    }

    /// Normalize over the last dimension. When autograd tracks `x` or the weight (draft
    /// training), the composite form runs: candle's fused kernel has no backward.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.track_op() || self.weight.track_op() {
            // training: one pass forward and one backward for f32 (the chain's backward goes
            // through broadcasting kernels)
            if super::train_ops::applies(x) && self.weight.dtype() == x.dtype() {
                return super::train_ops::rms_norm(x, &self.weight, self.eps);
            }
            return Ok(candle_nn::ops::rms_norm_slow(x, &self.weight, self.eps)?);
        }
        if crate::switches::fused_part(crate::switches::Part::Norm) {
            if let Some(y) = super::cpu_ops::rms_norm(x, &self.weight, self.eps)? {
                return Ok(y);
            }
        }
        let x = if x.is_contiguous() {
            x.clone()
        } else {
            x.contiguous()?
        };
        Ok(candle_nn::ops::rms_norm(&x, &self.weight, self.eps)?)
    }
}
