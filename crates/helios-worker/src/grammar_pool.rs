//! Grammar masks off the model thread.
//!
//! A constrained request's matcher stays with the request while it waits for a sample
//! ([`ReadyGrammar`]: the matcher and the mask for its next sample). Once that sample is
//! published, the model thread holds the request in the scheduler and sends the matcher and
//! the token here; a pool thread consumes the token and computes the next mask, and the model
//! thread takes the matcher back and resumes the request. The model thread never computes a
//! mask, so a grammar that is slow to advance delays only its own request, and the masks of
//! one step (the `n` choices of a request, say) are computed in parallel.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use helios_frontend::{GrammarError, GrammarMatcher};
use helios_scheduler::RequestId;

use crate::error::{RequestError, Stage};

/// A constrained choice's matcher and the packed mask for its next sample. Invariant: `mask`
/// is the allowed set of the matcher's current state.
pub(crate) struct ReadyGrammar {
    pub(crate) matcher: Box<GrammarMatcher>,
    pub(crate) mask: Arc<[u32]>,
    /// Copy proposals the grammar accepts from here, each with the mask after it (what a verify
    /// round's lanes sample under); empty without speculation. The proposals move to the
    /// scheduler when the grammar comes back; the masks stay for packing the round.
    pub(crate) proposals: Vec<u32>,
    pub(crate) proposal_masks: Vec<Arc<[u32]>>,
}

impl ReadyGrammar {
    /// A matcher and its current mask, with nothing looked ahead.
    pub(crate) fn new(matcher: Box<GrammarMatcher>, mask: Arc<[u32]>) -> Self {
        ReadyGrammar { matcher, mask, proposals: Vec::new(), proposal_masks: Vec::new() }
    }
}

impl std::fmt::Debug for ReadyGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let allowed: u32 = self.mask.iter().map(|w| w.count_ones()).sum();
        f.debug_struct("ReadyGrammar").field("matcher", &self.matcher).field("allowed", &allowed).finish()
    }
}

/// One step of grammar work: consume `tokens` (a step's samples: one, or a verify round's
/// accepted proposals and the sample after them), compute the next mask, then look ahead over
/// `candidates` (copy proposals) for the lanes of the next round.
pub(crate) struct GrammarJob {
    pub(crate) id: RequestId,
    pub(crate) matcher: Box<GrammarMatcher>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) candidates: Vec<u32>,
    /// Set when a thread starts the job: a budget counts from here, not from the queue.
    pub(crate) started: Arc<OnceLock<Instant>>,
}

/// A job's outcome; the matcher comes back with it.
pub(crate) struct GrammarDone {
    pub(crate) id: RequestId,
    pub(crate) matcher: Box<GrammarMatcher>,
    /// The next mask, and the accepted candidates with the masks after each.
    pub(crate) mask: Result<Lookahead, GrammarError>,
    /// How long the computation ran (queue wait excluded).
    pub(crate) elapsed: Duration,
}

/// A job's masks: the next sample's, and the proposals the grammar accepts with theirs.
pub(crate) struct Lookahead {
    pub(crate) mask: Arc<[u32]>,
    pub(crate) proposals: Vec<u32>,
    pub(crate) proposal_masks: Vec<Arc<[u32]>>,
}

/// Consumes `tokens`, computes the next mask and looks ahead over `candidates`.
fn advance(matcher: &mut GrammarMatcher, tokens: &[u32], candidates: &[u32]) -> Result<Lookahead, GrammarError> {
    for &t in tokens {
        matcher.consume_token(t)?;
    }
    let mask = matcher.compute_mask()?;
    let (proposals, masks) =
        if candidates.is_empty() { (Vec::new(), Vec::new()) } else { matcher.lookahead(&mask, candidates)? };
    Ok(Lookahead {
        mask: mask.words().into(),
        proposals,
        proposal_masks: masks.iter().map(|m| Arc::<[u32]>::from(m.words())).collect(),
    })
}

/// Work for a pool thread.
enum Work {
    Advance(GrammarJob),
    /// Free a matcher: a large grammar's lexer caches take milliseconds to free.
    Drop(Box<GrammarMatcher>),
}

