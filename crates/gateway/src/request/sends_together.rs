//! Letting the sends of one turn of the event loop leave together, when the loop is busy.
//!
//! A send to a peer that is asleep in `epoll_wait` (wrk, an nginx backend, a real client)
//! makes the kernel wake it, in the sender's own system call. On a VM, waking a task on another
//! CPU costs an inter-processor interrupt and a hypervisor exit, a good part of a request's CPU.
//! Sent one by one, nearly every request finds its peer asleep; sent together, one wake-up
//! serves several, and a saturated proxy thread spends markedly less CPU per request
//! (docs/benchmarks.md). HAProxy, which sends at the end of its loop's pass, does the same.
//!
//! The price is latency: a send that waits for the other ready requests waits for the time they
//! take to run. Below saturation there is little to batch and nothing to gain, while a request
//! that arrives in a burst still waits behind it: that wait was most of what sluice added to a
//! request's tail over an nginx proxy (`scripts/bench-dwell`). So each proxy thread decides
//! from how busy the runtime's workers have been lately: most of the time, and sends wait for
//! each other; half of it or less, and each goes at once. The store follows the same decision
//! (`sluice_store::load`): a call to Redis that waits for the end of the turn, or for the call
//! out before it, waits behind the same burst.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The thread looks at the load again after this many calls (about a third as many requests),
/// so that reading the clock and the runtime's counters costs nothing per request...
const LOOK_EVERY: u32 = 64;

/// ...and decides once a look finds at least this much time gone by since the last decision:
/// over a shorter span, the busy time tokio has published (at a park, or at a busy worker's
/// maintenance every 61 polls) is too coarse to read a share from.
const MIN_SPAN: Duration = Duration::from_millis(5);

/// If tokio has published no busy time since the last decision, the span is let grow, up to
/// this, before a decision reads it as idle: a saturated worker that never parks publishes only
/// at its maintenance.
const MAX_SPAN: Duration = Duration::from_millis(100);

/// Sends are batched from when the workers were busy (running tasks, as opposed to parked
/// waiting for events) more than this share of the span, in per mille, until a span in which
/// they were busy less than [`UNBATCHED_BELOW`]. A proxy well below its capacity is busy a
/// small share of the time, a saturated one nearly all of it; the gap between the two lines
/// keeps a load near one of them from switching at every span.
const BATCHED_ABOVE: u128 = 700;
const UNBATCHED_BELOW: u128 = 500;

struct Decision {
    /// Calls on this thread since the last look.
    calls: Cell<u32>,
    /// When the last decision was taken, and the workers' busy time then (average per
    /// worker). `None` until the first look.
    last: Cell<Option<(Instant, Duration)>>,
    /// Whether sends wait for each other until the next decision. Starts batched, as under
    /// load, until the first decision.
    together: Cell<bool>,
}

/// Proxy threads whose last decision was to batch, counted from each one's first look. The
/// store (`sluice_store::load`) holds one setting for the whole process: it is under load while
/// any thread is, so that threads deciding over different spans cannot leave it with whichever
/// flipped last.
static THREADS_BATCHING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static DECISION: Decision = const {
        Decision { calls: Cell::new(0), last: Cell::new(None), together: Cell::new(true) }
    };
}

/// Called right before a head is sent, to the member or to the client, and once the response
/// is sent, before the request's access line and metrics (so that the next request's send does
/// not wait behind them). On a busy thread the send waits until every other request ready on
/// this thread has run as far as it can (to its own send, or to its next wait), and then the
/// waiting sends go out one after another.
///
/// `yield_now` hands the task to the scheduler's deferred list, which is run after the ready
/// queue is empty or at the scheduler's maintenance (every 61 polls), so the wait is bounded by
/// one turn of the loop.
pub(super) async fn send_with_the_others() {
    if together() {
        tokio::task::yield_now().await;
    }
}

