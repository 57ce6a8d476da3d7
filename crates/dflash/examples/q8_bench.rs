//! Our int8 product (`nn::q8`) against candle's on the demo's shapes, 1 and 16 rows: Q8_0
//! (candle's and ours) and Q4_1 kept as stored (ours):
//! `cargo run --release --example q8_bench -p dflash`.
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use dflash::nn::q8::QMatrix;
use std::time::Instant;

fn main() -> dflash::Result<()> {
    for (n, k) in [
        (960, 576),
        (576, 576),
        (3072, 576),
        (576, 1536),
        (49152, 576),
    ] {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
        let q = QTensor::quantize(&w, GgmlDType::Q8_0)?;
        let ours = QMatrix::from_qtensor(&q)?.expect("q8");
        let q4 = QMatrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q4_1)?)?.expect("q4");
        let theirs = QMatMul::from_qtensor(q)?;
        for m in [1usize, 16] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
            let iters = if n > 10000 { 50 } else { 500 };
            let time = |f: &dyn Fn() -> dflash::Result<Tensor>| -> dflash::Result<f64> {
                for _ in 0..5 {
                    f()?;
                }
                let mut ts = vec![];
                for _ in 0..5 {
                    let t = Instant::now();
                    for _ in 0..iters {
                        f()?;
                    }
                    ts.push(t.elapsed().as_secs_f64() / iters as f64);
                }
                ts.sort_by(|a, b| a.total_cmp(b));
                Ok(ts[2])
            };
            let c = time(&|| Ok(theirs.forward(&x)?))?;
            let o = time(&|| ours.forward(&x))?;
            let o4 = time(&|| q4.forward(&x))?;
            println!(
                "[{n}x{k}] m={m}: candle Q8_0 {:.1} us, ours Q8_0 {:.1} us ({:.2}x), ours Q4_1 {:.1} us",
                c * 1e6,
                o * 1e6,
                c / o,
                o4 * 1e6
            );
        }
    }
    Ok(())
}
