//! Least-used pools in process: the same rule as the Redis script (`lua/allocator.lua`), for a
//! single instance. Part of [`crate::MemoryStore`].

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

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

    pub(crate) fn sync(&mut self, members: &[Arc<str>], excluded: &Excluded<'_>) {
        let wanted: HashSet<&str> = members.iter().map(|m| &**m).collect();
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

/// Every least-used pool of one gateway instance, by route.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    pools: RwLock<HashMap<Box<str>, Arc<Mutex<Counts>>>>,
}

impl Pools {
    /// The pool of `route`, created empty if it does not exist.
    pub(crate) fn pool(&self, route: &str) -> Arc<Mutex<Counts>> {
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

    /// Whether the pool of `route` was ever synced or used.
    pub(crate) fn exists(&self, route: &str) -> bool {
        self.pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(route)
    }
}
