//! The engine: one model thread owning the scheduler and the executor, fed by commands.
//!
//! Each loop turn: apply commands (submissions, cancellations) → plan one step → pack its
//! sampling inputs (parameters, grammar masks) → submit → validate completions → apply them
//! to the scheduler → publish tokens → retire finished requests. The thread never waits on
//! a consumer: output goes into per-request cells.
//!
//! Grammar masks are never computed here: a constrained request's next mask is computed on
//! the grammar threads while the scheduler holds the request (see `grammar_pool`), so one
//! slow grammar delays only its own request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use helios_contract::model::Manifest;
use helios_frontend::GrammarError;
use helios_replay::{Executor, ExecutorError, RowSampling, SamplingParams, StepInputs};
use helios_scheduler::{
    Completion, FinishReason, FinishedRequest, RequestId, RequestSpec, SampleSpec, SampledToken, Scheduler,
    SchedulerConfig, Step, StepOp,
};
use tokio::sync::oneshot;

use crate::error::{ErrorCode, LoopError, RequestError, Stage, Unavailable};
use crate::frontend::{Frontend, StartError};
use crate::grammar_pool::{GrammarOutcome, GrammarWork, ReadyGrammar};
use crate::metrics::{Metrics, TierMetrics};
use crate::output::{ChoiceStream, FinishCause, FinishInfo, OutputCell};
use crate::prep::PrepPool;
use crate::request::{GenerationInput, Prepared, prepare_checked};
use crate::trim::Trimmer;

/// How long shutdown waits for preparation threads once their work is cancelled (they
/// check their flag between writes; one that is still busy is left behind).
const PREP_SHUTDOWN_DEADLINE: Duration = Duration::from_secs(2);

/// Copy proposals per request and step by default (where the core can verify them).
pub const DEFAULT_SPECULATIVE_DEPTH: u32 = 4;

/// How often the memory trimmer looks for an idle server after activity.
const TRIM_PERIOD: Duration = Duration::from_secs(2);

/// Deployment options.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Requests running at once (at most the core's request slots).
    pub max_concurrency: u32,
    /// Requests waiting for admission before 503.
    pub queue_limit: usize,
    /// Most output tokens one request may ask for (default: the context limit). Requests that
    /// do not say get the core's default output limit, lowered to this cap.
    pub max_output_tokens: Option<u32>,
    pub prep_threads: usize,
    pub prep_queue: usize,
    /// Keep up to two decode steps in flight when the executor's graphs keep the pending
    /// token on the device (requests without a grammar).
    pub device_fed_decode: bool,
    /// Threads that advance grammars (consume a sampled token, compute the next mask) off the
    /// model thread; the masks of one step are computed in parallel. Default: the available
    /// cores, 2 to 8.
    pub grammar_threads: usize,
    /// Longest one grammar step (consume + mask) may run, timed from when a thread starts it.
    /// Past it the request fails alone (`grammar_too_complex`) and its computation is
    /// cancelled. Default 500 ms: far above what the parser's step limits let one mask cost
    /// (tens of ms), so only a grammar that cannot keep up reaches it.
    pub grammar_mask_budget: Duration,
    /// How long the model thread waits for a mask sent out less than this long ago before it
    /// plans a step without that request. Keeps a constrained request whose masks are quick in
    /// the same decode batch as the others; bounds what a slow one costs the others to this
    /// much per constrained token. Default 2 ms (about one decode step on the GPU).
    pub grammar_join_wait: Duration,
    /// Bytes of host memory for the checkpoint tier below the GPU prefix cache. `None`: the
    /// memory plan's default ([`helios_replay::memory::plan_host_tier`]: none on unified
    /// memory); `Some(0)`: no host tier. An executor without host transfers serves without one
    /// by default, and refuses to start when a size was asked for.
    pub host_cache_bytes: Option<u64>,
    /// A disk tier below the host tier (which it stages through); `None`: off.
    pub disk_cache: Option<DiskCacheOptions>,
    /// Most copy proposals a request verifies per step where the core has speculative
    /// programs; 0 turns speculation off.
    pub speculative_depth: u32,
}

/// Where and how large the disk tier is, and the core its files belong to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskCacheOptions {
    pub dir: std::path::PathBuf,
    pub capacity_bytes: u64,
    /// Identifies the core (sha256 of its manifest): files of another core are not used.
    pub fingerprint: [u8; 32],
    /// How long a graceful shutdown waits for the host tier to reach the disk.
    pub flush_timeout: Duration,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_concurrency: 4,
            queue_limit: 1024,
            max_output_tokens: None,
            prep_threads: 2,
            prep_queue: 1024,
            device_fed_decode: true,
            grammar_threads: std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)),
            grammar_mask_budget: Duration::from_millis(500),
            grammar_join_wait: Duration::from_millis(2),
            host_cache_bytes: None,
            disk_cache: None,
            speculative_depth: DEFAULT_SPECULATIVE_DEPTH,
        }
    }
}

/// Worker health, as `/health` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    Starting,
    Ready,
    Draining,
    Failed(String),
}

#[derive(Debug, Default)]
pub(crate) struct HealthState {
    status: AtomicU8,
    failure: Mutex<Option<String>>,
}

const STARTING: u8 = 0;
const READY: u8 = 1;
const DRAINING: u8 = 2;
const FAILED: u8 = 3;

impl HealthState {
    fn get(&self) -> Health {
        match self.status.load(Ordering::Acquire) {
            STARTING => Health::Starting,
            READY => Health::Ready,
            DRAINING => Health::Draining,
            _ => Health::Failed(self.failure.lock().ok().and_then(|f| f.clone()).unwrap_or_default()),
        }
    }

