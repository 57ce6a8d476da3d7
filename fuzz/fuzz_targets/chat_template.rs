//! Chat templates: the first byte picks the input's meaning.
//! 0: a `tokenizer_config.json` (its `chat_template` string or list, `bos_token`,
//!    `eos_token`), loaded from a file as a model directory's would be.
//! 1: raw Jinja source (what `chat_template.jinja` or GGUF `tokenizer.chat_template` hold).
//! The template is then rendered with a few conversations, with and without the generation
//! prompt, `enable_thinking` and tools. The instruction budget is lowered from the default
//! (20M) to keep executions fast; the budget itself is what bounds hostile templates.
#![no_main]
use dflash::chat::ChatTemplate;
use dflash_fuzz::{conversations, scratch_file};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let t = if mode % 2 == 0 {
        let p = scratch_file(Some("tc"), "tokenizer_config.json", rest);
        ChatTemplate::from_tokenizer_config(&p)
    } else {
        let Ok(src) = std::str::from_utf8(rest) else {
            return;
        };
        ChatTemplate::new(
            src,
            Some("<s>".into()),
            Some("</s>".into()),
            "chat_template.jinja",
        )
    };
    let Ok(mut t) = t else {
        return;
    };
    t.set_fuel(200_000);
    let mut extra = serde_json::Map::new();
    extra.insert(
        "tools".into(),
        serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    );
    for c in conversations() {
        let _ = t.render(&c, true, None, &Default::default());
        let _ = t.render(&c, false, Some(true), &extra);
    }
});
