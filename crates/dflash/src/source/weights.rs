//! Model weights with checked, named access, from memory-mapped safetensors or a GGUF file.
//!
//! Family loaders ask for HF tensor names (`model.layers.{i}.self_attn.q_proj.weight`); a
//! GGUF source maps them to llama.cpp names, un-permutes llama Q/K rows, and hands out
//! quantized matrices as stored to the policy in [`crate::nn::quant`], which places them
//! (requantized at load to a type with a fast CPU kernel unless `keep_quant`; on CUDA with
//! bf16 compute, the types that map exactly onto the affine layout as [`Linear::Affine`]). Every tensor is checked for presence and shape. Names that
//! were read are recorded so a loader can list the tensors a checkpoint carries that the
//! model did not use, and a GGUF load keeps a report of what it did to each tensor type.
//! MLX affine-quantized safetensors (packed `uint32` + `scales` + `biases`) are dequantized
//! here at load by [`super::mlx`], for every family.

use super::gguf::{gguf_name, unpermute_qk, GgufFile};
use super::mlx::{AffineParams, MlxQuant};
use crate::nn::quant::Placed;
use crate::nn::{Embedding, Linear};
use crate::{Error, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{safetensors::MmapedSafetensors, DType, Device, Shape, Tensor};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

enum Backend {
    Safetensors {
        st: MmapedSafetensors,
        files: Vec<PathBuf>,
    },
    Gguf(GgufSource),
    /// In-memory tensors (a draft being trained: the tensors of its `Var`s).
    Memory(BTreeMap<String, Tensor>),
}

struct GgufSource {
    file: std::sync::Arc<GgufFile>,
    /// llama-converted files: Q/K rows permuted for interleaved RoPE (heads, kv_heads).
    qk_permuted: Option<(usize, usize)>,
    keep_quant: bool,
    /// "Q4_1 -> Q8_0" style lines with tensor counts.
    report: RefCell<BTreeMap<String, usize>>,
}

pub struct Weights {
    backend: Backend,
    pub dtype: DType,
    pub device: Device,
    used: RefCell<BTreeSet<String>>,
    /// The MLX `quantization` entry of the config (safetensors), see [`Self::with_mlx_quant`].
    mlx: Option<MlxQuant>,
    /// MLX-quantized tensors dequantized so far, per (bits, group size).
    mlx_report: RefCell<BTreeMap<AffineParams, usize>>,
    /// MLX-quantized matrices kept as stored (CUDA, [`Linear::Affine`]).
    mlx_kept: RefCell<usize>,
    /// The FP8 `quantization_config` (safetensors), see [`Self::with_fp8_quant`].
    fp8: Option<super::fp8::Fp8Quant>,
    /// FP8 matrices dequantized so far.
    fp8_count: RefCell<usize>,
    /// FP8 matrices kept as stored (CUDA, [`Linear::Fp8`]).
    fp8_kept: RefCell<usize>,
    /// The AWQ / GPTQ / compressed-tensors `quantization_config`, see [`Self::with_int_quant`].
    intq: Option<super::intq::IntQuant>,
    /// Integer-quantized matrices loaded so far, and those kept as stored.
    intq_count: RefCell<usize>,
    intq_kept: RefCell<usize>,
    /// The tensor-parallel rank this load is for ([`Self::with_shard`]).
    shard: Option<crate::nn::parallel::Shard>,
}

/// How a linear's weight splits over tensor-parallel ranks ([`Weights::linear_split`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Column-parallel: each rank keeps its share of the output rows (and of the bias).
    Out,
    /// Row-parallel: each rank keeps its share of the input columns; its output is a partial
    /// sum, the bias kept on rank 0 only (so the all-reduce adds it once).
    In,
    /// The output rows `[at, at + len)` (the key/value head a rank needs when there are fewer
    /// of them than ranks: replicated over the ranks whose queries read it).
    Rows(usize, usize),
}

impl Weights {
    /// Memory-map the given safetensors files. Header errors (truncated file, bad JSON,
    /// offsets outside the file) are reported with the file name.
    pub fn open(files: &[PathBuf], dtype: DType, device: &Device) -> Result<Self> {
        for f in files {
            check_safetensors_file(f)?;
        }
        // SAFETY: the files are mapped read-only; modifying them while the model is loaded
        // is undefined behaviour, as for every mmap-based loader.
        let st = unsafe { MmapedSafetensors::multi(files) }.map_err(|e| {
            Error::weights(
                files
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                e.to_string(),
            )
        })?;
        Ok(Self::new(
            Backend::Safetensors {
                st,
                files: files.to_vec(),
            },
            dtype,
            device,
        ))
    }

    /// A GGUF file. `keep_quant` keeps every quantized matrix in its stored type.
    pub fn open_gguf(
        file: std::sync::Arc<GgufFile>,
        dtype: DType,
        device: &Device,
        keep_quant: bool,
    ) -> Result<Self> {
        let qk_permuted = if file.arch == "llama" {
            let heads = file.req_u64(&file.arch_key("attention.head_count"))? as usize;
            let kv = file
                .opt_u64(&file.arch_key("attention.head_count_kv"))?
                .map_or(heads, |x| x as usize);
            Some((heads, kv))
        } else {
            None
        };
        Ok(Self::new(
            Backend::Gguf(GgufSource {
                file,
                qk_permuted,
                keep_quant,
                report: RefCell::default(),
            }),
            dtype,
            device,
        ))
    }

    /// Tensors held in memory, e.g. the trainable variables of a draft in training: loaders
    /// then build the model on those very tensors (autograd reaches them).
    pub fn from_tensors(tensors: BTreeMap<String, Tensor>, dtype: DType, device: &Device) -> Self {
        Self::new(Backend::Memory(tensors), dtype, device)
    }