    fn fail(&self, why: String) {
        if let Ok(mut f) = self.failure.lock()
            && f.is_none()
        {
            *f = Some(why);
        }
        self.status.store(FAILED, Ordering::Release);
    }
}

pub(crate) enum Command {
    Submit {
        spec: Box<RequestSpec>,
        sampling: SamplingParams,
        grammar: Option<ReadyGrammar>,
        cell: Arc<OutputCell>,
        reply: oneshot::Sender<Result<RequestId, RequestError>>,
    },
    Cancel {
        id: RequestId,
        stop: bool,
    },
    /// Stop admitting; cancel everything when `cancel_running`.
    Drain {
        cancel_running: bool,
    },
}

/// The serving engine shared by the HTTP handlers.
pub struct Engine {
    frontend: Arc<Frontend>,
    commands: Mutex<Sender<Command>>,
    prep: PrepPool,
    health: Arc<HealthState>,
    metrics: Arc<Metrics>,
    thread: Mutex<Option<JoinHandle<()>>>,
    max_concurrency: u32,
    /// Gives freed heap memory back once load stops (stops with the engine).
    _trimmer: Trimmer,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("health", &self.health.get()).finish_non_exhaustive()
    }
}

impl Engine {
    /// Starts the model thread; `make_executor` runs on it (device contexts are
    /// thread-affine). Returns once the executor is ready, or its startup error.
    pub fn start<E, F>(
        manifest: &Manifest,
        frontend: Frontend,
        options: EngineOptions,
        make_executor: F,
    ) -> Result<Arc<Engine>, StartError>
    where
        E: Executor + 'static,
        F: FnOnce() -> Result<E, ExecutorError> + Send + 'static,
    {
        let mut frontend = frontend;
        // The cap may raise the output limit above the core's default, never past the context.
        frontend.max_output_tokens = options.max_output_tokens.unwrap_or(frontend.context_limit);
        if !(1..=frontend.context_limit).contains(&frontend.max_output_tokens) {
            return Err(StartError::Option {
                name: "max_output_tokens",
                reason: format!("must be between 1 and the context limit {}", frontend.context_limit),
            });
        }
        let config = SchedulerConfig {
            max_concurrency: options.max_concurrency,
            queue_limit: options.queue_limit,
            identity: helios_cache::PrefixIdentity::default(),
            device_fed_decode: false,
            speculative_depth: options.speculative_depth,
        };
        let device_fed_option = options.device_fed_decode;
        let host_cache_bytes = options.host_cache_bytes;
        let disk_cache = options.disk_cache.clone();
        // Refused here, before any thread starts; built once, on the model thread, for the
        // storage the executor backs.
        Scheduler::validate(&manifest.capacities, &config)?;
        let vocab = manifest.capacities.vocab_size;
        let (scheme, capacities) = (manifest.cache_scheme.clone(), manifest.capacities.clone());
        let (tx, rx) = channel();
        let health = Arc::new(HealthState::default());
        let metrics = Arc::new(Metrics::default());
        metrics.set_model_name(&frontend.model_name);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let grammars =
            GrammarWork::new(options.grammar_threads, options.grammar_mask_budget, options.grammar_join_wait)
                .map_err(StartError::Thread)?;
        let thread = {
            let health = health.clone();
            let metrics = metrics.clone();
            std::thread::Builder::new()
                .name("helios-model".into())
                .spawn(move || {
                    let ready = (|| -> Result<(E, Scheduler), String> {
                        let mut executor = make_executor().map_err(|e| e.to_string())?;
                        // The load-time memory plan may have backed fewer KV pages than
                        // prepared: the page pool is what the device holds, never more.
                        let pages =
                            executor.kv_pages().map_or(capacities.max_kv_pages, |p| p.min(capacities.max_kv_pages));
                        let caps = helios_contract::model::Capacities { max_kv_pages: pages, ..capacities };
                        let device_fed = device_fed_option && executor.device_fed_decode();
                        let config = SchedulerConfig { device_fed_decode: device_fed, ..config };
                        let speculating = config.speculative_depth > 0;
                        let mut scheduler = Scheduler::new(scheme, caps.clone(), config).map_err(|e| e.to_string())?;
                        if speculating {
                            measure_verification(&mut executor, &mut scheduler, &caps).map_err(|e| e.to_string())?;
                        }
                        let scheduler = attach_tiers(&mut executor, scheduler, host_cache_bytes, disk_cache.as_ref())?;
                        Ok((executor, scheduler))
                    })();
                    let (executor, scheduler) = match ready {
                        Ok(started) => started,
                        Err(e) => {
                            health.fail(e.clone());
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    if let Some(t) = scheduler.host_stats() {
                        metrics.set_host_tier(TierMetrics { tier: t, ..TierMetrics::default() });
                    }
                    health.status.store(READY, Ordering::Release);
                    let _ = ready_tx.send(Ok(()));
                    ModelLoop::new(scheduler, executor, rx, metrics, health, vocab, grammars)
                        .with_disk_flush(disk_cache.as_ref().map(|d| d.flush_timeout))
                        .run();
                })
                .map_err(StartError::Thread)?
        };
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(StartError::Executor(e)),
            Err(_) => return Err(StartError::Executor("the model thread exited during startup".into())),
        }
        let prep = PrepPool::new(options.prep_threads, options.prep_queue).map_err(StartError::Thread)?;
        let trimmer = {
            let (jobs, m) = (prep.jobs_counter(), metrics.clone());
            let activity =
                move || jobs.load(Ordering::Relaxed).wrapping_add(m.generated_tokens.load(Ordering::Relaxed));
            let m = metrics.clone();
            let idle = move || {
                let o = m.occupancy();
                o.running == 0 && o.waiting == 0
            };
            Trimmer::start(TRIM_PERIOD, activity, idle).map_err(StartError::Thread)?
        };
        Ok(Arc::new(Engine {
            _trimmer: trimmer,
            frontend: Arc::new(frontend),
            commands: Mutex::new(tx),
            prep,
            health,
            metrics,
            thread: Mutex::new(Some(thread)),
            max_concurrency: options.max_concurrency,
        }))
    }

    pub fn frontend(&self) -> &Arc<Frontend> {
        &self.frontend
    }

    pub fn health(&self) -> Health {
        self.health.get()
    }

    pub fn max_concurrency(&self) -> u32 {
        self.max_concurrency
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Prometheus text.
    pub fn metrics_text(&self) -> String {
        self.metrics.render(self.health() == Health::Ready)
    }

    fn sender(&self) -> Result<Sender<Command>, RequestError> {
        self.commands
            .lock()
            .map(|s| s.clone())
            .map_err(|_| Unavailable::Failed("command channel poisoned".into()).into())
    }

    fn check_available(&self) -> Result<(), RequestError> {
        match self.health() {
            Health::Ready => Ok(()),
            Health::Starting => Err(Unavailable::Starting.into()),
            Health::Draining => Err(Unavailable::Draining.into()),
            Health::Failed(why) => Err(Unavailable::Failed(why).into()),
        }
    }

    /// Runs CPU-bound frontend work on a preparation worker. `f` gets the job's cancellation
    /// flag (set when the returned future is dropped, or at shutdown): long work checks it.
    pub async fn run_prep<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Frontend, &helios_frontend::Cancel) -> T + Send + 'static,
    ) -> Result<T, RequestError> {
        let frontend = self.frontend.clone();
        Ok(self.prep.run(move |cancel| f(&frontend, cancel)).await?)
    }

