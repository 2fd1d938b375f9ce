//! Selection: which member a request goes to, decided together with the route's quota.
//!
//! Each route holds one [`Policy`], built once when the table is built. A policy answers two
//! questions, through the [`Selector`] trait:
//! - [`Selector::admit`]: may this request go, and to which member first? The quota and the
//!   first pick are decided together, in one store call where the policy needs the store, so
//!   that a request is charged only when it has somewhere to go;
//! - [`Selector::next`]: after a connect failure, which untried member next?
//!
//! What a policy is before any route uses it comes from the [`Kind`] trait: its name in the
//! config (`upstream.selection`), what it asks of a route (its own `check` rules, which
//! `sluice check` reports like any other config error), whether it keeps a shared count, and
//! how it is built. **A new policy is one new file that implements [`Selector`] and [`Kind`],
//! plus its line in [`KINDS`]**: the config, its validation and `/status` take the rest from
//! the trait.
//!
//! What every policy shares lives here: [`Attempt`], the guard of one try of one member, which
//! reports its outcome to the pool's health and gives back a down member's trial if the request
//! ends without using it; and [`Tried`], the members a request has tried.

mod least_in_flight;
mod least_used;
mod priority;
mod round_robin;

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use sluice_allocator::{Assign, Assignment, MemberUsage, Order, PoolMember, StateStore, Usage};
use sluice_balancer::{Members, WeightedRoundRobin};
use sluice_limiter::{Acquire, EntryId, Outcome, Period, StoreError};

use crate::config::{Config, Rules, Selection, UpstreamConfig, YamlPath};
use crate::lease::{LeaseGuard, LeasePlan};

pub(crate) use least_in_flight::LeastInFlight;
pub(crate) use least_used::LeastUsed;
pub(crate) use priority::Priority;
pub(crate) use round_robin::RoundRobin;

/// Every policy sluice knows, by the name `upstream.selection` gives it. A new policy is one
/// file, and one line here.
pub(crate) static KINDS: &[Entry] = &[
    Entry::of::<RoundRobin>(),
    Entry::of::<LeastUsed>(),
    Entry::of::<Priority>(),
    Entry::of::<LeastInFlight>(),
];

/// What admission decided about a request.
pub(crate) enum Admission {
    /// The request goes on. `first` is its first member, when the policy picked it here; a
    /// request without one picks in [`Selector::next`]. `quota` is the route quota's state
    /// after charging the request.
    Admitted {
        first: Option<Attempt>,
        quota: Option<Outcome>,
        /// What settles the request, when admission reserved ([`Reserving`]).
        entries: Entries,
    },
    /// The route's quota refused the request; nothing was charged or assigned.
    QuotaRefused(Outcome),
    /// No member is eligible; nothing was charged.
    NoMember { quota: Option<Outcome> },
    /// Members are eligible, but every one is cooling down or its own quota refuses the cost
    /// now; nothing was charged. `retry_after_us` is the exact time until the first admits it.
    Busy {
        retry_after_us: u64,
        quota: Option<Outcome>,
    },
    /// The route holds its `max_in_flight` requests, or every eligible member its own, or
    /// (`client`) the calling client its own; nothing was charged.
    Concurrency {
        quota: Option<Outcome>,
        client: bool,
    },
    /// The store failed; the route's `on_store_error` decides. `first` is the member already
    /// chosen in process, if any; `fallback` tells that selection itself fell back to
    /// round-robin (least-used), which is counted apart.
    StoreFailed {
        error: StoreError,
        first: Option<Attempt>,
        fallback: bool,
    },
}

impl Admission {
    /// The store's answer for a request: `first` is the attempt for the member it chose (made
    /// by the caller, who knows the pool), used only when one was chosen.
    fn of(
        assignment: Assignment,
        entries: Entries,
        first: impl FnOnce(&str) -> Option<Attempt>,
    ) -> Admission {
        match assignment {
            Assignment::Assigned { member, quota } => Admission::Admitted {
                first: first(&member),
                quota,
                entries,
            },
            Assignment::NoMember { quota } => Admission::NoMember { quota },
            Assignment::QuotaRefused(outcome) => Admission::QuotaRefused(outcome),
            Assignment::Busy {
                retry_after_us,
                quota,
            } => Admission::Busy {
                retry_after_us,
                quota,
            },
            Assignment::Concurrency { quota } => Admission::Concurrency {
                quota,
                client: false,
            },
            Assignment::ClientConcurrency { quota } => Admission::Concurrency {
                quota,
                client: true,
            },
        }
    }

