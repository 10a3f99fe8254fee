//! Request failures, classified the way the HTTP layer maps them.

use std::sync::Arc;

use helios_frontend::{FrontendError, GrammarError, OutputError, SamplingError, TemplateError, TokenizerError};
use helios_replay::ExecutorError;
use helios_scheduler::AdmissionError;

/// Declares [`ErrorCode`] with each variant's wire string written once.
macro_rules! error_codes {
    ($($variant:ident => $text:literal,)+) => {
        /// Every error code a request failure is reported with: snake case on the wire (the
        /// OpenAI envelope's `code`, Anthropic's `error.code`), in logs and in the failure
        /// metric's label. The HTTP layer's own codes are `helios_http::ApiCode`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($variant,)+
        }

        impl ErrorCode {
            /// Every code, in declaration order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $text,)+
                }
            }
        }
    };
}

error_codes! {
    InvalidChoiceCount => "invalid_choice_count",
    UnknownToolChoice => "unknown_tool_choice",
    TokenOutOfVocabulary => "token_out_of_vocabulary",
    EmptyPrompt => "empty_prompt",
    InvalidParameter => "invalid_parameter",
    TooManyMessages => "too_many_messages",
    ContextLengthExceeded => "context_length_exceeded",
    TokenizationFailed => "tokenization_failed",
    TemplateRaised => "template_raised",
    TemplateFailed => "template_failed",
    InvalidTemperature => "invalid_temperature",
    InvalidMaxTokens => "invalid_max_tokens",
    InvalidSamplingParameter => "invalid_sampling_parameter",
    InvalidRequest => "invalid_request",
    ExceedsCacheCapacity => "exceeds_cache_capacity",
    QueueFull => "queue_full",
    WorkerStarting => "worker_starting",
    ShuttingDown => "shutting_down",
    WorkerFailed => "worker_failed",
    ExecutionFailed => "execution_failed",
    InvalidGrammar => "invalid_grammar",
    GrammarFailed => "grammar_failed",
    GrammarTooComplex => "grammar_too_complex",
    GrammarTooSlow => "grammar_too_slow",
    RequiredToolCallMissing => "required_tool_call_missing",
    UndeclaredTool => "undeclared_tool",
    MalformedToolCall => "malformed_tool_call",
    ChannelClosed => "channel_closed",
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the model loop stopped: the executor failed, or its completions broke what the worker
/// checks of them (fence order, sampled ids inside the vocabulary).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoopError {
    #[error(transparent)]
    Executor(#[from] ExecutorError),
    #[error("completion reports fence {got}, expected {expected}")]
    UnexpectedFence { got: u64, expected: u64 },
    #[error("completion samples token {token} outside the vocabulary of {vocab}")]
    SampledOutOfVocabulary { token: u32, vocab: u32 },
}

/// Where a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Validation,
    Preparation,
    Admission,
    Execution,
    Output,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Validation => "validation",
            Stage::Preparation => "preparation",
            Stage::Admission => "admission",
            Stage::Execution => "execution",
            Stage::Output => "output",
        }
    }
}

/// How a failure is reported to clients: request errors (400), capacity or worker
/// unavailability (503), execution failures (500).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    InvalidRequest,
    Unavailable,
    Execution,
}

/// Why the worker cannot take a request now.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error("the worker is still starting")]
    Starting,
    #[error("the server is shutting down")]
    Draining,
    #[error("the worker failed: {0}")]
    Failed(String),
    #[error("preparation queue full ({0} waiting)")]
    PreparationQueueFull(usize),
}

/// Invalid request content found before preparation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidRequest {
    #[error("`n` must be between 1 and {max}, got {got}")]
    ChoiceCount { got: u32, max: u32 },
    #[error("tool_choice names {0:?}, which is not among the request's tools")]
    UnknownToolChoice(String),
    #[error("prompt token {token} outside the vocabulary of {vocab}")]
    TokenOutOfVocabulary { token: u32, vocab: u32 },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("`{param}`: {reason}")]
    Parameter { param: &'static str, reason: String },
    #[error("{got} messages cannot fit the context limit of {max} tokens")]
    TooManyMessages { got: usize, max: usize },
    #[error("the prompt is longer than the context limit of {limit} tokens")]
    PromptTooLong { limit: u32 },
}

