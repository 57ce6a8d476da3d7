//! Batched decoding (`Engine::generate_batch`, and `generate_queue` with fewer in flight than
//! requests, issue 23): every request's output under a batch
//! equals its output alone — greedy and sampled, fixed and adaptive block sizes, stop tokens,
//! max tokens, DFlash, DFlash2 and plain decoding, dense and hybrid (recurrent rollback per
//! sequence) targets; a bad request fails alone; cancelling one request leaves the others.

mod common;
use candle_core::Tensor;
use common::*;
use dflash::engine::{Engine, Flow, GenerateOutput, GenerateRequest, Sequence};
use dflash::sampling::SamplingParams;
use dflash::testing::hybrid::TinyHybrid;
use dflash::testing::{TinyDraft, TinyTarget};
use std::path::Path;

fn engine(dir: &Path, draft: bool) -> Engine {
    engine_from_dir(dir, draft)
}

/// Eight requests that differ in everything a batch must keep apart.
fn requests(vocab: usize) -> Vec<GenerateRequest> {
    (0..8u64)
        .map(|i| {
            let plen = 1 + (i as usize * 7) % 23;
            let mut r =
                GenerateRequest::new(ids(300 + i, plen, vocab - 1), 6 + (i as usize * 5) % 29);
            r.block_size = match i % 4 {
                0 => None, // the draft's, adaptive
                1 => Some(2),
                2 => Some(5),
                _ => Some(16),
            };
            r.adaptive = i % 4 == 0;
            if i % 3 == 1 {
                r.sampling = SamplingParams {
                    temperature: 0.8,
                    top_k: 0,
                    top_p: 0.95,
                    min_p: 0.0,
                    seed: 40 + i,
                    ..Default::default()
                };
            }
            // logit adjustments on some: each sequence keeps its own history
            if i % 3 == 2 || i == 7 {
                r.sampling.presence_penalty = 0.8;
                r.sampling.frequency_penalty = 0.4;
                r.sampling.repetition_penalty = 1.1 + i as f32 * 0.05;
                r.sampling.logit_bias = vec![(i as u32 % 5, 3.0), (1, -100.0)];
            }
            r
        })
        .collect()
}

fn alone(e: &Engine, reqs: &[GenerateRequest]) -> Vec<GenerateOutput> {
    reqs.iter()
        .map(|r| e.generate(r, &mut |_| Flow::Continue).unwrap())
        .collect()
}

/// Outputs equal; with a pinned block size the cycles are the same too.
fn assert_same(what: &str, reqs: &[GenerateRequest], a: &[GenerateOutput], b: &[GenerateOutput]) {
    for (i, ((r, x), y)) in reqs.iter().zip(a).zip(b).enumerate() {
        assert_eq!(x.output_ids, y.output_ids, "{what}: request {i}");
        assert_eq!(
            x.stats.finish_reason, y.stats.finish_reason,
            "{what}: request {i}"
        );
        if r.block_size.is_some() {
            assert_eq!(
                x.stats.acceptance_lengths, y.stats.acceptance_lengths,
                "{what}: request {i} cycles"
            );
        }
    }
}

