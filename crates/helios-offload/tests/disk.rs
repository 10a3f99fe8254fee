//! The disk tier over real files: round trips through the I/O thread, page sharing between
//! files, restart indexing, and every way a file can be unusable.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use helios_cache::{PrefixIdentity, PrefixKey, PromptDigests};
use helios_offload::{
    BlockRead, DiskDone, DiskIdentity, DiskIo, DiskJob, DiskTier, FormatError, HostArena, HostExtent, IoFailure,
    IoFaults, PageUid, ReadPlan, StoreGeometry, UNIT_BYTES, WritePlan, source_extent,
};

const GEOMETRY: StoreGeometry = StoreGeometry { page_tokens: 64, bytes_per_page: 6000, continuation_row_bytes: 300 };
const CORE: DiskIdentity = DiskIdentity { fingerprint: [7; 32], geometry: GEOMETRY };
const ID: PrefixIdentity = PrefixIdentity { model: 1, token_layout: 1 };

fn tokens() -> Vec<u32> {
    (0..1000).map(|i| i * 31 % 101).collect()
}

fn key(len: usize) -> PrefixKey {
    PromptDigests::key_of(ID, &tokens(), &[], len)
}

/// Host memory for tests: extents handed out in order, filled with a pattern per extent.
struct Host {
    arena: Arc<HostArena>,
    next: u64,
}

impl Host {
    fn new() -> Self {
        Host { arena: Arc::new(HostArena::new(512 * UNIT_BYTES).unwrap()), next: 0 }
    }
    fn extent(&mut self, len: u64, fill: Option<u8>) -> HostExtent {
        let e = HostExtent { offset: self.next, len };
        self.next += e.span();
        if let Some(f) = fill {
            let bytes: Vec<u8> = (0..len).map(|i| f.wrapping_add(i as u8)).collect();
            // SAFETY: single-threaded test, no job in flight on this extent.
            unsafe { self.arena.bytes_mut(e) }.copy_from_slice(&bytes);
        }
        e
    }
    fn bytes(&self, e: HostExtent) -> Vec<u8> {
        // SAFETY: as above.
        unsafe { self.arena.bytes(e) }.to_vec()
    }
}

/// A directory, host memory and the I/O thread over it.
fn setup() -> (tempfile::TempDir, Host, DiskIo) {
    let host = Host::new();
    let io = DiskIo::start(host.arena.clone()).unwrap();
    (tempfile::tempdir().unwrap(), host, io)
}

fn finish(io: &mut DiskIo) -> DiskDone {
    let mut done = io.wait(Duration::from_secs(10));
    assert_eq!(done.len(), 1, "one job, one outcome");
    done.pop().unwrap()
}

/// Writes checkpoint `len` with chain uids `uids`, pages filled from `fill + page index`.
fn write(tier: &mut DiskTier, io: &mut DiskIo, host: &mut Host, len: usize, uids: &[PageUid], fill: u8) -> WritePlan {
    let tail = !len.is_multiple_of(64);
    let plan = tier.begin_write(key(len), uids, tail).unwrap();
    let pages: Vec<HostExtent> =
        (0..uids.len()).map(|i| host.extent(GEOMETRY.bytes_per_page, Some(fill + i as u8))).collect();
    let tail_e = tail.then(|| host.extent(GEOMETRY.bytes_per_page, Some(fill + 100)));
    let row = host.extent(GEOMETRY.continuation_row_bytes, Some(fill + 200));
    let extents: Vec<HostExtent> =
        plan.sources.iter().map(|&s| source_extent(s, &pages, tail_e, row).unwrap()).collect();
    io.submit(DiskJob::Write { token: 1, plan: Box::new(plan.clone()), extents, identity: CORE });
    match finish(io) {
        DiskDone::Written { result: Ok(sums), .. } => tier.finish_write(&plan, Some(&sums)),
        other => panic!("write failed: {other:?}"),
    }
    plan
}

