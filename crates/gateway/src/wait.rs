//! Waiting for capacity instead of a 429 (SPEC §8, `quota.max_wait`).
//!
//! A request that the route's quota, every member's quota or every member's cooldown refuses
//! may wait up to `max_wait` for capacity. Three rules shape how:
//!
//! - **Arrival order, per instance.** The waiters of a route stand in one line: a fair
//!   (first-in, first-out) async mutex. Only the head of the line asks the store again; the
//!   others wait for their turn. A request that arrives while anyone waits joins the end of
//!   the line rather than asking the store first, or a steady stream of newcomers could take
//!   every freed unit from the waiters.
//! - **Wake-ups from the store's own answer, not polling.** A refusal carries the exact time
//!   until the request's cost fits (`retry_after_us`), computed by the store for every window
//!   and member. The head sleeps exactly that long and asks again. Another instance may take
//!   the capacity first; the head then gets a new exact time and sleeps again. A wait that
//!   would end past the deadline is not started: the request is refused at once, with the
//!   exact `Retry-After`.
//! - **A bound.** At most `max_waiting` requests wait per route and instance; past it a
//!   request that is refused is answered at once. Each waiter holds a connection and a task,
//!   and an unbounded line would let a burst hold them all.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, MutexGuard};
use tokio::time::Instant;

/// The waiting line of one route.
#[derive(Debug)]
pub struct WaitLine {
    /// Held by the head of the line while it waits and asks the store; tokio's mutex is fair,
    /// so the others get it in the order they asked.
    head: Mutex<()>,
    /// Requests in the line, the head included.
    waiting: AtomicUsize,
    /// `quota.max_wait`.
    pub max_wait: Duration,
    /// `quota.max_waiting`.
    pub max_waiting: usize,
}

/// A place in the line; leaving it (by drop) makes room for another.
pub struct Place<'a> {
    line: &'a WaitLine,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.line.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

impl WaitLine {
    /// A line for a route with this `max_wait` (non-zero) and `max_waiting`.
    pub fn new(max_wait: Duration, max_waiting: usize) -> WaitLine {
        WaitLine {
            head: Mutex::new(()),
            waiting: AtomicUsize::new(0),
            max_wait,
            max_waiting,
        }
    }

    /// Whether nobody waits: a newcomer may then ask the store directly.
    pub fn is_empty(&self) -> bool {
        self.waiting.load(Ordering::Acquire) == 0
    }

    /// How many wait now (for tests and status).
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// A place at the end of the line, or `None` when it is full.
    pub fn join(&self) -> Option<Place<'_>> {
        let taken = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_waiting).then_some(n + 1)
            });
        taken.ok().map(|_| Place { line: self })
    }

    /// Waits for the head of the line until `deadline`; `None` when the deadline came first.
    pub async fn head(&self, deadline: Instant) -> Option<MutexGuard<'_, ()>> {
        tokio::time::timeout_at(deadline, self.head.lock())
            .await
            .ok()
    }
}

/// When the head should ask again after a refusal that fits in `retry_after`, or `None` when
/// that is past `deadline` (waiting would only delay the same refusal).
pub fn wake_at(now: Instant, retry_after: Duration, deadline: Instant) -> Option<Instant> {
    // A refusal that says "now" (a member freed in the same microsecond) still yields, so
    // that a head that keeps losing races cannot spin.
    let wake = now + retry_after.max(Duration::from_millis(1));
    (wake <= deadline).then_some(wake)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_is_bounded_and_places_are_given_back() {
        let line = WaitLine::new(Duration::from_secs(1), 2);
        assert!(line.is_empty());
        let a = line.join().expect("room");
        let b = line.join().expect("room");
        assert!(line.join().is_none(), "max_waiting is 2");
        drop(a);
        assert_eq!(line.len(), 1);
        let _c = line.join().expect("a place was given back");
        drop(b);
        assert!(!line.is_empty());
    }

    #[tokio::test]
    async fn the_head_is_taken_in_arrival_order() {
        let line = std::sync::Arc::new(WaitLine::new(Duration::from_secs(10), 10));
        let first = line
            .head(Instant::now() + Duration::from_secs(1))
            .await
            .unwrap();
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (line, order) = (line.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _head = line
                    .head(Instant::now() + Duration::from_secs(60))
                    .await
                    .unwrap();
                order.lock().unwrap().push(i);
            }));
            // Each task is queued on the mutex before the next one starts.
            tokio::task::yield_now().await;
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
    }

    #[tokio::test]
    async fn a_waiter_past_its_deadline_gives_up() {
        let line = WaitLine::new(Duration::from_secs(1), 10);
        let _held = line
            .head(Instant::now() + Duration::from_secs(1))
            .await
            .unwrap();
        assert!(line
            .head(Instant::now() + Duration::from_millis(10))
            .await
            .is_none());
    }

    #[test]
    fn wake_ups_past_the_deadline_are_not_started() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(2);
        assert_eq!(
            wake_at(now, Duration::from_millis(1500), deadline),
            Some(now + Duration::from_millis(1500))
        );
        assert_eq!(wake_at(now, Duration::from_secs(3), deadline), None);
        assert_eq!(
            wake_at(now, Duration::ZERO, deadline),
            Some(now + Duration::from_millis(1))
        );
    }
}
