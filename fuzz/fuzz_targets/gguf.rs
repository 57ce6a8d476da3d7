//! A GGUF file as the engine uses it: header and metadata (bounded reader), the HF-style
//! config derived from the metadata, the tokenizer, chat template and stop ids from the
//! metadata, the memory estimate, then the model itself (tensor table, offsets, types,
//! dims -> weights -> a family) and one forward pass when it loads.
#![no_main]
use candle_core::{DType, Device};
use dflash::archs::{load_target, LoadOptions, Logits};
use dflash::source::gguf::GgufFile;
use dflash::source::ModelSource;
use dflash_fuzz::{conversations, scratch_file};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let p = scratch_file(None, "model.gguf", data);
    let Ok(g) = GgufFile::open(&p) else {
        return;
    };
    let _ = g.target_config();
    if let Ok(tok) = g.tokenizer() {
        if let Ok(ids) = tok.encode("Hello world! <|im_end|> ünïcödé 123", true) {
            let _ = tok.decode(&ids, false);
        }
        let n = tok.vocab_size().min(64) as u32;
        let _ = tok.decode(&(0..n).collect::<Vec<_>>(), true);
    }
    if let Ok(Some(mut t)) = g.chat_template() {
        t.set_fuel(200_000);
        for c in conversations() {
            let _ = t.render(&c, true, None, &Default::default());
        }
    }
    let _ = g.stop_token_ids();
    drop(g);
    let src = ModelSource::from_gguf("fuzz", &p);
    let _ = dflash::memory::weight_bytes(&src, DType::F32, &Device::Cpu, false);
    // requantized (the default) or as stored, by the input's length
    {
        let opts = LoadOptions {
            keep_quant: data.len() % 2 == 1,
            ..Default::default()
        };
        if let Ok((cfg, m)) = load_target(&src, &opts) {
            let toks: Vec<u32> = (0..cfg.vocab_size.min(3) as u32).collect();
            if let Ok(mut c) = m.new_cache(8) {
                let _ = m.forward(&toks, 0, &mut c, &[0], Logits::All);
            }
        }
    }
});
