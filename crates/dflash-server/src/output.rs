//! The model's generated text -> the parts of an OpenAI assistant message: `content`,
//! `reasoning_content` and `tool_calls`.
//!
//! Where it sits: after detokenization and stop strings (worker.rs), before the response
//! bodies (lib.rs); it only reads text, so DFlash's output (the target's tokens) is untouched.
//! Pure and incremental: [`OutputParser::push`] takes each text delta and returns what is now
//! final, [`OutputParser::finish`] flushes what was held back. A non-streaming response is the
//! fold of the same deltas, so streamed and not agree (tested on every split of the fixtures).
//!
//! Formats (the names are `--tool-call-parser` / `--reasoning-parser` values):
//! - `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\n{"name": f, "arguments": {..}}\n</tool_call>`
//! - `qwen3_coder`: `<tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call>`
//!   (values are text, typed by the tool's JSON schema)
//! - `gpt_oss` (harmony): `<|channel|>analysis<|message|>..<|end|>` is reasoning,
//!   `<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{..}`
//!   a call, `final` (and `commentary` without a recipient) content
//! - `llama3_json` (Llama 3.1 / 3.2): the whole output is `{"name": f, "parameters": {..}}`
//!   (optionally after `<|python_tag|>`, several separated by `;`)
//! - `kimi_k2`: `<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{..}<|tool_call_end|>..<|tool_calls_section_end|>`
//! - `gemma4`: `<|tool_call>call:f{k:<|"|>text<|"|>,n:3}<tool_call|>`
//! - reasoning `qwen3`: a leading `<think>..</think>` block (or, when the prompt already opened
//!   `<think>`, everything up to `</think>`).
//!
//! A call is checked whole before any of it is sent (streaming sends it as one
//! `delta.tool_calls` entry once its closing marker is generated), so that a malformed call
//! can come back as text instead: never a 500, and a tool call's text never reaches `content`.

use serde_json::{Map, Value};
use std::collections::HashMap;

/// A tool-call syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Qwen3Coder,
    GptOss,
    Llama3Json,
    KimiK2,
    Gemma4,
}

impl ToolFormat {
    pub const ALL: [ToolFormat; 6] = [
        ToolFormat::Hermes,
        ToolFormat::Qwen3Coder,
        ToolFormat::GptOss,
        ToolFormat::Llama3Json,
        ToolFormat::KimiK2,
        ToolFormat::Gemma4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Qwen3Coder => "qwen3_coder",
            ToolFormat::GptOss => "gpt_oss",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::KimiK2 => "kimi_k2",
            ToolFormat::Gemma4 => "gemma4",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == s)
    }

    /// The syntax a model's chat template teaches (the template prints it for past calls and
    /// describes it to the model), else the one of its `model_type`.
    pub fn detect(template: &str, model_type: &str) -> Option<Self> {
        let has = |s: &str| template.contains(s);
        if has("<|channel|>") || model_type == "gpt_oss" {
            Some(ToolFormat::GptOss)
        } else if has("<|tool_calls_section_begin|>") || model_type.starts_with("kimi") {
            Some(ToolFormat::KimiK2)
        } else if has("<|tool_call>") {
            Some(ToolFormat::Gemma4)
        } else if has("<function=") && has("<parameter=") {
            Some(ToolFormat::Qwen3Coder)
        } else if has("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if has("<|python_tag|>") || has("<|start_header_id|>ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// Whether its markers are special tokens, which the text must then keep
    /// (`skip_special_tokens = false`).
    pub fn needs_special_tokens(self) -> bool {
        matches!(
            self,
            ToolFormat::GptOss | ToolFormat::KimiK2 | ToolFormat::Gemma4
        )
    }
}

/// A reasoning syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// `<think>..</think>` (Qwen3 families, DeepSeek-R1 style).
    Qwen3,
    /// gpt-oss's `analysis` channel.
    GptOss,
}

impl ReasoningFormat {
    pub const ALL: [ReasoningFormat; 2] = [ReasoningFormat::Qwen3, ReasoningFormat::GptOss];

