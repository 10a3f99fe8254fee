//! The scheduler. One `schedule()` call plans one step:
//! 1. cancellations and finished requests (terminal capture, then release);
//! 2. captures at selected endpoints the previous step reached;
//! 3. one decode batch (growing page tables a page ahead, preempting when short);
//! 4. FIFO admission (skipping requests that do not fit, unless a decoder is short);
//! 5. at most one prefill chunk, clipped at the next selected endpoint.
//!
//! Invariants (asserted by [`Scheduler::check_invariants`]):
//! - every page's logical references equal its holders: running page tables, checkpoint
//!   segments and tails, and captures awaiting publication;
//! - every snapshot row is held by exactly one checkpoint or pending capture;
//! - running requests hold distinct slots, at most `max_concurrency` of them;
//! - a running request's page table covers its consumed tokens, and starts with its
//!   anchor checkpoint's complete-page chain; the anchor is pinned once per holder;
//! - a running request has at most two samples in flight, and consumes at most one token the
//!   host has not seen yet (a device-fed decode of a sample still in flight); a verify row in
//!   flight is its request's only sample in flight, and its copy proposer has seen exactly the
//!   request's tokens.
//!
//! Speculation (`SchedulerConfig::speculative_depth`, with speculative programs in the core):
//! a host-fed decoder whose history repeats gets copy proposals (`propose::CopyProposer`), as
//! deep as its `propose::DepthController` finds worth it at the verification cost of a batch
//! of that many decoders (measured per decode bucket), never deeper than the core's programs
//! for that batch verify, and the batch runs as one `StepOp::Verify` when the tokens its rows
//! expect pay for the round; the accepted proposals advance its consumed count when the round
//! lands. A round in flight keeps the batch host-fed (its consumed count is open until it
//! lands).
//!
//! Held requests ([`Scheduler::hold`]): the host is still preparing what a request's next
//! sample needs (a grammar mask computed off the model thread). Nothing that samples for a
//! held request is planned: no decode row, no prefill chunk that ends its prompt, no admission
//! (which may resume sampling from a cached prompt). The decoders' lockstep rule ignores held
//! requests, so one that is slow to come back never stops the others; it rejoins the batch
//! once [`Scheduler::resume`] releases it.
//!
//! Device-fed decode (`SchedulerConfig::device_fed_decode`): a decoder whose one sample is
//! still in flight may decode again, consuming that sample from device state, so two decode
//! steps can be in flight. Never for a request that needs host feedback, is cancelling, or
//! could exceed its output limit; a sample that arrives after its request finished (an EOS
//! followed by the step already in flight) is dropped, and that step's consumption stays part
//! of the request's state (the terminal capture covers the EOS).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use helios_cache::{
    CheckpointId, Fence, FencedPool, ImageSpan, PageId, PrefixCache, PrefixIdentity, PressureStats, PromptDigests,
    Publication, PublishOutcome, RowPool,
};
use helios_contract::model::{CacheScheme, Capacities};
use helios_offload::{DemoteOutcome, HostEntryId, HostExtent, HostTier, PageSource, StoreGeometry, TierStats};

use crate::plan::{Completion, ConsumeRow, PageCopy, RequestId, SampleSpec, SampledToken, Step, StepOp, epoch_of};
use crate::propose::{CopyProposer, DepthController, expected_tokens};

mod tiers;
use tiers::{CopyOut, DiskState, RestoreTicket};
pub use tiers::{DiskCounters, RESTORE_BYTES_PER_STEP};

/// Deployment choices that are not part of the core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Requests running at once; at most `request_slots`.
    pub max_concurrency: u32,
    /// Waiting requests accepted before `QueueFull`.
    pub queue_limit: usize,
    pub identity: PrefixIdentity,
    /// The executor's decode graphs read their input token from device state and every
    /// sampling graph writes it there: plan up to two decode steps in flight.
    pub device_fed_decode: bool,
    /// Most copy proposals one request verifies per step (`--speculative-depth`); 0 turns
    /// speculation off. Effective only up to what the core's speculative programs verify.
    pub speculative_depth: u32,
}

/// Invalid scheduler configuration for these capacities.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("the core has no decode request buckets")]
    NoDecodeBuckets,
    #[error("the core has no prefill chunk capacities")]
    NoPrefillCapacities,
    #[error("max concurrency {requested} outside 1..={slots} request slots")]
    Concurrency { requested: u32, slots: u32 },
}

/// Why a request was refused at submission.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("output limit must be at least one token")]
    NoOutput,
    #[error("prompt of {tokens} tokens leaves no room under context limit {limit}")]
    ContextLimit { tokens: usize, limit: u32 },
    #[error("token {token} outside vocabulary of {vocab}")]
    TokenOutOfVocabulary { token: u32, vocab: u32 },
    #[error("reservation of {pages} pages exceeds the pool of {pool}")]
    LargerThanPool { pages: u64, pool: u32 },
    #[error("admission queue full ({limit})")]
    QueueFull { limit: usize },
}

/// Where a decode row's input token comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DecodeInput {
    /// The host holds it (its sample completed).
    Host,
    /// The request's one sample in flight, read from device state.
    Device,
}

/// A request as submitted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    pub tokens: Vec<u32>,
    /// Sorted by position. Image-bearing requests reserve their whole output.
    pub images: Vec<ImageSpan>,
    /// Message endpoints (token counts) eligible for checkpoints.
    pub message_endpoints: Vec<u32>,
    pub max_output_tokens: u32,
    pub eos_tokens: Vec<u32>,
    pub seed: u64,
    /// Each step's inputs depend on the host having seen the previous sample (a grammar
    /// mask): never device-fed.
    pub needs_host_feedback: bool,
}

impl RequestSpec {
    /// A text-only request: no images, no message endpoints, no EOS, no host feedback.
    pub fn plain(tokens: Vec<u32>, max_output_tokens: u32, seed: u64) -> Self {
        RequestSpec {
            tokens,
            images: vec![],
            message_endpoints: vec![],
            max_output_tokens,
            eos_tokens: vec![],
            seed,
            needs_host_feedback: false,
        }
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Eos,
    Length,
    Cancelled,
    /// Its history outgrew the whole page pool.
    PoolExhausted,
}

/// A request that left the scheduler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinishedRequest {
    pub id: RequestId,
    pub output: Vec<u32>,
    pub reason: FinishReason,
    pub preemptions: u32,
    /// Prompt tokens restored from a checkpoint at first admission instead of recomputed.
    pub cached_tokens: u32,
    /// History tokens prefilled again at readmissions: what lay past the checkpoint each one
    /// restored (0 when every preemption's terminal checkpoint was still cached). Recomputed
    /// history is prefill arithmetic where the request first decoded, so on a device its
    /// later tokens may differ from an uninterrupted run.
    pub recomputed_tokens: u32,
}

/// Where storage is right now (for metrics and drain checks).
///
/// `pages_request` counts pages some running request or in-flight capture references
/// beyond what checkpoints hold; it is zero whenever the scheduler is idle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    pub waiting: usize,
    pub running: usize,
    pub pages_total: u32,
    pub pages_free: usize,
    pub pages_retiring: usize,
    /// Distinct pages owned by cached checkpoints.
    pub pages_cached: usize,
    pub pages_request: usize,
    pub snapshot_rows_total: u32,
    pub snapshot_rows_used: usize,
    /// Checkpoints pinned by a running request or an in-flight publication.
    pub checkpoints_pinned: usize,
    pub checkpoints: usize,
}

/// Counters for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub steps: u64,
    pub prefix_hit_tokens: u64,
    pub full_prompt_hits: u64,
    pub preemptions: u64,
    pub admission_page_waits: u64,
    pub snapshot_skips: u64,
    pub captures: u64,
    /// Restores started from the host tier (one per transfer, however many requests join it).
    pub host_restores: u64,
    /// Requests that joined a restore another request started.
    pub host_restore_joins: u64,
    /// Host hits not restored: the GPU storage they need was not available.
    pub host_restore_skips: u64,
    /// Steps that decoded without speculation, and decode rows of every decoding step (each
    /// samples one token, plus the proposals its round accepted).
    pub decode_steps: u64,
    pub decode_rows: u64,
    /// Speculative rounds: steps that verified proposals, their rows (requests), proposals
    /// verified, proposals accepted.
    pub verify_steps: u64,
    pub verify_rows: u64,
    pub proposed_tokens: u64,
    pub accepted_tokens: u64,
    /// Decode steps fed from the host because a round was expected, that then verified
    /// nothing: pipelining given up for no round (the planner's prediction missed).
    pub host_fed_without_round: u64,
}

