//! Native frontend: tokenizer, chat templates with checkpoint marks, incremental
//! detokenization, stop strings, output parsers, structured output and sampling defaults.
//!
//! Engine-facing pieces are narrow: [`Prompt`] carries token ids plus checkpoint
//! endpoints, [`GrammarMatcher`] exposes `compute_mask` / `consume_token` / `rollback`.

mod bytelevel;
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

pub use detok::IncrementalDecoder;
pub use error::{FrontendError, GrammarError, OutputError, SamplingError, TemplateError, TokenizerError};
pub use grammar::{AnswerFormat, GrammarEnv, GrammarMatcher, OutputProtocol, TokenMask};
pub use parse::{OutputDelta, OutputParser, ParsedOutput, ToolCall, ToolChoice};
pub use prompt::{Prompt, checkpoint_endpoints};
pub use sampling::{ResolvedSampling, SamplingRequest, resolve_sampling};
pub use stop::{StopMatcher, StopOutcome};
pub use template::{ChatTemplate, RenderInput, Rendered, TemplateConfig};
pub use tokenizer::{Encoded, Tokenizer};