    /// The member a retry goes to, if this admission found one (the in-process choice when
    /// the store failed).
    fn into_attempt(self) -> Option<Attempt> {
        match self {
            Admission::Admitted { first, .. } | Admission::StoreFailed { first, .. } => first,
            _ => None,
        }
    }
}

/// What one policy does for a request. Implementations know the route's pool; the state store
/// and the request's quota ask are given per call.
///
/// A route calls its policy through `dyn Selector`: one boxed future per call, which is what
/// lets a policy be a file of its own rather than an arm in every match of this module.
#[async_trait]
pub(crate) trait Selector: Send + Sync {
    /// Decides the quota and the first member of a request.
    async fn admit(
        &self,
        state: &dyn StateStore,
        quota: Option<Acquire<'_>>,
        cost: u64,
        reserving: Option<Reserving<'_>>,
    ) -> Admission;

    /// The member of the next attempt, skipping those `tried`; `None` when none is left.
    async fn next(&self, state: &dyn StateStore, tried: &mut Tried) -> Option<Attempt>;

    /// [`Selector::admit`] for a request without a quota or a reservation, when this policy
    /// decides it in process alone: `None` means "call `admit`". `admit`'s future is boxed (the
    /// selector is a trait object), an allocation and a copy that a round-robin request, which
    /// never waits here, need not pay.
    fn admit_in_process(&self) -> Option<Admission> {
        None
    }

    /// The round-robin schedule the policy picks from, if it has one: a table that replaces
    /// this one goes on from its position.
    fn schedule(&self) -> Option<&Arc<WeightedRoundRobin>> {
        None
    }
}

/// What a policy is before a route uses it: its config name, its rules, and how it is built.
pub(crate) trait Kind: Selector + Sized + 'static {
    /// The name `upstream.selection` gives it.
    const NAME: &'static str;

    /// Whether it keeps a count per member in the store: `/status` shows `assignments`, and
    /// `on_restore` applies to it.
    const COUNTS: bool = false;

    /// Whether it needs leases (requests in flight per member) whatever the route's caps.
    const LEASES: bool = false;

    /// What it asks of a route's upstream (at `at`) beyond what every route is checked for.
    fn check(_upstream: &UpstreamConfig, _at: &YamlPath, _problems: &mut Problems) {}

    /// The policy of one route.
    fn build(parts: &Parts<'_>) -> Self;
}

/// Config problems, each at its YAML path.
pub(crate) type Problems = Vec<(YamlPath, String)>;

/// One line of [`KINDS`]: a policy's [`Kind`], as plain values.
pub(crate) struct Entry {
    name: &'static str,
    counts: bool,
    leases: bool,
    check: fn(&UpstreamConfig, &YamlPath, &mut Problems),
    build: fn(&Parts<'_>) -> Box<dyn Selector>,
}

impl Entry {
    const fn of<K: Kind>() -> Entry {
        Entry {
            name: K::NAME,
            counts: K::COUNTS,
            leases: K::LEASES,
            check: K::check,
            build: build_boxed::<K>,
        }
    }

    /// The entry `selection` names; `check` refuses any other, so a config that got here
    /// names one (round-robin otherwise, the default).
    fn named(selection: &Selection) -> &'static Entry {
        KINDS
            .iter()
            .find(|k| k.name == selection.as_str())
            .unwrap_or(&KINDS[0])
    }
}

/// Whether a route's requests take leases: its policy needs them, or it caps requests in flight
/// on a member or on the whole route.
pub(crate) fn keeps_leases(route: &crate::config::RouteConfig) -> bool {
    Entry::named(&route.upstream.selection).leases
        || route.upstream.max_in_flight.is_some()
        || route.max_in_flight.is_some()
}

fn build_boxed<K: Kind>(parts: &Parts<'_>) -> Box<dyn Selector> {
    Box::new(K::build(parts))
}

