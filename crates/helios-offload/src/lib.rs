//! helios-offload: retention tiers below GPU memory for published, immutable checkpoints.
//!
//! When the GPU prefix cache retires a checkpoint, its bytes (the complete pages of its chain,
//! its tail page and its continuation row, laid out exactly as the core's cache scheme
//! declares) can be demoted here instead of lost. Tiers never interpret those bytes, so no
//! model knowledge lives here.
//!
//! - [`HostArena`]: host memory allocated once at startup, in unit-aligned extents that the
//!   executor's transfer ops copy into and out of (page-locked by executors that copy
//!   asynchronously).
//! - [`HostTier`]: the index over that memory: lookup by chained prefix digest, demotion
//!   planning with pages shared between entries of one conversation, pins for restores, and
//!   least-recently-used eviction of unpinned entries.
//!
//! The scheduler owns the tiers and the restore tickets: it plans every copy, so tiers hold no
//! locks and do no I/O on the model thread. On unified-memory machines a host tier spends the
//! same physical DRAM as the GPU cache; callers size it from the memory planner, never from
//! "free host RAM".

mod arena;
mod host;

pub use arena::{ArenaError, ExtentAllocator, HostArena, HostExtent, UNIT_BYTES};
pub use host::{DemoteError, DemoteOutcome, Demotion, HostEntry, HostEntryId, HostTier, PageSource, TierStats};

/// Geometry checkpoint images are laid out in (from the core's cache scheme).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreGeometry {
    pub page_tokens: u32,
    pub bytes_per_page: u64,
    pub continuation_row_bytes: u64,
}

impl From<&helios_contract::CacheScheme> for StoreGeometry {
    fn from(scheme: &helios_contract::CacheScheme) -> Self {
        StoreGeometry {
            page_tokens: scheme.page_tokens,
            bytes_per_page: scheme.bytes_per_page(),
            continuation_row_bytes: scheme.continuation_row_bytes,
        }
    }
}