    /// Renders, tokenizes and compiles a request on a preparation worker. The O(1) limits
    /// (choices, stops, message count, sizes) are checked first, on the caller's thread;
    /// dropping the future (the client left) stops the work, and so does shutdown.
    pub async fn prepare(&self, input: GenerationInput) -> Result<Prepared, RequestError> {
        self.check_available()?;
        crate::request::check_limits(&self.frontend, &input)?;
        let frontend = self.frontend.clone();
        match self.prep.run(move |cancel| prepare_checked(&frontend, input, cancel)).await? {
            Err(RequestError::Frontend(e))
                if matches!(
                    *e,
                    helios_frontend::FrontendError::Template(helios_frontend::TemplateError::Cancelled)
                ) =>
            {
                // Only shutdown cancels work whose caller still waits.
                Err(Unavailable::Draining.into())
            }
            other => other,
        }
    }

    /// Submits choice `index` of a prepared request and waits for scheduler admission.
    /// Capacity and limit failures come back here, before any response header.
    pub async fn generate(&self, prepared: &mut Prepared, index: u32) -> Result<ChoiceStream, RequestError> {
        self.check_available()?;
        let spec = RequestSpec {
            tokens: prepared.prompt_ids.to_vec(),
            images: Vec::new(),
            message_endpoints: prepared.message_endpoints.clone(),
            max_output_tokens: prepared.sampling.max_output_tokens,
            eos_tokens: if prepared.ignore_eos { Vec::new() } else { self.frontend.eos_token_ids.clone() },
            seed: prepared.seed.wrapping_add(u64::from(index)),
            needs_host_feedback: !prepared.grammars.is_empty(),
        };
        let grammar = if prepared.grammars.is_empty() { None } else { Some(prepared.grammars.remove(0)) };
        let cell = Arc::new(OutputCell::default());
        let (reply, answer) = oneshot::channel();
        let commands = self.sender()?;
        commands
            .send(Command::Submit {
                spec: Box::new(spec),
                sampling: prepared.sampling_params(),
                grammar,
                cell: cell.clone(),
                reply,
            })
            .map_err(|_| Unavailable::Failed("the model thread stopped".into()))?;
        let id = answer.await.map_err(|_| RequestError::ChannelClosed)??;
        let mut stream = ChoiceStream { cell, id, commands, done: false };
        stream.admitted().await?;
        Ok(stream)
    }

    /// Stops admission, lets running requests finish for up to `grace`, cancels the rest
    /// and joins the model thread and the preparation workers.
    pub async fn shutdown(self: &Arc<Self>, grace: Duration) {
        if self.health() == Health::Ready {
            self.health.status.store(DRAINING, Ordering::Release);
        }
        if let Ok(s) = self.sender() {
            let _ = s.send(Command::Drain { cancel_running: false });
        }
        // Nothing prepared from now on could be admitted: stop preparation at once.
        let engine = self.clone();
        let prep_closed = tokio::task::spawn_blocking(move || engine.prep.shutdown(PREP_SHUTDOWN_DEADLINE));
        let deadline = Instant::now() + grace;
        while !self.thread_finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if let Ok(s) = self.sender() {
            let _ = s.send(Command::Drain { cancel_running: true });
        }
        let engine = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let handle = engine.thread.lock().ok().and_then(|mut t| t.take());
            if let Some(h) = handle {
                let _ = h.join();
            }
        })
        .await;
        let _ = prep_closed.await;
    }

    fn thread_finished(&self) -> bool {
        self.thread.lock().map(|t| t.as_ref().is_none_or(|h| h.is_finished())).unwrap_or(true)
    }
}

