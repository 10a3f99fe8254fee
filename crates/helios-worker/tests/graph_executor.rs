//! Whole requests through the serving loop over the graph executor, on the CPU emulation of
//! the fixture core's graphs: the scheduler's steps are packed through the bound contract,
//! replayed, and answered from completion records. The same run on the GPU
//! (examples/cuda_replay_check) must give the same tokens.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../helios-replay/tests/support/device_fixture.rs"]
mod device_fixture;

use device_fixture::{Emulator, Hooked, Moment, PacedReads, device_fixture, device_fixture_with};
use helios_contract::RuntimeCore;
use helios_contract::fixtures::FixtureSpec;
use helios_replay::graph::{GraphBackend, GraphExecutor};
use helios_scheduler::{RequestSpec, Scheduler, SchedulerConfig};
use helios_worker::FinishCause;
use helios_worker::drive::LoopDriver;
use helios_worker::workload::{finish, test_config};

fn request(tokens: Vec<u32>, max_output: u32, seed: u64) -> RequestSpec {
    RequestSpec::plain(tokens, max_output, seed)
}

fn run(spec: &FixtureSpec, prompts: &[Vec<u32>], max_output: u32, deferred: bool) -> Vec<(Vec<u32>, FinishCause)> {
    run_on(spec, prompts, max_output, |core| {
        let mut emulator = Emulator::new(core);
        emulator.deferred = deferred;
        emulator
    })
    .0
}

/// The requests' outputs and the number of steps the scheduler took, over `backend(core)`.
fn run_on<B: GraphBackend>(
    spec: &FixtureSpec,
    prompts: &[Vec<u32>],
    max_output: u32,
    backend: impl FnOnce(&RuntimeCore) -> B,
) -> (Vec<(Vec<u32>, FinishCause)>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let core = device_fixture(dir.path(), spec);
    let m = core.manifest().clone();
    let executor = GraphExecutor::new(&m, backend(&core)).expect("drivable core");
    // The fixture's graphs take their tokens from the host only.
    assert!(!helios_replay::Executor::device_fed_decode(&executor));
    let config = test_config(4);
    let scheduler = Scheduler::new(m.cache_scheme.clone(), m.capacities.clone(), config).unwrap();
    let mut d = LoopDriver::new(scheduler, executor, m.capacities.vocab_size).unwrap();
    for p in prompts {
        d.submit(request(p.clone(), max_output, 1)).unwrap();
    }
    d.drain().unwrap();
    let outputs = d.take_ended().iter().map(|e| (e.output.clone(), finish(e).cause)).collect::<Vec<_>>();
    assert_eq!(outputs.len(), prompts.len());
    let scheduler = d.scheduler_mut();
    scheduler.evict_cache();
    assert!(scheduler.all_storage_free());
    (outputs, scheduler.stats().steps)
}

#[test]
fn steps_replay_through_records() {
    let spec = FixtureSpec::default();
    let vocab = spec.vocab_size;
    let prompts: Vec<Vec<u32>> = vec![
        (0..70).map(|i| i % vocab).collect(),
        (0..70).map(|i| i % vocab).collect(), // shares the first's prefix
        (5..40).map(|i| (i * 7) % vocab).collect(),
    ];
    let first = run(&spec, &prompts, 12, false);
    for (output, reason) in &first {
        assert_eq!(output.len(), 12);
        assert_eq!(*reason, FinishCause::Length);
        assert!(output.iter().all(|&t| t < vocab));
    }
    // Deterministic: packing, replay and record parsing are pure functions of the steps.
    assert_eq!(run(&spec, &prompts, 12, false), first);
    // Records copied behind the replay and collected a turn later: the scheduler plans with
    // a step in flight, so batches differ (and this fixture's graphs are not request-
    // deterministic), but every request completes, in fence order, deterministically.
    let deferred = run(&spec, &prompts, 12, true);
    for (output, reason) in &deferred {
        assert_eq!((output.len(), *reason), (12, FinishCause::Length));
    }
    assert_eq!(run(&spec, &prompts, 12, true), deferred);
}

