//! Deterministic scenarios and property tests over random agent workloads, every request run
//! through the serving loop (the worker's model loop, turned by [`LoopDriver`]) and compared
//! with its solo run.
#![allow(clippy::unwrap_used)]

use helios_contract::model::SpeculativeProgram;
use helios_contract::model::{CacheScheme, Capacities};
use helios_replay::SimModel;
use helios_replay::{Executor, SimulatedExecutor, StepLog, reference_schemes, test_capacities};
use helios_scheduler::{AdmissionError, RequestSpec, Scheduler, SchedulerConfig, StepOp};
use helios_worker::drive::{Ended, LoopDriver};
use helios_worker::workload::{
    Action, Tiers, assert_matches_oracle, assert_matches_oracle_as, finish, run_alone, run_workload,
    run_workload_tiered, test_config, tiered_scheduler,
};
use helios_worker::{FinishCause, RequestError};
use proptest::prelude::*;

fn spec(tokens: Vec<u32>, max_output: u32, seed: u64) -> RequestSpec {
    RequestSpec::plain(tokens, max_output, seed)
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + salt) % 96 + 1).collect()
}

/// The serving loop over `executor` and a fresh scheduler of `concurrency` slots.
fn looped<E: Executor>(scheme: &CacheScheme, caps: &Capacities, concurrency: u32, executor: E) -> LoopDriver<E> {
    looped_over(Scheduler::new(scheme.clone(), caps.clone(), test_config(concurrency)).unwrap(), caps, executor)
}

fn looped_over<E: Executor>(scheduler: Scheduler, caps: &Capacities, executor: E) -> LoopDriver<E> {
    LoopDriver::new(scheduler, executor, caps.vocab_size).unwrap()
}

/// Drains the loop and returns the one request that ended.
fn drain_one<E: Executor>(d: &mut LoopDriver<E>) -> Ended {
    d.drain().unwrap();
    let mut ended = d.take_ended();
    assert_eq!(ended.len(), 1, "{ended:?}");
    ended.pop().unwrap()
}

/// The serving loop over a fresh simulated executor and a scheduler over `tiers`.
fn tiered_loop(scheme: &CacheScheme, caps: &Capacities, tiers: &Tiers) -> LoopDriver<SimulatedExecutor> {
    let mut executor = SimulatedExecutor::new(scheme, caps);
    let scheduler = tiered_scheduler(&mut executor, scheme, caps, 4, tiers).unwrap();
    looped_over(scheduler, caps, executor)
}

/// Serves each conversation in turn through a loop over `tiers`, then shuts it down with the
/// write-out. Returns each conversation's history (prompt and output), the write-out's rounds,
/// and the GPU checkpoints cached before and after it.
fn served_then_written_out(
    scheme: &CacheScheme,
    caps: &Capacities,
    tiers: &Tiers,
    conversations: &[RequestSpec],
) -> (Vec<Vec<u32>>, u32, usize, usize) {
    let mut d = tiered_loop(scheme, caps, tiers);
    let mut histories = Vec::new();
    for c in conversations {
        d.submit(c.clone()).unwrap();
        let mut h = c.tokens.clone();
        h.extend(drain_one(&mut d).output);
        histories.push(h);
    }
    let before = d.scheduler().cached_checkpoints();
    let rounds = write_out(&mut d);
    (histories, rounds, before, d.scheduler().cached_checkpoints())
}

/// A graceful shutdown's write-out, as the serving loop runs it: returns the rounds it took.
fn write_out<E: Executor>(d: &mut LoopDriver<E>) -> u32 {
    let (rounds, left) = d.write_out(std::time::Duration::from_secs(30)).unwrap();
    assert_eq!(left, 0, "everything reached the disk");
    d.scheduler().check_invariants();
    rounds
}

fn admission(e: RequestError) -> AdmissionError {
    match e {
        RequestError::Admission(a) => a,
        other => panic!("not an admission error: {other:?}"),
    }
}

#[test]
fn page_boundary_prefixes_hit_and_match_solo_runs() {
    for scheme in reference_schemes() {
        let caps = test_capacities(4, 64, 16);
        for len in [1usize, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257] {
            let mut d = looped(&scheme, &caps, 4, SimulatedExecutor::new(&scheme, &caps));
            let first = spec(prompt(len, 3), 4, 1);
            d.submit(first.clone()).unwrap();
            let out = drain_one(&mut d).output;
            assert_eq!(out, run_alone(&scheme, &caps, &first));
            // Same prompt again: full-prompt hit through resume sampling, other seed.
            let again = spec(prompt(len, 3), 4, 2);
            d.submit(again.clone()).unwrap();
            assert_eq!(drain_one(&mut d).output, run_alone(&scheme, &caps, &again));
            assert!(d.scheduler().stats().full_prompt_hits >= 1, "len {len}: expected a full hit");
            // Continue the conversation: hit on the terminal endpoint.
            let mut longer = first.tokens.clone();
            longer.extend(&out);
            longer.extend(prompt(5, 9));
            let next = spec(longer, 3, 3);
            d.submit(next.clone()).unwrap();
            assert_eq!(drain_one(&mut d).output, run_alone(&scheme, &caps, &next));
            assert!(d.scheduler().stats().prefix_hit_tokens as usize >= 2 * len);
            d.scheduler_mut().evict_cache();
            assert!(d.scheduler().all_storage_free());
        }
    }
}

#[test]
fn branches_continue_independently() {
    for scheme in reference_schemes() {
        let caps = test_capacities(4, 64, 16);
        let mut d = looped(&scheme, &caps, 4, SimulatedExecutor::new(&scheme, &caps));
        let mut root = spec(prompt(150, 1), 6, 1);
        root.message_endpoints = vec![40, 100];
        d.submit(root.clone()).unwrap();
        assert_eq!(drain_one(&mut d).output, run_alone(&scheme, &caps, &root));
        let mut branches = Vec::new();
        for (i, cut) in [40usize, 100, 150].into_iter().enumerate() {
            let mut tokens = root.tokens[..cut].to_vec();
            tokens.extend(prompt(10 + i, 50 + i as u32));
            let b = spec(tokens, 8, 10 + i as u64);
            d.submit(b.clone()).unwrap();
            branches.push(b);
        }
        d.drain().unwrap();
        let done = d.take_ended();
        assert_eq!(done.len(), branches.len());
        for (b, e) in branches.iter().zip(&done) {
            assert_eq!(e.output, run_alone(&scheme, &caps, b));
        }
        assert!(d.scheduler().stats().prefix_hit_tokens >= 40 + 100 + 150);
    }
}

