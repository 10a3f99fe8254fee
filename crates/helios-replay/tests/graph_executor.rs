//! The graph executor over the CPU emulation of the fixture core's graphs: steps packed through
//! the bound contract, replayed, and answered from completion records; host transfers. Whole
//! requests through the serving loop over it: helios-worker's `tests/graph_executor.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use helios_contract::fixtures::FixtureSpec;
use helios_replay::graph::GraphExecutor;
use support::device_fixture::{Emulator, Moment, device_fixture, device_fixture_with};

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

/// A device that adds one token to every record a replay writes: it claims more tokens than
/// its row may emit.
fn overclaim(e: &mut Emulator, graph: helios_contract::model::GraphId, when: Moment) {
    if when == Moment::Before {
        return;
    }
    let m = e.manifest.clone();
    let g = m.graph(graph).unwrap();
    let Some(b) = g.binding(helios_contract::model::ValueKind::CompletionRecords) else { return };
    let start = (m.buffer(b.view.buffer).unwrap().offset + b.view.offset) as usize;
    for r in 0..b.shape[0] as usize {
        let at = start + r * b.shape[1] as usize * 4 + 12;
        let count = u32::from_le_bytes(e.arena[at..at + 4].try_into().unwrap());
        e.arena[at..at + 4].copy_from_slice(&(count + 1).to_le_bytes());
    }
}

mod speculative {
    use super::support::device_fixture::{Emulator, Hooked, device_fixture, device_fixture_with, toy_next};
    use super::*;
    use helios_contract::model::{SpeculativeProgram, ValueKind};
    use helios_contract::{BoundContract, CapacityError};
    use helios_replay::graph::graph_for;
    use helios_replay::{Executor, ExecutorError, RowSampling, SamplingParams, StepInputs};
    use helios_scheduler::{ConsumeRow, RequestId, SampleSpec, SampledToken, Step, StepOp};

    fn verify_step(program: SpeculativeProgram, rows: Vec<ConsumeRow>) -> Step {
        Step { fence: helios_cache::Fence(1), ops: vec![StepOp::Verify { program, rows }] }
    }

    fn row(live_row: u32, start: u32, tokens: Vec<u32>, request: u64, counter: u32) -> ConsumeRow {
        ConsumeRow {
            live_row,
            start,
            tokens,
            device_token: false,
            page_table: vec![0, 1],
            sample: Some(SampleSpec { request: RequestId(request), seed: 40 + request, counter }),
        }
    }

