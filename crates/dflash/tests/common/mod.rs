//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod fp8;
pub mod intq;
pub mod mlx;
pub mod mxfp4;

use candle_core::Tensor;
use dflash::archs::{load_target, LoadOptions, Logits, TargetModel};
use dflash::source::ModelSource;
use std::path::Path;

pub fn load(dir: &Path) -> Box<dyn TargetModel> {
    let src = ModelSource::from_dir("test", dir).unwrap();
    load_target(&src, &LoadOptions::default()).unwrap().1
}

/// A target from `dir` with the default options (f32 on the CPU), or the load's error.
pub fn load_with(dir: &Path) -> dflash::Result<Box<dyn TargetModel>> {
    let src = ModelSource::from_dir("test", dir)?;
    load_target(&src, &LoadOptions::default()).map(|x| x.1)
}

/// The logits of every position of `toks`, from a fresh cache.
pub fn all_logits(m: &dyn TargetModel, toks: &[u32]) -> Tensor {
    let mut c = m.new_cache(toks.len()).unwrap();
    m.forward(toks, 0, &mut c, &[], Logits::All)
        .unwrap()
        .logits
        .unwrap()
}

/// A tiny qwen3 of hidden 128 (so that every in-dimension takes group size 128).
pub fn qwen3_128(seed: u64) -> dflash::testing::TinyTarget {
    dflash::testing::TinyTarget {
        hidden: 128,
        intermediate: 256,
        ..dflash::testing::TinyTarget::qwen3(seed)
    }
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let b = b
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(a.len(), b.len(), "shape mismatch");
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut r = dflash::testing::Rng::new(seed);
    (0..n).map(|_| r.below(vocab) as u32).collect()
}

/// Greedy-decode `steps` tokens after `prompt` one row at a time, then replay the same tokens
/// as verify blocks of each size in `blocks`: every verify row's logits must equal its decode
/// step's, bit for bit (what makes greedy DFlash reproduce plain decoding exactly).
pub fn assert_verify_rows_equal_decode_steps(
    m: &dyn TargetModel,
    prompt: &[u32],
    steps: usize,
    blocks: &[usize],
    what: &str,
) {
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32
    };
    let last_row = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut c = m.new_cache(prompt.len() + steps + 8).unwrap();
    let first = m.forward(prompt, 0, &mut c, &[], Logits::Last).unwrap();
    let mut toks = vec![argmax(&last_row(first.logits.unwrap()))];
    let mut step_logits = Vec::new();
    for i in 0..steps {
        let out = m
            .forward(&toks[i..i + 1], prompt.len() + i, &mut c, &[], Logits::Last)
            .unwrap();
        let l = last_row(out.logits.unwrap());
        toks.push(argmax(&l));
        step_logits.push(l);
    }
    for &q in blocks {
        c.truncate(prompt.len()).unwrap();
        let mut i = 0;
        while i < steps {
            let n = q.min(steps - i);
            let l = m
                .forward(&toks[i..i + n], prompt.len() + i, &mut c, &[], Logits::All)
                .unwrap()
                .logits
                .unwrap();
            for r in 0..n {
                let row = l.get(r).unwrap().to_vec1::<f32>().unwrap();
                assert!(
                    row == step_logits[i + r],
                    "{what}, block {q}: row {r} of the verify at step {i} differs from the decode step (max diff {})",
                    row.iter()
                        .zip(&step_logits[i + r])
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max)
                );
            }
            i += n;
        }
    }
}

