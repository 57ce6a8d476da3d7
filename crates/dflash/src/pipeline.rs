//! One call from user-facing names (`--model`, `--draft`, `--dtype`, `--device`) to a ready
//! engine with its tokenizer, chat template and stop tokens. The CLI and the server use this.

use crate::archs::{load_target, LoadOptions};
use crate::bench::prompts::Prompt;
use crate::chat::{ChatMessage, ChatTemplate};
use crate::config::TargetConfig;
use crate::draft::load_draft;
use crate::engine::Engine;
use crate::source::ModelSource;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use candle_core::{DType, Device};

#[derive(Debug, Clone, Default)]
pub struct PipelineOptions {
    /// Target: a local directory or a hub repo id.
    pub model: String,
    /// Draft: a local directory or a hub repo id.
    pub draft: Option<String>,
    /// `f32`, `bf16`, `f16`; None = f32 on CPU, bf16 on CUDA.
    pub dtype: Option<String>,
    /// `cpu`, `cuda`, `cuda:N`; None = cpu.
    pub device: Option<String>,
    /// Largest context; None = the model's max_position_embeddings.
    pub max_context: Option<usize>,
    /// Do not look a draft up in the registry when `draft` is None.
    pub no_draft: bool,
    /// Fail when no draft is given or registered.
    pub require_draft: bool,
    /// GGUF: keep every quantized matrix in its stored type (no requantization at load).
    pub keep_quant: bool,
    /// Load even when the weights + KV cache do not fit in the memory available.
    pub force_memory: bool,
    /// Bytes to treat as available instead of what the machine reports (tests; leaving
    /// room for other processes).
    pub memory_limit: Option<u64>,
    /// Tensor-parallel ranks for the target (0 or 1: none; `archs::parallel`).
    pub tensor_parallel: usize,
}

/// The model to load: the user's `--model`, or the demo default (SmolLM2-135M-Instruct GGUF,
/// fetched into the user cache on first use) when none is given.
pub fn resolve_model_spec(model: Option<&str>) -> Result<String> {
    match model {
        Some(m) => Ok(m.to_string()),
        None => {
            let p = crate::source::demo_model_path()?;
            Ok(p.display().to_string())
        }
    }
}

/// The demo model's own DFlash draft, trained with `dflash train` (docs/training.md) and kept
/// in the repository (`models/smollm2-135m-dflash`, 4 layers, 21.9 MB at 8 bits with its narrow
/// head over 8,192 tokens, `draft::narrow`).
pub fn demo_draft_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/smollm2-135m-dflash")
}

/// Whether `model` is the demo GGUF (by file name: the draft was trained on exactly it).
fn is_demo_model(model: &str) -> bool {
    std::path::Path::new(model)
        .file_name()
        .is_some_and(|f| f == crate::source::demo::SMOLLM2_135M.file_name)
}

/// A loaded target (+ draft) and everything needed to turn text into ids and back.
pub struct Pipeline {
    pub engine: Engine,
    pub target_config: TargetConfig,
    pub tokenizer: Option<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub stop_ids: Vec<u32>,
    pub model_name: String,
    pub draft_name: Option<String>,
    pub dtype: DType,
    pub device: Device,
    /// One-line notices for the user (e.g. which draft the registry chose, or none).
    pub notices: Vec<String>,
    /// Bytes the memory check found free for caches once the weights are loaded (None: not
    /// checked); the server admits requests by it.
    pub cache_room: Option<u64>,
    /// Structured output's view of the vocabulary, built at the first grammar.
    grammar: std::sync::OnceLock<crate::grammar::GrammarCompiler>,
}

pub fn parse_device(s: Option<&str>) -> Result<Device> {
    match s.unwrap_or("cpu") {
        "cpu" => Ok(Device::Cpu),
        d if d == "cuda" || d.starts_with("cuda:") => {
            let n: usize = match d.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map_err(|_| Error::input(format!("--device {d}: expected cuda:N")))?,
                None => 0,
            };
            #[cfg(feature = "cuda")]
            let dev = crate::nn::cuda::open_device(n);
            #[cfg(not(feature = "cuda"))]
            let dev = Device::new_cuda(n);
            dev.map_err(|e| {
                Error::input(format!(
                    "--device {d}: {e}; build with `--features cuda` on a machine with an NVIDIA GPU, or use --device cpu"
                ))
            })
        }
        other => Err(Error::input(format!(
            "--device {other}: expected cpu, cuda or cuda:N"
        ))),
    }
}

