//! The flags every command that loads a model shares, declared once (`#[command(flatten)]`).

use anyhow::Result;
use clap::Args;
use dflash::pipeline::PipelineOptions;

/// How a model is loaded: device, dtype, quantized weights, memory checks.
#[derive(Args, Debug, Clone, Default)]
pub struct LoadFlags {
    /// f32 | bf16 | f16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long)]
    pub dtype: Option<String>,
    /// cpu | cuda | cuda:N.
    #[arg(long)]
    pub device: Option<String>,
    /// Weights as stored: GGUF quantized weights keep their stored type (no requantization to
    /// a type with a fast multi-row kernel, no dequantization on CUDA), and a float draft stays
    /// float on the CPU (by default its linears run at Q8_0 there).
    #[arg(long)]
    pub keep_quant: bool,
    /// Load even when the weights + KV cache for the context do not fit in the memory
    /// available (RAM on the CPU, free device memory on CUDA).
    #[arg(long)]
    pub force_memory: bool,
    /// Memory to plan with instead of what the machine reports, e.g. 8G or 512M.
    #[arg(long)]
    pub memory_limit: Option<String>,
    /// Split the target's attention heads and MLP units over N ranks (CPU threads for now;
    /// GPUs over NCCL are not built yet).
    #[arg(long = "tensor-parallel", visible_alias = "tp", default_value_t = 1)]
    pub tensor_parallel: usize,
}

impl LoadFlags {
    /// These flags on top of `o`.
    pub fn apply(&self, o: PipelineOptions) -> Result<PipelineOptions> {
        Ok(PipelineOptions {
            dtype: self.dtype.clone(),
            device: self.device.clone(),
            keep_quant: self.keep_quant,
            force_memory: self.force_memory,
            tensor_parallel: self.tensor_parallel,
            memory_limit: self
                .memory_limit
                .as_deref()
                .map(dflash::memory::parse_bytes)
                .transpose()?,
            ..o
        })
    }
}

/// Which target and draft to load, and how.
#[derive(Args, Debug, Clone, Default)]
pub struct ModelFlags {
    /// Target model: a local directory (HF layout), a .gguf file, or a hub repo id (Org/Name).
    /// Default: the demo model, SmolLM2-135M-Instruct (GGUF, fetched on first use).
    #[arg(long)]
    pub model: Option<String>,
    /// DFlash draft: a local directory or a hub repo id. Without it: the registry's draft for
    /// the target, else plain decoding.
    #[arg(long)]
    pub draft: Option<String>,
    /// Do not look up a draft in the registry (plain decoding unless --draft is given).
    #[arg(long, conflicts_with = "draft")]
    pub no_draft: bool,
    /// Fail instead of decoding plainly when no draft is given or registered.
    #[arg(long)]
    pub require_draft: bool,
    #[command(flatten)]
    pub load: LoadFlags,
}

impl ModelFlags {
    /// The pipeline these flags ask for (the demo model when no --model is given).
    pub fn pipeline(&self, max_context: Option<usize>) -> Result<PipelineOptions> {
        let model = dflash::pipeline::resolve_model_spec(self.model.as_deref())?;
        self.load.apply(PipelineOptions {
            model,
            draft: self.draft.clone(),
            max_context,
            no_draft: self.no_draft,
            require_draft: self.require_draft,
            ..Default::default()
        })
    }
}

/// Structured output: the generated text constrained to a grammar (at most one of these).
#[derive(Args, Debug, Clone, Default)]
pub struct GrammarFlags {
    /// Constrain the output to this JSON schema (a file, or the schema's JSON text).
    #[arg(long, value_name = "FILE|JSON", group = "constraint")]
    pub json_schema: Option<String>,
    /// Constrain the output to a JSON object (any keys).
    #[arg(long, group = "constraint")]
    pub json_object: bool,
    /// Constrain the output to match this regular expression.
    #[arg(long, value_name = "REGEX", group = "constraint")]
    pub regex: Option<String>,
    /// Constrain the output to this Lark grammar (llguidance's dialect; a file).
    #[arg(long, value_name = "FILE", group = "constraint")]
    pub grammar: Option<String>,
}

impl GrammarFlags {
    /// The grammar asked for, if any (a file that cannot be read, or a schema that is not
    /// JSON, is an error naming the flag).
    pub fn spec(&self) -> Result<Option<dflash::grammar::GrammarSpec>> {
        use dflash::grammar::GrammarSpec;
        let read = |flag: &str, v: &str| -> Result<String> {
            std::fs::read_to_string(v).map_err(|e| anyhow::anyhow!("--{flag} {v}: {e}"))
        };
        Ok(if let Some(s) = &self.json_schema {
            let text = if s.trim_start().starts_with('{') {
                s.clone()
            } else {
                read("json-schema", s)?
            };
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| anyhow::anyhow!("--json-schema {s}: not JSON: {e}"))?;
            Some(GrammarSpec::JsonSchema(v))
        } else if self.json_object {
            Some(GrammarSpec::JsonObject)
        } else if let Some(r) = &self.regex {
            Some(GrammarSpec::Regex(r.clone()))
        } else if let Some(g) = &self.grammar {
            Some(GrammarSpec::Lark(read("grammar", g)?))
        } else {
            None
        })
    }
}
