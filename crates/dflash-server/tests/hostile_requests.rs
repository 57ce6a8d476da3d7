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

/// No field is silently ignored: every OpenAI field this server does not implement is a 400
/// naming it (code `unsupported_parameter`) unless it has its neutral value, unknown fields are
/// a 400 (code `unknown_parameter`), and request metadata passes.
#[test]
fn unimplemented_and_unknown_fields_are_refused_by_name() {
    let chat = |extra: serde_json::Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hello"}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b.to_string()
    };
    let code = |kind: Kind, body: &str| {
        let e = run(kind, body, None).expect_err(body);
        assert_eq!(e.status.as_u16(), 400, "{}", e.message);
        (e.param.clone().unwrap_or_default(), e.code.unwrap_or(""))
    };
    let refused: Vec<(&str, serde_json::Value)> = vec![
        ("top_logprobs", json!(2)),
        ("store", json!(true)),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        ("tools", json!("all")),
        ("functions", json!([{"name": "f"}])),
        ("tool_choice", json!("auto")),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "f"}}),
        ),
        ("function_call", json!("auto")),
        ("parallel_tool_calls", json!("yes")),
        ("response_format", json!({"type": "json_object"})),
        ("response_format", json!({"type": "bogus"})),
        ("response_format", json!({"type": "text", "extra": 1})),
        ("modalities", json!(["text", "audio"])),
        ("audio", json!({"voice": "x"})),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("reasoning_effort", json!("high")),
        ("web_search_options", json!({})),
    ];
    for (k, v) in &refused {
        let body = chat(json!({ *k: v }));
        assert_eq!(
            code(Kind::Chat, &body),
            (k.to_string(), "unsupported_parameter"),
            "{body}"
        );
    }
    for k in ["temprature", "max_new_tokens", "do_sample", "prompt"] {
        let body = chat(json!({ k: 1 }));
        assert_eq!(
            code(Kind::Chat, &body),
            (k.to_string(), "unknown_parameter"),
            "{body}"
        );
    }
    // completion requests: their own fields; the chat-only ones are unknown there
    for (k, v) in [("suffix", json!("x"))] {
        let body = json!({"prompt": "a", k: v}).to_string();
        assert_eq!(
            code(Kind::Completion, &body),
            (k.to_string(), "unsupported_parameter")
        );
    }
    for k in ["messages", "tools", "chat_template_kwargs"] {
        let body = json!({"prompt": "a", k: []}).to_string();
        assert_eq!(
            code(Kind::Completion, &body),
            (k.to_string(), "unknown_parameter")
        );
    }
    // neutral values and metadata pass
    let ok = chat(
        json!({"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
        "logit_bias": {}, "top_logprobs": null, "store": false, "tools": [], "tool_choice": "none",
        "parallel_tool_calls": true, "response_format": {"type": "text"}, "modalities": ["text"],
        "audio": null, "user": "u1", "metadata": {"k": "v"}, "service_tier": "auto",
        "max_completion_tokens": 3}),
    );
    let p = run(Kind::Chat, &ok, None).unwrap();
    assert_eq!(p.max_tokens, 3);
    let ok = json!({"prompt": "a", "suffix": "", "user": "u", "logit_bias": null}).to_string();
    run(Kind::Completion, &ok, None).unwrap();
    // OpenAI's temperature range
    bad(
        Kind::Chat,
        &chat(json!({"temperature": 2.5})),
        Some("temperature"),
        "[0, 2]",
    );
    run(Kind::Chat, &chat(json!({"temperature": 2})), None).unwrap();
}

/// The penalties and `logit_bias` reach the sampling parameters as sent; values out of their
/// ranges, of the wrong type or naming tokens outside the vocabulary are a 400 naming them.
#[test]
fn penalties_and_logit_bias_are_parsed_and_bounded() {
    let chat = |extra: serde_json::Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hello"}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b.to_string()
    };
    let p = run(
        Kind::Chat,
        &chat(
            json!({"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
            "logit_bias": {"3": -100, " 1": 2.5}}),
        ),
        None,
    )
    .unwrap();
    let s = &p.common.sampling;
    assert_eq!(
        (
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty
        ),
        (0.5, -1.0, 1.3)
    );
    let mut bias = s.logit_bias.clone();
    bias.sort_by_key(|b| b.0);
    assert_eq!(bias, vec![(1, 2.5), (3, -100.0)]);
    let p = run(
        Kind::Completion,
        &json!({"prompt": "a", "frequency_penalty": 2}).to_string(),
        None,
    )
    .unwrap();
    assert_eq!(p.common.sampling.frequency_penalty, 2.0);
    for (k, v, want) in [
        ("presence_penalty", json!(2.01), "[-2, 2]"),
        ("presence_penalty", json!("high"), "number"),
        ("frequency_penalty", json!(-2.5), "[-2, 2]"),
        ("frequency_penalty", json!(true), "number"),
        ("repetition_penalty", json!(0), "> 0"),
        ("repetition_penalty", json!(-1.5), "> 0"),
        ("logit_bias", json!([1]), "object"),
        ("logit_bias", json!("3:1"), "object"),
        ("logit_bias", json!({"x": 1}), "not a token id"),
        ("logit_bias", json!({"-1": 1}), "not a token id"),
        ("logit_bias", json!({"5": 1}), "below the vocabulary size 5"),
        ("logit_bias", json!({"2": 100.5}), "[-100, 100]"),
        ("logit_bias", json!({"2": "1"}), "[-100, 100]"),
        ("logit_bias", json!({"2": null}), "[-100, 100]"),
    ] {
        bad(Kind::Chat, &chat(json!({ k: v })), Some(k), want);
    }
    let many: serde_json::Map<String, serde_json::Value> =
        (0..1025).map(|i| (format!("{i}"), json!(1))).collect();
    bad(
        Kind::Chat,
        &chat(json!({"logit_bias": many})),
        Some("logit_bias"),
        "at most 1024",
    );
}

/// A prompt far beyond the context is refused from its byte length, before tokenizing.
#[test]
fn text_beyond_the_context_is_refused_before_tokenizing() {
    use dflash_server::api::MAX_PROMPT_BYTES_PER_TOKEN;
    let most = 64 * MAX_PROMPT_BYTES_PER_TOKEN;
    let text = "hello ".repeat(most / 6 + 1);
    let body = json!({"prompt": text}).to_string();
    let e = run(Kind::Completion, &body, None).unwrap_err();
    assert_eq!(
        (e.param.as_deref(), e.code),
        (Some("prompt"), Some("context_length_exceeded"))
    );
    assert!(e.message.contains("before tokenizing"), "{}", e.message);
    let body = json!({"messages": [{"role": "user", "content": text}]}).to_string();
    let e = run(Kind::Chat, &body, None).unwrap_err();
    assert_eq!(
        (e.param.as_deref(), e.code),
        (Some("messages"), Some("context_length_exceeded"))
    );
    // at the bound it is tokenized (and then refused by its token count)
    let text = "a ".repeat(most / 2);
    let body = json!({"prompt": text}).to_string();
    let e = run(Kind::Completion, &body, None).unwrap_err();
    assert!(e.message.contains("the prompt has"), "{}", e.message);
}
