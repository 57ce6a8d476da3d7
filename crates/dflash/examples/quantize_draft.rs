//! Store a DFlash draft checkpoint MLX affine-quantized (the mlx-community layout the loader
//! reads and dequantizes at load): `cargo run --release --example quantize_draft -- IN_DIR
//! OUT_DIR [BITS=8] [GROUP=64]`. Every 2-D `.weight` whose width is a multiple of the group is
//! quantized (the linears and `fc`), norms stay as they are; `config.json` gains
//! `quantization: {group_size, bits}`. At 8 bits the demo draft is half its bf16 size and
//! proposes nearly the same tokens (docs/training.md measures its tau against the float one).

use dflash::source::mlx_write::{quantize_checkpoint, Layout};
use std::path::PathBuf;

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> R<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let (Some(src), Some(dst)) = (a.first().map(PathBuf::from), a.get(1).map(PathBuf::from)) else {
        return Err("usage: quantize_draft IN_DIR OUT_DIR [BITS=8] [GROUP=64]".into());
    };
    let num = |i: usize, d: usize| -> R<usize> {
        a.get(i).map_or(Ok(d), |s| {
            s.parse()
                .map_err(|_| format!("argument {}: `{s}` is not a number", i + 1).into())
        })
    };
    let layout = Layout::new(num(2, 8)?, num(3, 64)?);
    let w = src.join("model.safetensors");
    let float = candle_core::safetensors::load(&w, &candle_core::Device::Cpu)
        .map_err(|e| format!("{}: {e}", w.display()))?;
    let (mlx, _, n) = quantize_checkpoint(&float, &layout)?;
    let cfg_path = src.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path)?)
        .map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    cfg[layout.key] = layout.config_entry();
    std::fs::create_dir_all(&dst)?;
    candle_core::safetensors::save(&mlx, dst.join("model.safetensors"))?;
    std::fs::write(
        dst.join("config.json"),
        serde_json::to_string_pretty(&cfg)? + "\n",
    )?;
    let size = |p: PathBuf| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;
    println!(
        "{} -> {}: {n} tensors at {}-bit g{} ({:.1} MB -> {:.1} MB)",
        src.display(),
        dst.display(),
        layout.bits,
        layout.group,
        size(w),
        size(dst.join("model.safetensors"))
    );
    Ok(())
}
