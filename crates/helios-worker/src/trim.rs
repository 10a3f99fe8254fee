//! Returning freed heap memory to the OS once the server is idle.
//!
//! glibc keeps freed memory in its arenas: after a load burst (or an abusive request) the
//! process would stay at its peak resident size for good. A thread calls `malloc_trim(0)`
//! once work has happened and the server is idle again, at most once per period.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Releases free heap pages to the OS (glibc `malloc_trim(0)`); a no-op elsewhere.
/// Cost: a walk over the heap's free chunks, milliseconds for a large heap, so it runs on
/// the trimmer thread, never on a request path.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only reorganizes the allocator's own free lists; it has no
    // preconditions and is thread-safe in glibc.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The trimmer thread's handle: every `period` it trims if `activity()` (a counter of
/// work done) moved since its last trim and `idle()` (nothing running or waiting) holds
/// now. The thread exits when the handle is dropped.
#[derive(Debug)]
pub(crate) struct Trimmer {
    stop: Arc<AtomicBool>,
}

impl Trimmer {
    pub(crate) fn start(
        period: Duration,
        activity: impl Fn() -> u64 + Send + 'static,
        idle: impl Fn() -> bool + Send + 'static,
    ) -> std::io::Result<Self> {
        Self::start_with(period, activity, idle, release_free_memory)
    }

    fn start_with(
        period: Duration,
        activity: impl Fn() -> u64 + Send + 'static,
        idle: impl Fn() -> bool + Send + 'static,
        trim: impl Fn() + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new().name("helios-trim".into()).spawn(move || {
            let mut trimmed_at = activity();
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(period);
                let now = activity();
                if now != trimmed_at && idle() {
                    trim();
                    trimmed_at = now;
                }
            }
        })?;
        Ok(Trimmer { stop })
    }
}

impl Drop for Trimmer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// Trims once after activity, only when idle, and not again until more activity.
    #[test]
    fn trims_once_per_burst_when_idle() {
        let (work, busy, trims) =
            (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(true)), Arc::new(AtomicU64::new(0)));
        let t = {
            let (w, b, n) = (work.clone(), busy.clone(), trims.clone());
            Trimmer::start_with(
                Duration::from_millis(5),
                move || w.load(Ordering::Relaxed),
                move || !b.load(Ordering::Relaxed),
                move || {
                    n.fetch_add(1, Ordering::Relaxed);
                },
            )
            .expect("thread")
        };
        let settle = || std::thread::sleep(Duration::from_millis(60));
        settle();
        assert_eq!(trims.load(Ordering::Relaxed), 0, "no activity yet");
        work.fetch_add(1, Ordering::Relaxed);
        settle();
        assert_eq!(trims.load(Ordering::Relaxed), 0, "busy: no trim");
        busy.store(false, Ordering::Relaxed);
        settle();
        assert_eq!(trims.load(Ordering::Relaxed), 1, "idle after a burst: one trim");
        settle();
        assert_eq!(trims.load(Ordering::Relaxed), 1, "no new activity: no new trim");
        drop(t);
    }
}
