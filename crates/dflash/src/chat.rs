//! Chat templates: a list of chat messages -> the prompt text a chat model was trained on.
//!
//! Where it sits: before tokenization. The rendered string goes to
//! [`crate::tokenizer::Tokenizer::encode`] with `add_special_tokens = false` (the template
//! already wrote BOS and the role markers).
//!
//! The template is the Jinja source that Hugging Face repos ship, in `chat_template.jinja`
//! (newer repos) or in the `chat_template` field of `tokenizer_config.json` (a string, or a
//! list of `{name, template}` of which `default` is used). It is rendered with minijinja set
//! up the way `transformers` sets up Jinja2: `trim_blocks` and `lstrip_blocks` on, trailing
//! newline dropped, loop controls, Python string/dict methods (`.strip()`, `.split()`,
//! `.items()`, ..), `raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` that writes
//! what Python's `json.dumps` writes (`", "` and `": "` separators, non-ASCII kept,
//! `indent`, `separators`, `sort_keys`, `ensure_ascii` arguments).

use std::path::Path;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value as JValue};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Error, Result};

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    pub content: String,
    /// The other keys templates read, as the OpenAI / HF message has them: an assistant's
    /// `tool_calls` (`[{id, type, function: {name, arguments}}]`, arguments an object) and
    /// `reasoning_content`, a tool message's `tool_call_id` and `name`.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            extra: Map::new(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Name of the template inside the minijinja environment.
const TEMPLATE: &str = "chat_template";

/// Template instructions one render may execute. Templates come with the model files, so a
/// broken or hostile one must not loop forever. Measured on llama.cpp's 68 reference
/// templates: all but one render 8192 messages within this; Gemma 4's is quadratic in the
/// number of messages and fits about 2000 (a render at the limit takes about a second).
pub const TEMPLATE_FUEL: u64 = 20_000_000;
/// Largest rendered prompt, in bytes.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

