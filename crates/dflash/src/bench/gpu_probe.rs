//! `dflash doctor --gpu-probe` (CUDA builds): what one candle op costs on the host, and the
//! bandwidth of the bf16 projections at the Qwen3-8B shapes through cuBLAS and through our GEMV
//! kernel (with its error against an f32 product). docs/perf.md quotes it.

use candle_core::{DType, Device, Tensor};
use std::time::Instant;

fn med(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn gpu_probe(dev: &Device) -> crate::Result<String> {
    let dev = dev.clone();
    let mut rep = String::new();
    let x = Tensor::randn(0f32, 1.0, (1, 4096), &dev)?.to_dtype(DType::BF16)?;
    // 1. Host cost of one small elementwise op, and of a chain of them (async: host-bound).
    let mut y = x.clone();
    for _ in 0..50 {
        y = (&y + &x)?;
    }
    dev.synchronize()?;
    let n = 2000;
    let t = Instant::now();
    for _ in 0..n {
        y = (&y + &x)?;
    }
    let host = t.elapsed().as_secs_f64();
    dev.synchronize()?;
    let all = t.elapsed().as_secs_f64();
    rep += &format!(
        "small add chain: host {:.2} us/op, with sync {:.2} us/op\n",
        host / n as f64 * 1e6,
        all / n as f64 * 1e6
    );
    // Non-contiguous op (strided params uploaded per op).
    let xt = Tensor::randn(0f32, 1.0, (64, 64), &dev)?
        .to_dtype(DType::BF16)?
        .t()?;
    let t = Instant::now();
    for _ in 0..n {
        let _ = xt.contiguous()?;
    }
    dev.synchronize()?;
    rep += &format!(
        "strided copy 64x64: {:.2} us/op\n",
        t.elapsed().as_secs_f64() / n as f64 * 1e6
    );
    // 2. GEMV bandwidth for each weight shape [out, in] (x [m, in] @ W^T).
    for (m, out, inp) in [
        (1usize, 4096usize, 4096usize),
        (1, 6144, 4096),
        (1, 12288, 4096),
        (1, 24576, 4096),
        (1, 4096, 12288),
        (1, 151936, 4096),
        (1, 576, 576),
        (16, 576, 576),
        (16, 3072, 576),
        (16, 49152, 576),
        (2, 4096, 4096),
        (4, 6144, 4096),
        (8, 24576, 4096),
        (16, 4096, 4096),
        (16, 6144, 4096),
        (16, 24576, 4096),
        (16, 4096, 12288),
        (16, 151936, 4096),
    ] {
        // several weight copies so that the L2 (50 MB) does not serve repeats
        let ws: Vec<Tensor> = (0..4)
            .map(|_| {
                Tensor::randn(0f32, 0.02, (out, inp), &dev).and_then(|w| w.to_dtype(DType::BF16))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let xi = Tensor::randn(0f32, 1.0, (m, inp), &dev)?.to_dtype(DType::BF16)?;
        let bytes = (out * inp * 2) as f64;
        let time = |f: &dyn Fn(&Tensor) -> crate::Result<Tensor>| -> crate::Result<f64> {
            for w in &ws {
                let _ = f(w)?;
            }
            dev.synchronize()?;
            let mut ts = vec![];
            for i in 0..40 {
                let t = Instant::now();
                let _ = f(&ws[i % 4])?;
                dev.synchronize()?;
                ts.push(t.elapsed().as_secs_f64());
            }
            Ok(med(ts))
        };
        let s = time(&|w| Ok(xi.matmul(&w.t()?)?))?;
        rep += &format!(
            "m={m} [{out}x{inp}]: cublas {:.1} us {:.2} TB/s",
            s * 1e6,
            bytes / s / 1e12
        );
        // GEMV: one row (what `Linear` uses it for); the skinny GEMM: every row count. Each
        // with its error against an f32 reference product.
        type Kernel = fn(&Tensor, &Tensor) -> candle_core::Result<Option<Tensor>>;
        let kernels: [(&str, Kernel, bool); 2] = [
            ("gemv", crate::nn::cuda::gemv, m == 1),
            ("mma", crate::nn::cuda::mma_forced, true),
        ];
        let r = xi
            .to_dtype(DType::F32)?
            .matmul(&ws[0].to_dtype(DType::F32)?.t()?)?;
        for (name, kernel, applies) in kernels {
            if !applies {
                continue;
            }
            let run = |w: &Tensor| -> crate::Result<Tensor> {
                kernel(&xi, w)?.ok_or_else(|| {
                    crate::Error::input(format!("gpu probe: {name} does not apply to m={m}"))
                })
            };
            let g = time(&|w| run(w))?;
            let y = run(&ws[0])?.to_dtype(DType::F32)?;
            let err = ((&y - &r)?.sqr()?.sum_all()?.to_scalar::<f32>()?
                / r.sqr()?.sum_all()?.to_scalar::<f32>()?)
            .sqrt();
            rep += &format!(
                " | {name} {:.1} us {:.2} TB/s, rel err {err:.2e}",
                g * 1e6,
                bytes / g / 1e12
            );
        }
        rep.push('\n');
    }
    Ok(rep)
}
