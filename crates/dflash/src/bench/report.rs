//! Benchmark output: one JSON file per row (with the raw runs), `summary.json` (machine,
//! options, rows) and `table.md`, the seed's table with a status column, rows sorted by
//! speedup.

use super::{BenchOptions, Machine, RowResult, Status};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// UTC, `YYYY-MM-DDTHH:MM:SSZ`.
    pub started_at: String,
    pub machine: Machine,
    pub options: serde_json::Value,
    /// Rows in input order, without raw runs (those are in the per-row files).
    pub rows: Vec<RowResult>,
    /// Per-row file names, in input order.
    pub row_files: Vec<String>,
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a Unix time.
pub fn utc_timestamp(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

pub fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    utc_timestamp(secs)
}

/// A file-name-safe form of a row label.
pub fn slug(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    out = out.trim_matches('-').to_string();
    if out.is_empty() {
        "row".into()
    } else {
        out
    }
}

/// Write `NN-<name>.json` per row, `summary.json` and `table.md` into `dir`; returns the
/// summary.
pub fn write_all(
    dir: &Path,
    started_at: &str,
    machine: &Machine,
    opts: &BenchOptions,
    rows: &[RowResult],
) -> Result<Summary> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut files = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let name = format!("{:02}-{}.json", i + 1, slug(&r.name));
        let v = serde_json::json!({
            "started_at": started_at,
            "machine": machine,
            "options": opts,
            "row": r,
        });
        write_json(&dir.join(&name), &v)?;
        files.push(name);
    }
    let summary = Summary {
        started_at: started_at.into(),
        machine: machine.clone(),
        options: serde_json::to_value(opts).expect("options serialize"),
        rows: rows.iter().map(RowResult::summary).collect(),
        row_files: files,
    };
    write_json(
        &dir.join("summary.json"),
        &serde_json::to_value(&summary).expect("summary serialize"),
    )?;
    let md = markdown(&summary);
    let p = dir.join("table.md");
    std::fs::write(&p, md).map_err(|e| Error::io(&p, e))?;
    Ok(summary)
}

fn write_json(path: &PathBuf, v: &serde_json::Value) -> Result<()> {
    let s = serde_json::to_string_pretty(v).expect("json");
    std::fs::write(path, s + "\n").map_err(|e| Error::io(path, e))
}

fn bytes_human(b: u64) -> String {
    let g = b as f64 / (1u64 << 30) as f64;
    if g >= 1.0 {
        format!("{g:.1} GiB")
    } else {
        format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

fn tok_s(s: Option<super::Spread>) -> String {
    match s {
        Some(s) if s.min != s.max => format!("{:.1} ({:.1}-{:.1})", s.median, s.min, s.max),
        Some(s) => format!("{:.1}", s.median),
        None => "-".into(),
    }
}

/// Rows in table order: measured speedups descending, then baseline-only, then failures
/// (each group in input order).
pub fn sorted_rows(rows: &[RowResult]) -> Vec<&RowResult> {
    let mut v: Vec<&RowResult> = rows.iter().collect();
    let group = |r: &RowResult| match (r.status, r.speedup) {
        (Status::Ok, Some(_)) => 0,
        (Status::NoDraft, _) => 1,
        _ => 2,
    };
    v.sort_by(|a, b| {
        group(a).cmp(&group(b)).then_with(|| {
            b.speedup
                .unwrap_or(0.0)
                .total_cmp(&a.speedup.unwrap_or(0.0))
        })
    });
    v
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// The markdown report: header (machine, protocol), the table, acceptance histograms.
pub fn markdown(s: &Summary) -> String {
    let o = &s.options;
    let num = |k: &str| o.get(k).map(|v| v.to_string()).unwrap_or_default();
    let mut out = String::new();
    out += &format!("## dflash bench, {}\n\n", s.started_at);
    out += &format!("Machine: {}\n\n", s.machine.line());
    out += &format!(
        "Protocol: prompts {}, max_tokens {}, block size {}, temperature {}, thinking {}; \
         {} warm-up per mode (not counted), {} repeats (median, min-max), cooldown {} s, \
         order alternating; baseline = the same engine with block size 1; decode tok/s after \
         prefill.\n\n",
        o.get("prompt_source")
            .and_then(|v| v.as_str())
            .unwrap_or("?"),
        num("max_tokens"),
        o.get("block_size")
            .filter(|v| !v.is_null())
            .map(|v| v.to_string())
            .unwrap_or_else(|| "draft's".into()),
        num("temperature"),
        if o.get("enable_thinking").and_then(|v| v.as_bool()) == Some(true) {
            "on"
        } else {
            "off"
        },
        num("warmup"),
        num("repeat"),
        num("cooldown_s"),
    );
    out += "| Model | Draft | Status | Baseline tok/s | DFlash tok/s | Speedup | tau | Acceptance | TTFT ms | Prefill tok/s | Peak mem |\n";
    out += "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for r in sorted_rows(&s.rows) {
        let status = match (&r.failure, r.status) {
            (_, Status::Ok) => "ok".to_string(),
            (Some(f), st) => format!("{}: {}", st.as_str(), f.cause),
            (None, st) => st.as_str().to_string(),
        };
        let speedup = match (r.speedup, r.speedup_min, r.speedup_max) {
            (Some(x), Some(a), Some(b)) if a != b => format!("{x:.2}x ({a:.2}-{b:.2})"),
            (Some(x), _, _) => format!("{x:.2}x"),
            _ => "-".into(),
        };
        let f1 = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.1}"));
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            cell(&r.name),
            cell(&match (r.draft.as_deref(), r.draft_arch.as_deref()) {
                (Some(d), Some(a)) => format!("{d} ({a})"),
                (Some(d), None) => d.to_string(),
                (None, _) => "-".into(),
            }),
            cell(&status),
            tok_s(r.baseline_tok_s),
            tok_s(r.dflash_tok_s),
            speedup,
            r.tau.map_or("-".into(), |v| format!("{v:.2}")),
            r.acceptance_ratio
                .map_or("-".into(), |v| format!("{:.1}%", 100.0 * v)),
            f1(r.ttft_ms),
            f1(r.prefill_tok_s),
            r.peak_memory_bytes.map_or("-".into(), bytes_human),
        );
    }
    let any_hist = s.rows.iter().any(|r| r.histogram.iter().any(|&c| c > 0));
    if any_hist {
        out += "\nAcceptance lengths (tokens committed per verify cycle: cycles)\n\n";
        for r in sorted_rows(&s.rows) {
            if !r.histogram.iter().any(|&c| c > 0) {
                continue;
            }
            let last = r.histogram.iter().rposition(|&c| c > 0).unwrap_or(0);
            let h: Vec<String> = r.histogram[..=last]
                .iter()
                .enumerate()
                .skip(1)
                .map(|(k, c)| format!("{k}:{c}"))
                .collect();
            out += &format!("- {}: {}\n", cell(&r.name), h.join(" "));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(utc_timestamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_timestamp(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_timestamp(1_764_476_000), "2025-11-30T04:13:20Z");
    }

    #[test]
    fn slugs() {
        assert_eq!(slug("z-lab/Qwen3-8B DFlash"), "z-lab-Qwen3-8B-DFlash");
        assert_eq!(slug("///"), "row");
    }
}
