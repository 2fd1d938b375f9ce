//! sluice-allocator: choose the member of a pool that a request goes to, against shared state.
//!
//! This crate has one job: decide, in one atomic step, which member of a route takes a request
//! (or why none does), counting it where every instance sees the count. It holds
//! - the semantics and their types: [`PoolMember`] (an id and its own quota windows), the
//!   [`Order`] candidates are walked in, the [`Assign`] asked and the [`Assignment`] answered;
//! - [`StateStore`], the one interface the gateway uses for shared state;
//! - [`MemoryStore`], its in-process backend: least-used counts and cooldowns (`memory_pools`)
//!   with the limiter's memory logs ([`sluice_limiter::QuotaLogs`]) for quotas and member windows;
//! - [`lua`], the same rules as Redis runs them (`lua/allocator.lua`, `lua/members.lua` and the
//!   drivers that combine them with the quota).
//!
//! [`StateStore`] lives here, not in the store crate, because its central call,
//! [`StateStore::assign`], is this crate's decision: the route's quota (the limiter) and the
//! member walk (this crate) decided together. A backend is a way to keep that decision's state
//! (`sluice-store` runs it over Redis); the decision and its contract belong with its semantics,
//! and the gateway can use the memory backend without linking a Redis client.
//!
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
//! It knows nothing of Pingora, HTTP or Redis: the gateway turns a `Retry-After` into
//! [`StateStore::cool`], and passes the members it sees as down (and those a request already
//! tried) as `excluded`.

pub mod lua;
mod memory;
mod memory_leases;
mod memory_pools;
mod memory_sticky;

use std::sync::Arc;

use async_trait::async_trait;
use sluice_limiter::{
    Acquire, EntryId, Outcome, Owner, Period, Reservation, Reserve, Settle, Settled, StoreError,
    Window, WindowUsage,
};

pub use memory::MemoryStore;

/// The sub-log a request of a route kept as sub-logs (`state_shards`) tries first; the others
/// follow in turn whichever it is, so it changes which lane a request joins, never what is
/// admitted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SubLogStart {
    /// The next one in turn, per instance: an instance's requests are spread over every
    /// sub-log.
    #[default]
    RoundRobin,
    /// The instance's own (its index modulo the sub-logs' count): an instance's requests share
    /// one sub-log's batch lane while it has room, so its calls fill as one log's do.
    Home,
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
    /// These members, as indexes into [`Assign::members`], the one with the fewest leases in
    /// flight ([`Assign::lease`]) across every instance first, ties to the lexically smallest
    /// id (`least_in_flight`). Nothing is counted but the lease the assignment takes.
    LeastInFlight(&'a [usize]),
}

/// A lease the assignment takes on the member it chooses, in the same atomic step: the request
/// is in flight on it until [`StateStore::release`] (or the lease's expiry, when its instance
/// died). A member at `member_max` leases is not a candidate; a route at `route_max` assigns
/// nobody ([`Assignment::Concurrency`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease<'a> {
    /// Unique across instances (the gateway's instance id and a sequence number).
    pub id: &'a str,
    /// How long the lease lives unless renewed, in microseconds.
    pub ttl_us: u64,
    /// The most leases one member may hold (`upstream.max_in_flight`).
    pub member_max: Option<u64>,
    /// The most leases the route may hold (`max_in_flight`).
    pub route_max: Option<u64>,
    /// The calling client's cap (`clients.list[].max_in_flight`): the lease also counts in the
    /// client's own leases, on every route, and a client at its cap is assigned nobody
    /// ([`Assignment::ClientConcurrency`]).
    pub client: Option<ClientCap<'a>>,
}

/// A client's cap on its requests in flight, across every route and instance. Its leases live
/// under the client's name (on Redis, in the client's own hash tag), apart from any route's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientCap<'a> {
    /// The client's name.
    pub name: &'a str,
    /// The most leases it may hold.
    pub max: u64,
}

/// Every call that reads or takes a route's leases first drops at most this many that expired:
/// bounded work per call. The rest go in later calls and count meanwhile, which only ever
/// refuses early.
pub const LEASES_EXPIRED_PER_CALL: usize = 64;

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
    /// The lease to take on the chosen member, if the route keeps leases.
    pub lease: Option<Lease<'a>>,
    /// The request's session, on a route with `sticky`: its bound member is offered first.
    pub sticky: Option<Sticky<'a>>,
}

