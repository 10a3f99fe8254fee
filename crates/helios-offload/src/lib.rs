//! helios-offload: retention tiers below GPU memory for published, immutable checkpoints.
//!
//! A store keeps byte images of checkpoints the GPU prefix cache has published: their ordered
//! complete pages and their endpoint continuation row, laid out exactly as the core's cache
//! scheme declares. Stores never interpret those bytes, so no model knowledge lives here.
//!
//! Memory and disk stores share one interface ([`CheckpointStore`]): lookup by prefix digest,
//! insertion of an immutable image, and restore through a [`RestoreTicket`] that the scheduler
//! owns. Requests sharing a prefix join one ticket; a cancelled request only detaches its waiter.
//!
//! On unified-memory machines a host tier spends the same physical DRAM as the GPU cache;
//! callers size [`HostMemoryStore`] from the memory planner, never from "free host RAM".

use std::collections::{BTreeMap, HashMap};

/// Content address of a checkpoint: the chained prefix digest the GPU prefix cache uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CheckpointKey(pub [u8; 32]);

/// Byte image of one published checkpoint.
///
/// Invariant: `pages.len() == consumed_tokens.div_ceil(page_tokens)` of the scheme it was
/// taken under, every page has the scheme's `bytes_per_page`, and `row` has its
/// `continuation_row_bytes`. [`CheckpointStore::insert`] checks the sizes against its geometry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointImage {
    pub consumed_tokens: u64,
    pub pages: Vec<Vec<u8>>,
    pub row: Vec<u8>,
}

impl CheckpointImage {
    pub fn byte_size(&self) -> u64 {
        self.pages.iter().map(|p| p.len() as u64).sum::<u64>() + self.row.len() as u64
    }
}

/// Geometry a store validates images against (from the core's cache scheme).
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

/// Identifies a restore in flight; owned by the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RestoreTicket(pub u64);

/// Where a restore stands.
#[derive(Debug, PartialEq, Eq)]
pub enum RestoreState<'a> {
    /// Transfer still running (disk stores).
    Pending,
    /// The image is readable until the ticket is released.
    Ready(&'a CheckpointImage),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("image does not match the store geometry: {0}")]
    Geometry(GeometryMismatch),
    #[error("image of {needed} bytes exceeds the store budget of {budget}")]
    TooLarge { needed: u64, budget: u64 },
    #[error("no checkpoint stored under this key")]
    NotFound,
    #[error("unknown restore ticket {0:?}")]
    UnknownTicket(RestoreTicket),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GeometryMismatch {
    PageCount { expected: u64, found: u64 },
    PageBytes { page: usize, found: u64 },
    RowBytes { found: u64 },
}

impl std::fmt::Display for GeometryMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GeometryMismatch::PageCount { expected, found } => write!(f, "{found} pages, expected {expected}"),
            GeometryMismatch::PageBytes { page, found } => write!(f, "page {page} is {found} bytes"),
            GeometryMismatch::RowBytes { found } => write!(f, "row is {found} bytes"),
        }
    }
}

/// The interface every retention tier implements.
pub trait CheckpointStore {
    /// Consumed-token count of a stored checkpoint, without starting a transfer.
    fn lookup(&self, key: &CheckpointKey) -> Option<u64>;
    /// Stores an immutable image, evicting least recently used unpinned images to fit.
    /// Storing a key twice keeps the first image (images under one key are identical).
    fn insert(&mut self, key: CheckpointKey, image: CheckpointImage) -> Result<(), StoreError>;
    /// Starts (or joins) a restore. The image stays pinned until every joined ticket is released.
    fn begin_restore(&mut self, key: &CheckpointKey) -> Result<RestoreTicket, StoreError>;
    fn poll_restore(&self, ticket: RestoreTicket) -> Result<RestoreState<'_>, StoreError>;
    /// Detaches one waiter; the last release unpins the image.
    fn release(&mut self, ticket: RestoreTicket) -> Result<(), StoreError>;
    /// Bytes held.
    fn used_bytes(&self) -> u64;
}

struct Entry {
    image: CheckpointImage,
    last_use: u64,
    pins: u32,
}

/// Host-RAM tier with a fixed byte budget and LRU eviction of unpinned images.
pub struct HostMemoryStore {
    geometry: StoreGeometry,
    budget: u64,
    used: u64,
    clock: u64,
    next_ticket: u64,
    entries: HashMap<CheckpointKey, Entry>,
    tickets: BTreeMap<RestoreTicket, CheckpointKey>,
}

impl std::fmt::Debug for HostMemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemoryStore")
            .field("budget", &self.budget)
            .field("used", &self.used)
            .field("entries", &self.entries.len())
            .field("tickets", &self.tickets.len())
            .finish()
    }
}

impl HostMemoryStore {
    pub fn new(geometry: StoreGeometry, budget: u64) -> Self {
        HostMemoryStore {
            geometry,
            budget,
            used: 0,
            clock: 0,
            next_ticket: 1,
            entries: HashMap::new(),
            tickets: BTreeMap::new(),
        }
    }

    fn check(&self, image: &CheckpointImage) -> Result<(), StoreError> {
        let g = self.geometry;
        let expected = image.consumed_tokens.div_ceil(u64::from(g.page_tokens));
        if image.pages.len() as u64 != expected {
            return Err(StoreError::Geometry(GeometryMismatch::PageCount {
                expected,
                found: image.pages.len() as u64,
            }));
        }
        if let Some((page, p)) = image.pages.iter().enumerate().find(|(_, p)| p.len() as u64 != g.bytes_per_page) {
            return Err(StoreError::Geometry(GeometryMismatch::PageBytes { page, found: p.len() as u64 }));
        }
        if image.row.len() as u64 != g.continuation_row_bytes {
            return Err(StoreError::Geometry(GeometryMismatch::RowBytes { found: image.row.len() as u64 }));
        }
        Ok(())
    }

