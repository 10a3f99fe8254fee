//! Speculation and device-fed decode: a batch gives up its second step in flight only for a
//! round it will verify. One request's proposals that would pay for a round of its own, but
//! not for its batch's, must not make every decoder host-fed (session 19 measured 2-3% of c=4
//! decode throughput lost that way on the H100). The test drives the scheduler as its own
//! executor with completions one step late.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use helios_cache::PrefixIdentity;
use helios_contract::model::{Capacities, SpeculativeProgram};
use helios_scheduler::{Completion, RequestId, RequestSpec, SampledToken, Scheduler, SchedulerConfig, Step, StepOp};

mod support;
use support::{sampled, scheme};

fn scheduler() -> Scheduler {
    let capacities = Capacities {
        context_limit: 512,
        decode_request_buckets: vec![1, 2, 4],
        prefill_chunk_capacities: vec![16, 64],
        image_patch_buckets: vec![],
        request_slots: 4,
        snapshot_rows: 8,
        max_kv_pages: 128,
        vocab_size: 1000,
        completion_record_header_words: 0,
        speculative_programs: [(1, 7), (2, 7), (4, 3)].map(|(b, d)| SpeculativeProgram::rectangular(b, d)).to_vec(),
    };
    let config = SchedulerConfig {
        max_concurrency: 4,
        queue_limit: 16,
        identity: PrefixIdentity { model: 1, token_layout: 1 },
        device_fed_decode: true,
        speculative_depth: 4,
    };
    let mut s = Scheduler::new(scheme(), capacities, config).unwrap();
    // Measured-like costs: a round of four requests costs 1.7 plain steps at any depth. One
    // request's three proposals at the prior acceptance (0.7) expect 2.53 tokens: worth a round
    // of its own at that cost (2.53 / 1.7 > 1), not its batch's ((2.53 + 3) / 1.7 < 4).
    let us = Duration::from_micros;
    s.set_verify_costs(4, us(1000), &[us(1000), us(1700), us(1700), us(1700)]);
    s
}

fn spec(tokens: Vec<u32>, seed: u64) -> RequestSpec {
    RequestSpec {
        tokens,
        images: vec![],
        message_endpoints: vec![],
        max_output_tokens: 48,
        eos_tokens: vec![],
        seed,
        needs_host_feedback: false,
    }
}

#[test]
fn one_requests_proposals_do_not_cost_its_batch_the_pipelining() {
    let mut s = scheduler();
    // The copier's history cycles through eight tokens and its samples continue the cycle, so
    // its proposer always proposes several; the other three sample fresh tokens and never do.
    let copier = s.submit(spec((0..32).map(|i| i % 8 + 1).collect(), 1)).unwrap();
    let others: Vec<RequestId> = (0..3u32)
        .map(|k| s.submit(spec((0..32).map(|i| 100 + k * 100 + i).collect(), 2 + u64::from(k))).unwrap())
        .collect();
    let mut next: HashMap<RequestId, u32> =
        others.iter().enumerate().map(|(k, &id)| (id, 500 + 150 * k as u32)).collect();
    let mut in_flight: VecDeque<Step> = VecDeque::new();
    let (mut decode_steps, mut device_fed_steps) = (0, 0);
    for _ in 0..400 {
        if s.is_idle() && in_flight.is_empty() {
            break;
        }
        match s.schedule() {
            Some(step) => {
                let rows: Vec<bool> = step
                    .ops
                    .iter()
                    .flat_map(|op| match op {
                        StepOp::Decode { rows, .. } => rows.iter().map(|r| r.device_token).collect(),
                        _ => vec![],
                    })
                    .collect();
                if rows.len() == 4 {
                    decode_steps += 1;
                    device_fed_steps += usize::from(rows.iter().any(|&d| d));
                }
                in_flight.push_back(step);
                if in_flight.len() < 2 {
                    continue;
                }
            }
            None if in_flight.is_empty() => continue,
            None => {}
        }
        let step = in_flight.pop_front().expect("a step in flight");
        let verifies = step.ops.iter().any(|op| matches!(op, StepOp::Verify { .. }));
        assert!(!verifies, "a round was planned where none pays for its batch");
        let tokens = sampled(&step)
            .into_iter()
            .map(|request| {
                let t = next.entry(request).or_insert(0); // the copier's cycle restarts at 1
                *t = if request == copier { *t % 8 + 1 } else { *t + 1 };
                let token = *t;
                SampledToken { request, token }
            })
            .collect();
        s.complete(&Completion { fence: step.fence, sampled: tokens });
        s.take_finished();
        s.check_invariants();
    }
    assert!(s.is_idle(), "did not drain");
    let stats = s.stats();
    assert!(decode_steps >= 30, "{decode_steps} four-row decode steps");
    assert_eq!(stats.verify_steps, 0);
    assert_eq!(stats.host_fed_without_round, 0, "{stats:?}");
    // In steady state every other four-row step consumes the samples still in flight.
    assert!(device_fed_steps * 3 >= decode_steps, "{device_fed_steps} of {decode_steps} four-row steps device-fed");
}
