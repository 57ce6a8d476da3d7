//! The parsers on real outputs of each format (as the families' templates print past calls
//! and their docs show them), whole and split at random, malformed ones included.

use super::*;
use dflash::testing::Rng;
use serde_json::json;

fn cfg(tools: Option<ToolFormat>, reasoning: Option<ReasoningFormat>) -> ParserConfig {
    ParserConfig {
        tools,
        reasoning,
        id_prefix: "call_".into(),
        ..ParserConfig::default()
    }
}

fn whole(c: &ParserConfig, text: &str) -> Message {
    let mut p = OutputParser::new(c.clone());
    let mut m = Message::default();
    p.push(text).into_iter().for_each(|d| m.add(d));
    p.finish().into_iter().for_each(|d| m.add(d));
    m
}

/// `text` fed in random pieces (1 to 12 characters).
fn split(c: &ParserConfig, text: &str, rng: &mut Rng) -> Message {
    let chars: Vec<char> = text.chars().collect();
    let mut p = OutputParser::new(c.clone());
    let mut m = Message::default();
    let mut i = 0;
    while i < chars.len() {
        let n = 1 + rng.below(12);
        let piece: String = chars[i..(i + n).min(chars.len())].iter().collect();
        p.push(&piece).into_iter().for_each(|d| m.add(d));
        i += n;
    }
    p.finish().into_iter().for_each(|d| m.add(d));
    m
}

fn call(index: usize, name: &str, args: serde_json::Value) -> ToolCall {
    ToolCall {
        index,
        id: format!("call_{index}"),
        name: name.into(),
        arguments: args.to_string(),
    }
}

