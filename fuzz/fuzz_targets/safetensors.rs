//! Safetensors weights: the first byte picks the input's meaning.
//! 0: a whole `model.safetensors` file -> header checks, memory map, every tensor loaded
//!    (and converted to f32) by name and shape.
//! 1: a `model.safetensors.index.json` in a directory that also holds `config.json` and
//!    two valid shards (`a.safetensors`, `b.safetensors`) -> the shard list, then the
//!    weights of the shards it names.
#![no_main]
use candle_core::{DType, Device};
use dflash::source::weights::read_safetensors_header;
use dflash::source::{ModelSource, Weights};
use dflash_fuzz::scratch_file;
use libfuzzer_sys::fuzz_target;

/// A valid one-tensor safetensors file.
fn shard(name: &str) -> Vec<u8> {
    let h = format!(r#"{{"{name}":{{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}}}"#);
    let mut v = (h.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(h.as_bytes());
    v.extend_from_slice(&[0u8; 8]);
    v
}

fn load_all(files: &[std::path::PathBuf]) {
    let Ok(w) = Weights::open(files, DType::F32, &Device::Cpu) else {
        return;
    };
    for name in w.names() {
        if let Some(shape) = w.shape(&name) {
            let _ = w.get(&name, shape);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 2 {
        0 => {
            let p = scratch_file(None, "model.safetensors", rest);
            if read_safetensors_header(&p).is_ok() {
                load_all(&[p]);
            }
        }
        _ => {
            let p = scratch_file(Some("sharded"), "model.safetensors.index.json", rest);
            let dir = p.parent().unwrap().to_path_buf();
            std::fs::write(dir.join("config.json"), b"{}").unwrap();
            std::fs::write(dir.join("a.safetensors"), shard("x")).unwrap();
            std::fs::write(dir.join("b.safetensors"), shard("y")).unwrap();
            if let Ok(src) = ModelSource::from_dir("fuzz", &dir) {
                load_all(&src.weight_files);
            }
        }
    }
});
