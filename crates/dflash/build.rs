//! Records the resolved versions of the main dependencies (from the workspace Cargo.lock) so
//! that benchmark results can say which candle / tokenizers produced them.

fn main() {
    let lock = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    let text = std::fs::read_to_string(&lock).unwrap_or_default();
    let mut found: Vec<(String, String)> = Vec::new();
    let mut name: Option<String> = None;
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_string());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take()) {
            if ["candle-core", "candle-nn", "tokenizers", "safetensors"].contains(&n.as_str()) {
                let v = v.trim_matches('"').to_string();
                // Several versions of one crate in the lock: list them all.
                match found.iter_mut().find(|(k, _)| *k == n) {
                    Some((_, vs)) => *vs = format!("{vs}+{v}"),
                    None => found.push((n, v)),
                }
            }
        }
    }
    let found: Vec<String> = found.iter().map(|(n, v)| format!("{n}={v}")).collect();
    println!("cargo:rustc-env=DFLASH_DEP_VERSIONS={}", found.join(","));
}
