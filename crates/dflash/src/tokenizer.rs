//! Text <-> token ids.
//!
//! Where it sits: the prompt (after [`crate::chat`] rendered the chat template) is turned
//! into ids by [`Tokenizer::encode`]; the engine generates ids; [`TextStream`] turns them
//! back into text one id at a time for streaming output; [`stop_token_ids`] tells the
//! engine which ids end generation.
//!
//! [`Tokenizer`] wraps a Hugging Face `tokenizers::Tokenizer` loaded from `tokenizer.json`,
//! with padding and truncation switched off (the engine wants the raw ids). It is cheap to
//! clone (shared behind an `Arc`).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use serde_json::Value;

use crate::{Error, Result};

/// Run `f`, a call into the `tokenizers` library, turning a panic into an error message.
///
/// tokenizers 0.23 panics on some malformed tokenizer.json files instead of returning an
/// error (`expect("Helper")` on a decoder that fails to deserialize, `expect("Precompiled")`
/// on a bad `Precompiled` normalizer; found by fuzz/tokenizer_json). Model files come from
/// outside, so every call into it goes through here. The panic is not printed: a process
/// panic hook (installed once, chaining to the previous one) stays quiet while a guarded
/// call runs on this thread, so panics anywhere else still report (and still abort under
/// a fuzzer).
pub(crate) fn guarded<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    use std::cell::Cell;
    thread_local!(static QUIET: Cell<bool> = const { Cell::new(false) });
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                prev(info)
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    r.map_err(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        format!(
            "the tokenizers library failed on this input ({})",
            msg.lines().next().unwrap_or("panic")
        )
    })
}

/// A tokenizer loaded from a `tokenizer.json` file.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    /// Where it came from, for error messages.
    file: String,
    /// Built on first use: see [`Tokenizer::special_spans`], [`Tokenizer::encode_with_specials_at`].
    specials: Arc<Specials>,
}

/// The special tokens' texts and a matcher for them, and a copy of the tokenizer that encodes
/// their texts as ordinary text (`encode_special_tokens`).
#[derive(Default)]
struct Specials {
    matcher: OnceLock<Option<SpecialMatcher>>,
    as_text: OnceLock<tokenizers::Tokenizer>,
}

