//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod mlx;

use candle_core::Tensor;
use dflash::archs::{load_target, LoadOptions, TargetModel};
use dflash::source::ModelSource;
use std::path::Path;

pub fn load(dir: &Path) -> Box<dyn TargetModel> {
    let src = ModelSource::from_dir("test", dir).unwrap();
    load_target(&src, &LoadOptions::default()).unwrap().1
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let b = b
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(a.len(), b.len(), "shape mismatch");
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut r = dflash::testing::Rng::new(seed);
    (0..n).map(|_| r.below(vocab) as u32).collect()
}
