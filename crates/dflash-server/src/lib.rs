//! `dflash serve`: an OpenAI-compatible HTTP server over the dflash engine.
//!
//! ```text
//! HTTP (axum, tokio) -- parse + validate + tokenize --> bounded queue --> engine thread
//!       ^                                                              (one generation at a time,
//!       +---------- text deltas / finish / error (per-request channel) -- detokenize, stop strings)
//! ```
//! The engine is synchronous and CPU-bound: it runs on its own OS thread, never on the async
//! runtime. A full queue is a 503 with Retry-After. A client that goes away closes its
//! channel; the engine's token callback sees that and stops within one decode cycle.

pub mod api;
pub mod metrics;
pub mod output;
pub mod structured;
pub mod worker;

use crate::api::{dflash_ext, json_body, usage, ApiError, Finish, Kind, Limits, Prepared};
use crate::metrics::Metrics;
use crate::output::{Delta, Message, OutputParser, ReasoningFormat, ToolFormat};
use crate::worker::{Control, Event, Job};
use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use dflash::chat::ChatTemplate;
use dflash::engine::GenerateRequest;
use dflash::pipeline::{Pipeline, PipelineOptions};
use dflash::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Everything `dflash serve` is configured with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub pipeline: PipelineOptions,
    /// The id clients use in `model` and see in /v1/models; None = the model spec.
    pub served_model_name: Option<String>,
    pub host: String,
    pub port: u16,
    /// max_tokens when a request gives none.
    pub max_tokens_default: usize,
    /// Verify block size; None = the draft's.
    pub block_size: Option<usize>,
    /// Bearer token required on /v1/* when set.
    pub api_key: Option<String>,
    /// `Host` header names accepted (empty: loopback names when bound to a loopback address,
    /// any name otherwise).
    pub allowed_hosts: Vec<String>,
    /// `Origin`s whose pages may call the server from a browser (CORS); `*` = any. Empty: a
    /// request with an `Origin` header gets 403 unless it is from the server's own origin.
    pub allowed_origins: Vec<String>,
    /// A request's headers must arrive within this of the connection opening or of the
    /// previous response on it (so it also closes idle keep-alive connections).
    pub header_timeout: Duration,
    /// A request's body must arrive within this once its headers are in; else 408.
    pub body_timeout: Duration,
    /// Encode special-token text in chat message content as the special token (the old,
    /// injectable behaviour); default: as ordinary text.
    pub allow_special_tokens_in_content: bool,
    /// Requests that may wait for the engine besides the ones running; more get 503.
    pub max_queue: usize,
    /// Bytes of KV cache (and recurrent state) the running generations may hold together;
    /// a request waits in the queue until its caches fit. None: 90% of what the memory check
    /// left after the weights, less the prefix cache's budget (unbounded when memory was not
    /// checked).
    pub kv_cache_bytes: Option<u64>,
    /// Generations decoded together (one draft call and one verify per cycle for all); the
    /// rest wait in the queue.
    pub max_num_seqs: usize,
    /// Bytes of finished requests' caches kept for prompts that share a prefix (0 = off).
    pub prefix_cache_bytes: usize,
    /// Queue wait + generation; a generation past it stops (finish_reason "length",
    /// `dflash.timed_out`), a request still queued gets 504.
    pub request_timeout: Duration,
    pub max_body_bytes: usize,
    /// After SIGTERM / ctrl-c: how long the running generation may go on before it is
    /// cancelled. Queued requests are refused with 503 at once.
    pub shutdown_grace: Duration,
    /// The tool-call syntax (`--tool-call-parser`).
    pub tool_call_parser: ParserChoice<ToolFormat>,
    /// The reasoning syntax (`--reasoning-parser`).
    pub reasoning_parser: ParserChoice<ReasoningFormat>,
}

/// A parser flag: found from the model's chat template and type, turned off, or named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ParserChoice<T> {
    #[default]
    Auto,
    Off,
    Use(T),
}

impl<T: Copy> ParserChoice<T> {
    /// The parser in use, and how it was chosen (for the start-up line).
    fn resolve(self, detected: Option<T>) -> (Option<T>, &'static str) {
        match self {
            ParserChoice::Auto => (detected, "from the model's chat template and type"),
            ParserChoice::Off => (None, "turned off"),
            ParserChoice::Use(t) => (Some(t), "as asked"),
        }
    }
}

