//! The engine: one model thread owning the scheduler and the executor, fed by commands.
//!
//! Each loop turn: apply commands (submissions, cancellations) → plan one step → pack its
//! sampling inputs (parameters, grammar masks) → submit → validate completions → apply them
//! to the scheduler → publish tokens → retire finished requests. The thread never waits on
//! a consumer: output goes into per-request cells.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use helios_contract::model::Manifest;
use helios_frontend::GrammarMatcher;
use helios_replay::{Executor, ExecutorError, RowSampling, SamplingParams, StepInputs};
use helios_scheduler::{
    Completion, FinishReason, FinishedRequest, RequestId, RequestSpec, SampleSpec, SampledToken, Scheduler,
    SchedulerConfig, Step, StepOp,
};
use tokio::sync::oneshot;

use crate::error::{RequestError, Unavailable};
use crate::frontend::{Frontend, StartError};
use crate::metrics::Metrics;
use crate::output::{ChoiceStream, FinishCause, FinishInfo, OutputCell};
use crate::prep::PrepPool;
use crate::request::{GenerationInput, Prepared, prepare};

/// Deployment options.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Requests running at once (at most the core's request slots).
    pub max_concurrency: u32,
    /// Requests waiting for admission before 503.
    pub queue_limit: usize,
    /// Caps the core's default output limit.
    pub max_output_tokens: Option<u32>,
    pub prep_threads: usize,
    pub prep_queue: usize,
    /// Keep up to two decode steps in flight when the executor's graphs keep the pending
    /// token on the device (requests without a grammar).
    pub device_fed_decode: bool,
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
struct HealthState {
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
        spec: RequestSpec,
        sampling: SamplingParams,
        grammar: Option<Box<GrammarMatcher>>,
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
        if let Some(cap) = options.max_output_tokens {
            if cap == 0 {
                return Err(StartError::Option { name: "max_output_tokens", reason: "must be at least 1".into() });
            }
            frontend.sampling.max_output_tokens = frontend.sampling.max_output_tokens.min(cap);
        }
        let config = SchedulerConfig {
            max_concurrency: options.max_concurrency,
            queue_limit: options.queue_limit,
            identity: helios_cache::PrefixIdentity::default(),
            device_fed_decode: false,
        };
        let device_fed_option = options.device_fed_decode;
        let scheduler = Scheduler::new(manifest.cache_scheme.clone(), manifest.capacities.clone(), config)?;
        let vocab = manifest.capacities.vocab_size;
        let (scheme, capacities) = (manifest.cache_scheme.clone(), manifest.capacities.clone());
        let (tx, rx) = channel();
        let health = Arc::new(HealthState::default());
        let metrics = Arc::new(Metrics::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let thread = {
            let health = health.clone();
            let metrics = metrics.clone();
            std::thread::Builder::new()
                .name("helios-model".into())
                .spawn(move || {
                    let executor = match make_executor() {
                        Ok(e) => e,
                        Err(e) => {
                            health.fail(e.to_string());
                            let _ = ready_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    // The load-time memory plan may have backed fewer KV pages than prepared:
                    // the page pool is what the device holds, never more.
                    let cut = executor.kv_pages().filter(|&p| p < capacities.max_kv_pages);
                    let device_fed = device_fed_option && executor.device_fed_decode();
                    let scheduler = match (cut, device_fed) {
                        (None, false) => scheduler,
                        _ => {
                            let pages = cut.unwrap_or(capacities.max_kv_pages);
                            let caps = helios_contract::model::Capacities { max_kv_pages: pages, ..capacities };
                            let config = SchedulerConfig { device_fed_decode: device_fed, ..config };
                            match Scheduler::new(scheme, caps, config) {
                                Ok(s) => s,
                                Err(e) => {
                                    health.fail(e.to_string());
                                    let _ = ready_tx.send(Err(e.to_string()));
                                    return;
                                }
                            }
                        }
                    };
                    health.status.store(READY, Ordering::Release);
                    let _ = ready_tx.send(Ok(()));
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
                    }
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
        Ok(Arc::new(Engine {
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

    /// Runs CPU-bound frontend work on a preparation worker.
    pub async fn run_prep<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Frontend) -> T + Send + 'static,
    ) -> Result<T, RequestError> {
        let frontend = self.frontend.clone();
        Ok(self.prep.run(move || f(&frontend)).await?)
    }

    /// Renders, tokenizes and compiles a request on a preparation worker.
    pub async fn prepare(&self, input: GenerationInput) -> Result<Prepared, RequestError> {
        self.check_available()?;
        self.run_prep(move |f| prepare(f, input)).await?
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
        let grammar = if prepared.grammars.is_empty() { None } else { Some(Box::new(prepared.grammars.remove(0))) };
        let cell = Arc::new(OutputCell::default());
        let (reply, answer) = oneshot::channel();
        let commands = self.sender()?;
        commands
            .send(Command::Submit { spec, sampling: prepared.sampling_params(), grammar, cell: cell.clone(), reply })
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
            engine.prep.shutdown();
        })
        .await;
    }

    fn thread_finished(&self) -> bool {
        self.thread.lock().map(|t| t.as_ref().is_none_or(|h| h.is_finished())).unwrap_or(true)
    }
}

struct Active {
    cell: Arc<OutputCell>,
    grammar: Option<Box<GrammarMatcher>>,
    sampling: SamplingParams,
    prompt_tokens: u32,
    stop_requested: bool,
    failure: Option<RequestError>,
    submitted: Instant,
    last_token: Option<Instant>,
}

struct ModelLoop<E: Executor> {
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
}

impl<E: Executor> ModelLoop<E> {
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
                if let Err(e) = self.executor.synchronize().and_then(|done| self.apply(done)) {
                    tracing::error!(stage = "execution", code = "execution_failed", "executor failed: {e}");
                    self.health.fail(e.to_string());
                    self.fail_all(&RequestError::Execution(e));
                    break;
                }
                self.metrics.set_occupancy(self.scheduler.occupancy());
                if self.draining {
                    break;
                }
                self.sample_device_memory();
                match self.rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            if let Err(e) = self.turn() {
                tracing::error!(stage = "execution", code = "execution_failed", "executor failed: {e}");
                self.health.fail(e.to_string());
                self.fail_all(&RequestError::Execution(e));
                break;
            }
            self.metrics.set_occupancy(self.scheduler.occupancy());
        }
        self.metrics.set_occupancy(self.scheduler.occupancy());
        self.sample_device_memory();
        if self.metrics.device_memory_sampled.load(Ordering::Relaxed) {
            let growth = self.metrics.device_memory_growth.load(Ordering::Relaxed);
            tracing::info!(growth_bytes = growth, "model loop stopped: device memory growth since readiness");
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { spec, sampling, grammar, cell, reply } => {
                if self.draining {
                    let _ = reply.send(Err(Unavailable::Draining.into()));
                    return;
                }
                let prompt_tokens = spec.tokens.len() as u32;
                match self.scheduler.submit(spec) {
                    Ok(id) => {
                        self.metrics.admitted.fetch_add(1, Ordering::Relaxed);
                        self.metrics.prompt_tokens.fetch_add(u64::from(prompt_tokens), Ordering::Relaxed);
                        self.active.insert(
                            id,
                            Active {
                                cell,
                                grammar,
                                sampling,
                                prompt_tokens,
                                stop_requested: false,
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

    fn turn(&mut self) -> Result<(), ExecutorError> {
        let step = self.scheduler.schedule();
        for id in self.scheduler.take_admitted() {
            if let Some(a) = self.active.get(&id) {
                a.cell.admit();
            }
        }
        let completions = match step {
            Some(step) => {
                let inputs = self.pack(&step);
                let t0 = Instant::now();
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
                let done = self.executor.wait()?;
                if done.is_empty() && !self.scheduler.is_idle() {
                    // Nothing runnable (e.g. waiting for pages): wait briefly for a command.
                    match self.rx.recv_timeout(Duration::from_millis(1)) {
                        Ok(cmd) => self.handle(cmd),
                        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
                    }
                }
                done
            }
        };
        self.apply(completions)
    }

    /// Validates completions in fence order, applies them and retires finished requests.
    fn apply(&mut self, completions: Vec<Completion>) -> Result<(), ExecutorError> {
        for c in completions {
            self.validate(&c)?;
            let accepted = self.scheduler.complete(&c);
            self.publish(&accepted);
        }
        for f in self.scheduler.take_finished() {
            self.retire(f);
        }
        Ok(())
    }

    /// Sampling parameters and grammar masks for every request the step samples.
    fn pack(&mut self, step: &Step) -> StepInputs {
        let mut inputs = StepInputs::default();
        let mut sampled: Vec<SampleSpec> = Vec::new();
        for op in &step.ops {
            match op {
                StepOp::Decode { rows, .. } => sampled.extend(rows.iter().filter_map(|r| r.sample)),
                StepOp::Prefill { row, .. } => sampled.extend(row.sample),
                StepOp::ResumeSampling { sample, .. } => sampled.push(*sample),
                _ => {}
            }
        }
        for s in sampled {
            let Some(a) = self.active.get_mut(&s.request) else { continue };
            let mask = match a.grammar.as_mut().map(|g| g.compute_mask()) {
                None => None,
                Some(Ok(m)) => Some(Arc::<[u32]>::from(m.words())),
                Some(Err(e)) => {
                    a.failure.get_or_insert(RequestError::from(e));
                    self.scheduler.cancel(s.request);
                    None
                }
            };
            inputs.sampling.insert(s.request, RowSampling { params: a.sampling, mask });
        }
        inputs
    }

    /// Completions must arrive in fence order and sample ids inside the vocabulary.
    fn validate(&mut self, c: &Completion) -> Result<(), ExecutorError> {
        if c.fence.0 != self.next_fence {
            return Err(ExecutorError::UnexpectedFence { got: c.fence.0, expected: self.next_fence });
        }
        if let Some(s) = c.sampled.iter().find(|s| s.token >= self.vocab) {
            return Err(ExecutorError::SampledOutOfVocabulary { token: s.token, vocab: self.vocab });
        }
        self.next_fence += 1;
        Ok(())
    }

    /// Hands the samples the scheduler accepted to their requests (a sample the device drew
    /// after its request finished is not among them).
    fn publish(&mut self, accepted: &[SampledToken]) {
        let now = Instant::now();
        for s in accepted {
            let Some(a) = self.active.get_mut(&s.request) else { continue };
            if let Some(g) = a.grammar.as_mut()
                && let Err(e) = g.consume_token(s.token)
            {
                a.failure.get_or_insert(RequestError::from(e));
                self.scheduler.cancel(s.request);
            }
            match a.last_token {
                None => self.metrics.ttft.observe((now - a.submitted).as_secs_f64()),
                Some(t) => self.metrics.itl.observe((now - t).as_secs_f64()),
            }
            a.last_token = Some(now);
            self.metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
            a.cell.push(s.token);
        }
    }

    fn retire(&mut self, f: FinishedRequest) {
        let Some(a) = self.active.remove(&f.id) else { return };
        self.metrics.prefix_hit_tokens.fetch_add(u64::from(f.cached_tokens), Ordering::Relaxed);
        self.metrics.preemptions.fetch_add(u64::from(f.preemptions), Ordering::Relaxed);
        if let Some(e) = a.failure {
            self.metrics.failed.fetch_add(1, Ordering::Relaxed);
            a.cell.finish(Err(e));
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
        }));
    }

    fn fail_all(&mut self, e: &RequestError) {
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
