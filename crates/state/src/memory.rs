//! The in-process backend, for a single gateway instance: quota logs and least-used pools in
//! memory, with the same behaviour as the Redis scripts.

use std::sync::Arc;

use async_trait::async_trait;

use crate::memory_pools::{Excluded, Pools};
use crate::memory_quota::QuotaLogs;
use crate::{Acquire, Assignment, Outcome, StateStore, StoreError};

/// Quotas and least-used pools for a single gateway instance.
#[derive(Debug, Default)]
pub struct MemoryStore {
    quotas: QuotaLogs,
    pools: Pools,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// Number of quota keys held, across all routes (for tests and status).
    pub fn quota_keys(&self) -> usize {
        self.quotas.keys()
    }

    /// The quota decision, synchronously: memory never waits on anything but its locks.
    pub fn decide(&self, req: Acquire<'_>) -> Result<Outcome, StoreError> {
        self.quotas.decide(req)
    }
}

#[async_trait]
impl StateStore for MemoryStore {
    async fn acquire(&self, request: Acquire<'_>) -> Result<Outcome, StoreError> {
        self.decide(request)
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
        let synced = self.pools.exists(route);
        let pool = self.pools.pool(route);
        let mut counts = pool.lock().unwrap_or_else(|p| p.into_inner());
        if !synced {
            counts.sync(members, &excluded);
        }
        // Picks and counts the least-used member; runs at most once.
        let mut take = || {
            let (count, id) = counts.least(&excluded).cloned()?;
            counts.set(&id, count + 1);
            Some(id)
        };
        let Some(q) = quota else {
            return Ok(match take() {
                Some(id) => Assignment::Assigned {
                    member: id.to_string(),
                    quota: None,
                },
                None => Assignment::NoMember { quota: None },
            });
        };
        // The quota goes first, and records the request in the same step as the assignment,
        // under the quota key's lock (the pool's lock is held too): nothing can be admitted
        // between the check and the record.
        let (outcome, member) = self.quotas.decide_then(q, take)?;
        Ok(match member {
            Some(id) => Assignment::Assigned {
                member: id.to_string(),
                quota: Some(outcome),
            },
            None if !outcome.admitted => Assignment::QuotaRefused(outcome),
            None => Assignment::NoMember {
                quota: Some(outcome),
            },
        })
    }

    async fn sync(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        let pool = self.pools.pool(route);
        pool.lock()
            .unwrap_or_else(|p| p.into_inner())
            .sync(members, &Excluded::new(excluded));
        Ok(())
    }

    async fn restore_to_min(
        &self,
        route: &str,
        member: &str,
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        let pool = self.pools.pool(route);
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
        let pool = self.pools.pool(route);
        let counts = pool.lock().unwrap_or_else(|p| p.into_inner());
        Ok(counts
            .order
            .iter()
            .map(|(c, id)| (id.to_string(), *c))
            .collect())
    }
}
