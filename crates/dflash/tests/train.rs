//! Draft training (`dflash::train`): the training forward equals the inference forward
//! (no drift), and a tiny draft trained for a few hundred CPU steps on a learnable tiny target
//! lowers its loss and raises tau over the untrained draft, losslessly, through the normal
//! loader and engine.

mod common;
use candle_core::{Device, Tensor};
use common::*;
use dflash::archs::{LoadOptions, Logits, TargetModel};
use dflash::bench::prompts::Prompt;
use dflash::draft::{load_draft, BlockSegment, DraftModel};

/// Weights as stored: the loaded draft stays float on the CPU (by default its linears run at
/// Q8_0 there), so the training forward and the inference forward are the same arithmetic.
fn stored() -> LoadOptions {
    LoadOptions {
        keep_quant: true,
        ..Default::default()
    }
}
use dflash::engine::{Engine, Flow, GenerateRequest};
use dflash::pipeline::{Pipeline, PipelineOptions};
use dflash::source::ModelSource;
use dflash::testing::{TinyDraft, TinyTarget};
use dflash::train::{self, data, DataMode, SequenceOptions, TrainOptions, Trainer};
use std::path::Path;

/// Logits of `draft.forward` (inference: context cache + one block) for each anchor.
fn inference_logits(
    d: &DraftModel,
    t: &dyn TargetModel,
    taps: &Tensor,
    ids: &[u32],
    anchors: &[usize],
    q: usize,
) -> Vec<Tensor> {
    anchors
        .iter()
        .map(|&a| {
            let mut cache = d.new_cache(a + q).unwrap();
            let mut block = vec![ids[a]];
            block.extend(std::iter::repeat_n(d.mask_token_id(), q - 1));
            // Context in two chunks, as the engine feeds it (prefill, then accepted rows).
            let cut = a / 2;
            if cut > 0 {
                let mut b0 = block.clone();
                b0[0] = ids[cut];
                d.forward(t, &taps.narrow(0, 0, cut).unwrap(), &b0, cut, &mut cache)
                    .unwrap();
            }
            d.forward(
                t,
                &taps.narrow(0, cut, a - cut).unwrap(),
                &block,
                a,
                &mut cache,
            )
            .unwrap()
        })
        .collect()
}

fn target_taps(t: &dyn TargetModel, ids: &[u32], taps: &[usize]) -> Tensor {
    let mut c = t.new_cache(ids.len()).unwrap();
    t.forward(ids, 0, &mut c, taps, Logits::None)
        .unwrap()
        .taps
        .unwrap()
}

/// A random tiny Qwen3 target (seed 5) written to `dir/t` and loaded.
fn tiny_qwen3(
    dir: &Path,
) -> (
    TinyTarget,
    dflash::config::TargetConfig,
    Box<dyn TargetModel>,
) {
    let t = TinyTarget::qwen3(5);
    t.write(&dir.join("t")).unwrap();
    let tsrc = ModelSource::from_dir("t", &dir.join("t")).unwrap();
    let (cfg, target) = dflash::archs::load_target(&tsrc, &LoadOptions::default()).unwrap();
    (t, cfg, target)
}