    fn new(backend: Backend, dtype: DType, device: &Device) -> Self {
        Self {
            backend,
            dtype,
            device: device.clone(),
            used: RefCell::default(),
            mlx: None,
            mlx_report: RefCell::default(),
            mlx_kept: RefCell::default(),
            fp8: None,
            fp8_count: RefCell::default(),
            fp8_kept: RefCell::default(),
            intq: None,
            intq_count: RefCell::default(),
            intq_kept: RefCell::default(),
            shard: None,
        }
    }

    /// Load one tensor-parallel rank's part of the model: the layers that split
    /// ([`Self::linear_split`]) keep this rank's slice; everything else is loaded whole.
    pub fn with_shard(mut self, shard: Option<crate::nn::parallel::Shard>) -> Self {
        self.shard = shard.filter(|s| s.world > 1);
        self
    }

    /// The rank this load is for (None: the whole model).
    pub fn shard(&self) -> Option<&crate::nn::parallel::Shard> {
        self.shard.as_ref()
    }

    /// The MLX affine quantization named by the checkpoint's config (see
    /// [`MlxQuant::from_config`]): its packed weights are then dequantized at load. Without
    /// it, a packed weight is an error naming the missing config entry.
    pub fn with_mlx_quant(mut self, quant: Option<MlxQuant>) -> Self {
        self.mlx = quant;
        self
    }

    /// The FP8 block quantization named by the checkpoint's config (see
    /// [`super::fp8::Fp8Quant::from_config`]): its float8 weights are then dequantized at load.
    /// Without it, a float8 weight with scales is an error naming the missing config entry.
    pub fn with_fp8_quant(mut self, quant: Option<super::fp8::Fp8Quant>) -> Self {
        self.fp8 = quant;
        self
    }

    /// The AWQ / GPTQ / compressed-tensors quantization named by the checkpoint's config (see
    /// [`super::intq::IntQuant::from_config`]): its integer weights are then rewritten into the
    /// affine layout at load. Without it, an integer-quantized weight is an error.
    pub fn with_int_quant(mut self, quant: Option<super::intq::IntQuant>) -> Self {
        self.intq = quant;
        self
    }

    /// True for GGUF sources (their Gemma norms already include the `+ 1`).
    pub fn is_gguf(&self) -> bool {
        matches!(self.backend, Backend::Gguf(_))
    }

    /// The files these weights come from, for messages.
    pub fn file_desc(&self) -> String {
        match &self.backend {
            Backend::Gguf(g) => g.file.file_desc(),
            Backend::Memory(_) => "(in-memory tensors)".to_string(),
            Backend::Safetensors { files, .. } => match files.as_slice() {
                [one] => one.display().to_string(),
                many => format!(
                    "{} ({} shards)",
                    many[0]
                        .parent()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default(),
                    many.len()
                ),
            },
        }
    }

