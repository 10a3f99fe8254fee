//! Host memory the transfer operations address, and the allocator that hands it out.
//!
//! One [`HostArena`] is allocated at startup, before readiness (an executor that copies
//! asynchronously page-locks it then), and never grows. Extents start and end on
//! [`UNIT_BYTES`] boundaries, the alignment `O_DIRECT` I/O needs, so a disk tier can read and
//! write them in place.

use std::collections::BTreeMap;
use std::ptr::NonNull;

/// Allocation unit and alignment of every extent.
pub const UNIT_BYTES: u64 = 4096;

/// A byte range of the arena: starts on a unit boundary; `len` is the bytes it holds (the
/// allocation spans `len` rounded up to a unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostExtent {
    pub offset: u64,
    pub len: u64,
}

impl HostExtent {
    /// Bytes the allocation spans.
    pub fn span(&self) -> u64 {
        self.len.div_ceil(UNIT_BYTES).max(1) * UNIT_BYTES
    }
}

/// Why the arena could not be created.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArenaError {
    #[error("a host arena of {0} bytes cannot be laid out on this platform")]
    Layout(u64),
    #[error("the host refused {0} bytes for the host cache tier")]
    OutOfMemory(u64),
}

/// Fixed host memory: an anonymous private mapping, zero-filled and committed page by page as
/// it is first touched (or all at once when a device page-locks it).
///
/// Ownership of the bytes is not tracked here: the scheduler owns every extent and orders the
/// accesses to it (transfer ops run in step order; a disk tier touches an extent only while it
/// holds it). The unsafe accessors state that contract.
pub struct HostArena {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the arena is plain memory; concurrent access to one extent is excluded by the
// ownership contract of the unsafe accessors.
unsafe impl Send for HostArena {}
// SAFETY: as above.
unsafe impl Sync for HostArena {}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArena").field("bytes", &self.len).finish()
    }
}

impl HostArena {
    /// Maps `bytes` (rounded up to a unit, at least one) of zeroed memory. Nothing is
    /// committed until touched, so creating a large arena is cheap.
    pub fn new(bytes: u64) -> Result<Self, ArenaError> {
        let size = bytes.div_ceil(UNIT_BYTES).max(1) * UNIT_BYTES;
        let len = usize::try_from(size).map_err(|_| ArenaError::Layout(size))?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing; the
        // result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ArenaError::OutOfMemory(size));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(ArenaError::OutOfMemory(size))?;
        Ok(HostArena { ptr, len })
    }

    /// Bytes in the arena.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether the arena holds no bytes (never: creation rounds up to one unit).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the memory, for registering it with a device.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, e: HostExtent) {
        assert!(
            e.offset.checked_add(e.len).is_some_and(|end| end <= self.len()),
            "extent {e:?} outside the {}-byte arena",
            self.len()
        );
    }

    /// The bytes of `extent`.
    ///
    /// # Safety
    /// Nothing writes `extent` while the slice lives (its owner orders the accesses).
    ///
    /// # Panics
    /// If the extent lies outside the arena.
    pub unsafe fn bytes(&self, extent: HostExtent) -> &[u8] {
        self.check(extent);
        // SAFETY: in bounds (checked); no concurrent writer (caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(extent.offset as usize), extent.len as usize) }
    }

    /// The bytes of `extent`, writable.
    ///
    /// # Safety
    /// Nothing else reads or writes `extent` while the slice lives.
    ///
    /// # Panics
    /// If the extent lies outside the arena.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, extent: HostExtent) -> &mut [u8] {
        self.check(extent);
        // SAFETY: in bounds (checked); exclusive (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(extent.offset as usize), extent.len as usize) }
    }
}