/// A writer that fails once more than `max` bytes were written.
struct CappedWriter {
    buf: Vec<u8>,
    max: usize,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.max {
            return Err(std::io::Error::other(format!(
                "the rendered prompt exceeds {} bytes",
                self.max
            )));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    file: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("file", &self.file)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Loads the template of a model directory: `chat_template.jinja` if present, else
    /// the `chat_template` field of `tokenizer_config.json`; `bos_token` / `eos_token` come
    /// from `tokenizer_config.json` when it exists.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tc = dir.join("tokenizer_config.json");
        if tc.is_file() {
            return Self::from_tokenizer_config(&tc);
        }
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
            return Self::new(source, None, None, jinja.display().to_string());
        }
        Err(Error::Template {
            file: dir.display().to_string(),
            msg: "no tokenizer_config.json or chat_template.jinja: this model has no chat \
                  template; give it raw prompt text instead"
                .into(),
        })
    }

    /// Loads `tokenizer_config.json` (its `chat_template`, `bos_token`, `eos_token`). A
    /// `chat_template.jinja` in the same directory takes precedence over the field, as in
    /// `transformers`.
    pub fn from_tokenizer_config(path: &Path) -> Result<Self> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| Error::Template {
            file: file.clone(),
            msg: format!("not valid JSON: {e}"),
        })?;
        let bos = crate::tokenizer::token_content(json.get("bos_token")).map(str::to_string);
        let eos = crate::tokenizer::token_content(json.get("eos_token")).map(str::to_string);

        let jinja = path.with_file_name("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
            return Self::new(source, bos, eos, jinja.display().to_string());
        }
        let source = match json.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(list)) => {
                let named = |want: &str| {
                    list.iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some(want))
                };
                let names: Vec<&str> = list
                    .iter()
                    .filter_map(|t| t.get("name")?.as_str())
                    .collect();
                let t = named("default").ok_or_else(|| Error::Template {
                    file: file.clone(),
                    msg: format!(
                        "`chat_template` is a list without a `default` entry (names: {names:?})"
                    ),
                })?;
                t.get("template")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| Error::Template {
                        file: file.clone(),
                        msg: "`chat_template` entry `default` has no `template` string".into(),
                    })?
            }
            None | Some(Value::Null) => {
                return Err(Error::Template {
                    file,
                    msg: "no `chat_template` field and no chat_template.jinja next to it: this \
                          model has no chat template (a base model?); give it raw prompt text \
                          instead"
                        .into(),
                })
            }
            Some(other) => {
                return Err(Error::Template {
                    file,
                    msg: format!("`chat_template` must be a string or a list, found {other}"),
                })
            }
        };
        Self::new(source, bos, eos, file)
    }

    /// Compiles a template from source. `file` names it in errors.
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
        file: impl Into<String>,
    ) -> Result<Self> {
        let source = source.into();
        let file = file.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE, strip_generation_tags(&source))
            .map_err(|e| Error::Template {
                file: file.clone(),
                msg: describe(&e),
            })?;
        Ok(Self {
            env,
            source,
            file,
            bos_token,
            eos_token,
        })
    }

    /// Change the instruction budget of a render (default [`TEMPLATE_FUEL`]).
    pub fn set_fuel(&mut self, fuel: u64) {
        self.env.set_fuel(Some(fuel));
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Where the template came from.
    pub fn file(&self) -> &str {
        &self.file
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders a conversation.
    ///
    /// The template sees `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
    /// `tools` and `documents` (none unless `extra` sets them), `enable_thinking` only when
    /// given (templates test `enable_thinking is defined`), and every key of `extra`
    /// (e.g. `tools`, `reasoning_effort`). `messages`, `add_generation_prompt` and a given
    /// `enable_thinking` override `extra`; `extra` may override the special tokens.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
        extra: &Map<String, Value>,
    ) -> Result<String> {
        let mut ctx = Map::new();
        ctx.insert(
            "bos_token".into(),
            self.bos_token
                .clone()
                .map_or(Value::String(String::new()), Value::String),
        );
        ctx.insert(
            "eos_token".into(),
            self.eos_token
                .clone()
                .map_or(Value::String(String::new()), Value::String),
        );
        ctx.insert("tools".into(), Value::Null);
        ctx.insert("documents".into(), Value::Null);
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        let msgs = serde_json::to_value(messages).map_err(|e| self.err(e.to_string()))?;
        ctx.insert("messages".into(), msgs);
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        if let Some(b) = enable_thinking {
            ctx.insert("enable_thinking".into(), Value::Bool(b));
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE)
            .map_err(|e| self.err(describe(&e)))?;
        let mut out = CappedWriter {
            buf: Vec::new(),
            max: MAX_RENDERED_BYTES,
        };
        tmpl.render_captured_to(JValue::from_serialize(&ctx), &mut out)
            .map_err(|e| match e.kind() {
                ErrorKind::OutOfFuel => self.err(format!(
                    "rendering {} messages used up the template's instruction budget; the conversation is too long for this template, or the template does not terminate",
                    messages.len()
                )),
                _ => self.err(describe(&e)),
            })?;
        String::from_utf8(out.buf).map_err(|e| self.err(format!("rendered text: {e}")))
    }

    fn err(&self, msg: String) -> Error {
        Error::Template {
            file: self.file.clone(),
            msg,
        }
    }
}

/// A minijinja error with its template line (and causes), on one line.
fn describe(e: &minijinja::Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

/// Removes the `{% generation %}` / `{% endgeneration %}` markers (transformers'
/// AssistantTracker extension, which only marks assistant spans for training masks).
fn strip_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        // The closing `%}` comes after the opening `{%` (in `{%}` they would overlap).
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = tag[2..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        if inner != "generation" && inner != "endgeneration" {
            out.push_str(&tag[..end + 2]);
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn raise_exception(msg: String) -> std::result::Result<JValue, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("template raised an exception: {msg}"),
    ))
}

/// Python's `datetime.now().strftime(fmt)`, in UTC.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(secs, &fmt)
}

/// Formats a Unix time (UTC) with the common strftime directives; `%-d` etc. drop the
/// zero padding as glibc does. Unknown directives are kept as written.
fn strftime(unix: i64, fmt: &str) -> String {
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (h, mi, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let h12 = if h % 12 == 0 { 12 } else { h % 12 };

    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |v: i64, w: usize| {
            if no_pad {
                v.to_string()
            } else {
                format!("{v:0w$}")
            }
        };
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&num(y.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(m, 2)),
            Some('d') => out.push_str(&num(d, 2)),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&num(h, 2)),
            Some('I') => out.push_str(&num(h12, 2)),
            Some('M') => out.push_str(&num(mi, 2)),
            Some('S') => out.push_str(&num(s, 2)),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('u') => out.push_str(&(weekday + 1).to_string()),
            Some('w') => out.push_str(&((weekday + 1) % 7).to_string()),
            Some('F') => out.push_str(&format!("{y}-{m:02}-{d:02}")),
            Some('T') => out.push_str(&format!("{h:02}:{mi:02}:{s:02}")),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, i.e. Python's `json.dumps`.
fn tojson(
    value: JValue,
    indent: Option<JValue>,
    kwargs: Kwargs,
) -> std::result::Result<JValue, minijinja::Error> {
    let indent = match kwargs.get::<Option<JValue>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer",
                    )
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    kwargs.assert_all_used()?;
    let opts = PyJson {
        indent,
        item_sep,
        key_sep,
        ensure_ascii,
        sort_keys,
    };
    let mut out = String::new();
    opts.write(&value, 0, &mut out)?;
    Ok(JValue::from_safe_string(out))
}

struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson {
    fn write(
        &self,
        v: &JValue,
        level: usize,
        out: &mut String,
    ) -> std::result::Result<(), minijinja::Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    out.push_str(&v.to_string());
                } else {
                    out.push_str(&py_float(f64::try_from(v.clone()).unwrap_or(f64::NAN)));
                }
            }
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<JValue> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<JValue> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort();
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    match k.kind() {
                        ValueKind::String => self.string(k.as_str().unwrap_or_default(), out),
                        ValueKind::None => out.push_str("\"null\""),
                        ValueKind::Bool => {
                            out.push_str(if k.is_true() { "\"true\"" } else { "\"false\"" })
                        }
                        _ => self.string(&k.to_string(), out),
                    }
                    out.push_str(&self.key_sep);
                    self.write(&v.get_item(k)?, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            ValueKind::Bytes => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: bytes are not JSON serializable",
                ))
            }
            _ => self.string(&v.to_string(), out),
        }
        Ok(())
    }

    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0C}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7e) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)` as `json.dumps` writes it.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{f:e}"); // shortest round-trip digits, e.g. "1.5e-7"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            s + ".0"
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Qwen3's published chat template (Qwen/Qwen3-8B tokenizer_config.json; the fixture
    /// file is its `chat_template` string as published).
    const QWEN3: &str = include_str!("../tests/fixtures/templates/qwen3-8b.chat_template.jinja");

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    /// Meta-Llama-3-8B-Instruct's template.
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

    /// Mistral-style: Python string methods, `raise_exception`, block tags on their own
    /// lines (trim_blocks / lstrip_blocks matter).
    const PYCOMPAT: &str = "{{ bos_token -}}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'].strip() + '\\n\\n' %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set system = '' %}
    {% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% if loop.first %}
            {{- '[INST] ' + system + message['content'].strip() + ' [/INST]' -}}
        {% else %}
            {{- '[INST] ' + message['content'].strip() + ' [/INST]' -}}
        {% endif %}
    {% elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'].strip().replace('  ', ' ') + eos_token -}}
    {% endif %}
{% endfor %}
";

    fn no_extra() -> Map<String, Value> {
        Map::new()
    }

    fn qwen3() -> ChatTemplate {
        ChatTemplate::new(
            QWEN3,
            None,
            Some("<|im_end|>".into()),
            "qwen3/tokenizer_config.json",
        )
        .unwrap()
    }

    #[test]
    fn qwen3_thinking_on_and_off() {
        let t = qwen3();
        let msgs = [
            ChatMessage::system("You are helpful."),
            ChatMessage::user("Hi!"),
        ];
        let base = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(
            t.render(&msgs, true, Some(true), &no_extra()).unwrap(),
            base
        );
        assert_eq!(t.render(&msgs, true, None, &no_extra()).unwrap(), base);
        assert_eq!(
            t.render(&msgs, true, Some(false), &no_extra()).unwrap(),
            format!("{base}<think>\n\n</think>\n\n")
        );
        // Without a generation prompt there is no assistant header.
        assert_eq!(
            t.render(&msgs, false, Some(false), &no_extra()).unwrap(),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        );
    }

    #[test]
    fn qwen3_multi_turn_drops_old_reasoning() {
        let t = qwen3();
        let msgs = [
            ChatMessage::user("1+1?"),
            ChatMessage::assistant("<think>\nadd them\n</think>\n\n2"),
            ChatMessage::user("2+2?"),
        ];
        let out = t.render(&msgs, true, Some(true), &no_extra()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        // A final assistant turn (after the last query) keeps its reasoning.
        let msgs = [
            ChatMessage::user("1+1?"),
            ChatMessage::assistant("<think>\nadd them\n</think>\n\n2"),
        ];
        let out = t.render(&msgs, false, None, &no_extra()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n<think>\nadd them\n</think>\n\n2<|im_end|>\n"
        );
    }

    #[test]
    fn qwen3_tools_use_python_json() {
        let t = qwen3();
        let tool = json!({"type": "function", "function": {"name": "get_weather", "description": "Météo",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
        let mut extra = Map::new();
        extra.insert("tools".into(), json!([tool]));
        let out = t
            .render(&[ChatMessage::user("Paris?")], true, None, &extra)
            .unwrap();
        let expect = r#"<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Météo", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>"#;
        assert!(out.contains(expect), "{out}");
        assert!(out.starts_with("<|im_start|>system\n# Tools\n"), "{out}");
        assert!(
            out.ends_with("<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n"),
            "{out}"
        );
    }

    /// An assistant's `tool_calls` and the `tool` answers reach the template as HF passes
    /// them (Qwen3's template prints the calls as `<tool_call>` JSON, the answers as
    /// `<tool_response>` in a user turn).
    #[test]
    fn qwen3_renders_tool_calls_and_tool_messages() {
        let t = qwen3();
        let mut call = ChatMessage::assistant("");
        call.extra.insert(
            "tool_calls".into(),
            json!([{"id": "call_0", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]),
        );
        let mut answer = ChatMessage::new("tool", "18 C, sunny");
        answer
            .extra
            .insert("tool_call_id".into(), Value::String("call_0".into()));
        let msgs = [ChatMessage::user("Paris?"), call, answer];
        let out = t.render(&msgs, true, None, &no_extra()).unwrap();
        assert!(
            out.ends_with("<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
            "{out}"
        );
    }

    #[test]
    fn chatml() {
        let t = ChatTemplate::new(CHATML, None, None, "chatml").unwrap();
        let out = t.render(
            &[
                ChatMessage::user("a"),
                ChatMessage::assistant("b"),
                ChatMessage::user("c"),
            ],
            true,
            None,
            &no_extra(),
        );
        assert_eq!(
            out.unwrap(),
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn llama3_with_bos() {
        let t = ChatTemplate::new(
            LLAMA3,
            Some("<|begin_of_text|>".into()),
            Some("<|eot_id|>".into()),
            "llama3",
        )
        .unwrap();
        let out = t.render(
            &[
                ChatMessage::system("Be brief. "),
                ChatMessage::user("\nHello"),
            ],
            true,
            None,
            &no_extra(),
        );
        assert_eq!(
            out.unwrap(),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn pycompat_methods_and_block_whitespace() {
        let t = ChatTemplate::new(PYCOMPAT, Some("<s>".into()), Some("</s>".into()), "mistral")
            .unwrap();
        let msgs = [
            ChatMessage::system("  Be nice.  "),
            ChatMessage::user(" hi "),
            ChatMessage::assistant(" hello  there "),
            ChatMessage::user("bye"),
        ];
        let out = t.render(&msgs, false, None, &no_extra()).unwrap();
        assert_eq!(
            out,
            "<s>[INST] Be nice.\n\nhi [/INST] hello there</s>[INST] bye [/INST]"
        );
    }

    #[test]
    fn raise_exception_is_a_template_error() {
        let t = ChatTemplate::new(
            PYCOMPAT,
            Some("<s>".into()),
            Some("</s>".into()),
            "mistral/tokenizer_config.json",
        )
        .unwrap();
        let e = t
            .render(&[ChatMessage::assistant("x")], false, None, &no_extra())
            .unwrap_err();
        assert!(matches!(e, Error::Template { .. }), "{e:?}");
        let s = e.to_string();
        assert!(
            s.contains("mistral/tokenizer_config.json") && s.contains("roles must alternate"),
            "{s}"
        );
    }

    #[test]
    fn syntax_error_names_the_file() {
        let e = ChatTemplate::new(
            "{% for m in messages %}{{ m.content }",
            None,
            None,
            "x/tokenizer_config.json",
        )
        .unwrap_err();
        assert!(matches!(e, Error::Template { .. }), "{e:?}");
        assert!(e.to_string().contains("x/tokenizer_config.json"), "{e}");
    }

    #[test]
    fn tojson_kwargs_like_transformers() {
        let src = "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':'), sort_keys=true) }}|{{ x | tojson(ensure_ascii=true) }}|{{ [] | tojson(indent=2) }}";
        let t = ChatTemplate::new(src, None, None, "t").unwrap();
        let mut extra = Map::new();
        extra.insert(
            "x".into(),
            json!({"b": [1, 2.5, null, true], "a": "é<\"\n"}),
        );
        let out = t.render(&[], false, None, &extra).unwrap();
        let parts: Vec<&str> = out.split('|').collect();
        assert_eq!(parts[0], r#"{"b": [1, 2.5, null, true], "a": "é<\"\n"}"#);
        assert_eq!(
            parts[1],
            "{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": \"é<\\\"\\n\"\n}"
        );
        assert_eq!(parts[2], r#"{"a":"é<\"\n","b":[1,2.5,null,true]}"#);
        assert_eq!(
            parts[3],
            r#"{"b": [1, 2.5, null, true], "a": "\u00e9<\"\n"}"#
        );
        assert_eq!(parts[4], "[]");
    }

    #[test]
    fn python_floats() {
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(0.1), "0.1");
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(1.5e-7), "1.5e-07");
        assert_eq!(py_float(123456.75), "123456.75");
        assert_eq!(py_float(0.0001), "0.0001");
    }

    #[test]
    fn strftime_formats() {
        // 2024-07-26 13:25:09 UTC, a Friday.
        let t = 1_722_000_309;
        assert_eq!(strftime(t, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            strftime(t, "%Y-%m-%d %H:%M:%S %A %j %I%p %%"),
            "2024-07-26 13:25:09 Friday 208 01PM %"
        );
        assert_eq!(strftime(0, "%-d %B %Y %a"), "1 January 1970 Thu");
        assert_eq!(strftime(951_782_400, "%F"), "2000-02-29");
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", None, None, "t").unwrap();
        let year: i64 = t
            .render(&[], false, None, &no_extra())
            .unwrap()
            .parse()
            .unwrap();
        assert!(year >= 2024);
    }

    #[test]
    fn loop_controls_and_generation_tags() {
        let src = "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}";
        let t = ChatTemplate::new(src, None, None, "t").unwrap();
        let out = t
            .render(
                &[ChatMessage::user("a"), ChatMessage::user("b")],
                false,
                None,
                &no_extra(),
            )
            .unwrap();
        assert_eq!(out, "a");
    }

    #[test]
    fn load_from_tokenizer_config_string_list_and_jinja_file() {
        let dir = tempfile::tempdir().unwrap();
        let tc = dir.path().join("tokenizer_config.json");
        // String template, AddedToken-object bos.
        let cfg = json!({"bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>",
                         "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"});
        std::fs::write(&tc, cfg.to_string()).unwrap();
        let t = ChatTemplate::from_tokenizer_config(&tc).unwrap();
        assert_eq!(t.bos_token(), Some("<s>"));
        assert_eq!(
            t.render(&[ChatMessage::user("x")], false, None, &no_extra())
                .unwrap(),
            "<s>x</s>"
        );
        // List of named templates: `default` is used.
        let cfg = json!({"chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]});
        std::fs::write(&tc, cfg.to_string()).unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap();
        assert_eq!(t.render(&[], false, None, &no_extra()).unwrap(), "DEFAULT");
        let cfg = json!({"chat_template": [{"name": "tool_use", "template": "TOOLS"}]});
        std::fs::write(&tc, cfg.to_string()).unwrap();
        let e = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("default") && e.contains("tool_use"), "{e}");
        // chat_template.jinja next to it wins.
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "JINJA {{ eos_token }}\n",
        )
        .unwrap();
        std::fs::write(&tc, json!({"eos_token": "</s>"}).to_string()).unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap();
        assert_eq!(
            t.render(&[], false, None, &no_extra()).unwrap(),
            "JINJA </s>"
        );
        assert!(t.file().ends_with("chat_template.jinja"));
        // A syntax error in the .jinja file names that file.
        std::fs::write(dir.path().join("chat_template.jinja"), "{% if %}").unwrap();
        let e = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("chat_template.jinja"), "{e}");
    }

    #[test]
    fn missing_template_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let tc = dir.path().join("tokenizer_config.json");
        std::fs::write(&tc, r#"{"eos_token": "</s>"}"#).unwrap();
        let e = ChatTemplate::from_tokenizer_config(&tc).unwrap_err();
        assert!(matches!(e, Error::Template { .. }), "{e:?}");
        let s = e.to_string();
        assert!(
            s.contains("tokenizer_config.json") && s.contains("no `chat_template`"),
            "{s}"
        );
        std::fs::remove_file(&tc).unwrap();
        let e = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no chat template"), "{e}");
        std::fs::write(&tc, "{bad json").unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).is_err());
        std::fs::write(&tc, r#"{"chat_template": 3}"#).unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).is_err());
    }
}
