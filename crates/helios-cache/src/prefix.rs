//! The prefix cache: immutable, content-addressed checkpoints in parent-linked page chains.
//!
//! A checkpoint at consumed length `S` owns:
//! - a *segment*: the complete pages `full(parent.S) .. full(S)` of the chain (where
//!   `full(n) = n / page_tokens`), shared read-only with requests that use them;
//! - a private *tail page* exactly when `S % page_tokens != 0` (restore copies it);
//! - one snapshot row holding the continuation state at `S`.
//!
//! Invariants (asserted by [`PrefixCache::check_invariants`]):
//! - parent links form a forest; `parent.tokens < child.tokens`; children lists mirror them;
//! - `segment.len() == full(S) - full(parent.S)` (parent of a root has `S = 0`);
//! - `tail_page.is_some() == (S % page_tokens != 0)`;
//! - `index` holds exactly the live checkpoints, each under its key;
//! - the eviction index holds exactly the unpinned leaves and one-child ancestors, under keys
//!   computed from their current state (so choosing a victim is a lookup, not a scan);
//! - the cache holds one logical reference on each segment page, tail page and snapshot row.

use std::collections::{BTreeSet, HashMap};

use crate::digest::ImageSpan;
use crate::digest::{PrefixIndex, PrefixKey, PromptDigests};
use crate::fence::{Fence, FencedPool};

/// Index of a KV page.
pub type PageId = u32;
/// Identifies a checkpoint; never reused.
pub type CheckpointId = u64;

/// One immutable checkpoint.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub id: CheckpointId,
    pub parent: Option<CheckpointId>,
    pub children: Vec<CheckpointId>,
    pub key: PrefixKey,
    pub segment: Vec<PageId>,
    pub tail_page: Option<PageId>,
    /// Snapshot index in the row pool.
    pub snapshot: u32,
    /// Direct pins (requests anchored here, publications in flight below it).
    pub pins: u32,
    pub last_access: u64,
    /// Last GPU step that read or wrote this checkpoint's storage.
    pub last_use: Fence,
}

impl Checkpoint {
    /// Consumed tokens at this endpoint.
    pub fn tokens(&self) -> u64 {
        self.key.tokens
    }
}

/// A snapshot whose copy fence completed, ready to become a checkpoint. The caller already
/// holds one reference on each segment page, the tail page and the snapshot row; publishing
/// hands them to the cache (or releases them for a duplicate).
#[derive(Clone, Debug)]
pub struct Publication {
    pub key: PrefixKey,
    pub parent: Option<CheckpointId>,
    pub segment: Vec<PageId>,
    pub tail_page: Option<PageId>,
    pub snapshot: u32,
    pub fence: Fence,
}

/// Result of [`PrefixCache::publish`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishOutcome {
    Published(CheckpointId),
    /// An equal endpoint already existed; only the publication's own storage was released.
    Duplicate(CheckpointId),
}

/// A checkpoint the cache just retired, described for demotion to a lower tier.
///
/// Its storage was released at the checkpoint's last use, so a page may be handed out again
/// in the step being planned: the caller copies it out at the start of that step, before any
/// op can write it. Generations identify the page contents copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retired {
    pub key: PrefixKey,
    /// Complete pages of its chain in token order, with their allocation generations.
    pub chain: Vec<(PageId, u64)>,
    pub tail_page: Option<PageId>,
    pub snapshot: u32,
}

/// Eviction counters, page and snapshot pressure kept apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PressureStats {
    pub page_leaf_evictions: u64,
    pub page_ancestor_removals: u64,
    pub snapshot_thinnings: u64,
    pub snapshot_leaf_evictions: u64,
    pub duplicate_publications: u64,
}

/// Where one checkpoint sits in the eviction index (absent: pinned, or more than one child).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Indexed {
    /// Key in `EvictionIndex::lru`.
    lru: (u64, CheckpointId),
    /// A leaf: its key in `leaves`; a one-child ancestor: its key in `thin`.
    leaf: bool,
    thin: Option<ThinKey>,
}

/// Thinning order: interior before root, shortest surviving parent..child interval, then least
/// recent use, then id.
type ThinKey = (bool, u64, u64, CheckpointId);

