//! The switchboard: every `DFLASH_*` setting that changes which kernels run, read from the
//! environment once, in this one place. Code below asks [`get`]; `dflash bench` records
//! [`describe`] (the effective values, defaults included) with every report.
//!
//! | variable | default | effect |
//! |---|---|---|
//! | `DFLASH_FUSED` | on | the fused CUDA kernels (`nn::fused`); `0` runs the portable candle path |
//! | `DFLASH_FUSED_OFF` | none | some of them off, by part: `attention,norm,moe,delta,mla` (to locate a difference) |
//! | `DFLASH_BATCH_INVARIANT` | on (CUDA) | 1-16 row products through the batch-invariant skinny GEMM, so a verify reproduces the decode steps bit for bit; `0` takes the GEMV / cuBLAS kernels (faster, near-tie flips possible) |
//! | `DFLASH_GEMV_ROWS` | 1 | rows up to which the non-invariant path takes the GEMV kernel (0..=8) |
//! | `DFLASH_Q8` | on | dflash's own CPU Q8_0 / Q4 product; `0` keeps candle's |
//! | `DFLASH_Q4` | on | Q4_0 / Q4_1 / Q5_0 / Q6_K GGUF matrices keep their stored weights on the CPU; `0` requantizes them to Q8_0 |
//! | `DFLASH_DRAFT_Q8` | on | a float draft on the CPU runs its linears as Q8_0 through the int8 product (its f32 GEMMs cost ~3x; proposals only, so exactness is untouched); `0` keeps them float |
//! | `DFLASH_Q8_SCALAR` | off | `1` forces the scalar reference of the int8 product (same bits) |
//! | `DFLASH_TRY` | none | kernels built but not yet proven on a GPU, by name (or `all`); none at present, see [`Trial`] |
//! | `DFLASH_ATTN_MMA` | auto | attention of head dim 64 / 128 on the tensor cores: `auto` for launches of more rows than the batch-invariant products take (a batch's step), `1` for every launch, `0` never (the CUDA-core kernels), see [`AttnMma`] |
//! | `DFLASH_CUDA_GRAPHS` | on | decode / verify forwards (1-16 rows) of models whose layers all replay (attention + dense or MoE feed-forward) run as CUDA graphs (`archs::graphs`); `0` runs them eagerly |
//! | `DFLASH_CUDA_POOL_KEEP` | off | `1`: the device's memory pool keeps freed memory for the next allocation (release threshold: unlimited) instead of CUDA's default (every free byte goes back at each synchronization, so the next step's allocations map it again); a trial until measured (tools/gpu-bench/session49b.sh) |
//! | `DFLASH_CUDA_EVENTS` | off | `1` keeps cudarc's per-buffer event tracking (two CUDA events made and destroyed with every device buffer; dflash runs one stream, so they are never waited on) |
//! | `DFLASH_PROFILE` | off | `1`: per-section times after a device sync; `gpu`: from CUDA events; `ncu`: `bench --micro` brackets its timed verify forwards with cuProfilerStart/Stop (for `ncu --profile-from-start off`); `ncu-draft`: its timed draft proposals; `ncu-batch`: the 11th and 12th batch steps of 8+ sequences; `ncu-train`: the 6th and 7th training steps |

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// Per-section timing of forwards (`stats::SectionTimer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Off,
    /// Synchronize the device at every mark (wall times).
    Sync,
    /// CUDA events (GPU times, no host syncs inside the step).
    Gpu,
    /// No section timing; the micro bench's timed verify forwards run between
    /// cuProfilerStart and cuProfilerStop, so a profiler started with collection off
    /// (`ncu --profile-from-start off`) sees only them.
    Ncu,
    /// As `Ncu`, around the micro bench's timed draft proposals instead (`ncu-draft`).
    NcuDraft,
    /// As `Ncu`, around batch steps of 8 or more sequences (the 11th and 12th such steps of
    /// the process: past the warm-up, in the steady state; `ncu-batch`).
    NcuBatch,
    /// As `Ncu`, around the 6th and 7th training steps of the process (`ncu-train`).
    NcuTrain,
}

