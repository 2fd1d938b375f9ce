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
//! from how busy the runtime's workers have been lately: past half their time, sends wait for
//! each other; below it, each goes at once.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// The decision is taken again after this many calls on a thread (about a third as many
/// requests): often enough to follow a change of load within milliseconds, rarely enough that
/// reading the clock and the runtime's counters costs nothing per request.
const DECIDE_EVERY: u32 = 64;

/// Batched when the workers were busy (running tasks, not asleep waiting for events) more than
/// this share of the time since the last decision, in per mille. A proxy well below its
/// capacity is busy a small share of the time, a saturated one nearly all of it.
const BUSY_PER_MILLE: u128 = 500;

struct Decision {
    /// Calls on this thread since the last decision.
    calls: Cell<u32>,
    /// When the last decision was taken, and the workers' busy time then (average per
    /// worker). `None` until the first.
    last: Cell<Option<(Instant, Duration)>>,
    /// Whether sends wait for each other until the next decision. Starts batched, as under
    /// load, until the first decision.
    together: Cell<bool>,
}

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
        if calls < DECIDE_EVERY {
            d.calls.set(calls);
            return d.together.get();
        }
        d.calls.set(0);
        let Some(busy) = busy_per_worker() else {
            return d.together.get();
        };
        let now = Instant::now();
        let Some((then, busy_then)) = d.last.replace(Some((now, busy))) else {
            return d.together.get();
        };
        let wall = now.saturating_duration_since(then).as_nanos();
        let worked = busy.saturating_sub(busy_then).as_nanos();
        let together = worked * 1000 > wall * BUSY_PER_MILLE;
        d.together.set(together);
        together
    })
}

/// How long, on average, each worker of the current runtime has spent running tasks (as
/// opposed to parked, waiting for events). Tokio publishes it when a worker parks, which a
/// saturated worker still does once its ready tasks run out.
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

    /// A runtime whose worker waits on a timer between short calls is mostly idle, so sends go
    /// at once; one whose worker spins most of the time between calls batches.
    #[test]
    fn batches_only_while_the_workers_are_busy() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Idle: every call waits on a timer (at least a millisecond), the call itself is short.
        let idle = rt.block_on(async {
            tokio::spawn(async {
                let mut last = true;
                for _ in 0..DECIDE_EVERY * 3 {
                    tokio::time::sleep(std::time::Duration::from_micros(50)).await;
                    last = together();
                }
                last
            })
            .await
            .unwrap()
        });
        assert!(!idle, "a loop idle most of the time sends at once");
        // Busy: the task spins for 8 ms between calls and then waits on a timer for 1 ms or
        // a little more, so the worker is busy most of the time, and parks (which publishes
        // its busy time) once per call.
        let busy = rt.block_on(async {
            tokio::spawn(async {
                let mut last = false;
                for _ in 0..DECIDE_EVERY * 2 {
                    let until = Instant::now() + Duration::from_millis(8);
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                    tokio::time::sleep(Duration::from_micros(1)).await;
                    last = together();
                }
                last
            })
            .await
            .unwrap()
        });
        assert!(busy, "a loop busy most of the time batches its sends");
    }
}