/// Like [`assert_verify_rows_equal_decode_steps`], with a rollback after every verify (a random
/// number of the block's rows kept, as a partial acceptance keeps them), so it also holds for
/// targets whose state cannot be cropped back arbitrarily (the hybrids' recurrent layers roll
/// back only inside their last forward): every verify row's logits equal its decode step's,
/// bit for bit, and the state after each rollback continues exactly as the decode steps did.
pub fn assert_verify_with_rollback_equals_decode_steps(
    m: &dyn TargetModel,
    prompt: &[u32],
    steps: usize,
    q: usize,
    seed: u64,
    what: &str,
) {
    let last_row = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let p = prompt.len();
    let mut c = m.new_cache(p + steps + q + 8).unwrap();
    let first = m.forward(prompt, 0, &mut c, &[], Logits::Last).unwrap();
    let mut toks = vec![dflash::sampling::argmax(&last_row(first.logits.unwrap()))];
    let mut step_logits = Vec::new();
    for i in 0..steps {
        let out = m
            .forward(&toks[i..i + 1], p + i, &mut c, &[], Logits::Last)
            .unwrap();
        let l = last_row(out.logits.unwrap());
        toks.push(dflash::sampling::argmax(&l));
        step_logits.push(l);
    }
    let mut c = m.new_cache(p + steps + q + 8).unwrap();
    m.forward(prompt, 0, &mut c, &[], Logits::Last).unwrap();
    let mut rng = dflash::testing::Rng::new(seed);
    let mut i = 0;
    while i < steps {
        let n = q.min(steps - i);
        let l = m
            .forward(&toks[i..i + n], p + i, &mut c, &[], Logits::All)
            .unwrap()
            .logits
            .unwrap();
        for r in 0..n {
            let row = l.get(r).unwrap().to_vec1::<f32>().unwrap();
            assert!(
                row == step_logits[i + r],
                "{what}, block {q}: row {r} of the verify at step {i} differs from the decode step (max diff {})",
                row.iter()
                    .zip(&step_logits[i + r])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max)
            );
        }
        let keep = 1 + rng.below(n);
        c.truncate(p + i + keep).unwrap();
        i += keep;
    }
}

/// Greedy DFlash output equals greedy plain decoding (block 1) on `engine`, for a few prompts
/// and block sizes; returns the number of generations compared.
pub fn assert_greedy_dflash_equals_plain(
    engine: &dflash::engine::Engine,
    vocab: usize,
    blocks: &[usize],
    what: &str,
) -> usize {
    use dflash::engine::{Flow, GenerateRequest};
    let mut n = 0;
    for seed in 0..3u64 {
        let prompt = ids(900 + seed, 5 + 7 * seed as usize, vocab);
        let run = |block: usize| {
            let mut r = GenerateRequest::new(prompt.clone(), 40);
            r.block_size = Some(block);
            r.adaptive = false;
            engine
                .generate(&r, &mut |_| Flow::Continue)
                .unwrap()
                .output_ids
        };
        let plain = run(1);
        for &b in blocks {
            assert_eq!(run(b), plain, "{what}: prompt {seed}, block {b}");
            n += 1;
        }
    }
    n
}

/// A target fixture under `tests/fixtures/targets/<name>` (by the scripts in tools/goldens).
pub fn fixture(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/targets")
        .join(name)
}

/// What a fixture's `golden.safetensors` and `golden.json` hold.
pub struct Golden {
    /// The recorded tensors (`input_ids`, `logits`, `hidden_<k>`, ...).
    pub t: std::collections::HashMap<String, Tensor>,
    pub meta: serde_json::Value,
    /// The tapped layers (`meta.taps`).
    pub taps: Vec<usize>,
    /// `input_ids` as token ids.
    pub ids: Vec<u32>,
}

