//! Slots of the connection cap that a connection takes on top of its own, for descriptors it
//! holds beyond the two the cap counts per connection. Its own module, which depends on
//! nothing of the gateway's, because the cap's owner (`limits`) hands it to the tunnels, which
//! the cap's owner reaches through the request path.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Slots of the connection cap that a connection takes on top of its own, for descriptors it
/// holds beyond the two the cap counts per connection (its socket and its member's). A plain
/// tunnel moved by `splice(2)` holds five more: a duplicate of the client socket and a pipe each
/// way (crate::tunnel). Without this, tunnels a client keeps open would use up the open-file
/// limit at two sevenths of the cap, and past that every accept, upstream connect and Redis
/// reconnect of the gateway fails while the cap says there is room.
#[derive(Clone)]
pub struct ExtraSlots {
    open: Arc<AtomicUsize>,
    /// The high-water mark `limits::MemoryTrim` measures closes from, which counts these slots
    /// too.
    high: Arc<AtomicUsize>,
    max: usize,
}

impl ExtraSlots {
    /// Slots of the cap counted by `open` (and its high-water mark `high`), at most `max`.
    pub fn new(open: Arc<AtomicUsize>, high: Arc<AtomicUsize>, max: usize) -> ExtraSlots {
        ExtraSlots { open, high, max }
    }

    /// Takes `n` slots, or None if fewer are free (the caller then does without what they were
    /// for). They count against the cap until the guard is dropped, but not in the gauge of
    /// open connections.
    pub fn take(&self, n: usize) -> Option<ExtraHeld> {
        let before = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |open| {
                (open.saturating_add(n) <= self.max).then_some(open + n)
            })
            .ok()?;
        self.high.fetch_max(before + n, Ordering::Relaxed);
        Some(ExtraHeld {
            open: self.open.clone(),
            n,
        })
    }
}

/// Extra slots taken by [`ExtraSlots::take`], given back when dropped.
pub struct ExtraHeld {
    open: Arc<AtomicUsize>,
    n: usize,
}

impl Drop for ExtraHeld {
    fn drop(&mut self) {
        self.open.fetch_sub(self.n, Ordering::AcqRel);
    }
}
