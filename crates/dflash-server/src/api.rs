//! The OpenAI wire format: error objects, request parsing and validation (every bad input is
//! a 4xx naming the field), and the response / stream chunk bodies.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use dflash::chat::{ChatMessage, ChatTemplate};
use dflash::sampling::SamplingParams;
use dflash::stats::GenerationStats;
use dflash::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use std::collections::HashMap;

use crate::output::{ParserConfig, ReasoningFormat, ToolFormat};

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_s: None,
        }
    }
    /// 400 naming the offending field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = Some(param.to_string());
        e
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, json_body(&self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// A JSON response body with its content type.
pub fn json_body(v: &Value) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string(v).expect("json"),
    )
        .into_response()
}

/// Typed access to the fields of a request object, naming the field on error.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    pub fn f32(&self, k: &str) -> Result<Option<f32>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64().map(|x| x as f32)),
            Some(v) => Err(ApiError::invalid(
                k,
                format!("`{k}` must be a number, got {}", type_name(v)),
            )),
        }
    }
    pub fn i64(&self, k: &str) -> Result<Option<i64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_i64() {
                Some(x) => Ok(Some(x)),
                None if n.as_u64().is_some() => {
                    Err(ApiError::invalid(k, format!("`{k}` is out of range: {n}")))
                }
                None => Err(ApiError::invalid(
                    k,
                    format!("`{k}` must be an integer, got {n}"),
                )),
            },
            Some(v) => Err(ApiError::invalid(
                k,
                format!("`{k}` must be an integer, got {}", type_name(v)),
            )),
        }
    }
    pub fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid(
                k,
                format!("`{k}` must be a boolean, got {}", type_name(v)),
            )),
        }
    }
    pub fn str(&self, k: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::invalid(
                k,
                format!("`{k}` must be a string, got {}", type_name(v)),
            )),
        }
    }
    pub fn object(&self, k: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o)),
            Some(v) => Err(ApiError::invalid(
                k,
                format!("`{k}` must be an object, got {}", type_name(v)),
            )),
        }
    }
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What the server knows about its model, for validation.
#[derive(Debug, Clone)]
pub struct Limits {
    pub model_names: Vec<String>,
    pub vocab_size: usize,
    pub max_context: usize,
    pub max_tokens_default: usize,
    pub max_stop: usize,
    /// Message content may contain special tokens (`--allow-special-tokens-in-content`, the
    /// old behaviour); by default their text in content is encoded as ordinary text.
    pub special_tokens_in_content: bool,
    /// The model's tool-call syntax (from its template, or `--tool-call-parser`); None:
    /// requests with `tools` are refused.
    pub tool_format: Option<ToolFormat>,
    /// The model's reasoning syntax (`--reasoning-parser`); None: all text is content.
    pub reasoning_format: Option<ReasoningFormat>,
}

/// Most messages one chat request may carry.
pub const MAX_MESSAGES: usize = 8192;
/// Text bytes a prompt may carry per token of context, checked before tokenizing (a token is
/// rarely more than 16 bytes of text; 64 leaves room for long whitespace and repeat tokens):
/// a body far beyond the context is refused before it is expanded into tokens.
pub const MAX_PROMPT_BYTES_PER_TOKEN: usize = 64;