/// The groups of fused kernels that [`fused_part`] switches separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// K/V write and attention over the cache (`nn::attention`).
    Attention,
    /// Residual add + RMSNorm, SwiGLU.
    Norm,
    /// Routing and experts (`nn::moe`).
    Moe,
    /// Gated DeltaNet (`nn::gated_delta`).
    Delta,
    /// MLA latent attention and its absorbed products (`nn::mla`).
    Mla,
    /// DFlash2 draft convolutions and the selector's top-k (`nn::dyn_conv`, `draft::dflash2`).
    Dflash2,
}

impl Part {
    pub const ALL: [Part; 6] = [
        Part::Attention,
        Part::Norm,
        Part::Moe,
        Part::Delta,
        Part::Mla,
        Part::Dflash2,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Part::Attention => "attention",
            Part::Norm => "norm",
            Part::Moe => "moe",
            Part::Delta => "delta",
            Part::Mla => "mla",
            Part::Dflash2 => "dflash2",
        }
    }
    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// CUDA paths that are written and compiled but not yet run on a GPU: off unless named in
/// `DFLASH_TRY`, so a build between two GPU sessions keeps the proven kernels. Each becomes the
/// default (and leaves this list) once the H200 tests and benchmarks of docs/perf.md pass.
/// None at present. Proven and promoted: session 22's three (`attention_fill`, `moe_mma`,
/// `route_bf16`) in session 23, session 23's `route_union` in session 24, session 25's
/// `dflash2_fuse` (the selector's warp-list top-k, pair scores and walk on the device) in session
/// 25; `moe_narrow` ran no faster and was dropped; session 26's `mma_split` (narrow weights'
/// K over a cluster of blocks) passed the H200 tests but gained 10-20% on a few narrow
/// products only, and was dropped (the lab keeps it: tools/gpu-bench/skinny); session 30:
/// `shared` (the MoE shared expert as one more slot of the routed launches, 4-8% off the hybrid
/// MoE steps) promoted, `prefetch` (L2 prefetch of coming weights on a side stream: 17-20%
/// slower) and `combine` (the MoE combine in the down launch's last blocks: no faster at one
/// row, slower at 16) dropped (docs/perf.md, session 30; the code is in git history, 9ddb477);
/// session 31: `narrow16` (16 warps a tile for weights of at most 128 tiles) and
/// `conv_epilogue` (a DFlash2 layer's convolutions in the skinny GEMM's epilogues) promoted
/// together (the DFlash2 / DFlash draft step 1.15 -> 1.13-1.14). Session 32:
/// `fp8_block_scale` (FP8 weights as their exact e4m3 values on the tensor cores, the block
/// scales applied to each scale column's partial sums) ran 5-7% slower than the default FP8
/// kernel at the Qwen3-8B shape in session 34 and was dropped (docs/perf.md; the code is in git
/// history, dd90746). Session 39: `widen_logits` (the head's logits widened by one kernel) and
/// `attn_mma` (attention on the tensor cores) promoted in session 41 (docs/perf.md): the first
/// always, the second where the launch has more rows than the batch-invariant products take
/// (see [`attn_mma`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trial {}

impl Trial {
    pub const ALL: [Trial; 0] = [];
    pub fn name(self) -> &'static str {
        match self {}
    }
    fn bit(self) -> u8 {
        match self {}
    }
}

/// Which attention launches take the tensor-core kernel (`kernels/fused.cu`'s ATTN_MMA; the
/// door that decides is `nn::cuda::attention`). Its bits differ from the CUDA-core kernel's (q
/// and the probabilities enter the mma as bf16), so `Auto` keeps it off the launches that must
/// reproduce each other bit for bit (decode steps and one sequence's verify of up to 16 rows)
/// and gives it the launches past them (a batch's step, whose products already leave the
/// batch-invariant skinny GEMM for cuBLAS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnMma {
    Auto,
    On,
    Off,
}

impl AttnMma {
    const ALL: [AttnMma; 3] = [AttnMma::Auto, AttnMma::On, AttnMma::Off];
    pub fn name(self) -> &'static str {
        match self {
            AttnMma::Auto => "auto",
            AttnMma::On => "on",
            AttnMma::Off => "off",
        }
    }
}

/// 0 = follow `DFLASH_ATTN_MMA`, else 1 + the index in [`AttnMma::ALL`] set by [`set_attn_mma`].
static ATTN_MMA_OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// The tensor-core attention policy: `DFLASH_ATTN_MMA` (or [`set_attn_mma`]).
pub fn attn_mma() -> AttnMma {
    match ATTN_MMA_OVERRIDE.load(Ordering::Relaxed) {
        0 => get().attn_mma,
        b => AttnMma::ALL[b as usize - 1],
    }
}