    pub fn name(self) -> &'static str {
        match self {
            ReasoningFormat::Qwen3 => "qwen3",
            ReasoningFormat::GptOss => "gpt_oss",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == s)
    }

    pub fn detect(template: &str, model_type: &str) -> Option<Self> {
        if template.contains("<|channel|>") || model_type == "gpt_oss" {
            Some(ReasoningFormat::GptOss)
        } else if template.contains("<think>") || template.contains("</think>") {
            Some(ReasoningFormat::Qwen3)
        } else {
            None
        }
    }
}

/// How one response is parsed.
#[derive(Debug, Clone, Default)]
pub struct ParserConfig {
    /// None: no tool-call parsing (no `tools`, or `tool_choice: "none"`).
    pub tools: Option<ToolFormat>,
    pub reasoning: Option<ReasoningFormat>,
    /// The prompt ends inside a `<think>` block that the template opened.
    pub reasoning_open: bool,
    /// false: calls after the first are dropped (`parallel_tool_calls: false`).
    pub single_call: bool,
    /// Call ids are this prefix and the call's index.
    pub id_prefix: String,
    /// Function -> parameter -> JSON-schema `type` (qwen3_coder's values are text).
    pub param_types: HashMap<String, HashMap<String, String>>,
}

impl ParserConfig {
    /// Whether the parser has anything to do (else the text is all content).
    pub fn active(&self) -> bool {
        self.tools.is_some() || self.reasoning.is_some()
    }
    /// Whether the text must keep special tokens.
    pub fn needs_special_tokens(&self) -> bool {
        self.tools.is_some_and(ToolFormat::needs_special_tokens)
            || self.reasoning == Some(ReasoningFormat::GptOss)
    }
    fn harmony(&self) -> bool {
        self.tools == Some(ToolFormat::GptOss) || self.reasoning == Some(ReasoningFormat::GptOss)
    }
}

/// One finished tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub index: usize,
    pub id: String,
    pub name: String,
    /// A JSON object, as text.
    pub arguments: String,
}

/// A piece of the message, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    Reasoning(String),
    ToolCall(ToolCall),
}

/// A whole message (the fold of its deltas).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Message {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Message {
    pub fn add(&mut self, d: Delta) {
        match d {
            Delta::Content(t) => self.content.push_str(&t),
            Delta::Reasoning(t) => self.reasoning.push_str(&t),
            Delta::ToolCall(c) => self.tool_calls.push(c),
        }
    }
}

/// A call as parsed, before it is numbered.
#[derive(Debug)]
struct RawCall {
    name: String,
    arguments: String,
    id: Option<String>,
}

/// The incremental parser of one response.
pub struct OutputParser {
    cfg: ParserConfig,
    stage: Stage,
    calls: usize,
}

enum Stage {
    Harmony(Harmony),
    Split {
        think: Option<Think>,
        tools: Option<Tools>,
    },
}

/// What the stages emit, merged and numbered.
struct Out<'a> {
    cfg: &'a ParserConfig,
    calls: &'a mut usize,
    deltas: Vec<Delta>,
}

impl Out<'_> {
    fn content(&mut self, t: &str) {
        self.text(t, false)
    }
    fn reasoning(&mut self, t: &str) {
        self.text(t, true)
    }
    fn text(&mut self, t: &str, reasoning: bool) {
        if t.is_empty() {
            return;
        }
        match (self.deltas.last_mut(), reasoning) {
            (Some(Delta::Content(s)), false) | (Some(Delta::Reasoning(s)), true) => s.push_str(t),
            _ => self.deltas.push(if reasoning {
                Delta::Reasoning(t.to_string())
            } else {
                Delta::Content(t.to_string())
            }),
        }
    }
    fn call(&mut self, c: RawCall) {
        if self.cfg.single_call && *self.calls >= 1 {
            return;
        }
        let index = *self.calls;
        *self.calls += 1;
        self.deltas.push(Delta::ToolCall(ToolCall {
            index,
            id: c
                .id
                .unwrap_or_else(|| format!("{}{index}", self.cfg.id_prefix)),
            name: c.name,
            arguments: c.arguments,
        }));
    }
}

