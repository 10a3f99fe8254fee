//! Held requests (`Scheduler::hold` / `resume`): nothing that samples for a held request is
//! planned, a held request never stops the other decoders' lockstep, and it rejoins once
//! resumed. The test drives the scheduler as its own executor (every sample is token 7).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;

use helios_cache::PrefixIdentity;
use helios_contract::model::Capacities;
use helios_scheduler::{
    Completion, FinishReason, RequestId, RequestSpec, SampledToken, Scheduler, SchedulerConfig, Step, StepOp,
};
use proptest::prelude::*;

mod support;
use support::{sampled, scheme};

fn capacities(pages: u32) -> Capacities {
    Capacities {
        context_limit: 512,
        decode_request_buckets: vec![1, 2, 4],
        prefill_chunk_capacities: vec![16, 64],
        image_patch_buckets: vec![],
        request_slots: 4,
        snapshot_rows: 4,
        max_kv_pages: pages,
        vocab_size: 100,
        completion_record_header_words: 0,
        speculative_programs: vec![],
    }
}

fn scheduler(pages: u32, device_fed: bool) -> Scheduler {
    let config = SchedulerConfig {
        max_concurrency: 3,
        queue_limit: 16,
        identity: PrefixIdentity { model: 1, token_layout: 1 },
        device_fed_decode: device_fed,
        speculative_depth: 0,
    };
    Scheduler::new(scheme(), capacities(pages), config).unwrap()
}

fn spec(prompt: usize, salt: u32, max_output: u32, host_feedback: bool) -> RequestSpec {
    RequestSpec {
        tokens: (0..prompt as u32).map(|i| (i * 7 + salt) % 90 + 1).collect(),
        images: vec![],
        message_endpoints: vec![],
        max_output_tokens: max_output,
        eos_tokens: vec![],
        seed: u64::from(salt),
        needs_host_feedback: host_feedback,
    }
}

fn completion(step: &Step) -> Completion {
    let sampled = sampled(step).into_iter().map(|request| SampledToken { request, token: 7 }).collect();
    Completion { fence: step.fence, sampled }
}

/// Plans one step and asserts it samples no held request.
fn plan(s: &mut Scheduler) -> Option<Step> {
    let step = s.schedule()?;
    for id in sampled(&step) {
        assert!(!s.is_held(id), "held request {id:?} was planned to sample");
    }
    s.check_invariants();
    Some(step)
}

/// Plans and completes steps (no lag) until `id` has sampled `n` times.
fn run_until_sampled(s: &mut Scheduler, id: RequestId, n: usize) {
    let mut seen = 0;
    for _ in 0..200 {
        let step = plan(s).expect("work to plan");
        seen += sampled(&step).iter().filter(|&&r| r == id).count();
        s.complete(&completion(&step));
        if seen >= n {
            return;
        }
    }
    panic!("{id:?} sampled {seen} of {n} times");
}

fn drain(s: &mut Scheduler) -> Vec<helios_scheduler::FinishedRequest> {
    let mut finished = Vec::new();
    for _ in 0..2000 {
        if s.is_idle() {
            return finished;
        }
        if let Some(step) = plan(s) {
            s.complete(&completion(&step));
        }
        finished.extend(s.take_finished());
    }
    panic!("did not drain");
}

#[test]
fn a_held_request_is_not_planned_and_rejoins_when_resumed() {
    let mut s = scheduler(64, false);
    let a = s.submit(spec(20, 1, 30, true)).unwrap();
    let b = s.submit(spec(24, 2, 30, true)).unwrap();
    run_until_sampled(&mut s, a, 2);
    run_until_sampled(&mut s, b, 2);
    assert!(s.hold(a));
    assert!(s.is_held(a));
    // B decodes in every step while A waits.
    for _ in 0..5 {
        let step = plan(&mut s).expect("B decodes");
        assert_eq!(sampled(&step), vec![b]);
        s.complete(&completion(&step));
    }
    s.resume(a);
    let step = plan(&mut s).expect("both decode");
    let mut both = sampled(&step);
    both.sort();
    assert_eq!(both, vec![a, b], "A rejoins B's batch");
    s.complete(&completion(&step));
    let finished = drain(&mut s);
    assert_eq!(finished.len(), 2);
    for f in finished {
        assert_eq!((f.reason, f.output.len()), (FinishReason::Length, 30));
    }
    // Nothing left to hold.
    assert!(!s.hold(a));
}