/// Override the tensor-core attention policy for the process (tests run every case through
/// the kernel, or compare it with the CUDA-core one).
pub fn set_attn_mma(m: AttnMma) {
    ATTN_MMA_OVERRIDE.store(m as u8 + 1, Ordering::Relaxed);
}

/// Trials set by [`set_trials`] (bits of [`Trial`]); 0xff = follow `DFLASH_TRY`.
static TRIALS_OVERRIDE: AtomicU8 = AtomicU8::new(0xff);

/// Whether `DFLASH_TRY` (or [`set_trials`]) names this trial.
pub fn trial(t: Trial) -> bool {
    let on = match TRIALS_OVERRIDE.load(Ordering::Relaxed) {
        0xff => get().trials,
        b => b,
    };
    on & t.bit() != 0
}

/// Run with exactly these trials on, whatever `DFLASH_TRY` says (tests compare a trial's
/// path with the default's in one process).
pub fn set_trials(trials: &[Trial]) {
    TRIALS_OVERRIDE.store(
        trials.iter().fold(0u8, |b, t| b | t.bit()),
        Ordering::Relaxed,
    );
}

/// The settings as read from the environment.
#[derive(Debug, Clone)]
pub struct Switches {
    pub fused: bool,
    /// Parts switched off by `DFLASH_FUSED_OFF` (bits of [`Part`]).
    fused_off: u8,
    /// None: not set (the device's default applies, see [`batch_invariant`]).
    batch_invariant_env: Option<bool>,
    pub gemv_rows: usize,
    pub q8: bool,
    pub q4: bool,
    /// A float draft's linears requantized to Q8_0 on the CPU (`DFLASH_DRAFT_Q8`, on).
    pub draft_q8: bool,
    pub q8_scalar: bool,
    pub profile: Profile,
    /// cudarc's event tracking on every device buffer (`DFLASH_CUDA_EVENTS=1`).
    pub cuda_events: bool,
    /// The CUDA memory pool keeps what is freed (`DFLASH_CUDA_POOL_KEEP=1`).
    pub cuda_pool_keep: bool,
    /// Bits of [`Trial`] named by `DFLASH_TRY`.
    trials: u8,
    /// `DFLASH_ATTN_MMA`: `1` on, `0` off, else auto.
    pub attn_mma: AttnMma,
    /// CUDA graphs for decode / verify forwards (on unless `DFLASH_CUDA_GRAPHS=0`).
    pub cuda_graphs: bool,
}

/// The most rows the GEMV kernel takes (one accumulator per row).
pub const GEMV_MAX_ROWS: usize = 8;

impl Switches {
    /// Parse from variable lookups (tests pass their own).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let off = |k: &str| get(k).is_some_and(|v| v == "0");
        let on = |k: &str| get(k).is_some_and(|v| v == "1");
        let fused_off = get("DFLASH_FUSED_OFF")
            .map(|v| {
                v.split(',')
                    .filter_map(|n| Part::ALL.into_iter().find(|p| p.name() == n.trim()))
                    .fold(0u8, |b, p| b | p.bit())
            })
            .unwrap_or(0);
        Self {
            fused: !off("DFLASH_FUSED"),
            fused_off,
            batch_invariant_env: get("DFLASH_BATCH_INVARIANT")
                .filter(|v| !v.is_empty())
                .map(|v| v != "0"),
            gemv_rows: get("DFLASH_GEMV_ROWS")
                .and_then(|v| v.parse().ok())
                .map_or(1, |n: usize| n.min(GEMV_MAX_ROWS)),
            q8: !off("DFLASH_Q8"),
            q4: !off("DFLASH_Q4"),
            draft_q8: !off("DFLASH_DRAFT_Q8"),
            q8_scalar: on("DFLASH_Q8_SCALAR"),
            cuda_events: on("DFLASH_CUDA_EVENTS"),
            cuda_pool_keep: on("DFLASH_CUDA_POOL_KEEP"),
            cuda_graphs: !off("DFLASH_CUDA_GRAPHS"),
            trials: get("DFLASH_TRY")
                .map(|v| {
                    v.split(',')
                        .flat_map(|n| {
                            let n = n.trim();
                            Trial::ALL
                                .into_iter()
                                .filter(move |t| n == "all" || t.name() == n)
                        })
                        .fold(0u8, |b, t| b | t.bit())
                })
                .unwrap_or(0),
            attn_mma: match get("DFLASH_ATTN_MMA").as_deref() {
                Some("1") => AttnMma::On,
                Some("0") => AttnMma::Off,
                _ => AttnMma::Auto,
            },
            profile: match get("DFLASH_PROFILE").as_deref() {
                Some("1") => Profile::Sync,
                Some("gpu") => Profile::Gpu,
                Some("ncu") => Profile::Ncu,
                Some("ncu-draft") => Profile::NcuDraft,
                Some("ncu-batch") => Profile::NcuBatch,
                Some("ncu-train") => Profile::NcuTrain,
                _ => Profile::Off,
            },
        }
    }
}