struct Active {
    cell: Arc<OutputCell>,
    /// Constrained: its matcher with the mask for its next sample; `None` while the grammar
    /// threads advance it (the request is held then).
    grammar: Option<ReadyGrammar>,
    constrained: bool,
    sampling: SamplingParams,
    prompt_tokens: u32,
    stop_requested: bool,
    /// The scheduler reserved its capacity (its response headers may be out).
    admitted: bool,
    failure: Option<RequestError>,
    submitted: Instant,
    last_token: Option<Instant>,
}

/// What one turn of the model loop did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Turn {
    /// A step was submitted, or completions landed.
    Progressed,
    /// Nothing ran or landed; the turn waited briefly for a grammar mask or the disk, and
    /// `landed` says whether one came back.
    Waited { landed: bool },
    /// Nothing ran, landed or could be waited for here: the loop waits for a command.
    Blocked,
}

pub(crate) struct ModelLoop<E: Executor> {
    scheduler: Scheduler,
    executor: E,
    active: HashMap<RequestId, Active>,
    rx: Receiver<Command>,
    metrics: Arc<Metrics>,
    health: Arc<HealthState>,
    draining: bool,
    /// Fence of the oldest submitted step whose completion has not arrived.
    next_fence: u64,
    vocab: u32,
    grammars: GrammarWork,
    /// When the gauges were last published. The scheduler keeps its occupancy (constant time),
    /// but the tiers' gauges and the metrics locks are not free: busy turns publish at most
    /// every `OCCUPANCY_PERIOD`.
    occupancy_at: Instant,
    /// Submission time of each step that copies a restore in, by fence.
    restores_in_flight: HashMap<u64, Instant>,
    /// With a disk tier: how long the exit flush may take.
    disk_flush_timeout: Option<Duration>,
}

/// Gives the executor a host arena and the scheduler a host tier over it, sized as
/// [`EngineOptions::host_cache_bytes`] says, and the disk tier below it when asked for (its
/// directory indexed now: unusable files are logged and removed). Before readiness: the arena
/// is allocated (and page-locked by the executor) here, never later.
/// Replays measured per program by [`measure_verification`].
const VERIFY_MEASURE_REPS: u32 = 20;

/// Times verification rounds at each depth against the plain decode step of the same batch, for
/// every decode bucket (all rows padding, wall time, before readiness), and gives the ratios to
/// the scheduler, so a request proposes only where its acceptance pays for its batch's round.
/// A program is timed once however many (bucket, depth) pairs it serves. An executor that cannot
/// measure (the simulated one) leaves the scheduler's assumption.
fn measure_verification<E: Executor>(
    executor: &mut E,
    scheduler: &mut Scheduler,
    caps: &helios_contract::model::Capacities,
) -> Result<(), ExecutorError> {
    use helios_scheduler::StepOp;
    let mut measured: Vec<(helios_contract::model::SpeculativeProgram, Duration)> = Vec::new();
    for &bucket in &caps.decode_request_buckets {
        let max = caps.max_speculative_depth(bucket);
        if max == 0 {
            continue;
        }
        let plain = StepOp::Decode { bucket, rows: Vec::new() };
        let Some(decode) = executor.measure_step(&plain, VERIFY_MEASURE_REPS)? else { return Ok(()) };
        let mut rounds = vec![decode];
        for depth in 1..=max {
            let Some(program) = caps.speculative_program_for(bucket, depth) else { break };
            let t = match measured.iter().find(|(p, _)| *p == program) {
                Some((_, t)) => *t,
                None => {
                    let op = StepOp::Verify { program, rows: Vec::new() };
                    let Some(t) = executor.measure_step(&op, VERIFY_MEASURE_REPS)? else { return Ok(()) };
                    measured.push((program, t));
                    t
                }
            };
            rounds.push(t);
        }
        tracing::info!(
            bucket,
            decode_us = decode.as_secs_f64() * 1e6,
            round_us = ?rounds[1..].iter().map(|t| (t.as_secs_f64() * 1e6).round()).collect::<Vec<_>>(),
            "speculative rounds measured against plain decode (per depth)"
        );
        scheduler.set_verify_costs(bucket, decode, &rounds);
    }
    Ok(())
}