/// The device check (examples/cuda_replay_check) compares a GPU run with the emulation step
/// for step. A device's reads land when its timing says, which changes the schedule and so
/// (this fixture's graphs depend on the batch) the tokens; pacing the reads restores both.
#[test]
fn paced_reads_give_the_emulated_schedule_whatever_the_device_timing() {
    let spec = FixtureSpec::default();
    let vocab = spec.vocab_size;
    let prompts: Vec<Vec<u32>> =
        (0..8u32).map(|r| (0..(r % 3) * 40 + 30 + r).map(|i| (i * 5 + r) % vocab).collect()).collect();
    let emulated = |fast: bool| {
        move |core: &RuntimeCore| {
            let mut e = Emulator::new(core);
            e.deferred = true;
            e.reads_land_at_once = fast;
            e
        }
    };
    let paced = run_on(&spec, &prompts, 16, emulated(false));
    let fast = run_on(&spec, &prompts, 16, emulated(true));
    // A fast "device" changes the schedule, and with it the tokens: the raw comparison fails.
    assert_ne!(fast.1, paced.1, "steps");
    assert_ne!(fast.0, paced.0, "outputs");
    let fast_paced = run_on(&spec, &prompts, 16, |core| PacedReads::new(emulated(true)(core)));
    assert_eq!(fast_paced, paced);
}

/// Whole requests with two decode steps in flight, on graphs that keep the pending token.
#[test]
fn device_fed_requests_run_with_two_steps_in_flight() {
    let spec = FixtureSpec::default();
    let dir = tempfile::tempdir().unwrap();
    let core = device_fixture_with(dir.path(), &spec, |f| {
        f.add_pending_tokens();
    });
    let m = core.manifest().clone();
    let mut emulator = Emulator::new(&core);
    emulator.deferred = true;
    let executor = GraphExecutor::new(&m, emulator).unwrap();
    let config = SchedulerConfig { device_fed_decode: true, ..test_config(4) };
    let scheduler = Scheduler::new(m.cache_scheme.clone(), m.capacities.clone(), config).unwrap();
    let mut d = LoopDriver::new(scheduler, executor, m.capacities.vocab_size).unwrap();
    for p in 0..3u32 {
        let tokens = (0..40).map(|i| (i * 3 + p) % spec.vocab_size).collect();
        d.submit(request(tokens, 10, 1)).unwrap();
    }
    d.drain().unwrap();
    let finished = d.take_ended();
    assert_eq!(finished.len(), 3);
    assert!(finished.iter().all(|f| f.output.len() == 10 && finish(f).cause == FinishCause::Length));
}

/// Whole requests with copy proposals verified through the fixture's speculative programs, host-
/// and device-fed, records landing at once or a turn later. The emulated programs verify with a
/// toy sampler of their own (not the decode graph's), so outputs differ from a run without
/// speculation; what must hold is that every round's multi-token records land as samples the
/// scheduler accepts: each request completes at its length, and storage drains.
#[test]
fn speculative_rounds_replay_through_records() {
    speculative_rounds(&FixtureSpec::speculative());
}

/// The same rounds on a core with checkpoint stamps: the captures after speculative rounds
/// pass the device's consumed-count check (the accepted proposals are counted on both sides).
#[test]
fn speculative_rounds_keep_stamps_exact() {
    speculative_rounds(&FixtureSpec::stamped());
}

