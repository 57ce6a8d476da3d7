//! `dflash bench`: the seed's table (baseline tok/s, DFlash tok/s, speedup, acceptance) for
//! one target/draft pair or a matrix of them, measured so that the numbers can be trusted.
//!
//! Protocol (each rule closes a way peers got misleading numbers):
//! - the prompts are encoded ONCE per row; baseline and DFlash runs get the same token ids
//!   (every run records a hash of its ids and the row asserts they agree per prompt);
//! - baseline = the same engine and kernels with block size 1 (plain autoregressive);
//! - decode tok/s is measured after prefill (the engine's `decode_tok_s`: generated tokens
//!   after the first, over decode time);
//! - one warm-up generation per mode is run and not counted;
//! - `repeat` repeats with `cooldown` seconds between them; the baseline/DFlash order
//!   alternates between repeats; the median and min/max over repeats are reported;
//! - the machine, dtype, quantization, git commit and crate versions are recorded.
//!
//! Per repeat and mode, tok/s = sum over prompts of (generated - 1) / sum of decode seconds.
//! Speedup = median DFlash tok/s / median baseline tok/s (min/max: of the per-repeat ratios).
//! tau and the acceptance ratio pool all counted DFlash runs: tau = sum of acceptance lengths
//! / cycles; acceptance ratio = tokens from the draft / tokens generated.
//!
//! A failing row never stops a matrix: it gets a [`Status`] and a classified cause
//! ([`classify`]).

pub mod classify;
pub mod concurrency;
#[cfg(feature = "cuda")]
pub mod gpu_probe;
pub mod machine;
pub mod micro;
pub mod prompts;
pub mod report;

pub use classify::{classify, Failure, Status};
pub use machine::Machine;
pub use prompts::Prompt;

use crate::archs::family_for;
use crate::config::draft::DraftConfig;
use crate::engine::GenerateRequest;
use crate::pipeline::{Pipeline, PipelineOptions};
use crate::sampling::SamplingParams;
use crate::source::ModelSource;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{Duration, Instant};

/// One target/draft pair of a matrix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairSpec {
    pub model: String,
    #[serde(default)]
    pub draft: Option<String>,
    /// Display name (default: the model's last path component).
    #[serde(default)]
    pub name: Option<String>,
}

impl PairSpec {
    pub fn label(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            self.model
                .trim_end_matches('/')
                .rsplit('/')
                .next()
                .unwrap_or(&self.model)
                .to_string()
        })
    }
}

/// Read a matrix file: a JSON list of `{"model": .., "draft": .., "name": ..}` (or an object
/// with such a list under `rows`).
pub fn read_matrix(path: &Path) -> Result<Vec<PairSpec>> {
    let v = crate::config::read_json(path)?;
    let name = path.display().to_string();
    let list = v.get("rows").cloned().unwrap_or(v);
    let rows: Vec<PairSpec> = serde_json::from_value(list).map_err(|e| {
        Error::config(
            &name,
            "(rows)",
            format!("expected a list of {{\"model\", \"draft\"?, \"name\"?}}: {e}"),
        )
    })?;
    if rows.is_empty() {
        return Err(Error::config(&name, "(rows)", "the matrix is empty"));
    }
    Ok(rows)
}

/// How to benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct BenchOptions {
    pub max_tokens: usize,
    /// None = the draft's block size.
    pub block_size: Option<usize>,
    /// DFlash runs choose their block size per cycle (ignored when block_size is given).
    pub adaptive: bool,
    /// GGUF: keep stored quantization (no requantization at load).
    pub keep_quant: bool,
    pub repeat: usize,
    /// Seconds between repeats (and between matrix rows).
    pub cooldown_s: f64,
    /// Uncounted warm-up generations per mode.
    pub warmup: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: u64,
    pub dtype: Option<String>,
    pub device: Option<String>,
    /// The chat template's thinking flag.
    pub enable_thinking: bool,
    /// Generate `max_tokens` regardless of end-of-sequence tokens.
    pub ignore_eos: bool,
    pub max_context: Option<usize>,
    /// Load even when the model does not fit the memory available.
    pub force_memory: bool,
    /// Memory to plan with instead of what the machine reports (bytes).
    pub memory_limit: Option<u64>,
    /// Where the prompts came from (for the report).
    pub prompt_source: String,
    /// Structured output: every generation (both modes) under this grammar.
    pub grammar: Option<crate::grammar::GrammarSpec>,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            max_tokens: 512,
            block_size: None,
            adaptive: true,
            keep_quant: false,
            repeat: 3,
            cooldown_s: 60.0,
            warmup: 1,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            dtype: None,
            device: None,
            enable_thinking: false,
            ignore_eos: false,
            max_context: None,
            force_memory: false,
            memory_limit: None,
            prompt_source: "default".into(),
            grammar: None,
        }
    }
}