fn attach_tiers<E: Executor>(
    executor: &mut E,
    scheduler: Scheduler,
    requested: Option<u64>,
    disk: Option<&DiskCacheOptions>,
) -> Result<Scheduler, String> {
    let bytes = requested.unwrap_or_else(|| {
        let available = helios_replay::memory::host_available_bytes().unwrap_or(0);
        helios_replay::memory::plan_host_tier(available, executor.unified_memory())
    });
    if bytes == 0 {
        return match disk {
            Some(_) => Err("the disk cache tier stages through host memory: give the host tier room".into()),
            None => Ok(scheduler),
        };
    }
    let arena = Arc::new(helios_offload::HostArena::new(bytes).map_err(|e| format!("host cache tier: {e}"))?);
    let geometry = helios_offload::StoreGeometry::from(scheduler.scheme());
    let scheduler = match executor.attach_host_arena(arena.clone(), geometry) {
        Ok(()) => scheduler.with_host_tier(bytes),
        Err(helios_replay::ExecutorError::NoHostTransfers | helios_replay::ExecutorError::TransferGeometry { .. })
            if requested.is_none() && disk.is_none() =>
        {
            return Ok(scheduler);
        }
        Err(e) => return Err(format!("host cache tier of {bytes} bytes: {e}")),
    };
    let Some(d) = disk else { return Ok(scheduler) };
    let identity = helios_offload::DiskIdentity { fingerprint: d.fingerprint, geometry };
    let (tier, rejected) = helios_offload::DiskTier::open(&d.dir, identity, d.capacity_bytes)
        .map_err(|e| format!("disk cache tier: {e}"))?;
    for r in &rejected {
        tracing::warn!(path = %r.path.display(), reason = %r.reason, "disk cache: file not usable, removed");
    }
    let io = helios_offload::DiskIo::start(arena).map_err(|e| format!("disk cache I/O thread: {e}"))?;
    let stats = tier.stats();
    tracing::info!(
        dir = %d.dir.display(),
        checkpoints = stats.entries,
        resident_gib = stats.resident_bytes as f64 / (1u64 << 30) as f64,
        capacity_gib = d.capacity_bytes as f64 / (1u64 << 30) as f64,
        rejected = rejected.len(),
        io = io.backend(),
        "disk cache tier indexed"
    );
    Ok(scheduler.with_disk_tier(tier, io, identity))
}

/// Completions must arrive in fence order (`next_fence` is the oldest one in flight) and
/// sample ids inside the vocabulary.
fn check_completion(c: &Completion, next_fence: &mut u64, vocab: u32) -> Result<(), LoopError> {
    if c.fence.0 != *next_fence {
        return Err(LoopError::UnexpectedFence { got: c.fence.0, expected: *next_fence });
    }
    if let Some(s) = c.sampled.iter().find(|s| s.token >= vocab) {
        return Err(LoopError::SampledOutOfVocabulary { token: s.token, vocab });
    }
    *next_fence += 1;
    Ok(())
}

/// How often busy turns refresh the occupancy gauges (idle and exit always do).
const OCCUPANCY_PERIOD: Duration = Duration::from_millis(20);

impl<E: Executor> ModelLoop<E> {
    /// The loop over a built scheduler and a ready executor. `vocab` bounds sampled ids.
    pub(crate) fn new(
        scheduler: Scheduler,
        executor: E,
        rx: Receiver<Command>,
        metrics: Arc<Metrics>,
        health: Arc<HealthState>,
        vocab: u32,
        grammars: GrammarWork,
    ) -> Self {
        ModelLoop {
            scheduler,
            executor,
            active: HashMap::new(),
            rx,
            metrics,
            health,
            draining: false,
            next_fence: 1,
            vocab,
            grammars,
            occupancy_at: Instant::now(),
            restores_in_flight: HashMap::new(),
            disk_flush_timeout: None,
        }
    }

    pub(crate) fn with_disk_flush(mut self, timeout: Option<Duration>) -> Self {
        self.disk_flush_timeout = timeout;
        self
    }

    #[cfg(feature = "testkit")]
    pub(crate) fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    #[cfg(feature = "testkit")]
    pub(crate) fn scheduler_mut(&mut self) -> &mut Scheduler {
        &mut self.scheduler
    }

    #[cfg(feature = "testkit")]
    pub(crate) fn executor_mut(&mut self) -> &mut E {
        &mut self.executor
    }

    fn publish_occupancy(&mut self, force: bool) {
        let now = Instant::now();
        if force || now.duration_since(self.occupancy_at) >= OCCUPANCY_PERIOD {
            self.metrics.set_occupancy(self.scheduler.occupancy());
            if let Some(tier) = self.scheduler.host_stats() {
                let s = self.scheduler.stats();
                self.metrics.set_host_tier(TierMetrics {
                    tier,
                    restores: s.host_restores,
                    restore_joins: s.host_restore_joins,
                    restore_skips: s.host_restore_skips,
                    restore_failures: 0,
                    write_failures: 0,
                });
            }
            if let Some((disk, c)) = self.scheduler.disk_stats() {
                self.metrics.set_disk_tier(TierMetrics {
                    tier: helios_offload::TierStats {
                        entries: disk.entries,
                        resident_bytes: disk.resident_bytes,
                        capacity_bytes: disk.capacity_bytes,
                        demotions: disk.writes,
                        demoted_bytes: disk.written_bytes,
                        demotion_skips: disk.write_skips,
                        evictions: disk.evictions,
                        hits: c.fetches,
                    },
                    restores: c.fetches,
                    restore_joins: c.fetch_joins,
                    restore_skips: c.fetch_skips,
                    restore_failures: c.fetch_failures,
                    write_failures: disk.write_failures,
                });
            }
            self.publish_step_counters();
            for d in self.scheduler.take_disk_fetches() {
                self.metrics.disk_fetch.observe(d.as_secs_f64());
            }
            self.occupancy_at = now;
        }
    }

    /// The scheduler's decode and speculation counters into the metrics: with the occupancy,
    /// and when a request ends, before its end reaches the client (so its rounds are counted).
    fn publish_step_counters(&self) {
        let s = self.scheduler.stats();
        let m = &self.metrics;
        for (counter, v) in [
            (&m.decode_rows, s.decode_rows),
            (&m.speculative_rounds, s.verify_steps),
            (&m.proposed_tokens, s.proposed_tokens),
            (&m.accepted_tokens, s.accepted_tokens),
        ] {
            counter.store(v, Ordering::Relaxed);
        }
    }

