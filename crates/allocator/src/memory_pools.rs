//! Least-used pools and member cooldowns in process: the same rules as the Redis scripts
//! (`lua/allocator.lua`, `lua/members.lua`), for a single instance. Part of
//! [`crate::MemoryStore`].

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

/// What one route shares between its assignments, behind one lock: every assignment on the
/// route takes it first, which makes the walk over its members one atomic step.
#[derive(Debug, Default)]
pub(crate) struct Route {
    /// The least-used pool (empty for routes that never used least-used).
    pub(crate) counts: Counts,
    /// Member id → the time in µs until which it cools. A cooldown that is over stays until
    /// the next assignment settles it ([`Route::settle_cooldowns`]), so this holds at most one
    /// entry per member that was cooled.
    pub(crate) cooling: HashMap<Arc<str>, u64>,
    /// The requests in flight on its members (routes that keep leases).
    pub(crate) leases: crate::memory_leases::Leases,
    /// Its sticky sessions' bindings (routes with `sticky`).
    pub(crate) sticky: crate::memory_sticky::Bindings,
}

impl Route {
    /// Settles the cooldowns that are over at `now`: on a least-used pool, each of their
    /// members is raised to the least count among the members that could take requests
    /// meanwhile (not cooling, not `excluded`, not at their most leases (`capped`), not just
    /// back themselves), as `on_restore: min` does after ill health; at its old count it would
    /// take every request until it caught up, which tends to bring the provider's 429 straight
    /// back. Never lowers a count. The same rule as `members_cooling` in `lua/members.lua`,
    /// which is given the members at their cap among the excluded (`leases_cap`).
    pub(crate) fn settle_cooldowns(
        &mut self,
        excluded: &Excluded<'_>,
        capped: impl Fn(&Self, &str) -> bool,
        now: u64,
        least_used: bool,
    ) {
        if self.cooling.values().all(|&until| until > now) {
            return;
        }
        let ended: Vec<Arc<str>> = self
            .cooling
            .iter()
            .filter(|(_, &until)| until <= now)
            .map(|(id, _)| id.clone())
            .collect();
        self.cooling.retain(|_, until| *until > now);
        if !least_used {
            return;
        }
        let cooling = &self.cooling;
        let least = self
            .counts
            .order
            .iter()
            .find(|(_, id)| {
                !excluded.contains(id)
                    && !cooling.contains_key(id)
                    && !ended.contains(id)
                    && !capped(self, id)
            })
            .map(|(count, _)| *count);
        let Some(least) = least else {
            return;
        };
        for id in &ended {
            if let Some(&count) = self.counts.by_member.get(id) {
                if count < least {
                    self.counts.set(id, least);
                }
            }
        }
    }
}

/// One pool's counts, ordered as the Redis sorted set orders them: by count, then by id.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) by_member: HashMap<Arc<str>, u64>,
    pub(crate) order: BTreeSet<(u64, Arc<str>)>,
}

/// Membership test for the excluded ids: a scan for the usual handful, a set beyond.
pub(crate) enum Excluded<'a> {
    Few(&'a [&'a str]),
    Many(HashSet<&'a str>),
}

impl<'a> Excluded<'a> {
    pub(crate) fn new(ids: &'a [&'a str]) -> Excluded<'a> {
        if ids.len() <= 16 {
            Excluded::Few(ids)
        } else {
            Excluded::Many(ids.iter().copied().collect())
        }
    }
    pub(crate) fn contains(&self, id: &str) -> bool {
        match self {
            Excluded::Few(ids) => ids.contains(&id),
            Excluded::Many(set) => set.contains(id),
        }
    }
}

impl Counts {
    pub(crate) fn least(&self, excluded: &Excluded<'_>) -> Option<&(u64, Arc<str>)> {
        self.order.iter().find(|(_, id)| !excluded.contains(id))
    }

    pub(crate) fn set(&mut self, id: &Arc<str>, count: u64) {
        if let Some(old) = self.by_member.insert(id.clone(), count) {
            self.order.remove(&(old, id.clone()));
        }
        self.order.insert((count, id.clone()));
    }

    pub(crate) fn sync<'m>(
        &mut self,
        members: impl Iterator<Item = &'m Arc<str>> + Clone,
        excluded: &Excluded<'_>,
    ) {
        let wanted: HashSet<&str> = members.clone().map(|m| &**m).collect();
        let leaving: Vec<Arc<str>> = self
            .by_member
            .keys()
            .filter(|id| !wanted.contains(&***id))
            .cloned()
            .collect();
        for id in leaving {
            if let Some(count) = self.by_member.remove(&id) {
                self.order.remove(&(count, id));
            }
        }
        let floor = self.least(excluded).map_or(0, |(c, _)| *c);
        for m in members {
            if !self.by_member.contains_key(m) {
                self.set(m, floor);
            }
        }
    }
}

/// Every route's pool and cooldowns, in one gateway instance.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    pools: RwLock<HashMap<Box<str>, Arc<Mutex<Route>>>>,
}

impl Pools {
    /// The state of `route`, if it has any; for reads, which must not create it.
    pub(crate) fn get(&self, route: &str) -> Option<Arc<Mutex<Route>>> {
        self.pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(route)
            .cloned()
    }

    /// Drops the state of every route not in `routes`.
    pub(crate) fn retain(&self, routes: &[&str]) {
        let keep: HashSet<&str> = routes.iter().copied().collect();
        self.pools
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|route, _| keep.contains(&**route));
    }

    /// How many routes hold state (for tests).
    pub(crate) fn len(&self) -> usize {
        self.pools.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The state of `route`, created empty if it does not exist.
    pub(crate) fn route(&self, route: &str) -> Arc<Mutex<Route>> {
        if let Some(p) = self
            .pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(route)
        {
            return p.clone();
        }
        self.pools
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(route.into())
            .or_default()
            .clone()
    }
}