/// The rules every policy brings to `sluice check` ([`crate::config::Rules`]): the name must
/// be one of [`KINDS`], `on_restore` needs a policy that counts, and each policy's own checks.
pub(crate) static RULES: PolicyRules = PolicyRules;

/// See [`RULES`].
pub(crate) struct PolicyRules;

impl Rules for PolicyRules {
    fn check(&self, config: &Config) -> Vec<(YamlPath, String)> {
        let mut problems = Vec::new();
        for (i, route) in config.routes.iter().enumerate() {
            let at = YamlPath::root().key("routes").index(i).key("upstream");
            let up = &route.upstream;
            let Some(entry) = KINDS.iter().find(|k| k.name == up.selection.as_str()) else {
                let names: Vec<&str> = KINDS.iter().map(|k| k.name).collect();
                problems.push((
                    at.key("selection"),
                    format!(
                        "unknown selection {:?}; one of: {}",
                        up.selection.as_str(),
                        names.join(", ")
                    ),
                ));
                continue;
            };
            if up.on_restore.is_some() && !entry.counts {
                let counting: Vec<&str> =
                    KINDS.iter().filter(|k| k.counts).map(|k| k.name).collect();
                problems.push((
                    at.clone().key("on_restore"),
                    format!(
                        "on_restore applies to selection: {} only: {} keeps no count to restore",
                        counting.join(" or "),
                        entry.name
                    ),
                ));
            }
            (entry.check)(up, &at, &mut problems);
        }
        problems
    }
}

/// For a policy's [`Kind::check`]: a member `weight` is refused, since `why` the policy does
/// not weigh members.
pub(crate) fn refuse_weights(
    up: &UpstreamConfig,
    at: &YamlPath,
    why: &str,
    problems: &mut Problems,
) {
    for (j, member) in up.members.iter().enumerate() {
        if member.weight.is_some() {
            problems.push((
                at.clone().key("members").index(j).key("weight"),
                format!("weight applies to round_robin only; {why}"),
            ));
        }
    }
}

/// What a policy is built from ([`Kind::build`]).
pub(crate) struct Parts<'a> {
    /// The route's name.
    pub(crate) route: &'a Arc<str>,
    /// Its members and their health.
    pub(crate) pool: &'a Arc<Members>,
    /// The route's policy in the table this one replaces, if any.
    before: Option<&'a Policy>,
    /// Every member with its own windows, and whether cooldowns apply.
    pub(crate) limits: &'a Limits,
}

impl Parts<'_> {
    /// The round-robin schedule over the pool, going on from the replaced policy's
    /// ([`schedule_for`]).
    pub(crate) fn schedule(&self) -> Arc<WeightedRoundRobin> {
        schedule_for(self.pool, self.before)
    }

    /// Member windows and cooldowns, when the route has any: only then must an in-process
    /// policy let the store choose.
    pub(crate) fn active_limits(&self) -> Option<Limits> {
        self.limits.active().then(|| self.limits.clone())
    }
}

/// The selection policy of one route.
pub(crate) struct Policy {
    entry: &'static Entry,
    selector: Box<dyn Selector>,
}

impl Policy {
    /// The policy `selection` names, over `pool`. `before` is the route's policy in the table
    /// this one replaces: round-robin goes on from where it was.
    pub(crate) fn new(
        selection: &Selection,
        route: &Arc<str>,
        pool: &Arc<Members>,
        before: Option<&Policy>,
        limits: Limits,
    ) -> Policy {
        let entry = Entry::named(selection);
        let parts = Parts {
            route,
            pool,
            before,
            limits: &limits,
        };
        Policy {
            entry,
            selector: (entry.build)(&parts),
        }
    }

