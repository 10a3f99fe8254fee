//! helios-worker: the native serving worker, independent of any transport.
//!
//! - [`Engine`] owns one model thread that alone touches the [`helios_scheduler::Scheduler`]
//!   and the [`helios_replay::Executor`]; handlers talk to it through commands.
//! - Tokenization, template rendering and grammar compilation run on bounded
//!   preparation workers ([`Engine::prepare`]), after O(1) limits ([`check_limits`]); work
//!   whose client left, or that shutdown cancels, stops at its next check.
//! - Grammar masks are computed on grammar threads while the scheduler holds the request, so
//!   a slow grammar delays only its own request; the model thread never computes one.
//! - Each choice streams through a [`ChoiceStream`] backed by bounded storage: the model
//!   thread never blocks on a consumer; dropping the stream cancels the request.
//! - [`ChoiceDecoder`] turns tokens into presented deltas (detokenization, stop strings,
//!   reasoning and tool-call parsing).
//!
//! Invariants: every request the scheduler accepted ends with exactly one terminal event
//! (finished or failed); `flare_requests_admitted_total` equals the finished plus failed
//! counts whenever the worker is idle.

mod decode;
/// The serving loop driven one turn at a time, for tests and device examples (feature `testkit`).
#[cfg(feature = "testkit")]
pub mod drive;
mod engine;
mod error;
mod frontend;
mod grammar_pool;
mod metrics;
mod output;
mod prep;
mod request;
mod trim;
/// Agent-like workloads through the serving loop and their solo-run oracle (feature `testkit`).
#[cfg(feature = "testkit")]
pub mod workload;

pub use decode::{ChoiceDecoder, Decoded, StopHit};
pub use engine::{DEFAULT_SPECULATIVE_DEPTH, DiskCacheOptions, Engine, EngineOptions, Health};
pub use error::{ErrorClass, ErrorCode, InvalidRequest, LoopError, RequestError, Stage, Unavailable};
pub use frontend::{Frontend, StartError};
pub use metrics::{Metrics, TierMetrics};
pub use output::{ChoiceEvent, ChoiceStream, FinishCause, FinishInfo};
pub use prep::PrepPool;
pub use request::{
    ChatPrompt, GREEDY_SEED, GenerationInput, MAX_CHOICES, Prepared, PromptInput, check_limits, prepare, tokenize,
    tool_name,
};
pub use trim::release_free_memory;