/// A restore the scheduler finished (its checkpoint published), for latency metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestoreDone {
    /// The step that copied it in.
    pub fence: Fence,
    /// Prefix length restored, and the tokens of it copied from the host (beyond a GPU parent).
    pub tokens: u64,
    pub copied_tokens: u64,
}

/// Snapshot captures per request: loaded capacity ÷ max concurrency, capped at 8, at least
/// one for a nonempty pool.
pub fn snapshot_budget(snapshot_rows: u32, max_concurrency: u32) -> u32 {
    if snapshot_rows == 0 {
        return 0;
    }
    (snapshot_rows / max_concurrency.max(1)).clamp(1, 8)
}

/// Chooses at most `count` message endpoints strictly inside `(reused, prompt)`: all when
/// they fit, else the nearest to evenly spaced targets (ties to the earlier), deduplicated.
pub fn select_message_endpoints(endpoints: &[u32], reused: u32, prompt: u32, count: u32) -> Vec<u32> {
    let eligible: Vec<u32> = endpoints.iter().copied().filter(|&e| e > reused && e < prompt).collect();
    if eligible.len() <= count as usize {
        return eligible;
    }
    let span = u64::from(prompt - reused);
    let mut chosen: Vec<u32> = (1..=u64::from(count))
        .map(|k| u64::from(reused) + k * span / (u64::from(count) + 1))
        .filter_map(|target| eligible.iter().copied().min_by_key(|&e| (u64::from(e).abs_diff(target), e)))
        .collect();
    chosen.dedup();
    chosen
}

/// A broken scheduler invariant: a bug, not an input condition. Fails loudly, naming it.
#[cold]
fn broken(invariant: &str) -> ! {
    panic!("scheduler invariant broken: {invariant}")
}

/// Request ids are dense counters: a multiplicative hash is enough and much cheaper than
/// SipHash on the per-step path.
#[derive(Clone, Copy, Debug, Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type IdMap<V> = HashMap<RequestId, V, BuildHasherDefault<IdHasher>>;

#[derive(Clone, Debug)]
struct Live {
    slot: u32,
    page_table: Vec<PageId>,
    consumed: u32,
    anchor: Option<CheckpointId>,
    /// Selected endpoints still ahead, ascending.
    captures: VecDeque<u32>,
    /// Samples submitted whose completion has not arrived (at most two).
    samples_in_flight: u32,
    last_fence: Fence,
    admitted: u64,
}

#[derive(Clone, Debug)]
struct Request {
    spec: RequestSpec,
    /// Prompt, then generated tokens; the last one is pending while decoding.
    tokens: Vec<u32>,
    prompt_len: u32,
    generated: u32,
    max_output: u32,
    capture_terminal: bool,
    message_budget: u32,
    full_reservation: bool,
    preemptions: u32,
    cached_tokens: u32,
    /// [`FinishedRequest::recomputed_tokens`] so far.
    recomputed_tokens: u32,
    finishing: Option<FinishReason>,
    /// Cancelled; finishes once nothing is in flight. Plans nothing meanwhile.
    cancelling: bool,
    /// Its next sample's host inputs are not ready: nothing that samples is planned.
    held: bool,
    live: Option<Live>,
    /// Copy proposals over its history, when speculation is on.
    speculation: Option<Box<Speculation>>,
}

/// Shortest and longest history suffix the copy proposer matches.
const PROPOSER_MIN_MATCH: usize = 2;
const PROPOSER_MAX_MATCH: usize = 8;
/// How far back proposals look (the index holds fewer than twice this many tokens per
/// request: about 8 MB at the longest, whatever the context).
const PROPOSER_WINDOW: usize = 16_384;
/// Cost of verifying one more proposal, in plain decode steps, until the executor measures the
/// core's speculative programs (`Scheduler::set_verify_costs`, at startup): decode at small
/// batches is bandwidth-bound, so extra target rows are nearly free.
const VERIFY_ROW_COST: f64 = 0.1;
/// Acceptance assumed before a request has verified anything: optimistic, so it gets to try.
const ACCEPTANCE_PRIOR: f64 = 0.7;

/// A request's speculation state.
///
/// Invariant: `proposer` has seen exactly the request's `tokens` (prompt, then every accepted
/// sample); `in_flight` is `Some(k)` exactly while a verify row with `k` proposals is in flight,
/// and then the request has one sample in flight.
#[derive(Clone, Debug)]
struct Speculation {
    proposer: CopyProposer,
    depth: DepthController,
    in_flight: Option<u32>,
    /// A request under a grammar proposes only what its grammar accepts: the host looks ahead
    /// over [`Scheduler::proposal_candidates`] with the grammar (computing each lane's mask) and
    /// hands back the accepted prefix ([`Scheduler::set_checked_proposals`]); it is used by the
    /// next round, then cleared. Always `None` for unconstrained requests.
    checked: Option<Vec<u32>>,
}

/// Where a capture's partial tail page comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TailPage {
    /// A fresh page the live tail is copied into (evicting cached checkpoints for it if
    /// `may_evict`); the request keeps writing its own.
    Copied { may_evict: bool },
    /// The live tail page itself, for a request released right after the capture with nothing
    /// in flight (a preemption victim).
    Handed,
}

impl Speculation {
    fn new(history: &[u32]) -> Box<Self> {
        // Only the window's tail of a long prompt is indexed (submission runs on the model thread).
        let proposer = CopyProposer::new(PROPOSER_MIN_MATCH, PROPOSER_MAX_MATCH)
            .with_window(PROPOSER_WINDOW)
            .with_history(history);
        Box::new(Speculation {
            proposer,
            depth: DepthController::new(ACCEPTANCE_PRIOR),
            in_flight: None,
            checked: None,
        })
    }
}

/// The prefix of `available` a request proposes: as deep as its depth controller goes at `cost`
/// (its batch's), never past an EOS token (an accepted EOS would be consumed, which ordinary
/// decoding never does).
fn within_depth(r: &Request, spec: &Speculation, available: &[u32], cost: &[f64]) -> Vec<u32> {
    let proposals = &available[..spec.depth.depth(available.len(), cost)];
    let end = proposals.iter().position(|t| r.spec.eos_tokens.contains(t)).unwrap_or(proposals.len());
    proposals[..end].to_vec()
}

/// A round's cost at depths `0..=max_depth` before anything was measured.
fn assumed_verify_cost(max_depth: u32) -> Vec<f64> {
    (0..=max_depth).map(|d| 1.0 + VERIFY_ROW_COST * f64::from(d)).collect()
}

#[derive(Clone, Debug)]
struct PendingCapture {
    request: RequestId,
    publication: Publication,
}

/// The CPU side of the request lifecycle for one core.
#[derive(Debug)]
pub struct Scheduler {
    scheme: CacheScheme,
    capacities: Capacities,
    config: SchedulerConfig,
    pages: FencedPool,
    rows: RowPool,
    prefix: PrefixCache,
    requests: IdMap<Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    cancelled: Vec<RequestId>,
    pending: Vec<PendingCapture>,
    finished: Vec<FinishedRequest>,
    admitted: Vec<RequestId>,
    /// Host tier below the prefix cache, when configured.
    host: Option<HostTier>,
    tickets: Vec<RestoreTicket>,
    restored: Vec<RestoreDone>,
    /// Disk tier below the host tier, when configured.
    disk: Option<Box<DiskState>>,
    /// Newest fence the executor reported complete.
    completed: Fence,
    /// Bytes of restore copies per step.
    restore_budget: u64,
    /// Per decode bucket (ascending, as in the capacities): a verification round's cost at each
    /// proposal depth (index) for a batch of that many requests, over that bucket's plain
    /// decode step: `[0] == 1`, non-decreasing, as long as the deepest program for that many
    /// requests allows (`[1]` only: no program). Assumed (`VERIFY_ROW_COST` per proposal)
    /// until the executor measures the core's programs ([`Self::set_verify_costs`]).
    verify_cost: Vec<(u32, Vec<f64>)>,
    next_request: u64,
    next_fence: u64,
    admissions: u64,
    stats: SchedulerStats,
}