/// Victims in eviction order, maintained on every change to a checkpoint's pins, children,
/// parent or recency. Invariant: exactly the evictable checkpoints, each under the key its
/// current state gives (checked against a scan by [`PrefixCache::check_invariants`]).
#[derive(Clone, Debug, Default)]
struct EvictionIndex {
    /// Unpinned leaves and one-child ancestors by (last access, id): page pressure's victim.
    lru: BTreeSet<(u64, CheckpointId)>,
    /// Unpinned leaves by (last access, id): snapshot pressure's victim when nothing thins.
    leaves: BTreeSet<(u64, CheckpointId)>,
    /// Unpinned one-child ancestors by [`ThinKey`]: snapshot pressure's first choice.
    thin: BTreeSet<ThinKey>,
    at: HashMap<CheckpointId, Indexed>,
}

impl EvictionIndex {
    fn remove(&mut self, id: CheckpointId) {
        if let Some(old) = self.at.remove(&id) {
            self.lru.remove(&old.lru);
            if old.leaf {
                self.leaves.remove(&old.lru);
            }
            if let Some(t) = old.thin {
                self.thin.remove(&t);
            }
        }
    }

    fn insert(&mut self, id: CheckpointId, entry: Indexed) {
        self.lru.insert(entry.lru);
        if entry.leaf {
            self.leaves.insert(entry.lru);
        }
        if let Some(t) = entry.thin {
            self.thin.insert(t);
        }
        self.at.insert(id, entry);
    }
}

/// Content-addressed checkpoint store. Storage lives in pools the caller owns.
#[derive(Clone, Debug)]
pub struct PrefixCache {
    page_tokens: u64,
    checkpoints: HashMap<CheckpointId, Checkpoint>,
    index: PrefixIndex<CheckpointId>,
    eviction: EvictionIndex,
    next_id: CheckpointId,
    clock: u64,
    stats: PressureStats,
    /// Retirements not yet taken; `None` when nobody demotes them.
    retired: Option<Vec<Retired>>,
    /// Checkpoints with a pin.
    pinned: usize,
}

impl PrefixCache {
    /// An empty cache for pages of `page_tokens` tokens.
    pub fn new(page_tokens: u32) -> Self {
        Self {
            page_tokens: u64::from(page_tokens.max(1)),
            checkpoints: HashMap::new(),
            index: PrefixIndex::default(),
            eviction: EvictionIndex::default(),
            next_id: 1,
            clock: 0,
            stats: PressureStats::default(),
            retired: None,
            pinned: 0,
        }
    }

    /// Checkpoints with a pin (kept, not counted).
    pub fn pinned(&self) -> usize {
        self.pinned
    }

    /// Keeps a description of every checkpoint retired from now on, for [`Self::take_retired`].
    pub fn record_retirements(&mut self) {
        self.retired.get_or_insert_with(Vec::new);
    }

    /// Pages (chain and tail) of the checkpoints retired and not yet taken: an upper bound on
    /// what demoting them copies (pages their chains share count once per checkpoint).
    pub fn retired_pages(&self) -> usize {
        self.retired.as_ref().map_or(0, |r| r.iter().map(|c| c.chain.len() + usize::from(c.tail_page.is_some())).sum())
    }

