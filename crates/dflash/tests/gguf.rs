//! GGUF targets: a tiny random model converted to GGUF (f32 and quantized) gives the logits
//! of its safetensors original; the real SmolLM2 / Gemma-3 GGUF files decode greedily like
//! llama.cpp (fixtures recorded by tools/llama-cpp-fixtures/make_fixtures.sh).

mod common;
use candle_core::quantized::GgmlDType;
use common::*;
use dflash::archs::{load_target, LoadOptions, Logits, TargetModel};
use dflash::source::gguf::GgufFile;
use dflash::source::ModelSource;
use dflash::testing::{write_gguf, TinyTarget};
use std::path::Path;

fn load_gguf(path: &Path, keep_quant: bool) -> Box<dyn TargetModel> {
    let opts = LoadOptions {
        keep_quant,
        ..Default::default()
    };
    load_target(&ModelSource::from_gguf("test", path), &opts)
        .unwrap()
        .1
}

fn all_logits(m: &dyn TargetModel, toks: &[u32]) -> candle_core::Tensor {
    let mut c = m.new_cache(toks.len()).unwrap();
    m.forward(toks, 0, &mut c, &[], Logits::All)
        .unwrap()
        .logits
        .unwrap()
}

fn max_abs(t: &candle_core::Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn tiny_gguf_gives_the_safetensors_logits() {
    for spec in [
        TinyTarget::qwen3(21),
        TinyTarget::llama(22),
        TinyTarget::qwen2(23),
    ] {
        let dir = tempfile::tempdir().unwrap();
        spec.write(dir.path()).unwrap();
        let st = load(dir.path());
        let toks = ids(spec.seed, 24, spec.vocab);
        let want = all_logits(st.as_ref(), &toks);
        let scale = max_abs(&want);
        for (dt, tol) in [
            (GgmlDType::F32, 1e-4),
            (GgmlDType::Q8_0, 0.03),
            (GgmlDType::Q4_1, 0.3),
        ] {
            let path = write_gguf(&spec, dir.path(), dt).unwrap();
            let g = load_gguf(&path, true);
            assert_eq!(g.info().family, st.info().family);
            let d = max_abs_diff(&all_logits(g.as_ref(), &toks), &want) / scale;
            assert!(d < tol, "{} {dt:?}: relative max diff {d}", spec.model_type);
            // The default load (Q4_1 kept for dflash's own product where the CPU has VNNI,
            // else requantized to Q8_0) stays as close to the stored model under candle's.
            if dt == GgmlDType::Q4_1 {
                let keep = all_logits(g.as_ref(), &toks);
                let rq = load_gguf(&path, false);
                let q = rq.info().quantization.clone().unwrap();
                if dflash::nn::q8::keeps_as_stored(dt, spec.hidden) {
                    assert!(q.contains("Q4_1 x") && !q.contains("Q4_1->"), "{q}");
                } else {
                    assert!(q.contains("Q4_1->Q8_0"), "{q}");
                }
                let d = max_abs_diff(&all_logits(rq.as_ref(), &toks), &keep) / scale;
                assert!(d < 0.03, "{}: requantized vs stored {d}", spec.model_type);
            }
        }
    }
}

#[test]
fn tiny_gguf_config_matches_safetensors_config() {
    let spec = TinyTarget::llama(5);
    let dir = tempfile::tempdir().unwrap();
    spec.write(dir.path()).unwrap();
    let path = write_gguf(&spec, dir.path(), GgmlDType::Q8_0).unwrap();
    let a = dflash::config::TargetConfig::from_file(&dir.path().join("config.json")).unwrap();
    let b = GgufFile::open(&path).unwrap().target_config().unwrap();
    assert_eq!(
        (
            a.hidden_size,
            a.num_hidden_layers,
            a.num_attention_heads,
            a.num_key_value_heads
        ),
        (
            b.hidden_size,
            b.num_hidden_layers,
            b.num_attention_heads,
            b.num_key_value_heads
        )
    );
    assert_eq!(
        (a.head_dim, a.vocab_size, a.intermediate_size),
        (b.head_dim, b.vocab_size, b.intermediate_size)
    );
    assert_eq!(a.tie_word_embeddings, b.tie_word_embeddings);
    // llama3 scaling arrives as per-frequency factors with the same inverse frequencies
    let (fa, _) = a.rope.inv_freq(a.head_dim);
    let (fb, _) = b.rope.inv_freq(b.head_dim);
    for (x, y) in fa.iter().zip(&fb) {
        assert!((x - y).abs() <= 1e-6 * x.abs().max(1e-6), "{x} vs {y}");
    }
}

// ---- real models -------------------------------------------------------------------------

#[derive(serde::Deserialize)]
struct Fixture {
    llama_cpp: String,
    cases: Vec<Case>,
}
#[derive(serde::Deserialize)]
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    ids: Vec<u32>,
}

