//! Typed errors. External libraries' messages are carried as detail text only.

use thiserror::Error;

/// Loading or running the tokenizer failed.
#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("cannot read tokenizer file: {0}")]
    Io(#[from] std::io::Error),
    #[error("invalid tokenizer.json: {0}")]
    Load(String),
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("decoding failed: {0}")]
    Decode(String),
    #[error("token id {0} is outside the vocabulary")]
    UnknownToken(u32),
}

/// Chat template compilation or rendering failed.
#[derive(Debug, Error)]
pub enum TemplateError {
    #[error("template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`.
    #[error("template raised: {0}")]
    Raised(String),
    #[error("template rendering failed: {0}")]
    Render(String),
    #[error("continue_final_message needs a non-empty conversation whose final message has text content")]
    NothingToContinue,
    #[error("the final message does not appear in the rendered prompt, so it cannot be continued")]
    ContinuationLost,
    #[error("add_generation_prompt and continue_final_message are mutually exclusive")]
    ContinueWithGenerationPrompt,
    #[error("invalid tokenizer_config.json: {0}")]
    Config(String),
    /// The render was cancelled (its client left, or the server is shutting down).
    #[error("rendering was cancelled")]
    Cancelled,
    /// The rendered prompt passed the longest text that can fit the context.
    #[error("the rendered prompt exceeds {max_bytes} bytes, more than the context can hold")]
    TooLong { max_bytes: usize },
}

/// Model output did not follow the selected protocol.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum OutputError {
    #[error("tool call {index} is not valid JSON: {detail}")]
    InvalidToolJson { index: usize, detail: String },
    #[error("tool call {index} lacks a string \"name\"")]
    MissingToolName { index: usize },
    #[error("tool call {index} is malformed: {detail}")]
    MalformedToolCall { index: usize, detail: String },
    #[error("tool call {index} was not closed before the output ended")]
    UnterminatedToolCall { index: usize },
    #[error("tool call {index} names {name:?}, which the request does not allow")]
    UndeclaredTool { index: usize, name: String },
    #[error("the request requires a completed tool call and none was produced")]
    NoRequiredToolCall,
}

/// A parser failure: its message (the first line of llguidance's report, which may go on to
/// dump the grammar) and, when llguidance raised it, its error kept whole as the source.
#[derive(Debug, Error)]
#[error("{message}")]
pub struct ParserFailure {
    pub message: String,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl From<&str> for ParserFailure {
    fn from(message: &str) -> Self {
        ParserFailure { message: message.to_owned(), source: None }
    }
}

impl From<String> for ParserFailure {
    fn from(message: String) -> Self {
        ParserFailure { message, source: None }
    }
}

/// Structured-output grammar construction or advancement failed.
#[derive(Debug, Error)]
pub enum GrammarError {
    #[error("grammar does not compile: {0}")]
    Compile(#[source] ParserFailure),
    #[error("token {0} is not allowed by the grammar")]
    Rejected(u32),
    #[error("cannot roll back {requested} tokens; only {available} consumed")]
    Rollback { requested: usize, available: usize },
    #[error("grammar matcher failed: {0}")]
    Matcher(#[source] ParserFailure),
    /// The grammar exceeds the parser's limits, at compile or computing a mask: too complex
    /// to serve, the request's fault.
    #[error("the grammar exceeds the parser's limits: {0}")]
    Limit(#[source] ParserFailure),
    #[error("tokenizer environment: {0}")]
    Env(String),
}

/// A sampling request is out of contract.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplingError {
    #[error("temperature must be positive, got {0}")]
    NonPositiveTemperature(f64),
    #[error("{name} must be finite")]
    NotFinite { name: &'static str },
    #[error("max_output_tokens must be at least 1")]
    ZeroMaxTokens,
}

/// Any frontend failure.
#[derive(Debug, Error)]
pub enum FrontendError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Output(#[from] OutputError),
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The prompt's tokens leave no room for output under the context limit.
    #[error("prompt of {tokens} tokens leaves no room under context limit {limit}")]
    ContextLimit { tokens: usize, limit: usize },
}
