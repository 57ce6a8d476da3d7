//! Shared layers, written once and used by every target family and by the draft:
//! linear (dense or quantized), RMSNorm, RoPE, attention with a croppable KV cache, gated MLP;
//! for the hybrid families, gated attention and the Gated DeltaNet with its recurrent cache.
//!
//! Activations are 2-D `[tokens, features]` (batch 1): the engine decodes one sequence.
//! Every layer reports the bytes of weights it holds (`weight_bytes`), fused copies included,
//! so a family's sizing is the sum of its layers'.

pub mod affine;
pub mod attention;
pub mod cpu_attention;
pub mod cpu_ops;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dyn_conv;
pub mod embedding;
pub mod fp8;
pub mod fused;
pub mod gated_delta;
pub mod gguf_affine;
pub mod kv_cache;
pub mod latent_cache;
pub mod linear;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod mxfp4;
pub mod norm;
pub mod parallel;
pub mod q8;
pub mod quant;
pub mod recurrent_cache;
pub mod rope;
pub mod train_ops;

pub use affine::AffineWeight;
pub use attention::{
    attend, attention_mask, sdpa, sdpa_blocks, sdpa_with_sinks, Attention, AttentionSpec, Masks,
    Props, Site, Visibility,
};
pub use dyn_conv::dyn_conv;
pub use embedding::Embedding;
pub use fp8::Fp8Weight;
pub use gated_delta::{ChunkMasks, GatedDeltaNet, GatedDeltaSpec, InProjLayout};
pub use kv_cache::KvCache;
pub use latent_cache::LatentCache;
pub use linear::Linear;
pub use mla::{LatentAttention, MlaShape, QProj};
pub use mlp::{Activation, GatedMlp};
pub use moe::{ExpertMatrix, Experts, MoeConfig, Router, SparseMoe};
pub use mxfp4::Mxfp4Stack;
pub use norm::RmsNorm;
pub use recurrent_cache::RecurrentCache;
pub use rope::{Rope, RopeTables};

