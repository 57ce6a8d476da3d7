//! Gated MLP: `down(act(gate(x)) * up(x))` (SwiGLU for silu, GeGLU-tanh for Gemma).

use super::Linear;
use crate::source::Weights;
use crate::{Error, Result};
use candle_core::{Tensor, D};

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
    /// `gate` and `up` stacked (see `fuse`): one matmul for both.
    pub gate_up: Option<Linear>,
    /// A tensor-parallel rank's MLP (its share of the units): `down`'s output is this rank's
    /// partial sum, all-reduced over the ranks.
    pub shard: Option<super::parallel::Shard>,
}

impl GatedMlp {
    /// From its three linears, gate and up stacked (see [`Self::fuse`]).
    pub fn new(gate: Linear, up: Linear, down: Linear, act: Activation) -> Result<Self> {
        let mut m = Self {
            gate,
            up,
            down,
            act,
            gate_up: None,
            shard: None,
        };
        m.fuse()?;
        Ok(m)
    }

    /// Load `{prefix}.{gate,up,down}_proj`; in a tensor-parallel load (`w.shard()`) this
    /// rank's share of the `inter` units (gate/up rows, down columns), `down`'s output
    /// all-reduced.
    pub fn load(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        bias: bool,
        act: Activation,
    ) -> Result<Self> {
        Self::load_as(w, prefix, hidden, inter, bias, act, true)
    }

    /// [`Self::load`] whole on every tensor-parallel rank (a MoE block's shared expert, which
    /// the block's own kernels take as whole weights: it stays with the routed experts).
    pub fn load_whole(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        bias: bool,
        act: Activation,
    ) -> Result<Self> {
        Self::load_as(w, prefix, hidden, inter, bias, act, false)
    }

    fn load_as(
        w: &Weights,
        prefix: &str,
        hidden: usize,
        inter: usize,
        bias: bool,
        act: Activation,
        split: bool,
    ) -> Result<Self> {
        use crate::source::Split;
        let lin = |n: &str, i, o, part| {
            let name = format!("{prefix}.{n}");
            match split {
                true => w.linear_split(&name, i, o, bias, part),
                false => w.linear(&name, i, o, bias),
            }
        };
        Ok(Self {
            gate: lin("gate_proj", hidden, inter, Split::Out)?,
            up: lin("up_proj", hidden, inter, Split::Out)?,
            down: lin("down_proj", inter, hidden, Split::In)?,
            act,
            gate_up: None,
            shard: w.shard().filter(|_| split).cloned(),
        })
    }

    /// Stack `gate` and `up` into one linear when [`Linear::concat`] can (dense, or quantized
    /// of one type on the CPU); the separate weights are then dropped, so memory does not grow.
    pub fn fuse(&mut self) -> Result<()> {
        if self.gate_up.is_none() {
            if let Some(f) = Linear::concat(&[&self.gate, &self.up])? {
                self.gate = self.gate.emptied()?;
                self.up = self.up.emptied()?;
                self.gate_up = Some(f);
            }
        }
        Ok(())
    }

    /// Every linear it holds (the stacked one included).
    pub fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        [&mut self.gate, &mut self.up, &mut self.down]
            .into_iter()
            .chain(self.gate_up.as_mut())
    }

    /// Parameters of a `hidden -> inter -> hidden` gated MLP.
    pub fn params(hidden: usize, inter: usize, bias: bool) -> u64 {
        let (h, i) = (hidden as u64, inter as u64);
        3 * h * i + if bias { 2 * i + h } else { 0 }
    }

    /// Bytes of weights held (the stacked gate/up included, the emptied parts at 0).
    pub fn weight_bytes(&self) -> usize {
        self.gate.weight_bytes()
            + self.up.weight_bytes()
            + self.down.weight_bytes()
            + self.gate_up.as_ref().map_or(0, Linear::weight_bytes)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_then(x, None)
    }

    /// [`Self::forward`], with a convolution of the down projection's output (a DFlash2 draft
    /// layer's `finish`) done with the projection (`nn::dyn_conv::project_then_conv`).
    pub fn forward_then(
        &self,
        x: &Tensor,
        after: Option<&super::dyn_conv::ConvAfter>,
    ) -> Result<Tensor> {
        let down = |h: &Tensor| {
            match (after, &self.shard) {
            (Some(c), None) => super::dyn_conv::project_then_conv(&self.down, h, c),
            (None, None) => self.down.forward(h),
            (None, Some(sh)) => sh.all_reduce(&self.down.forward(h)?),
            (Some(_), Some(_)) => Err(Error::input(
                "tensor parallel: a convolution after a sharded MLP (a DFlash2 draft layer) is not supported",
            )),
        }
        };
        let (g, u) = match &self.gate_up {
            Some(gu) => {
                let y = gu.forward(x)?;
                if let Some(h) = super::fused::gated(&y, self.act)? {
                    return down(&h);
                }
                let i = y.dim(D::Minus1)? / 2;
                (y.narrow(D::Minus1, 0, i)?, y.narrow(D::Minus1, i, i)?)
            }
            None => (self.gate.forward(x)?, self.up.forward(x)?),
        };
        let g = self.act.apply(&g)?;
        down(&(g * u)?)
    }
}
