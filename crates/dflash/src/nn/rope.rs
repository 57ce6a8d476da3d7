//! Rotary position embeddings, rotate-half ("neox") layout, at absolute positions.
//!
//! cos/sin rows are computed per forward for exactly the positions it covers (no
//! max-position table), so long contexts cost nothing up front.

use crate::config::RopeConfig;
use crate::Result;
use candle_core::{DType, Device, Tensor};

#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// Multiplies cos and sin (yarn's attention factor; 1 otherwise).
    scale: f32,
    pub head_dim: usize,
    pub rotary_dim: usize,
}

/// cos/sin for a run of positions: `[len, rotary_dim / 2]` each, uploaded on first use (a
/// forward that runs only fused kernels never needs them: two uploads and two casts fewer
/// per table).
#[derive(Debug, Clone)]
pub struct RopeTables {
    host: std::sync::Arc<(Vec<f32>, Vec<f32>)>,
    len: usize,
    device: Device,
    dtype: DType,
    cos_sin: std::sync::OnceLock<(Tensor, Tensor)>,
    /// `[len, rotary_dim]` = `cos | sin` per row in the compute dtype, for the fused CUDA
    /// kernels (built only where they can run).
    pub packed: Option<Tensor>,
    /// `packed` is a table over absolute positions (row p for position p), for a forward
    /// whose positions live on the device (`nn::fused::DeviceStep`); there are no host rows.
    pub by_position: bool,
}

impl RopeTables {
    /// Positions (rows) the tables cover.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tables for `len` rows whose positions live on the device: `table` is
    /// [`Rope::position_table`]'s.
    pub fn by_position(table: Tensor, len: usize) -> Self {
        Self {
            host: std::sync::Arc::new((vec![], vec![])),
            len,
            device: table.device().clone(),
            dtype: table.dtype(),
            cos_sin: std::sync::OnceLock::new(),
            packed: Some(table),
            by_position: true,
        }
    }

    /// The `(cos, sin)` tensors in the compute dtype.
    pub fn cos_sin(&self) -> Result<&(Tensor, Tensor)> {
        if let Some(cs) = self.cos_sin.get() {
            return Ok(cs);
        }
        if self.by_position {
            return Err(crate::Error::input(
                "rope: a forward with positions on the device (a CUDA graph step) reached a path other than the fused kernels; run with DFLASH_CUDA_GRAPHS=0 and report this",
            ));
        }
        let half = self.host.0.len() / self.len.max(1);
        let up = |v: &Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_slice(v, (self.len, half), &self.device)?.to_dtype(self.dtype)?)
        };
        let cs = (up(&self.host.0)?, up(&self.host.1)?);
        Ok(self.cos_sin.get_or_init(|| cs))
    }
}

impl Rope {
    pub fn new(cfg: &RopeConfig, head_dim: usize) -> Self {
        let (inv_freq, scale) = cfg.inv_freq(head_dim);
        Self {
            rotary_dim: 2 * inv_freq.len(),
            inv_freq,
            scale,
            head_dim,
        }
    }

    /// Tables for positions `start .. start + len`.
    pub fn tables(
        &self,
        start: usize,
        len: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<RopeTables> {
        let positions: Vec<usize> = (start..start + len).collect();
        self.tables_at(&positions, device, dtype)
    }

    /// Tables for arbitrary positions (one row per entry of `positions`), e.g. the blocks of
    /// a training batch that sit at different anchors.
    pub fn tables_at(
        &self,
        positions: &[usize],
        device: &Device,
        dtype: DType,
    ) -> Result<RopeTables> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                // HF multiplies position and inverse frequency in float32.
                let a = (p as f32) * f;
                cos.push(a.cos() * self.scale);
                sin.push(a.sin() * self.scale);
            }
        }
        let n = positions.len();
        let packed = if device.is_cuda() && dtype == DType::BF16 && super::fused::allowed() {
            let mut v = Vec::with_capacity(n * 2 * half);
            for r in 0..n {
                let row = r * half..(r + 1) * half;
                v.extend(cos[row.clone()].iter().map(|&x| ::half::bf16::from_f32(x)));
                v.extend(sin[row].iter().map(|&x| ::half::bf16::from_f32(x)));
            }
            Some(Tensor::from_vec(v, (n, 2 * half), device)?)
        } else {
            None
        };
        Ok(RopeTables {
            host: std::sync::Arc::new((cos, sin)),
            len: n,
            device: device.clone(),
            dtype,
            cos_sin: std::sync::OnceLock::new(),
            packed,
            by_position: false,
        })
    }

    /// The fused kernels' packed table (`cos | sin`) of positions `0 .. len`, row p for
    /// position p: each row is the one [`Self::tables`] makes for that position (the same
    /// products in f32, the same rounding), so a step that reads its rows from here by position
    /// gives the same bits. None where the fused kernels do not run.
    pub fn position_table(
        &self,
        len: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Option<Tensor>> {
        Ok(self.tables(0, len, device, dtype)?.packed)
    }

    /// Rotate `x [heads, len, head_dim]` (contiguous) by the tables of its positions. When
    /// autograd tracks `x` (draft training) the composite form runs (the fused kernel has no
    /// backward).
    pub fn apply(&self, x: &Tensor, t: &RopeTables) -> Result<Tensor> {
        let x4 = x.unsqueeze(0)?;
        let (cos, sin) = t.cos_sin()?;
        let rope = |x: &Tensor| -> Result<Tensor> {
            Ok(if x.track_op() {
                candle_nn::rotary_emb::rope_slow(x, cos, sin)?
            } else {
                candle_nn::rotary_emb::rope(x, cos, sin)?
            })
        };
        let out = if self.rotary_dim == self.head_dim {
            rope(&x4)?
        } else {
            let rot = x4.narrow(3, 0, self.rotary_dim)?.contiguous()?;
            let pass = x4.narrow(3, self.rotary_dim, self.head_dim - self.rotary_dim)?;
            let rot = rope(&rot)?;
            Tensor::cat(&[&rot, &pass], 3)?
        };
        Ok(out.squeeze(0)?)
    }
}
