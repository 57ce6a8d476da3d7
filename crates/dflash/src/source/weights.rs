//! Memory-mapped safetensors weights with checked, named access.
//!
//! Every tensor is checked for presence and shape and converted to the compute dtype on the
//! target device. Names that were read are recorded so a loader can list the tensors a
//! checkpoint carries that the model did not use.

use crate::{Error, Result};
use candle_core::{safetensors::MmapedSafetensors, DType, Device, Shape, Tensor};
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::PathBuf;

pub struct Weights {
    st: MmapedSafetensors,
    files: Vec<PathBuf>,
    pub dtype: DType,
    pub device: Device,
    used: RefCell<BTreeSet<String>>,
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
        Ok(Self {
            st,
            files: files.to_vec(),
            dtype,
            device: device.clone(),
            used: RefCell::default(),
        })
    }

    fn file_desc(&self) -> String {
        match self.files.as_slice() {
            [one] => one.display().to_string(),
            many => format!(
                "{} ({} shards)",
                many[0]
                    .parent()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                many.len()
            ),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.st.get(name).is_ok()
    }

    /// All tensor names in the checkpoint.
    pub fn names(&self) -> Vec<String> {
        self.st.tensors().into_iter().map(|(n, _)| n).collect()
    }

    /// Load `name`, check its shape, convert to the compute dtype on the device.
    pub fn get(&self, name: &str, shape: impl Into<Shape>) -> Result<Tensor> {
        self.get_dtype(name, shape, self.dtype)
    }

    pub fn get_dtype(&self, name: &str, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        let shape = shape.into();
        let view = self.st.get(name).map_err(|_| {
            Error::weights(
                self.file_desc(),
                format!("missing tensor `{name}` (expected shape {shape:?})"),
            )
        })?;
        if view.shape() != shape.dims() {
            return Err(Error::weights(
                self.file_desc(),
                format!(
                    "tensor `{name}` has shape {:?}, expected {:?}",
                    view.shape(),
                    shape.dims()
                ),
            ));
        }
        self.used.borrow_mut().insert(name.to_string());
        let t = self
            .st
            .load(name, &Device::Cpu)
            .map_err(|e| Error::weights(self.file_desc(), format!("tensor `{name}`: {e}")))?;
        let t = if t.dtype() != dtype {
            t.to_dtype(dtype)?
        } else {
            t
        };
        Ok(t.to_device(&self.device)?)
    }

    /// Shape of `name` from the header, without loading it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.st.get(name).ok().map(|v| v.shape().to_vec())
    }

    /// Record `name` as understood though not loaded (e.g. a bool buffer the engine derives).
    pub fn mark_used(&self, name: &str) {
        self.used.borrow_mut().insert(name.to_string());
    }

    /// Load `name` if present.
    pub fn get_opt(&self, name: &str, shape: impl Into<Shape>) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
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

/// Validate a safetensors file's header against its length before mapping: the 8-byte
/// header length, the JSON header, and every tensor's offsets and byte size.
pub fn check_safetensors_file(path: &PathBuf) -> Result<()> {
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
    let v: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| Error::weights(&file, format!("header is not valid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| Error::weights(&file, "header is not a JSON object"))?;
    let data_len = len - 8 - hlen;
    for (name, t) in obj {
        if name == "__metadata__" {
            continue;
        }
        let offs = t
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| {
                Error::weights(
                    &file,
                    format!("tensor `{name}`: missing or invalid data_offsets"),
                )
            })?;
        if offs.0 > offs.1 || offs.1 > data_len {
            return Err(Error::weights(
                &file,
                format!(
                    "tensor `{name}`: data_offsets {:?} outside the data section ({data_len} bytes): the file is truncated; re-download it",
                    offs
                ),
            ));
        }
    }
    Ok(())
}
