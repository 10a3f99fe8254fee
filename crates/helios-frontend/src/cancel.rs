//! Cooperative cancellation for long frontend work.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A shared flag that long frontend work (template renders, mark probes) checks at
/// bounded intervals: once it is set, that work stops with a `Cancelled` error instead of
/// running to the end. Clones share the flag; the default is a flag nobody can set.
///
/// Cost: one relaxed atomic load per check.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Option<Arc<Flag>>);

#[derive(Debug, Default)]
struct Flag {
    set: AtomicBool,
    /// Cancelling the parent cancels this flag too (a pool-wide shutdown, say).
    parent: Option<Cancel>,
}

impl Cancel {
    /// A flag that [`Cancel::cancel`] can set.
    pub fn new() -> Self {
        Cancel(Some(Arc::default()))
    }

    /// A flag of its own that also reads as cancelled once `parent` is.
    pub fn child_of(parent: &Cancel) -> Self {
        Cancel(Some(Arc::new(Flag { set: AtomicBool::new(false), parent: Some(parent.clone()) })))
    }

    /// Sets the flag (idempotent); a parent is not affected. A `Cancel::default()` ignores it.
    pub fn cancel(&self) {
        if let Some(f) = &self.0 {
            f.set.store(true, Ordering::Relaxed);
        }
    }

    /// Cost: one relaxed load per ancestor.
    pub fn is_cancelled(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|f| f.set.load(Ordering::Relaxed) || f.parent.as_ref().is_some_and(Cancel::is_cancelled))
    }
}

/// Sets its flag when dropped: ties work to the lifetime of whoever waits for it.
#[derive(Debug)]
pub struct CancelOnDrop(pub Cancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_and_default_never_cancels() {
        let c = Cancel::new();
        let seen = c.clone();
        assert!(!seen.is_cancelled());
        drop(CancelOnDrop(c));
        assert!(seen.is_cancelled());
        let never = Cancel::default();
        never.cancel();
        assert!(!never.is_cancelled());
        let parent = Cancel::new();
        let (a, b) = (Cancel::child_of(&parent), Cancel::child_of(&parent));
        a.cancel();
        assert!(a.is_cancelled() && !b.is_cancelled() && !parent.is_cancelled());
        parent.cancel();
        assert!(b.is_cancelled());
    }
}