impl ServerConfig {
    pub fn new(pipeline: PipelineOptions) -> Self {
        Self {
            pipeline,
            served_model_name: None,
            host: "127.0.0.1".into(),
            port: 8000,
            max_tokens_default: 256,
            block_size: None,
            api_key: None,
            allowed_hosts: Vec::new(),
            allow_special_tokens_in_content: false,
            allowed_origins: Vec::new(),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            max_queue: 64,
            max_num_seqs: 8,
            kv_cache_bytes: None,
            prefix_cache_bytes: 1 << 30,
            request_timeout: Duration::from_secs(600),
            max_body_bytes: 4 << 20,
            shutdown_grace: Duration::from_secs(10),
            tool_call_parser: ParserChoice::Auto,
            reasoning_parser: ParserChoice::Auto,
        }
    }
}

/// Shared state of the HTTP side.
pub struct App {
    cfg: ServerConfig,
    limits: Limits,
    model_name: String,
    tokenizer: Tokenizer,
    template: Option<Arc<ChatTemplate>>,
    stop_ids: Vec<u32>,
    jobs: SyncSender<Job>,
    metrics: Arc<Metrics>,
    control: Arc<Control>,
    started: u64,
    next_id: AtomicU64,
    draft_name: Option<String>,
    block_size: usize,
    /// Request preparation (parse, template, tokenize) running at once: bounded, so that
    /// many large bodies cannot all be expanded in memory together.
    preparing: Arc<tokio::sync::Semaphore>,
    /// `Host` names accepted, lower case (empty: any).
    hosts: Vec<String>,
    /// `Origin`s allowed to call from a browser, lower case, without a trailing `/`.
    origins: Vec<String>,
    /// Which output parsers are on, and why (printed at start).
    parsers: String,
    /// Structured output's view of the vocabulary, built at the first request that asks for
    /// a grammar (or why it cannot be).
    grammar: std::sync::OnceLock<std::result::Result<dflash::grammar::GrammarCompiler, String>>,
}

/// The `Host` names a server bound to `host` accepts: `allowed` when given, else the loopback
/// names for a loopback bind (a page on another site that resolves its own name to 127.0.0.1,
/// DNS rebinding, sends its own name) and any name for other binds.
fn allowed_hosts(host: &str, allowed: &[String]) -> Vec<String> {
    if !allowed.is_empty() {
        return allowed
            .iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .collect();
    }
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if loopback {
        ["localhost", "127.0.0.1", "[::1]"]
            .map(String::from)
            .to_vec()
    } else {
        Vec::new()
    }
}

/// The name part of a `Host` header (`name:port`, `[v6]:port`), lower case.
fn host_name(h: &str) -> String {
    let h = h.trim();
    let name = if h.starts_with('[') {
        h.split_inclusive(']').next().unwrap_or(h)
    } else {
        match h.rsplit_once(':') {
            Some((n, p)) if p.chars().all(|c| c.is_ascii_digit()) => n,
            _ => h,
        }
    };
    name.to_ascii_lowercase()
}