fn check(what: &str, e: &Engine, vocab: usize) -> usize {
    let mut reqs = requests(vocab);
    // a stop token inside one request's output
    let first = alone(e, &reqs[..1]);
    if first[0].output_ids.len() > 4 {
        reqs[0].stop_ids = vec![first[0].output_ids[3]];
    }
    // a prompt longer than a prefill chunk: it prefills over several batch steps while the
    // others decode
    let long = dflash::engine::PREFILL_CHUNK + 300;
    reqs[5].prompt_ids = ids(999, long, vocab - 1);
    let solo = alone(e, &reqs);
    let mut seen: Vec<Vec<u32>> = vec![vec![]; reqs.len()];
    let batched: Vec<GenerateOutput> = e
        .generate_batch(&reqs, &mut |i, ids| {
            seen[i].extend_from_slice(ids);
            Flow::Continue
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_same(what, &reqs, &solo, &batched);
    for (i, b) in batched.iter().enumerate() {
        assert_eq!(
            seen[i], b.output_ids,
            "{what}: request {i}'s callback saw its own tokens"
        );
    }
    // at most 3 in flight: each next request joins a batch already decoding, as one leaves
    let queued: Vec<GenerateOutput> = e
        .generate_queue(&reqs, 3, &mut |_, _| Flow::Continue)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_same(&format!("{what}, 3 in flight"), &reqs, &solo, &queued);
    reqs.len()
}

#[test]
fn batched_outputs_equal_outputs_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = TinyTarget::qwen3(71);
    t.dominant = vec![(3, 4.0), (7, 3.0)];
    t.write(&dir.path().join("t")).unwrap();
    let mut n = 0;
    for (k, dflash2) in [false, true].into_iter().enumerate() {
        let mut d = TinyDraft::for_target(&t, 2, vec![0, 2], 16, 72 + k as u64);
        if dflash2 {
            d = d.dflash2(2, 16, 8, 4);
        }
        d.write(&dir.path().join("d"), t.vocab).unwrap();
        let e = engine(dir.path(), true);
        n += check(if dflash2 { "dflash2" } else { "dflash" }, &e, t.vocab);
    }
    let plain = engine(dir.path(), false);
    n += check("plain", &plain, t.vocab);
    assert_eq!(n, 24);
}

#[test]
fn batched_hybrid_sequences_roll_back_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = TinyHybrid::new("qwen3_5", 81);
    t.dominant = vec![(3, 3.0), (7, 2.5)];
    t.write(&dir.path().join("t")).unwrap();
    let d = TinyDraft::for_target(&t.as_tiny_target(), 2, vec![0, 2], 16, 82);
    d.write(&dir.path().join("d"), t.vocab).unwrap();
    let e = engine(dir.path(), true);
    check("qwen3_5", &e, t.vocab);
}

#[test]
fn a_bad_request_fails_alone_and_a_cancelled_one_leaves_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let t = TinyTarget::qwen3(91);
    t.write(&dir.path().join("t")).unwrap();
    TinyDraft::for_target(&t, 1, vec![1], 4, 92)
        .write(&dir.path().join("d"), t.vocab)
        .unwrap();
    let e = engine(dir.path(), true);
    let mut reqs = vec![
        GenerateRequest::new(ids(1, 5, t.vocab), 12),
        GenerateRequest::new(vec![], 12), // empty prompt
        GenerateRequest::new(ids(2, 7, t.vocab), 12),
        GenerateRequest::new(vec![1, t.vocab as u32 + 5, 2], 12), // id outside the vocabulary
        GenerateRequest::new(ids(3, 9, t.vocab), 12),
    ];
    reqs[4].block_size = Some(3);
    let solo: Vec<_> = [0, 2, 4]
        .iter()
        .map(|&i| e.generate(&reqs[i], &mut |_| Flow::Continue).unwrap())
        .collect();
    let mut cancel_after = 0;
    let out = e.generate_batch(&reqs, &mut |i, ids| {
        if i == 2 {
            cancel_after += ids.len();
            if cancel_after >= 3 {
                return Flow::Stop;
            }
        }
        Flow::Continue
    });
    assert_eq!(out.len(), 5);
    let err = |i: usize| {
        out[i]
            .as_ref()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(err(1).contains("empty prompt"), "{}", err(1));
    assert!(!err(3).is_empty() && !err(3).contains('\n'), "{}", err(3));
    assert_eq!(out[0].as_ref().unwrap().output_ids, solo[0].output_ids);
    assert_eq!(out[4].as_ref().unwrap().output_ids, solo[2].output_ids);
    let c = out[2].as_ref().unwrap();
    assert_eq!(c.stats.finish_reason, "cancelled");
    assert_eq!(c.output_ids[..], solo[1].output_ids[..c.output_ids.len()]);
    assert!(c.output_ids.len() >= 3 && c.output_ids.len() < 12);
}