fn check_text_bytes(param: &str, bytes: usize, lim: &Limits) -> Result<(), ApiError> {
    let most = lim.max_context.saturating_mul(MAX_PROMPT_BYTES_PER_TOKEN);
    if bytes > most {
        return Err(ApiError::invalid(
            param,
            format!(
                "`{param}` has {bytes} bytes of text; this model's context of {} tokens holds at most {most} (checked before tokenizing); shorten `{param}`",
                lim.max_context
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// Longest stop string, in bytes (matching costs O(length^2) per generated token).
pub const MAX_STOP_BYTES: usize = 512;

/// The fields shared by chat and completion requests, validated.
#[derive(Debug, Clone)]
pub struct Common {
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop_strings: Vec<String>,
    pub stop_ids: Vec<u32>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

/// Parse the body into a JSON object: malformed JSON and non-objects are 400s.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(v) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!(
                "the request body must be a JSON object, got {}",
                type_name(&v)
            ),
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("invalid JSON in the request body: {e}"),
        )
        .with_code("invalid_json")),
    }
}

/// What the server does with a request field: every field a request may carry is in this
/// table, so none is silently ignored (issue 24).
enum FieldUse {
    /// Parsed and honoured (`parse_common`, `parse_messages`, `parse_prompt`, `prepare`).
    Used,
    /// Accepted and without effect on the output, as documented (docs/serve.md): request
    /// metadata such as `user`.
    Metadata,
    /// Not implemented: refused unless it has its neutral value (the value that means "off").
    RefusedUnlessNeutral(fn(&Value) -> bool, &'static str),
}

fn null_or(v: &Value, f: impl Fn(&Value) -> bool) -> bool {
    v.is_null() || f(v)
}

fn neutral_zero(v: &Value) -> bool {
    null_or(v, |v| v.as_f64() == Some(0.0))
}
fn neutral_empty(v: &Value) -> bool {
    null_or(v, |v| {
        v.as_array().is_some_and(|a| a.is_empty()) || v.as_object().is_some_and(|o| o.is_empty())
    })
}
fn neutral_false(v: &Value) -> bool {
    null_or(v, |v| v.as_bool() == Some(false))
}
fn neutral_tool_choice(v: &Value) -> bool {
    null_or(v, |v| v.as_str() == Some("none"))
}
fn neutral_text_modality(v: &Value) -> bool {
    null_or(v, |v| {
        v.as_array()
            .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text")))
    })
}
fn neutral_empty_string(v: &Value) -> bool {
    null_or(v, |v| v.as_str() == Some(""))
}

/// Most entries of one `logit_bias` (OpenAI documents no bound; a few hundred is typical).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// `logit_bias`: an object from token ids (as strings, OpenAI's form) to a bias in [-100, 100].
fn logit_bias(v: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    const P: &str = "logit_bias";
    let Some(v) = v else { return Ok(Vec::new()) };
    let Value::Object(m) = v else {
        return Err(ApiError::invalid(
            P,
            format!(
                "`logit_bias` must be an object of token id -> bias, got {}",
                type_name(v)
            ),
        ));
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            P,
            format!(
                "`logit_bias` has {} entries, at most {MAX_LOGIT_BIAS}",
                m.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(m.len());
    for (k, b) in m {
        let id = k
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&i| (i as usize) < vocab)
            .ok_or_else(|| {
                ApiError::invalid(
                    P,
                    format!("`logit_bias` key {k:?} is not a token id below the vocabulary size {vocab}"),
                )
            })?;
        let bias = b
            .as_f64()
            .filter(|x| (-100.0..=100.0).contains(x))
            .ok_or_else(|| {
                ApiError::invalid(
                    P,
                    format!("`logit_bias` of token {id} must be a number in [-100, 100], got {b}"),
                )
            })?;
        out.push((id, bias as f32));
    }
    Ok(out)
}

/// The fields of a chat (`chat`) or completion request and their use.
fn field_use(name: &str, chat: bool) -> Option<FieldUse> {
    use FieldUse::*;
    const FUNCTIONS: &str =
        "the deprecated function-calling fields are not supported; send `tools` and `tool_choice`";
    Some(match name {
        "model" | "max_tokens" | "temperature" | "top_p" | "top_k" | "min_p" | "seed" | "stop"
        | "stop_token_ids" | "stream" | "stream_options" | "ignore_eos" | "n" | "best_of"
        | "echo" | "logprobs" => Used,
        "max_completion_tokens" => Used,
        // applied in every verify row as plain decoding would (dflash::sampling)
        "presence_penalty" | "frequency_penalty" | "repetition_penalty" | "logit_bias" => Used,
        "messages" | "chat_template_kwargs" if chat => Used,
        // rendered by the chat template, parsed out of the output (crate::output)
        "tools" | "tool_choice" | "parallel_tool_calls" if chat => Used,
        "prompt" if !chat => Used,
        "user" | "metadata" | "service_tier" => Metadata,
        "top_logprobs" => RefusedUnlessNeutral(neutral_zero, "log probabilities are not supported"),
        "store" => RefusedUnlessNeutral(neutral_false, "this server does not store completions"),
        "functions" if chat => RefusedUnlessNeutral(neutral_empty, FUNCTIONS),
        "function_call" if chat => RefusedUnlessNeutral(neutral_tool_choice, FUNCTIONS),
        // structured output (`structured`): OpenAI's field and vLLM's
        "response_format" | "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar"
        | "structured_outputs" => Used,
        "modalities" if chat => {
            RefusedUnlessNeutral(neutral_text_modality, "this model outputs text only")
        }
        "audio" | "prediction" | "web_search_options" | "reasoning_effort" if chat => {
            RefusedUnlessNeutral(Value::is_null, "not supported by this server")
        }
        "suffix" if !chat => RefusedUnlessNeutral(
            neutral_empty_string,
            "`suffix` (insertion) is not supported",
        ),
        _ => return None,
    })
}

/// Every field of the request is one this server honours, documents as metadata, or has at its
/// neutral value; a 400 naming the first that is not.
pub fn check_fields(obj: &Map<String, Value>, chat: bool) -> Result<(), ApiError> {
    for (k, v) in obj {
        match field_use(k, chat) {
            Some(FieldUse::Used) | Some(FieldUse::Metadata) => {}
            Some(FieldUse::RefusedUnlessNeutral(neutral, why)) => {
                if !neutral(v) {
                    return Err(ApiError::invalid(k, format!("`{k}`: {why}"))
                        .with_code("unsupported_parameter"));
                }
            }
            None => {
                let what = if chat {
                    "chat completion"
                } else {
                    "completion"
                };
                return Err(ApiError::invalid(
                    k,
                    format!("unknown field `{k}` for a {what} request (docs/serve.md lists the fields this server takes)"),
                )
                .with_code("unknown_parameter"));
            }
        }
    }
    Ok(())
}

pub fn parse_common(f: &Fields, lim: &Limits) -> Result<Common, ApiError> {
    if let Some(m) = f.str("model")? {
        if !lim.model_names.iter().any(|n| n == m) {
            let mut e = ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    lim.model_names[0]
                ),
            )
            .with_code("model_not_found");
            e.param = Some("model".into());
            return Err(e);
        }
    }
    if let Some(n) = f.i64("n")? {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be 1 (one choice per request), got {n}"),
            ));
        }
    }
    if let Some(n) = f.i64("best_of")? {
        if n != 1 {
            return Err(ApiError::invalid("best_of", "`best_of` must be 1"));
        }
    }
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::invalid("echo", "`echo` is not supported"));
    }
    // `logprobs` is a boolean in chat and an integer in completions.
    match f.0.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(Value::Number(n)) if n.as_u64() == Some(0) => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "logprobs",
                "`logprobs` is not supported by this server",
            ))
        }
    }
    let max_tokens = match f.i64("max_completion_tokens")? {
        Some(v) => Some(("max_completion_tokens", v)),
        None => f.i64("max_tokens")?.map(|v| ("max_tokens", v)),
    };
    let max_tokens = match max_tokens {
        None => None,
        Some((k, v)) => {
            if v < 1 || v as u64 > lim.max_context as u64 {
                return Err(ApiError::invalid(
                    k,
                    format!(
                        "`{k}` must be between 1 and the context size {}, got {v}",
                        lim.max_context
                    ),
                ));
            }
            Some(v as usize)
        }
    };
    let mut sp = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    if let Some(t) = f.f32("temperature")? {
        if !t.is_finite() || !(0.0..=2.0).contains(&t) {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be a number in [0, 2], got {t}"),
            ));
        }
        sp.temperature = t;
    }
    if let Some(p) = f.f32("top_p")? {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {p}"),
            ));
        }
        sp.top_p = p;
    }
    if let Some(k) = f.i64("top_k")? {
        if k < -1 {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be >= 0 (0 or -1 = off), got {k}"),
            ));
        }
        sp.top_k = k.max(0) as usize;
    }
    if let Some(m) = f.f32("min_p")? {
        if !(0.0..=1.0).contains(&m) {
            return Err(ApiError::invalid(
                "min_p",
                format!("`min_p` must be in [0, 1], got {m}"),
            ));
        }
        sp.min_p = m;
    }
    for k in ["presence_penalty", "frequency_penalty"] {
        if let Some(v) = f.f32(k)? {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                return Err(ApiError::invalid(
                    k,
                    format!("`{k}` must be a number in [-2, 2], got {v}"),
                ));
            }
            if k == "presence_penalty" {
                sp.presence_penalty = v;
            } else {
                sp.frequency_penalty = v;
            }
        }
    }
    if let Some(v) = f.f32("repetition_penalty")? {
        if !v.is_finite() || v <= 0.0 {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("`repetition_penalty` must be a number > 0 (1 = off), got {v}"),
            ));
        }
        sp.repetition_penalty = v;
    }
    sp.logit_bias = logit_bias(f.get("logit_bias"), lim.vocab_size)?;
    if let Some(s) = f.i64("seed")? {
        sp.seed = s as u64;
    } else {
        // No seed: a different sample each request.
        sp.seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
    }
    sp.validate()
        .map_err(|e| ApiError::invalid("sampling", e.to_string()))?;

    let mut stop_strings = Vec::new();
    let mut stop_ids = Vec::new();
    let mut add_stop = |v: &Value, param: &str| -> Result<(), ApiError> {
        match v {
            Value::String(s) if s.is_empty() => {
                Err(ApiError::invalid(param, "stop strings must not be empty"))
            }
            Value::String(s) if s.len() > MAX_STOP_BYTES => Err(ApiError::invalid(
                param,
                format!(
                    "stop strings must be at most {MAX_STOP_BYTES} bytes, got one of {}",
                    s.len()
                ),
            )),
            _ if stop_strings.len() + stop_ids.len() >= lim.max_stop => Err(ApiError::invalid(
                "stop",
                format!("at most {} stop sequences", lim.max_stop),
            )),
            Value::String(s) => {
                stop_strings.push(s.clone());
                Ok(())
            }
            Value::Number(n) => match n.as_u64() {
                Some(id) if (id as usize) < lim.vocab_size => {
                    stop_ids.push(id as u32);
                    Ok(())
                }
                _ => Err(ApiError::invalid(
                    param,
                    format!(
                        "stop token ids must be integers in [0, {}), got {n}",
                        lim.vocab_size
                    ),
                )),
            },
            v => Err(ApiError::invalid(
                param,
                format!(
                    "`{param}` entries must be strings or token ids, got {}",
                    type_name(v)
                ),
            )),
        }
    };
    match f.0.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for v in a {
                add_stop(v, "stop")?;
            }
        }
        Some(v @ Value::String(_)) => add_stop(v, "stop")?,
        Some(v) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "`stop` must be a string or an array of strings, got {}",
                    type_name(v)
                ),
            ))
        }
    }
    match f.0.get("stop_token_ids") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for v in a {
                if !v.is_number() {
                    return Err(ApiError::invalid(
                        "stop_token_ids",
                        "`stop_token_ids` must be an array of integers",
                    ));
                }
                add_stop(v, "stop_token_ids")?;
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop_token_ids",
                "`stop_token_ids` must be an array of integers",
            ))
        }
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(o) => Fields(o)
            .bool("include_usage")
            .map_err(|e| ApiError::invalid("stream_options.include_usage", e.message))?
            .unwrap_or(false),
        None => false,
    };
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    Ok(Common {
        max_tokens,
        sampling: sp,
        stop_strings,
        stop_ids,
        stream,
        include_usage,
        ignore_eos,
    })
}

