//! Quantized matmul speed per GGML type on this CPU: 1-row (decode) and 16-row (verify block)
//! products against one weight, to choose the requantization target for types without a
//! tiled multi-row kernel in candle. `cargo run --release --example qmatmul_bench [in] [out]`.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use std::time::Instant;

fn main() -> candle_core::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (k, n) = (
        *args.first().unwrap_or(&1536),
        *args.get(1).unwrap_or(&1536),
    );
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.05, (n, k), &dev)?;
    println!(
        "weight [{n} x {k}], threads {}; median ms per matmul",
        candle_core::utils::get_num_threads()
    );
    println!(
        "{:>6} {:>9} {:>9} {:>7}",
        "type", "1 row", "16 rows", "16/1"
    );
    use GgmlDType::*;
    for dt in [F32, Q8_0, Q4K, Q4_0, Q4_1, Q5_0, Q5_1, Q5K, Q6K, Q3K, Q2K] {
        if k % dt.block_size() != 0 {
            println!(
                "{:>6} (in {k} not a multiple of the block size {})",
                format!("{dt:?}"),
                dt.block_size()
            );
            continue;
        }
        let q = QMatMul::from_qtensor(QTensor::quantize(&w, dt)?)?;
        let mut t = [0f64; 2];
        for (slot, rows) in [1usize, 16].into_iter().enumerate() {
            let x = Tensor::randn(0f32, 1.0, (rows, k), &dev)?;
            let reps = if rows == 1 { 200 } else { 50 };
            let mut v = Vec::with_capacity(reps);
            for _ in 0..reps + 5 {
                let s = Instant::now();
                let y = q.forward(&x)?;
                std::hint::black_box(&y);
                v.push(s.elapsed().as_secs_f64() * 1e3);
            }
            v.drain(..5);
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            t[slot] = v[v.len() / 2];
        }
        println!(
            "{:>6} {:>9.4} {:>9.4} {:>7.1}",
            format!("{dt:?}"),
            t[0],
            t[1],
            t[1] / t[0]
        );
    }
    Ok(())
}
