//! Request failures, classified the way the HTTP layer maps them.

use std::sync::Arc;

use helios_frontend::{FrontendError, GrammarError, OutputError, SamplingError, TemplateError, TokenizerError};
use helios_replay::ExecutorError;
use helios_scheduler::AdmissionError;

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
    Execution(#[from] ExecutorError),
    #[error("grammar: {0}")]
    Grammar(Arc<GrammarError>),
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
    fn from(e: GrammarError) -> Self {
        RequestError::Grammar(Arc::new(e))
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
    pub fn class(&self) -> ErrorClass {
        match self {
            RequestError::Invalid(_) | RequestError::Frontend(_) => ErrorClass::InvalidRequest,
            RequestError::Admission(AdmissionError::QueueFull { .. }) | RequestError::Unavailable(_) => {
                ErrorClass::Unavailable
            }
            RequestError::Admission(_) => ErrorClass::InvalidRequest,
            // A grammar that does not compile is the request's fault; a matcher failure mid-run is not.
            RequestError::Grammar(g) if matches!(**g, GrammarError::Compile(_)) => ErrorClass::InvalidRequest,
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
            RequestError::Admission(_) | RequestError::Unavailable(_) => Stage::Admission,
            RequestError::Execution(_) | RequestError::Grammar(_) | RequestError::ChannelClosed => Stage::Execution,
            RequestError::Output(_) => Stage::Output,
        }
    }

    /// A stable, typed error code (snake case) for clients and logs.
    pub fn code(&self) -> &'static str {
        match self {
            RequestError::Invalid(e) => match e {
                InvalidRequest::ChoiceCount { .. } => "invalid_choice_count",
                InvalidRequest::UnknownToolChoice(_) => "unknown_tool_choice",
                InvalidRequest::TokenOutOfVocabulary { .. } => "token_out_of_vocabulary",
                InvalidRequest::EmptyPrompt => "empty_prompt",
                InvalidRequest::Parameter { .. } => "invalid_parameter",
            },
            RequestError::Frontend(e) => match &**e {
                FrontendError::Tokenizer(_) => "tokenization_failed",
                FrontendError::Template(TemplateError::Raised(_)) => "template_raised",
                FrontendError::Template(_) => "template_failed",
                FrontendError::Sampling(SamplingError::NonPositiveTemperature(_)) => "invalid_temperature",
                FrontendError::Sampling(SamplingError::ZeroMaxTokens) => "invalid_max_tokens",
                FrontendError::Sampling(_) => "invalid_sampling_parameter",
                _ => "invalid_request",
            },
            RequestError::Admission(e) => match e {
                AdmissionError::EmptyPrompt => "empty_prompt",
                AdmissionError::NoOutput => "invalid_max_tokens",
                AdmissionError::ContextLimit { .. } => "context_length_exceeded",
                AdmissionError::TokenOutOfVocabulary { .. } => "token_out_of_vocabulary",
                AdmissionError::LargerThanPool { .. } => "exceeds_cache_capacity",
                AdmissionError::QueueFull { .. } => "queue_full",
            },
            RequestError::Unavailable(e) => match e {
                Unavailable::Starting => "worker_starting",
                Unavailable::Draining => "shutting_down",
                Unavailable::Failed(_) => "worker_failed",
                Unavailable::PreparationQueueFull(_) => "queue_full",
            },
            RequestError::Execution(_) => "execution_failed",
            RequestError::Grammar(g) if matches!(**g, GrammarError::Compile(_)) => "invalid_grammar",
            RequestError::Grammar(_) => "grammar_failed",
            RequestError::Output(e) => match e {
                OutputError::NoRequiredToolCall => "required_tool_call_missing",
                OutputError::UndeclaredTool { .. } => "undeclared_tool",
                _ => "malformed_tool_call",
            },
            RequestError::ChannelClosed => "channel_closed",
        }
    }

    /// The request parameter at fault, when one is.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            RequestError::Invalid(InvalidRequest::Parameter { param, .. }) => Some(param),
            RequestError::Invalid(InvalidRequest::ChoiceCount { .. }) => Some("n"),
            RequestError::Invalid(InvalidRequest::UnknownToolChoice(_)) => Some("tool_choice"),
            RequestError::Frontend(f) => match &**f {
                FrontendError::Sampling(SamplingError::NonPositiveTemperature(_)) => Some("temperature"),
                FrontendError::Sampling(SamplingError::ZeroMaxTokens) => Some("max_tokens"),
                FrontendError::Template(_) => Some("messages"),
                _ => None,
            },
            RequestError::Admission(AdmissionError::NoOutput) => Some("max_tokens"),
            RequestError::Admission(AdmissionError::ContextLimit { .. }) => Some("messages"),
            RequestError::Grammar(g) if matches!(**g, GrammarError::Compile(_)) => Some("response_format"),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_follow_the_design_mapping() {
        let queue = RequestError::Admission(AdmissionError::QueueFull { limit: 1 });
        assert_eq!(queue.class(), ErrorClass::Unavailable);
        let ctx = RequestError::Admission(AdmissionError::ContextLimit { tokens: 9, limit: 8 });
        assert_eq!(
            (ctx.class(), ctx.code(), ctx.stage()),
            (ErrorClass::InvalidRequest, "context_length_exceeded", Stage::Admission)
        );
        let exec = RequestError::Execution(ExecutorError::BadRow(3));
        assert_eq!(exec.class(), ErrorClass::Execution);
        let bad = RequestError::from(SamplingError::NonPositiveTemperature(0.0));
        assert_eq!((bad.class(), bad.param()), (ErrorClass::InvalidRequest, Some("temperature")));
    }
}
