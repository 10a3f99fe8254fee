//! The graph executor over the CPU emulation of the fixture core's graphs: the scheduler's
//! steps are packed through the bound contract, replayed, and answered from completion
//! records. The same run on the GPU (examples/cuda_replay_check) must give the same tokens.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use helios_contract::fixtures::FixtureSpec;
use helios_replay::graph::GraphExecutor;
use helios_replay::turn;
use helios_scheduler::{FinishReason, RequestSpec, Scheduler, SchedulerConfig};
use support::device_fixture::{Emulator, device_fixture};

fn run(spec: &FixtureSpec, prompts: &[Vec<u32>], max_output: u32) -> Vec<(Vec<u32>, FinishReason)> {
    let dir = tempfile::tempdir().unwrap();
    let core = device_fixture(dir.path(), spec);
    let m = core.manifest().clone();
    let mut executor = GraphExecutor::new(&m, Emulator::new(&core)).expect("drivable core");
    let config = SchedulerConfig { max_concurrency: 4, queue_limit: 64, identity: Default::default() };
    let mut scheduler = Scheduler::new(m.cache_scheme.clone(), m.capacities.clone(), config).unwrap();
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| {
            scheduler
                .submit(RequestSpec {
                    tokens: p.clone(),
                    images: vec![],
                    message_endpoints: vec![],
                    max_output_tokens: max_output,
                    eos_tokens: vec![],
                    seed: 1,
                })
                .unwrap()
        })
        .collect();
    let mut finished = Vec::new();
    for _ in 0..10_000 {
        if scheduler.is_idle() {
            break;
        }
        turn(&mut scheduler, &mut executor).expect("executes");
        finished.extend(scheduler.take_finished());
        scheduler.check_invariants();
    }
    assert!(scheduler.is_idle());
    scheduler.evict_cache();
    assert!(scheduler.all_storage_free());
    ids.iter()
        .map(|id| {
            let f = finished.iter().find(|f| f.id == *id).expect("finished");
            (f.output.clone(), f.reason)
        })
        .collect()
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
    let first = run(&spec, &prompts, 12);
    for (output, reason) in &first {
        assert_eq!(output.len(), 12);
        assert_eq!(*reason, FinishReason::Length);
        assert!(output.iter().all(|&t| t < vocab));
    }
    // Deterministic: packing, replay and record parsing are pure functions of the steps.
    assert_eq!(run(&spec, &prompts, 12), first);
}
