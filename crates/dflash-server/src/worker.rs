//! The engine thread: up to `--max-num-seqs` generations decoded together, fed by a bounded
//! queue (queued requests join the batch between cycles). Candle work never runs on the async
//! runtime. Detokenization and stop strings are done here too, so that a stop string stops
//! its generation at once.

use crate::api::{ApiError, Finish};
use crate::metrics::Metrics;
use axum::http::StatusCode;
use dflash::engine::{Batch, Engine, Flow, GenerateRequest, Sequence};
use dflash::tokenizer::{TextStream, Tokenizer};
use std::cell::RefCell;
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// What the engine thread sends back for one request.
#[derive(Debug)]
pub enum Event {
    /// Newly final text (never part of a stop string).
    Text(String),
    Done(Box<Finish>),
    Error(ApiError),
}

pub struct Job {
    pub req: GenerateRequest,
    pub stop_strings: Vec<String>,
    pub deadline: Instant,
    pub events: UnboundedSender<Event>,
    /// Leave special tokens out of the text (false where the output parser reads them).
    pub skip_special: bool,
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

/// Runs jobs until the queue's senders are gone: up to `max_seqs` generations at once, decoded
/// together (`dflash::engine::Batch`: one draft call and one verify per cycle for all of
/// them); queued jobs join between cycles, in order, while their caches fit in `kv_budget`
/// bytes (`Engine::request_cache_bytes`; a job that does not fit waits for running ones to
/// end, and one that could never fit is refused naming `max_tokens`).
pub fn run(
    engine: Engine,
    tokenizer: Tokenizer,
    jobs: std::sync::mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
    control: Arc<Control>,
    max_seqs: usize,
    kv_budget: Option<u64>,
) {
    let max_seqs = max_seqs.max(1);
    let mut batch = Batch::new(&engine);
    // (batch id, state, cache bytes it holds)
    let mut running: Vec<(usize, Rc<RefCell<Running>>, u64)> = Vec::new();
    // a job taken from the queue whose caches did not fit yet: first in line
    let mut waiting: Option<Job> = None;
    let mut next_id = 0usize;
    let mut open = true;
    while open || !batch.is_empty() || waiting.is_some() {
        // Admit: wait for work when idle, else take what is queued (up to the limit).
        while (open || waiting.is_some()) && batch.len() < max_seqs {
            let job = if let Some(j) = waiting.take() {
                j
            } else if batch.is_empty() {
                match jobs.recv() {
                    Ok(j) => j,
                    Err(_) => {
                        open = false;
                        break;
                    }
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
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
            let need = match engine.request_cache_bytes(&job.req) {
                Ok(b) => b,
                Err(e) => {
                    send_engine_error(&job.events, &metrics, e);
                    continue;
                }
            };
            if let Some(budget) = kv_budget {
                let used: u64 = running.iter().map(|r| r.2).sum();
                if need > budget {
                    let _ = job.events.send(Event::Error(ApiError::invalid(
                        "max_tokens",
                        format!(
                            "this request's caches need {} MiB (prompt + max_tokens positions), more than the {} MiB this server gives all running requests (--kv-cache-mb); lower max_tokens or shorten the prompt",
                            need.div_ceil(1 << 20),
                            budget >> 20
                        ),
                    ).with_code("kv_cache_exceeded")));
                    metrics.error("invalid_request_error");
                    continue;
                }
                if used + need > budget {
                    // wait (first in line) until running generations free their caches
                    metrics.requeued();
                    waiting = Some(job);
                    break;
                }
            }
            let state = Rc::new(RefCell::new(Running::new(&tokenizer, job)));
            let req = state.borrow().req.clone();
            let cb = {
                let state = state.clone();
                let control = control.clone();
                Box::new(move |ids: &[u32]| state.borrow_mut().on_tokens(ids, &control))
                    as Box<dyn FnMut(&[u32]) -> Flow>
            };
            let events = state.borrow().events.clone();
            let started =
                std::panic::catch_unwind(AssertUnwindSafe(|| Sequence::new(&engine, req, cb)));
            match started {
                Ok(Ok(seq)) => {
                    batch.push(next_id, seq);
                    running.push((next_id, state, need));
                    next_id += 1;
                }
                Ok(Err(e)) => send_engine_error(&events, &metrics, e),
                Err(_) => send_panic(&events, &metrics),
            }
        }
        metrics.set_running(batch.len());
        // Clients gone and deadlines passed are also checked between steps, not only when
        // tokens are committed: a long prompt prefills over many steps (a chunk each) and
        // commits nothing meanwhile, so leaving frees the engine within one chunk.
        let mut k = 0;
        while k < running.len() {
            let gone = running[k].1.borrow().gone(&control);
            let Some(why) = gone else {
                k += 1;
                continue;
            };
            let (id, st, _) = running.swap_remove(k);
            if let Some(seq) = batch.take(id) {
                let out = seq.finish();
                let mut st = Rc::try_unwrap(st)
                    .ok()
                    .map(RefCell::into_inner)
                    .expect("the sequence (and its callback) ended");
                st.end(why);
                st.done(out, &metrics);
            }
        }
        metrics.set_running(batch.len());
        if batch.is_empty() {
            continue;
        }
        let ended = match std::panic::catch_unwind(AssertUnwindSafe(|| batch.step())) {
            Ok(e) => e,
            Err(_) => {
                // A panic inside a shared step: every running generation ends with the error.
                for (_, st, _) in running.drain(..) {
                    send_panic(&st.borrow().events, &metrics);
                }
                batch = Batch::new(&engine);
                metrics.set_running(0);
                continue;
            }
        };
        for (id, result) in ended {
            let Some(k) = running.iter().position(|(i, _, _)| *i == id) else {
                continue;
            };
            let (_, st, _) = running.swap_remove(k);
            let st = Rc::try_unwrap(st)
                .ok()
                .map(RefCell::into_inner)
                .expect("the sequence (and its callback) ended");
            match result {
                Ok(out) => st.done(out, &metrics),
                Err(e) => send_engine_error(&st.events.clone(), &metrics, e),
            }
        }
        metrics.set_running(batch.len());
    }
}

fn send_panic(events: &UnboundedSender<Event>, metrics: &Metrics) {
    let _ = events.send(Event::Error(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the engine panicked on this request; see the server log",
    )));
    metrics.error("server_error");
}

fn send_engine_error(events: &UnboundedSender<Event>, metrics: &Metrics, e: dflash::Error) {
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

/// A generation the server's shutdown cut (after `--shutdown-grace`).
pub fn cut_by_shutdown() -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_shutting_down",
        "the server shut down before this generation finished (its --shutdown-grace ran out); the text so far is incomplete: retry the request",
    )
    .with_code("server_shutdown");
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

/// One running request: its text stream, stop strings and what ended it.
struct Running {
    req: GenerateRequest,
    deadline: Instant,
    events: UnboundedSender<Event>,
    stream: TextStream,
    matcher: StopMatcher,
    stopped_by: Option<String>,
    cancelled: bool,
    timed_out: bool,
    /// Cancelled by the server's shutdown (after `--shutdown-grace`), not by its client.
    shutdown: bool,
    decode_err: Option<String>,
}

/// Why a running request ends before its engine is done with it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Gone {
    /// Its client went away.
    Left,
    /// The server is shutting down and the grace period is over.
    Shutdown,
    /// `--request-timeout` passed.
    Deadline,
}

impl Running {
    fn new(tok: &Tokenizer, job: Job) -> Self {
        let Job {
            req,
            stop_strings,
            deadline,
            events,
            skip_special,
        } = job;
        Self {
            stream: TextStream::with_prompt(tok, &req.prompt_ids, skip_special),
            matcher: StopMatcher::new(stop_strings),
            req,
            deadline,
            events,
            stopped_by: None,
            cancelled: false,
            timed_out: false,
            shutdown: false,
            decode_err: None,
        }
    }

