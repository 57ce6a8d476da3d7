//! Hostile request bodies through `api::prepare` (what the server runs on every body): each
//! is a 4xx naming the field, never a panic or an unbounded allocation. Inputs the
//! server_request fuzz target found are pinned here too (docs/reliability.md).

use dflash::chat::ChatTemplate;
use dflash::tokenizer::Tokenizer;
use dflash_server::api::{prepare, ApiError, Kind, Limits, Prepared, MAX_MESSAGES, MAX_STOP_BYTES};
use serde_json::json;

fn tokenizer() -> Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> = ["<unk>", "hello", "world", "a", "b"]
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), json!(i)))
        .collect();
    let t = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    Tokenizer::from_bytes(t.to_string().as_bytes(), "words.json").unwrap()
}

fn limits() -> Limits {
    Limits {
        model_names: vec!["m".into()],
        vocab_size: 5,
        max_context: 64,
        max_tokens_default: 8,
        max_stop: 16,
    }
}

fn run(kind: Kind, body: &str, template: Option<&ChatTemplate>) -> Result<Prepared, ApiError> {
    prepare(kind, body.as_bytes(), &limits(), &tokenizer(), template)
}

fn bad(kind: Kind, body: &str, param: Option<&str>, want: &str) {
    let e = run(kind, body, None).expect_err(body.get(..200).unwrap_or(body));
    assert_eq!(e.status.as_u16(), 400, "{}", e.message);
    assert_eq!(e.param.as_deref(), param, "{}", e.message);
    assert!(!e.message.contains('\n'), "{}", e.message);
    assert!(
        e.message.contains(want),
        "`{}` does not mention `{want}`",
        e.message
    );
}

#[test]
fn a_good_request_passes() {
    let p = run(
        Kind::Chat,
        r#"{"messages":[{"role":"user","content":"hello world"}],"stop":["x"]}"#,
        None,
    )
    .unwrap();
    assert_eq!(p.prompt_ids, vec![1, 2]);
    assert_eq!(p.max_tokens, 8);
    let p = run(
        Kind::Completion,
        r#"{"prompt":[1,2,3],"max_tokens":64}"#,
        None,
    )
    .unwrap();
    assert_eq!(p.max_tokens, 61, "capped to the room the context leaves");
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let deep = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
    bad(Kind::Chat, &deep, None, "recursion limit");
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"hi"}}],"chat_template_kwargs":{{"x":{}1{}}}}}"#,
        "[".repeat(200_000),
        "]".repeat(200_000)
    );
    bad(Kind::Chat, &body, None, "recursion limit");
}

#[test]
fn counts_and_lengths_are_bounded() {
    let msgs: Vec<_> = (0..MAX_MESSAGES + 1)
        .map(|_| json!({"role": "user", "content": "a"}))
        .collect();
    let body = json!({ "messages": msgs }).to_string();
    bad(Kind::Chat, &body, Some("messages"), "at most 8192");

    let long = "x".repeat(MAX_STOP_BYTES + 1);
    let body = json!({"prompt": "a", "stop": [long]}).to_string();
    bad(Kind::Completion, &body, Some("stop"), "at most 512 bytes");

    // 100k stop strings: refused at the 17th, not collected
    let many: Vec<&str> = vec!["s"; 100_000];
    let body = json!({"prompt": "a", "stop": many}).to_string();
    bad(
        Kind::Completion,
        &body,
        Some("stop"),
        "at most 16 stop sequences",
    );
    let ids: Vec<u32> = vec![1; 100];
    let body = json!({"prompt": "a", "stop": ["a"], "stop_token_ids": ids}).to_string();
    bad(
        Kind::Completion,
        &body,
        Some("stop"),
        "at most 16 stop sequences",
    );

    for mt in [
        json!(0),
        json!(65),
        json!(-1),
        json!(u64::MAX),
        json!(1e300),
    ] {
        let body = json!({"prompt": "a", "max_tokens": mt}).to_string();
        let e = run(Kind::Completion, &body, None).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("max_tokens"),
            "{mt}: {}",
            e.message
        );
    }

    // a prompt as long as the context
    let ids: Vec<u32> = vec![1; 64];
    let body = json!({ "prompt": ids }).to_string();
    let e = run(Kind::Completion, &body, None).unwrap_err();
    assert_eq!(e.code, Some("context_length_exceeded"), "{}", e.message);
    let body = json!({"prompt": [1, 5]}).to_string();
    bad(Kind::Completion, &body, Some("prompt"), "[0, 5)");
}

#[test]
fn a_chat_template_that_fails_is_a_400() {
    let t = ChatTemplate::new(
        "{% for m in messages %}{{ raise_exception('no ' + m.role) }}{% endfor %}",
        None,
        None,
        "t.jinja",
    )
    .unwrap();
    let e = run(
        Kind::Chat,
        r#"{"messages":[{"role":"user","content":"hello"}]}"#,
        Some(&t),
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages"));
    assert!(e.message.contains("no user"), "{}", e.message);
}