    /// A verify round through the (2 requests, depth 3) program: request 0 consumes its pending
    /// token and two proposals (the first accepted, the second not), request 1 is device-fed. The
    /// staging views hold the lanes with stride W = 4, and the records' tokens come back as
    /// samples in order: accepted proposal, then the sample that ended the round.
    #[test]
    fn verify_packs_lanes_with_stride_w_and_returns_every_record_token() {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture_with(dir.path(), &FixtureSpec::speculative(), |f| {
            f.add_pending_tokens();
        });
        let m = core.manifest().clone();
        let vocab = m.capacities.vocab_size;
        let mut executor = GraphExecutor::new(&m, Emulator::new(&core)).unwrap();
        // Decode and speculative graphs read the pending token, every sampling graph writes it.
        assert!(executor.device_fed_decode());

        // Pending token 10 at position 5: the target samples y0; propose it, then a miss.
        let y0 = toy_next(10, 5, vocab);
        let y1 = toy_next(y0, 6, vocab);
        let miss = (y1 + 1) % vocab;
        let program = SpeculativeProgram::rectangular(2, 3);
        let mut device_fed = row(2, 9, vec![], 1, 4);
        device_fed.device_token = true;
        let step = verify_step(program, vec![row(1, 5, vec![10, y0, miss], 0, 7), device_fed]);
        // The device-fed row's pending token, as an earlier step on slot 2 stored it.
        let pending = m.buffers.iter().find(|b| b.name == "pending_tokens").unwrap().offset as usize;
        executor.backend_mut().arena[pending + 8..pending + 12].copy_from_slice(&21u32.to_le_bytes());
        let z0 = toy_next(21, 9, vocab);

        let words = vocab.div_ceil(32) as usize;
        // The grammar's masks at lanes 0, 1 and 2 (after the first and the second proposal).
        let lane_mask = |lane: u32| -> Vec<u32> { (0..words as u32).map(|i| (0x0f0f_0000 << lane) | i).collect() };
        let (mask, mask1, mask2) = (lane_mask(0), lane_mask(1), lane_mask(2));
        let constrained = RowSampling {
            params: SamplingParams { temperature: 0.5, top_k: 9, ..SamplingParams::default() },
            mask: Some(mask.clone().into()),
            proposal_masks: vec![mask1.clone().into(), mask2.clone().into()],
        };
        // Without the masks of its proposal lanes, a constrained verify row is refused.
        let mut inputs = StepInputs::default();
        let partial = RowSampling { proposal_masks: vec![mask1.clone().into()], ..constrained.clone() };
        inputs.sampling.insert(RequestId(0), partial);
        assert_eq!(executor.submit(&step, &inputs), Err(ExecutorError::MissingLaneMask { request: 0, lane: 2 }));
        inputs.sampling.insert(RequestId(0), constrained);
        executor.submit(&step, &inputs).unwrap();
        let done = executor.synchronize().unwrap();
        let sample = |request, token| SampledToken { request: RequestId(request), token };
        assert_eq!(done[0].sampled, vec![sample(0, y0), sample(0, y1), sample(1, z0)]);

        // What was staged, read back from the emulated device.
        let bound = BoundContract::bind(&m);
        let g = bound.speculative(program).unwrap();
        assert_eq!(graph_for(&bound, &step.ops[0]), Some(g.id));
        let arena = &executor.backend().arena;
        let staged = |v: ValueKind| {
            let view = g.view(v).unwrap();
            let b = m.buffer(view.buffer).unwrap();
            (view.clone(), &arena[b.offset as usize..b.end() as usize])
        };
        let i32s = |v| {
            let (view, bytes) = staged(v);
            view.read::<i32>(bytes).unwrap()
        };
        assert_eq!(i32s(ValueKind::TokenIds), vec![10, y0 as i32, miss as i32, -1, -1, -1, -1, -1]);
        assert_eq!(i32s(ValueKind::Positions), vec![5, 6, 7, 0, 9, 0, 0, 0]);
        assert_eq!(i32s(ValueKind::QueryLengths), vec![3, 1]);
        assert_eq!(i32s(ValueKind::RequestSlots), vec![1, 2]);
        assert_eq!(i32s(ValueKind::TopK), vec![9, 0]);
        assert_eq!(i32s(ValueKind::PageTable)[..2], [0, 1]);
        let (view, bytes) = staged(ValueKind::RngCounter);
        assert_eq!(view.read::<u64>(bytes).unwrap(), vec![7, 4], "the counter of lane 0");
        let (view, bytes) = staged(ValueKind::RngSeed);
        assert_eq!(view.read::<u64>(bytes).unwrap(), vec![40, 41]);
        let (view, bytes) = staged(ValueKind::Temperature);
        assert_eq!(view.read::<f32>(bytes).unwrap(), vec![0.5, 1.0]);
        // One mask per lane: request 0's grammar state at each of its three used lanes, every
        // other lane unmasked.
        let (view, bytes) = staged(ValueKind::GrammarMask);
        assert_eq!(view.shape, vec![8, words as u64]);
        let lanes: Vec<Vec<u32>> = view.read::<u32>(bytes).unwrap().chunks(words).map(<[u32]>::to_vec).collect();
        let open = vec![u32::MAX; words];
        assert_eq!(lanes, vec![mask, mask1, mask2, open.clone(), open.clone(), open.clone(), open.clone(), open]);
        // The emulated program stored each request's last emitted token as its pending token.
        let pending_of =
            |slot: usize| u32::from_le_bytes(arena[pending + 4 * slot..pending + 4 * slot + 4].try_into().unwrap());
        assert_eq!((pending_of(1), pending_of(2)), (y1, z0));
    }