/// The pool's target passes run several sequences in one batched forward: each example (taps,
/// and the argmax labels of a relabelled text) equals its sequence's pass alone, whatever the
/// lengths in the batch (to f32 rounding: candle's f32 GEMM may block a 3-row product
/// differently from a 97-row one).
#[test]
fn batched_target_passes_equal_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (t, _, target) = tiny_qwen3(dir.path());
    let taps = [0usize, 2, 3];
    let seqs: Vec<data::Sequence> = [9usize, 40, 17, 3, 28]
        .iter()
        .enumerate()
        .map(|(i, &n)| data::Sequence {
            ids: ids(60 + i as u64, n, t.vocab - 1),
            response_start: n / 3,
        })
        .collect();
    let all: Vec<&data::Sequence> = seqs.iter().collect();
    for labels in [train::Labels::Sequence, train::Labels::Argmax] {
        let batched = train::make_examples_batch(&*target, &taps, &all, labels).unwrap();
        assert_eq!(batched.len(), seqs.len());
        for (s, b) in all.iter().zip(&batched) {
            // each example owns exactly its rows, not a view into the batch's tensor (which
            // would stay allocated as long as any one example of the batch is held)
            let (storage, layout) = b.taps.storage_and_layout();
            let held = match &*storage {
                candle_core::Storage::Cpu(c) => c.as_slice::<f32>().unwrap().len(),
                _ => unreachable!("the test target runs on the CPU"),
            };
            assert_eq!((layout.start_offset(), held), (0, b.taps.elem_count()));
            drop(storage);
            let alone = &train::make_examples_batch(&*target, &taps, &[s], labels).unwrap()[0];
            assert_eq!(b.ids, s.ids);
            assert_eq!(b.response_start, s.response_start);
            assert_eq!(
                b.labels,
                alone.labels,
                "{labels:?} labels, {} tokens",
                s.ids.len()
            );
            let (x, y) = (
                b.taps.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                alone.taps.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(x.len(), s.ids.len() * taps.len() * t.hidden);
            let close = |a: &[f32], b: &[f32]| {
                let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let err = a.iter().zip(b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                assert!(
                    err <= 1e-5 * scale,
                    "{labels:?}, {} tokens: max |diff| {err} of {scale}",
                    s.ids.len()
                );
            };
            close(&x, &y);
            // and the pass is the target's forward
            let want = target_taps(&*target, &s.ids, &taps);
            close(&want.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &y);
        }
        if labels == train::Labels::Argmax {
            // a relabelled text's labels are the target's choices, not the text
            assert!(batched.iter().any(|e| e.labels[1..] != e.ids[1..]));
        }
    }
}

/// Many blocks in one training forward (block-sparse mask) give, block by block, the logits
/// of the inference path (context cache, one block per call): full and sliding layers.
#[test]
fn training_forward_equals_inference_forward() {
    let dir = tempfile::tempdir().unwrap();
    let (t, cfg, target) = tiny_qwen3(dir.path());
    // (sliding layers, DFlash2 convolutions): the convolutions must stay inside each block.
    for (i, (sliding, dflash2)) in [(false, false), (true, false), (false, true), (true, true)]
        .into_iter()
        .enumerate()
    {
        let mut d = TinyDraft::for_target(&t, 3, vec![0, 2, 3], 6, 40 + i as u64);
        if dflash2 {
            d = d.dflash2(3, 8, 8, 4);
            d.is_causal = Some(i == 2);
        }
        if sliding {
            d.layer_types = Some(vec![
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ]);
            d.sliding_window = 4;
        }
        let dd = dir.path().join(format!("d{i}"));
        d.write(&dd, t.vocab).unwrap();
        let draft = load_draft(
            &ModelSource::from_dir("d", &dd).unwrap(),
            &cfg,
            "t",
            &stored(),
        )
        .unwrap();
        let ids = ids(7, 40, t.vocab - 1);
        let taps = target_taps(&*target, &ids, &draft.taps);
        let anchors = [1usize, 9, 10, 23, 33];
        let q = 6;
        let mut block_ids = vec![];
        for &a in &anchors {
            block_ids.push(ids[a]);
            block_ids.extend(std::iter::repeat_n(draft.mask_token_id(), q - 1));
        }
        let train = draft
            .forward_blocks(&*target, &taps, &anchors, &block_ids, None)
            .unwrap();
        let inf = inference_logits(&draft, &*target, &taps, &ids, &anchors, q);
        for (b, l) in inf.iter().enumerate() {
            let tb = train.narrow(0, b * (q - 1), q - 1).unwrap();
            let diff = max_abs_diff(&tb, l);
            assert!(
                diff < 1e-4,
                "sliding={sliding} dflash2={dflash2} block {b}: max |diff| {diff}"
            );
        }
        // Several sequences in one forward (the trainer's packing on a GPU): each segment's
        // rows are the rows it gives alone (its own context, its own positions).
        let ids2: Vec<u32> = ids.iter().rev().take(27).copied().collect();
        let taps2 = target_taps(&*target, &ids2, &draft.taps);
        let segs: [(&Tensor, &[u32], Vec<usize>); 3] = [
            (&taps, &ids, vec![1, 9, 10]),
            (&taps2, &ids2, vec![0, 5, 20]),
            (&taps, &ids, vec![23, 33]),
        ];
        let blocks = |sids: &[u32], anchors: &[usize]| -> Vec<u32> {
            anchors
                .iter()
                .flat_map(|&a| {
                    std::iter::once(sids[a])
                        .chain(std::iter::repeat_n(draft.mask_token_id(), q - 1))
                })
                .collect()
        };
        let all_ids: Vec<u32> = segs.iter().flat_map(|(_, i, a)| blocks(i, a)).collect();
        let joint = draft
            .forward_segments_rows(
                &*target,
                &segs
                    .iter()
                    .map(|(c, _, a)| BlockSegment { ctx: c, anchors: a })
                    .collect::<Vec<_>>(),
                &all_ids,
            )
            .unwrap();
        let mut row = 0;
        for (c, sids, a) in &segs {
            let alone = draft
                .forward_blocks_rows(&*target, c, a, &blocks(sids, a))
                .unwrap();
            let n = alone.dim(0).unwrap();
            let diff = max_abs_diff(&joint.narrow(0, row, n).unwrap(), &alone);
            assert!(
                diff < 1e-5,
                "sliding={sliding} dflash2={dflash2} segment at row {row}: max |diff| {diff}"
            );
            row += n;
        }
        assert_eq!(row, joint.dim(0).unwrap());
    }
}

/// A target whose next token is a function of the current token only: attention and MLP
/// outputs are zeroed, so the residual stream stays the token's embedding.
fn learnable_target(dir: &Path) -> TinyTarget {
    let mut t = TinyTarget::qwen3(21);
    t.layers = 2;
    t.write(dir).unwrap();
    let st = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
    for (n, v) in w.iter_mut() {
        if n.ends_with("o_proj.weight") || n.ends_with("down_proj.weight") {
            *v = v.zeros_like().unwrap();
        }
    }
    candle_core::safetensors::save(&w, &st).unwrap();
    t
}

/// The learnable target in `dir/t`, its plain pipeline, and its greedy answers (24 tokens)
/// to 12 prompts seeded `seed`.
fn learnable_sequences(dir: &Path, seed: u64) -> (TinyTarget, Pipeline, Vec<data::Sequence>) {
    let td = dir.join("t");
    let t = learnable_target(&td);
    let p = plain_pipeline(&td);
    let (seqs, _) = train::build_sequences(
        &p,
        &prompts(seed, 12, t.vocab - 1),
        &SequenceOptions {
            max_seq: 64,
            max_new: 24,
            chat_template: false,
            ..Default::default()
        },
        &mut |_, _| true,
    )
    .unwrap();
    (t, p, seqs)
}

/// An example pool holding every sequence (no budget), each drawn at most once a pass.
fn resident_pool(seqs: &[data::Sequence], tr: &Trainer) -> train::ExamplePool {
    train::ExamplePool::new(
        seqs.to_vec(),
        &tr.taps.clone(),
        DataMode::SelfGenerated.labels(),
        u64::MAX,
        1,
        5,
    )
    .unwrap()
}

/// The target in `dir` loaded without a draft (as `dflash train` loads it).
fn plain_pipeline(dir: &Path) -> Pipeline {
    Pipeline::load(&PipelineOptions {
        model: dir.display().to_string(),
        no_draft: true,
        ..Default::default()
    })
    .unwrap()
}

fn prompts(seed: u64, n: usize, vocab: usize) -> Vec<data::Record> {
    (0..n)
        .map(|i| data::Record {
            prompt: Prompt {
                id: format!("{i}"),
                text: None,
                prompt_ids: Some(ids(seed + i as u64, 3 + i % 7, vocab)),
                earlier: Vec::new(),
            },
            reference: None,
        })
        .collect()
}

/// `self` data generated in groups (one batched target pass a step) is the data generated one
/// prompt at a time, greedy and sampled (record i is seeded seed + i in either grouping), and
/// a group whose prompts finish at different lengths leaves none of them short (continuous
/// admission: the next prompt joins as one finishes).
#[test]
fn grouped_self_generation_equals_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let td = dir.path().join("t");
    let mut t = TinyTarget::qwen3(33);
    t.layers = 2;
    t.write(&td).unwrap();
    let p = plain_pipeline(&td);
    let recs = prompts(77, 10, t.vocab);
    let opts = |temperature: f32, gen_batch: usize| SequenceOptions {
        max_seq: 40,
        max_new: 24,
        temperature,
        seed: 5,
        chat_template: false,
        gen_batch,
        ..Default::default()
    };
    let gen = |temperature: f32, gen_batch: usize| {
        let (seqs, notes) =
            train::build_sequences(&p, &recs, &opts(temperature, gen_batch), &mut |_, _| true)
                .unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        seqs.into_iter()
            .map(|s| (s.ids, s.response_start))
            .collect::<Vec<_>>()
    };
    for temperature in [0.0, 1.0] {
        let alone = gen(temperature, 1);
        assert_eq!(alone.len(), recs.len());
        let mut lens = vec![];
        for (s, r) in alone.iter().zip(&recs) {
            assert_eq!(s.1, r.prompt.prompt_ids.as_ref().unwrap().len());
            lens.push(s.0.len() - s.1);
        }
        eprintln!("T = {temperature}: response lengths {lens:?}");
        assert!(lens.iter().all(|&n| (1..=24).contains(&n)), "{lens:?}");
        lens.dedup();
        assert!(lens.len() > 1, "every response the same length: {lens:?}");
        // (gen_batch in flight, the next admitted as one finishes)
        assert_eq!(gen(temperature, 2), alone, "T = {temperature}, 2 in flight");
        assert_eq!(gen(temperature, 4), alone, "T = {temperature}, 4 in flight");
        assert_eq!(
            gen(temperature, 16),
            alone,
            "T = {temperature}, all at once"
        );
    }
    assert_ne!(gen(0.0, 4), gen(1.0, 4), "sampling changed nothing");
    // three shards (the records 0 mod 3, 1 mod 3, 2 mod 3, each with its whole-run seed)
    // interleaved are the whole run, sampled (T = 1: the seeds matter)
    let shard = |k: usize, n: usize| {
        let o = SequenceOptions {
            shard: (k, n),
            ..opts(1.0, 4)
        };
        train::build_sequences(&p, &recs, &o, &mut |_, _| true).map(|(seqs, _)| {
            seqs.into_iter()
                .map(|s| (s.ids, s.response_start))
                .collect::<Vec<_>>()
        })
    };
    let parts: Vec<_> = (0..3).map(|k| shard(k, 3).unwrap()).collect();
    let mut merged = vec![];
    for i in 0..recs.len() {
        merged.push(parts[i % 3][i / 3].clone());
    }
    assert_eq!(
        merged,
        gen(1.0, 4),
        "three shards interleaved != the whole run"
    );
    let err = shard(3, 3).unwrap_err().to_string();
    assert!(err.contains("--gen-shard"), "{err}");
    // a budget that closes admission after 6 records: the 6 admitted answers come back whole
    // (the ones in flight finish), the rest are not started, and the note says where it stopped
    let alone = gen(1.0, 1);
    let mut asked = vec![];
    let (seqs, notes) = train::build_sequences(&p, &recs, &opts(1.0, 4), &mut |i, n| {
        asked.push((i, n));
        i < 6
    })
    .unwrap();
    let got: Vec<_> = seqs
        .into_iter()
        .map(|s| (s.ids, s.response_start))
        .collect();
    assert_eq!(
        got,
        alone[..6],
        "budgeted answers differ from unbudgeted ones"
    );
    assert_eq!(notes, ["stopped after 6 of 10 records (time budget)"]);
    assert_eq!(
        asked,
        (0..=6)
            .map(|i| (i, 10))
            .chain([(6, 10)])
            .collect::<Vec<_>>()
    );
}