/// Fixed threads behind an unbounded FIFO queue. The model thread sends at most one job per
/// constrained request in flight (and each matcher once to be freed), so the queue never
/// holds more than about twice the running requests.
pub(crate) struct GrammarPool {
    jobs: Option<Sender<Work>>,
    done: Receiver<GrammarDone>,
    threads: Vec<JoinHandle<()>>,
}

impl GrammarPool {
    /// Starts `threads` (at least one) threads.
    pub(crate) fn new(threads: usize) -> std::io::Result<Self> {
        let (jobs, queue) = channel::<Work>();
        let (done_tx, done) = channel();
        let queue = Arc::new(Mutex::new(queue));
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let (queue, done_tx) = (queue.clone(), done_tx.clone());
            let handle = std::thread::Builder::new().name(format!("helios-grammar-{i}")).spawn(move || {
                loop {
                    // Hold the lock only to take one job.
                    let job = match queue.lock() {
                        Ok(q) => q.recv(),
                        Err(_) => return,
                    };
                    let GrammarJob { id, mut matcher, tokens, candidates, started } = match job {
                        Ok(Work::Advance(job)) => job,
                        Ok(Work::Drop(matcher)) => {
                            drop(matcher);
                            continue;
                        }
                        Err(_) => return,
                    };
                    let t0 = Instant::now();
                    let _ = started.set(t0);
                    // llguidance catches its own panics; this keeps a thread alive regardless,
                    // since a lost result would leave its request held.
                    let mask = catch_unwind(AssertUnwindSafe(|| advance(&mut matcher, &tokens, &candidates)))
                        .unwrap_or_else(|_| Err(GrammarError::Matcher("the grammar matcher panicked".into())));
                    if done_tx.send(GrammarDone { id, matcher, mask, elapsed: t0.elapsed() }).is_err() {
                        return;
                    }
                }
            });
            match handle {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // Close the queue so the threads already started exit.
                    drop(jobs);
                    for h in handles {
                        let _ = h.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(GrammarPool { jobs: Some(jobs), done, threads: handles })
    }

    /// Queues a job; gives it back if no thread is left to run it.
    pub(crate) fn submit(&self, job: GrammarJob) -> Result<(), ()> {
        match &self.jobs {
            Some(jobs) => jobs.send(Work::Advance(job)).map_err(drop),
            None => Err(()),
        }
    }

    /// Frees `matcher` on a pool thread (here, if none is left).
    pub(crate) fn dispose(&self, matcher: Box<GrammarMatcher>) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Work::Drop(matcher));
        }
    }

    /// A finished job, if one is ready.
    pub(crate) fn try_recv(&self) -> Option<GrammarDone> {
        self.done.try_recv().ok()
    }

    /// The next finished job, waiting until `deadline` at most.
    pub(crate) fn recv_until(&self, deadline: Instant) -> Option<GrammarDone> {
        let wait = deadline.saturating_duration_since(Instant::now());
        self.done.recv_timeout(wait).ok()
    }
}

