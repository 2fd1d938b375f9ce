//! Sliding-window quota logs in process: the same logs as the Redis script keeps, on a
//! monotonic clock. Part of [`crate::MemoryStore`].

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::{Acquire, Outcome, StoreError, WindowState};

/// Independent shards, so that requests for different keys rarely meet on a lock.
const SHARDS: usize = 64;

/// The most quota keys one route may hold in memory by default, over all shards
/// ([`crate::MemoryLimits::max_keys`]). A client that chooses its key (`key: header:X-Tenant`)
/// could otherwise grow the store without bound. Past it, keys whose entries have all left
/// their windows are dropped first; if the route is still full, a request with a new key is
/// refused ([`StoreError::TooManyKeys`]). Forgetting a key that still holds admitted requests
/// would let its owner in again, and admitting the new key without a log would leave it
/// unmetered: both would lift the quota.
pub const MAX_KEYS_PER_ROUTE: usize = 100_000;

/// Once in this many calls, one shard (in turn) drops its idle keys. Every shard is swept once
/// per `SWEEP_EVERY × SHARDS` calls, whichever keys the traffic hits, which bounds the memory held
/// by keys nobody uses any more.
const SWEEP_EVERY: u64 = 256;

/// One admitted request, as remembered by each window's log.
#[derive(Debug, Clone, Copy)]
struct Entry {
    at_us: u64,
    cost: u64,
}

#[derive(Debug, Default)]
struct Log {
    entries: VecDeque<Entry>,
    total: u64,
}

impl Log {
    fn expire(&mut self, now_us: u64, length_us: u64) {
        while let Some(e) = self.entries.front() {
            if e.at_us + length_us > now_us {
                break;
            }
            self.total -= e.cost;
            self.entries.pop_front();
        }
    }

    /// Microseconds until `need` units have left the window.
    fn wait_for(&self, need: u64, now_us: u64, length_us: u64) -> u64 {
        let mut freed = 0;
        for e in &self.entries {
            freed += e.cost;
            if freed >= need {
                return (e.at_us + length_us).saturating_sub(now_us);
            }
        }
        length_us
    }
}

/// The logs of one quota key: one per window, by window name.
#[derive(Debug, Default)]
struct KeyState {
    logs: Vec<(Arc<str>, Log)>,
    last_us: u64,
    longest_us: u64,
}

#[derive(Debug, Default)]
struct Shard {
    /// route → quota key → state; two levels so that lookups borrow `&str` and never allocate.
    routes: HashMap<Arc<str>, HashMap<Box<str>, KeyState>>,
}

/// Every quota log of one gateway instance.
#[derive(Debug)]
pub(crate) struct QuotaLogs {
    shards: Box<[Mutex<Shard>]>,
    epoch: Instant,
    calls: AtomicU64,
    /// The most keys one route may hold in one shard: the route's bound, spread evenly over
    /// the shards as the keys' hashes spread them.
    max_keys_per_shard: usize,
}

impl Default for QuotaLogs {
    fn default() -> Self {
        QuotaLogs::new()
    }
}

impl QuotaLogs {
    /// No logs yet, with the default bounds.
    pub(crate) fn new() -> QuotaLogs {
        QuotaLogs::with_limits(&crate::MemoryLimits::default())
    }

    /// No logs yet, with these bounds.
    pub(crate) fn with_limits(limits: &crate::MemoryLimits) -> QuotaLogs {
        QuotaLogs {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            epoch: Instant::now(),
            calls: AtomicU64::new(0),
            max_keys_per_shard: limits.max_keys.max(1).div_ceil(SHARDS),
        }
    }

    /// Number of quota keys held, across all routes (for tests and status).
    pub(crate) fn keys(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap_or_else(|p| p.into_inner());
                s.routes.values().map(HashMap::len).sum::<usize>()
            })
            .sum()
    }

    /// The store's clock: microseconds since these logs were made, monotonic.
    pub(crate) fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    fn shard(&self, route: &str, key: &str) -> &Mutex<Shard> {
        let mut h = DefaultHasher::new();
        route.hash(&mut h);
        key.hash(&mut h);
        &self.shards[(h.finish() as usize) % self.shards.len()]
    }

    /// Decides on one request and records it if admitted.
    pub(crate) fn decide(&self, req: Acquire<'_>) -> Result<Outcome, StoreError> {
        // A cost of 0 only reads the windows (see `Acquire::cost`).
        self.decide_then(req, || (req.cost > 0).then_some(()))
            .map(|(outcome, _)| outcome)
    }

    /// Decides on one request; when every window admits it, asks `then` (under the key's lock,
    /// so nothing can slip in between) and records the request only if `then` returns `Some`.
    /// This is how a least-used assignment and its quota become one atomic step: the quota is
    /// never charged for a request that found no member, and never left uncharged for one
    /// that did.
    pub(crate) fn decide_then<T>(
        &self,
        req: Acquire<'_>,
        then: impl FnOnce() -> Option<T>,
    ) -> Result<(Outcome, Option<T>), StoreError> {
        let now = req.at_us.unwrap_or_else(|| self.now_us());
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        if call % SWEEP_EVERY == SWEEP_EVERY - 1 {
            let turn = (call / SWEEP_EVERY) as usize % self.shards.len();
            sweep(
                &mut self.shards[turn].lock().unwrap_or_else(|p| p.into_inner()),
                now,
            );
        }
        let mut shard = self
            .shard(req.route, req.key)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let keys = match shard.routes.get_mut(req.route) {
            Some(keys) => keys,
            None => shard.routes.entry(req.route.into()).or_default(),
        };
        if !keys.contains_key(req.key) && keys.len() >= self.max_keys_per_shard {
            keys.retain(|_, s| s.last_us + s.longest_us > now);
            if keys.len() >= self.max_keys_per_shard {
                return Err(StoreError::TooManyKeys);
            }
        }
        let state = match keys.get_mut(req.key) {
            Some(state) => state,
            None => keys.entry(req.key.into()).or_default(),
        };
        Ok(decide(state, &req, now, then))
    }
}

