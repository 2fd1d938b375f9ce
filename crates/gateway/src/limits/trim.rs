//! Giving memory back to the system once many connections have closed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use prometheus::IntCounter;

/// How often [`MemoryTrim`] looks at the connection count.
const TRIM_EVERY: Duration = Duration::from_secs(5);
/// How many connections must have closed since the last look for a trim: with about 100 KiB
/// held per connection, 256 of them are some 25 MiB.
const TRIM_AFTER_CLOSED: usize = 256;

/// Every [`TRIM_EVERY`], if at least [`TRIM_AFTER_CLOSED`] fewer connections are open than the
/// most that were open since the last trim, calls glibc's `malloc_trim(0)`, which hands the
/// free pages of every heap back to the system (5,000 idle connections that had come and gone
/// left ~95 KiB each behind, all of it returned by a trim). So at most one trim per period,
/// only after a large net drop (a slow one too), never on a steady load however busy; it takes
/// the allocator's locks for a few milliseconds at most. What fewer than [`TRIM_AFTER_CLOSED`]
/// connections freed since the last trim may stay. Built with the `jemalloc` allocator, the
/// same trigger purges jemalloc's arenas instead. mimalloc and other C libraries: nothing.
pub struct MemoryTrim {
    pub(super) open: Arc<AtomicUsize>,
    pub(super) high: Arc<AtomicUsize>,
    /// `sluice_memory_trims_total`.
    pub(super) trims: IntCounter,
}

impl MemoryTrim {
    /// Whether enough connections closed since the last trim; if so, the count starts again
    /// from the connections open now.
    fn due(&self) -> bool {
        let open = self.open.load(Ordering::Relaxed);
        let high = self.high.load(Ordering::Relaxed);
        if high.saturating_sub(open) < TRIM_AFTER_CLOSED {
            return false;
        }
        // A connection taken in between may be forgotten: the next drop is then seen a little
        // smaller, no more.
        self.high.store(open, Ordering::Relaxed);
        true
    }
}

#[async_trait]
impl BackgroundService for MemoryTrim {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut every = tokio::time::interval(TRIM_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = shutdown.changed() => return,
            }
            if self.due()
                && cfg!(any(
                    all(target_os = "linux", target_env = "gnu"),
                    feature = "jemalloc"
                ))
            {
                // This service has its runtime thread to itself: blocking it blocks nobody.
                let trimmed = malloc_trim();
                self.trims.inc();
                tracing::debug!(target: "sluice::server", trimmed, "memory handed back after connections closed");
            }
        }
    }
}

/// With the `jemalloc` allocator: purges the unused dirty pages of every arena
/// (`arena.<MALLCTL_ARENAS_ALL>.purge`), which jemalloc's own decay only does when the process
/// allocates (docs/benchmarks.md). True if the purge ran.
#[cfg(feature = "jemalloc")]
fn malloc_trim() -> bool {
    // MALLCTL_ARENAS_ALL is 4096 in jemalloc 5.
    const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
    // SAFETY: a NUL-terminated name and no old or new value, as the purge command takes.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        ) == 0
    }
}

/// glibc's `malloc_trim(0)`: true if memory was handed back.
#[cfg(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc")))]
fn malloc_trim() -> bool {
    // SAFETY: malloc_trim takes no pointer and may be called at any time from any thread.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(any(all(target_os = "linux", target_env = "gnu"), feature = "jemalloc")))]
fn malloc_trim() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_is_due_only_after_a_large_drop_and_once_per_drop() {
        let trim = MemoryTrim {
            open: Arc::new(AtomicUsize::new(0)),
            high: Arc::new(AtomicUsize::new(0)),
            trims: IntCounter::new("t", "t").unwrap(),
        };
        let (open, high) = (trim.open.clone(), trim.high.clone());
        let set = |now: usize, peak: usize| {
            open.store(now, Ordering::Relaxed);
            high.fetch_max(peak, Ordering::Relaxed);
        };
        // A steady load, however large: no trim.
        set(5000, 5000);
        assert!(!trim.due());
        // A small drop: none either.
        set(5000 - TRIM_AFTER_CLOSED + 1, 5000);
        assert!(!trim.due());
        // A slow decline adds up.
        set(5000 - TRIM_AFTER_CLOSED, 5000);
        assert!(trim.due());
        assert!(!trim.due());
        // 5,000 came and went: one trim, then none until the count rises and falls again.
        set(0, 5000);
        assert!(trim.due());
        assert!(!trim.due());
        set(0, TRIM_AFTER_CLOSED);
        assert!(trim.due());
    }
}