    /// Every proposal accepted: the record holds W tokens (depth + 1), all of them samples.
    #[test]
    fn a_fully_accepted_round_emits_depth_plus_one_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture(dir.path(), &FixtureSpec::speculative());
        let m = core.manifest().clone();
        let vocab = m.capacities.vocab_size;
        let mut executor = GraphExecutor::new(&m, Emulator::new(&core)).unwrap();
        // The speculative graphs here keep no pending token: nothing is device-fed.
        assert!(!executor.device_fed_decode());
        let mut chain = vec![3u32];
        for j in 0..4 {
            chain.push(toy_next(chain[j], 20 + j as u32, vocab));
        }
        let step = verify_step(SpeculativeProgram::rectangular(1, 3), vec![row(1, 20, chain[..4].to_vec(), 5, 0)]);
        executor.submit(&step, &StepInputs::default()).unwrap();
        let done = executor.synchronize().unwrap();
        let tokens: Vec<u32> = done[0].sampled.iter().map(|s| s.token).collect();
        assert_eq!(tokens, chain[1..].to_vec());
        assert!(done[0].sampled.iter().all(|s| s.request == RequestId(5)));
    }

    #[test]
    fn verify_outside_the_cores_programs_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture(dir.path(), &FixtureSpec::speculative());
        let m = core.manifest().clone();
        let bound = BoundContract::bind(&m);
        let mut executor = GraphExecutor::new(&m, Emulator::new(&core)).unwrap();
        let rows = || vec![row(1, 0, vec![1, 2], 0, 0)];
        // (2, 2) is not captured; (2, 3) is, but is not looked up in its place.
        let missing = verify_step(SpeculativeProgram::rectangular(2, 2), rows());
        assert_eq!(graph_for(&bound, &missing.ops[0]), None);
        assert_eq!(
            executor.submit(&missing, &StepInputs::default()),
            Err(ExecutorError::Capacity(CapacityError::MissingProgram { requests: 2, depth: 2 }))
        );
        // Rows that do not fit the program.
        let program = SpeculativeProgram::rectangular(1, 3);
        let two = verify_step(program, vec![row(1, 0, vec![1], 0, 0), row(2, 0, vec![1], 1, 0)]);
        assert_eq!(executor.submit(&two, &StepInputs::default()), Err(ExecutorError::VerifyRows { program, rows: 2 }));
        let deep = verify_step(program, vec![row(1, 0, vec![1, 2, 3, 4, 5], 0, 0)]);
        assert_eq!(
            executor.submit(&deep, &StepInputs::default()),
            Err(ExecutorError::VerifyLanes { program, live_row: 1, lanes: 5 })
        );
        let mut silent = row(1, 0, vec![1, 2], 0, 0);
        silent.sample = None;
        assert_eq!(
            executor.submit(&verify_step(program, vec![silent]), &StepInputs::default()),
            Err(ExecutorError::VerifyWithoutSample(1))
        );
        // Graphs without the pending token cannot take a device-fed row.
        let mut device_fed = row(1, 3, vec![], 0, 0);
        device_fed.device_token = true;
        assert_eq!(
            executor.submit(&verify_step(program, vec![device_fed]), &StepInputs::default()),
            Err(ExecutorError::DeviceFedUnsupported)
        );

        // A core of an older ABI has no programs at all.
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture(dir.path(), &FixtureSpec::abi2());
        let mut executor = GraphExecutor::new(core.manifest(), Emulator::new(&core)).unwrap();
        assert_eq!(
            executor.submit(&verify_step(program, rows()), &StepInputs::default()),
            Err(ExecutorError::Capacity(CapacityError::MissingProgram { requests: 1, depth: 3 }))
        );
    }

    /// A record may emit at most one token per lane its row used (a decode record exactly one).
    #[test]
    fn records_claiming_more_tokens_than_lanes_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture(dir.path(), &FixtureSpec::speculative());
        let m = core.manifest().clone();
        let mut executor =
            GraphExecutor::new(&m, Hooked { emulator: Emulator::new(&core), hook: super::overclaim }).unwrap();
        let program = SpeculativeProgram::rectangular(1, 3);
        // Pending token and one proposal, rejected: one token, claimed as two, fits two lanes…
        executor.submit(&verify_step(program, vec![row(1, 0, vec![1, 63], 0, 0)]), &StepInputs::default()).unwrap();
        assert_eq!(executor.synchronize().unwrap()[0].sampled.len(), 2);
        // …but a lone pending token has one lane.
        executor.submit(&verify_step(program, vec![row(1, 0, vec![1], 0, 0)]), &StepInputs::default()).unwrap();
        assert_eq!(executor.synchronize(), Err(ExecutorError::TooManyTokens { row: 0, count: 2, most: 1 }));

        let mut executor =
            GraphExecutor::new(&m, Hooked { emulator: Emulator::new(&core), hook: super::overclaim }).unwrap();
        let decode = Step {
            fence: helios_cache::Fence(1),
            ops: vec![StepOp::Decode { bucket: 1, rows: vec![row(1, 0, vec![1], 0, 0)] }],
        };
        executor.submit(&decode, &StepInputs::default()).unwrap();
        assert_eq!(executor.synchronize(), Err(ExecutorError::TooManyTokens { row: 0, count: 2, most: 1 }));
    }

    /// Device-fed generation needs every speculative graph to read and write the pending token.
    #[test]
    fn device_fed_needs_speculative_graphs_that_keep_the_pending_token() {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture_with(dir.path(), &FixtureSpec::speculative(), |f| {
            f.add_pending_tokens();
            let kind = helios_contract::pb::GraphKind::Speculative as i32;
            let pending = helios_contract::pb::ValueKind::PendingTokens as i32;
            for g in f.manifest.graphs.iter_mut().filter(|g| g.kind == kind) {
                g.bindings.retain(|b| b.value != pending);
            }
        });
        let executor = GraphExecutor::new(core.manifest(), Emulator::new(&core)).unwrap();
        assert!(!executor.device_fed_decode());
    }
}