impl BenchOptions {
    fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: 0.0,
            seed: self.seed,
            ..Default::default()
        }
    }
    /// Generations one row runs (warm-up included), for progress bars.
    pub fn generations_per_row(&self, prompts: usize, with_draft: bool) -> usize {
        let modes = if with_draft { 2 } else { 1 };
        modes * (self.warmup + self.repeat * prompts)
    }
}

/// Baseline (block size 1) or DFlash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Baseline,
    Dflash,
}

/// One counted generation, with the raw numbers every summary value is computed from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    pub repeat: usize,
    pub mode: Mode,
    pub prompt_index: usize,
    /// FNV-1a of the prompt ids (equal for both modes of a prompt: asserted).
    pub prompt_hash: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Decode time after prefill (the engine's `decode_ms`).
    pub decode_ms: f64,
    /// Parts of it: target forwards + choosing tokens (`verify_ms`), draft calls (`draft_ms`);
    /// the rest is engine bookkeeping.
    #[serde(default)]
    pub verify_ms: f64,
    #[serde(default)]
    pub draft_ms: f64,
    /// Recurrent-state rollback after partial acceptances (hybrid targets), part of decode.
    #[serde(default)]
    pub rollback_ms: f64,
    pub decode_tok_s: f64,
    pub ttft_ms: f64,
    pub prefill_tok_s: f64,
    pub block_size: usize,
    pub cycles: usize,
    pub acceptance_lengths: Vec<usize>,
    /// Tokens that came from the draft.
    pub draft_tokens: usize,
    pub tau: f64,
    pub acceptance_ratio: f64,
    pub histogram: Vec<usize>,
    pub finish_reason: String,
    /// FNV-1a of the generated ids.
    pub output_hash: String,
    /// The engine decoded plainly although DFlash was asked for, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
}

/// Median, min and max over repeats.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        Some(Spread {
            median: median_sorted(&v),
            min: v[0],
            max: v[v.len() - 1],
        })
    }
}

/// Median of sorted values (the mean of the middle two for an even count).
pub fn median_sorted(v: &[f64]) -> f64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One repeat's throughput per mode.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RepeatTiming {
    pub repeat: usize,
    /// The order the modes ran in.
    pub order: Vec<Mode>,
    pub baseline_tok_s: Option<f64>,
    pub dflash_tok_s: Option<f64>,
    pub speedup: Option<f64>,
}

/// A prompt as benchmarked in a row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromptRecord {
    pub id: String,
    pub prompt_ids: Vec<u32>,
}

/// One row of the table, with everything behind it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RowResult {
    pub name: String,
    pub model: String,
    pub draft: Option<String>,
    /// The draft's architecture as loaded ("DFlash", "DFlash2"), so DFlash and DFlash2 drafts
    /// of one target read apart in one table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_arch: Option<String>,
    /// Tokens the draft can propose when its head is narrower than the target's vocabulary
    /// (`draft::narrow`); absent: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_vocab: Option<usize>,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    pub block_size: Option<usize>,
    /// Target weight quantization as loaded (e.g. "Q4_1->Q8_0 x210", "mlx affine 4-bit g64
    /// x197; dequantized to f32"), None for float checkpoints.
    #[serde(default)]
    pub quantization: Option<String>,
    pub load_s: Option<f64>,
    pub baseline_tok_s: Option<Spread>,
    pub dflash_tok_s: Option<Spread>,
    /// Median DFlash tok/s / median baseline tok/s.
    pub speedup: Option<f64>,
    /// Min and max of the per-repeat speedups.
    pub speedup_min: Option<f64>,
    pub speedup_max: Option<f64>,
    /// Mean acceptance length (counting the bonus), over all counted DFlash runs.
    pub tau: Option<f64>,
    /// Tokens from the draft / tokens generated, over all counted DFlash runs.
    pub acceptance_ratio: Option<f64>,
    /// `histogram[k]` = cycles that committed k tokens, summed over counted DFlash runs.
    pub histogram: Vec<usize>,
    /// Median TTFT of the DFlash runs (of the baseline runs for a baseline-only row).
    pub ttft_ms: Option<f64>,
    pub baseline_ttft_ms: Option<f64>,
    /// Median prefill tok/s over all counted runs.
    pub prefill_tok_s: Option<f64>,
    /// Peak resident memory of the process during this row (Linux VmHWM, reset per row),
    /// host memory only.
    pub peak_memory_bytes: Option<u64>,
    /// At temperature 0: prompts x repeats where DFlash's output differed from the
    /// baseline's (the lossless check; should be 0 up to documented near-ties).
    pub greedy_mismatches: Option<usize>,
    /// Mean generated tokens per counted run.
    pub mean_generated_tokens: Option<f64>,
    pub repeats: Vec<RepeatTiming>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompts: Vec<PromptRecord>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<RunRecord>,
}

