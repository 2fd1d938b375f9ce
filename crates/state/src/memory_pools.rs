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
    /// Member id → the time in µs until which it cools. Trimmed whenever a member is cooled,
    /// so it holds only recent cooldowns of configured members.
    pub(crate) cooling: HashMap<Arc<str>, u64>,
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
