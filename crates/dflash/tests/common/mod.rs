//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod mlx;

use candle_core::Tensor;
use dflash::archs::{load_target, LoadOptions, Logits, TargetModel};
use dflash::source::ModelSource;
use std::path::Path;

pub fn load(dir: &Path) -> Box<dyn TargetModel> {
    let src = ModelSource::from_dir("test", dir).unwrap();
    load_target(&src, &LoadOptions::default()).unwrap().1
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
