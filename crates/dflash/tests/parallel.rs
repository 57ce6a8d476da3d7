//! Tensor parallelism on the CPU (issue 28): N ranks as threads, each holding its share of the
//! attention heads and dense MLP units, joined by an in-process all-reduce
//! (`archs::parallel::Sharded`); routed experts split by expert. Sharded == unsharded for
//! every family's golden fixture at N = 2 and 4 (where the heads and experts split evenly): a prompt, decode steps, a verify
//! block rolled back, and batched forwards, logits and taps within f32 rounding (the partial
//! sums add in another order); greedy DFlash == plain decoding through the sharded path; and
//! what cannot split is a one-line error.

mod common;

use dflash::archs::{load_target, BatchItem, LoadOptions, Logits, TargetModel};
use dflash::source::ModelSource;
use std::path::PathBuf;

fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/targets"
    ));
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    v.sort();
    v
}

fn load(dir: &std::path::Path, tp: usize) -> dflash::Result<Box<dyn TargetModel>> {
    let opts = LoadOptions {
        tensor_parallel: tp,
        ..Default::default()
    };
    Ok(load_target(&ModelSource::from_dir("t", dir)?, &opts)?.1)
}

/// An engine over `target` split over `tp` ranks (GGUF matrices kept as stored) with the
/// draft in `draft` whole (drafts are not split).
fn sharded_engine(
    target: &ModelSource,
    draft: &std::path::Path,
    tp: usize,
) -> dflash::engine::Engine {
    let opts = LoadOptions {
        keep_quant: true,
        tensor_parallel: tp,
        ..Default::default()
    };
    let (cfg, t) = load_target(target, &opts).unwrap();
    let d = dflash::draft::load_draft(
        &ModelSource::from_dir("d", draft).unwrap(),
        &cfg,
        "t",
        &LoadOptions::default(),
    )
    .unwrap();
    dflash::engine::Engine::new(t, Some(d))
}

fn rel(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    let d = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let m = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    d / m.max(1e-6)
}

/// The forwards of a short DFlash run (prompt, steps, a verify block cut back, batched
/// forwards of two sequences) on both models, every output compared.
fn compare(name: &str, whole: &dyn TargetModel, split: &dyn TargetModel, tp: usize) -> f32 {
    let vocab = whole.info().vocab_size.min(500);
    let taps = [0usize, whole.info().num_layers - 1];
    let prompt = common::ids(7, 17, vocab);
    let (mut cw, mut cs) = (whole.new_cache(64).unwrap(), split.new_cache(64).unwrap());
    assert_eq!(cs.ranks.len(), tp - 1);
    let mut worst = 0f32;
    let mut check =
        |what: &str, a: dflash::archs::ForwardOutput, b: dflash::archs::ForwardOutput| {
            let (la, lb) = (a.logits.unwrap(), b.logits.unwrap());
            let e = rel(&lb, &la);
            assert!(e < 1e-4, "{name} tp {tp} {what}: logits rel err {e}");
            if let (Some(ta), Some(tb)) = (a.taps, b.taps) {
                let e = rel(&tb, &ta);
                assert!(e < 1e-4, "{name} tp {tp} {what}: taps rel err {e}");
            }
            worst = worst.max(e);
        };
    let fw = |m: &dyn TargetModel, c: &mut dflash::archs::TargetCache, toks: &[u32], at: usize| {
        m.forward(toks, at, c, &taps, Logits::All).unwrap()
    };
    check(
        "prompt",
        fw(whole, &mut cw, &prompt, 0),
        fw(split, &mut cs, &prompt, 0),
    );
    let mut pos = prompt.len();
    for (i, t) in [3u32, 9, 4].iter().enumerate() {
        check(
            &format!("step {i}"),
            fw(whole, &mut cw, &[*t], pos),
            fw(split, &mut cs, &[*t], pos),
        );
        pos += 1;
    }
    let block = common::ids(11, 5, vocab);
    check(
        "verify",
        fw(whole, &mut cw, &block, pos),
        fw(split, &mut cs, &block, pos),
    );
    cw.truncate(pos + 2).unwrap();
    cs.truncate(pos + 2).unwrap();
    assert!(
        cs.ranks.iter().all(|c| c.len() == pos + 2),
        "{name}: rank caches rolled back"
    );
    pos += 2;
    check(
        "after rollback",
        fw(whole, &mut cw, &[5], pos),
        fw(split, &mut cs, &[5], pos),
    );
    pos += 1;
    // two sequences in one batched forward: the second a fresh prompt
    let (mut cw2, mut cs2) = (whole.new_cache(64).unwrap(), split.new_cache(64).unwrap());
    let p2 = common::ids(13, 6, vocab);
    let run = |m: &dyn TargetModel,
               c1: &mut dflash::archs::TargetCache,
               c2: &mut dflash::archs::TargetCache| {
        let mut items = [
            BatchItem {
                tokens: &[8u32, 2],
                start: pos,
                cache: c1,
                logits: Logits::All,
            },
            BatchItem {
                tokens: &p2,
                start: 0,
                cache: c2,
                logits: Logits::All,
            },
        ];
        m.forward_batch(&mut items, &taps).unwrap()
    };
    let (ow, os) = (run(whole, &mut cw, &mut cw2), run(split, &mut cs, &mut cs2));
    for (k, (a, b)) in ow.into_iter().zip(os).enumerate() {
        check(&format!("batch item {k}"), a.unwrap(), b.unwrap());
    }
    assert!(cs2.ranks.iter().all(|c| c.len() == p2.len()));
    worst
}

