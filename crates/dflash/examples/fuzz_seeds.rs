//! Writes the seed corpora of the fuzz targets (`fuzz/seeds/<target>/`) and the fixed
//! assets they use (`fuzz/assets/`), from the files the tests use: the fixture configs, tiny
//! checkpoints written by `dflash::testing`, and (when cached) the demo GGUF files' metadata
//! with their tokenizers trimmed to a few hundred tokens, plus the first 16 KiB of each.
//!
//! cargo run --release -p dflash --example fuzz_seeds -- fuzz

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device};
use dflash::source::gguf::GgufFile;
use dflash::testing::{write_gguf, TensorFactory, TinyDraft, TinyTarget};
use serde_json::json;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

type R<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn put(root: &Path, target: &str, name: &str, bytes: &[u8]) -> R<()> {
    let d = root.join("seeds").join(target);
    std::fs::create_dir_all(&d)?;
    std::fs::write(d.join(name), bytes)?;
    Ok(())
}

fn with_mode(mode: u8, body: &[u8]) -> Vec<u8> {
    let mut v = vec![mode];
    v.extend_from_slice(body);
    v
}

fn configs(root: &Path, fixtures: &Path) -> R<()> {
    let mut n = 0;
    let mut stack = vec![fixtures.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|f| f == "config.json") {
                n += 1;
                put(
                    root,
                    "config_json",
                    &format!("fixture{n}.json"),
                    &std::fs::read(&p)?,
                )?;
            }
        }
    }
    let t = TinyTarget::qwen3(1);
    for (name, spec) in [
        ("qwen3", &t),
        ("llama", &TinyTarget::llama(2)),
        ("qwen2", &TinyTarget::qwen2(3)),
    ] {
        put(
            root,
            "config_json",
            &format!("tiny_{name}.json"),
            spec.config().to_string().as_bytes(),
        )?;
    }
    let d = TinyDraft::for_target(&t, 2, vec![0, 2], 8, 4);
    put(
        root,
        "config_json",
        "tiny_draft_zlab.json",
        d.config(t.vocab).to_string().as_bytes(),
    )?;
    let tmp = tempfile::tempdir()?;
    let rows = candle_core::Tensor::zeros((4, t.hidden), DType::F32, &Device::Cpu)?;
    d.write_speculators(tmp.path(), t.vocab, &[0, 5, 9, 11], &rows, "org/target")?;
    put(
        root,
        "config_json",
        "tiny_draft_speculators.json",
        &std::fs::read(tmp.path().join("config.json"))?,
    )?;
    Ok(())
}

