//! Shared pieces of the fuzz targets: a scratch directory for inputs that the engine reads
//! from files, and the fixed tokenizer / chat template / target config the targets use
//! around the fuzzed input.

use dflash::chat::{ChatMessage, ChatTemplate};
use dflash::config::TargetConfig;
use dflash::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A per-process directory on a RAM disk when there is one (inputs are written there).
pub fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let d = base.join(format!("dflash-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("scratch dir");
        d
    })
}

/// Write `data` to `name` in the scratch directory (a sub-directory `sub` if given, emptied
/// first) and return its path.
pub fn scratch_file(sub: Option<&str>, name: &str, data: &[u8]) -> PathBuf {
    let dir = match sub {
        Some(s) => {
            let d = scratch_dir().join(s);
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).expect("scratch sub-dir");
            d
        }
        None => scratch_dir().to_path_buf(),
    };
    let p = dir.join(name);
    std::fs::write(&p, data).expect("write scratch file");
    p
}

/// The byte-level BPE tokenizer the server target tokenizes with (`assets/tokenizer.json`,
/// written by `cargo run --release -p dflash --example fuzz_seeds`).
pub fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::from_bytes(
            include_bytes!("../assets/tokenizer.json"),
            "assets/tokenizer.json",
        )
        .expect("assets/tokenizer.json")
    })
}

/// SmolLM2's chat template (`assets/chat_template.jinja`).
pub fn template() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| {
        ChatTemplate::new(
            include_str!("../assets/chat_template.jinja"),
            Some("<|im_start|>".into()),
            Some("<|im_end|>".into()),
            "assets/chat_template.jinja",
        )
        .expect("assets/chat_template.jinja")
    })
}

/// A small target config drafts are validated against.
pub fn target_config() -> &'static TargetConfig {
    static T: OnceLock<TargetConfig> = OnceLock::new();
    T.get_or_init(|| {
        let v = serde_json::json!({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 128});
        TargetConfig::from_value("target.json", v).expect("target config")
    })
}

/// Conversations every template is rendered with.
pub fn conversations() -> Vec<Vec<ChatMessage>> {
    vec![
        vec![ChatMessage::user("Hello!")],
        vec![
            ChatMessage::system("Be brief."),
            ChatMessage::user("What is 2+2?"),
            ChatMessage::assistant("4"),
            ChatMessage::user("And 3+3? <|im_end|> {{ x }}"),
        ],
    ]
}