impl OutputParser {
    pub fn new(cfg: ParserConfig) -> Self {
        let stage = if cfg.harmony() {
            // the generation prompt ends with `<|start|>assistant`: the output begins inside
            // a header (` to=functions.f<|channel|>commentary json<|message|>` or
            // `<|channel|>analysis<|message|>`)
            Stage::Harmony(Harmony {
                state: HState::Header,
                ..Harmony::default()
            })
        } else {
            Stage::Split {
                think: (cfg.reasoning == Some(ReasoningFormat::Qwen3)).then(|| Think {
                    state: if cfg.reasoning_open {
                        ThinkState::In { lead: true }
                    } else {
                        ThinkState::Start
                    },
                    buf: String::new(),
                }),
                tools: cfg.tools.map(Tools::new),
            }
        };
        Self {
            cfg,
            stage,
            calls: 0,
        }
    }

    /// Feeds newly generated text; returns what is final.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.run(Some(text))
    }

    /// The generation ended: everything held back, parsed as far as it goes.
    pub fn finish(&mut self) -> Vec<Delta> {
        self.run(None)
    }

    /// Whether any tool call was emitted.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    fn run(&mut self, text: Option<&str>) -> Vec<Delta> {
        let mut out = Out {
            cfg: &self.cfg,
            calls: &mut self.calls,
            deltas: Vec::new(),
        };
        match &mut self.stage {
            Stage::Harmony(h) => {
                let tools = self.cfg.tools.is_some();
                let reasoning = self.cfg.reasoning.is_some();
                match text {
                    Some(t) => h.push(t, tools, reasoning, &mut out),
                    None => h.finish(tools, reasoning, &mut out),
                }
            }
            Stage::Split { think, tools } => {
                let mut content = Vec::new();
                match (think.as_mut(), text) {
                    (Some(th), Some(t)) => th.push(t, &mut out, &mut content),
                    (Some(th), None) => th.finish(&mut out, &mut content),
                    (None, Some(t)) => content.push(t.to_string()),
                    (None, None) => {}
                }
                match tools {
                    Some(tl) => {
                        for c in &content {
                            tl.push(c, &self.cfg, &mut out);
                        }
                        if text.is_none() {
                            tl.finish(&self.cfg, &mut out);
                        }
                    }
                    None => content.iter().for_each(|c| out.content(c)),
                }
            }
        }
        out.deltas
    }
}

/// The longest suffix of `buf` that is a proper prefix of one of `markers` (held back: it may
/// become a marker).
fn partial_suffix(buf: &str, markers: &[&str]) -> usize {
    let mut keep = 0;
    for m in markers {
        for l in (keep + 1..m.len()).rev() {
            if m.is_char_boundary(l) && buf.ends_with(&m[..l]) {
                keep = l;
                break;
            }
        }
    }
    keep
}

/// The earliest of `markers` in `buf` at or after `from`: (position, marker).
fn find_first<'m>(buf: &str, from: usize, markers: &[&'m str]) -> Option<(usize, &'m str)> {
    let mut from = from.min(buf.len());
    while !buf.is_char_boundary(from) {
        from -= 1;
    }
    markers
        .iter()
        .filter_map(|m| buf[from..].find(m).map(|p| (from + p, *m)))
        .min_by_key(|(p, _)| *p)
}

// ---------------------------------------------------------------- reasoning: <think> blocks

const THINK: &str = "<think>";
const UNTHINK: &str = "</think>";

struct Think {
    state: ThinkState,
    buf: String,
}

enum ThinkState {
    /// Before the first non-blank text: a `<think>` there opens reasoning.
    Start,
    /// Inside the block; `lead`: its leading blanks not yet skipped.
    In { lead: bool },
    /// After it (or without one); `lead`: the blanks after `</think>` not yet skipped.
    Out { lead: bool },
}

