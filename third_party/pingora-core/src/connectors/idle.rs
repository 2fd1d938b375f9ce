// PATCH (sluice: idle pool without a task per connection, third_party/PATCHES.md)

//! Idle upstream connections, kept without a watcher task each.
//!
//! pingora-pool parks every released connection behind a `Mutex`, a oneshot and an eviction
//! `Notify`, and spawns a task that watches it (a read, the idle timer, the eviction). Taking it
//! back means waking that task and waiting for it to let go of the lock. On a keep-alive proxy
//! that is a task spawn, a timer and two wake-ups for every request.
//!
//! Here a released connection is only stored. Whether it is still usable is asked without
//! waiting when it is taken, as before (`test_reusable_stream`: a read polled once, which sees
//! the close the reactor already recorded). One sweeper task per pool, alive while the pool
//! holds anything, closes every [`SWEEP`] the connections whose peer closed them or whose idle
//! timeout passed, so a closed connection's descriptor is not held longer than that.
//!
//! Connections are taken newest first per key (the one most likely still open, and the others
//! age out), and when the pool is full the oldest in the whole pool is closed, as pingora-pool's
//! LRU does.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How often the sweeper looks at idle connections.
pub(crate) const SWEEP: Duration = Duration::from_secs(1);

/// A pool of idle connections `S`, grouped by key (a peer's `reuse_hash`).
pub(crate) struct IdlePool<S> {
    inner: Mutex<Inner<S>>,
    size: usize,
}

struct Idle<S> {
    /// Release order, unique in the pool: what the eviction order refers to.
    seq: u64,
    since: Instant,
    timeout: Option<Duration>,
    stream: S,
}

impl<S> Idle<S> {
    fn expired(&self, now: Instant) -> bool {
        self.timeout
            .is_some_and(|t| now.saturating_duration_since(self.since) >= t)
    }
}

struct Inner<S> {
    /// Per key, oldest first (ascending `seq`).
    keys: HashMap<u64, VecDeque<Idle<S>>>,
    /// `(seq, key)` in release order. An entry whose connection was taken or swept stays until
    /// it reaches the front or the queue is compacted: a take does not search this queue.
    order: VecDeque<(u64, u64)>,
    count: usize,
    next_seq: u64,
    sweeping: bool,
}

/// A connection that left the pool without being taken: how long it was idle, for the
/// connector's keep-alive callback. Dropping it closes the connection.
pub(crate) struct Closed<S> {
    pub(crate) idle: Duration,
    pub(crate) stream: S,
}

impl<S> Inner<S> {
    /// Closes the oldest connection in the pool.
    fn evict_oldest(&mut self) -> Option<Idle<S>> {
        while let Some((seq, key)) = self.order.pop_front() {
            let Some(idle) = self.keys.get_mut(&key) else {
                continue;
            };
            // Every older connection of this key had its entry earlier in `order`, and was
            // evicted or found gone then, so a live `seq` is at the front of its key.
            if idle.front().is_some_and(|c| c.seq == seq) {
                let oldest = idle.pop_front();
                if idle.is_empty() {
                    self.keys.remove(&key);
                }
                self.count -= 1;
                return oldest;
            }
        }
        None
    }

    /// Drops the entries of `order` whose connection is gone, once they outnumber the live
    /// ones, so that the queue stays within about twice the pool's size whatever the traffic.
    fn compact(&mut self) {
        if self.order.len() <= 2 * self.count + 32 {
            return;
        }
        let keys = &self.keys;
        self.order.retain(|(seq, key)| {
            keys.get(key)
                .is_some_and(|idle| idle.binary_search_by_key(seq, |c| c.seq).is_ok())
        });
    }
}

