//! Native frontend: tokenizer, chat templates with checkpoint marks, incremental
//! detokenization, stop strings, output parsers, structured output and sampling defaults.
//!
//! Engine-facing pieces are narrow: [`Prompt`] carries token ids plus checkpoint
//! endpoints, [`GrammarMatcher`] exposes `compute_mask` / `consume_token` / `rollback`.

mod bytelevel;
mod cancel;
mod detok;
mod error;
mod grammar;
mod jsonfmt;
mod parse;
mod prompt;
mod sampling;
mod stop;
mod template;
mod tokenizer;

pub use cancel::{Cancel, CancelOnDrop};
pub use detok::IncrementalDecoder;
pub use error::{
    FrontendError, GrammarError, OutputError, ParserFailure, SamplingError, TemplateError, TokenizerError,
};
pub use grammar::{AnswerFormat, Calls, GrammarEnv, GrammarMatcher, OutputProtocol, TokenMask};
pub use parse::{OutputDelta, OutputParser, ParsedOutput, ToolCall, ToolChoice};
pub use prompt::{Prompt, checkpoint_endpoints};
pub use sampling::{ResolvedSampling, SamplingRequest, resolve_sampling};
pub use stop::{MAX_STOP_BYTES, MAX_STOP_TOTAL_BYTES, MAX_STOPS, StopMatcher, StopOutcome, StopSet};
pub use template::{
    ChatTemplate, MARK_EXHAUSTIVE, MARK_SPREAD, MARK_TAIL, RenderInput, RenderLimits, Rendered, TemplateConfig,
    select_probes,
};
pub use tokenizer::{Encoded, Tokenizer};
