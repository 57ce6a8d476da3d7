//! `dflash bench` end to end on tiny random models (prompts as token ids): the JSON agrees
//! with a hand computation from the raw per-run timings, the table has the rows, and a matrix
//! with a missing repo, an unsupported family and a weight mismatch reports all three and
//! still benchmarks the good row.

use dflash::testing::{TinyDraft, TinyTarget};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn dflash(args: &[&str], hub_cache: &Path) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(args)
        // Never touch the network: a repo id that is not cached is "not found".
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HUB_CACHE", hub_cache)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

/// A target/draft pair whose draft agrees with the target often (shared dominant tokens).
fn write_pair(dir: &Path) -> (String, String) {
    let mut t = TinyTarget::qwen3(11);
    t.dominant = vec![(3, 4.0), (7, 3.0)];
    let d = TinyDraft::for_target(&t, 1, vec![1, 3], 4, 12);
    let (td, dd) = (dir.join("target"), dir.join("draft"));
    t.write(&td).unwrap();
    d.write(&dd, t.vocab).unwrap();
    (
        td.to_str().unwrap().to_string(),
        dd.to_str().unwrap().to_string(),
    )
}

fn read(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn bench_pair_json_agrees_with_raw_runs_and_table() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, draft) = write_pair(tmp.path());
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt_ids\": [5, 17, 42, 9]}\n{\"id\": \"second\", \"prompt_ids\": [3, 8, 1, 60, 2]}\n",
    )
    .unwrap();
    let out = tmp.path().join("out");
    let (rc, stdout, stderr) = dflash(
        &[
            "bench",
            "--model",
            &target,
            "--draft",
            &draft,
            "--name",
            "tiny-qwen3",
            "--adaptive",
            "off",
            "--prompts",
            prompts.to_str().unwrap(),
            "--repeat",
            "2",
            "--cooldown",
            "0",
            "--max-tokens",
            "24",
            "--ignore-eos",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ],
        tmp.path(),
    );
    assert_eq!(rc, 0, "{stderr}");

    let summary = read(&out.join("summary.json"));
    let m = &summary["machine"];
    assert!(!m["cpu"].as_str().unwrap().is_empty());
    assert!(m["threads"].as_u64().unwrap() >= 1);
    assert_eq!(m["dtype"], "f32");
    assert_eq!(
        m["quantization"],
        "none (float safetensors); GGUF and MLX-quantized: per row"
    );
    assert!(m["versions"]["dflash"].is_string() && m["versions"]["candle-core"].is_string());
    assert!(m.get("git_commit").is_some());
    assert_eq!(summary["options"]["repeat"], 2);
    let file = summary["row_files"][0].as_str().unwrap();
    assert!(
        read(&out.join(file))["quantization"].is_null(),
        "a float safetensors row is not quantized"
    );
    let row = read(&out.join(file))["row"].clone();
    assert_eq!(row["status"], "ok");
    assert_eq!(row["block_size"], 4);
    let runs = row["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2 * 2 * 2, "repeats x modes x prompts");

    // Same prompt ids for both modes, recorded and hashed per run.
    for r in runs {
        let i = r["prompt_index"].as_u64().unwrap() as usize;
        let ids = row["prompts"][i]["prompt_ids"].as_array().unwrap();
        assert_eq!(r["prompt_tokens"].as_u64().unwrap() as usize, ids.len());
        let same: Vec<&Value> = runs
            .iter()
            .filter(|o| o["prompt_index"] == r["prompt_index"])
            .collect();
        assert!(same.iter().all(|o| o["prompt_hash"] == r["prompt_hash"]));
        assert_eq!(r["generated_tokens"], 24);
        if r["mode"] == "baseline" {
            assert_eq!(r["block_size"], 1);
            assert_eq!(r["draft_tokens"], 0);
        } else {
            assert_eq!(r["block_size"], 4);
        }
    }
    // Order alternates between repeats.
    assert_eq!(
        row["repeats"][0]["order"],
        serde_json::json!(["baseline", "dflash"])
    );
    assert_eq!(
        row["repeats"][1]["order"],
        serde_json::json!(["dflash", "baseline"])
    );

    // tok/s per repeat and mode from the raw timings; medians; speedup.
    let tok_s = |rep: u64, mode: &str| {
        let sel: Vec<&Value> = runs
            .iter()
            .filter(|r| r["repeat"] == rep && r["mode"] == mode)
            .collect();
        let toks: f64 = sel.iter().map(|r| f(&r["generated_tokens"]) - 1.0).sum();
        let secs: f64 = sel.iter().map(|r| f(&r["decode_ms"]) / 1e3).sum();
        toks / secs
    };
    let base: Vec<f64> = (0..2).map(|r| tok_s(r, "baseline")).collect();
    let dfl: Vec<f64> = (0..2).map(|r| tok_s(r, "dflash")).collect();
    for r in 0..2 {
        let t = &row["repeats"][r];
        assert!(close(f(&t["baseline_tok_s"]), base[r]));
        assert!(close(f(&t["dflash_tok_s"]), dfl[r]));
        assert!(close(f(&t["speedup"]), dfl[r] / base[r]));
    }
    let (mb, md) = (median(base.clone()), median(dfl.clone()));
    assert!(close(f(&row["baseline_tok_s"]["median"]), mb));
    assert!(close(f(&row["dflash_tok_s"]["median"]), md));
    assert!(close(
        f(&row["baseline_tok_s"]["min"]),
        base[0].min(base[1])
    ));
    assert!(close(f(&row["dflash_tok_s"]["max"]), dfl[0].max(dfl[1])));
    let speedup = f(&row["speedup"]);
    assert!(close(speedup, md / mb), "{speedup} vs {}", md / mb);
    let ratios: Vec<f64> = (0..2).map(|r| dfl[r] / base[r]).collect();
    assert!(close(f(&row["speedup_min"]), ratios[0].min(ratios[1])));
    assert!(close(f(&row["speedup_max"]), ratios[0].max(ratios[1])));

    // tau and acceptance ratio from the per-run stats.
    let dr: Vec<&Value> = runs.iter().filter(|r| r["mode"] == "dflash").collect();
    let mut committed = 0.0;
    let mut cycles = 0.0;
    let (mut drafted, mut generated) = (0.0, 0.0);
    for r in &dr {
        let lens: Vec<f64> = r["acceptance_lengths"]
            .as_array()
            .unwrap()
            .iter()
            .map(f)
            .collect();
        assert!(close(
            f(&r["tau"]),
            lens.iter().sum::<f64>() / lens.len() as f64
        ));
        assert_eq!(f(&r["cycles"]) as usize, lens.len());
        assert_eq!(
            f(&r["draft_tokens"]),
            (f(&r["acceptance_ratio"]) * f(&r["generated_tokens"])).round()
        );
        committed += lens.iter().sum::<f64>();
        cycles += lens.len() as f64;
        drafted += f(&r["draft_tokens"]);
        generated += f(&r["generated_tokens"]);
    }
    let tau = f(&row["tau"]);
    let acc = f(&row["acceptance_ratio"]);
    assert!(close(tau, committed / cycles));
    assert!(close(acc, drafted / generated));
    assert!(
        tau > 1.0,
        "the pair should accept some draft tokens (tau {tau})"
    );
    let hist: f64 = row["histogram"].as_array().unwrap().iter().map(f).sum();
    assert_eq!(hist, cycles);
    // Lossless at T=0.
    assert_eq!(row["greedy_mismatches"], 0);
    assert!(f(&row["ttft_ms"]) > 0.0 && f(&row["prefill_tok_s"]) > 0.0);
    assert!(row["peak_memory_bytes"].as_u64().unwrap() > 0);

    // The table (stdout and table.md) has the row with the JSON's numbers.
    let md_file = std::fs::read_to_string(out.join("table.md")).unwrap();
    assert_eq!(md_file, stdout);
    let line = md_file
        .lines()
        .find(|l| l.starts_with("| tiny-qwen3 |"))
        .unwrap_or_else(|| panic!("no row in\n{md_file}"));
    assert!(line.contains("| ok |"), "{line}");
    assert!(line.contains(&format!("| {speedup:.2}x")), "{line}");
    assert!(line.contains(&format!("| {tau:.2} |")), "{line}");
    assert!(line.contains(&format!("| {:.1}% |", 100.0 * acc)), "{line}");
    assert!(line.contains(&format!("{md:.1}")), "{line}");
    assert!(
        md_file.contains("- tiny-qwen3: 1:"),
        "histogram line\n{md_file}"
    );
}

