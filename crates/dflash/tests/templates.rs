//! Published chat templates rendered by our minijinja setup == rendered by transformers'
//! Jinja setup (fixtures by tools/goldens/make_template_goldens.py). gpt-oss's harmony
//! template is the hardest one we ship models for: macros with recursion, `namespace`,
//! `strftime_now`, `tojson`, Python-style `.items()`, tool schemas as TypeScript.

use dflash::chat::{ChatMessage, ChatTemplate};
use serde_json::{Map, Value};
use std::path::PathBuf;

fn undate(s: &str) -> String {
    match s.find("Current date: ") {
        Some(i) => {
            let d = i + "Current date: ".len();
            format!("{}<DATE>{}", &s[..d], &s[d + 10..])
        }
        None => s.to_string(),
    }
}

#[test]
fn gpt_oss_harmony_template_renders_like_transformers() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
    let src = std::fs::read_to_string(dir.join("gpt-oss-20b.chat_template.jinja")).unwrap();
    let cases: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(dir.join("gpt-oss-20b.renders.json")).unwrap(),
    )
    .unwrap();
    let t = ChatTemplate::new(
        src,
        Some("<|startoftext|>".into()),
        Some("<|return|>".into()),
        "gpt-oss-20b/chat_template.jinja",
    )
    .unwrap();
    for (i, c) in cases.iter().enumerate() {
        let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let mut extra: Map<String, Value> = c["extra"].as_object().unwrap().clone();
        if !c["tools"].is_null() {
            extra.insert("tools".into(), c["tools"].clone());
        }
        let got = t
            .render(
                &msgs,
                c["add_generation_prompt"].as_bool().unwrap(),
                None,
                &extra,
            )
            .unwrap();
        assert_eq!(undate(&got), c["rendered"].as_str().unwrap(), "case {i}");
    }
}
