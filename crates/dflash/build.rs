//! Records the resolved versions of the main dependencies (from the workspace Cargo.lock) so
//! that benchmark results can say which candle / tokenizers produced them; with
//! `--features cuda`, compiles kernels/*.cu to PTX with nvcc (found through CUDA_HOME or PATH,
//! e.g. after `source ../shared/tools/cuda-env.sh`) for CUDA_COMPUTE_CAP (default 90).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    dep_versions();
    cuda_kernels();
}

fn dep_versions() {
    let lock = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    let text = std::fs::read_to_string(&lock).unwrap_or_default();
    let mut found: Vec<(String, String)> = Vec::new();
    let mut name: Option<String> = None;
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_string());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take()) {
            if ["candle-core", "candle-nn", "tokenizers", "safetensors"].contains(&n.as_str()) {
                let v = v.trim_matches('"').to_string();
                // Several versions of one crate in the lock: list them all.
                match found.iter_mut().find(|(k, _)| *k == n) {
                    Some((_, vs)) => *vs = format!("{vs}+{v}"),
                    None => found.push((n, v)),
                }
            }
        }
    }
    let found: Vec<String> = found.iter().map(|(n, v)| format!("{n}={v}")).collect();
    println!("cargo:rustc-env=DFLASH_DEP_VERSIONS={}", found.join(","));
}

fn cuda_kernels() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = std::env::var("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin").join("nvcc"))
        .ok()
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for name in [
        "gemv", "fused", "mma", "moe", "delta", "dflash2", "affine", "fp8", "train",
    ] {
        let ptx = out.join(format!("{name}.ptx"));
        let src = format!("kernels/{name}.cu");
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=compute_{cap}")])
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "dflash: --features cuda needs nvcc ({}): {e}; see README (source ../shared/tools/cuda-env.sh)",
                    nvcc.display()
                )
            });
        assert!(status.success(), "dflash: nvcc failed on {src}");
    }
}
