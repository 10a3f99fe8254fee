//! The graph executor over the CPU emulation of the fixture core's graphs: steps packed through
//! the bound contract, replayed, and answered from completion records; host transfers. Whole
//! requests through the serving loop over it: helios-worker's `tests/graph_executor.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use helios_contract::fixtures::FixtureSpec;
use helios_replay::graph::GraphExecutor;
use support::device_fixture::{Emulator, device_fixture, device_fixture_with};

#[test]
fn device_fed_rows_need_graphs_that_keep_the_pending_token() {
    use helios_replay::{Executor, ExecutorError, StepInputs};
    use helios_scheduler::{ConsumeRow, SampleSpec, Step, StepOp};
    let spec = FixtureSpec::default();
    let step = Step {
        fence: helios_cache::Fence(1),
        ops: vec![StepOp::Decode {
            bucket: 1,
            rows: vec![ConsumeRow {
                live_row: 1,
                start: 3,
                tokens: vec![],
                device_token: true,
                page_table: vec![0],
                sample: Some(SampleSpec { request: helios_scheduler::RequestId(0), seed: 1, counter: 1 }),
            }],
        }],
    };
    let dir = tempfile::tempdir().unwrap();
    let host_fed = device_fixture(dir.path(), &spec);
    let mut executor = GraphExecutor::new(host_fed.manifest(), Emulator::new(&host_fed)).unwrap();
    assert_eq!(executor.submit(&step, &StepInputs::default()), Err(ExecutorError::DeviceFedUnsupported));

    let dir = tempfile::tempdir().unwrap();
    let core = device_fixture_with(dir.path(), &spec, |f| {
        f.add_pending_tokens();
    });
    let m = core.manifest().clone();
    let mut emulator = Emulator::new(&core);
    emulator.deferred = true;
    let mut executor = GraphExecutor::new(&m, emulator).unwrap();
    assert!(executor.device_fed_decode());
    executor.submit(&step, &StepInputs::default()).unwrap();
    assert!(executor.poll().unwrap().is_empty(), "the records copy is still in flight");
    let done = executor.wait().unwrap();
    assert_eq!((done.len(), done[0].sampled.len()), (1, 1));
}

/// Host transfers address whole pages of the KV buffer and whole rows of the row buffer: bytes
/// copied out of page 3 and row 5 come back, unchanged, into page 7 and row 6.
#[test]
fn host_transfers_copy_whole_pages_and_rows() {
    use helios_contract::model::BufferRole;
    use helios_offload::{HostArena, HostExtent, UNIT_BYTES};
    use helios_replay::Executor;
    use helios_scheduler::{Step, StepOp};

    let dir = tempfile::tempdir().unwrap();
    let core = device_fixture(dir.path(), &FixtureSpec::default());
    let m = core.manifest().clone();
    let scheme = &m.cache_scheme;
    let (page_bytes, row_bytes) = (scheme.bytes_per_page(), scheme.continuation_row_bytes);
    assert!(page_bytes > 0 && row_bytes > 0, "the fixture declares pages and rows");
    let buffer = |role| m.buffers.iter().find(|b| b.role == role).unwrap().id;
    let (kv, rows) = (buffer(BufferRole::KvPages), buffer(BufferRole::ContinuationRows));
    let mut executor = GraphExecutor::new(&m, Emulator::new(&core)).unwrap();
    let refused = executor.submit(
        &Step {
            fence: helios_cache::Fence(1),
            ops: vec![StepOp::CopyOut { pages: vec![], rows: vec![(1, HostExtent { offset: 0, len: row_bytes })] }],
        },
        &Default::default(),
    );
    assert_eq!(refused, Err(helios_replay::ExecutorError::NoHostTransfers));
    let arena = std::sync::Arc::new(HostArena::new(16 * UNIT_BYTES).unwrap());
    let mut other = helios_offload::StoreGeometry::from(scheme);
    other.bytes_per_page += 1;
    assert!(matches!(
        executor.attach_host_arena(arena.clone(), other),
        Err(helios_replay::ExecutorError::TransferGeometry { .. })
    ));
    executor.attach_host_arena(arena, helios_offload::StoreGeometry::from(scheme)).unwrap();
    let page: Vec<u8> = (0..page_bytes).map(|i| (i * 7 + 1) as u8).collect();
    let row: Vec<u8> = (0..row_bytes).map(|i| (i * 5 + 3) as u8).collect();
    // Seed the sources in the emulated device memory.
    let write = |e: &mut GraphExecutor<Emulator>, buffer, offset, bytes: &[u8]| {
        let b = m.buffer(buffer).unwrap();
        let start = (b.offset + offset) as usize;
        let arena = &mut e.backend_mut().arena;
        arena[start..start + bytes.len()].copy_from_slice(bytes);
    };
    write(&mut executor, kv, 3 * page_bytes, &page);
    write(&mut executor, rows, 5 * row_bytes, &row);
    let (pe, re) = (HostExtent { offset: 0, len: page_bytes }, HostExtent { offset: 8 * UNIT_BYTES, len: row_bytes });
    let out = Step {
        fence: helios_cache::Fence(1),
        ops: vec![StepOp::CopyOut { pages: vec![(3, pe)], rows: vec![(5, re)] }],
    };
    let back =
        Step { fence: helios_cache::Fence(2), ops: vec![StepOp::CopyIn { pages: vec![(pe, 7)], rows: vec![(re, 6)] }] };
    executor.submit(&out, &Default::default()).unwrap();
    executor.submit(&back, &Default::default()).unwrap();
    executor.synchronize().unwrap();
    let read = |e: &GraphExecutor<Emulator>, buffer, offset, len| {
        let b = m.buffer(buffer).unwrap();
        let start = (b.offset + offset) as usize;
        e.backend().arena[start..start + len as usize].to_vec()
    };
    assert_eq!(read(&executor, kv, 7 * page_bytes, page_bytes), page);
    assert_eq!(read(&executor, rows, 6 * row_bytes, row_bytes), row);
    let short = HostExtent { offset: 0, len: page_bytes - 1 };
    let bad =
        Step { fence: helios_cache::Fence(3), ops: vec![StepOp::CopyOut { pages: vec![(3, short)], rows: vec![] }] };
    assert_eq!(
        executor.submit(&bad, &Default::default()),
        Err(helios_replay::ExecutorError::TransferSize { extent: short, expected: page_bytes })
    );
}