    /// Its name in the config, for `/status`.
    pub(crate) fn name(&self) -> &'static str {
        self.entry.name
    }

    /// Whether it keeps a count per member in the store ([`Kind::COUNTS`]).
    pub(crate) fn counts(&self) -> bool {
        self.entry.counts
    }

    /// The round-robin schedule this policy picks from, least-used's fallback included.
    fn schedule(&self) -> Option<&Arc<WeightedRoundRobin>> {
        self.selector.schedule()
    }

    pub(crate) async fn admit(
        &self,
        state: &dyn StateStore,
        quota: Option<Acquire<'_>>,
        cost: u64,
        reserving: Option<Reserving<'_>>,
    ) -> Admission {
        if quota.is_none() && reserving.is_none() {
            if let Some(admission) = self.selector.admit_in_process() {
                return admission;
            }
        }
        self.selector.admit(state, quota, cost, reserving).await
    }

    pub(crate) async fn next(&self, state: &dyn StateStore, tried: &mut Tried) -> Option<Attempt> {
        self.selector.next(state, tried).await
    }
}

/// What the store must weigh besides the route's quota when it chooses a member (SPEC §8): the
/// members' own windows and whether cooldowns apply. Built once per table.
#[derive(Clone)]
pub(crate) struct Limits {
    /// Every member, in pool order, with its own windows.
    pub(crate) members: Arc<[PoolMember]>,
    /// The route has `cooldown`.
    pub(crate) cooldowns: bool,
    /// The leases its requests take, when they take any.
    pub(crate) leases: Option<LeasePlan>,
    /// The route is sticky: a session's member is found in the store, so the store chooses.
    pub(crate) sticky: bool,
}

impl Limits {
    /// The members of `pool` with no windows, and no cooldowns.
    pub(crate) fn plain(pool: &Members) -> Limits {
        Limits {
            members: pool
                .members()
                .iter()
                .map(|m| PoolMember::new(m.id.clone()))
                .collect(),
            cooldowns: false,
            leases: None,
            sticky: false,
        }
    }

    /// Whether any of it applies: only then do round-robin and priority ask the store to
    /// choose, rather than choosing in process.
    pub(crate) fn active(&self) -> bool {
        self.cooldowns
            || self.leases.is_some()
            || self.sticky
            || self.members.iter().any(|m| !m.windows.is_empty())
    }
}

/// A policy that orders the members in process (round_robin, priority). Without member windows
/// or cooldowns it picks alone and the store only charges the route's quota; with them it
/// orders the candidates and the store chooses among them ([`choose_among`]).
pub(crate) trait InProcess {
    fn pool(&self) -> &Arc<Members>;
    fn route(&self) -> &str;
    /// Member windows and cooldowns, when the route has any.
    fn limits(&self) -> Option<&Limits>;
    /// The next untried member, chosen in process.
    fn pick(&self, tried: &Tried) -> Option<Attempt>;
    /// Every untried candidate, best first, and the down member's trial claimed among them.
    fn order(&self, tried: &Tried) -> (Vec<usize>, Option<usize>);
    /// The round-robin schedule it picks from, if any ([`Selector::schedule`]).
    fn schedule(&self) -> Option<&Arc<WeightedRoundRobin>> {
        None
    }
}

/// Round-robin and priority share their whole request path; each says only how it orders.
#[async_trait]
impl<P: InProcess + Send + Sync> Selector for P {
    async fn admit(
        &self,
        state: &dyn StateStore,
        quota: Option<Acquire<'_>>,
        cost: u64,
        reserving: Option<Reserving<'_>>,
    ) -> Admission {
        let tried = Tried::default();
        match (self.limits(), reserving) {
            // The member is chosen before the quota is charged, so that a request with
            // nowhere to go costs nothing.
            (None, None) => charge(state, quota, self.pick(&tried)).await,
            // A reservation's entries come back only from an assignment: the store takes the
            // first of the order, as it would pick in process, and reserves in the same step.
            (None, Some(_)) => {
                let plain = Limits::plain(self.pool());
                choose_in_order(self, state, &plain, &tried, quota, cost, reserving).await
            }
            (Some(limits), _) => {
                choose_in_order(self, state, limits, &tried, quota, cost, reserving).await
            }
        }
    }

    fn admit_in_process(&self) -> Option<Admission> {
        // What `admit` does with neither limits, a quota nor a reservation (`charge` with no
        // quota), without its future.
        if self.limits().is_some() {
            return None;
        }
        Some(match self.pick(&Tried::default()) {
            Some(first) => Admission::Admitted {
                first: Some(first),
                quota: None,
                entries: Entries::default(),
            },
            None => Admission::NoMember { quota: None },
        })
    }

