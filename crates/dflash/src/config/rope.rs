//! RoPE parameters: parsing of both config spellings and the inverse frequencies that HF
//! computes for each rope type (default, linear, llama3, yarn with the mscale rules).

use super::Fields;
use crate::Result;

#[derive(Debug, Clone, PartialEq)]
pub enum RopeKind {
    Default,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: f64,
    },
    Yarn {
        factor: f64,
        original_max_position: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: bool,
    },
    /// Per-frequency divisors stored in GGUF files (`rope_freqs.weight`, llama3-style
    /// scaling precomputed by llama.cpp's converter): inv_freq[i] = plain[i] / factors[i].
    FreqFactors {
        factors: Vec<f64>,
    },
    /// transformers' `proportional` rope (gemma4 global layers): the first
    /// `floor(partial_rotary_factor * head_dim / 2)` frequencies have exponents over the whole
    /// `head_dim`, the remaining ones are zero (identity), and the rotate-half rotation spans
    /// the whole head, pairing dimensions `i` and `i + head_dim / 2`.
    Proportional {
        factor: f64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub kind: RopeKind,
    /// Fraction of head_dim that is rotated (1.0 for most models).
    pub partial_rotary_factor: f64,
}

impl RopeConfig {
    /// Parse `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
    /// (transformers 4). `max_pos` is the config's `max_position_embeddings`.
    pub fn parse(f: &Fields, max_pos: usize) -> Result<Self> {
        let params = f.sub("rope_parameters")?;
        let scaling = f.sub("rope_scaling")?;
        // A per-layer-type dict (gemma3 in transformers 5) is handled by the family; here we
        // take `full_attention` when present.
        let params = match params {
            Some(p) if p.has("full_attention") => p.sub("full_attention")?,
            p => p,
        };
        let theta = match &params {
            Some(p) if p.has("rope_theta") => p.opt_f64("rope_theta")?.unwrap(),
            _ => f.opt_f64("rope_theta")?.unwrap_or(10000.0),
        };
        if !(theta > 0.0) {
            return Err(f.err("rope_theta", format!("must be > 0, found {theta}")));
        }
        let partial_rotary_factor = match &params {
            Some(p) if p.has("partial_rotary_factor") => {
                p.opt_f64("partial_rotary_factor")?.unwrap()
            }
            _ => f.opt_f64("partial_rotary_factor")?.unwrap_or(1.0),
        };
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
            return Err(f.err(
                "partial_rotary_factor",
                format!("must be in (0, 1], found {partial_rotary_factor}"),
            ));
        }
        let s = params.or(scaling);
        let kind = match s {
            None => RopeKind::Default,
            Some(s) => Self::parse_kind(&s, max_pos)?,
        };
        Ok(RopeConfig {
            theta,
            kind,
            partial_rotary_factor,
        })
    }

    fn parse_kind(s: &Fields, max_pos: usize) -> Result<RopeKind> {
        let ty = match s.opt_str("rope_type")? {
            Some(t) => t,
            None => s.opt_str("type")?.unwrap_or("default"),
        };
        let factor = |s: &Fields| -> Result<f64> {
            let x = s
                .opt_f64("factor")?
                .ok_or_else(|| s.err("factor", format!("missing (required by rope type {ty})")))?;
            if !(x > 0.0) {
                return Err(s.err("factor", format!("must be > 0, found {x}")));
            }
            Ok(x)
        };
        Ok(match ty {
            "default" => RopeKind::Default,
            "linear" => RopeKind::Linear { factor: factor(s)? },
            "llama3" => RopeKind::Llama3 {
                factor: factor(s)?,
                low_freq_factor: s
                    .opt_f64("low_freq_factor")?
                    .ok_or_else(|| s.err("low_freq_factor", "missing (llama3 rope)"))?,
                high_freq_factor: s
                    .opt_f64("high_freq_factor")?
                    .ok_or_else(|| s.err("high_freq_factor", "missing (llama3 rope)"))?,
                original_max_position: s.opt_f64("original_max_position_embeddings")?.ok_or_else(
                    || s.err("original_max_position_embeddings", "missing (llama3 rope)"),
                )?,
            },
            "yarn" => {
                let factor = factor(s)?;
                // transformers 5.17 uses the explicit factor even when
                // max_position_embeddings / original_max_position_embeddings differs
                // (checked by the qwen3_yarn_tied golden).
                let original = s
                    .opt_f64("original_max_position_embeddings")?
                    .unwrap_or(max_pos as f64);
                RopeKind::Yarn {
                    factor,
                    original_max_position: original,
                    beta_fast: s.opt_f64("beta_fast")?.unwrap_or(32.0),
                    beta_slow: s.opt_f64("beta_slow")?.unwrap_or(1.0),
                    mscale: s.opt_f64("mscale")?,
                    mscale_all_dim: s.opt_f64("mscale_all_dim")?,
                    attention_factor: s.opt_f64("attention_factor")?,
                    truncate: s.opt_bool("truncate")?.unwrap_or(true),
                }
            }
            "freq_factors" => {
                let factors = match s.get("factors") {
                    Some(serde_json::Value::Array(a)) => a
                        .iter()
                        .map(|x| {
                            x.as_f64()
                                .ok_or_else(|| s.err("factors", "expected numbers"))
                        })
                        .collect::<Result<Vec<_>>>()?,
                    _ => return Err(s.err("factors", "missing (freq_factors rope)")),
                };
                RopeKind::FreqFactors { factors }
            }
            "proportional" => RopeKind::Proportional {
                factor: match s.opt_f64("factor")? {
                    Some(x) if !(x > 0.0) => {
                        return Err(s.err("factor", format!("must be > 0, found {x}")))
                    }
                    Some(x) => x,
                    None => 1.0,
                },
            },
            other => {
                return Err(s.err(
                    "rope_type",
                    format!(
                    "unsupported rope type `{other}` (supported: default, linear, llama3, yarn, proportional)"
                ),
                ))
            }
        })
    }

    /// Number of rotated dimensions for a head of `head_dim`.
    pub fn rotary_dim(&self, head_dim: usize) -> usize {
        let d = (head_dim as f64 * self.partial_rotary_factor) as usize;
        d - d % 2
    }

    /// Inverse frequencies (`rotary_dim / 2` of them) and the attention scaling factor that
    /// multiplies cos and sin, exactly as transformers computes them.
    pub fn inv_freq(&self, head_dim: usize) -> (Vec<f32>, f32) {
        if let RopeKind::Proportional { factor } = &self.kind {
            // Always head_dim / 2 frequencies: Rope then rotates the whole head.
            let angles = ((self.partial_rotary_factor * head_dim as f64) / 2.0).floor() as usize;
            let angles = angles.min(head_dim / 2);
            let base = self.theta as f32;
            let mut inv: Vec<f32> = (0..angles)
                .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
                .collect();
            inv.resize(head_dim / 2, 0.0);
            let factor = *factor as f32;
            return (inv.into_iter().map(|x| x / factor).collect(), 1.0);
        }
        let dim = self.rotary_dim(head_dim);
        let base = self.theta;
        // HF computes base ** (arange(0, dim, 2) / dim) in float32.
        let pos_freqs: Vec<f64> = (0..dim / 2)
            .map(|i| (base as f32).powf((2 * i) as f32 / dim as f32) as f64)
            .collect();
        let plain: Vec<f64> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        let (inv, scale) = match &self.kind {
            RopeKind::Default => (plain, 1.0),
            RopeKind::Linear { factor } => (plain.iter().map(|f| f / factor).collect(), 1.0),
            RopeKind::FreqFactors { factors } => (
                plain
                    .iter()
                    .enumerate()
                    .map(|(i, f)| f / factors.get(i).copied().unwrap_or(1.0))
                    .collect(),
                1.0,
            ),
            RopeKind::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let low_wavelen = original_max_position / low_freq_factor;
                let high_wavelen = original_max_position / high_freq_factor;
                let inv = plain
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (original_max_position / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
            RopeKind::Yarn {
                factor,
                original_max_position,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attn = match attention_factor {
                    Some(a) => *a,
                    None => match (mscale, mscale_all_dim) {
                        (Some(m), Some(ma)) if *m != 0.0 && *ma != 0.0 => {
                            get_mscale(*factor, *m) / get_mscale(*factor, *ma)
                        }
                        _ => get_mscale(*factor, 1.0),
                    },
                };
                let corr_dim = |rot: f64| {
                    (dim as f64 * (original_max_position / (rot * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (corr_dim(*beta_fast), corr_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(dim as f64 - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                let inv = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrap_factor = 1.0 - ramp;
                        let interp = 1.0 / (factor * p);
                        let extrap = 1.0 / p;
                        interp * (1.0 - extrap_factor) + extrap * extrap_factor
                    })
                    .collect();
                (inv, attn)
            }
            RopeKind::Proportional { .. } => unreachable!("handled above"),
        };
        (inv.into_iter().map(|x| x as f32).collect(), scale as f32)
    }
}
