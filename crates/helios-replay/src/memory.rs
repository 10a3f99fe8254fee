//! The load-time memory plan: how much of a core's arena is physically backed.
//!
//! Everything in the arena is backed except, when free memory is short, the tail of the KV
//! page range: KV pages are backed from page 0 as far as free memory (less the configured
//! reserve and the driver margin) allows, in whole pages, and the served page pool shrinks to
//! the backed count. The unbacked hole is granularity-aligned and lies strictly inside the KV
//! buffer, so every other buffer (and the neighbours of the KV buffer that share its first or
//! last granule) stays backed.
//!
//! Invariants (asserted by the tests): `backed_bytes + hole length == arena bytes`; page
//! `kv_pages - 1` ends at or before the hole; the plan never backs fewer pages than one
//! full-context request needs, and never more than the core prepared. A core whose padding
//! slot lies in a page past the backed ones is refused rather than faulting later.

use helios_contract::model::{BufferRole, Manifest};

/// Device memory the driver keeps for itself beyond what the core maps (contexts, modules, graphs).
pub const DRIVER_MARGIN_BYTES: u64 = 64 << 20;

/// What to back at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Arena bytes rounded up to the allocation granularity.
    pub arena_bytes: u64,
    /// Bytes physically backed.
    pub backed_bytes: u64,
    /// KV pages served (at most the core's `max_kv_pages`).
    pub kv_pages: u32,
    /// Arena offsets `[start, end)` left unbacked, when KV pages were cut.
    pub hole: Option<(u64, u64)>,
}

/// Why no plan fits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "the core needs {needed} bytes of device memory; {free} are free, less the {reserve}-byte reserve \
         and the {margin}-byte driver margin"
    )]
    InsufficientMemory { needed: u64, free: u64, reserve: u64, margin: u64 },
    #[error("the core's padding slot {slot} lies in KV page {page}, past the {backed} pages that fit")]
    PaddingSlotUnbacked { slot: i64, page: u64, backed: u32 },
}

fn up(x: u64, g: u64) -> u64 {
    x.div_ceil(g) * g
}

fn down(x: u64, g: u64) -> u64 {
    x / g * g
}

/// Default host-tier size: a quarter of the host memory available now, at most
/// [`HOST_TIER_DEFAULT_CAP`]; none where the device shares the host's memory (a host copy of
/// device data would spend the same DRAM twice). Rounded down to whole 4 KiB units.
pub fn plan_host_tier(available_host: u64, unified_memory: bool) -> u64 {
    if unified_memory {
        return 0;
    }
    (available_host / 4).min(HOST_TIER_DEFAULT_CAP) / 4096 * 4096
}

/// Largest default host tier: page-locking it at startup takes time and memory from the host.
pub const HOST_TIER_DEFAULT_CAP: u64 = 16 << 30;

