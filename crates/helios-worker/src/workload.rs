//! Agent-like workloads and the solo-run oracle shared by scenario and property tests
//! (feature `testkit`). Every run goes through the serving loop ([`LoopDriver`]).

use std::collections::HashMap;

use helios_cache::PrefixIdentity;
use helios_contract::model::{CacheScheme, Capacities};
use helios_replay::{Executor, ExecutorError, SimModel, SimulatedExecutor, seeded_tokens};
use helios_scheduler::{RequestId, RequestSpec, Scheduler, SchedulerConfig, snapshot_budget};

use crate::drive::{Ended, LoopDriver};
use crate::error::LoopError;
use crate::output::{FinishCause, FinishInfo};

/// One workload event.
#[derive(Clone, Debug)]
pub enum Action {
    /// A fresh conversation of `messages` messages of `message_len` tokens.
    Start { messages: u8, message_len: u16, max_output: u16, seed: u64 },
    /// Multi-turn or tool-result append to conversation `conversation % n` once it is idle.
    Append { conversation: u8, len: u16, max_output: u16 },
    /// Branch from message endpoint `cut` of conversation `conversation % n`.
    Branch { conversation: u8, cut: u8, len: u16, max_output: u16 },
    /// Cancel the `index % n`-th request still in flight.
    Cancel { index: u8 },
    /// Run some serving-loop turns.
    Run { turns: u8 },
}

#[derive(Clone, Debug, Default)]
struct Conversation {
    history: Vec<u32>,
    endpoints: Vec<u32>,
    in_flight: Option<RequestId>,
}

/// The lifecycle scenario replayed on a device (`examples/core_workload`) and on the CPU
/// emulation of the fixture core: six three-message conversations, a cancel, appended turns
/// and branches from message endpoints while others decode, then more appends.
pub fn device_scenario() -> Vec<Action> {
    let mut a = Vec::new();
    for seed in 0..6u64 {
        a.push(Action::Start { messages: 3, message_len: 90, max_output: 24, seed });
        a.push(Action::Run { turns: 3 });
    }
    a.push(Action::Cancel { index: 1 });
    a.push(Action::Run { turns: 40 });
    for c in 0..6u8 {
        a.push(Action::Append { conversation: c, len: 40, max_output: 16 });
        a.push(Action::Branch { conversation: c, cut: 1, len: 30, max_output: 16 });
        a.push(Action::Run { turns: 6 });
    }
    a.push(Action::Run { turns: 200 });
    for c in 0..4u8 {
        a.push(Action::Append { conversation: c + 6, len: 25, max_output: 12 });
    }
    a
}

/// `actions` with every request's output budget set to `max_output`. Admission reserves the
/// prompt and grows page tables as tokens come, so long outputs in a small pool run short of
/// pages mid-decode and preempt (the device pressure run, `core_workload --max-output`).
pub fn with_max_output(actions: &[Action], max_output: u16) -> Vec<Action> {
    actions
        .iter()
        .map(|a| match *a {
            Action::Start { messages, message_len, seed, .. } => {
                Action::Start { messages, message_len, max_output, seed }
            }
            Action::Append { conversation, len, .. } => Action::Append { conversation, len, max_output },
            Action::Branch { conversation, cut, len, .. } => Action::Branch { conversation, cut, len, max_output },
            ref other => other.clone(),
        })
        .collect()
}

/// Config for tests (no speculation).
pub fn test_config(max_concurrency: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_concurrency,
        queue_limit: 64,
        identity: PrefixIdentity { model: 1, token_layout: 1 },
        device_fed_decode: false,
        speculative_depth: 0,
    }
}

/// Output of `spec` run alone on an unlimited pool (the simulated executor's hash model),
/// decoded without speculation.
pub fn run_alone(scheme: &CacheScheme, capacities: &Capacities, spec: &RequestSpec) -> Vec<u32> {
    run_alone_as(SimModel::Hash, scheme, capacities, spec)
}

/// [`run_alone`] for the simulated executor's `model`.
pub fn run_alone_as(model: SimModel, scheme: &CacheScheme, capacities: &Capacities, spec: &RequestSpec) -> Vec<u32> {
    let caps = solo_capacities(scheme, capacities);
    let mut executor = SimulatedExecutor::new(scheme, &caps).with_model(model);
    run_alone_on(&mut executor, scheme, capacities, spec).expect("oracle executes")
}

/// Pages for one request (and one request at a time, `test_config(1)`): nothing cached, nothing
/// shared. The slots stay the pool's, so its rows lie where the executor's do; its snapshot rows
/// are the per-request budget of the shared pool (every slot busy), so it captures at the same
/// message endpoints a workload request does and prefills in the same chunks: a recipe whose
/// prefill rounds differently when split elsewhere (a chunked recurrence) still compares.
fn solo_capacities(scheme: &CacheScheme, capacities: &Capacities) -> Capacities {
    let mut caps = capacities.clone();
    caps.snapshot_rows = snapshot_budget(capacities.snapshot_rows, capacities.request_slots);
    caps.max_kv_pages = (caps.pages_per_request(scheme.page_tokens) as u32 + 2).min(capacities.max_kv_pages);
    caps
}

