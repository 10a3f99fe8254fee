//! Bounded preparation workers: tokenization, template rendering and grammar compilation
//! run here, so CPU work never blocks sockets, health or cancellation.

use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use crate::error::Unavailable;

type Job = Box<dyn FnOnce() + Send>;

/// A fixed pool of threads behind a bounded queue; a full queue refuses work (503).
#[derive(Debug)]
pub struct PrepPool {
    queue: Mutex<Option<SyncSender<Job>>>,
    capacity: usize,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl PrepPool {
    pub fn new(threads: usize, capacity: usize) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<Job>(capacity);
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            handles.push(std::thread::Builder::new().name(format!("helios-prep-{i}")).spawn(move || {
                loop {
                    // Hold the lock only to take one job.
                    let job = match rx.lock() {
                        Ok(r) => r.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                }
            })?);
        }
        Ok(PrepPool { queue: Mutex::new(Some(tx)), capacity, threads: Mutex::new(handles) })
    }

    /// Runs `f` on a preparation thread.
    pub async fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T, Unavailable> {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
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
        rx.await.map_err(|_| Unavailable::Failed("a preparation worker panicked".into()))
    }

    /// Stops accepting work and joins the threads after the queued jobs ran.
    pub fn shutdown(&self) {
        if let Ok(mut q) = self.queue.lock() {
            q.take();
        }
        let handles = self.threads.lock().map(|mut h| std::mem::take(&mut *h)).unwrap_or_default();
        for h in handles {
            let _ = h.join();
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
            tokio::spawn(async move { pool.run(move || block_rx.recv().is_ok()).await })
        };
        // Let the first job start, then fill the single queue slot.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let second = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.run(|| 2).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(pool.run(|| 3).await, Err(Unavailable::PreparationQueueFull(1)));
        block_tx.send(()).expect("unblocks");
        assert_eq!(first.await.expect("joins"), Ok(true));
        assert_eq!(second.await.expect("joins"), Ok(2));
        pool.shutdown();
        assert_eq!(pool.run(|| 4).await, Err(Unavailable::Draining));
    }
}
