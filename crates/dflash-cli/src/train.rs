//! `dflash train`: train a DFlash draft for a target on the engine's own code (see
//! `dflash::train`), save it in the z-lab format, and optionally measure its tau on held-out
//! prompts with the normal loader and engine.

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash::engine::{Flow, GenerateRequest};
use dflash::pipeline::{Pipeline, PipelineOptions};
use dflash::train::{self, data, DataMode, SequenceOptions, TrainOptions, Trainer};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Target model: a local directory, a .gguf file or a hub repo id. Default: the demo model.
    #[arg(long)]
    pub target: Option<String>,
    /// Prompt files (.jsonl, .jsonl.gz, .json array; HumanEval `prompt`, MT-Bench `turns`,
    /// ShareGPT `conversations`) or dataset names (sharegpt, humaneval, mtbench).
    #[arg(long, num_args = 1.., required_unless_present_any = ["sequences", "synth_prompts"])]
    pub prompts: Vec<String>,
    /// `self`: also sample this many user turns from the target itself (the chat template up
    /// to the user's text is the prompt: what the model expects users to ask), after the
    /// --prompts records, and answer them like those: prompts in any number, from the model's
    /// own distribution. Unfinished and repeated turns are dropped.
    #[arg(long, default_value_t = 0)]
    pub synth_prompts: usize,
    /// Text the sampled user turns start with, cycled over them (repeat the flag for several),
    /// e.g. "Write a Python function" for code questions.
    #[arg(long)]
    pub synth_steer: Vec<String>,
    /// Longest sampled user turn, tokens (the demo model ends ~75% of its turns within 128).
    #[arg(long, default_value_t = 128)]
    pub synth_max_new: usize,
    /// Temperature of the sampled user turns.
    #[arg(long, default_value_t = 0.8)]
    pub synth_temperature: f32,
    /// Seed of the sampled user turns (turn i: this + i); default --seed + 2^32, apart from
    /// the answers' seeds.
    #[arg(long)]
    pub synth_seed: Option<u64>,
    /// Prompt files or dataset names never to train on: records whose first user turn equals
    /// one of theirs are dropped before generation (the `--eval-prompts` are always
    /// excluded too). Counted in OUT/manifest.json.
    #[arg(long, num_args = 1..)]
    pub exclude_prompts: Vec<String>,
    /// Reuse sequences written by earlier runs (DIR/sequences.jsonl; several files are joined,
    /// e.g. greedy and sampled responses) instead of --prompts.
    #[arg(long, num_args = 1..)]
    pub sequences: Vec<PathBuf>,
    /// Stop once the sequences are written (OUT/sequences.jsonl): make the data in one run
    /// (or device call) and train on it in others with --sequences.
    #[arg(long)]
    pub data_only: bool,
    /// Output directory (config.json + model.safetensors, sequences.jsonl, train_log.jsonl).
    #[arg(long)]
    pub out: PathBuf,
    /// Draft architecture: dflash (DFlashDraftModel) | dflash2 (DFlash2DraftModel:
    /// convolutions around attention and the MLP, and a candidate selector).
    #[arg(long, default_value = "dflash", value_parser = ["dflash", "dflash2"])]
    pub arch: String,
    /// dflash2: taps of each convolution over the block rows.
    #[arg(long, default_value_t = 2)]
    pub conv_kernel: usize,
    /// dflash2: channels sharing one dynamic kernel value (divides the hidden size).
    #[arg(long, default_value_t = 16)]
    pub conv_group: usize,
    /// dflash2: width of the selector's codebooks (two [vocab, rank] tables).
    #[arg(long, default_value_t = 256)]
    pub selector_rank: usize,
    /// dflash2: candidates per block row.
    #[arg(long, default_value_t = 16)]
    pub selector_top_k: usize,
    /// dflash2: weight of the selector's loss.
    #[arg(long, default_value_t = 1.0)]
    pub selector_loss_alpha: f64,
    /// Sequences of a step share one draft forward while a layer's attention scores stay
    /// within this many elements (default: 2^28 on CUDA, 0 = one forward per sequence, on the
    /// CPU). Same loss either way; for A/B runs of the step time.
    #[arg(long)]
    pub pack_scores: Option<usize>,
    /// Keep f32 matmuls on CUDA exact. By default this run's f32 matmuls (the draft's, and the
    /// target's if loaded with `--dtype f32`) use TF32 tensor cores: 10-bit mantissa
    /// products, f32 sums, the usual setting for training. No effect on the CPU.
    #[arg(long)]
    pub exact_f32: bool,
    #[arg(long, default_value_t = 1)]
    pub draft_layers: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// `auto` (5 layers spread over the target) or comma-separated 0-based layer ids.
    #[arg(long, default_value = "auto")]
    pub taps: String,
    /// Mask token id; `auto`: a spare special token of the tokenizer, else the last id.
    #[arg(long, default_value = "auto")]
    pub mask_token: String,
    /// Draft MLP width (default: the target's intermediate size).
    #[arg(long)]
    pub intermediate_size: Option<usize>,
    #[arg(long, default_value_t = 1000)]
    pub steps: usize,
    #[arg(long, default_value_t = 6e-4)]
    pub lr: f64,
    #[arg(long, default_value_t = 50)]
    pub warmup: usize,
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    /// Global gradient-norm clip (0 = off).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// Loss decay over block rows (default 7 * block_size / 16).
    #[arg(long)]
    pub gamma: Option<f64>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// self (the target's own responses, generated) | relabel (reference responses, labels =
    /// the target's argmax; one forward per sequence, no generation).
    #[arg(long, default_value = "self", value_parser = ["self", "relabel"])]
    pub data: String,
    /// Prompts read per file.
    #[arg(long, default_value_t = 200)]
    pub max_prompts: usize,
    /// `self`: tokens generated per prompt.
    #[arg(long, default_value_t = 256)]
    pub max_new: usize,
    /// `self`: sampling temperature for the responses (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// `self`: responses generated together, one target pass a step for the group (each the
    /// same as alone).
    #[arg(long, default_value_t = 16)]
    pub gen_batch: usize,
    /// Also write OUT/narrow-K: the trained draft with a head of its own over the K target
    /// tokens most frequent in the training responses (`dflash::draft::narrow`; it proposes
    /// only those, and its head costs K / vocab of the full one). 0: not.
    #[arg(long, default_value_t = 0)]
    pub draft_vocab: usize,
    /// `K/N`: answer only the prompts whose index (after --exclude-prompts) is K modulo N,
    /// each with the seed it has in the whole run: N processes, K = 0..N-1, make the whole
    /// run's sequences between them (a host-bound generation step runs N at once on one GPU).
    #[arg(long, value_parser = parse_shard)]
    pub gen_shard: Option<(usize, usize)>,
    /// Longest training sequence (prompt + response), tokens.
    #[arg(long, default_value_t = 1024)]
    pub max_seq: usize,
    /// Blocks per optimizer step.
    #[arg(long, default_value_t = 64)]
    pub batch_blocks: usize,
    /// Blocks drawn from one sequence per forward.
    #[arg(long, default_value_t = 16)]
    pub blocks_per_seq: usize,
    /// How the target loads (its compute dtype: f32 on CPU, bf16 on CUDA; the draft trains in
    /// f32).
    #[command(flatten)]
    pub load: crate::flags::LoadFlags,
    /// Dtype of the saved weights: bf16 | f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    pub save_dtype: String,
    /// Format prompts without the chat template.
    #[arg(long)]
    pub no_chat_template: bool,
    /// Device memory for the target passes (taps) of the training sequences, GB: when they
    /// do not all fit, a window of them streams through (each pass made once a visit).
    #[arg(long, default_value_t = 8.0)]
    pub example_budget_gb: f64,
    /// Stop generating `self` responses after this many seconds (keep what was generated).
    #[arg(long)]
    pub data_time_limit: Option<f64>,
    /// Training time budget in seconds, counted from when the data is ready (so the target
    /// passes that fill the example pool count): after 20 steps the step count is cut to what
    /// fits (the cosine schedule follows the new count; the cut is saved with a resumable
    /// checkpoint, and a --resume'd call's own limit can only cut it further).
    #[arg(long)]
    pub time_limit: Option<f64>,
    /// Stop after this many seconds (counted as --time-limit is) with a resumable checkpoint
    /// (the schedule stays; continue with --resume OUT). Unlike --time-limit, which shortens
    /// the schedule to fit.
    #[arg(long)]
    pub chunk_time: Option<f64>,
    /// Continue a run from the resumable checkpoint in DIR (its parameters, optimizer moments,
    /// step, schedule and sampler state); the draft's flags must be the ones it was trained with.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start from the weights of a draft `dflash train` saved in DIR (config.json +
    /// model.safetensors, e.g. an earlier device session's returned draft, bf16, f32 or
    /// MLX-quantized (dequantized, as models/ keeps drafts); same draft flags),
    /// with a fresh optimizer and schedule: training over several sessions whose optimizer
    /// state (--resume) stays behind on the machine.
    #[arg(long, conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    /// Also write the resumable checkpoint (DIR/resume.safetensors + resume.json: f32
    /// parameters and optimizer moments, ~12 bytes a parameter) with every save (implied by
    /// --chunk-time and --resume).
    #[arg(long)]
    pub save_state: bool,
    /// Save a checkpoint every N steps (0 = only at the end).
    #[arg(long, default_value_t = 500)]
    pub save_every: usize,
    /// Log every N steps.
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,
    /// After training, load the saved draft and measure tau (greedy) on these prompts.
    #[arg(long, num_args = 1..)]
    pub eval_prompts: Vec<String>,
    /// Held-out prompts evaluated per --eval-prompts file.
    #[arg(long, default_value_t = 10)]
    pub eval_n: usize,
    /// Tokens generated per evaluation prompt.
    #[arg(long, default_value_t = 128)]
    pub eval_max_tokens: usize,
}

