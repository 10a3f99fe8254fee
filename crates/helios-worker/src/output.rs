//! Per-request output channels. The model thread appends tokens to a cell and never
//! blocks; the consumer takes everything pending at once. Storage is bounded by the
//! request's output limit, so a slow consumer costs its own memory only.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use helios_scheduler::RequestId;
use tokio::sync::Notify;

use crate::engine::Command;
use crate::error::RequestError;

/// How a choice ended, as presented to clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishCause {
    Eos,
    Length,
    /// A stop string matched (presentation trimmed, request cancelled).
    Stop,
    Cancelled,
    /// The request's history outgrew the whole page pool.
    PoolExhausted,
}

impl FinishCause {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishCause::Eos => "eos",
            FinishCause::Length => "length",
            FinishCause::Stop => "stop",
            FinishCause::Cancelled => "cancelled",
            FinishCause::PoolExhausted => "pool_exhausted",
        }
    }
}

/// Terminal accounting of one choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FinishInfo {
    pub cause: FinishCause,
    pub prompt_tokens: u32,
    /// Tokens the model generated (EOS included), whatever presentation trimmed.
    pub generated: u32,
    /// Prompt tokens restored from the prefix cache.
    pub cached_tokens: u32,
    pub preemptions: u32,
    /// History prefilled again at readmissions after preemption (see
    /// `helios_scheduler::FinishedRequest::recomputed_tokens`).
    pub recomputed_tokens: u32,
}

/// What a consumer receives.
#[derive(Clone, Debug)]
pub enum ChoiceEvent {
    Tokens(Vec<u32>),
    Finished(FinishInfo),
    Failed(RequestError),
}

#[derive(Debug, Default)]
struct CellState {
    admitted: bool,
    tokens: Vec<u32>,
    terminal: Option<Result<FinishInfo, RequestError>>,
    times: CellTimes,
}

/// When a request reached the phases the metrics time (queue, prefill, decode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CellTimes {
    /// First admission by the scheduler (a preempted request keeps its first).
    pub admitted: Option<Instant>,
    /// First token pushed.
    pub first_token: Option<Instant>,
}

/// Shared between the model thread (producer) and one consumer.
#[derive(Debug, Default)]
pub(crate) struct OutputCell {
    state: Mutex<CellState>,
    notify: Notify,
}

impl OutputCell {
    fn update(&self, f: impl FnOnce(&mut CellState)) {
        if let Ok(mut s) = self.state.lock()
            && s.terminal.is_none()
        {
            f(&mut s);
        }
        self.notify.notify_one();
    }

    pub(crate) fn admit(&self) {
        self.update(|s| {
            s.admitted = true;
            s.times.admitted.get_or_insert_with(Instant::now);
        });
    }

    pub(crate) fn push(&self, token: u32) {
        self.update(|s| {
            s.times.first_token.get_or_insert_with(Instant::now);
            s.tokens.push(token);
        });
    }

    /// The phase instants so far (for the metrics, when the request retires).
    pub(crate) fn times(&self) -> CellTimes {
        self.state.lock().map(|s| s.times).unwrap_or_default()
    }

    pub(crate) fn finish(&self, result: Result<FinishInfo, RequestError>) {
        self.update(|s| s.terminal = Some(result));
    }

    /// Every token and the terminal outcome, once the request ended (the test driver, which
    /// reads a cell only then).
    #[cfg(feature = "testkit")]
    pub(crate) fn ended(&self) -> Option<(Vec<u32>, Result<FinishInfo, RequestError>)> {
        let mut s = self.state.lock().ok()?;
        let terminal = s.terminal.take()?;
        Some((std::mem::take(&mut s.tokens), terminal))
    }
}

/// The consumer side of one choice. Dropping it before the terminal event cancels the
/// request (client disconnect), which frees its pages at the next submission boundary.
#[derive(Debug)]
pub struct ChoiceStream {
    pub(crate) cell: Arc<OutputCell>,
    pub(crate) id: RequestId,
    pub(crate) commands: Sender<Command>,
    pub(crate) done: bool,
}

impl ChoiceStream {
    /// Scheduler id of this choice.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Waits until the scheduler admitted the request (reserved its capacity) or it failed.
    pub async fn admitted(&mut self) -> Result<(), RequestError> {
        loop {
            let notified = self.cell.notify.notified();
            {
                let s = self.cell.state.lock().map_err(|_| RequestError::ChannelClosed)?;
                if s.admitted {
                    return Ok(());
                }
                match &s.terminal {
                    Some(Err(e)) => {
                        self.done = true;
                        return Err(e.clone());
                    }
                    // Finished before admission (cancelled while queued): nothing to stream.
                    Some(Ok(_)) => return Ok(()),
                    None => {}
                }
            }
            notified.await;
        }
    }

    /// Next event: all tokens produced since the last call, then one terminal event, then `None`.
    pub async fn next(&mut self) -> Option<ChoiceEvent> {
        if self.done {
            return None;
        }
        loop {
            let notified = self.cell.notify.notified();
            {
                let Ok(mut s) = self.cell.state.lock() else {
                    self.done = true;
                    return Some(ChoiceEvent::Failed(RequestError::ChannelClosed));
                };
                if !s.tokens.is_empty() {
                    return Some(ChoiceEvent::Tokens(std::mem::take(&mut s.tokens)));
                }
                if let Some(t) = s.terminal.take() {
                    self.done = true;
                    return Some(match t {
                        Ok(info) => ChoiceEvent::Finished(info),
                        Err(e) => ChoiceEvent::Failed(e),
                    });
                }
            }
            notified.await;
        }
    }

    /// Ends generation because presentation stopped (a stop string matched); the next
    /// terminal event reports [`FinishCause::Stop`].
    pub fn stop(&self) {
        let _ = self.commands.send(Command::Cancel { id: self.id, stop: true });
    }
}

impl Drop for ChoiceStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Cancel { id: self.id, stop: false });
        }
    }
}
