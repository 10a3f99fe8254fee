//! The planned step handed to an executor, and what the executor hands back.

use helios_cache::{Fence, PageId, PrefixKey};
use helios_contract::model::SpeculativeProgram;
use helios_offload::HostExtent;

/// A checkpoint's epoch: the low 32 bits of its prefix key's digest. A function of the key
/// alone, so the same checkpoint has the same epoch on every tier and after a restart.
pub fn epoch_of(key: &PrefixKey) -> u32 {
    key.digest.0 as u32
}

/// Identifies a request for the lifetime of the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Copy one whole page (tail pages of checkpoints).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCopy {
    pub source: PageId,
    pub destination: PageId,
}

/// Sample one token after the op: seeded per request, counter = tokens generated so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleSpec {
    pub request: RequestId,
    pub seed: u64,
    pub counter: u32,
}

/// Tokens to consume for one request at consecutive positions starting at `start`.
/// The live row must hold exactly `start` consumed tokens beforehand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumeRow {
    pub live_row: u32,
    pub start: u32,
    pub tokens: Vec<u32>,
    /// Decode only: the row consumes one token the host has not seen, its live row's pending
    /// token on the device (sampled by a step still in flight); `tokens` is then empty.
    pub device_token: bool,
    pub page_table: Vec<PageId>,
    pub sample: Option<SampleSpec>,
}

impl ConsumeRow {
    /// Proposals a verify row carries (every token after its pending one).
    pub fn proposals(&self) -> usize {
        (self.tokens.len() + usize::from(self.device_token)).saturating_sub(1)
    }

    /// Tokens the row consumes.
    pub fn len(&self) -> usize {
        self.tokens.len() + usize::from(self.device_token)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One operation; ops in a step run in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepOp {
    /// Reset the slot's live rows from the null row.
    Initialize { live_row: u32, rows: u32 },
    /// Copy a snapshot into a live row, and the checkpoint's tail page into a private page.
    ///
    /// `consumed` and `epoch` are the checkpoint's stamp, which the snapshot row holds (see
    /// `Snapshot`): a device that checks stamps refuses a row holding anything else.
    Restore { snapshot_row: u32, live_row: u32, tail: Option<PageCopy>, consumed: u32, epoch: u32 },
    /// Copy a live row into a snapshot, and the live tail page into the checkpoint's page.
    ///
    /// Invariant: `consumed` is the checkpoint's token count, exactly what the live row has
    /// consumed when the op runs (ops and steps run in order), and `epoch` its tag, the low 32
    /// bits of its prefix key's digest ([`epoch_of`]). The device checks the live row's count
    /// and stamps the snapshot row `(consumed, epoch)`; the stamp travels with the row's bytes
    /// (host and disk tiers, restarts) and the checkpoint keeps its key, so a later `Restore`
    /// of it carries the same pair with no counter to keep.
    Snapshot { live_row: u32, snapshot_row: u32, tail: Option<PageCopy>, consumed: u32, epoch: u32 },
    /// A decode batch at a captured request bucket (`rows.len() <= bucket`).
    Decode { bucket: u32, rows: Vec<ConsumeRow> },
    /// A speculative round through a captured speculative program (`program.requests >=
    /// rows.len()`): each row consumes its pending token (from `tokens[0]`, or the device's
    /// pending token when `device_token`) followed by its proposals (the rest of `tokens`, at
    /// most `program.depth`), and samples at each of those positions with the ordinary
    /// sampler until a sample differs from the next proposal. The completion reports, per
    /// row, the accepted proposals and then the sample that ended the round, in order
    /// (accepted + 1 tokens). Afterwards the row's state holds exactly the pending token and
    /// the accepted proposals; positions of rejected proposals were written but are not
    /// state (they are overwritten before anything reads them).
    Verify { program: SpeculativeProgram, rows: Vec<ConsumeRow> },
    /// One prefill chunk at a captured token capacity.
    Prefill { capacity: u32, row: ConsumeRow },
    /// Sample from a restored state without consuming (full-prompt hit).
    ResumeSampling { live_row: u32, consumed: u32, page_table: Vec<PageId>, sample: SampleSpec },
    /// Count the request's prompt into its live row's penalty histogram, once, at admission
    /// (after the row's Initialize or Restore; on a prefix hit too). After a preemption the
    /// prompt is every token the request has, its pending sampled token included. Sampling graphs count
    /// each sampled token afterwards. Cores without a penalty histogram skip it.
    AdmitHistogram { live_row: u32, tokens: Vec<u32> },
    /// Copy retired checkpoints out to the host tier: pages and snapshot rows into host
    /// extents. Always first in its step: the storage was released when it retired and may be
    /// written by a later op of the same step (ops and steps run in order).
    CopyOut { pages: Vec<(PageId, HostExtent)>, rows: Vec<(u32, HostExtent)> },
    /// Copy host extents into pages and a snapshot row (a restore); the checkpoint they form
    /// publishes when the step completes, so nothing reads them before.
    CopyIn { pages: Vec<(HostExtent, PageId)>, rows: Vec<(HostExtent, u32)> },
}

/// Everything submitted between two scheduling decisions; completes as one fence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub fence: Fence,
    pub ops: Vec<StepOp>,
}

/// A sampled token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampledToken {
    pub request: RequestId,
    pub token: u32,
}

/// The executor's report that `fence` finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub fence: Fence,
    /// Sampled tokens in row order; a verify row's tokens are contiguous, in order.
    pub sampled: Vec<SampledToken>,
}
