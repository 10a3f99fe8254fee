//! The host tier: byte images of checkpoints the GPU prefix cache retired.
//!
//! An entry is one retired checkpoint: the complete pages of its chain, its private tail page
//! and its continuation row, under its chained prefix key. Entries of one conversation share
//! their common pages: a page is copied once per *source* (a GPU page and the allocation
//! generation it had), because a page's bytes never change while a checkpoint holds it. Pages
//! with equal prefix digests but different sources are kept apart: they were computed by
//! different requests and need not be bitwise equal, and a restored chain must be exactly the
//! one its row was computed against.
//!
//! Every page also has a [`PageUid`], kept when it goes to disk and comes back: the disk tier
//! shares pages between files by uid the same way.
//!
//! Entries being filled from disk ([`HostTier::begin_fill`]) are pinned and invisible to
//! lookups until [`HostTier::finish_fill`]; their fresh pages are not shared until then.
//!
//! Invariants (asserted by [`HostTier::check_invariants`]):
//! - a host page's `refs` is the number of entries whose chain lists it; pages with no
//!   reference are freed at once; `by_source` indexes exactly the live pages copied from the
//!   GPU; `by_uid` names, per uid, one live page not being filled (two copies of a uid can live
//!   when fills raced; sharing by uid is best effort);
//! - `index` holds exactly the visible (not filling) entries, each under its key;
//! - `lru` holds exactly the unpinned entries, under their last access; of those, only entries
//!   whose copy-out completed (`ready <= completed`) are evicted: until then their extents are
//!   still the target of a device copy, and handing them out again would let two copies (or a
//!   copy and a disk read) write the same bytes;
//! - the allocator's used bytes are the spans of every live page, tail and row extent.

use std::collections::{BTreeSet, HashMap};

use helios_cache::{Fence, ImageSpan, PageId, PrefixIndex, PrefixKey, PromptDigests};

use crate::StoreGeometry;
use crate::arena::{ExtentAllocator, HostExtent};

/// Identifies a host entry; never reused.
pub type HostEntryId = u64;

/// Where a page copy came from: a GPU page and its allocation generation. Two copies with one
/// source hold the same bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageSource {
    pub page: PageId,
    pub generation: u64,
}

/// Identity of a page's bytes across tiers and restarts: assigned when the page is first
/// copied off the GPU, kept by every copy of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageUid(pub u128);

#[derive(Clone, Copy, Debug)]
struct HostPage {
    extent: HostExtent,
    refs: u32,
    /// The GPU page it was copied from (none for pages read from disk).
    source: Option<PageSource>,
    uid: PageUid,
    /// Its bytes are still being read from disk.
    filling: bool,
}

/// One retained checkpoint.
#[derive(Clone, Debug)]
pub struct HostEntry {
    pub key: PrefixKey,
    /// Host pages of its chain, token order (ids into the tier's page table).
    pages: Vec<u64>,
    /// Its private partial page, when the endpoint is not page-aligned.
    pub tail: Option<HostExtent>,
    pub row: HostExtent,
    /// Restores reading it.
    pins: u32,
    last_access: u64,
    /// The step whose copy-out fills it: readers off the model stream wait for this fence.
    pub ready: Fence,
    /// Being filled from disk: pinned, and invisible to lookups.
    filling: bool,
}

/// What a fill from disk must read: the chain pages the host does not hold yet (by chain
/// index), the tail page and the row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fill {
    pub entry: HostEntryId,
    pub pages: Vec<(usize, HostExtent)>,
    pub tail: Option<HostExtent>,
    pub row: HostExtent,
}

/// The copies one demotion needs: GPU pages into new host extents (pages the host already
/// holds from the same source are shared, not copied), the tail page and the row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Demotion {
    pub entry: HostEntryId,
    pub pages: Vec<(PageId, HostExtent)>,
    pub tail: Option<(PageId, HostExtent)>,
    pub row: HostExtent,
}

/// Result of [`HostTier::demote`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DemoteOutcome {
    Copy(Demotion),
    /// The key is already on the host: nothing copied, the entry marked used.
    Present(HostEntryId),
}

/// Why a demotion was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DemoteError {
    #[error("{needed} bytes do not fit the host tier's {capacity} bytes beside its pinned entries")]
    NoRoom { needed: u64, capacity: u64 },
    #[error("a chain of {chain} pages for {tokens} tokens does not match {page_tokens}-token pages")]
    Geometry { chain: usize, tokens: u64, page_tokens: u32 },
}