impl<S: Send + 'static> IdlePool<S> {
    /// A pool that holds at most `size` connections.
    pub(crate) fn new(size: usize) -> Self {
        IdlePool {
            inner: Mutex::new(Inner {
                keys: HashMap::new(),
                order: VecDeque::new(),
                count: 0,
                next_seq: 0,
                sweeping: false,
            }),
            size,
        }
    }

    /// Number of connections held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().count
    }

    /// Keeps `stream` under `key`. Returns the connection evicted to make room, if any, which
    /// the caller drops outside the lock, and whether a sweeper must be started
    /// ([`IdlePool::sweep`]); the pool starts none itself so that it does not depend on a
    /// runtime.
    #[must_use]
    pub(crate) fn put(
        &self,
        key: u64,
        stream: S,
        timeout: Option<Duration>,
    ) -> (Option<Closed<S>>, bool) {
        let now = Instant::now();
        if self.size == 0 {
            return (
                Some(Closed {
                    idle: Duration::ZERO,
                    stream,
                }),
                false,
            );
        }
        let mut inner = self.inner.lock();
        let evicted = if inner.count >= self.size {
            inner.evict_oldest()
        } else {
            None
        };
        let seq = inner.next_seq;
        inner.next_seq += 1;
        inner.keys.entry(key).or_default().push_back(Idle {
            seq,
            since: now,
            timeout,
            stream,
        });
        inner.order.push_back((seq, key));
        inner.count += 1;
        inner.compact();
        let start_sweeper = !inner.sweeping;
        inner.sweeping = true;
        drop(inner);
        let evicted = evicted.map(|c| Closed {
            idle: now.saturating_duration_since(c.since),
            stream: c.stream,
        });
        (evicted, start_sweeper)
    }

    /// The newest connection kept under `key` whose idle timeout has not passed. Expired ones
    /// met on the way are closed.
    pub(crate) fn take(&self, key: u64) -> Option<S> {
        let mut inner = self.inner.lock();
        let idle = inner.keys.get_mut(&key)?;
        let newest = idle.pop_back();
        if idle.is_empty() {
            inner.keys.remove(&key);
        }
        let newest = newest?;
        inner.count -= 1;
        drop(inner);
        if newest.expired(Instant::now()) {
            // The rest of this key is older still: the sweeper closes them.
            return None;
        }
        Some(newest.stream)
    }

    /// Removes the connections whose idle timeout passed or that `usable` rejects (polled
    /// without waiting, under the pool's lock: a readiness check each, with a system call only
    /// for a connection the reactor saw something on; at most `size` of them once a second).
    /// Returns them, to be dropped outside the lock, and whether the sweeper should go on: it
    /// stops once the pool is empty, and the next [`IdlePool::put`] asks for a new one.
    pub(crate) fn sweep(&self, mut usable: impl FnMut(&mut S) -> bool) -> (Vec<Closed<S>>, bool) {
        let now = Instant::now();
        let mut closed = Vec::new();
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        for idle in inner.keys.values_mut() {
            for mut c in std::mem::take(idle) {
                if !c.expired(now) && usable(&mut c.stream) {
                    idle.push_back(c);
                } else {
                    closed.push(Closed {
                        idle: now.saturating_duration_since(c.since),
                        stream: c.stream,
                    });
                }
            }
        }
        inner.keys.retain(|_, idle| !idle.is_empty());
        inner.count -= closed.len();
        inner.compact();
        let go_on = inner.count > 0;
        inner.sweeping = go_on;
        (closed, go_on)
    }
}