/// Consecutive pages into consecutive extents go as one copy each way; a gap splits the run.
/// Pages of 64 tokens × 16 hidden × 4 bytes are exactly one extent unit here.
#[test]
fn contiguous_host_transfers_coalesce() {
    use helios_contract::model::BufferRole;
    use helios_offload::{HostArena, HostExtent, UNIT_BYTES};
    use helios_replay::Executor;
    use helios_scheduler::{Step, StepOp};

    let dir = tempfile::tempdir().unwrap();
    let spec = FixtureSpec { hidden: 16, ..FixtureSpec::default() };
    let core = device_fixture(dir.path(), &spec);
    let m = core.manifest().clone();
    let page_bytes = m.cache_scheme.bytes_per_page();
    assert_eq!(page_bytes, UNIT_BYTES, "the fixture's pages are one unit");
    let kv = m.buffers.iter().find(|b| b.role == BufferRole::KvPages).unwrap();
    let mut executor = GraphExecutor::new(&m, Emulator::new(&core)).unwrap();
    let arena = std::sync::Arc::new(HostArena::new(16 * UNIT_BYTES).unwrap());
    executor.attach_host_arena(arena, helios_offload::StoreGeometry::from(&m.cache_scheme)).unwrap();
    for p in 0..8u64 {
        let start = (kv.offset + p * page_bytes) as usize;
        executor.backend_mut().arena[start..start + page_bytes as usize].fill(p as u8 + 1);
    }
    let extent = |i: u64| HostExtent { offset: i * UNIT_BYTES, len: page_bytes };
    // Pages 3, 4, 5 into extents 0, 1, 2 (one run); page 7 into extent 4 (a gap: a second).
    let out = vec![(3, extent(0)), (4, extent(1)), (5, extent(2)), (7, extent(4))];
    let back: Vec<(HostExtent, u32)> = vec![(extent(0), 10), (extent(1), 11), (extent(2), 12), (extent(4), 14)];
    let steps = [
        Step { fence: helios_cache::Fence(1), ops: vec![StepOp::CopyOut { pages: out, rows: vec![] }] },
        Step { fence: helios_cache::Fence(2), ops: vec![StepOp::CopyIn { pages: back, rows: vec![] }] },
    ];
    for step in &steps {
        executor.submit(step, &Default::default()).unwrap();
    }
    executor.synchronize().unwrap();
    assert_eq!(executor.backend().host_copies, 4, "two runs each way");
    for (page, fill) in [(10u64, 4u8), (11, 5), (12, 6), (14, 8)] {
        let start = (kv.offset + page * page_bytes) as usize;
        assert!(executor.backend().arena[start..start + page_bytes as usize].iter().all(|&b| b == fill), "page {page}");
    }
}