    /// Samples device memory growth since readiness into the metrics (every 1024 steps and
    /// when the loop ends); a driver query, so not on every step.
    fn sample_device_memory(&mut self) {
        if let Some(growth) = self.executor.device_memory_growth_bytes() {
            self.metrics.device_memory_growth.store(growth, Ordering::Relaxed);
            self.metrics.device_memory_sampled.store(true, Ordering::Relaxed);
            if growth != 0 {
                tracing::warn!(growth_bytes = growth, "device memory in use changed since readiness");
            }
        }
    }

    fn run(&mut self) {
        loop {
            if self.scheduler.is_idle() {
                // A step whose samples were all dropped (the step after an EOS) may still be in
                // flight: land it before sleeping, so its pages and slot retire.
                if let Err(e) = self.land_all() {
                    self.executor_failed(e);
                    break;
                }
                self.publish_occupancy(true);
                if self.draining {
                    break;
                }
                self.sample_device_memory();
                if self.scheduler.disk_pending() {
                    // Write-behind still running: keep turning so its outcomes are applied.
                    match self.rx.recv_timeout(Duration::from_millis(5)) {
                        Ok(cmd) => self.handle(cmd),
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                } else {
                    match self.rx.recv() {
                        Ok(cmd) => self.handle(cmd),
                        Err(_) => break,
                    }
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            match self.turn() {
                Ok(Turn::Blocked) if !self.scheduler.is_idle() => {
                    // Nothing runnable (e.g. waiting for pages): wait briefly for a command.
                    match self.rx.recv_timeout(Duration::from_millis(1)) {
                        Ok(cmd) => self.handle(cmd),
                        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    self.executor_failed(e);
                    break;
                }
            }
            self.publish_occupancy(false);
        }
        self.flush_to_disk();
        self.publish_occupancy(true);
        self.sample_device_memory();
        if self.metrics.device_memory_sampled.load(Ordering::Relaxed) {
            let growth = self.metrics.device_memory_growth.load(Ordering::Relaxed);
            tracing::info!(growth_bytes = growth, "model loop stopped: device memory growth since readiness");
        }
    }

    /// The executor failed: the worker is marked failed and every request fails with it; the
    /// loop ends.
    fn executor_failed(&mut self, e: LoopError) {
        tracing::error!(stage = "execution", code = ErrorCode::ExecutionFailed.as_str(), "executor failed: {e}");
        self.health.fail(e.to_string());
        self.fail_all(&RequestError::Execution(e));
    }

    /// At exit, with a disk tier and a healthy executor: demotes the GPU cache to the host,
    /// runs the step that copies it out, and writes the host tier to disk, so a restart finds
    /// the conversations that were open.
    fn flush_to_disk(&mut self) {
        let Some(timeout) = self.disk_flush_timeout else { return };
        if !matches!(self.health.get(), Health::Ready | Health::Draining) || !self.scheduler.is_idle() {
            return;
        }
        let t0 = Instant::now();
        tracing::info!(gpu_checkpoints = self.scheduler.cached_checkpoints(), "disk cache: writing the cache out");
        let left = match self.write_out(t0 + timeout) {
            Ok((_, left)) => left,
            Err(e) => {
                tracing::error!("disk cache flush: the copy-out step failed: {e}");
                return;
            }
        };
        let disk = self.scheduler.disk_stats().map(|(d, _)| d).unwrap_or_default();
        tracing::info!(
            unwritten = left,
            on_disk = disk.entries,
            elapsed_ms = t0.elapsed().as_millis() as u64,
            "disk cache: flushed"
        );
    }

    /// The shutdown write-out ([`Scheduler::write_out`]): the GPU cache demoted and copied
    /// out, the host tier written to disk until `deadline`. Returns the rounds it took and the
    /// checkpoints left unwritten.
    pub(crate) fn write_out(&mut self, deadline: Instant) -> Result<(u32, usize), LoopError> {
        let (executor, next_fence, vocab) = (&mut self.executor, &mut self.next_fence, self.vocab);
        self.scheduler.write_out(deadline, |scheduler, step| {
            executor.submit(&step, &StepInputs::default())?;
            for c in executor.synchronize()? {
                check_completion(&c, next_fence, vocab)?;
                scheduler.complete(&c);
            }
            Ok::<(), LoopError>(())
        })
    }

    pub(crate) fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { spec, sampling, grammar, cell, reply } => {
                if self.draining {
                    let _ = reply.send(Err(Unavailable::Draining.into()));
                    return;
                }
                let prompt_tokens = spec.tokens.len() as u32;
                match self.scheduler.submit(*spec) {
                    Ok(id) => {
                        self.metrics.admitted.fetch_add(1, Ordering::Relaxed);
                        self.metrics.prompt_tokens.fetch_add(u64::from(prompt_tokens), Ordering::Relaxed);
                        self.active.insert(
                            id,
                            Active {
                                cell,
                                constrained: grammar.is_some(),
                                grammar,
                                sampling,
                                prompt_tokens,
                                stop_requested: false,
                                admitted: false,
                                failure: None,
                                submitted: Instant::now(),
                                last_token: None,
                            },
                        );
                        if reply.send(Ok(id)).is_err() {
                            // The submitter went away before learning its id.
                            self.scheduler.cancel(id);
                        }
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.into()));
                    }
                }
            }
            Command::Cancel { id, stop } => {
                if let Some(a) = self.active.get_mut(&id) {
                    a.stop_requested |= stop;
                    self.scheduler.cancel(id);
                }
            }
            Command::Drain { cancel_running } => {
                self.draining = true;
                if cancel_running {
                    let ids: Vec<RequestId> = self.active.keys().copied().collect();
                    for id in ids {
                        self.scheduler.cancel(id);
                    }
                }
            }
        }
    }