    async fn next(&self, state: &dyn StateStore, tried: &mut Tried) -> Option<Attempt> {
        match self.limits() {
            None => self.pick(tried),
            Some(limits) => {
                let reserving = tried.reserving();
                let admission =
                    choose_in_order(self, state, limits, tried, None, tried.cost, reserving).await;
                if let Admission::Admitted { entries, .. } = &admission {
                    tried.reserved(entries);
                }
                admission.into_attempt()
            }
        }
    }

    fn schedule(&self) -> Option<&Arc<WeightedRoundRobin>> {
        InProcess::schedule(self)
    }
}

/// The store's choice among what `policy` orders for a request that has `tried` some members.
async fn choose_in_order<P: InProcess + Sync>(
    policy: &P,
    state: &dyn StateStore,
    limits: &Limits,
    tried: &Tried,
    quota: Option<Acquire<'_>>,
    cost: u64,
    reserving: Option<Reserving<'_>>,
) -> Admission {
    let (order, trial) = policy.order(tried);
    if order.is_empty() {
        return Admission::NoMember { quota: None };
    }
    choose_among(
        state,
        policy.route(),
        policy.pool(),
        limits,
        &order,
        trial,
        quota,
        cost,
        reserving,
    )
    .await
}

/// Round-robin and priority on a route with member windows or cooldowns: the policy orders the
/// candidates in process (`order`, indexes, best first), and the store takes the first that is
/// not cooling and whose windows admit `cost`, with the route's quota, in one atomic step.
/// `trial` is a down member's claimed trial among them, given back unless it is chosen.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn choose_among(
    state: &dyn StateStore,
    route: &str,
    pool: &Arc<Members>,
    limits: &Limits,
    order: &[usize],
    trial: Option<usize>,
    quota: Option<Acquire<'_>>,
    cost: u64,
    reserving: Option<Reserving<'_>>,
) -> Admission {
    let claimed = trial.map(|i| Attempt::new(pool.clone(), i, true));
    // The attempt for the chosen member: the claimed trial if it is the one (any other
    // choice drops the claim, which gives the trial back).
    let pick = |index: usize, claimed: Option<Attempt>| {
        if Some(index) == trial {
            claimed
        } else {
            Some(Attempt::new(pool.clone(), index, false))
        }
    };
    let plan = limits.leases.as_ref();
    let lease_id = plan.map(LeasePlan::next_id);
    let ask = Assign {
        route,
        members: &limits.members,
        order: match plan {
            Some(p) if p.fewest => Order::LeastInFlight(order),
            _ => Order::Preference(order),
        },
        excluded: &[],
        quota,
        cost: cost.max(1),
        cooldowns: limits.cooldowns,
        at_us: None,
        lease: plan.zip(lease_id.as_deref()).map(|(p, id)| p.ask(id)),
        sticky: None,
    };
    let index_of = |id: &str| limits.members.iter().position(|m| &*m.id == id);
    match assign(state, ask, reserving).await {
        Ok((assignment, entries)) => {
            let lease = held(plan, lease_id, &assignment);
            Admission::of(assignment, entries, |member| {
                index_of(member)
                    .and_then(|i| pick(i, claimed))
                    .map(|a| a.leased(lease))
            })
        }
        // A full store refuses what it must count: a member whose windows were not charged
        // must not be sent the request (on a retry, nothing else would stop it).
        // (`ask` is `Copy`: the check runs only on this error path, not on every request.)
        Err(error @ StoreError::TooManyKeys) if counts_in_windows(&ask) => {
            given_back(plan, lease_id);
            Admission::StoreFailed {
                error,
                first: None,
                fallback: false,
            }
        }
        // The store cannot say: the in-process first choice goes, as on a route without
        // member limits, and the route's on_store_error decides.
        Err(error) => {
            given_back(plan, lease_id);
            Admission::StoreFailed {
                error,
                first: order.first().and_then(|&i| pick(i, claimed)),
                fallback: false,
            }
        }
    }
}