    /// Checkpoints retired since the last call, in retirement order.
    pub fn take_retired(&mut self) -> Vec<Retired> {
        self.retired.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn note_retired(&mut self, id: CheckpointId, pages: &FencedPool) {
        let Some(cp) = self.checkpoints.get(&id).filter(|_| self.retired.is_some()) else { return };
        let (key, tail_page, snapshot) = (cp.key, cp.tail_page, cp.snapshot);
        let chain = self.chain_pages(id).into_iter().map(|p| (p, pages.generation(p))).collect();
        let retired = Retired { key, chain, tail_page, snapshot };
        if let Some(list) = self.retired.as_mut() {
            list.push(retired);
        }
    }

    /// The index entry `id`'s current state gives (None: not evictable now).
    fn index_entry(&self, id: CheckpointId) -> Option<Indexed> {
        let cp = self.checkpoints.get(&id)?;
        let leaf = Self::evictable_leaf(cp);
        if !leaf && !Self::removable_ancestor(cp) {
            return None;
        }
        let thin = (!leaf).then(|| {
            let parent_tokens = cp.parent.and_then(|p| self.checkpoints.get(&p)).map_or(0, Checkpoint::tokens);
            let child_tokens = self.checkpoints.get(&cp.children[0]).map_or(cp.tokens(), Checkpoint::tokens);
            (cp.parent.is_none(), child_tokens - parent_tokens, cp.last_access, cp.id)
        });
        Some(Indexed { lru: (cp.last_access, cp.id), leaf, thin })
    }

    /// Brings the eviction index up to date for checkpoints whose state changed.
    fn reindex(&mut self, ids: &[Option<CheckpointId>]) {
        for id in ids.iter().flatten() {
            self.eviction.remove(*id);
            if let Some(entry) = self.index_entry(*id) {
                self.eviction.insert(*id, entry);
            }
        }
    }

    fn full_pages(&self, tokens: u64) -> usize {
        (tokens / self.page_tokens) as usize
    }

    /// Number of live checkpoints.
    pub fn len(&self) -> usize {
        self.checkpoints.len()
    }

    /// Whether the cache holds no checkpoint.
    pub fn is_empty(&self) -> bool {
        self.checkpoints.is_empty()
    }

    /// Eviction counters.
    pub fn stats(&self) -> PressureStats {
        self.stats
    }

    /// A checkpoint by id.
    pub fn get(&self, id: CheckpointId) -> Option<&Checkpoint> {
        self.checkpoints.get(&id)
    }

    /// All live checkpoints (any order).
    pub fn checkpoints(&self) -> impl Iterator<Item = &Checkpoint> {
        self.checkpoints.values()
    }

    /// Whether an endpoint with this key exists.
    pub fn contains(&self, key: &PrefixKey) -> bool {
        self.index.contains(key)
    }

    /// Longest checkpoint that is a prefix of `tokens` with at most `max_tokens` tokens.
    /// Marks it recently used.
    pub fn lookup(
        &mut self,
        digests: &PromptDigests,
        tokens: &[u32],
        images: &[ImageSpan],
        max_tokens: usize,
    ) -> Option<CheckpointId> {
        let checkpoints = &self.checkpoints;
        let id = self.index.deepest(digests, tokens, images, max_tokens, |id| checkpoints[&id].key)?;
        self.touch(id, Fence(0));
        Some(id)
    }

    /// Marks a checkpoint used now, by the GPU up to `fence`.
    pub fn touch(&mut self, id: CheckpointId, fence: Fence) {
        self.clock += 1;
        if let Some(cp) = self.checkpoints.get_mut(&id) {
            cp.last_access = self.clock;
            cp.last_use = cp.last_use.max(fence);
            // A parent thins by its own recency, and its child's key does not read it.
            self.reindex(&[Some(id)]);
        }
    }

    /// Adds a direct pin: pinned checkpoints are never evicted or bypassed.
    pub fn pin(&mut self, id: CheckpointId) {
        if let Some(cp) = self.checkpoints.get_mut(&id) {
            self.pinned += usize::from(cp.pins == 0);
            cp.pins += 1;
            self.reindex(&[Some(id)]);
        }
    }

    /// Drops a direct pin.
    pub fn unpin(&mut self, id: CheckpointId) {
        if let Some(cp) = self.checkpoints.get_mut(&id) {
            assert!(cp.pins > 0, "unpin of unpinned checkpoint {id}");
            cp.pins -= 1;
            self.pinned -= usize::from(cp.pins == 0);
            self.reindex(&[Some(id)]);
        }
    }

    /// Complete pages of the chain ending at `id`, in token order.
    pub fn chain_pages(&self, id: CheckpointId) -> Vec<PageId> {
        let mut segments = Vec::new();
        let mut at = Some(id);
        while let Some(cp) = at.and_then(|i| self.checkpoints.get(&i)) {
            segments.push(&cp.segment);
            at = cp.parent;
        }
        segments.into_iter().rev().flatten().copied().collect()
    }

    /// Publishes a completed snapshot. A duplicate endpoint releases only the publication's
    /// own storage; the existing checkpoint and its pages stay untouched.
    pub fn publish(
        &mut self,
        publication: Publication,
        pages: &mut FencedPool,
        snapshots: &mut FencedPool,
    ) -> PublishOutcome {
        let Publication { key, parent, segment, tail_page, snapshot, fence } = publication;
        if let Some(existing) = self.index.get(&key) {
            for page in segment {
                pages.release(page, fence);
            }
            if let Some(tail) = tail_page {
                pages.release(tail, fence);
            }
            snapshots.release(snapshot, fence);
            self.stats.duplicate_publications += 1;
            self.touch(existing, Fence(0));
            return PublishOutcome::Duplicate(existing);
        }
        let parent_tokens = parent.and_then(|p| self.checkpoints.get(&p)).map_or(0, |p| p.tokens());
        assert!(parent_tokens < key.tokens, "checkpoint must extend its parent");
        assert_eq!(
            segment.len(),
            self.full_pages(key.tokens) - self.full_pages(parent_tokens),
            "segment must cover exactly the pages completed since the parent"
        );
        let id = self.next_id;
        self.next_id += 1;
        self.clock += 1;
        if let Some(p) = parent.and_then(|p| self.checkpoints.get_mut(&p)) {
            p.children.push(id);
        }
        self.index.insert(&key, id);
        // The publication's references become the cache's own.
        for &page in segment.iter().chain(tail_page.iter()) {
            pages.own(page);
        }
        self.checkpoints.insert(
            id,
            Checkpoint {
                id,
                parent,
                children: Vec::new(),
                key,
                segment,
                tail_page,
                snapshot,
                pins: 0,
                last_access: self.clock,
                last_use: fence,
            },
        );
        // The parent gained a child (no longer a leaf; a second child: no longer thinnable).
        self.reindex(&[Some(id), parent]);
        PublishOutcome::Published(id)
    }

    fn unindex(&mut self, cp: &Checkpoint) {
        self.index.remove(&cp.key, cp.id);
    }

    /// Evicts a leaf: releases its segment, tail page and snapshot.
    fn evict_leaf(&mut self, id: CheckpointId, pages: &mut FencedPool, snapshots: &mut FencedPool) {
        self.note_retired(id, pages);
        let Some(cp) = self.checkpoints.remove(&id) else { return };
        debug_assert!(cp.children.is_empty() && cp.pins == 0);
        self.unindex(&cp);
        if let Some(p) = cp.parent.and_then(|p| self.checkpoints.get_mut(&p)) {
            p.children.retain(|&c| c != id);
        }
        // The parent lost a child: it may now be a leaf or thinnable; its parent's interval
        // does not read it.
        self.reindex(&[Some(id), cp.parent]);
        for &page in cp.segment.iter().chain(cp.tail_page.iter()) {
            pages.disown(page);
            pages.release(page, cp.last_use);
        }
        snapshots.release(cp.snapshot, cp.last_use);
    }

    /// Removes a one-child ancestor: its segment and last-use fence move to the child, the
    /// chain bypasses it, and only its snapshot and tail page are retired.
    fn remove_ancestor(&mut self, id: CheckpointId, pages: &mut FencedPool, snapshots: &mut FencedPool) {
        self.note_retired(id, pages);
        let Some(cp) = self.checkpoints.remove(&id) else { return };
        debug_assert!(cp.children.len() == 1 && cp.pins == 0);
        self.unindex(&cp);
        let child_id = cp.children[0];
        if let Some(child) = self.checkpoints.get_mut(&child_id) {
            let mut segment = cp.segment.clone();
            segment.append(&mut child.segment);
            child.segment = segment;
            child.parent = cp.parent;
            child.last_use = child.last_use.max(cp.last_use);
        }
        if let Some(p) = cp.parent.and_then(|p| self.checkpoints.get_mut(&p)) {
            for c in &mut p.children {
                if *c == id {
                    *c = child_id;
                }
            }
        }
        // The child's parent moved up (its interval widened); the parent's only child is now
        // further away (its interval widened too).
        self.reindex(&[Some(id), Some(child_id), cp.parent]);
        if let Some(tail) = cp.tail_page {
            pages.disown(tail);
            pages.release(tail, cp.last_use);
        }
        snapshots.release(cp.snapshot, cp.last_use);
    }

    fn removable_ancestor(cp: &Checkpoint) -> bool {
        cp.children.len() == 1 && cp.pins == 0
    }

    fn evictable_leaf(cp: &Checkpoint) -> bool {
        cp.children.is_empty() && cp.pins == 0
    }

    /// One retirement under snapshot-row pressure: thin a chain (interior before root,
    /// shortest surviving parent..child interval, then least recent use); otherwise evict
    /// the least recently used unpinned leaf. Returns false when nothing is evictable.
    pub fn evict_for_snapshot(&mut self, pages: &mut FencedPool, snapshots: &mut FencedPool) -> bool {
        if let Some(&(_, _, _, id)) = self.eviction.thin.first() {
            self.remove_ancestor(id, pages, snapshots);
            self.stats.snapshot_thinnings += 1;
            return true;
        }
        match self.eviction.leaves.first() {
            Some(&(_, id)) => {
                self.evict_leaf(id, pages, snapshots);
                self.stats.snapshot_leaf_evictions += 1;
                true
            }
            None => false,
        }
    }

    /// One retirement under KV-page pressure: the least recently used unpinned leaf or
    /// removable ancestor. The caller rechecks physical backing after each call.
    pub fn evict_for_pages(&mut self, pages: &mut FencedPool, snapshots: &mut FencedPool) -> bool {
        let Some(&(_, id)) = self.eviction.lru.first() else { return false };
        if self.eviction.at.get(&id).is_some_and(|e| e.leaf) {
            self.evict_leaf(id, pages, snapshots);
            self.stats.page_leaf_evictions += 1;
        } else {
            self.remove_ancestor(id, pages, snapshots);
            self.stats.page_ancestor_removals += 1;
        }
        true
    }

    /// Evicts every unpinned checkpoint that can go (draining).
    pub fn evict_all(&mut self, pages: &mut FencedPool, snapshots: &mut FencedPool) {
        while self.evict_for_pages(pages, snapshots) {}
    }

    /// Asserts the invariants in the module documentation; returns the logical references the
    /// cache holds per page and per snapshot, for the owner's pool cross-check.
    pub fn check_invariants(&self, page_refs: &mut [u32], snapshot_refs: &mut [u32]) {
        assert_eq!(self.index.len(), self.checkpoints.len(), "key index out of sync");
        self.index.check_invariants();
        // The eviction index, against a scan of every checkpoint.
        let mut expected = EvictionIndex::default();
        for &id in self.checkpoints.keys() {
            if let Some(entry) = self.index_entry(id) {
                expected.insert(id, entry);
            }
        }
        assert_eq!(self.eviction.at, expected.at, "eviction index out of sync");
        assert_eq!(self.eviction.lru, expected.lru, "eviction LRU order out of sync");
        assert_eq!(self.eviction.leaves, expected.leaves, "eviction leaf order out of sync");
        assert_eq!(self.eviction.thin, expected.thin, "thinning order out of sync");
        for cp in self.checkpoints.values() {
            assert!(self.index.holds(&cp.key, cp.id), "checkpoint {} not indexed under its key", cp.id);
            let parent_tokens = match cp.parent {
                Some(p) => {
                    let parent = self.checkpoints.get(&p).expect("parent of live checkpoint exists");
                    assert!(parent.children.contains(&cp.id), "child missing from parent");
                    parent.tokens()
                }
                None => 0,
            };
            assert!(parent_tokens < cp.tokens(), "checkpoint does not extend parent");
            assert_eq!(
                cp.segment.len(),
                self.full_pages(cp.tokens()) - self.full_pages(parent_tokens),
                "segment length of checkpoint {}",
                cp.id
            );
            assert_eq!(cp.tail_page.is_some(), !cp.tokens().is_multiple_of(self.page_tokens));
            for &c in &cp.children {
                assert_eq!(self.checkpoints[&c].parent, Some(cp.id), "child link broken");
            }
            for &page in cp.segment.iter().chain(cp.tail_page.iter()) {
                page_refs[page as usize] += 1;
            }
            snapshot_refs[cp.snapshot as usize] += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::digest::PrefixIdentity;

    const PT: u32 = 64;

    struct Fixture {
        tokens: Vec<u32>,
        digests: PromptDigests,
        pages: FencedPool,
        snapshots: FencedPool,
        cache: PrefixCache,
    }

    impl Fixture {
        fn new(snapshot_rows: u32) -> Self {
            let tokens: Vec<u32> = (0..1000).collect();
            let digests = PromptDigests::new(PrefixIdentity::default(), &tokens, &[]);
            Self {
                tokens,
                digests,
                pages: FencedPool::new(64),
                snapshots: FencedPool::new(snapshot_rows),
                cache: PrefixCache::new(PT),
            }
        }

        /// Publishes `end` under `parent` with fresh pages for its segment.
        fn publish(&mut self, parent: Option<CheckpointId>, end: usize) -> PublishOutcome {
            let parent_end = parent.map_or(0, |p| self.cache.get(p).unwrap().tokens() as usize);
            let segment = (parent_end / 64..end / 64).map(|_| self.pages.allocate().unwrap()).collect();
            let tail_page = (!end.is_multiple_of(64)).then(|| self.pages.allocate().unwrap());
            let publication = Publication {
                key: self.digests.key_at(&self.tokens, &[], end),
                parent,
                segment,
                tail_page,
                snapshot: self.snapshots.allocate().unwrap(),
                fence: Fence(0),
            };
            self.cache.publish(publication, &mut self.pages, &mut self.snapshots)
        }

        fn id(outcome: PublishOutcome) -> CheckpointId {
            match outcome {
                PublishOutcome::Published(id) | PublishOutcome::Duplicate(id) => id,
            }
        }

        fn check(&self) {
            let mut page_refs = vec![0; 64];
            let mut snapshot_refs = vec![0; self.snapshots.len() as usize];
            self.cache.check_invariants(&mut page_refs, &mut snapshot_refs);
            for p in 0..64 {
                assert_eq!(page_refs[p as usize], self.pages.refs(p));
            }
        }
    }

    #[test]
    fn lookup_finds_longest_prefix_across_block_boundaries() {
        let mut f = Fixture::new(8);
        let a = Fixture::id(f.publish(None, 63));
        let b = Fixture::id(f.publish(Some(a), 65));
        let c = Fixture::id(f.publish(Some(b), 200));
        f.check();
        let (tokens, digests) = (f.tokens.clone(), f.digests.clone());
        assert_eq!(f.cache.lookup(&digests, &tokens, &[], 1000), Some(c));
        assert_eq!(f.cache.lookup(&digests, &tokens, &[], 199), Some(b));
        assert_eq!(f.cache.lookup(&digests, &tokens, &[], 64), Some(a));
        assert_eq!(f.cache.lookup(&digests, &tokens, &[], 62), None);
        assert_eq!(f.cache.chain_pages(c).len(), 3);
    }

    #[test]
    fn duplicate_publication_releases_only_its_reservation() {
        let mut f = Fixture::new(4);
        let a = Fixture::id(f.publish(None, 100));
        let free = f.pages.free_count();
        assert_eq!(f.publish(None, 100), PublishOutcome::Duplicate(a));
        assert_eq!(f.pages.free_count(), free, "duplicate's own pages were returned");
        assert_eq!(f.snapshots.free_count(), 3);
        f.check();
    }

    #[test]
    fn snapshot_pressure_thins_shortest_interior_interval_first() {
        let mut f = Fixture::new(8);
        let root = Fixture::id(f.publish(None, 100));
        let x = Fixture::id(f.publish(Some(root), 300));
        let y = Fixture::id(f.publish(Some(x), 320));
        let leaf = Fixture::id(f.publish(Some(y), 900));
        // Interior x spans 100..320 = 220, interior y spans 300..900 = 600: thin x first.
        assert!(f.cache.evict_for_snapshot(&mut f.pages, &mut f.snapshots));
        assert!(f.cache.get(x).is_none());
        assert_eq!(f.cache.get(y).unwrap().parent, Some(root));
        f.check();
        // Then y (interior) before the root.
        assert!(f.cache.evict_for_snapshot(&mut f.pages, &mut f.snapshots));
        assert!(f.cache.get(y).is_none());
        assert_eq!(f.cache.chain_pages(leaf).len(), 900 / 64, "descendant chain kept intact");
        f.cache.pin(leaf);
        // Root has one child, no pin: removable as a chain root.
        assert!(f.cache.evict_for_snapshot(&mut f.pages, &mut f.snapshots));
        assert!(!f.cache.evict_for_snapshot(&mut f.pages, &mut f.snapshots), "pinned leaf stays");
        f.check();
        f.cache.unpin(leaf);
        f.cache.evict_all(&mut f.pages, &mut f.snapshots);
        assert!(f.pages.all_free() && f.snapshots.all_free());
    }

    #[test]
    fn page_pressure_evicts_lru_leaf_and_keeps_branching_ancestors() {
        let mut f = Fixture::new(8);
        let root = Fixture::id(f.publish(None, 128));
        let left = Fixture::id(f.publish(Some(root), 200));
        let right = Fixture::id(f.publish(Some(root), 260));
        f.cache.touch(left, Fence(0));
        assert!(f.cache.evict_for_pages(&mut f.pages, &mut f.snapshots));
        assert!(f.cache.get(right).is_none(), "least recently used leaf goes first");
        assert!(f.cache.get(root).is_some());
        f.check();
    }
}
