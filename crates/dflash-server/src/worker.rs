//! The engine thread: one generation at a time, fed by a bounded queue. Candle work never
//! runs on the async runtime. Detokenization and stop strings are done here too, so that a
//! stop string stops the engine at once.

use crate::api::{ApiError, Finish};
use crate::metrics::Metrics;
use axum::http::StatusCode;
use dflash::engine::{Engine, Flow, GenerateRequest};
use dflash::tokenizer::{TextStream, Tokenizer};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// What the engine thread sends back for one request.
#[derive(Debug)]
pub enum Event {
    /// Newly final text (never part of a stop string).
    Text(String),
    Done(Finish),
    Error(ApiError),
}

pub struct Job {
    pub req: GenerateRequest,
    pub stop_strings: Vec<String>,
    pub deadline: Instant,
    pub events: UnboundedSender<Event>,
}

/// Flags shared by the HTTP side and the engine thread.
#[derive(Default)]
pub struct Control {
    /// No new work: queued jobs are refused.
    pub draining: AtomicBool,
    /// Stop the running generation now.
    pub cancel_running: AtomicBool,
}

/// Incremental stop-string matching over streamed text: text that could still become a stop
/// string is held back; a match cuts the text before it.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            pending: String::new(),
        }
    }

    /// Adds text; returns the text that is now final and the stop string matched, if any
    /// (then nothing after it may be emitted).
    pub fn push(&mut self, text: &str) -> (String, Option<String>) {
        if self.stops.is_empty() {
            return (text.to_string(), None);
        }
        self.pending.push_str(text);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|p| (p, s)))
            .min_by_key(|(p, _)| *p);
        if let Some((pos, s)) = hit {
            let s = s.clone();
            let out = self.pending[..pos].to_string();
            self.pending.clear();
            return (out, Some(s));
        }
        // Hold back the longest suffix that is a proper prefix of a stop string.
        let mut keep = 0;
        for s in &self.stops {
            for l in (1..s.len()).rev() {
                if l <= keep {
                    break;
                }
                if s.is_char_boundary(l) && self.pending.ends_with(&s[..l]) {
                    keep = l;
                    break;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, None)
    }

    /// The held-back text, at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Runs jobs until the queue's senders are gone.
pub fn run(
    engine: Engine,
    tokenizer: Tokenizer,
    jobs: std::sync::mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
    control: Arc<Control>,
) {
    while let Ok(job) = jobs.recv() {
        metrics.dequeued();
        if job.events.is_closed() {
            metrics.finished("cancelled", None);
            continue;
        }
        if control.draining.load(Ordering::SeqCst) {
            let _ = job.events.send(Event::Error(shutting_down()));
            metrics.error("server_shutting_down");
            continue;
        }
        if Instant::now() >= job.deadline {
            let _ = job.events.send(Event::Error(timeout_error()));
            metrics.error("timeout_error");
            continue;
        }
        metrics.set_running(true);
        let events = job.events.clone();
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            run_job(&engine, &tokenizer, job, &metrics, &control)
        }));
        if r.is_err() {
            let _ = events.send(Event::Error(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "the engine panicked on this request; see the server log",
            )));
            metrics.error("server_error");
        }
        metrics.set_running(false);
    }
}

pub fn shutting_down() -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_shutting_down",
        "the server is shutting down",
    );
    e.retry_after_s = Some(1);
    e
}

pub fn timeout_error() -> ApiError {
    ApiError::new(
        StatusCode::GATEWAY_TIMEOUT,
        "timeout_error",
        "the request timed out waiting for the engine",
    )
    .with_code("timeout")
}