/// Counters and gauges of one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    pub entries: u64,
    pub resident_bytes: u64,
    pub capacity_bytes: u64,
    /// Checkpoints copied in.
    pub demotions: u64,
    /// Bytes those copies moved (shared pages excluded).
    pub demoted_bytes: u64,
    /// Retired checkpoints not taken: no room beside pinned entries.
    pub demotion_skips: u64,
    /// Entries dropped to make room.
    pub evictions: u64,
    /// Lookups where this tier held the deepest prefix.
    pub hits: u64,
}

/// Host-memory checkpoint tier: an index over extents of a [`crate::HostArena`] that the
/// executor copies into and out of. Plans copies; never touches the bytes.
#[derive(Debug)]
pub struct HostTier {
    geometry: StoreGeometry,
    extents: ExtentAllocator,
    pages: HashMap<u64, HostPage>,
    by_source: HashMap<PageSource, u64>,
    by_uid: HashMap<PageUid, u64>,
    entries: HashMap<HostEntryId, HostEntry>,
    index: PrefixIndex<HostEntryId>,
    /// Unpinned entries by (last access, id): eviction order.
    lru: BTreeSet<(u64, HostEntryId)>,
    next_page: u64,
    /// High half of every uid this tier assigns (distinct per process start).
    uid_seed: u64,
    next_entry: HostEntryId,
    clock: u64,
    /// Newest step the executor completed.
    completed: Fence,
    stats: TierStats,
}

impl HostTier {
    /// An empty tier over `capacity` bytes of arena (from offset 0).
    pub fn new(geometry: StoreGeometry, capacity: u64) -> Self {
        let extents = ExtentAllocator::new(capacity);
        let stats = TierStats { capacity_bytes: extents.capacity(), ..TierStats::default() };
        HostTier {
            geometry,
            extents,
            pages: HashMap::new(),
            by_source: HashMap::new(),
            by_uid: HashMap::new(),
            entries: HashMap::new(),
            index: PrefixIndex::default(),
            lru: BTreeSet::new(),
            next_page: 0,
            uid_seed: uid_seed(),
            next_entry: 1,
            clock: 0,
            completed: Fence(0),
            stats,
        }
    }

    /// The geometry images are laid out in.
    pub fn geometry(&self) -> StoreGeometry {
        self.geometry
    }

    /// Counters and gauges.
    pub fn stats(&self) -> TierStats {
        TierStats { entries: self.entries.len() as u64, resident_bytes: self.extents.used(), ..self.stats }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the tier holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// An entry by id.
    pub fn entry(&self, id: HostEntryId) -> Option<&HostEntry> {
        self.entries.get(&id)
    }

    /// Whether an entry with this key exists.
    pub fn contains(&self, key: &PrefixKey) -> bool {
        self.index.contains(key)
    }

    /// Extents of an entry's chain pages, token order.
    pub fn page_extents(&self, id: HostEntryId) -> Vec<HostExtent> {
        self.chain(id).map(|p| p.extent).collect()
    }

    /// Sources of an entry's chain pages, token order (`None`: read from disk).
    pub fn page_sources(&self, id: HostEntryId) -> Vec<Option<PageSource>> {
        self.chain(id).map(|p| p.source).collect()
    }

    /// Uids of an entry's chain pages, token order.
    pub fn page_uids(&self, id: HostEntryId) -> Vec<PageUid> {
        self.chain(id).map(|p| p.uid).collect()
    }

    /// Visible entries, for write-behind (any order).
    pub fn entry_ids(&self) -> impl Iterator<Item = HostEntryId> + '_ {
        self.index.ids()
    }

    /// An entry's pins (restores and disk writes reading it).
    pub fn pins(&self, id: HostEntryId) -> u32 {
        self.entries.get(&id).map_or(0, |e| e.pins)
    }

    fn chain(&self, id: HostEntryId) -> impl Iterator<Item = &HostPage> {
        self.entries.get(&id).into_iter().flat_map(|e| e.pages.iter().filter_map(|p| self.pages.get(p)))
    }

    fn touch(&mut self, id: HostEntryId) {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(&id) {
            if e.pins == 0 {
                self.lru.remove(&(e.last_access, id));
                self.lru.insert((self.clock, id));
            }
            e.last_access = self.clock;
        }
    }

