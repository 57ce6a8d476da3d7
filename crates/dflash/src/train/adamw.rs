//! AdamW whose state can be saved and restored, so a training run can resume where a
//! checkpoint left it (candle's `AdamW` keeps its moments private). The update is candle's,
//! operation for operation: `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`, then
//! `theta = theta (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)`.

use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

pub struct AdamW {
    /// (name, parameter, first moment, second moment)
    vars: Vec<(String, Var, Var, Var)>,
    pub lr: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Updates made (the bias corrections' t).
    pub t: usize,
}

impl AdamW {
    /// Zero moments for every named parameter; candle's default betas and eps.
    pub fn new(vars: &[(String, Var)], lr: f64, weight_decay: f64) -> Result<Self> {
        let vars = vars
            .iter()
            .map(|(n, v)| {
                let z = || Var::zeros(v.shape(), v.dtype(), v.device());
                Ok((n.clone(), v.clone(), z()?, z()?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW {
            vars,
            lr,
            weight_decay,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            t: 0,
        })
    }

    /// One update from `grads` (parameters without a gradient are left alone).
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.t += 1;
        let (b1, b2) = (self.beta1, self.beta2);
        let scale_m = 1.0 / (1.0 - b1.powi(self.t as i32));
        let scale_v = 1.0 / (1.0 - b2.powi(self.t as i32));
        for (_, theta, m, v) in &self.vars {
            let Some(g) = grads.get(theta) else { continue };
            let next_m = ((m.as_tensor() * b1)? + (g * (1.0 - b1))?)?;
            let next_v = ((v.as_tensor() * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let next = (theta.as_tensor() * (1.0 - self.lr * self.weight_decay))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + self.eps)?)?;
            let next = (next - (adjusted * self.lr)?)?;
            m.set(&next_m)?;
            v.set(&next_v)?;
            theta.set(&next)?;
        }
        Ok(())
    }

    /// The parameters and both moments as one safetensors file (`p.NAME`, `m.NAME`, `v.NAME`,
    /// full precision).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut t = HashMap::new();
        for (n, p, m, v) in &self.vars {
            for (k, x) in [("p", p), ("m", m), ("v", v)] {
                t.insert(format!("{k}.{n}"), x.as_tensor().to_device(&Device::Cpu)?);
            }
        }
        candle_core::safetensors::save(&t, path)
            .map_err(|e| Error::weights(path.display().to_string(), e.to_string()))
    }

    /// Restore what [`AdamW::save`] wrote: every parameter and moment must be there with the
    /// same shape (a checkpoint of another draft shape is refused, naming the tensor).
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let file = path.display().to_string();
        let dev = self
            .vars
            .first()
            .map(|v| v.1.device().clone())
            .unwrap_or(Device::Cpu);
        let t = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| Error::weights(file.clone(), e.to_string()))?;
        for (n, p, m, v) in &self.vars {
            for (k, x) in [("p", p), ("m", m), ("v", v)] {
                let key = format!("{k}.{n}");
                let s: &Tensor = t.get(&key).ok_or_else(|| {
                    Error::weights(
                        file.clone(),
                        format!("{key} missing: the checkpoint is of another draft (resume with the flags it was trained with)"),
                    )
                })?;
                if s.shape() != x.shape() {
                    return Err(Error::weights(
                        file.clone(),
                        format!(
                            "{key} is {:?}, the draft's is {:?}: resume with the flags it was trained with",
                            s.dims(),
                            x.dims()
                        ),
                    ));
                }
                x.set(&s.to_dtype(x.dtype())?.to_device(&dev)?)?;
            }
        }
        Ok(())
    }
}