/// Reads checkpoint `len` back; returns the read result and the bytes of each block read.
fn read(tier: &mut DiskTier, io: &mut DiskIo, host: &mut Host, len: usize) -> (Result<(), IoFailure>, Vec<Vec<u8>>) {
    let plan: ReadPlan = tier.begin_read(&key(len)).expect("on disk");
    let mut reads: Vec<(BlockRead, HostExtent)> =
        plan.pages.iter().map(|r| (r.clone(), host.extent(r.len, None))).collect();
    reads.extend(plan.tail.iter().map(|r| (r.clone(), host.extent(r.len, None))));
    reads.push((plan.row.clone(), host.extent(plan.row.len, None)));
    io.submit(DiskJob::Read { token: 2, reads: reads.clone() });
    let result = match finish(io) {
        DiskDone::Read { result, .. } => result,
        other => panic!("{other:?}"),
    };
    match result.as_ref().err().and_then(IoFailure::path) {
        Some(path) => tier.fail_read(&plan.key, path),
        None => tier.finish_read(&plan.key, result.is_ok()),
    }
    (result, reads.iter().map(|(_, e)| host.bytes(*e)).collect())
}

fn pattern(len: u64, fill: u8) -> Vec<u8> {
    (0..len).map(|i| fill.wrapping_add(i as u8)).collect()
}

#[test]
fn files_round_trip_share_pages_and_survive_a_restart() {
    let (dir, mut host, mut io) = setup();
    eprintln!("disk I/O backend: {}", io.backend());
    let (mut tier, rejected) = DiskTier::open(dir.path(), CORE, 1 << 30).unwrap();
    assert!(rejected.is_empty());
    let uids: Vec<PageUid> = (1..=4).map(PageUid).collect();
    let first = write(&mut tier, &mut io, &mut host, 130, &uids[..2], 10);
    // The next turn stores only its two new pages; the first two are the first file's.
    let second = write(&mut tier, &mut io, &mut host, 256, &uids, 10);
    assert_eq!(second.header.chain[0].file, first.file);
    assert_eq!(second.header.blocks.len(), 2 + 1, "two pages and the row");
    tier.check_invariants();
    let (ok, blocks) = read(&mut tier, &mut io, &mut host, 256);
    ok.unwrap();
    for (i, b) in blocks[..4].iter().enumerate() {
        assert_eq!(b, &pattern(GEOMETRY.bytes_per_page, 10 + i as u8), "page {i}");
    }
    assert_eq!(blocks[4], pattern(GEOMETRY.continuation_row_bytes, 210));
    // Restart: both checkpoints are found again, with their sharing.
    drop(tier);
    let (mut tier, rejected) = DiskTier::open(dir.path(), CORE, 1 << 30).unwrap();
    assert!(rejected.is_empty(), "{rejected:?}");
    assert_eq!(tier.stats().entries, 2);
    let digests = PromptDigests::new(ID, &tokens(), &[]);
    assert_eq!(tier.lookup(&digests, &tokens(), &[], 1000, 0), Some(key(256)));
    assert_eq!(tier.lookup(&digests, &tokens(), &[], 200, 0), Some(key(130)));
    let (ok, blocks) = read(&mut tier, &mut io, &mut host, 130);
    ok.unwrap();
    assert_eq!(blocks[2], pattern(GEOMETRY.bytes_per_page, 110), "tail page");
    tier.check_invariants();
}

