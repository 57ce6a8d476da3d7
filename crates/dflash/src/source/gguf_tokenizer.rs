//! A `tokenizers::Tokenizer` rebuilt from GGUF metadata, following llama.cpp's rules for the
//! two vocabulary kinds in use:
//!
//! - `tokenizer.ggml.model = gpt2`: byte-level BPE from `tokens` + `merges`; the split regex
//!   comes from `tokenizer.ggml.pre` (llama.cpp's table of pre-tokenizer names).
//! - `tokenizer.ggml.model = llama`: SentencePiece-style BPE (llama.cpp's "SPM"): spaces
//!   become `▁` (with a leading one when `add_space_prefix`), the highest-scoring adjacent
//!   pair merges first, unknown characters fall back to `<0xXX>` byte tokens. Merges are
//!   derived from the vocabulary and its scores.
//!
//! Control and user-defined tokens (`token_type` 3 and 4) are added tokens, matched in the
//! raw text before the model runs, as llama.cpp does; control tokens are special (skipped by
//! `decode(.., skip_special = true)`).

use super::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::collections::HashMap;
use tokenizers::decoders::{
    byte_fallback::ByteFallback, byte_level::ByteLevel as ByteLevelDecoder, fuse::Fuse,
    sequence::Sequence as DecoderSequence, strip::Strip, DecoderWrapper,
};
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{
    prepend::Prepend, replace::Replace, unicode::NFC, utils::Sequence as NormSequence,
    NormalizerWrapper,
};
use tokenizers::pre_tokenizers::{
    byte_level::ByteLevel, sequence::Sequence as PreSequence, split::Split, split::SplitPattern,
    PreTokenizerWrapper,
};
use tokenizers::processors::{
    byte_level::ByteLevel as ByteLevelProcessor, sequence::Sequence as ProcSequence,
    template::TemplateProcessing, PostProcessorWrapper,
};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

/// Longest token (bytes) that gets SentencePiece merge candidates.
const MAX_MERGED_TOKEN_BYTES: usize = 256;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

// llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`.
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn terr(g: &GgufFile, msg: impl Into<String>) -> Error {
    Error::Tokenizer {
        file: g.file_desc(),
        msg: msg.into(),
    }
}

/// Build the tokenizer of a GGUF file.
pub fn build(g: &GgufFile) -> Result<Tokenizer> {
    let kind = g
        .opt_str("tokenizer.ggml.model")?
        .ok_or_else(|| terr(g, "no tokenizer.ggml.model: the file carries no tokenizer"))?
        .to_string();
    let tokens = g.tokens()?;
    let types = g
        .opt_int_array("tokenizer.ggml.token_type")?
        .unwrap_or_default();
    let id = |key: &str| g.opt_token_id(key);
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let unk = id("tokenizer.ggml.unknown_token_id")?;
    let add_bos = g.opt_bool("tokenizer.ggml.add_bos_token")?;
    let add_eos = g.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();

    let mut tk = match kind.as_str() {
        "gpt2" => {
            let merges: Vec<(String, String)> = g
                .opt_str_array("tokenizer.ggml.merges")?
                .ok_or_else(|| terr(g, "gpt2 tokenizer without tokenizer.ggml.merges"))?
                .iter()
                .map(|m| {
                    m.split_once(' ')
                        .map(|(a, b)| (a.to_string(), b.to_string()))
                        .ok_or_else(|| terr(g, format!("invalid merge `{m}`")))
                })
                .collect::<Result<_>>()?;
            let bpe = BPE::builder()
                .vocab_and_merges(vocab, merges)
                .build()
                .map_err(|e| terr(g, format!("BPE: {e}")))?;
            let mut tk = tokenizers::Tokenizer::new(bpe);
            let pre = g.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
            let (norm, pre_tok) = gpt2_pre(g, pre)?;
            if let Some(n) = norm {
                tk.with_normalizer(Some(n))
                    .map_err(|e| terr(g, e.to_string()))?;
            }
            tk.with_pre_tokenizer(Some(pre_tok));
            tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::new(
                true, true, true,
            ))));
            let mut procs = vec![PostProcessorWrapper::ByteLevel(ByteLevelProcessor::new(
                true, false, true,
            ))];
            procs.extend(template(
                &tokens,
                bos,
                eos,
                add_bos.unwrap_or(false),
                add_eos,
            ));
            tk.with_post_processor(Some(PostProcessorWrapper::Sequence(ProcSequence::new(
                procs,
            ))));
            tk
        }
        "llama" => {
            let scores = g
                .opt_f32_array("tokenizer.ggml.scores")?
                .ok_or_else(|| terr(g, "llama tokenizer without tokenizer.ggml.scores"))?;
            let merges = spm_merges(&tokens, &scores, &types);
            let mut b = BPE::builder()
                .vocab_and_merges(vocab, merges)
                .byte_fallback(true)
                .fuse_unk(true);
            if let Some(u) = unk.and_then(|u| tokens.get(u as usize)) {
                b = b.unk_token(u.to_string());
            }
            let bpe = b.build().map_err(|e| terr(g, format!("BPE: {e}")))?;
            let mut tk = tokenizers::Tokenizer::new(bpe);
            let prefix = g
                .opt_bool("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(true);
            let mut norms: Vec<NormalizerWrapper> = Vec::new();
            if prefix {
                norms.push(Prepend::new("▁".into()).into());
            }
            norms.push(
                Replace::new(" ", "▁")
                    .map_err(|e| terr(g, e.to_string()))?
                    .into(),
            );
            tk.with_normalizer(Some(NormalizerWrapper::Sequence(NormSequence::new(norms))))
                .map_err(|e| terr(g, e.to_string()))?;
            let mut decs: Vec<DecoderWrapper> = vec![
                DecoderWrapper::Replace(
                    Replace::new("▁", " ").map_err(|e| terr(g, e.to_string()))?,
                ),
                DecoderWrapper::ByteFallback(ByteFallback::new()),
                DecoderWrapper::Fuse(Fuse::new()),
            ];
            if prefix {
                decs.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
            }
            tk.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(decs))));
            // SentencePiece vocabularies add BOS unless told otherwise.
            if let Some(p) = template(&tokens, bos, eos, add_bos.unwrap_or(true), add_eos) {
                tk.with_post_processor(Some(p));
            }
            tk
        }
        other => {
            return Err(terr(
                g,
                format!("unsupported tokenizer.ggml.model `{other}` (supported: gpt2, llama)"),
            ))
        }
    };
    // Control / user-defined tokens are matched in the raw text.
    let added: Vec<AddedToken> = tokens
        .iter()
        .enumerate()
        .filter_map(|(i, t)| {
            let ty = types.get(i).copied().unwrap_or(1);
            (ty == TOKEN_CONTROL || ty == TOKEN_USER_DEFINED)
                .then(|| AddedToken::from(t.to_string(), ty == TOKEN_CONTROL).normalized(false))
        })
        .collect();
    tk.add_tokens(added).map_err(|e| terr(g, e.to_string()))?;
    Tokenizer::from_inner(tk, format!("{} (tokenizer.ggml.*)", g.file_desc()))
}