    /// The deepest entry that is a prefix of `tokens`, at most `max_tokens` long and longer
    /// than `min_tokens`; marks it used and counts a hit. Cost as [`PromptDigests::deepest`].
    pub fn lookup(
        &mut self,
        digests: &PromptDigests,
        tokens: &[u32],
        images: &[ImageSpan],
        max_tokens: usize,
        min_tokens: u64,
    ) -> Option<(HostEntryId, u64)> {
        let entries = &self.entries;
        let id = self.index.deepest(digests, tokens, images, max_tokens, |id| entries[&id].key)?;
        let found = self.entries[&id].key.tokens;
        if found <= min_tokens {
            return None;
        }
        self.touch(id);
        self.stats.hits += 1;
        Some((id, found))
    }

    /// Records that every step up to `fence` completed: entries demoted by them may be evicted.
    pub fn complete(&mut self, fence: Fence) {
        self.completed = self.completed.max(fence);
    }

    /// Pins an entry against eviction (a restore reads it).
    pub fn pin(&mut self, id: HostEntryId) {
        if let Some(e) = self.entries.get_mut(&id) {
            if e.pins == 0 {
                self.lru.remove(&(e.last_access, id));
            }
            e.pins += 1;
        }
    }

    /// Drops a pin.
    pub fn unpin(&mut self, id: HostEntryId) {
        if let Some(e) = self.entries.get_mut(&id) {
            assert!(e.pins > 0, "unpin of unpinned host entry {id}");
            e.pins -= 1;
            if e.pins == 0 {
                self.lru.insert((e.last_access, id));
            }
        }
    }

    fn release_page(&mut self, page: u64) {
        let Some(p) = self.pages.get_mut(&page) else { return };
        p.refs -= 1;
        if p.refs == 0 {
            let p = *p;
            self.pages.remove(&page);
            if let Some(source) = p.source {
                self.by_source.remove(&source);
            }
            // Two copies of one uid can live (a fill that raced another); the index names one.
            if self.by_uid.get(&p.uid) == Some(&page) {
                self.by_uid.remove(&p.uid);
            }
            self.extents.free(p.extent);
        }
    }

    /// Drops an unpinned entry (eviction, or an image found unusable).
    pub fn remove(&mut self, id: HostEntryId) -> bool {
        let Some(e) = self.entries.get(&id).filter(|e| e.pins == 0) else { return false };
        let e = e.clone();
        self.entries.remove(&id);
        self.lru.remove(&(e.last_access, id));
        if !e.filling {
            self.index.remove(&e.key, id);
        }
        for &page in &e.pages {
            self.release_page(page);
        }
        if let Some(t) = e.tail {
            self.extents.free(t);
        }
        self.extents.free(e.row);
        true
    }

    fn new_page(&mut self, extent: HostExtent, source: Option<PageSource>, uid: PageUid, filling: bool) -> u64 {
        let id = self.next_page;
        self.next_page += 1;
        self.pages.insert(id, HostPage { extent, refs: 1, source, uid, filling });
        if let Some(s) = source {
            self.by_source.insert(s, id);
        }
        if !filling {
            self.by_uid.insert(uid, id);
        }
        id
    }

    /// Holds the pages the tier already has (`shared`, by chain position: held, they survive
    /// the evictions that make room) and allocates extents for the others, the tail and the
    /// row. All or nothing: on `Err(needed)` nothing stays held.
    fn hold_and_allocate(
        &mut self,
        shared: &[Option<u64>],
        tail: bool,
    ) -> Result<(Vec<HostExtent>, Option<HostExtent>, HostExtent), u64> {
        for p in shared.iter().flatten() {
            if let Some(page) = self.pages.get_mut(p) {
                page.refs += 1;
            }
        }
        let result = self.allocate_image(shared.iter().filter(|p| p.is_none()).count(), tail);
        if result.is_err() {
            for &p in shared.iter().flatten() {
                self.release_page(p);
            }
        }
        result
    }