impl RowResult {
    fn new(spec: &PairSpec) -> Self {
        Self {
            name: spec.label(),
            model: spec.model.clone(),
            draft: spec.draft.clone(),
            draft_arch: None,
            draft_vocab: None,
            status: Status::Ok,
            failure: None,
            block_size: None,
            quantization: None,
            load_s: None,
            baseline_tok_s: None,
            dflash_tok_s: None,
            speedup: None,
            speedup_min: None,
            speedup_max: None,
            tau: None,
            acceptance_ratio: None,
            histogram: vec![],
            ttft_ms: None,
            baseline_ttft_ms: None,
            prefill_tok_s: None,
            peak_memory_bytes: None,
            greedy_mismatches: None,
            mean_generated_tokens: None,
            repeats: vec![],
            prompts: vec![],
            runs: vec![],
        }
    }

    fn fail(mut self, f: Failure) -> Self {
        self.status = f.status;
        self.failure = Some(f);
        self
    }

    /// The row without its raw runs and prompt ids (for summary.json).
    pub fn summary(&self) -> Self {
        Self {
            runs: vec![],
            prompts: vec![],
            ..self.clone()
        }
    }
}

/// Progress callbacks (the CLI draws bars; tests pass [`Silent`]).
pub trait Progress {
    /// A row starts; it will run `generations` generations if nothing fails.
    fn row_start(&mut self, _index: usize, _rows: usize, _label: &str, _generations: usize) {}
    /// One generation (warm-up included) finished.
    fn generation_done(&mut self, _what: &str) {}
    /// A phase message (loading, cooldown).
    fn phase(&mut self, _msg: &str) {}
    fn row_done(&mut self, _row: &RowResult) {}
}

/// No progress output.
pub struct Silent;
impl Progress for Silent {}