    /// One turn: plan, pack and submit a step, or wait for the oldest one in flight; then
    /// apply what completed. Commands are not taken here (`run` and the test driver do).
    pub(crate) fn turn(&mut self) -> Result<Turn, LoopError> {
        self.collect_grammars(None);
        let step = self.scheduler.schedule();
        for id in self.scheduler.take_admitted() {
            if let Some(a) = self.active.get_mut(&id) {
                a.admitted = true;
                a.cell.admit();
            }
        }
        let mut turned = Turn::Progressed;
        let completions = match step {
            Some(step) => {
                let inputs = self.pack(&step);
                let t0 = Instant::now();
                if step.ops.iter().any(|op| matches!(op, StepOp::CopyIn { .. })) {
                    self.restores_in_flight.insert(step.fence.0, t0);
                }
                self.executor.submit(&step, &inputs)?;
                let done = self.executor.poll()?;
                self.metrics.executor.observe(t0.elapsed().as_secs_f64());
                let steps = self.metrics.steps.fetch_add(1, Ordering::Relaxed);
                if steps.is_multiple_of(1024) {
                    self.sample_device_memory();
                }
                done
            }
            None => {
                // The oldest step only: a later one stays in flight while this turn plans.
                let t0 = Instant::now();
                let done = self.executor.wait()?;
                self.metrics.executor_wait.observe(t0.elapsed().as_secs_f64());
                if done.is_empty() && !self.scheduler.is_idle() && !self.grammars.is_empty() {
                    // Held for masks: wait briefly for one (commands are taken next turn).
                    let landed = self.collect_grammars(Some(Duration::from_millis(1)));
                    turned = Turn::Waited { landed };
                } else if done.is_empty() && self.scheduler.disk_busy() {
                    // Requests wait on a disk fetch: wait for the disk, briefly.
                    let landed = self.scheduler.wait_disk(Duration::from_millis(1));
                    turned = Turn::Waited { landed };
                } else if done.is_empty() {
                    turned = Turn::Blocked;
                }
                done
            }
        };
        self.apply(completions)?;
        Ok(turned)
    }

    /// Lands every step still in flight (an idle scheduler may still have one whose samples
    /// were all dropped, the step after an EOS), so its pages and slot retire.
    pub(crate) fn land_all(&mut self) -> Result<(), LoopError> {
        let done = self.executor.synchronize()?;
        self.apply(done)
    }

    /// Validates completions in fence order, applies them and retires finished requests.
    fn apply(&mut self, completions: Vec<Completion>) -> Result<(), LoopError> {
        for c in completions {
            self.validate(&c)?;
            let accepted = self.scheduler.complete(&c);
            self.publish(&accepted);
        }
        for e in self.scheduler.take_disk_errors() {
            tracing::warn!(error = %e, "disk cache: I/O failure (the checkpoint is dropped; its prefix is recomputed)");
        }
        for r in self.scheduler.take_restored() {
            if let Some(t0) = self.restores_in_flight.remove(&r.fence.0) {
                self.metrics.host_restore.observe(t0.elapsed().as_secs_f64());
            }
        }
        for f in self.scheduler.take_finished() {
            self.retire(f);
        }
        Ok(())
    }

    /// Takes finished grammar work (waiting as `GrammarWork::poll` says): a request whose
    /// mask is back is resumed; one whose grammar failed or ran past its budget fails alone.
    /// Returns whether any outcome came back.
    fn collect_grammars(&mut self, block: Option<Duration>) -> bool {
        let mut outcomes = Vec::new();
        self.grammars.poll(block, &mut outcomes);
        let landed = !outcomes.is_empty();
        for o in outcomes {
            match o {
                GrammarOutcome::Ready(id, mut ready) => match self.active.get_mut(&id) {
                    Some(a) => {
                        self.scheduler.set_checked_proposals(id, std::mem::take(&mut ready.proposals));
                        a.grammar = Some(ready);
                        self.scheduler.resume(id);
                    }
                    None => self.grammars.dispose(ready.matcher),
                },
                GrammarOutcome::Failed(id, e) => {
                    if let Some(a) = self.active.get_mut(&id) {
                        tracing::info!(request = id.0, code = e.code().as_str(), "grammar failed: {e}");
                        a.failure.get_or_insert(e);
                        self.scheduler.cancel(id);
                    }
                }
            }
        }
        landed
    }

    /// Sampling parameters and grammar masks for every request the step samples.
    fn pack(&mut self, step: &Step) -> StepInputs {
        let mut inputs = StepInputs::default();
        let mut sampled: Vec<SampleSpec> = Vec::new();
        for op in &step.ops {
            match op {
                StepOp::Decode { rows, .. } | StepOp::Verify { rows, .. } => {
                    sampled.extend(rows.iter().filter_map(|r| r.sample))
                }
                StepOp::Prefill { row, .. } => sampled.extend(row.sample),
                StepOp::ResumeSampling { sample, .. } => sampled.push(*sample),
                _ => {}
            }
        }
        for s in sampled {
            let Some(a) = self.active.get_mut(&s.request) else { continue };
            let mut proposal_masks = Vec::new();
            let mask = match &a.grammar {
                Some(g) => {
                    // A verify row's lanes: as many of these as the round carries proposals.
                    proposal_masks.clone_from(&g.proposal_masks);
                    Some(g.mask.clone())
                }
                None if !a.constrained => None,
                None => {
                    // Held while its mask is computed, so never planned: a broken invariant.
                    let e = GrammarError::Matcher("a constrained request sampled without its mask".into());
                    a.failure.get_or_insert(RequestError::grammar(e, Stage::Execution));
                    self.scheduler.cancel(s.request);
                    None
                }
            };
            inputs.sampling.insert(s.request, RowSampling { params: a.sampling, mask, proposal_masks });
        }
        inputs
    }