#[test]
fn bench_matrix_reports_failures_and_benchmarks_good_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, draft) = write_pair(tmp.path());

    // An unsupported family.
    let mamba = tmp.path().join("mamba");
    TinyTarget::qwen3(3).write(&mamba).unwrap();
    let cfg_path = mamba.join("config.json");
    let mut cfg = read(&cfg_path);
    cfg["model_type"] = "mamba9".into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();

    // A draft with an extra tensor.
    let extra = tmp.path().join("draft-extra");
    let t = TinyTarget::qwen3(11);
    TinyDraft::for_target(&t, 1, vec![1, 3], 4, 12)
        .write(&extra, t.vocab)
        .unwrap();
    let st = extra.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&st, &candle_core::Device::Cpu).unwrap();
    tensors.insert(
        "extra_head.weight".into(),
        candle_core::Tensor::zeros(
            (t.vocab, t.hidden),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap(),
    );
    candle_core::safetensors::save(&tensors, &st).unwrap();

    let matrix = tmp.path().join("matrix.json");
    let rows = serde_json::json!([
        {"name": "missing", "model": "dflash-test/no-such-model", "draft": draft},
        {"name": "mamba", "model": mamba, "draft": draft},
        {"name": "extra-tensor", "model": target, "draft": extra},
        {"name": "good", "model": target, "draft": draft},
        {"name": "baseline-only", "model": target},
    ]);
    std::fs::write(&matrix, rows.to_string()).unwrap();
    let prompts = tmp.path().join("p.jsonl");
    std::fs::write(&prompts, "{\"prompt_ids\": [5, 17, 42, 9]}\n").unwrap();
    let out = tmp.path().join("out");
    let (rc, stdout, stderr) = dflash(
        &[
            "bench",
            "--matrix",
            matrix.to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
            "--repeat",
            "1",
            "--cooldown",
            "0",
            "--max-tokens",
            "8",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ],
        tmp.path(),
    );
    assert_eq!(rc, 0, "{stderr}");
    let summary = read(&out.join("summary.json"));
    let by_name = |n: &str| -> Value {
        summary["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == n)
            .unwrap()
            .clone()
    };
    let missing = by_name("missing");
    assert_eq!(missing["status"], "not_found", "{missing}");
    assert!(missing["failure"]["cause"]
        .as_str()
        .unwrap()
        .contains("dflash-test/no-such-model"));
    let mamba = by_name("mamba");
    assert_eq!(mamba["status"], "unsupported_architecture", "{mamba}");
    assert_eq!(mamba["failure"]["family"], "mamba9");
    let extra = by_name("extra-tensor");
    assert_eq!(extra["status"], "weight_mismatch", "{extra}");
    assert_eq!(
        extra["failure"]["tensors"],
        serde_json::json!(["extra_head.weight"])
    );
    assert_eq!(
        extra["failure"]["cause"],
        "draft: 1 extra params: extra_head.weight"
    );
    let good = by_name("good");
    assert_eq!(good["status"], "ok", "{good}");
    assert!(f(&good["speedup"]) > 0.0 && f(&good["tau"]) >= 1.0);
    let base = by_name("baseline-only");
    assert_eq!(base["status"], "no_draft");
    assert!(f(&base["baseline_tok_s"]["median"]) > 0.0);
    assert!(base["speedup"].is_null());

    // Every row has a file; the table lists the good row first and every failure's cause.
    assert_eq!(summary["row_files"].as_array().unwrap().len(), 5);
    let table: Vec<&str> = stdout.lines().filter(|l| l.starts_with("| ")).collect();
    assert!(table[0].starts_with("| Model |"));
    assert!(table[1].starts_with("| good |"), "{stdout}");
    assert!(table[2].starts_with("| baseline-only |") && table[2].contains("no draft"));
    for (n, s) in [
        ("missing", "not found"),
        (
            "mamba",
            "unsupported architecture: target: unsupported architecture `mamba9`",
        ),
        (
            "extra-tensor",
            "weight mismatch: draft: 1 extra params: extra_head.weight",
        ),
    ] {
        let l = table
            .iter()
            .find(|l| l.starts_with(&format!("| {n} |")))
            .unwrap();
        assert!(l.contains(s), "{l}");
    }
}

/// DFlash and DFlash2 drafts of one target in one table: both rows run, each says its draft's
/// architecture, and both are lossless at T = 0.
#[test]
fn bench_table_holds_dflash_and_dflash2_drafts_of_one_target() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, draft) = write_pair(tmp.path());
    let t = {
        let mut t = TinyTarget::qwen3(11);
        t.dominant = vec![(3, 4.0), (7, 3.0)];
        t
    };
    let d2 = tmp.path().join("draft2");
    TinyDraft::for_target(&t, 1, vec![1, 3], 4, 12)
        .dflash2(2, 8, 8, 4)
        .write(&d2, t.vocab)
        .unwrap();
    let matrix = tmp.path().join("matrix.json");
    let rows = serde_json::json!([
        {"name": "dflash", "model": target, "draft": draft},
        {"name": "dflash2", "model": target, "draft": d2},
    ]);
    std::fs::write(&matrix, rows.to_string()).unwrap();
    let prompts = tmp.path().join("p.jsonl");
    std::fs::write(&prompts, "{\"prompt_ids\": [5, 17, 42, 9]}\n").unwrap();
    let out = tmp.path().join("out");
    let (rc, stdout, stderr) = dflash(
        &[
            "bench",
            "--matrix",
            matrix.to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
            "--repeat",
            "1",
            "--cooldown",
            "0",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ],
        tmp.path(),
    );
    assert_eq!(rc, 0, "{stderr}");
    let summary = read(&out.join("summary.json"));
    for (name, arch) in [("dflash", "DFlash"), ("dflash2", "DFlash2")] {
        let row = summary["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap();
        assert_eq!(row["status"], "ok", "{row}");
        assert_eq!(row["draft_arch"], arch);
        assert_eq!(row["greedy_mismatches"], 0);
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {name} |")))
            .unwrap_or_else(|| panic!("no {name} row in\n{stdout}"));
        assert!(line.contains(&format!("({arch}) | ok |")), "{line}");
    }
}