impl Drop for GrammarPool {
    /// Closes the queue and joins the threads once their current job ends (the model thread
    /// cancels the jobs of requests it retires, so that is soon).
    fn drop(&mut self) {
        self.jobs.take();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// What became of a request's grammar work.
#[derive(Debug)]
pub(crate) enum GrammarOutcome {
    /// The mask for its next sample is ready: resume it.
    Ready(RequestId, ReadyGrammar),
    /// Its grammar failed, exceeded the parser's limits or ran past the budget: it fails alone.
    Failed(RequestId, RequestError),
}

/// A job in the pool, seen from the model thread.
struct InFlight {
    dispatched: Instant,
    started: Arc<OnceLock<Instant>>,
    cancel: Box<dyn Fn() + Send + Sync>,
}

/// The model thread's side of the pool: jobs in flight, the per-mask budget and the join wait.
///
/// Invariant: at most one job per request; a request with a job is held in the scheduler.
pub(crate) struct GrammarWork {
    pool: GrammarPool,
    in_flight: HashMap<RequestId, InFlight>,
    budget: Duration,
    join_wait: Duration,
}

impl GrammarWork {
    /// `budget`: longest one job may run; `join_wait`: how long [`GrammarWork::poll`] waits
    /// for a job dispatched that recently.
    pub(crate) fn new(threads: usize, budget: Duration, join_wait: Duration) -> std::io::Result<Self> {
        Ok(GrammarWork { pool: GrammarPool::new(threads)?, in_flight: HashMap::new(), budget, join_wait })
    }

    /// Whether no job is in flight.
    pub(crate) fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// Sends one step of `id`'s grammar (consume `tokens`, compute the next mask, look ahead
    /// over `candidates`) to the pool.
    pub(crate) fn dispatch(
        &mut self,
        id: RequestId,
        matcher: Box<GrammarMatcher>,
        tokens: Vec<u32>,
        candidates: Vec<u32>,
    ) -> Result<(), RequestError> {
        let started = Arc::new(OnceLock::new());
        let cancel = Box::new(matcher.canceller());
        let job = GrammarJob { id, matcher, tokens, candidates, started: started.clone() };
        self.pool.submit(job).map_err(|_| {
            RequestError::grammar(GrammarError::Matcher("the grammar threads stopped".into()), Stage::Execution)
        })?;
        self.in_flight.insert(id, InFlight { dispatched: Instant::now(), started, cancel });
        Ok(())
    }

    /// Frees a matcher off the model thread.
    pub(crate) fn dispose(&self, matcher: Box<GrammarMatcher>) {
        self.pool.dispose(matcher);
    }

    /// Cancels `id`'s job, if any: its request left. Its result is dropped when it comes back.
    pub(crate) fn abandon(&mut self, id: RequestId) {
        if let Some(job) = self.in_flight.remove(&id) {
            (job.cancel)();
        }
    }

    /// Cancels every job.
    pub(crate) fn abandon_all(&mut self) {
        for (_, job) in self.in_flight.drain() {
            (job.cancel)();
        }
    }

    /// Collects finished jobs into `out`. Waits for jobs dispatched less than the join wait
    /// ago (so a request whose mask is quick keeps its place in the decode batch), and up to
    /// `block` more for one result when the caller has nothing else to do. Then fails every
    /// job that has run past the budget (and cancels its computation).
    pub(crate) fn poll(&mut self, block: Option<Duration>, out: &mut Vec<GrammarOutcome>) {
        let now = Instant::now();
        while let Some(done) = self.pool.try_recv() {
            self.finish(done, out);
        }
        loop {
            let join = self.in_flight.values().map(|j| j.dispatched + self.join_wait).filter(|&t| t > now).max();
            let Some(until) = join else { break };
            match self.pool.recv_until(until) {
                Some(done) => self.finish(done, out),
                None => break,
            }
        }
        if let Some(block) = block
            && !self.in_flight.is_empty()
            && let Some(done) = self.pool.recv_until(now + block)
        {
            self.finish(done, out);
            while let Some(done) = self.pool.try_recv() {
                self.finish(done, out);
            }
        }
        let over: Vec<(RequestId, Duration)> = self
            .in_flight
            .iter()
            .filter_map(|(&id, j)| j.started.get().map(|t| (id, t.elapsed())))
            .filter(|&(_, ran)| ran > self.budget)
            .collect();
        for (id, ran) in over {
            self.abandon(id);
            out.push(GrammarOutcome::Failed(id, self.too_slow(ran)));
        }
    }

    fn too_slow(&self, ran: Duration) -> RequestError {
        RequestError::GrammarTooSlow { elapsed_ms: ran.as_millis() as u64, budget_ms: self.budget.as_millis() as u64 }
    }

    fn finish(&mut self, done: GrammarDone, out: &mut Vec<GrammarOutcome>) {
        let GrammarDone { id, matcher, mask, elapsed } = done;
        if self.in_flight.remove(&id).is_none() {
            self.dispose(matcher); // abandoned
            return;
        }
        let failure = match mask {
            Ok(Lookahead { mask, proposals, proposal_masks }) if elapsed <= self.budget => {
                out.push(GrammarOutcome::Ready(id, ReadyGrammar { matcher, mask, proposals, proposal_masks }));
                return;
            }
            Err(e) if elapsed <= self.budget => RequestError::grammar(e, Stage::Execution),
            _ => self.too_slow(elapsed),
        };
        self.dispose(matcher);
        out.push(GrammarOutcome::Failed(id, failure));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use helios_frontend::{AnswerFormat, GrammarEnv, OutputProtocol, Tokenizer};

    fn matcher() -> (GrammarMatcher, u32) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/frontend");
        let tokenizer = Arc::new(Tokenizer::from_file(dir.join("smollm2/tokenizer.json")).expect("tokenizer"));
        let eos = tokenizer.token_id("<|im_end|>").expect("eos");
        let open = tokenizer.encode("{", false).expect("encodes").ids[0];
        let env = GrammarEnv::new(tokenizer, &[eos]).expect("env");
        let proto = OutputProtocol {
            reasoning: helios_contract::ReasoningParser::None,
            tools: helios_contract::ToolParser::None,
            calls: helios_frontend::Calls::None,
            starts_in_reasoning: false,
        };
        let mut m = env.matcher(&AnswerFormat::JsonObject, &proto).expect("compiles");
        assert!(m.start().expect("starts").is_allowed(open));
        (m, open)
    }

    /// Polls until an outcome arrives (at most a few seconds).
    fn next(work: &mut GrammarWork) -> GrammarOutcome {
        let mut out = Vec::new();
        for _ in 0..5000 {
            work.poll(Some(Duration::from_millis(1)), &mut out);
            if let Some(o) = out.pop() {
                assert!(out.is_empty(), "one outcome per job");
                return o;
            }
        }
        panic!("no outcome");
    }

    #[test]
    fn masks_come_back_and_abandoned_jobs_are_dropped() {
        let (m, open) = matcher();
        let mut work = GrammarWork::new(2, Duration::from_secs(5), Duration::from_millis(2)).expect("pool");
        work.dispatch(RequestId(1), Box::new(m.fork()), vec![open], Vec::new()).expect("dispatches");
        match next(&mut work) {
            GrammarOutcome::Ready(id, ready) => {
                assert_eq!(id, RequestId(1));
                let allowed: u32 = ready.mask.iter().map(|w| w.count_ones()).sum();
                assert!(allowed > 0 && (ready.mask[open as usize / 32] >> (open % 32)) & 1 == 0, "after `{{`");
                assert_eq!(ready.matcher.consumed(), 1);
            }
            o => panic!("{o:?}"),
        }
        assert!(work.is_empty());
        work.dispatch(RequestId(2), Box::new(m.fork()), vec![open], Vec::new()).expect("dispatches");
        work.abandon(RequestId(2));
        assert!(work.is_empty());
        let mut out = Vec::new();
        work.poll(Some(Duration::from_millis(200)), &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn a_job_over_the_budget_fails_alone_and_is_cancelled() {
        let (m, open) = matcher();
        // Nothing runs within no time at all: the watchdog or the job's own clock fails it.
        let mut work = GrammarWork::new(1, Duration::ZERO, Duration::ZERO).expect("pool");
        work.dispatch(RequestId(7), Box::new(m.fork()), vec![open], Vec::new()).expect("dispatches");
        match next(&mut work) {
            GrammarOutcome::Failed(id, e) => {
                assert_eq!(id, RequestId(7));
                assert!(matches!(e, RequestError::GrammarTooSlow { budget_ms: 0, .. }), "{e:?}");
            }
            o => panic!("{o:?}"),
        }
        assert!(work.is_empty());
        let mut out = Vec::new();
        work.poll(Some(Duration::from_millis(100)), &mut out);
        assert!(out.is_empty(), "reported once: {out:?}");
        // A matcher failing on its own mid-run is not the request's fault (500); the pool
        // keeps working afterwards.
        let mut work = GrammarWork::new(1, Duration::from_secs(5), Duration::ZERO).expect("pool");
        let stopped = m.fork();
        let cancel = stopped.canceller();
        cancel();
        assert!(stopped.is_cancelled());
        work.dispatch(RequestId(8), Box::new(stopped), vec![open], Vec::new()).expect("dispatches");
        match next(&mut work) {
            GrammarOutcome::Failed(_, e) => assert_eq!(e.code(), crate::ErrorCode::GrammarFailed, "{e}"),
            o => panic!("{o:?}"),
        }
        work.dispatch(RequestId(9), Box::new(m.fork()), vec![open], Vec::new()).expect("dispatches");
        assert!(matches!(next(&mut work), GrammarOutcome::Ready(RequestId(9), _)));
    }
}
