//! A bounded reader for the header of a GGUF file (magic, metadata, tensor table), producing
//! candle's [`Content`] so that tensors are then read by candle as before.
//!
//! Where it sits: [`crate::source::gguf::GgufFile::open`] calls [`read_content`]; nothing
//! else reads GGUF headers. Model files come from outside, so every count, length, dimension
//! and offset taken from the file is checked against the file's size before anything is
//! allocated, and every tensor's bytes (dims x type size, overflow-checked) must lie inside
//! the data section without overlapping another tensor. A violation is a one-line
//! [`Error::Weights`] naming the file and the key or tensor.

use crate::{Error, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use candle_core::quantized::GgmlDType;
use std::collections::HashMap;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

/// Most metadata values (array elements included) one file may hold. The largest real
/// vocabularies store about 1.5M (tokens + merges + scores + types); each value costs about
/// 32 bytes in memory, so this bounds the metadata to about 256 MiB whatever the file says.
pub const MAX_METADATA_VALUES: u64 = 1 << 23;
/// Dimensions of a tensor (ggml's GGML_MAX_DIMS).
pub const MAX_DIMS: u32 = 4;
/// Largest accepted `general.alignment`.
pub const MAX_ALIGNMENT: u64 = 1 << 16;
const DEFAULT_ALIGNMENT: u64 = 32;

/// The ggml type ids that exist but this build cannot load, for a clearer error.
fn ggml_type_name(t: u32) -> Option<&'static str> {
    Some(match t {
        4 | 5 => "Q4_2/Q4_3 (removed from ggml)",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

/// The ggml type of id `t`, if candle can hold it.
pub fn ggml_dtype(t: u32) -> Option<GgmlDType> {
    use GgmlDType::*;
    Some(match t {
        0 => F32,
        1 => F16,
        2 => Q4_0,
        3 => Q4_1,
        6 => Q5_0,
        7 => Q5_1,
        8 => Q8_0,
        9 => Q8_1,
        10 => Q2K,
        11 => Q3K,
        12 => Q4K,
        13 => Q5K,
        14 => Q6K,
        15 => Q8K,
        30 => BF16,
        _ => return None,
    })
}

/// Bytes a tensor of `dims` (GGUF order: innermost first) and type `dt` occupies, or a
/// message saying why it cannot exist.
pub fn tensor_bytes(dims: &[u64], dt: GgmlDType) -> std::result::Result<u64, String> {
    let mut elems: u64 = 1;
    for &d in dims {
        if d == 0 {
            return Err(format!("dimension of size 0 in {dims:?}"));
        }
        elems = elems
            .checked_mul(d)
            .ok_or_else(|| format!("dims {dims:?} overflow 64 bits"))?;
    }
    let block = dt.block_size() as u64;
    let row = dims.first().copied().unwrap_or(1);
    if row % block != 0 {
        return Err(format!(
            "row length {row} is not a multiple of the {dt:?} block size {block}"
        ));
    }
    (elems / block)
        .checked_mul(dt.type_size() as u64)
        .filter(|b| *b <= isize::MAX as u64)
        .ok_or_else(|| format!("dims {dims:?} of {dt:?} exceed the address space"))
}

struct Reader<'a, R> {
    r: R,
    pos: u64,
    len: u64,
    file: &'a str,
    v1: bool,
    /// Metadata values still allowed.
    values_left: u64,
}

impl<R: Read> Reader<'_, R> {
    fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::weights(self.file, format!("GGUF header: {msg}"))
    }
    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }
    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        if self.remaining() < N as u64 {
            return Err(self.err(format!(
                "file ends at byte {} inside {what} (truncated download? re-download it)",
                self.len
            )));
        }
        self.r
            .read_exact(&mut b)
            .map_err(|e| self.err(format!("reading {what}: {e}")))?;
        self.pos += N as u64;
        Ok(b)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.bytes::<1>(what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(what)?))
    }
    /// A length prefix (u32 in version 1, u64 after).
    fn len_prefix(&mut self, what: &str) -> Result<u64> {
        if self.v1 {
            Ok(self.u32(what)? as u64)
        } else {
            self.u64(what)
        }
    }
    fn prefix_size(&self) -> u64 {
        if self.v1 {
            4
        } else {
            8
        }
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len_prefix(what)?;
        if n > self.remaining() {
            return Err(self.err(format!(
                "{what}: string of {n} bytes, but only {} bytes are left in the file (truncated or corrupt file)",
                self.remaining()
            )));
        }
        let mut v = vec![0u8; n as usize];
        self.r
            .read_exact(&mut v)
            .map_err(|e| self.err(format!("reading {what}: {e}")))?;
        self.pos += n;
        // Strings are not NUL-terminated by the spec, but some writers add one.
        while v.last() == Some(&0) {
            v.pop();
        }
        Ok(String::from_utf8_lossy(&v).into_owned())
    }
    /// Smallest encoding of one value of type `t` (to bound array lengths by the file size).
    fn min_size(&self, t: u32) -> u64 {
        match t {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => self.prefix_size(),
            _ => 4 + self.prefix_size(),
        }
    }
    fn take_value_budget(&mut self, n: u64, key: &str) -> Result<()> {
        if n > self.values_left {
            return Err(self.err(format!(
                "`{key}`: more than {MAX_METADATA_VALUES} metadata values in the file"
            )));
        }
        self.values_left -= n;
        Ok(())
    }
    fn value(&mut self, t: u32, key: &str, in_array: bool) -> Result<Value> {
        Ok(match t {
            0 => Value::U8(self.u8(key)?),
            1 => Value::I8(self.u8(key)? as i8),
            2 => Value::U16(u16::from_le_bytes(self.bytes(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(self.u32(key)? as i32),
            6 => Value::F32(f32::from_le_bytes(self.bytes(key)?)),
            7 => match self.u8(key)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("`{key}`: bool value {b} (expected 0 or 1)"))),
            },
            8 => Value::String(self.string(key)?),
            9 if in_array => {
                return Err(self.err(format!("`{key}`: arrays of arrays are not supported")))
            }
            9 => {
                let et = self.u32(key)?;
                if et > 12 {
                    return Err(self.err(format!("`{key}`: unknown array element type {et}")));
                }
                let n = self.len_prefix(key)?;
                let need = n.saturating_mul(self.min_size(et));
                if need > self.remaining() {
                    return Err(self.err(format!(
                        "`{key}`: array of {n} elements needs at least {need} bytes, only {} are left in the file (truncated or corrupt file)",
                        self.remaining()
                    )));
                }
                self.take_value_budget(n, key)?;
                let mut v = Vec::with_capacity(n.min(1 << 16) as usize);
                for _ in 0..n {
                    v.push(self.value(et, key, true)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(self.u64(key)? as i64),
            12 => Value::F64(f64::from_le_bytes(self.bytes(key)?)),
            other => return Err(self.err(format!("`{key}`: unknown value type {other}"))),
        })
    }
}

/// Read and validate the header of the GGUF file at `path`.
pub fn read_content(path: &Path) -> Result<Content> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    let file = path.display().to_string();
    read_content_from(BufReader::new(f), len, &file)
}

/// [`read_content`] over any reader of `len` bytes positioned at the file's start; `file`
/// names it in errors.
pub fn read_content_from<R: Read + Seek>(r: R, len: u64, file: &str) -> Result<Content> {
    let mut rd = Reader {
        r,
        pos: 0,
        len,
        file,
        v1: false,
        values_left: MAX_METADATA_VALUES,
    };
    let magic = rd.bytes::<4>("the magic number")?;
    if &magic != b"GGUF" {
        return Err(rd.err(format!(
            "not a GGUF file (starts with {magic:02x?}, expected \"GGUF\")"
        )));
    }
    let version = rd.u32("the version")?;
    let magic = match version {
        1 => VersionedMagic::GgufV1,
        2 => VersionedMagic::GgufV2,
        3 => VersionedMagic::GgufV3,
        v if (1..=3).contains(&v.swap_bytes()) => {
            return Err(rd.err("big-endian GGUF files are not supported"));
        }
        v => return Err(rd.err(format!("unsupported version {v} (supported: 1, 2, 3)"))),
    };
    rd.v1 = version == 1;
    let n_tensors = rd.len_prefix("the tensor count")?;
    let n_kv = rd.len_prefix("the metadata count")?;
    // Each metadata entry is at least a key length + a type + one byte; each tensor entry a
    // name length + n_dims + type + offset.
    let p = rd.prefix_size();
    let need = n_kv
        .saturating_mul(p + 5)
        .saturating_add(n_tensors.saturating_mul(p + 16));
    if need > rd.remaining() {
        return Err(rd.err(format!(
            "claims {n_tensors} tensors and {n_kv} metadata entries, which need at least {need} bytes; the file has {len} (truncated or corrupt file)"
        )));
    }
    rd.take_value_budget(n_kv, "metadata count")?;

    let mut metadata = HashMap::with_capacity(n_kv.min(1 << 12) as usize);
    for i in 0..n_kv {
        let key = rd.string(&format!("metadata key #{i}"))?;
        let t = rd.u32(&key)?;
        let v = rd.value(t, &key, false)?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(rd.err(format!("duplicate metadata key `{key}`")));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I32(x) if *x >= 0 => *x as u64,
            other => {
                return Err(rd.err(format!(
                    "`general.alignment`: expected an unsigned integer, found {other:?}"
                )))
            }
        },
    };
    if alignment == 0 || !alignment.is_power_of_two() || alignment > MAX_ALIGNMENT {
        return Err(rd.err(format!(
            "`general.alignment` is {alignment}: must be a power of two <= {MAX_ALIGNMENT}"
        )));
    }

    // (name, offset, bytes) in file order, for the bounds and overlap checks below.
    let mut spans: Vec<(String, u64, u64)> = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
    let mut tensor_infos = HashMap::with_capacity(n_tensors.min(1 << 16) as usize);
    for i in 0..n_tensors {
        let name = rd.string(&format!("tensor name #{i}"))?;
        let what = format!("tensor `{name}`");
        let n_dims = rd.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(rd.err(format!(
                "{what} has {n_dims} dimensions (at most {MAX_DIMS})"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(if rd.v1 {
                rd.u32(&what)? as u64
            } else {
                rd.u64(&what)?
            });
        }
        let t = rd.u32(&what)?;
        let dt = ggml_dtype(t).ok_or_else(|| {
            rd.err(match ggml_type_name(t) {
                Some(n) => format!("{what} has ggml type {t} ({n}), which this build cannot load"),
                None => format!("{what} has unknown ggml type {t}"),
            })
        })?;
        let offset = rd.u64(&what)?;
        let bytes = tensor_bytes(&dims, dt).map_err(|m| rd.err(format!("{what}: {m}")))?;
        if offset % alignment != 0 {
            return Err(rd.err(format!(
                "{what}: offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let shape: Vec<usize> = dims.iter().rev().map(|&d| d as usize).collect();
        spans.push((name.clone(), offset, bytes));
        if tensor_infos
            .insert(
                name.clone(),
                TensorInfo {
                    ggml_dtype: dt,
                    shape: shape.into(),
                    offset,
                },
            )
            .is_some()
        {
            return Err(rd.err(format!("duplicate tensor name `{name}`")));
        }
    }

    let data_start = rd
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| rd.err("header end overflows"))?;
    let data_len = len.saturating_sub(data_start);
    spans.sort_by_key(|s| s.1);
    for (i, (name, off, bytes)) in spans.iter().enumerate() {
        let end = off.checked_add(*bytes).filter(|e| *e <= data_len);
        let Some(end) = end else {
            return Err(rd.err(format!(
                "tensor `{name}` ({bytes} bytes at data offset {off}) extends past the end of the file ({data_len} bytes of tensor data): the file is truncated; re-download it"
            )));
        };
        if let Some((next, noff, _)) = spans.get(i + 1) {
            if *noff < end {
                return Err(rd.err(format!(
                    "tensors `{name}` (data offsets {off}..{end}) and `{next}` (from {noff}) overlap"
                )));
            }
        }
    }
    Ok(Content {
        magic,
        metadata,
        tensor_infos,
        tensor_data_offset: data_start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked() {
        assert_eq!(tensor_bytes(&[64, 2], GgmlDType::F32), Ok(512));
        assert_eq!(tensor_bytes(&[64, 2], GgmlDType::Q8_0), Ok(4 * 34));
        assert!(tensor_bytes(&[1 << 40, 1 << 40], GgmlDType::F32)
            .unwrap_err()
            .contains("overflow"));
        assert!(tensor_bytes(&[1 << 62], GgmlDType::F32)
            .unwrap_err()
            .contains("address space"));
        assert!(tensor_bytes(&[33], GgmlDType::Q8_0)
            .unwrap_err()
            .contains("block size 32"));
        assert!(tensor_bytes(&[0, 3], GgmlDType::F32).is_err());
    }
}