/// `TargetModel::forward_batch` == each item's `forward` alone, on every target fixture
/// (dense, sliding, yarn, tied, MoE, sinks, MLA, hybrids, gemma4 with PLE and shared KV):
/// a batched prefill of three prompts, then a batched step of three blocks of different
/// lengths over the caches it left; logits and taps, f32.
#[test]
fn forward_batch_equals_forward_alone_for_every_family() {
    use dflash::archs::{BatchItem, Logits};
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/targets");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    names.sort();
    let mut worst = 0f32;
    for name in &names {
        let m = load(&dir.join(name));
        let info = m.info();
        let vocab = info.vocab_size.min(250);
        let taps: Vec<usize> = vec![0, info.num_layers - 1];
        let prompts: Vec<Vec<u32>> = [5usize, 1, 9]
            .iter()
            .enumerate()
            .map(|(i, &n)| ids(10 + i as u64, n, vocab))
            .collect();
        let blocks: Vec<Vec<u32>> = [4usize, 1, 7]
            .iter()
            .enumerate()
            .map(|(i, &n)| ids(20 + i as u64, n, vocab))
            .collect();
        // alone
        let mut solo = vec![];
        for (p, b) in prompts.iter().zip(&blocks) {
            let mut c = m.new_cache(64).unwrap();
            let a = m.forward(p, 0, &mut c, &taps, Logits::Last).unwrap();
            let v = m.forward(b, p.len(), &mut c, &taps, Logits::All).unwrap();
            solo.push((a, v));
        }
        // together
        let mut caches: Vec<_> = (0..3).map(|_| m.new_cache(64).unwrap()).collect();
        let mut items: Vec<BatchItem> = caches
            .iter_mut()
            .zip(&prompts)
            .map(|(c, p)| BatchItem {
                tokens: p,
                start: 0,
                cache: c,
                logits: Logits::Last,
            })
            .collect();
        let pre: Vec<_> = m
            .forward_batch(&mut items, &taps)
            .unwrap()
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        drop(items);
        let mut items: Vec<BatchItem> = caches
            .iter_mut()
            .zip(&blocks)
            .zip(&prompts)
            .map(|((c, b), p)| BatchItem {
                tokens: b,
                start: p.len(),
                cache: c,
                logits: Logits::All,
            })
            .collect();
        let ver: Vec<_> = m
            .forward_batch(&mut items, &taps)
            .unwrap()
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        drop(items);
        for (k, ((a, v), (pa, pv))) in solo.iter().zip(pre.iter().zip(&ver)).enumerate() {
            for (what, x, y) in [
                ("prefill logits", &a.logits, &pa.logits),
                ("prefill taps", &a.taps, &pa.taps),
                ("verify logits", &v.logits, &pv.logits),
                ("verify taps", &v.taps, &pv.taps),
            ] {
                let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
                assert_eq!(x.dims(), y.dims(), "{name} item {k} {what}");
                let d = max_abs_diff(x, y);
                worst = worst.max(d);
                assert!(
                    d < 1e-4,
                    "{name} item {k} {what}: batched vs alone differ by {d}"
                );
            }
        }
        assert_eq!(
            caches.iter().map(|c| c.len()).collect::<Vec<_>>(),
            vec![9, 2, 16],
            "{name}"
        );
    }
    eprintln!(
        "{} families: batched vs alone max |diff| {worst:e}",
        names.len()
    );
}