#[test]
fn sharded_equals_unsharded_for_every_family() {
    let mut ran = 0;
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let whole = load(&dir, 1).unwrap();
        for tp in [2usize, 4] {
            match load(&dir, tp) {
                Ok(split) => {
                    let e = compare(&name, whole.as_ref(), split.as_ref(), tp);
                    let info = split.info().quantization.clone().unwrap_or_default();
                    assert!(info.contains(&format!("tensor parallel {tp}")), "{info}");
                    eprintln!("ok {name} tp {tp}: worst logits rel err {e:.2e}; {info}");
                    ran += 1;
                }
                // heads or experts that neither split nor replicate evenly: a one-line error
                // naming them
                Err(e) => {
                    let e = e.to_string();
                    assert!(
                        (e.contains("do not split")
                            || e.contains("replicated evenly")
                            || e.contains("fewer than the ranks"))
                            && !e.contains('\n'),
                        "{name} tp {tp}: {e}"
                    );
                    eprintln!("refused {name} tp {tp}: {e}");
                }
            }
        }
    }
    assert!(ran >= 30, "only {ran} sharded loads ran");
}

/// Greedy DFlash equals plain decoding with the target split over 2 and 4 ranks, and equals
/// the unsharded engine's output; the logits follow the whole model's (qwen2 has no golden
/// fixture: its q/k/v biases split with their rows here).
#[test]
fn greedy_dflash_equals_plain_through_the_sharded_target() {
    use dflash::testing::{TinyDraft, TinyTarget};
    for (t, tps) in [
        (TinyTarget::qwen3(31), [2usize, 4]),
        (TinyTarget::llama(32), [2, 4]),
        (TinyTarget::qwen2(33), [2, 4]),
    ] {
        let mut t = t;
        t.dominant = vec![(3, 4.0), (7, 3.0)];
        let d = TinyDraft::for_target(&t, 2, vec![0, 2], 16, 77);
        let dir = tempfile::tempdir().unwrap();
        t.write(&dir.path().join("t")).unwrap();
        d.write(&dir.path().join("d"), t.vocab).unwrap();
        let whole = common::engine_from_dir(dir.path(), true);
        for tp in tps {
            let tsrc = ModelSource::from_dir("t", &dir.path().join("t")).unwrap();
            let e = sharded_engine(&tsrc, &dir.path().join("d"), tp);
            compare(&t.model_type, whole.target.as_ref(), e.target.as_ref(), tp);
            let n = common::assert_greedy_dflash_equals_plain(
                &e,
                t.vocab,
                &[2, 8, 16],
                &format!("{} tp {tp}", t.model_type),
            );
            // and the same tokens as the whole model
            for seed in 0..3u64 {
                let prompt = common::ids(900 + seed, 9, t.vocab);
                let gen = |e: &dflash::engine::Engine| {
                    let mut r = dflash::engine::GenerateRequest::new(prompt.clone(), 24);
                    r.block_size = Some(8);
                    e.generate(&r, &mut |_| dflash::engine::Flow::Continue)
                        .unwrap()
                        .output_ids
                };
                assert_eq!(gen(&e), gen(&whole), "{} tp {tp} seed {seed}", t.model_type);
            }
            eprintln!(
                "ok {} tp {tp}: {n} generations greedy DFlash == plain",
                t.model_type
            );
        }
    }
}

/// A GGUF target (Q8_0 and Q4_0 matrices, kept as stored: the CPU's int8 products) split over
/// 2 and 4 ranks: each rank's matrices are whole blocks of the stored ones (rows, or columns
/// at block boundaries), logits follow the whole model's (the int8 partial sums add in another
/// order), and greedy DFlash == plain decoding through the sharded target (every rank's
/// products are row-invariant, so a verify row equals its decode step).
#[test]
fn gguf_blocks_split_as_stored() {
    use candle_core::quantized::GgmlDType;
    use dflash::testing::{write_gguf_with, TinyDraft, TinyTarget};
    let mut t = TinyTarget::qwen3(41);
    t.dominant = vec![(3, 4.0), (7, 3.0)];
    let dir = tempfile::tempdir().unwrap();
    t.write(dir.path()).unwrap();
    let gguf = write_gguf_with(&t, dir.path(), |name: &str| {
        if name.contains("mlp") {
            GgmlDType::Q4_0
        } else {
            GgmlDType::Q8_0
        }
    })
    .unwrap();
    let d = TinyDraft::for_target(&t, 2, vec![0, 2], 16, 78);
    let ddir = tempfile::tempdir().unwrap();
    d.write(ddir.path(), t.vocab).unwrap();
    let opts = |tp| LoadOptions {
        keep_quant: true,
        tensor_parallel: tp,
        ..Default::default()
    };
    let src = || ModelSource::from_gguf("t", &gguf);
    let whole = load_target(&src(), &opts(1)).unwrap().1;
    for tp in [2usize, 4] {
        let split = load_target(&src(), &opts(tp)).unwrap().1;
        let info = split.info().quantization.clone().unwrap_or_default();
        assert!(
            info.contains("Q8_0") && info.contains(&format!("tensor parallel {tp}")),
            "{info}"
        );
        let e = compare("gguf qwen3", whole.as_ref(), split.as_ref(), tp);
        let engine = sharded_engine(&src(), ddir.path(), tp);
        let n = common::assert_greedy_dflash_equals_plain(&engine, t.vocab, &[2, 8, 16], "gguf");
        eprintln!("ok gguf tp {tp}: logits rel err {e:.2e}, {n} generations greedy DFlash == plain; {info}");
    }
}