async fn check_host(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if app.hosts.is_empty() {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(host_name);
    if given.as_ref().is_some_and(|g| app.hosts.contains(g)) {
        return next.run(req).await;
    }
    let e = ApiError::new(
        StatusCode::FORBIDDEN,
        "permission_error",
        format!(
            "the Host `{}` is not one this server answers to ({}); start it with --allowed-hosts NAME to allow it",
            given.unwrap_or_default().chars().take(100).collect::<String>(),
            app.hosts.join(", ")
        ),
    )
    .with_code("host_not_allowed");
    fail(&app, "other", e)
}

/// Most request headers, and most bytes of them (names + values), before a 431 with a JSON
/// error. hyper itself refuses heads beyond its read buffer (about 400 KB) or
/// `HYPER_MAX_HEADERS` headers with a bare 431 and closes the connection.
pub const MAX_HEADERS: usize = 100;
pub const MAX_HEADER_BYTES: usize = 64 << 10;
const HYPER_MAX_HEADERS: usize = 1000;

async fn check_header_size(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let h = req.headers();
    let bytes: usize = h.iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
    if h.len() <= MAX_HEADERS && bytes <= MAX_HEADER_BYTES {
        return next.run(req).await;
    }
    let e = ApiError::new(
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        "invalid_request_error",
        format!(
            "the request has {} headers of {bytes} bytes; at most {MAX_HEADERS} headers of {MAX_HEADER_BYTES} bytes in all are accepted",
            h.len()
        ),
    )
    .with_code("headers_too_large");
    fail(&app, "other", e)
}

/// An origin as compared: lower case, no trailing `/`.
fn normal_origin(o: &str) -> String {
    o.trim().trim_end_matches('/').to_ascii_lowercase()
}

/// Whether `origin` (normalized) is the server's own as addressed by `host` (the `Host`
/// header): the same name and port, a missing port being the scheme's default.
fn same_origin(origin: &str, host: &str) -> bool {
    let (scheme, authority) = match origin.split_once("://") {
        Some(x) => x,
        None => return false,
    };
    let default = match scheme {
        "http" => "80",
        "https" => "443",
        _ => return false,
    };
    let with_port = |a: &str| -> String {
        let a = a.trim().to_ascii_lowercase();
        let has_port = if a.starts_with('[') {
            a.contains("]:")
        } else {
            a.contains(':')
        };
        if has_port {
            a
        } else {
            format!("{a}:{default}")
        }
    };
    with_port(authority) == with_port(host)
}

/// Browser requests (they carry `Origin`): from an allowed origin they get CORS headers (a
/// preflight `OPTIONS` is answered here, before authentication, as browsers send it without
/// credentials); from the server's own origin (its `Host` on the host allowlist) they pass
/// without; from any other origin they are refused (403 `origin_not_allowed`), so a web page
/// cannot make a browser use the server, not even with a "simple" request that needs no
/// preflight. Requests without `Origin` (curl, SDKs) are not affected.
async fn check_origin(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(raw) = req.headers().get(header::ORIGIN).cloned() else {
        return next.run(req).await;
    };
    let origin = normal_origin(raw.to_str().unwrap_or(""));
    let allowed = app.origins.iter().any(|o| o == "*" || *o == origin);
    if !allowed {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let own = !app.hosts.is_empty()
            && app.hosts.contains(&host_name(host))
            && same_origin(&origin, host);
        if own {
            return next.run(req).await;
        }
        let e = ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            format!(
                "requests from web pages of the origin `{}` are not allowed; start the server with --allowed-origins ORIGIN to allow them",
                origin.chars().take(100).collect::<String>()
            ),
        )
        .with_code("origin_not_allowed");
        return fail(&app, "other", e);
    }
    let vary = header::HeaderValue::from_static(
        "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
    );
    let preflight = req.method() == axum::http::Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let asked = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or_else(|| header::HeaderValue::from_static("authorization, content-type"));
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, raw);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            header::HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            header::HeaderValue::from_static("600"),
        );
        h.insert(header::VARY, vary);
        return record(&app, "other", r);
    }
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, raw);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        header::HeaderValue::from_static("retry-after"),
    );
    h.append(header::VARY, vary);
    r
}