/// Checkpoint stamps: restore and snapshot graphs that bind the epoch get the step's
/// (consumed, epoch); status records come back with the step, a rejected op as a typed error.
mod stamps {
    use super::support::device_fixture::{Emulator, Hooked, Moment, device_fixture, stamp_of};
    use super::*;
    use helios_contract::BoundContract;
    use helios_contract::model::{GraphId, MaintenanceOp, Manifest, ValueKind};
    use helios_contract::record::RecordError;
    use helios_replay::{Executor, ExecutorError, StepInputs};
    use helios_scheduler::{ConsumeRow, Step, StepOp};

    const EPOCH: u32 = 0x9abc_def0;

    fn step(fence: u64, ops: Vec<StepOp>) -> Step {
        Step { fence: helios_cache::Fence(fence), ops }
    }

    /// Live row 1 initialized and fed five prompt tokens (no sample).
    fn fill_row_1() -> Vec<StepOp> {
        let row = ConsumeRow {
            live_row: 1,
            start: 0,
            tokens: vec![3, 1, 4, 1, 5],
            device_token: false,
            page_table: vec![0],
            sample: None,
        };
        vec![StepOp::Initialize { live_row: 1, rows: 1 }, StepOp::Prefill { capacity: 64, row }]
    }

    fn snapshot(consumed: u32, epoch: u32, snapshot_row: u32) -> StepOp {
        StepOp::Snapshot { live_row: 1, snapshot_row, tail: None, consumed, epoch }
    }

