//! Write the HF-side files of a GGUF model into a directory: `config.json` (as the engine
//! derives it), `tokenizer.json` (the tokenizer the engine builds from the GGUF metadata) and
//! `tokenizer_config.json` (chat template, BOS/EOS). No weights. Used to run llama.cpp's
//! `convert_hf_to_gguf.py --target-model-dir DIR` on one of our drafts when the target exists
//! only as a GGUF (docs/training.md, the llama.cpp comparison).
//!
//!     cargo run --release --example gguf_to_hf -p dflash -- MODEL.gguf OUT_DIR

use dflash::source::gguf::GgufFile;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, gguf, out] = args.as_slice() else {
        eprintln!("usage: gguf_to_hf MODEL.gguf OUT_DIR");
        std::process::exit(2);
    };
    let g = GgufFile::open(std::path::Path::new(gguf))?;
    let out = std::path::Path::new(out);
    std::fs::create_dir_all(out)?;
    let mut cfg = g.config_json()?;
    // transformers / llama.cpp need the architecture class name as well as model_type
    let arch = match cfg["model_type"].as_str() {
        Some("llama") => "LlamaForCausalLM",
        Some("qwen2") => "Qwen2ForCausalLM",
        Some("qwen3") => "Qwen3ForCausalLM",
        Some("gemma3_text") => "Gemma3ForCausalLM",
        other => return Err(format!("no HF class known for model_type {other:?}").into()),
    };
    cfg["architectures"] = serde_json::json!([arch]);
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    let tok = g.tokenizer()?;
    let json = tok.inner().to_string(true).map_err(|e| e.to_string())?;
    std::fs::write(out.join("tokenizer.json"), json)?;
    let tokens = g.tokens()?;
    let name = |k: &str| -> Option<String> {
        g.opt_u64(k)
            .ok()
            .flatten()
            .and_then(|i| tokens.get(i as usize).map(|s| s.to_string()))
    };
    let mut tc = serde_json::json!({ "tokenizer_class": "PreTrainedTokenizerFast" });
    if let Some(b) = name("tokenizer.ggml.bos_token_id") {
        tc["bos_token"] = b.into();
    }
    if let Some(e) = name("tokenizer.ggml.eos_token_id") {
        tc["eos_token"] = e.into();
    }
    if let Some(t) = g.opt_str("tokenizer.chat_template")? {
        tc["chat_template"] = t.into();
    }
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tc)?,
    )?;
    println!(
        "wrote {}/config.json, tokenizer.json, tokenizer_config.json",
        out.display()
    );
    Ok(())
}