/// The id a model is served under by default: a local path's last component (the full path,
/// which may show a home directory, stays accepted as an alias), a hub id as given.
fn default_model_id(name: &str) -> String {
    let p = std::path::Path::new(name);
    match (p.exists(), p.file_name().and_then(|f| f.to_str())) {
        (true, Some(f)) if !f.is_empty() => f.to_string(),
        _ => name.to_string(),
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Loads the model and starts the engine thread. Returns the state to serve and the thread.
pub fn start(cfg: ServerConfig) -> Result<(Arc<App>, std::thread::JoinHandle<()>)> {
    let p = Pipeline::load(&cfg.pipeline)?;
    let Pipeline {
        engine,
        tokenizer,
        template,
        stop_ids,
        model_name,
        draft_name,
        cache_room,
        target_config,
        ..
    } = p;
    let source = template.as_ref().map_or("", |t| t.source());
    let model_type = target_config.model_type.as_str();
    let (tool_format, how_tools) = cfg
        .tool_call_parser
        .resolve(ToolFormat::detect(source, model_type));
    let (reasoning_format, how_reasoning) = cfg
        .reasoning_parser
        .resolve(ReasoningFormat::detect(source, model_type));
    let parsers = format!(
        "tool-call parser: {} ({how_tools}); reasoning parser: {} ({how_reasoning})",
        tool_format.map_or("none", ToolFormat::name),
        reasoning_format.map_or("none", ReasoningFormat::name),
    );
    let kv_budget = cfg
        .kv_cache_bytes
        .or_else(|| cache_room.map(|r| r.saturating_sub(cfg.prefix_cache_bytes as u64) / 10 * 9));
    let tokenizer = tokenizer.with_context(|| {
        format!(
            "model {model_name} has no tokenizer.json: the server needs one to read and write text"
        )
    })?;
    let mut engine = engine;
    engine.enable_prefix_cache(cfg.prefix_cache_bytes);
    let vocab_size = engine.target.info().vocab_size;
    let max_context = engine.max_context;
    let block_size = match (&engine.draft, cfg.block_size) {
        (None, _) => 1,
        (Some(d), None) => d.block_size(),
        (Some(_), Some(b)) => b.max(1),
    };
    let served = cfg
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_model_id(&model_name));
    let mut names = vec![served.clone()];
    if model_name != served {
        names.push(model_name.clone());
    }
    let limits = Limits {
        model_names: names,
        vocab_size,
        max_context,
        max_tokens_default: cfg.max_tokens_default,
        max_stop: 16,
        special_tokens_in_content: cfg.allow_special_tokens_in_content,
        tool_format,
        reasoning_format,
    };
    let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(cfg.max_queue);
    let metrics = Arc::new(Metrics::default());
    let control = Arc::new(Control::default());
    let thread = {
        let (m, c, t) = (metrics.clone(), control.clone(), tokenizer.clone());
        let max_seqs = cfg.max_num_seqs;
        std::thread::Builder::new()
            .name("dflash-engine".into())
            .spawn(move || worker::run(engine, t, rx, m, c, max_seqs, kv_budget))?
    };
    let hosts = allowed_hosts(&cfg.host, &cfg.allowed_hosts);
    let origins = cfg
        .allowed_origins
        .iter()
        .map(|o| normal_origin(o))
        .filter(|o| !o.is_empty())
        .collect();
    let app = Arc::new(App {
        cfg,
        limits,
        model_name: served,
        tokenizer,
        template: template.map(Arc::new),
        stop_ids,
        jobs: tx,
        metrics,
        control,
        started: now_s(),
        next_id: AtomicU64::new(1),
        draft_name,
        block_size,
        hosts,
        origins,
        parsers,
        grammar: Default::default(),
        preparing: Arc::new(tokio::sync::Semaphore::new(
            std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .max(2),
        )),
    });
    Ok((app, thread))
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_by_id))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // (the last layer runs first: header size, then Host, then Origin)
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            check_origin,
        ))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            check_host,
        ))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            check_header_size,
        ))
        .with_state(app)
}

/// Serves until `shutdown` resolves, then drains: open connections finish their responses
/// (idle ones close), and the running generation gets `shutdown_grace` to finish before it is
/// cancelled.
///
/// Each connection is served by hyper's HTTP/1 connection with a timer, so that its
/// header-read timeout applies: a client must send a request's headers within
/// `header_timeout` of connecting or of its previous response, else the connection is closed
/// (half-sent requests and idle keep-alive connections do not stay open).
pub async fn serve(
    app: Arc<App>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let control = app.control.clone();
    let grace = app.cfg.shutdown_grace;
    let signal = async move {
        shutdown.await;
        eprintln!("dflash serve: shutting down (running generation gets {grace:?})");
        control.draining.store(true, Ordering::SeqCst);
        let c = control.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            c.cancel_running.store(true, Ordering::SeqCst);
        });
    };
    let header_timeout = app.cfg.header_timeout;
    let service = router(app);
    // `stop` tells the connections to finish; each holds a `done` sender, so that `recv`
    // returns None once every connection has ended.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<()>(1);
    let mut signal = std::pin::pin!(signal);
    loop {
        let tcp = tokio::select! {
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // out of file descriptors and the like: wait, as axum::serve does
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut signal => break,
        };
        let _ = tcp.set_nodelay(true);
        let svc = hyper_util::service::TowerToHyperService::new(service.clone());
        let (mut stop, done) = (stop_rx.clone(), done_tx.clone());
        tokio::spawn(async move {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_headers(HYPER_MAX_HEADERS);
            let conn = b.serve_connection(hyper_util::rt::TokioIo::new(tcp), svc);
            let mut conn = std::pin::pin!(conn);
            let stopping = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stopping => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.as_mut().await;
                }
            }
            drop(done);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(done_tx);
    let _ = done_rx.recv().await;
    Ok(())
}

/// SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// `dflash serve`: load, bind, print the address, serve until SIGTERM / ctrl-c.
pub fn run(cfg: ServerConfig) -> Result<()> {
    let (host, port) = (cfg.host.clone(), cfg.port);
    let (app, engine_thread) = start(cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = TcpListener::bind((host.as_str(), port))
            .await
            .with_context(|| format!("binding {host}:{port}"))?;
        let addr = listener.local_addr()?;
        eprintln!("dflash serve: {}", app.parsers);
        eprintln!(
            "dflash serve: model `{}` listening on http://{addr}",
            app.model_name
        );
        serve(app, listener, shutdown_signal()).await
    })?;
    // The router (and with it the queue's sender) is gone: the engine thread ends.
    let _ = engine_thread.join();
    eprintln!("dflash serve: stopped");
    Ok(())
}

// ---- handlers ----

fn record(app: &App, endpoint: &str, r: Response) -> Response {
    app.metrics.request(endpoint, r.status().as_u16());
    r
}

fn fail(app: &App, endpoint: &str, e: ApiError) -> Response {
    app.metrics.error(e.kind);
    record(app, endpoint, e.into_response())
}

fn check_auth(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.cfg.api_key else {
        return Ok(());
    };
    // the scheme is case-insensitive (RFC 6750 / 7235)
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(rest)
        })
        .map(str::trim);
    if given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        if given.is_none() {
            "missing API key: send `Authorization: Bearer <key>`"
        } else {
            "invalid API key"
        },
    )
    .with_code("invalid_api_key"))
}

/// Byte strings equal, in time that depends on their lengths only (no early exit on the first
/// differing byte: the API key cannot be guessed byte by byte from response times).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// A POST body must be declared JSON: a web page can make a browser send `text/plain` or form
/// bodies to any address without a preflight, and this refuses them (415).
fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = ct.split(';').next().unwrap_or("").trim();
    if mime.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
        format!(
            "`Content-Type` must be `application/json`, got {}; send the header (curl: -H 'Content-Type: application/json')",
            if ct.is_empty() { "none".to_string() } else { format!("`{}`", ct.chars().take(100).collect::<String>()) }
        ),
    )
    .with_code("unsupported_media_type"))
}

/// The request body, at most `--max-body-bytes` (413: a declared `Content-Length` beyond it
/// is refused before reading), within `--body-timeout` (408); a body that ends before its
/// `Content-Length` (the client closed or broke the connection) is a 400 naming the body.
async fn read_body(app: &App, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    use futures_util::StreamExt;
    let limit = app.cfg.max_body_bytes;
    let too_large = |n: String| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than {limit} bytes ({n}); send less, or start the server with a larger --max-body-bytes"),
        )
        .with_code("request_too_large")
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > limit as u64) {
        return Err(too_large(format!("Content-Length {n}")));
    }
    let read = async {
        let mut buf = Vec::with_capacity(declared.unwrap_or(0) as usize);
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    format!(
                        "the request body could not be read: it ended after {} bytes{} ({e})",
                        buf.len(),
                        declared.map_or(String::new(), |n| format!(
                            " of the {n} its Content-Length declares"
                        ))
                    ),
                )
                .with_code("incomplete_body")
            })?;
            if buf.len() + chunk.len() > limit {
                return Err(too_large("sent without a Content-Length".into()));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    let t = app.cfg.body_timeout;
    match tokio::time::timeout(t, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("the request body did not arrive within {t:?} (--body-timeout)"),
        )
        .with_code("body_timeout")),
    }
}

async fn not_found(State(app): State<Arc<App>>) -> Response {
    let e = ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        "no such endpoint; see /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics",
    );
    fail(&app, "other", e)
}

async fn method_not_allowed(State(app): State<Arc<App>>) -> Response {
    let e = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method not allowed on this endpoint",
    );
    fail(&app, "other", e)
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let draining = app.control.draining.load(Ordering::SeqCst);
    let status = if draining {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let v = json!({
        "status": if draining { "shutting_down" } else { "ok" },
        "model": app.model_name,
        "queue_depth": app.metrics.queue_depth().max(0),
    });
    let mut r = json_body(&v);
    *r.status_mut() = status;
    record(&app, "/health", r)
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    app.metrics.request("/metrics", 200);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
        .into_response()
}

fn model_object(app: &App) -> Value {
    json!({
        "id": app.model_name,
        "object": "model",
        "created": app.started,
        "owned_by": "dflash",
        "max_model_len": app.limits.max_context,
        "dflash": {"draft": app.draft_name, "block_size": app.block_size},
    })
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = check_auth(&app, &headers) {
        return fail(&app, "/v1/models", e);
    }
    let v = json!({"object": "list", "data": [model_object(&app)]});
    record(&app, "/v1/models", json_body(&v))
}