impl Golden {
    pub fn load(dir: &Path) -> Self {
        let t = candle_core::safetensors::load(
            dir.join("golden.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let taps = meta["taps"]
            .as_array()
            .map(|a| a.iter().map(|x| x.as_u64().unwrap() as usize).collect())
            .unwrap_or_default();
        let ids = u32s(&t["input_ids"]);
        Self { t, meta, taps, ids }
    }

    /// The recorded logits of positions `start .. start + n`.
    pub fn logits(&self, start: usize, n: usize) -> Tensor {
        self.t["logits"].narrow(0, start, n).unwrap()
    }

    /// Width of one tapped hidden state.
    pub fn hidden(&self) -> usize {
        self.t[&format!("hidden_{}", self.taps[0])].dim(1).unwrap()
    }

    /// A forward's taps `[n, taps * hidden]` (in `order`) against the recorded hidden states of
    /// rows `start ..`, each within `tol(want)`.
    pub fn assert_taps(
        &self,
        what: &str,
        got: &Tensor,
        order: &[usize],
        start: usize,
        tol: impl Fn(&Tensor) -> f32,
    ) {
        let (h, n) = (self.hidden(), got.dim(0).unwrap());
        for k in &self.taps {
            let slot = order.iter().position(|x| x == k).unwrap();
            let want = self.t[&format!("hidden_{k}")].narrow(0, start, n).unwrap();
            let d = max_abs_diff(&got.narrow(1, slot * h, h).unwrap(), &want);
            assert!(d < tol(&want), "{what}: tap {k} max abs error {d}");
        }
    }
}

/// Every value of `t` (any float dtype, any shape) as the bits of its f32: for bit-for-bit
/// comparisons.
pub fn f32_bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// `[n]` i64 (or u32) ids as u32.
pub fn u32s(t: &Tensor) -> Vec<u32> {
    t.to_dtype(candle_core::DType::I64)
        .unwrap()
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

/// Token-by-token decoding of `ids[from..]` on cache `c` (holding `ids[..from]`): every
/// position's logits within 1e-4 of the golden's.
pub fn assert_token_by_token(
    what: &str,
    m: &dyn TargetModel,
    g: &Golden,
    c: &mut dflash::archs::TargetCache,
    from: usize,
) {
    for (i, &t) in g.ids.iter().enumerate().skip(from) {
        let l = m
            .forward(&[t], i, c, &[], Logits::Last)
            .unwrap()
            .logits
            .unwrap();
        let d = max_abs_diff(&l, &g.logits(i, 1));
        assert!(d < 1e-4, "{what}: position {i} incremental error {d}");
    }
}

/// The small family models under `DFLASH_FAMILY_MODELS` (`families.py build --small`: one
/// directory per family with `target/` and `draft/`), sorted; None when it is not set.
pub fn family_models() -> Option<Vec<std::path::PathBuf>> {
    let root = std::env::var_os("DFLASH_FAMILY_MODELS")?;
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("target/config.json").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no family models under {root:?}");
    Some(dirs)
}

/// An engine over the tiny target in `dir/t` and, with `draft`, the draft in `dir/d`
/// (default load options: f32 on the CPU).
pub fn engine_from_dir(dir: &Path, draft: bool) -> dflash::engine::Engine {
    let lo = LoadOptions::default();
    let (cfg, target) =
        load_target(&ModelSource::from_dir("t", &dir.join("t")).unwrap(), &lo).unwrap();
    let d = draft.then(|| {
        dflash::draft::load_draft(
            &ModelSource::from_dir("d", &dir.join("d")).unwrap(),
            &cfg,
            "t",
            &lo,
        )
        .unwrap()
    });
    dflash::engine::Engine::new(target, d)
}

/// A tiny target + draft written to a temporary directory and loaded (f32, CPU); keep the
/// directory alive as long as the engine.
pub fn tiny_engine(
    t: &dflash::testing::TinyTarget,
    d: &dflash::testing::TinyDraft,
) -> (tempfile::TempDir, dflash::engine::Engine) {
    let dir = tempfile::tempdir().unwrap();
    t.write(&dir.path().join("t")).unwrap();
    d.write(&dir.path().join("d"), t.vocab).unwrap();
    let e = engine_from_dir(dir.path(), true);
    (dir, e)
}

/// Narrow a tiny z-lab draft (`draft::narrow`) to the 8 tokens its target says most and to 8
/// it never says, and check both with the target on `lo`'s device: greedy DFlash == plain,
/// every generation the target's own; tau exactly 1 for the never-said tokens (no proposal
/// outside the head is possible) and above 1.2 for the most-said ones; narrowing a narrowed
/// draft, or to the whole vocabulary, refused by name. Returns the two taus.
pub fn check_narrowed_draft(lo: &dflash::archs::LoadOptions) -> (f64, f64) {
    use dflash::config::draft::DraftConfig;
    use dflash::draft::load_draft;
    use dflash::draft::narrow;
    use dflash::engine::{Engine, Flow, GenerateRequest};
    use dflash::source::ModelSource;
    use dflash::testing::{TinyDraft, TinyTarget};
    use dflash::train::data::Sequence;
    let dir = tempfile::tempdir().unwrap();
    let mut t = TinyTarget::qwen3(71);
    t.tied = false;
    t.dominant = vec![(3, 4.0), (7, 3.0)];
    let td = dir.path().join("t");
    t.write(&td).unwrap();
    let d = TinyDraft::for_target(&t, 1, vec![1, t.layers - 1], 8, 72);
    d.write(&dir.path().join("zlab"), t.vocab).unwrap();
    let tsrc = ModelSource::from_dir("t", &td).unwrap();
    let (tcfg, target) = dflash::archs::load_target(&tsrc, lo).unwrap();
    let plain = Engine::new(target, None);
    // what the target says, greedy, after a few prompts
    let mut seqs = vec![];
    for seed in 0..6u64 {
        let prompt = ids(300 + seed, 6, t.vocab);
        let out = plain
            .generate(&GenerateRequest::new(prompt.clone(), 24), &mut |_| {
                Flow::Continue
            })
            .unwrap()
            .output_ids;
        seqs.push(Sequence {
            response_start: prompt.len(),
            ids: [prompt, out].concat(),
        });
    }
    let (counts, n) = narrow::response_counts(&seqs, t.vocab);
    assert_eq!(n, 6 * 24);
    let frequent = narrow::most_frequent(&counts, 8);
    let never: Vec<u32> = (0..t.vocab as u32)
        .filter(|&i| counts[i as usize] == 0)
        .take(8)
        .collect();
    assert_eq!(
        never.len(),
        8,
        "the target says fewer than {} tokens",
        t.vocab - 8
    );
    let tau_of = |name: &str, ids: &[u32]| {
        let out = dir.path().join(name);
        narrow::narrow_checkpoint(&dir.path().join("zlab"), &tsrc, ids, &out).unwrap();
        let cfg = DraftConfig::from_file(&out.join("config.json")).unwrap();
        assert_eq!(cfg.draft_vocab_size, Some(8));
        let (_, target) = dflash::archs::load_target(&tsrc, lo).unwrap();
        let draft =
            load_draft(&ModelSource::from_dir(name, &out).unwrap(), &tcfg, "t", lo).unwrap();
        assert_eq!(
            draft.draft_vocab(),
            Some(8),
            "{name}: the narrow head's tokens"
        );
        let engine = Engine::new(target, Some(draft));
        assert_greedy_dflash_equals_plain(&engine, t.vocab, &[4, 8], name);
        let mut accepted = 0.0;
        for s in &seqs {
            let mut r = GenerateRequest::new(s.ids[..s.response_start].to_vec(), 24);
            r.block_size = Some(8);
            r.adaptive = false;
            let o = engine.generate(&r, &mut |_| Flow::Continue).unwrap();
            assert_eq!(
                o.output_ids,
                s.ids[s.response_start..],
                "{name}: not the target's output"
            );
            accepted += o.stats.tau;
        }
        accepted / seqs.len() as f64
    };
    let tau_frequent = tau_of("frequent", &frequent);
    let tau_never = tau_of("never", &never);
    eprintln!(
        "tau: narrowed to the 8 most said tokens {tau_frequent:.2}, to 8 never said {tau_never:.2}"
    );
    assert_eq!(
        tau_never, 1.0,
        "a proposal outside what the target says was accepted"
    );
    assert!(
        tau_frequent > 1.2,
        "narrowed to what the target says, tau {tau_frequent:.2}"
    );
    // narrowing a narrowed draft, or to the whole vocabulary, is refused by name
    let e = narrow::narrow_checkpoint(
        &dir.path().join("frequent"),
        &tsrc,
        &frequent,
        &dir.path().join("x"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("head (or vocabulary map) of its own"), "{e}");
    let all: Vec<u32> = (0..t.vocab as u32).collect();
    let e = narrow::narrow_checkpoint(&dir.path().join("zlab"), &tsrc, &all, &dir.path().join("y"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("want 0 < K"), "{e}");
    (tau_frequent, tau_never)
}