impl Think {
    /// Splits `text`: reasoning goes to `out`, content (in order) to `content`.
    fn push(&mut self, text: &str, out: &mut Out, content: &mut Vec<String>) {
        self.buf.push_str(text);
        loop {
            match &mut self.state {
                ThinkState::Start => {
                    let t = self.buf.trim_start();
                    if t.is_empty() || (THINK.starts_with(t) && t != THINK) {
                        return;
                    }
                    if let Some(rest) = t.strip_prefix(THINK) {
                        self.buf = rest.to_string();
                        self.state = ThinkState::In { lead: true };
                    } else {
                        self.state = ThinkState::Out { lead: false };
                    }
                }
                ThinkState::In { lead } => {
                    if *lead {
                        let t = self.buf.trim_start();
                        if t.is_empty() {
                            self.buf.clear();
                            return;
                        }
                        self.buf = t.to_string();
                        *lead = false;
                    }
                    if let Some(p) = self.buf.find(UNTHINK) {
                        out.reasoning(self.buf[..p].trim_end());
                        self.buf.drain(..p + UNTHINK.len());
                        self.state = ThinkState::Out { lead: true };
                        continue;
                    }
                    // hold back a possible `</think>` and the blanks before it
                    let keep = partial_suffix(&self.buf, &[UNTHINK]);
                    let body = self.buf[..self.buf.len() - keep].trim_end();
                    let cut = body.len();
                    out.reasoning(body);
                    self.buf.drain(..cut);
                    return;
                }
                ThinkState::Out { lead } => {
                    if *lead {
                        let t = self.buf.trim_start();
                        if t.is_empty() {
                            self.buf.clear();
                            return;
                        }
                        self.buf = t.to_string();
                        *lead = false;
                    }
                    if !self.buf.is_empty() {
                        content.push(std::mem::take(&mut self.buf));
                    }
                    return;
                }
            }
        }
    }

    fn finish(&mut self, out: &mut Out, content: &mut Vec<String>) {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            // a thought cut off (max_tokens, a stop string) is still reasoning
            ThinkState::In { .. } => out.reasoning(rest.trim()),
            _ => {
                if !rest.is_empty() {
                    content.push(rest)
                }
            }
        }
    }
}

// ---------------------------------------------------------------- tool calls in text

struct Tools {
    fmt: ToolFormat,
    buf: String,
    state: ToolState,
    /// Blanks after the last content text, sent only if more content follows (blanks next
    /// to a call are dropped).
    blanks: String,
    /// The last thing out was a call: the blanks after it are dropped.
    after_call: bool,
    /// How far the current block was searched for its end marker.
    searched: usize,
}

#[derive(PartialEq)]
enum ToolState {
    /// llama3_json: before the first non-blank text, which decides.
    JsonStart,
    /// llama3_json: the output is calls; parsed whole at the end.
    Json,
    Text,
    /// Between a begin marker and its end marker.
    Block,
}

const PYTHON_TAG: &str = "<|python_tag|>";

impl Tools {
    fn new(fmt: ToolFormat) -> Self {
        Self {
            fmt,
            buf: String::new(),
            state: if fmt == ToolFormat::Llama3Json {
                ToolState::JsonStart
            } else {
                ToolState::Text
            },
            blanks: String::new(),
            after_call: false,
            searched: 0,
        }
    }

    /// (begin, end) markers of a block of calls.
    fn markers(&self) -> Option<(&'static str, &'static str)> {
        match self.fmt {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => Some(("<tool_call>", "</tool_call>")),
            ToolFormat::KimiK2 => {
                Some(("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"))
            }
            ToolFormat::Gemma4 => Some(("<|tool_call>", "<tool_call|>")),
            ToolFormat::Llama3Json | ToolFormat::GptOss => None,
        }
    }

    fn text(&mut self, s: &str, out: &mut Out) {
        let s = if self.after_call { s.trim_start() } else { s };
        if s.is_empty() {
            return;
        }
        self.after_call = false;
        let t = s.trim_end();
        if !t.is_empty() {
            let b = std::mem::take(&mut self.blanks);
            out.content(&b);
            out.content(t);
        }
        self.blanks.push_str(&s[t.len()..]);
    }

    fn calls(&mut self, calls: Vec<RawCall>, out: &mut Out) {
        self.blanks.clear();
        self.after_call = true;
        calls.into_iter().for_each(|c| out.call(c));
    }

