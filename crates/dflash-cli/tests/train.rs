//! `dflash train` end to end on a tiny random target (prompts as token ids, `self` data):
//! it writes a z-lab checkpoint, the sequences and the loss log; `dflash generate --draft`
//! loads the checkpoint unchanged and its greedy output equals plain decoding; bad input is
//! a one-line error.

use dflash::testing::TinyTarget;
use serde_json::Value;
use std::process::Command;

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
fn train_saves_a_draft_that_generate_loads_losslessly() {
    let dir = tempfile::tempdir().unwrap();
    let td = dir.path().join("t");
    let mut t = TinyTarget::qwen3(31);
    t.dominant = vec![(3, 4.0), (7, 3.0)];
    t.write(&td).unwrap();
    // `dflash train --target <the tiny target>` with `args` after
    let train = |args: &[&str]| {
        let mut all = vec!["train", "--target", td.to_str().unwrap()];
        all.extend_from_slice(args);
        dflash(&all)
    };
    let prompts = dir.path().join("p.jsonl");
    let lines: Vec<String> = (0..12)
        .map(|i| format!("{{\"prompt_ids\": [{}, {}, {}]}}", 5 + i, 40 + i, 9 + 2 * i))
        .collect();
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    // held-out prompts: two of the training file's (never trained on) and two others
    let eval = dir.path().join("eval.jsonl");
    std::fs::write(
        &eval,
        "{\"prompt_ids\": [5, 40, 9]}\n{\"prompt_ids\": [6, 41, 11]}\n{\"prompt_ids\": [90, 3, 7]}\n{\"prompt_ids\": [2, 2, 8]}",
    )
    .unwrap();
    let out = dir.path().join("draft");
    let (rc, _, err) = train(&[
        "--prompts",
        prompts.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-new",
        "24",
        "--block-size",
        "4",
        "--steps",
        "30",
        "--batch-blocks",
        "8",
        "--blocks-per-seq",
        "4",
        "--lr",
        "2e-3",
        "--warmup",
        "5",
        "--mask-token",
        "127",
        "--intermediate-size",
        "64",
        "--eval-prompts",
        eval.to_str().unwrap(),
        "--eval-n",
        "2",
        "--eval-max-tokens",
        "8",
        "--draft-vocab",
        "16",
    ]);
    assert_eq!(rc, 0, "{err}");
    assert!(err.contains("eval ") && err.contains("tau"), "{err}");
    // the narrowed copy (--draft-vocab): its own head over 16 tokens, the body the same
    let narrowed = out.join("narrow-16");
    let ncfg: Value =
        serde_json::from_str(&std::fs::read_to_string(narrowed.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(ncfg["draft_vocab_size"], 16, "{ncfg}");
    assert!(err.contains("--draft-vocab 16:"), "{err}");
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "DFlashDraftModel");
    assert_eq!(cfg["dflash_config"]["mask_token_id"], 127);
    assert_eq!(
        cfg["dflash_config"]["target_layer_ids"],
        serde_json::json!([0, 1, 2, 3])
    );
    assert_eq!(cfg["block_size"], 4);
    let log = std::fs::read_to_string(out.join("train_log.jsonl")).unwrap();
    assert_eq!(log.lines().count(), 3, "steps 10, 20, 30");
    assert!(err.contains("2 prompts excluded"), "{err}");
    assert_eq!(
        std::fs::read_to_string(out.join("sequences.jsonl"))
            .unwrap()
            .lines()
            .count(),
        10
    );
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        (
            &m["records_read"],
            &m["excluded_prompts"]["records"],
            &m["sequences"]
        ),
        (&12.into(), &2.into(), &10.into()),
        "{m}"
    );
    assert!(m["response_tokens"].as_u64().unwrap() > 0, "{m}");
    assert!(m["tokens"].as_u64() > m["response_tokens"].as_u64(), "{m}");
    let gen = |draft: Option<&str>| -> Value {
        let mut a = vec![
            "generate",
            "--model",
            td.to_str().unwrap(),
            "--prompt-ids",
            "5,40,9",
            "--max-tokens",
            "20",
            "--json",
        ];
        match draft {
            Some(d) => a.extend(["--draft", d, "--block-size", "4"]),
            None => a.push("--no-draft"),
        }
        let (rc, o, e) = dflash(&a);
        assert_eq!(rc, 0, "{e}");
        serde_json::from_str(&o).unwrap()
    };
    let with = gen(Some(out.to_str().unwrap()));
    assert_eq!(with["stats"]["mode"], "dflash");
    assert_eq!(with["output_ids"], gen(None)["output_ids"]);
    let with_narrow = gen(Some(narrowed.to_str().unwrap()));
    assert_eq!(with_narrow["stats"]["mode"], "dflash");
    assert_eq!(with_narrow["output_ids"], with["output_ids"]);
    // a narrowed copy as wide as the vocabulary is refused before any work
    let (rc, _, err) = train(&[
        "--prompts",
        prompts.to_str().unwrap(),
        "--out",
        dir.path().join("wide").to_str().unwrap(),
        "--draft-vocab",
        "128",
    ]);
    assert_ne!(rc, 0);
    assert!(err.contains("--draft-vocab 128: want fewer"), "{err}");

    // Reuse the sequences; bad taps are a one-line error.
    let (rc, _, err) = train(&[
        "--sequences",
        out.join("sequences.jsonl").to_str().unwrap(),
        "--out",
        dir.path().join("d2").to_str().unwrap(),
        "--taps",
        "1,9",
        "--steps",
        "2",
    ]);
    assert_ne!(rc, 0);
    assert!(err.contains("tap layer 9"), "{err}");

    // Data in one run, training in another on two sequence files joined (greedy + sampled).
    let s1 = dir.path().join("sampled");
    let (rc, _, err) = train(&[
        "--prompts",
        prompts.to_str().unwrap(),
        "--out",
        s1.to_str().unwrap(),
        "--max-new",
        "12",
        "--temperature",
        "1",
        "--seed",
        "3",
        "--data-only",
    ]);
    assert_eq!(rc, 0, "{err}");
    let sampled = std::fs::read_to_string(s1.join("sequences.jsonl")).unwrap();
    assert_eq!(sampled.lines().count(), 12);
    assert!(
        !s1.join("config.json").exists(),
        "--data-only trained a draft"
    );
    let (rc, _, err) = train(&[
        "--sequences",
        out.join("sequences.jsonl").to_str().unwrap(),
        s1.join("sequences.jsonl").to_str().unwrap(),
        "--out",
        dir.path().join("joined").to_str().unwrap(),
        "--block-size",
        "4",
        "--steps",
        "2",
        "--intermediate-size",
        "32",
    ]);
    assert_eq!(rc, 0, "{err}");
    // 24 sequences, 1 held out for the loss check, those that cannot anchor a block dropped:
    // more than one file's 12
    let n: usize = err
        .split(" target passes over ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{err}"));
    assert!((13..=23).contains(&n), "{n} sequences: {err}");

    // --arch dflash2 on the same sequences: a DFlash2 checkpoint that generate loads.
    let d2 = dir.path().join("dflash2");
    let (rc, _, err) = train(&[
        "--sequences",
        out.join("sequences.jsonl").to_str().unwrap(),
        "--out",
        d2.to_str().unwrap(),
        "--arch",
        "dflash2",
        "--conv-kernel",
        "3",
        "--conv-group",
        "8",
        "--selector-rank",
        "8",
        "--selector-top-k",
        "4",
        "--block-size",
        "4",
        "--steps",
        "10",
        "--batch-blocks",
        "8",
        "--blocks-per-seq",
        "4",
        "--warmup",
        "2",
        "--mask-token",
        "127",
        "--intermediate-size",
        "64",
    ]);
    assert_eq!(rc, 0, "{err}");
    assert!(err.contains("draft: DFlash2 1 layers"), "{err}");
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(d2.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "DFlash2DraftModel");
    assert_eq!(cfg["dflash_config"]["conv_kernel_size"], 3);
    assert_eq!(cfg["dflash_config"]["selector_top_k"], 4);
    let with2 = gen(Some(d2.to_str().unwrap()));
    assert_eq!(with2["stats"]["mode"], "dflash");
    assert_eq!(with2["output_ids"], gen(None)["output_ids"]);
    // A group that does not divide the hidden size is a one-line error naming the key.
    let (rc, _, err) = train(&[
        "--sequences",
        out.join("sequences.jsonl").to_str().unwrap(),
        "--out",
        dir.path().join("bad").to_str().unwrap(),
        "--arch",
        "dflash2",
        "--conv-group",
        "7",
        "--steps",
        "1",
    ]);
    assert_ne!(rc, 0);
    assert!(
        err.contains("conv_group_size") && err.contains("does not divide"),
        "{err}"
    );
}