fn safetensors(root: &Path) -> R<()> {
    let tmp = tempfile::tempdir()?;
    let mut f = TensorFactory::new(7);
    f.normal("model.embed_tokens.weight", &[4, 3], 1.0)?;
    f.uniform("model.norm.weight", &[3], 0.5, 1.5)?;
    let bf = f.tensors["model.norm.weight"].to_dtype(DType::BF16)?;
    f.tensors.insert("model.norm.bf16".into(), bf);
    let d2t = candle_core::Tensor::from_vec(vec![0i64, 3, -1], 3, &Device::Cpu)?;
    f.tensors.insert("d2t".into(), d2t);
    let p = tmp.path().join("m.safetensors");
    f.save(&p)?;
    put(
        root,
        "safetensors",
        "tiny.safetensors",
        &with_mode(0, &std::fs::read(&p)?),
    )?;
    let idx = json!({"metadata": {"total_size": 16},
        "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}});
    put(
        root,
        "safetensors",
        "index.json",
        &with_mode(1, idx.to_string().as_bytes()),
    )?;
    let idx = json!({"weight_map": {"x": "a.safetensors"}});
    put(
        root,
        "safetensors",
        "index_one.json",
        &with_mode(1, idx.to_string().as_bytes()),
    )?;
    Ok(())
}

/// The tokenizer metadata of a real GGUF file with its vocabulary cut to the first `keep`
/// tokens (merges and per-token arrays trimmed to match), plus its chat template.
fn trimmed_tokenizer_meta(g: &GgufFile, keep: usize) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let tokens: Vec<String> = g
        .opt_str_array("tokenizer.ggml.tokens")
        .ok()
        .flatten()
        .unwrap_or_default()
        .into_iter()
        .take(keep)
        .map(String::from)
        .collect();
    let kept: HashSet<&str> = tokens.iter().map(String::as_str).collect();
    for (k, v) in &g.content.metadata {
        if !k.starts_with("tokenizer.") {
            continue;
        }
        let v = match (k.as_str(), v) {
            ("tokenizer.ggml.merges", Value::Array(a)) => Value::Array(
                a.iter()
                    .filter(|m| match m {
                        Value::String(s) => s.split_once(' ').is_some_and(|(x, y)| {
                            kept.contains(x)
                                && kept.contains(y)
                                && kept.contains(format!("{x}{y}").as_str())
                        }),
                        _ => false,
                    })
                    .cloned()
                    .collect(),
            ),
            (_, Value::Array(a)) => Value::Array(a.iter().take(keep).cloned().collect()),
            (_, v) => v.clone(),
        };
        out.push((k.clone(), v));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// A tiny target as GGUF with `extra` metadata added.
fn tiny_gguf(spec: &TinyTarget, dt: GgmlDType, extra: &[(String, Value)]) -> R<Vec<u8>> {
    let tmp = tempfile::tempdir()?;
    spec.write(tmp.path())?;
    let p = write_gguf(spec, tmp.path(), dt)?;
    let mut r = std::fs::File::open(&p)?;
    let c = gguf_file::Content::read(&mut r)?;
    let mut names: Vec<&String> = c.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|n| Ok((n.clone(), c.tensor(&mut r, n, &Device::Cpu)?)))
        .collect::<R<_>>()?;
    let mut meta: Vec<(String, Value)> = c
        .metadata
        .into_iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .collect();
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    meta.extend(extra.iter().cloned());
    let out = tmp.path().join("out.gguf");
    let mut w = std::fs::File::create(&out)?;
    let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &m, &t)?;
    Ok(std::fs::read(out)?)
}

fn small(model_type: &str) -> TinyTarget {
    let base = match model_type {
        "llama" => TinyTarget::llama(11),
        "qwen2" => TinyTarget::qwen2(12),
        _ => TinyTarget::qwen3(13),
    };
    TinyTarget {
        vocab: 32,
        hidden: 32,
        intermediate: 32,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        ..base
    }
}

fn main() -> R<()> {
    let root = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "fuzz".into()));
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    configs(&root, &fixtures)?;
    safetensors(&root)?;

    let demo = dflash::source::demo::cache_dir().join("models");
    let smol = demo.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let gemma = demo.join("gemma-3-270m-q4_k_m.gguf");
    let mut templates = Vec::new();
    for (name, path, tiny) in [("smollm2", &smol, "llama"), ("gemma3", &gemma, "qwen3")] {
        if !path.is_file() {
            eprintln!("{} not cached: skipping its seeds", path.display());
            continue;
        }
        let bytes = std::fs::read(path)?;
        put(
            &root,
            "gguf",
            &format!("{name}_first16k.gguf"),
            &bytes[..16 << 10],
        )?;
        let g = GgufFile::open(path)?;
        put(
            &root,
            "config_json",
            &format!("{name}_gguf.json"),
            g.config_json()?.to_string().as_bytes(),
        )?;
        let meta = trimmed_tokenizer_meta(&g, 400);
        put(
            &root,
            "gguf",
            &format!("tiny_{tiny}_{name}_tokenizer.gguf"),
            &tiny_gguf(&small(tiny), GgmlDType::Q8_0, &meta)?,
        )?;
        // the trimmed tokenizer as tokenizer.json
        let tmp = tempfile::tempdir()?;
        let tp = tmp.path().join("t.gguf");
        std::fs::write(&tp, tiny_gguf(&small(tiny), GgmlDType::F32, &meta)?)?;
        let tg = GgufFile::open(&tp)?;
        let tok = tg.tokenizer()?;
        let json = tok.inner().to_string(false).map_err(|e| e.to_string())?;
        put(
            &root,
            "tokenizer_json",
            &format!("{name}.json"),
            json.as_bytes(),
        )?;
        if name == "smollm2" {
            std::fs::create_dir_all(root.join("assets"))?;
            std::fs::write(root.join("assets/tokenizer.json"), &json)?;
        }
        if let Some(src) = g.opt_str("tokenizer.chat_template")? {
            let tokens = g.tokens()?;
            let id = |k: &str| {
                g.opt_u64(k)
                    .ok()
                    .flatten()
                    .and_then(|i| tokens.get(i as usize).map(|s| s.to_string()))
            };
            let tc = json!({"chat_template": src, "bos_token": id("tokenizer.ggml.bos_token_id"),
                "eos_token": {"content": id("tokenizer.ggml.eos_token_id")}});
            put(
                &root,
                "chat_template",
                &format!("{name}_tokenizer_config.json"),
                &with_mode(0, tc.to_string().as_bytes()),
            )?;
            put(
                &root,
                "chat_template",
                &format!("{name}.jinja"),
                &with_mode(1, src.as_bytes()),
            )?;
            templates.push(src.to_string());
            if name == "smollm2" {
                std::fs::write(root.join("assets/chat_template.jinja"), src)?;
            }
        }
    }
    put(
        &root,
        "gguf",
        "tiny_qwen2_f32.gguf",
        &tiny_gguf(&small("qwen2"), GgmlDType::F32, &[])?,
    )?;
    if let Some(t) = templates.first() {
        let tc = json!({"chat_template": [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": t}]});
        put(
            &root,
            "chat_template",
            "list_tokenizer_config.json",
            &with_mode(0, tc.to_string().as_bytes()),
        )?;
    }

    let bodies: &[(u8, serde_json::Value)] = &[
        (
            0,
            json!({"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
            "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3,
            "stop": ["\n\n", "User:"], "stop_token_ids": [2], "stream": true, "stream_options": {"include_usage": true}}),
        ),
        (
            0,
            json!({"messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": null},
            {"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": false}, "max_completion_tokens": 4,
            "n": 1, "logprobs": false, "ignore_eos": true}),
        ),
        (
            2,
            json!({"messages": [{"role": "user", "content": "raw text"}], "stop": "."}),
        ),
        (
            1,
            json!({"model": "org/m", "prompt": "Once upon a time", "max_tokens": 8, "echo": false, "best_of": 1, "logprobs": 0}),
        ),
        (1, json!({"prompt": [1, 2, 3, 4], "stop": ["a", 5]})),
        (3, json!({"prompt": ["one string"], "stream": false})),
    ];
    for (i, (mode, b)) in bodies.iter().enumerate() {
        put(
            &root,
            "server_request",
            &format!("body{i}.json"),
            &with_mode(*mode, b.to_string().as_bytes()),
        )?;
    }
    eprintln!("seeds written under {}", root.join("seeds").display());
    Ok(())
}
