//! Memory a model needs against memory the machine has, checked before loading.
//!
//! Where it sits: [`crate::pipeline::Pipeline::load`] estimates the weights (from the file
//! headers, in the dtype they will have once loaded) and the KV cache per token of context,
//! reads what is available (host RAM for the CPU, the device's free memory for CUDA), and
//! then either loads, lowers the default context to what fits (when the user asked for no
//! context), or refuses with the numbers and what to do. A model that cannot fit is refused
//! before its weights are read instead of being killed by the OS half-way.

use crate::config::TargetConfig;
use crate::nn::quant::cpu_target;
use crate::source::weights::read_safetensors_header;
use crate::source::ModelSource;
use crate::{Error, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};

/// Contexts below this are not worth loading a model for: refuse instead of fitting.
pub const MIN_CONTEXT: usize = 256;

/// Memory available to the model, and where the number comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct Available {
    pub bytes: u64,
    /// e.g. `MemAvailable in /proc/meminfo`, `cgroup memory.max`, `CUDA free memory`.
    pub source: String,
}

/// Bytes as `1.5 GiB` / `12.0 MiB`.
pub fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut i = 0;
    while x >= 1024.0 && i + 1 < U.len() {
        x /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{x:.1} {}", U[i])
    }
}

/// Parse `8G`, `512M`, `1.5GiB`, `1000000` (bytes; K/M/G/T are powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let num_end = lower
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(num_end);
    let mult: u64 = match unit.trim().trim_end_matches("ib").trim_end_matches('b') {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        "t" => 1 << 40,
        _ => {
            return Err(Error::input(format!(
                "`{s}`: expected a size like 8G, 512M or 1000000"
            )))
        }
    };
    let x: f64 = num
        .parse()
        .map_err(|_| Error::input(format!("`{s}`: expected a size like 8G, 512M or 1000000")))?;
    let b = x * mult as f64;
    if !(0.0..1.8e19).contains(&b) {
        return Err(Error::input(format!("`{s}`: size out of range")));
    }
    Ok(b as u64)
}