#[test]
fn a_held_request_in_flight_does_not_stop_the_lockstep() {
    let mut s = scheduler(64, false);
    let a = s.submit(spec(20, 1, 30, true)).unwrap();
    let b = s.submit(spec(24, 2, 30, true)).unwrap();
    run_until_sampled(&mut s, a, 1);
    run_until_sampled(&mut s, b, 1);
    // A decodes alone while B is held; its sample stays in flight.
    assert!(s.hold(b));
    let first = plan(&mut s).expect("A decodes");
    assert_eq!(sampled(&first), vec![a]);
    // Now A is held with one sample in flight (the host-fed limit) and B is ready: B must
    // still be planned, although A alone would otherwise keep the decoders in lockstep.
    assert!(s.hold(a));
    s.resume(b);
    let second = plan(&mut s).expect("B decodes");
    assert_eq!(sampled(&second), vec![b]);
    let accepted = s.complete(&completion(&first));
    assert_eq!(accepted.len(), 1, "A's sample in flight is accepted while it is held");
    s.complete(&completion(&second));
    s.resume(a);
    assert_eq!(drain(&mut s).len(), 2);
}

#[test]
fn held_requests_wait_for_admission_and_their_final_prefill_chunk() {
    let mut s = scheduler(64, false);
    // A waiting held request is skipped; a later one is admitted.
    let a = s.submit(spec(10, 1, 4, true)).unwrap();
    assert!(s.hold(a));
    let b = s.submit(spec(100, 2, 4, true)).unwrap();
    let step = plan(&mut s).expect("B admitted");
    assert!(step.ops.iter().any(|op| matches!(op, StepOp::Prefill { row, .. } if row.start == 0)));
    assert_eq!(s.occupancy().running, 1);
    s.complete(&completion(&step));
    // B's prompt takes two chunks: the first does not sample and runs while B is held; the
    // last one samples and waits.
    assert!(s.hold(b));
    assert!(plan(&mut s).is_none(), "B's final chunk samples: nothing to plan");
    s.resume(b);
    let step = plan(&mut s).expect("final chunk");
    assert_eq!(sampled(&step), vec![b]);
    s.complete(&completion(&step));
    s.resume(a);
    let finished = drain(&mut s);
    assert_eq!(finished.len(), 2);
    // Cancelled and unknown requests cannot be held.
    let c = s.submit(spec(10, 3, 4, true)).unwrap();
    s.cancel(c);
    assert!(!s.hold(c));
    assert!(!s.hold(RequestId(999)));
}

#[derive(Clone, Debug)]
enum Action {
    Hold(usize),
    Resume(usize),
    /// Plan one step (it stays in flight).
    Plan,
    /// Complete the oldest step in flight.
    Complete,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        1 => (0usize..3).prop_map(Action::Hold),
        1 => (0usize..3).prop_map(Action::Resume),
        3 => Just(Action::Plan),
        3 => Just(Action::Complete),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    /// Random holds and resumes over host-fed and device-fed decoders, tight or roomy pools
    /// (preemption of held requests included): no held request is ever planned to sample,
    /// invariants hold, and once everything is resumed every request finishes with its whole
    /// output (or, in a tight pool, is told the pool cannot hold it).
    #[test]
    fn holds_never_plan_samples_and_everything_finishes(
        device_fed in any::<bool>(),
        tight in any::<bool>(),
        feedback in prop::collection::vec(any::<bool>(), 3),
        actions in prop::collection::vec(action(), 1..80),
    ) {
        let mut s = scheduler(if tight { 9 } else { 64 }, device_fed);
        let ids: Vec<RequestId> = (0..3)
            .map(|i| s.submit(spec(18 + 11 * i, i as u32 + 1, 25, feedback[i])).unwrap())
            .collect();
        let mut in_flight: VecDeque<Step> = VecDeque::new();
        let mut finished = Vec::new();
        for a in actions {
            match a {
                Action::Hold(i) => {
                    s.hold(ids[i]);
                }
                Action::Resume(i) => s.resume(ids[i]),
                Action::Plan if in_flight.len() < 2 => {
                    if let Some(step) = plan(&mut s) {
                        in_flight.push_back(step);
                    }
                }
                Action::Plan => {}
                Action::Complete => {
                    if let Some(step) = in_flight.pop_front() {
                        s.complete(&completion(&step));
                        s.check_invariants();
                    }
                }
            }
            finished.extend(s.take_finished());
        }
        for &id in &ids {
            s.resume(id);
        }
        for _ in 0..4000 {
            if s.is_idle() && in_flight.is_empty() {
                break;
            }
            let planned = if in_flight.len() < 2 { plan(&mut s) } else { None };
            match planned {
                Some(step) => in_flight.push_back(step),
                None => {
                    let step = in_flight.pop_front();
                    prop_assert!(step.is_some(), "stalled with nothing in flight");
                    if let Some(step) = step {
                        s.complete(&completion(&step));
                    }
                }
            }
            s.check_invariants();
            finished.extend(s.take_finished());
        }
        finished.extend(s.take_finished());
        prop_assert!(s.is_idle(), "did not drain");
        prop_assert_eq!(finished.len(), 3);
        for f in finished {
            prop_assert!(
                f.reason == FinishReason::PoolExhausted || (f.reason == FinishReason::Length && f.output.len() == 25),
                "{:?}", f
            );
        }
    }
}