    /// Extents for `fresh` pages, then a tail page when `tail`, then a row, evicting as
    /// needed; all or nothing (`None`, with the room counted for the caller's error).
    fn allocate_image(
        &mut self,
        fresh: usize,
        tail: bool,
    ) -> Result<(Vec<HostExtent>, Option<HostExtent>, HostExtent), u64> {
        let page_bytes = self.geometry.bytes_per_page;
        let row_bytes = self.geometry.continuation_row_bytes;
        let count = fresh + usize::from(tail);
        let mut got: Vec<HostExtent> = Vec::with_capacity(count);
        let mut row = None;
        for i in 0..=count {
            let len = if i == count { row_bytes } else { page_bytes };
            match self.allocate(len) {
                Some(e) if i == count => row = Some(e),
                Some(e) => got.push(e),
                None => break,
            }
        }
        let Some(row) = row else {
            let span = |len| HostExtent { offset: 0, len }.span();
            for e in got {
                self.extents.free(e);
            }
            return Err(count as u64 * span(page_bytes) + span(row_bytes));
        };
        let tail_extent = if tail { got.pop() } else { None };
        Ok((got, tail_extent, row))
    }

    /// Prepares an entry to receive a disk image of `key` (chain page uids, and whether it
    /// has a tail page): pages the host already holds under those uids are shared, the rest,
    /// the tail and the row get fresh extents for the caller to read into. The entry is
    /// pinned and invisible until [`Self::finish_fill`] (or dropped by [`Self::abort_fill`]).
    pub fn begin_fill(&mut self, key: PrefixKey, chain: &[PageUid], tail: bool) -> Result<Fill, DemoteError> {
        let pages: Vec<Option<u64>> = chain.iter().map(|uid| self.by_uid.get(uid).copied()).collect();
        let (fresh, tail_extent, row) = self
            .hold_and_allocate(&pages, tail)
            .map_err(|needed| DemoteError::NoRoom { needed, capacity: self.extents.capacity() })?;
        let mut fresh = fresh.into_iter();
        let mut reads = Vec::new();
        let mut ids = Vec::with_capacity(chain.len());
        for (i, (uid, shared)) in chain.iter().zip(pages).enumerate() {
            let id = match (shared, if shared.is_none() { fresh.next() } else { None }) {
                (Some(id), _) => id,
                (None, Some(extent)) => {
                    reads.push((i, extent));
                    self.new_page(extent, None, *uid, true)
                }
                (None, None) => unreachable!("one fresh extent was allocated per unshared page"),
            };
            ids.push(id);
        }
        let id = self.next_entry;
        self.next_entry += 1;
        self.clock += 1;
        let entry = HostEntry {
            key,
            pages: ids,
            tail: tail_extent,
            row,
            pins: 1,
            last_access: self.clock,
            ready: Fence(0),
            filling: true,
        };
        self.entries.insert(id, entry);
        Ok(Fill { entry: id, pages: reads, tail: tail_extent, row })
    }

    /// The fill's bytes arrived: the entry becomes visible (unless its key arrived meanwhile,
    /// then it is dropped) and unpinned, its fresh pages shareable.
    pub fn finish_fill(&mut self, id: HostEntryId) {
        let Some(e) = self.entries.get_mut(&id).filter(|e| e.filling) else { return };
        e.filling = false;
        let (key, pages) = (e.key, e.pages.clone());
        for page in pages {
            if let Some(p) = self.pages.get_mut(&page).filter(|p| p.filling) {
                p.filling = false;
                let uid = p.uid;
                self.by_uid.entry(uid).or_insert(page);
            }
        }
        let duplicate = self.index.contains(&key);
        self.unpin(id);
        if duplicate {
            // Hidden entries are not indexed; drop it without touching the visible one.
            if let Some(e) = self.entries.get_mut(&id) {
                e.filling = true;
            }
            self.remove(id);
        } else {
            self.index.insert(&key, id);
        }
    }

    /// The fill failed: the entry and its fresh pages are dropped.
    pub fn abort_fill(&mut self, id: HostEntryId) {
        if self.entries.get(&id).is_some_and(|e| e.filling) {
            self.unpin(id);
            self.remove(id);
        }
    }

    /// Drops every unpinned entry (the caller's steps all completed).
    pub fn clear(&mut self) {
        let unpinned: Vec<HostEntryId> = self.lru.iter().map(|&(_, id)| id).collect();
        for id in unpinned {
            self.remove(id);
        }
    }

    /// An extent of `len` bytes, evicting least recently used unpinned entries as needed.
    fn allocate(&mut self, len: u64) -> Option<HostExtent> {
        loop {
            if let Some(e) = self.extents.allocate(len) {
                return Some(e);
            }
            let completed = self.completed;
            let entries = &self.entries;
            let &(_, victim) = self.lru.iter().find(|(_, id)| entries.get(id).is_some_and(|e| e.ready <= completed))?;
            self.remove(victim);
            self.stats.evictions += 1;
        }
    }