/// `GET /v1/models/{id}` (the SDK's `models.retrieve`): the model under any name it is
/// served as, else 404 `model_not_found`.
async fn model_by_id(
    State(app): State<Arc<App>>,
    axum::extract::Path(id): axum::extract::Path<String>,
    headers: HeaderMap,
) -> Response {
    const EP: &str = "/v1/models/{id}";
    if let Err(e) = check_auth(&app, &headers) {
        return fail(&app, EP, e);
    }
    if !app.limits.model_names.contains(&id) {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!(
                "the model `{}` does not exist; this server serves `{}`",
                id.chars().take(200).collect::<String>(),
                app.model_name
            ),
        )
        .with_code("model_not_found");
        e.param = Some("model".into());
        return fail(&app, EP, e);
    }
    record(&app, EP, json_body(&model_object(&app)))
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    handle(app, Kind::Chat, headers, body).await
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    handle(app, Kind::Completion, headers, body).await
}

/// Parse, validate and tokenize, and compile the request's grammar (CPU work: runs on the
/// blocking pool).
fn prepare(
    app: &App,
    kind: Kind,
    body: &[u8],
) -> Result<(Prepared, Option<dflash::grammar::Grammar>), ApiError> {
    let p = api::prepare(
        kind,
        body,
        &app.limits,
        &app.tokenizer,
        app.template.as_deref(),
    )?;
    let grammar = match &p.grammar {
        None => None,
        Some((field, spec)) => {
            let compiler = app.grammar.get_or_init(|| {
                dflash::grammar::GrammarCompiler::new(
                    &app.tokenizer,
                    app.limits.vocab_size,
                    &app.stop_ids,
                )
                .map_err(|e| e.to_string())
            });
            let c = compiler.as_ref().map_err(|e| {
                ApiError::invalid(
                    field,
                    format!("structured output is not available for this model: {e}"),
                )
                .with_code("unsupported_parameter")
            })?;
            Some(c.compile(spec).map_err(|e| {
                ApiError::invalid(field, format!("`{field}`: {e}")).with_code("invalid_grammar")
            })?)
        }
    };
    Ok((p, grammar))
}

async fn handle(app: Arc<App>, kind: Kind, headers: HeaderMap, body: Body) -> Response {
    let ep = kind.endpoint();
    if let Err(e) = check_auth(&app, &headers) {
        return fail(&app, ep, e);
    }
    if let Err(e) = check_content_type(&headers) {
        return fail(&app, ep, e);
    }
    if app.control.draining.load(Ordering::SeqCst) {
        return fail(&app, ep, worker::shutting_down());
    }
    let bytes = match read_body(&app, &headers, body).await {
        Ok(b) => b,
        Err(e) => return fail(&app, ep, e),
    };
    let a = app.clone();
    // (the permit is held while the body is expanded, then released)
    let Ok(permit) = app.preparing.clone().acquire_owned().await else {
        return fail(&app, ep, worker::shutting_down());
    };
    let (prepared, grammar) =
        match tokio::task::spawn_blocking(move || prepare(&a, kind, &bytes)).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return fail(&app, ep, e),
            Err(_) => {
                return fail(
                    &app,
                    ep,
                    ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "request parsing failed unexpectedly",
                    ),
                )
            }
        };
    drop(permit);
    let Prepared {
        common,
        prompt_ids,
        max_tokens,
        mut output,
        grammar: _,
    } = prepared;
    let mut stop_ids = if common.ignore_eos {
        vec![]
    } else {
        app.stop_ids.clone()
    };
    stop_ids.extend(&common.stop_ids);
    let req = GenerateRequest {
        prompt_ids,
        max_tokens,
        sampling: common.sampling.clone(),
        stop_ids,
        block_size: app.cfg.block_size,
        adaptive: true,
        trace: false,
        grammar,
    };
    let (tx, rx) = unbounded_channel();
    let timeout = app.cfg.request_timeout;
    let job = Job {
        req,
        stop_strings: common.stop_strings.clone(),
        deadline: Instant::now() + timeout,
        events: tx,
        // harmony channels, Kimi's sections and Gemma 4's calls are special tokens
        skip_special: !output.needs_special_tokens(),
    };
    app.metrics.enqueued();
    match app.jobs.try_send(job) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            app.metrics.dequeued();
            app.metrics.rejected_full();
            let mut e = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_overloaded",
                format!(
                    "the engine is busy and {} requests are already waiting; retry later",
                    app.cfg.max_queue
                ),
            )
            .with_code("queue_full");
            e.retry_after_s = Some(1);
            return fail(&app, ep, e);
        }
        Err(TrySendError::Disconnected(_)) => {
            app.metrics.dequeued();
            return fail(&app, ep, worker::shutting_down());
        }
    }
    let id = format!(
        "{}-{:x}{:04x}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        app.started,
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    output.id_prefix = format!("call_{}_", id.rsplit('-').next().unwrap_or(""));
    let ctx = ChunkCtx {
        id,
        created: now_s(),
        model: app.model_name.clone(),
        kind,
        include_usage: common.include_usage,
        parser: (kind == Kind::Chat && output.active()).then(|| OutputParser::new(output)),
    };
    if common.stream {
        app.metrics.request(ep, 200);
        return stream_response(ctx, rx);
    }
    collect_response(app, ctx, rx, timeout).await
}

