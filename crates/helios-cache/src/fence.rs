//! Reference-counted pools whose entries also wait for GPU completion.

/// Identifies one submitted step; the executor completes fences in increasing order.
/// `Fence(0)` means "never used by the GPU".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence(pub u64);

/// A fixed set of entries `0..len` with logical reference counts and last-use fences.
///
/// One holder may mark its references as *owned* ([`FencedPool::own`]): the prefix cache does,
/// so the pool keeps, without a scan, how many entries the owner holds and how many only the
/// owner holds (occupancy gauges).
///
/// Invariants (checked by [`FencedPool::check_invariants`]):
/// - every entry is in exactly one state: referenced (`refs > 0`), retiring (`refs == 0`,
///   `last_use > completed`, listed in `retiring`) or free (`refs == 0`,
///   `last_use <= completed`, listed in `free`);
/// - `free` and `retiring` hold no duplicates.
#[derive(Clone, Debug)]
pub struct FencedPool {
    refs: Vec<u32>,
    last_use: Vec<Fence>,
    free: Vec<u32>,
    retiring: Vec<u32>,
    completed: Fence,
    /// Allocations of each entry so far: an entry's content is one allocation's, so a copy
    /// taken under one generation is stale under another.
    generation: Vec<u64>,
    /// Of `refs`, the owner's; `owned <= refs`.
    owned: Vec<u32>,
    /// Entries with `owned > 0`, and entries with `refs == owned > 0`.
    owned_entries: usize,
    owned_only: usize,
}

impl FencedPool {
    /// A pool of `len` free entries; allocation hands out the lowest index first.
    pub fn new(len: u32) -> Self {
        Self {
            refs: vec![0; len as usize],
            last_use: vec![Fence(0); len as usize],
            free: (0..len).rev().collect(),
            retiring: Vec::new(),
            completed: Fence(0),
            generation: vec![0; len as usize],
            owned: vec![0; len as usize],
            owned_entries: 0,
            owned_only: 0,
        }
    }

    /// Number of entries.
    pub fn len(&self) -> u32 {
        self.refs.len() as u32
    }

    /// Whether the pool has no entries at all.
    pub fn is_empty(&self) -> bool {
        self.refs.is_empty()
    }

    /// Entries allocatable right now.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Entries with no references still waiting for their fence.
    pub fn retiring_count(&self) -> usize {
        self.retiring.len()
    }

    /// Whether every entry is free.
    pub fn all_free(&self) -> bool {
        self.free.len() == self.refs.len()
    }

    /// Logical references held on `index`.
    pub fn refs(&self, index: u32) -> u32 {
        self.refs[index as usize]
    }

    /// Whether only the owner holds entry `i`.
    fn owned_only_at(&self, i: usize) -> bool {
        self.owned[i] > 0 && self.refs[i] == self.owned[i]
    }

    /// Applies `change` to entry `i`, keeping the owned counters.
    fn tracked(&mut self, i: usize, change: impl FnOnce(&mut Self)) {
        let (was_owned, was_only) = (self.owned[i] > 0, self.owned_only_at(i));
        change(self);
        let (is_owned, is_only) = (self.owned[i] > 0, self.owned_only_at(i));
        self.owned_entries = self.owned_entries + usize::from(is_owned) - usize::from(was_owned);
        self.owned_only = self.owned_only + usize::from(is_only) - usize::from(was_only);
    }

    /// Entries the owner holds a reference on.
    pub fn owned_count(&self) -> usize {
        self.owned_entries
    }

    /// Entries only the owner holds.
    pub fn owned_only_count(&self) -> usize {
        self.owned_only
    }

    /// Marks one of the references held on `index` as the owner's (no new reference).
    pub fn own(&mut self, index: u32) {
        let i = index as usize;
        assert!(self.owned[i] < self.refs[i], "own of entry {index} beyond its references");
        self.tracked(i, |p| p.owned[i] += 1);
    }

