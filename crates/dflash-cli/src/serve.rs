//! `dflash serve`: the OpenAI-compatible server (crate `dflash-server`).

use anyhow::{bail, Result};
use clap::Args;
use dflash::pipeline::PipelineOptions;
use dflash_server::ServerConfig;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Target model: a local directory (HF layout) or a hub repo id (Org/Name).
    #[arg(long)]
    pub model: Option<String>,
    /// DFlash draft: a local directory or a hub repo id. Without it: plain decoding.
    #[arg(long)]
    pub draft: Option<String>,
    /// The model id clients send and /v1/models lists (default: the --model value).
    #[arg(long)]
    pub served_model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 = any free port (the address is printed on stderr).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// max_tokens for requests that give none.
    #[arg(long, default_value_t = 256)]
    pub max_tokens_default: usize,
    /// Largest context (prompt + generated); default: the model's.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Require `Authorization: Bearer KEY` on /v1/* (also read from DFLASH_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests that may wait for the engine besides the running one; more get 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Seconds a request may take, queue wait included.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Largest request body, bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Seconds the running generation may continue after SIGTERM / ctrl-c.
    #[arg(long, default_value_t = 10.0)]
    pub shutdown_grace: f64,
    /// Verify block size (default: the draft's); 1 = plain decoding.
    #[arg(long)]
    pub block_size: Option<usize>,
    /// f32 | bf16 | f16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long)]
    pub dtype: Option<String>,
    /// cpu | cuda | cuda:N.
    #[arg(long)]
    pub device: Option<String>,
    /// Load even when the weights + KV cache for the context do not fit in the memory
    /// available (RAM on the CPU, free device memory on CUDA).
    #[arg(long)]
    pub force_memory: bool,
    /// Memory to plan with instead of what the machine reports, e.g. 8G or 512M.
    #[arg(long)]
    pub memory_limit: Option<String>,
}

/// The target to serve: `--model`, or the demo default model when none is given.

pub fn resolve_model_spec(model: Option<&str>) -> Result<String> {
    Ok(dflash::pipeline::resolve_model_spec(model)?)
}

fn seconds(flag: &str, s: f64) -> Result<Duration> {
    if !(s.is_finite() && s > 0.0) {
        bail!("{flag} {s}: expected a positive number of seconds");
    }
    Ok(Duration::from_secs_f64(s))
}

pub fn config(a: ServeArgs) -> Result<ServerConfig> {
    let model = resolve_model_spec(a.model.as_deref())?;
    if a.max_tokens_default == 0 {
        bail!("--max-tokens-default must be at least 1");
    }
    let mut c = ServerConfig::new(PipelineOptions {
        model,
        draft: a.draft,
        dtype: a.dtype,
        device: a.device,
        max_context: a.max_context,
        no_draft: false,
        require_draft: false,
        keep_quant: false,
        force_memory: a.force_memory,
        memory_limit: a
            .memory_limit
            .as_deref()
            .map(dflash::memory::parse_bytes)
            .transpose()?,
    });
    c.served_model_name = a.served_model_name;
    c.host = a.host;
    c.port = a.port;
    c.max_tokens_default = a.max_tokens_default;
    c.block_size = a.block_size;
    c.api_key = a
        .api_key
        .or_else(|| std::env::var("DFLASH_API_KEY").ok())
        .filter(|k| !k.is_empty());
    c.max_queue = a.max_queue;
    c.request_timeout = seconds("--request-timeout", a.request_timeout)?;
    c.max_body_bytes = a.max_body_bytes;
    c.shutdown_grace = Duration::from_secs_f64(a.shutdown_grace.max(0.0));
    Ok(c)
}

pub fn run(a: ServeArgs) -> Result<()> {
    dflash_server::run(config(a)?)
}