/// `messages`: a non-empty array of `{role, content}`; content is a string or text parts.
pub fn parse_messages(f: &Fields) -> Result<Vec<ChatMessage>, ApiError> {
    let arr = match f.0.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("messages", "`messages` is required"))
        }
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages` must be an array, got {}", type_name(v)),
            ))
        }
    };
    if arr.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    if arr.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "`messages` has {} messages; at most {MAX_MESSAGES} are accepted",
                arr.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, m) in arr.iter().enumerate() {
        let o = m.as_object().ok_or_else(|| {
            ApiError::invalid(
                &format!("messages[{i}]"),
                format!("`messages[{i}]` must be an object, got {}", type_name(m)),
            )
        })?;
        let role = match o.get("role") {
            Some(Value::String(r)) => r.as_str(),
            _ => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!("`messages[{i}].role` must be a string"),
                ))
            }
        };
        let role = match role {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            r => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!(
                        "`messages[{i}].role` must be system, user, assistant or tool, got `{r}`"
                    ),
                ))
            }
        };
        let p = format!("messages[{i}].content");
        let content = match o.get("content") {
            Some(Value::String(s)) => s.clone(),
            None | Some(Value::Null) if role == "assistant" => String::new(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for part in parts {
                    match (
                        part.get("type").and_then(Value::as_str),
                        part.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => s.push_str(t),
                        (ty, _) => {
                            return Err(ApiError::invalid(
                                &p,
                                format!(
                                    "`{p}` parts must be {{\"type\": \"text\", \"text\": ...}}, got type {}",
                                    ty.unwrap_or("(none)")
                                ),
                            ))
                        }
                    }
                }
                s
            }
            Some(v) => {
                return Err(ApiError::invalid(
                    &p,
                    format!(
                        "`{p}` must be a string or an array of text parts, got {}",
                        type_name(v)
                    ),
                ))
            }
            None => return Err(ApiError::invalid(&p, format!("`{p}` is required"))),
        };
        let mut msg = ChatMessage::new(role, content);
        msg.extra = message_extra(o, i, role)?;
        out.push(msg);
    }
    Ok(out)
}

/// The keys of message `i` besides role and content that templates read: `name`, an
/// assistant's `tool_calls` (arguments, a JSON string on the wire, become the object HF
/// templates iterate) and `reasoning_content`, a tool message's `tool_call_id`.
fn message_extra(
    o: &Map<String, Value>,
    i: usize,
    role: &str,
) -> Result<Map<String, Value>, ApiError> {
    let mut extra = Map::new();
    let string = |k: &str| -> Result<Option<String>, ApiError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(ApiError::invalid(
                &format!("messages[{i}].{k}"),
                format!("`messages[{i}].{k}` must be a string, got {}", type_name(v)),
            )),
        }
    };
    if let Some(n) = string("name")? {
        extra.insert("name".into(), n.into());
    }
    if let Some(id) = string("tool_call_id")? {
        extra.insert("tool_call_id".into(), id.into());
    }
    if let Some(r) = string("reasoning_content")? {
        if role != "assistant" {
            return Err(ApiError::invalid(
                &format!("messages[{i}].reasoning_content"),
                format!("`messages[{i}].reasoning_content` is for assistant messages only"),
            ));
        }
        extra.insert("reasoning_content".into(), r.into());
    }
    let calls = match o.get("tool_calls") {
        None | Some(Value::Null) => return Ok(extra),
        Some(Value::Array(a)) if role == "assistant" => a,
        Some(_) if role != "assistant" => {
            return Err(ApiError::invalid(
                &format!("messages[{i}].tool_calls"),
                format!("`messages[{i}].tool_calls` is for assistant messages only"),
            ))
        }
        Some(v) => {
            return Err(ApiError::invalid(
                &format!("messages[{i}].tool_calls"),
                format!(
                    "`messages[{i}].tool_calls` must be an array of {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}, got {}",
                    type_name(v)
                ),
            ))
        }
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let p = format!("messages[{i}].tool_calls[{j}]");
        let f = c
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                ApiError::invalid(
                    &format!("{p}.function"),
                    format!("`{p}.function` must be an object {{\"name\", \"arguments\"}}"),
                )
            })?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                ApiError::invalid(
                    &format!("{p}.function.name"),
                    format!("`{p}.function.name` must be a non-empty string"),
                )
            })?;
        let ap = format!("{p}.function.arguments");
        let args = match f.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(o @ Value::Object(_)) => o.clone(),
            Some(Value::String(t)) => match serde_json::from_str::<Value>(t) {
                Ok(o @ Value::Object(_)) => o,
                _ => {
                    return Err(ApiError::invalid(
                        &ap,
                        format!(
                        "`{ap}` must be a JSON object encoded as a string (as the API returned it)"
                    ),
                    ))
                }
            },
            Some(v) => {
                return Err(ApiError::invalid(
                    &ap,
                    format!(
                        "`{ap}` must be a JSON object encoded as a string, got {}",
                        type_name(v)
                    ),
                ))
            }
        };
        let mut call = json!({"type": "function", "function": {"name": name, "arguments": args}});
        match c.get("id") {
            None | Some(Value::Null) => {}
            Some(Value::String(id)) => call["id"] = id.clone().into(),
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("{p}.id"),
                    format!("`{p}.id` must be a string"),
                ))
            }
        }
        out.push(call);
    }
    extra.insert("tool_calls".into(), Value::Array(out));
    Ok(extra)
}

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 512;

/// `tool_choice: "required"` or a named function as a grammar, for the Hermes / Qwen format
/// (`<tool_call>\n{"name": f, "arguments": {..}}\n</tool_call>`, the arguments as the tool's
/// `parameters` schema): the output is then one call (or several with `parallel_tool_calls`)
/// and nothing else, after the thought where the model thinks (the template opened `<think>`:
/// the thought first; thinking on: an optional `<think>` block). Other formats: None (the
/// choice is given to the template only; docs/serve.md).
fn tool_grammar(
    tools: &Tools,
    output: &ParserConfig,
    enable_thinking: Option<bool>,
) -> Option<dflash::grammar::GrammarSpec> {
    let name_is = |t: &Value, n: &str| t["function"]["name"].as_str() == Some(n);
    let chosen: Vec<&Value> = match &tools.choice {
        ToolChoice::Required => tools.tools.iter().collect(),
        ToolChoice::Function(n) => tools.tools.iter().filter(|t| name_is(t, n)).collect(),
        ToolChoice::None | ToolChoice::Auto => return None,
    };
    if output.tools != Some(ToolFormat::Hermes) || chosen.is_empty() {
        return None;
    }
    let one = |t: &Value| {
        let f = &t["function"];
        let params = match &f["parameters"] {
            Value::Object(p) if !p.is_empty() => Value::Object(p.clone()),
            _ => json!({"type": "object"}),
        };
        json!({"type": "object",
               "properties": {"name": {"const": f["name"]}, "arguments": params},
               "required": ["name", "arguments"], "additionalProperties": false})
    };
    let schema = if chosen.len() == 1 {
        one(chosen[0])
    } else {
        json!({"anyOf": chosen.iter().map(|t| one(t)).collect::<Vec<_>>()})
    };
    let calls = if tools.parallel {
        r#"call ("\n" call)*"#
    } else {
        "call"
    };
    let thinking = output.reasoning.is_some() && enable_thinking != Some(false);
    let head = if output.reasoning_open {
        // the template opened the thought: it runs to its end marker, then the calls
        r#"thought /[ \t\n]*/ "#
    } else if thinking {
        r#"("<think>" thought /[ \t\n]*/)? "#
    } else {
        ""
    };
    Some(dflash::grammar::GrammarSpec::Lark(format!(
        "start: {head}{calls}\n{}\n{}\nbody: %json {schema}\n",
        r#"thought[stop="</think>"]: /(.|\n)*/"#, r#"call: "<tool_call>\n" body "\n</tool_call>""#,
    )))
}

/// What the request asks of tool calls (`tool_choice`).
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Function(String),
}

/// The request's `tools`, `tool_choice` and `parallel_tool_calls`, validated.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The tool objects as sent (`{"type": "function", "function": {..}}`), checked.
    pub tools: Vec<Value>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

impl Tools {
    /// The tools the template is given: none for `none`, the named one for a named function.
    pub fn rendered(&self) -> Vec<Value> {
        match &self.choice {
            ToolChoice::None => Vec::new(),
            ToolChoice::Function(n) => self
                .tools
                .iter()
                .filter(|t| t["function"]["name"].as_str() == Some(n.as_str()))
                .cloned()
                .collect(),
            _ => self.tools.clone(),
        }
    }
    /// Function -> parameter -> its JSON-schema type (a string type, or the first of a list).
    fn param_types(&self) -> HashMap<String, HashMap<String, String>> {
        let mut out = HashMap::new();
        for t in &self.tools {
            let f = &t["function"];
            let Some(name) = f["name"].as_str() else {
                continue;
            };
            let mut m = HashMap::new();
            if let Some(props) = f["parameters"]["properties"].as_object() {
                for (k, v) in props {
                    let ty = match &v["type"] {
                        Value::String(s) => Some(s.clone()),
                        Value::Array(a) => a
                            .iter()
                            .filter_map(Value::as_str)
                            .find(|s| *s != "null")
                            .map(str::to_string),
                        _ => None,
                    };
                    if let Some(ty) = ty {
                        m.insert(k.clone(), ty);
                    }
                }
            }
            out.insert(name.to_string(), m);
        }
        out
    }
}

/// `tools`: `[{"type": "function", "function": {"name", "description"?, "parameters"?,
/// "strict"?}}]`; `tool_choice`: `none` / `auto` / `required` / `{"type": "function",
/// "function": {"name"}}` (one of the tools); `parallel_tool_calls`: a boolean.
pub fn parse_tools(f: &Fields) -> Result<Tools, ApiError> {
    const SHAPE: &str = "[{\"type\": \"function\", \"function\": {\"name\": ..., \"description\": ..., \"parameters\": {JSON schema}}}]";
    let tools = match f.get("tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(v) => {
            return Err(ApiError::invalid(
                "tools",
                format!("`tools` must be an array {SHAPE}, got {}", type_name(v)),
            ))
        }
    };
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            "tools",
            format!("`tools` has {} tools, at most {MAX_TOOLS}", tools.len()),
        ));
    }
    let mut names: Vec<&str> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let p = format!("tools[{i}]");
        let o = t.as_object().ok_or_else(|| {
            ApiError::invalid(&p, format!("`{p}` must be an object {{\"type\": \"function\", \"function\": {{...}}}}, got {}", type_name(t)))
        })?;
        if o.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                &format!("{p}.type"),
                format!("`{p}.type` must be \"function\" (the only tool type this server knows)"),
            ));
        }
        let func = o.get("function").and_then(Value::as_object).ok_or_else(|| {
            ApiError::invalid(
                &format!("{p}.function"),
                format!("`{p}.function` must be an object {{\"name\", \"description\", \"parameters\"}}"),
            )
        })?;
        let np = format!("{p}.function.name");
        let name = func.get("name").and_then(Value::as_str).unwrap_or("");
        let good = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !good {
            return Err(ApiError::invalid(
                &np,
                format!(
                    "`{np}` must be 1 to 64 letters, digits, `_`, `-` or `.`, got {:?}",
                    name.chars().take(80).collect::<String>()
                ),
            ));
        }
        if names.contains(&name) {
            return Err(ApiError::invalid(
                &np,
                format!("`{np}`: two tools are named `{name}`; tool names must be unique"),
            ));
        }
        names.push(name);
        for (k, want, ok) in [
            (
                "description",
                "a string",
                func.get("description")
                    .is_none_or(|v| v.is_string() || v.is_null()),
            ),
            (
                "parameters",
                "a JSON schema object",
                func.get("parameters")
                    .is_none_or(|v| v.is_object() || v.is_null()),
            ),
            (
                "strict",
                "a boolean",
                func.get("strict")
                    .is_none_or(|v| v.is_boolean() || v.is_null()),
            ),
        ] {
            if !ok {
                let kp = format!("{p}.function.{k}");
                return Err(ApiError::invalid(&kp, format!("`{kp}` must be {want}")));
            }
        }
    }
    let choice = match f.get("tool_choice") {
        None if tools.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(c)) => match c.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {:?}", other.chars().take(80).collect::<String>()),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"));
            match name {
                Some(n) => ToolChoice::Function(n.to_string()),
                None => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` as an object must be {\"type\": \"function\", \"function\": {\"name\": NAME}}",
                    ))
                }
            }
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` must be a string or an object, got {}", type_name(v)),
            ))
        }
    };
    match &choice {
        ToolChoice::Function(n) if !names.contains(&n.as_str()) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` names the function `{}`, which is not one of `tools` ({})",
                    n.chars().take(80).collect::<String>(),
                    if names.is_empty() { "none given".to_string() } else { names.join(", ") }
                ),
            ))
        }
        ToolChoice::Auto | ToolChoice::Required if tools.is_empty() => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` asks for tool calls but `tools` is empty; send `tools` or omit `tool_choice`",
            ))
        }
        _ => {}
    }
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    Ok(Tools {
        tools,
        choice,
        parallel,
    })
}

