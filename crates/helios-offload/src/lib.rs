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
//! - [`DiskTier`]: checkpoint files under one directory, indexed at startup so a restarted
//!   server serves the conversations it had; pages shared between files by uid.
//! - [`DiskIo`]: the I/O thread that moves bytes between those files and host extents
//!   (io_uring, `O_DIRECT`), so the model thread never blocks on the disk.
//!
//! The scheduler owns the tiers and the restore tickets: it plans every copy, so tiers hold no
//! locks and do no I/O on the model thread. On unified-memory machines a host tier spends the
//! same physical DRAM as the GPU cache; callers size it from the memory planner, never from
//! "free host RAM".

mod arena;
mod disk;
mod host;
mod io;

pub use arena::{ArenaError, ExtentAllocator, HostArena, HostExtent, UNIT_BYTES};
pub use disk::{
    BlockInfo, BlockKind, BlockRead, BlockSource, DiskError, DiskIdentity, DiskStats, DiskTier, FILE_MAGIC,
    FORMAT_VERSION, FileHeader, FormatError, PageRef, ReadPlan, Rejection, WritePlan, checksum, source_extent,
};
pub use host::{
    DemoteError, DemoteOutcome, Demotion, Fill, HostEntry, HostEntryId, HostTier, PageSource, PageUid, TierStats,
};
pub use io::{DiskDone, DiskIo, DiskJob, IoFailure, IoFaults};

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