/// `dflash train --synth-prompts` with no prompt file: the target writes the user turns
/// (a scripted bigram target through its real byte-level tokenizer and template: after `>` it
/// writes `Hi?` and ends the turn), the turns land in OUT/synth_prompts.jsonl, are answered
/// like a prompt file's, and the manifest says how they were made; without --prompts,
/// --sequences or --synth-prompts the command refuses, naming --prompts.
#[test]
fn synth_prompts_are_written_and_answered() {
    let dir = tempfile::tempdir().unwrap();
    let td = dir.path().join("t");
    dflash::testing::write_turn_target(&td, b">", "Hi?").unwrap();
    let out = dir.path().join("out");
    let (rc, _, err) = dflash(&[
        "train",
        "--target",
        td.to_str().unwrap(),
        "--synth-prompts",
        "3",
        "--synth-temperature",
        "0",
        "--data-only",
        "--max-new",
        "8",
        "--gen-batch",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        err.contains("1 user turns sampled from the target (3 of 3 asked)"),
        "{err}"
    );
    let turns = std::fs::read_to_string(out.join("synth_prompts.jsonl")).unwrap();
    assert_eq!(turns, "{\"id\":\"synth-0\",\"prompt\":\"Hi?\"}\n");
    // the turn answered at the template: the assistant slot ends with `>`, so `Hi?` again
    let seqs = std::fs::read_to_string(out.join("sequences.jsonl")).unwrap();
    let s: Value = serde_json::from_str(seqs.lines().next().unwrap()).unwrap();
    let ids: Vec<u64> = s["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let start = s["response_start"].as_u64().unwrap() as usize;
    assert_eq!(ids[start..], [72, 105, 63, 255], "{ids:?}");
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["synth_prompts"]["asked"], 3);
    assert_eq!(manifest["sequences"], 1);
    // nothing to make sequences from
    let (rc, _, err) = dflash(&[
        "train",
        "--target",
        td.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_ne!(rc, 0);
    assert!(
        err.contains("required arguments were not provided") && err.contains("--prompts"),
        "{err}"
    );
}
