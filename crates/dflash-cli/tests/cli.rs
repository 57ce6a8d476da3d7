//! The `dflash` binary end to end: determinism, equality with greedy decoding by full
//! recomputation, the JSON/trace fields, and one-line errors with a non-zero exit.

use dflash::archs::{load_target, LoadOptions};
use dflash::engine::greedy_by_recompute;
use dflash::source::ModelSource;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dflash/tests/fixtures")
}

fn dflash(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn generate_json_is_deterministic_and_equals_greedy_recomputation() {
    let t = fixtures().join("targets/qwen3");
    let args = [
        "generate",
        "--model",
        t.to_str().unwrap(),
        "--prompt-ids",
        "5,17,42,9",
        "--max-tokens",
        "12",
        "--json",
        "--temperature",
        "0",
    ];
    let (rc, out1, err) = dflash(&args);
    assert_eq!(rc, 0, "{err}");
    let (_, out2, _) = dflash(&args);
    assert_eq!(out1.trim().lines().count(), 1, "one JSON object");
    let v1: Value = serde_json::from_str(&out1).unwrap();
    let v2: Value = serde_json::from_str(&out2).unwrap();
    assert_eq!(v1["output_ids"], v2["output_ids"]);
    let src = ModelSource::from_dir("t", &t).unwrap();
    let (_, m) = load_target(&src, &LoadOptions::default()).unwrap();
    let want = greedy_by_recompute(m.as_ref(), &[5, 17, 42, 9], 12).unwrap();
    let got: Vec<u32> = v1["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(got, want);
    assert_eq!(v1["stats"]["generated_tokens"], 12);
    assert!(v1["stats"]["decode_tok_s"].as_f64().unwrap() > 0.0);
}

/// `dflash generate` on the qwen3 block-16 fixture pair (target + draft) with `args` after.
fn generate_b16(args: &[&str]) -> (i32, String, String) {
    let d = fixtures().join("dflash/qwen3_b16");
    let (t, dr) = (d.join("target"), d.join("draft"));
    let mut all = vec![
        "generate",
        "--model",
        t.to_str().unwrap(),
        "--draft",
        dr.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    dflash(&all)
}

#[test]
fn generate_with_draft_prints_trace_and_acceptance() {
    let (rc, out, err) = generate_b16(&[
        "--prompt-ids",
        "1,2,3,4,5,6",
        "--max-tokens",
        "30",
        "--temperature",
        "0",
        "--json",
        "--trace",
        "--dtype",
        "f32",
        "--adaptive",
        "off",
    ]);
    assert_eq!(rc, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let steps = v["steps"].as_array().unwrap();
    let al = v["stats"]["acceptance_lengths"].as_array().unwrap();
    assert_eq!(steps.len(), al.len());
    assert_eq!(steps[0]["block_ids"].as_array().unwrap().len(), 16);
    assert_eq!(
        steps[0]["block_ids"][0], v["output_ids"][0],
        "block starts with the last committed token"
    );
    assert!(v["stats"]["tau"].as_f64().unwrap() >= 1.0);
    assert!(v["stats"]["acceptance_ratio"].is_number());
    // block size 1 through the same engine gives the same ids
    let (_, out1, _) = generate_b16(&[
        "--prompt-ids",
        "1,2,3,4,5,6",
        "--max-tokens",
        "30",
        "--json",
        "--block-size",
        "1",
    ]);
    let v1: Value = serde_json::from_str(&out1).unwrap();
    assert_eq!(v1["output_ids"], v["output_ids"]);
    assert_eq!(v1["stats"]["mode"], "plain");
    // stats line on stderr in streaming mode
    let (rc, _, err) = generate_b16(&["--prompt-ids", "1,2,3", "--max-tokens", "8"]);
    assert_eq!(rc, 0);
    assert!(
        err.contains("tau") && err.contains("acceptance") && err.contains("TTFT"),
        "{err}"
    );
}

/// `--compare` runs plain decoding after DFlash through the same engine: at T = 0 the outputs
/// are checked equal and the speedup is the ratio of the two decode rates printed beside it.
#[test]
fn generate_compare_reports_speedup_against_plain_decoding() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--prompt-ids",
            "1,2,3,4,5,6",
            "--max-tokens",
            "24",
            "--dtype",
            "f32",
            "--compare",
        ];
        args.extend_from_slice(extra);
        let (rc, out, err) = generate_b16(&args);
        assert_eq!(rc, 0, "{err}");
        (out, err)
    };
    let (out, _) = run(&["--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    let c = &v["compare"];
    assert_eq!(c["identical"], true, "{c}");
    assert_eq!(c["tokens"], v["output_ids"].as_array().unwrap().len());
    let (pl, df) = (
        c["plain_decode_tok_s"].as_f64().unwrap(),
        c["dflash_decode_tok_s"].as_f64().unwrap(),
    );
    assert!(pl > 0.0 && df > 0.0, "{c}");
    assert!(
        (c["speedup"].as_f64().unwrap() - df / pl).abs() < 1e-9,
        "{c}"
    );
    assert_eq!(df, v["stats"]["decode_tok_s"].as_f64().unwrap());
    // streaming: the stats line, then the comparison line; sampled runs are not compared
    let (_, err) = run(&[]);
    assert!(
        err.contains("[compare] plain decoding") && err.contains("output identical (24 tokens)"),
        "{err}"
    );
    let (_, err) = run(&["--temperature", "1", "--seed", "3"]);
    assert!(err.contains("outputs not compared"), "{err}");
}

#[test]
fn errors_are_one_line_and_exit_non_zero() {
    let tmp = tempfile::tempdir().unwrap();
    // unknown model_type
    let bad = tmp.path().join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(
        fixtures().join("targets/qwen3/model.safetensors"),
        bad.join("model.safetensors"),
    )
    .unwrap();
    let mut cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("targets/qwen3/config.json")).unwrap(),
    )
    .unwrap();
    cfg["model_type"] = "mamba9".into();
    std::fs::write(bad.join("config.json"), cfg.to_string()).unwrap();
    // truncated safetensors
    let trunc = tmp.path().join("trunc");
    std::fs::create_dir_all(&trunc).unwrap();
    let bytes = std::fs::read(fixtures().join("targets/qwen3/model.safetensors")).unwrap();
    std::fs::write(trunc.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    std::fs::copy(
        fixtures().join("targets/qwen3/config.json"),
        trunc.join("config.json"),
    )
    .unwrap();
    // malformed config
    let malformed = tmp.path().join("malformed");
    std::fs::create_dir_all(&malformed).unwrap();
    std::fs::write(
        malformed.join("config.json"),
        "{\"model_type\": \"qwen3\", ",
    )
    .unwrap();
    std::fs::copy(
        fixtures().join("targets/qwen3/model.safetensors"),
        malformed.join("model.safetensors"),
    )
    .unwrap();
    let t = fixtures().join("targets/qwen3");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--model".into(),
                bad.display().to_string(),
                "--prompt-ids".into(),
                "1".into(),
            ],
            "unsupported architecture `mamba9`",
        ),
        (
            vec![
                "--model".into(),
                trunc.display().to_string(),
                "--prompt-ids".into(),
                "1".into(),
            ],
            "truncated",
        ),
        (
            vec![
                "--model".into(),
                malformed.display().to_string(),
                "--prompt-ids".into(),
                "1".into(),
            ],
            "invalid JSON",
        ),
        (
            vec![
                "--model".into(),
                "/no/such/dir".into(),
                "--prompt-ids".into(),
                "1".into(),
            ],
            "no such directory",
        ),
        (
            vec![
                "--model".into(),
                t.display().to_string(),
                "--prompt".into(),
                "hi".into(),
            ],
            "no tokenizer.json",
        ),
        (
            vec![
                "--model".into(),
                t.display().to_string(),
                "--prompt-ids".into(),
                "1,99999".into(),
            ],
            "token id 99999",
        ),
        (
            vec![
                "--model".into(),
                t.display().to_string(),
                "--prompt-ids".into(),
                "1".into(),
                "--top-p".into(),
                "0".into(),
            ],
            "top_p",
        ),
        (
            vec![
                "--model".into(),
                t.display().to_string(),
                "--prompt-ids".into(),
                "1".into(),
                "--device".into(),
                "cuda".into(),
            ],
            "--features cuda",
        ),
        (
            vec![
                "--model".into(),
                t.display().to_string(),
                "--prompt-ids".into(),
                "1".into(),
                "--dtype".into(),
                "f8".into(),
            ],
            "--dtype f8",
        ),
        (
            // nothing to compare without a draft
            vec![
                "--model".into(),
                t.display().to_string(),
                "--prompt-ids".into(),
                "1".into(),
                "--compare".into(),
            ],
            "--compare needs DFlash",
        ),
    ];
    for (args, want) in cases {
        let mut full = vec!["generate".to_string()];
        full.extend(args.clone());
        let refs: Vec<&str> = full.iter().map(|s| s.as_str()).collect();
        let (rc, _, err) = dflash(&refs);
        assert_ne!(rc, 0, "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: expected `{want}` in: {err}");
        let lines: Vec<&str> = err
            .trim()
            .lines()
            .filter(|l| !l.starts_with("note: "))
            .collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line, got: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn models_lists_the_seed_rows_and_dflash2_rows_and_names_missing_families() {
    let (rc, out, _) = dflash(&["models", "--json"]);
    assert_eq!(rc, 0);
    let rows: Vec<Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(rows.len(), 17);
    assert_eq!(rows.iter().filter(|r| r["arch"] == "DFlash").count(), 16);
    let qwen3_8b = rows.iter().find(|r| r["target"] == "Qwen3-8B").unwrap();
    assert_eq!(qwen3_8b["supported"], true);
    assert_eq!(qwen3_8b["draft"], "z-lab/Qwen3-8B-DFlash-b16");
    // GPU fit per row: one H200 and a 24 GB card, at bf16 / as published / ~4.5 bits.
    let fit = |target: &str, gpu: usize, what: &str| {
        let r = rows.iter().find(|r| r["target"] == target).unwrap();
        r["memory"]["gpu_fit"][gpu][what].clone()
    };
    assert_eq!(fit("Qwen3-8B", 0, "bf16"), true);
    assert_eq!(fit("gpt-oss-120b", 0, "bf16"), false);
    assert_eq!(
        fit("gpt-oss-120b", 0, "as_published"),
        true,
        "MXFP4 as published fits an H200"
    );
    assert_eq!(fit("Qwen3.5-27B", 1, "bf16"), false);
    assert_eq!(fit("Qwen3.5-27B", 1, "q4"), true);
    assert_eq!(fit("Kimi-K2.5", 0, "q4"), false);
    // as dflash holds a checkpoint on CUDA: linear layers at 5 / 9 bits a weight (affine) or a
    // byte (FP8), the embedding and the routed experts in bf16
    assert_eq!(fit("Qwen3-8B", 1, "cuda_affine_8bit"), true);
    assert_eq!(fit("Qwen3-8B", 1, "cuda_fp8"), true);
    assert_eq!(fit("Qwen3.5-27B", 1, "cuda_affine_4bit"), true);
    assert_eq!(fit("Qwen3.5-27B", 1, "cuda_affine_8bit"), false);
    assert_eq!(fit("Qwen3.5-27B", 1, "cuda_fp8"), false);
    assert_eq!(fit("Qwen3.5-27B", 0, "cuda_fp8"), true);
    // the MoE rows: 4-bit MLX expert stacks stay as stored on CUDA (5 bits a weight with their
    // bf16 scales and biases), so a 4-bit Qwen3.5-122B-A10B fits one H200 and a 4-bit
    // Qwen3.5-35B-A3B a 24 GB card; at 8 bits neither fits the smaller card
    assert_eq!(fit("Qwen3.5-122B-A10B", 0, "q4"), true);
    assert_eq!(fit("Qwen3.5-122B-A10B", 0, "cuda_affine_4bit"), true);
    assert_eq!(fit("Qwen3.5-122B-A10B", 0, "cuda_affine_8bit"), false);
    assert_eq!(fit("Qwen3.5-35B-A3B", 0, "cuda_affine_4bit"), true);
    assert_eq!(fit("Qwen3.5-35B-A3B", 1, "cuda_affine_4bit"), true);
    assert_eq!(fit("Qwen3.5-35B-A3B", 1, "cuda_affine_8bit"), false);
    let held = |target: &str, what: &str| {
        let r = rows.iter().find(|r| r["target"] == target).unwrap();
        r["memory"]["cuda_held_bytes"][what].as_u64().unwrap()
    };
    // Qwen3-8B: 6.95 G matrices at a byte, the embedding and the LM head (0.62 G each) bf16
    let fp8 = held("Qwen3-8B", "fp8") as f64;
    assert!((fp8 / 9.44e9 - 1.0).abs() < 0.02, "{fp8}");
    let d2 = rows.iter().find(|r| r["arch"] == "DFlash2").unwrap();
    assert_eq!(
        (
            d2["draft"].as_str(),
            d2["block_size"].as_u64(),
            d2["format"].as_str()
        ),
        (Some("z-lab/Qwen3.8-27B-DFlash2"), Some(8), Some("z-lab"))
    );
    let (rc, table, _) = dflash(&["models"]);
    assert_eq!(rc, 0);
    let line = table
        .lines()
        .find(|l| l.starts_with("Qwen3.8-27B"))
        .unwrap();
    assert!(line.contains("z-lab DFlash2"), "{line}");
    for r in &rows {
        let line = table
            .lines()
            .find(|l| l.starts_with(r["target"].as_str().unwrap()))
            .unwrap();
        if r["supported"] == false {
            assert!(
                line.contains(&format!(
                    "no: target family `{}`",
                    r["family"].as_str().unwrap()
                )),
                "{line}"
            );
        }
    }
}

#[test]
fn draft_registry_notice_and_require_draft() {
    let t = fixtures().join("targets/qwen3");
    let (rc, _, err) = dflash(&[
        "generate",
        "--model",
        t.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "2",
    ]);
    assert_eq!(rc, 0);
    assert!(
        err.contains("no DFlash draft registered") && err.contains("plain decoding"),
        "{err}"
    );
    let (rc, _, err) = dflash(&[
        "generate",
        "--model",
        t.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--require-draft",
    ]);
    assert_ne!(rc, 0);
    assert!(
        err.contains("--require-draft") && err.contains("Qwen3-8B"),
        "{err}"
    );
}

/// Without --model the demo GGUF runs with its trained draft (models/smollm2-135m-dflash):
/// the draft is announced, some of its tokens are accepted (tau > 1 on a coding prompt at a
/// pinned block size), and the output is exactly the plain decoding's.
#[test]
fn demo_default_uses_the_trained_draft_losslessly() {
    if dflash::source::demo::SMOLLM2_135M.path().is_err() {
        eprintln!("SKIPPED: demo model not available (no network?)");
        return;
    }
    let prompt = "Write a Python function that returns the sum of a list.";
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--prompt",
            prompt,
            "--max-tokens",
            "48",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (rc, out, err) = dflash(&args);
        assert_eq!(rc, 0, "{err}");
        (
            serde_json::from_str::<serde_json::Value>(&out).unwrap(),
            err,
        )
    };
    let (spec, err) = run(&["--block-size", "8"]);
    assert!(err.contains("smollm2-135m-dflash"), "{err}");
    let (plain, _) = run(&["--no-draft"]);
    assert!(
        spec["text"].as_str().is_some_and(|t| !t.is_empty()),
        "{spec}"
    );
    assert_eq!(
        spec["output_ids"], plain["output_ids"],
        "DFlash output must equal plain decoding"
    );
    let tau = spec["stats"]["tau"].as_f64().unwrap();
    assert!(
        tau > 1.0,
        "the trained draft should get some tokens accepted: tau {tau}"
    );
}

#[test]
fn a_model_larger_than_the_memory_limit_is_refused_unless_forced() {
    let t = fixtures().join("targets/qwen3");
    let base = [
        "generate",
        "--model",
        t.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "2",
        "--memory-limit",
        "100K",
    ];
    let (rc, _, err) = dflash(&base);
    assert_ne!(rc, 0);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("not enough memory"), "{err}");
    assert!(
        err.contains("100.0 KiB is available (--memory-limit)"),
        "{err}"
    );
    let mut forced = base.to_vec();
    forced.push("--force-memory");
    let (rc, _, err) = dflash(&forced);
    assert_eq!(rc, 0, "{err}");
    let (rc, _, err) = dflash(&[
        "generate",
        "--model",
        t.to_str().unwrap(),
        "--prompt-ids",
        "1",
        "--memory-limit",
        "lots",
    ]);
    assert_ne!(rc, 0);
    assert!(err.contains("`lots`: expected a size"), "{err}");
}