/// (parser config, model output, expected content, reasoning, calls)
fn fixtures() -> Vec<(
    ParserConfig,
    &'static str,
    &'static str,
    &'static str,
    Vec<ToolCall>,
)> {
    let hermes = cfg(Some(ToolFormat::Hermes), Some(ReasoningFormat::Qwen3));
    let mut coder = cfg(Some(ToolFormat::Qwen3Coder), None);
    coder.param_types = HashMap::from([(
        "run_command".to_string(),
        HashMap::from([
            ("command".to_string(), "string".to_string()),
            ("timeout".to_string(), "integer".to_string()),
            ("env".to_string(), "object".to_string()),
        ]),
    )]);
    let oss = cfg(Some(ToolFormat::GptOss), Some(ReasoningFormat::GptOss));
    let llama = cfg(Some(ToolFormat::Llama3Json), None);
    let kimi = cfg(Some(ToolFormat::KimiK2), None);
    let gemma = cfg(Some(ToolFormat::Gemma4), None);
    let think = cfg(None, Some(ReasoningFormat::Qwen3));
    let mut think_open = think.clone();
    think_open.reasoning_open = true;
    let kimi_call = |i: usize, city: &str| ToolCall {
        index: i,
        id: format!("functions.get_weather:{i}"),
        name: "get_weather".into(),
        arguments: json!({ "city": city }).to_string(),
    };
    vec![
        // Qwen3 thinking, then a call (the syntax its template prints)
        (
            hermes.clone(),
            "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
            "",
            "The user wants the weather in Paris. I should call get_weather.",
            vec![call(0, "get_weather", json!({"city": "Paris", "unit": "celsius"}))],
        ),
        // Qwen2.5's function-calling docs: text, then two parallel calls
        (
            hermes.clone(),
            "Let me check both.\n\n<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": {\"location\": \"San Francisco, CA, USA\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"location\": \"San Francisco, CA, USA\", \"date\": \"2024-10-01\", \"unit\": \"celsius\"}}\n</tool_call>",
            "Let me check both.",
            "",
            vec![
                call(0, "get_current_temperature", json!({"location": "San Francisco, CA, USA"})),
                call(1, "get_temperature_date", json!({"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"})),
            ],
        ),
        // plain Qwen3 answers, thinking or not
        (
            hermes.clone(),
            "<think>\n2 and 2 make 4.\n</think>\n\nThe answer is **4**.",
            "The answer is **4**.",
            "2 and 2 make 4.",
            vec![],
        ),
        (hermes.clone(), "Hello! How can I help?", "Hello! How can I help?", "", vec![]),
        // a text mention of the tag that is no call: text
        (
            hermes.clone(),
            "Use <tool_call> tags.</tool_call> Done.",
            "Use <tool_call> tags.</tool_call> Done.",
            "",
            vec![],
        ),
        // Qwen3-Coder's XML (the example in its template), values typed by the schema
        (
            coder.clone(),
            "I'll run the tests.\n<tool_call>\n<function=run_command>\n<parameter=command>\ncargo test --release\n</parameter>\n<parameter=timeout>\n600\n</parameter>\n<parameter=env>\n{\"RUST_LOG\": \"info\"}\n</parameter>\n</function>\n</tool_call>",
            "I'll run the tests.",
            "",
            vec![call(0, "run_command", json!({"command": "cargo test --release", "timeout": 600, "env": {"RUST_LOG": "info"}}))],
        ),
        (
            coder.clone(),
            "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=content>\nfn main() {\n    println!(\"<hi>\");\n}\n</parameter>\n</function>\n</tool_call>",
            "",
            "",
            vec![call(0, "write_file", json!({"path": "src/main.rs", "content": "fn main() {\n    println!(\"<hi>\");\n}"}))],
        ),
        // gpt-oss (OpenAI's harmony docs): analysis, then a call on the commentary channel
        (
            oss.clone(),
            "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}",
            "",
            "Need to use function get_weather.",
            vec![call(0, "get_weather", json!({"location": "San Francisco"}))],
        ),
        // ... the recipient in the role part, a preamble before it
        (
            oss.clone(),
            "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"location\": \"Tokyo\"}",
            "Checking the weather.",
            "Look it up.",
            vec![call(0, "get_weather", json!({"location": "Tokyo"}))],
        ),
        // ... the recipient right after the generation prompt (`<|start|>assistant`)
        (
            oss.clone(),
            " to=functions.get_weather<|channel|>commentary json<|message|>{\"location\": \"Paris\"}",
            "",
            "",
            vec![call(0, "get_weather", json!({"location": "Paris"}))],
        ),
        // ... text that is not harmony at all: content
        (oss.clone(), "Hello there.", "Hello there.", "", vec![]),
        // ... and an answer
        (
            oss.clone(),
            "<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
            "2 + 2 = 4.",
            "User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.",
            vec![],
        ),
        // Llama 3.1's JSON (its template's format), with and without <|python_tag|>
        (
            llama.clone(),
            "{\"name\": \"get_current_conditions\", \"parameters\": {\"location\": \"San Francisco, CA\", \"unit\": \"Fahrenheit\"}}",
            "",
            "",
            vec![call(0, "get_current_conditions", json!({"location": "San Francisco, CA", "unit": "Fahrenheit"}))],
        ),
        (
            llama.clone(),
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}",
            "",
            "",
            vec![call(0, "a", json!({"x": 1})), call(1, "b", json!({}))],
        ),
        (llama.clone(), "It is sunny in Paris.", "It is sunny in Paris.", "", vec![]),
        // Kimi K2's sections (its docs), ids from the model
        (
            kimi.clone(),
            "I'll check both cities.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Beijing\"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"city\": \"Shanghai\"}<|tool_call_end|><|tool_calls_section_end|>",
            "I'll check both cities.",
            "",
            vec![kimi_call(0, "Beijing"), kimi_call(1, "Shanghai")],
        ),
        // Gemma 4's calls (its template's format_argument)
        (
            gemma.clone(),
            "<|tool_call>call:get_weather{location:<|\"|>Paris, France<|\"|>,days:3,metric:true,hours:[9,12],opts:{lang:<|\"|>fr<|\"|>}}<tool_call|>",
            "",
            "",
            vec![call(0, "get_weather", json!({"location": "Paris, France", "days": 3, "metric": true, "hours": [9, 12], "opts": {"lang": "fr"}}))],
        ),
        // thinking only: a closed block, one the prompt opened, one cut off
        (think.clone(), "<think>\nhmm\n</think>\n\nHi.", "Hi.", "hmm", vec![]),
        (think_open.clone(), "Let me see.\n</think>\n\nYes.", "Yes.", "Let me see.", vec![]),
        (think.clone(), "<think>\nstill thinking abo", "", "still thinking abo", vec![]),
        (think.clone(), "No thought. <think>x</think>", "No thought. <think>x</think>", "", vec![]),
    ]
}