    /// The stored name of an HF name (itself for safetensors).
    fn stored_name(&self, name: &str) -> Option<String> {
        match &self.backend {
            Backend::Safetensors { .. } | Backend::Memory(_) => Some(name.to_string()),
            Backend::Gguf(g) => gguf_name(&g.file.arch, name),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        match (&self.backend, self.stored_name(name)) {
            (Backend::Safetensors { st, .. }, _) => {
                st.get(name).is_ok() || super::intq::is_quantized(st, name)
            }
            (Backend::Memory(m), _) => m.contains_key(name),
            (Backend::Gguf(g), Some(n)) => g.file.has_tensor(&n),
            (Backend::Gguf(_), None) => false,
        }
    }

    /// All tensor names in the checkpoint (as stored).
    pub fn names(&self) -> Vec<String> {
        match &self.backend {
            Backend::Safetensors { st, .. } => st.tensors().into_iter().map(|(n, _)| n).collect(),
            Backend::Memory(m) => m.keys().cloned().collect(),
            Backend::Gguf(g) => g.file.content.tensor_infos.keys().cloned().collect(),
        }
    }

    fn missing(&self, name: &str, shape: &Shape) -> Error {
        let stored = match self.stored_name(name) {
            Some(s) if s != name => format!(" (`{s}` in GGUF)"),
            _ => String::new(),
        };
        Error::weights(
            self.file_desc(),
            format!("missing tensor `{name}`{stored} (expected shape {shape:?})"),
        )
    }

    fn check_shape(&self, name: &str, found: &[usize], shape: &Shape) -> Result<()> {
        if found != shape.dims() {
            return Err(Error::weights(
                self.file_desc(),
                format!(
                    "tensor `{name}` has shape {found:?}, expected {:?}",
                    shape.dims()
                ),
            ));
        }
        Ok(())
    }

    /// Load `name`, check its shape, convert to the compute dtype on the device.
    pub fn get(&self, name: &str, shape: impl Into<Shape>) -> Result<Tensor> {
        self.get_dtype(name, shape, self.dtype)
    }

    pub fn get_dtype(&self, name: &str, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        let shape = shape.into();
        let t = match &self.backend {
            Backend::Safetensors { st, .. } => {
                // Quantized safetensors formats, dequantized here: MLX affine, then FP8 blocks.
                let desc = self.file_desc();
                let deq = self.dequantized(st, name, shape.dims(), &desc)?;
                if let Some((t, read)) = deq {
                    self.used.borrow_mut().extend(read);
                    return Ok(t.to_dtype(dtype)?.to_device(&self.device)?);
                }
                let view = st.get(name).map_err(|_| self.missing(name, &shape))?;
                self.check_shape(name, view.shape(), &shape)?;
                self.used.borrow_mut().insert(name.to_string());
                st.load(name, &Device::Cpu).map_err(|e| {
                    Error::weights(self.file_desc(), format!("tensor `{name}`: {e}"))
                })?
            }
            Backend::Gguf(_) => self.qtensor(name, &shape)?.dequantize(&Device::Cpu)?,
            Backend::Memory(m) => {
                let t = m.get(name).ok_or_else(|| self.missing(name, &shape))?;
                self.check_shape(name, t.dims(), &shape)?;
                self.used.borrow_mut().insert(name.to_string());
                t.clone()
            }
        };
        let t = if t.dtype() != dtype {
            t.to_dtype(dtype)?
        } else {
            t
        };
        Ok(t.to_device(&self.device)?)
    }

    /// Entries `at .. at + len` of dimension `dim` of the tensor `name` of `shape` (`dim` 0 of
    /// any tensor: rows, or a stack's matrices; `dim` 1 of a matrix: columns), in the compute
    /// dtype on the device: a tensor-parallel rank's shard. From an ordinary safetensors
    /// tensor only that part's bytes are read from the mapped file and converted (the whole
    /// is never materialized, on the host or the device); a quantized safetensors format is
    /// dequantized whole on the host, then cut; in-memory tensors are cut.
    pub fn get_part(
        &self,
        name: &str,
        shape: impl Into<Shape>,
        dim: usize,
        at: usize,
        len: usize,
    ) -> Result<Tensor> {
        let full: Shape = shape.into();
        let dims = full.dims().to_vec();
        if dims.is_empty() || dim > 1 || (dim == 1 && dims.len() != 2) || at + len > dims[dim] {
            return Err(Error::input(format!(
                "tensor `{name}`: part {at}..{} of dimension {dim} of {dims:?}",
                at + len
            )));
        }
        let (rows, cols) = (dims[0], dims[1..].iter().product::<usize>());
        let Backend::Safetensors { st, .. } = &self.backend else {
            return Ok(self.get(name, full)?.narrow(dim, at, len)?.contiguous()?);
        };
        let desc = self.file_desc();
        if let Some((t, read)) = self.dequantized(st, name, full.dims(), &desc)? {
            self.used.borrow_mut().extend(read);
            let t = t.narrow(dim, at, len)?.contiguous()?;
            return Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?);
        }
        let view = st.get(name).map_err(|_| self.missing(name, &full))?;
        self.check_shape(name, view.shape(), &full)?;
        let stored = DType::try_from(view.dtype())
            .map_err(|e| Error::weights(desc.clone(), format!("tensor `{name}`: {e}")))?;
        if !matches!(stored, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
            return Ok(self.get(name, full)?.narrow(dim, at, len)?.contiguous()?);
        }
        self.used.borrow_mut().insert(name.to_string());
        let es = stored.size_in_bytes();
        let data = view.data();
        let mut part = dims.clone();
        part[dim] = len;
        let bytes: std::borrow::Cow<[u8]> = if dim == 0 {
            data[at * cols * es..(at + len) * cols * es].into()
        } else {
            let mut v = Vec::with_capacity(rows * len * es);
            for r in 0..rows {
                v.extend_from_slice(&data[(r * cols + at) * es..(r * cols + at + len) * es]);
            }
            v.into()
        };
        let t = Tensor::from_raw_buffer(&bytes, stored, &part, &Device::Cpu)
            .map_err(|e| Error::weights(desc, format!("tensor `{name}`: {e}")))?;
        Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?)
    }

    /// `name` dequantized to f32 on the CPU when a quantized safetensors format stores it (MLX
    /// affine, FP8 blocks, integer groups; counted for the load report), with the stored
    /// tensors it read; None for an ordinary tensor.
    fn dequantized(
        &self,
        st: &MmapedSafetensors,
        name: &str,
        dims: &[usize],
        desc: &str,
    ) -> Result<Option<(Tensor, Vec<String>)>> {
        if let Some(d) = super::mlx::load_dequantized(st, self.mlx.as_ref(), name, dims, desc)? {
            *self.mlx_report.borrow_mut().entry(d.params).or_default() += 1;
            return Ok(Some((d.tensor, d.read)));
        }
        if let Some(d) = super::fp8::load_dequantized(st, self.fp8.as_ref(), name, dims, desc)? {
            *self.fp8_count.borrow_mut() += 1;
            return Ok(Some((d.tensor, d.read.to_vec())));
        }
        if let Some(s) = super::intq::load_stored(st, self.intq.as_ref(), name, dims, desc)? {
            *self.intq_count.borrow_mut() += 1;
            let t = Tensor::from_vec(s.dequantize()?, dims, &Device::Cpu)?;
            return Ok(Some((t, s.read)));
        }
        Ok(None)
    }

    /// `name` exactly as stored (dtype unchanged, on the CPU), shape-checked: packed
    /// quantized data (MXFP4 blocks and scales) that must not go through a float conversion.
    pub fn get_raw(&self, name: &str, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        let Backend::Safetensors { st, .. } = &self.backend else {
            return Err(Error::weights(
                self.file_desc(),
                format!("tensor `{name}`: packed tensors are read from safetensors only"),
            ));
        };
        let view = st.get(name).map_err(|_| self.missing(name, &shape))?;
        self.check_shape(name, view.shape(), &shape)?;
        self.used.borrow_mut().insert(name.to_string());
        st.load(name, &Device::Cpu)
            .map_err(|e| Error::weights(self.file_desc(), format!("tensor `{name}`: {e}")))
    }

    /// Shape of `name` (HF naming) from the header, without loading it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match &self.backend {
            Backend::Safetensors { st, .. } => match st.get(name) {
                Ok(v) => Some(
                    super::mlx::logical_shape(st, self.mlx.as_ref(), name, v.shape())
                        .unwrap_or_else(|| v.shape().to_vec()),
                ),
                Err(_) => super::intq::logical_shape(st, self.intq.as_ref(), name),
            },
            Backend::Memory(m) => m.get(name).map(|t| t.dims().to_vec()),
            Backend::Gguf(g) => self.stored_name(name).and_then(|n| g.file.tensor_shape(&n)),
        }
    }

    /// Record `name` as understood though not loaded (e.g. a bool buffer the engine derives).
    pub fn mark_used(&self, name: &str) {
        if let Some(n) = self.stored_name(name) {
            self.used.borrow_mut().insert(n);
        }
    }

    /// A GGUF tensor as stored (CPU), shape-checked, with llama Q/K rows un-permuted.
    fn qtensor(&self, name: &str, shape: &Shape) -> Result<QTensor> {
        let Backend::Gguf(g) = &self.backend else {
            unreachable!("qtensor on a safetensors source")
        };
        let stored = gguf_name(&g.file.arch, name)
            .filter(|n| g.file.has_tensor(n))
            .ok_or_else(|| self.missing(name, shape))?;
        let found = g.file.tensor_shape(&stored).unwrap_or_default();
        self.check_shape(name, &found, shape)?;
        self.used.borrow_mut().insert(stored.clone());
        let q = g.file.tensor(&stored)?;
        Ok(match g.qk_permuted {
            Some((heads, _)) if stored.contains(".attn_q.") => unpermute_qk(&q, heads)?,
            Some((_, kv_heads)) if stored.contains(".attn_k.") => unpermute_qk(&q, kv_heads)?,
            _ => q,
        })
    }

    /// Load `name` if present.
    pub fn get_opt(&self, name: &str, shape: impl Into<Shape>) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A linear layer `{prefix}.weight [out, in]` (+ `{prefix}.bias [out]`): dense for float
    /// weights, quantized GGUF weights as [`crate::nn::quant::place`] decides.
    pub fn linear(
        &self,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Linear> {
        let bias = if bias {
            Some(self.get(&format!("{prefix}.bias"), out_dim)?)
        } else {
            None
        };
        let name = format!("{prefix}.weight");
        let shape = Shape::from((out_dim, in_dim));
        if let Some(l) = self.mlx_affine(&name, out_dim, in_dim, &bias)? {
            return Ok(l);
        }
        if let Some(l) = self.fp8_stored(&name, out_dim, in_dim, &bias)? {
            return Ok(l);
        }
        if !self.is_gguf() {
            return Ok(Linear::Dense {
                weight: self.get(&name, shape)?,
                bias,
            });
        }
        let q = self.qtensor(&name, &shape)?;
        self.gguf_linear(Arc::new(q), &name, bias, out_dim)
    }

    /// A GGUF matrix `q` (of `out_dim` rows) as a linear layer, placed as
    /// [`crate::nn::quant::place`] decides: kept quantized, as affine weights, or dequantized.
    fn gguf_linear(
        &self,
        q: Arc<QTensor>,
        name: &str,
        bias: Option<Tensor>,
        out_dim: usize,
    ) -> Result<Linear> {
        Ok(match self.matmul_weight(q.clone(), name)? {
            Placed::Quant(weight) => Linear::quant(weight, bias, out_dim)?,
            Placed::Affine(weight) => Linear::Affine {
                weight: Arc::new(weight),
                bias,
            },
            Placed::Float => Linear::Dense {
                weight: q
                    .dequantize(&Device::Cpu)?
                    .to_dtype(self.dtype)?
                    .to_device(&self.device)?,
                bias,
            },
        })
    }

    /// [`Self::linear`] split over the tensor-parallel ranks ([`Split`]); the whole linear
    /// when the load is not sharded. `out_dim` / `in_dim` are the whole matrix's. Dense
    /// weights, and GGUF block types (whole blocks: a row split at any row, a column split at
    /// block boundaries); MLX / FP8 / integer-quantized safetensors are an error naming the
    /// tensor.
    pub fn linear_split(
        &self,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        split: Split,
    ) -> Result<Linear> {
        let Some(sh) = self.shard.clone() else {
            return self.linear(prefix, in_dim, out_dim, bias);
        };
        let (dim, (at, len)) = match split {
            Split::Out | Split::In => {
                let (dim, n) = if split == Split::Out {
                    (0, out_dim)
                } else {
                    (1, in_dim)
                };
                let what = if dim == 0 { "rows" } else { "columns" };
                sh.check_divides(n, &format!("{what} of `{prefix}`"))?;
                (dim, sh.range(n))
            }
            Split::Rows(at, len) if at + len <= out_dim => (0, (at, len)),
            Split::Rows(at, len) => {
                return Err(Error::input(format!(
                    "tensor parallel: rows {at}..{} of `{prefix}`, which has {out_dim}",
                    at + len
                )))
            }
        };
        let bias = match bias {
            true => Some(self.get(&format!("{prefix}.bias"), out_dim)?),
            false => None,
        };
        let bias = match (split, bias) {
            (Split::Out | Split::Rows(..), Some(b)) => Some(b.narrow(0, at, len)?.contiguous()?),
            (Split::In, b) if sh.rank == 0 => b,
            _ => None,
        };
        let out_len = if dim == 0 { len } else { out_dim };
        if self.is_gguf() {
            let name = format!("{prefix}.weight");
            let q = self.qtensor(&name, &Shape::from((out_dim, in_dim)))?;
            let q = slice_qtensor(&q, dim, at, len)
                .map_err(|e| Error::input(format!("tensor parallel: `{name}`: {e}")))?;
            return self.gguf_linear(Arc::new(q), &name, bias, out_len);
        }
        let name = format!("{prefix}.weight");
        if self.mlx_affine(&name, out_dim, in_dim, &None)?.is_some()
            || self.fp8_stored(&name, out_dim, in_dim, &None)?.is_some()
        {
            return Err(Error::input(format!(
                "tensor parallel: `{prefix}` is quantized ({}); sharding keeps dense and GGUF weights only so far (run it without --tensor-parallel)",
                self.file_desc()
            )));
        }
        Ok(Linear::Dense {
            weight: self.get_part(&name, (out_dim, in_dim), dim, at, len)?,
            bias,
        })
    }

    /// An MLX-quantized matrix kept as stored ([`Linear::Affine`]) where the kernels take it:
    /// on CUDA with bf16 compute ([`crate::nn::quant::keeps_affine`]). None: load it dense.
    fn mlx_affine(
        &self,
        name: &str,
        out_dim: usize,
        in_dim: usize,
        bias: &Option<Tensor>,
    ) -> Result<Option<Linear>> {
        let Backend::Safetensors { st, .. } = &self.backend else {
            return Ok(None);
        };
        if !crate::nn::quant::keeps_affine(&self.device, self.dtype)
            || (self.mlx.is_none() && self.intq.is_none())
        {
            return Ok(None);
        }
        let (dims, desc) = ([out_dim, in_dim], self.file_desc());
        let stored = match &self.mlx {
            Some(q) => super::mlx::load_stored(st, Some(q), name, &dims, &desc)?,
            None => super::intq::load_stored(st, self.intq.as_ref(), name, &dims, &desc)?,
        };
        let Some(s) = stored else {
            return Ok(None);
        };
        let (bits, group) = (s.params.bits, s.params.group_size);
        if !crate::nn::AffineWeight::supported(bits, group, in_dim, s.scales.dtype()) {
            return Ok(None); // dequantized by `get`
        }
        // integer formats carry f32 biases (-s z): rounded to the scales' dtype here, exact
        // for the symmetric ones (source/intq.rs)
        let w = crate::nn::AffineWeight::from_stored(
            &s.packed,
            &s.scales,
            &s.biases.to_dtype(s.scales.dtype())?,
            bits,
            group,
            out_dim,
            in_dim,
            &self.device,
        )?;
        self.used.borrow_mut().extend(s.read);
        if self.mlx.is_some() {
            *self.mlx_report.borrow_mut().entry(s.params).or_default() += 1;
            *self.mlx_kept.borrow_mut() += 1;
        } else {
            *self.intq_count.borrow_mut() += 1;
            *self.intq_kept.borrow_mut() += 1;
        }
        Ok(Some(Linear::Affine {
            weight: std::sync::Arc::new(w),
            bias: bias.clone(),
        }))
    }

    /// Whether the MLX expert stack `name` (logical `[E, rows, k]`) stays as stored
    /// ([`Self::mlx_expert_stack`]): on CUDA with bf16 compute, 4 bits with bf16 scales, at
    /// widths the MoE tensor-core kernels and the affine layout take (`k` a multiple of 128,
    /// `rows` of 32). False for a float tensor or where it is dequantized instead.
    pub fn mlx_keeps_stack(&self, name: &str, (e, rows, k): (usize, usize, usize)) -> Result<bool> {
        let Backend::Safetensors { st, .. } = &self.backend else {
            return Ok(false);
        };
        if !crate::nn::quant::keeps_affine(&self.device, self.dtype)
            || self.mlx.is_none()
            || rows % 32 != 0
        {
            return Ok(false);
        }
        let Some(s) = super::mlx::load_stored(
            st,
            self.mlx.as_ref(),
            name,
            &[e, rows, k],
            &self.file_desc(),
        )?
        else {
            return Ok(false);
        };
        Ok(s.params.bits == 4
            && crate::nn::AffineWeight::supported(4, s.params.group_size, k, s.scales.dtype())
            && s.scales.dtype() == DType::BF16)
    }

    /// MLX expert stacks `names` (each logical `[E, rows, k]`, [`Self::mlx_keeps_stack`] true
    /// for each, same group size) as one affine matrix of `E * rows * names.len()` rows, kept as
    /// stored: expert e's rows of `names[0]`, then its rows of `names[1]`, ... (gate rows then
    /// up rows, as the MoE kernels take `gate_up`).
    pub fn mlx_expert_stack(
        &self,
        names: &[&str],
        (e, rows, k): (usize, usize, usize),
    ) -> Result<crate::nn::AffineWeight> {
        let Backend::Safetensors { st, .. } = &self.backend else {
            return Err(Error::input(
                "MLX expert stacks are read from safetensors only",
            ));
        };
        let mut parts = Vec::with_capacity(names.len());
        for name in names {
            let s = super::mlx::load_stored(
                st,
                self.mlx.as_ref(),
                name,
                &[e, rows, k],
                &self.file_desc(),
            )?
            .ok_or_else(|| {
                Error::weights(
                    self.file_desc(),
                    format!("tensor `{name}` is not MLX-quantized"),
                )
            })?;
            parts.push(s);
        }
        let group = parts[0].params.group_size;
        if parts.iter().any(|p| p.params != parts[0].params) {
            return Err(Error::weights(
                self.file_desc(),
                format!("the expert stacks {names:?} differ in bits or group size"),
            ));
        }
        // interleave per expert: expert x's rows of each part, in order
        let row_bytes = k / 2;
        let block = rows * row_bytes;
        let mut packed = Vec::with_capacity(e * block * parts.len());
        for x in 0..e {
            for p in &parts {
                packed.extend_from_slice(&p.packed[x * block..(x + 1) * block]);
            }
        }
        let scales = Tensor::cat(&parts.iter().map(|p| &p.scales).collect::<Vec<_>>(), 1)?;
        let biases = Tensor::cat(&parts.iter().map(|p| &p.biases).collect::<Vec<_>>(), 1)?;
        let w = crate::nn::AffineWeight::from_stored(
            &packed,
            &scales,
            &biases,
            4,
            group,
            e * rows * parts.len(),
            k,
            &self.device,
        )?;
        for p in parts {
            self.used.borrow_mut().extend(p.read);
            *self.mlx_report.borrow_mut().entry(p.params).or_default() += 1;
            *self.mlx_kept.borrow_mut() += 1;
        }
        Ok(w)
    }

    /// Whether the integer-quantized per-expert matrices `names` (each logical `[rows, k]`)
    /// stay as stored ([`Self::int_expert_stack`]): on CUDA with bf16 compute, 4 bits with bf16
    /// scales (compressed-tensors, as Kimi-K2.5 publishes its experts), `rows` a multiple of 32,
    /// `k` a width the affine layout takes. False where they are loaded dense instead.
    pub fn int_keeps_stack(&self, names: &[String], (rows, k): (usize, usize)) -> Result<bool> {
        let Backend::Safetensors { st, .. } = &self.backend else {
            return Ok(false);
        };
        let Some(quant) = self.intq.as_ref() else {
            return Ok(false);
        };
        if !crate::nn::quant::keeps_affine(&self.device, self.dtype)
            || quant.params.bits != 4
            || rows % 32 != 0
            || !crate::nn::AffineWeight::supported(4, quant.params.group_size, k, DType::BF16)
            || names.iter().any(|n| !super::intq::is_quantized(st, n))
        {
            return Ok(false);
        }
        let Some(first) = names.first() else {
            return Ok(false);
        };
        let s = super::intq::load_stored(st, Some(quant), first, &[rows, k], &self.file_desc())?;
        Ok(s.is_some_and(|s| s.scales.dtype() == DType::BF16))
    }

    /// The matrices `names` ([`Self::int_keeps_stack`] true) as one affine matrix of
    /// `names.len() * rows` rows in that order (expert 0's gate, its up, expert 1's gate, ...),
    /// kept as stored.
    pub fn int_expert_stack(
        &self,
        names: &[String],
        (rows, k): (usize, usize),
    ) -> Result<crate::nn::AffineWeight> {
        let Backend::Safetensors { st, .. } = &self.backend else {
            return Err(Error::input(
                "integer expert stacks are read from safetensors only",
            ));
        };
        let quant = self.intq.as_ref();
        let desc = self.file_desc();
        let mut parts = Vec::with_capacity(names.len());
        for name in names {
            let s = super::intq::load_stored(st, quant, name, &[rows, k], &desc)?
                .filter(|s| s.scales.dtype() == DType::BF16 && s.params.bits == 4)
                .ok_or_else(|| {
                    Error::weights(
                        &desc,
                        format!("tensor `{name}` is not 4-bit integer-quantized with bf16 scales like the other experts"),
                    )
                })?;
            parts.push(s);
        }
        let packed: Vec<u8> = parts
            .iter()
            .flat_map(|p| p.packed.iter().copied())
            .collect();
        let scales = Tensor::cat(&parts.iter().map(|p| &p.scales).collect::<Vec<_>>(), 0)?;
        let biases = Tensor::cat(&parts.iter().map(|p| &p.biases).collect::<Vec<_>>(), 0)?;
        let w = crate::nn::AffineWeight::from_stored(
            &packed,
            &scales,
            &biases.to_dtype(DType::BF16)?,
            4,
            parts[0].params.group_size,
            rows * parts.len(),
            k,
            &self.device,
        )?;
        for p in parts {
            self.used.borrow_mut().extend(p.read);
            *self.intq_count.borrow_mut() += 1;
            *self.intq_kept.borrow_mut() += 1;
        }
        Ok(w)
    }

    /// An FP8 matrix kept as stored ([`Linear::Fp8`]) where the kernels take it: on CUDA with
    /// bf16 compute, column blocks of whole 32-wide chunks. None: load it dense (`get`
    /// dequantizes it).
    fn fp8_stored(
        &self,
        name: &str,
        out_dim: usize,
        in_dim: usize,
        bias: &Option<Tensor>,
    ) -> Result<Option<Linear>> {
        let Backend::Safetensors { st, .. } = &self.backend else {
            return Ok(None);
        };
        let Some(quant) = self.fp8.as_ref() else {
            return Ok(None);
        };
        if !crate::nn::quant::keeps_affine(&self.device, self.dtype)
            || !crate::nn::Fp8Weight::supported(in_dim, quant.block)
        {
            return Ok(None);
        }
        let Some(s) =
            super::fp8::load_stored(st, Some(quant), name, &[out_dim, in_dim], &self.file_desc())?
        else {
            return Ok(None);
        };
        let w =
            crate::nn::Fp8Weight::from_stored(s.bytes, &s.scales, s.block, s.n, s.k, &self.device)?;
        self.used.borrow_mut().extend(s.read);
        *self.fp8_count.borrow_mut() += 1;
        *self.fp8_kept.borrow_mut() += 1;
        Ok(Some(Linear::Fp8 {
            weight: std::sync::Arc::new(w),
            bias: bias.clone(),
        }))
    }

    /// A GGUF matmul weight `name` placed by [`crate::nn::quant::place`] (the policy: which
    /// stored types are requantized, or become affine weights, for which device and dtype);
    /// [`Placed::Float`] for float types (the caller loads those dense).
    fn matmul_weight(&self, q: Arc<QTensor>, name: &str) -> Result<Placed> {
        let Backend::Gguf(g) = &self.backend else {
            return Ok(Placed::Float);
        };
        let mut note = |k: String| *g.report.borrow_mut().entry(k).or_default() += 1;
        crate::nn::quant::place(q, &self.device, self.dtype, g.keep_quant, &mut note)
            .map_err(|e| Error::weights(self.file_desc(), format!("tensor `{name}`: {e}")))
    }

    /// The token embedding table `[vocab, hidden]`. Quantized GGUF tables stay quantized
    /// in their stored type (rows are dequantized on lookup: exactly the stored values).
    pub fn embedding(&self, name: &str, vocab: usize, hidden: usize) -> Result<Embedding> {
        let shape = Shape::from((vocab, hidden));
        if self.is_gguf() {
            let q = self.qtensor(name, &shape)?;
            if !matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
                && self.device.is_cpu()
            {
                return Ok(Embedding::Quant {
                    table: Arc::new(q),
                    dtype: self.dtype,
                });
            }
        }
        Ok(Embedding::Dense(self.get(name, shape)?))
    }

    /// The LM head of a tied model: the embedding table as a linear layer (quantized
    /// tables stay quantized, requantized like any matmul weight unless `keep_quant`).
    pub fn tied_head(&self, emb: &Embedding) -> Result<Linear> {
        Ok(match emb {
            Embedding::Dense(t) => Linear::dense(t.clone(), None),
            Embedding::Quant { table, .. } => {
                let out_features = table.shape().dims()[0];
                match self.matmul_weight(table.clone(), "lm_head.weight (tied)")? {
                    Placed::Quant(weight) => Linear::quant(weight, None, out_features)?,
                    Placed::Affine(weight) => Linear::Affine {
                        weight: Arc::new(weight),
                        bias: None,
                    },
                    Placed::Float => Linear::dense(emb.table_dense()?, None),
                }
            }
        })
    }

    /// What the load did to quantized tensors, e.g. `Q4_1->Q8_0 x210, Q8_0 x1` (GGUF),
    /// `mlx affine 4-bit g64 x197; dequantized to f32` (MLX safetensors), `fp8 e4m3 128x128
    /// x197; dequantized to bf16` (FP8 safetensors), or None for float safetensors.
    pub fn quant_report(&self) -> Option<String> {
        let Backend::Gguf(g) = &self.backend else {
            let parts: Vec<String> = [
                super::mlx::report(
                    &self.mlx_report.borrow(),
                    *self.mlx_kept.borrow(),
                    self.dtype,
                ),
                super::fp8::report(
                    self.fp8.as_ref(),
                    *self.fp8_count.borrow(),
                    *self.fp8_kept.borrow(),
                    self.dtype,
                ),
                super::intq::report(
                    self.intq.as_ref(),
                    *self.intq_count.borrow(),
                    *self.intq_kept.borrow(),
                    self.dtype,
                ),
            ]
            .into_iter()
            .flatten()
            .collect();
            return (!parts.is_empty()).then(|| parts.join("; "));
        };
        let r = g.report.borrow();
        Some(
            r.iter()
                .map(|(k, n)| format!("{k} x{n}"))
                .collect::<Vec<_>>()
                .join(", "),
        )
    }

    /// Names in the checkpoint that were never read.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.borrow();
        let mut v: Vec<String> = self
            .names()
            .into_iter()
            .filter(|n| !used.contains(n))
            .collect();
        v.sort();
        v
    }
}

