//! sluice-limiter: sliding-window quotas.
//!
//! This crate has one job: decide whether a request of a given cost fits every window of its
//! quota key, and record it if, and only if, it fits them all. The decision is exact: the units
//! admitted in any interval as long as a window never exceed its limit, and a refused request
//! learns exactly how long until its cost would fit.
//!
//! Two stores implement [`QuotaStore`] with the same behaviour:
//! - [`MemoryStore`], for a single gateway instance (the default);
//! - [`RedisStore`], shared by every instance, driven by one Lua script (`lua/quota.lua`) in one
//!   `EVALSHA` per request, with the time taken from Redis `TIME`.
//!
//! It knows nothing of Pingora or HTTP: the gateway turns an [`Outcome`] into headers.

mod memory;
mod redis_store;

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

pub use memory::MemoryStore;
pub use redis_store::{
    parse_reply, push_quota_args, RedisConnection, RedisStore, RedisStoreConfig,
};

/// The quota library (`lua/quota.lua`): Lua functions that check and record a quota, for
/// scripts that compose the quota with another policy in one atomic call.
pub const QUOTA_LIBRARY: &str = include_str!("../../../lua/quota.lua");

/// The script the Redis store runs: the library followed by its driver (`lua/quota_run.lua`).
pub fn quota_script() -> String {
    format!(
        "{QUOTA_LIBRARY}\n{}",
        include_str!("../../../lua/quota_run.lua")
    )
}

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

/// What is asked of the store for one request.
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

/// The decision for one request.
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

/// A failure to reach or use the store. The caller applies its `on_store_error` policy.
#[derive(Debug)]
pub enum StoreError {
    /// The store did not answer within its timeout.
    Timeout,
    /// The store answered with an error, or the connection failed.
    Backend(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Timeout => f.write_str("quota store timed out"),
            StoreError::Backend(e) => write!(f, "quota store failed: {e}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// Where quota logs live. Implementations must be atomic per quota key: concurrent calls for
/// one key behave as if they ran one after another.
#[async_trait]
pub trait QuotaStore: Send + Sync + 'static {
    /// Decides on one request and records it if admitted.
    async fn acquire(&self, request: Acquire<'_>) -> Result<Outcome, StoreError>;

    /// Whether the store can be used right now (for readiness).
    async fn ready(&self) -> bool {
        true
    }
}
