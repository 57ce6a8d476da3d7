//! The grouped dynamic causal convolution of DFlash2 draft layers, over the rows of each block.
//!
//! `x [B*L, H]` holds B blocks of L rows (block-major); `dynk [B*L, K*G]` a per-row dynamic
//! kernel value per offset and channel group (G = H / group); `base [K, H]` a learned kernel per
//! offset and channel. Row i of a block gets
//!
//! ```text
//! out[i, c] = sum over o < K, o <= i of (base[o, c] + dynk[i, o, c / group]) * x[i - o, c]
//! ```
//!
//! so a row reads itself and the rows before it in its own block (zero padding: offsets at or
//! past a row's index contribute nothing, which also covers blocks shorter than K). This module
//! is the one door: the portable path below (candle ops, any device, differentiable for
//! training), and the CUDA kernel where it runs.

use crate::nn::Linear;
use crate::Result;
use candle_core::Tensor;

/// A convolution to apply to a projection's output (a DFlash2 layer's `finish` after `o_proj`
/// or `down_proj`): the arguments of [`dyn_conv`] but x, which the projection makes.
#[derive(Clone, Copy)]
pub struct ConvAfter<'a> {
    pub dynk: &'a Tensor,
    pub base: &'a Tensor,
    pub group: usize,
    pub block: usize,
}

/// `dyn_conv(lin.forward(x), ...)`. On CUDA (batch-invariant mode, a bf16 weight without bias,
/// 1..=16 rows) one launch: the skinny GEMM convolves its product in its epilogue, bit for bit
/// the two launches it replaces (`nn::cuda::mma_conv`); elsewhere the projection, then
/// [`dyn_conv`].
pub fn project_then_conv(lin: &Linear, x: &Tensor, c: &ConvAfter) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(weight) = fused_weight(lin, x) {
        let (n, h) = (x.dim(0)?, weight.dim(0)?);
        check(n, h, c.dynk, c.base, c.group, c.block)?;
        let epi = crate::nn::cuda::ConvEpilogue {
            dynk: c.dynk.clone(),
            base: c.base.clone(),
            group: c.group,
            block: c.block,
        };
        if let Some(y) = crate::nn::cuda::mma_conv(x, weight, &epi)? {
            return Ok(y);
        }
    }
    dyn_conv(&lin.forward(x)?, c.dynk, c.base, c.group, c.block)
}

/// A DFlash2 layer's kernel projection of its sublayer input `x [n, h]`, `dynk = proj(x)` `[n,
/// 2 K G]` (the preparing half's columns, then the finishing half's), and `x` convolved with
/// the preparing half: `(dyn_conv(x, dynk[:, ..K G], base, group, block), dynk)`. On CUDA
/// (batch-invariant mode, a bf16 weight without bias, 1..=16 rows, K dividing 16) one launch
/// with the bits of the two it replaces (`nn::cuda::mma_kconv`); elsewhere the projection,
/// then [`dyn_conv`].
pub fn project_and_conv(
    proj: &Linear,
    x: &Tensor,
    base: &Tensor,
    group: usize,
    block: usize,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if let Some(weight) = fused_weight(proj, x) {
        let (n, h) = x.dims2()?;
        let (k, hb) = base.dims2()?;
        let fits = group > 0
            && hb == h
            && h % group == 0
            && block > 0
            && n % block == 0
            && weight.dim(0)? == 2 * k * (h / group);
        let prep = crate::nn::cuda::ConvPrepare {
            base: base.clone(),
            group,
            block,
        };
        if fits {
            if let Some(both) = crate::nn::cuda::mma_kconv(x, weight, &prep)? {
                return Ok(both);
            }
        }
    }
    let d = proj.forward(x)?;
    let kg = base.dim(0)? * (x.dim(1)? / group.max(1));
    Ok((dyn_conv(x, &d.narrow(1, 0, kg)?, base, group, block)?, d))
}

/// The weight of `lin` when the convolving epilogues may run for input `x` (CUDA, nothing
/// tracked by autograd, the DFlash2 kernels on, a bf16 weight without bias); the kernels' own
/// wrappers check the rest.
#[cfg(feature = "cuda")]
fn fused_weight<'a>(lin: &'a Linear, x: &Tensor) -> Option<&'a Tensor> {
    if !x.device().is_cuda()
        || x.track_op()
        || !crate::nn::fused::allowed_part(crate::switches::Part::Dflash2)
    {
        return None;
    }
    match lin {
        Linear::Dense { weight, bias: None } => Some(weight),
        _ => None,
    }
}

/// The shapes [`dyn_conv`] takes for an input of `n` rows and `h` channels.
fn check(
    n: usize,
    h: usize,
    dynk: &Tensor,
    base: &Tensor,
    group: usize,
    block: usize,
) -> Result<()> {
    let (k, hb) = base.dims2()?;
    let g = h / group.max(1);
    if group == 0
        || hb != h
        || g * group != h
        || block == 0
        || !n.is_multiple_of(block)
        || dynk.dims2()? != (n, k * g)
    {
        return Err(crate::Error::input(format!(
            "dyn_conv: x [{n}, {h}], dynamic kernel {:?}, base {:?}, group {group}, block {block} do not fit",
            dynk.dims(),
            base.dims()
        )));
    }
    Ok(())
}