/// Bytes of a tensor's elements.
pub fn tensor_bytes(t: &candle_core::Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Parameters of a model or layer by how a checkpoint may store them (sizing from a config).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Params {
    /// Weights stored in the checkpoint's float dtype.
    pub plain: u64,
    /// Routed-expert matrices (what MXFP4 / int4 checkpoints quantize).
    pub experts: u64,
    /// Of `experts`, those whose widths the affine MoE kernels take (`nn::moe::ExpertMatrix::
    /// Affine`: in-widths multiples of 128), so that a 4-bit MLX checkpoint keeps them as
    /// stored on CUDA.
    pub affine_experts: u64,
}

impl Params {
    pub fn total(&self) -> u64 {
        self.plain + self.experts
    }
}

impl std::ops::AddAssign for Params {
    fn add_assign(&mut self, o: Params) {
        self.plain += o.plain;
        self.experts += o.experts;
        self.affine_experts += o.affine_experts;
    }
}

/// Rows `rows` of `t [n, ..]` in that order, in one op: `t` itself when they are all its rows
/// in order, a view when they are consecutive, else one gather (one upload of the indices)
/// instead of a copy per piece.
pub fn gather_rows(t: &candle_core::Tensor, rows: &[usize]) -> crate::Result<candle_core::Tensor> {
    let n = t.dim(0)?;
    if let Some(&r) = rows.iter().find(|&&r| r >= n) {
        return Err(crate::Error::input(format!(
            "gather_rows: row {r} of a tensor of {n} rows"
        )));
    }
    let consecutive = rows.windows(2).all(|w| w[1] == w[0] + 1);
    Ok(match rows.first() {
        Some(&first) if consecutive => {
            if first == 0 && rows.len() == n {
                t.clone()
            } else {
                t.narrow(0, first, rows.len())?
            }
        }
        _ => {
            let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let idx = candle_core::Tensor::from_vec(idx, rows.len(), t.device())?;
            t.index_select(&idx, 0)?
        }
    })
}

/// Where a tensor sits in a larger one made for a batch of sequences: it is rows `first ..`
/// of `whole`. Kept beside the part so that the parts, handed back together in order, are the
/// batch's tensor again ([`rejoin`]) instead of a copy of every piece.
#[derive(Debug, Clone)]
pub struct PartOf {
    pub whole: candle_core::Tensor,
    pub first: usize,
}

/// The parts' rows back to back: `whole` itself when the parts are, in order, every row of one
/// batch tensor (nothing copied), else their concatenation.
pub fn rejoin(
    parts: &[(&candle_core::Tensor, Option<&PartOf>)],
) -> crate::Result<candle_core::Tensor> {
    if let Some((_, Some(first))) = parts.first() {
        let mut row = 0;
        let mut in_order = true;
        for (t, p) in parts {
            match p {
                Some(p) if p.whole.id() == first.whole.id() && p.first == row => row += t.dim(0)?,
                _ => {
                    in_order = false;
                    break;
                }
            }
        }
        if in_order && row == first.whole.dim(0)? {
            return Ok(first.whole.clone());
        }
    }
    Ok(match parts {
        [] => {
            return Err(crate::Error::input("rejoin: no parts"));
        }
        [(t, _)] => (*t).clone(),
        _ => {
            let ts: Vec<&candle_core::Tensor> = parts.iter().map(|(t, _)| *t).collect();
            candle_core::Tensor::cat(&ts, 0)?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn t(rows: usize, seed: f32) -> Tensor {
        Tensor::arange(0f32, (rows * 3) as f32, &Device::Cpu)
            .unwrap()
            .affine(1.0, seed as f64)
            .unwrap()
            .reshape((rows, 3))
            .unwrap()
    }

    /// The parts of one batch tensor, in order and complete, come back as that tensor (no
    /// copy); out of order, incomplete or from other tensors, as their concatenation.
    #[test]
    fn rejoin_hands_back_the_batch_only_when_whole_and_in_order() {
        let whole = t(6, 0.0);
        let part = |first, n| {
            (
                whole.narrow(0, first, n).unwrap(),
                PartOf {
                    whole: whole.clone(),
                    first,
                },
            )
        };
        let (a, b, c) = (part(0, 2), part(2, 3), part(5, 1));
        let got = rejoin(&[(&a.0, Some(&a.1)), (&b.0, Some(&b.1)), (&c.0, Some(&c.1))]).unwrap();
        assert_eq!(
            got.id(),
            whole.id(),
            "in order and complete: the batch's tensor"
        );
        let rows = |x: &Tensor| x.to_vec2::<f32>().unwrap();
        for parts in [
            vec![(&b.0, Some(&b.1)), (&a.0, Some(&a.1)), (&c.0, Some(&c.1))],
            vec![(&a.0, Some(&a.1)), (&b.0, Some(&b.1))],
            vec![(&a.0, Some(&a.1)), (&b.0, None), (&c.0, Some(&c.1))],
        ] {
            let got = rejoin(&parts).unwrap();
            assert_ne!(got.id(), whole.id());
            let want: Vec<Tensor> = parts.iter().map(|(x, _)| (*x).clone()).collect();
            assert_eq!(rows(&got), rows(&Tensor::cat(&want, 0).unwrap()));
        }
        let other = t(2, 100.0);
        let got = rejoin(&[(&other, None)]).unwrap();
        assert_eq!(rows(&got), rows(&other));
        assert!(rejoin(&[]).is_err());
    }

    /// Rows gathered in any order equal the rows picked one by one; all rows in order are the
    /// tensor itself; a row past the end is an error naming it.
    #[test]
    fn gather_rows_picks_the_rows_asked_for() {
        let x = t(5, 0.0);
        let rows = |x: &Tensor| x.to_vec2::<f32>().unwrap();
        assert_eq!(gather_rows(&x, &[0, 1, 2, 3, 4]).unwrap().id(), x.id());
        for pick in [vec![1, 2, 3], vec![4, 0, 2], vec![3], vec![2, 2]] {
            let want: Vec<Vec<f32>> = pick.iter().map(|&r| rows(&x)[r].clone()).collect();
            assert_eq!(rows(&gather_rows(&x, &pick).unwrap()), want, "{pick:?}");
        }
        let e = gather_rows(&x, &[1, 5]).unwrap_err().to_string();
        assert!(e.contains("row 5"), "{e}");
    }
}
