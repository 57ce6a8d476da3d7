//! `dflash serve`: the OpenAI-compatible server (crate `dflash-server`).

use anyhow::{bail, Result};
use clap::Args;
use dflash_server::output::{ReasoningFormat, ToolFormat};
use dflash_server::{ParserChoice, ServerConfig};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub m: crate::flags::ModelFlags,
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
    /// Require `Authorization: Bearer KEY` on /v1/* (also read from DFLASH_API_KEY). Shows
    /// in `ps`: prefer --api-key-file.
    #[arg(long, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from this file (its first line; not shown in `ps`).
    #[arg(long)]
    pub api_key_file: Option<std::path::PathBuf>,
    /// Host names clients may address the server as (the `Host` header), comma-separated;
    /// default when bound to a loopback address: localhost, 127.0.0.1 and [::1] only (a web
    /// page cannot reach it through a DNS name it controls); when bound elsewhere: any.
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Web origins whose pages may call the server from a browser (CORS), comma-separated
    /// (`http://localhost:3000`; `*` = any). Default: none; a request carrying an `Origin`
    /// header from another origin gets 403.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Seconds a client has to send a request's headers, from connecting or from the
    /// previous response (so idle keep-alive connections close after it too).
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a client has to send a request's body once its headers are in (else 408).
    #[arg(long, default_value_t = 60.0)]
    pub body_timeout: f64,
    /// Encode special-token text in chat messages (`<|im_end|>` in a user message) as the
    /// special token, as before issue 24: a client can then forge turn boundaries. Default:
    /// such text in message content is encoded as ordinary text.
    #[arg(long)]
    pub allow_special_tokens_in_content: bool,
    /// Requests that may wait for the engine besides the running ones; more get 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Generations decoded together (one draft call and one verify per cycle for all of
    /// them); 1 = one at a time.
    #[arg(long, default_value_t = 8)]
    pub max_num_seqs: usize,
    /// MiB of finished requests' caches kept for later prompts that start the same way (a
    /// shared system prompt, the earlier turns of a chat); 0 = off.
    #[arg(long, default_value_t = 1024)]
    pub prefix_cache_mb: usize,
    /// MiB of KV cache the running requests may hold together; a request waits in the queue
    /// until its caches fit (default: 90% of the memory left after the weights, less the
    /// prefix cache).
    #[arg(long)]
    pub kv_cache_mb: Option<u64>,
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
    /// How the model writes tool calls, parsed into `tool_calls` (default `auto`: from the
    /// model's chat template and type; `none`: requests with `tools` are refused).
    #[arg(long, default_value = "auto", value_parser = ["auto", "none", "hermes", "qwen3_coder", "gpt_oss", "llama3_json", "kimi_k2", "gemma4"])]
    pub tool_call_parser: String,
    /// How the model writes its reasoning, parsed into `reasoning_content` (default `auto`:
    /// from the template; `qwen3` = `<think>` blocks, `gpt_oss` = the analysis channel;
    /// `none`: all text is content).
    #[arg(long, default_value = "auto", value_parser = ["auto", "none", "qwen3", "gpt_oss"])]
    pub reasoning_parser: String,
}

/// A parser flag's value (clap has checked it is one of the listed names).
fn parser_choice<T>(v: &str, named: impl Fn(&str) -> Option<T>) -> ParserChoice<T> {
    match v {
        "auto" => ParserChoice::Auto,
        "none" => ParserChoice::Off,
        n => named(n).map_or(ParserChoice::Auto, ParserChoice::Use),
    }
}

fn seconds(flag: &str, s: f64) -> Result<Duration> {
    if !(s.is_finite() && s > 0.0) {
        bail!("{flag} {s}: expected a positive number of seconds");
    }
    Ok(Duration::from_secs_f64(s))
}

pub fn config(a: ServeArgs) -> Result<ServerConfig> {
    if a.max_tokens_default == 0 {
        bail!("--max-tokens-default must be at least 1");
    }
    let mut c = ServerConfig::new(a.m.pipeline(a.max_context)?);
    c.served_model_name = a.served_model_name;
    c.host = a.host;
    c.port = a.port;
    c.max_tokens_default = a.max_tokens_default;
    c.block_size = a.block_size;
    let from_file = match &a.api_key_file {
        None => None,
        Some(p) => {
            let t = std::fs::read_to_string(p)
                .map_err(|e| anyhow::anyhow!("--api-key-file {}: {e}", p.display()))?;
            let k = t.lines().next().unwrap_or("").trim().to_string();
            if k.is_empty() {
                bail!(
                    "--api-key-file {}: the file's first line is empty",
                    p.display()
                );
            }
            Some(k)
        }
    };
    c.api_key = from_file
        .or(a.api_key)
        .or_else(|| std::env::var("DFLASH_API_KEY").ok())
        .filter(|k| !k.is_empty());
    c.allowed_hosts = a.allowed_hosts;
    c.allow_special_tokens_in_content = a.allow_special_tokens_in_content;
    c.allowed_origins = a.allowed_origins;
    c.header_timeout = seconds("--header-timeout", a.header_timeout)?;
    c.body_timeout = seconds("--body-timeout", a.body_timeout)?;
    c.max_queue = a.max_queue;
    if a.max_num_seqs == 0 {
        anyhow::bail!("--max-num-seqs must be at least 1");
    }
    c.max_num_seqs = a.max_num_seqs;
    c.prefix_cache_bytes = a.prefix_cache_mb << 20;
    c.kv_cache_bytes = a.kv_cache_mb.map(|m| m << 20);
    c.request_timeout = seconds("--request-timeout", a.request_timeout)?;
    c.max_body_bytes = a.max_body_bytes;
    c.shutdown_grace = Duration::from_secs_f64(a.shutdown_grace.max(0.0));
    c.tool_call_parser = parser_choice(&a.tool_call_parser, ToolFormat::from_name);
    c.reasoning_parser = parser_choice(&a.reasoning_parser, ReasoningFormat::from_name);
    Ok(c)
}

pub fn run(a: ServeArgs) -> Result<()> {
    dflash_server::run(config(a)?)
}
