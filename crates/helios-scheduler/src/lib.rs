//! helios-scheduler: admission, page growth, chunked prefill, decode batching, checkpoint
//! capture, preemption and cancellation for one runtime core. Policy follows only from the
//! cache scheme geometry and the capacities.

mod plan;
pub mod propose;
mod scheduler;

pub use plan::{Completion, ConsumeRow, PageCopy, RequestId, SampleSpec, SampledToken, Step, StepOp, epoch_of};
pub use scheduler::{
    AdmissionError, ConfigError, DiskCounters, FinishReason, FinishedRequest, Occupancy, RESTORE_BYTES_PER_STEP,
    RequestSpec, RestoreDone, Scheduler, SchedulerConfig, SchedulerStats, select_message_endpoints, snapshot_budget,
};