    fn send(&self, text: String) {
        if !text.is_empty() {
            let _ = self.events.send(Event::Text(text));
        }
    }

    /// Whether the request should end now, and why.
    fn gone(&self, control: &Control) -> Option<Gone> {
        if self.events.is_closed() {
            Some(Gone::Left)
        } else if control.cancel_running.load(Ordering::SeqCst) {
            Some(Gone::Shutdown)
        } else if Instant::now() >= self.deadline {
            Some(Gone::Deadline)
        } else {
            None
        }
    }

    fn end(&mut self, why: Gone) {
        self.timed_out = why == Gone::Deadline;
        self.cancelled = why != Gone::Deadline;
        self.shutdown = why == Gone::Shutdown;
    }

    /// Newly committed ids: text out, stop strings, cancellation and the deadline.
    fn on_tokens(&mut self, ids: &[u32], control: &Control) -> Flow {
        let mut text = String::new();
        for &id in ids {
            if self.req.stop_ids.contains(&id) {
                continue; // a stop token ends the text and is not part of it
            }
            match self.stream.push(id) {
                Ok(t) => text.push_str(&t),
                Err(e) => {
                    self.decode_err = Some(e.to_string());
                    return Flow::Stop;
                }
            }
        }
        let (out, hit) = self.matcher.push(&text);
        self.send(out);
        if hit.is_some() {
            self.stopped_by = hit;
            return Flow::Stop;
        }
        match self.gone(control) {
            Some(why) => {
                self.end(why);
                Flow::Stop
            }
            None => Flow::Continue,
        }
    }

    /// The generation ended: the held-back text, then the finish event.
    fn done(mut self, out: dflash::engine::GenerateOutput, metrics: &Metrics) {
        if let Some(m) = self.decode_err.take() {
            metrics.error("server_error");
            let _ = self.events.send(Event::Error(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                format!("decoding the generated tokens: {m}"),
            )));
            return;
        }
        if self.shutdown {
            // Not an ordinary stop: the client gets an error (a stream: an error event, then
            // [DONE]), so that it does not take the cut text for a finished answer.
            metrics.finished("shutdown", Some(&out.stats));
            metrics.error("server_shutting_down");
            let _ = self.events.send(Event::Error(cut_by_shutdown()));
            return;
        }
        if self.stopped_by.is_none() && !self.cancelled {
            if let Ok(t) = self.stream.flush() {
                let (o, hit) = self.matcher.push(&t);
                self.send(o);
                self.stopped_by = hit;
            }
            if self.stopped_by.is_none() {
                let rest = self.matcher.finish();
                self.send(rest);
            }
        }
        let finish_reason = if self.stopped_by.is_some() || out.stats.finish_reason == "stop" {
            "stop"
        } else {
            "length"
        };
        let label = if self.cancelled {
            "cancelled"
        } else if self.timed_out {
            "timeout"
        } else {
            finish_reason
        };
        metrics.finished(label, Some(&out.stats));
        let _ = self.events.send(Event::Done(Box::new(Finish {
            finish_reason,
            prompt_tokens: self.req.prompt_ids.len(),
            completion_tokens: out.output_ids.len(),
            stats: out.stats,
            timed_out: self.timed_out,
            stopped_by: self.stopped_by,
        })));
    }
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