#[test]
fn unusable_files_are_rejected_and_removed_at_startup() {
    let (dir, mut host, mut io) = setup();
    let (mut tier, _) = DiskTier::open(dir.path(), CORE, 1 << 30).unwrap();
    let uids: Vec<PageUid> = (1..=4).map(PageUid).collect();
    let a = write(&mut tier, &mut io, &mut host, 128, &uids[..2], 1);
    let b = write(&mut tier, &mut io, &mut host, 256, &uids, 1);
    let c = write(&mut tier, &mut io, &mut host, 64 * 5, &[PageUid(9); 5], 3);
    drop(tier);
    // A write killed half way, a truncated file and a corrupted header.
    std::fs::write(dir.path().join("00000000000000000000000000000001.tmp"), b"partial").unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&c.path).unwrap();
    f.set_len(8192).unwrap();
    let mut bytes = std::fs::read(&a.path).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&a.path, &bytes).unwrap();
    let (tier, rejected) = DiskTier::open(dir.path(), CORE, 1 << 30).unwrap();
    let reasons: Vec<FormatError> = rejected.iter().map(|r| r.reason).collect();
    assert!(reasons.contains(&FormatError::Checksum), "{rejected:?}");
    assert!(reasons.iter().any(|r| matches!(r, FormatError::Truncated { .. })), "{rejected:?}");
    // b references a's pages: unusable without it.
    assert!(reasons.contains(&FormatError::MissingReference), "{rejected:?}");
    assert_eq!(tier.stats().entries, 0);
    tier.check_invariants();
    drop(tier);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(left.is_empty(), "every unusable file was removed: {left:?} (b: {:?})", b.path);
    // Files of another core are refused.
    let (mut tier, _) = DiskTier::open(dir.path(), CORE, 1 << 30).unwrap();
    write(&mut tier, &mut io, &mut host, 64, &uids[..1], 5);
    drop(tier);
    let other = DiskIdentity { fingerprint: [8; 32], ..CORE };
    let (tier, rejected) = DiskTier::open(dir.path(), other, 1 << 30).unwrap();
    assert!(rejected.iter().any(|r| r.reason == FormatError::OtherCore), "{rejected:?}");
    assert_eq!(tier.stats().entries, 0);
}

#[test]
fn read_faults_discard_the_checkpoint_and_its_dependents() {
    for faults in [
        IoFaults { flip_bits: true, ..IoFaults::default() },
        IoFaults { short_reads: true, ..IoFaults::default() },
        IoFaults { read_errno: Some(libc::EIO), ..IoFaults::default() },
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut host = Host::new();
        let mut io = DiskIo::start(host.arena.clone()).unwrap();
        let (mut tier, _) = DiskTier::open(dir.path(), CORE, 1 << 30).unwrap();
        let uids: Vec<PageUid> = (1..=4).map(PageUid).collect();
        write(&mut tier, &mut io, &mut host, 128, &uids[..2], 1);
        write(&mut tier, &mut io, &mut host, 256, &uids, 1);
        io.inject(faults);
        let (result, _) = read(&mut tier, &mut io, &mut host, 128);
        assert!(result.is_err(), "{faults:?}");
        // The failed file is gone, and so is the checkpoint whose chain runs through it.
        assert_eq!(tier.stats().entries, 0, "{faults:?}");
        tier.check_invariants();
        io.inject(IoFaults::default());
    }
}