/// (tau, outputs) of greedy DFlash with the draft saved in `dd`, through the normal loader.
fn tau_with(model: &Path, dd: &Path, prompts: &[data::Record], q: usize) -> (f64, Vec<Vec<u32>>) {
    let p = Pipeline::load(&PipelineOptions {
        model: model.display().to_string(),
        draft: Some(dd.display().to_string()),
        ..Default::default()
    })
    .unwrap();
    let (mut lens, mut outs) = (vec![], vec![]);
    for r in prompts {
        let mut req = GenerateRequest::new(r.prompt.prompt_ids.clone().unwrap(), 40);
        req.block_size = Some(q);
        req.adaptive = false;
        let o = p.engine.generate(&req, &mut |_| Flow::Continue).unwrap();
        lens.extend(o.stats.acceptance_lengths);
        outs.push(o.output_ids);
    }
    (lens.iter().sum::<usize>() as f64 / lens.len() as f64, outs)
}

#[test]
fn training_lowers_loss_and_raises_tau() {
    train_and_check(None);
}

/// `--arch dflash2`: the convolutions and the selector train with the draft; the checkpoint
/// loads as a DFlash2 draft and decodes losslessly with a higher tau.
#[test]
fn dflash2_training_lowers_loss_and_raises_tau() {
    train_and_check(Some(dflash::config::draft::Dflash2Config {
        conv_kernel_size: 2,
        conv_group_size: 8,
        selector_rank: 16,
        selector_top_k: 8,
    }));
}

