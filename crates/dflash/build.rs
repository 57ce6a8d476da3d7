//! Records the resolved versions of the main dependencies (from the workspace Cargo.lock) so
//! that benchmark results can say which candle / tokenizers produced them.

fn main() {
    let lock = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    let text = std::fs::read_to_string(&lock).unwrap_or_default();
    let mut found = Vec::new();
    let mut name: Option<String> = None;
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_string());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take()) {
            if ["candle-core", "candle-nn", "tokenizers", "safetensors"].contains(&n.as_str()) {
                found.push(format!("{n}={}", v.trim_matches('"')));
            }
        }
    }
    println!("cargo:rustc-env=DFLASH_DEP_VERSIONS={}", found.join(","));
}