    /// Plans the demotion of a retired checkpoint: its chain pages (with their sources), its
    /// tail page and its row, copied by the step `ready`. All or nothing: on `NoRoom` the tier
    /// is as before, except for entries evicted while looking for room.
    pub fn demote(
        &mut self,
        key: PrefixKey,
        chain: &[PageSource],
        tail_page: Option<PageId>,
        ready: Fence,
    ) -> Result<DemoteOutcome, DemoteError> {
        let pt = u64::from(self.geometry.page_tokens.max(1));
        if chain.len() as u64 != key.tokens / pt || tail_page.is_some() == key.tokens.is_multiple_of(pt) {
            return Err(DemoteError::Geometry {
                chain: chain.len(),
                tokens: key.tokens,
                page_tokens: self.geometry.page_tokens,
            });
        }
        if let Some(id) = self.index.get(&key) {
            self.touch(id);
            return Ok(DemoteOutcome::Present(id));
        }
        let pages: Vec<Option<u64>> = chain.iter().map(|source| self.by_source.get(source).copied()).collect();
        let (fresh, tail_extent, row) = match self.hold_and_allocate(&pages, tail_page.is_some()) {
            Ok(image) => image,
            Err(needed) => {
                self.stats.demotion_skips += 1;
                return Err(DemoteError::NoRoom { needed, capacity: self.extents.capacity() });
            }
        };
        let mut fresh = fresh.into_iter();
        let mut copies = Vec::new();
        let mut ids = Vec::with_capacity(chain.len());
        for (source, shared) in chain.iter().zip(pages) {
            let id = match (shared, if shared.is_none() { fresh.next() } else { None }) {
                (Some(id), _) => id,
                (None, Some(extent)) => {
                    let uid = PageUid(u128::from(self.uid_seed) << 64 | u128::from(self.next_page));
                    copies.push((source.page, extent));
                    self.new_page(extent, Some(*source), uid, false)
                }
                (None, None) => unreachable!("one fresh extent was allocated per unshared page"),
            };
            ids.push(id);
        }
        let tail = tail_page.zip(tail_extent);
        let id = self.next_entry;
        self.next_entry += 1;
        self.clock += 1;
        self.entries.insert(
            id,
            HostEntry {
                key,
                pages: ids,
                tail: tail_extent,
                row,
                pins: 0,
                last_access: self.clock,
                ready,
                filling: false,
            },
        );
        self.index.insert(&key, id);
        self.lru.insert((self.clock, id));
        let page_bytes = self.geometry.bytes_per_page;
        self.stats.demotions += 1;
        self.stats.demoted_bytes +=
            (copies.len() as u64 + u64::from(tail.is_some())) * page_bytes + self.geometry.continuation_row_bytes;
        Ok(DemoteOutcome::Copy(Demotion { entry: id, pages: copies, tail, row }))
    }

    /// Asserts that each entry's pins are `expected` (absent: none), as the pin holders count them.
    pub fn check_pins(&self, expected: &HashMap<HostEntryId, u32>) {
        for (id, e) in &self.entries {
            assert_eq!(e.pins, expected.get(id).copied().unwrap_or(0), "pins of host entry {id}");
        }
        assert!(expected.keys().all(|id| self.entries.contains_key(id)), "a pin holder's host entry is gone");
    }

    /// Asserts the invariants in the module documentation.
    pub fn check_invariants(&self) {
        self.extents.check_invariants();
        let visible = self.entries.values().filter(|e| !e.filling).count();
        assert_eq!(self.index.len(), visible, "key index out of sync");
        self.index.check_invariants();
        let mut refs: HashMap<u64, u32> = HashMap::new();
        let mut used = 0;
        let mut lru = BTreeSet::new();
        for (&id, e) in &self.entries {
            if e.filling {
                assert!(e.pins > 0, "a filling entry is pinned");
            } else {
                assert!(self.index.holds(&e.key, id), "host entry {id} not indexed under its key");
            }
            for p in &e.pages {
                *refs.entry(*p).or_default() += 1;
            }
            used += e.tail.map_or(0, |t| t.span()) + e.row.span();
            if e.pins == 0 {
                lru.insert((e.last_access, id));
            }
        }
        assert_eq!(lru, self.lru, "eviction order out of sync");
        assert_eq!(refs.len(), self.pages.len(), "a host page without an entry, or an entry's page missing");
        for (id, p) in &self.pages {
            assert_eq!(refs.get(id), Some(&p.refs), "refs of host page {id}");
            if let Some(source) = p.source {
                assert_eq!(self.by_source.get(&source), Some(id), "source index of host page {id}");
            }
            used += p.extent.span();
        }
        assert_eq!(self.by_source.len(), self.pages.values().filter(|p| p.source.is_some()).count());
        for (uid, p) in &self.by_uid {
            assert!(self.pages.get(p).is_some_and(|p| !p.filling && p.uid == *uid), "uid index out of sync");
        }
        assert_eq!(used, self.extents.used(), "allocated bytes out of sync");
    }
}