fn train_and_check(dflash2: Option<dflash::config::draft::Dflash2Config>) {
    let dir = tempfile::tempdir().unwrap();
    let td = dir.path().join("t");
    let t = learnable_target(&td);
    let p = plain_pipeline(&td);
    let vocab = t.vocab - 1; // the last id is the mask token
    let (seqs, _) = train::build_sequences(
        &p,
        &prompts(1000, 40, vocab),
        &SequenceOptions {
            mode: DataMode::SelfGenerated,
            max_seq: 96,
            max_new: 48,
            temperature: 0.0,
            seed: 0,
            chat_template: false,
            gen_batch: 8,
            shard: (0, 1),
        },
        &mut |_, _| true,
    )
    .unwrap();
    assert_eq!(seqs.len(), 40);
    let q = 8;
    let opts = TrainOptions {
        draft_layers: 1,
        block_size: q,
        mask_token_id: (t.vocab - 1) as u32,
        intermediate_size: Some(128),
        steps: 300,
        lr: 3e-3,
        warmup: 20,
        batch_blocks: 32,
        blocks_per_seq: 8,
        seed: 3,
        dflash2,
        ..Default::default()
    };
    let target = &*p.engine.target;
    let mut tr = Trainer::new(target, &p.target_config, opts).unwrap();
    // DFlash trains from a window of ~10 of the 40 sequences' passes (the streaming pool),
    // DFlash2 with all of them resident.
    let one = &train::make_examples(
        target,
        &tr.taps.clone(),
        &seqs[..1],
        DataMode::SelfGenerated,
    )
    .unwrap()[0]
        .taps;
    let budget = match dflash2 {
        None => 10 * (one.elem_count() * one.dtype().size_in_bytes()) as u64,
        Some(_) => u64::MAX,
    };
    let reuse = train::ExamplePool::reuse_for(&tr.opts, 300, seqs.len());
    let mut pool = train::ExamplePool::new(
        seqs.clone(),
        &tr.taps.clone(),
        DataMode::SelfGenerated.labels(),
        budget,
        reuse,
        7,
    )
    .unwrap();
    pool.fill(target, &mut |_, _| {}).unwrap();
    let (resident, bytes) = pool.resident();
    let untrained = dir.path().join("untrained");
    tr.save(&untrained, candle_core::DType::F32).unwrap();
    let mut losses = vec![];
    for _ in 0..300 {
        losses.push(tr.step(target, &mut pool).unwrap().loss);
    }
    match dflash2 {
        None => {
            assert!(
                (8..=14).contains(&resident),
                "window {resident} ({bytes} of {budget} bytes)"
            );
            // 300 steps x 4 draws over 40 sequences: each example leaves after `reuse` = 30
            // draws, so the run made ~1200 / 30 passes beyond the first window: every sequence
            // was visited, about once
            assert_eq!(reuse, 30);
            assert!(pool.passes >= 40, "{} passes", pool.passes);
            assert!(pool.passes < 2 * 40, "{} passes", pool.passes);
        }
        Some(_) => {
            assert_eq!(resident, 40);
            assert_eq!(pool.passes, 40, "every pass made once and kept");
        }
    }
    let first: f64 = losses[..10].iter().sum::<f64>() / 10.0;
    let last: f64 = losses[290..].iter().sum::<f64>() / 10.0;
    assert!(last < 0.5 * first, "loss {first:.3} -> {last:.3}");

    // Training forward == inference forward on the trained weights (autograd path vs the
    // fused kernels of a checkpoint loaded from disk, f32).
    let trained = dir.path().join("trained");
    tr.save(&trained, candle_core::DType::F32).unwrap();
    let loaded = load_draft(
        &ModelSource::from_dir("d", &trained).unwrap(),
        &p.target_config,
        "t",
        &stored(),
    )
    .unwrap();
    assert_eq!(
        loaded.arch_name(),
        if dflash2.is_some() {
            "DFlash2"
        } else {
            "DFlash"
        }
    );
    let e = &train::make_examples(
        target,
        &tr.taps.clone(),
        &seqs[3..4],
        DataMode::SelfGenerated,
    )
    .unwrap()[0];
    let anchors = [e.response_start, e.response_start + 5];
    let mut block_ids = vec![];
    for &a in &anchors {
        block_ids.push(e.ids[a]);
        block_ids.extend(std::iter::repeat_n(loaded.mask_token_id(), q - 1));
    }
    let train_logits = tr
        .draft()
        .forward_blocks(target, &e.taps, &anchors, &block_ids, Some(tr.head_t()))
        .unwrap();
    let inf = inference_logits(&loaded, target, &e.taps, &e.ids, &anchors, q);
    for (b, l) in inf.iter().enumerate() {
        let d = max_abs_diff(&train_logits.narrow(0, b * (q - 1), q - 1).unwrap(), l);
        assert!(d < 1e-3, "block {b}: max |diff| {d}");
    }
    drop(tr);

    // Held-out prompts: tau rises; output stays the target's greedy decoding.
    let held = prompts(5000, 8, vocab);
    let (tau0, out0) = tau_with(&td, &untrained, &held, q);
    let (tau1, out1) = tau_with(&td, &trained, &held, q);
    assert_eq!(out0, out1, "greedy output must not depend on the draft");
    let plain = Engine::new(
        dflash::archs::load_target(
            &ModelSource::from_dir("t", &td).unwrap(),
            &LoadOptions::default(),
        )
        .unwrap()
        .1,
        None,
    );
    for (r, o) in held.iter().zip(&out1) {
        let req = GenerateRequest::new(r.prompt.prompt_ids.clone().unwrap(), 40);
        assert_eq!(
            &plain
                .generate(&req, &mut |_| Flow::Continue)
                .unwrap()
                .output_ids,
            o
        );
    }
    eprintln!("loss {first:.3} -> {last:.3}; tau untrained {tau0:.2} -> trained {tau1:.2}");
    assert!(
        tau1 > tau0 + 1.0 && tau1 > 2.5,
        "tau {tau0:.2} -> {tau1:.2}"
    );
}