    fn evict_until(&mut self, needed: u64) -> bool {
        while self.used + needed > self.budget {
            let victim =
                self.entries.iter().filter(|(_, e)| e.pins == 0).min_by_key(|(_, e)| e.last_use).map(|(k, _)| *k);
            let Some(victim) = victim else { return false };
            if let Some(e) = self.entries.remove(&victim) {
                self.used -= e.image.byte_size();
            }
        }
        true
    }
}

impl CheckpointStore for HostMemoryStore {
    fn lookup(&self, key: &CheckpointKey) -> Option<u64> {
        self.entries.get(key).map(|e| e.image.consumed_tokens)
    }

    fn insert(&mut self, key: CheckpointKey, image: CheckpointImage) -> Result<(), StoreError> {
        self.check(&image)?;
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            e.last_use = self.clock;
            return Ok(());
        }
        let needed = image.byte_size();
        if needed > self.budget || !self.evict_until(needed) {
            return Err(StoreError::TooLarge { needed, budget: self.budget });
        }
        self.used += needed;
        self.entries.insert(key, Entry { image, last_use: self.clock, pins: 0 });
        Ok(())
    }

    fn begin_restore(&mut self, key: &CheckpointKey) -> Result<RestoreTicket, StoreError> {
        self.clock += 1;
        let entry = self.entries.get_mut(key).ok_or(StoreError::NotFound)?;
        entry.pins += 1;
        entry.last_use = self.clock;
        let ticket = RestoreTicket(self.next_ticket);
        self.next_ticket += 1;
        self.tickets.insert(ticket, *key);
        Ok(ticket)
    }

    fn poll_restore(&self, ticket: RestoreTicket) -> Result<RestoreState<'_>, StoreError> {
        let key = self.tickets.get(&ticket).ok_or(StoreError::UnknownTicket(ticket))?;
        // A pinned entry cannot be evicted, so a live ticket always finds its image.
        let entry = self.entries.get(key).ok_or(StoreError::UnknownTicket(ticket))?;
        Ok(RestoreState::Ready(&entry.image))
    }

    fn release(&mut self, ticket: RestoreTicket) -> Result<(), StoreError> {
        let key = self.tickets.remove(&ticket).ok_or(StoreError::UnknownTicket(ticket))?;
        if let Some(e) = self.entries.get_mut(&key) {
            e.pins -= 1;
        }
        Ok(())
    }

    fn used_bytes(&self) -> u64 {
        self.used
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const GEOMETRY: StoreGeometry = StoreGeometry { page_tokens: 64, bytes_per_page: 16, continuation_row_bytes: 8 };

    fn image(tokens: u64, fill: u8) -> CheckpointImage {
        CheckpointImage {
            consumed_tokens: tokens,
            pages: vec![vec![fill; 16]; tokens.div_ceil(64) as usize],
            row: vec![fill; 8],
        }
    }

    fn key(n: u8) -> CheckpointKey {
        CheckpointKey([n; 32])
    }

    #[test]
    fn geometry_is_checked() {
        let mut store = HostMemoryStore::new(GEOMETRY, 1 << 20);
        let mut bad = image(65, 1);
        bad.pages.pop();
        assert_eq!(
            store.insert(key(1), bad),
            Err(StoreError::Geometry(GeometryMismatch::PageCount { expected: 2, found: 1 }))
        );
        let mut bad = image(64, 1);
        bad.row.push(0);
        assert!(matches!(
            store.insert(key(1), bad),
            Err(StoreError::Geometry(GeometryMismatch::RowBytes { found: 9 }))
        ));
    }

    #[test]
    fn lru_eviction_spares_pinned_images() {
        // Each 64-token image is 16 + 8 = 24 bytes; the budget holds two.
        let mut store = HostMemoryStore::new(GEOMETRY, 48);
        store.insert(key(1), image(64, 1)).unwrap();
        store.insert(key(2), image(64, 2)).unwrap();
        let ticket = store.begin_restore(&key(1)).unwrap();
        store.insert(key(3), image(64, 3)).unwrap();
        assert_eq!(store.lookup(&key(2)), None, "oldest unpinned image is evicted");
        assert_eq!(store.lookup(&key(1)), Some(64));
        match store.poll_restore(ticket).unwrap() {
            RestoreState::Ready(img) => assert_eq!(img, &image(64, 1)),
            RestoreState::Pending => panic!("host restores are immediate"),
        }
        // Both remaining images pinned: nothing can make room.
        let t3 = store.begin_restore(&key(3)).unwrap();
        assert_eq!(store.insert(key(4), image(64, 4)), Err(StoreError::TooLarge { needed: 24, budget: 48 }));
        store.release(t3).unwrap();
        store.insert(key(4), image(64, 4)).unwrap();
        assert_eq!(store.used_bytes(), 48);
    }

    #[test]
    fn joined_restores_pin_until_the_last_release() {
        let mut store = HostMemoryStore::new(GEOMETRY, 24);
        store.insert(key(1), image(10, 1)).unwrap();
        let a = store.begin_restore(&key(1)).unwrap();
        let b = store.begin_restore(&key(1)).unwrap();
        store.release(a).unwrap();
        assert!(store.insert(key(2), image(10, 2)).is_err(), "still pinned by b");
        store.release(b).unwrap();
        assert_eq!(store.release(b), Err(StoreError::UnknownTicket(b)));
        store.insert(key(2), image(10, 2)).unwrap();
        assert_eq!(store.begin_restore(&key(1)), Err(StoreError::NotFound));
    }
}