/// The model file, or None (with a loud message) when it cannot be fetched.
fn real_model(
    get: fn() -> dflash::Result<std::path::PathBuf>,
    name: &str,
) -> Option<std::path::PathBuf> {
    match get() {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!("\n!!!!!! SKIPPED: cannot fetch {name}: {e}\n");
            None
        }
    }
}

/// Greedy ids from `prompt_ids`, stopping at a stop id (included) or after `n`; also the
/// logits of every step.
fn greedy(
    m: &dyn TargetModel,
    prompt_ids: &[u32],
    n: usize,
    stops: &[u32],
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut c = m.new_cache(prompt_ids.len() + n + 1).unwrap();
    let mut logits = m
        .forward(prompt_ids, 0, &mut c, &[], Logits::Last)
        .unwrap()
        .logits
        .unwrap();
    let (mut out, mut all) = (vec![], vec![]);
    let mut pos = prompt_ids.len();
    for _ in 0..n {
        let l: Vec<f32> = logits.squeeze(0).unwrap().to_vec1().unwrap();
        let next = l
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            )
            .0 as u32;
        out.push(next);
        all.push(l);
        if stops.contains(&next) {
            break;
        }
        logits = m
            .forward(&[next], pos, &mut c, &[], Logits::Last)
            .unwrap()
            .logits
            .unwrap();
        pos += 1;
    }
    (out, all)
}

/// Compare with llama.cpp's ids: equal, except that a divergence is allowed at a near tie
/// (our logit of llama.cpp's token within `tie` of our best), after which the two
/// continuations are no longer comparable. Returns the number of equal leading tokens.
fn compare(name: &str, ours: &[u32], logits: &[Vec<f32>], theirs: &[u32], tie: f32) -> usize {
    let n = ours.iter().zip(theirs).take_while(|(a, b)| a == b).count();
    if n < theirs.len().min(ours.len()) {
        let l = &logits[n];
        let gap = l[ours[n] as usize] - l[theirs[n] as usize];
        eprintln!("{name}: diverges from llama.cpp at token {n}: ours {} vs llama.cpp {} (logit gap {gap:.4})", ours[n], theirs[n]);
        assert!(gap < tie, "{name}: token {n}: ours {} vs llama.cpp {}: logit gap {gap} is not a near tie\nours   {ours:?}\ntheirs {theirs:?}", ours[n], theirs[n]);
    } else {
        assert_eq!(
            ours.len(),
            theirs.len(),
            "{name}: lengths differ\nours   {ours:?}\ntheirs {theirs:?}"
        );
    }
    n
}