struct SpecialMatcher {
    ac: aho_corasick::AhoCorasick,
    /// (lstrip, rstrip) of each pattern
    strip: Vec<(bool, bool)>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("file", &self.file)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`. Errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::from_bytes(&bytes, file)
    }

    /// Parses the content of a `tokenizer.json`; `file` names it in errors.
    pub fn from_bytes(bytes: &[u8], file: impl Into<String>) -> Result<Self> {
        let file = file.into();
        // Valid JSON first: tokenizers panics on some syntax errors (see `guarded`).
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes).map_err(|e| Error::Tokenizer {
            file: file.clone(),
            msg: format!("cannot parse: {e}"),
        })?;
        let mut inner = guarded(|| tokenizers::Tokenizer::from_bytes(bytes))
            .map_err(|msg| Error::Tokenizer {
                file: file.clone(),
                msg: format!("cannot parse: {msg}"),
            })?
            .map_err(|e| Error::Tokenizer {
                file: file.clone(),
                msg: format!("cannot parse: {e}"),
            })?;
        inner.with_padding(None);
        inner.with_truncation(None).map_err(|e| Error::Tokenizer {
            file: file.clone(),
            msg: e.to_string(),
        })?;
        Ok(Self {
            inner: Arc::new(inner),
            file,
            specials: Arc::default(),
        })
    }

    /// Wraps an already built `tokenizers::Tokenizer` (e.g. one rebuilt from GGUF metadata
    /// by [`crate::source::gguf::GgufFile::tokenizer`]); `file` names it in errors.
    pub fn from_inner(mut inner: tokenizers::Tokenizer, file: impl Into<String>) -> Result<Self> {
        let file = file.into();
        inner.with_padding(None);
        inner.with_truncation(None).map_err(|e| Error::Tokenizer {
            file: file.clone(),
            msg: e.to_string(),
        })?;
        Ok(Self {
            inner: Arc::new(inner),
            file,
            specials: Arc::default(),
        })
    }

    /// The file this tokenizer was loaded from.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Text to ids. `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS
    /// token); pass `false` for text rendered by a chat template, which already has them.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = guarded(|| self.inner.encode(text, add_special_tokens))
            .map_err(|m| self.err(format!("encode: {m}")))?
            .map_err(|e| self.err(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    fn special_matcher(&self) -> Option<&SpecialMatcher> {
        self.specials
            .matcher
            .get_or_init(|| {
                let mut toks: Vec<(String, bool, bool)> = self
                    .inner
                    .get_added_tokens_decoder()
                    .into_values()
                    .filter(|t| t.special && !t.content.is_empty())
                    .map(|t| (t.content, t.lstrip, t.rstrip))
                    .collect();
                toks.sort();
                toks.dedup_by(|a, b| a.0 == b.0);
                if toks.is_empty() {
                    return None;
                }
                let ac = aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(toks.iter().map(|t| &t.0))
                    .ok()?;
                let strip = toks.iter().map(|t| (t.1, t.2)).collect();
                Some(SpecialMatcher { ac, strip })
            })
            .as_ref()
    }

    /// Byte ranges of `text` that are the text of a special token (an added token marked
    /// `special`, e.g. `<|im_end|>`), leftmost-longest and not overlapping: where
    /// [`Tokenizer::encode`] puts special tokens. Special tokens matched after normalization
    /// (`normalized: true`, rare for special tokens) are matched on the raw text here.
    pub fn special_spans(&self, text: &str) -> Vec<(usize, usize)> {
        match self.special_matcher() {
            None => Vec::new(),
            Some(m) => m.ac.find_iter(text).map(|x| (x.start(), x.end())).collect(),
        }
    }

    /// Text to ids with special tokens recognized only at `specials` (byte ranges, sorted and
    /// not overlapping, each one a special token's text: a subset of
    /// [`Tokenizer::special_spans`]); the text between them is encoded with special-token text
    /// kept as ordinary text (`<|im_end|>` there becomes the ids of its characters). With
    /// `specials` = all of `special_spans(text)` this is exactly [`Tokenizer::encode`] (the
    /// library also splits at every special token and encodes the pieces on their own; a
    /// token's `lstrip` / `rstrip` takes the whitespace next to it, as there).
    /// `add_special_tokens` applies the post-processor once, to the whole.
    pub fn encode_with_specials_at(
        &self,
        text: &str,
        specials: &[(usize, usize)],
        add_special_tokens: bool,
    ) -> Result<Vec<u32>> {
        let all = self.special_matcher().map(|m| {
            m.ac.find_iter(text)
                .map(|x| ((x.start(), x.end()), m.strip[x.pattern().as_usize()]))
                .collect::<Vec<_>>()
        });
        let all = all.unwrap_or_default();
        // cut points: each given range, widened by its token's lstrip / rstrip
        let mut pieces: Vec<(&str, bool)> = Vec::with_capacity(2 * specials.len() + 1);
        let mut at = 0;
        let mut j = 0;
        for &(a, b) in specials {
            while j < all.len() && all[j].0 .0 < a {
                j += 1;
            }
            let Some(&(_, (lstrip, rstrip))) = all.get(j).filter(|s| s.0 == (a, b)) else {
                return Err(self.err(format!(
                    "encode: {a}..{b} is not a special token of the text, or out of order"
                )));
            };
            let mut a = a;
            if lstrip {
                let ws = text[at..a].len() - text[at..a].trim_end().len();
                a -= ws;
            }
            let mut b = b;
            if rstrip {
                b += text[b..].len() - text[b..].trim_start().len();
            }
            if a > at {
                pieces.push((&text[at..a], false));
            }
            pieces.push((&text[a..b], true));
            at = b;
        }
        if at < text.len() {
            pieces.push((&text[at..], false));
        }
        let as_text = self.specials.as_text.get_or_init(|| {
            let mut t = (*self.inner).clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = guarded(|| -> tokenizers::Result<tokenizers::Encoding> {
            let mut parts = Vec::with_capacity(pieces.len());
            for (p, special) in &pieces {
                let t = if *special { &*self.inner } else { as_text };
                parts.push(t.encode(*p, false)?);
            }
            let merged = tokenizers::Encoding::merge(parts, true);
            if add_special_tokens {
                self.inner.post_process(merged, None, true)
            } else {
                Ok(merged)
            }
        })
        .map_err(|m| self.err(format!("encode: {m}")))?
        .map_err(|e| self.err(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids to text. Unknown ids are an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        guarded(|| self.inner.decode(ids, skip_special))
            .map_err(|m| self.err(format!("decode: {m}")))?
            .map_err(|e| self.err(format!("decode: {e}")))
    }

    /// The id of a token (including added/special tokens), if it exists.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id, if it exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of tokens, added tokens included. Note that a model's embedding matrix may
    /// be larger (padded); ids in between have no token.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn err(&self, msg: String) -> Error {
        Error::Tokenizer {
            file: self.file.clone(),
            msg,
        }
    }
}

/// How many prompt ids [`TextStream::with_prompt`] keeps as decoding context.
const PROMPT_CONTEXT: usize = 5;

/// Streaming detokenizer: fed one id at a time, returns the text that id completed.
///
/// Decoding ids one by one does not work: a multi-byte character may be split over
/// several byte tokens, and SentencePiece/ByteLevel decoders drop or add a leading space
/// depending on what precedes. So this decodes a small window of recent ids twice, with and
/// without the new ones, and returns the difference, holding back text that ends in an
/// incomplete character (U+FFFD) until it completes.
#[derive(Debug, Clone)]
pub struct TextStream {
    tokenizer: Tokenizer,
    skip_special: bool,
    /// Ids of the current window; `ids[..read]` have been emitted.
    ids: Vec<u32>,
    /// Start of the decoding window (context for the leading space).
    prefix: usize,
    /// End of the already emitted ids.
    read: usize,
}

impl TextStream {
    /// A stream with no context: the first token's leading space (if any) is dropped, as
    /// `decode` would drop it.
    pub fn new(tokenizer: &Tokenizer, skip_special: bool) -> Self {
        Self {
            tokenizer: tokenizer.clone(),
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// A stream that continues after `prompt_ids`: the last few prompt ids are used as
    /// context (never emitted), so the first generated token keeps its leading space.
    pub fn with_prompt(tokenizer: &Tokenizer, prompt_ids: &[u32], skip_special: bool) -> Self {
        let ctx = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..];
        Self {
            tokenizer: tokenizer.clone(),
            skip_special,
            ids: ctx.to_vec(),
            prefix: 0,
            read: ctx.len(),
        }
    }

    /// Adds one id; returns the newly completed text (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix_text = self
            .tokenizer
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let new_text = self
            .tokenizer
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        if new_text.len() > prefix_text.len() && !new_text.ends_with('\u{FFFD}') {
            let out = suffix_after(&new_text, &prefix_text).to_string();
            self.advance();
            Ok(out)
        } else {
            Ok(String::new())
        }
    }

    /// Adds several ids; returns the text they completed.
    pub fn push_all(&mut self, ids: &[u32]) -> Result<String> {
        let mut out = String::new();
        for &id in ids {
            out.push_str(&self.push(id)?);
        }
        Ok(out)
    }

    /// Ends the stream: returns text still held back (an incomplete character comes out
    /// as U+FFFD).
    pub fn flush(&mut self) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let prefix_text = self
            .tokenizer
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let new_text = self
            .tokenizer
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        let out = if new_text.len() > prefix_text.len() {
            suffix_after(&new_text, &prefix_text).to_string()
        } else {
            String::new()
        };
        self.advance();
        Ok(out)
    }

    fn advance(&mut self) {
        self.prefix = self.read;
        self.read = self.ids.len();
        // Keep only the window: everything before `prefix` is no longer needed.
        self.ids.drain(..self.prefix);
        self.read -= self.prefix;
        self.prefix = 0;
    }
}

/// The part of `new` beyond `prefix`. Normally `prefix` is a prefix of `new`; when a
/// decoder rewrote earlier text, falls back to the part beyond the longest common prefix.
fn suffix_after<'a>(new: &'a str, prefix: &str) -> &'a str {
    if let Some(rest) = new.strip_prefix(prefix) {
        return rest;
    }
    let common = new
        .char_indices()
        .zip(prefix.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| prefix.len().min(new.len()));
    // `common` is a char boundary of `new` in the first case; guard the second.
    let mut i = common;
    while !new.is_char_boundary(i) {
        i -= 1;
    }
    &new[i..]
}

/// The ids that end generation: the union, in this order and without duplicates, of
/// `eos_token_id` in `generation_config.json`, `eos_token_id` in `config.json` (each an
/// int, a list of ints, or null), and `eos_token` of `tokenizer_config.json` (a string or
/// `{"content": ..}`) looked up in the tokenizer. Pass `None` for files that are absent.
/// Each argument is `(file name for errors, parsed JSON)`.
pub fn stop_token_ids(
    tokenizer: &Tokenizer,
    generation_config: Option<(&str, &Value)>,
    config: Option<(&str, &Value)>,
    tokenizer_config: Option<(&str, &Value)>,
) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for (file, json) in [generation_config, config].into_iter().flatten() {
        ids.extend(eos_ids_field(file, json)?);
    }
    if let Some((file, json)) = tokenizer_config {
        if let Some(tok) = token_content(json.get("eos_token")) {
            match tokenizer.token_to_id(tok) {
                Some(id) => ids.push(id),
                None => tracing::warn!("{file}: eos_token `{tok}` is not in the vocabulary"),
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    ids.retain(|id| seen.insert(*id));
    Ok(ids)
}

/// [`stop_token_ids`] reading `generation_config.json`, `config.json` and
/// `tokenizer_config.json` from a model directory (each optional).
pub fn stop_token_ids_from_dir(tokenizer: &Tokenizer, dir: &Path) -> Result<Vec<u32>> {
    let read = |name: &str| -> Result<Option<(String, Value)>> {
        let path = dir.join(name);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let file = path.display().to_string();
        let json = serde_json::from_str(&text)
            .map_err(|e| Error::config(&file, "(json)", e.to_string()))?;
        Ok(Some((file, json)))
    };
    let gen = read("generation_config.json")?;
    let cfg = read("config.json")?;
    let tok = read("tokenizer_config.json")?;
    fn as_ref(o: &Option<(String, Value)>) -> Option<(&str, &Value)> {
        o.as_ref().map(|(f, v)| (f.as_str(), v))
    }
    stop_token_ids(tokenizer, as_ref(&gen), as_ref(&cfg), as_ref(&tok))
}

fn eos_ids_field(file: &str, json: &Value) -> Result<Vec<u32>> {
    let one = |v: &Value| -> Result<u32> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                Error::config(
                    file,
                    "eos_token_id",
                    format!("expected a token id, found {v}"),
                )
            })
    };
    match json.get("eos_token_id") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

/// A token given as a string or as an AddedToken object `{"content": ..}`.
pub(crate) fn token_content(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A byte-level BPE tokenizer (GPT-2 / Qwen style): the 256 byte symbols plus a few
    /// merges, and two special tokens.
    fn byte_level() -> Tokenizer {
        // the 256 byte symbols in byte order
        let mut vocab = serde_json::Map::new();
        for (i, c) in crate::testing::byte_chars().iter().enumerate() {
            vocab.insert(c.to_string(), json!(i));
        }
        // "Ġ" is the space symbol.
        let merges = [
            "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
        ];
        let mut next = 256;
        for m in merges {
            vocab.insert(m.replace(' ', ""), json!(next));
            next += 1;
        }
        crate::testing::bpe_tokenizer(
            vocab,
            &merges,
            &[(next, "<|endoftext|>"), (next + 1, "<|im_end|>")],
        )
    }

    /// A SentencePiece-style tokenizer (Llama 2 / Mistral style): `▁` for spaces, byte
    /// fallback tokens `<0xNN>` for characters outside the vocabulary, BOS added.
    fn sentencepiece() -> Tokenizer {
        let mut vocab = serde_json::Map::new();
        vocab.insert("<unk>".into(), json!(0));
        vocab.insert("<s>".into(), json!(1));
        vocab.insert("</s>".into(), json!(2));
        for b in 0..256 {
            vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
        }
        let pieces = [
            "▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "ll", "he", "hell", "hello",
            "▁hello", "or", "ld", "▁world",
        ];
        let mut id = 259;
        for p in pieces {
            vocab.insert(p.into(), json!(id));
            id += 1;
        }
        // Ranked: "▁hello" must be built before "▁h" could take the "h".
        let merges = [
            "h e",
            "l l",
            "he ll",
            "hell o",
            "▁ hello",
            "▁ h",
            "▁ w",
            "o r",
            "l d",
            "▁w or",
            "▁wor ld",
        ];
        // "▁wor" is needed as an intermediate.
        vocab.insert("▁wor".into(), json!(id));
        let t = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
            ]},
            "pre_tokenizer": null,
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                      "vocab": vocab, "merges": merges}
        });
        Tokenizer::from_bytes(t.to_string().as_bytes(), "sp.json").unwrap()
    }

    /// Streams `ids` one at a time; checks that no chunk has a replacement character and
    /// that the chunks add up to `decode(ids)`.
    fn stream_all(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
        let mut s = TextStream::new(tok, skip_special);
        let mut chunks: Vec<String> = ids.iter().map(|&id| s.push(id).unwrap()).collect();
        chunks.push(s.flush().unwrap());
        for c in &chunks {
            assert!(
                !c.contains('\u{FFFD}'),
                "chunk with a partial character: {chunks:?}"
            );
        }
        assert_eq!(chunks.concat(), tok.decode(ids, skip_special).unwrap());
        chunks
    }

    #[test]
    fn byte_level_roundtrip_and_lookup() {
        let tok = byte_level();
        let ids = tok.encode("hello world", false).unwrap();
        assert_eq!(ids.len(), 2, "merges applied: {ids:?}");
        assert_eq!(tok.id_to_token(ids[0]).as_deref(), Some("hello"));
        assert_eq!(tok.id_to_token(ids[1]).as_deref(), Some("Ġworld"));
        assert_eq!(tok.decode(&ids, false).unwrap(), "hello world");
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(266));
        assert_eq!(tok.vocab_size(), 267);
        assert_eq!(tok.token_to_id("nope"), None);
        assert_eq!(tok.id_to_token(100_000), None);
        // An unknown id is an error, not a panic.
        let e = tok.decode(&[100_000], false);
        assert!(e.is_err() || e.unwrap().is_empty());
    }

    /// Special tokens only where told: elsewhere their text is encoded as its characters;
    /// told every special token of the text, exactly `encode`.
    #[test]
    fn special_token_text_can_be_kept_as_text() {
        let tok = byte_level();
        let end = tok.token_to_id("<|im_end|>").unwrap();
        let eot = tok.token_to_id("<|endoftext|>").unwrap();
        for text in [
            "hello world",
            "hello <|im_en d|> world",
            "",
            "hello<|im_end|>\n<|endoftext|><|im_end|> world",
            "<|im_end|>",
        ] {
            let all = tok.special_spans(text);
            assert_eq!(
                tok.encode_with_specials_at(text, &all, false).unwrap(),
                tok.encode(text, false).unwrap(),
                "{text}"
            );
        }
        let text = "hello<|im_end|>\n<|endoftext|><|im_end|> world";
        let spans = tok.special_spans(text);
        assert_eq!(spans, vec![(5, 15), (16, 29), (29, 39)]);
        let normal = tok.encode(text, false).unwrap();
        assert_eq!(normal.iter().filter(|&&i| i == end).count(), 2);
        // none special: the text's characters, decoding back to the same text
        let kept = tok.encode_with_specials_at(text, &[], false).unwrap();
        assert!(!kept.contains(&end) && !kept.contains(&eot), "{kept:?}");
        assert_eq!(tok.decode(&kept, false).unwrap(), text);
        assert!(kept.len() > normal.len() + 10);
        // only the middle one special
        let one = tok
            .encode_with_specials_at(text, &spans[1..2], false)
            .unwrap();
        assert_eq!(one.iter().filter(|&&i| i == eot).count(), 1, "{one:?}");
        assert!(!one.contains(&end), "{one:?}");
        assert_eq!(tok.decode(&one, false).unwrap(), text);
        // ranges that are not special tokens of the text are an error, not a panic
        assert!(tok.encode_with_specials_at(text, &[(0, 5)], false).is_err());
        assert!(tok
            .encode_with_specials_at(text, &[(16, 29), (5, 15)], false)
            .is_err());
        assert!(tok.encode_with_specials_at("é", &[(1, 2)], false).is_err());
    }

    /// With a post-processor (a BOS token): applied once to the whole, not per piece.
    #[test]
    fn keeping_text_applies_the_post_processor_once() {
        let tok = sentencepiece();
        let text = "hello</s>world</s>";
        let spans = tok.special_spans(text);
        assert_eq!(spans, vec![(5, 9), (14, 18)]);
        assert_eq!(
            tok.encode_with_specials_at(text, &spans, true).unwrap(),
            tok.encode(text, true).unwrap()
        );
        let kept = tok.encode_with_specials_at(text, &[], true).unwrap();
        assert_eq!(kept[0], 1, "{kept:?}");
        assert_eq!(kept.iter().filter(|&&i| i == 1).count(), 1, "{kept:?}");
        assert!(!kept.contains(&2), "{kept:?}");
        assert_eq!(tok.decode(&kept, true).unwrap(), text);
    }

    #[test]
    fn byte_level_stream_multibyte() {
        let tok = byte_level();
        let text = "hello 你好 world é!";
        let ids = tok.encode(text, false).unwrap();
        // "你" is 3 byte tokens: the stream must hold back the partial bytes.
        let chunks = stream_all(&tok, &ids, false);
        assert_eq!(chunks.concat(), text);
        assert!(chunks.contains(&"你".to_string()), "{chunks:?}");
        assert!(chunks.contains(&" world".to_string()), "{chunks:?}");
        // The chunk count: some ids complete nothing.
        assert!(chunks.iter().filter(|c| c.is_empty()).count() >= 4);
    }

    #[test]
    fn byte_level_stream_special_tokens() {
        let tok = byte_level();
        let mut ids = tok.encode("hello", false).unwrap();
        ids.push(tok.token_to_id("<|im_end|>").unwrap());
        let chunks = stream_all(&tok, &ids, true);
        assert_eq!(chunks.concat(), "hello");
        let chunks = stream_all(&tok, &ids, false);
        assert_eq!(chunks.concat(), "hello<|im_end|>");
    }

    #[test]
    fn sentencepiece_stream_spaces_and_byte_fallback() {
        let tok = sentencepiece();
        let ids = tok.encode("hello world ü€ hello", true).unwrap();
        assert_eq!(ids[0], 1, "BOS added");
        assert!(ids.contains(&(3 + 0xC3)), "byte fallback used: {ids:?}");
        let chunks = stream_all(&tok, &ids, true);
        assert_eq!(chunks.concat(), "hello world ü€ hello");
        // The space before a word comes with that word, not lost between chunks.
        assert!(chunks.contains(&" world".to_string()), "{chunks:?}");
        assert!(chunks.contains(&"€".to_string()), "{chunks:?}");
    }

    #[test]
    fn stream_after_prompt_keeps_leading_space() {
        let tok = sentencepiece();
        let prompt = tok.encode("hello", true).unwrap();
        let gen = tok.encode("hello world", false).unwrap();
        // "world" without context would decode as "world"; after the prompt it is " world".
        let mut s = TextStream::with_prompt(&tok, &prompt, true);
        let mut out = s.push_all(&gen[gen.len() - 1..]).unwrap();
        out.push_str(&s.flush().unwrap());
        assert_eq!(out, " world");
        let mut s = TextStream::new(&tok, true);
        assert_eq!(s.push(*gen.last().unwrap()).unwrap(), "world");
    }

    #[test]
    fn flush_emits_incomplete_character() {
        let tok = sentencepiece();
        let e_acute_first_byte = 3 + 0xC3;
        let mut s = TextStream::new(&tok, true);
        assert_eq!(s.push(tok.token_to_id("▁hello").unwrap()).unwrap(), "hello");
        assert_eq!(s.push(e_acute_first_byte).unwrap(), "");
        assert_eq!(s.flush().unwrap(), "\u{FFFD}");
        assert_eq!(s.flush().unwrap(), "");
    }

    #[test]
    fn long_stream_keeps_window_small() {
        let tok = byte_level();
        let text = "hello world ".repeat(200);
        let ids = tok.encode(&text, false).unwrap();
        let mut s = TextStream::new(&tok, false);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&s.push(id).unwrap());
            assert!(s.ids.len() <= 4, "window grows: {}", s.ids.len());
        }
        out.push_str(&s.flush().unwrap());
        assert_eq!(out, text);
    }

    #[test]
    fn load_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("tokenizer.json");
        let e = Tokenizer::from_file(&missing).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        std::fs::write(&missing, "{not json").unwrap();
        let e = Tokenizer::from_file(&missing).unwrap_err();
        assert!(matches!(e, Error::Tokenizer { .. }), "{e:?}");
        assert!(e.to_string().contains("tokenizer.json"), "{e}");
    }

    #[test]
    fn stop_ids_union_dedup() {
        let tok = byte_level();
        let gen = json!({"eos_token_id": [266, 265]});
        let cfg = json!({"eos_token_id": 266});
        let tc = json!({"eos_token": {"content": "<|endoftext|>", "special": true}});
        let ids =
            stop_token_ids(&tok, Some(("g", &gen)), Some(("c", &cfg)), Some(("t", &tc))).unwrap();
        assert_eq!(ids, vec![266, 265]);
        let tc = json!({"eos_token": "<|im_end|>"});
        let cfg = json!({"eos_token_id": null});
        assert_eq!(
            stop_token_ids(&tok, None, Some(("c", &cfg)), Some(("t", &tc))).unwrap(),
            vec![266]
        );
        assert_eq!(
            stop_token_ids(&tok, None, None, None).unwrap(),
            Vec::<u32>::new()
        );
        // Unknown eos token string: ignored (with a warning).
        let tc = json!({"eos_token": "</s>"});
        assert_eq!(
            stop_token_ids(&tok, None, None, Some(("t", &tc))).unwrap(),
            Vec::<u32>::new()
        );
        // Wrong type: a config error naming the file and field.
        let bad = json!({"eos_token_id": "x"});
        let e = stop_token_ids(&tok, Some(("generation_config.json", &bad)), None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("eos_token_id"),
            "{e}"
        );
        let bad = json!({"eos_token_id": [-1]});
        assert!(stop_token_ids(&tok, None, Some(("c", &bad)), None).is_err());
    }

    #[test]
    fn stop_ids_from_dir() {
        let tok = byte_level();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), r#"{"eos_token_id": 265}"#).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": "<|im_end|>"}"#,
        )
        .unwrap();
        assert_eq!(
            stop_token_ids_from_dir(&tok, dir.path()).unwrap(),
            vec![265, 266]
        );
        std::fs::write(dir.path().join("generation_config.json"), "{oops").unwrap();
        let e = stop_token_ids_from_dir(&tok, dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("generation_config.json"), "{e}");
    }
}