fn together() -> bool {
    DECISION.with(|d| {
        let calls = d.calls.get() + 1;
        if calls < LOOK_EVERY {
            d.calls.set(calls);
            return d.together.get();
        }
        d.calls.set(0);
        let Some(busy) = busy_per_worker() else {
            return d.together.get();
        };
        let now = Instant::now();
        let Some((then, busy_then)) = d.last.get() else {
            d.last.set(Some((now, busy)));
            if d.together.get() {
                THREADS_BATCHING.fetch_add(1, Ordering::Relaxed);
            }
            return d.together.get();
        };
        let span = now.saturating_duration_since(then);
        let worked = busy.saturating_sub(busy_then);
        if span < MIN_SPAN || (worked.is_zero() && span < MAX_SPAN) {
            return d.together.get();
        }
        d.last.set(Some((now, busy)));
        let share = worked.as_nanos() * 1000 / span.as_nanos().max(1);
        let was = d.together.get();
        if share > BATCHED_ABOVE {
            d.together.set(true);
        } else if share < UNBATCHED_BELOW {
            d.together.set(false);
        }
        match (was, d.together.get()) {
            (false, true) => {
                THREADS_BATCHING.fetch_add(1, Ordering::Relaxed);
            }
            (true, false) => {
                THREADS_BATCHING.fetch_sub(1, Ordering::Relaxed);
            }
            _ => {}
        }
        // The store trades latency for throughput on the same terms. Set at every decision,
        // not only at a flip, so that two threads flipping at once cannot leave it stale.
        sluice_store::load::under_load(THREADS_BATCHING.load(Ordering::Relaxed) > 0);
        d.together.get()
    })
}

/// How long, on average, each worker of the current runtime has spent running tasks (as
/// opposed to parked, waiting for events). Tokio publishes a worker's figure when it parks and
/// at its maintenance, every 61 polls however busy it is; a yield's non-blocking look at the
/// driver publishes nothing.
fn busy_per_worker() -> Option<Duration> {
    let metrics = tokio::runtime::Handle::try_current().ok()?.metrics();
    let workers = metrics.num_workers();
    let total: Duration = (0..workers)
        .map(|w| metrics.worker_total_busy_duration(w))
        .sum();
    Some(total / u32::try_from(workers.max(1)).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `calls` calls on the runtime's one worker, each after `between`, and returns the
    /// last decision.
    fn decide_after<F, Fut>(rt: &tokio::runtime::Runtime, calls: u32, between: F) -> bool
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        rt.block_on(async move {
            tokio::spawn(async move {
                let mut last = together();
                for _ in 1..calls {
                    between().await;
                    last = together();
                }
                last
            })
            .await
            .unwrap()
        })
    }

    fn spin(how_long: Duration) {
        let until = Instant::now() + how_long;
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }

    /// A worker that waits on a timer between short calls is mostly idle, so sends go at once;
    /// one that spins most of the time between calls batches, whether it parks between them
    /// (and so publishes its busy time each time) or never parks at all (and publishes only at
    /// its maintenance). Each phase starts from the decision the one before left.
    #[test]
    fn batches_only_while_the_workers_are_busy() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Each call waits on a timer (a millisecond or more); the call itself is short.
        let idle = || async { tokio::time::sleep(Duration::from_micros(50)).await };
        assert!(
            !decide_after(&rt, LOOK_EVERY * 3, idle),
            "a worker idle most of the time sends at once"
        );
        // Spins 8 ms, then waits on a timer (under a millisecond more): parks once per call.
        let busy_parking = || async {
            spin(Duration::from_millis(8));
            tokio::time::sleep(Duration::from_micros(1)).await;
        };
        assert!(
            decide_after(&rt, LOOK_EVERY * 2, busy_parking),
            "a worker busy most of the time batches its sends"
        );
        assert!(
            !decide_after(&rt, LOOK_EVERY * 3, idle),
            "idle again, at once again"
        );
        // Spins 1 ms and yields: the worker always has this task to run, so it never parks.
        let busy_never_parking = || async {
            spin(Duration::from_millis(1));
            tokio::task::yield_now().await;
        };
        assert!(
            decide_after(&rt, LOOK_EVERY * 4, busy_never_parking),
            "a worker that never parks batches its sends"
        );
    }
}