/// The guard of the lease `assignment` took under `id`, made as soon as the store answers so
/// that no path can lose it: dropped unused (no attempt for the member), it releases the lease.
pub(crate) fn held(
    plan: Option<&LeasePlan>,
    id: Option<Arc<str>>,
    assignment: &Assignment,
) -> Option<LeaseGuard> {
    match (plan, id, assignment) {
        (Some(plan), Some(id), Assignment::Assigned { .. }) => Some(plan.hold(id)),
        _ => None,
    }
}

/// The store failed an ask that carried lease `id`: the call may have run all the same (its
/// answer timed out or was lost on the way), and then holds a lease nobody would release. It is
/// released as a guard dropped unused would be; releasing a lease the store never took changes
/// nothing.
pub(crate) fn given_back(plan: Option<&LeasePlan>, id: Option<Arc<str>>) {
    if let (Some(plan), Some(id)) = (plan, id) {
        drop(plan.hold(id));
    }
}

/// What a request reserves in its route's windows when they count usage units or calendar
/// periods: admission goes through [`StateStore::assign_reserve`], whose entries settle it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reserving<'a> {
    /// Per window of the route's quota, its amount (millionths of a unit, or a request's cost).
    pub(crate) amounts: &'a [u64],
    /// Per window, its period; empty when every window slides.
    pub(crate) periods: &'a [Option<Period>],
    /// What the route's members' own windows are charged.
    pub(crate) members: &'a MemberPlan,
    /// Per window of the calling client's own, its amount (millionths of a unit, 0 for a unit
    /// the route does not meter, or a request's cost); empty: the cost in each.
    pub(crate) client: &'a [u64],
    /// Per window of the client's own, its period; empty when every window slides.
    pub(crate) client_periods: &'a [Option<Period>],
}

/// What a request charges the members' own windows, planned before admission; kept for a
/// retry, which reserves the same in the next member's windows.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemberPlan {
    /// Per member, in pool order, per window of its own, its amount.
    pub(crate) amounts: Vec<Vec<u64>>,
    /// Per member, per window, its period; empty for a member whose windows all slide.
    pub(crate) periods: Vec<Vec<Option<Period>>>,
    /// Per member, its windows, a calendar window's length its current period's.
    pub(crate) windows: Vec<Arc<[sluice_limiter::Window]>>,
}

impl MemberPlan {
    /// Whether some member has a calendar window.
    pub(crate) fn has_periods(&self) -> bool {
        self.periods.iter().any(|p| !p.is_empty())
    }
}

/// The entries a reservation recorded, which the request's settlement rewrites.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Entries {
    /// In the route's windows.
    pub(crate) route: Option<EntryId>,
    /// In the chosen member's own windows, with the member's id.
    pub(crate) member: Option<(Arc<str>, EntryId)>,
    /// In the calling client's own windows.
    pub(crate) client: Option<EntryId>,
}

/// Whether `ask` counts anything in a window: its route quota's, its client's or a member's.
/// A full store ([`StoreError::TooManyKeys`]: the memory store's key table, or Redis at its
/// `maxmemory`) refuses such a request rather than let it go unmetered; a request that counts
/// nothing goes on as on any store failure, chosen in process.
pub(crate) fn counts_in_windows(ask: &Assign<'_>) -> bool {
    ask.quota
        .as_ref()
        .is_some_and(|q| !q.windows.is_empty() || q.client.is_some())
        || ask.members.iter().any(|m| !m.windows.is_empty())
}