fn speculative_rounds(spec: &FixtureSpec) {
    let spec = spec.clone();
    for (device_fed, deferred) in [(false, false), (false, true), (true, true)] {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture_with(dir.path(), &spec, |f| {
            if device_fed {
                f.add_pending_tokens();
            }
        });
        let m = core.manifest().clone();
        let mut emulator = Emulator::new(&core);
        emulator.deferred = deferred;
        let executor = GraphExecutor::new(&m, emulator).unwrap();
        assert_eq!(helios_replay::Executor::device_fed_decode(&executor), device_fed);
        let config = SchedulerConfig { device_fed_decode: device_fed, speculative_depth: 3, ..test_config(4) };
        let scheduler = Scheduler::new(m.cache_scheme.clone(), m.capacities.clone(), config).unwrap();
        let mut d = LoopDriver::new(scheduler, executor, m.capacities.vocab_size).unwrap();
        for p in 0..3u32 {
            // Repetitive prompts: the history offers copy proposals.
            let tokens = (0..48).map(|i| (i % 6) * 5 + p).collect();
            d.submit(request(tokens, 24, 1)).unwrap();
        }
        d.drain().unwrap();
        let finished = d.take_ended();
        assert_eq!(finished.len(), 3);
        for f in &finished {
            assert_eq!((f.output.len(), finish(f).cause), (24, FinishCause::Length), "device-fed {device_fed}");
            assert!(f.output.iter().all(|&t| t < spec.vocab_size));
        }
        let scheduler = d.scheduler_mut();
        let stats = scheduler.stats();
        assert!(stats.verify_steps > 0 && stats.proposed_tokens > 0, "no speculative round (device-fed {device_fed})");
        assert!(stats.captures > 0);
        scheduler.evict_cache();
        assert!(scheduler.all_storage_free());
    }
}

/// The verification cost a core measures decides whether requests propose at all: the same
/// repetitive workload verifies when a round costs about a plain step and never when it costs
/// as much as the tokens it could yield. Measuring replays padding only, and serving goes on
/// after it. (That padding writes nothing a request owns is the prepared graphs' invariant,
/// checked in Ignition's tests; this toy emulator's kernels accumulate into scratch anyway.)
#[test]
fn measured_verification_cost_gates_proposals() {
    use helios_replay::Executor;
    use helios_scheduler::StepOp;
    use std::time::Duration;
    let spec = FixtureSpec::speculative();
    let run = |round_ms: Option<f64>, measure: bool| {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture(dir.path(), &spec);
        let m = core.manifest().clone();
        let mut executor = GraphExecutor::new(&m, Emulator::new(&core)).unwrap();
        if measure {
            let program = m.capacities.speculative_program_for(1, 3).unwrap();
            for op in [StepOp::Decode { bucket: 1, rows: vec![] }, StepOp::Verify { program, rows: vec![] }] {
                assert!(executor.measure_step(&op, 3).unwrap().is_some());
            }
        }
        let config = SchedulerConfig { speculative_depth: 3, ..test_config(4) };
        let mut scheduler = Scheduler::new(m.cache_scheme.clone(), m.capacities.clone(), config).unwrap();
        if let Some(ms) = round_ms {
            for &bucket in &m.capacities.decode_request_buckets {
                let depths = scheduler.verify_costs(bucket).len();
                let round = vec![Duration::from_secs_f64(ms / 1e3); depths];
                scheduler.set_verify_costs(bucket, Duration::from_millis(1), &round);
                assert!(depths < 2 || scheduler.verify_costs(bucket)[1] >= 1.0);
            }
        }
        let mut d = LoopDriver::new(scheduler, executor, m.capacities.vocab_size).unwrap();
        for p in 0..3u32 {
            d.submit(request((0..48).map(|i| (i % 6) * 5 + p).collect(), 24, 1)).unwrap();
        }
        d.drain().unwrap();
        let outputs: Vec<Vec<u32>> = d.take_ended().into_iter().map(|f| f.output).collect();
        (d.scheduler_mut().stats().verify_steps, outputs)
    };
    let (cheap, _) = run(Some(1.05), false);
    assert!(cheap > 0, "a round about as cheap as a step: requests propose");
    let (expensive, _) = run(Some(10.0), false);
    assert_eq!(expensive, 0, "a round costing ten steps never pays at depth 3");
    let (_, outputs) = run(None, true);
    assert!(outputs.len() == 3 && outputs.iter().all(|o| o.len() == 24));
}