    fn push(&mut self, text: &str, cfg: &ParserConfig, out: &mut Out) {
        self.buf.push_str(text);
        loop {
            match self.state {
                ToolState::JsonStart => {
                    let t = self.buf.trim_start();
                    if t.is_empty() || (PYTHON_TAG.starts_with(t) && t != PYTHON_TAG) {
                        return;
                    }
                    self.state = if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                        ToolState::Json
                    } else {
                        ToolState::Text
                    };
                }
                ToolState::Json => return,
                ToolState::Text => {
                    let Some((begin, _)) = self.markers() else {
                        let b = std::mem::take(&mut self.buf);
                        self.text(&b, out);
                        return;
                    };
                    if let Some(p) = self.buf.find(begin) {
                        let before = self.buf[..p].to_string();
                        self.text(&before, out);
                        self.buf.drain(..p + begin.len());
                        self.state = ToolState::Block;
                        self.searched = 0;
                        continue;
                    }
                    let cut = self.buf.len() - partial_suffix(&self.buf, &[begin]);
                    let before = self.buf[..cut].to_string();
                    self.text(&before, out);
                    self.buf.drain(..cut);
                    return;
                }
                ToolState::Block => {
                    let (begin, end) = self.markers().expect("a block has markers");
                    let from = self.searched.saturating_sub(end.len());
                    match find_first(&self.buf, from, &[end]) {
                        Some((p, _)) => {
                            let body = self.buf[..p].to_string();
                            self.buf.drain(..p + end.len());
                            self.state = ToolState::Text;
                            match parse_block(self.fmt, &body, cfg) {
                                Some(c) => self.calls(c, out),
                                None => self.text(&format!("{begin}{body}{end}"), out),
                            }
                        }
                        None => {
                            self.searched = self.buf.len();
                            return;
                        }
                    }
                }
            }
        }
    }

    fn finish(&mut self, cfg: &ParserConfig, out: &mut Out) {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            ToolState::Json => match parse_llama3(&rest) {
                Some(c) => self.calls(c, out),
                None => self.text(&rest, out),
            },
            ToolState::Block => {
                let (begin, _) = self.markers().expect("a block has markers");
                // the end marker never came (max_tokens, or the model stopped): a call only if
                // what came is whole
                match parse_block(self.fmt, &rest, cfg) {
                    Some(c) => self.calls(c, out),
                    None => self.text(&format!("{begin}{rest}"), out),
                }
            }
            ToolState::JsonStart | ToolState::Text => self.text(&rest, out),
        }
        if !self.after_call {
            let b = std::mem::take(&mut self.blanks);
            out.content(&b);
        }
    }
}

fn parse_block(fmt: ToolFormat, body: &str, cfg: &ParserConfig) -> Option<Vec<RawCall>> {
    match fmt {
        ToolFormat::Hermes => parse_hermes(body).map(|c| vec![c]),
        ToolFormat::Qwen3Coder => parse_qwen3_coder(body, &cfg.param_types),
        ToolFormat::KimiK2 => parse_kimi(body),
        ToolFormat::Gemma4 => parse_gemma4(body).map(|c| vec![c]),
        ToolFormat::Llama3Json | ToolFormat::GptOss => None,
    }
}

/// `arguments` as a JSON object's text: an object, or a string holding one; none = `{}`.
fn arguments_text(v: Option<&Value>) -> Option<String> {
    match v {
        None | Some(Value::Null) => Some("{}".into()),
        Some(o @ Value::Object(_)) => Some(o.to_string()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(o @ Value::Object(_)) => Some(o.to_string()),
            _ => None,
        },
        Some(_) => None,
    }
}

/// `{"name": f, "arguments": {..}}` (also `parameters`, Llama's key).
fn json_call(v: &Value) -> Option<RawCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let args = o.get("arguments").or_else(|| o.get("parameters"));
    Some(RawCall {
        name: name.to_string(),
        arguments: arguments_text(args)?,
        id: None,
    })
}

fn parse_hermes(body: &str) -> Option<RawCall> {
    json_call(&serde_json::from_str::<Value>(body.trim()).ok()?)
}