async fn collect_response(
    app: Arc<App>,
    mut ctx: ChunkCtx,
    mut rx: UnboundedReceiver<Event>,
    timeout: Duration,
) -> Response {
    let ep = ctx.kind.endpoint();
    let mut msg = Message::default();
    let parser = &mut ctx.parser;
    let wait = async {
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Text(t) => match parser.as_mut() {
                    Some(p) => p.push(&t).into_iter().for_each(|d| msg.add(d)),
                    None => msg.content.push_str(&t),
                },
                Event::Done(f) => {
                    if let Some(p) = parser.as_mut() {
                        p.finish().into_iter().for_each(|d| msg.add(d));
                    }
                    return Ok(f);
                }
                Event::Error(e) => return Err(e),
            }
        }
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the engine dropped the request",
        ))
    };
    // The engine enforces the deadline itself; this only guards against a stuck queue.
    let r = match tokio::time::timeout(timeout + Duration::from_secs(5), wait).await {
        Ok(r) => r,
        Err(_) => Err(worker::timeout_error()),
    };
    match r {
        Ok(f) => {
            let v = ctx.full(&msg, &f);
            record(&app, ep, json_body(&v))
        }
        Err(e) => fail(&app, ep, e),
    }
}

/// What every chunk of one response shares.
struct ChunkCtx {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    include_usage: bool,
    /// Splits a chat response into content, reasoning and tool calls (None: all content).
    parser: Option<OutputParser>,
}

/// A tool call as the API shows it (`message.tool_calls[i]`, `delta.tool_calls[i]`).
fn tool_call_json(c: &crate::output::ToolCall) -> Value {
    json!({"index": c.index, "id": c.id, "type": "function",
        "function": {"name": c.name, "arguments": c.arguments}})
}