/// Host memory available for new allocations (`MemAvailable` of `/proc/meminfo`), when known.
pub fn host_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Plans the backing of `manifest`'s arena for `free` device bytes; see the module docs.
pub fn plan_memory(manifest: &Manifest, granularity: u64, free: u64, reserve: u64) -> Result<MemoryPlan, PlanError> {
    let g = granularity.max(1);
    let arena = up(manifest.arena.byte_size, g);
    let usable = free.saturating_sub(reserve).saturating_sub(DRIVER_MARGIN_BYTES);
    let prepared = manifest.capacities.max_kv_pages;
    let full = MemoryPlan { arena_bytes: arena, backed_bytes: arena, kv_pages: prepared, hole: None };
    let short = |needed| PlanError::InsufficientMemory { needed, free, reserve, margin: DRIVER_MARGIN_BYTES };
    if arena <= usable {
        return Ok(full);
    }
    let bytes_per_page = manifest.cache_scheme.bytes_per_page();
    let kv = manifest.buffers.iter().find(|b| b.role == BufferRole::KvPages);
    let (Some(kv), true) = (kv, bytes_per_page > 0) else { return Err(short(arena)) };
    let hole_end = down(kv.offset + kv.byte_size, g);
    // Backing for the first `n` pages: everything but the granules wholly past page n.
    let plan = |n: u32| {
        let start = up(kv.offset + u64::from(n) * bytes_per_page, g);
        let hole = (start < hole_end).then_some((start, hole_end));
        let backed = arena - hole.map_or(0, |(s, e)| e - s);
        MemoryPlan { arena_bytes: arena, backed_bytes: backed, kv_pages: n, hole }
    };
    let minimum = manifest.capacities.pages_per_request(manifest.cache_scheme.page_tokens) as u32;
    let minimum = minimum.min(prepared);
    if plan(minimum).backed_bytes > usable {
        return Err(short(plan(minimum).backed_bytes));
    }
    // The largest n with plan(n) fitting: backed bytes grow with n.
    let (mut lo, mut hi) = (minimum, prepared);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if plan(mid).backed_bytes <= usable {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let chosen = plan(lo);
    let slot = manifest.cache_scheme.padding_slot;
    if slot >= 0 {
        let page = slot as u64 / u64::from(manifest.cache_scheme.page_tokens.max(1));
        if page >= u64::from(chosen.kv_pages) {
            return Err(PlanError::PaddingSlotUnbacked { slot, page, backed: chosen.kv_pages });
        }
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use helios_contract::fixtures::{Fixture, FixtureSpec};

    const MIB: u64 = 1 << 20;

    fn manifest() -> Manifest {
        let f = Fixture::build(&FixtureSpec { max_kv_pages: 64, context_limit: 512, ..FixtureSpec::default() });
        helios_contract::validate(&f.manifest).unwrap()
    }

    fn kv(m: &Manifest) -> (u64, u64) {
        let b = m.buffers.iter().find(|b| b.role == BufferRole::KvPages).unwrap();
        (b.offset, b.byte_size)
    }

    #[test]
    fn the_default_host_tier_is_a_capped_quarter_and_none_on_unified_memory() {
        assert_eq!(plan_host_tier(8 << 30, false), 2 << 30);
        assert_eq!(plan_host_tier(1 << 40, false), HOST_TIER_DEFAULT_CAP);
        assert_eq!(plan_host_tier(1 << 40, true), 0);
        assert_eq!(plan_host_tier(4 * 4096 + 12, false) % 4096, 0);
    }

    #[test]
    fn everything_is_backed_when_it_fits() {
        let m = manifest();
        let p = plan_memory(&m, 4096, 1 << 40, 0).unwrap();
        assert_eq!((p.kv_pages, p.hole, p.backed_bytes), (m.capacities.max_kv_pages, None, p.arena_bytes));
    }

    #[test]
    fn short_memory_cuts_kv_pages_inside_the_kv_buffer() {
        let m = manifest();
        let g = 4096;
        let full = plan_memory(&m, g, 1 << 40, 0).unwrap();
        let bpp = m.cache_scheme.bytes_per_page();
        let (off, size) = kv(&m);
        let minimum = m.capacities.pages_per_request(m.cache_scheme.page_tokens) as u32;
        // Free memory for about half of the pages beyond what the rest needs.
        let rest = full.arena_bytes - size;
        let free = rest + size / 2 + DRIVER_MARGIN_BYTES;
        let p = plan_memory(&m, g, free, 0).unwrap();
        assert!(p.kv_pages >= minimum && p.kv_pages < m.capacities.max_kv_pages, "{p:?}");
        assert!(p.backed_bytes <= free - DRIVER_MARGIN_BYTES);
        let (start, end) = p.hole.unwrap();
        assert_eq!(p.backed_bytes + (end - start), p.arena_bytes);
        assert!(start >= off + u64::from(p.kv_pages) * bpp && end <= off + size);
        assert!(start % g == 0 && end % g == 0);
        // One more page would not fit (or would not change the granules backed).
        let start_more = up(off + u64::from(p.kv_pages + 1) * bpp, g);
        let backed_more = p.arena_bytes - end.saturating_sub(start_more);
        assert!(backed_more > free - DRIVER_MARGIN_BYTES, "{p:?}: {} more pages fit", 1);
        // A reserve takes the same memory away.
        let q = plan_memory(&m, g, free + 8 * MIB, 8 * MIB).unwrap();
        assert_eq!(q, p);
    }

    #[test]
    fn the_reserve_and_the_driver_margin_are_kept() {
        let m = manifest();
        let arena = plan_memory(&m, 4096, 1 << 40, 0).unwrap().arena_bytes;
        let reserve = 4 << 30;
        let exact = plan_memory(&m, 4096, arena + reserve + DRIVER_MARGIN_BYTES, reserve).unwrap();
        assert_eq!(exact.hole, None);
        let tight = plan_memory(&m, 4096, arena + reserve + DRIVER_MARGIN_BYTES - 1, reserve).unwrap();
        assert!(tight.hole.is_some() && tight.backed_bytes < arena, "{tight:?}");
    }

    #[test]
    fn fewer_pages_than_one_request_is_a_typed_error() {
        let m = manifest();
        let (_, size) = kv(&m);
        let full = plan_memory(&m, 4096, 1 << 40, 0).unwrap();
        let e = plan_memory(&m, 4096, full.arena_bytes - size + DRIVER_MARGIN_BYTES, 0).unwrap_err();
        assert!(matches!(e, PlanError::InsufficientMemory { .. }), "{e}");
        assert!(plan_memory(&m, 4096, 0, 0).is_err());
    }

    #[test]
    fn a_padding_slot_past_the_backed_pages_is_refused() {
        let mut m = manifest();
        let (_, size) = kv(&m);
        let full = plan_memory(&m, 4096, 1 << 40, 0).unwrap();
        let free = full.arena_bytes - size / 2 + DRIVER_MARGIN_BYTES;
        let p = plan_memory(&m, 4096, free, 0).unwrap();
        m.cache_scheme.padding_slot = i64::from(m.capacities.max_kv_pages - 1) * i64::from(m.cache_scheme.page_tokens);
        let e = plan_memory(&m, 4096, free, 0).unwrap_err();
        assert!(matches!(e, PlanError::PaddingSlotUnbacked { backed, .. } if backed == p.kv_pages), "{e}");
    }
}