/// A device that flips one bit of a snapshot row's epoch just before it is restored: what a
/// corrupted host copy or a stale snapshot row would look like to a stamping device.
fn flip_restored_epoch(e: &mut Emulator, graph: helios_contract::model::GraphId, when: Moment) {
    use helios_contract::model::{MaintenanceOp, ValueKind};
    let m = e.manifest.clone();
    let g = m.graph(graph).unwrap();
    if when == Moment::Before && g.maintenance_op == Some(MaintenanceOp::Restore) {
        let b = g.binding(ValueKind::SourceRows).unwrap();
        let at = (m.buffer(b.view.buffer).unwrap().offset + b.view.offset) as usize;
        let source = u32::from_le_bytes(e.arena[at..at + 4].try_into().unwrap());
        let epoch = device_fixture::stamp_at(&m, source).unwrap() as usize + 4;
        e.arena[epoch] ^= 1;
    }
}

/// Whole requests over a core with checkpoint stamps: every capture and every restore of a
/// shared prefix (records read back at once or a turn later) passes the device's checks, so
/// the scheduler's (consumed, epoch) pairs are the rows' own.
#[test]
fn stamped_checkpoints_pass_the_device_checks() {
    let spec = FixtureSpec::stamped();
    let vocab = spec.vocab_size;
    let prompts: Vec<Vec<u32>> = vec![
        (0..70).map(|i| i % vocab).collect(),
        (0..70).map(|i| i % vocab).collect(),
        (0..90).map(|i| i % vocab).collect(),
        (5..40).map(|i| (i * 7) % vocab).collect(),
    ];
    for deferred in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let core = device_fixture(dir.path(), &spec);
        let m = core.manifest().clone();
        let mut emulator = Emulator::new(&core);
        emulator.deferred = deferred;
        let executor = GraphExecutor::new(&m, emulator).unwrap();
        let scheduler = Scheduler::new(m.cache_scheme.clone(), m.capacities.clone(), test_config(4)).unwrap();
        let mut d = LoopDriver::new(scheduler, executor, vocab).unwrap();
        // One at a time, so the later prompts find the earlier ones' checkpoints.
        for p in &prompts {
            d.submit(request(p.clone(), 8, 1)).unwrap();
            d.drain().unwrap();
        }
        let ended = d.take_ended();
        assert_eq!(ended.len(), prompts.len());
        assert!(ended.iter().all(|e| e.output.len() == 8 && finish(e).cause == FinishCause::Length));
        let stats = d.scheduler().stats();
        assert!(stats.captures > 0 && stats.prefix_hit_tokens >= 70 + 70, "{stats:?}");
    }
}

/// A restore the device rejects stops the loop with the typed error (the serving loop then
/// fails every request and marks the worker failed, as for any executor failure).
#[test]
fn a_rejected_restore_stops_the_loop_with_a_typed_error() {
    use helios_contract::model::MaintenanceOp;
    use helios_replay::ExecutorError;
    use helios_worker::LoopError;
    let spec = FixtureSpec::stamped();
    let dir = tempfile::tempdir().unwrap();
    let core = device_fixture(dir.path(), &spec);
    let m = core.manifest().clone();
    let executor =
        GraphExecutor::new(&m, Hooked { emulator: Emulator::new(&core), hook: flip_restored_epoch }).unwrap();
    let scheduler = Scheduler::new(m.cache_scheme.clone(), m.capacities.clone(), test_config(4)).unwrap();
    let mut d = LoopDriver::new(scheduler, executor, spec.vocab_size).unwrap();
    let prompt: Vec<u32> = (0..70).map(|i| i % spec.vocab_size).collect();
    d.submit(request(prompt.clone(), 4, 1)).unwrap();
    d.drain().unwrap();
    d.submit(request(prompt, 4, 1)).unwrap();
    match d.drain() {
        Err(LoopError::Executor(ExecutorError::CheckpointRejected {
            op: MaintenanceOp::Restore,
            destination_row,
            expected,
            found,
            ..
        })) => {
            assert!((1..=spec.request_slots).contains(&destination_row));
            assert_eq!(expected.0, found.0);
            assert_eq!(expected.1 ^ 1, found.1, "the flipped bit");
        }
        other => panic!("expected a rejected restore, got {other:?}"),
    }
}