/// `--gen-shard K/N`: 0 <= K < N.
fn parse_shard(s: &str) -> std::result::Result<(usize, usize), String> {
    let bad = || format!("{s}: expected K/N with 0 <= K < N (e.g. 0/4)");
    let (k, n) = s.split_once('/').ok_or_else(bad)?;
    let (k, n) = (
        k.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    );
    if k >= n {
        return Err(bad());
    }
    Ok((k, n))
}

fn bar(n: usize, what: &str) -> ProgressBar {
    let b = ProgressBar::new(n as u64);
    b.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta}")
            .expect("template")
            .progress_chars("=> "),
    );
    b.set_message(what.to_string());
    b
}

pub fn run(a: TrainArgs) -> Result<()> {
    if a.block_size < 2 {
        bail!("--block-size must be at least 2");
    }
    if a.draft_layers == 0 {
        bail!("--draft-layers must be at least 1");
    }
    let model = dflash::pipeline::resolve_model_spec(a.target.as_deref())?;
    let p = Pipeline::load(&a.load.apply(PipelineOptions {
        model: model.clone(),
        no_draft: true,
        ..Default::default()
    })?)?;
    for n in &p.notices {
        eprintln!("{n}");
    }
    let vocab = p.target_config.vocab_size;
    if a.draft_vocab >= vocab {
        bail!(
            "--draft-vocab {}: want fewer than the target's {vocab} tokens (0: no narrowed copy)",
            a.draft_vocab
        );
    }
    let mask_token_id = match a.mask_token.as_str() {
        "auto" => {
            let spare = [
                "<|mask|>",
                "<mask>",
                "<|MASK|>",
                "<|fim_pad|>",
                "<gh_stars>",
            ];
            let t = p.tokenizer.as_ref();
            spare
                .iter()
                .find_map(|s| t.and_then(|t| t.token_to_id(s)))
                .unwrap_or(vocab as u32 - 1)
        }
        s => s
            .parse()
            .with_context(|| format!("--mask-token {s}: expected auto or an id"))?,
    };
    let taps = match a.taps.as_str() {
        "auto" => None,
        s => Some(
            s.split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .with_context(|| {
                    format!("--taps {s}: expected auto or comma-separated layer ids")
                })?,
        ),
    };
    let mode = DataMode::parse(&a.data)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;

    // 1. Sequences: generated (self) or reference (relabel), or reused.
    let seqs = match a.sequences.as_slice() {
        [] => {
            let t0 = std::time::Instant::now();
            let mut records = vec![];
            for spec in &a.prompts {
                let f = data::resolve_file(spec)?;
                records.extend(data::read_records(&f, a.max_prompts)?);
            }
            let mut synth_notes = vec![];
            // turn i of --synth-prompts is sampled with seed synth_seed + i
            let synth_seed = a.synth_seed.unwrap_or(a.seed.wrapping_add(1 << 32));
            if a.synth_prompts > 0 {
                if mode != DataMode::SelfGenerated {
                    bail!(
                        "--synth-prompts makes prompts without reference answers: use --data self"
                    );
                }
                let b = bar(a.synth_prompts, "sampling user turns");
                let (turns, notes) = train::synth_prompts(
                    &p,
                    &train::SynthOptions {
                        count: a.synth_prompts,
                        steers: a.synth_steer.clone(),
                        max_new: a.synth_max_new,
                        temperature: a.synth_temperature,
                        seed: synth_seed,
                        gen_batch: a.gen_batch,
                    },
                    &mut |i, _| {
                        b.set_position(i as u64);
                        true
                    },
                )?;
                b.finish();
                for n in &notes {
                    eprintln!("{n}");
                }
                // the turns as a prompt file: to read, and to answer again (--prompts)
                let f = a.out.join("synth_prompts.jsonl");
                let lines: String = turns
                    .iter()
                    .map(|r| {
                        serde_json::json!({"id": r.prompt.id, "prompt": r.prompt.text}).to_string()
                            + "\n"
                    })
                    .collect();
                std::fs::write(&f, lines).with_context(|| format!("writing {}", f.display()))?;
                records.extend(turns);
                synth_notes = notes;
            }
            // the evaluation prompts are never trained on (same turn to answer, or same ids)
            let key = |r: &data::Record| match (&r.prompt.text, &r.prompt.prompt_ids) {
                (Some(t), _) => Some(t.trim().to_string()),
                (None, Some(ids)) => Some(format!("{ids:?}")),
                (None, None) => None,
            };
            let mut held = std::collections::HashSet::new();
            for spec in a.exclude_prompts.iter().chain(&a.eval_prompts) {
                let f = data::resolve_file(spec)?;
                held.extend(data::read_records(&f, usize::MAX)?.iter().filter_map(key));
            }
            let before = records.len();
            records.retain(|r| key(r).is_none_or(|k| !held.contains(&k)));
            let excluded = before - records.len();
            if excluded > 0 {
                eprintln!("{excluded} prompts excluded (--exclude-prompts / --eval-prompts)");
            }
            let b = bar(
                records.len(),
                if mode == DataMode::SelfGenerated {
                    "generating responses"
                } else {
                    "encoding references"
                },
            );
            let (seqs, notes) = train::build_sequences(
                &p,
                &records,
                &SequenceOptions {
                    mode,
                    max_seq: a.max_seq,
                    max_new: a.max_new,
                    temperature: a.temperature,
                    seed: a.seed,
                    chat_template: !a.no_chat_template,
                    gen_batch: a.gen_batch,
                    shard: a.gen_shard.unwrap_or((0, 1)),
                },
                &mut |i, _| {
                    b.set_position(i as u64);
                    a.data_time_limit
                        .is_none_or(|l| b.elapsed().as_secs_f64() < l)
                },
            )?;
            b.finish();
            for n in &notes {
                eprintln!("{n}");
            }
            let notes: Vec<String> = synth_notes.into_iter().chain(notes).collect();
            let f = a.out.join("sequences.jsonl");
            data::write_sequences(&f, &seqs)?;
            let tokens: usize = seqs.iter().map(|s| s.ids.len()).sum();
            let response: usize = seqs.iter().map(|s| s.ids.len() - s.response_start).sum();
            eprintln!(
                "{} sequences ({tokens} tokens, {response} of them responses) -> {}",
                seqs.len(),
                f.display()
            );
            // what made them, for whoever trains on them later
            let manifest = serde_json::json!({
                "sequences_file": "sequences.jsonl",
                "format": "one JSON object a line: ids (prompt + response token ids), response_start",
                "target": p.model_name,
                "data": a.data,
                "prompt_files": a.prompts,
                "synth_prompts": (a.synth_prompts > 0).then(|| serde_json::json!({
                    "asked": a.synth_prompts, "steers": a.synth_steer, "max_new": a.synth_max_new,
                    "temperature": a.synth_temperature,
                    "seed": synth_seed,
                })),
                "records_read": before,
                "excluded_prompts": {"files": a.exclude_prompts.iter().chain(&a.eval_prompts).collect::<Vec<_>>(), "records": excluded},
                "temperature": a.temperature,
                "seed": a.seed,
                "max_new": a.max_new,
                "max_seq": a.max_seq,
                "gen_batch": a.gen_batch,
                "gen_shard": a.gen_shard.map(|(k, n)| format!("{k}/{n}")),
                "chat_template": !a.no_chat_template,
                "sequences": seqs.len(),
                "tokens": tokens,
                "response_tokens": response,
                "notes": notes,
                "seconds": t0.elapsed().as_secs_f64(),
                "dflash": env!("CARGO_PKG_VERSION"),
            });
            std::fs::write(
                a.out.join("manifest.json"),
                serde_json::to_string_pretty(&manifest)? + "\n",
            )?;
            seqs
        }
        files => {
            let mut seqs = vec![];
            for f in files {
                seqs.extend(data::read_sequences(f)?);
            }
            seqs
        }
    };
    if seqs.is_empty() {
        bail!("no training sequences (see the notes above)");
    }
    if a.data_only {
        eprintln!("--data-only: done");
        return Ok(());
    }

    // 2. The draft and the target passes (taps + labels), cached on the device.
    let opts = TrainOptions {
        draft_layers: a.draft_layers,
        block_size: a.block_size,
        taps,
        mask_token_id,
        intermediate_size: a.intermediate_size,
        steps: a.steps,
        lr: a.lr,
        warmup: a.warmup.min(a.steps / 2),
        weight_decay: a.weight_decay,
        clip: a.clip,
        gamma: a.gamma,
        seed: a.seed,
        batch_blocks: a.batch_blocks,
        blocks_per_seq: a.blocks_per_seq,
        dflash2: (a.arch == "dflash2").then_some(dflash::config::draft::Dflash2Config {
            conv_kernel_size: a.conv_kernel,
            conv_group_size: a.conv_group,
            selector_rank: a.selector_rank,
            selector_top_k: a.selector_top_k,
        }),
        selector_loss_alpha: a.selector_loss_alpha,
        pack_scores: a.pack_scores,
        ..Default::default()
    };
    let target = &*p.engine.target;
    let mut trainer = Trainer::new(target, &p.target_config, opts.clone())?;
    let keep_state = a.save_state || a.chunk_time.is_some() || a.resume.is_some();
    let mut pool_position = 0;
    if let Some(dir) = &a.init_from {
        trainer.init_from(dir)?;
        eprintln!("started from the weights of {}", dir.display());
    }
    if let Some(dir) = &a.resume {
        pool_position = trainer.resume(dir)?;
        eprintln!(
            "resumed {} at step {} of {}",
            dir.display(),
            trainer.steps_done(),
            trainer.opts.steps
        );
    }
    let tf32 = target.info().device.is_cuda() && !a.exact_f32;
    candle_core::cuda::set_gemm_reduced_precision_f32(tf32);
    eprintln!(
        "draft: {} {} layers, {} params, taps {:?}, block {}, mask token {mask_token_id}, gamma {:.2}, data {}, f32 matmuls {}",
        trainer.draft().arch_name(),
        a.draft_layers,
        trainer.num_params(),
        trainer.taps,
        a.block_size,
        opts.gamma(),
        a.data,
        if tf32 { "tf32" } else { "exact" }
    );
    // --time-limit and --chunk-time count from here: the pool's target passes take their
    // share of a device call too (tens of thousands of sequences: minutes).
    let ready = Instant::now();
    // Hold out ~5% of sequences (at least 1 when there are 20+) for a loss check.
    // --draft-vocab: token counts over every sequence's response (before the held-out split)
    let narrow_counts =
        (a.draft_vocab > 0).then(|| dflash::draft::narrow::response_counts(&seqs, vocab));
    let n_hold = if seqs.len() >= 20 { seqs.len() / 20 } else { 0 };
    let mut seqs = seqs;
    let train_seqs = seqs.split_off(n_hold);
    let held = train::make_examples(target, &trainer.taps.clone(), &seqs, mode)?;
    // (a resumed run draws over its remaining steps, its window from where the last one was)
    let left = trainer.opts.steps.saturating_sub(trainer.steps_done());
    let reuse = train::ExamplePool::reuse_for(&trainer.opts, left, train_seqs.len());
    let mut pool = train::ExamplePool::new(
        train_seqs,
        &trainer.taps.clone(),
        mode.labels(),
        (a.example_budget_gb * 1e9) as u64,
        reuse,
        a.seed,
    )?;
    pool.start_at(pool_position);
    let b = bar(pool.len(), "target passes (taps, labels)");
    pool.fill(target, &mut |i, _| b.set_position(i as u64))?;
    b.finish();
    let (resident, bytes) = pool.resident();
    if resident < pool.len() {
        eprintln!(
            "{resident} of {} sequences' passes fit --example-budget-gb {} ({:.2} GB): the rest stream through",
            pool.len(),
            a.example_budget_gb,
            bytes as f64 / 1e9
        );
    }

    // 3. Optimize.
    let log_path = a.out.join("train_log.jsonl");
    // a resumed run continues its log
    let mut log = match &a.resume {
        Some(dir) => std::fs::read_to_string(dir.join("train_log.jsonl")).unwrap_or_default(),
        None => String::new(),
    };
    let t0 = Instant::now();
    let (mut tok_window, mut t_window) = (0usize, Instant::now());
    let mut first_loss = None;
    let mut last = None;
    let save = if a.save_dtype == "f32" {
        candle_core::DType::F32
    } else {
        candle_core::DType::BF16
    };
    let start = trainer.steps_done();
    let mut step = start;
    // the step of the newest checkpoint in OUT (for an out-of-memory error to name)
    let mut saved_at = a.resume.is_some().then_some(start);
    // device memory free as the driver reports it, logged with the loss on CUDA (a run that
    // grows toward an out-of-memory error shows it falling)
    let device = target.info().device.clone();
    let free_gb = || {
        device
            .is_cuda()
            .then(|| dflash::memory::available(&device))
            .flatten()
            .map(|m| m.bytes as f64 / 1e9)
    };
    let mut chunk_end = None;
    while step < trainer.opts.steps {
        if a.chunk_time
            .is_some_and(|c| ready.elapsed().as_secs_f64() >= c)
        {
            chunk_end = Some(step);
            break;
        }
        let s = match trainer.step(target, &mut pool) {
            Ok(s) => s,
            Err(e) if !e.is_out_of_memory() => return Err(e.into()),
            Err(_) => {
                // The taps held leave the step too little memory: hold a quarter fewer (those
                // that leave stream through instead) and try the step again, until one
                // example is left. (An error in the optimizer's update, after the backward,
                // may leave part of the parameters updated once more.)
                let (resident, bytes) = pool.resident();
                if let Some(left) = pool.shrink(bytes / 4 * 3) {
                    let (now, now_bytes) = pool.resident();
                    eprintln!(
                        "training step {}: the device ran out of memory with {resident} sequences' taps held ({:.1} GB); holding {now} ({:.1} GB, {left} fewer: they stream through) and trying the step again",
                        step + 1,
                        bytes as f64 / 1e9,
                        now_bytes as f64 / 1e9
                    );
                    continue;
                }
                bail!(
                    "training step {}: the device ran out of memory ({resident} sequences' taps, {:.1} GB, held by --example-budget-gb {}; {} blocks a step): lower --batch-blocks; {}",
                    step + 1,
                    bytes as f64 / 1e9,
                    a.example_budget_gb,
                    a.batch_blocks,
                    match saved_at {
                        Some(k) if keep_state => format!(
                            "the checkpoint of step {k} resumes with --resume {}",
                            a.out.display()
                        ),
                        Some(k) => format!("the draft of step {k} is in {}", a.out.display()),
                        None => "no checkpoint was saved yet (--save-every)".to_string(),
                    }
                )
            }
        };
        step += 1;
        if let (Some(limit), 20) = (a.time_limit, step - start) {
            let per = t0.elapsed().as_secs_f64() / 20.0;
            let left = limit - ready.elapsed().as_secs_f64();
            let fit = start + 20 + (left.max(0.0) / per) as usize;
            if fit < trainer.opts.steps {
                trainer.opts.steps = fit.max(start + 21);
                trainer.opts.warmup = trainer.opts.warmup.min(trainer.opts.steps / 2);
                pool.set_reuse(train::ExamplePool::reuse_for(
                    &trainer.opts,
                    trainer.opts.steps - start,
                    pool.len(),
                ));
                eprintln!(
                    "{per:.3}s/step: --time-limit {limit}s fits {} steps; schedule shortened",
                    trainer.opts.steps
                );
            }
        }
        let step = step - 1;
        let steps = trainer.opts.steps;
        first_loss.get_or_insert(s.loss);
        tok_window += s.tokens;
        if (step + 1) % a.log_every.max(1) == 0 || step + 1 == steps {
            let dt = t_window.elapsed().as_secs_f64();
            let free = free_gb();
            let line = format!(
                "step {:>5}/{} loss {:.4} acc1 {:.3} lr {:.2e} |g| {:.3} {:.0} tok/s {:.0}s{}",
                step + 1,
                steps,
                s.loss,
                s.acc1,
                s.lr,
                s.grad_norm,
                tok_window as f64 / dt.max(1e-9),
                t0.elapsed().as_secs_f64(),
                free.map(|g| format!(" free {g:.1} GB")).unwrap_or_default()
            );
            eprintln!("{line}");
            let mut entry = serde_json::json!({"step": step + 1, "loss": s.loss, "acc1": s.acc1,
                "lr": s.lr, "grad_norm": s.grad_norm, "elapsed_s": t0.elapsed().as_secs_f64()});
            if let Some(g) = free {
                entry["device_free_gb"] = serde_json::json!(g);
            }
            log.push_str(&entry.to_string());
            log.push('\n');
            tok_window = 0;
            t_window = Instant::now();
        }
        last = Some(s);
        if a.save_every > 0 && (step + 1) % a.save_every == 0 && step + 1 < steps {
            trainer.save(&a.out, save)?;
            if keep_state {
                trainer.save_state(&a.out, &pool)?;
            }
            saved_at = Some(step + 1);
        }
    }
    std::fs::write(&log_path, &log).with_context(|| format!("writing {}", log_path.display()))?;
    if !held.is_empty() {
        let l = trainer.eval_loss(target, &held, a.blocks_per_seq)?;
        eprintln!("held-out loss ({} sequences): {l:.4}", held.len());
    }
    trainer.save(&a.out, save)?;
    if keep_state {
        trainer.save_state(&a.out, &pool)?;
    }
    if let Some(at) = chunk_end {
        eprintln!(
            "--chunk-time {}s reached at step {at} of {}: resume with --resume {}",
            a.chunk_time.unwrap_or_default(),
            trainer.opts.steps,
            a.out.display()
        );
    }
    eprintln!(
        "saved {} (loss {:.4} -> {:.4}, {:.0}s, {} target passes over {} sequences)",
        a.out.display(),
        first_loss.unwrap_or(f64::NAN),
        last.map_or(f64::NAN, |s| s.loss),
        t0.elapsed().as_secs_f64(),
        pool.passes,
        pool.len()
    );
    drop(trainer);
    if let Some((counts, n)) = narrow_counts {
        let src = dflash::source::ModelSource::resolve(&model)?;
        let dir = a.out.join(format!("narrow-{}", a.draft_vocab));
        let share =
            dflash::draft::narrow::narrow_to_frequent(&a.out, &src, &counts, a.draft_vocab, &dir)
                .with_context(|| format!("--draft-vocab {}", a.draft_vocab))?;
        eprintln!(
            "--draft-vocab {}: {} (its head over the {} tokens most frequent in the responses, {:.1}% of {n})",
            a.draft_vocab,
            dir.display(),
            a.draft_vocab,
            100.0 * share
        );
    }

    // 4. Held-out tau with the saved checkpoint through the normal loader.
    if !a.eval_prompts.is_empty() {
        let mut p = Pipeline::load(&a.load.apply(PipelineOptions {
            model,
            draft: Some(a.out.display().to_string()),
            ..Default::default()
        })?)?;
        p.engine.max_context = p.engine.max_context.min(4096);
        let mut report = vec![];
        for spec in &a.eval_prompts {
            let f = data::resolve_file(spec)?;
            let recs = data::read_records(&f, a.eval_n)?;
            let (mut lens, mut gen) = (vec![], 0usize);
            for r in &recs {
                let Some(ids) = p.prompt_record_ids(&r.prompt, !a.no_chat_template, None)? else {
                    continue;
                };
                let mut req = GenerateRequest::new(ids, a.eval_max_tokens);
                req.stop_ids = p.stop_ids.clone();
                req.block_size = Some(a.block_size);
                req.adaptive = false;
                let out = p.engine.generate(&req, &mut |_| Flow::Continue)?;
                gen += out.stats.generated_tokens;
                lens.extend(out.stats.acceptance_lengths);
            }
            let tau = lens.iter().sum::<usize>() as f64 / lens.len().max(1) as f64;
            // Tokens that came from the draft: every cycle's accepted rows (length - bonus).
            let drafted: usize = lens.iter().map(|l| l.saturating_sub(1)).sum();
            let ratio = drafted as f64 / gen.max(1) as f64;
            eprintln!(
                "eval {spec}: {} prompts, {gen} tokens, tau {tau:.3}, acceptance ratio {ratio:.3} (greedy, block {})",
                recs.len(),
                a.block_size
            );
            report.push(
                serde_json::json!({"prompts": spec, "n": recs.len(), "generated_tokens": gen,
                "cycles": lens.len(), "tau": tau, "acceptance_ratio": ratio, "temperature": 0.0,
                "block_size": a.block_size, "max_tokens": a.eval_max_tokens}),
            );
        }
        let f = a.out.join("eval.json");
        std::fs::write(&f, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", f.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_shard;

    #[test]
    fn gen_shard_takes_k_of_n_and_names_a_bad_one() {
        assert_eq!(parse_shard("0/4"), Ok((0, 4)));
        assert_eq!(parse_shard(" 3 / 4"), Ok((3, 4)));
        for bad in ["4/4", "1", "a/2", "1/0", "-1/2"] {
            let e = parse_shard(bad).unwrap_err();
            assert!(e.starts_with(bad) && e.contains("K/N"), "{bad}: {e}");
        }
    }
}
