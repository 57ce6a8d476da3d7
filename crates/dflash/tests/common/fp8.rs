//! FP8 block-quantized checkpoints written as the publishers lay them out (float8 e4m3 matrices
//! with a `_scale_inv` per block, `quantization_config: {quant_method: "fp8",
//! weight_block_size}`), by a quantizer written from the format (candle's own e4m3 conversion,
//! independent of the loader's decoder), with their dequantized twins.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use dflash::testing::{write_json, TinyTarget};
use std::collections::HashMap;
use std::path::Path;

/// A tensor's values in f32.
fn f32s(t: &Tensor) -> Vec<f32> {
    super::f32_bits(t).into_iter().map(f32::from_bits).collect()
}

const FP8_MAX: f32 = 448.0;

/// Block-wise FP8 of a row-major `[n, k]` matrix: per (bn, bk) block (the last ones partial),
/// `scale = amax / 448` (1 for an all-zero block), the stored value `e4m3(w / scale)`; gives the
/// float8 tensor, the `[ceil(n/bn), ceil(k/bk)]` f32 scales and the dequantized f32 matrix
/// (`f32(e4m3) * scale`, what the twin stores).
pub fn quantize(w: &Tensor, bn: usize, bk: usize) -> (Tensor, Tensor, Tensor) {
    let (n, k) = w.dims2().unwrap();
    let v = f32s(w);
    let (sn, sk) = (n.div_ceil(bn), k.div_ceil(bk));
    let mut scale = vec![1f32; sn * sk];
    for (bi, s) in scale.iter_mut().enumerate() {
        let (br, bc) = (bi / sk, bi % sk);
        let mut amax = 0f32;
        for r in br * bn..((br + 1) * bn).min(n) {
            for c in bc * bk..((bc + 1) * bk).min(k) {
                amax = amax.max(v[r * k + c].abs());
            }
        }
        if amax > 0.0 {
            *s = amax / FP8_MAX;
        }
    }
    let scaled: Vec<f32> = (0..n * k)
        .map(|i| v[i] / scale[(i / k / bn) * sk + (i % k) / bk])
        .collect();
    let q = Tensor::from_vec(scaled, (n, k), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F8E4M3)
        .unwrap();
    let back = f32s(&q);
    let deq: Vec<f32> = (0..n * k)
        .map(|i| back[i] * scale[(i / k / bn) * sk + (i % k) / bk])
        .collect();
    (
        q,
        Tensor::from_vec(scale, (sn, sk), &Device::Cpu).unwrap(),
        Tensor::from_vec(deq, (n, k), &Device::Cpu).unwrap(),
    )
}

/// `t` as an FP8 checkpoint in `fp8_dir` (every matrix but the embedding, the LM head and
/// `skip`) and its dequantized twin in `twin_dir`; the number of FP8 matrices.
pub fn write_fp8(
    t: &TinyTarget,
    block: (usize, usize),
    skip: &str,
    fp8_dir: &Path,
    twin_dir: &Path,
) -> usize {
    t.write(fp8_dir).unwrap();
    t.write(twin_dir).unwrap();
    quantize_dir(block, skip, fp8_dir, twin_dir)
}

/// The checkpoint in `fp8_dir` (its `model.safetensors` and `config.json`, also in `twin_dir`)
/// rewritten as FP8 there, and its dequantized twin in `twin_dir`; the number of FP8 matrices.
pub fn quantize_dir(block: (usize, usize), skip: &str, fp8_dir: &Path, twin_dir: &Path) -> usize {
    let st = fp8_dir.join("model.safetensors");
    let orig = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
    let (mut q, mut twin) = (HashMap::new(), HashMap::new());
    let mut count = 0;
    for (name, w) in orig {
        let matrix =
            w.rank() == 2 && !name.contains("embed_tokens") && !name.starts_with("lm_head");
        if matrix && !name.starts_with(skip) {
            let (f8, scale, deq) = quantize(&w, block.0, block.1);
            q.insert(name.clone(), f8);
            q.insert(format!("{name}_scale_inv"), scale);
            twin.insert(name, deq.to_dtype(w.dtype()).unwrap());
            count += 1;
        } else {
            q.insert(name.clone(), w.clone());
            twin.insert(name, w);
        }
    }
    candle_core::safetensors::save(&q, &st).unwrap();
    candle_core::safetensors::save(&twin, twin_dir.join("model.safetensors")).unwrap();
    let cfg_path = fp8_dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
        "activation_scheme": "dynamic", "weight_block_size": [block.0, block.1]});
    write_json(&cfg_path, &cfg).unwrap();
    count
}
