//! Per-generation statistics, named as the ecosystem reports them.

use serde::Serialize;

#[derive(Debug, Clone, Default, Serialize)]
pub struct GenerationStats {
    /// "dflash" or "plain".
    pub mode: String,
    /// Why the engine decoded plainly although a draft was loaded, if it did.
    pub fallback_reason: Option<String>,
    pub block_size: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens restored from the prefix cache (not prefilled).
    pub cached_prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Time to the first generated token (prefill + first sample), ms.
    pub ttft_ms: f64,
    pub prefill_tok_s: f64,
    /// Generated tokens after the first, per second, measured after prefill and excluding the
    /// first draft call (which also prefills the draft's context cache).
    pub decode_tok_s: f64,
    pub decode_ms: f64,
    /// Draft and verify time summed over cycles, ms.
    pub draft_ms: f64,
    pub verify_ms: f64,
    /// Target-cache rollback after the verifies, summed, ms: rebuilding the recurrent state
    /// after a partial acceptance (hybrid targets; measured up to a device sync), ~0 for
    /// attention-only targets, whose KV crop is O(1).
    pub rollback_ms: f64,
    /// Structured output: grammar masks computed (one per verify row reached, per draft row,
    /// per plain step) and their time, ms (0 without a grammar).
    pub grammar_masks: usize,
    pub grammar_mask_ms: f64,
    /// Decode cycles (target forward passes after prefill).
    pub cycles: usize,
    /// Committed tokens per cycle (accepted draft tokens + the bonus).
    pub acceptance_lengths: Vec<usize>,
    /// Mean acceptance length (tau), counting the bonus.
    pub tau: f64,
    /// Tokens that came from the draft / tokens generated.
    pub acceptance_ratio: f64,
    /// `histogram[k]` = cycles that committed k tokens (index 0 unused).
    pub histogram: Vec<usize>,
    /// Whether the adaptive block-size policy chose the block sizes.
    pub adaptive: bool,
    /// `q_histogram[q]` = cycles that verified q rows (q = 1: a plain step).
    pub q_histogram: Vec<usize>,
    /// Why the policy chose its block sizes: reason -> cycles.
    pub q_reasons: std::collections::BTreeMap<String, usize>,
    /// Peak resident memory of the process, bytes (Linux VmHWM), if known.
    pub peak_memory_bytes: Option<u64>,
    /// "stop" (a stop token), "length" (max tokens), "context" (context size), "cancelled".
    pub finish_reason: String,
}

impl GenerationStats {
    /// Fill the derived fields from the raw counts.
    pub fn finish(&mut self, draft_tokens: usize) {
        let n = self.acceptance_lengths.len();
        self.cycles = n;
        self.tau = if n > 0 {
            self.acceptance_lengths.iter().sum::<usize>() as f64 / n as f64
        } else {
            0.0
        };
        self.acceptance_ratio = if self.generated_tokens > 0 {
            draft_tokens as f64 / self.generated_tokens as f64
        } else {
            0.0
        };
        let maxl = self
            .acceptance_lengths
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(self.block_size);
        let mut h = vec![0; maxl + 1];
        for &a in &self.acceptance_lengths {
            h[a] += 1;
        }
        self.histogram = h;
        self.peak_memory_bytes = peak_rss_bytes();
    }

    /// One human line for stderr.
    pub fn line(&self) -> String {
        let mut s = format!(
            "[{}] prompt {} tok, prefill {:.1} tok/s, TTFT {:.1} ms, generated {} tok, decode {:.2} tok/s",
            self.mode, self.prompt_tokens, self.prefill_tok_s, self.ttft_ms, self.generated_tokens, self.decode_tok_s
        );
        if self.mode == "dflash" {
            s += &format!(
                ", block {}, tau {:.2}, acceptance {:.1}%, cycles {}",
                self.block_size,
                self.tau,
                100.0 * self.acceptance_ratio,
                self.cycles
            );
        }
        if self.adaptive {
            let used: Vec<String> = self
                .q_histogram
                .iter()
                .enumerate()
                .filter(|(_, &n)| n > 0)
                .map(|(q, n)| format!("q{q}x{n}"))
                .collect();
            s += &format!(", adaptive [{}]", used.join(" "));
        }
        if let Some(r) = &self.fallback_reason {
            s += &format!(" (plain decoding: {r})");
        }
        s += &format!(", finish: {}", self.finish_reason);
        s
    }
}

/// Peak resident set size (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Under `DFLASH_PROFILE=ncu` (the micro bench's verify forwards), `ncu-draft` (its draft
/// proposals) or `ncu-batch` (batch steps of 8 or more sequences) on a CUDA build, when `what`
/// is the one asked for: profile collection on until the guard drops (cuProfilerStart /
/// cuProfilerStop), so `ncu --profile-from-start off` sees only what it brackets.
#[cfg(feature = "cuda")]
pub fn profiler_range(
    what: crate::switches::Profile,
) -> Option<candle_core::cuda_backend::cudarc::driver::Profiler> {
    (crate::switches::get().profile == what)
        .then(|| candle_core::cuda_backend::cudarc::driver::Profiler::new().ok())
        .flatten()
}
#[cfg(not(feature = "cuda"))]
pub fn profiler_range(_: crate::switches::Profile) -> Option<()> {
    None
}

