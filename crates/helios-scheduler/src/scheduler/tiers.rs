//! The tiers below the GPU prefix cache, as the scheduler drives them: demotion of retired
//! checkpoints to the host tier, restore tickets (host → GPU), and the disk tier's fetches
//! (disk → host) and write-behind (host → disk).

use std::time::{Duration, Instant};

use helios_offload::{
    BlockRead, DiskDone, DiskIdentity, DiskIo, DiskJob, DiskStats, DiskTier, HostExtent, WritePlan, source_extent,
};

use super::*;

/// Disk writes in flight at once: write-behind never queues more on the I/O thread.
const DISK_WRITES_IN_FLIGHT: usize = 2;
/// Host entries waiting for their disk write, at most; beyond it the oldest go unwritten.
const DISK_WRITE_QUEUE: usize = 4096;

/// The disk tier as the scheduler drives it.
#[derive(Debug)]
pub(super) struct DiskState {
    pub(super) tier: DiskTier,
    pub(super) io: DiskIo,
    pub(super) identity: DiskIdentity,
    /// Host entries demoted and not yet written, oldest first (write-behind order).
    pub(super) queue: VecDeque<HostEntryId>,
    /// Writes in flight by token: the plan and the host entry they pin.
    pub(super) writes: HashMap<u64, (WritePlan, HostEntryId)>,
    /// Fetches (disk → host) in flight.
    pub(super) fetches: Vec<DiskFetch>,
    pub(super) next_token: u64,
    pub(super) stats: DiskCounters,
    /// Durations of fetches finished since the last take (for metrics).
    pub(super) fetched: Vec<Duration>,
    /// I/O failures since the last take (for the log).
    pub(super) errors: Vec<helios_offload::IoFailure>,
    /// Measured fetch rate (bytes per second, a running average of finished fetches).
    pub(super) fetch_rate: Option<f64>,
    /// Measured prefill rate (tokens per second), reported by the serving loop.
    pub(super) prefill_rate: Option<f64>,
}

/// A checkpoint being read from disk into a host entry; requests wait on it like on a
/// restore ticket, and leave it the same way. Once its bytes landed it keeps the host entry
/// pinned until each waiter looked it up again, so host pressure cannot evict a fetched
/// checkpoint before the requests that asked for it start restoring it.
#[derive(Debug)]
pub(super) struct DiskFetch {
    pub(super) token: u64,
    pub(super) key: helios_cache::PrefixKey,
    pub(super) entry: HostEntryId,
    pub(super) waiters: Vec<RequestId>,
    pub(super) started: Instant,
    pub(super) landed: bool,
    /// Bytes it reads.
    pub(super) bytes: u64,
}

/// Scheduler-side disk counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCounters {
    /// Fetches started (disk → host), and requests that joined one running.
    pub fetches: u64,
    pub fetch_joins: u64,
    /// Fetches that failed (I/O error, checksum): the prefix is recomputed.
    pub fetch_failures: u64,
    /// Disk hits not fetched: no host room for them.
    pub fetch_skips: u64,
    /// Disk hits not fetched because recomputing the tokens they add is measured to be faster.
    pub fetch_declined: u64,
}

/// Bytes of restore copies one step carries (at least one copy per restore in progress), so a
/// long checkpoint comes in over several steps instead of stalling one: on the device the
/// copies overlap the step's replays.
pub const RESTORE_BYTES_PER_STEP: u64 = 64 << 20;