/// One tensor of a safetensors header, as validated by [`read_safetensors_header`].
#[derive(Debug, Clone)]
pub struct StTensor {
    pub name: String,
    /// The safetensors dtype (`F32`, `BF16`, `I64`, ...).
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: u64,
}

impl StTensor {
    /// A floating-point tensor (converted to the compute dtype at load).
    pub fn is_float(&self) -> bool {
        self.dtype.starts_with('F') || self.dtype == "BF16"
    }
    pub fn elements(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// Bits per element of a safetensors dtype, None for names the format does not define.
fn safetensors_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// Validate a safetensors file's header against its length before mapping: the 8-byte
/// header length, the JSON header, and for every tensor its dtype, its shape x dtype size
/// (overflow-checked) against its data_offsets, the offsets against the file, and that no
/// two tensors overlap.
pub fn check_safetensors_file(path: &PathBuf) -> Result<()> {
    read_safetensors_header(path).map(|_| ())
}

/// [`check_safetensors_file`], returning the tensors the header lists.
pub fn read_safetensors_header(path: &Path) -> Result<Vec<StTensor>> {
    use std::io::Read;
    let file = path.display().to_string();
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    if len < 8 {
        return Err(Error::weights(
            file,
            format!(
                "file is {len} bytes: too short for a safetensors header (truncated download?)"
            ),
        ));
    }
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|e| Error::io(path, e))?;
    let hlen = u64::from_le_bytes(n);
    if hlen > 100_000_000 || 8 + hlen > len {
        return Err(Error::weights(
            file,
            format!("header length {hlen} exceeds the file size {len} (truncated or not a safetensors file)"),
        ));
    }
    let mut header = vec![0u8; hlen as usize];
    f.read_exact(&mut header).map_err(|e| Error::io(path, e))?;
    parse_safetensors_header(&header, len - 8 - hlen, &file)
}

/// The checks of [`read_safetensors_header`] on the JSON header bytes of a file whose data
/// section is `data_len` bytes; `file` names it in errors.
pub fn parse_safetensors_header(header: &[u8], data_len: u64, file: &str) -> Result<Vec<StTensor>> {
    let v: serde_json::Value = serde_json::from_slice(header)
        .map_err(|e| Error::weights(file, format!("header is not valid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| Error::weights(file, "header is not a JSON object"))?;
    let mut out = Vec::with_capacity(obj.len());
    let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(obj.len());
    for (name, t) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = |msg: String| Error::weights(file, format!("tensor `{name}`: {msg}"));
        let offs = t
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| {
                bad("missing or invalid data_offsets (two non-negative integers)".into())
            })?;
        if offs.0 > offs.1 || offs.1 > data_len {
            return Err(bad(format!(
                "data_offsets {offs:?} outside the data section ({data_len} bytes): the file is truncated; re-download it"
            )));
        }
        let dtype = t
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("missing dtype".into()))?;
        let bits =
            safetensors_bits(dtype).ok_or_else(|| bad(format!("unknown dtype `{dtype}`")))?;
        let shape = t
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
            .ok_or_else(|| {
                bad("missing or invalid shape (a list of non-negative integers)".into())
            })?;
        let bytes = shape
            .iter()
            .try_fold(bits, |acc, &d| acc.checked_mul(d as u64))
            .map(|b| b.div_ceil(8))
            .ok_or_else(|| bad(format!("shape {shape:?} x {dtype} overflows 64 bits")))?;
        if bytes != offs.1 - offs.0 {
            return Err(bad(format!(
                "shape {shape:?} x {dtype} is {bytes} bytes but data_offsets {offs:?} span {} bytes",
                offs.1 - offs.0
            )));
        }
        spans.push((offs.0, offs.1, out.len()));
        out.push(StTensor {
            name: name.clone(),
            dtype: dtype.to_string(),
            shape,
            bytes,
        });
    }
    spans.sort_unstable();
    // The format requires the tensors to cover the data section exactly, in order.
    let (mut end, mut prev) = (0u64, None::<usize>);
    for &(a, b, i) in &spans {
        if a > end {
            let after = prev.map_or("the header".to_string(), |p| format!("`{}`", out[p].name));
            return Err(Error::weights(
                file,
                format!("{} unused bytes between {after} and tensor `{}` (bytes {a}..{b}): corrupt file", a - end, out[i].name),
            ));
        }
        end = end.max(b);
        prev = Some(i);
    }
    if end != data_len {
        return Err(Error::weights(
            file,
            format!(
                "the tensors cover {end} of the {data_len} data bytes: corrupt or truncated file"
            ),
        ));
    }
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::weights(
                file,
                format!(
                    "tensors `{}` (bytes {}..{}) and `{}` (bytes {}..{}) overlap",
                    out[w[0].2].name, w[0].0, w[0].1, out[w[1].2].name, w[1].0, w[1].1
                ),
            ));
        }
    }
    Ok(out)
}