/// One or more JSON calls, separated by `;` or blanks, after an optional `<|python_tag|>`.
fn parse_llama3(text: &str) -> Option<Vec<RawCall>> {
    let mut s = text.trim();
    s = s.strip_prefix(PYTHON_TAG).unwrap_or(s).trim_start();
    let mut calls = Vec::new();
    while !s.is_empty() {
        let mut it = serde_json::Deserializer::from_str(s).into_iter::<Value>();
        let v = it.next()?.ok()?;
        calls.push(json_call(&v)?);
        s = s[it.byte_offset()..].trim_start();
        s = s.strip_prefix(';').unwrap_or(s).trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// `<function=f>` `<parameter=k>` value `</parameter>` ... `</function>`, values typed by the
/// tool's schema (text when it says `string` or nothing).
fn parse_qwen3_coder(
    body: &str,
    types: &HashMap<String, HashMap<String, String>>,
) -> Option<Vec<RawCall>> {
    const FUNC: &str = "<function=";
    const PARAM: &str = "<parameter=";
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(p) = rest.find(FUNC) {
        let (name, inner_all) = tag_name(&rest[p + FUNC.len()..])?;
        let (inner, next) = match inner_all.find("</function>") {
            Some(e) => (&inner_all[..e], &inner_all[e + "</function>".len()..]),
            None => (inner_all, ""),
        };
        let mut args = Map::new();
        let mut ps = inner;
        while let Some(q) = ps.find(PARAM) {
            let (key, v) = tag_name(&ps[q + PARAM.len()..])?;
            let (val, after_v) = match find_first(v, 0, &["</parameter>", PARAM]) {
                Some((e, "</parameter>")) => (&v[..e], &v[e + "</parameter>".len()..]),
                Some((e, _)) => (&v[..e], &v[e..]),
                None => (v, ""),
            };
            let val = val.strip_prefix('\n').unwrap_or(val);
            let val = val.strip_suffix('\n').unwrap_or(val);
            let ty = types.get(name).and_then(|t| t.get(key)).map(String::as_str);
            args.insert(key.to_string(), typed_value(val, ty));
            ps = after_v;
        }
        calls.push(RawCall {
            name: name.to_string(),
            arguments: Value::Object(args).to_string(),
            id: None,
        });
        rest = next;
    }
    (!calls.is_empty()).then_some(calls)
}

/// The name of `<function=NAME>` / `<parameter=NAME>` (`s` starts after the `=`) and the text
/// after the `>`; None for an empty name or one holding `<` or a newline (not a tag).
fn tag_name(s: &str) -> Option<(&str, &str)> {
    let gt = s.find('>')?;
    let name = s[..gt].trim();
    (!name.is_empty() && !name.contains(['<', '\n'])).then_some((name, &s[gt + 1..]))
}

/// A parameter's text as its schema type says (text when it cannot be read as that type).
fn typed_value(s: &str, ty: Option<&str>) -> Value {
    let t = s.trim();
    let parsed = match ty {
        None | Some("string") => None,
        Some(_) if t == "null" || t == "None" => Some(Value::Null),
        Some("boolean") => match t.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        Some("integer") | Some("number") => serde_json::from_str::<Value>(t)
            .ok()
            .filter(Value::is_number),
        Some(_) => serde_json::from_str::<Value>(t).ok(),
    };
    parsed.unwrap_or_else(|| Value::String(s.to_string()))
}

/// `<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{..}<|tool_call_end|>`, any
/// number of them; the id is the model's (`functions.f:0`).
fn parse_kimi(body: &str) -> Option<Vec<RawCall>> {
    const BEGIN: &str = "<|tool_call_begin|>";
    const ARGS: &str = "<|tool_call_argument_begin|>";
    const END: &str = "<|tool_call_end|>";
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(p) = rest.find(BEGIN) {
        let a = &rest[p + BEGIN.len()..];
        let q = a.find(ARGS)?;
        let id = a[..q].trim();
        let after = &a[q + ARGS.len()..];
        let (args, next) = match after.find(END) {
            Some(e) => (&after[..e], &after[e + END.len()..]),
            None => (after, ""),
        };
        let base = id.rsplit_once(':').map_or(id, |(n, _)| n);
        let name = base.strip_prefix("functions.").unwrap_or(base);
        if name.is_empty() || name.contains(char::is_whitespace) {
            return None;
        }
        let v: Value = serde_json::from_str(args.trim()).ok()?;
        calls.push(RawCall {
            name: name.to_string(),
            arguments: arguments_text(Some(&v))?,
            id: Some(id.to_string()),
        });
        rest = next;
    }
    (!calls.is_empty()).then_some(calls)
}

/// `call:f{k:v,..}` with Gemma 4's values: `<|"|>text<|"|>`, numbers, `true`, `false`,
/// `null`, `[..]`, `{..}` (bare keys).
fn parse_gemma4(body: &str) -> Option<RawCall> {
    let s = body.trim().strip_prefix("call:")?;
    let brace = s.find('{')?;
    let name = s[..brace].trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    let mut g = GemmaArgs {
        s: &s[brace..],
        at: 0,
    };
    let v = g.value(0)?;
    if !v.is_object() || !g.s[g.at..].trim().is_empty() {
        return None;
    }
    Some(RawCall {
        name: name.to_string(),
        arguments: v.to_string(),
        id: None,
    })
}

struct GemmaArgs<'a> {
    s: &'a str,
    at: usize,
}

const GEMMA_QUOTE: &str = "<|\"|>";
/// Nesting a value may have (deeper is refused, never a stack overflow).
const MAX_DEPTH: usize = 64;

impl<'a> GemmaArgs<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.at..]
    }
    fn blanks(&mut self) {
        let r = self.rest();
        self.at += r.len() - r.trim_start().len();
    }
    fn eat(&mut self, c: char) -> bool {
        self.blanks();
        if self.rest().starts_with(c) {
            self.at += c.len_utf8();
            true
        } else {
            false
        }
    }
    fn quoted(&mut self) -> Option<String> {
        let r = self.rest().strip_prefix(GEMMA_QUOTE)?;
        let e = r.find(GEMMA_QUOTE)?;
        let v = r[..e].to_string();
        self.at += GEMMA_QUOTE.len() * 2 + e;
        Some(v)
    }
    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.blanks();
        let r = self.rest();
        if r.starts_with(GEMMA_QUOTE) {
            return self.quoted().map(Value::String);
        }
        if r.starts_with('"') {
            let mut it = serde_json::Deserializer::from_str(r).into_iter::<String>();
            let v = it.next()?.ok()?;
            self.at += it.byte_offset();
            return Some(Value::String(v));
        }
        if self.eat('{') {
            let mut m = Map::new();
            if self.eat('}') {
                return Some(Value::Object(m));
            }
            loop {
                self.blanks();
                let key = if self.rest().starts_with(GEMMA_QUOTE) {
                    self.quoted()?
                } else {
                    let r = self.rest();
                    let e = r.find(':')?;
                    let k = r[..e].trim();
                    if k.is_empty() || k.contains([',', '{', '}', '[', ']', '"']) {
                        return None;
                    }
                    let k = k.to_string();
                    self.at += e;
                    k
                };
                if !self.eat(':') {
                    return None;
                }
                let v = self.value(depth + 1)?;
                m.insert(key, v);
                if self.eat(',') {
                    continue;
                }
                if self.eat('}') {
                    return Some(Value::Object(m));
                }
                return None;
            }
        }
        if self.eat('[') {
            let mut a = Vec::new();
            if self.eat(']') {
                return Some(Value::Array(a));
            }
            loop {
                a.push(self.value(depth + 1)?);
                if self.eat(',') {
                    continue;
                }
                if self.eat(']') {
                    return Some(Value::Array(a));
                }
                return None;
            }
        }
        let e = r.find([',', '}', ']']).unwrap_or(r.len());
        let tok = r[..e].trim();
        if tok.is_empty() {
            return None;
        }
        self.at += e;
        Some(match tok {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            "null" => Value::Null,
            t => serde_json::from_str::<Value>(t)
                .ok()
                .filter(Value::is_number)
                .unwrap_or_else(|| Value::String(t.to_string())),
        })
    }
}

