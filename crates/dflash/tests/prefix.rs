//! The prefix cache (issue 23): a second chat turn starts from the first turn's caches and
//! gives the output of a cold run, for dense (DFlash, DFlash2, plain) and hybrid targets,
//! greedy and sampled; a prompt sharing only a system prompt reuses that part (attention
//! caches cut anywhere, recurrent state only whole); the byte budget evicts.

mod common;
use common::*;
use dflash::engine::{Engine, Flow, GenerateOutput, GenerateRequest};
use dflash::sampling::SamplingParams;
use dflash::testing::hybrid::TinyHybrid;
use dflash::testing::{TinyDraft, TinyTarget};
use std::path::Path;

fn engine(dir: &Path, draft: bool, prefix_bytes: usize) -> Engine {
    let mut e = engine_from_dir(dir, draft);
    e.enable_prefix_cache(prefix_bytes);
    e
}

fn run(e: &Engine, r: &GenerateRequest) -> GenerateOutput {
    e.generate(r, &mut |_| Flow::Continue).unwrap()
}

/// Turn 1, then turn 2 = turn 1's prompt + its answer + new tokens, on a cached engine and a
/// cold one; then a prompt sharing only the first `shared` tokens.
fn check(what: &str, dir: &Path, draft: bool, vocab: usize, hybrid: bool) {
    let warm = engine(dir, draft, 64 << 20);
    let cold = engine(dir, draft, 0);
    for sampled in [false, true] {
        let mut r1 = GenerateRequest::new(ids(7 + sampled as u64, 120, vocab - 1), 20);
        r1.block_size = Some(4);
        if sampled {
            r1.sampling = SamplingParams {
                temperature: 0.8,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 5,
                ..Default::default()
            };
        }
        let o1 = run(&warm, &r1);
        assert_eq!(o1.output_ids, run(&cold, &r1).output_ids, "{what}: turn 1");
        assert_eq!(o1.stats.cached_prompt_tokens, 0);
        let mut r2 = r1.clone();
        r2.prompt_ids.extend_from_slice(&o1.output_ids);
        r2.prompt_ids.extend(ids(70, 9, vocab - 1));
        let w2 = run(&warm, &r2);
        let c2 = run(&cold, &r2);
        assert_eq!(
            w2.output_ids, c2.output_ids,
            "{what} sampled={sampled}: turn 2"
        );
        // every position turn 1 left in its cache: its prompt and all its answer but the last
        // token (which was never run)
        assert_eq!(
            w2.stats.cached_prompt_tokens,
            r1.prompt_ids.len() + o1.output_ids.len() - 1,
            "{what} sampled={sampled}"
        );
        assert!(w2.stats.ttft_ms > 0.0);
        // a prompt that shares only a system prompt of 50 tokens
        let mut r3 = r1.clone();
        r3.prompt_ids.truncate(50);
        r3.prompt_ids
            .extend(ids(90 + sampled as u64, 30, vocab - 1));
        let w3 = run(&warm, &r3);
        assert_eq!(
            w3.output_ids,
            run(&cold, &r3).output_ids,
            "{what}: shared system prompt"
        );
        let want = if hybrid { 0 } else { 50 };
        assert_eq!(
            w3.stats.cached_prompt_tokens, want,
            "{what}: shared system prompt reuse"
        );
    }
    let st = warm.prefix_stats().unwrap();
    assert!(st.hits >= 2 && st.reused_tokens > 0, "{what}: {st:?}");
    assert!(cold.prefix_stats().is_none());
}

#[test]
fn second_turn_starts_from_the_first_and_equals_a_cold_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = TinyTarget::qwen3(111);
    t.dominant = vec![(3, 4.0), (7, 3.0)];
    t.write(&dir.path().join("t")).unwrap();
    for dflash2 in [false, true] {
        let mut d = TinyDraft::for_target(&t, 2, vec![0, 2], 8, 112);
        if dflash2 {
            d = d.dflash2(2, 16, 8, 4);
        }
        d.write(&dir.path().join("d"), t.vocab).unwrap();
        check(
            if dflash2 { "dflash2" } else { "dflash" },
            dir.path(),
            true,
            t.vocab,
            false,
        );
    }
    check("plain", dir.path(), false, t.vocab, false);
}

#[test]
fn hybrid_targets_reuse_whole_entries_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = TinyHybrid::new("qwen3_5", 121);
    t.dominant = vec![(3, 3.0), (7, 2.5)];
    t.write(&dir.path().join("t")).unwrap();
    TinyDraft::for_target(&t.as_tiny_target(), 2, vec![0, 2], 8, 122)
        .write(&dir.path().join("d"), t.vocab)
        .unwrap();
    check("qwen3_5", dir.path(), true, t.vocab, true);
}

#[test]
fn the_byte_budget_evicts_least_recently_used_entries() {
    let dir = tempfile::tempdir().unwrap();
    let t = TinyTarget::qwen3(131);
    t.write(&dir.path().join("t")).unwrap();
    let probe = engine(dir.path(), false, 64 << 20);
    let r = |seed| GenerateRequest::new(ids(seed, 100, t.vocab - 1), 10);
    run(&probe, &r(1));
    let one = probe.prefix_stats().unwrap().bytes;
    assert!(one > 0);
    // room for two entries
    let e = engine(dir.path(), false, one * 2 + one / 2);
    for s in 1..=3 {
        run(&e, &r(s));
    }
    let st = e.prefix_stats().unwrap();
    assert_eq!((st.entries, st.evictions), (2, 1), "{st:?}");
    // the oldest (seed 1) is gone, the others hit
    let again = |s| {
        let mut q = r(s);
        q.prompt_ids.push(3);
        run(&e, &q).stats.cached_prompt_tokens
    };
    assert_eq!(again(1), 0);
    assert!(again(3) >= 100);
}