/// The process's switches (read once).
pub fn get() -> &'static Switches {
    static S: OnceLock<Switches> = OnceLock::new();
    S.get_or_init(|| Switches::from_lookup(|k| std::env::var(k).ok()))
}

/// 0 = follow the environment / default, 1 = off, 2 = on.
static INVARIANT_OVERRIDE: AtomicU8 = AtomicU8::new(0);
static FUSED_OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// The fused CUDA kernels: on unless `DFLASH_FUSED=0` or [`set_fused`]`(false)`.
pub fn fused() -> bool {
    match FUSED_OVERRIDE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => get().fused,
    }
}

/// Override the fused kernels for the process (tests compare both paths in one run; never
/// while a model is generating).
pub fn set_fused(on: bool) {
    FUSED_OVERRIDE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Parts switched off by [`set_fused_off`] (bits of [`Part`]); 0xff = follow the environment.
static PARTS_OVERRIDE: AtomicU8 = AtomicU8::new(0xff);

/// Whether the fused kernels of `part` run: [`fused`] and the part not in `DFLASH_FUSED_OFF`
/// (or [`set_fused_off`]).
pub fn fused_part(part: Part) -> bool {
    let off = match PARTS_OVERRIDE.load(Ordering::Relaxed) {
        0xff => get().fused_off,
        b => b,
    };
    fused() && off & part.bit() == 0
}

/// Switch these parts off for the process (the rest on); tests use it to find which part of
/// a fused path differs from the portable one.
pub fn set_fused_off(parts: &[Part]) {
    let b = parts.iter().fold(0u8, |b, p| b | p.bit());
    PARTS_OVERRIDE.store(b, Ordering::Relaxed);
}

static GRAPHS_OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// CUDA graphs for the decode / verify forwards of models whose every layer can be replayed
/// (`archs::graphs`): on unless `DFLASH_CUDA_GRAPHS=0` or [`set_cuda_graphs`]`(false)`.
pub fn cuda_graphs() -> bool {
    match GRAPHS_OVERRIDE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => get().cuda_graphs,
    }
}

/// Override CUDA graphs for the process (tests compare graphs with eager forwards).
pub fn set_cuda_graphs(on: bool) {
    GRAPHS_OVERRIDE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Batch-invariant kernels on CUDA: on unless `DFLASH_BATCH_INVARIANT=0` or
/// [`set_batch_invariant`]`(false)`. With them a Q-row verify computes every row exactly as a
/// one-row decode step would, so greedy DFlash equals plain greedy decoding on the GPU (the
/// CPU path is exact by construction: `nn::attention`'s row-wise verify and row-invariant
/// int8 products).
pub fn batch_invariant() -> bool {
    match INVARIANT_OVERRIDE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => get().batch_invariant_env.unwrap_or(true),
    }
}