/// Output of `spec` run alone through `executor` (a fresh scheduler over a solo pool: one request
/// at a time, its own captures only). The executor's storage needs no reset: admission initializes the row and the
/// request writes every KV position before reading it.
pub fn run_alone_on<E: Executor>(
    executor: &mut E,
    scheme: &CacheScheme,
    capacities: &Capacities,
    spec: &RequestSpec,
) -> Result<Vec<u32>, LoopError> {
    let caps = solo_capacities(scheme, capacities);
    let scheduler = Scheduler::new(scheme.clone(), caps, test_config(1)).expect("solo config");
    let mut driver = LoopDriver::new(scheduler, executor, capacities.vocab_size).expect("loop driver");
    driver.submit(spec.clone()).expect("solo admits");
    driver.drain()?;
    let ended = driver.take_ended().pop().expect("solo finishes");
    finish(&ended);
    Ok(ended.output)
}

/// Result of a workload run.
#[derive(Debug, Default)]
pub struct WorkloadReport {
    pub finished: Vec<(RequestSpec, Ended)>,
    pub turns: u64,
    pub preemptions: u64,
    pub captures: u64,
    pub evictions: u64,
    /// Host tier activity (zero without one).
    pub demotions: u64,
    pub host_restores: u64,
    /// Disk tier activity (zero without one): files written, fetches, failed fetches.
    pub disk_writes: u64,
    pub disk_fetches: u64,
    pub disk_fetch_failures: u64,
    /// Steps that decoded without speculation and speculative rounds (and their rows);
    /// proposals verified and accepted.
    pub decode_steps: u64,
    pub verify_steps: u64,
    pub verify_rows: u64,
    pub proposed_tokens: u64,
    pub accepted_tokens: u64,
    /// `SchedulerStats::host_fed_without_round`.
    pub host_fed_without_round: u64,
}

/// Runs `actions` through the serving loop over one scheduler, checking invariants after every
/// turn, then drains. Panics on an invariant violation; returns the loop's errors.
pub fn run_workload(
    scheme: &CacheScheme,
    capacities: &Capacities,
    max_concurrency: u32,
    eos_tokens: &[u32],
    completion_lag: usize,
    actions: &[Action],
) -> Result<WorkloadReport, LoopError> {
    let mut executor = SimulatedExecutor::with_completion_lag(scheme, capacities, completion_lag);
    run_workload_on(&mut executor, scheme, capacities, max_concurrency, eos_tokens, actions)
}

/// [`run_workload`] through any executor (a device one included) whose storage holds at least
/// `capacities`.
pub fn run_workload_on<E: Executor>(
    executor: &mut E,
    scheme: &CacheScheme,
    capacities: &Capacities,
    max_concurrency: u32,
    eos_tokens: &[u32],
    actions: &[Action],
) -> Result<WorkloadReport, LoopError> {
    run_workload_tiered(executor, scheme, capacities, max_concurrency, eos_tokens, &Tiers::default(), actions)
}

/// The tiers below the GPU cache a workload runs over, and how deep it speculates.
#[derive(Clone, Debug, Default)]
pub struct Tiers {
    /// Copy proposals per request and step (0: off); the capacities must declare speculative
    /// programs for it to take effect.
    pub speculative_depth: u32,
    /// Host tier bytes (an arena of that size is attached to the executor).
    pub host_bytes: Option<u64>,
    /// Disk tier directory and byte budget (needs a host tier).
    pub disk: Option<(std::path::PathBuf, u64)>,
    /// Faults injected into the disk tier's I/O.
    pub faults: helios_offload::IoFaults,
    /// Bytes of restore copies per step (`None`: the scheduler's default).
    pub restore_budget: Option<u64>,
}

/// The identity disk files of test workloads carry.
pub fn test_disk_identity(scheme: &CacheScheme) -> helios_offload::DiskIdentity {
    helios_offload::DiskIdentity { fingerprint: [0x5a; 32], geometry: helios_offload::StoreGeometry::from(scheme) }
}

