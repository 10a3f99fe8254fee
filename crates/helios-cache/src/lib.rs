//! helios-cache: fenced storage pools and the content-addressed prefix cache.
//!
//! Ownership rule shared by every pool here: an entry is reusable only after its logical
//! references have all been released *and* the last GPU submission that used it (its fence)
//! has completed. Logical references are counted; GPU use is a monotonically increasing
//! [`Fence`] the executor signals in order.

mod digest;
mod fence;
mod prefix;
mod rows;

pub use digest::{Digest, HASH_BLOCK_TOKENS, ImageSpan, PrefixIdentity, PrefixIndex, PrefixKey, PromptDigests};
pub use fence::{Fence, FencedPool};
pub use prefix::{Checkpoint, CheckpointId, PageId, PrefixCache, PressureStats, Publication, PublishOutcome, Retired};
pub use rows::RowPool;