/// Under `DFLASH_PROFILE=<what>`: counts a call in `counter` and, when it is one of `steps`
/// (0-based: past the warm-up, in the steady state), keeps the profiler's collection on until
/// the returned guard drops ([`profiler_range`]). The batch engine's steps (`ncu-batch`) and
/// the trainer's (`ncu-train`).
pub fn profiled_steps(
    what: crate::switches::Profile,
    counter: &std::sync::atomic::AtomicUsize,
    steps: std::ops::Range<usize>,
) -> Option<Box<dyn std::any::Any>> {
    if crate::switches::get().profile != what {
        return None;
    }
    let k = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    steps
        .contains(&k)
        .then(|| profiler_range(what))
        .flatten()
        .map(|g| Box::new(g) as Box<dyn std::any::Any>)
}

/// Where a forward pass spends its time, for `DFLASH_PROFILE` runs only; `finish` prints one
/// line to stderr. Off (no syncs, no clock reads) unless the variable is set.
/// - `DFLASH_PROFILE=1`: each `mark` synchronizes the device and charges the wall time since
///   the previous mark to a label (the syncs change what they measure on a GPU: every section
///   then pays a launch and a sync);
/// - `DFLASH_PROFILE=gpu` (CUDA): each `mark` records a CUDA event instead, and `finish` syncs
///   once and charges the GPU time between events: the kernels' own time per section, as long
///   as the host keeps ahead of the GPU (it does on the H200: docs/perf.md, run 5).
pub struct SectionTimer {
    dev: Option<candle_core::Device>,
    what: &'static str,
    last: std::time::Instant,
    acc: Vec<(&'static str, f64)>,
    #[cfg(feature = "cuda")]
    events: Option<
        Vec<(
            &'static str,
            candle_core::cuda_backend::cudarc::driver::CudaEvent,
        )>,
    >,
}

use crate::switches::Profile as ProfileMode;

impl SectionTimer {
    fn mode() -> ProfileMode {
        crate::switches::get().profile
    }

    pub fn enabled() -> bool {
        Self::mode() != ProfileMode::Off
    }

    #[cfg(feature = "cuda")]
    fn event(
        dev: &candle_core::Device,
    ) -> Option<candle_core::cuda_backend::cudarc::driver::CudaEvent> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
        let stream = dev.as_cuda_device().ok()?.cuda_stream();
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .ok()
    }

    pub fn start(what: &'static str, dev: &candle_core::Device) -> Self {
        let mode = Self::mode();
        let dev = (mode != ProfileMode::Off).then(|| dev.clone());
        #[cfg(feature = "cuda")]
        let events = match &dev {
            Some(d) if mode == ProfileMode::Gpu && d.is_cuda() => {
                Self::event(d).map(|e| vec![("", e)])
            }
            _ => None,
        };
        #[cfg(feature = "cuda")]
        let sync = events.is_none();
        #[cfg(not(feature = "cuda"))]
        let sync = true;
        if let (Some(d), true) = (&dev, sync) {
            let _ = d.synchronize();
        }
        Self {
            dev,
            what,
            last: std::time::Instant::now(),
            acc: Vec::new(),
            #[cfg(feature = "cuda")]
            events,
        }
    }

    fn charge(&mut self, label: &'static str, ms: f64) {
        match self.acc.iter_mut().find(|(l, _)| *l == label) {
            Some((_, t)) => *t += ms,
            None => self.acc.push((label, ms)),
        }
    }

    pub fn mark(&mut self, label: &'static str) {
        let Some(d) = &self.dev else { return };
        #[cfg(feature = "cuda")]
        if let Some(ev) = &mut self.events {
            if let Some(e) = Self::event(d) {
                ev.push((label, e));
            }
            return;
        }
        let _ = d.synchronize();
        let now = std::time::Instant::now();
        let ms = (now - self.last).as_secs_f64() * 1e3;
        self.last = now;
        self.charge(label, ms);
    }

    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    pub fn finish(mut self) {
        if self.dev.is_none() {
            return;
        }
        #[cfg(feature = "cuda")]
        if let Some(ev) = self.events.take() {
            for w in ev.windows(2) {
                if let Ok(ms) = w[0].1.elapsed_ms(&w[1].1) {
                    self.charge(w[1].0, ms as f64);
                }
            }
        }
        if self.acc.is_empty() {
            return; // nothing marked (a forward that took no timed section): no empty line
        }
        let total: f64 = self.acc.iter().map(|(_, t)| t).sum();
        let parts: Vec<String> = self
            .acc
            .iter()
            .map(|(l, t)| format!("{l} {t:.3}"))
            .collect();
        eprintln!(
            "profile {}: total {total:.3} ms = {}",
            self.what,
            parts.join(", ")
        );
    }
}