/// A scheduler over `tiers` for `executor` (which gets the host arena).
pub fn tiered_scheduler<E: Executor>(
    executor: &mut E,
    scheme: &CacheScheme,
    capacities: &Capacities,
    max_concurrency: u32,
    tiers: &Tiers,
) -> Result<Scheduler, ExecutorError> {
    let config = SchedulerConfig {
        device_fed_decode: executor.device_fed_decode(),
        speculative_depth: tiers.speculative_depth,
        ..test_config(max_concurrency)
    };
    let mut scheduler = Scheduler::new(scheme.clone(), capacities.clone(), config).expect("test config");
    if let Some(bytes) = tiers.host_bytes {
        let arena = std::sync::Arc::new(helios_offload::HostArena::new(bytes).expect("host arena"));
        executor.attach_host_arena(arena.clone(), helios_offload::StoreGeometry::from(scheme))?;
        scheduler = scheduler.with_host_tier(bytes);
        if let Some(budget) = tiers.restore_budget {
            scheduler.set_restore_budget(budget);
        }
        if let Some((dir, disk_bytes)) = &tiers.disk {
            let identity = test_disk_identity(scheme);
            let (tier, _) = helios_offload::DiskTier::open(dir, identity, *disk_bytes).expect("disk tier");
            let io = helios_offload::DiskIo::start(arena).expect("disk I/O thread");
            io.inject(tiers.faults);
            scheduler = scheduler.with_disk_tier(tier, io, identity);
        }
    }
    Ok(scheduler)
}

/// [`run_workload_on`] over `tiers` below the GPU prefix cache. After draining (and flushing
/// the disk tier), the host tier must empty out completely: no extent, pin, ticket or write
/// left behind.
pub fn run_workload_tiered<E: Executor>(
    executor: &mut E,
    scheme: &CacheScheme,
    capacities: &Capacities,
    max_concurrency: u32,
    eos_tokens: &[u32],
    tiers: &Tiers,
    actions: &[Action],
) -> Result<WorkloadReport, LoopError> {
    let scheduler = tiered_scheduler(executor, scheme, capacities, max_concurrency, tiers)?;
    let vocab = capacities.vocab_size;
    let mut driver = LoopDriver::new(scheduler, executor, vocab).expect("loop driver");
    let mut conversations: Vec<Conversation> = Vec::new();
    let mut specs: HashMap<RequestId, (usize, RequestSpec)> = HashMap::new();
    let mut report = WorkloadReport::default();
    let eos = eos_tokens.to_vec();
    let collect = |driver: &mut LoopDriver<&mut E>,
                   conversations: &mut Vec<Conversation>,
                   specs: &mut HashMap<RequestId, (usize, RequestSpec)>,
                   report: &mut WorkloadReport| {
        for done in driver.take_ended() {
            if let Some((conv, spec)) = specs.remove(&done.id) {
                let c = &mut conversations[conv];
                c.in_flight = None;
                if matches!(finish(&done).cause, FinishCause::Eos | FinishCause::Length) {
                    c.endpoints.push(spec.tokens.len() as u32);
                    c.history = spec.tokens.clone();
                    c.history.extend(&done.output);
                }
                report.finished.push((spec, done));
            }
        }
    };
    let limit = capacities.context_limit as usize;
    for (step, action) in actions.iter().enumerate() {
        let submit = |c: &mut Conversation,
                      prompt: Vec<u32>,
                      endpoints: Vec<u32>,
                      max_output: u16,
                      driver: &mut LoopDriver<&mut E>| {
            if prompt.len() + 1 >= limit || c.in_flight.is_some() {
                return None;
            }
            let spec = RequestSpec {
                tokens: prompt,
                images: vec![],
                message_endpoints: endpoints,
                max_output_tokens: u32::from(max_output.max(1)),
                eos_tokens: eos.clone(),
                seed: step as u64,
                needs_host_feedback: false,
            };
            let id = driver.submit(spec.clone()).ok()?;
            c.in_flight = Some(id);
            Some((id, spec))
        };
        match *action {
            Action::Start { messages, message_len, max_output, seed } => {
                let len = usize::from(message_len.max(1));
                let prompt = seeded_tokens(seed, len * usize::from(messages.max(1)), vocab);
                let endpoints = (1..messages.max(1)).map(|m| (usize::from(m) * len) as u32).collect();
                let mut c = Conversation::default();
                if let Some((id, spec)) = submit(&mut c, prompt, endpoints, max_output, &mut driver) {
                    specs.insert(id, (conversations.len(), spec));
                    conversations.push(c);
                }
            }
            Action::Append { conversation, len, max_output } if !conversations.is_empty() => {
                let index = usize::from(conversation) % conversations.len();
                let c = &mut conversations[index];
                if c.history.is_empty() {
                    continue;
                }
                let mut prompt = c.history.clone();
                let mut endpoints = c.endpoints.clone();
                endpoints.push(prompt.len() as u32);
                prompt.extend(seeded_tokens(step as u64 + 99, usize::from(len.max(1)), vocab));
                if let Some((id, spec)) = submit(c, prompt, endpoints, max_output, &mut driver) {
                    specs.insert(id, (index, spec));
                }
            }
            Action::Branch { conversation, cut, len, max_output } if !conversations.is_empty() => {
                let index = usize::from(conversation) % conversations.len();
                let source = &conversations[index];
                if source.endpoints.is_empty() {
                    continue;
                }
                let end = source.endpoints[usize::from(cut) % source.endpoints.len()] as usize;
                let mut prompt = source.history[..end.min(source.history.len())].to_vec();
                let endpoints: Vec<u32> =
                    source.endpoints.iter().copied().filter(|&e| (e as usize) <= prompt.len()).collect();
                prompt.extend(seeded_tokens(step as u64 + 7, usize::from(len.max(1)), vocab));
                let mut branch = Conversation { history: Vec::new(), endpoints: endpoints.clone(), in_flight: None };
                if let Some((id, spec)) = submit(&mut branch, prompt, endpoints, max_output, &mut driver) {
                    specs.insert(id, (conversations.len(), spec));
                    conversations.push(branch);
                }
            }
            Action::Cancel { index } => {
                let mut ids: Vec<RequestId> = specs.keys().copied().collect();
                ids.sort();
                if !ids.is_empty() {
                    driver.cancel(ids[usize::from(index) % ids.len()]);
                }
            }
            Action::Run { turns } => {
                for _ in 0..turns {
                    driver.turn()?;
                    report.turns += 1;
                    driver.scheduler_mut().settle_disk(std::time::Duration::from_secs(30));
                    driver.scheduler().check_invariants();
                    collect(&mut driver, &mut conversations, &mut specs, &mut report);
                }
            }
            _ => {}
        }
    }
    report.turns += driver.drain_checked(|d| d.scheduler().check_invariants())?;
    collect(&mut driver, &mut conversations, &mut specs, &mut report);
    assert!(specs.is_empty(), "requests never ended: {:?}", specs.keys().collect::<Vec<_>>());
    let scheduler = driver.scheduler_mut();
    let stats = scheduler.stats();
    report.preemptions = stats.preemptions;
    report.captures = stats.captures;
    let pressure = scheduler.pressure();
    report.evictions = pressure.page_leaf_evictions
        + pressure.page_ancestor_removals
        + pressure.snapshot_thinnings
        + pressure.snapshot_leaf_evictions;
    report.host_restores = stats.host_restores;
    report.verify_steps = stats.verify_steps;
    report.verify_rows = stats.verify_rows;
    report.proposed_tokens = stats.proposed_tokens;
    report.accepted_tokens = stats.accepted_tokens;
    report.decode_steps = stats.decode_steps;
    report.host_fed_without_round = stats.host_fed_without_round;
    report.demotions = scheduler.host_stats().map_or(0, |h| h.demotions);
    scheduler.evict_cache();
    scheduler.check_invariants();
    assert!(scheduler.all_storage_free(), "storage leaked after draining");
    assert_eq!(scheduler.flush_disk(std::time::Duration::from_secs(30)), 0, "disk writes stalled");
    scheduler.check_invariants();
    if let Some((disk, counters)) = scheduler.disk_stats() {
        report.disk_writes = disk.writes;
        report.disk_fetches = counters.fetches;
        report.disk_fetch_failures = counters.fetch_failures;
    }
    if let Some(host) = scheduler.clear_host_tier() {
        assert_eq!((host.entries, host.resident_bytes), (0, 0), "host tier leaked after draining");
    }
    Ok(report)
}

