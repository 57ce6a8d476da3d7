//! Structured output: the output constrained to a grammar (a JSON schema, any JSON object, a
//! regular expression, a Lark grammar, one of a list of strings), compiled by `llguidance`
//! into a token mask per position.
//!
//! Under DFlash the mask of verify row i is the grammar state reached after the committed
//! tokens and the block's proposals before row i, which is exactly the state plain decoding
//! has there when those proposals are accepted; the draft's proposals are masked the same way
//! (so they stay acceptable), and sample-and-compare draws every row from the masked
//! distribution, so the output is a lossless sample of the constrained target. A
//! [`Constraint`] keeps the speculative tokens consumed past the committed ones and their
//! masks, so a block costs one mask per row it reaches, and a commit of a prefix of them costs
//! nothing (llguidance rolls back the rest). The masks are applied in
//! [`crate::sampling::Sampler::adjusted`], after the bias and the penalties.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use crate::{Error, Result};

/// What the output must match.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format: {"type": "json_schema", ...}`, vLLM `guided_json`).
    JsonSchema(serde_json::Value),
    /// A regular expression the whole output matches (`guided_regex`).
    Regex(String),
    /// A Lark grammar, llguidance's dialect (`guided_grammar`, `--grammar`).
    Lark(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
}

impl GrammarSpec {
    /// A short name for logs and stats.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject => "json_object",
            GrammarSpec::JsonSchema(_) => "json_schema",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Lark(_) => "lark",
            GrammarSpec::Choice(_) => "choice",
        }
    }

    fn top_level(&self) -> TopLevelGrammar {
        match self {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(compact_json(
                serde_json::json!({"type": "object"}),
            )),
            GrammarSpec::JsonSchema(v) => {
                TopLevelGrammar::from_json_schema(compact_json(v.clone()))
            }
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            GrammarSpec::Choice(c) => {
                let alts: Vec<String> = c.iter().map(|s| regex_escape(s)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alts.join("|")))
            }
        }
    }
}

/// A JSON schema compiled without free whitespace between tokens (llguidance's
/// `whitespace_flexible: false`: one fixed separator after `,` and `:`), unless the schema
/// says otherwise in its own `x-guidance`. With free whitespace a model can emit newlines
/// until `max_tokens` and end with an incomplete object (the demo model does so greedily on
/// docs/serve.md's example).
fn compact_json(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// `s` as a regular expression matching exactly `s`.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~/\"".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The vocabulary as llguidance sees it: every token's bytes in a trie (special tokens
/// marked), the end-of-sequence set, and the tokenizer for forced text. Built once per model.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tokenizer
                .encode(s, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// Whether the tokenizer codes bytes in its token strings (GPT-2's byte-level alphabet, or
/// SentencePiece's `<0xNN>` byte fallback): then llguidance reads the token bytes from them.
fn byte_coded(json: &serde_json::Value) -> bool {
    let d = &json["decoder"];
    d["type"] == "ByteLevel"
        || d["decoders"]
            .as_array()
            .is_some_and(|ds| ds.iter().any(|x| x["type"] == "ByteFallback"))
}

/// Token bytes of a vocabulary of whole-text tokens (no byte coding): each token decoded on
/// its own; special tokens marked as llguidance marks them; a token that does not decode to
/// text of its own (a replacement character the token string lacks) gets no bytes, so the
/// grammar never allows it.
fn text_token_bytes(tok: &crate::tokenizer::Tokenizer, json: &serde_json::Value) -> Vec<Vec<u8>> {
    let special: std::collections::HashSet<u32> = json["added_tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["special"] == true)
        .filter_map(|t| t["id"].as_u64().map(|i| i as u32))
        .collect();
    (0..tok.vocab_size() as u32)
        .map(|id| {
            let Some(name) = tok.id_to_token(id) else {
                return Vec::new();
            };
            if special.contains(&id) {
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend(name.as_bytes());
                return b;
            }
            match tok.decode(&[id], false) {
                // a replacement character of the decoder's own: not the token's text
                Ok(t) if t.is_empty() || (t.contains('\u{FFFD}') && !name.contains('\u{FFFD}')) => {
                    Vec::new()
                }
                Ok(t) => t.into_bytes(),
                Err(_) => Vec::new(),
            }
        })
        .collect()
}

/// Compiles grammars for one model's vocabulary (cheap to clone).
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GrammarCompiler(vocab {})",
            self.factory.tok_env().tok_trie().vocab_size()
        )
    }
}

