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
    /// `git rev-parse HEAD` of the working directory (plus `-dirty`), when available: the
    /// checkout's commit, not necessarily the binary's.
    pub git_commit: Option<String>,
    /// When this binary lies inside that checkout (its `target/`) and one of the checkout's
    /// source files (`crates/*/src`, `kernels/`, `Cargo.lock`) is newer than it: that file. The
    /// numbers are then of an older build than `git_commit` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_binary: Option<String>,
    /// dflash and its main dependencies, `name -> version`.
    pub versions: BTreeMap<String, String>,
    /// The switches that change what runs (`DFLASH_*` kernel switches such as
    /// `DFLASH_BATCH_INVARIANT`, `DFLASH_FUSED`; `CANDLE_*`; `RAYON_NUM_THREADS`), as set.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The effective kernel switches (`crate::switches::describe`: defaults included, so a
    /// report says e.g. `batch_invariant=on` even when nothing was set).
    #[serde(default)]
    pub switches: BTreeMap<String, String>,
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
        let stale_binary = stale_binary();
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
            stale_binary,
            versions,
            env: switches(std::env::vars()),
            switches: crate::switches::describe()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
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
        let env: Vec<String> = self.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let sw: Vec<String> = self
            .switches
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!(
            "{hw}; {}; dtype {}, quantization {}; commit {}{}; {}{}{}",
            self.os,
            self.dtype,
            self.quantization,
            self.git_commit.as_deref().unwrap_or("unknown"),
            match &self.stale_binary {
                Some(f) => format!(" (STALE BINARY: {f} is newer)"),
                None => String::new(),
            },
            v.join(", "),
            if env.is_empty() {
                String::new()
            } else {
                format!("; env {}", env.join(" "))
            },
            if sw.is_empty() {
                String::new()
            } else {
                format!("; switches {}", sw.join(" "))
            }
        )
    }
}

/// [`Machine::stale_binary`] for this process: None when the binary is not inside the
/// working directory's git checkout (then nothing says which sources built it) or no source
/// file there is newer than it.
fn stale_binary() -> Option<String> {
    let exe = std::env::current_exe().ok()?.canonicalize().ok()?;
    let root = command_line("git", &["rev-parse", "--show-toplevel"])?;
    let root = std::path::Path::new(&root).canonicalize().ok()?;
    if !exe.starts_with(&root) {
        return None;
    }
    let built = std::fs::metadata(&exe).ok()?.modified().ok()?;
    let newer = newest_newer_than(&root, built)?;
    Some(
        newer
            .strip_prefix(&root)
            .unwrap_or(&newer)
            .display()
            .to_string(),
    )
}

/// The newest of `root`'s source files (`crates/*/src/**`, `kernels/**`, `Cargo.lock`)
/// modified after `t`, if any.
pub fn newest_newer_than(
    root: &std::path::Path,
    t: std::time::SystemTime,
) -> Option<std::path::PathBuf> {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(ft) if ft.is_dir() => walk(&e.path(), out),
                Ok(ft) if ft.is_file() => out.push(e.path()),
                _ => {}
            }
        }
    }
    let mut files = vec![root.join("Cargo.lock")];
    walk(&root.join("kernels"), &mut files);
    if let Ok(rd) = std::fs::read_dir(root.join("crates")) {
        for c in rd.flatten() {
            walk(&c.path().join("src"), &mut files);
        }
    }
    files
        .into_iter()
        .filter_map(|f| Some((std::fs::metadata(&f).ok()?.modified().ok()?, f)))
        .filter(|(m, _)| *m > t)
        .max_by_key(|(m, _)| *m)
        .map(|(_, f)| f)
}

/// The environment variables that change which kernels run or how many threads they use.
/// Paths and logging (`DFLASH_CACHE`, `DFLASH_LOG`) do not change a number, so they are left
/// out.
fn switches(vars: impl Iterator<Item = (String, String)>) -> BTreeMap<String, String> {
    vars.filter(|(k, _)| {
        (k.starts_with("DFLASH_") && k != "DFLASH_CACHE" && k != "DFLASH_LOG")
            || k.starts_with("CANDLE_")
            || k == "RAYON_NUM_THREADS"
    })
    .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_keep_kernel_and_thread_settings_only() {
        let vars = [
            ("DFLASH_BATCH_INVARIANT", "1"),
            ("DFLASH_FUSED", "0"),
            ("DFLASH_CACHE", "/tmp/c"),
            ("DFLASH_LOG", "debug"),
            ("CANDLE_DEQUANTIZE_ALL", "1"),
            ("RAYON_NUM_THREADS", "2"),
            ("HOME", "/root"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let got: Vec<String> = switches(vars.into_iter()).into_keys().collect();
        assert_eq!(
            got,
            [
                "CANDLE_DEQUANTIZE_ALL",
                "DFLASH_BATCH_INVARIANT",
                "DFLASH_FUSED",
                "RAYON_NUM_THREADS"
            ]
        );
    }

    /// Source files newer than a build are found (the newest of them); docs and files outside
    /// the source folders are not sources.
    #[test]
    fn newer_sources_than_the_build_are_found() {
        use std::time::{Duration, SystemTime};
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        let build = SystemTime::now() - Duration::from_secs(3600);
        let file = |rel: &str, age_s: u64| {
            let p = r.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, "x").unwrap();
            let f = std::fs::File::options().write(true).open(&p).unwrap();
            f.set_modified(SystemTime::now() - Duration::from_secs(age_s))
                .unwrap();
        };
        file("crates/a/src/lib.rs", 7200);
        file("kernels/k.cu", 7000);
        file("Cargo.lock", 7200);
        file("docs/perf.md", 10);
        file("crates/a/tests/t.rs", 10);
        assert_eq!(newest_newer_than(r, build), None);
        file("crates/a/src/deep/m.rs", 600);
        file("kernels/k.cu", 60);
        assert_eq!(newest_newer_than(r, build), Some(r.join("kernels/k.cu")));
    }
}
