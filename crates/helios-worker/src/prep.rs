//! Bounded preparation workers: tokenization, template rendering and grammar compilation
//! run here, so CPU work never blocks sockets, health or cancellation.
//!
//! Every job gets a [`Cancel`] flag that is set when its caller stops waiting (the client
//! left: the `run` future was dropped) or the pool shuts down; a job whose flag is set
//! before it starts is skipped, and long frontend work checks it as it goes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use helios_frontend::{Cancel, CancelOnDrop};
use tokio::sync::oneshot;

use crate::error::Unavailable;

type Job = Box<dyn FnOnce() + Send>;

/// A fixed pool of threads behind a bounded queue; a full queue refuses work (503).
#[derive(Debug)]
pub struct PrepPool {
    queue: Mutex<Option<SyncSender<Job>>>,
    capacity: usize,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Parent of every job's flag: set at shutdown.
    closing: Cancel,
    /// Jobs taken by the threads so far (activity for the memory trimmer).
    jobs: Arc<AtomicU64>,
}

impl PrepPool {
    pub fn new(threads: usize, capacity: usize) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<Job>(capacity);
        let rx = Arc::new(Mutex::new(rx));
        let jobs = Arc::new(AtomicU64::new(0));
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let (rx, jobs) = (rx.clone(), jobs.clone());
            handles.push(std::thread::Builder::new().name(format!("helios-prep-{i}")).spawn(move || {
                loop {
                    // Hold the lock only to take one job.
                    let job = match rx.lock() {
                        Ok(r) => r.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => {
                            jobs.fetch_add(1, Ordering::Relaxed);
                            // A panicking job loses only its own result (its caller gets an
                            // error), never the thread: the pool keeps its size.
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        }
                        Err(_) => return,
                    }
                }
            })?);
        }
        Ok(PrepPool {
            queue: Mutex::new(Some(tx)),
            capacity,
            threads: Mutex::new(handles),
            closing: Cancel::new(),
            jobs,
        })
    }

    /// A counter of the jobs taken so far, shared with whoever watches activity.
    pub fn jobs_counter(&self) -> Arc<AtomicU64> {
        self.jobs.clone()
    }

    /// Runs `f` on a preparation thread. Dropping the returned future (the client left)
    /// sets the job's flag: a queued job is then skipped, a running one sees it.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Cancel) -> T + Send + 'static,
    ) -> Result<T, Unavailable> {
        let (tx, rx) = oneshot::channel();
        let cancel = Cancel::child_of(&self.closing);
        let _guard = CancelOnDrop(cancel.clone());
        let job: Job = Box::new(move || {
            if cancel.is_cancelled() {
                return;
            }
            let _ = tx.send(f(&cancel));
        });
        {
            let queue = self.queue.lock().map_err(|_| Unavailable::Draining)?;
            let sender = queue.as_ref().ok_or(Unavailable::Draining)?;
            match sender.try_send(job) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => return Err(Unavailable::PreparationQueueFull(self.capacity)),
                Err(TrySendError::Disconnected(_)) => return Err(Unavailable::Draining),
            }
        }
        rx.await.map_err(|_| {
            if self.closing.is_cancelled() {
                Unavailable::Draining
            } else {
                Unavailable::Failed("a preparation worker panicked".into())
            }
        })
    }

    /// Stops accepting work and cancels every queued and running job, then joins the
    /// threads for at most `deadline`; a thread still busy after that is left behind
    /// (detached), so shutdown never waits on a job beyond its deadline.
    pub fn shutdown(&self, deadline: Duration) {
        self.closing.cancel();
        if let Ok(mut q) = self.queue.lock() {
            q.take();
        }
        let handles = self.threads.lock().map(|mut h| std::mem::take(&mut *h)).unwrap_or_default();
        let until = Instant::now() + deadline;
        for h in handles {
            while !h.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(2));
            }
            if h.is_finished() {
                let _ = h.join();
            } else {
                tracing::warn!("shutdown: a preparation thread is still busy after its deadline; leaving it");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn full_queue_refuses_and_shutdown_drains() {
        let pool = Arc::new(PrepPool::new(1, 1).expect("pool"));
        let (block_tx, block_rx) = std::sync::mpsc::channel::<()>();
        let first = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.run(move |_| block_rx.recv().is_ok()).await })
        };
        // Let the first job start, then fill the single queue slot.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let second = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.run(|_| 2).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(pool.run(|_| 3).await, Err(Unavailable::PreparationQueueFull(1)));
        block_tx.send(()).expect("unblocks");
        assert_eq!(first.await.expect("joins"), Ok(true));
        assert_eq!(second.await.expect("joins"), Ok(2));
        // A panicking job fails alone; the single thread still serves the next one.
        let panicked = pool.run(|_| -> u32 { panic!("a bug on an input path") }).await;
        assert!(matches!(panicked, Err(Unavailable::Failed(_))), "{panicked:?}");
        assert_eq!(pool.run(|_| 5).await, Ok(5));
        pool.shutdown(std::time::Duration::from_secs(5));
        assert_eq!(pool.run(|_| 4).await, Err(Unavailable::Draining));
    }

    /// Work whose caller left stops: a queued job never starts, a running one sees its
    /// flag; shutdown cancels what runs and waits no longer than its deadline.
    #[tokio::test]
    async fn abandoned_and_shutdown_jobs_are_cancelled() {
        let pool = Arc::new(PrepPool::new(1, 4).expect("pool"));
        let (seen_tx, seen_rx) = std::sync::mpsc::channel::<&'static str>();
        // A job that spins until cancelled.
        let spin = |seen: std::sync::mpsc::Sender<&'static str>| {
            move |c: &Cancel| {
                while !c.is_cancelled() {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                let _ = seen.send("cancelled");
            }
        };
        let running = {
            let (pool, f) = (pool.clone(), spin(seen_tx.clone()));
            tokio::spawn(async move { pool.run(f).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let queued = {
            let (pool, seen) = (pool.clone(), seen_tx.clone());
            tokio::spawn(async move { pool.run(move |_| seen.send("queued job ran")).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        // Aborted tasks drop their futures (and set their flags) when the runtime runs them.
        queued.abort();
        running.abort();
        assert!(queued.await.is_err() && running.await.is_err());
        let got = seen_rx.recv_timeout(std::time::Duration::from_secs(5)).expect("the running job stops");
        assert_eq!(got, "cancelled");
        assert!(seen_rx.recv_timeout(std::time::Duration::from_millis(100)).is_err(), "the abandoned queued job ran");
        // A job that ignores its flag cannot hold shutdown past the deadline.
        let (block_tx, block_rx) = std::sync::mpsc::channel::<()>();
        let stuck = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.run(move |_| block_rx.recv().is_ok()).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let t0 = std::time::Instant::now();
        pool.shutdown(std::time::Duration::from_millis(200));
        assert!(t0.elapsed() < std::time::Duration::from_secs(2));
        drop(block_tx);
        assert_eq!(stuck.await.expect("joins"), Ok(false));
    }
}