pub fn parse_dtype(s: Option<&str>, device: &Device) -> Result<DType> {
    match s {
        None => Ok(if device.is_cpu() {
            DType::F32
        } else {
            DType::BF16
        }),
        Some("f32" | "float32") => Ok(DType::F32),
        Some("bf16" | "bfloat16") => Ok(DType::BF16),
        Some("f16" | "float16") => Ok(DType::F16),
        Some(o) => Err(Error::input(format!(
            "--dtype {o}: expected f32, bf16 or f16"
        ))),
    }
}

/// The memory check of [`Pipeline::load`]: the context to load with (None = the model's)
/// after comparing weights + KV cache with the memory available, and the bytes left for caches
/// after the weights (None: not checked); see [`crate::memory`].
fn plan_memory(
    opts: &PipelineOptions,
    src: &ModelSource,
    dsrc: Option<&ModelSource>,
    dtype: DType,
    device: &Device,
    notices: &mut Vec<String>,
) -> Result<(Option<usize>, Option<u64>)> {
    use crate::memory::{self, Available, Need};
    let tcfg = src.target_config()?;
    if let Some(m) = opts.max_context {
        if m == 0 || m > tcfg.max_position_embeddings {
            return Err(Error::input(format!(
                "--max-context {m}: must be between 1 and the model's max_position_embeddings ({})",
                tcfg.max_position_embeddings
            )));
        }
    }
    if opts.force_memory {
        return Ok((opts.max_context, None));
    }
    let avail = match opts.memory_limit {
        Some(b) => Available {
            bytes: b,
            source: "--memory-limit".into(),
        },
        None => match memory::available(device) {
            Some(a) => a,
            None => {
                notices.push(format!(
                    "memory not checked: this build cannot tell how much memory device {} has free",
                    opts.device.as_deref().unwrap_or("cpu")
                ));
                return Ok((opts.max_context, None));
            }
        },
    };
    let (kv_per_token, fixed) = memory::target_cache_bytes(&tcfg, dtype)?;
    let mut need = Need {
        weights: memory::weight_bytes(src, dtype, device, opts.keep_quant)?,
        fixed,
        kv_per_token,
    };
    let tp = opts.tensor_parallel.max(1) as u64;
    if tp > 1 {
        // ranks on one host: each holds the embedding and the LM head whole, and its share
        // of the rest (the KV cache splits with the heads)
        let (v, h) = (tcfg.vocab_size as u64, tcfg.hidden_size as u64);
        let tables = if tcfg.tie_word_embeddings { 1 } else { 2 };
        let whole = (v * h * tables * dtype.size_in_bytes() as u64).min(need.weights);
        need.weights += (tp - 1) * whole;
        notices.push(format!(
            "tensor parallel {tp} on one host: memory planned for the model plus {} more copies of its embedding and LM head ({} each), which every rank holds whole",
            tp - 1,
            memory::human(whole)
        ));
    }
    if let Some(d) = dsrc {
        let dcfg = crate::config::draft::DraftConfig::from_file(&d.config)?;
        need.weights += memory::weight_bytes(d, dtype, device, opts.keep_quant)?;
        need.kv_per_token += memory::kv_bytes_per_token(&dcfg.layers, dtype);
    }
    let (ctx, note) = memory::plan_context(
        &opts.model,
        need,
        &avail,
        opts.max_context,
        tcfg.max_position_embeddings,
        dtype,
    )?;
    notices.extend(note.clone());
    let room = avail.bytes.saturating_sub(need.weights);
    Ok((
        if opts.max_context.is_some() || note.is_some() {
            Some(ctx)
        } else {
            None
        },
        Some(room),
    ))
}

