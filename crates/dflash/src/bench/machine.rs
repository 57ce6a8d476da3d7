//! The machine and build a benchmark ran on: a number without these is not comparable.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::process::Command;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Machine {
    /// `model name` from /proc/cpuinfo (or `uname -m` elsewhere).
    pub cpu: String,
    /// Threads available to this process.
    pub threads: usize,
    /// GPU name(s) from `nvidia-smi`, when running on CUDA.
    pub gpu: Option<String>,
    pub os: String,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    pub dtype: String,
    /// Weight quantization of float safetensors models (`none`); GGUF and MLX-quantized rows
    /// record theirs in the row's `quantization`.
    pub quantization: String,
    /// `git rev-parse HEAD` of the working directory (plus `-dirty`), when available.
    pub git_commit: Option<String>,
    /// dflash and its main dependencies, `name -> version`.
    pub versions: BTreeMap<String, String>,
}

impl Machine {
    pub fn describe(device: &str, dtype: &str) -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name") || l.starts_with("Hardware"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let gpu = if device.starts_with("cuda") {
            command_line("nvidia-smi", &["--query-gpu=name", "--format=csv,noheader"])
                .map(|s| s.lines().collect::<Vec<_>>().join(", "))
        } else {
            None
        };
        let git_commit = command_line("git", &["rev-parse", "--short=12", "HEAD"]).map(|c| {
            let dirty = command_line("git", &["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{c}-dirty")
            } else {
                c
            }
        });
        let mut versions = BTreeMap::new();
        versions.insert("dflash".into(), env!("CARGO_PKG_VERSION").into());
        for kv in env!("DFLASH_DEP_VERSIONS").split(',') {
            if let Some((k, v)) = kv.split_once('=') {
                versions.insert(k.into(), v.into());
            }
        }
        Machine {
            cpu,
            threads,
            gpu,
            os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
            device: device.into(),
            dtype: dtype.into(),
            quantization: "none (float safetensors); GGUF and MLX-quantized: per row".into(),
            git_commit,
            versions,
        }
    }

    /// One line for the report header.
    pub fn line(&self) -> String {
        let hw = match &self.gpu {
            Some(g) => format!("{g} ({}), host {} x{}", self.device, self.cpu, self.threads),
            None => format!("{} ({} threads)", self.cpu, self.threads),
        };
        let v: Vec<String> = self
            .versions
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        format!(
            "{hw}; {}; dtype {}, quantization {}; commit {}; {}",
            self.os,
            self.dtype,
            self.quantization,
            self.git_commit.as_deref().unwrap_or("unknown"),
            v.join(", ")
        )
    }
}

/// Trimmed stdout of a successful command.
fn command_line(cmd: &str, args: &[&str]) -> Option<String> {
    let o = Command::new(cmd).args(args).output().ok()?;
    if !o.status.success() {
        return None;
    }
    let s = String::from_utf8_lossy(&o.stdout).trim().to_string();
    (!s.is_empty()).then_some(s)
}
