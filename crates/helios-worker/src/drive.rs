//! The model loop driven one turn at a time (feature `testkit`).
//!
//! Lifecycle scenarios, property tests and the device examples run requests through the
//! same loop [`crate::Engine`] serves with: submission and cancellation go through its
//! command handler, and every turn packs, submits, validates completions (fence order,
//! vocabulary), publishes tokens and retires requests exactly as serving does. Only the
//! thread, the command channel and the HTTP side are left out.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{Sender, channel};
use std::time::{Duration, Instant};

use helios_replay::{Executor, SamplingParams};
use helios_scheduler::{RequestId, RequestSpec, Scheduler};
use tokio::sync::oneshot;

use crate::engine::{Command, HealthState, ModelLoop, Turn};
use crate::error::{LoopError, RequestError};
use crate::grammar_pool::GrammarWork;
use crate::metrics::Metrics;
use crate::output::{FinishInfo, OutputCell};

/// Turns in a row without progress after which [`LoopDriver::drain`] calls the loop stalled.
const STALL_TURNS: u32 = 3;

/// How long [`LoopDriver::drain`] waits for a disk fetch or write before a turn counts as stalled.
const DISK_WAIT: Duration = Duration::from_secs(10);

/// A request that ended, as the loop published it.
#[derive(Debug)]
pub struct Ended {
    pub id: RequestId,
    /// Every token the loop published for it (EOS included).
    pub output: Vec<u32>,
    /// Its terminal event: how it finished, or why it failed.
    pub result: Result<FinishInfo, RequestError>,
}

/// The serving loop over `E`, turned by its caller.
///
/// Invariant: every request [`LoopDriver::submit`] accepted is reported once by
/// [`LoopDriver::take_ended`] after it ends.
pub struct LoopDriver<E: Executor> {
    model: ModelLoop<E>,
    /// Keeps the loop's command channel open (commands are handed to it directly).
    _commands: Sender<Command>,
    cells: BTreeMap<RequestId, Arc<OutputCell>>,
}

impl<E: Executor> std::fmt::Debug for LoopDriver<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopDriver").field("requests", &self.cells.len()).finish_non_exhaustive()
    }
}

impl<E: Executor> LoopDriver<E> {
    /// The loop over `scheduler` and a ready `executor`; sampled ids must be below `vocab`.
    /// Starts one grammar thread (no test request is constrained, but the loop owns one).
    pub fn new(scheduler: Scheduler, executor: E, vocab: u32) -> std::io::Result<Self> {
        let (tx, rx) = channel();
        let grammars = GrammarWork::new(1, Duration::from_millis(500), Duration::from_millis(2))?;
        let model = ModelLoop::new(
            scheduler,
            executor,
            rx,
            Arc::new(Metrics::default()),
            Arc::new(HealthState::default()),
            vocab,
            grammars,
        );
        Ok(LoopDriver { model, _commands: tx, cells: BTreeMap::new() })
    }

    /// Submits a request sampled with default parameters, as the serving loop's command
    /// handler does; admission errors come back typed.
    pub fn submit(&mut self, spec: RequestSpec) -> Result<RequestId, RequestError> {
        self.submit_sampled(spec, SamplingParams::default())
    }

    /// [`LoopDriver::submit`] with explicit sampling parameters.
    pub fn submit_sampled(&mut self, spec: RequestSpec, sampling: SamplingParams) -> Result<RequestId, RequestError> {
        let cell = Arc::new(OutputCell::default());
        let (reply, mut answer) = oneshot::channel();
        self.model.handle(Command::Submit { spec: Box::new(spec), sampling, grammar: None, cell: cell.clone(), reply });
        let id = answer.try_recv().map_err(|_| RequestError::ChannelClosed)??;
        self.cells.insert(id, cell);
        Ok(id)
    }

    /// Cancels a request (a client that left), as the command handler does.
    pub fn cancel(&mut self, id: RequestId) {
        self.model.handle(Command::Cancel { id, stop: false });
    }

    /// One turn of the serving loop. Returns whether it made progress: a step submitted,
    /// completions landed, or a mask or disk fetch came back while it waited.
    pub fn turn(&mut self) -> Result<bool, LoopError> {
        Ok(match self.model.turn()? {
            Turn::Progressed => true,
            Turn::Waited { landed } => landed,
            Turn::Blocked => false,
        })
    }

    /// Turns until the scheduler is idle, then lands the steps still in flight, as the loop
    /// does before it sleeps. `check` runs after every turn (invariant checks).
    ///
    /// Panics when [`STALL_TURNS`] turns in a row make no progress with work outstanding
    /// (a turn that finds requests waiting on the disk waits for it first).
    pub fn drain_checked(&mut self, mut check: impl FnMut(&mut Self)) -> Result<u64, LoopError> {
        let (mut turns, mut idle) = (0u64, 0u32);
        while !self.model.scheduler().is_idle() {
            // Work waiting on the disk is progress the loop would poll for; wait for it here.
            let waited = |d: &mut Self| d.model.scheduler().disk_busy() && d.model.scheduler_mut().wait_disk(DISK_WAIT);
            if self.turn()? || waited(self) {
                idle = 0;
            } else {
                idle += 1;
                assert!(idle < STALL_TURNS, "the loop stalled with work outstanding");
            }
            turns += 1;
            check(self);
        }
        self.model.land_all()?;
        check(self);
        Ok(turns)
    }

    /// [`LoopDriver::drain_checked`] with the scheduler's invariant checks.
    pub fn drain(&mut self) -> Result<u64, LoopError> {
        self.drain_checked(|d| d.scheduler().check_invariants())
    }

    /// Requests that ended since the last call, in id order.
    pub fn take_ended(&mut self) -> Vec<Ended> {
        let mut ended = Vec::new();
        self.cells.retain(|&id, cell| match cell.ended() {
            Some((output, result)) => {
                ended.push(Ended { id, output, result });
                false
            }
            None => true,
        });
        ended
    }

    /// The serving loop's shutdown write-out with `timeout`: returns the rounds it took and
    /// the checkpoints left unwritten.
    pub fn write_out(&mut self, timeout: Duration) -> Result<(u32, usize), LoopError> {
        self.model.write_out(Instant::now() + timeout)
    }

    pub fn scheduler(&self) -> &Scheduler {
        self.model.scheduler()
    }

    /// For checks and tier set-up between turns; plans nothing on its own.
    pub fn scheduler_mut(&mut self) -> &mut Scheduler {
        self.model.scheduler_mut()
    }

    pub fn executor_mut(&mut self) -> &mut E {
        self.model.executor_mut()
    }
}
