//! sluice-state: the state that every gateway instance shares — sliding-window quotas and
//! least-used assignment counts — and the one operation that decides both for a request.
//!
//! This crate has one job: own that state. It is the only place that knows
//! - the [`StateStore`] trait, the single interface the gateway uses;
//! - the Redis connection and its call discipline (timeout, one retry after a reconnect),
//!   in [`connection`];
//! - the Redis key schema (SPEC §6), in [`keys`];
//! - how the Lua scripts in `lua/` are assembled, called and answered, in [`scripts`];
//! - [`StoreError`], whatever part of the state failed.
//!
//! Two backends implement [`StateStore`] with the same behaviour, and the same behavioural
//! suites run against both (and against Redis Cluster):
//! - [`MemoryStore`], for a single gateway instance (the default);
//! - [`RedisStore`], shared by every instance: one `EVALSHA` per request, time from Redis `TIME`.
//!
//! A new backend is one file that implements [`StateStore`].
//!
//! The decisions are exact. For quotas, the units admitted in any interval as long as a window
//! never exceed its limit, and a refused request learns exactly how long until its cost fits.
//! For least-used, the member with the fewest assignments is picked and counted in the same
//! atomic step, so two instances can never both take the same minimum; ties go to the
//! lexically smallest member id. When a route has both, the quota is checked first, nothing is
//! assigned when it refuses, and nothing is charged when no member is eligible.
//!
//! It knows nothing of Pingora or HTTP: the gateway turns an [`Outcome`] into headers, and
//! passes the members it sees as down (and those a request already tried) as `excluded`.

pub mod connection;
pub mod keys;
mod memory;
mod memory_pools;
mod memory_quota;
mod redis;
pub mod scripts;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

pub use connection::RedisConnection;
pub use memory::MemoryStore;
pub use redis::{RedisStore, RedisStoreConfig};

/// One window of a quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// Name, unique within the quota; part of the store keys.
    pub name: Arc<str>,
    /// Units admitted per window, at least 1.
    pub limit: u64,
    /// Length in microseconds, at least 1.
    pub length_us: u64,
}

/// What is asked of the quota for one request.
#[derive(Debug, Clone, Copy)]
pub struct Acquire<'a> {
    /// The route; the store keeps each route's keys apart (and on one Redis Cluster slot).
    pub route: &'a str,
    /// The quota key within the route (`route`, a header value or a client address).
    pub key: &'a str,
    /// The windows, all of which must admit the request.
    pub windows: &'a [Window],
    /// The request's cost in units, at least 1.
    pub cost: u64,
    /// The time in microseconds, for tests that replay a trace. `None` (always, in the gateway)
    /// uses the store's own clock: monotonic in memory, Redis `TIME` in Redis.
    pub at_us: Option<u64>,
}

/// The state of one window after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowState {
    /// Units still available in the window, after this request if it was admitted.
    pub remaining: u64,
    /// Microseconds until the window's oldest counted request leaves it; 0 when empty.
    pub reset_us: u64,
}

/// The quota's decision for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// True when every window admitted the request, which is then recorded in all of them.
    pub admitted: bool,
    /// For a refused request, microseconds until its cost fits every window if no other traffic
    /// arrives; 0 when admitted.
    pub retry_after_us: u64,
    /// Per window, in the order of [`Acquire::windows`].
    pub windows: Vec<WindowState>,
}

impl Outcome {
    /// The index of the window with the least remaining units (the first, on a tie).
    pub fn tightest(&self) -> Option<usize> {
        (0..self.windows.len()).min_by_key(|&i| self.windows[i].remaining)
    }
}

/// The result of one least-used assignment.
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

/// A failure to reach or use the store. The caller applies its route's `on_store_error`.
#[derive(Debug)]
pub enum StoreError {
    /// The store did not answer within its timeout.
    Timeout,
    /// The store answered with an error, or the connection failed.
    Backend(String),
    /// The route holds as many quota keys as the memory store allows; a request with a new key
    /// is not decided.
    TooManyKeys,
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Timeout => f.write_str("state store timed out"),
            StoreError::Backend(e) => write!(f, "state store failed: {e}"),
            StoreError::TooManyKeys => write!(
                f,
                "the route holds {} quota keys, the most the memory store keeps per route",
                memory_quota::MAX_KEYS_PER_ROUTE
            ),
        }
    }
}

impl std::error::Error for StoreError {}

/// Where quota logs and least-used pools live.
///
/// Implementations are atomic per route: concurrent calls behave as if they ran one after
/// another, and a call that decides both a quota and an assignment decides them together.
#[async_trait]
pub trait StateStore: Send + Sync + 'static {
    /// Decides on one request against its quota, and records it if admitted.
    async fn acquire(&self, request: Acquire<'_>) -> Result<Outcome, StoreError>;

    /// Picks the least-used member of `route` that is not `excluded` and counts the assignment,
    /// after checking `quota` first when given, all in one atomic step. A pool that was never
    /// synced (or vanished with a Redis restart) is synced from `members` on the way.
    async fn assign(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
        quota: Option<Acquire<'_>>,
    ) -> Result<Assignment, StoreError>;

    /// Makes the pool of `route` hold exactly `members`. A member new to the pool starts at the
    /// current least count among the members not `excluded`; a member already there keeps its
    /// count; members not listed leave.
    async fn sync(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError>;

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

    /// Whether the store can be used right now (for readiness).
    async fn ready(&self) -> bool {
        true
    }
}