/// `DraftModel::propose_batch` (one pass for every sequence) == each `propose` alone, for a
/// DFlash and a DFlash2 draft with sliding layers, over two calls per sequence (the second
/// reads the cached context rows and adds new ones), blocks of different sizes.
#[test]
fn draft_batch_equals_draft_alone() {
    use dflash::archs::Logits;
    use dflash::draft::DraftItem;
    let dir = tempfile::tempdir().unwrap();
    let t = TinyTarget::qwen3(101);
    t.write(&dir.path().join("t")).unwrap();
    for dflash2 in [false, true] {
        let mut d = TinyDraft::for_target(&t, 3, vec![0, 2], 16, 102);
        d.layer_types = Some(vec![
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ]);
        d.sliding_window = 5;
        if dflash2 {
            d = d.dflash2(3, 8, 8, 4);
        }
        d.write(&dir.path().join("d"), t.vocab).unwrap();
        let e = engine(dir.path(), true);
        let draft = e.draft.as_ref().unwrap();
        let target = e.target.as_ref();
        let seqs: Vec<Vec<u32>> = [12usize, 3, 20]
            .iter()
            .enumerate()
            .map(|(i, &n)| ids(50 + i as u64, n, t.vocab - 1))
            .collect();
        let taps: Vec<Tensor> = seqs
            .iter()
            .map(|s| {
                let mut c = target.new_cache(64).unwrap();
                target
                    .forward(s, 0, &mut c, &draft.taps, Logits::None)
                    .unwrap()
                    .taps
                    .unwrap()
            })
            .collect();
        // call 1: context 0..cut, block at cut; call 2: context cut..len-1, block at len-1
        let cuts = [7usize, 1, 15];
        let qs = [[4usize, 16], [2, 5], [16, 3]];
        let block = |s: &[u32], at: usize, q: usize| {
            let mut b = vec![s[at]];
            b.resize(q, draft.mask_token_id());
            b
        };
        let mut alone = vec![];
        for (k, s) in seqs.iter().enumerate() {
            let mut c = draft.new_cache(64).unwrap();
            let b1 = block(s, cuts[k], qs[k][0]);
            let p1 = draft
                .propose(
                    target,
                    &taps[k].narrow(0, 0, cuts[k]).unwrap(),
                    &b1,
                    cuts[k],
                    &mut c,
                    None,
                )
                .unwrap();
            let n = s.len() - 1;
            let b2 = block(s, n, qs[k][1]);
            let p2 = draft
                .propose(
                    target,
                    &taps[k].narrow(0, cuts[k], n - cuts[k]).unwrap(),
                    &b2,
                    n,
                    &mut c,
                    None,
                )
                .unwrap();
            alone.push((p1, p2));
        }
        let mut caches: Vec<_> = (0..3).map(|_| draft.new_cache(64).unwrap()).collect();
        let b1: Vec<Vec<u32>> = (0..3).map(|k| block(&seqs[k], cuts[k], qs[k][0])).collect();
        let mut items: Vec<DraftItem> = caches
            .iter_mut()
            .enumerate()
            .map(|(k, c)| DraftItem {
                ctx: taps[k].narrow(0, 0, cuts[k]).unwrap(),
                block: &b1[k],
                start: cuts[k],
                cache: c,
                guide: None,
            })
            .collect();
        let p1 = draft.propose_batch(target, &mut items).unwrap();
        drop(items);
        let b2: Vec<Vec<u32>> = (0..3)
            .map(|k| block(&seqs[k], seqs[k].len() - 1, qs[k][1]))
            .collect();
        let mut items: Vec<DraftItem> = caches
            .iter_mut()
            .enumerate()
            .map(|(k, c)| {
                let n = seqs[k].len() - 1;
                DraftItem {
                    ctx: taps[k].narrow(0, cuts[k], n - cuts[k]).unwrap(),
                    block: &b2[k],
                    start: n,
                    cache: c,
                    guide: None,
                }
            })
            .collect();
        let p2 = draft.propose_batch(target, &mut items).unwrap();
        drop(items);
        for k in 0..3 {
            assert_eq!(p1[k], alone[k].0, "dflash2={dflash2} seq {k} call 1");
            assert_eq!(p2[k], alone[k].1, "dflash2={dflash2} seq {k} call 2");
        }
    }
}

