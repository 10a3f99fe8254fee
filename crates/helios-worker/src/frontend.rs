//! The native frontend instances built once at startup from the core's assets.

use std::sync::Arc;

use helios_contract::model::Manifest;
use helios_contract::{ReasoningParser, RuntimeCore, SamplingDefaults, ToolParser};
use helios_frontend::{
    ChatTemplate, GrammarEnv, GrammarError, TemplateConfig, TemplateError, Tokenizer, TokenizerError,
};

/// Startup failures; a failed startup binds no socket.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot read frontend asset {path}: {source}")]
    Asset { path: String, source: std::io::Error },
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("chat template: {0}")]
    Template(#[from] TemplateError),
    #[error("grammar environment: {0}")]
    Grammar(#[from] GrammarError),
    #[error("scheduler: {0}")]
    Scheduler(#[from] helios_scheduler::ConfigError),
    #[error("executor: {0}")]
    Executor(String),
    #[error("option {name}: {reason}")]
    Option { name: &'static str, reason: String },
    #[error("cannot start the model thread: {0}")]
    Thread(std::io::Error),
}

/// Tokenizer, template, grammar environment and typed defaults of one core.
pub struct Frontend {
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub grammar: GrammarEnv,
    pub eos_token_ids: Vec<u32>,
    pub sampling: SamplingDefaults,
    pub reasoning_parser: ReasoningParser,
    pub tool_parser: ToolParser,
    pub model_name: String,
    pub vocab_size: u32,
    pub context_limit: u32,
    /// Most output tokens one request may ask for (requests asking more are clamped to it);
    /// `sampling.max_output_tokens` is the default when a request does not say. Stated in the
    /// startup log and `/v1/models`.
    pub max_output_tokens: u32,
}

impl std::fmt::Debug for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frontend").field("model_name", &self.model_name).finish_non_exhaustive()
    }
}

impl Frontend {
    /// Loads the core's tokenizer and template (digests were verified by the loader);
    /// `chat_template` overrides the core's template source.
    pub fn load(core: &RuntimeCore, chat_template: Option<String>) -> Result<Self, StartError> {
        let m = core.manifest();
        let read = |rel: &str| {
            std::fs::read(core.asset_path(rel)).map_err(|source| StartError::Asset { path: rel.to_owned(), source })
        };
        let tokenizer = Tokenizer::from_bytes(&read(&m.frontend.tokenizer.path)?)?;
        let template = match chat_template {
            Some(t) => t,
            None => String::from_utf8_lossy(&read(&m.frontend.chat_template.path)?).into_owned(),
        };
        Self::from_parts(m, tokenizer, &template)
    }

    /// Builds the frontend from already-loaded parts.
    pub fn from_parts(m: &Manifest, tokenizer: Tokenizer, template: &str) -> Result<Self, StartError> {
        let tokenizer = Arc::new(tokenizer);
        let template =
            ChatTemplate::new(&TemplateConfig { chat_template: template.to_owned(), special_tokens: vec![] })?;
        let grammar = GrammarEnv::new(tokenizer.clone(), &m.frontend.eos_token_ids)?;
        Ok(Frontend {
            tokenizer,
            template,
            grammar,
            eos_token_ids: m.frontend.eos_token_ids.clone(),
            sampling: m.frontend.sampling,
            reasoning_parser: m.frontend.reasoning_parser,
            tool_parser: m.frontend.tool_parser,
            model_name: m.frontend.served_model_name.clone(),
            vocab_size: m.capacities.vocab_size,
            context_limit: m.capacities.context_limit,
            max_output_tokens: m.capacities.context_limit,
        })
    }
}