    fn validate(&mut self, c: &Completion) -> Result<(), LoopError> {
        check_completion(c, &mut self.next_fence, self.vocab)
    }

    /// Hands the samples the scheduler accepted to their requests (a sample the device drew
    /// after its request finished is not among them).
    fn publish(&mut self, accepted: &[SampledToken]) {
        let now = Instant::now();
        // A constrained request's samples of this step (a verify round lands several), in order:
        // its grammar consumes them all in one job.
        let mut constrained: Vec<(RequestId, Vec<u32>)> = Vec::new();
        for s in accepted {
            let Some(a) = self.active.get_mut(&s.request) else { continue };
            if a.grammar.is_some() {
                match constrained.iter_mut().find(|(id, _)| *id == s.request) {
                    Some((_, tokens)) => tokens.push(s.token),
                    None => constrained.push((s.request, vec![s.token])),
                }
            }
            match a.last_token {
                None => self.metrics.ttft.observe((now - a.submitted).as_secs_f64()),
                // The tokens one speculative round lands together are one step apart from
                // the previous ones, not from each other: one observation per step.
                Some(t) if t != now => self.metrics.itl.observe((now - t).as_secs_f64()),
                Some(_) => {}
            }
            a.last_token = Some(now);
            self.metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
            a.cell.push(s.token);
        }
        // Held until the next mask is back; the job also checks the next round's proposals.
        for (id, tokens) in constrained {
            let Some(a) = self.active.get_mut(&id) else { continue };
            let Some(ready) = a.grammar.take() else { continue };
            if !self.scheduler.hold(id) {
                a.grammar = Some(ready);
                continue;
            }
            let candidates = self.scheduler.proposal_candidates(id);
            if let Err(e) = self.grammars.dispatch(id, ready.matcher, tokens, candidates) {
                a.failure.get_or_insert(e);
                self.scheduler.cancel(id);
            }
        }
    }

    fn retire(&mut self, f: FinishedRequest) {
        self.grammars.abandon(f.id);
        if let Some(g) = self.active.get_mut(&f.id).and_then(|a| a.grammar.take()) {
            self.grammars.dispose(g.matcher);
        }
        let Some(a) = self.active.remove(&f.id) else { return };
        self.metrics.prefix_hit_tokens.fetch_add(u64::from(f.cached_tokens), Ordering::Relaxed);
        let times = a.cell.times();
        self.metrics.observe_retired(a.submitted, times, a.prompt_tokens);
        // A prompt mostly computed (not restored) measures the prefill rate the disk tier
        // weighs its fetches against.
        let computed = a.prompt_tokens.saturating_sub(f.cached_tokens);
        if let (Some(admitted), Some(first)) = (times.admitted, times.first_token)
            && computed >= 256
        {
            let secs = first.saturating_duration_since(admitted).as_secs_f64();
            if secs > 0.0 {
                self.scheduler.observe_prefill_rate(f64::from(computed) / secs);
            }
        }
        self.metrics.preemptions.fetch_add(u64::from(f.preemptions), Ordering::Relaxed);
        self.publish_step_counters();
        if let Some(e) = a.failure {
            self.metrics.failed.fetch_add(1, Ordering::Relaxed);
            a.cell.finish(Err(e));
            return;
        }
        if f.reason == FinishReason::Cancelled && !a.admitted && self.draining {
            // Cancelled by shutdown while queued: no header went out yet, so it is a 503.
            self.metrics.failed.fetch_add(1, Ordering::Relaxed);
            a.cell.finish(Err(Unavailable::Draining.into()));
            return;
        }
        let cause = match f.reason {
            FinishReason::Eos => FinishCause::Eos,
            FinishReason::Length => FinishCause::Length,
            FinishReason::Cancelled if a.stop_requested => FinishCause::Stop,
            FinishReason::Cancelled => FinishCause::Cancelled,
            FinishReason::PoolExhausted => FinishCause::PoolExhausted,
        };
        self.metrics.finished(cause);
        a.cell.finish(Ok(FinishInfo {
            cause,
            prompt_tokens: a.prompt_tokens,
            generated: f.output.len() as u32,
            cached_tokens: f.cached_tokens,
            preemptions: f.preemptions,
            recomputed_tokens: f.recomputed_tokens,
        }));
    }

    fn fail_all(&mut self, e: &RequestError) {
        self.grammars.abandon_all();
        for g in self.active.values_mut().filter_map(|a| a.grammar.take()) {
            self.grammars.dispose(g.matcher);
        }
        for (_, a) in self.active.drain() {
            self.metrics.failed.fetch_add(1, Ordering::Relaxed);
            a.cell.finish(Err(e.clone()));
        }
    }
}

impl<E: Executor> Drop for ModelLoop<E> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.health.fail("the model thread panicked".into());
        }
        // Nothing may wait forever on a request this thread will never finish.
        self.fail_all(&RequestError::Unavailable(Unavailable::Failed("the model thread stopped".into())));
    }
}
