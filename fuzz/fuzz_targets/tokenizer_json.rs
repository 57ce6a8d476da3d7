//! tokenizer.json: parse, encode a few strings (with and without special tokens), decode
//! ids back (whole and streamed), and look up the stop ids a tokenizer_config names.
#![no_main]
use dflash::tokenizer::{stop_token_ids, TextStream, Tokenizer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(tok) = Tokenizer::from_bytes(data, "tokenizer.json") else {
        return;
    };
    for text in ["Hello world!", " <|im_end|>\n\tünïcödé 🦀 1234", ""] {
        for special in [false, true] {
            if let Ok(ids) = tok.encode(text, special) {
                let _ = tok.decode(&ids, false);
                let mut s = TextStream::new(&tok, true);
                let _ = s.push_all(&ids);
                let _ = s.flush();
            }
        }
    }
    let n = tok.vocab_size().min(300) as u32;
    let ids: Vec<u32> = (0..n).chain([n, n + 1, u32::MAX]).collect();
    let _ = tok.decode(&ids, true);
    for id in [0, 1, n.saturating_sub(1), n, u32::MAX] {
        let _ = tok.id_to_token(id);
    }
    let tc = serde_json::json!({"eos_token": "<|im_end|>"});
    let _ = stop_token_ids(&tok, None, None, Some(("tokenizer_config.json", &tc)));
});