/// `prompt` of /v1/completions: a string, a one-element array of a string, or token ids.
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

pub fn parse_prompt(f: &Fields, vocab: usize) -> Result<Prompt, ApiError> {
    let bad_id = |n: &Value| {
        ApiError::invalid(
            "prompt",
            format!("prompt token ids must be integers in [0, {vocab}), got {n}"),
        )
    };
    match f.0.get("prompt") {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(Prompt::Text(a[0].as_str().unwrap().to_string()))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) && !a.is_empty() => {
            let mut ids = Vec::with_capacity(a.len());
            for n in a {
                match n.as_u64() {
                    Some(id) if (id as usize) < vocab => ids.push(id as u32),
                    _ => return Err(bad_id(n)),
                }
            }
            Ok(Prompt::Ids(ids))
        }
        Some(Value::Array(a)) if a.is_empty() => {
            Err(ApiError::invalid("prompt", "`prompt` must not be empty"))
        }
        Some(Value::Array(_)) => Err(ApiError::invalid(
            "prompt",
            "`prompt` must be a string, one string in an array, or an array of token ids (batches of prompts are not supported)",
        )),
        Some(v) => Err(ApiError::invalid(
            "prompt",
            format!("`prompt` must be a string or an array of token ids, got {}", type_name(v)),
        )),
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    Chat,
    Completion,
}

