//! The in-process store: the same sliding logs as the Redis script, on a monotonic clock.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;

use crate::{Acquire, Outcome, QuotaStore, StoreError, WindowState};

/// Independent shards, so that requests for different keys rarely meet on a lock.
const SHARDS: usize = 64;

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

/// Quotas for a single gateway instance.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    epoch: Instant,
    calls: AtomicU64,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            epoch: Instant::now(),
            calls: AtomicU64::new(0),
        }
    }

    /// Number of quota keys held, across all routes (for tests and status).
    pub fn keys(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap_or_else(|p| p.into_inner());
                s.routes.values().map(HashMap::len).sum::<usize>()
            })
            .sum()
    }

    fn shard(&self, route: &str, key: &str) -> &Mutex<Shard> {
        let mut h = DefaultHasher::new();
        route.hash(&mut h);
        key.hash(&mut h);
        &self.shards[(h.finish() as usize) % self.shards.len()]
    }

    /// The decision, synchronously: the memory store never waits on anything but its lock.
    pub fn decide(&self, req: Acquire<'_>) -> Outcome {
        self.decide_with(req, true)
    }

    /// The decision; with `record: false` an admissible request is reported but not recorded,
    /// for callers that still have to find it a member.
    pub fn decide_with(&self, req: Acquire<'_>, record: bool) -> Outcome {
        let now = req
            .at_us
            .unwrap_or_else(|| self.epoch.elapsed().as_micros() as u64);
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
        let state = match keys.get_mut(req.key) {
            Some(state) => state,
            None => keys.entry(req.key.into()).or_default(),
        };
        decide(state, &req, now, record)
    }
}

fn decide(state: &mut KeyState, req: &Acquire<'_>, now: u64, record: bool) -> Outcome {
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
    for w in req.windows {
        let log = &mut state
            .logs
            .iter_mut()
            .find(|(name, _)| *name == w.name)
            .expect("added above")
            .1;
        if admitted && record {
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
    Outcome {
        admitted,
        retry_after_us,
        windows,
    }
}

/// Drops keys whose every entry has left its window.
fn sweep(shard: &mut Shard, now: u64) {
    for keys in shard.routes.values_mut() {
        keys.retain(|_, s| s.last_us + s.longest_us > now);
    }
    shard.routes.retain(|_, keys| !keys.is_empty());
}

#[async_trait]
impl QuotaStore for MemoryStore {
    async fn acquire(&self, request: Acquire<'_>) -> Result<Outcome, StoreError> {
        Ok(self.decide(request))
    }
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

    #[test]
    fn idle_keys_are_swept() {
        let store = MemoryStore::new();
        let w = windows();
        for i in 0..100 {
            let key = format!("k{i}");
            store.decide(Acquire {
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
            store.decide(Acquire {
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
