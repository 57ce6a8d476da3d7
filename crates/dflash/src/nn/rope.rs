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
    /// These tables are rows `first ..` of one packed table made for a batch of sequences
    /// ([`Rope::tables_runs`]): `(that table, first)`. A batched kernel over all the
    /// sequences then reads the batch's table as it is instead of gathering the pieces.
    joint: Option<super::PartOf>,
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
            joint: None,
        }
    }

    /// The packed tables of several forwards' rows back to back (`[sum of lens, rotary_dim]`),
    /// for a kernel that runs them in one launch: the batch's table when `parts` are the runs
    /// of one [`Rope::tables_runs`] call in order, else the pieces concatenated. None when a
    /// part has no packed table.
    pub fn joint_packed(parts: &[&RopeTables]) -> Result<Option<Tensor>> {
        let mut packed = Vec::with_capacity(parts.len());
        for t in parts {
            match &t.packed {
                Some(p) if !t.by_position => packed.push((p, t.joint.as_ref())),
                _ => return Ok(None),
            }
        }
        if packed.is_empty() {
            return Ok(None);
        }
        Ok(Some(super::rejoin(&packed)?))
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

    /// Tables for several runs of positions `(start, len)` (the forwards of a batch of
    /// sequences), made at once: one upload of one packed table, each run's tables a view of
    /// its rows ([`RopeTables::joint_packed`] hands the batch's table back whole). Each run's
    /// rows are the ones [`Self::tables`] makes for it (the same bits).
    pub fn tables_runs(
        &self,
        runs: &[(usize, usize)],
        device: &Device,
        dtype: DType,
    ) -> Result<Vec<RopeTables>> {
        let positions: Vec<usize> = runs.iter().flat_map(|&(s, n)| s..s + n).collect();
        let all = self.tables_at(&positions, device, dtype)?;
        let half = self.inv_freq.len();
        let mut out = Vec::with_capacity(runs.len());
        let mut row = 0;
        for &(_, n) in runs {
            let span = row * half..(row + n) * half;
            out.push(RopeTables {
                host: std::sync::Arc::new((
                    all.host.0[span.clone()].to_vec(),
                    all.host.1[span].to_vec(),
                )),
                len: n,
                device: device.clone(),
                dtype,
                cos_sin: std::sync::OnceLock::new(),
                packed: all
                    .packed
                    .as_ref()
                    .map(|p| p.narrow(0, row, n))
                    .transpose()?,
                by_position: false,
                joint: all.packed.as_ref().map(|p| super::PartOf {
                    whole: p.clone(),
                    first: row,
                }),
            });
            row += n;
        }
        Ok(out)
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
            joint: None,
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
        if let Some(y) = self.apply_cpu(x, t)? {
            return Ok(y);
        }
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

    /// [`Self::apply`] for f32 on the CPU from the host tables: the same products as candle's
    /// rope kernel (`x1 cos - x2 sin`, `x1 sin + x2 cos`, the rest of a partial rotation
    /// copied), so the same bits, without its rayon dispatch: candle runs any rope of more than
    /// one position on rayon's pool, whose threads then fight the spinning worker of candle's
    /// barrier pool (the int8 products' and attention's) for the cores; on two cores that cost
    /// a verify block ~2 ms over 60 ropes (docs/perf.md, session 35). Small ropes run inline,
    /// larger ones on the barrier pool (`cpu_ops::for_items`). None where it does not apply.
    fn apply_cpu(&self, x: &Tensor, t: &RopeTables) -> Result<Option<Tensor>> {
        if !x.device().is_cpu()
            || x.dtype() != DType::F32
            || t.dtype != DType::F32
            || t.by_position
            || x.track_op()
            || !x.is_contiguous()
        {
            return Ok(None);
        }
        let (heads, len, d) = x.dims3()?;
        let half = self.rotary_dim / 2;
        let (cos, sin) = (&t.host.0, &t.host.1);
        if d != self.head_dim || len != t.len || cos.len() != len * half || sin.len() != cos.len() {
            return Err(crate::Error::input(format!(
                "rope: input {:?} against tables of {} positions x {half} for head_dim {}",
                x.dims(),
                t.len,
                self.head_dim
            )));
        }
        let (storage, layout) = x.storage_and_layout();
        let src = match &*storage {
            candle_core::Storage::Cpu(c) => &c.as_slice::<f32>()?[layout.start_offset()..],
            _ => return Ok(None),
        };
        let rotate = |row: usize, src: &[f32], dst: &mut [f32]| {
            let p = row % len;
            let (c, s) = (
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
            );
            for i in 0..half {
                let (x1, x2) = (src[i], src[i + half]);
                dst[i] = x1 * c[i] - x2 * s[i];
                dst[i + half] = x1 * s[i] + x2 * c[i];
            }
            dst[2 * half..].copy_from_slice(&src[2 * half..]);
        };
        // SAFETY: the rows 0 .. heads * len cover the buffer
        let [dst] = unsafe {
            super::cpu_ops::written(heads * len * d, |[out]| {
                super::cpu_ops::for_items(heads * len, d, |r| {
                    // SAFETY: row r, written by this item only.
                    rotate(r, &src[r * d..(r + 1) * d], out.span(r * d, d));
                })
            })
        };
        drop(storage);
        Ok(Some(Tensor::from_vec(dst, (heads, len, d), x.device())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RopeConfig, RopeKind};

    /// A batch's tables are each run's own tables (the same rows, bit for bit), and the joint
    /// table comes back whole only for the runs of one call in order; anything else is
    /// gathered (and equals the pieces back to back).
    #[test]
    fn batch_tables_are_each_runs_tables() {
        let dev = Device::Cpu;
        let cfg = RopeConfig {
            theta: 10_000.0,
            kind: RopeKind::Default,
            partial_rotary_factor: 0.5,
        };
        let rope = Rope::new(&cfg, 32);
        let runs = [(0, 3), (130, 1), (7, 0), (41, 5)];
        let batch = rope.tables_runs(&runs, &dev, DType::F32).unwrap();
        for (t, &(start, n)) in batch.iter().zip(&runs) {
            let alone = rope.tables(start, n, &dev, DType::F32).unwrap();
            assert_eq!(t.len(), n);
            assert_eq!(t.host, alone.host, "run at {start}");
        }
        // Packed tables exist on CUDA only; the joint logic is exercised on them there
        // (tests/fused_cuda.rs); here: no packed table, no joint table.
        let parts: Vec<&RopeTables> = batch.iter().collect();
        assert!(RopeTables::joint_packed(&parts).unwrap().is_none());
    }

    /// The CPU rotation gives candle's rope kernel's bits (and its composite form's), for full
    /// and partial rotations, one position and many, inline and on the pool.
    #[test]
    fn cpu_rope_equals_candles_bit_for_bit() {
        let dev = Device::Cpu;
        for (partial, heads, len, start) in [
            (1.0, 9, 1, 130),
            (1.0, 9, 16, 128),
            (0.5, 4, 7, 3),
            (1.0, 9, 600, 0),
            (0.25, 8, 300, 17),
        ] {
            let cfg = RopeConfig {
                theta: 10_000.0,
                kind: RopeKind::Default,
                partial_rotary_factor: partial,
            };
            let rope = Rope::new(&cfg, 64);
            let t = rope.tables(start, len, &dev, DType::F32).unwrap();
            let x = Tensor::randn(0f32, 1.0, (heads, len, 64), &dev).unwrap();
            let ours = rope
                .apply_cpu(&x, &t)
                .unwrap()
                .expect("f32 on the CPU applies");
            // candle's kernel, as `apply` ran it before
            let (cos, sin) = t.cos_sin().unwrap();
            let x4 = x.unsqueeze(0).unwrap();
            let r = rope.rotary_dim;
            let rot = x4.narrow(3, 0, r).unwrap().contiguous().unwrap();
            let theirs = Tensor::cat(
                &[
                    &candle_nn::rotary_emb::rope(&rot, cos, sin).unwrap(),
                    &x4.narrow(3, r, 64 - r).unwrap(),
                ],
                3,
            )
            .unwrap()
            .squeeze(0)
            .unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                v.iter().map(|f| f.to_bits()).collect()
            };
            assert_eq!(
                bits(&ours),
                bits(&theirs),
                "partial {partial}, {heads}x{len}"
            );
        }
    }
}