fn decide<T>(
    state: &mut KeyState,
    req: &Acquire<'_>,
    now: u64,
    then: impl FnOnce() -> Option<T>,
) -> (Outcome, Option<T>) {
    state.last_us = now;
    state.longest_us = req.windows.iter().map(|w| w.length_us).max().unwrap_or(0);
    // Windows are few; a linear search by name keeps state across config reloads that
    // reorder, add or remove windows.
    for w in req.windows {
        if !state.logs.iter().any(|(name, _)| *name == w.name) {
            state.logs.push((w.name.clone(), Log::default()));
        }
    }
    state
        .logs
        .retain(|(name, _)| req.windows.iter().any(|w| w.name == *name));

    let mut admitted = true;
    let mut retry_after_us = 0;
    let mut windows = Vec::with_capacity(req.windows.len());
    for w in req.windows {
        let log = &mut state
            .logs
            .iter_mut()
            .find(|(name, _)| *name == w.name)
            .expect("added above")
            .1;
        log.expire(now, w.length_us);
        if log.total + req.cost > w.limit {
            admitted = false;
            let wait = if req.cost > w.limit {
                w.length_us
            } else {
                log.wait_for(log.total + req.cost - w.limit, now, w.length_us)
            };
            retry_after_us = retry_after_us.max(wait);
        }
    }
    let taken = if admitted { then() } else { None };
    let record = taken.is_some();
    for w in req.windows {
        let log = &mut state
            .logs
            .iter_mut()
            .find(|(name, _)| *name == w.name)
            .expect("added above")
            .1;
        if record {
            log.entries.push_back(Entry {
                at_us: now,
                cost: req.cost,
            });
            log.total += req.cost;
        }
        windows.push(WindowState {
            remaining: w.limit.saturating_sub(log.total),
            reset_us: log
                .entries
                .front()
                .map_or(0, |e| (e.at_us + w.length_us).saturating_sub(now)),
        });
    }
    let outcome = Outcome {
        admitted,
        retry_after_us,
        windows,
    };
    (outcome, taken)
}

/// Drops keys whose every entry has left its window.
fn sweep(shard: &mut Shard, now: u64) {
    for keys in shard.routes.values_mut() {
        keys.retain(|_, s| s.last_us + s.longest_us > now);
    }
    shard.routes.retain(|_, keys| !keys.is_empty());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Window;

    fn windows() -> Vec<Window> {
        vec![Window {
            name: "w".into(),
            limit: 10,
            length_us: 1_000,
        }]
    }

    /// What makes a least-used assignment and its quota one step: `then` runs while the key's
    /// lock is held, so no other decision on the key can come between the check and the record.
    #[test]
    fn then_runs_under_the_key_lock() {
        let logs = QuotaLogs::new();
        let w = windows();
        let req = Acquire {
            route: "r",
            key: "k",
            windows: &w,
            cost: 1,
            at_us: Some(0),
        };
        let (outcome, held) = logs
            .decide_then(req, || Some(logs.shard("r", "k").try_lock().is_err()))
            .unwrap();
        assert!(outcome.admitted);
        assert_eq!(
            held,
            Some(true),
            "the key's shard is locked while `then` runs"
        );
        // A refused `then` records nothing.
        let (_, none) = logs.decide_then(req, || None::<()>).unwrap();
        assert_eq!(none, None);
        assert_eq!(
            logs.decide(req).unwrap().windows[0].remaining,
            8,
            "two recorded, not three"
        );
    }

    #[test]
    fn a_route_holds_a_bounded_number_of_keys() {
        let store = QuotaLogs::new();
        let w = windows();
        fn ask<'a>(w: &'a [Window], key: &'a str, at_us: u64) -> Acquire<'a> {
            Acquire {
                route: "r",
                key,
                windows: w,
                cost: 1,
                at_us: Some(at_us),
            }
        }
        let mut refused = 0;
        for i in 0..(MAX_KEYS_PER_ROUTE + 5_000) {
            match store.decide(ask(&w, &format!("k{i}"), 0)) {
                Ok(o) => assert!(o.admitted),
                Err(StoreError::TooManyKeys) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(refused > 0, "nothing refused");
        assert!(store.keys() <= MAX_KEYS_PER_ROUTE.div_ceil(SHARDS) * SHARDS);
        // Other routes are not affected, and a key already held still answers.
        assert!(store
            .decide(Acquire {
                route: "other",
                ..ask(&w, "k1", 0)
            })
            .is_ok());
        assert!(store.decide(ask(&w, "k1", 0)).is_ok());
        // Once the entries have left their windows, new keys take the idle ones' place.
        assert!(store.decide(ask(&w, "fresh", 10_000)).is_ok());
    }

    #[test]
    fn idle_keys_are_swept() {
        let store = QuotaLogs::new();
        let w = windows();
        for i in 0..100 {
            let key = format!("k{i}");
            let _ = store.decide(Acquire {
                route: "r",
                key: &key,
                windows: &w,
                cost: 1,
                at_us: Some(0),
            });
        }
        assert_eq!(store.keys(), 100);
        // Calls on one key, long after the window, make every shard sweep in turn.
        for _ in 0..(SWEEP_EVERY * SHARDS as u64) {
            let _ = store.decide(Acquire {
                route: "r",
                key: "k0",
                windows: &w,
                cost: 1,
                at_us: Some(5_000),
            });
        }
        assert!(store.keys() <= 1, "idle keys remain: {}", store.keys());
    }
}