    fn restore(consumed: u32, epoch: u32, snapshot_row: u32) -> StepOp {
        StepOp::Restore { snapshot_row, live_row: 2, tail: None, consumed, epoch }
    }

    /// The i32 values staged for `value` in `op`'s maintenance graph.
    fn staged(m: &Manifest, arena: &[u8], op: MaintenanceOp, value: ValueKind) -> Vec<i32> {
        let bound = BoundContract::bind(m);
        let view = bound.maintenance(op, 1).unwrap().view(value).unwrap().clone();
        let b = m.buffer(view.buffer).unwrap();
        view.read::<i32>(&arena[b.offset as usize..b.end() as usize]).unwrap()
    }

    /// A stamped core behind an executor whose records land a step late, live row 1 filled
    /// to 5 tokens and snapshotted (consumed 5, `EPOCH`): (its directory, manifest, snapshot
    /// row, executor).
    fn snapshotted() -> (tempfile::TempDir, Manifest, u32, GraphExecutor<Emulator>) {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture(dir.path(), &FixtureSpec::stamped());
        let m = core.manifest().clone();
        let snap = m.cache_scheme.snapshot_row(m.capacities.request_slots, 0);
        let mut emulator = Emulator::new(&core);
        emulator.deferred = true;
        let mut executor = GraphExecutor::new(&m, emulator).unwrap();
        let mut ops = fill_row_1();
        ops.push(snapshot(5, EPOCH, snap));
        executor.submit(&step(1, ops), &StepInputs::default()).unwrap();
        assert_eq!(executor.synchronize().unwrap().len(), 1);
        (dir, m, snap, executor)
    }

    #[test]
    fn maintenance_packs_the_checkpoint_stamp_and_the_device_checks_it() {
        let (_dir, m, snap, mut executor) = snapshotted();
        let arena = executor.backend().arena.clone();
        assert_eq!(staged(&m, &arena, MaintenanceOp::Snapshot, ValueKind::ExpectedConsumed), vec![5]);
        assert_eq!(
            staged(&m, &arena, MaintenanceOp::Snapshot, ValueKind::CheckpointEpoch),
            vec![EPOCH as i32],
            "the epoch's bits"
        );
        assert_eq!(staged(&m, &arena, MaintenanceOp::Snapshot, ValueKind::SourceRows), vec![1]);
        assert_eq!(stamp_of(&m, &arena, 1), (5, 0), "a live row's epoch is its initialize's");
        assert_eq!(stamp_of(&m, &arena, snap), (5, EPOCH));

        // Restored with the same stamp: the live row takes the checkpoint's.
        executor
            .submit(
                &step(2, vec![StepOp::Initialize { live_row: 2, rows: 1 }, restore(5, EPOCH, snap)]),
                &StepInputs::default(),
            )
            .unwrap();
        assert_eq!(executor.synchronize().unwrap().len(), 1);
        let arena = executor.backend().arena.clone();
        assert_eq!(staged(&m, &arena, MaintenanceOp::Restore, ValueKind::ExpectedConsumed), vec![5]);
        assert_eq!(stamp_of(&m, &arena, 2), (5, EPOCH));
    }

