//! Token embedding table: dense, or quantized as stored in a GGUF file (rows dequantized on
//! lookup, so every row is exactly the stored value: the mask-token row is never
//! re-quantized).

use crate::Result;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub enum Embedding {
    /// `[vocab, hidden]` in the compute dtype.
    Dense(Tensor),
    /// `[vocab, hidden]` quantized (CPU); lookups return `dtype`.
    Quant { table: Arc<QTensor>, dtype: DType },
}

impl Embedding {
    /// Rows of `ids` (u32, 1-D): `[n, hidden]` in the compute dtype.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Embedding::Dense(t) => t.index_select(ids, 0)?,
            Embedding::Quant { table, dtype } => {
                let rows = table.embedding(&ids.to_device(&Device::Cpu)?)?;
                if rows.dtype() != *dtype {
                    rows.to_dtype(*dtype)?
                } else {
                    rows
                }
            }
        })
    }

    /// The whole table in the compute dtype.
    pub fn table_dense(&self) -> Result<Tensor> {
        Ok(match self {
            Embedding::Dense(t) => t.clone(),
            Embedding::Quant { table, dtype } => {
                table.dequantize(&Device::Cpu)?.to_dtype(*dtype)?
            }
        })
    }

    pub fn bytes(&self) -> usize {
        match self {
            Embedding::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Embedding::Quant { table, .. } => table.storage_size_in_bytes(),
        }
    }
}