fn meminfo_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn stat_field(path: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Room left under this process's cgroup memory limit (v2, then v1): the limit minus what
/// the group uses, not counting inactive page cache (which the kernel reclaims first).
fn cgroup_available() -> Option<(u64, &'static str)> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    // "0::/path" (v2) and "N:...memory...:/path" (v1)
    let path_of = |v2: bool| -> String {
        groups
            .lines()
            .find_map(|l| {
                let mut it = l.splitn(3, ':');
                let (_, ctrl, path) = (it.next()?, it.next()?, it.next()?);
                let hit = if v2 {
                    ctrl.is_empty()
                } else {
                    ctrl.split(',').any(|c| c == "memory")
                };
                hit.then(|| path.trim().trim_end_matches('/').to_string())
            })
            .unwrap_or_default()
    };
    let room = |max: u64, cur: u64, inactive: u64| max.saturating_sub(cur.saturating_sub(inactive));
    let v2 = path_of(true);
    for dir in [format!("/sys/fs/cgroup{v2}"), "/sys/fs/cgroup".to_string()] {
        if let Some(max) = read_u64(&format!("{dir}/memory.max")) {
            let cur = read_u64(&format!("{dir}/memory.current")).unwrap_or(0);
            let inactive = stat_field(&format!("{dir}/memory.stat"), "inactive_file").unwrap_or(0);
            return Some((room(max, cur, inactive), "cgroup memory.max"));
        }
    }
    let v1 = path_of(false);
    for dir in [
        format!("/sys/fs/cgroup/memory{v1}"),
        "/sys/fs/cgroup/memory".to_string(),
    ] {
        let Some(max) = read_u64(&format!("{dir}/memory.limit_in_bytes")) else {
            continue;
        };
        if max >= 1 << 60 {
            continue; // "unlimited"
        }
        let cur = read_u64(&format!("{dir}/memory.usage_in_bytes")).unwrap_or(0);
        let inactive =
            stat_field(&format!("{dir}/memory.stat"), "total_inactive_file").unwrap_or(0);
        return Some((room(max, cur, inactive), "cgroup memory.limit_in_bytes"));
    }
    None
}

/// Memory available for a model on `device`; None when this platform does not say.
pub fn available(device: &Device) -> Option<Available> {
    if device.is_cpu() {
        let mem = meminfo_available().map(|b| Available {
            bytes: b,
            source: "MemAvailable in /proc/meminfo".into(),
        });
        let cg = cgroup_available().map(|(b, s)| Available {
            bytes: b,
            source: s.into(),
        });
        return match (mem, cg) {
            (Some(m), Some(c)) if c.bytes < m.bytes => Some(c),
            (Some(m), _) => Some(m),
            (None, c) => c,
        };
    }
    cuda_free(device)
}

#[cfg(feature = "cuda")]
fn cuda_free(device: &Device) -> Option<Available> {
    let d = device.as_cuda_device().ok()?;
    let (free, _total) = d.cuda_stream().context().mem_get_info().ok()?;
    Some(Available {
        bytes: free as u64,
        source: "CUDA free memory (cuMemGetInfo)".into(),
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_free(_device: &Device) -> Option<Available> {
    None
}

/// Bytes the weights of `src` will occupy once loaded in `dtype` on `device`: float
/// tensors in the compute dtype, integer tensors as stored; GGUF quantized matrices as
/// [`gguf_tensor_bytes`] says. An estimate from the headers (tensors a family does not use
/// are counted too).
pub fn weight_bytes(
    src: &ModelSource,
    dtype: DType,
    device: &Device,
    keep_quant: bool,
) -> Result<u64> {
    let el = dtype.size_in_bytes() as u64;
    let mut total = 0u64;
    if let Some(g) = src.gguf_file()? {
        let affine = crate::nn::quant::keeps_gguf_affine(device, dtype);
        for (name, t) in &g.content.tensor_infos {
            total += gguf_tensor_bytes(
                name,
                t.ggml_dtype,
                t.shape.dims(),
                dtype,
                device.is_cpu(),
                affine,
                keep_quant,
            );
        }
        return Ok(total);
    }
    for f in &src.weight_files {
        for t in read_safetensors_header(f)? {
            total += if t.is_float() {
                t.elements().saturating_mul(el)
            } else {
                t.bytes
            };
        }
    }
    Ok(total)
}

/// Bytes one GGUF tensor (`dims` row-major, the input dimension last) takes once loaded: a
/// float type in the compute dtype; a quantized one as stored, or requantized on the CPU (see
/// [`cpu_target`]) unless `keep_quant`, or at its in-memory size where dflash's int8 product
/// keeps it; off the CPU, the token embedding in the compute dtype (it is dequantized there),
/// and with `affine` ([`crate::nn::quant::keeps_gguf_affine`]) the matrices rewritten as affine
/// weights ([`crate::nn::quant::gguf_affine_type`]) at that layout's size
/// ([`crate::nn::gguf_affine::kept_bytes`]), at widths that layout refuses in the compute
/// dtype (dequantized) unless `keep_quant`.
pub fn gguf_tensor_bytes(
    name: &str,
    dt: GgmlDType,
    dims: &[usize],
    dtype: DType,
    on_cpu: bool,
    affine: bool,
    keep_quant: bool,
) -> u64 {
    let n: u64 = dims.iter().map(|&d| d as u64).product();
    let el = dtype.size_in_bytes() as u64;
    let stored = n / dt.block_size() as u64 * dt.type_size() as u64;
    if matches!(dt, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
        || (!on_cpu && name == "token_embd.weight")
    {
        return n * el;
    }
    let cols = dims.last().copied().unwrap_or(0);
    if affine && dims.len() == 2 && crate::nn::quant::gguf_affine_type(dt, keep_quant) {
        return match crate::nn::gguf_affine::kept_bytes(dt, dims[0], cols) {
            Some(b) => b,
            // a width the affine kernels refuse: dequantized (`nn::quant::place_as`)
            None if !keep_quant => n * el,
            None => stored,
        };
    }
    let cpu = on_cpu && !keep_quant;
    match cpu_target(dt, cols).filter(|_| cpu) {
        Some(to) => n / to.block_size() as u64 * to.type_size() as u64,
        // kept for the own int8 product, at its in-memory size
        None if cpu && crate::nn::q8::keeps_as_stored(dt, cols) => {
            n / 32 * crate::nn::q8::kept_block_bytes(dt) as u64
        }
        None => stored,
    }
}

/// KV cache bytes per token of context of an attention-only decoder with `cfg`'s shape (K and
/// V of every layer) in `dtype`: a DFlash draft.
pub fn kv_bytes_per_token(cfg: &TargetConfig, dtype: DType) -> u64 {
    2 * cfg.num_hidden_layers as u64
        * cfg.num_key_value_heads as u64
        * cfg.head_dim as u64
        * dtype.size_in_bytes() as u64
}

/// A target's cache in `dtype` from its family's plan: (bytes per token of context, bytes
/// held whatever the context). Attention layers grow, MLA layers grow by their latent row,
/// Gated DeltaNet layers hold a fixed state; KV-shared layers hold nothing of their own.
pub fn target_cache_bytes(cfg: &TargetConfig, dtype: DType) -> Result<(u64, u64)> {
    let fam = crate::archs::family_for(cfg)?;
    let plan = (fam.plan)(cfg)?;
    Ok((
        plan.cache_bytes_per_token(dtype),
        plan.cache_fixed_bytes(dtype),
    ))
}

/// What a load needs: weights, cache state of a fixed size, and a cache that grows with the
/// context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Need {
    pub weights: u64,
    /// Cache bytes that do not grow with the context (recurrent state).
    pub fixed: u64,
    pub kv_per_token: u64,
}

impl Need {
    pub fn at(&self, context: usize) -> u64 {
        self.weights
            .saturating_add(self.fixed)
            .saturating_add(self.kv_per_token.saturating_mul(context as u64))
    }
    /// ` + 12.0 MiB of recurrent state` when there is any.
    fn fixed_note(&self) -> String {
        if self.fixed == 0 {
            String::new()
        } else {
            format!(" + {} of recurrent state", human(self.fixed))
        }
    }
    /// The largest context that fits in `avail` bytes (0 when the weights alone do not fit).
    pub fn max_context(&self, avail: u64) -> usize {
        match avail.checked_sub(self.weights.saturating_add(self.fixed)) {
            None => 0,
            Some(_) if self.kv_per_token == 0 => usize::MAX,
            Some(room) => usize::try_from(room / self.kv_per_token).unwrap_or(usize::MAX),
        }
    }
}

/// Decide the context to load with. `requested` is the user's `--max-context` (None = the
/// model's `model_max`). Returns the context and, when it had to be lowered, a notice.
/// Refuses (one line, with the numbers and what to do) when even the requested context, or
/// [`MIN_CONTEXT`] when none was requested, does not fit.
pub fn plan_context(
    model: &str,
    need: Need,
    avail: &Available,
    requested: Option<usize>,
    model_max: usize,
    dtype: DType,
) -> Result<(usize, Option<String>)> {
    let want = requested.unwrap_or(model_max);
    if need.at(want) <= avail.bytes {
        return Ok((want, None));
    }
    let fits = need.max_context(avail.bytes);
    let floor = MIN_CONTEXT.min(want);
    if requested.is_none() && fits >= floor {
        let ctx = if fits >= 1024 { fits / 256 * 256 } else { fits };
        return Ok((
            ctx,
            Some(format!(
                "context limited to {ctx} tokens (the model allows {model_max}) to fit in {} ({}): weights {}{} + KV cache {} per 1k tokens; --max-context chooses, --force-memory skips this check",
                human(avail.bytes),
                avail.source,
                human(need.weights),
                need.fixed_note(),
                human(need.kv_per_token * 1024),
            )),
        ));
    }
    let mut advice = Vec::new();
    if fits >= 1 && requested.is_some() {
        advice.push(format!("a smaller --max-context (at most {fits} fits)"));
    }
    if dtype == DType::F32 {
        advice.push("--dtype bf16 (halves float weights and the KV cache)".to_string());
    }
    advice.push("a quantized GGUF of the model".to_string());
    advice.push("--force-memory to load anyway".to_string());
    Err(Error::input(format!(
        "not enough memory for {model}: weights {}{} + KV cache {} for a context of {want} tokens = {}, but {} is available ({}); use {}",
        human(need.weights),
        need.fixed_note(),
        human(need.kv_per_token.saturating_mul(want as u64)),
        human(need.at(want)),
        human(avail.bytes),
        avail.source,
        advice.join(", or "),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GGUF tensors once loaded: on the CPU as the CPU policy says (unchanged); on CUDA with
    /// bf16 compute the mapped types at the affine layout's size (20 bytes a block of 32 at 4
    /// bits, 36 at 8), at widths the kernels do not take dense (as stored under keep_quant),
    /// other types as stored; the token embedding off the CPU in the compute dtype.
    #[test]
    fn gguf_tensors_at_their_loaded_size() {
        use GgmlDType::*;
        let b = |name: &str, dt, dims: &[usize], cpu, affine| {
            gguf_tensor_bytes(name, dt, dims, DType::BF16, cpu, affine, false)
        };
        let m = "blk.0.attn_q.weight";
        // CUDA, bf16: affine
        assert_eq!(b(m, Q4_0, &[64, 256], false, true), 64 * 8 * 20);
        assert_eq!(b(m, Q4_1, &[64, 256], false, true), 64 * 8 * 20);
        assert_eq!(b(m, Q8_0, &[64, 256], false, true), 64 * 8 * 36);
        assert_eq!(b(m, Q5_0, &[64, 256], false, true), 64 * 8 * 36);
        assert_eq!(b(m, Q5_1, &[64, 256], false, true), 64 * 8 * 36);
        // a width the affine kernels refuse: dense, or as stored under --keep-quant
        assert_eq!(b(m, Q4_0, &[64, 96], false, true), 64 * 96 * 2);
        assert_eq!(
            gguf_tensor_bytes(m, Q4_0, &[64, 96], DType::BF16, false, true, true),
            64 * 3 * 18
        );
        // not mapped: as stored
        assert_eq!(b(m, Q6K, &[64, 256], false, true), 64 * 210);
        assert_eq!(b(m, Q4K, &[64, 256], false, true), 64 * 8 * 20);
        assert_eq!(b(m, Q5K, &[64, 256], false, true), 64 * 8 * 36);
        // K-quants under --keep-quant stay as stored
        assert_eq!(
            gguf_tensor_bytes(m, Q4K, &[64, 256], DType::BF16, false, true, true),
            64 * 144
        );
        assert_eq!(b(m, Q5_0, &[64, 256], false, false), 64 * 8 * 22);
        // the embedding off the CPU: dense bf16
        assert_eq!(
            b("token_embd.weight", Q4_0, &[64, 256], false, true),
            64 * 256 * 2
        );
        // the CPU: the own int8 product's layout (Q5_0 in the Q8 layout), as before
        assert_eq!(
            b(m, Q5_0, &[64, 256], true, false),
            64 * 8 * crate::nn::q8::kept_block_bytes(Q5_0) as u64
        );
        assert_eq!(
            b("token_embd.weight", F16, &[64, 256], true, false),
            64 * 256 * 2
        );
    }

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert_eq!(parse_bytes("8G").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("512 MB").unwrap(), 512 << 20);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("1e30").is_err());
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(12), "12 B");
    }

    #[test]
    fn context_is_fitted_or_refused() {
        let need = Need {
            weights: 1000,
            fixed: 0,
            kv_per_token: 10,
        };
        let avail = |b| Available {
            bytes: b,
            source: "test".into(),
        };
        // fits as asked
        assert_eq!(
            plan_context("m", need, &avail(1000 + 10 * 4096), None, 4096, DType::F32).unwrap(),
            (4096, None)
        );
        // no context requested: lowered to what fits, with a notice
        let (ctx, note) =
            plan_context("m", need, &avail(1000 + 10 * 3000), None, 4096, DType::F32).unwrap();
        assert_eq!(ctx, 2816);
        assert!(note.unwrap().contains("context limited to 2816"));
        // requested explicitly: refused with the numbers
        let e = plan_context(
            "m",
            need,
            &avail(1000 + 10 * 3000),
            Some(4096),
            4096,
            DType::F32,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not enough memory for m"), "{e}");
        assert!(e.contains("at most 3000 fits"), "{e}");
        assert!(e.contains("--force-memory"), "{e}");
        // the weights alone do not fit
        let e = plan_context("m", need, &avail(999), None, 4096, DType::BF16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("999 B is available (test)"), "{e}");
        assert!(!e.contains("--dtype bf16"), "{e}");
    }
}
