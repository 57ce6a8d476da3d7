//! MXFP4 test data: random expert stacks as gpt-oss stores them, and a checkpoint's dequantized
//! twin (the float layout transformers loads), both by the format's own definition
//! (`dflash::source::mxfp4::dequantize`, itself tested against hand-packed groups).

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// Random codes and scales for `groups` groups of 32 values: every code, scales from `lo..=hi`.
pub fn random_groups(groups: usize, lo: u8, hi: u8, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let mut rng = dflash::testing::Rng::new(seed);
    let codes = (0..16 * groups).map(|_| rng.below(256) as u8).collect();
    let span = (hi - lo) as usize + 1;
    let scales = (0..groups).map(|_| lo + rng.below(span) as u8).collect();
    (codes, scales)
}

/// Codes and scales as `[lead.., k]` dequantized to bf16 on `dev` (exact).
pub fn dequantized(codes: &[u8], scales: &[u8], shape: &[usize], dev: &Device) -> Tensor {
    let v = dflash::source::mxfp4::dequantize(codes, scales).unwrap();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

/// The gpt_oss checkpoint in `src` (config.json, model.safetensors) with its MXFP4 experts
/// (`*_blocks` / `*_scales`) written as bf16 floats in transformers' layout
/// (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`) into `dst`, without the
/// `quantization_config`; returns the number of MXFP4 tensors rewritten.
pub fn dequantized_twin(src: &Path, dst: &Path) -> usize {
    std::fs::create_dir_all(dst).unwrap();
    let st = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut out = HashMap::new();
    let mut count = 0;
    for (name, t) in &st {
        if let Some(base) = name.strip_suffix("_blocks") {
            let s = &st[&format!("{base}_scales")];
            let d = t.dims().to_vec(); // [E, rows, k / 32, 16]
            let (e, rows, k) = (d[0], d[1], d[2] * 32);
            let codes = t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            let scales = s.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            let w = dequantized(&codes, &scales, &[e, rows, k], &Device::Cpu);
            out.insert(
                base.to_string(),
                w.transpose(1, 2).unwrap().contiguous().unwrap(),
            );
            count += 1;
        } else if !name.ends_with("_scales") {
            out.insert(name.clone(), t.clone());
        }
    }
    candle_core::safetensors::save(&out, dst.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
    count
}