/// A session's binding to a member, looked up and moved in the same atomic step as the
/// assignment: the bound member is offered before the order's candidates (when it is one, and
/// it is not excluded, cooling, refused by its windows or at its most leases); whichever member
/// is chosen, the session is bound to it for `ttl_us` more. A new session finds the table at
/// `max_bindings` and goes unbound (counted in [`StickyCounts::unbound`]), never refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sticky<'a> {
    /// The session key, hashed by the caller: it may be a secret (a cookie), and the store and
    /// its logs see only the hash.
    pub session: &'a str,
    /// How long a binding lives after its last use, in microseconds.
    pub ttl_us: u64,
    /// The most bindings the route keeps.
    pub max_bindings: u64,
}

/// A route's sticky bindings, across every instance (for status pages and metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StickyCounts {
    /// Bindings held now (expired ones not yet dropped may still count, at most for a while).
    pub bindings: u64,
    /// New sessions routed without a binding because the table was full, ever.
    pub unbound: u64,
    /// Bindings moved off their member (it could not take the request, or it answered a
    /// `rebind_on` status), ever.
    pub moved: u64,
}

/// Every call that reads or takes a route's bindings first drops at most this many that
/// expired: bounded work per call. The rest go in later calls; meanwhile a full table may send
/// a new session unbound a little early, and an expired binding is never followed.
pub const BINDINGS_EXPIRED_PER_CALL: usize = 64;

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
    /// The route holds its `max_in_flight` leases, or every eligible member holds its own: a
    /// lease must be released first. Nothing was recorded.
    Concurrency {
        /// The route quota's state, unchanged by this request.
        quota: Option<Outcome>,
    },
    /// The calling client holds its `max_in_flight` leases ([`Lease::client`]): one of them
    /// must be released first. Nothing was recorded.
    ClientConcurrency {
        /// The route quota's state, unchanged by this request.
        quota: Option<Outcome>,
    },
}

/// What an assignment reserves when its windows count usage ([`StateStore::assign_reserve`]):
/// per window its own amount, and per fixed window its period, as in [`Reserve`].
#[derive(Debug, Clone, Copy)]
pub struct Usage<'a> {
    /// Per window of the route's quota ([`Assign::quota`]), its amount.
    pub route: &'a [u64],
    /// Per window of the route's quota, its period; empty when every window slides.
    pub route_periods: &'a [Option<Period>],
    /// Per member, in the order of [`Assign::members`]: per window of its own, its amount and
    /// period. A member is chosen only when each of its windows admits its amount.
    pub members: &'a [MemberUsage<'a>],
    /// Per window of the calling client's own ([`Acquire::client`]), its amount.
    pub client: &'a [u64],
    /// Per window of the client's own, its period; empty when every window slides.
    pub client_periods: &'a [Option<Period>],
}

/// A member's part of a [`Usage`].
#[derive(Debug, Clone, Copy, Default)]
pub struct MemberUsage<'a> {
    /// Per window of the member's own ([`PoolMember::windows`]), its amount.
    pub amounts: &'a [u64],
    /// Per window, its period; empty when every window slides.
    pub periods: &'a [Option<Period>],
}

/// The answer to [`StateStore::assign_reserve`]: the assignment, and the entries that settle it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    /// As [`StateStore::assign`] answers.
    pub assignment: Assignment,
    /// The entry in the route quota's windows, when it has any and a member was assigned.
    pub route: Option<EntryId>,
    /// The entry in the chosen member's own windows, when it has any.
    pub member: Option<EntryId>,
    /// The entry in the client's own windows, when it has any and a member was assigned.
    pub client: Option<EntryId>,
}