#[test]
fn eos_and_output_limits() {
    let scheme = reference_schemes().remove(0);
    let caps = test_capacities(2, 32, 4);
    let mut d = looped(&scheme, &caps, 2, SimulatedExecutor::new(&scheme, &caps));
    let free_run = run_alone(&scheme, &caps, &spec(prompt(20, 1), 30, 5));
    let mut with_eos = spec(prompt(20, 1), 30, 5);
    with_eos.eos_tokens = vec![free_run[4]];
    d.submit(with_eos).unwrap();
    d.submit(spec(prompt(20, 1), 1, 5)).unwrap();
    d.drain().unwrap();
    let done = d.take_ended();
    let eos = done.iter().find(|e| finish(e).cause == FinishCause::Eos).unwrap();
    let first_eos = free_run.iter().position(|&t| t == free_run[4]).unwrap();
    assert_eq!(eos.output, free_run[..=first_eos]);
    let one = done.iter().find(|e| finish(e).cause == FinishCause::Length).unwrap();
    assert_eq!(one.output, free_run[..1]);
}

#[test]
fn slots_are_reused_and_exhaustion_is_typed() {
    let scheme = reference_schemes().remove(0);
    let caps = test_capacities(2, 8, 2);
    let mut d = looped(&scheme, &caps, 2, SimulatedExecutor::new(&scheme, &caps));
    let refused = |d: &mut LoopDriver<SimulatedExecutor>, s| admission(d.submit(s).unwrap_err());
    assert_eq!(refused(&mut d, spec(vec![], 1, 0)), AdmissionError::EmptyPrompt);
    assert!(matches!(refused(&mut d, spec(prompt(1024, 0), 1, 0)), AdmissionError::ContextLimit { .. }));
    assert!(matches!(refused(&mut d, spec(prompt(600, 0), 1, 0)), AdmissionError::LargerThanPool { .. }));
    assert!(matches!(refused(&mut d, spec(vec![500], 1, 0)), AdmissionError::TokenOutOfVocabulary { .. }));
    let mut specs = Vec::new();
    for i in 0..6 {
        let s = spec(prompt(30 + i, i as u32), 20, i as u64);
        d.submit(s.clone()).unwrap();
        specs.push(s);
    }
    d.drain().unwrap();
    let done = d.take_ended();
    assert_eq!(done.len(), specs.len());
    for (s, e) in specs.iter().zip(&done) {
        assert_eq!(e.output, run_alone(&scheme, &caps, s));
    }
    d.scheduler_mut().evict_cache();
    assert!(d.scheduler().all_storage_free());
}

#[test]
fn preemption_under_tight_pages_matches_solo_runs() {
    for scheme in reference_schemes() {
        let pages = (scheme.pages_for(1024) + 1) as u32;
        let caps = test_capacities(4, pages, 4);
        let mut actions = Vec::new();
        for i in 0..4u64 {
            actions.push(Action::Start { messages: 2, message_len: 60, max_output: 400, seed: i });
        }
        actions.push(Action::Run { turns: 255 });
        let report = run_workload(&scheme, &caps, 4, &[], 0, &actions).unwrap();
        assert_matches_oracle(&scheme, &caps, &report);
        assert_eq!(report.finished.len(), 4);
        assert!(report.preemptions > 0, "expected preemption with {pages} pages");
    }
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        (1u8..4, 1u16..80, 1u16..40, any::<u64>()).prop_map(|(messages, message_len, max_output, seed)| {
            Action::Start { messages, message_len, max_output, seed }
        }),
        (any::<u8>(), 1u16..60, 1u16..30).prop_map(|(conversation, len, max_output)| Action::Append {
            conversation,
            len,
            max_output
        }),
        (any::<u8>(), any::<u8>(), 1u16..40, 1u16..30)
            .prop_map(|(conversation, cut, len, max_output)| Action::Branch { conversation, cut, len, max_output }),
        any::<u8>().prop_map(|index| Action::Cancel { index }),
        (1u8..30).prop_map(|turns| Action::Run { turns }),
    ]
}

/// `device_fed`: decode reads the pending token on the "device", so with a lag two decode steps
/// are in flight; the oracle is always the host-fed solo run. `host_pages`: a host tier of that
/// many pages' worth of bytes (rows included), 0 for none.
fn check(scheme_index: usize, tight: bool, lag: usize, device_fed: bool, host_pages: u64, actions: Vec<Action>) {
    check_tiers(scheme_index, tight, lag, device_fed, host_pages, None, actions);
}

/// Speculative programs for every decode bucket at depths up to `depth` (rectangular).
fn with_speculation(mut caps: Capacities, depth: u32) -> Capacities {
    caps.speculative_programs = caps
        .decode_request_buckets
        .iter()
        .flat_map(|&b| [1, depth].map(|d| SpeculativeProgram::rectangular(b, d)))
        .collect();
    caps.speculative_programs.sort_by_key(|p| (p.requests, p.depth));
    caps.speculative_programs.dedup();
    caps
}

/// A workload run with copy proposals verified by speculative programs, on the induction model
/// (which copies from the history, so proposals are often accepted) or the hash model (rarely):
/// every request's tokens equal its solo run decoded without speculation, invariants hold after
/// every turn, and storage drains.
#[allow(clippy::too_many_arguments)]
fn check_speculative(
    scheme_index: usize,
    model: SimModel,
    lag: usize,
    device_fed: bool,
    depth: u32,
    host_pages: u64,
    actions: &[Action],
) -> helios_worker::workload::WorkloadReport {
    let scheme = reference_schemes().remove(scheme_index);
    let min_pages = scheme.pages_for(1024) as u32 + 2;
    let caps = with_speculation(test_capacities(4, min_pages * 2, 8), depth);
    let executor = SimulatedExecutor::with_completion_lag(&scheme, &caps, lag).with_model(model);
    let mut executor = if device_fed { executor.with_device_fed_decode() } else { executor };
    let host = (host_pages > 0).then_some(host_pages * helios_offload::UNIT_BYTES);
    let tiers = Tiers { speculative_depth: depth, host_bytes: host, ..Tiers::default() };
    let report = run_workload_tiered(&mut executor, &scheme, &caps, 4, &[0], &tiers, actions).unwrap();
    assert_matches_oracle_as(model, &scheme, &caps, &report);
    report
}