impl Scheduler {
    /// Checks a configuration against the capacities without building anything (what
    /// [`Self::new`] refuses, it refuses).
    pub fn validate(capacities: &Capacities, config: &SchedulerConfig) -> Result<(), ConfigError> {
        if capacities.decode_request_buckets.is_empty() {
            return Err(ConfigError::NoDecodeBuckets);
        }
        if capacities.prefill_chunk_capacities.is_empty() {
            return Err(ConfigError::NoPrefillCapacities);
        }
        if config.max_concurrency == 0 || config.max_concurrency > capacities.request_slots {
            return Err(ConfigError::Concurrency {
                requested: config.max_concurrency,
                slots: capacities.request_slots,
            });
        }
        Ok(())
    }

    /// A scheduler over empty pools sized from the scheme and capacities.
    pub fn new(scheme: CacheScheme, capacities: Capacities, config: SchedulerConfig) -> Result<Self, ConfigError> {
        Self::validate(&capacities, &config)?;
        let verify_cost = capacities
            .decode_request_buckets
            .iter()
            .map(|&b| (b, assumed_verify_cost(capacities.max_speculative_depth(b))))
            .collect();
        Ok(Self {
            pages: FencedPool::new(capacities.max_kv_pages),
            rows: RowPool::new(&scheme, capacities.request_slots, capacities.snapshot_rows),
            prefix: PrefixCache::new(scheme.page_tokens),
            scheme,
            capacities,
            config,
            requests: IdMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            cancelled: Vec::new(),
            pending: Vec::new(),
            finished: Vec::new(),
            admitted: Vec::new(),
            host: None,
            tickets: Vec::new(),
            restored: Vec::new(),
            disk: None,
            completed: Fence(0),
            restore_budget: tiers::RESTORE_BYTES_PER_STEP,
            verify_cost,
            next_request: 0,
            next_fence: 1,
            admissions: 0,
            stats: SchedulerStats::default(),
        })
    }

    /// The cache scheme it plans for.
    pub fn scheme(&self) -> &CacheScheme {
        &self.scheme
    }

    fn pt(&self) -> u32 {
        self.scheme.page_tokens
    }

    /// A request the scheduler tracks (running, waiting or finishing).
    ///
    /// # Panics
    /// If `id` is not in the request table: every id in `running` and `waiting` is, by the
    /// module's invariants, so a miss is a scheduler bug, not an input condition.
    fn request(&self, id: impl std::borrow::Borrow<RequestId>) -> &Request {
        let id = *id.borrow();
        match self.requests.get(&id) {
            Some(r) => r,
            None => {
                panic!("scheduler invariant broken: request {id:?} is queued or running but not in the request table")
            }
        }
    }

    fn reservation_pages(&self, request: &Request) -> u64 {
        let output = if request.full_reservation { request.max_output - request.generated } else { self.pt() };
        let tokens = (u64::from(request.prompt_len) + u64::from(output)).min(u64::from(self.capacities.context_limit));
        self.scheme.pages_for(tokens)
    }

