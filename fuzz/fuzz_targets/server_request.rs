//! The server's request path: the first byte picks the endpoint (chat or completions), the
//! rest is the HTTP body -> `dflash_server::api::prepare` (JSON, every field validated
//! against the limits, chat template rendered, prompt tokenized, context checked) -> on
//! success the stop strings run over the detokenized prompt as the engine thread would.
#![no_main]
use dflash_fuzz::{template, tokenizer};
use dflash_server::api::{prepare, Kind, Limits};
use dflash_server::output::{OutputParser, ReasoningFormat, ToolFormat};
use dflash_server::worker::StopMatcher;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, body)) = data.split_first() else {
        return;
    };
    let tok = tokenizer();
    let lim = Limits {
        model_names: vec!["m".into(), "org/m".into()],
        vocab_size: tok.vocab_size(),
        max_context: 2048,
        max_tokens_default: 16,
        max_stop: 16,
        special_tokens_in_content: false,
        tool_format: Some(ToolFormat::Hermes),
        reasoning_format: Some(ReasoningFormat::Qwen3),
    };
    let kind = if mode & 1 == 0 {
        Kind::Chat
    } else {
        Kind::Completion
    };
    let tmpl = (mode & 2 == 0).then(template);
    if let Ok(p) = prepare(kind, body, &lim, tok, tmpl) {
        assert!(!p.prompt_ids.is_empty() && p.prompt_ids.len() < lim.max_context);
        assert!(p.max_tokens >= 1 && p.prompt_ids.len() + p.max_tokens <= lim.max_context);
        let mut m = StopMatcher::new(p.common.stop_strings.clone());
        let mut stream = dflash::tokenizer::TextStream::new(tok, true);
        let mut parser = OutputParser::new(p.output.clone());
        for &id in &p.prompt_ids {
            if let Ok(t) = stream.push(id) {
                let _ = m.push(&t);
                let _ = parser.push(&t);
            }
        }
        let _ = parser.finish();
        let _ = m.finish();
    }
});