fn run_job(engine: &Engine, tok: &Tokenizer, job: Job, metrics: &Metrics, control: &Control) {
    let Job {
        req,
        stop_strings,
        deadline,
        events,
    } = job;
    let mut stream = TextStream::with_prompt(tok, &req.prompt_ids, true);
    let mut matcher = StopMatcher::new(stop_strings);
    let mut stopped_by: Option<String> = None;
    let mut cancelled = false;
    let mut timed_out = false;
    let mut decode_err: Option<String> = None;
    let send = |text: String| {
        if !text.is_empty() {
            let _ = events.send(Event::Text(text));
        }
    };
    let result = engine.generate(&req, &mut |ids| {
        let mut text = String::new();
        for &id in ids {
            if req.stop_ids.contains(&id) {
                continue; // a stop token ends the text and is not part of it
            }
            match stream.push(id) {
                Ok(t) => text.push_str(&t),
                Err(e) => {
                    decode_err = Some(e.to_string());
                    return Flow::Stop;
                }
            }
        }
        let (out, hit) = matcher.push(&text);
        send(out);
        if hit.is_some() {
            stopped_by = hit;
            return Flow::Stop;
        }
        if events.is_closed() || control.cancel_running.load(Ordering::SeqCst) {
            cancelled = true;
            return Flow::Stop;
        }
        if Instant::now() >= deadline {
            timed_out = true;
            return Flow::Stop;
        }
        Flow::Continue
    });
    let out = match result {
        Ok(o) => o,
        Err(e) => {
            let err = match e {
                dflash::Error::Input(m) => {
                    ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", m)
                }
                e => ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    e.to_string(),
                ),
            };
            metrics.error(err.kind);
            let _ = events.send(Event::Error(err));
            return;
        }
    };
    if let Some(m) = decode_err {
        metrics.error("server_error");
        let _ = events.send(Event::Error(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("decoding the generated tokens: {m}"),
        )));
        return;
    }
    if stopped_by.is_none() && !cancelled {
        if let Ok(t) = stream.flush() {
            let (o, hit) = matcher.push(&t);
            send(o);
            stopped_by = hit;
        }
        if stopped_by.is_none() {
            send(matcher.finish());
        }
    }
    let finish_reason = if stopped_by.is_some() || out.stats.finish_reason == "stop" {
        "stop"
    } else {
        "length"
    };
    let label = if cancelled {
        "cancelled"
    } else if timed_out {
        "timeout"
    } else {
        finish_reason
    };
    metrics.finished(label, Some(&out.stats));
    let _ = events.send(Event::Done(Finish {
        finish_reason,
        prompt_tokens: req.prompt_ids.len(),
        completion_tokens: out.output_ids.len(),
        stats: out.stats,
        timed_out,
        stopped_by,
    }));
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, Option<String>) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = vec![];
        for p in pieces {
            let (o, hit) = m.push(p);
            out.push(o);
            if hit.is_some() {
                return (out, hit);
            }
        }
        out.push(m.finish());
        (out, None)
    }

    #[test]
    fn stop_string_across_pieces_is_cut_and_never_leaks() {
        let (out, hit) = run(&["o w"], &["hel", "lo", " wo", "rld"]);
        assert_eq!(hit.as_deref(), Some("o w"));
        assert_eq!(out.concat(), "hell");
        // "lo" was held back as a possible start of "o w" until it could not be
        assert_eq!(out, vec!["hel", "l", ""]);
    }

    #[test]
    fn held_back_prefix_is_released_when_it_does_not_match() {
        let (out, hit) = run(&["abc"], &["xa", "b", "d", "e"]);
        assert_eq!(hit, None);
        assert_eq!(out.concat(), "xabde");
        assert_eq!(out[0], "x");
        assert_eq!(out[1], "");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_unicode_is_safe() {
        let (out, hit) = run(&["zz", "é!"], &["caf", "é", "!zz"]);
        assert_eq!(hit.as_deref(), Some("é!"));
        assert_eq!(out.concat(), "caf");
        let (out, hit) = run(&[], &["a", "b"]);
        assert_eq!((out.concat(), hit), ("ab".to_string(), None));
    }
}
