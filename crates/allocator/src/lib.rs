//! sluice-allocator: least-used member selection, shared by every gateway instance.
//!
//! This crate has one job: among the members eligible for a request, pick the one with the
//! fewest recorded assignments, and add one to its count in the same atomic step, so that two
//! instances can never both take the same minimum. Ties go to the lexically smallest member id.
//!
//! Two stores implement [`AssignmentStore`] with the same behaviour:
//! - [`MemoryAllocator`], for a single instance;
//! - [`RedisAllocator`]: a sorted set per pool and one Lua script (`lua/allocator.lua`).
//!
//! A route with a quota as well asks for both in one call ([`AssignmentStore::assign`] with a
//! quota request): the quota is checked first, nothing is assigned when it refuses, and nothing
//! is charged when no member is eligible. On Redis that is one script, composed from the quota
//! library of `sluice-limiter` and this crate's library, so a request costs one round trip.
//!
//! Eligibility comes from the caller: it passes the members it sees as down (and those a request
//! already tried) as `excluded`. The crate knows nothing of Pingora or health checks.

mod memory;
mod redis_store;

use std::sync::Arc;

use async_trait::async_trait;
use sluice_limiter::{Acquire, Outcome, StoreError};

pub use memory::MemoryAllocator;
pub use redis_store::RedisAllocator;

/// The result of one assignment request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assignment {
    /// `member` was chosen and its count raised; the quota (if any) recorded the request.
    Assigned {
        /// The chosen member's id.
        member: String,
        /// The quota's state after recording the request.
        quota: Option<Outcome>,
    },
    /// No member is eligible; nothing was assigned and the quota recorded nothing.
    NoMember {
        /// The quota's state, unchanged by this request.
        quota: Option<Outcome>,
    },
    /// The quota refused the request; nothing was assigned.
    QuotaRefused(Outcome),
}

/// Where pools and their assignment counts live.
#[async_trait]
pub trait AssignmentStore: Send + Sync + 'static {
    /// Makes the pool of `route` hold exactly `members`. A member new to the pool starts at the
    /// current least count among the members not `excluded`; a member already there keeps its
    /// count; members not listed leave.
    async fn sync(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError>;

    /// Picks the least-used member of `route` that is not `excluded` and counts the assignment,
    /// after checking `quota` first when given. A pool that was never synced (or vanished with
    /// a Redis restart) is synced from `members` on the way.
    async fn assign(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
        quota: Option<Acquire<'_>>,
    ) -> Result<Assignment, StoreError>;

    /// The `min` restore policy: raises `member` to the least count among the other members
    /// not `excluded`. Never lowers a count.
    async fn restore_to_min(
        &self,
        route: &str,
        member: &str,
        excluded: &[&str],
    ) -> Result<(), StoreError>;

    /// Every member's assignment count, for status pages.
    async fn counts(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError>;
}
