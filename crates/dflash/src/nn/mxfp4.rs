//! MXFP4 expert stacks kept as stored on the GPU: gpt-oss publishes its routed experts as OCP
//! microscaling FP4 (`source::mxfp4` reads them: e2m1 codes, two a byte, and one e8m0 scale a
//! group of 32). On CUDA with bf16 compute the codes and scales stay as stored (4.25 bits a
//! weight instead of 16: gpt-oss-120b's experts take 60.9 GB instead of 229 GB) and the MoE
//! kernels (`kernels/moe.cu`, the `moe_*_mma_mx` forms) dequantize each weight in registers to
//! exactly its bf16 value, so their products are bit for bit the bf16 kernels' on the
//! dequantized experts. Elsewhere (CPU, f32, widths the kernels do not take) the loader
//! dequantizes at load as before ([`crate::nn::quant::keeps_mxfp4`] decides).

use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// Routed experts' matrices `[E, rows, k]` in MXFP4 as stored.
#[derive(Debug, Clone)]
pub struct Mxfp4Stack {
    /// `u8 [E, rows, k / 2]`: the e2m1 codes (value 2i of a group in byte i's low nibble).
    pub q: Tensor,
    /// `u8 [E, rows, k / 32]`: the e8m0 scales, bias 127.
    pub scales: Tensor,
}

impl Mxfp4Stack {
    /// From the checkpoint's bytes in expert-major, row-major order: `codes` (16 bytes a group
    /// of 32 values) and `scales` (one byte a group). `what` names the tensor in errors.
    pub fn new(
        what: &str,
        codes: Vec<u8>,
        scales: Vec<u8>,
        (experts, rows, k): (usize, usize, usize),
        device: &Device,
    ) -> Result<Self> {
        let groups = experts * rows * (k / 32);
        if k % 32 != 0 || codes.len() != 16 * groups || scales.len() != groups {
            return Err(Error::weights(
                what,
                format!(
                    "MXFP4 [{experts}, {rows}, {k}]: {} code bytes and {} scales (expected {} and {groups})",
                    codes.len(),
                    scales.len(),
                    16 * groups
                ),
            ));
        }
        if let Some(g) = scales.iter().position(|&s| s == 255) {
            return Err(Error::weights(
                format!("{what}_scales"),
                format!("scale {g} is 255 (NaN in e8m0)"),
            ));
        }
        Ok(Self {
            q: Tensor::from_vec(codes, (experts, rows, k / 2), device)?,
            scales: Tensor::from_vec(scales, (experts, rows, k / 32), device)?,
        })
    }

    /// `(E, rows, k)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        let d = self.q.dims();
        (d[0], d[1], 2 * d[2])
    }

    /// Bytes held: the codes and the scales, as stored.
    pub fn bytes(&self) -> usize {
        self.q.elem_count() + self.scales.elem_count()
    }

    /// Expert `e` as bf16 `[rows, k]`, exactly (a kernel on CUDA; the host's dequantization
    /// elsewhere).
    pub fn dequantize(&self, e: usize) -> Result<Tensor> {
        let (_, rows, k) = self.dims();
        let (q, s) = (self.q.get(e)?, self.scales.get(e)?);
        #[cfg(feature = "cuda")]
        if let Some(t) = super::cuda::mxfp4_dequantize(&q, &s)? {
            return Ok(t.reshape((rows, k))?);
        }
        let vals = crate::source::mxfp4::dequantize(
            &q.flatten_all()?.to_vec1::<u8>()?,
            &s.flatten_all()?.to_vec1::<u8>()?,
        )
        .map_err(Error::input)?;
        Ok(Tensor::from_vec(vals, (rows, k), q.device())?.to_dtype(DType::BF16)?)
    }
}