// ---------------------------------------------------------------- gpt-oss harmony

const H_START: &str = "<|start|>";
const H_CHANNEL: &str = "<|channel|>";
const H_MESSAGE: &str = "<|message|>";
const H_END: &str = "<|end|>";
const H_RETURN: &str = "<|return|>";
const H_CALL: &str = "<|call|>";
/// Longest message header accepted (`<|channel|>commentary to=functions.f <|constrain|>json`).
const MAX_HEADER: usize = 1024;

#[derive(Default)]
struct Harmony {
    buf: String,
    state: HState,
    /// The arguments of the call being generated.
    args: String,
    searched: usize,
}

#[derive(Default, Clone, PartialEq)]
enum HState {
    /// Between messages.
    #[default]
    Outside,
    /// After `<|start|>` (or at `<|channel|>`, or at the start of the output), before
    /// `<|message|>`.
    Header,
    Body(Kind),
}

#[derive(Clone, PartialEq)]
enum Kind {
    Reasoning,
    Content,
    Call(String),
}

impl Harmony {
    fn classify(header: &str, tools: bool, reasoning: bool) -> Kind {
        let word = |after: &str| -> String {
            after
                .split(|c: char| c.is_whitespace() || c == '<')
                .next()
                .unwrap_or("")
                .to_string()
        };
        let recipient = header.find("to=").map(|p| word(&header[p + 3..]));
        let channel = header
            .find(H_CHANNEL)
            .map(|p| word(&header[p + H_CHANNEL.len()..]));
        match recipient {
            Some(r) if tools && !r.is_empty() => {
                Kind::Call(r.strip_prefix("functions.").unwrap_or(&r).to_string())
            }
            _ if reasoning && channel.as_deref() == Some("analysis") => Kind::Reasoning,
            _ => Kind::Content,
        }
    }

