//! Structured output under DFlash. On a tiny random target + draft over a byte vocabulary
//! (fast enough for many generations): 200 sampled generations under a JSON schema all parse
//! and validate; greedy DFlash under four kinds of grammar equals greedy plain decoding under
//! them, for many prompts and block sizes. On the demo model (SmolLM2-135M-Instruct Q4_1 GGUF
//! with its DFlash draft): the same equality on real text, and tau under a grammar.

mod common;
use common::tiny_engine;
use dflash::chat::ChatMessage;
use dflash::engine::{Engine, Flow, GenerateOutput, GenerateRequest};
use dflash::grammar::{Grammar, GrammarCompiler, GrammarSpec};
use dflash::pipeline::{Pipeline, PipelineOptions};
use dflash::sampling::SamplingParams;
use dflash::testing::{byte_tokenizer, Rng, TinyDraft, TinyTarget};
use serde_json::{json, Value};

const EOS: u32 = 255;

/// A tiny qwen3 target over the 256-token byte vocabulary and a draft sharing its head.
fn tiny() -> (tempfile::TempDir, Engine, GrammarCompiler) {
    let mut t = TinyTarget::qwen3(11);
    t.vocab = 256;
    // a few frequent JSON bytes make the draft agree at times (acceptance > 0)
    t.dominant = vec![(b'"' as u32, 2.0), (b'a' as u32, 1.5), (b'1' as u32, 1.5)];
    let d = TinyDraft::for_target(&t, 2, vec![1, 3], 16, 12);
    let (dir, e) = tiny_engine(&t, &d);
    let c = GrammarCompiler::new(&byte_tokenizer(&[]), 256, &[EOS]).unwrap();
    (dir, e, c)
}

fn tiny_request(prompt: &[u32], g: &Grammar, max_tokens: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt.to_vec(), max_tokens);
    r.stop_ids = vec![EOS];
    r.grammar = Some(g.clone());
    r
}

/// The bytes before the final end of output, as text.
fn tiny_text(out: &GenerateOutput) -> String {
    let ids = match out.output_ids.split_last() {
        Some((&EOS, rest)) => rest,
        _ => &out.output_ids[..],
    };
    let bytes: Vec<u8> = ids.iter().map(|&t| t as u8).collect();
    String::from_utf8(bytes).expect("the grammar keeps the output UTF-8")
}

/// The demo pipeline, or None (with a loud message) when the model cannot be fetched.
fn demo() -> Option<Pipeline> {
    let model = match dflash::source::demo_model_path() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("\n!!!!!! SKIPPED: cannot fetch the demo model: {e}\n");
            return None;
        }
    };
    let opts = PipelineOptions {
        model: model.display().to_string(),
        draft: Some(dflash::pipeline::demo_draft_dir().display().to_string()),
        ..Default::default()
    };
    Some(Pipeline::load(&opts).expect("demo pipeline"))
}

fn prompt(p: &Pipeline, text: &str) -> Vec<u32> {
    p.encode_prompt(&[ChatMessage::user(text)], true, Some(false))
        .unwrap()
}

fn request(p: &Pipeline, ids: Vec<u32>, g: &Grammar, max_tokens: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(ids, max_tokens);
    r.stop_ids = p.stop_ids.clone();
    r.grammar = Some(g.clone());
    r
}

/// The generated text without its final stop token.
fn text(p: &Pipeline, out: &GenerateOutput) -> String {
    let mut ids = out.output_ids.clone();
    if ids.last().is_some_and(|t| p.stop_ids.contains(t)) {
        ids.pop();
    }
    p.tokenizer.as_ref().unwrap().decode(&ids, false).unwrap()
}

/// The schema of the sampled test: bounded, so every generation ends within its budget.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["rust", "cuda", "python", "go"]}, "maxItems": 3}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false}
    })
}

/// What the schema asks, checked independently of llguidance.
fn validate_person(s: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(s).map_err(|e| format!("not JSON: {e}"))?;
    let o = v.as_object().ok_or("not an object")?;
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    if keys != ["age", "name", "tags"] {
        return Err(format!("keys {keys:?}"));
    }
    let name = o["name"].as_str().ok_or("name is not a string")?;
    if name.chars().count() > 10 {
        return Err(format!("name {name:?} longer than 10"));
    }
    let age = o["age"].as_i64().ok_or("age is not an integer")?;
    if !(0..=120).contains(&age) {
        return Err(format!("age {age} out of [0, 120]"));
    }
    let tags = o["tags"].as_array().ok_or("tags is not an array")?;
    if tags.len() > 3 {
        return Err(format!("{} tags", tags.len()));
    }
    for t in tags {
        if !["rust", "cuda", "python", "go"].contains(&t.as_str().unwrap_or("")) {
            return Err(format!("tag {t}"));
        }
    }
    Ok(())
}