/// `bench --micro` says what target it timed as loaded: the weights held and the load's
/// quantization (the machine line's `quantization` speaks of the matrix's rows), in the report
/// and its JSON.
#[test]
fn bench_micro_reports_the_weights_as_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let (target, draft) = write_pair(dir.path());
    let out = dir.path().join("micro");
    let (code, stdout, stderr) = dflash(
        &[
            "bench",
            "--micro",
            "--model",
            &target,
            "--draft",
            &draft,
            "--micro-context",
            "8",
            "--micro-q",
            "1,2",
            "--micro-iters",
            "1",
            "--out",
            out.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert_eq!(code, 0, "{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("target weights held: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.ends_with("(float)"), "{line}");
    let v = read(&out.join("micro.json"));
    assert!(v["weight_bytes"].as_u64().unwrap() > 0, "{v}");
    assert!(v["quantization"].is_null(), "{v}");
    // the draft's proposal at its block size first (what the gpu-bench scripts read), then at
    // each smaller --micro-q of 2 or more
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("| draft forward Q="))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(!rows[0].starts_with("| draft forward Q=2 |"), "{stdout}");
    assert!(rows[1].starts_with("| draft forward Q=2 |"), "{stdout}");
}

/// `bench --concurrency`: one row per (mode, level) in the table and the JSON (every level
/// serving the same requests, concurrency 1 one after another), consistent with
/// each other (the ratios follow from the JSON's own rates), the greedy check counts every batched output equal to its run alone on
/// the CPU (row-invariant kernels), the switches line is there; a level of 0 is a one-line
/// error naming the flag.
#[test]
fn bench_concurrency_reports_every_level_and_checks_batched_equals_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (target, draft) = write_pair(dir.path());
    let out = dir.path().join("conc");
    // `bench --concurrency` of the pair, prompts of 6 ids, with `args` after
    let conc = |args: &[&str]| {
        let mut all = vec![
            "bench",
            "--model",
            &target,
            "--draft",
            &draft,
            "--concurrency-prompt-len",
            "6",
        ];
        all.extend_from_slice(args);
        dflash(&all, dir.path())
    };
    let (code, stdout, stderr) = conc(&[
        "--concurrency",
        "1,3",
        "--max-tokens",
        "8",
        "--concurrency-check",
        "--concurrency-rounds",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v = read(&out.join("concurrency.json"));
    let rows = v["results"]["rows"].as_array().unwrap();
    let got: Vec<(String, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["mode"].as_str().unwrap().to_string(),
                r["concurrency"].as_u64().unwrap(),
            )
        })
        .collect();
    let want: Vec<(String, u64)> = [("plain", 1), ("plain", 3), ("dflash", 1), ("dflash", 3)]
        .iter()
        .map(|(m, c)| (m.to_string(), *c))
        .collect();
    assert_eq!(got, want, "{v}");
    // level 1 serves max(3, 2 x 1) = 3 requests one after another, level 3 serves 2 x 3 = 6
    // with at most 3 at once
    for r in rows {
        let want = if r["concurrency"] == 1 { 3 } else { 6 };
        assert_eq!(r["requests"].as_u64(), Some(want), "{r}");
    }
    for pair in rows.chunks(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(close(f(&a["aggregate_x"]), 1.0));
        assert!(close(
            f(&b["aggregate_x"]),
            f(&b["aggregate_tok_s"]) / f(&a["aggregate_tok_s"])
        ));
        assert!(close(
            f(&b["per_request_x"]),
            f(&b["per_request_tok_s"]) / f(&a["per_request_tok_s"])
        ));
        assert!(f(&b["latency_p50_ms"]) <= f(&b["latency_p99_ms"]), "{b}");
        assert!(f(&a["tau"]) >= 1.0, "{a}");
    }
    assert_eq!(f(&rows[0]["tau"]), 1.0, "plain decoding accepts one a step");
    for mode in ["plain", "dflash"] {
        let line = format!("{mode}: greedy at concurrency 3: 3 of 3 outputs equal their run alone");
        assert!(stdout.contains(&line), "{stdout}");
    }
    assert!(stdout.contains("switches: fused="), "{stdout}");
    for r in rows {
        let line = format!(
            "| {} | {} | {} | {:.1} |",
            r["mode"].as_str().unwrap(),
            r["concurrency"],
            r["requests"],
            f(&r["aggregate_tok_s"])
        );
        assert!(stdout.contains(&line), "{line} not in {stdout}");
    }
    // one mode only
    let (code, stdout, stderr) = conc(&[
        "--concurrency",
        "2",
        "--max-tokens",
        "4",
        "--concurrency-modes",
        "dflash",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("| dflash | 2 | 8 |"), "{stdout}"); // 4 rounds of 2
    assert!(!stdout.contains("| plain |"), "{stdout}");
    let (code, _, stderr) = dflash(
        &[
            "bench",
            "--model",
            &target,
            "--concurrency",
            "2",
            "--concurrency-modes",
            "dflash",
        ],
        dir.path(),
    );
    assert_ne!(code, 0);
    assert!(stderr.contains("--draft"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    let (code, _, stderr) = dflash(
        &["bench", "--model", &target, "--concurrency", "0,2"],
        dir.path(),
    );
    assert_ne!(code, 0);
    assert!(stderr.contains("--concurrency"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}
