//! A linear layer whose weight is dense (any float dtype) or quantized (GGUF block types, MLX
//! affine kept as stored on CUDA).

use super::q8::QMatrix;
use super::{AffineWeight, Fp8Weight};
use crate::source::Weights;
use crate::Result;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub enum Linear {
    /// `weight [out, in]` in the compute dtype.
    Dense {
        weight: Tensor,
        bias: Option<Tensor>,
    },
    /// A quantized weight; input and output stay in the compute dtype.
    Quant {
        weight: QMatMul,
        bias: Option<Tensor>,
        out_features: usize,
    },
    /// A Q8_0 weight on the CPU multiplied by dflash's own kernel ([`QMatrix`]), where that
    /// is faster than candle's (rows not a multiple of 256).
    Q8 {
        weight: Arc<QMatrix>,
        bias: Option<Tensor>,
    },
    /// An MLX affine-quantized weight kept as stored (CUDA: [`AffineWeight`]).
    Affine {
        weight: Arc<AffineWeight>,
        bias: Option<Tensor>,
    },
    /// An FP8 block-scaled weight kept as stored (CUDA: [`Fp8Weight`]).
    Fp8 {
        weight: Arc<Fp8Weight>,
        bias: Option<Tensor>,
    },
}

impl Linear {
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear::Dense { weight, bias }
    }

    /// A quantized weight: [`Linear::Q8`] when it is a CPU Q8_0 matrix that dflash's own
    /// kernel multiplies faster than candle (`DFLASH_Q8=0` keeps candle's), else
    /// [`Linear::Quant`].
    pub fn quant(weight: QMatMul, bias: Option<Tensor>, out_features: usize) -> Result<Self> {
        if let QMatMul::QTensor(q) = &weight {
            let cols = q.shape().dims().last().copied().unwrap_or(0);
            if QMatrix::preferred_for(cols) && super::q8::enabled() {
                if let Some(m) = QMatrix::from_qtensor(q)? {
                    return Ok(Linear::Q8 {
                        weight: Arc::new(m),
                        bias,
                    });
                }
            }
        }
        Ok(Linear::Quant {
            weight,
            bias,
            out_features,
        })
    }

    /// Bytes of weights (and biases) held.
    pub fn weight_bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        let b = |bias: &Option<Tensor>| bias.as_ref().map_or(0, t);
        match self {
            Linear::Dense { weight, bias } => t(weight) + b(bias),
            Linear::Quant { weight, bias, .. } => {
                b(bias)
                    + match weight {
                        QMatMul::QTensor(q) => q.storage_size_in_bytes(),
                        QMatMul::Tensor(x) | QMatMul::TensorF16(x) => t(x),
                    }
            }
            Linear::Q8 { weight, bias } => weight.bytes() + b(bias),
            Linear::Affine { weight, bias } => weight.bytes() + b(bias),
            Linear::Fp8 { weight, bias } => weight.bytes() + b(bias),
        }
    }

    /// Load `{prefix}.weight [out, in]` (and `{prefix}.bias [out]` when `bias`): dense, or
    /// quantized for quantized GGUF weights (see [`Weights::linear`]).
    pub fn load(
        w: &Weights,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        w.linear(prefix, in_dim, out_dim, bias)
    }

    /// Several linears with the same input as one (weights stacked along the output dim,
    /// biases too): one matmul launch instead of several, and a longer GEMV. Dense parts, or
    /// quantized parts of one block type on the CPU (a quantized matrix is a sequence of
    /// self-contained rows, so the rows are stacked as bytes, exactly; the input is then
    /// quantized once instead of once per part). None for mixed parts or biases.
    pub fn concat(parts: &[&Linear]) -> Result<Option<Linear>> {
        let biases: Vec<Tensor> = parts.iter().filter_map(|p| p.bias().cloned()).collect();
        let bias = match biases.len() {
            0 => None,
            n if n == parts.len() => Some(Tensor::cat(&biases, 0)?),
            _ => return Ok(None),
        };
        if parts.is_empty() {
            return Ok(None);
        }
        let dense: Option<Vec<Tensor>> = parts
            .iter()
            .map(|p| match p {
                Linear::Dense { weight, .. } => Some(weight.clone()),
                _ => None,
            })
            .collect();
        if let Some(ws) = dense {
            let weight = Tensor::cat(&ws, 0)?;
            return Ok(Some(Linear::Dense { weight, bias }));
        }
        let q8: Option<Vec<&QMatrix>> = parts
            .iter()
            .map(|p| match p {
                Linear::Q8 { weight, .. } => Some(weight.as_ref()),
                _ => None,
            })
            .collect();
        if let Some(ws) = q8 {
            return Ok(QMatrix::stack(&ws).map(|w| Linear::Q8 {
                weight: Arc::new(w),
                bias,
            }));
        }
        let affine: Option<Vec<&AffineWeight>> = parts
            .iter()
            .map(|p| match p {
                Linear::Affine { weight, .. } => Some(weight.as_ref()),
                _ => None,
            })
            .collect();
        if let Some(ws) = affine {
            return Ok(AffineWeight::concat(&ws)?.map(|w| Linear::Affine {
                weight: Arc::new(w),
                bias,
            }));
        }
        let fp8: Option<Vec<&Fp8Weight>> = parts
            .iter()
            .map(|p| match p {
                Linear::Fp8 { weight, .. } => Some(weight.as_ref()),
                _ => None,
            })
            .collect();
        if let Some(ws) = fp8 {
            return Ok(Fp8Weight::concat(&ws)?.map(|w| Linear::Fp8 {
                weight: Arc::new(w),
                bias,
            }));
        }
        let quant: Option<Vec<&QTensor>> = parts
            .iter()
            .map(|p| match p {
                Linear::Quant {
                    weight: QMatMul::QTensor(q),
                    ..
                } => Some(q.as_ref()),
                _ => None,
            })
            .collect();
        match quant {
            Some(qs) => Self::stack_quantized(&qs, bias),
            None => Ok(None),
        }
    }

    fn bias(&self) -> Option<&Tensor> {
        match self {
            Linear::Dense { bias, .. }
            | Linear::Quant { bias, .. }
            | Linear::Q8 { bias, .. }
            | Linear::Affine { bias, .. }
            | Linear::Fp8 { bias, .. } => bias.as_ref(),
        }
    }

    /// CPU quantized matrices of one block type and width, rows stacked as bytes.
    fn stack_quantized(qs: &[&QTensor], bias: Option<Tensor>) -> Result<Option<Linear>> {
        use candle_core::quantized::QStorage;
        let dtype = qs[0].dtype();
        let k = qs[0].shape().dims2()?.1;
        let mut bytes = Vec::new();
        let mut rows = 0;
        for q in qs {
            let (n, kq) = q.shape().dims2()?;
            if !q.device().is_cpu() || kq != k || q.dtype() != dtype {
                return Ok(None);
            }
            rows += n;
            bytes.extend_from_slice(&q.data()?);
        }
        let storage = QStorage::from_data(
            std::borrow::Cow::Owned(bytes),
            &candle_core::Device::Cpu,
            dtype,
        )?;
        let q = QTensor::new(storage, (rows, k))?;
        Ok(Some(Linear::quant(
            QMatMul::from_arc(Arc::new(q))?,
            bias,
            rows,
        )?))
    }

    /// Output rows `start .. start + len` of a dense linear as a linear of its own, sharing
    /// the weight (a view, no copy). None for quantized weights.
    pub fn rows(&self, start: usize, len: usize) -> Result<Option<Linear>> {
        match self {
            Linear::Dense { weight, bias } => Ok(Some(Linear::Dense {
                weight: weight.narrow(0, start, len)?,
                bias: bias.as_ref().map(|b| b.narrow(0, start, len)).transpose()?,
            })),
            Linear::Affine { weight, bias } => Ok(Some(Linear::Affine {
                weight: Arc::new(weight.rows(start, len)?),
                bias: bias.as_ref().map(|b| b.narrow(0, start, len)).transpose()?,
            })),
            Linear::Fp8 { weight, bias } => {
                let bias = bias.as_ref().map(|b| b.narrow(0, start, len)).transpose()?;
                Ok(weight.rows(start, len)?.map(|w| Linear::Fp8 {
                    weight: Arc::new(w),
                    bias,
                }))
            }
            Linear::Quant { .. } | Linear::Q8 { .. } => Ok(None),
        }
    }

    /// A 0x0 dense stand-in for a linear whose weight moved into a fused one (frees it).
    pub fn emptied(&self) -> Result<Linear> {
        let (dtype, device) = match self {
            Linear::Dense { weight, .. } => (weight.dtype(), weight.device().clone()),
            Linear::Affine { weight, .. } => (DType::BF16, weight.q.device().clone()),
            Linear::Fp8 { weight, .. } => (DType::BF16, weight.q.device().clone()),
            Linear::Quant { .. } | Linear::Q8 { .. } => (DType::F32, candle_core::Device::Cpu),
        };
        Ok(Linear::Dense {
            weight: Tensor::zeros((0, 0), dtype, &device)?,
            bias: None,
        })
    }

    /// This dense CPU weight requantized to Q8_0 for dflash's int8 product (a draft on the
    /// CPU, whose f32 GEMMs cost ~3x the int8 ones: docs/perf.md); None when it is not a
    /// dense CPU weight of a width that product takes (emptied stand-ins included).
    pub fn to_q8(&self) -> Result<Option<Linear>> {
        let Linear::Dense { weight, bias } = self else {
            return Ok(None);
        };
        let (rows, cols) = weight.dims2()?;
        if !weight.device().is_cpu()
            || rows == 0
            || !QMatrix::preferred_for(cols)
            || !super::q8::enabled()
        {
            return Ok(None);
        }
        // a fresh copy: `QTensor::quantize` reads the storage from its start, ignoring a
        // view's offset (the draft's `kv` is a row range of `qkv`)
        let w = weight
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let w = Tensor::from_vec(w, (rows, cols), weight.device())?;
        let q = QTensor::quantize(&w, candle_core::quantized::GgmlDType::Q8_0)?;
        Ok(Some(Linear::quant(
            QMatMul::from_qtensor(q)?,
            bias.clone(),
            rows,
        )?))
    }

    /// A dense weight (the CUDA kernels take these).
    pub fn is_dense(&self) -> bool {
        matches!(self, Linear::Dense { .. })
    }

    pub fn out_features(&self) -> usize {
        match self {
            Linear::Dense { weight, .. } => weight.dims()[0],
            Linear::Quant { out_features, .. } => *out_features,
            Linear::Q8 { weight, .. } => weight.rows(),
            Linear::Affine { weight, .. } => weight.n,
            Linear::Fp8 { weight, .. } => weight.n,
        }
    }

    /// `x [n, in] -> [n, out]` f32, each value what [`Linear::forward`] gives cast to f32 (the
    /// LM head's logits): on CUDA a bias-free dense weight's skinny GEMM writes them directly
    /// (one launch, not a GEMM and a cast).
    pub fn forward_f32(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Linear::Dense { weight, bias: None } = self {
            if let Some(y) = super::cuda::mma_f32(x, weight)? {
                return Ok(y);
            }
        }
        if let Linear::Fp8 { weight, bias: None } = self {
            return weight.forward_f32(x);
        }
        let y = self.forward(x)?;
        // cuBLAS ran the head (a batch's verify): widen its bf16 logits with one vectorized
        // kernel (candle's cast took 390 us for 256 x 152k on an H100, docs/perf.md session 39).
        #[cfg(feature = "cuda")]
        if let Some(f) = super::cuda::bf16_to_f32(&y)? {
            return Ok(f);
        }
        Ok(y.to_dtype(DType::F32)?)
    }

    /// A dense product through dflash's own kernels where one applies, else None (candle's
    /// matmul then). CUDA, batch-invariant mode (`DFLASH_BATCH_INVARIANT=1`): 1..=16 rows
    /// through the tensor-core skinny GEMM, whose bits for a row do not depend on the rows
    /// beside it (a verify reproduces the decode steps); otherwise the GEMV kernel for one row
    /// and cuBLAS above it (faster, not batch-invariant). f32 on the CPU: gemm on the barrier
    /// pool, not rayon's (`cpu_ops::matmul_t`; off with `DFLASH_FUSED=0`).
    fn dense_kernel(x: &Tensor, weight: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let Some(y) = super::cuda::mma(x, weight)? {
            return Ok(Some(y));
        }
        #[cfg(feature = "cuda")]
        if let Some(y) = super::cuda::gemv(x, weight)? {
            return Ok(Some(y));
        }
        if !super::fused::allowed() {
            return Ok(None);
        }
        super::cpu_ops::matmul_t(x, weight)
    }

    /// `x [n, in] -> [n, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (y, bias) = match self {
            Linear::Dense { weight, bias } => {
                let y = match Self::dense_kernel(x, weight)? {
                    Some(y) => y,
                    None => x.matmul(&weight.t()?)?,
                };
                (y, bias)
            }
            Linear::Quant { weight, bias, .. } => {
                // candle's quantized CPU kernels take f32 activations.
                let y = if x.dtype() == DType::F32 {
                    weight.forward(x)?
                } else {
                    weight
                        .forward(&x.to_dtype(DType::F32)?)?
                        .to_dtype(x.dtype())?
                };
                (y, bias)
            }
            Linear::Q8 { weight, bias } => (weight.forward(x)?.to_dtype(x.dtype())?, bias),
            Linear::Affine { weight, bias } => (weight.forward(x)?, bias),
            Linear::Fp8 { weight, bias } => (weight.forward(x)?, bias),
        };
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// `DFLASH_Q8=0` keeps candle's Q8_0 product everywhere (A/B runs).
#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::Device;

    fn quant(rows: usize, cols: usize, dt: GgmlDType, seed: u64, bias: bool) -> Linear {
        let w = (Tensor::rand(-1f32, 1f32, (rows, cols), &Device::Cpu).unwrap()
            * (1.0 + seed as f64))
            .unwrap();
        let q = QTensor::quantize(&w, dt).unwrap();
        // as a loaded weight becomes one: dflash's own product where it applies (Q8_0)
        Linear::quant(
            QMatMul::from_qtensor(q).unwrap(),
            bias.then(|| Tensor::rand(-1f32, 1f32, rows, &Device::Cpu).unwrap()),
            rows,
        )
        .unwrap()
    }

    /// Quantized parts stacked as bytes give, column for column, exactly the separate parts'
    /// outputs (1 and 16 rows, Q8_0 and Q4_K, with and without biases); mixed block types,
    /// mixed biases and mixed widths are refused.
    #[test]
    fn quantized_concat_equals_the_parts() {
        for (dt, cols) in [(GgmlDType::Q8_0, 576), (GgmlDType::Q4K, 512)] {
            for bias in [false, true] {
                let parts: Vec<Linear> = [(64, 0), (32, 1), (32, 2)]
                    .iter()
                    .map(|&(r, s)| quant(r, cols, dt, s, bias))
                    .collect();
                let refs: Vec<&Linear> = parts.iter().collect();
                let fused = Linear::concat(&refs).unwrap().expect("same type: stacks");
                assert_eq!(fused.out_features(), 128);
                for n in [1, 16] {
                    let x = Tensor::rand(-1f32, 1f32, (n, cols), &Device::Cpu).unwrap();
                    let want: Vec<Tensor> = parts.iter().map(|p| p.forward(&x).unwrap()).collect();
                    let want = Tensor::cat(&want, 1).unwrap().to_vec2::<f32>().unwrap();
                    let got = fused.forward(&x).unwrap().to_vec2::<f32>().unwrap();
                    assert_eq!(got, want, "{dt:?} bias {bias} rows {n}");
                }
            }
        }
        let a = quant(32, 512, GgmlDType::Q8_0, 0, false);
        let b = quant(32, 512, GgmlDType::Q4K, 0, false);
        let c = quant(32, 512, GgmlDType::Q8_0, 0, true);
        let d = quant(32, 576, GgmlDType::Q8_0, 0, false);
        assert!(Linear::concat(&[&a, &b]).unwrap().is_none(), "mixed types");
        assert!(Linear::concat(&[&a, &c]).unwrap().is_none(), "mixed biases");
        assert!(Linear::concat(&[&a, &d]).unwrap().is_none(), "mixed widths");
    }
    /// A dense CPU weight requantized by `to_q8`, also a row range of a larger weight (a
    /// view, as the draft's `kv` is of `qkv`), multiplies like the same rows quantized from a
    /// fresh tensor (bit for bit) and like the float weight within Q8_0's error; widths the
    /// int8 product does not take, and emptied stand-ins, stay as they are.
    #[test]
    fn to_q8_requantizes_views_of_their_own_rows() {
        let dev = Device::Cpu;
        let full = Tensor::rand(-1f32, 1f32, (96, 64), &dev).unwrap();
        let bias = Tensor::rand(-1f32, 1f32, 32, &dev).unwrap();
        let view = Linear::dense(full.clone(), None)
            .rows(40, 32)
            .unwrap()
            .unwrap();
        let view = match view {
            Linear::Dense { weight, .. } => Linear::dense(weight, Some(bias.clone())),
            _ => unreachable!(),
        };
        let fresh_w = Tensor::from_vec(
            full.narrow(0, 40, 32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            (32, 64),
            &dev,
        )
        .unwrap();
        let fresh = Linear::dense(fresh_w, Some(bias));
        let (qv, qf) = (
            view.to_q8().unwrap().unwrap(),
            fresh.to_q8().unwrap().unwrap(),
        );
        let x = Tensor::rand(-1f32, 1f32, (5, 64), &dev).unwrap();
        let v = |l: &Linear| {
            l.forward(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(v(&qv), v(&qf), "a view quantizes its own rows");
        let (yq, yf) = (v(&qv), v(&fresh));
        let err = yq
            .iter()
            .zip(&yf)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // 64 products of |x| <= 1 with weight errors <= 1/254 and activation errors alike
        assert!(err < 0.1, "Q8_0 vs float: max error {err}");
        assert!(err > 0.0, "the product did change to the int8 one");
        let odd = Linear::dense(Tensor::rand(-1f32, 1f32, (8, 48), &dev).unwrap(), None);
        assert!(
            odd.to_q8().unwrap().is_none(),
            "width 48: not a multiple of 32"
        );
        assert!(
            fresh.emptied().unwrap().to_q8().unwrap().is_none(),
            "emptied"
        );
    }
}