/// Each fixture gives its message, whole and fed in random pieces: streaming and not agree.
#[test]
fn real_outputs_parse_streamed_and_not() {
    let mut rng = Rng::new(25);
    for (i, (c, text, content, reasoning, calls)) in fixtures().into_iter().enumerate() {
        let want = Message {
            content: content.into(),
            reasoning: reasoning.into(),
            tool_calls: calls,
        };
        assert_eq!(whole(&c, text), want, "fixture {i}: {text}");
        for _ in 0..200 {
            assert_eq!(split(&c, text, &mut rng), want, "fixture {i} split: {text}");
        }
    }
}

/// Malformed calls come back as text (all of it), never as a call and never lost.
#[test]
fn malformed_calls_are_text() {
    let mut rng = Rng::new(7);
    let cases: Vec<(Option<ToolFormat>, &str, &str)> = vec![
        (
            Some(ToolFormat::Hermes),
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par\n</tool_call>",
        ),
        // cut by max_tokens before the end marker
        (
            Some(ToolFormat::Hermes),
            "Sure.<tool_call>\n{\"name\": \"get_wea",
            "Sure.<tool_call>\n{\"name\": \"get_wea",
        ),
        (
            Some(ToolFormat::Hermes),
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
        ),
        (
            Some(ToolFormat::Qwen3Coder),
            "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>",
            "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>",
        ),
        (
            Some(ToolFormat::GptOss),
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops",
            "{oops",
        ),
        (
            Some(ToolFormat::KimiK2),
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad<|tool_call_end|><|tool_calls_section_end|>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad<|tool_call_end|><|tool_calls_section_end|>",
        ),
        (
            Some(ToolFormat::Gemma4),
            "<|tool_call>call:f{a:<|\"|>x}<tool_call|>",
            "<|tool_call>call:f{a:<|\"|>x}<tool_call|>",
        ),
        (
            Some(ToolFormat::Llama3Json),
            "{\"name\": 3, \"parameters\": {}}",
            "{\"name\": 3, \"parameters\": {}}",
        ),
        (
            Some(ToolFormat::Llama3Json),
            "{\"name\": \"f\", \"parameters\": {}} and more",
            "{\"name\": \"f\", \"parameters\": {}} and more",
        ),
    ];
    for (fmt, text, content) in cases {
        let c = cfg(fmt, None);
        let m = whole(&c, text);
        assert!(m.tool_calls.is_empty(), "{text}: {m:?}");
        assert_eq!(m.content, content, "{text}");
        for _ in 0..50 {
            assert_eq!(split(&c, text, &mut rng), m, "{text}");
        }
    }
}

#[test]
fn parallel_tool_calls_false_keeps_the_first() {
    let (mut c, text, ..) = fixtures().swap_remove(1);
    c.single_call = true;
    let m = whole(&c, text);
    assert_eq!(m.tool_calls.len(), 1);
    assert_eq!(m.tool_calls[0].name, "get_current_temperature");
}

#[test]
fn without_parsers_all_is_content() {
    let c = cfg(None, None);
    assert!(!c.active());
    let t = "<think>x</think><tool_call>{\"name\": \"f\"}</tool_call>";
    assert_eq!(whole(&c, t).content, t);
}

#[test]
fn formats_are_detected_from_the_template() {
    let oss =
        include_str!("../../../dflash/tests/fixtures/templates/gpt-oss-20b.chat_template.jinja");
    assert_eq!(ToolFormat::detect(oss, "gpt_oss"), Some(ToolFormat::GptOss));
    assert_eq!(
        ReasoningFormat::detect(oss, "gpt_oss"),
        Some(ReasoningFormat::GptOss)
    );
    let qwen3 = "{{- '<tool_call>\\n{\"name\": \"' }}{%- if '</think>' in content %}";
    assert_eq!(ToolFormat::detect(qwen3, "qwen3"), Some(ToolFormat::Hermes));
    assert_eq!(
        ReasoningFormat::detect(qwen3, "qwen3"),
        Some(ReasoningFormat::Qwen3)
    );
    let coder = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>";
    assert_eq!(
        ToolFormat::detect(coder, "qwen3_moe"),
        Some(ToolFormat::Qwen3Coder)
    );
    assert_eq!(ReasoningFormat::detect(coder, "qwen3_moe"), None);
    assert_eq!(
        ToolFormat::detect("{{ '<|python_tag|>' }}", "llama"),
        Some(ToolFormat::Llama3Json)
    );
    assert_eq!(
        ToolFormat::detect("<|tool_calls_section_begin|>", "deepseek_v3"),
        Some(ToolFormat::KimiK2)
    );
    assert_eq!(
        ToolFormat::detect("{{ '<|tool_call>call:' }}", "gemma4"),
        Some(ToolFormat::Gemma4)
    );
    assert_eq!(ToolFormat::detect("{{ m.content }}", "llama"), None);
    for f in ToolFormat::ALL {
        assert_eq!(ToolFormat::from_name(f.name()), Some(f));
    }
}