/// Override batch-invariant mode for the process; set it before loading models.
pub fn set_batch_invariant(on: bool) {
    INVARIANT_OVERRIDE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// The effective value of every switch, for reports (`bench` records these).
pub fn describe() -> Vec<(&'static str, String)> {
    let s = get();
    let b = |x: bool| if x { "on" } else { "off" }.to_string();
    vec![
        ("fused", b(fused())),
        ("fused_off", {
            let off: Vec<&str> = Part::ALL
                .into_iter()
                .filter(|&p| fused() && !fused_part(p))
                .map(Part::name)
                .collect();
            if off.is_empty() {
                "none".into()
            } else {
                off.join(",")
            }
        }),
        ("batch_invariant", b(batch_invariant())),
        ("gemv_rows", s.gemv_rows.to_string()),
        ("q8", b(s.q8)),
        ("q4", b(s.q4)),
        ("draft_q8", b(s.draft_q8)),
        ("q8_scalar", b(s.q8_scalar)),
        ("cuda_events", b(s.cuda_events)),
        ("cuda_pool_keep", b(s.cuda_pool_keep)),
        ("cuda_graphs", b(cuda_graphs())),
        ("attn_mma", attn_mma().name().to_string()),
        ("try", {
            let on: Vec<&str> = Trial::ALL
                .into_iter()
                .filter(|&t| trial(t))
                .map(Trial::name)
                .collect();
            if on.is_empty() {
                "none".into()
            } else {
                on.join(",")
            }
        }),
        (
            "profile",
            match s.profile {
                Profile::Off => "off",
                Profile::Sync => "sync",
                Profile::Gpu => "gpu",
                Profile::Ncu => "ncu",
                Profile::NcuDraft => "ncu-draft",
                Profile::NcuBatch => "ncu-batch",
                Profile::NcuTrain => "ncu-train",
            }
            .into(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Switches {
        Switches::from_lookup(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn defaults_and_opt_outs() {
        let d = parse(&[]);
        assert!(d.fused && d.q8 && d.q4 && !d.q8_scalar && !d.cuda_events && !d.cuda_pool_keep);
        assert_eq!(d.batch_invariant_env, None);
        assert_eq!((d.gemv_rows, d.profile), (1, Profile::Off));
        let s = parse(&[
            ("DFLASH_FUSED", "0"),
            ("DFLASH_BATCH_INVARIANT", "0"),
            ("DFLASH_GEMV_ROWS", "99"),
            ("DFLASH_Q8", "0"),
            ("DFLASH_Q4", "0"),
            ("DFLASH_Q8_SCALAR", "1"),
            ("DFLASH_PROFILE", "gpu"),
            ("DFLASH_CUDA_EVENTS", "1"),
            ("DFLASH_CUDA_POOL_KEEP", "1"),
        ]);
        assert!(!s.fused && !s.q8 && !s.q4 && s.q8_scalar && s.cuda_events && s.cuda_pool_keep);
        assert_eq!(s.batch_invariant_env, Some(false));
        assert_eq!((s.gemv_rows, s.profile), (GEMV_MAX_ROWS, Profile::Gpu));
        assert_eq!(
            parse(&[("DFLASH_BATCH_INVARIANT", "1")]).batch_invariant_env,
            Some(true)
        );
        let p = parse(&[("DFLASH_FUSED_OFF", "moe, delta,bogus")]);
        assert_eq!(p.fused_off, Part::Moe.bit() | Part::Delta.bit());
        assert_eq!(d.trials, 0);
        // names that are not trials (former ones included) are ignored
        let t = parse(&[(
            "DFLASH_TRY",
            "moe_narrow, route_union, prefetch, combine, conv_epilogue, widen_logits, attn_mma, bogus",
        )]);
        assert_eq!(t.trials, 0);
        let all = Trial::ALL.iter().fold(0u8, |b, t| b | t.bit());
        assert_eq!(parse(&[("DFLASH_TRY", "all")]).trials, all);
        assert_eq!(d.attn_mma, AttnMma::Auto);
        assert_eq!(parse(&[("DFLASH_ATTN_MMA", "1")]).attn_mma, AttnMma::On);
        assert_eq!(parse(&[("DFLASH_ATTN_MMA", "0")]).attn_mma, AttnMma::Off);
        assert_eq!(
            parse(&[("DFLASH_ATTN_MMA", "auto")]).attn_mma,
            AttnMma::Auto
        );
        for m in AttnMma::ALL {
            assert_eq!(AttnMma::ALL[m as usize], m, "ALL in declaration order");
        }
        assert!(d.cuda_graphs);
        assert!(!parse(&[("DFLASH_CUDA_GRAPHS", "0")]).cuda_graphs);
        assert!(parse(&[("DFLASH_CUDA_GRAPHS", "1")]).cuda_graphs);
    }
}