#[test]
fn sampled_generations_under_a_schema_all_validate() {
    let (_dir, e, c) = tiny();
    let g = c
        .compile(&GrammarSpec::JsonSchema(person_schema()))
        .unwrap();
    let mut rng = Rng::new(5);
    let (mut committed, mut cycles, mut lengths) = (0usize, 0usize, 0usize);
    let mut distinct = std::collections::HashSet::new();
    for seed in 0..200u64 {
        let plen = 1 + rng.below(12);
        let prompt: Vec<u32> = (0..plen).map(|_| rng.below(255) as u32).collect();
        let mut r = tiny_request(&prompt, &g, 400);
        r.sampling = SamplingParams {
            temperature: 1.0,
            seed,
            ..Default::default()
        };
        r.block_size = Some([2, 4, 8, 16][seed as usize % 4]);
        let out = e.generate(&r, &mut |_| Flow::Continue).unwrap();
        let s = tiny_text(&out);
        assert_eq!(out.stats.finish_reason, "stop", "seed {seed}: {s:?}");
        if let Err(err) = validate_person(&s) {
            panic!("seed {seed}: {s:?} does not validate: {err}");
        }
        assert!(out.stats.grammar_masks > 0);
        committed += out.stats.acceptance_lengths.iter().sum::<usize>();
        cycles += out.stats.cycles;
        lengths += out
            .stats
            .acceptance_lengths
            .iter()
            .filter(|&&a| a > 1)
            .count();
        distinct.insert(s);
    }
    // sampling really varies the output (a constraint that forced one string would pass the
    // checks above), and some proposals were accepted under the mask
    assert!(
        distinct.len() > 150,
        "{} distinct outputs of 200",
        distinct.len()
    );
    assert!(lengths > 0, "no cycle accepted a proposal");
    eprintln!(
        "200 generations, {} distinct, tau {:.2} under the schema",
        distinct.len(),
        committed as f64 / cycles.max(1) as f64
    );
}

#[test]
fn greedy_dflash_equals_plain_under_grammars_on_a_tiny_pair() {
    let (_dir, e, c) = tiny();
    let specs = [
        GrammarSpec::JsonSchema(person_schema()),
        GrammarSpec::JsonObject,
        GrammarSpec::Regex("(yes|no), [a-z ]{1,30}\\.".into()),
        GrammarSpec::Choice(vec!["positive".into(), "negative".into(), "neutral".into()]),
    ];
    let mut rng = Rng::new(9);
    let mut runs = 0;
    for spec in &specs {
        let g = c.compile(spec).unwrap();
        for _ in 0..6 {
            let plen = 1 + rng.below(20);
            let prompt: Vec<u32> = (0..plen).map(|_| rng.below(255) as u32).collect();
            let max = 8 + rng.below(60);
            let run = |block: Option<usize>, adaptive: bool| {
                let mut r = tiny_request(&prompt, &g, max);
                r.block_size = block;
                r.adaptive = adaptive;
                e.generate(&r, &mut |_| Flow::Continue).unwrap()
            };
            let plain = run(Some(1), false);
            if let (GrammarSpec::Choice(c), "stop") = (spec, plain.stats.finish_reason.as_str()) {
                assert!(c.contains(&tiny_text(&plain)), "{:?}", tiny_text(&plain));
            }
            for (block, adaptive) in [
                (Some(2), false),
                (Some(8), false),
                (Some(16), false),
                (None, true),
            ] {
                let d = run(block, adaptive);
                assert_eq!(
                    d.output_ids,
                    plain.output_ids,
                    "{} block {block:?}: {:?} vs plain {:?}",
                    spec.kind(),
                    tiny_text(&d),
                    tiny_text(&plain)
                );
                runs += 1;
            }
        }
    }
    assert_eq!(runs, 96);
}

#[test]
fn greedy_dflash_equals_plain_under_grammars_on_the_demo() {
    let Some(p) = demo() else { return };
    let specs = [
        GrammarSpec::JsonSchema(json!({
            "type": "object",
            "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                           "genres": {"type": "array", "items": {"type": "string"}}},
            "required": ["title", "year", "genres"]
        })),
        GrammarSpec::Regex("(Yes|No), because [a-z ,]{1,60}\\.".into()),
    ];
    let prompts = [
        "Describe your favourite film as JSON.",
        "Is the sky blue? Answer yes or no and say why.",
    ];
    let mut tau = Vec::new();
    for (spec, text_prompt) in specs.iter().zip(prompts) {
        let g = p.compile_grammar(spec).unwrap();
        let ids = prompt(&p, text_prompt);
        let run = |block: usize| {
            let mut r = request(&p, ids.clone(), &g, 40);
            r.block_size = Some(block);
            r.adaptive = false;
            p.engine.generate(&r, &mut |_| Flow::Continue).unwrap()
        };
        let plain = run(1);
        let plain_text = text(&p, &plain);
        if plain.stats.finish_reason == "stop" {
            match spec {
                GrammarSpec::JsonSchema(_) | GrammarSpec::JsonObject => {
                    let v: Value = serde_json::from_str(&plain_text)
                        .unwrap_or_else(|e| panic!("{plain_text:?}: {e}"));
                    assert!(v.is_object(), "{plain_text}");
                }
                GrammarSpec::Choice(c) => assert!(c.contains(&plain_text), "{plain_text:?}"),
                _ => assert!(plain_text.ends_with('.'), "{plain_text:?}"),
            }
        }
        for block in [8, 16] {
            let d = run(block);
            assert_eq!(
                d.output_ids,
                plain.output_ids,
                "{} block {block}: {:?} vs plain {plain_text:?}",
                spec.kind(),
                text(&p, &d)
            );
            tau.push((spec.kind(), block, d.stats.tau));
        }
    }
    eprintln!("tau under grammars: {tau:?}");
}

#[test]
fn grammar_errors_name_what_is_wrong() {
    let c = GrammarCompiler::new(&byte_tokenizer(&[]), 256, &[EOS]).unwrap();
    let e = c
        .compile(&GrammarSpec::JsonSchema(
            json!({"type": "object", "properties": 3}),
        ))
        .unwrap_err();
    assert!(e.to_string().contains("json_schema"), "{e}");
    // a stop token outside the vocabulary, or none at all
    let e = GrammarCompiler::new(&byte_tokenizer(&[]), 256, &[300]).unwrap_err();
    assert!(e.to_string().contains("stop token 300"), "{e}");
    let e = GrammarCompiler::new(&byte_tokenizer(&[]), 256, &[]).unwrap_err();
    assert!(e.to_string().contains("no stop token"), "{e}");
}