/// Random text made of the formats' markers and JSON pieces: no panic, and any split gives
/// what the whole gives.
#[test]
fn random_marker_soup_never_panics_and_splits_agree() {
    let pieces = [
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think>",
        "{",
        "}",
        "\"name\"",
        ": ",
        "\"f\"",
        ", ",
        "\"arguments\"",
        "<function=",
        "<parameter=",
        ">",
        "</parameter>",
        "</function>",
        "<|channel|>",
        "analysis",
        "final",
        "commentary to=functions.f",
        "<|message|>",
        "<|end|>",
        "<|start|>",
        "assistant",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "functions.f:0",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<|tool_call>",
        "call:f",
        "<tool_call|>",
        "<|\"|>",
        "<|python_tag|>",
        ";",
        "\n",
        " ",
        "é",
        "x",
        "[",
        "]",
        ":",
        "1",
        "null",
    ];
    let mut rng = Rng::new(1);
    let configs: Vec<ParserConfig> = ToolFormat::ALL
        .into_iter()
        .map(|f| cfg(Some(f), Some(ReasoningFormat::Qwen3)))
        .chain([cfg(None, Some(ReasoningFormat::GptOss))])
        .collect();
    for _ in 0..400 {
        let n = rng.below(40);
        let text: String = (0..n).map(|_| pieces[rng.below(pieces.len())]).collect();
        for c in &configs {
            let m = whole(c, &text);
            assert_eq!(split(c, &text, &mut rng), m, "{text:?} {:?}", c.tools);
        }
    }
}

/// Calls as the families' own templates print them in a past assistant turn (what the
/// models are trained to write) parse back into the same calls.
#[test]
fn calls_rendered_by_the_templates_parse_back() {
    use dflash::chat::{ChatMessage, ChatTemplate};
    let mut turn = ChatMessage::assistant("");
    turn.extra.insert(
        "tool_calls".into(),
        json!([{"id": "c", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]),
    );
    let msgs = [ChatMessage::user("Weather?"), turn];
    let want = vec![call(
        0,
        "get_weather",
        json!({"city": "Paris", "days": [1, 2]}),
    )];
    let mut rng = Rng::new(3);
    // Qwen3: the assistant turn's text, between its header and <|im_end|>
    let t = ChatTemplate::new(
        include_str!("../../../dflash/tests/fixtures/templates/qwen3-8b.chat_template.jinja"),
        None,
        Some("<|im_end|>".into()),
        "qwen3",
    )
    .unwrap();
    let r = t.render(&msgs, false, None, &Map::new()).unwrap();
    let out = r.rsplit("<|im_start|>assistant\n").next().unwrap();
    let out = out.strip_suffix("<|im_end|>\n").unwrap_or(out);
    let c = cfg(Some(ToolFormat::Hermes), Some(ReasoningFormat::Qwen3));
    assert_eq!(whole(&c, out).tool_calls, want, "{out}");
    assert_eq!(split(&c, out, &mut rng).tool_calls, want, "{out}");
    // gpt-oss: what follows the generation prompt `<|start|>assistant`, up to <|call|> (a
    // stop token, so not in the output)
    let t = ChatTemplate::new(
        include_str!("../../../dflash/tests/fixtures/templates/gpt-oss-20b.chat_template.jinja"),
        None,
        Some("<|return|>".into()),
        "gpt-oss",
    )
    .unwrap();
    let r = t.render(&msgs, false, None, &Map::new()).unwrap();
    let out = r.rsplit("<|start|>assistant").next().unwrap();
    let out = out.split("<|call|>").next().unwrap();
    assert!(out.contains("to=functions.get_weather"), "{r}");
    let c = cfg(Some(ToolFormat::GptOss), Some(ReasoningFormat::GptOss));
    let m = whole(&c, out);
    assert_eq!(
        (m.tool_calls, m.content.as_str()),
        (want.clone(), ""),
        "{out}"
    );
    assert_eq!(split(&c, out, &mut rng).tool_calls, want, "{out}");
}
