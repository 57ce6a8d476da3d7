//! `dflash generate`: stream a completion to stdout, stats to stderr (or one JSON object).

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash::chat::ChatMessage;
use dflash::engine::{Flow, GenerateRequest};
use dflash::pipeline::Pipeline;
use dflash::sampling::SamplingParams;
use dflash::tokenizer::TextStream;
use std::io::Write;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub m: crate::flags::ModelFlags,
    /// Verify block size (default: the draft's); 1 = plain decoding through the same engine.
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Adaptive block size (on: choose the verify size per cycle from measured costs and
    /// acceptance; never slower than plain decoding by design). A given --block-size pins it.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub adaptive: String,
    /// The user message (or raw text with --no-chat-template).
    #[arg(long)]
    pub prompt: Option<String>,
    /// A system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Feed the prompt text as is, without the model's chat template.
    #[arg(long)]
    pub no_chat_template: bool,
    /// Render the chat template with enable_thinking=true (default false).
    #[arg(long)]
    pub enable_thinking: bool,
    /// Prompt token ids, comma-separated (for models without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Subtracted from the logit of every token generated so far (OpenAI's; in [-2, 2]).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub presence_penalty: f32,
    /// Times each token's count so far (OpenAI's; in [-2, 2]).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub frequency_penalty: f32,
    /// HF / vLLM: divides positive (multiplies negative) logits of prompt and output tokens;
    /// 1 = off.
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Additional stop token ids.
    #[arg(long, value_delimiter = ',')]
    pub stop_ids: Option<Vec<u32>>,
    /// Do not stop at the model's end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object (output_ids, text, stats) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// With --json: include each verify cycle's block ids and acceptance.
    #[arg(long)]
    pub trace: bool,
    /// After the DFlash generation, generate the same request with plain decoding through the
    /// same engine and print the decode speedup (at T = 0 the outputs must be identical: a
    /// difference is an error).
    #[arg(long)]
    pub compare: bool,
    #[command(flatten)]
    pub grammar: crate::flags::GrammarFlags,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    if a.prompt.is_none() && a.prompt_ids.is_none() {
        bail!("give a prompt: --prompt TEXT or --prompt-ids 1,2,3");
    }
    if a.prompt.is_some() && a.prompt_ids.is_some() {
        bail!("give either --prompt or --prompt-ids, not both");
    }
    if a.trace && !a.json {
        bail!("--trace needs --json");
    }
    let p = Pipeline::load(&a.m.pipeline(None)?)?;
    for n in &p.notices {
        eprintln!("note: {n}");
    }
    let prompt_ids = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => {
            let mut msgs = vec![];
            if let Some(s) = &a.system {
                msgs.push(ChatMessage::system(s.clone()));
            }
            msgs.push(ChatMessage::user(text.clone()));
            p.encode_prompt(&msgs, !a.no_chat_template, Some(a.enable_thinking))?
        }
        _ => unreachable!(),
    };
    let mut stop_ids = if a.ignore_eos {
        vec![]
    } else {
        p.stop_ids.clone()
    };
    stop_ids.extend(a.stop_ids.clone().unwrap_or_default());
    let req = GenerateRequest {
        prompt_ids: prompt_ids.clone(),
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            seed: a.seed,
            presence_penalty: a.presence_penalty,
            frequency_penalty: a.frequency_penalty,
            repetition_penalty: a.repetition_penalty,
            ..Default::default()
        },
        stop_ids,
        block_size: a.block_size,
        adaptive: a.adaptive == "on",
        trace: a.trace,
        grammar: a
            .grammar
            .spec()?
            .map(|g| p.compile_grammar(&g))
            .transpose()?,
    };
    if p.engine.draft.is_none() && a.block_size.is_some_and(|b| b > 1) {
        eprintln!("note: --block-size without --draft: plain decoding");
    }
    if a.compare && (p.engine.draft.is_none() || a.block_size == Some(1)) {
        bail!("--compare needs DFlash to compare: give a --draft (or a model the registry has one for) and a --block-size above 1");
    }
    let mut stream = p
        .tokenizer
        .as_ref()
        .map(|t| TextStream::with_prompt(t, &prompt_ids, true));
    let mut stdout = std::io::stdout().lock();
    let mut stream_err: Option<anyhow::Error> = None;
    let out = p.engine.generate(&req, &mut |ids| {
        if !a.json {
            if let Some(s) = stream.as_mut() {
                match s.push_all(ids) {
                    Ok(text) => {
                        let _ = stdout.write_all(text.as_bytes());
                        let _ = stdout.flush();
                    }
                    Err(e) => {
                        stream_err = Some(e.into());
                        return Flow::Stop;
                    }
                }
            } else {
                let s: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
                let _ = write!(stdout, "{} ", s.join(" "));
                let _ = stdout.flush();
            }
        }
        Flow::Continue
    })?;
    if let Some(e) = stream_err {
        return Err(e).context("decoding the generated tokens");
    }
    // the plain run second, so that any first-run warm-up is DFlash's (the speedup errs low)
    let compare = match a.compare {
        true => {
            let plain_req = GenerateRequest {
                block_size: Some(1),
                adaptive: false,
                trace: false,
                ..req.clone()
            };
            let plain = p.engine.generate(&plain_req, &mut |_| Flow::Continue)?;
            Some(Comparison::of(&out, &plain, a.temperature == 0.0)?)
        }
        false => None,
    };
    if a.json {
        let mut v = serde_json::to_value(&out)?;
        if let Some(t) = &p.tokenizer {
            v["text"] = t.decode(&out.output_ids, true)?.into();
        }
        v["prompt_tokens"] = prompt_ids.len().into();
        v["model"] = p.model_name.clone().into();
        if let Some(d) = &p.draft_name {
            v["draft"] = d.clone().into();
        }
        if let Some(c) = &compare {
            v["compare"] = c.json();
        }
        writeln!(stdout, "{}", serde_json::to_string(&v)?)?;
    } else {
        if let Some(s) = stream.as_mut() {
            let _ = stdout.write_all(s.flush()?.as_bytes());
        }
        writeln!(stdout)?;
        eprintln!("{}", out.stats.line());
        if let Some(c) = &compare {
            eprintln!("{}", c.line());
        }
    }
    Ok(())
}

