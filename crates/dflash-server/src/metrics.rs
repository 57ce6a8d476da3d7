//! Counters and gauges for `GET /metrics` (Prometheus text format 0.0.4).

use dflash::stats::GenerationStats;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Default)]
struct Gen {
    /// By finish label: stop, length, timeout, cancelled.
    finished: BTreeMap<String, u64>,
    prompt_tokens: u64,
    generated_tokens: u64,
    /// Generations that started from the prefix cache, and the prompt tokens it gave them.
    prefix_hits: u64,
    prefix_tokens: u64,
    last_decode_tok_s: f64,
    last_tau: f64,
    last_acceptance_ratio: f64,
    sum_decode_tok_s: f64,
    sum_tau: f64,
    sum_acceptance_ratio: f64,
    count: u64,
}

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    errors: Mutex<BTreeMap<String, u64>>,
    gen: Mutex<Gen>,
    queue_depth: AtomicI64,
    running: AtomicI64,
    rejected_full: AtomicU64,
}

impl Metrics {
    pub fn request(&self, endpoint: &str, status: u16) {
        *self
            .requests
            .lock()
            .unwrap()
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }
    pub fn error(&self, kind: &str) {
        *self
            .errors
            .lock()
            .unwrap()
            .entry(kind.to_string())
            .or_default() += 1;
    }
    pub fn enqueued(&self) {
        self.queue_depth.fetch_add(1, Ordering::SeqCst);
    }
    pub fn dequeued(&self) {
        self.queue_depth.fetch_sub(1, Ordering::SeqCst);
    }
    /// A dequeued job goes back to wait (its caches did not fit yet).
    pub fn requeued(&self) {
        self.queue_depth.fetch_add(1, Ordering::SeqCst);
    }
    pub fn queue_depth(&self) -> i64 {
        self.queue_depth.load(Ordering::SeqCst)
    }
    pub fn rejected_full(&self) {
        self.rejected_full.fetch_add(1, Ordering::SeqCst);
    }
    /// Generations in the engine's batch.
    pub fn set_running(&self, n: usize) {
        self.running.store(n as i64, Ordering::SeqCst);
    }
    pub fn finished(&self, label: &str, stats: Option<&GenerationStats>) {
        let mut g = self.gen.lock().unwrap();
        *g.finished.entry(label.to_string()).or_default() += 1;
        if let Some(s) = stats {
            g.prompt_tokens += s.prompt_tokens as u64;
            g.generated_tokens += s.generated_tokens as u64;
            if s.cached_prompt_tokens > 0 {
                g.prefix_hits += 1;
                g.prefix_tokens += s.cached_prompt_tokens as u64;
            }
            g.last_decode_tok_s = s.decode_tok_s;
            g.last_tau = s.tau;
            g.last_acceptance_ratio = s.acceptance_ratio;
            g.sum_decode_tok_s += s.decode_tok_s;
            g.sum_tau += s.tau;
            g.sum_acceptance_ratio += s.acceptance_ratio;
            g.count += 1;
        }
    }

    pub fn render(&self) -> String {
        let mut o = String::new();
        let family = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        family(
            &mut o,
            "dflash_requests_total",
            "counter",
            "HTTP requests by endpoint and status code.",
        );
        for ((ep, st), n) in self.requests.lock().unwrap().iter() {
            let _ = writeln!(
                o,
                "dflash_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}"
            );
        }
        family(
            &mut o,
            "dflash_errors_total",
            "counter",
            "Error responses by OpenAI error type.",
        );
        for (k, n) in self.errors.lock().unwrap().iter() {
            let _ = writeln!(o, "dflash_errors_total{{type=\"{k}\"}} {n}");
        }
        family(
            &mut o,
            "dflash_queue_rejections_total",
            "counter",
            "Requests refused with 503 because the queue was full.",
        );
        let _ = writeln!(
            o,
            "dflash_queue_rejections_total {}",
            self.rejected_full.load(Ordering::SeqCst)
        );
        {
            let g = self.gen.lock().unwrap();
            for (name, help, v) in [
                (
                    "dflash_prefix_cache_hits_total",
                    "Generations that started from a cached prefix.",
                    g.prefix_hits,
                ),
                (
                    "dflash_prefix_cache_tokens_total",
                    "Prompt tokens restored from the prefix cache instead of prefilled.",
                    g.prefix_tokens,
                ),
            ] {
                family(&mut o, name, "counter", help);
                let _ = writeln!(o, "{name} {v}");
            }
        }
        family(
            &mut o,
            "dflash_queue_depth",
            "gauge",
            "Requests waiting for the engine.",
        );
        let _ = writeln!(o, "dflash_queue_depth {}", self.queue_depth().max(0));
        family(
            &mut o,
            "dflash_requests_running",
            "gauge",
            "Generations running on the engine.",
        );
        let _ = writeln!(
            o,
            "dflash_requests_running {}",
            self.running.load(Ordering::SeqCst)
        );
        let g = self.gen.lock().unwrap();
        family(
            &mut o,
            "dflash_generations_total",
            "counter",
            "Finished generations by outcome.",
        );
        for (k, n) in g.finished.iter() {
            let _ = writeln!(o, "dflash_generations_total{{outcome=\"{k}\"}} {n}");
        }
        for (name, help, v) in [
            (
                "dflash_prompt_tokens_total",
                "Prompt tokens prefilled.",
                g.prompt_tokens,
            ),
            (
                "dflash_generation_tokens_total",
                "Tokens generated.",
                g.generated_tokens,
            ),
        ] {
            family(&mut o, name, "counter", help);
            let _ = writeln!(o, "{name} {v}");
        }
        for (name, help, last, sum) in [
            (
                "dflash_decode_tokens_per_second",
                "Decode throughput of generations (tokens after the first per second).",
                g.last_decode_tok_s,
                g.sum_decode_tok_s,
            ),
            (
                "dflash_tau",
                "Mean acceptance length (tokens committed per verify cycle).",
                g.last_tau,
                g.sum_tau,
            ),
            (
                "dflash_acceptance_ratio",
                "Share of generated tokens that came from the draft.",
                g.last_acceptance_ratio,
                g.sum_acceptance_ratio,
            ),
        ] {
            family(&mut o, name, "gauge", &format!("{help} Last generation."));
            let _ = writeln!(o, "{name} {last}");
            family(
                &mut o,
                &format!("{name}_per_generation"),
                "summary",
                &format!("{help} Sum and count over generations."),
            );
            let _ = writeln!(o, "{name}_per_generation_sum {sum}");
            let _ = writeln!(o, "{name}_per_generation_count {}", g.count);
        }
        o
    }
}
