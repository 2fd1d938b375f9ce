//! sluice-state: the state that every gateway instance shares — sliding-window quotas,
//! least-used assignment counts, pool members' own quota windows and their cooldowns — and the
//! one operation that decides all of them for a request.
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
//! - [`RedisStore`], shared by every instance: at most one script call per request (requests
//!   that wait together share one), time from Redis `TIME`.
//!
//! A new backend is one file that implements [`StateStore`].
//!
//! The decisions are exact. For quotas, the units admitted in any interval as long as a window
//! never exceed its limit, and a refused request learns exactly how long until its cost fits.
//! For least-used, the member with the fewest assignments is picked and counted in the same
//! atomic step, so two instances can never both take the same minimum; ties go to the
//! lexically smallest member id.
//!
//! [`StateStore::assign`] is SPEC §8's one atomic step: the route's quota is checked first;
//! then the candidates are walked in order (the least-used pool's, or a preference the gateway
//! computed in process), skipping excluded members, cooling ones and those whose own windows
//! ([`PoolMember::windows`]) refuse the cost; the first that admits is chosen, and only then is
//! anything recorded (route quota, member windows, pool count). When every eligible member
//! cools or refuses, [`Assignment::Busy`] says exactly when the first of them admits, and
//! nothing is charged anywhere. Cooldowns are set with [`StateStore::cool`], which never
//! shortens one, so that instances learning from 429s at once agree.
//!
//! It knows nothing of Pingora or HTTP: the gateway turns an [`Outcome`] into headers, a
//! `Retry-After` into [`StateStore::cool`], and passes the members it sees as down (and those a
//! request already tried) as `excluded`.

mod batch;
mod call;
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
pub use memory::{MemoryLimits, MemoryStore};
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
    /// The request's cost in units. 0 records nothing and only reports the windows' state
    /// ([`StateStore::acquire`] only; the gateway's metrics read the quota this way).
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

/// A pool member as the store sees it.
///
/// The store needs a member's identity (to count, cool and log it) and its own quota windows
/// (to skip it when they refuse a request): nothing else of it, and nothing secret. The gateway
/// builds these once per policy, at config load, so an assignment borrows them and copies none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMember {
    /// Its identity (the member's `name`): the entry in the least-used pool, and the key of its
    /// quota logs and its cooldown.
    pub id: Arc<str>,
    /// The member's own quota windows (the provider's per-key limits); empty = none. They are
    /// charged with [`Assign::cost`] when the member is chosen, and shared by every instance.
    pub windows: Arc<[Window]>,
}

impl PoolMember {
    /// A member with no windows of its own.
    pub fn new(id: impl Into<Arc<str>>) -> PoolMember {
        PoolMember {
            id: id.into(),
            windows: Arc::new([]),
        }
    }
}

/// Which member an assignment prefers: the store walks candidates in this order and takes the
/// first one that is eligible now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order<'a> {
    /// The least-used member of the route's pool (`least_used`): the pool's order (count, then
    /// the lexically smallest id), picked and counted in the store, so that every instance
    /// agrees.
    LeastUsed,
    /// These members, as indexes into [`Assign::members`], best first: the order `round_robin`
    /// and `priority` decide in process. Nothing is counted; the store only applies member
    /// windows, cooldowns and the route's quota. An index out of range is not a candidate.
    Preference(&'a [usize]),
}

/// Everything one assignment decides on, in one atomic step: the route's quota, then the first
/// candidate (in [`Assign::order`]) that is not excluded, not cooling and whose own windows
/// admit [`Assign::cost`].
#[derive(Debug, Clone, Copy)]
pub struct Assign<'a> {
    /// The route; its pool, cooldowns and member logs live under it (one Redis Cluster slot).
    pub route: &'a str,
    /// Every member of the route, in config order. A least-used pool that was never synced (or
    /// vanished with a Redis restart) is synced from these ids on the way.
    pub members: &'a [PoolMember],
    /// Which member is preferred.
    pub order: Order<'a>,
    /// Ids never to choose: members seen as down, or already tried by this request.
    pub excluded: &'a [&'a str],
    /// The route's quota, checked first: when it refuses, nothing else is looked at.
    pub quota: Option<Acquire<'a>>,
    /// The request's cost in units, charged to the chosen member's windows (the route's quota
    /// charges its own [`Acquire::cost`]); at least 1.
    pub cost: u64,
    /// Whether the route has a `cooldown`: cooling members are skipped. Without it, cooldowns
    /// are neither read nor waited for.
    pub cooldowns: bool,
    /// The time in microseconds, for tests that replay a trace (as [`Acquire::at_us`]); `None`
    /// uses the store's clock. It is used for every part of the decision, the route's quota
    /// included (whose own `at_us` only applies when this is `None`).
    pub at_us: Option<u64>,
}