impl Pipeline {
    pub fn load(opts: &PipelineOptions) -> Result<Self> {
        let device = parse_device(opts.device.as_deref())?;
        let dtype = parse_dtype(opts.dtype.as_deref(), &device)?;
        let lo = LoadOptions {
            dtype,
            device: device.clone(),
            keep_quant: opts.keep_quant,
            tensor_parallel: opts.tensor_parallel.max(1),
        };
        let src = ModelSource::resolve(&opts.model)?;
        let mut notices = vec![];
        let draft_name = match (&opts.draft, opts.no_draft) {
            (Some(d), _) => Some(d.clone()),
            (None, true) => None,
            (None, false) if is_demo_model(&opts.model) && demo_draft_dir().is_dir() => {
                let d = demo_draft_dir();
                notices.push(format!(
                    "draft: {} (trained for the demo model with `dflash train`, docs/training.md; --draft overrides, --no-draft disables)",
                    d.display()
                ));
                Some(d.display().to_string())
            }
            (None, false) => match crate::registry::resolve_draft(&opts.model) {
                Some(e) => {
                    notices.push(format!("draft: {} (registry row {}; --draft overrides, --no-draft disables)", e.draft, e.target));
                    Some(e.draft.to_string())
                }
                None if opts.require_draft => {
                    return Err(Error::input(format!(
                        "no DFlash draft registered for `{}` (--require-draft); pass --draft, or use one of: {}",
                        opts.model,
                        crate::registry::registry_targets()
                    )))
                }
                None => {
                    notices.push(format!("no DFlash draft registered for `{}`: plain decoding (pass --draft to speculate)", opts.model));
                    None
                }
            },
        };
        let dsrc = match &draft_name {
            Some(d) => Some(ModelSource::resolve(d).map_err(|e| match e {
                Error::Hub { repo, cause, hint } if opts.draft.is_none() => Error::Hub {
                    repo,
                    cause,
                    hint: format!("{hint}; or pass --draft DIR, or --no-draft for plain decoding"),
                },
                e => e,
            })?),
            None => None,
        };
        // Refuse (or fit the context) before reading any weights.
        let (max_context, cache_room) =
            plan_memory(opts, &src, dsrc.as_ref(), dtype, &device, &mut notices)?;
        let (target_config, target) = load_target(&src, &lo)?;
        let draft = match &dsrc {
            Some(d) => Some(load_draft(d, &target_config, &opts.model, &lo)?),
            None => None,
        };
        if let Some(k) = draft.as_ref().and_then(|d| d.draft_vocab()) {
            notices.push(format!(
                "draft proposes from {k} of the target's {} tokens (a head of its own; the output is still the target's)",
                target_config.vocab_size
            ));
        }
        let assets = src.chat_assets(&target_config)?;
        notices.extend(assets.notices);
        let (tokenizer, template, mut stop_ids) =
            (assets.tokenizer, assets.template, assets.stop_ids);
        if let Some(q) = &target.info().quantization {
            notices.push(format!("weights: {q}"));
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let mut engine = Engine::new(target, draft);
        if let Some(m) = max_context {
            engine.max_context = m;
        }
        Ok(Pipeline {
            engine,
            target_config,
            tokenizer,
            template,
            stop_ids,
            model_name: opts.model.clone(),
            draft_name,
            dtype,
            device,
            notices,
            cache_room,
            grammar: Default::default(),
        })
    }

    /// Compile a structured-output grammar for this model (its vocabulary read once, at the
    /// first call; the output may end with any of its stop tokens once the grammar is done).
    pub fn compile_grammar(
        &self,
        spec: &crate::grammar::GrammarSpec,
    ) -> Result<crate::grammar::Grammar> {
        if self.grammar.get().is_none() {
            let tok = self.tokenizer.as_ref().ok_or_else(|| {
                Error::input("structured output needs the model's tokenizer (none was found)")
            })?;
            let c = crate::grammar::GrammarCompiler::new(
                tok,
                self.engine.target.info().vocab_size,
                &self.stop_ids,
            )?;
            let _ = self.grammar.set(c);
        }
        self.grammar.get().expect("set above").compile(spec)
    }

    /// A prompt record's ids: its `prompt_ids` as given, else its chat
    /// ([`Prompt::messages`]) through [`Pipeline::encode_prompt`]; None when it has neither.
    pub fn prompt_record_ids(
        &self,
        prompt: &Prompt,
        use_template: bool,
        enable_thinking: Option<bool>,
    ) -> Result<Option<Vec<u32>>> {
        match (&prompt.prompt_ids, prompt.messages()) {
            (Some(ids), _) => Ok(Some(ids.clone())),
            (None, Some(chat)) => self
                .encode_prompt(&chat, use_template, enable_thinking)
                .map(Some),
            (None, None) => Ok(None),
        }
    }

    /// Prompt ids for a chat (rendered with the chat template) or raw text.
    pub fn encode_prompt(
        &self,
        messages: &[ChatMessage],
        use_template: bool,
        enable_thinking: Option<bool>,
    ) -> Result<Vec<u32>> {
        let tok = self.tokenizer.as_ref().ok_or_else(|| {
            Error::input(format!(
                "model {} has no tokenizer.json: pass token ids (--prompt-ids)",
                self.model_name
            ))
        })?;
        if use_template {
            if let Some(t) = &self.template {
                let text = t.render(messages, true, enable_thinking, &Default::default())?;
                // The template already wrote BOS where the model wants it.
                return tok.encode(&text, false);
            }
        }
        let text: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
        tok.encode(&text.join("\n"), true)
    }
}