#[test]
fn write_faults_and_a_full_disk_leave_nothing_behind() {
    let (dir, mut host, mut io) = setup();
    // Room for about two single-page checkpoints.
    let (mut tier, _) = DiskTier::open(dir.path(), CORE, 9 * UNIT_BYTES).unwrap();
    io.inject(IoFaults { write_errno: Some(libc::ENOSPC), ..IoFaults::default() });
    let plan = tier.begin_write(key(64), &[PageUid(1)], false).unwrap();
    let extents =
        vec![host.extent(GEOMETRY.bytes_per_page, Some(1)), host.extent(GEOMETRY.continuation_row_bytes, Some(2))];
    io.submit(DiskJob::Write { token: 1, plan: Box::new(plan.clone()), extents, identity: CORE });
    match finish(&mut io) {
        DiskDone::Written { result: Err(IoFailure::Io { .. }), .. } => tier.finish_write(&plan, None),
        other => panic!("{other:?}"),
    }
    tier.check_invariants();
    assert_eq!(tier.stats().resident_bytes, 0);
    for d in tier.take_deletions() {
        let _ = std::fs::remove_file(d);
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no temporary file left");
    io.inject(IoFaults::default());
    // Three checkpoints into room for two: the least recently used goes.
    write(&mut tier, &mut io, &mut host, 64, &[PageUid(1)], 1);
    write(&mut tier, &mut io, &mut host, 64 * 2, &[PageUid(5), PageUid(6)], 1);
    tier.check_invariants();
    assert!(tier.stats().evictions >= 1);
    assert!(tier.stats().resident_bytes <= 9 * UNIT_BYTES);
}

#[test]
fn a_bad_block_in_an_ancestor_file_discards_that_file_too() {
    let (dir, mut host, mut io) = setup();
    let (mut tier, _) = DiskTier::open(dir.path(), CORE, 1 << 30).unwrap();
    let uids: Vec<PageUid> = (1..=4).map(PageUid).collect();
    let a = write(&mut tier, &mut io, &mut host, 128, &uids[..2], 1);
    write(&mut tier, &mut io, &mut host, 256, &uids, 1);
    // Corrupt the first page block of a's file: the deeper checkpoint reads it.
    let offset = a.header.blocks[0].offset as usize;
    let mut bytes = std::fs::read(&a.path).unwrap();
    bytes[offset + 10] ^= 0x40;
    std::fs::write(&a.path, &bytes).unwrap();
    let (result, _) = read(&mut tier, &mut io, &mut host, 256);
    assert!(matches!(result, Err(IoFailure::Checksum { ref path, .. }) if *path == a.path), "{result:?}");
    assert_eq!(tier.stats().entries, 0, "both checkpoints through the bad file are gone");
    tier.check_invariants();
    // A new checkpoint of the same pages stores them again instead of referencing a's file.
    let c = tier.begin_write(key(192), &uids[..3], false).unwrap();
    assert!(c.header.chain.iter().all(|r| r.file == c.file), "{:?}", c.header.chain);
    tier.finish_write(&c, None);
    tier.check_invariants();
}

#[test]
fn a_write_that_cannot_fit_evicts_nothing() {
    let (dir, mut host, mut io) = setup();
    // Each page block spans two units (6000 bytes), a row one, a header one.
    let (mut tier, _) = DiskTier::open(dir.path(), CORE, 12 * UNIT_BYTES).unwrap();
    write(&mut tier, &mut io, &mut host, 64, &[PageUid(1)], 1);
    write(&mut tier, &mut io, &mut host, 1, &[], 2);
    let before = tier.stats();
    // Six pages never fit in twelve units, whatever is evicted.
    let six: Vec<PageUid> = (10..16).map(PageUid).collect();
    assert!(tier.begin_write(key(64 * 6), &six, false).is_err());
    assert_eq!(tier.stats().entries, before.entries, "nothing evicted for a write that cannot fit");
    tier.check_invariants();
}

#[test]
fn a_file_kept_for_its_pages_is_revived_not_rewritten() {
    let (dir, mut host, mut io) = setup();
    // a (one page), b (a's page and one more), x: four units each, twelve in all.
    let (mut tier, _) = DiskTier::open(dir.path(), CORE, 12 * UNIT_BYTES).unwrap();
    let uids: Vec<PageUid> = (1..=2).map(PageUid).collect();
    write(&mut tier, &mut io, &mut host, 64, &uids[..1], 1);
    write(&mut tier, &mut io, &mut host, 128, &uids, 1);
    write(&mut tier, &mut io, &mut host, 1, &[], 5);
    // While b is being read, y needs room: a's checkpoint goes (its file stays: b references
    // it), then x's.
    let reading = tier.begin_read(&key(128)).unwrap();
    write(&mut tier, &mut io, &mut host, 2, &[], 6);
    tier.finish_read(&reading.key, true);
    tier.check_invariants();
    let digests = PromptDigests::new(ID, &tokens(), &[]);
    assert_eq!(tier.lookup(&digests, &tokens(), &[], 64, 63), None, "a's checkpoint was evicted");
    // Writing a again revives the kept file instead.
    assert!(matches!(tier.begin_write(key(64), &uids[..1], false), Err(helios_offload::DiskError::Present)));
    assert_eq!(tier.lookup(&digests, &tokens(), &[], 64, 63), Some(key(64)));
    tier.check_invariants();
    let (ok, blocks) = read(&mut tier, &mut io, &mut host, 64);
    ok.unwrap();
    assert_eq!(blocks[0], pattern(GEOMETRY.bytes_per_page, 1));
}