/// See the module docs. `block` is L (the rows of one block); `x.dim(0)` must be a multiple.
pub fn dyn_conv(
    x: &Tensor,
    dynk: &Tensor,
    base: &Tensor,
    group: usize,
    block: usize,
) -> Result<Tensor> {
    let (n, h) = x.dims2()?;
    check(n, h, dynk, base, group, block)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && crate::nn::fused::allowed_part(crate::switches::Part::Dflash2) {
        if let Some(y) = crate::nn::cuda::dflash2::dyn_conv(x, dynk, base, group, block)? {
            return Ok(y);
        }
    }
    portable(x, dynk, base, group, block)
}

/// The convolution as candle ops, in the reference's order of rounding: per offset, the base
/// term, then the dynamic term.
pub fn portable(
    x: &Tensor,
    dynk: &Tensor,
    base: &Tensor,
    group: usize,
    block: usize,
) -> Result<Tensor> {
    let (n, h) = x.dims2()?;
    let k = base.dim(0)?;
    let g = h / group;
    let nb = n / block;
    let x3 = x.reshape((nb, block, h))?;
    let mut out = x.zeros_like()?.reshape((nb, block, g, group))?;
    for o in 0..k.min(block) {
        // x shifted down by o rows inside each block, zeros on top.
        let v = if o == 0 {
            x3.clone()
        } else {
            let pad = Tensor::zeros((nb, o, h), x.dtype(), x.device())?;
            Tensor::cat(&[&pad, &x3.narrow(1, 0, block - o)?], 1)?
        };
        let v = v.reshape((nb, block, g, group))?;
        let b = base
            .narrow(0, o, 1)?
            .reshape((1, 1, g, group))?
            .to_dtype(x.dtype())?;
        out = (out + v.broadcast_mul(&b)?)?;
        let d = dynk
            .narrow(1, o * g, g)?
            .contiguous()?
            .reshape((nb, block, g, 1))?;
        out = (out + v.broadcast_mul(&d)?)?;
    }
    Ok(out.reshape((n, h))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, IndexOp};

    /// The formula, element by element.
    fn naive(
        x: &[Vec<f32>],
        d: &[Vec<f32>],
        b: &[Vec<f32>],
        group: usize,
        block: usize,
    ) -> Vec<Vec<f32>> {
        let (n, h, k) = (x.len(), x[0].len(), b.len());
        let g = h / group;
        let mut out = vec![vec![0f32; h]; n];
        for i in 0..n {
            let r = i % block;
            for c in 0..h {
                for o in 0..k.min(r + 1) {
                    out[i][c] += (b[o][c] + d[i][o * g + c / group]) * x[i - o][c];
                }
            }
        }
        out
    }

    #[test]
    fn matches_the_formula_with_blocks_shorter_than_the_kernel() {
        let dev = Device::Cpu;
        for &(n, h, k, group, block) in &[
            (8, 12, 3, 4, 8),
            (6, 8, 2, 2, 3),
            (4, 6, 5, 3, 2), // every block shorter than the kernel
            (1, 4, 2, 1, 1),
        ] {
            let g = h / group;
            let x = Tensor::randn(0f32, 1.0, (n, h), &dev).unwrap();
            let d = Tensor::randn(0f32, 1.0, (n, k * g), &dev).unwrap();
            let b = Tensor::randn(0f32, 1.0, (k, h), &dev).unwrap();
            let y = dyn_conv(&x, &d, &b, group, block).unwrap();
            let want = naive(
                &x.to_vec2().unwrap(),
                &d.to_vec2().unwrap(),
                &b.to_vec2().unwrap(),
                group,
                block,
            );
            let got: Vec<Vec<f32>> = y.to_vec2().unwrap();
            for (i, (gr, wr)) in got.iter().zip(&want).enumerate() {
                for (c, (a, w)) in gr.iter().zip(wr).enumerate() {
                    assert!(
                        (a - w).abs() < 1e-5,
                        "n{n} h{h} k{k}: row {i} col {c}: {a} vs {w}"
                    );
                }
            }
            // Row 0 of each block only reads itself.
            let r0 = y.i(0).unwrap().to_vec1::<f32>().unwrap();
            let x0 = x.i(0).unwrap().to_vec1::<f32>().unwrap();
            let b0 = b.i(0).unwrap().to_vec1::<f32>().unwrap();
            let d0 = d.i(0).unwrap().to_vec1::<f32>().unwrap();
            for c in 0..h {
                let w = (b0[c] + d0[c / group]) * x0[c];
                assert!((r0[c] - w).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn refuses_shapes_that_do_not_fit() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((6, 8), candle_core::DType::F32, &dev).unwrap();
        let b = Tensor::zeros((2, 8), candle_core::DType::F32, &dev).unwrap();
        let d = Tensor::zeros((6, 8), candle_core::DType::F32, &dev).unwrap();
        // group 2 -> G = 4 -> dynk needs 2 * 4 = 8 columns: fits; block 4 does not divide 6.
        assert!(dyn_conv(&x, &d, &b, 2, 4).is_err());
        assert!(dyn_conv(&x, &d, &b, 3, 6).is_err());
        assert!(dyn_conv(&x, &d, &b, 2, 6).is_ok());
    }
}