fn check_against_llama_cpp(path: &Path, fixture: &str, chat: bool) {
    let fx: Fixture = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let g = GgufFile::open(path).unwrap();
    let tok = g.tokenizer().unwrap();
    let stops = g.stop_token_ids().unwrap();
    let keep = load_gguf(path, true);
    let requant = load_gguf(path, false);
    eprintln!(
        "{}: {:?}; fixture from {}",
        path.display(),
        requant.info().quantization,
        fx.llama_cpp
    );
    let mut total = 0;
    for (i, case) in fx.cases.iter().enumerate() {
        // the GGUF tokenizer gives llama.cpp's prompt ids
        let add_special = !case.prompt.starts_with("<|im_start|>");
        assert_eq!(
            tok.encode(&case.prompt, add_special).unwrap(),
            case.prompt_ids,
            "prompt {i} tokens"
        );
        let (ours, logits) = greedy(
            keep.as_ref(),
            &case.prompt_ids,
            fx.cases[i].ids.len().max(32),
            &stops,
        );
        // a near tie: within 0.1 (0.25 until session 47; the largest gaps at a divergence
        // are now 0.085 on SmolLM2, whose Q4_1 activations follow llama.cpp's x86 rule, and
        // 0.084 on Gemma; issue 27 asks 0.05)
        total += compare(
            &format!("prompt {i} (stored quant)"),
            &ours,
            &logits,
            &case.ids,
            0.1,
        );
        // The default load (Q4_1 through dflash's own int8 product where the CPU has VNNI,
        // else requantized to Q8_0): the same choices except at near ties. The measured logit
        // shift of candle's Q8_0 kernels is up to ~0.4 on SmolLM2 (the exact f32 model's
        // top-2 gap is 0.02-0.04 at the first token of these prompts).
        let (rq, rq_logits) = greedy(requant.as_ref(), &case.prompt_ids, 32, &stops);
        let same = compare(
            &format!("prompt {i} (requantized vs stored)"),
            &rq,
            &rq_logits,
            &ours,
            0.5,
        );
        eprintln!("prompt {i}: requantized == stored for {same} tokens");
    }
    eprintln!(
        "{total} tokens equal to llama.cpp over {} prompts",
        fx.cases.len()
    );
    if chat {
        // the chat template from the GGUF renders the fixture's prompt text
        let t = g.chat_template().unwrap().expect("chat template");
        let text = t
            .render(
                &[dflash::chat::ChatMessage::user(
                    "What is the capital of France?",
                )],
                true,
                None,
                &Default::default(),
            )
            .unwrap();
        assert_eq!(text, fx.cases[0].prompt);
    }
}

#[test]
fn smollm2_greedy_matches_llama_cpp() {
    let Some(path) = real_model(dflash::source::demo_model_path, "SmolLM2-135M-Instruct") else {
        return;
    };
    let fx = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gguf/smollm2-135m-instruct-q4_1.llama_cpp.json"
    );
    check_against_llama_cpp(&path, fx, true);
    let g = GgufFile::open(&path).unwrap();
    assert!(
        g.stop_token_ids().unwrap().contains(&2),
        "<|im_end|> is a stop id"
    );
}

/// 253 MB download: run with `cargo test --release -p dflash --test gguf -- --ignored`.
#[test]
#[ignore]
fn gemma3_270m_greedy_matches_llama_cpp() {
    let Some(path) = real_model(dflash::source::demo::gemma3_270m_path, "Gemma-3-270M") else {
        return;
    };
    let fx = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gguf/gemma-3-270m-q4_k_m.llama_cpp.json"
    );
    check_against_llama_cpp(&path, fx, false);
}

/// A verify of q rows gives, row for row, the logits plain decoding computes one token at a
/// time: bit-equal, not close. Without it greedy DFlash output drifts from plain decoding on
/// quantized targets: the attention products round differently per shape and activation
/// quantization turns those last bits into logit differences (~0.9 on SmolLM2 before the
/// row-wise verify attention), enough to flip greedy choices that are not near-ties.
#[test]
fn smollm2_verify_rows_equal_decode_steps() {
    let Some(path) = real_model(dflash::source::demo_model_path, "SmolLM2-135M-Instruct") else {
        return;
    };
    // Q4_1: requantized to Q8_0, and kept (per-row dot products): both row-invariant.
    for keep_quant in [false, true] {
        verify_rows_equal_decode_steps(&path, keep_quant);
    }
}