/// Rows (`dim` 0) or columns (`dim` 1) `[at, at + len)` of a 2-D quantized matrix, as
/// stored: a row is a run of self-contained blocks, so rows slice at any row and columns at
/// block boundaries (an error otherwise, naming the block size).
pub fn slice_qtensor(q: &QTensor, dim: usize, at: usize, len: usize) -> Result<QTensor> {
    use candle_core::quantized::QStorage;
    use std::borrow::Cow;
    let dims = q.shape().dims().to_vec();
    let (rows, cols) = match dims[..] {
        [r, c] => (r, c),
        _ => return Err(Error::input(format!("a 2-D matrix, not {dims:?}"))),
    };
    let dt = q.dtype();
    let (bs, ts) = (dt.block_size(), dt.type_size());
    let data = q.data()?;
    let row_bytes = data.len() / rows.max(1);
    let (out, shape) = if dim == 0 {
        (
            data[at * row_bytes..(at + len) * row_bytes].to_vec(),
            (len, cols),
        )
    } else {
        if !at.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(Error::input(format!(
                "columns {at}..{} do not fall on its {dt:?} blocks of {bs} (choose a tensor-parallel size that splits the width into whole blocks)",
                at + len
            )));
        }
        let (b0, nb) = (at / bs * ts, len / bs * ts);
        let mut out = Vec::with_capacity(rows * nb);
        for r in 0..rows {
            out.extend_from_slice(&data[r * row_bytes + b0..r * row_bytes + b0 + nb]);
        }
        (out, (rows, len))
    };
    let storage = QStorage::from_data(Cow::Owned(out), &Device::Cpu, dt)?;
    Ok(QTensor::new(storage, shape)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's part read from the mapped file equals the whole tensor loaded and cut, for
    /// rows and columns, every stored float dtype, parts at the start, middle and end; a part
    /// past the tensor is an error naming it.
    #[test]
    fn a_part_read_from_the_file_equals_the_whole_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let base = Tensor::arange(0f32, 60.0, &Device::Cpu)
            .unwrap()
            .affine(0.37, -3.0)
            .unwrap()
            .reshape((6, 10))
            .unwrap();
        let mut m = std::collections::HashMap::new();
        for (n, dt) in [
            ("f32", DType::F32),
            ("bf16", DType::BF16),
            ("f16", DType::F16),
        ] {
            m.insert(n.to_string(), base.to_dtype(dt).unwrap());
        }
        // a stack of 4 experts' [3, 5] matrices
        let stack = base.reshape((4, 3, 5)).unwrap();
        m.insert("stack".to_string(), stack.to_dtype(DType::BF16).unwrap());
        candle_core::safetensors::save(&m, &path).unwrap();
        let v = |t: &Tensor| -> Vec<f32> {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        for compute in [DType::F32, DType::BF16] {
            let w = Weights::open(&[path.clone()], compute, &Device::Cpu).unwrap();
            for name in ["f32", "bf16", "f16"] {
                let whole = w.get(name, (6, 10)).unwrap();
                for (dim, at, len) in [
                    (0, 0, 3),
                    (0, 3, 3),
                    (0, 2, 1),
                    (1, 0, 5),
                    (1, 5, 5),
                    (1, 3, 4),
                ] {
                    let part = w.get_part(name, (6, 10), dim, at, len).unwrap();
                    let want = whole.narrow(dim, at, len).unwrap();
                    assert_eq!(part.dims(), want.dims());
                    assert_eq!(part.dtype(), compute);
                    assert_eq!(
                        v(&part),
                        v(&want),
                        "{name} as {compute:?}, dim {dim} {at}+{len}"
                    );
                }
            }
            let whole = w.get("stack", (4, 3, 5)).unwrap();
            for (at, len) in [(0, 2), (2, 2), (1, 3), (3, 1)] {
                let part = w.get_part("stack", (4, 3, 5), 0, at, len).unwrap();
                let want = whole.narrow(0, at, len).unwrap();
                assert_eq!(part.dims(), &[len, 3, 5]);
                assert_eq!(v(&part), v(&want), "stack experts {at}+{len}");
            }
            assert!(
                w.get_part("stack", (4, 3, 5), 1, 0, 2).is_err(),
                "columns of a stack"
            );
            let e = w.get_part("f32", (6, 10), 1, 8, 3).unwrap_err().to_string();
            assert!(e.contains("`f32`") && e.contains("8..11"), "{e}");
            let e = w.get_part("f32", (5, 10), 0, 0, 2).unwrap_err().to_string();
            assert!(e.contains("shape"), "{e}");
        }
    }
}