/// Sequences packed into one draft forward per step (what the trainer does on a GPU) train
/// like one forward per sequence (the CPU's default): the same losses step by step and the
/// same weights after six steps, up to the float order of the sums.
#[test]
fn packed_steps_equal_sequence_by_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let (t, p, seqs) = learnable_sequences(dir.path(), 700);
    let target = &*p.engine.target;
    let run = |pack: usize| {
        let opts = TrainOptions {
            draft_layers: 2,
            block_size: 8,
            mask_token_id: (t.vocab - 1) as u32,
            intermediate_size: Some(64),
            steps: 6,
            lr: 3e-3,
            warmup: 2,
            batch_blocks: 24,
            blocks_per_seq: 4,
            seed: 3,
            pack_scores: Some(pack),
            ..Default::default()
        };
        let mut tr = Trainer::new(target, &p.target_config, opts).unwrap();
        let mut pool = resident_pool(&seqs, &tr);
        pool.fill(target, &mut |_, _| {}).unwrap();
        let losses: Vec<f64> = (0..6)
            .map(|_| tr.step(target, &mut pool).unwrap().loss)
            .collect();
        let d = dir.path().join(format!("pack{pack}"));
        tr.save(&d, candle_core::DType::F32).unwrap();
        let w = candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap();
        (losses, w)
    };
    let (alone, wa) = run(0);
    let (packed, wp) = run(usize::MAX);
    for (i, (a, b)) in alone.iter().zip(&packed).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * a.abs().max(1.0),
            "step {i}: loss {a} alone vs {b} packed"
        );
    }
    assert!(alone[5] < alone[0], "the steps trained: {alone:?}");
    for (n, w) in &wa {
        let d = max_abs_diff(w, &wp[n]);
        assert!(d < 1e-3, "{n}: max |diff| {d} after six steps");
    }
}

/// A 1-layer block-8 draft for the learnable target, trained `steps` steps of 16 blocks (the
/// resume and init-from tests).
fn one_layer_opts(t: &TinyTarget, steps: usize) -> TrainOptions {
    TrainOptions {
        draft_layers: 1,
        block_size: 8,
        mask_token_id: (t.vocab - 1) as u32,
        intermediate_size: Some(64),
        steps,
        lr: 3e-3,
        warmup: 4,
        batch_blocks: 16,
        blocks_per_seq: 8,
        seed: 11,
        ..Default::default()
    }
}