/// The same for Gemma-3-270M Q4_K_M (Q4_K, Q5_0, Q6_K and Q8_0 matrices; 253 MB download:
/// `--ignored`). Default load only: candle multiplies one row by a Q6_K matrix with another
/// kernel than several rows (max difference 0.70, 1.17 with `--keep-quant`;
/// `examples/verify_rows.rs`); by default its Q6_K matrices now go through dflash's own
/// int8 product, as stored (row-invariant).
#[test]
#[ignore]
fn gemma3_270m_verify_rows_equal_decode_steps() {
    let Some(path) = real_model(dflash::source::demo::gemma3_270m_path, "Gemma-3-270M") else {
        return;
    };
    verify_rows_equal_decode_steps(&path, false);
}

/// 20 decode steps after the first llama.cpp fixture prompt against verify blocks of 2, 5
/// and 16 rows (`common::assert_verify_rows_equal_decode_steps`).
fn verify_rows_equal_decode_steps(path: &Path, keep_quant: bool) {
    let fx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/gguf/smollm2-135m-instruct-q4_1.llama_cpp.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let prompt: Vec<u32> = fx["cases"][0]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let m = load_gguf(path, keep_quant);
    let what = format!("{} keep_quant {keep_quant}", path.display());
    assert_verify_rows_equal_decode_steps(&*m, &prompt, 20, &[2, 5, 16], &what);
}

/// The demo GGUF (SmolLM2-135M Q4_1, loaded as stored: dflash's int8 products) against the
/// same file with every tensor dequantized to f32 (candle's GGUF dequantization, then f32
/// products): every position's logits over a 24-token prompt. Issue 27 asks for 1e-3; but the
/// quantized products quantize the activations to 8 bits (one scale per 32, as llama.cpp's
/// Q8_1 and candle's own Q4_1 kernel do), which costs far more over 30 layers. Measured in
/// session 32: max |diff| / max |logit| 0.166 with dflash's products, 0.163 with candle's
/// (`DFLASH_Q8=0 DFLASH_Q4=0`), mean |diff| 0.29-0.33 at max |logit| 35, the argmax equal at
/// 18 / 22 of 24 positions of this random-token prompt. The assertion is the bound a wrong
/// weight, scale or block layout breaks (rel err ~1, argmax at chance).
#[test]
fn smollm2_logits_match_the_dequantized_weights() {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let Some(path) = real_model(dflash::source::demo_model_path, "SmolLM2-135M-Instruct") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let twin = dir.path().join("f32.gguf");
    {
        let mut f = std::fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut f).unwrap();
        let dev = candle_core::Device::Cpu;
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut names: Vec<&String> = content.tensor_infos.keys().collect();
        names.sort();
        for name in names {
            let q = content.tensor(&mut f, name, &dev).unwrap();
            let w = q.dequantize(&dev).unwrap();
            tensors.push((name.clone(), QTensor::quantize(&w, GgmlDType::F32).unwrap()));
        }
        let meta: Vec<(&str, &gguf_file::Value)> = content
            .metadata
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .collect();
        let t_ref: Vec<(&str, &QTensor)> = tensors.iter().map(|(a, b)| (a.as_str(), b)).collect();
        let mut out = std::fs::File::create(&twin).unwrap();
        gguf_file::write(&mut out, &meta, &t_ref).unwrap();
    }
    let (q, f) = (load_gguf(&path, false), load_gguf(&twin, false));
    let toks: Vec<u32> = (0..24u32).map(|i| 1 + (i * 7919) % 49000).collect();
    let (a, b) = (all_logits(q.as_ref(), &toks), all_logits(f.as_ref(), &toks));
    let rel = max_abs(&(&a - &b).unwrap()) / max_abs(&b);
    let argmax = |t: &candle_core::Tensor| t.argmax(1).unwrap().to_vec1::<u32>().unwrap();
    let same = argmax(&a)
        .iter()
        .zip(argmax(&b))
        .filter(|(x, y)| **x == *y)
        .count();
    let mean_abs = (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    eprintln!(
        "smollm2 Q4_1 as stored vs dequantized to f32: max logit rel err {rel:.3e}, mean abs diff {mean_abs:.3e}, max |logit| {:.2}, argmax equal at {same} of {} positions",
        max_abs(&b),
        toks.len()
    );
    assert!(
        rel < 0.25 && same >= 16,
        "rel err {rel}, argmax equal at {same}"
    );
}
