//! Leases in process: the requests in flight on each member of a route, for a single instance.
//! The same rules as `lua/leases.lua`. Part of [`crate::MemoryStore`], under the route's lock.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// One route's leases. Every lease is held by a live request (or, until its expiry, one that
/// ended without a release reaching the store), so the table is bounded by the requests in
/// flight.
#[derive(Debug, Default)]
pub(crate) struct Leases {
    /// Lease id → its member and expiry (µs).
    by_id: HashMap<Box<str>, (Arc<str>, u64)>,
    /// (expiry, lease id), soonest first.
    expiries: BTreeSet<(u64, Box<str>)>,
    /// Member id → its leases; members with none are absent.
    counts: HashMap<Arc<str>, u64>,
}

impl Leases {
    /// Drops the leases whose expiry is not after `now`, at most
    /// [`crate::LEASES_EXPIRED_PER_CALL`] of them, as the scripts do (`leases_open`): the rest
    /// go in later calls and count meanwhile, so that both stores count the same leases.
    pub(crate) fn expire(&mut self, now: u64) {
        for _ in 0..crate::LEASES_EXPIRED_PER_CALL {
            match self.expiries.first() {
                Some(first) if first.0 <= now => {}
                _ => break,
            }
            if let Some((_, id)) = self.expiries.pop_first() {
                self.forget(&id);
            }
        }
    }

    /// Leases on `member`.
    pub(crate) fn count(&self, member: &str) -> u64 {
        self.counts.get(member).copied().unwrap_or(0)
    }

    /// Leases on the whole route.
    pub(crate) fn total(&self) -> u64 {
        self.by_id.len() as u64
    }

    /// Takes lease `id` on `member` until `expiry`. An id already held (never, with unique
    /// ids) is replaced, so the counts stay exact.
    pub(crate) fn take(&mut self, id: &str, member: &Arc<str>, expiry: u64) {
        self.release(id);
        self.by_id.insert(id.into(), (member.clone(), expiry));
        self.expiries.insert((expiry, id.into()));
        *self.counts.entry(member.clone()).or_insert(0) += 1;
    }

    /// Releases lease `id`, if it is still held.
    pub(crate) fn release(&mut self, id: &str) {
        if let Some((_, expiry)) = self.by_id.get(id) {
            let key = (*expiry, Box::<str>::from(id));
            self.expiries.remove(&key);
            self.forget(id);
        }
    }

    /// Moves a lease still held to expire at `expiry`.
    pub(crate) fn renew(&mut self, id: &str, expiry: u64) {
        if let Some((_, at)) = self.by_id.get_mut(id) {
            let old = std::mem::replace(at, expiry);
            self.expiries.remove(&(old, Box::<str>::from(id)));
            self.expiries.insert((expiry, id.into()));
        }
    }

    /// Each member's leases, by member id.
    pub(crate) fn counts(&self) -> Vec<(String, u64)> {
        let mut counts: Vec<(String, u64)> = self
            .counts
            .iter()
            .map(|(id, &n)| (id.to_string(), n))
            .collect();
        counts.sort_unstable();
        counts
    }

    /// Removes `id` from the table and its member's count (its expiry entry is the caller's).
    fn forget(&mut self, id: &str) {
        let Some((member, _)) = self.by_id.remove(id) else {
            return;
        };
        if let Some(n) = self.counts.get_mut(&member) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.counts.remove(&member);
            }
        }
    }
}
