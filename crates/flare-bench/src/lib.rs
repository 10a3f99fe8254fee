//! flare-bench: drivers that measure and stress any OpenAI-compatible endpoint.
//!
//! * [`run_bench`] drives the design's workloads (cold prompt, fixed-length decode at concurrency
//!   1/2/4, multi-turn agent append with tool results, shared-prefix branches) through streaming
//!   `/v1/chat/completions` and reports TTFT, inter-token latency and throughput.
//! * [`run_load`] runs many concurrent streaming clients (some disconnecting mid-stream, some
//!   reading slowly), then audits the server's `/metrics`, its error envelopes for malformed
//!   requests, and that it still answers. [`LoadReport::check`] turns the audit into a verdict.
//!
//! The `flare` binary exposes these as `flare bench` and `flare load`; [`BenchArgs`] and
//! [`LoadArgs`] are the clap argument sets it flattens.

mod bench;
mod error;
mod http;
mod load;
pub mod metrics;
pub mod sse;
pub mod stats;

pub use bench::{AgentTurn, BenchArgs, BenchReport, RequestRecord, Workload, WorkloadKind, run_bench};
pub use error::BenchError;
pub use http::Target;
pub use load::{ClientKind, LoadArgs, LoadReport, MalformedCase, MetricsSnapshot, run_load};

#[cfg(test)]
mod fake;