/// FNV-1a over u32 ids, as hex.
pub fn ids_hash(ids: &[u32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &i in ids {
        for b in i.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// Reset the process's peak RSS (Linux: write 5 to /proc/self/clear_refs).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Cheap checks before loading, so that a failure names the model at fault.
fn preflight(spec: &PairSpec) -> std::result::Result<(), Failure> {
    let target = ModelSource::resolve(&spec.model).map_err(|e| classify(&e, "target"))?;
    let tcfg = target.target_config().map_err(|e| classify(&e, "target"))?;
    family_for(&tcfg).map_err(|e| classify(&e, "target"))?;
    if let Some(d) = &spec.draft {
        let dsrc = ModelSource::resolve(d).map_err(|e| classify(&e, "draft"))?;
        let dcfg = DraftConfig::from_file(&dsrc.config).map_err(|e| classify(&e, "draft"))?;
        dcfg.validate_against(&tcfg, &spec.model)
            .map_err(|e| classify(&e, "draft"))?;
    }
    Ok(())
}

/// Which model a load error came from: weights errors name their file.
fn load_role(e: &Error, spec: &PairSpec) -> &'static str {
    if let (Error::Weights { file, .. }, Some(d)) = (e, &spec.draft) {
        if let Ok(dsrc) = ModelSource::resolve(d) {
            if Path::new(file).starts_with(&dsrc.dir) {
                return "draft";
            }
        }
    }
    match e {
        Error::Mismatch { .. } => "draft",
        _ if spec.draft.is_some() => "target/draft",
        _ => "target",
    }
}

/// Path-like specs that do not exist (and are no repo id) are "not found", not input errors.
fn missing_local(spec: &str) -> Option<Failure> {
    let p = Path::new(spec);
    if p.is_dir() && !p.join("config.json").is_file() {
        return Some(Failure::new(
            Status::NotFound,
            format!("{spec}: no config.json"),
            format!("{}: no config.json", p.display()),
        ));
    }
    if !p.exists() && !crate::source::hub::looks_like_repo_id(spec) {
        return Some(Failure::new(
            Status::NotFound,
            format!("{spec}: no such directory (and not an Org/Name repo id)"),
            format!("model `{spec}`: no such directory"),
        ));
    }
    None
}

/// Benchmark one pair. Never panics on a model problem: failures become the row's status.
pub fn bench_pair(
    spec: &PairSpec,
    prompts: &[Prompt],
    opts: &BenchOptions,
    progress: &mut dyn Progress,
) -> RowResult {
    let row = RowResult::new(spec);
    for (role, s) in [
        ("target", Some(&spec.model)),
        ("draft", spec.draft.as_ref()),
    ] {
        if let Some(mut f) = s.and_then(|s| missing_local(s)) {
            f.cause = format!("{role}: {}", f.cause);
            return row.fail(f);
        }
    }
    if let Err(f) = preflight(spec) {
        return row.fail(f);
    }
    reset_peak_rss();
    progress.phase("loading");
    let t0 = Instant::now();
    let p = match Pipeline::load(&PipelineOptions {
        model: spec.model.clone(),
        draft: spec.draft.clone(),
        dtype: opts.dtype.clone(),
        device: opts.device.clone(),
        max_context: opts.max_context,
        no_draft: false,
        require_draft: false,
        keep_quant: opts.keep_quant,
        force_memory: opts.force_memory,
        memory_limit: opts.memory_limit,
        tensor_parallel: 1,
    }) {
        Ok(p) => p,
        Err(e) => return row.fail(classify(&e, load_role(&e, spec))),
    };
    let mut row = RowResult {
        load_s: Some(t0.elapsed().as_secs_f64()),
        quantization: p.engine.target.info().quantization.clone(),
        draft_arch: p.engine.draft.as_ref().map(|d| d.arch_name().to_string()),
        draft_vocab: p.engine.draft.as_ref().and_then(|d| d.draft_vocab()),
        ..row
    };
    match encode_prompts(&p, prompts, opts) {
        Ok(v) => row.prompts = v,
        Err(e) => return row.fail(classify(&e, "prompt")),
    }
    match run_protocol(&p, opts, progress, &mut row) {
        Ok(()) => {}
        Err(e) => {
            let f = classify(&e, "generate");
            row.status = f.status;
            row.failure = Some(f);
        }
    }
    if row.status == Status::Ok && spec.draft.is_none() {
        row.status = Status::NoDraft;
        row.failure = Some(Failure::new(
            Status::NoDraft,
            "baseline only (the row names no draft)",
            "no draft for this target",
        ));
    }
    row
}

/// Warm up, run the repeats, aggregate (the prompts are in `row.prompts`).
fn run_protocol(
    p: &Pipeline,
    opts: &BenchOptions,
    progress: &mut dyn Progress,
    row: &mut RowResult,
) -> Result<()> {
    let encoded: Vec<Vec<u32>> = row.prompts.iter().map(|p| p.prompt_ids.clone()).collect();
    let with_draft = p.engine.draft.is_some();
    let grammar = opts
        .grammar
        .as_ref()
        .map(|g| p.compile_grammar(g))
        .transpose()?;
    let stop_ids = if opts.ignore_eos {
        vec![]
    } else {
        p.stop_ids.clone()
    };
    let request = |mode: Mode, ids: &[u32]| GenerateRequest {
        prompt_ids: ids.to_vec(),
        max_tokens: opts.max_tokens,
        sampling: opts.sampling(),
        stop_ids: stop_ids.clone(),
        block_size: match mode {
            Mode::Baseline => Some(1),
            Mode::Dflash => opts.block_size,
        },
        adaptive: opts.adaptive,
        trace: false,
        grammar: grammar.clone(),
    };
    let modes: Vec<Mode> = if with_draft {
        vec![Mode::Baseline, Mode::Dflash]
    } else {
        vec![Mode::Baseline]
    };
    row.block_size = Some(
        p.engine
            .block_size(&request(*modes.last().unwrap(), &encoded[0])),
    );

    // Warm-up: not counted.
    for w in 0..opts.warmup {
        for &m in &modes {
            progress.phase(&format!("warm-up {}", w + 1));
            p.engine.generate(&request(m, &encoded[0]), &mut |_| {
                crate::engine::Flow::Continue
            })?;
            progress.generation_done("warm-up");
        }
    }

    for r in 0..opts.repeat {
        if r > 0 && opts.cooldown_s > 0.0 {
            progress.phase(&format!("cooldown {:.0} s", opts.cooldown_s));
            std::thread::sleep(Duration::from_secs_f64(opts.cooldown_s));
        }
        // Alternate which mode goes first.
        let mut order = modes.clone();
        if r % 2 == 1 {
            order.reverse();
        }
        for &m in &order {
            progress.phase(&format!("repeat {}/{} {:?}", r + 1, opts.repeat, m));
            for (i, ids) in encoded.iter().enumerate() {
                let req = request(m, ids);
                let out = p
                    .engine
                    .generate(&req, &mut |_| crate::engine::Flow::Continue)?;
                let s = &out.stats;
                let draft_tokens =
                    (s.acceptance_ratio * s.generated_tokens as f64).round() as usize;
                row.runs.push(RunRecord {
                    repeat: r,
                    mode: m,
                    prompt_index: i,
                    prompt_hash: ids_hash(&req.prompt_ids),
                    prompt_tokens: s.prompt_tokens,
                    generated_tokens: s.generated_tokens,
                    decode_ms: s.decode_ms,
                    verify_ms: s.verify_ms,
                    draft_ms: s.draft_ms,
                    rollback_ms: s.rollback_ms,
                    decode_tok_s: s.decode_tok_s,
                    ttft_ms: s.ttft_ms,
                    prefill_tok_s: s.prefill_tok_s,
                    block_size: s.block_size,
                    cycles: s.cycles,
                    acceptance_lengths: s.acceptance_lengths.clone(),
                    draft_tokens,
                    tau: s.tau,
                    acceptance_ratio: s.acceptance_ratio,
                    histogram: s.histogram.clone(),
                    finish_reason: s.finish_reason.clone(),
                    output_hash: ids_hash(&out.output_ids),
                    fallback_reason: s.fallback_reason.clone(),
                });
                progress.generation_done("run");
            }
        }
        row.repeats.push(RepeatTiming {
            repeat: r,
            order,
            baseline_tok_s: None,
            dflash_tok_s: None,
            speedup: None,
        });
    }
    aggregate(row, opts.temperature == 0.0);
    Ok(())
}

/// Encode every prompt once (token ids as given, else the chat, earlier turns and the turn
/// to answer, through the chat template with the thinking flag); both modes use these very
/// ids.
fn encode_prompts(
    p: &Pipeline,
    prompts: &[Prompt],
    opts: &BenchOptions,
) -> Result<Vec<PromptRecord>> {
    if prompts.is_empty() {
        return Err(Error::input("no prompts"));
    }
    let mut out = Vec::new();
    for pr in prompts {
        if pr.prompt_ids.is_none() && pr.text.is_some() && p.tokenizer.is_none() {
            return Err(Error::input(format!(
                "prompt {}: the model has no tokenizer.json; give `prompt_ids` in the prompts JSONL",
                pr.id
            )));
        }
        let ids = p
            .prompt_record_ids(pr, true, Some(opts.enable_thinking))?
            .ok_or_else(|| Error::input(format!("prompt {}: empty", pr.id)))?;
        out.push(PromptRecord {
            id: pr.id.clone(),
            prompt_ids: ids,
        });
    }
    Ok(out)
}

/// Pooled tok/s of the runs of one repeat and mode.
pub fn repeat_tok_s(runs: &[RunRecord], repeat: usize, mode: Mode) -> Option<f64> {
    let sel: Vec<&RunRecord> = runs
        .iter()
        .filter(|r| r.repeat == repeat && r.mode == mode)
        .collect();
    if sel.is_empty() {
        return None;
    }
    let toks: usize = sel
        .iter()
        .map(|r| r.generated_tokens.saturating_sub(1))
        .sum();
    let secs: f64 = sel.iter().map(|r| r.decode_ms / 1e3).sum();
    Some(toks as f64 / secs.max(1e-12))
}

/// Fill the row's summary values from its raw runs.
pub fn aggregate(row: &mut RowResult, greedy: bool) {
    // The protocol's core promise: per prompt, one token sequence for every run.
    for i in 0..row.prompts.len() {
        let want = ids_hash(&row.prompts[i].prompt_ids);
        for r in row.runs.iter().filter(|r| r.prompt_index == i) {
            assert_eq!(
                r.prompt_hash, want,
                "run {:?} repeat {} used other prompt ids than prompt {i}",
                r.mode, r.repeat
            );
        }
    }
    let mut base = Vec::new();
    let mut dfl = Vec::new();
    let mut ratios = Vec::new();
    for t in &mut row.repeats {
        t.baseline_tok_s = repeat_tok_s(&row.runs, t.repeat, Mode::Baseline);
        t.dflash_tok_s = repeat_tok_s(&row.runs, t.repeat, Mode::Dflash);
        t.speedup = t.baseline_tok_s.zip(t.dflash_tok_s).map(|(b, d)| d / b);
        base.extend(t.baseline_tok_s);
        dfl.extend(t.dflash_tok_s);
        ratios.extend(t.speedup);
    }
    row.baseline_tok_s = Spread::of(&base);
    row.dflash_tok_s = Spread::of(&dfl);
    row.speedup = row
        .baseline_tok_s
        .zip(row.dflash_tok_s)
        .map(|(b, d)| d.median / b.median);
    let rs = Spread::of(&ratios);
    row.speedup_min = rs.map(|s| s.min);
    row.speedup_max = rs.map(|s| s.max);

    let dr: Vec<&RunRecord> = row.runs.iter().filter(|r| r.mode == Mode::Dflash).collect();
    let br: Vec<&RunRecord> = row
        .runs
        .iter()
        .filter(|r| r.mode == Mode::Baseline)
        .collect();
    if !dr.is_empty() {
        let cycles: usize = dr.iter().map(|r| r.acceptance_lengths.len()).sum();
        let committed: usize = dr
            .iter()
            .map(|r| r.acceptance_lengths.iter().sum::<usize>())
            .sum();
        let draft: usize = dr.iter().map(|r| r.draft_tokens).sum();
        let generated: usize = dr.iter().map(|r| r.generated_tokens).sum();
        row.tau = Some(if cycles > 0 {
            committed as f64 / cycles as f64
        } else {
            0.0
        });
        row.acceptance_ratio = Some(if generated > 0 {
            draft as f64 / generated as f64
        } else {
            0.0
        });
        let len = dr.iter().map(|r| r.histogram.len()).max().unwrap_or(0);
        let mut h = vec![0; len];
        for r in &dr {
            for (k, c) in r.histogram.iter().enumerate() {
                h[k] += c;
            }
        }
        row.histogram = h;
    }
    let med = |v: Vec<f64>| Spread::of(&v).map(|s| s.median);
    row.baseline_ttft_ms = med(br.iter().map(|r| r.ttft_ms).collect());
    row.ttft_ms = if dr.is_empty() {
        row.baseline_ttft_ms
    } else {
        med(dr.iter().map(|r| r.ttft_ms).collect())
    };
    row.prefill_tok_s = med(row.runs.iter().map(|r| r.prefill_tok_s).collect());
    row.peak_memory_bytes = crate::stats::peak_rss_bytes();
    if !row.runs.is_empty() {
        let n = row.runs.len() as f64;
        row.mean_generated_tokens =
            Some(row.runs.iter().map(|r| r.generated_tokens).sum::<usize>() as f64 / n);
    }
    if greedy && !dr.is_empty() {
        let mismatches = dr
            .iter()
            .filter(|d| {
                br.iter().any(|b| {
                    b.repeat == d.repeat
                        && b.prompt_index == d.prompt_index
                        && b.output_hash != d.output_hash
                })
            })
            .count();
        row.greedy_mismatches = Some(mismatches);
    }
}

/// Run a matrix: every row, whatever the others did.
pub fn bench_matrix(
    specs: &[PairSpec],
    prompts: &[Prompt],
    opts: &BenchOptions,
    progress: &mut dyn Progress,
) -> Vec<RowResult> {
    let mut rows = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let gens = opts.generations_per_row(prompts.len(), spec.draft.is_some());
        progress.row_start(i, specs.len(), &spec.label(), gens);
        if i > 0
            && opts.cooldown_s > 0.0
            && rows.last().is_some_and(|r: &RowResult| !r.runs.is_empty())
        {
            progress.phase(&format!("cooldown {:.0} s", opts.cooldown_s));
            std::thread::sleep(Duration::from_secs_f64(opts.cooldown_s));
        }
        // A panic inside one row (a kernel assertion, the protocol's own checks) becomes
        // that row's error; the matrix goes on.
        let row = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            bench_pair(spec, prompts, opts, &mut *progress)
        }))
        .unwrap_or_else(|e| {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            RowResult::new(spec).fail(Failure::new(
                Status::Error,
                format!("panic: {msg}"),
                msg.clone(),
            ))
        });
        progress.row_done(&row);
        rows.push(row);
    }
    rows
}