    #[test]
    fn a_rejected_checkpoint_is_a_typed_error_and_writes_nothing() {
        let (_dir, m, snap, mut executor) = snapshotted();

        // A snapshot one token off: the step is submitted, and fails when its records land.
        executor.submit(&step(2, vec![snapshot(6, EPOCH, snap + 1)]), &StepInputs::default()).unwrap();
        assert_eq!(
            executor.synchronize(),
            Err(ExecutorError::CheckpointRejected {
                op: MaintenanceOp::Snapshot,
                source_row: 1,
                destination_row: snap + 1,
                expected: (6, EPOCH),
                found: (5, 0),
            })
        );
        assert_eq!(stamp_of(&m, &executor.backend().arena, snap + 1), (0, 0), "nothing written");

        // A restore of the right count under another epoch, and of another count.
        for (consumed, epoch) in [(5, EPOCH ^ 1), (4, EPOCH)] {
            let before = executor.backend().arena.clone();
            executor.submit(&step(3, vec![restore(consumed, epoch, snap)]), &StepInputs::default()).unwrap();
            assert_eq!(
                executor.synchronize(),
                Err(ExecutorError::CheckpointRejected {
                    op: MaintenanceOp::Restore,
                    source_row: snap,
                    destination_row: 2,
                    expected: (consumed, epoch),
                    found: (5, EPOCH),
                })
            );
            let rows =
                m.buffers.iter().find(|b| b.role == helios_contract::model::BufferRole::ContinuationRows).unwrap();
            let (start, end) = (rows.offset as usize, rows.end() as usize);
            assert_eq!(executor.backend().arena[start..end], before[start..end], "no row written");
        }
    }

    /// A device that tampers with what a maintenance replay wrote: erases its status record
    /// (`erase`: as if never written) or makes it name another row.
    fn tamper_maintenance(erase: bool) -> impl FnMut(&mut Emulator, GraphId, Moment) {
        move |e, graph, when| {
            let m = e.manifest.clone();
            let g = m.graph(graph).unwrap();
            if when == Moment::Before || g.maintenance_op.is_none() {
                return;
            }
            let b = g.binding(ValueKind::CompletionRecords).unwrap();
            let at = (m.buffer(b.view.buffer).unwrap().offset + b.view.offset) as usize;
            if erase {
                e.arena[at..at + 4].fill(0);
            } else {
                e.arena[at + 4] ^= 4;
            }
        }
    }

    #[test]
    fn a_status_record_not_written_or_for_another_row_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture(dir.path(), &FixtureSpec::stamped());
        let m = core.manifest().clone();
        let initialize = step(1, vec![StepOp::Initialize { live_row: 1, rows: 1 }]);
        let erasing = Hooked { emulator: Emulator::new(&core), hook: tamper_maintenance(true) };
        let mut executor = GraphExecutor::new(&m, erasing).unwrap();
        executor.submit(&initialize, &StepInputs::default()).unwrap();
        assert_eq!(executor.synchronize(), Err(ExecutorError::Record { row: 0, error: RecordError::NotWritten(0) }));

        let renaming = Hooked { emulator: Emulator::new(&core), hook: tamper_maintenance(false) };
        let mut executor = GraphExecutor::new(&m, renaming).unwrap();
        executor.submit(&initialize, &StepInputs::default()).unwrap();
        assert_eq!(
            executor.synchronize(),
            Err(ExecutorError::CheckpointRecordRow { op: MaintenanceOp::Initialize, expected: 1, found: 5 })
        );
    }

    /// A core without stamps: maintenance gets -1 (unchecked) whatever the step carries, and
    /// nothing is read back.
    #[test]
    fn cores_without_stamps_check_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture(dir.path(), &FixtureSpec::speculative());
        let m = core.manifest().clone();
        let snap = m.cache_scheme.snapshot_row(m.capacities.request_slots, 0);
        let mut executor = GraphExecutor::new(&m, Emulator::new(&core)).unwrap();
        let mut ops = fill_row_1();
        ops.push(snapshot(99, EPOCH, snap));
        executor.submit(&step(1, ops), &StepInputs::default()).unwrap();
        assert_eq!(executor.synchronize().unwrap().len(), 1);
        let arena = executor.backend().arena.clone();
        assert_eq!(staged(&m, &arena, MaintenanceOp::Snapshot, ValueKind::ExpectedConsumed), vec![-1]);
        executor.submit(&step(2, vec![restore(7, 1, snap)]), &StepInputs::default()).unwrap();
        assert_eq!(executor.synchronize().unwrap().len(), 1);
        let arena = executor.backend().arena.clone();
        assert_eq!(staged(&m, &arena, MaintenanceOp::Restore, ValueKind::ExpectedConsumed), vec![-1]);
    }
}