/// `--compare`: the DFlash generation against plain decoding of the same request.
struct Comparison {
    plain_decode_tok_s: f64,
    dflash_decode_tok_s: f64,
    /// dflash / plain decode tok/s
    speedup: f64,
    /// Some(true) at T = 0 (checked equal); None when sampled (exact in distribution only)
    identical: Option<bool>,
    tokens: usize,
}

impl Comparison {
    fn of(
        dflash: &dflash::engine::GenerateOutput,
        plain: &dflash::engine::GenerateOutput,
        greedy: bool,
    ) -> Result<Self> {
        if greedy && dflash.output_ids != plain.output_ids {
            let at = dflash
                .output_ids
                .iter()
                .zip(&plain.output_ids)
                .position(|(a, b)| a != b)
                .unwrap_or(dflash.output_ids.len().min(plain.output_ids.len()));
            bail!(
                "--compare: the DFlash output differs from plain decoding at token {at} ({} vs {} tokens): a bug; please report it with this command line",
                dflash.output_ids.len(),
                plain.output_ids.len()
            );
        }
        let (d, pl) = (dflash.stats.decode_tok_s, plain.stats.decode_tok_s);
        Ok(Self {
            plain_decode_tok_s: pl,
            dflash_decode_tok_s: d,
            speedup: if pl > 0.0 { d / pl } else { 0.0 },
            identical: greedy.then_some(true),
            tokens: dflash.output_ids.len(),
        })
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "plain_decode_tok_s": self.plain_decode_tok_s,
            "dflash_decode_tok_s": self.dflash_decode_tok_s,
            "speedup": self.speedup,
            "identical": self.identical,
            "tokens": self.tokens,
        })
    }

    fn line(&self) -> String {
        format!(
            "[compare] plain decoding {:.2} tok/s, DFlash {:.2} tok/s: {:.2}x; {}",
            self.plain_decode_tok_s,
            self.dflash_decode_tok_s,
            self.speedup,
            match self.identical {
                Some(_) => format!("output identical ({} tokens)", self.tokens),
                None => "sampled (T > 0): exact in distribution, outputs not compared".into(),
            }
        )
    }
}