    /// Returns one of the owner's references to an ordinary one (before releasing it).
    pub fn disown(&mut self, index: u32) {
        let i = index as usize;
        assert!(self.owned[i] > 0, "disown of entry {index} the owner does not hold");
        self.tracked(i, |p| p.owned[i] -= 1);
    }

    /// Takes a free entry with one reference.
    pub fn allocate(&mut self) -> Option<u32> {
        let index = self.free.pop()?;
        self.refs[index as usize] = 1;
        self.generation[index as usize] += 1;
        Some(index)
    }

    /// How many times `index` was allocated: unchanged while anyone holds it.
    pub fn generation(&self, index: u32) -> u64 {
        self.generation[index as usize]
    }

    /// Adds a reference to an entry that is already referenced (sharing, never resurrection).
    pub fn retain(&mut self, index: u32) {
        let i = index as usize;
        assert!(self.refs[i] > 0, "retain of unreferenced entry {index}");
        self.tracked(i, |p| p.refs[i] += 1);
    }

    /// Drops a reference; `fence` is the last step in which this holder used the entry.
    pub fn release(&mut self, index: u32, fence: Fence) {
        let i = index as usize;
        assert!(self.refs[i] > self.owned[i], "release of unreferenced (or only owned) entry {index}");
        self.tracked(i, |p| p.refs[i] -= 1);
        self.last_use[i] = self.last_use[i].max(fence);
        if self.refs[i] == 0 {
            if self.last_use[i] <= self.completed {
                self.free.push(index);
            } else {
                self.retiring.push(index);
            }
        }
    }

    /// Records that the executor finished every step up to `fence`.
    pub fn signal(&mut self, fence: Fence) {
        if fence <= self.completed {
            return;
        }
        self.completed = fence;
        let last_use = &self.last_use;
        let (done, waiting): (Vec<u32>, Vec<u32>) = self.retiring.iter().partition(|&&i| last_use[i as usize] <= fence);
        self.retiring = waiting;
        self.free.extend(done);
    }

    /// Asserts the invariants in the type documentation.
    pub fn check_invariants(&self) {
        let mut seen = vec![false; self.refs.len()];
        for &i in &self.free {
            assert!(!seen[i as usize], "entry {i} listed twice");
            seen[i as usize] = true;
            assert_eq!(self.refs[i as usize], 0, "free entry {i} is referenced");
            assert!(self.last_use[i as usize] <= self.completed, "free entry {i} is in flight");
        }
        for &i in &self.retiring {
            assert!(!seen[i as usize], "entry {i} listed twice");
            seen[i as usize] = true;
            assert_eq!(self.refs[i as usize], 0, "retiring entry {i} is referenced");
        }
        for (i, &refs) in self.refs.iter().enumerate() {
            assert_eq!(refs > 0, !seen[i], "entry {i} lost or double-tracked");
            assert!(self.owned[i] <= refs, "entry {i} owned beyond its references");
        }
        assert_eq!(self.owned_entries, self.owned.iter().filter(|&&o| o > 0).count(), "owned count out of sync");
        assert_eq!(
            self.owned_only,
            (0..self.refs.len()).filter(|&i| self.owned_only_at(i)).count(),
            "owned-only count out of sync"
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn reuse_waits_for_both_references_and_fence() {
        let mut pool = FencedPool::new(1);
        let a = pool.allocate().unwrap();
        pool.retain(a);
        pool.release(a, Fence(3));
        assert_eq!(pool.allocate(), None, "still referenced");
        pool.release(a, Fence(2));
        assert_eq!(pool.allocate(), None, "fence 3 outstanding");
        pool.signal(Fence(2));
        assert_eq!(pool.allocate(), None, "fence 3 outstanding");
        pool.signal(Fence(3));
        pool.check_invariants();
        assert_eq!(pool.allocate(), Some(a));
        pool.check_invariants();
    }
}