/// How `ended` finished; a failed request is a broken workload run.
pub fn finish(ended: &Ended) -> FinishInfo {
    match &ended.result {
        Ok(info) => *info,
        Err(e) => panic!("request {:?} failed: {e}", ended.id),
    }
}

/// Asserts every request matches its solo run (cancelled ones: a prefix of it).
pub fn assert_matches_oracle(scheme: &CacheScheme, capacities: &Capacities, report: &WorkloadReport) {
    assert_matches_oracle_as(SimModel::Hash, scheme, capacities, report);
}

/// [`assert_matches_oracle`] for runs on the simulated executor's `model`.
pub fn assert_matches_oracle_as(
    model: SimModel,
    scheme: &CacheScheme,
    capacities: &Capacities,
    report: &WorkloadReport,
) {
    for (spec, done) in &report.finished {
        let alone = run_alone_as(model, scheme, capacities, spec);
        let info = finish(done);
        match info.cause {
            FinishCause::Cancelled | FinishCause::PoolExhausted => {
                assert!(alone.starts_with(&done.output), "partial output diverged for {:?}", done.id)
            }
            _ => assert_eq!(
                done.output,
                alone,
                "request {:?} ({:?}) diverged: prompt {}, cached {}, preemptions {}",
                done.id,
                info.cause,
                spec.tokens.len(),
                info.cached_tokens,
                info.preemptions
            ),
        }
    }
}