    /// Queues a request; typed errors for requests the core can never serve.
    pub fn submit(&mut self, spec: RequestSpec) -> Result<RequestId, AdmissionError> {
        let limit = self.capacities.context_limit;
        if spec.tokens.is_empty() {
            return Err(AdmissionError::EmptyPrompt);
        }
        if spec.max_output_tokens == 0 {
            return Err(AdmissionError::NoOutput);
        }
        if spec.tokens.len() >= limit as usize {
            return Err(AdmissionError::ContextLimit { tokens: spec.tokens.len(), limit });
        }
        let vocab = self.capacities.vocab_size;
        if let Some(&token) = spec.tokens.iter().find(|&&t| t >= vocab) {
            return Err(AdmissionError::TokenOutOfVocabulary { token, vocab });
        }
        if self.waiting.len() >= self.config.queue_limit {
            return Err(AdmissionError::QueueFull { limit: self.config.queue_limit });
        }
        let prompt_len = spec.tokens.len() as u32;
        let max_output = spec.max_output_tokens.min(limit - prompt_len);
        let budget = snapshot_budget(self.capacities.snapshot_rows, self.config.max_concurrency);
        let prompt_capture = u32::from(budget >= 2 && max_output > 1);
        let request = Request {
            tokens: spec.tokens.clone(),
            prompt_len,
            generated: 0,
            max_output,
            capture_terminal: budget >= 1,
            message_budget: budget.saturating_sub(1 + prompt_capture),
            full_reservation: !spec.images.is_empty(),
            preemptions: 0,
            cached_tokens: 0,
            recomputed_tokens: 0,
            finishing: None,
            cancelling: false,
            held: false,
            live: None,
            speculation: None,
            spec,
        };
        // A request that needs host feedback (a grammar) proposes what its grammar accepts.
        let speculate = self.speculation_depth() > 0;
        let request = Request { speculation: speculate.then(|| Speculation::new(&request.tokens)), ..request };
        let pages = self.reservation_pages(&request);
        if pages > u64::from(self.capacities.max_kv_pages) {
            return Err(AdmissionError::LargerThanPool { pages, pool: self.capacities.max_kv_pages });
        }
        let id = RequestId(self.next_request);
        self.next_request += 1;
        self.requests.insert(id, request);
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Cancels at the next submission boundary.
    pub fn cancel(&mut self, id: RequestId) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.cancelling = true;
            self.cancelled.push(id);
        }
    }

    /// Holds `id`'s sampling until [`Scheduler::resume`]: nothing that samples for it is
    /// planned (no decode row, no prefill chunk ending its prompt, no admission); samples
    /// already in flight still complete, and it may still be preempted or cancelled. The
    /// lockstep rule ignores it, so other decoders keep going.
    ///
    /// Returns whether the request will sample again: `false`, holding nothing, when it is
    /// unknown, finishing (EOS, output limit) or cancelled.
    pub fn hold(&mut self, id: RequestId) -> bool {
        match self.requests.get_mut(&id) {
            Some(r) if r.finishing.is_none() && !r.cancelling => {
                r.held = true;
                true
            }
            _ => false,
        }
    }

    /// Ends a hold; the request is planned again from the next step. No-op when it is not held.
    pub fn resume(&mut self, id: RequestId) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.held = false;
        }
    }

    /// Whether `id` is held.
    pub fn is_held(&self, id: RequestId) -> bool {
        self.requests.get(&id).is_some_and(|r| r.held)
    }

    /// Requests that ended since the last call.
    pub fn take_finished(&mut self) -> Vec<FinishedRequest> {
        std::mem::take(&mut self.finished)
    }

    /// Requests that started running for the first time since the last call (readmissions
    /// after preemption are not repeated).
    pub fn take_admitted(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.admitted)
    }

    /// Current storage use.
    /// Constant time: every figure is a counter the pools and the cache keep.
    pub fn occupancy(&self) -> Occupancy {
        let in_use = self.pages.len() as usize - self.pages.free_count() - self.pages.retiring_count();
        Occupancy {
            waiting: self.waiting.len(),
            running: self.running.len(),
            pages_total: self.pages.len(),
            pages_free: self.pages.free_count(),
            pages_retiring: self.pages.retiring_count(),
            pages_cached: self.pages.owned_count(),
            pages_request: in_use - self.pages.owned_only_count(),
            snapshot_rows_total: self.rows.snapshots.len(),
            snapshot_rows_used: (self.rows.snapshots.len() as usize).saturating_sub(self.rows.snapshots.free_count()),
            checkpoints_pinned: self.prefix.pinned(),
            checkpoints: self.prefix.len(),
        }
    }

    /// [`Self::occupancy`] recomputed by walking every checkpoint (invariant checks).
    fn occupancy_scan(&self) -> Occupancy {
        let mut cached = vec![0u32; self.pages.len() as usize];
        let mut checkpoints_pinned = 0;
        for cp in self.prefix.checkpoints() {
            for &page in cp.segment.iter().chain(cp.tail_page.iter()) {
                if let Some(c) = cached.get_mut(page as usize) {
                    *c += 1;
                }
            }
            checkpoints_pinned += usize::from(cp.pins > 0);
        }
        let pages_cached = cached.iter().filter(|&&c| c > 0).count();
        let pages_request = cached.iter().enumerate().filter(|&(page, &c)| self.pages.refs(page as u32) > c).count();
        Occupancy { pages_cached, pages_request, checkpoints_pinned, ..self.occupancy() }
    }

    /// Counters.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// Cache eviction counters (page and snapshot pressure apart).
    pub fn pressure(&self) -> PressureStats {
        self.prefix.stats()
    }

    /// Live checkpoints.
    pub fn cached_checkpoints(&self) -> usize {
        self.prefix.len()
    }

    /// Whether no request is waiting or running and no capture awaits publication.
    pub fn is_idle(&self) -> bool {
        self.requests.is_empty()
            && self.pending.is_empty()
            && self.tickets.is_empty()
            && self.disk.as_ref().is_none_or(|d| d.fetches.is_empty())
    }

    /// Evicts unpinned checkpoints, least recently used first, until those evicted would copy
    /// about `bytes` out (at least one); returns false once nothing is left to evict. With a host
    /// tier the next step copies them out: a graceful shutdown writes the GPU cache to disk in
    /// rounds that fit host memory.
    fn evict_cache_batch(&mut self, bytes: u64) -> bool {
        // What the host tier spends: whole extents.
        let span = |len: u64| HostExtent { offset: 0, len }.span();
        let (page_bytes, row_bytes) = (span(self.scheme.bytes_per_page()), span(self.scheme.continuation_row_bytes));
        let start = self.prefix.len();
        loop {
            let evicted = (start - self.prefix.len()) as u64;
            let planned = self.prefix.retired_pages() as u64 * page_bytes + evicted * row_bytes;
            if planned >= bytes && evicted > 0 {
                return true;
            }
            if !self.prefix.evict_for_pages(&mut self.pages, &mut self.rows.snapshots) {
                return false;
            }
        }
    }

    /// Evicts every unpinned checkpoint (draining, tests).
    ///
    /// With a host tier the evicted checkpoints are demoted: the next step copies them out
    /// first, before any op can reuse their storage.
    pub fn evict_cache(&mut self) {
        self.prefix.evict_all(&mut self.pages, &mut self.rows.snapshots);
    }

    /// Whether every page, slot and snapshot row is free.
    pub fn all_storage_free(&self) -> bool {
        self.pages.all_free() && self.rows.all_free()
    }

    /// Applies a completion: fences, sampled tokens, publications. Returns the samples the
    /// requests accepted: a sample of a request that finished meanwhile is dropped.
    pub fn complete(&mut self, completion: &Completion) -> Vec<SampledToken> {
        self.completed = self.completed.max(completion.fence);
        if let Some(host) = self.host.as_mut() {
            host.complete(completion.fence);
        }
        self.pages.signal(completion.fence);
        self.rows.slots.signal(completion.fence);
        self.rows.snapshots.signal(completion.fence);
        let mut accepted = Vec::with_capacity(completion.sampled.len());
        for (i, sampled) in completion.sampled.iter().enumerate() {
            // Expected, not skipped silently: a sample the device drew for the step after an
            // EOS (two steps in flight) lands after its request finished and left the table.
            let Some(request) = self.requests.get_mut(&sampled.request) else { continue };
            let Some(live) = request.live.as_mut() else {
                broken("a sample landed for a request without live state (preempted with samples in flight)")
            };
            // One sampling row per request and step, its tokens contiguous: the first lands it.
            if i == 0 || completion.sampled[i - 1].request != sampled.request {
                live.samples_in_flight = live.samples_in_flight.saturating_sub(1);
                if let Some(spec) = request.speculation.as_mut() {
                    match spec.in_flight.take() {
                        None => spec.depth.relax(),
                        Some(k) => {
                            let row = completion.sampled[i..].iter().take_while(|s| s.request == sampled.request);
                            let Some(accepted) = (row.count() as u32).checked_sub(1).filter(|&a| a <= k) else {
                                broken("a verify row reported more tokens than its proposals and one sample")
                            };
                            // The device consumed the accepted proposals after the pending token.
                            live.consumed += accepted;
                            spec.depth.observe(k as usize, accepted as usize);
                            self.stats.proposed_tokens += u64::from(k);
                            self.stats.accepted_tokens += u64::from(accepted);
                        }
                    }
                }
            }
            if request.finishing.is_some() {
                continue;
            }
            accepted.push(*sampled);
            request.tokens.push(sampled.token);
            if let Some(spec) = request.speculation.as_mut() {
                spec.proposer.push(sampled.token);
            }
            request.generated += 1;
            if request.spec.eos_tokens.contains(&sampled.token) {
                request.finishing = Some(FinishReason::Eos);
            } else if request.generated >= request.max_output {
                request.finishing = Some(FinishReason::Length);
            }
        }
        let (done, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.pending).into_iter().partition(|p| p.publication.fence <= completion.fence);
        self.pending = waiting;
        for capture in done {
            let parent = capture.publication.parent;
            let outcome = self.prefix.publish(capture.publication, &mut self.pages, &mut self.rows.snapshots);
            if let PublishOutcome::Published(id) = outcome
                && let Some(live) = self.requests.get_mut(&capture.request).and_then(|r| r.live.as_mut())
                && live.anchor == parent
            {
                self.prefix.pin(id);
                if let Some(old) = live.anchor {
                    self.prefix.unpin(old);
                }
                live.anchor = Some(id);
            }
            if let Some(p) = parent {
                self.prefix.unpin(p);
            }
        }
        self.publish_restores(completion.fence);
        accepted
    }

    fn allocate_page(&mut self, may_evict: bool) -> Option<PageId> {
        loop {
            if let Some(page) = self.pages.allocate() {
                return Some(page);
            }
            if !may_evict || !self.prefix.evict_for_pages(&mut self.pages, &mut self.rows.snapshots) {
                return None;
            }
        }
    }

    fn ensure_free_pages(&mut self, count: usize) -> bool {
        while self.pages.free_count() < count {
            if !self.prefix.evict_for_pages(&mut self.pages, &mut self.rows.snapshots) {
                return false;
            }
        }
        true
    }

    /// Snapshots `id`'s live state at its consumed count, unless that endpoint is cached or no
    /// backing is available. The capture publishes when `fence` completes.
    fn capture(&mut self, id: RequestId, fence: Fence, ops: &mut Vec<StepOp>, tail: TailPage) {
        let Some(request) = self.requests.get(&id) else { broken("a captured request is not in the request table") };
        let Some(live) = request.live.as_ref() else { broken("a captured request has no live state") };
        let end = live.consumed as usize;
        if end == 0 {
            return;
        }
        let key = PromptDigests::key_of(self.config.identity, &request.tokens, &request.spec.images, end);
        if self.prefix.contains(&key) || self.pending.iter().any(|p| p.publication.key == key) {
            return;
        }
        let snapshot = match self.rows.snapshots.allocate() {
            Some(s) => Some(s),
            None => {
                self.prefix.evict_for_snapshot(&mut self.pages, &mut self.rows.snapshots);
                self.rows.snapshots.allocate()
            }
        };
        let Some(snapshot) = snapshot else {
            self.stats.snapshot_skips += 1;
            return;
        };
        let pt = self.pt() as usize;
        let copy_to = match tail {
            _ if end.is_multiple_of(pt) => None,
            TailPage::Handed => None,
            TailPage::Copied { may_evict } => match self.allocate_page(may_evict) {
                Some(page) => Some(page),
                None => {
                    self.rows.snapshots.release(snapshot, Fence(0));
                    self.stats.snapshot_skips += 1;
                    return;
                }
            },
        };
        let Some(live) = self.requests.get_mut(&id).and_then(|r| r.live.as_mut()) else {
            broken("a captured request lost its live state while the capture was planned")
        };
        // A handed-over tail page is the live one itself: the checkpoint keeps a reference to
        // it, so the request's release leaves it in place and nothing needs copying.
        let handed = (!end.is_multiple_of(pt) && tail == TailPage::Handed).then(|| live.page_table[end / pt]);
        if let Some(page) = handed {
            self.pages.retain(page);
        }
        let parent = live.anchor.filter(|a| self.prefix.get(*a).is_some());
        let parent_tokens = parent.and_then(|a| self.prefix.get(a)).map_or(0, |a| a.tokens()) as usize;
        let segment = live.page_table[parent_tokens / pt..end / pt].to_vec();
        for &page in &segment {
            self.pages.retain(page);
        }
        if let Some(p) = parent {
            self.prefix.pin(p);
        }
        live.last_fence = fence;
        // The live row holds exactly `end` tokens when this op runs: every op consuming into it
        // was planned in an earlier step or earlier in this one (a verify round's count is
        // settled, since no capture is planned while one is in flight).
        ops.push(StepOp::Snapshot {
            live_row: self.rows.live_row(live.slot),
            snapshot_row: self.rows.snapshot_row(snapshot),
            tail: copy_to.map(|destination| PageCopy { source: live.page_table[end / pt], destination }),
            consumed: live.consumed,
            epoch: epoch_of(&key),
        });
        self.stats.captures += 1;
        self.pending.push(PendingCapture {
            request: id,
            publication: Publication { key, parent, segment, tail_page: copy_to.or(handed), snapshot, fence },
        });
    }

    /// Returns a running request's storage; its captures keep their own references.
    fn release(&mut self, id: RequestId) {
        // A request that never ran (cancelled or refused while queued) holds no storage.
        let Some(live) = self.requests.get_mut(&id).and_then(|r| r.live.take()) else { return };
        for &page in &live.page_table {
            self.pages.release(page, live.last_fence);
        }
        self.rows.slots.release(live.slot, live.last_fence);
        if let Some(anchor) = live.anchor {
            self.prefix.unpin(anchor);
        }
        self.running.retain(|&r| r != id);
    }

    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        self.release(id);
        self.leave_restore(id);
        self.waiting.retain(|&r| r != id);
        if let Some(request) = self.requests.remove(&id) {
            self.finished.push(FinishedRequest {
                id,
                output: request.tokens[request.spec.tokens.len()..].to_vec(),
                reason,
                preemptions: request.preemptions,
                cached_tokens: request.cached_tokens,
                recomputed_tokens: request.recomputed_tokens,
            });
        }
    }

    /// Preempts a decoder: terminal capture when backing allows, release, readmit first.
    ///
    /// Its history to consume again ends where it stopped consuming: the token it sampled last
    /// stays pending, and after readmission a decode row consumes it as one would have without
    /// the preemption (decode and prefill graphs round differently, so a prefill chunk there
    /// would change the request's later tokens on a device).
    fn preempt(&mut self, id: RequestId, fence: Fence, ops: &mut Vec<StepOp>) {
        let consumed = self.request(id).live.as_ref().map(|l| l.consumed);
        // Nothing of a victim is in flight and its pages are released next: its tail page
        // goes to the checkpoint as it is (a copy would need a free page, and pages are short).
        self.capture(id, fence, ops, TailPage::Handed);
        self.release(id);
        self.stats.preemptions += 1;
        if let Some(request) = self.requests.get_mut(&id) {
            request.preemptions += 1;
            request.prompt_len = consumed.unwrap_or(request.tokens.len() as u32).min(request.tokens.len() as u32);
            request.message_budget = 0;
        }
        let too_large =
            self.requests.get(&id).is_some_and(|r| self.reservation_pages(r) > u64::from(self.capacities.max_kv_pages));
        if too_large {
            self.finish(id, FinishReason::PoolExhausted);
        } else {
            self.waiting.push_front(id);
        }
    }

    /// Running requests past their prompt that are neither finishing nor cancelled.
    fn decoding(&self) -> impl Iterator<Item = &Request> {
        self.running.iter().filter_map(|id| self.requests.get(id)).filter(|r| {
            r.finishing.is_none() && !r.cancelling && r.live.as_ref().is_some_and(|l| l.consumed >= r.prompt_len)
        })
    }

    /// The decoders a step batches: [`Self::decoding`] requests that are not held.
    fn decoders(&self) -> usize {
        self.decoding().filter(|r| !r.held).count()
    }

    /// Whether this step may device-feed decoders, and whether it decodes at all. Decoders move
    /// in lockstep: while one has as many samples in flight as it may (two device-fed, one
    /// host-fed) the step plans no decode, and the next one takes everybody. Otherwise a
    /// request left out of one step drifts into alternate steps: on the H200 two requests then
    /// took turns in single-row steps and each one's ITL doubled. Any decoder that needs host
    /// feedback keeps every decoder host-fed (one step in flight), so it is never left out.
    /// Held requests count for that choice but not for lockstep: they are left out until
    /// resumed, and must not stop the decoders that are ready.
    fn decode_plan(&self) -> (bool, bool, bool) {
        // A verify row in flight leaves its request's consumed count open until it lands: its
        // next input needs the host, and so (lockstep) does everybody's.
        let verifying = self.decoding().any(|r| r.speculation.as_ref().is_some_and(|s| s.in_flight.is_some()));
        // Proposals follow the pending token, so a batch that would verify some is fed from the
        // host: a round, while it pays at this batch's cost, takes the place of the second step
        // in flight. Judged for the batch as `round_pays` judges it: one row's proposals that do
        // not pay for the whole batch's round must not cost everybody the pipelining (at c=4
        // that cost 2-3% of decode throughput on the H100, session 19).
        let round_expected = self.round_expected();
        let device_fed = self.config.device_fed_decode
            && !verifying
            && !self.decoding().any(|r| r.spec.needs_host_feedback)
            && !round_expected;
        let limit = if device_fed { 2 } else { 1 };
        let lockstep =
            !self.decoding().any(|r| !r.held && r.live.as_ref().is_some_and(|l| l.samples_in_flight >= limit));
        (device_fed, lockstep, round_expected)
    }

    /// Whether the request decodes next step, and how its input token is fed.
    fn decode_input(&self, id: RequestId, device_fed: bool) -> Option<DecodeInput> {
        let r = self.requests.get(&id)?;
        let l = r.live.as_ref()?;
        if r.finishing.is_some() || r.cancelling || l.consumed < r.prompt_len {
            return None;
        }
        if l.samples_in_flight == 0 && (r.tokens.len() as u32) > l.consumed {
            return Some(DecodeInput::Host);
        }
        // The one sample in flight is the next input: consume it where it was written.
        let device_fed = device_fed
            && !r.spec.needs_host_feedback
            && l.samples_in_flight == 1
            && r.tokens.len() as u32 == l.consumed
            && r.generated + 1 < r.max_output;
        device_fed.then_some(DecodeInput::Device)
    }

    /// A decoder that could yield its storage: nothing of it in flight.
    fn is_idle_decoder(&self, id: RequestId) -> bool {
        self.decode_input(id, false) == Some(DecodeInput::Host)
    }

    /// Plans the next step; `None` when there is nothing to submit.
    pub fn schedule(&mut self) -> Option<Step> {
        let fence = Fence(self.next_fence);
        let mut ops = Vec::new();
        self.poll_disk(self.completed);
        // Retired outside planning (`evict_cache`): on the host before this step's lookups.
        let mut copy_out = CopyOut::default();
        self.demote_retired(fence, &mut copy_out);

        for id in std::mem::take(&mut self.cancelled) {
            let awaiting =
                self.requests.get(&id).and_then(|r| r.live.as_ref()).is_some_and(|l| l.samples_in_flight > 0);
            if awaiting {
                self.cancelled.push(id);
            } else if self.requests.contains_key(&id) {
                self.finish(id, FinishReason::Cancelled);
            }
        }

        let finishing: Vec<(RequestId, FinishReason)> =
            self.running.iter().filter_map(|id| self.request(id).finishing.map(|f| (*id, f))).collect();
        for (id, reason) in finishing {
            if self.request(id).capture_terminal {
                self.capture(id, fence, &mut ops, TailPage::Copied { may_evict: true });
            }
            self.finish(id, reason);
        }

        let reached: Vec<RequestId> = self
            .running
            .iter()
            .copied()
            .filter(|id| {
                let live = self.request(id).live.as_ref();
                live.is_some_and(|l| l.captures.front() == Some(&l.consumed))
            })
            .collect();
        for id in reached {
            if let Some(live) = self.requests.get_mut(&id).and_then(|r| r.live.as_mut()) {
                live.captures.pop_front();
            }
            self.capture(id, fence, &mut ops, TailPage::Copied { may_evict: true });
        }

        let short_of_pages = self.plan_decode(fence, &mut ops);
        if !short_of_pages {
            self.admit(fence, &mut ops);
        }
        self.plan_prefill(fence, &mut ops);
        self.plan_restore_copies(fence, &mut ops);
        self.demote_retired(fence, &mut copy_out);
        if !copy_out.rows.is_empty() {
            ops.insert(0, StepOp::CopyOut { pages: copy_out.pages, rows: copy_out.rows });
        }

        if ops.is_empty() {
            return None;
        }
        self.next_fence += 1;
        self.stats.steps += 1;
        Some(Step { fence, ops })
    }

    /// Plans the decode batch. Returns whether some decoder was short of pages.
    fn plan_decode(&mut self, fence: Fence, ops: &mut Vec<StepOp>) -> bool {
        let max_bucket = self.capacities.decode_request_buckets.last().copied().unwrap_or(0) as usize;
        let pt = u64::from(self.pt());
        let page_limit = self.capacities.pages_per_request(self.pt()) as usize;
        let mut rows = Vec::new();
        let mut short = false;
        let candidates: Vec<RequestId> = self.running.clone();
        let (device_fed, lockstep, round_expected) = self.decode_plan();
        if !lockstep {
            return false;
        }
        // Proposals are weighed at the cost of a round for the batch this step will have.
        let batch = candidates
            .iter()
            .filter(|&&id| !self.request(id).held && self.decode_input(id, device_fed).is_some())
            .count()
            .min(max_bucket);
        for id in candidates {
            if rows.len() >= max_bucket {
                continue;
            }
            if self.request(id).held {
                continue;
            }
            let Some(input) = self.decode_input(id, device_fed) else { continue };
            let consumed = self.request(id).live.as_ref().map_or(0, |l| l.consumed);
            let need = self.scheme.pages_for(u64::from(consumed) + 1) as usize;
            let want = (self.scheme.pages_for(u64::from(consumed) + 1 + pt) as usize).min(page_limit).max(need);
            let mut have = self.request(id).live.as_ref().map_or(0, |l| l.page_table.len());
            while have < want {
                let Some(page) = self.allocate_page(have < need) else { break };
                if let Some(live) = self.requests.get_mut(&id).and_then(|r| r.live.as_mut()) {
                    live.page_table.push(page);
                }
                have += 1;
            }
            if have < need && input == DecodeInput::Device {
                // Its sample is still in flight: decode it host-fed once it arrives.
                short = true;
                continue;
            }
            if have < need {
                short = true;
                // Newest eligible decoder not yet batched (possibly this one) yields.
                let victim = self
                    .running
                    .iter()
                    .copied()
                    .filter(|&v| self.is_idle_decoder(v) && !self.request(v).full_reservation)
                    .filter(|&v| v == id || !rows.iter().any(|(r, _): &(RequestId, ConsumeRow)| *r == v))
                    .max_by_key(|v| self.request(v).live.as_ref().map_or(0, |l| l.admitted));
                match victim {
                    Some(v) if v != id || self.running.len() > 1 => self.preempt(v, fence, ops),
                    _ => self.finish(id, FinishReason::PoolExhausted),
                }
                continue;
            }
            let proposals = match input {
                DecodeInput::Host => self.proposals(id, have, batch),
                DecodeInput::Device => Vec::new(),
            };
            let Some(request) = self.requests.get_mut(&id) else { broken("a decoder is not in the request table") };
            if let Some(spec) = request.speculation.as_mut() {
                spec.checked = None; // one round's worth: the next comes with the next mask
            }
            let Some(live) = request.live.as_mut() else { broken("a decoder has no live state") };
            let (tokens, device_token) = match input {
                DecodeInput::Host => {
                    let mut tokens = vec![request.tokens[live.consumed as usize]];
                    tokens.extend(proposals);
                    (tokens, false)
                }
                DecodeInput::Device => (Vec::new(), true),
            };
            let counter = request.generated + live.samples_in_flight;
            let row = ConsumeRow {
                live_row: self.rows.live_row(live.slot),
                start: live.consumed,
                tokens,
                device_token,
                page_table: live.page_table.clone(),
                sample: Some(SampleSpec { request: id, seed: request.spec.seed, counter }),
            };
            live.consumed += 1;
            live.samples_in_flight += 1;
            live.last_fence = fence;
            rows.push((id, row));
        }
        if rows.is_empty() {
            return short;
        }
        self.stats.decode_rows += rows.len() as u64;
        if !self.round_pays(&mut rows) {
            // Every row decodes its pending token alone, as plain decoding would.
            for (_, row) in rows.iter_mut() {
                row.tokens.truncate(usize::from(!row.device_token));
            }
        }
        let depth = rows.iter().map(|(_, r)| r.proposals()).max().unwrap_or(0) as u32;
        let program = self.capacities.speculative_program_for(rows.len() as u32, depth).filter(|_| depth > 0);
        if let Some(program) = program {
            // Device-fed rows (their sample still in flight) carry no proposals: they decode
            // inside the program as they would alone, and stay ordinary rows.
            for (id, row) in rows.iter().filter(|(_, r)| !r.device_token) {
                if let Some(spec) = self.requests.get_mut(id).and_then(|r| r.speculation.as_mut()) {
                    spec.in_flight = Some(row.proposals() as u32);
                }
            }
            self.stats.verify_steps += 1;
            self.stats.verify_rows += rows.len() as u64;
            ops.push(StepOp::Verify { program, rows: rows.into_iter().map(|(_, r)| r).collect() });
        } else if let Some(bucket) = self.capacities.decode_bucket_for(rows.len() as u32) {
            // No program verifies this batch: every row decodes its pending token alone.
            let rows = rows.into_iter().map(|(_, mut r)| {
                r.tokens.truncate(usize::from(!r.device_token));
                r
            });
            self.stats.decode_steps += 1;
            self.stats.host_fed_without_round += u64::from(round_expected && self.config.device_fed_decode);
            ops.push(StepOp::Decode { bucket, rows: rows.collect() });
        }
        short
    }

    /// Replaces the assumed cost of verification for batches of `bucket` requests (a decode
    /// bucket of the capacities; any other is ignored) with what the executor measured on this
    /// core: `round[d]` is the wall time of a round that verifies up to `d` proposals for each
    /// of `bucket` requests, `decode` that of the bucket's plain decode step (`round[0]` is
    /// ignored). Decisions from then on weigh proposals against it; where a round costs as much
    /// as the tokens it can yield, requests in such a batch never propose. Called before
    /// readiness.
    pub fn set_verify_costs(&mut self, bucket: u32, decode: std::time::Duration, round: &[std::time::Duration]) {
        let base = decode.as_secs_f64();
        let Some((_, table)) = self.verify_cost.iter_mut().find(|(b, _)| *b == bucket) else { return };
        if base <= 0.0 || round.len() != table.len() {
            return;
        }
        let mut cost = vec![1.0];
        for t in &round[1..] {
            // Never below a plain step, never cheaper than a shallower round.
            let c = (t.as_secs_f64() / base).max(*cost.last().unwrap_or(&1.0));
            cost.push(c);
        }
        *table = cost;
    }

    /// The verification cost per depth a batch of `bucket` requests weighs proposals against
    /// (see [`Self::set_verify_costs`]); empty for a bucket the capacities do not have.
    pub fn verify_costs(&self, bucket: u32) -> &[f64] {
        self.verify_cost.iter().find(|(b, _)| *b == bucket).map_or(&[], |(_, c)| c.as_slice())
    }

    /// The round cost per depth for a batch of `requests` decoders: its decode bucket's table,
    /// cut at the depth this configuration allows (`[1.0]` alone: no proposals).
    fn batch_cost(&self, requests: usize) -> &[f64] {
        const NONE: &[f64] = &[1.0];
        let n = requests.max(1) as u32;
        let Some((_, cost)) = self.verify_cost.iter().find(|(b, _)| *b >= n) else { return NONE };
        &cost[..cost.len().min(self.speculation_depth() as usize + 1)]
    }

    /// Whether a batch's proposals pay for its round: the tokens its rows expect (each at its
    /// request's acceptance estimate; a row without proposals yields its one sample) per unit of
    /// the round's cost, against one token per row for a plain step. Proposals deeper than any
    /// program for this many requests verifies are cut first. Costs O(rows x depth).
    fn round_pays(&self, rows: &mut [(RequestId, ConsumeRow)]) -> bool {
        let cap = self.capacities.max_speculative_depth(rows.len() as u32) as usize;
        for (_, row) in rows.iter_mut() {
            row.tokens.truncate(usize::from(!row.device_token) + cap);
        }
        let weighed: Vec<(f64, usize)> = rows
            .iter()
            .map(|(id, row)| {
                let p =
                    self.requests.get(id).and_then(|r| r.speculation.as_ref()).map_or(0.0, |s| s.depth.acceptance());
                (p, row.proposals())
            })
            .collect();
        self.round_pays_for(&weighed)
    }

    /// [`Self::round_pays`] over `(acceptance estimate, proposals)` per row, the proposals
    /// already cut to what the batch's programs verify; true when nobody proposes.
    fn round_pays_for(&self, rows: &[(f64, usize)]) -> bool {
        let depth = rows.iter().map(|&(_, k)| k).max().unwrap_or(0);
        if depth == 0 {
            return true;
        }
        let cost = self.batch_cost(rows.len());
        let Some(&round) = cost.get(depth) else { return false };
        let expected: f64 = rows.iter().map(|&(p, k)| expected_tokens(p, k)).sum();
        expected / round > rows.len() as f64
    }

    /// Whether the next decode step would verify a round: its decoders' proposals (what each
    /// proposer finds, as deep as its controller goes at the batch's cost) pay for the batch's
    /// round. A prediction from the same inputs `plan_decode` weighs, before it allocates.
    fn round_expected(&self) -> bool {
        if self.config.speculative_depth == 0 {
            return false;
        }
        let decoders: Vec<&Request> = self.decoding().filter(|r| !r.held).collect();
        let max_bucket = self.capacities.decode_request_buckets.last().copied().unwrap_or(0) as usize;
        let n = decoders.len().min(max_bucket);
        let cost = self.batch_cost(n);
        let cap = self.capacities.max_speculative_depth(n as u32) as usize;
        let rows: Vec<(f64, usize)> = decoders
            .iter()
            .take(n)
            .map(|r| match r.speculation.as_deref() {
                Some(s) => {
                    let available = s.proposer.propose(self.speculation_depth() as usize);
                    (s.depth.acceptance(), within_depth(r, s, available, cost).len().min(cap))
                }
                None => (0.0, 0),
            })
            .collect();
        rows.iter().any(|&(_, k)| k > 0) && self.round_pays_for(&rows)
    }

    /// Copy proposals a request under a grammar could verify next, for the host to check with
    /// its grammar (see `Speculation::checked`): what its proposer finds, as deep as its depth
    /// controller would go, never past an EOS token. Empty without speculation or a match.
    pub fn proposal_candidates(&self, id: RequestId) -> Vec<u32> {
        let Some(r) = self.requests.get(&id) else { return Vec::new() };
        let Some(spec) = r.speculation.as_ref() else { return Vec::new() };
        let cost = self.batch_cost(self.decoders());
        within_depth(r, spec, spec.proposer.propose(self.speculation_depth() as usize), cost)
    }

    /// The proposals a request under a grammar verifies next: a prefix of its
    /// [`Self::proposal_candidates`] that the grammar accepts, whose lane masks the host packs
    /// with the round. Replaces any earlier list; used by one round.
    pub fn set_checked_proposals(&mut self, id: RequestId, tokens: Vec<u32>) {
        if let Some(spec) = self.requests.get_mut(&id).and_then(|r| r.speculation.as_mut()) {
            spec.checked = Some(tokens);
        }
    }

    /// The speculative program depth this configuration allows (0: speculation off).
    fn speculation_depth(&self) -> u32 {
        self.config.speculative_depth.min(self.capacities.max_speculative_depth(1))
    }

    /// Copy proposals for a host-fed decoder with `pages` pages in a step of `batch` decoders: as
    /// deep as its depth controller chooses at that batch's round cost, within its output limit and the pages it holds, never past an EOS
    /// token (an accepted EOS would be consumed, which ordinary decoding never does). Empty
    /// without speculation, for a request that needs host feedback, or without a match.
    fn proposals(&self, id: RequestId, pages: usize, batch: usize) -> Vec<u32> {
        let Some(r) = self.requests.get(&id) else { return Vec::new() };
        let (Some(spec), Some(live)) = (r.speculation.as_ref(), r.live.as_ref()) else { return Vec::new() };
        let room_output = r.max_output.saturating_sub(r.generated + 1);
        let room_pages = (pages as u64 * u64::from(self.pt())).saturating_sub(u64::from(live.consumed) + 1);
        let cap = self.speculation_depth().min(room_output).min(room_pages.min(u64::from(u32::MAX)) as u32);
        let available = if r.spec.needs_host_feedback {
            // What the grammar accepted (and has lane masks for), or nothing.
            let checked = spec.checked.as_deref().unwrap_or_default();
            &checked[..checked.len().min(cap as usize)]
        } else {
            spec.proposer.propose(cap as usize)
        };
        within_depth(r, spec, available, self.batch_cost(batch))
    }

    /// FIFO admission; a request that does not fit waits without blocking later ones.
    fn admit(&mut self, fence: Fence, ops: &mut Vec<StepOp>) {
        let queue: Vec<RequestId> = self.waiting.iter().copied().collect();
        for id in queue {
            if self.running.len() >= self.config.max_concurrency as usize || self.rows.slots.free_count() == 0 {
                return;
            }
            if self.requests.get(&id).is_some_and(|r| r.held) {
                continue;
            }
            if self.try_admit(id, fence, ops) {
                self.waiting.retain(|&r| r != id);
            }
        }
    }

    /// Admits one waiting request if its storage fits: finds its deepest cached prefix,
    /// reserves pages and a slot, attaches the prefix (or initializes the row) and starts it.
    fn try_admit(&mut self, id: RequestId, fence: Fence, ops: &mut Vec<StepOp>) -> bool {
        let Some((hit, hit_tokens, total)) = self.lookup_prefix(id, fence) else { return false };
        let Some(slot) = self.reserve(hit, hit_tokens, total) else { return false };
        let live_row = self.rows.live_row(slot);
        let page_table = self.attach_prefix(hit, live_row, total, fence, ops);
        self.stats.prefix_hit_tokens += u64::from(hit_tokens);
        self.leave_restore(id);
        self.start(id, slot, live_row, page_table, hit, hit_tokens, fence, ops)
    }

    /// The request's deepest cached prefix on the GPU (marked recently used), its length in
    /// tokens, and the pages the request reserves in all. None for an unknown request, and
    /// while the deepest prefix is being restored from the host (started or joined here).
    fn lookup_prefix(&mut self, id: RequestId, fence: Fence) -> Option<(Option<CheckpointId>, u32, usize)> {
        if self.awaits_tier(id) {
            return None;
        }
        let request = self.requests.get(&id)?;
        let digests = PromptDigests::new(self.config.identity, &request.tokens, &request.spec.images);
        let max = request.prompt_len as usize;
        let hit = self.prefix.lookup(&digests, &request.tokens, &request.spec.images, max);
        let hit_tokens = hit.and_then(|h| self.prefix.get(h)).map_or(0, |c| c.tokens()) as u32;
        let total = self.reservation_pages(request) as usize;
        if self.fetch_deeper(id, &digests, hit, hit_tokens, fence) {
            return None;
        }
        Some((hit, hit_tokens, total))
    }

    /// Pins the prefix and reserves the pages beyond it and a slot; on a shortfall nothing
    /// stays reserved or pinned (the request keeps waiting).
    fn reserve(&mut self, hit: Option<CheckpointId>, hit_tokens: u32, total: usize) -> Option<u32> {
        let shared = (hit_tokens / self.pt()) as usize;
        if let Some(h) = hit {
            self.prefix.pin(h);
        }
        let slot = if self.ensure_free_pages(total - shared) {
            self.rows.slots.allocate()
        } else {
            self.stats.admission_page_waits += 1;
            None
        };
        if slot.is_none()
            && let Some(h) = hit
        {
            self.prefix.unpin(h);
        }
        slot
    }

    /// The page table a request starts with: the prefix's complete-page chain (shared), a
    /// private copy of its tail page, then fresh pages up to `total`; and the op that fills
    /// the live row (restore from the prefix's snapshot, or initialize).
    fn attach_prefix(
        &mut self,
        hit: Option<CheckpointId>,
        live_row: u32,
        total: usize,
        fence: Fence,
        ops: &mut Vec<StepOp>,
    ) -> Vec<PageId> {
        let mut page_table = hit.map(|h| self.prefix.chain_pages(h)).unwrap_or_default();
        for &page in &page_table {
            self.pages.retain(page);
        }
        match hit.and_then(|h| self.prefix.get(h)) {
            Some(cp) => {
                let snapshot_row = self.rows.snapshot_row(cp.snapshot);
                let source = cp.tail_page;
                let id_hit = cp.id;
                // The stamp its snapshot row was given at capture (or brought back from the host
                // or disk tier, where the row's bytes and the key travel together).
                let (consumed, epoch) = (cp.tokens() as u32, epoch_of(&cp.key));
                let tail = source.and_then(|source| {
                    self.pages.allocate().map(|destination| {
                        page_table.push(destination);
                        PageCopy { source, destination }
                    })
                });
                self.prefix.touch(id_hit, fence);
                ops.push(StepOp::Restore { snapshot_row, live_row, tail, consumed, epoch });
            }
            // The verification columns after the live rows are written by every speculative
            // round before it reads them: only the live rows start from the null row.
            None => ops.push(StepOp::Initialize { live_row, rows: self.scheme.live_rows_per_slot }),
        }
        while page_table.len() < total {
            match self.pages.allocate() {
                Some(page) => page_table.push(page),
                None => break,
            }
        }
        page_table
    }

    /// The admitted request starts running: its prompt counted into the histogram, the
    /// endpoints it will capture, and sampling resumed at once on a full-prompt hit.
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        id: RequestId,
        slot: u32,
        live_row: u32,
        page_table: Vec<PageId>,
        hit: Option<CheckpointId>,
        hit_tokens: u32,
        fence: Fence,
        ops: &mut Vec<StepOp>,
    ) -> bool {
        let Some(request) = self.requests.get_mut(&id) else {
            broken("an admitted request is not in the request table")
        };
        // Every token the request has seen, a readmitted one's pending token included.
        ops.push(StepOp::AdmitHistogram { live_row, tokens: request.tokens.clone() });
        let mut captures: VecDeque<u32> = select_message_endpoints(
            &request.spec.message_endpoints,
            hit_tokens,
            request.prompt_len,
            request.message_budget,
        )
        .into();
        if snapshot_budget(self.capacities.snapshot_rows, self.config.max_concurrency) >= 2
            && request.max_output > 1
            && request.preemptions == 0
            && hit_tokens < request.prompt_len
        {
            captures.push_back(request.prompt_len);
        }
        request.message_budget = 0;
        if request.preemptions == 0 {
            request.cached_tokens = hit_tokens;
            self.admitted.push(id);
        } else {
            request.recomputed_tokens += request.prompt_len - hit_tokens;
        }
        self.admissions += 1;
        let mut live = Live {
            slot,
            page_table,
            consumed: hit_tokens,
            anchor: hit,
            captures,
            samples_in_flight: 0,
            last_fence: fence,
            admitted: self.admissions,
        };
        // A readmitted request's pending token is consumed by a decode row, which samples.
        if hit_tokens == request.prompt_len && request.tokens.len() == request.prompt_len as usize {
            self.stats.full_prompt_hits += 1;
            live.samples_in_flight = 1;
            ops.push(StepOp::ResumeSampling {
                live_row,
                consumed: hit_tokens,
                page_table: live.page_table.clone(),
                sample: SampleSpec { request: id, seed: request.spec.seed, counter: request.generated },
            });
        }
        request.live = Some(live);
        self.running.push(id);
        true
    }

    /// At most one prefill chunk: the oldest request still consuming its prompt (skipping a
    /// held one whose chunk would end its prompt, since that chunk samples).
    fn plan_prefill(&mut self, fence: Fence, ops: &mut Vec<StepOp>) {
        let max_chunk = self.capacities.max_prefill_chunk();
        // Where the next chunk stops: the next capture endpoint, the prompt end or the chunk limit.
        let chunk_stop = |r: &Request, l: &Live| {
            let stop = l.captures.iter().copied().find(|&e| e > l.consumed).unwrap_or(r.prompt_len);
            stop.min(r.prompt_len).min(l.consumed + max_chunk)
        };
        let next = self.running.iter().copied().find(|id| {
            let r = self.request(id);
            r.finishing.is_none()
                && !r.cancelling
                && r.live.as_ref().is_some_and(|l| {
                    l.samples_in_flight == 0
                        && l.consumed < r.prompt_len
                        && !(r.held && chunk_stop(r, l) == r.prompt_len)
                })
        });
        let Some(id) = next else { return };
        let Some(stop) = self.requests.get(&id).and_then(|r| r.live.as_ref().map(|l| chunk_stop(r, l))) else {
            broken("a prefilling request has no live state")
        };
        let Some(request) = self.requests.get_mut(&id) else {
            broken("a prefilling request is not in the request table")
        };
        let Some(live) = request.live.as_mut() else { broken("a prefilling request has no live state") };
        let len = stop - live.consumed;
        let Some(capacity) = self.capacities.prefill_capacity_for(len) else {
            broken("a prefill chunk is longer than the largest captured capacity")
        };
        // The chunk ending the prompt samples, unless a token is already pending (readmission).
        let ends_prompt = stop == request.prompt_len && request.tokens.len() == stop as usize;
        let row = ConsumeRow {
            live_row: self.rows.live_row(live.slot),
            start: live.consumed,
            tokens: request.tokens[live.consumed as usize..stop as usize].to_vec(),
            device_token: false,
            page_table: live.page_table.clone(),
            sample: ends_prompt.then_some(SampleSpec {
                request: id,
                seed: request.spec.seed,
                counter: request.generated,
            }),
        };
        live.consumed = stop;
        live.samples_in_flight = u32::from(ends_prompt);
        live.last_fence = fence;
        ops.push(StepOp::Prefill { capacity, row });
    }

    /// Asserts the invariants in the module documentation.
    pub fn check_invariants(&self) {
        self.pages.check_invariants();
        self.rows.slots.check_invariants();
        self.rows.snapshots.check_invariants();
        let mut page_refs = vec![0u32; self.pages.len() as usize];
        let mut snapshot_refs = vec![0u32; self.rows.snapshots.len() as usize];
        self.prefix.check_invariants(&mut page_refs, &mut snapshot_refs);
        let mut pins: HashMap<CheckpointId, u32> = HashMap::new();
        for capture in &self.pending {
            let p = &capture.publication;
            for &page in p.segment.iter().chain(p.tail_page.iter()) {
                page_refs[page as usize] += 1;
            }
            snapshot_refs[p.snapshot as usize] += 1;
            if let Some(parent) = p.parent {
                *pins.entry(parent).or_default() += 1;
            }
        }
        self.check_tier_invariants(&mut page_refs, &mut snapshot_refs, &mut pins);
        assert_eq!(self.occupancy(), self.occupancy_scan(), "maintained occupancy differs from a scan");
        assert!(self.running.len() <= self.config.max_concurrency as usize, "too many running");
        let mut slots = vec![false; self.rows.slots.len() as usize];
        for id in &self.running {
            let request = self.request(id);
            let live = request.live.as_ref().expect("running request is live");
            assert!(!slots[live.slot as usize], "slot {} shared", live.slot);
            slots[live.slot as usize] = true;
            assert_eq!(self.rows.slots.refs(live.slot), 1);
            assert!(
                live.page_table.len() as u64 >= self.scheme.pages_for(u64::from(live.consumed)),
                "page table does not cover consumed tokens"
            );
            assert!(live.samples_in_flight <= 2, "more than two samples in flight");
            if let Some(spec) = &request.speculation {
                assert_eq!(spec.proposer.committed(), request.tokens.len(), "the proposer missed committed tokens");
                if spec.in_flight.is_some() {
                    assert_eq!(live.samples_in_flight, 1, "a verify row in flight beside another sample");
                }
            }
            assert!(live.consumed as usize <= request.tokens.len() + 1, "consumed tokens the host has not seen");
            for &page in &live.page_table {
                page_refs[page as usize] += 1;
            }
            if let Some(anchor) = live.anchor {
                *pins.entry(anchor).or_default() += 1;
                let chain = self.prefix.chain_pages(anchor);
                assert_eq!(&live.page_table[..chain.len()], &chain[..], "anchor chain differs from page table");
            }
        }
        for page in 0..self.pages.len() {
            assert_eq!(self.pages.refs(page), page_refs[page as usize], "page {page} reference count");
        }
        for row in 0..self.rows.snapshots.len() {
            assert_eq!(self.rows.snapshots.refs(row), snapshot_refs[row as usize], "snapshot {row}");
            assert!(snapshot_refs[row as usize] <= 1, "snapshot {row} shared");
        }
        for cp in self.prefix.checkpoints() {
            assert_eq!(cp.pins, pins.get(&cp.id).copied().unwrap_or(0), "pins of checkpoint {}", cp.id);
        }
    }
}