/// A restore from the host tier: host bytes copied into GPU storage over one or more steps,
/// the last being `publication.fence`. The scheduler owns it, not a request: requests sharing
/// the prefix join it, and a request that leaves only detaches (the copy and its storage are
/// unaffected).
///
/// Holds, until its last copy's fence completes: references on `publication`'s pages and
/// snapshot row, a pin on its parent checkpoint and one on the host entry. Then it publishes an
/// ordinary, unpinned checkpoint and ends: its waiters find it at their next lookup. A pin held
/// for them could deadlock admission on a small pool (two restored prefixes, each waiting for
/// pages the other's pin keeps), and retention is a preference, never a reservation.
#[derive(Clone, Debug)]
pub(super) struct RestoreTicket {
    pub(super) entry: HostEntryId,
    pub(super) publication: Publication,
    /// Copies not yet planned into a step: pages, then the row.
    pub(super) pending: VecDeque<(HostExtent, PageId)>,
    pub(super) row: Option<(HostExtent, u32)>,
    /// The step of its first copy.
    pub(super) started: Option<Fence>,
    pub(super) copied_tokens: u64,
    pub(super) waiters: Vec<RequestId>,
}

/// The copies of one step's [`StepOp::CopyOut`], gathered while it is planned.
#[derive(Debug, Default)]
pub(super) struct CopyOut {
    pub(super) pages: Vec<(PageId, HostExtent)>,
    pub(super) rows: Vec<(u32, HostExtent)>,
}

impl Scheduler {
    /// Adds a host tier of `capacity_bytes` below the prefix cache: checkpoints the cache
    /// retires are copied out to it ([`StepOp::CopyOut`]), and a prompt whose deepest cached
    /// prefix is on the host is restored from it ([`StepOp::CopyIn`]) before admission. The
    /// executor's host arena must hold at least `capacity_bytes`.
    pub fn with_host_tier(mut self, capacity_bytes: u64) -> Self {
        self.prefix.record_retirements();
        self.host = Some(HostTier::new(StoreGeometry::from(&self.scheme), capacity_bytes));
        self
    }

    /// Host tier counters and gauges, when there is one.
    pub fn host_stats(&self) -> Option<TierStats> {
        self.host.as_ref().map(HostTier::stats)
    }

    /// Restores that published since the last call.
    pub fn take_restored(&mut self) -> Vec<RestoreDone> {
        std::mem::take(&mut self.restored)
    }

    /// Drops every host entry no restore is reading; returns the tier's stats afterwards
    /// (draining, tests). `None` without a host tier.
    pub fn clear_host_tier(&mut self) -> Option<TierStats> {
        let host = self.host.as_mut()?;
        host.clear();
        Some(host.stats())
    }