/// The Gated DeltaNet hybrids at head counts that split 4 ways (the golden fixtures have 2 key
/// heads): qwen3_5, qwen3_5_moe and qwen3_next with 4 key / 8 value heads == the whole model at
/// 2 and 4 ranks (each rank's conv window and recurrent state hold its heads only), and greedy
/// DFlash == plain through the split qwen3_next.
#[test]
fn hybrids_split_by_linear_attention_heads() {
    use dflash::testing::{TinyDraft, TinyHybrid};
    for fam in ["qwen3_5", "qwen3_5_moe", "qwen3_next"] {
        let mut h = TinyHybrid::new(fam, 51);
        h.lin_k_heads = 4;
        h.lin_v_heads = 8;
        h.dominant = vec![(3, 4.0), (7, 3.0)];
        let dir = tempfile::tempdir().unwrap();
        h.write(&dir.path().join("t")).unwrap();
        let whole = load(&dir.path().join("t"), 1).unwrap();
        for tp in [2usize, 4] {
            let split = load(&dir.path().join("t"), tp).unwrap();
            let e = compare(fam, whole.as_ref(), split.as_ref(), tp);
            eprintln!("ok {fam} (4 / 8 linear heads) tp {tp}: worst logits rel err {e:.2e}");
        }
        if fam == "qwen3_next" {
            let d = TinyDraft::for_target(&h.as_tiny_target(), 2, vec![0, 3], 16, 79);
            d.write(&dir.path().join("d"), h.vocab).unwrap();
            let tsrc = ModelSource::from_dir("t", &dir.path().join("t")).unwrap();
            let engine = sharded_engine(&tsrc, &dir.path().join("d"), 2);
            let n = common::assert_greedy_dflash_equals_plain(&engine, h.vocab, &[2, 8, 16], fam);
            eprintln!("ok {fam} tp 2: {n} generations greedy DFlash == plain");
        }
    }
}

/// The memory plan of a split load on one host counts the embedding and LM head once a rank:
/// at a limit where the whole model fits 1,000 tokens of context, two ranks fit 32 fewer
/// (2 x 128 x 64 f32 more = 64 KiB at 2 KiB of KV a token), with a notice.
#[test]
fn the_memory_plan_counts_what_every_rank_holds() {
    use dflash::pipeline::{Pipeline, PipelineOptions};
    let dir = tempfile::tempdir().unwrap();
    dflash::testing::TinyTarget::qwen3(5)
        .write(dir.path())
        .unwrap();
    let src = ModelSource::from_dir("t", dir.path()).unwrap();
    let dev = candle_core::Device::Cpu;
    let w = dflash::memory::weight_bytes(&src, candle_core::DType::F32, &dev, false).unwrap();
    let kv =
        dflash::memory::kv_bytes_per_token(&src.target_config().unwrap(), candle_core::DType::F32);
    let load = |tp: usize| {
        Pipeline::load(&PipelineOptions {
            model: dir.path().display().to_string(),
            no_draft: true,
            memory_limit: Some(w + kv * 1000),
            tensor_parallel: tp,
            ..Default::default()
        })
        .unwrap()
    };
    assert_eq!(load(1).engine.max_context, 1000);
    let p = load(2);
    assert_eq!(p.engine.max_context, 1000 - 2 * 128 * 64 * 4 / kv as usize);
    assert!(
        p.notices
            .iter()
            .any(|n| n.contains("tensor parallel 2 on one host")),
        "{:?}",
        p.notices
    );
}

/// What cannot split says so in one line naming the count: 4 heads over 3 ranks.
#[test]
fn uneven_splits_are_one_line_errors() {
    let dir = fixtures()
        .into_iter()
        .find(|d| d.ends_with("qwen3"))
        .unwrap();
    let e = load(&dir, 3)
        .err()
        .expect("4 heads do not split over 3 ranks")
        .to_string();
    assert!(
        e.contains("4 attention heads") && e.contains("3 ranks") && !e.contains('\n'),
        "{e}"
    );
}
