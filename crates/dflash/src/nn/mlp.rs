//! Gated MLP: `down(act(gate(x)) * up(x))` (SwiGLU for silu, GeGLU-tanh for Gemma).

use super::Linear;
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::Tensor;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
}

impl Activation {
    pub fn parse(file: &str, s: &str) -> Result<Self> {
        match s {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_tanh" | "gelu_new" => Ok(Activation::GeluTanh),
            other => Err(Error::config(
                file,
                "hidden_act",
                format!("unsupported activation `{other}` (supported: silu, gelu_pytorch_tanh)"),
            )),
        }
    }
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Activation::Silu => candle_nn::ops::silu(x)?,
            Activation::GeluTanh => x.gelu()?,
        })
    }
}

#[derive(Debug, Clone)]
pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub act: Activation,
}

impl GatedMlp {
    /// Load `{prefix}.{gate,up,down}_proj`.
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        bias: bool,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self {
            gate: Linear::load(w, &format!("{prefix}.gate_proj"), hidden, inter, bias)?,
            up: Linear::load(w, &format!("{prefix}.up_proj"), hidden, inter, bias)?,
            down: Linear::load(w, &format!("{prefix}.down_proj"), inter, hidden, bias)?,
            act,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let g = self.act.apply(&self.gate.forward(x)?)?;
        let u = self.up.forward(x)?;
        self.down.forward(&(g * u)?)
    }
}