impl Kind {
    pub fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        }
    }
}

/// A validated request, ready for the engine.
#[derive(Debug)]
pub struct Prepared {
    pub common: Common,
    pub prompt_ids: Vec<u32>,
    /// The request's max_tokens (or the default), capped to the room the context leaves.
    pub max_tokens: usize,
    /// How the output is split into content, reasoning and tool calls (inactive for
    /// completions); `id_prefix` is left to the caller.
    pub output: ParserConfig,
    /// The grammar the output must follow, and the field that asked for it (compiled by the
    /// caller, which holds the model's vocabulary).
    pub grammar: Option<(String, dflash::grammar::GrammarSpec)>,
}

/// A request body -> a validated request: parse, validate every field against `lim`, render
/// the chat template, tokenize, check the context. Pure (no server state), so that it can be
/// tested and fuzzed on its own; the server calls it on its blocking pool.
pub fn prepare(
    kind: Kind,
    body: &[u8],
    lim: &Limits,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> Result<Prepared, ApiError> {
    let obj = parse_object(body)?;
    check_fields(&obj, kind == Kind::Chat)?;
    let f = Fields(&obj);
    let common = parse_common(&f, lim)?;
    let mut grammar =
        crate::structured::grammar(&obj).map_err(|b| ApiError::invalid(&b.param, b.message))?;
    let mut output = ParserConfig::default();
    let (prompt_ids, param) = match kind {
        Kind::Chat => {
            let msgs = parse_messages(&f)?;
            let tools = parse_tools(&f)?;
            let rendered_tools = tools.rendered();
            let extra_bytes: usize = msgs
                .iter()
                .filter(|m| !m.extra.is_empty())
                .map(|m| Value::Object(m.extra.clone()).to_string().len())
                .sum::<usize>()
                + if rendered_tools.is_empty() {
                    0
                } else {
                    Value::Array(rendered_tools.clone()).to_string().len()
                };
            check_text_bytes(
                "messages",
                msgs.iter().map(|m| m.content.len()).sum::<usize>() + extra_bytes,
                lim,
            )?;
            let mut kwargs: Map<String, Value> = f
                .object("chat_template_kwargs")?
                .cloned()
                .unwrap_or_default();
            if !rendered_tools.is_empty() {
                let Some(fmt) = lim.tool_format else {
                    return Err(ApiError::invalid(
                        "tools",
                        format!("this model's chat template shows no tool-call format this server can parse; start the server with --tool-call-parser ({}), or send no `tools`", ToolFormat::ALL.map(ToolFormat::name).join(", ")),
                    )
                    .with_code("unsupported_parameter"));
                };
                if template.is_none() {
                    return Err(ApiError::invalid(
                        "tools",
                        "this model has no chat template to tell it about `tools`; send no `tools`",
                    )
                    .with_code("unsupported_parameter"));
                }
                kwargs.insert("tools".into(), Value::Array(rendered_tools));
                output.tools = Some(fmt);
                output.single_call = !tools.parallel;
                output.param_types = tools.param_types();
            }
            output.reasoning = lim.reasoning_format;
            let enable_thinking = match kwargs.get("enable_thinking") {
                None | Some(Value::Null) => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(_) => {
                    return Err(ApiError::invalid(
                        "chat_template_kwargs.enable_thinking",
                        "`chat_template_kwargs.enable_thinking` must be a boolean",
                    ))
                }
            };
            let ids = match template {
                Some(t) => {
                    let (ids, think_open) =
                        encode_chat(t, tokenizer, &msgs, enable_thinking, &kwargs, lim)?;
                    output.reasoning_open = think_open;
                    if let Some(g) = tool_grammar(&tools, &output, enable_thinking) {
                        if let Some((field, _)) = &grammar {
                            return Err(ApiError::invalid(
                                "tool_choice",
                                format!("`tool_choice` (required or a named function) and `{field}` both constrain the output; send one of them"),
                            ));
                        }
                        grammar = Some(("tool_choice".into(), g));
                    }
                    ids
                }
                None => {
                    // no template: the text is all content, so no special token is wanted
                    let text: Vec<&str> = msgs.iter().map(|m| m.content.as_str()).collect();
                    let text = text.join("\n");
                    if lim.special_tokens_in_content || tokenizer.special_spans(&text).is_empty() {
                        tokenizer.encode(&text, true)
                    } else {
                        tokenizer.encode_with_specials_at(&text, &[], true)
                    }
                    .map_err(|e| ApiError::invalid("messages", e.to_string()))?
                }
            };
            (ids, "messages")
        }
        Kind::Completion => {
            let ids = match parse_prompt(&f, lim.vocab_size)? {
                Prompt::Ids(ids) => ids,
                // A raw prompt is the client's whole text, with no turns to forge: special
                // tokens in it are parsed (as vLLM and llama.cpp do), so that a client can
                // render a chat template itself (docs/serve.md).
                Prompt::Text(t) => {
                    check_text_bytes("prompt", t.len(), lim)?;
                    tokenizer.encode(&t, true)
                }
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
            };
            (ids, "prompt")
        }
    };
    if prompt_ids.is_empty() {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` encodes to no tokens: nothing to condition on"),
        ));
    }
    let ctx = lim.max_context;
    if prompt_ids.len() >= ctx {
        return Err(ApiError::invalid(
            param,
            format!(
                "this model's context is {ctx} tokens; the prompt has {} tokens (at least one token must be generated); shorten `{param}`",
                prompt_ids.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = ctx - prompt_ids.len();
    let max_tokens = common
        .max_tokens
        .unwrap_or(lim.max_tokens_default)
        .min(room);
    Ok(Prepared {
        common,
        prompt_ids,
        max_tokens,
        output,
        grammar,
    })
}

/// Renders the chat template over `msgs` and tokenizes it. Special-token text inside a
/// message's content (`<|im_end|>\n<|im_start|>system` in a user message, which would forge
/// a turn boundary) is encoded as ordinary text: only the template's own markers become
/// special tokens (issue 24). How: each special-token text in content is replaced by a
/// placeholder (a Unicode noncharacter that no content holds, an index, the same character),
/// the template is rendered, the placeholders are put back, and every special token of the
/// result except those is a marker of the template. Content without special-token text (the
/// usual case) takes the plain path: the same ids as without this. The strings of messages'
/// other keys (`tool_calls` arguments, `reasoning_content`) and of `tools` (in `kwargs`) are
/// content too. Also returns whether the prompt ends inside a `<think>` block that the
/// template opened (the output then starts in reasoning).
fn encode_chat(
    t: &ChatTemplate,
    tok: &Tokenizer,
    msgs: &[ChatMessage],
    enable_thinking: Option<bool>,
    kwargs: &Map<String, Value>,
    lim: &Limits,
) -> Result<(Vec<u32>, bool), ApiError> {
    let think_open = |text: &str| text.trim_end().ends_with("<think>");
    let render = |m: &[ChatMessage], kw: &Map<String, Value>| {
        t.render(m, true, enable_thinking, kw)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))
    };
    let enc_err = |e: dflash::Error| ApiError::invalid("messages", e.to_string());
    let forged: Vec<Vec<(usize, usize)>> = if lim.special_tokens_in_content {
        Vec::new()
    } else {
        msgs.iter().map(|m| tok.special_spans(&m.content)).collect()
    };
    // `chat_template_kwargs` strings reach the prompt too when a template prints them
    let kw_forged = !lim.special_tokens_in_content
        && strings_of(kwargs).any(|s| !tok.special_spans(s).is_empty());
    let extra_forged = !lim.special_tokens_in_content
        && msgs
            .iter()
            .any(|m| strings_of(&m.extra).any(|s| !tok.special_spans(s).is_empty()));
    if forged.iter().all(Vec::is_empty) && !kw_forged && !extra_forged {
        let text = render(msgs, kwargs)?;
        let ids = tok.encode(&text, false).map_err(enc_err)?;
        return Ok((ids, think_open(&text)));
    }
    let kw = Value::Object(kwargs.clone()).to_string();
    let extras: Vec<String> = msgs
        .iter()
        .filter(|m| !m.extra.is_empty())
        .map(|m| Value::Object(m.extra.clone()).to_string())
        .collect();
    let Some(mark) = ('\u{FDD0}'..='\u{FDEF}').find(|c| {
        !kw.contains(*c)
            && !msgs.iter().any(|m| m.content.contains(*c))
            && !extras.iter().any(|e| e.contains(*c))
    }) else {
        return Err(ApiError::invalid(
            "messages",
            "`messages` contain special-token text and all 32 Unicode noncharacters U+FDD0..U+FDEF, which this server needs to keep that text as text; remove the noncharacters",
        ));
    };
    let mut texts: Vec<String> = Vec::new();
    let marked: Vec<ChatMessage> = msgs
        .iter()
        .zip(&forged)
        .map(|(m, spans)| {
            let mut c = ChatMessage::new(
                m.role.clone(),
                marked_text(&m.content, spans, mark, &mut texts),
            );
            c.extra = if extra_forged {
                m.extra
                    .iter()
                    .map(|(k, v)| (k.clone(), marked_value(v, tok, mark, &mut texts)))
                    .collect()
            } else {
                m.extra.clone()
            };
            c
        })
        .collect();
    let marked_kw: Map<String, Value> = if kw_forged {
        kwargs
            .iter()
            .map(|(k, v)| (k.clone(), marked_value(v, tok, mark, &mut texts)))
            .collect()
    } else {
        kwargs.clone()
    };
    let rendered = render(&marked, &marked_kw)?;
    let mangled = || {
        ApiError::invalid(
            "messages",
            format!(
                "a message contains special-token text (`{}`) and this chat template rewrites message content, so that text cannot be kept as text; remove it, or start the server with --allow-special-tokens-in-content",
                texts[0]
            ),
        )
        .with_code("special_token_in_content")
    };
    let mut text = String::with_capacity(rendered.len());
    let mut content_specials = Vec::new();
    let mut parts = rendered.split(mark);
    text.push_str(parts.next().unwrap_or(""));
    while let Some(idx) = parts.next() {
        let after = parts.next().ok_or_else(mangled)?;
        let i: usize = idx.parse().map_err(|_| mangled())?;
        let lit = texts.get(i).ok_or_else(mangled)?;
        content_specials.push((text.len(), text.len() + lit.len()));
        text.push_str(lit);
        text.push_str(after);
    }
    // every special token of the result that is not (or overlaps) content text is the template's
    let template_specials: Vec<(usize, usize)> = tok
        .special_spans(&text)
        .into_iter()
        .filter(|&(a, b)| !content_specials.iter().any(|&(c, d)| a < d && c < b))
        .collect();
    let ids = tok
        .encode_with_specials_at(&text, &template_specials, false)
        .map_err(enc_err)?;
    Ok((ids, think_open(&text)))
}

/// `text` with each special-token span replaced by `mark` index `mark` (the span's text kept
/// in `texts` at that index).
fn marked_text(
    text: &str,
    spans: &[(usize, usize)],
    mark: char,
    texts: &mut Vec<String>,
) -> String {
    let mut c = String::with_capacity(text.len() + 8 * spans.len());
    let mut at = 0;
    for &(a, b) in spans {
        c.push_str(&text[at..a]);
        c.push(mark);
        c.push_str(&texts.len().to_string());
        c.push(mark);
        texts.push(text[a..b].to_string());
        at = b;
    }
    c.push_str(&text[at..]);
    c
}

/// Every string inside a JSON value (object values, array items), depth first.
fn strings_of(m: &Map<String, Value>) -> impl Iterator<Item = &str> {
    fn walk<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::String(s) => out.push(s),
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            Value::Object(o) => o.values().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    m.values().for_each(|v| walk(v, &mut out));
    out.into_iter()
}

/// A kwargs value with the special-token text of its strings marked (as [`marked_text`]).
fn marked_value(v: &Value, tok: &Tokenizer, mark: char, texts: &mut Vec<String>) -> Value {
    match v {
        Value::String(s) => Value::String(marked_text(s, &tok.special_spans(s), mark, texts)),
        Value::Array(a) => Value::Array(
            a.iter()
                .map(|x| marked_value(x, tok, mark, texts))
                .collect(),
        ),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| (k.clone(), marked_value(x, tok, mark, texts)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Why a generation ended and what it cost.
#[derive(Debug, Clone)]
pub struct Finish {
    /// OpenAI's: "stop" or "length" (the response says "tool_calls" when it made calls).
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub stats: GenerationStats,
    pub timed_out: bool,
    pub stopped_by: Option<String>,
}

pub fn usage(f: &Finish) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

/// The `dflash` extension object.
pub fn dflash_ext(f: &Finish) -> Value {
    let s = &f.stats;
    let mut v = json!({
        "mode": s.mode,
        "block_size": s.block_size,
        "tau": s.tau,
        "acceptance_ratio": s.acceptance_ratio,
        "decode_tok_s": s.decode_tok_s,
        "prefill_tok_s": s.prefill_tok_s,
        "ttft_ms": s.ttft_ms,
        "cached_prompt_tokens": s.cached_prompt_tokens,
        "cycles": s.cycles,
        "engine_finish_reason": s.finish_reason,
    });
    if s.grammar_masks > 0 {
        // structured output: masks computed and their time (tau above is under the grammar)
        v["grammar_masks"] = s.grammar_masks.into();
        v["grammar_mask_ms"] = s.grammar_mask_ms.into();
    }
    if f.timed_out {
        v["timed_out"] = true.into();
    }
    if let Some(st) = &f.stopped_by {
        v["stop"] = st.clone().into();
    }
    v
}