    fn body_text(kind: &Kind, t: &str, args: &mut String, out: &mut Out) {
        match kind {
            Kind::Reasoning => out.reasoning(t),
            Kind::Content => out.content(t),
            Kind::Call(_) => args.push_str(t),
        }
    }

    fn end_call(&mut self, name: &str, out: &mut Out) {
        let a = std::mem::take(&mut self.args);
        match serde_json::from_str::<Value>(a.trim()) {
            Ok(v @ Value::Object(_)) => out.call(RawCall {
                name: name.to_string(),
                arguments: v.to_string(),
                id: None,
            }),
            _ => out.content(&a),
        }
    }

    fn push(&mut self, text: &str, tools: bool, reasoning: bool, out: &mut Out) {
        self.buf.push_str(text);
        loop {
            match self.state.clone() {
                HState::Outside => match find_first(&self.buf, 0, &[H_START, H_CHANNEL]) {
                    Some((p, m)) => {
                        out.content(&self.buf[..p]);
                        let skip = if m == H_START { p + m.len() } else { p };
                        self.buf.drain(..skip);
                        self.state = HState::Header;
                    }
                    None => {
                        let cut = self.buf.len() - partial_suffix(&self.buf, &[H_START, H_CHANNEL]);
                        out.content(&self.buf[..cut]);
                        self.buf.drain(..cut);
                        return;
                    }
                },
                HState::Header => match self.buf.find(H_MESSAGE) {
                    Some(p) if p <= MAX_HEADER => {
                        let kind = Self::classify(&self.buf[..p], tools, reasoning);
                        self.buf.drain(..p + H_MESSAGE.len());
                        self.state = HState::Body(kind);
                        self.searched = 0;
                    }
                    _ if self.buf.len() > MAX_HEADER => {
                        // not a header after all: its first MAX_HEADER bytes are text (the
                        // same cut however the text was split)
                        let mut k = MAX_HEADER;
                        while !self.buf.is_char_boundary(k) {
                            k -= 1;
                        }
                        out.content(&self.buf[..k]);
                        self.buf.drain(..k);
                        self.state = HState::Outside;
                    }
                    _ => return,
                },
                HState::Body(kind) => {
                    const ENDS: [&str; 4] = [H_END, H_RETURN, H_CALL, H_START];
                    let from = self.searched.saturating_sub(H_RETURN.len());
                    match find_first(&self.buf, from, &ENDS) {
                        Some((p, m)) => {
                            let body = self.buf[..p].to_string();
                            Self::body_text(&kind, &body, &mut self.args, out);
                            if let Kind::Call(name) = &kind {
                                self.end_call(name, out);
                            }
                            let skip = if m == H_START { p } else { p + m.len() };
                            self.buf.drain(..skip);
                            self.state = HState::Outside;
                        }
                        None => {
                            let cut = self.buf.len() - partial_suffix(&self.buf, &ENDS);
                            let body = self.buf[..cut].to_string();
                            Self::body_text(&kind, &body, &mut self.args, out);
                            self.buf.drain(..cut);
                            self.searched = self.buf.len();
                            return;
                        }
                    }
                }
            }
        }
    }

    fn finish(&mut self, _tools: bool, _reasoning: bool, out: &mut Out) {
        let rest = std::mem::take(&mut self.buf);
        match std::mem::take(&mut self.state) {
            HState::Outside | HState::Header => out.content(&rest),
            // (gpt-oss ends a call with <|call|> and an answer with <|return|>: stop tokens,
            // so they are not in the text and the last message ends here)
            HState::Body(kind) => {
                Self::body_text(&kind, &rest, &mut self.args, out);
                if let Kind::Call(name) = &kind {
                    self.end_call(name, out);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