/// Starts the sweeper of `pool` on the current runtime. It holds the pool weakly, and clears
/// `sweeping` if its runtime drops it, so that a later `put` starts another.
pub(crate) fn spawn_sweeper<S: Send + 'static>(
    pool: &Arc<IdlePool<S>>,
    mut usable: impl FnMut(&mut S) -> bool + Send + 'static,
) {
    struct Running<S>(Weak<IdlePool<S>>, bool);
    impl<S> Running<S> {
        /// The sweeper stops on its own: `sweep` or the pool's drop already saw to `sweeping`.
        fn disarm(&mut self) {
            self.1 = false;
        }
    }
    impl<S> Drop for Running<S> {
        fn drop(&mut self) {
            if self.1 {
                if let Some(pool) = self.0.upgrade() {
                    pool.inner.lock().sweeping = false;
                }
            }
        }
    }
    if tokio::runtime::Handle::try_current().is_err() {
        // No runtime to run on: leave it to a later release, rather than panic here with the
        // flag set and the pool never swept.
        pool.inner.lock().sweeping = false;
        return;
    }
    let mut running = Running(Arc::downgrade(pool), true);
    pingora_runtime::current_handle().spawn(async move {
        loop {
            pingora_timeout::sleep(SWEEP).await;
            let Some(pool) = running.0.upgrade() else {
                running.disarm();
                return;
            };
            let (closed, go_on) = pool.sweep(&mut usable);
            drop(pool);
            if !go_on {
                // Before the drops below: from here on a new sweeper may own the flag.
                running.disarm();
            }
            drop(closed);
            if !go_on {
                return;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(size: usize) -> IdlePool<u32> {
        IdlePool::new(size)
    }

    #[test]
    fn takes_the_newest_of_its_key() {
        let p = pool(8);
        for (key, conn) in [(1, 10), (2, 20), (1, 11), (1, 12)] {
            assert!(p.put(key, conn, None).0.is_none());
        }
        assert_eq!(p.take(1), Some(12));
        assert_eq!(p.take(1), Some(11));
        assert_eq!(p.take(1), Some(10));
        assert_eq!(p.take(1), None);
        assert_eq!(p.take(2), Some(20));
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn a_full_pool_closes_its_oldest_connection() {
        let p = pool(3);
        let _ = p.put(1, 10, None);
        let _ = p.put(2, 20, None);
        let _ = p.put(1, 11, None);
        assert_eq!(p.put(3, 30, None).0.map(|c| c.stream), Some(10));
        // 20 is the oldest now; once it is taken, 11 is.
        assert_eq!(p.take(2), Some(20));
        let _ = p.put(3, 31, None);
        assert_eq!(p.put(3, 32, None).0.map(|c| c.stream), Some(11));
        assert_eq!(p.len(), 3);
        let none: IdlePool<u32> = pool(0);
        assert_eq!(none.put(1, 1, None).0.map(|c| c.stream), Some(1));
        assert_eq!(none.take(1), None);
    }

    #[test]
    fn expired_connections_are_not_taken_and_are_swept() {
        let p = pool(8);
        let _ = p.put(1, 10, Some(Duration::ZERO));
        let _ = p.put(1, 11, Some(Duration::from_secs(3600)));
        let _ = p.put(2, 20, Some(Duration::ZERO));
        assert_eq!(p.take(2), None);
        let (closed, go_on) = p.sweep(|_| true);
        assert_eq!(closed.iter().map(|c| c.stream).collect::<Vec<_>>(), [10]);
        assert!(go_on);
        assert_eq!(p.take(1), Some(11));
    }

    #[test]
    fn the_sweep_closes_what_is_unusable_and_stops_when_empty() {
        let p = pool(8);
        let (_, start) = p.put(1, 10, None);
        assert!(start, "the first connection asks for a sweeper");
        let (_, start) = p.put(1, 11, None);
        assert!(!start, "one sweeper at a time");
        let (closed, go_on) = p.sweep(|c| *c != 10);
        assert_eq!(closed.iter().map(|c| c.stream).collect::<Vec<_>>(), [10]);
        assert!(go_on);
        let (closed, go_on) = p.sweep(|_| false);
        assert_eq!(closed.len(), 1);
        assert!(!go_on);
        let (_, start) = p.put(1, 12, None);
        assert!(start, "a new sweeper once the last one stopped");
    }

    /// Against a model that keeps every connection in release order: random puts, takes and
    /// sweeps evict and take the same connections, and the order queue stays bounded.
    #[test]
    fn matches_a_model_in_release_order() {
        let size = 16;
        let p = pool(size);
        let mut model: Vec<(u64, u32)> = Vec::new(); // (key, conn), oldest first
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for conn in 0..20_000u32 {
            let r = next();
            let key = r % 5;
            match (r >> 8) % 8 {
                0..=3 => {
                    let evicted = p.put(key, conn, None).0.map(|c| c.stream);
                    let expected = (model.len() >= size).then(|| model.remove(0).1);
                    model.push((key, conn));
                    assert_eq!(evicted, expected);
                }
                4..=6 => {
                    let expected = model
                        .iter()
                        .rposition(|(k, _)| *k == key)
                        .map(|i| model.remove(i).1);
                    assert_eq!(p.take(key), expected);
                }
                _ => {
                    let odd = r >> 16 & 1 == 1;
                    let (closed, _) = p.sweep(|c| (*c % 7 == 0) != odd);
                    let mut closed: Vec<u32> = closed.into_iter().map(|c| c.stream).collect();
                    closed.sort_unstable();
                    let mut expected: Vec<u32> = Vec::new();
                    model.retain(|(_, c)| {
                        let keep = (*c % 7 == 0) != odd;
                        if !keep {
                            expected.push(*c);
                        }
                        keep
                    });
                    expected.sort_unstable();
                    assert_eq!(closed, expected);
                }
            }
            let inner = p.inner.lock();
            assert_eq!(inner.count, model.len());
            // Takes leave their entries; puts compact: bounded by the size, not the traffic.
            assert!(inner.order.len() <= 2 * size + 33);
        }
    }

    /// A sweeper whose runtime shuts down gives the flag back, so that the next release starts
    /// another; with no runtime at all, none is started and the flag is not left set.
    #[test]
    fn a_sweeper_dropped_with_its_runtime_lets_the_next_release_start_one() {
        let p = Arc::new(pool(8));
        let (_, start) = p.put(1, 10, None);
        assert!(start);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async { spawn_sweeper(&p, |_: &mut u32| true) });
        assert!(p.inner.lock().sweeping);
        drop(rt);
        assert!(
            !p.inner.lock().sweeping,
            "the dropped task cleared the flag"
        );
        let (_, start) = p.put(1, 11, None);
        assert!(start, "the next release asks for a sweeper");
        spawn_sweeper(&p, |_: &mut u32| true);
        assert!(
            !p.inner.lock().sweeping,
            "no runtime: no sweeper, and the flag is clear"
        );
    }

    #[tokio::test]
    async fn the_sweeper_task_empties_the_pool() {
        let p = Arc::new(pool(8));
        let (_, start) = p.put(1, 10, None);
        assert!(start);
        spawn_sweeper(&p, |c: &mut u32| *c != 10);
        tokio::time::timeout(Duration::from_secs(30), async {
            while p.len() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the sweeper closed the unusable connection");
        assert!(!p.inner.lock().sweeping);
    }
}