impl ChunkCtx {
    /// "tool_calls" when the generation stopped after making calls (OpenAI's), else the
    /// engine's reason.
    fn finish_reason(&self, f: &Finish) -> &'static str {
        match &self.parser {
            Some(p) if p.called() && f.finish_reason == "stop" => "tool_calls",
            _ => f.finish_reason,
        }
    }

    fn full(&self, m: &Message, f: &Finish) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let calls = !m.tool_calls.is_empty();
                let mut message = json!({"role": "assistant",
                    "content": if calls && m.content.trim().is_empty() { Value::Null } else { m.content.clone().into() }});
                if !m.reasoning.is_empty() {
                    message["reasoning_content"] = m.reasoning.clone().into();
                }
                if calls {
                    message["tool_calls"] = m
                        .tool_calls
                        .iter()
                        .map(|c| {
                            let mut v = tool_call_json(c);
                            v.as_object_mut().map(|o| o.remove("index"));
                            v
                        })
                        .collect();
                }
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": null,
                    "finish_reason": self.finish_reason(f),
                })
            }
            Kind::Completion => json!({
                "index": 0,
                "text": m.content,
                "logprobs": null,
                "finish_reason": f.finish_reason,
            }),
        };
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(f),
            "dflash": dflash_ext(f),
        })
    }

    fn chunk(&self, choices: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn delta(&self, text: Option<&str>, role: bool, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut d = json!({});
                if role {
                    d["role"] = "assistant".into();
                }
                if let Some(t) = text {
                    d["content"] = t.into();
                }
                json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": finish})
            }
            Kind::Completion => json!({
                "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
            }),
        };
        self.chunk(json!([choice]))
    }

    /// A chunk for one parsed delta.
    fn parsed(&self, d: &Delta) -> Value {
        let delta = match d {
            Delta::Content(t) => json!({ "content": t }),
            Delta::Reasoning(t) => json!({ "reasoning_content": t }),
            Delta::ToolCall(c) => json!({ "tool_calls": [tool_call_json(c)] }),
        };
        self.chunk(json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]))
    }

    /// SSE events for one engine event.
    fn events(&mut self, ev: Event, out: &mut VecDeque<SseEvent>) {
        let data = |v: Value| SseEvent::default().data(v.to_string());
        match ev {
            Event::Text(t) => match self.parser.as_mut() {
                Some(p) => {
                    let ds = p.push(&t);
                    ds.iter().for_each(|d| out.push_back(data(self.parsed(d))));
                }
                None => out.push_back(data(self.delta(Some(&t), false, None))),
            },
            Event::Done(f) => {
                if let Some(p) = self.parser.as_mut() {
                    let ds = p.finish();
                    ds.iter().for_each(|d| out.push_back(data(self.parsed(d))));
                }
                let mut last = self.delta(None, false, Some(self.finish_reason(&f)));
                last["dflash"] = dflash_ext(&f);
                out.push_back(data(last));
                if self.include_usage {
                    let mut u = self.chunk(json!([]));
                    u["usage"] = usage(&f);
                    u["dflash"] = dflash_ext(&f);
                    out.push_back(data(u));
                }
                out.push_back(SseEvent::default().data("[DONE]"));
            }
            Event::Error(e) => {
                out.push_back(data(e.body()));
                out.push_back(SseEvent::default().data("[DONE]"));
            }
        }
    }
}

fn stream_response(mut ctx: ChunkCtx, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut buf: VecDeque<SseEvent> = VecDeque::new();
    if ctx.kind == Kind::Chat {
        buf.push_back(SseEvent::default().data(ctx.delta(Some(""), true, None).to_string()));
    }
    let mut ended = false;
    // The stream owns the receiver: when the client goes away the response body (and the
    // receiver) is dropped, and the engine stops at its next callback.
    let stream = futures_util::stream::poll_fn(move |cx| loop {
        if let Some(e) = buf.pop_front() {
            return Poll::Ready(Some(Ok::<_, std::convert::Infallible>(e)));
        }
        if ended {
            return Poll::Ready(None);
        }
        match rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(ev)) => {
                if matches!(ev, Event::Done(_) | Event::Error(_)) {
                    ended = true;
                }
                ctx.events(ev, &mut buf);
            }
            Poll::Ready(None) => {
                ended = true;
                ctx.events(
                    Event::Error(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "the engine dropped the request",
                    )),
                    &mut buf,
                );
            }
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_model_is_served_under_its_name_not_its_path() {
        let dir = std::env::temp_dir().join("dflash-model-id-test");
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(
            default_model_id(dir.to_str().unwrap()),
            "dflash-model-id-test"
        );
        assert_eq!(default_model_id("Qwen/Qwen3-8B"), "Qwen/Qwen3-8B");
    }

    #[test]
    fn host_names_and_the_default_allowlist() {
        assert_eq!(host_name("127.0.0.1:8000"), "127.0.0.1");
        assert_eq!(host_name("LocalHost"), "localhost");
        assert_eq!(host_name("[::1]:80"), "[::1]");
        assert_eq!(host_name("evil.example:8000"), "evil.example");
        let lo = allowed_hosts("127.0.0.1", &[]);
        assert!(
            lo.contains(&"localhost".to_string()) && lo.len() == 3,
            "{lo:?}"
        );
        assert_eq!(allowed_hosts("::1", &[]).len(), 3);
        assert_eq!(allowed_hosts("localhost", &[]).len(), 3);
        assert!(allowed_hosts("0.0.0.0", &[]).is_empty());
        assert_eq!(
            allowed_hosts("0.0.0.0", &["Box.Lan".into()]),
            vec!["box.lan".to_string()]
        );
    }

    #[test]
    fn keys_compare_whole() {
        assert!(constant_time_eq(b"sekret", b"sekret"));
        assert!(!constant_time_eq(b"sekret", b"sekreT"));
        assert!(!constant_time_eq(b"sekret", b"sekret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