/// A run stopped with a resumable checkpoint and resumed (`Trainer::save_state` /
/// `Trainer::resume`, as `dflash train --chunk-time` / `--resume` do) ends with exactly the
/// weights of the same run uninterrupted, on the checkpoint's schedule whatever the resumed
/// call's flags say; a checkpoint of another draft shape is refused with
/// a one-line error naming the flags.
#[test]
fn resumed_training_equals_uninterrupted() {
    let dir = tempfile::tempdir().unwrap();
    let (t, p, seqs) = learnable_sequences(dir.path(), 500);
    let opts = one_layer_opts(&t, 24);
    let target = &*p.engine.target;
    let run = |tr: &mut Trainer, steps: usize, position: usize| {
        let mut pool = resident_pool(&seqs, tr);
        pool.start_at(position);
        pool.fill(target, &mut |_, _| {}).unwrap();
        for _ in 0..steps {
            tr.step(target, &mut pool).unwrap();
        }
        pool
    };
    let weights = |tr: &Trainer, name: &str| {
        let d = dir.path().join(name);
        tr.save(&d, candle_core::DType::F32).unwrap();
        candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap()
    };
    let mut whole = Trainer::new(target, &p.target_config, opts.clone()).unwrap();
    run(&mut whole, 24, 0);
    let want = weights(&whole, "whole");

    let mut first = Trainer::new(target, &p.target_config, opts.clone()).unwrap();
    let pool = run(&mut first, 10, 0);
    let ckpt = dir.path().join("ckpt");
    first.save_state(&ckpt, &pool).unwrap();
    drop(first);
    // the resumed call's own schedule flags differ (as `--steps`' default does after the
    // first call's `--time-limit` shortened the schedule): the checkpoint's schedule holds
    let mut rest = Trainer::new(
        target,
        &p.target_config,
        TrainOptions {
            steps: 30_000,
            warmup: 300,
            ..opts.clone()
        },
    )
    .unwrap();
    let position = rest.resume(&ckpt).unwrap();
    assert_eq!(rest.steps_done(), 10);
    assert_eq!((rest.opts.steps, rest.opts.warmup), (24, 4));
    run(&mut rest, 14, position);
    let got = weights(&rest, "resumed");
    assert_eq!(want.len(), got.len());
    let mut changed = 0;
    for (n, w) in &want {
        let (a, b) = (w.flatten_all().unwrap(), got[n].flatten_all().unwrap());
        let (a, b) = (a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        assert!(a == b, "{n} differs after resuming");
        changed += usize::from(n.contains("layers"));
    }
    assert!(changed > 0);

    refuses_another_shape(target, &p, opts, |tr| tr.resume(&ckpt).map(drop));
}

/// A draft saved by one run starts another (`dflash train --init-from`, training over several
/// device sessions): the new trainer holds exactly the saved weights (f32; bf16 as rounded),
/// its first steps lower the loss from where the first run ended rather than from scratch,
/// a quantized copy (as models/ keeps drafts) starts from its dequantized weights, and a
/// checkpoint of another draft shape is refused in one line.
#[test]
fn init_from_a_saved_draft_continues_it() {
    let dir = tempfile::tempdir().unwrap();
    let (t, p, seqs) = learnable_sequences(dir.path(), 500);
    let opts = one_layer_opts(&t, 60);
    let target = &*p.engine.target;
    let mut first = Trainer::new(target, &p.target_config, opts.clone()).unwrap();
    let mut pool = resident_pool(&seqs, &first);
    pool.fill(target, &mut |_, _| {}).unwrap();
    let fresh_loss = first.step(target, &mut pool).unwrap().loss;
    let mut last = vec![];
    for _ in 1..60 {
        last.push(first.step(target, &mut pool).unwrap().loss);
    }
    let ended = last[50..].iter().sum::<f64>() / 9.0;
    let saved = dir.path().join("saved");
    first.save(&saved, candle_core::DType::F32).unwrap();
    let saved16 = dir.path().join("saved16");
    first.save(&saved16, candle_core::DType::BF16).unwrap();
    let load = |d: &Path| {
        candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap()
    };

    for (src, dt) in [
        (&saved, candle_core::DType::F32),
        (&saved16, candle_core::DType::BF16),
    ] {
        let mut next = Trainer::new(
            target,
            &p.target_config,
            TrainOptions {
                seed: 12,
                ..opts.clone()
            },
        )
        .unwrap();
        next.init_from(src).unwrap();
        let check = dir.path().join("check");
        next.save(&check, candle_core::DType::F32).unwrap();
        let (want, got) = (load(&saved), load(&check));
        assert_eq!(want.len(), got.len());
        for (n, w) in &want {
            let w = w
                .to_dtype(dt)
                .unwrap()
                .to_dtype(candle_core::DType::F32)
                .unwrap();
            let (a, b) = (
                w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                got[n].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert!(a == b, "{n} differs after init_from ({dt:?})");
        }
        if dt == candle_core::DType::F32 {
            // a fresh optimizer over the trained weights: the loss starts where the first
            // run ended (other draws), not at the untrained draft's
            let mut pool = resident_pool(&seqs, &next);
            pool.fill(target, &mut |_, _| {}).unwrap();
            let l = next.step(target, &mut pool).unwrap().loss;
            assert!(
                l < 1.3 * ended && ended < 0.7 * fresh_loss,
                "first loss {l:.3}; the first run {fresh_loss:.3} -> {ended:.3}"
            );
        }
    }

    let mut other = Trainer::new(
        target,
        &p.target_config,
        TrainOptions {
            draft_layers: 2,
            ..opts.clone()
        },
    )
    .unwrap();
    let e = other.init_from(&saved).unwrap_err().to_string();
    assert!(e.contains("--draft-layers") && !e.contains('\n'), "{e}");
    // an MLX-quantized copy (quantize_draft, as models/ keeps drafts) starts from its weights
    // dequantized: exactly what the writer's dequantization gives, float tensors as saved
    let q = dir.path().join("q");
    std::fs::create_dir_all(&q).unwrap();
    let layout = dflash::source::mlx_write::Layout::new(8, 32);
    let float = load(&saved);
    let (mlx, deq, n) = dflash::source::mlx_write::quantize_checkpoint(&float, &layout).unwrap();
    assert!(
        n > 0,
        "nothing quantized: the fixture's widths are not multiples of 32"
    );
    candle_core::safetensors::save(&mlx, q.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).unwrap()).unwrap();
    cfg[layout.key] = layout.config_entry();
    std::fs::write(q.join("config.json"), cfg.to_string()).unwrap();
    let mut again = Trainer::new(target, &p.target_config, opts.clone()).unwrap();
    again.init_from(&q).unwrap();
    let check = dir.path().join("check-q");
    again.save(&check, candle_core::DType::F32).unwrap();
    let got = load(&check);
    for (name, w) in &float {
        let want = deq.get(name).unwrap_or(w);
        let (a, b) = (
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            got[name].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert!(a == b, "{name} differs after init_from a quantized draft");
    }
    // ... and so does a narrowed copy of it (draft::narrow, as models/ keeps the demo
    // draft): its head of its own and d2t are left out, the body is the same
    let nq = dir.path().join("nq");
    let tsrc = dflash::source::ModelSource::from_dir("t", &dir.path().join("t")).unwrap();
    let vocab = p.target_config.vocab_size;
    let counts = dflash::draft::narrow::response_counts(&seqs, vocab).0;
    let ids = dflash::draft::narrow::most_frequent(&counts, 4);
    dflash::draft::narrow::narrow_checkpoint(&q, &tsrc, &ids, &nq).unwrap();
    let mut narrowed = Trainer::new(target, &p.target_config, opts.clone()).unwrap();
    narrowed.init_from(&nq).unwrap();
    let check = dir.path().join("check-nq");
    narrowed.save(&check, candle_core::DType::F32).unwrap();
    let from_narrowed = load(&check);
    assert_eq!(from_narrowed.len(), got.len());
    for (name, w) in &got {
        let (a, b) = (
            w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            from_narrowed[name]
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
        );
        assert!(a == b, "{name} differs after init_from a narrowed draft");
    }
    // ... and one of another shape is still refused in one line
    refuses_another_shape(target, &p, opts, |tr| tr.init_from(&q));
}

/// A trainer of another draft shape (2 layers, not `opts`' 1) refuses what `load` reads, in
/// one line naming the flag.
fn refuses_another_shape(
    target: &dyn TargetModel,
    p: &Pipeline,
    opts: TrainOptions,
    load: impl FnOnce(&mut Trainer) -> dflash::Result<()>,
) {
    let mut other = Trainer::new(
        target,
        &p.target_config,
        TrainOptions {
            draft_layers: 2,
            ..opts
        },
    )
    .unwrap();
    let e = load(&mut other).unwrap_err().to_string();
    assert!(e.contains("--draft-layers") && !e.contains('\n'), "{e}");
}

/// The evaluation split (tools/train/eval_split.py): the held files are the first 40 records of
/// the HumanEval and MT-Bench sets (what `bench --limit N <= 40` reads), and no training record
/// of the `-rest` files asks what a held record asks (the trainer's exclusion key: the first
/// user turn), while each set's rest is the remainder, 16 times.
#[test]
fn eval_split_keeps_held_prompts_out_of_training_files() {
    use dflash::train::data::read_records;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = |r: &dflash::train::data::Record| r.prompt.text.clone().expect("a text prompt");
    for (full, held, rest) in [
        (
            "HumanEval.jsonl.gz",
            "humaneval-held.jsonl.gz",
            "humaneval-rest.jsonl.gz",
        ),
        (
            "mt_bench_question.jsonl.gz",
            "mtbench-held.jsonl.gz",
            "mtbench-rest.jsonl.gz",
        ),
    ] {
        let all = read_records(&root.join("data/eval").join(full), usize::MAX).unwrap();
        let held = read_records(&root.join("data/eval").join(held), usize::MAX).unwrap();
        let rest = read_records(&root.join("data/train").join(rest), usize::MAX).unwrap();
        assert_eq!(held.len(), 40, "{full}");
        let first: Vec<String> = all[..40].iter().map(text).collect();
        assert_eq!(held.iter().map(text).collect::<Vec<_>>(), first, "{full}");
        let held: std::collections::HashSet<String> = first.into_iter().collect();
        assert_eq!(rest.len(), (all.len() - 40) * 16, "{full}");
        assert!(
            rest.iter().all(|r| !held.contains(&text(r))),
            "{full}: a held prompt in the rest"
        );
        let distinct: std::collections::HashSet<String> = rest.iter().map(text).collect();
        assert_eq!(distinct.len(), all.len() - 40, "{full}");
    }
}

/// `synth_prompts` samples user turns from the target at its chat template's user slot: a
/// scripted bigram target (after `>` or `:` it writes `Hi?` and ends the turn) through the real
/// loader, byte-level tokenizer and template. Each steer starts its turns; repeated and
/// unfinished turns are dropped and counted; a model without a template is a clear error.
#[test]
fn synth_prompts_sample_user_turns_at_the_template() {
    let dir = tempfile::tempdir().unwrap();
    let td = dir.path().join("t");
    dflash::testing::write_turn_target(&td, b">:", "Hi?").unwrap();
    let p = plain_pipeline(&td);
    let synth = |steers: &[&str], max_new| {
        let o = train::SynthOptions {
            count: 4,
            steers: steers.iter().map(|s| s.to_string()).collect(),
            max_new,
            temperature: 0.0,
            seed: 0,
            gen_batch: 2,
        };
        let mut calls = vec![];
        let r = train::synth_prompts(&p, &o, &mut |done, n| {
            calls.push((done, n));
            true
        });
        (r, calls)
    };
    let (r, calls) = synth(&["", "Q:"], 8);
    let (records, notes) = r.unwrap();
    let turns: Vec<(&str, &str)> = records
        .iter()
        .map(|r| (r.prompt.id.as_str(), r.prompt.text.as_deref().unwrap()))
        .collect();
    assert_eq!(turns, [("synth-0", "Hi?"), ("synth-1", "Q:Hi?")]);
    assert!(
        notes[0].contains("2 user turns")
            && notes[0].contains("0 unfinished")
            && notes[0].contains("2 empty or repeated"),
        "{notes:?}"
    );
    // before each turn is admitted, then the final report
    assert_eq!(calls, [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]);
    // the turn does not end within 2 tokens: every one is unfinished
    let (r, _) = synth(&[], 2);
    let (records, notes) = r.unwrap();
    assert!(records.is_empty(), "{records:?}");
    assert!(
        notes[0].contains("4 unfinished after 2 tokens"),
        "{notes:?}"
    );
    // no tokenizer, no template: a one-line error naming the flag
    let plain = dir.path().join("plain");
    TinyTarget::qwen3(5).write(&plain).unwrap();
    let o = train::SynthOptions {
        count: 1,
        steers: vec![],
        max_new: 4,
        temperature: 1.0,
        seed: 0,
        gen_batch: 1,
    };
    let e = train::synth_prompts(&plain_pipeline(&plain), &o, &mut |_, _| true).unwrap_err();
    assert!(
        e.to_string()
            .contains("--synth-prompts needs the model's tokenizer"),
        "{e}"
    );
}

/// A pool told to hold fewer taps (`ExamplePool::shrink`, as `dflash train` does when a step
/// runs out of device memory) lets the examples loaded last go and then runs exactly as a pool
/// filled to that budget from the start: the same examples held after every step, the same
/// losses. One example always stays.
#[test]
fn a_shrunk_pool_runs_as_one_filled_to_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (t, p, seqs) = learnable_sequences(dir.path(), 3);
    let target = &*p.engine.target;
    let trainer = || Trainer::new(target, &p.target_config, one_layer_opts(&t, 20)).unwrap();
    let ids = |pool: &train::ExamplePool| -> Vec<Vec<u32>> {
        pool.resident_ids().iter().map(|s| s.to_vec()).collect()
    };
    // every sequence resident, then half the bytes
    let (mut ta, mut tb) = (trainer(), trainer());
    let mut a = resident_pool(&seqs, &ta);
    a.fill(target, &mut |_, _| {}).unwrap();
    let n = a.len();
    let (all, bytes) = a.resident();
    assert_eq!(all, n);
    let before = ids(&a);
    let left = a.shrink(bytes / 2).unwrap();
    let (now, now_bytes) = a.resident();
    assert!(
        left >= 1 && now + left == n,
        "{left} left, {now} of {n} kept"
    );
    assert!(now_bytes <= bytes / 2, "{now_bytes} of {bytes} bytes held");
    assert_eq!(ids(&a), before[..now], "the first loaded stay");
    // the same pool filled to what the shrunk one holds
    let mut b = train::ExamplePool::new(
        seqs.to_vec(),
        &tb.taps.clone(),
        DataMode::SelfGenerated.labels(),
        now_bytes,
        1,
        5,
    )
    .unwrap();
    b.fill(target, &mut |_, _| {}).unwrap();
    assert_eq!(ids(&b), ids(&a));
    for step in 0..8 {
        let (la, lb) = (
            ta.step(target, &mut a).unwrap().loss,
            tb.step(target, &mut b).unwrap().loss,
        );
        assert_eq!(ids(&a), ids(&b), "step {step}: the examples held");
        assert!((la - lb).abs() < 1e-5, "step {step}: loss {la} vs {lb}");
    }
    // down to one example, then no more
    while a.shrink(0).is_some() {}
    assert_eq!(a.resident().0, 1);
    assert!(a.shrink(0).is_none());
    ta.step(target, &mut a).unwrap();
}