impl Drop for HostArena {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length; no slice of it outlives the arena.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// First-fit allocator of unit-aligned extents over `0..capacity`, coalescing on free.
///
/// Invariants (checked by [`ExtentAllocator::check_invariants`]): free runs are disjoint,
/// non-adjacent (coalesced), unit-aligned and inside the capacity; `used` is the capacity less
/// the free runs.
#[derive(Clone, Debug)]
pub struct ExtentAllocator {
    capacity: u64,
    /// Free runs: offset → length, both in bytes.
    free: BTreeMap<u64, u64>,
    used: u64,
}

impl ExtentAllocator {
    /// An allocator over `capacity` bytes (rounded down to a unit).
    pub fn new(capacity: u64) -> Self {
        let capacity = capacity / UNIT_BYTES * UNIT_BYTES;
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        ExtentAllocator { capacity, free, used: 0 }
    }

    /// Bytes under management.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes allocated (spans, not lengths).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// An extent holding `len` bytes, or `None` when no free run is long enough.
    pub fn allocate(&mut self, len: u64) -> Option<HostExtent> {
        let extent = HostExtent { offset: 0, len };
        let span = extent.span();
        let (&offset, &run) = self.free.iter().find(|&(_, &run)| run >= span)?;
        self.free.remove(&offset);
        if run > span {
            self.free.insert(offset + span, run - span);
        }
        self.used += span;
        Some(HostExtent { offset, len })
    }

    /// Returns an extent this allocator handed out.
    pub fn free(&mut self, extent: HostExtent) {
        let (mut offset, mut span) = (extent.offset, extent.span());
        self.used -= span;
        if let Some((&prev, &run)) = self.free.range(..offset).next_back()
            && prev + run == offset
        {
            self.free.remove(&prev);
            offset = prev;
            span += run;
        }
        if let Some(&run) = self.free.get(&(offset + span)) {
            self.free.remove(&(offset + span));
            span += run;
        }
        self.free.insert(offset, span);
    }

    /// Asserts the invariants in the type documentation.
    pub fn check_invariants(&self) {
        let mut end = None;
        let mut free = 0;
        for (&offset, &run) in &self.free {
            assert!(offset.is_multiple_of(UNIT_BYTES) && run.is_multiple_of(UNIT_BYTES) && run > 0);
            assert!(end.is_none_or(|e| e < offset), "free runs overlap or are not coalesced");
            end = Some(offset + run);
            free += run;
        }
        assert!(end.is_none_or(|e| e <= self.capacity), "free run past the capacity");
        assert_eq!(self.used + free, self.capacity, "used bytes out of sync");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn extents_are_aligned_and_coalesce() {
        let mut a = ExtentAllocator::new(10 * UNIT_BYTES + 5);
        assert_eq!(a.capacity(), 10 * UNIT_BYTES);
        let x = a.allocate(1).unwrap();
        let y = a.allocate(2 * UNIT_BYTES + 1).unwrap();
        let z = a.allocate(UNIT_BYTES).unwrap();
        assert_eq!((x.offset, y.offset, z.offset), (0, UNIT_BYTES, 4 * UNIT_BYTES));
        assert_eq!(a.used(), 5 * UNIT_BYTES);
        assert!(a.allocate(6 * UNIT_BYTES).is_none());
        a.free(y);
        a.check_invariants();
        // The hole of three units is reused first-fit.
        assert_eq!(a.allocate(3 * UNIT_BYTES).unwrap().offset, UNIT_BYTES);
        a.free(HostExtent { offset: UNIT_BYTES, len: 3 * UNIT_BYTES });
        a.free(x);
        a.free(z);
        a.check_invariants();
        assert_eq!(a.used(), 0);
        assert_eq!(a.allocate(10 * UNIT_BYTES).unwrap().offset, 0, "everything coalesced");
    }

    #[test]
    fn arena_bytes_round_trip() {
        let arena = HostArena::new(3 * UNIT_BYTES - 1).unwrap();
        assert_eq!(arena.len(), 3 * UNIT_BYTES);
        let e = HostExtent { offset: UNIT_BYTES, len: 10 };
        // SAFETY: single-threaded test; no other slice of the extent lives.
        unsafe { arena.bytes_mut(e).copy_from_slice(&[7; 10]) };
        // SAFETY: as above.
        assert_eq!(unsafe { arena.bytes(e) }, &[7; 10]);
        // SAFETY: as above.
        assert_eq!(unsafe { arena.bytes(HostExtent { offset: 0, len: 4 }) }, &[0; 4]);
    }
}