/// One assignment: [`StateStore::assign`], or with `reserving` [`StateStore::assign_reserve`],
/// which charges the route's windows and the members' their amounts and the client's own
/// windows (in requests) the request's cost, and answers the entries that settle them.
pub(crate) async fn assign(
    state: &dyn StateStore,
    ask: Assign<'_>,
    reserving: Option<Reserving<'_>>,
) -> Result<(Assignment, Entries), StoreError> {
    let Some(r) = reserving else {
        return Ok((state.assign(ask).await?, Entries::default()));
    };
    // The members with their calendar windows cut to the periods planned: a fixed window's
    // length is its period's.
    let cut: Option<Vec<PoolMember>> = r.members.has_periods().then(|| {
        ask.members
            .iter()
            .enumerate()
            .map(|(i, m)| PoolMember {
                id: m.id.clone(),
                windows: r
                    .members
                    .windows
                    .get(i)
                    .filter(|w| w.len() == m.windows.len())
                    .cloned()
                    .unwrap_or_else(|| m.windows.clone()),
            })
            .collect()
    });
    let ask = match &cut {
        Some(members) => Assign { members, ..ask },
        None => ask,
    };
    // A member's planned amounts when they match its windows; else its windows count
    // requests and take the cost.
    let member_amounts: Vec<Vec<u64>> = ask
        .members
        .iter()
        .enumerate()
        .map(|(i, m)| match r.members.amounts.get(i) {
            Some(a) if a.len() == m.windows.len() => a.clone(),
            _ => vec![ask.cost; m.windows.len()],
        })
        .collect();
    let members: Vec<MemberUsage<'_>> = member_amounts
        .iter()
        .enumerate()
        .map(|(i, amounts)| MemberUsage {
            amounts,
            periods: r
                .members
                .periods
                .get(i)
                .filter(|p| p.len() == amounts.len())
                .map_or(&[][..], |p| &p[..]),
        })
        .collect();
    let (client_cost, client_windows) = ask.quota.map_or((0, 0), |q| {
        (q.cost, q.client.map_or(0, |c| c.windows.len()))
    });
    let client = match r.client {
        planned if planned.len() == client_windows => planned.to_vec(),
        _ => vec![client_cost; client_windows],
    };
    let client_periods = match r.client_periods {
        planned if planned.len() == client_windows => planned,
        _ => &[],
    };
    let usage = Usage {
        route: r.amounts,
        route_periods: r.periods,
        members: &members,
        client: &client,
        client_periods,
    };
    let reserved = state.assign_reserve(ask, usage).await?;
    let member = match (&reserved.assignment, reserved.member) {
        (Assignment::Assigned { member, .. }, Some(entry)) => ask
            .members
            .iter()
            .find(|m| *m.id == **member)
            .map(|m| (m.id.clone(), entry)),
        _ => None,
    };
    let entries = Entries {
        route: reserved.route,
        member,
        client: reserved.client,
    };
    Ok((reserved.assignment, entries))
}

/// The round-robin schedule over `pool`. A table that keeps the previous table's member set
/// (its upstream is unchanged) keeps its schedule too, so requests of both tables share one
/// cursor; a new member set gets a new schedule that goes on from the old position, so a
/// reload does not send the next requests to the first members again.
fn schedule_for(pool: &Arc<Members>, before: Option<&Policy>) -> Arc<WeightedRoundRobin> {
    let before = before.and_then(Policy::schedule);
    match before {
        Some(b) if Arc::ptr_eq(b.members(), pool) => b.clone(),
        _ => {
            let schedule = WeightedRoundRobin::new(pool.clone());
            if let Some(b) = before {
                schedule.resume_at(b.cursor());
            }
            schedule
        }
    }
}

/// One try of one member: the request's claim on it, until the try's outcome is known.
///
/// A down member's single trial request is a claim on the whole member: nobody else may try
/// it until this request reports. If the request ends first (refused by its quota, the client
/// gone, an error before connecting), dropping the attempt gives the trial back, so the member
/// is tried again by the next request rather than waiting forever.
pub(crate) struct Attempt {
    pool: Arc<Members>,
    index: usize,
    trial: bool,
    settled: bool,
    /// The request's lease on the member, released when the attempt ends (the request is
    /// done, or it moves to another member).
    lease: Option<LeaseGuard>,
}

impl Attempt {
    pub(crate) fn new(pool: Arc<Members>, index: usize, trial: bool) -> Attempt {
        Attempt {
            pool,
            index,
            trial,
            settled: false,
            lease: None,
        }
    }

    /// The attempt holding `lease` on its member.
    pub(crate) fn leased(mut self, lease: Option<LeaseGuard>) -> Attempt {
        self.lease = lease;
        self
    }

    /// The member's index in the route's pool.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// The attempt's lease, taken out to be released before the request asks the store again
    /// ([`LeaseGuard::release`]).
    pub(crate) fn take_lease(&mut self) -> Option<LeaseGuard> {
        self.lease.take()
    }

    /// A trial that the member cannot take now (it cools, or its own windows are full): given
    /// back to be claimed again `after` this, not by the very next request.
    pub(crate) fn put_off(&mut self, after: std::time::Duration) {
        if self.trial && !self.settled {
            self.settled = true;
            self.pool.release_trial(self.index, Instant::now() + after);
        }
    }