impl GrammarCompiler {
    /// For `tokenizer`'s vocabulary padded to `vocab_size` (the model's logits width), with
    /// `eos` the tokens that may end the output once the grammar is complete (the model's stop
    /// tokens).
    pub fn new(
        tokenizer: &crate::tokenizer::Tokenizer,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<Self> {
        let what = |e: String| {
            Error::input(format!(
                "structured output: cannot read the vocabulary of {}: {e}",
                tokenizer.file()
            ))
        };
        let inner = tokenizer.inner().clone();
        let json = inner
            .to_string(false)
            .map_err(|e| what(format!("serializing the tokenizer: {e}")))?;
        let json: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| what(e.to_string()))?;
        let mut bytes = if byte_coded(&json) {
            // llguidance's reader panics on some malformed vocabularies: a panic is an error
            crate::tokenizer::guarded(|| {
                llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())
            })
            .map_err(&what)?
            .map_err(&what)?
        } else {
            text_token_bytes(tokenizer, &json)
        };
        if bytes.len() > vocab_size {
            return Err(what(format!(
                "the tokenizer has {} tokens, more than the model's {vocab_size} logits",
                bytes.len()
            )));
        }
        bytes.resize(vocab_size, Vec::new());
        let first_eos = *eos.first().ok_or_else(|| {
            what("no stop token is known (structured output needs one to end the output)".into())
        })?;
        if let Some(&t) = eos.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(what(format!("stop token {t} is outside the vocabulary")));
        }
        let mut trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, first_eos), &bytes);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        let env: TokEnv = Arc::new(VocabEnv {
            trie,
            tokenizer: inner,
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| what(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// Compile `spec` (a bad schema / regex / grammar is an error naming what is wrong).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar> {
        let g = Grammar {
            factory: self.factory.clone(),
            grammar: Arc::new(spec.top_level()),
            spec: Arc::new(spec.clone()),
        };
        // a parser now: compile errors surface with the request, not mid-generation
        g.start()?;
        Ok(g)
    }
}

/// A compiled grammar: each generation under it starts a [`Constraint`].
#[derive(Clone)]
pub struct Grammar {
    factory: Arc<ParserFactory>,
    grammar: Arc<TopLevelGrammar>,
    spec: Arc<GrammarSpec>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammar({})", self.spec.kind())
    }
}

impl Grammar {
    /// A fresh matcher at the start of the output.
    pub fn start(&self) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser((*self.grammar).clone())
            .map_err(|e| Error::input(format!("invalid {} grammar: {e}", self.spec.kind())))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(Error::input(format!(
                "invalid {} grammar: {e}",
                self.spec.kind()
            )));
        }
        Ok(Constraint {
            inner: Mutex::new(State {
                matcher: m,
                spec: Vec::new(),
                after_stop: 0,
                masks: Vec::new(),
                error: None,
                mask_time: Duration::ZERO,
                masks_computed: 0,
            }),
        })
    }
}

/// One generation's grammar state: the committed tokens consumed, `spec` consumed past them,
/// `masks[i]` the mask after committed + `spec[..i]`.
struct State {
    matcher: Matcher,
    spec: Vec<u32>,
    /// The last `after_stop` tokens of `spec` came after the grammar was complete (end of
    /// output tokens, which the mask then allows): not consumed by the matcher, which takes
    /// nothing once stopped.
    after_stop: usize,
    masks: Vec<SimpleVob>,
    error: Option<String>,
    mask_time: Duration,
    masks_computed: usize,
}

impl State {
    fn fail(&mut self, what: &str, e: impl std::fmt::Display) {
        if self.error.is_none() {
            self.error = Some(format!("structured output: {what}: {e}"));
        }
    }

    /// Roll the speculative tokens back to their first `keep`.
    fn keep(&mut self, keep: usize) {
        if keep < self.spec.len() {
            let n = self.spec.len() - keep;
            let virtual_n = n.min(self.after_stop);
            self.after_stop -= virtual_n;
            if let Err(e) = self.matcher.rollback(n - virtual_n) {
                self.fail("rollback", e);
            }
            self.spec.truncate(keep);
            self.masks.truncate(keep + 1);
        }
    }

    /// The mask at the current position (computed once).
    fn mask_here(&mut self) -> Option<&SimpleVob> {
        if self.masks.len() == self.spec.len() {
            let t = Instant::now();
            let m = self.matcher.compute_mask_or_eos();
            self.mask_time += t.elapsed();
            self.masks_computed += 1;
            match m {
                Ok(m) => self.masks.push(m),
                Err(e) => {
                    self.fail("computing the token mask", e);
                    return None;
                }
            }
        }
        self.masks.last()
    }