/// A request's failure, from validation to output parsing.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Invalid(#[from] InvalidRequest),
    #[error(transparent)]
    Frontend(Arc<FrontendError>),
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    #[error("execution failed: {0}")]
    Execution(#[from] LoopError),
    /// A grammar that does not compile (400 `invalid_grammar`), or a matcher failing mid-run
    /// on its own (500 `grammar_failed`).
    #[error("grammar: {0}")]
    Grammar(Arc<GrammarError>),
    /// The grammar exceeds the parser's limits (`ParserLimits`: too large, or too many
    /// alternatives at a position), found at `stage`: 400 `grammar_too_complex`.
    #[error("the grammar is too complex: {message}")]
    GrammarTooComplex { message: String, stage: Stage },
    /// One of the grammar's masks took longer than the engine's per-mask budget
    /// (`EngineOptions::grammar_mask_budget`): 503 `grammar_too_slow`. Wall-clock time also
    /// measures the server's load, and the parser's limits already refuse (400) grammars whose
    /// steps are too costly by construction, so this is not the client's fault.
    #[error("a grammar mask took {elapsed_ms} ms, over the budget of {budget_ms} ms")]
    GrammarTooSlow { elapsed_ms: u64, budget_ms: u64 },
    #[error(transparent)]
    Output(#[from] OutputError),
    #[error("the request's output channel closed without a terminal event")]
    ChannelClosed,
}

impl From<FrontendError> for RequestError {
    fn from(e: FrontendError) -> Self {
        RequestError::Frontend(Arc::new(e))
    }
}

impl From<GrammarError> for RequestError {
    /// A grammar failure while preparing: see [`RequestError::grammar`].
    fn from(e: GrammarError) -> Self {
        RequestError::grammar(e, Stage::Preparation)
    }
}

impl From<SamplingError> for RequestError {
    fn from(e: SamplingError) -> Self {
        FrontendError::Sampling(e).into()
    }
}

impl From<TemplateError> for RequestError {
    fn from(e: TemplateError) -> Self {
        FrontendError::Template(e).into()
    }
}

impl From<TokenizerError> for RequestError {
    fn from(e: TokenizerError) -> Self {
        FrontendError::Tokenizer(e).into()
    }
}

impl RequestError {
    /// Classifies a grammar failure found at `stage`: over the parser's limits, the request's
    /// fault ([`RequestError::GrammarTooComplex`]); anything else stays a
    /// [`RequestError::Grammar`] (a compile failure is still the request's fault).
    pub fn grammar(e: GrammarError, stage: Stage) -> Self {
        match e {
            GrammarError::Limit(failure) => RequestError::GrammarTooComplex { message: failure.message, stage },
            e => RequestError::Grammar(Arc::new(e)),
        }
    }

    pub fn class(&self) -> ErrorClass {
        match self {
            RequestError::Invalid(_) | RequestError::Frontend(_) => ErrorClass::InvalidRequest,
            RequestError::Admission(AdmissionError::QueueFull { .. }) | RequestError::Unavailable(_) => {
                ErrorClass::Unavailable
            }
            RequestError::Admission(_) => ErrorClass::InvalidRequest,
            // A grammar that does not compile is the request's fault; a matcher failure mid-run is not.
            RequestError::Grammar(g) if matches!(**g, GrammarError::Compile(_)) => ErrorClass::InvalidRequest,
            RequestError::GrammarTooComplex { .. } => ErrorClass::InvalidRequest,
            RequestError::GrammarTooSlow { .. } => ErrorClass::Unavailable,
            RequestError::Grammar(_) | RequestError::Execution(_) | RequestError::ChannelClosed => {
                ErrorClass::Execution
            }
            RequestError::Output(_) => ErrorClass::Execution,
        }
    }

    pub fn stage(&self) -> Stage {
        match self {
            RequestError::Invalid(_) => Stage::Validation,
            RequestError::Frontend(_) => Stage::Preparation,
            RequestError::Grammar(g) if matches!(**g, GrammarError::Compile(_)) => Stage::Preparation,
            RequestError::GrammarTooComplex { stage, .. } => *stage,
            RequestError::GrammarTooSlow { .. } => Stage::Execution,
            RequestError::Admission(_) | RequestError::Unavailable(_) => Stage::Admission,
            RequestError::Execution(_) | RequestError::Grammar(_) | RequestError::ChannelClosed => Stage::Execution,
            RequestError::Output(_) => Stage::Output,
        }
    }

    /// A stable, typed error code (snake case) for clients and logs.
    pub fn code(&self) -> ErrorCode {
        match self {
            RequestError::Invalid(e) => match e {
                InvalidRequest::ChoiceCount { .. } => ErrorCode::InvalidChoiceCount,
                InvalidRequest::UnknownToolChoice(_) => ErrorCode::UnknownToolChoice,
                InvalidRequest::TokenOutOfVocabulary { .. } => ErrorCode::TokenOutOfVocabulary,
                InvalidRequest::EmptyPrompt => ErrorCode::EmptyPrompt,
                InvalidRequest::Parameter { .. } => ErrorCode::InvalidParameter,
                InvalidRequest::TooManyMessages { .. } => ErrorCode::TooManyMessages,
                InvalidRequest::PromptTooLong { .. } => ErrorCode::ContextLengthExceeded,
            },
            RequestError::Frontend(e) => match &**e {
                FrontendError::Tokenizer(_) => ErrorCode::TokenizationFailed,
                FrontendError::Template(TemplateError::Raised(_)) => ErrorCode::TemplateRaised,
                FrontendError::Template(_) => ErrorCode::TemplateFailed,
                FrontendError::Sampling(SamplingError::NonPositiveTemperature(_)) => ErrorCode::InvalidTemperature,
                FrontendError::Sampling(SamplingError::ZeroMaxTokens) => ErrorCode::InvalidMaxTokens,
                FrontendError::Sampling(_) => ErrorCode::InvalidSamplingParameter,
                _ => ErrorCode::InvalidRequest,
            },
            RequestError::Admission(e) => match e {
                AdmissionError::EmptyPrompt => ErrorCode::EmptyPrompt,
                AdmissionError::NoOutput => ErrorCode::InvalidMaxTokens,
                AdmissionError::ContextLimit { .. } => ErrorCode::ContextLengthExceeded,
                AdmissionError::TokenOutOfVocabulary { .. } => ErrorCode::TokenOutOfVocabulary,
                AdmissionError::LargerThanPool { .. } => ErrorCode::ExceedsCacheCapacity,
                AdmissionError::QueueFull { .. } => ErrorCode::QueueFull,
            },
            RequestError::Unavailable(e) => match e {
                Unavailable::Starting => ErrorCode::WorkerStarting,
                Unavailable::Draining => ErrorCode::ShuttingDown,
                Unavailable::Failed(_) => ErrorCode::WorkerFailed,
                Unavailable::PreparationQueueFull(_) => ErrorCode::QueueFull,
            },
            RequestError::Execution(_) => ErrorCode::ExecutionFailed,
            RequestError::Grammar(g) if matches!(**g, GrammarError::Compile(_)) => ErrorCode::InvalidGrammar,
            RequestError::Grammar(_) => ErrorCode::GrammarFailed,
            RequestError::GrammarTooComplex { .. } => ErrorCode::GrammarTooComplex,
            RequestError::GrammarTooSlow { .. } => ErrorCode::GrammarTooSlow,
            RequestError::Output(e) => match e {
                OutputError::NoRequiredToolCall => ErrorCode::RequiredToolCallMissing,
                OutputError::UndeclaredTool { .. } => ErrorCode::UndeclaredTool,
                _ => ErrorCode::MalformedToolCall,
            },
            RequestError::ChannelClosed => ErrorCode::ChannelClosed,
        }
    }

    /// The request parameter at fault, when one is.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            RequestError::Invalid(InvalidRequest::Parameter { param, .. }) => Some(param),
            RequestError::Invalid(InvalidRequest::ChoiceCount { .. }) => Some("n"),
            RequestError::Invalid(InvalidRequest::UnknownToolChoice(_)) => Some("tool_choice"),
            RequestError::Invalid(InvalidRequest::TooManyMessages { .. } | InvalidRequest::PromptTooLong { .. }) => {
                Some("messages")
            }
            RequestError::Frontend(f) => match &**f {
                FrontendError::Sampling(SamplingError::NonPositiveTemperature(_)) => Some("temperature"),
                FrontendError::Sampling(SamplingError::ZeroMaxTokens) => Some("max_tokens"),
                FrontendError::Template(_) => Some("messages"),
                _ => None,
            },
            RequestError::Admission(AdmissionError::NoOutput) => Some("max_tokens"),
            RequestError::Admission(AdmissionError::ContextLimit { .. }) => Some("messages"),
            RequestError::Grammar(g) if matches!(**g, GrammarError::Compile(_)) => Some("response_format"),
            RequestError::GrammarTooComplex { .. } | RequestError::GrammarTooSlow { .. } => Some("response_format"),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_are_distinct_snake_case() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            let s = code.as_str();
            assert!(seen.insert(s), "{s} twice");
            assert!(!s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{s}");
        }
    }

    #[test]
    fn classes_follow_the_design_mapping() {
        let queue = RequestError::Admission(AdmissionError::QueueFull { limit: 1 });
        assert_eq!(queue.class(), ErrorClass::Unavailable);
        let ctx = RequestError::Admission(AdmissionError::ContextLimit { tokens: 9, limit: 8 });
        assert_eq!(
            (ctx.class(), ctx.code(), ctx.stage()),
            (ErrorClass::InvalidRequest, ErrorCode::ContextLengthExceeded, Stage::Admission)
        );
        let exec = RequestError::Execution(LoopError::Executor(ExecutorError::BadRow(3)));
        assert_eq!(exec.class(), ErrorClass::Execution);
        let bad = RequestError::from(SamplingError::NonPositiveTemperature(0.0));
        assert_eq!((bad.class(), bad.param()), (ErrorClass::InvalidRequest, Some("temperature")));
    }

    #[test]
    fn grammar_failures_the_client_caused_are_invalid_requests() {
        let limit = "Parser Error: Current row has 20007 items; max is 2000";
        let e = RequestError::grammar(GrammarError::Limit(limit.into()), Stage::Execution);
        assert_eq!(
            (e.class(), e.code(), e.stage(), e.param()),
            (ErrorClass::InvalidRequest, ErrorCode::GrammarTooComplex, Stage::Execution, Some("response_format"))
        );
        let e = RequestError::from(GrammarError::Limit("grammar size (number of symbols) too big (limit 5)".into()));
        assert_eq!(
            (e.class(), e.code(), e.stage()),
            (ErrorClass::InvalidRequest, ErrorCode::GrammarTooComplex, Stage::Preparation)
        );
        let e = RequestError::from(GrammarError::Compile("unknown type".into()));
        assert_eq!((e.class(), e.code()), (ErrorClass::InvalidRequest, ErrorCode::InvalidGrammar));
        let slow = RequestError::GrammarTooSlow { elapsed_ms: 900, budget_ms: 500 };
        assert_eq!((slow.class(), slow.code()), (ErrorClass::Unavailable, ErrorCode::GrammarTooSlow));
        // A matcher failing on its own, or rejecting a token its mask allowed: the server's fault.
        for e in [GrammarError::Matcher("internal".into()), GrammarError::Rejected(5)] {
            let e = RequestError::grammar(e, Stage::Execution);
            assert_eq!((e.class(), e.code()), (ErrorClass::Execution, ErrorCode::GrammarFailed));
        }
    }
}