/// A request taken out of the batch while its long prompt is still prefilling (its client
/// left: the server checks between steps) leaves the others' outputs as they are alone.
#[test]
fn a_sequence_taken_out_mid_prefill_leaves_the_others() {
    use dflash::engine::{Batch, PREFILL_CHUNK};
    let dir = tempfile::tempdir().unwrap();
    let t = TinyTarget::qwen3(93);
    t.write(&dir.path().join("t")).unwrap();
    TinyDraft::for_target(&t, 1, vec![1], 4, 94)
        .write(&dir.path().join("d"), t.vocab)
        .unwrap();
    let e = engine(dir.path(), true);
    let reqs = [
        GenerateRequest::new(ids(5, 6, t.vocab), 10),
        GenerateRequest::new(ids(6, 3 * PREFILL_CHUNK + 7, t.vocab), 10),
        GenerateRequest::new(ids(7, 9, t.vocab), 10),
    ];
    let solo = alone(&e, &[reqs[0].clone(), reqs[2].clone()]);
    let mut batch = Batch::new(&e);
    for (i, r) in reqs.iter().enumerate() {
        batch.push(
            i,
            Sequence::new(&e, r.clone(), Box::new(|_| Flow::Continue)).unwrap(),
        );
    }
    let mut outs = std::collections::HashMap::new();
    for (i, o) in batch.step() {
        outs.insert(i, o.unwrap());
    }
    let taken = batch.take(1).expect("still in the batch");
    assert!(
        taken.prefilling(),
        "one chunk of a 3.5-chunk prompt went through"
    );
    assert!(batch.take(1).is_none());
    drop(taken);
    while !batch.is_empty() {
        for (i, o) in batch.step() {
            outs.insert(i, o.unwrap());
        }
    }
    assert_eq!(outs.len(), 2);
    assert_eq!(outs[&0].output_ids, solo[0].output_ids);
    assert_eq!(outs[&2].output_ids, solo[1].output_ids);
}

/// On the CPU a prefill chunk shrinks as the context grows (the server cancels between
/// chunks); on a GPU it is fixed. Either way a function of the position alone.
#[test]
fn cpu_prefill_chunks_shrink_with_the_context() {
    use dflash::engine::{prefill_rows, PREFILL_CHUNK};
    for pos in [0, 1000, 100_000] {
        assert_eq!(prefill_rows(pos, true), PREFILL_CHUNK);
    }
    let rows: Vec<usize> = [0, 1000, 3500, 8000, 100_000]
        .iter()
        .map(|&p| prefill_rows(p, false))
        .collect();
    assert_eq!(rows, vec![384, 155, 62, 48, 48]);
}

/// What the server admits by: `Engine::request_cache_bytes` is the bytes the sequence's caches
/// really hold, with and without a draft, pinned and adaptive blocks, for a dense and a hybrid
/// target (whose recurrent state is a fixed part).
#[test]
fn request_cache_bytes_are_what_a_sequence_allocates() {
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    let dense = TinyTarget::qwen3(60);
    let hybrid = TinyHybrid::new("qwen3_5", 61);
    for k in 0..2 {
        let d = dir.path().join(format!("m{k}"));
        let tt = if k == 0 {
            dense.write(&d.join("t")).unwrap();
            dense.clone()
        } else {
            hybrid.write(&d.join("t")).unwrap();
            hybrid.as_tiny_target()
        };
        TinyDraft::for_target(&tt, 1, vec![1], 8, 62)
            .write(&d.join("d"), tt.vocab)
            .unwrap();
        for with_draft in [false, true] {
            let e = engine(&d, with_draft);
            for (plen, max, block) in [(3, 5, None), (40, 100, Some(4)), (7, 1, Some(1))] {
                let mut r = GenerateRequest::new(ids(70 + plen as u64, plen, tt.vocab), max);
                r.block_size = block;
                let want = e.request_cache_bytes(&r).unwrap();
                let s = Sequence::new(&e, r, Box::new(|_| Flow::Continue)).unwrap();
                assert_eq!(
                    s.cache_bytes(),
                    want,
                    "family {k} draft {with_draft} plen {plen}"
                );
                assert!(want > 0);
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 12);
}