    /// Consume `t` if the grammar allows it here; false (nothing consumed) if not.
    fn advance(&mut self, t: u32) -> bool {
        if !self.mask_here().is_some_and(|m| m.is_allowed(t)) {
            return false;
        }
        if self.matcher.is_stopped() {
            // complete: the mask allowed only an end of output, which ends it
            self.after_stop += 1;
            self.spec.push(t);
            return true;
        }
        if let Err(e) = self.matcher.consume_token(t) {
            self.fail("consuming a token", e);
            return false;
        }
        self.spec.push(t);
        true
    }

    /// Position the matcher after committed + `extra` (false: `extra` leaves the grammar).
    fn seek(&mut self, extra: &[u32]) -> bool {
        let common = self
            .spec
            .iter()
            .zip(extra)
            .take_while(|(a, b)| a == b)
            .count();
        self.keep(common);
        extra[common..].iter().all(|&t| self.advance(t))
    }
}

/// The grammar state of one generation (see the module docs).
pub struct Constraint {
    inner: Mutex<State>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

impl Constraint {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // a panic elsewhere while holding it leaves the state as consistent as before
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Set every entry of `row` whose token the grammar forbids after the committed tokens
    /// and `extra` to -inf. `index` maps a target token to its place in `row` (None: `row` is
    /// indexed by target token id), as in [`crate::sampling::Sampler::adjusted`]. When
    /// `extra` itself leaves the grammar (a draft proposal the target rejects before this
    /// row, so the row is never used) the row is left as it is.
    pub fn mask_row(
        &self,
        row: &mut [f32],
        extra: &[u32],
        index: Option<&dyn Fn(u32) -> Option<usize>>,
    ) {
        let mut s = self.state();
        if !s.seek(extra) {
            return;
        }
        let Some(mask) = s.mask_here() else { return };
        match index {
            None => {
                for (t, l) in row.iter_mut().enumerate() {
                    if !mask.is_allowed(t as u32) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            Some(index) => {
                let mut keep = vec![false; row.len()];
                mask.iter_set_entries(|t| {
                    if let Some(k) = index(t as u32).and_then(|i| keep.get_mut(i)) {
                        *k = true;
                    }
                });
                for (l, k) in row.iter_mut().zip(keep) {
                    if !k {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// The output grew by `tokens` (accepted proposals and the bonus, or a plain step).
    pub fn commit(&self, tokens: &[u32]) {
        let mut s = self.state();
        let common = s
            .spec
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count();
        // a prefix of the speculative tokens: nothing to undo (the rest stays speculative)
        if common < tokens.len() {
            s.keep(common);
            for &t in &tokens[common..] {
                if !s.advance(t) {
                    let why = format!("token {t} is not allowed here");
                    s.fail("committing the output", why);
                    return;
                }
            }
        }
        // the committed tokens leave the speculative list; their masks go with them
        let n = tokens.len();
        s.spec.drain(..n);
        s.after_stop = s.after_stop.min(s.spec.len());
        let m = n.min(s.masks.len());
        s.masks.drain(..m);
    }

    /// An internal llguidance failure, if one happened (the generation must stop with it).
    pub fn error(&self) -> Option<String> {
        self.state().error.clone()
    }

    /// Time spent computing masks, and how many.
    pub fn mask_cost(&self) -> (Duration, usize) {
        let s = self.state();
        (s.mask_time, s.masks_computed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::byte_tokenizer;

    const EOS: u32 = 255;

    fn compiler(words: &[&str]) -> GrammarCompiler {
        GrammarCompiler::new(&byte_tokenizer(words), 256 + words.len(), &[EOS]).unwrap()
    }

    /// The tokens the constraint allows after the committed ones and `extra`.
    fn allowed(c: &Constraint, vocab: usize, extra: &[u32]) -> Vec<u32> {
        let mut row = vec![0.0f32; vocab];
        c.mask_row(&mut row, extra, None);
        (0..vocab as u32)
            .filter(|&t| row[t as usize] == 0.0)
            .collect()
    }

    /// JSON compiles without free whitespace (no newline or space may follow `{`) unless the
    /// schema's own `x-guidance` asks for it.
    #[test]
    fn json_has_no_free_whitespace_unless_the_schema_asks() {
        let (open, nl, sp, quote) = (b'{' as u32, b'\n' as u32, b' ' as u32, b'"' as u32);
        let after_open = |spec: GrammarSpec| {
            let c = compiler(&[]).compile(&spec).unwrap().start().unwrap();
            allowed(&c, 256, &[open])
        };
        for spec in [
            GrammarSpec::JsonObject,
            GrammarSpec::JsonSchema(serde_json::json!({
                "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]
            })),
        ] {
            let a = after_open(spec);
            assert!(
                a.contains(&quote) && !a.contains(&nl) && !a.contains(&sp),
                "{a:?}"
            );
        }
        let a = after_open(GrammarSpec::JsonSchema(serde_json::json!({
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "x-guidance": {"whitespace_flexible": true}
        })));
        assert!(
            a.contains(&quote) && a.contains(&nl) && a.contains(&sp),
            "{a:?}"
        );
    }

    #[test]
    fn masks_follow_speculation_rollback_and_commit() {
        let g = compiler(&["ab"])
            .compile(&GrammarSpec::Regex("ab|cd".into()))
            .unwrap();
        let c = g.start().unwrap();
        let (a, b, cc, d, ab) = (b'a' as u32, b'b' as u32, b'c' as u32, b'd' as u32, 256);
        assert_eq!(allowed(&c, 257, &[]), vec![a, cc, ab]);
        assert_eq!(allowed(&c, 257, &[a]), vec![b]);
        // another proposal at the same place: rolled back, then advanced along it
        assert_eq!(allowed(&c, 257, &[cc]), vec![d]);
        // complete: only the end of output
        assert_eq!(allowed(&c, 257, &[cc, d]), vec![EOS]);
        assert_eq!(allowed(&c, 257, &[ab]), vec![EOS]);
        // a proposal the grammar forbids leaves later rows as they are
        assert_eq!(allowed(&c, 257, &[b]).len(), 257);
        // commit a prefix of the speculation, then the rest and the end of output
        c.commit(&[a]);
        assert_eq!(allowed(&c, 257, &[]), vec![b]);
        c.commit(&[b]);
        assert_eq!(allowed(&c, 257, &[]), vec![EOS]);
        c.commit(&[EOS]);
        assert!(c.error().is_none(), "{:?}", c.error());
        let (_, n) = c.mask_cost();
        assert!(n >= 6, "masks computed: {n}");
    }

    #[test]
    fn a_forbidden_commit_is_an_error_not_a_silent_pass() {
        let g = compiler(&[])
            .compile(&GrammarSpec::Choice(vec!["yes".into(), "no".into()]))
            .unwrap();
        let c = g.start().unwrap();
        c.commit(&[b'y' as u32, b'e' as u32]);
        assert!(c.error().is_none());
        c.commit(&[b'x' as u32]);
        let e = c.error().expect("x after `ye` is not allowed");
        assert!(e.contains("not allowed"), "{e}");
    }

    #[test]
    fn mapped_rows_are_masked_through_the_index() {
        // a narrow head: row position i holds target token 255 - i (a reversed map)
        let g = compiler(&[])
            .compile(&GrammarSpec::Regex("[0-9]+".into()))
            .unwrap();
        let c = g.start().unwrap();
        let mut row = vec![0.0f32; 256];
        c.mask_row(
            &mut row,
            &[],
            Some(&|t: u32| (t < 256).then(|| 255 - t as usize)),
        );
        let kept: Vec<usize> = (0..256)
            .filter(|&i| row[i] == 0.0)
            .map(|i| 255 - i)
            .collect();
        let want: Vec<usize> = (b'0'..=b'9').rev().map(|b| b as usize).collect();
        assert_eq!(kept, want);
    }

    #[test]
    fn bad_grammars_are_errors_naming_the_kind() {
        let c = compiler(&[]);
        let e = c
            .compile(&GrammarSpec::Regex("(unclosed".into()))
            .unwrap_err();
        assert!(e.to_string().contains("regex"), "{e}");
        let e = c
            .compile(&GrammarSpec::JsonSchema(
                serde_json::json!({"type": "no-such-type"}),
            ))
            .unwrap_err();
        assert!(e.to_string().contains("json_schema"), "{e}");
        let e = c
            .compile(&GrammarSpec::Lark("start: ???".into()))
            .unwrap_err();
        assert!(e.to_string().contains("lark"), "{e}");
    }

    #[test]
    fn the_sampler_draws_only_what_the_grammar_allows() {
        use crate::sampling::{Sampler, SamplingParams};
        let g = compiler(&[])
            .compile(&GrammarSpec::JsonSchema(serde_json::json!({
                "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}
            })))
            .unwrap();
        let params = SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(params).with_constraint(g.start().unwrap());
        assert!(s.adjusts());
        let mut out = Vec::new();
        for _ in 0..40 {
            let mut row = vec![0.0f32; 256];
            let t = s.sample_after(&mut row, &[]);
            s.commit(&[t]);
            if t == EOS {
                break;
            }
            out.push(t as u8);
        }
        let text = String::from_utf8(out).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
        assert!(v["n"].is_i64(), "{text}");
        assert!(s.constraint().unwrap().error().is_none());
    }
}