    /// The connection is made: the member is reachable, which is all passive health asks.
    pub(crate) fn connected(&mut self) {
        if !self.settled {
            self.settled = true;
            self.pool.report_success(self.index);
        }
    }

    /// The connection failed or timed out: nothing was sent, so another member may be tried.
    pub(crate) fn failed_to_connect(&mut self) {
        if !self.settled {
            self.settled = true;
            self.pool.report_connect_failure(self.index, Instant::now());
        }
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if self.trial && !self.settled {
            self.pool.release_trial(self.index, Instant::now());
        }
    }
}

/// The members a request has tried, and whether its least-used selection fell back to
/// round-robin. Retries are few, so a small inline array avoids an allocation per request;
/// past it, the oldest entries are forgotten, which at worst lets a very long retry chain
/// revisit a member that the pool has meanwhile marked down anyway.
#[derive(Default)]
pub(crate) struct Tried {
    indexes: [u32; 8],
    len: usize,
    /// The least-used store failed for this request: it goes on with round-robin.
    pub(crate) fallback: bool,
    /// The request's cost, which another member's own windows are charged on a retry of a
    /// request that reserved nothing.
    pub(crate) cost: u64,
    /// What a retry reserves in the next member's own windows: the request's planned amounts,
    /// when a member has windows of its own.
    pub(crate) members: Option<Arc<MemberPlan>>,
    /// The entries retries reserved in members' own windows ([`Tried::members`]), with each
    /// member's id, which the request's settlement closes.
    pub(crate) retried: Vec<(Arc<str>, EntryId)>,
}

impl Tried {
    /// A retry's reservation in the members' own windows: only theirs, the amounts and periods
    /// of the request's admission. `None` when the request reserved nothing in members' windows
    /// (a plain assignment then charges the cost).
    pub(crate) fn reserving(&self) -> Option<Reserving<'_>> {
        self.members.as_deref().map(|members| Reserving {
            amounts: &[],
            periods: &[],
            members,
            client: &[],
            client_periods: &[],
        })
    }

    /// Keeps the member's entry a retry reserved, for the request's settlement.
    pub(crate) fn reserved(&mut self, entries: &Entries) {
        if let Some(member) = &entries.member {
            self.retried.push(member.clone());
        }
    }

    pub(crate) fn push(&mut self, index: usize) {
        self.indexes[self.len % self.indexes.len()] = index as u32;
        self.len += 1;
    }

    pub(crate) fn contains(&self, index: usize) -> bool {
        self.indexes[..self.len.min(self.indexes.len())].contains(&(index as u32))
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.indexes[..self.len.min(self.indexes.len())]
            .iter()
            .map(|&i| i as usize)
    }

    /// The member of the latest attempt.
    pub(crate) fn last(&self) -> Option<usize> {
        let n = self.indexes.len();
        (self.len > 0).then(|| self.indexes[(self.len - 1) % n] as usize)
    }

    /// How many attempts were made.
    pub(crate) fn count(&self) -> usize {
        self.len
    }
}

/// Charges the route quota for a member already chosen in process; gives the member back (by
/// dropping the attempt) when the quota refuses or fails.
pub(crate) async fn charge(
    state: &dyn StateStore,
    quota: Option<Acquire<'_>>,
    attempt: Option<Attempt>,
) -> Admission {
    let Some(first) = attempt else {
        return Admission::NoMember { quota: None };
    };
    let Some(ask) = quota else {
        return Admission::Admitted {
            first: Some(first),
            quota: None,
            entries: Entries::default(),
        };
    };
    match state.acquire(ask).await {
        Ok(outcome) if outcome.admitted => Admission::Admitted {
            first: Some(first),
            quota: Some(outcome),
            entries: Entries::default(),
        },
        Ok(outcome) => Admission::QuotaRefused(outcome),
        Err(error) => Admission::StoreFailed {
            error,
            first: Some(first),
            fallback: false,
        },
    }
    // A refused request drops `first` here, which gives back a claimed trial.
}

#[cfg(test)]
mod tests;