/// Conversations that repeat themselves (the induction model continues copies), so copy
/// proposals are accepted: outputs equal ordinary decoding, and rounds verified several tokens.
#[test]
fn speculative_rounds_match_ordinary_decoding() {
    for scheme in 0..3 {
        for lag in [0, 1] {
            let mut actions = Vec::new();
            for seed in 0..3u64 {
                actions.push(Action::Start { messages: 2, message_len: 40, max_output: 60, seed });
                actions.push(Action::Run { turns: 5 });
            }
            actions.push(Action::Run { turns: 200 });
            for c in 0..3u8 {
                actions.push(Action::Append { conversation: c, len: 12, max_output: 40 });
            }
            let report = check_speculative(scheme, SimModel::Induction, lag, lag > 0, 4, 0, &actions);
            let outputs: u64 = report.finished.iter().map(|(_, d)| d.output.len() as u64).sum();
            assert!(report.verify_steps > 0, "no speculative round: {report:?}");
            assert!(report.accepted_tokens > 0, "nothing accepted: {report:?}");
            assert!(
                report.decode_steps + report.verify_steps < outputs,
                "speculation saved no step: {} + {} steps for {outputs} tokens",
                report.decode_steps,
                report.verify_steps
            );
        }
    }
}

/// Programs shaped as Ignition prepares them (fewer proposals for more requests: (1, 7), (2, 7),
/// (4, 3)) with requests asked to propose 4 deep: a batch of four verifies at most 3 each. On
/// the H200 (2026-12-06) four copy streams proposed 4, no program for four requests held that,
/// and every step decoded host-fed: 5% slower than without speculation. Outputs equal ordinary
/// decoding, and rounds of three or four requests happen; with completions a step late (device-
/// fed decode in play) too, and then few steps give up their pipelining for a round they do not
/// verify (`tests/pipelining.rs` in helios-scheduler pins that rule down).
#[test]
fn batches_beyond_a_program_depth_still_verify_what_it_holds() {
    let scheme = reference_schemes().remove(0);
    let min_pages = scheme.pages_for(1024) as u32 + 2;
    let mut caps = test_capacities(4, min_pages * 2, 8);
    caps.speculative_programs = [(1, 7), (2, 7), (4, 3)].map(|(b, d)| SpeculativeProgram::rectangular(b, d)).to_vec();
    for lag in [0, 1] {
        let executor = SimulatedExecutor::with_completion_lag(&scheme, &caps, lag).with_model(SimModel::Induction);
        let mut executor = executor.with_device_fed_decode();
        let tiers = Tiers { speculative_depth: 4, ..Tiers::default() };
        let mut actions = Vec::new();
        for seed in 0..4u64 {
            actions.push(Action::Start { messages: 2, message_len: 40, max_output: 120, seed });
        }
        actions.push(Action::Run { turns: 200 });
        actions.push(Action::Run { turns: 200 });
        let report = run_workload_tiered(&mut executor, &scheme, &caps, 4, &[0], &tiers, &actions).unwrap();
        assert_matches_oracle_as(SimModel::Induction, &scheme, &caps, &report);
        assert!(report.accepted_tokens > 0, "{report:?}");
        assert!(
            report.verify_rows > 2 * report.verify_steps,
            "lag {lag}: rounds stayed at one or two requests: {} rows in {} rounds",
            report.verify_rows,
            report.verify_steps
        );
        let steps = report.decode_steps + report.verify_steps;
        assert!(
            report.host_fed_without_round * 20 <= steps,
            "lag {lag}: {} of {steps} steps gave up pipelining for a round they did not verify",
            report.host_fed_without_round
        );
    }
}

/// A restore budget of `pages` page copies per step (0: the default), to split restores.
fn restore_budget(scheme_index: usize, pages: u64) -> Option<u64> {
    let page_bytes = reference_schemes()[scheme_index].bytes_per_page();
    (pages > 0).then_some(pages * page_bytes)
}

/// Disk faults the property test draws from: none (twice as likely), a corrupted medium, short
/// reads, EIO on reads, ENOSPC on writes.
const FAULTS: [helios_offload::IoFaults; 6] = [
    helios_offload::IoFaults { write_errno: None, read_errno: None, short_reads: false, flip_bits: false },
    helios_offload::IoFaults { write_errno: None, read_errno: None, short_reads: false, flip_bits: false },
    helios_offload::IoFaults { write_errno: None, read_errno: None, short_reads: false, flip_bits: true },
    helios_offload::IoFaults { write_errno: None, read_errno: None, short_reads: true, flip_bits: false },
    helios_offload::IoFaults { write_errno: None, read_errno: Some(libc::EIO), short_reads: false, flip_bits: false },
    helios_offload::IoFaults {
        write_errno: Some(libc::ENOSPC),
        read_errno: None,
        short_reads: false,
        flip_bits: false,
    },
];

/// [`check`] with a disk tier of `disk_units` 4 KiB units below the host tier, with faults.
fn check_tiers(
    scheme_index: usize,
    tight: bool,
    lag: usize,
    device_fed: bool,
    host_pages: u64,
    disk: Option<(u64, helios_offload::IoFaults)>,
    actions: Vec<Action>,
) {
    let scheme = reference_schemes().remove(scheme_index);
    let min_pages = scheme.pages_for(1024) as u32 + 2;
    let caps = if tight { test_capacities(4, min_pages, 3) } else { test_capacities(4, min_pages * 3, 16) };
    let mut executor = SimulatedExecutor::with_completion_lag(&scheme, &caps, lag);
    if device_fed {
        executor = executor.with_device_fed_decode();
    }
    // Extents are 4 KiB units: one per page or row of these small schemes.
    let host = (host_pages > 0).then_some(host_pages * helios_offload::UNIT_BYTES);
    let dir = tempfile::tempdir().unwrap();
    let faults = disk.map(|d| d.1).unwrap_or_default();
    let disk = disk.map(|(u, _)| (dir.path().to_path_buf(), u * helios_offload::UNIT_BYTES));
    // Odd host sizes also split restores over steps (one or two page copies per step).
    let tiers = Tiers {
        host_bytes: host,
        disk,
        faults,
        restore_budget: restore_budget(scheme_index, host_pages % 3),
        ..Tiers::default()
    };
    let report = run_workload_tiered(&mut executor, &scheme, &caps, 4, &[0], &tiers, &actions).unwrap();
    assert_matches_oracle(&scheme, &caps, &report);
}