/// A per-process value for the high half of page uids: start time and process id.
fn uid_seed() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 48)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::arena::UNIT_BYTES;
    use helios_cache::PrefixIdentity;

    const PT: u32 = 64;
    const GEOMETRY: StoreGeometry = StoreGeometry { page_tokens: PT, bytes_per_page: 100, continuation_row_bytes: 30 };
    const ID: PrefixIdentity = PrefixIdentity { model: 3, token_layout: 1 };

    fn tokens() -> Vec<u32> {
        (0..400).map(|i| i * 13 % 97).collect()
    }

    fn key(len: usize) -> PrefixKey {
        PromptDigests::key_of(ID, &tokens(), &[], len)
    }

    fn chain(len: usize, first_page: u32, generation: u64) -> Vec<PageSource> {
        (0..len as u32 / PT).map(|i| PageSource { page: first_page + i, generation }).collect()
    }

    fn tail(len: usize) -> Option<PageId> {
        (!(len as u32).is_multiple_of(PT)).then_some(99)
    }

    fn demote(tier: &mut HostTier, len: usize, first_page: u32, generation: u64) -> Result<DemoteOutcome, DemoteError> {
        tier.demote(key(len), &chain(len, first_page, generation), tail(len), Fence(1))
    }

    #[test]
    fn a_conversation_copies_each_page_once() {
        let mut tier = HostTier::new(GEOMETRY, 64 * UNIT_BYTES);
        let DemoteOutcome::Copy(a) = demote(&mut tier, 130, 0, 1).unwrap() else { panic!() };
        assert_eq!(a.pages.len(), 2);
        assert!(a.tail.is_some());
        // The next turn's checkpoint shares the first two pages (same GPU pages, same generations).
        let DemoteOutcome::Copy(b) = demote(&mut tier, 300, 0, 1).unwrap() else { panic!() };
        assert_eq!(b.pages.iter().map(|p| p.0).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(tier.page_extents(b.entry)[..2], tier.page_extents(a.entry)[..]);
        assert_eq!(demote(&mut tier, 300, 0, 1).unwrap(), DemoteOutcome::Present(b.entry));
        // The same prefix computed by another request (other pages): copied, not shared.
        tier.remove(b.entry);
        let DemoteOutcome::Copy(c) = demote(&mut tier, 300, 10, 1).unwrap() else { panic!() };
        assert_eq!(c.pages.len(), 4);
        tier.check_invariants();
        let digests = PromptDigests::new(ID, &tokens(), &[]);
        assert_eq!(tier.lookup(&digests, &tokens(), &[], 400, 0), Some((c.entry, 300)));
        assert_eq!(tier.lookup(&digests, &tokens(), &[], 299, 0), Some((a.entry, 130)));
        assert_eq!(tier.lookup(&digests, &tokens(), &[], 400, 300), None, "not deeper than the GPU hit");
        assert_eq!(tier.stats().hits, 2);
    }

    #[test]
    fn eviction_spares_pinned_entries_and_rolls_back_when_full() {
        // 2 units per page (100 bytes -> one unit), rows one unit: a 64-token entry takes 2 units.
        let mut tier = HostTier::new(GEOMETRY, 4 * UNIT_BYTES);
        tier.complete(Fence(1));
        let DemoteOutcome::Copy(a) = demote(&mut tier, 64, 0, 1).unwrap() else { panic!() };
        let DemoteOutcome::Copy(b) = demote(&mut tier, 128, 10, 1).unwrap() else { panic!() };
        // b took three units; the full tier evicts a (least recent) to fit c.
        assert!(tier.entry(a.entry).is_none());
        tier.pin(b.entry);
        assert_eq!(
            demote(&mut tier, 64, 20, 1),
            Err(DemoteError::NoRoom { needed: 2 * UNIT_BYTES, capacity: 4 * UNIT_BYTES })
        );
        tier.check_invariants();
        assert_eq!(tier.stats().demotion_skips, 1);
        tier.unpin(b.entry);
        assert!(matches!(demote(&mut tier, 64, 20, 1), Ok(DemoteOutcome::Copy(_))));
        assert!(tier.entry(b.entry).is_none());
        tier.check_invariants();
        assert!(matches!(
            tier.demote(key(64), &chain(128, 0, 1), None, Fence(1)),
            Err(DemoteError::Geometry { chain: 2, tokens: 64, .. })
        ));
    }

    #[test]
    fn a_shared_page_survives_the_eviction_that_makes_room() {
        // a (one page + row = 2 units) fills half; b extends a's chain by one page: it shares
        // page 0, needs 2 more units, and must not lose page 0 when a is evicted for them.
        let mut tier = HostTier::new(GEOMETRY, 3 * UNIT_BYTES);
        tier.complete(Fence(1));
        let DemoteOutcome::Copy(a) = demote(&mut tier, 64, 0, 1).unwrap() else { panic!() };
        let DemoteOutcome::Copy(b) = demote(&mut tier, 128, 0, 1).unwrap() else { panic!() };
        assert!(tier.entry(a.entry).is_none(), "a was evicted for room");
        assert_eq!(b.pages.len(), 1, "page 0 shared");
        assert_eq!(tier.page_sources(b.entry), chain(128, 0, 1).into_iter().map(Some).collect::<Vec<_>>());
        tier.check_invariants();
    }

    #[test]
    fn fills_share_held_pages_and_stay_hidden_until_finished() {
        let mut tier = HostTier::new(GEOMETRY, 64 * UNIT_BYTES);
        let DemoteOutcome::Copy(a) = demote(&mut tier, 130, 0, 1).unwrap() else { panic!() };
        let uids = tier.page_uids(a.entry);
        // A deeper image of the same conversation comes back from disk: it shares a's two
        // pages by uid and reads only its own.
        let mut chain = uids.clone();
        chain.extend([PageUid(7), PageUid(8)]);
        let fill = tier.begin_fill(key(300), &chain, true).unwrap();
        assert_eq!(fill.pages.iter().map(|p| p.0).collect::<Vec<_>>(), vec![2, 3]);
        assert!(fill.tail.is_some());
        let digests = PromptDigests::new(ID, &tokens(), &[]);
        assert_eq!(tier.lookup(&digests, &tokens(), &[], 400, 0), Some((a.entry, 130)), "hidden while filling");
        // A second fill of the same pages does not share bytes still being read.
        let other = tier.begin_fill(key(256), &chain[..4], false).unwrap();
        assert_eq!(other.pages.len(), 4 - 2);
        tier.check_invariants();
        tier.abort_fill(other.entry);
        tier.finish_fill(fill.entry);
        assert_eq!(tier.lookup(&digests, &tokens(), &[], 400, 0), Some((fill.entry, 300)));
        assert_eq!(tier.page_uids(fill.entry), chain);
        tier.check_invariants();
        tier.clear();
        assert_eq!(tier.stats().resident_bytes, 0);
    }

    #[test]
    fn an_entry_is_not_evicted_before_its_copy_out_completed() {
        // Room for one single-page entry. The second demotion of the same step cannot take the
        // first one's extents: the device may still be writing them.
        let mut tier = HostTier::new(GEOMETRY, 2 * UNIT_BYTES);
        let DemoteOutcome::Copy(a) = tier.demote(key(64), &chain(64, 0, 1), None, Fence(5)).unwrap() else { panic!() };
        assert!(matches!(tier.demote(key(128), &chain(128, 10, 1), None, Fence(5)), Err(DemoteError::NoRoom { .. })));
        tier.complete(Fence(5));
        assert!(matches!(tier.demote(key(64 * 3), &[], None, Fence(6)), Err(DemoteError::Geometry { .. })));
        let b = tier.demote(PromptDigests::key_of(ID, &tokens(), &[], 1), &[], tail(1), Fence(6)).unwrap();
        assert!(matches!(b, DemoteOutcome::Copy(_)));
        assert!(tier.entry(a.entry).is_none(), "evicted once its copy completed");
        tier.check_invariants();
    }
}