/// Normalizer and pre-tokenizer for a byte-level BPE vocabulary, by llama.cpp pre name.
fn gpt2_pre(g: &GgufFile, pre: &str) -> Result<(Option<NormalizerWrapper>, PreTokenizerWrapper)> {
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        Ok(Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| terr(g, e.to_string()))?
        .into())
    };
    // ByteLevel with use_regex applies GPT-2's own split regex.
    let gpt2 = || PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    let bytes_only = || PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false));
    Ok(match pre {
        "llama3" | "llama-bpe" | "llama-v3" | "smaug-bpe" | "dbrx" | "falcon3" | "pixtral" => (
            None,
            PreSequence::new(vec![split(RE_LLAMA3)?, bytes_only()]).into(),
        ),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => (
            Some(NFC.into()),
            PreSequence::new(vec![split(RE_QWEN2)?, bytes_only()]).into(),
        ),
        // Digits split one by one, then GPT-2's regex.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => (
            None,
            PreSequence::new(vec![split(r"\p{N}")?, gpt2()]).into(),
        ),
        "gpt2" | "default" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "mpt" | "olmo" => {
            (None, gpt2())
        }
        other => {
            tracing::warn!(
                "{}: tokenizer.ggml.pre `{other}` unknown; using GPT-2's split rule (tokens may differ from llama.cpp)",
                g.file_desc()
            );
            (None, gpt2())
        }
    })
}

/// A post-processor adding BOS/EOS when the metadata asks for them.
fn template(
    tokens: &[&str],
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
) -> Option<PostProcessorWrapper> {
    let tok = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize).map(|t| (t.to_string(), i)));
    let bos = tok(bos).filter(|_| add_bos);
    let eos = tok(eos).filter(|_| add_eos);
    if bos.is_none() && eos.is_none() {
        return None;
    }
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Vec::new();
    if let Some((t, i)) = &bos {
        single.push(t.clone());
        pair.push(t.clone());
        specials.push((t.clone(), *i));
    }
    single.push("$A".to_string());
    pair.push("$A".to_string());
    if let Some((t, i)) = &eos {
        single.push(t.clone());
        pair.push(t.clone());
        specials.push((t.clone(), *i));
    }
    pair.push("$B:1".to_string());
    let p = TemplateProcessing::builder()
        .try_single(single)
        .ok()?
        .try_pair(pair)
        .ok()?
        .special_tokens(specials)
        .build()
        .ok()?;
    Some(PostProcessorWrapper::Template(p))
}

/// Merges that make a BPE behave like SentencePiece's score-driven merging: every split of a
/// normal token into two tokens of the vocabulary is a merge, ranked by the score of the
/// merged token (highest first), then by its id.
fn spm_merges(tokens: &[&str], scores: &[f32], types: &[i64]) -> Vec<(String, String)> {
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut cands: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let ty = types.get(i).copied().unwrap_or(1);
        // Only normal tokens are produced by merging. Real pieces are short; a long one
        // (a broken or hostile file) would cost O(length^2) here, so it gets no merges.
        if ty != 1 || t.len() > MAX_MERGED_TOKEN_BYTES {
            continue;
        }
        for (cut, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(cut);
            if let (Some(&ia), Some(&ib)) = (ids.get(a), ids.get(b)) {
                cands.push((scores.get(i).copied().unwrap_or(0.0), i, ia.max(ib), a, b));
            }
        }
    }
    cands.sort_by(|x, y| {
        y.0.partial_cmp(&x.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(x.1.cmp(&y.1))
            .then(x.2.cmp(&y.2))
    });
    cands
        .into_iter()
        .map(|(_, _, _, a, b)| (a.to_string(), b.to_string()))
        .collect()
}