/// Six conversations, then each one continued twice in start order: on a tight pool the early
/// ones were evicted by the later ones by the time they come back.
fn revisited_conversations() -> Vec<Action> {
    let mut actions = Vec::new();
    for seed in 0..6u64 {
        actions.push(Action::Start { messages: 3, message_len: 70, max_output: 12, seed });
        actions.push(Action::Run { turns: 30 });
    }
    for round in 0..2u16 {
        for c in 0..6u8 {
            actions.push(Action::Append { conversation: c, len: 20 + round, max_output: 8 });
            actions.push(Action::Run { turns: 30 });
        }
    }
    actions
}

/// Conversations that outgrow a tight GPU pool come back from the host tier: every output
/// equals its solo run, restores happen, and nothing is left behind.
#[test]
fn evicted_conversations_are_restored_from_the_host_tier() {
    for scheme in reference_schemes() {
        let min_pages = scheme.pages_for(1024) as u32 + 2;
        let caps = test_capacities(4, min_pages, 3);
        let actions = revisited_conversations();
        let mut executor = SimulatedExecutor::new(&scheme, &caps);
        let host = Some(4096 * helios_offload::UNIT_BYTES);
        // Restores in single-page copies, one step each.
        let tiers = Tiers { host_bytes: host, restore_budget: Some(1), ..Tiers::default() };
        let report = run_workload_tiered(&mut executor, &scheme, &caps, 4, &[], &tiers, &actions).unwrap();
        assert_matches_oracle(&scheme, &caps, &report);
        assert!(report.demotions > 0 && report.host_restores > 0, "{report:?}");
        // Appends hit the previous turn's terminal checkpoint, wherever it was cached: the whole
        // history but its last sampled token (never consumed).
        let appended = report.finished.iter().filter(|(s, _)| s.message_endpoints.len() >= 3);
        for (spec, done) in appended {
            let previous = *spec.message_endpoints.last().unwrap();
            let cached = finish(done).cached_tokens;
            assert!(cached + 1 >= previous, "{cached} of {previous} cached");
        }
        // Without the host tier the same workload recomputes evicted prefixes.
        let mut executor = SimulatedExecutor::new(&scheme, &caps);
        let plain = run_workload_tiered(&mut executor, &scheme, &caps, 4, &[], &Tiers::default(), &actions).unwrap();
        let cached = |r: &helios_worker::workload::WorkloadReport| -> u32 {
            r.finished.iter().map(|(_, d)| finish(d).cached_tokens).sum()
        };
        assert!(cached(&report) > cached(&plain), "{} vs {}", cached(&report), cached(&plain));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]
    #[test]
    fn random_agent_workloads(scheme in 0usize..3, tight in any::<bool>(), lag in 0usize..3, device_fed in any::<bool>(), host_pages in prop_oneof![Just(0u64), 4u64..40, Just(4096)], actions in prop::collection::vec(action(), 1..24)) {
        check(scheme, tight, lag, device_fed, host_pages, actions);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    #[test]
    fn random_speculative_workloads(scheme in 0usize..3, induction in any::<bool>(), lag in 0usize..3, device_fed in any::<bool>(), depth in 1u32..6, host_pages in prop_oneof![Just(0u64), 4u64..40], actions in prop::collection::vec(action(), 1..24)) {
        let model = if induction { SimModel::Induction } else { SimModel::Hash };
        check_speculative(scheme, model, lag, device_fed, depth, host_pages, &actions);
    }
}

/// Actions that revisit conversations often, so a tight pool evicts them and the host tier
/// restores them.
fn revisiting_action() -> impl Strategy<Value = Action> {
    prop_oneof![
        1 => (1u8..4, 20u16..80, 1u16..20, any::<u64>()).prop_map(|(messages, message_len, max_output, seed)| {
            Action::Start { messages, message_len, max_output, seed }
        }),
        3 => (any::<u8>(), 1u16..40, 1u16..12).prop_map(|(conversation, len, max_output)| Action::Append {
            conversation,
            len,
            max_output
        }),
        1 => (any::<u8>(), any::<u8>(), 1u16..30, 1u16..12)
            .prop_map(|(conversation, cut, len, max_output)| Action::Branch { conversation, cut, len, max_output }),
        1 => any::<u8>().prop_map(|index| Action::Cancel { index }),
        2 => (5u8..40).prop_map(|turns| Action::Run { turns }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]
    #[test]
    fn random_workloads_over_a_host_tier(scheme in 0usize..3, lag in 0usize..3, device_fed in any::<bool>(), host_pages in prop_oneof![4u64..40, Just(4096)], actions in prop::collection::vec(revisiting_action(), 8..40)) {
        check(scheme, true, lag, device_fed, host_pages, actions);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn random_workloads_over_host_and_disk_tiers(scheme in 0usize..3, lag in 0usize..3, host_pages in 2u64..14, disk_units in prop_oneof![8u64..64, Just(1 << 16)], fault in 0usize..6, actions in prop::collection::vec(revisiting_action(), 16..60)) {
        check_tiers(scheme, true, lag, false, host_pages, Some((disk_units, FAULTS[fault])), actions);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]
    #[test]
    #[ignore = "soak: cargo test -p helios-worker --test lifecycle -- --ignored"]
    fn random_agent_workloads_soak(scheme in 0usize..3, tight in any::<bool>(), lag in 0usize..3, device_fed in any::<bool>(), host_pages in prop_oneof![Just(0u64), 4u64..40, Just(4096)], actions in prop::collection::vec(action(), 1..48)) {
        check(scheme, tight, lag, device_fed, host_pages, actions);
    }
}

#[test]
fn image_requests_reserve_their_whole_output() {
    let scheme = reference_schemes().remove(0);
    let caps = test_capacities(2, 8, 2);
    let mut scheduler = Scheduler::new(scheme.clone(), caps.clone(), test_config(2)).unwrap();
    let mut text = spec(prompt(100, 1), 900, 1);
    assert!(scheduler.submit(text.clone()).is_ok(), "text reserves prompt + one page");
    text.images = vec![helios_cache::ImageSpan { position: 10, identity: 42 }];
    assert!(matches!(scheduler.submit(text), Err(AdmissionError::LargerThanPool { .. })));
}

#[test]
fn executor_rejects_stale_rows() {
    use helios_cache::Fence;
    use helios_replay::{Executor, ExecutorError};
    use helios_scheduler::{ConsumeRow, Step, StepOp};
    let scheme = reference_schemes().remove(0);
    let caps = test_capacities(1, 4, 1);
    let mut executor = SimulatedExecutor::new(&scheme, &caps);
    let row =
        ConsumeRow { live_row: 1, start: 5, tokens: vec![1], device_token: false, page_table: vec![0], sample: None };
    let step = Step { fence: Fence(1), ops: vec![StepOp::Prefill { capacity: 16, row }] };
    assert!(matches!(
        executor.submit(&step, &helios_replay::StepInputs::default()),
        Err(ExecutorError::StaleRow { .. })
    ));
}

/// Every admission counts its prompt into the live row's penalty histogram exactly once, right
/// after the row is initialized or restored, cold and on a prefix hit alike.
#[test]
fn admission_counts_the_prompt_once() {
    let scheme = reference_schemes().remove(0);
    let caps = test_capacities(4, 64, 16);
    let mut d = looped(&scheme, &caps, 4, StepLog::new(SimulatedExecutor::new(&scheme, &caps)));
    let tokens = prompt(70, 5);
    for seed in [1u64, 2] {
        d.submit(spec(tokens.clone(), 3, seed)).unwrap();
        d.drain().unwrap();
        let mut admits = Vec::new();
        for step in std::mem::take(&mut d.executor_mut().steps) {
            for (i, op) in step.ops.iter().enumerate() {
                if let StepOp::AdmitHistogram { live_row, tokens: counted } = op {
                    let before = i.checked_sub(1).map(|j| &step.ops[j]);
                    let after_reset = matches!(before, Some(StepOp::Initialize { live_row: r, .. } | StepOp::Restore { live_row: r, .. }) if r == live_row);
                    assert!(after_reset, "{:?}", step.ops);
                    admits.push(counted.clone());
                }
            }
        }
        assert_eq!(admits, vec![tokens.clone()], "seed {seed}");
    }
    assert!(d.scheduler().stats().full_prompt_hits >= 1, "the second request is a prefix hit");
}

/// With snapshot rows sized to the KV pages (as `ignition prepare` sizes them for rows this
/// small), a shared system prefix stays a hit after unrelated conversations filled the pool:
/// page pressure retires the least recently used checkpoints, not the fresh branch point.
/// (With rows far below pages, snapshot pressure thins every new chain down to its endpoint
/// first, as the design orders, and the shared prefix is lost: seen on the GPU with 32 rows.)
#[test]
fn a_shared_prefix_survives_page_pressure_when_rows_match_pages() {
    for scheme in reference_schemes() {
        let pt = scheme.page_tokens as usize;
        let caps = test_capacities(4, 16, 16);
        let mut d = looped(&scheme, &caps, 4, SimulatedExecutor::new(&scheme, &caps));
        for i in 0..12 {
            let mut other = spec(prompt(2 * pt + 22, 100 + i), 8, u64::from(i));
            other.message_endpoints = vec![pt as u32 + 5];
            d.submit(other).unwrap();
            drain_one(&mut d);
        }
        let pressure = d.scheduler().pressure();
        assert!(pressure.page_leaf_evictions + pressure.page_ancestor_removals > 0, "no page pressure: {pressure:?}");
        let boundary = 3 * pt + 20;
        let system = prompt(boundary, 7);
        let ask = |q: u32| {
            let mut tokens = system.clone();
            tokens.extend(prompt(12, 200 + q));
            let mut s = spec(tokens, 4, u64::from(q));
            s.message_endpoints = vec![boundary as u32];
            s
        };
        d.submit(ask(0)).unwrap();
        drain_one(&mut d);
        let before = d.scheduler().stats().prefix_hit_tokens;
        for q in 1..=3 {
            d.submit(ask(q)).unwrap();
            assert_eq!(drain_one(&mut d).output, run_alone(&scheme, &caps, &ask(q)));
        }
        let hit = d.scheduler().stats().prefix_hit_tokens - before;
        assert!(hit >= 3 * boundary as u64, "page tokens {pt}: the shared system prefix was lost ({hit} hit tokens)");
    }
}

/// The device lifecycle scenario (what `examples/core_workload` runs on a real core), on the
/// simulated executor: every request matches its solo run on the *same* executor, so a solo
/// run needs no storage reset (admission initializes the row; every KV position is written
/// before it is read), and the run exercised captures, prefix hits, a cancel and page pressure.
#[test]
fn the_device_scenario_matches_solo_runs_on_the_same_executor() {
    use helios_worker::workload::{device_scenario, run_alone_on, run_workload_on};

    for scheme in reference_schemes() {
        let caps = test_capacities(4, 24, 24);
        let mut executor = SimulatedExecutor::new(&scheme, &caps);
        let report = run_workload_on(&mut executor, &scheme, &caps, 4, &[], &device_scenario()).unwrap();
        assert!(report.finished.len() >= 12 && report.captures > 0 && report.evictions > 0, "{report:?}");
        assert!(report.finished.iter().any(|(_, d)| finish(d).cached_tokens > 0), "no prefix hit");
        assert!(report.finished.iter().any(|(_, d)| finish(d).cause == FinishCause::Cancelled), "no cancel");
        for (spec, done) in &report.finished {
            let alone = run_alone_on(&mut executor, &scheme, &caps, spec).unwrap();
            match finish(done).cause {
                FinishCause::Cancelled | FinishCause::PoolExhausted => assert!(alone.starts_with(&done.output)),
                _ => assert_eq!(done.output, alone, "{:?} diverged from its solo run", done.id),
            }
        }
    }
}

/// The same scenario with long outputs in a small pool (`core_workload --max-output --pages`):
/// decoding requests run short of pages, the newest yields and is readmitted later, and every
/// request still matches its solo run.
#[test]
fn the_device_scenario_with_long_outputs_preempts_and_still_matches_solo_runs() {
    use helios_worker::workload::{device_scenario, run_alone_on, run_workload_tiered, with_max_output};

    let actions = with_max_output(&device_scenario(), 600);
    for scheme in reference_schemes() {
        // About two requests' prompts and reservations: four admitted ones outgrow it.
        let mut caps = test_capacities(4, 1600u32.div_ceil(scheme.page_tokens), 24);
        caps.context_limit = 4096; // appended turns after 600-token answers still fit
        // Without graph rounding every request matches its solo run. With it, history that
        // readmission recomputed by prefill may change what follows (a victim's checkpoint,
        // holding the pages its preemption freed, is evicted for them). With a host tier the
        // checkpoint comes back from host memory: every victim resumes whole, its pending token
        // decoded as in the uninterrupted run, and matches.
        for (rounding, host) in [(false, None), (true, None), (true, Some(64u64 << 20))] {
            let mut executor = SimulatedExecutor::new(&scheme, &caps);
            if rounding {
                executor = executor.with_graph_rounding();
            }
            let tiers = Tiers { host_bytes: host, ..Tiers::default() };
            let report = run_workload_tiered(&mut executor, &scheme, &caps, 4, &[], &tiers, &actions).unwrap();
            let (pt, preempted, finished) = (scheme.page_tokens, report.preemptions, report.finished.len());
            assert!(preempted > 0 && finished >= 6, "page tokens {pt}: {preempted} preemptions, {finished} finished");
            for (spec, done) in &report.finished {
                let info = finish(done);
                if host.is_some() {
                    assert_eq!(info.recomputed_tokens, 0, "page tokens {pt}: {:?} recomputed history", done.id);
                } else if rounding && info.recomputed_tokens > 0 {
                    continue;
                }
                let alone = run_alone_on(&mut executor, &scheme, &caps, spec).unwrap();
                match info.cause {
                    FinishCause::Cancelled | FinishCause::PoolExhausted => assert!(alone.starts_with(&done.output)),
                    _ => assert_eq!(
                        done.output, alone,
                        "{:?} diverged from its solo run ({rounding}, {host:?})",
                        done.id
                    ),
                }
            }
        }
    }
}

/// Runs one request with completions one step late and device-fed decode; returns its output,
/// the device-fed decode rows planned and the most samples that were in flight at once.
fn pipelined(scheme: &CacheScheme, spec: &RequestSpec) -> (Vec<u32>, usize, usize) {
    let caps = test_capacities(2, 40, 4);
    let executor = StepLog::new(SimulatedExecutor::with_completion_lag(scheme, &caps, 1).with_device_fed_decode());
    let config = SchedulerConfig { device_fed_decode: true, ..test_config(2) };
    let mut d = looped_over(Scheduler::new(scheme.clone(), caps.clone(), config).unwrap(), &caps, executor);
    d.submit(spec.clone()).unwrap();
    let out = drain_one(&mut d).output;
    let log = d.executor_mut();
    let device_rows = log
        .steps
        .iter()
        .flat_map(|s| &s.ops)
        .map(|op| match op {
            StepOp::Decode { rows, .. } => rows.iter().filter(|r| r.device_token).count(),
            _ => 0,
        })
        .sum();
    (out, device_rows, log.most_sampling_in_flight)
}

#[test]
fn device_fed_decode_keeps_two_steps_in_flight_and_matches_solo_runs() {
    for scheme in reference_schemes() {
        let caps = test_capacities(2, 40, 4);
        let plain = spec(prompt(70, 3), 24, 11);
        let alone = run_alone(&scheme, &caps, &plain);
        let (out, device_rows, most) = pipelined(&scheme, &plain);
        assert_eq!(out, alone, "page_tokens {}", scheme.page_tokens);
        assert!(device_rows >= 20, "{device_rows} device-fed rows");
        assert_eq!(most, 2, "two sampling steps in flight");
        // An EOS sampled while the next step is in flight: that step's sample is dropped.
        let eos = alone[9];
        let first = alone.iter().position(|&t| t == eos).unwrap();
        let stopping = RequestSpec { eos_tokens: vec![eos], ..plain.clone() };
        let (out, _, _) = pipelined(&scheme, &stopping);
        assert_eq!(out, alone[..=first].to_vec(), "stops at the first EOS");
        // Grammar-like host feedback: never device-fed.
        let fed = RequestSpec { needs_host_feedback: true, ..plain.clone() };
        let (out, device_rows, _) = pipelined(&scheme, &fed);
        assert_eq!((out, device_rows), (alone, 0));
    }
}

/// Two requests that start apart stay in one decode batch with two steps in flight (lockstep):
/// neither drifts into alternate single-row steps, and both match their solo runs.
#[test]
fn device_fed_decoders_stay_batched() {
    // Lag 2: a step's completion arrives two submissions later, as on a GPU whose host is
    // ahead, so a decoder is still at two samples in flight when the next step is planned.
    // Host-fed too: completions arrive late there as well once records are copied behind.
    for (lag, device_fed) in [(1, true), (2, true), (1, false), (2, false)] {
        stay_batched(lag, device_fed);
    }
}

fn stay_batched(lag: usize, device_fed: bool) {
    let scheme = reference_schemes().remove(0);
    let caps = test_capacities(2, 40, 4);
    let executor = SimulatedExecutor::with_completion_lag(&scheme, &caps, lag);
    let executor = StepLog::new(if device_fed { executor.with_device_fed_decode() } else { executor });
    let config = SchedulerConfig { device_fed_decode: device_fed, ..test_config(2) };
    let mut d = looped_over(Scheduler::new(scheme.clone(), caps.clone(), config).unwrap(), &caps, executor);
    let specs = [spec(prompt(20, 1), 40, 5), spec(prompt(150, 2), 40, 6)];
    let ids: Vec<_> = specs.iter().map(|s| d.submit(s.clone()).unwrap()).collect();
    d.drain().unwrap();
    let finished = d.take_ended();
    for (id, s) in ids.iter().zip(&specs) {
        let done = finished.iter().find(|f| f.id == *id).unwrap();
        assert_eq!(done.output, run_alone(&scheme, &caps, s));
    }
    let batch_sizes: Vec<usize> = d
        .executor_mut()
        .steps
        .iter()
        .flat_map(|s| &s.ops)
        .filter_map(|op| match op {
            StepOp::Decode { rows, .. } => Some(rows.len()),
            _ => None,
        })
        .collect();
    // The first request decodes alone while the second prefills, then both share every step.
    let shared = batch_sizes.iter().filter(|&&n| n == 2).count();
    let alone = batch_sizes.iter().filter(|&&n| n == 1).count();
    assert!(shared >= 30, "{batch_sizes:?}");
    assert!(alone <= 12, "{batch_sizes:?}");
    let first_shared = batch_sizes.iter().position(|&n| n == 2).unwrap();
    let last_shared = batch_sizes.iter().rposition(|&n| n == 2).unwrap();
    assert!(batch_sizes[first_shared..=last_shared].iter().all(|&n| n == 2), "drifted apart: {batch_sizes:?}");
}

/// With a host tier too small to keep them, evicted conversations go on to disk and come back
/// from it: outputs equal solo runs, fetches happen, and everything drains.
#[test]
fn evicted_conversations_come_back_from_the_disk_tier() {
    for scheme in reference_schemes() {
        let min_pages = scheme.pages_for(1024) as u32 + 2;
        let caps = test_capacities(4, min_pages, 3);
        let actions = revisited_conversations();
        let dir = tempfile::tempdir().unwrap();
        let tiers = Tiers {
            host_bytes: Some(10 * helios_offload::UNIT_BYTES),
            disk: Some((dir.path().to_path_buf(), 1 << 30)),
            ..Tiers::default()
        };
        let mut executor = SimulatedExecutor::new(&scheme, &caps);
        let report = run_workload_tiered(&mut executor, &scheme, &caps, 4, &[], &tiers, &actions).unwrap();
        assert_matches_oracle(&scheme, &caps, &report);
        assert!(report.disk_writes > 0 && report.disk_fetches > 0, "{report:?}");
    }
}

/// Requests sharing a prefix join one restore; a waiter that cancels only leaves it; a restore
/// nobody waits for any more still completes and publishes; nothing leaks.
#[test]
fn restore_tickets_are_shared_and_outlive_their_waiters() {
    let scheme = reference_schemes().remove(2);
    let caps = test_capacities(4, 64, 8);
    let host_bytes = 512 * helios_offload::UNIT_BYTES;
    let scheduler = Scheduler::new(scheme.clone(), caps.clone(), test_config(4)).unwrap().with_host_tier(host_bytes);
    // Completions arrive one submission late: restores stay in flight across planning.
    let mut executor = StepLog::new(SimulatedExecutor::with_completion_lag(&scheme, &caps, 1));
    let arena = std::sync::Arc::new(helios_offload::HostArena::new(host_bytes).unwrap());
    executor.attach_host_arena(arena, helios_offload::StoreGeometry::from(&scheme)).unwrap();
    let mut d = looped_over(scheduler, &caps, executor);
    let first = spec(prompt(150, 4), 5, 1);
    d.submit(first.clone()).unwrap();
    let out = drain_one(&mut d).output;
    let mut history = first.tokens.clone();
    history.extend(&out);
    let terminal = (history.len() - 1) as u32;

    d.scheduler_mut().evict_cache();
    assert_eq!(d.scheduler().cached_checkpoints(), 0);
    let mut next = history.clone();
    next.extend(prompt(9, 40));
    let a = d.submit(spec(next.clone(), 4, 2)).unwrap();
    let b = d.submit(spec(next.clone(), 4, 3)).unwrap();
    let submitted = d.executor_mut().steps.len();
    assert!(d.turn().unwrap());
    let step = &d.executor_mut().steps[submitted];
    assert!(matches!(step.ops[0], StepOp::CopyOut { .. }), "demotions come first");
    assert_eq!(step.ops.iter().filter(|op| matches!(op, StepOp::CopyIn { .. })).count(), 1, "one transfer");
    assert!(!step.ops.iter().any(|op| matches!(op, StepOp::Prefill { .. })), "both wait for the restore");
    let stats = d.scheduler().stats();
    assert_eq!((stats.host_restores, stats.host_restore_joins), (1, 1));
    d.cancel(b);
    d.scheduler().check_invariants();
    d.drain().unwrap();
    let done = d.take_ended();
    let (da, db) = (done.iter().find(|e| e.id == a).unwrap(), done.iter().find(|e| e.id == b).unwrap());
    assert_eq!(finish(db).cause, FinishCause::Cancelled);
    assert_eq!(da.output, run_alone(&scheme, &caps, &spec(next.clone(), 4, 2)));
    assert_eq!(finish(da).cached_tokens, terminal, "restored the previous turn's terminal checkpoint");

    // A restore whose only waiter cancels still publishes: a later request hits it on the GPU.
    d.scheduler_mut().evict_cache();
    let c = d.submit(spec(next.clone(), 4, 4)).unwrap();
    let submitted = d.executor_mut().steps.len();
    assert!(d.turn().unwrap());
    assert!(d.executor_mut().steps[submitted].ops.iter().any(|op| matches!(op, StepOp::CopyIn { .. })));
    d.cancel(c);
    d.drain().unwrap();
    assert_eq!(finish(&d.take_ended()[0]).cause, FinishCause::Cancelled);
    let restores = d.scheduler().stats().host_restores;
    let e = spec(next.clone(), 4, 5);
    d.submit(e.clone()).unwrap();
    let done = drain_one(&mut d);
    assert_eq!(done.output, run_alone(&scheme, &caps, &e));
    assert!(finish(&done).cached_tokens >= terminal);
    assert_eq!(d.scheduler().stats().host_restores, restores, "served from the GPU, no second transfer");
    let scheduler = d.scheduler_mut();
    scheduler.evict_cache();
    scheduler.check_invariants();
    assert!(scheduler.all_storage_free());
    let host = scheduler.clear_host_tier().unwrap();
    assert_eq!((host.entries, host.resident_bytes), (0, 0));
}

/// A conversation cached before a restart (scheduler, executor and host memory gone; only the
/// disk directory kept) is served after it with its history cached, identical tokens; with a
/// corrupted medium the restore fails, the prefix is recomputed, and the tokens are still the
/// same.
#[test]
fn conversations_survive_a_restart_through_the_disk_tier() {
    for flip in [false, true] {
        for scheme in reference_schemes() {
            let caps = test_capacities(4, 64, 8);
            let dir = tempfile::tempdir().unwrap();
            let tiers = Tiers {
                host_bytes: Some(1024 * helios_offload::UNIT_BYTES),
                disk: Some((dir.path().to_path_buf(), 1 << 30)),
                ..Tiers::default()
            };
            let first = spec(prompt(150, 4), 6, 1);
            let (histories, ..) = served_then_written_out(&scheme, &caps, &tiers, std::slice::from_ref(&first));
            let history = &histories[0];
            let mut next = history.clone();
            next.extend(prompt(12, 30));
            let again = spec(next, 5, 2);
            let mut executor = SimulatedExecutor::new(&scheme, &caps);
            let faults = helios_offload::IoFaults { flip_bits: flip, ..Default::default() };
            let tiers = Tiers { faults, ..tiers };
            let scheduler = tiered_scheduler(&mut executor, &scheme, &caps, 4, &tiers).unwrap();
            let (disk, _) = scheduler.disk_stats().unwrap();
            assert!(disk.entries >= 2, "prompt and terminal checkpoints indexed at startup: {disk:?}");
            let mut d = looped_over(scheduler, &caps, executor);
            d.submit(again.clone()).unwrap();
            let done = drain_one(&mut d);
            assert_eq!(done.output, run_alone(&scheme, &caps, &again), "flip {flip}");
            let cached = finish(&done).cached_tokens;
            let scheduler = d.scheduler_mut();
            let (_, counters) = scheduler.disk_stats().unwrap();
            if flip {
                assert!(counters.fetch_failures >= 1, "{counters:?}");
                assert_eq!(cached, 0, "nothing usable survived the corruption");
            } else {
                assert_eq!(counters.fetch_failures, 0);
                assert_eq!(cached as usize, history.len() - 1, "the terminal checkpoint");
            }
            scheduler.evict_cache();
            scheduler.check_invariants();
            assert!(scheduler.all_storage_free());
        }
    }
}

/// A graceful shutdown with a host tier far smaller than the GPU cache still writes every
/// conversation out (in rounds that fit host memory), and after a restart each continuation
/// finds its history on disk.
#[test]
fn a_shutdown_writes_a_gpu_cache_larger_than_host_memory_to_disk() {
    let scheme = reference_schemes().remove(0);
    let caps = test_capacities(4, 256, 32);
    let dir = tempfile::tempdir().unwrap();
    // Room for about two checkpoints' pages in host memory; six conversations on the GPU.
    let tiers = Tiers {
        host_bytes: Some(12 * helios_offload::UNIT_BYTES),
        disk: Some((dir.path().to_path_buf(), 1 << 30)),
        ..Tiers::default()
    };
    let conversations: Vec<RequestSpec> = (0..6).map(|i| spec(prompt(150, 10 + i), 4, u64::from(i))).collect();
    let (histories, rounds, before, after) = served_then_written_out(&scheme, &caps, &tiers, &conversations);
    assert!(before >= 6 && after == 0, "{before} checkpoints before the write-out, {after} after");
    assert!(rounds > 1, "the cache went out in several rounds");
    let mut d = tiered_loop(&scheme, &caps, &tiers);
    for (i, h) in histories.iter().enumerate() {
        let mut next = h.clone();
        next.extend(prompt(7, 60 + i as u32));
        let s = spec(next, 3, 100 + i as u64);
        d.submit(s.clone()).unwrap();
        let done = drain_one(&mut d);
        assert_eq!(done.output, run_alone(&scheme, &caps, &s));
        assert_eq!(finish(&done).cached_tokens as usize, h.len() - 1, "conversation {i} continued from disk");
    }
}

/// Once the fetch rate and the prefill rate are both measured, a disk hit whose tokens are
/// cheaper to recompute than to read is declined: the request recomputes, with the same
/// output.
#[test]
fn a_disk_fetch_slower_than_recomputing_is_declined() {
    let scheme = reference_schemes().remove(0);
    let caps = test_capacities(4, 256, 32);
    let dir = tempfile::tempdir().unwrap();
    let tiers = Tiers {
        host_bytes: Some(1024 * helios_offload::UNIT_BYTES),
        disk: Some((dir.path().to_path_buf(), 1 << 30)),
        ..Tiers::default()
    };
    let conversations: Vec<RequestSpec> = (0..2).map(|i| spec(prompt(150, 20 + i), 4, u64::from(i))).collect();
    let (histories, ..) = served_then_written_out(&scheme, &caps, &tiers, &conversations);
    let mut d = tiered_loop(&scheme, &caps, &tiers);
    let continue_with = |d: &mut LoopDriver<SimulatedExecutor>, i: usize| {
        let mut next = histories[i].clone();
        next.extend(prompt(7, 70 + i as u32));
        let s = spec(next, 3, 200 + i as u64);
        d.submit(s.clone()).unwrap();
        let done = drain_one(d);
        assert_eq!(done.output, run_alone(&scheme, &caps, &s));
        finish(&done).cached_tokens
    };
    // Rates unknown: the first continuation fetches (and measures the fetch rate).
    assert!(continue_with(&mut d, 0) > 0);
    // Prefill measured absurdly fast: reading is never worth it.
    d.scheduler_mut().observe_prefill_rate(1e18);
    assert_eq!(continue_with(&mut d, 1), 0, "recomputed instead");
    let (_, counters) = d.scheduler().disk_stats().unwrap();
    assert_eq!((counters.fetches, counters.fetch_declined), (1, 1), "{counters:?}");
}
