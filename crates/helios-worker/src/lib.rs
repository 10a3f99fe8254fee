//! helios-worker: the native serving worker, independent of any transport.
//!
//! - [`Engine`] owns one model thread that alone touches the [`helios_scheduler::Scheduler`]
//!   and the [`helios_replay::Executor`]; handlers talk to it through commands.
//! - Tokenization, template rendering and grammar compilation run on bounded
//!   preparation workers ([`Engine::prepare`]).
//! - Each choice streams through a [`ChoiceStream`] backed by bounded storage: the model
//!   thread never blocks on a consumer; dropping the stream cancels the request.
//! - [`ChoiceDecoder`] turns tokens into presented deltas (detokenization, stop strings,
//!   reasoning and tool-call parsing).
//!
//! Invariants: every request the scheduler accepted ends with exactly one terminal event
//! (finished or failed); `flare_requests_admitted_total` equals the finished plus failed
//! counts whenever the worker is idle.

mod decode;
mod engine;
mod error;
mod frontend;
mod metrics;
mod output;
mod prep;
mod request;

pub use decode::{ChoiceDecoder, Decoded};
pub use engine::{Engine, EngineOptions, Health};
pub use error::{ErrorClass, InvalidRequest, RequestError, Stage, Unavailable};
pub use frontend::{Frontend, StartError};
pub use metrics::Metrics;
pub use output::{ChoiceEvent, ChoiceStream, FinishCause, FinishInfo};
pub use prep::PrepPool;
pub use request::{ChatPrompt, GenerationInput, MAX_CHOICES, Prepared, PromptInput, prepare, tool_name};