    /// Publishes the restores whose copies completed by `fence` as ordinary checkpoints; their
    /// tickets end.
    pub(super) fn publish_restores(&mut self, fence: Fence) {
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.tickets)
            .into_iter()
            .partition(|t| t.pending.is_empty() && t.row.is_none() && t.publication.fence <= fence);
        self.tickets = running;
        for t in done {
            let parent = t.publication.parent;
            let tokens = t.publication.key.tokens;
            // A duplicate (the prefix was computed meanwhile) releases only the restored storage.
            self.prefix.publish(t.publication, &mut self.pages, &mut self.rows.snapshots);
            if let Some(p) = parent {
                self.prefix.unpin(p);
            }
            if let Some(host) = self.host.as_mut() {
                host.unpin(t.entry);
            }
            let started = t.started.unwrap_or(fence);
            self.restored.push(RestoreDone { fence: started, tokens, copied_tokens: t.copied_tokens });
        }
    }

    /// Plans this step's restore copies: for each restore in progress, oldest first, its next
    /// copies within the step's byte budget (at least one copy each, so every restore
    /// advances). A restore's last copy sets the fence it publishes at.
    pub(super) fn plan_restore_copies(&mut self, fence: Fence, ops: &mut Vec<StepOp>) {
        let mut budget = self.restore_budget;
        let (mut pages, mut rows) = (Vec::new(), Vec::new());
        for t in &mut self.tickets {
            if t.pending.is_empty() && t.row.is_none() {
                continue;
            }
            let mut first = true;
            while let Some(&(extent, page)) = t.pending.front() {
                if !first && extent.len > budget {
                    break;
                }
                budget = budget.saturating_sub(extent.len);
                pages.push((extent, page));
                t.pending.pop_front();
                first = false;
            }
            if t.pending.is_empty()
                && let Some((extent, row)) = t.row
                && (first || extent.len <= budget)
            {
                budget = budget.saturating_sub(extent.len);
                rows.push((extent, row));
                t.row = None;
            }
            t.started.get_or_insert(fence);
            t.publication.fence = fence;
        }
        // First in the step (after the copy-out): on the device the copy-in then overlaps the
        // step's replays instead of waiting for them.
        if !pages.is_empty() || !rows.is_empty() {
            ops.insert(0, StepOp::CopyIn { pages, rows });
        }
    }

    /// Sets the bytes of restore copies one step carries (tests use small budgets).
    pub fn set_restore_budget(&mut self, bytes: u64) {
        self.restore_budget = bytes;
    }

    /// `id` no longer waits on a restore (admitted, or gone).
    pub(super) fn leave_restore(&mut self, id: RequestId) {
        for t in &mut self.tickets {
            t.waiters.retain(|&w| w != id);
        }
        if let Some(disk) = self.disk.as_mut() {
            for f in disk.fetches.iter_mut().filter(|f| !f.landed) {
                f.waiters.retain(|&w| w != id);
            }
        }
        self.leave_fetches(id);
    }

    /// Plans the copy-out of what the cache retired since the last call into `out` (pages,
    /// rows); [`Self::schedule`] places it ahead of every other op of the step.
    pub(super) fn demote_retired(&mut self, fence: Fence, out: &mut CopyOut) {
        let retired = self.prefix.take_retired();
        let Some(host) = self.host.as_mut() else { return };
        let CopyOut { pages, rows } = out;
        let mut demoted = Vec::new();
        for r in retired {
            let chain: Vec<PageSource> =
                r.chain.iter().map(|&(page, generation)| PageSource { page, generation }).collect();
            // No room beside pinned entries: the checkpoint is dropped, as without a host tier
            // (counted by the tier). A geometry mismatch is a planning bug.
            match host.demote(r.key, &chain, r.tail_page, fence) {
                Ok(DemoteOutcome::Copy(d)) => {
                    pages.extend(d.pages);
                    pages.extend(d.tail);
                    rows.push((self.rows.snapshot_row(r.snapshot), d.row));
                    demoted.push(d.entry);
                }
                Ok(DemoteOutcome::Present(_)) | Err(helios_offload::DemoteError::NoRoom { .. }) => {}
                Err(e @ helios_offload::DemoteError::Geometry { .. }) => {
                    debug_assert!(false, "retired checkpoint does not match the scheme: {e}");
                }
            }
        }
        for entry in demoted {
            self.queue_disk_write(entry);
        }
    }

    /// Starts (or joins) the restore of host entry `entry` for request `id`; `hit` is the
    /// request's deepest GPU prefix. Returns false when the GPU storage it needs is not
    /// available now (the request is admitted against `hit` instead).
    ///
    /// The restored checkpoint extends `hit` when the entry's first pages were copied from
    /// exactly `hit`'s chain pages; otherwise it restores the whole chain, so the restored row
    /// always continues the very pages it was computed against.
    pub(super) fn restore(
        &mut self,
        id: RequestId,
        entry: HostEntryId,
        hit: Option<CheckpointId>,
        fence: Fence,
    ) -> bool {
        let Some(host) = self.host.as_ref() else { return false };
        let Some(e) = host.entry(entry) else { return false };
        let (key, tail_extent, row_extent) = (e.key, e.tail, e.row);
        if let Some(t) = self.tickets.iter_mut().find(|t| t.publication.key.digest == key.digest) {
            if !t.waiters.contains(&id) {
                t.waiters.push(id);
                self.stats.host_restore_joins += 1;
            }
            return true;
        }
        let sources = host.page_sources(entry);
        let extents = host.page_extents(entry);
        let parent = hit.filter(|&h| {
            let chain = self.prefix.chain_pages(h);
            chain.len() <= sources.len()
                && chain
                    .iter()
                    .zip(&sources)
                    .all(|(&p, s)| s.is_some_and(|s| s.page == p && s.generation == self.pages.generation(p)))
        });
        let shared = parent.map_or(0, |p| self.prefix.chain_pages(p).len());
        let pages_needed = extents.len() - shared + usize::from(tail_extent.is_some());
        // The GPU hit survives the evictions below either way: the ticket's parent, or the
        // prefix the request is admitted against when the restore cannot start.
        for h in [hit, parent].into_iter().flatten() {
            self.prefix.pin(h);
        }
        if let Some(host) = self.host.as_mut() {
            host.pin(entry);
        }
        let snapshot = self.rows.snapshots.allocate().or_else(|| {
            self.prefix.evict_for_snapshot(&mut self.pages, &mut self.rows.snapshots);
            self.rows.snapshots.allocate()
        });
        let snapshot = match snapshot {
            Some(s) if self.ensure_free_pages(pages_needed) => s,
            other => {
                if let Some(s) = other {
                    self.rows.snapshots.release(s, Fence(0));
                }
                for h in [hit, parent].into_iter().flatten() {
                    self.prefix.unpin(h);
                }
                if let Some(host) = self.host.as_mut() {
                    host.unpin(entry);
                }
                self.stats.host_restore_skips += 1;
                return false;
            }
        };
        let mut fresh = || self.pages.allocate().expect("pages were made free above");
        let segment: Vec<PageId> = (shared..extents.len()).map(|_| fresh()).collect();
        let tail_page = tail_extent.map(|_| fresh());
        let mut copies: VecDeque<(HostExtent, PageId)> =
            extents[shared..].iter().copied().zip(segment.iter().copied()).collect();
        copies.extend(tail_extent.zip(tail_page));
        let parent_tokens = parent.and_then(|p| self.prefix.get(p)).map_or(0, |p| p.tokens());
        if let Some(h) = hit {
            self.prefix.unpin(h);
        }
        self.tickets.push(RestoreTicket {
            entry,
            publication: Publication { key, parent, segment, tail_page, snapshot, fence },
            pending: copies,
            row: Some((row_extent, self.rows.snapshot_row(snapshot))),
            started: None,
            copied_tokens: key.tokens - parent_tokens,
            waiters: vec![id],
        });
        self.stats.host_restores += 1;
        true
    }

    /// Adds a disk tier below the host tier (which it stages through: [`Self::with_host_tier`]
    /// first). Checkpoints demoted to the host are written behind, a few at a time; a prompt
    /// whose deepest cached prefix is on disk is read back into the host tier first.
    ///
    /// # Panics
    /// Without a host tier.
    pub fn with_disk_tier(mut self, tier: DiskTier, io: DiskIo, identity: DiskIdentity) -> Self {
        assert!(self.host.is_some(), "the disk tier stages through the host tier");
        self.disk = Some(Box::new(DiskState {
            tier,
            io,
            identity,
            queue: VecDeque::new(),
            writes: HashMap::new(),
            fetches: Vec::new(),
            next_token: 1,
            stats: DiskCounters::default(),
            fetched: Vec::new(),
            errors: Vec::new(),
            fetch_rate: None,
            prefill_rate: None,
        }));
        self
    }

    /// Disk tier gauges and the scheduler's disk counters, when there is a disk tier.
    pub fn disk_stats(&self) -> Option<(DiskStats, DiskCounters)> {
        self.disk.as_ref().map(|d| (d.tier.stats(), d.stats))
    }

    /// How the disk tier moves bytes ("io_uring …" or "pread"), when there is one.
    pub fn disk_backend(&self) -> Option<&'static str> {
        self.disk.as_ref().map(|d| d.io.backend())
    }

    /// Durations of disk fetches finished since the last call.
    pub fn take_disk_fetches(&mut self) -> Vec<Duration> {
        self.disk.as_mut().map(|d| std::mem::take(&mut d.fetched)).unwrap_or_default()
    }

    /// Disk I/O failures since the last call (each one's checkpoint was dropped or recomputed).
    pub fn take_disk_errors(&mut self) -> Vec<helios_offload::IoFailure> {
        self.disk.as_mut().map(|d| std::mem::take(&mut d.errors)).unwrap_or_default()
    }

    /// Injects I/O faults into the disk tier (tests); no-op without one.
    pub fn inject_disk_faults(&mut self, faults: helios_offload::IoFaults) {
        if let Some(d) = &self.disk {
            d.io.inject(faults);
        }
    }

    /// Whether `id` waits on a transfer still running (restore or disk fetch).
    pub(super) fn awaits_tier(&self, id: RequestId) -> bool {
        self.tickets.iter().any(|t| t.waiters.contains(&id))
            || self.disk.as_ref().is_some_and(|d| d.fetches.iter().any(|f| !f.landed && f.waiters.contains(&id)))
    }

    /// Looks below the GPU hit (`hit_tokens` deep): a deeper host entry starts (or joins) a
    /// restore; a deeper disk checkpoint starts (or joins) a fetch into the host. Returns
    /// whether the request waits for one.
    pub(super) fn fetch_deeper(
        &mut self,
        id: RequestId,
        digests: &PromptDigests,
        hit: Option<CheckpointId>,
        hit_tokens: u32,
        fence: Fence,
    ) -> bool {
        let Some(request) = self.requests.get(&id) else { return false };
        let (tokens, images, max) = (&request.tokens, &request.spec.images, request.prompt_len as usize);
        let host_hit = self.host.as_mut().and_then(|h| h.lookup(digests, tokens, images, max, u64::from(hit_tokens)));
        let floor = host_hit.map_or(u64::from(hit_tokens), |(_, t)| t);
        let disk_hit = self.disk.as_mut().and_then(|d| d.tier.lookup(digests, tokens, images, max, floor));
        let disk_hit = disk_hit.filter(|key| self.disk_pays(key, floor));
        if let Some(key) = disk_hit
            && self.fetch(id, key)
        {
            return true;
        }
        let waits = host_hit.is_some_and(|(entry, _)| self.restore(id, entry, hit, fence));
        // A fetch this request waited for has served its purpose: it looked the host up again.
        self.leave_fetches(id);
        waits
    }

    /// `id` no longer waits on landed fetches; those nobody waits on release their host entry.
    pub(super) fn leave_fetches(&mut self, id: RequestId) {
        let (Some(disk), Some(host)) = (self.disk.as_mut(), self.host.as_mut()) else { return };
        disk.fetches.retain_mut(|f| {
            if f.landed {
                f.waiters.retain(|&w| w != id);
                if f.waiters.is_empty() {
                    host.unpin(f.entry);
                    return false;
                }
            }
            true
        });
    }

    /// Whether fetching `key` from disk is faster than recomputing the tokens it adds beyond
    /// `floor`, by the measured fetch and prefill rates (yes until both are measured). On a
    /// slow disk a short prefix is cheaper to prefill than to read.
    fn disk_pays(&mut self, key: &helios_cache::PrefixKey, floor: u64) -> bool {
        let Some(disk) = self.disk.as_mut() else { return false };
        let (Some(fetch), Some(prefill)) = (disk.fetch_rate, disk.prefill_rate) else { return true };
        let Some(bytes) = disk.tier.image_bytes(key) else { return true };
        let pays = bytes as f64 / fetch <= key.tokens.saturating_sub(floor) as f64 / prefill;
        if !pays {
            disk.stats.fetch_declined += 1;
        }
        pays
    }

    /// Records a measured prefill rate (tokens per second of a prompt computed without a
    /// cached prefix); the disk tier weighs its fetches against it.
    pub fn observe_prefill_rate(&mut self, tokens_per_s: f64) {
        if let Some(d) = self.disk.as_mut().filter(|_| tokens_per_s.is_finite() && tokens_per_s > 0.0) {
            d.prefill_rate = Some(d.prefill_rate.map_or(tokens_per_s, |r| r + 0.3 * (tokens_per_s - r)));
        }
    }

    /// Starts (or joins) reading checkpoint `key` from disk into the host tier. Returns false
    /// when the host has no room for it now.
    fn fetch(&mut self, id: RequestId, key: helios_cache::PrefixKey) -> bool {
        let (Some(disk), Some(host)) = (self.disk.as_mut(), self.host.as_mut()) else { return false };
        if let Some(f) = disk.fetches.iter_mut().find(|f| !f.landed && f.key.digest == key.digest) {
            if !f.waiters.contains(&id) {
                f.waiters.push(id);
                disk.stats.fetch_joins += 1;
            }
            return true;
        }
        let Some(plan) = disk.tier.begin_read(&key) else { return false };
        let fill = match host.begin_fill(key, &plan.chain, plan.tail.is_some()) {
            Ok(fill) => fill,
            Err(_) => {
                disk.tier.finish_read(&key, true);
                disk.stats.fetch_skips += 1;
                return false;
            }
        };
        let mut reads: Vec<(BlockRead, HostExtent)> =
            fill.pages.iter().map(|&(i, extent)| (plan.pages[i].clone(), extent)).collect();
        reads.extend(plan.tail.clone().zip(fill.tail));
        reads.push((plan.row.clone(), fill.row));
        let bytes = reads.iter().map(|(r, _)| r.len).sum();
        let token = disk.next_token;
        disk.next_token += 1;
        disk.io.submit(DiskJob::Read { token, reads });
        disk.fetches.push(DiskFetch {
            token,
            key,
            entry: fill.entry,
            waiters: vec![id],
            started: Instant::now(),
            landed: false,
            bytes,
        });
        disk.stats.fetches += 1;
        true
    }

    /// Takes the I/O thread's outcomes (fetches land in the host tier, or are discarded;
    /// writes become disk checkpoints), queues deletions, and starts write-behind for host
    /// entries whose copy-out completed by `completed`.
    pub(super) fn poll_disk(&mut self, completed: Fence) {
        let Some(disk) = self.disk.as_mut() else { return };
        let done = disk.io.poll();
        self.apply_disk(done);
        self.write_behind(completed, DISK_WRITES_IN_FLIGHT);
    }

    fn apply_disk(&mut self, done: Vec<DiskDone>) {
        let (Some(disk), Some(host)) = (self.disk.as_mut(), self.host.as_mut()) else { return };
        for d in done {
            match d {
                DiskDone::Read { token, result } => {
                    let Some(i) = disk.fetches.iter().position(|f| f.token == token) else { continue };
                    let mut f = disk.fetches.swap_remove(i);
                    match result.as_ref().err().and_then(|e| e.path()) {
                        Some(path) => disk.tier.fail_read(&f.key, path),
                        None => disk.tier.finish_read(&f.key, result.is_ok()),
                    }
                    let took = f.started.elapsed();
                    disk.fetched.push(took);
                    if result.is_ok() && f.bytes > 0 && !took.is_zero() {
                        let rate = f.bytes as f64 / took.as_secs_f64();
                        disk.fetch_rate = Some(disk.fetch_rate.map_or(rate, |r| r + 0.3 * (rate - r)));
                    }
                    match result {
                        Ok(()) => {
                            host.finish_fill(f.entry);
                            // Held for its waiters' next lookup (dropped if the key arrived meanwhile).
                            if host.entry(f.entry).is_some() && !f.waiters.is_empty() {
                                host.pin(f.entry);
                                f.landed = true;
                                disk.fetches.push(f);
                            }
                        }
                        Err(e) => {
                            host.abort_fill(f.entry);
                            disk.stats.fetch_failures += 1;
                            disk.errors.push(e);
                        }
                    }
                }
                DiskDone::Written { token, result } => {
                    let Some((plan, entry)) = disk.writes.remove(&token) else { continue };
                    disk.tier.finish_write(&plan, result.as_ref().ok().map(Vec::as_slice));
                    host.unpin(entry);
                    if let Err(e) = result {
                        disk.errors.push(e);
                    }
                }
            }
        }
        for path in disk.tier.take_deletions() {
            disk.io.submit(DiskJob::Delete(path));
        }
    }

    /// Starts disk writes for queued host entries, up to `limit` in flight.
    fn write_behind(&mut self, completed: Fence, limit: usize) {
        let (Some(disk), Some(host)) = (self.disk.as_mut(), self.host.as_mut()) else { return };
        while disk.writes.len() < limit {
            let Some(&entry) = disk.queue.front() else { break };
            let Some(e) = host.entry(entry) else {
                disk.queue.pop_front();
                continue;
            };
            // Demotions queue in fence order: the first not yet copied out stops the rest.
            if e.ready > completed {
                break;
            }
            disk.queue.pop_front();
            let (key, tail, row) = (e.key, e.tail, e.row);
            if disk.tier.contains(&key) {
                continue;
            }
            let uids = host.page_uids(entry);
            let plan = disk.tier.begin_write(key, &uids, tail.is_some());
            // Files the tier let go while making room are unlinked before this write can
            // create one of the same name (the I/O thread runs jobs in order).
            for path in disk.tier.take_deletions() {
                disk.io.submit(DiskJob::Delete(path));
            }
            let Ok(plan) = plan else { continue };
            let pages = host.page_extents(entry);
            let extents: Option<Vec<HostExtent>> =
                plan.sources.iter().map(|&s| source_extent(s, &pages, tail, row)).collect();
            let Some(extents) = extents else {
                disk.tier.finish_write(&plan, None);
                continue;
            };
            host.pin(entry);
            let token = disk.next_token;
            disk.next_token += 1;
            disk.io.submit(DiskJob::Write { token, plan: Box::new(plan.clone()), extents, identity: disk.identity });
            disk.writes.insert(token, (plan, entry));
        }
        for path in disk.tier.take_deletions() {
            disk.io.submit(DiskJob::Delete(path));
        }
    }

    /// Whether a disk fetch some request waits for is in flight.
    pub fn disk_busy(&self) -> bool {
        self.disk.as_ref().is_some_and(|d| d.fetches.iter().any(|f| !f.landed))
    }

    /// Whether disk writes are queued or in flight (an idle loop keeps turning for them).
    pub fn disk_pending(&self) -> bool {
        self.disk.as_ref().is_some_and(|d| !d.queue.is_empty() || d.io.in_flight() > 0)
    }

    /// Waits up to `timeout` for disk I/O outcomes and applies them; returns whether any came.
    /// For a loop with nothing to submit while requests wait on a fetch.
    pub fn wait_disk(&mut self, timeout: Duration) -> bool {
        let Some(disk) = self.disk.as_mut() else { return false };
        let done = disk.io.wait(timeout);
        let any = !done.is_empty();
        self.apply_disk(done);
        any
    }

    /// Waits (up to `timeout`) until write-behind has caught up: every queued entry already
    /// copied out is written and nothing is in flight. Tests use it to make the disk tier's
    /// content independent of the I/O thread's timing.
    pub fn settle_disk(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            self.write_behind(self.completed, DISK_WRITES_IN_FLIGHT);
            let Some(disk) = self.disk.as_mut() else { return };
            let ready = disk.queue.front().is_some_and(|&e| {
                self.host.as_ref().and_then(|h| h.entry(e)).is_none_or(|e| e.ready <= self.completed)
            });
            let left = deadline.saturating_duration_since(Instant::now());
            if (!ready && disk.io.in_flight() == 0) || left.is_zero() {
                return;
            }
            let done = disk.io.wait(left);
            self.apply_disk(done);
        }
    }

    /// Queues a host entry for its disk write.
    pub(super) fn queue_disk_write(&mut self, entry: HostEntryId) {
        if let Some(disk) = self.disk.as_mut() {
            if disk.queue.len() >= DISK_WRITE_QUEUE {
                disk.queue.pop_front();
            }
            disk.queue.push_back(entry);
        }
    }

    /// Writes every host entry not on disk yet, and waits (up to `timeout`) until the writes
    /// and fetches in flight finished. For a graceful shutdown, after the GPU cache was
    /// demoted ([`Self::evict_cache`], then the step that copies it out). Returns the number
    /// of entries still unwritten at the deadline.
    pub fn flush_disk(&mut self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let (Some(disk), Some(host)) = (self.disk.as_mut(), self.host.as_ref()) else { return 0 };
        let mut all: Vec<HostEntryId> = host.entry_ids().collect();
        all.sort_unstable();
        disk.queue = all.into();
        loop {
            self.write_behind(self.completed, DISK_WRITES_IN_FLIGHT * 4);
            let Some(disk) = self.disk.as_mut() else { return 0 };
            if disk.queue.is_empty() && disk.io.in_flight() == 0 {
                return 0;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return disk.queue.len() + disk.writes.len();
            }
            let done = disk.io.wait(left);
            self.apply_disk(done);
        }
    }

    /// Writes the GPU cache out through the tiers for a graceful shutdown: evicts a round of
    /// checkpoints that fits half the host tier, has `run_step` submit and complete the step
    /// that copies them out, writes the host tier to disk, and repeats until the cache is empty
    /// or `deadline` passes. Returns the rounds run and the host entries left unwritten.
    pub fn write_out<E>(
        &mut self,
        deadline: Instant,
        mut run_step: impl FnMut(&mut Self, Step) -> Result<(), E>,
    ) -> Result<(u32, usize), E> {
        let round = self.host.as_ref().map_or(0, |h| h.stats().capacity_bytes / 2);
        let mut rounds = 0;
        loop {
            let more = self.evict_cache_batch(round);
            if let Some(step) = self.schedule() {
                run_step(self, step)?;
            }
            let left = self.flush_disk(deadline.saturating_duration_since(Instant::now()));
            rounds += 1;
            if !more || left > 0 || Instant::now() >= deadline {
                return Ok((rounds, left));
            }
        }
    }

    /// Tier invariants, with the references and pins tickets hold added to the counts.
    pub(super) fn check_tier_invariants(
        &self,
        page_refs: &mut [u32],
        snapshot_refs: &mut [u32],
        pins: &mut HashMap<CheckpointId, u32>,
    ) {
        let mut host_pins: HashMap<HostEntryId, u32> = HashMap::new();
        for t in &self.tickets {
            let p = &t.publication;
            for &page in p.segment.iter().chain(p.tail_page.iter()) {
                page_refs[page as usize] += 1;
            }
            snapshot_refs[p.snapshot as usize] += 1;
            if let Some(parent) = p.parent {
                *pins.entry(parent).or_default() += 1;
            }
            *host_pins.entry(t.entry).or_default() += 1;
        }
        if let Some(disk) = &self.disk {
            for f in &disk.fetches {
                *host_pins.entry(f.entry).or_default() += 1;
            }
            for (_, entry) in disk.writes.values() {
                *host_pins.entry(*entry).or_default() += 1;
            }
            disk.tier.check_invariants();
        }
        if let Some(host) = &self.host {
            host.check_invariants();
            host.check_pins(&host_pins);
        }
    }
}