/// Where quota logs and least-used pools live.
///
/// Implementations are atomic per route: concurrent calls behave as if they ran one after
/// another, and a call that decides both a quota and an assignment decides them together.
#[async_trait]
pub trait StateStore: Send + Sync + 'static {
    /// Decides on one request against its quota, and records it if admitted.
    async fn acquire(&self, request: Acquire<'_>) -> Result<Outcome, StoreError>;

    /// Decides on a reservation against one quota key, each window charged its own amount
    /// (usage windows: the units reserved), and records it in every window when each admits
    /// it: one atomic step, one round trip. The answer's entry is what settles it. A quota with
    /// no windows admits, and records nothing to settle. A request with a client's own windows,
    /// or a member to charge, reserves through [`StateStore::assign_reserve`] instead (a member
    /// chosen in process as a preference of one), which decides them all in the same step.
    async fn reserve(&self, request: Reserve<'_>) -> Result<Reservation, StoreError>;

    /// [`StateStore::assign`] for a request whose windows count usage: the route's windows, the
    /// client's own and each candidate's are charged their amounts from `usage` (a member is
    /// skipped when its windows refuse theirs), in the same one atomic step (on Redis Cluster,
    /// the client's first, given back when the route then assigns nobody), and the entries come
    /// back to settle.
    async fn assign_reserve(
        &self,
        ask: Assign<'_>,
        usage: Usage<'_>,
    ) -> Result<Reserved, StoreError>;

    /// Settles reservations of `route` (its quota's, its members' and its clients') in one atomic
    /// step per settlement, all in one call (one round trip; on Redis Cluster, one more per
    /// client, whose windows live in a slot of their own): each entry, in each window, changes
    /// from its reserved amount to its settled one and the window's running total with it. An entry that already left its window
    /// changes nothing. Returns, per settlement and window, what happened; `at_us` as in
    /// [`Acquire::at_us`].
    async fn settle(
        &self,
        route: &str,
        settlements: &[Settle<'_>],
        at_us: Option<u64>,
    ) -> Result<Vec<Vec<Settled>>, StoreError>;

    /// What each of `windows` holds now, and how much of that is reservations not yet settled,
    /// across every instance (for status pages and metrics); records nothing. `key` is the
    /// quota key, the member's id or the client's name, as `owner` says; `at_us` as in
    /// [`Acquire::at_us`].
    async fn usage(
        &self,
        route: &str,
        owner: Owner,
        key: &str,
        windows: &[Window],
        at_us: Option<u64>,
    ) -> Result<Vec<WindowUsage>, StoreError>;

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

    /// The routes of the config in force with their `state_shards` (how many sub-logs their
    /// state is split into) and `state_shards_start` (which sub-log a request tries first). A
    /// store that keeps one exact log per route (the memory store) ignores it; Redis keeps a
    /// route with more than one as that many sub-logs, each with its share of every limit, under
    /// hash tags of their own. Every call on such a route answers for the route as a whole
    /// (reads sum the sub-logs).
    ///
    /// Returns how many of the routes ask to start at the instance's own sub-log
    /// ([`SubLogStart::Home`]) but start in turn, since the store has no instance index (it is
    /// read at start only): the caller says so.
    fn shard_routes(&self, _routes: &[(&str, u32, SubLogStart)]) -> usize {
        0
    }

    /// Releases leases of `route` taken by [`Assign::lease`], all in one call: each stops
    /// counting. Idempotent: a lease already released or expired changes nothing.
    async fn release(&self, route: &str, leases: &[&str]) -> Result<(), StoreError>;

    /// Renews leases of `route`, all in one call: each one still held expires `ttl_us` from now
    /// (the store's clock, or `at_us`). A lease already released or expired is not taken again.
    async fn renew(
        &self,
        route: &str,
        leases: &[&str],
        ttl_us: u64,
        at_us: Option<u64>,
    ) -> Result<(), StoreError>;

    /// Releases leases that also counted in `client`'s own ([`Lease::client`]), all in one
    /// call. Idempotent, as [`StateStore::release`], which releases their route's part.
    async fn release_client(&self, client: &str, leases: &[&str]) -> Result<(), StoreError>;

    /// Renews leases of `client`'s own, as [`StateStore::renew`] does a route's.
    async fn renew_client(
        &self,
        client: &str,
        leases: &[&str],
        ttl_us: u64,
        at_us: Option<u64>,
    ) -> Result<(), StoreError>;

    /// The leases in flight on each member of `route` that holds any, across every instance,
    /// expired ones dropped first (for status pages and metrics); `at_us` as in
    /// [`Acquire::at_us`].
    async fn in_flight(
        &self,
        route: &str,
        at_us: Option<u64>,
    ) -> Result<Vec<(String, u64)>, StoreError>;

    /// Drops the binding of `session` on `route` if it still points to `member` (a
    /// `rebind_on` status or a connect failure there): the session's next request is routed by
    /// the policy and bound anew. A binding another request already moved stays.
    async fn unbind(&self, route: &str, session: &str, member: &str) -> Result<(), StoreError>;

    /// The route's sticky bindings and their counters ([`StickyCounts`]); `at_us` as in
    /// [`Acquire::at_us`].
    async fn sticky_counts(
        &self,
        route: &str,
        at_us: Option<u64>,
    ) -> Result<StickyCounts, StoreError>;

    /// Whether the store can be used right now (for readiness).
    async fn ready(&self) -> bool {
        true
    }
}

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    sluice_testkit::architecture::assert_no_cycles(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    );
}
