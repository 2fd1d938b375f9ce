//! The in-process allocator: the same rule as the Redis script, for a single instance.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use sluice_limiter::{Acquire, MemoryStore, StoreError};

use crate::{Assignment, AssignmentStore};

/// One pool's counts, ordered as the Redis sorted set orders them: by count, then by id.
#[derive(Debug, Default)]
struct Counts {
    by_member: HashMap<Arc<str>, u64>,
    order: BTreeSet<(u64, Arc<str>)>,
}

/// Membership test for the excluded ids: a scan for the usual handful, a set beyond.
enum Excluded<'a> {
    Few(&'a [&'a str]),
    Many(HashSet<&'a str>),
}

impl<'a> Excluded<'a> {
    fn new(ids: &'a [&'a str]) -> Excluded<'a> {
        if ids.len() <= 16 {
            Excluded::Few(ids)
        } else {
            Excluded::Many(ids.iter().copied().collect())
        }
    }
    fn contains(&self, id: &str) -> bool {
        match self {
            Excluded::Few(ids) => ids.contains(&id),
            Excluded::Many(set) => set.contains(id),
        }
    }
}

impl Counts {
    fn least(&self, excluded: &Excluded<'_>) -> Option<&(u64, Arc<str>)> {
        self.order.iter().find(|(_, id)| !excluded.contains(id))
    }

    fn set(&mut self, id: &Arc<str>, count: u64) {
        if let Some(old) = self.by_member.insert(id.clone(), count) {
            self.order.remove(&(old, id.clone()));
        }
        self.order.insert((count, id.clone()));
    }

    fn sync(&mut self, members: &[Arc<str>], excluded: &Excluded<'_>) {
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

/// Least-used selection for a single gateway instance.
pub struct MemoryAllocator {
    pools: RwLock<HashMap<Box<str>, Arc<Mutex<Counts>>>>,
    /// Quotas of routes that also select least-used are decided under the pool's lock, so that
    /// the pair is as atomic as the fused Redis script.
    quotas: Arc<MemoryStore>,
}

impl MemoryAllocator {
    /// An allocator whose combined calls decide quotas in `quotas`.
    pub fn new(quotas: Arc<MemoryStore>) -> MemoryAllocator {
        MemoryAllocator {
            pools: RwLock::default(),
            quotas,
        }
    }

    fn pool(&self, route: &str) -> Arc<Mutex<Counts>> {
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

    fn exists(&self, route: &str) -> bool {
        self.pools
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(route)
    }
}

#[async_trait]
impl AssignmentStore for MemoryAllocator {
    async fn sync(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        let pool = self.pool(route);
        pool.lock()
            .unwrap_or_else(|p| p.into_inner())
            .sync(members, &Excluded::new(excluded));
        Ok(())
    }

    async fn assign(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
        quota: Option<Acquire<'_>>,
    ) -> Result<Assignment, StoreError> {
        // As in Redis, where an empty sorted set cannot exist.
        if members.is_empty() {
            return Ok(Assignment::NoMember { quota: None });
        }
        let excluded = Excluded::new(excluded);
        let synced = self.exists(route);
        let pool = self.pool(route);
        let mut counts = pool.lock().unwrap_or_else(|p| p.into_inner());
        if !synced {
            counts.sync(members, &excluded);
        }
        // The quota goes first; it records only once a member is certain.
        let mut outcome = None;
        if let Some(q) = quota {
            let checked = self.quotas.decide_with(q, false);
            if !checked.admitted {
                return Ok(Assignment::QuotaRefused(checked));
            }
            outcome = Some(checked);
        }
        let Some((count, id)) = counts.least(&excluded).cloned() else {
            return Ok(Assignment::NoMember { quota: outcome });
        };
        if let Some(q) = quota {
            outcome = Some(self.quotas.decide_with(q, true));
        }
        counts.set(&id, count + 1);
        Ok(Assignment::Assigned {
            member: id.to_string(),
            quota: outcome,
        })
    }

    async fn restore_to_min(
        &self,
        route: &str,
        member: &str,
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        let pool = self.pool(route);
        let mut counts = pool.lock().unwrap_or_else(|p| p.into_inner());
        let mut others: Vec<&str> = excluded.to_vec();
        others.push(member);
        let least = counts.least(&Excluded::new(&others)).map(|(c, _)| *c);
        if let (Some(least), Some(&current)) = (least, counts.by_member.get(member)) {
            if least > current {
                let id: Arc<str> = member.into();
                counts.set(&id, least);
            }
        }
        Ok(())
    }

    async fn counts(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let pool = self.pool(route);
        let counts = pool.lock().unwrap_or_else(|p| p.into_inner());
        Ok(counts
            .order
            .iter()
            .map(|(c, id)| (id.to_string(), *c))
            .collect())
    }
}