/// The result of one assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assignment {
    /// `member` was chosen: the route's quota (if any) and the member's windows recorded the
    /// request, and a least-used pool counted it.
    Assigned {
        /// The chosen member's id.
        member: String,
        /// The route quota's state after recording the request.
        quota: Option<Outcome>,
    },
    /// No candidate is eligible (every one excluded, or the pool is empty): the request has
    /// nowhere to go (a 503 upstream). Nothing was recorded.
    NoMember {
        /// The route quota's state, unchanged by this request.
        quota: Option<Outcome>,
    },
    /// The route's quota refused the request; nothing was recorded.
    QuotaRefused(Outcome),
    /// Eligible members exist, but each is cooling down or its own windows refuse the cost
    /// now. Nothing was recorded anywhere.
    Busy {
        /// Exact, assuming no other traffic: the least, over the eligible members, of the time
        /// until that member admits the cost (the longer of its remaining cooldown and its own
        /// quota wait).
        retry_after_us: u64,
        /// The route quota's state, unchanged by this request.
        quota: Option<Outcome>,
    },
}

/// A failure to reach or use the store. The caller applies its route's `on_store_error`.
#[derive(Debug, Clone)]
pub enum StoreError {
    /// The store did not answer within its timeout.
    Timeout,
    /// The store answered with an error, or the connection failed.
    Backend(String),
    /// The route holds as many quota keys, or log entries, as the memory store allows, each
    /// still counting: a request with a new key, or one that would add entries, is not decided.
    /// This is no outage: the store works, and what it holds keeps being decided. The gateway
    /// refuses the request rather than admit it unmetered.
    TooManyKeys,
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Timeout => f.write_str("state store timed out"),
            StoreError::Backend(e) => write!(f, "state store failed: {e}"),
            StoreError::TooManyKeys => f.write_str(
                "the route holds as many quota keys, or entries, as the memory store keeps",
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

    /// Chooses a member for one request, in one atomic step (one round trip to Redis): the
    /// route's quota first; then the candidates in `ask.order`, skipping excluded members,
    /// cooling ones (when `ask.cooldowns`) and those whose own windows refuse `ask.cost`. The
    /// first that admits is chosen, and only then is anything recorded: the route's quota, the
    /// member's windows, and (least-used) its count. See [`Assignment`] for the answers.
    async fn assign(&self, ask: Assign<'_>) -> Result<Assignment, StoreError>;

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

    /// What is left now in each of `member`'s own windows on `route`, in the order of
    /// [`PoolMember::windows`], recording nothing (for metrics and status pages).
    async fn member_remaining(
        &self,
        route: &str,
        member: &PoolMember,
    ) -> Result<Vec<u64>, StoreError>;

    /// Every member's assignment count, for status pages.
    async fn counts(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError>;

    /// Cools `member` of `route` for `for_us` from now (the store's clock, or `at_us` in
    /// tests), so that no instance chooses it meanwhile (when the route has `cooldown`). Never
    /// shortens a longer cooldown already set: two instances learning at once keep the longer.
    /// Returns the member's remaining cooldown in microseconds.
    async fn cool(
        &self,
        route: &str,
        member: &str,
        for_us: u64,
        at_us: Option<u64>,
    ) -> Result<u64, StoreError>;

    /// The members of `route` cooling now, with their remaining microseconds, soonest to end
    /// first (for `/status`).
    async fn cooldowns(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError>;

    /// The routes of the config in force, after a reload. A store that keeps per-route state in
    /// process drops the least-used pools and cooldowns of every other route: no request asks
    /// for them again, and reloads that come and go would otherwise grow it without end. Quota
    /// logs stay until their windows pass (the idle sweep drops them), so a route that comes
    /// back in a later reload keeps its quota. Redis drops nothing here.
    async fn retain_routes(&self, _routes: &[&str]) {}

    /// Whether the store can be used right now (for readiness).
    async fn ready(&self) -> bool {
        true
    }
}
