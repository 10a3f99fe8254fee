//! The continuation-row pool: null row, live rows per request slot, immutable snapshot rows.

use helios_contract::model::CacheScheme;

use crate::fence::FencedPool;

/// Row pool with the fixed layout of [`CacheScheme`]: row 0 is the null state, request slot
/// `s` owns rows `first_live_row(s) .. first_live_row(s) + rows_per_slot()`, snapshot `i`
/// is row `snapshot_row(C, i)`. Slots and snapshots are separate [`FencedPool`]s, so a slot or
/// snapshot is reusable only after its holders released it and its last fence completed.
#[derive(Clone, Debug)]
pub struct RowPool {
    scheme: CacheScheme,
    request_slots: u32,
    /// Request slots (index = slot).
    pub slots: FencedPool,
    /// Snapshot rows (index = snapshot index, not absolute row).
    pub snapshots: FencedPool,
}

impl RowPool {
    /// Sizes the pool from the scheme and the loaded capacities.
    pub fn new(scheme: &CacheScheme, request_slots: u32, snapshot_rows: u32) -> Self {
        Self {
            scheme: scheme.clone(),
            request_slots,
            slots: FencedPool::new(request_slots),
            snapshots: FencedPool::new(snapshot_rows),
        }
    }

    /// First live row of `slot`.
    pub fn live_row(&self, slot: u32) -> u32 {
        self.scheme.first_live_row(slot)
    }

    /// Absolute row of snapshot `index`.
    pub fn snapshot_row(&self, index: u32) -> u32 {
        self.scheme.snapshot_row(self.request_slots, index)
    }

    /// Rows in the whole pool, null row included.
    pub fn total_rows(&self) -> u32 {
        self.scheme.total_rows(self.request_slots, self.snapshots.len())
    }

    /// Whether every slot and snapshot row is free.
    pub fn all_free(&self) -> bool {
        self.slots.all_free() && self.snapshots.all_free()
    }
}
