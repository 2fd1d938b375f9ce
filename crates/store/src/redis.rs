//! The shared backend: every instance on one Redis (or Redis Cluster) sees the same quotas, the
//! same assignment counts, member windows and cooldowns. Each request costs at most one call
//! (`FCALL`, or `EVALSHA` where Redis takes no functions): the quota script, the allocator
//! script, both fused into one, or (with member windows, cooldowns or a preference order) the
//! assign script, which does all of it. A quota, allocator or fused call decides every request of
//! its route (and quota key) that waits for one (batch.rs).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::Value;

use sluice_allocator::{
    Assign, Assignment, ClientCap, Lease, MemberUsage, Order, PoolMember, Reserved, StateStore,
    StickyCounts, SubLogStart, Usage,
};
use sluice_limiter::{
    check_amounts, check_periods, placement, Acquire, ClientWindows, Outcome, Owner, Period,
    Reservation, Reserve, Settle, Settled, StoreError, Window, WindowState, WindowUsage,
    MAX_AMOUNT,
};

use crate::batch::{Ask, Batches};

/// A route's sticky keys (`lua/sticky.lua`): expiries (`sz`), session → member (`sh`), and the
/// counters (`sc`).
const STICKY_KEYS: [&str; 3] = ["}:sz", "}:sh", "}:sc"];
use crate::call::ScriptCall;
use crate::connection::RedisConnection;
use crate::keys::Keys;
use crate::scripts::{self, Scripts};
use crate::settle_batch::{settle_call, Owned, SettleBatches};
use crate::shards::Shards;
use sub_logs::{by_figure, per_member};
use written::WrittenCalls;

// A route kept as sub-logs: how a call goes to one of them, or to each.
mod sub_logs;
// Key-pool calls written once per route's shape and shared.
mod written;

/// How to reach a single Redis, for a store with a connection of its own.
#[derive(Debug, Clone)]
pub struct RedisStoreConfig {
    /// `redis://host:port/db`.
    pub url: String,
    /// First part of every key.
    pub key_prefix: String,
    /// Time allowed for one call, retry included; past it the caller's policy applies.
    pub timeout: Duration,
}

/// Quotas and least-used pools shared by every gateway instance that uses the same Redis.
pub struct RedisStore {
    connection: Arc<RedisConnection>,
    scripts: Arc<Scripts>,
    keys: Arc<Keys>,
    /// The fused quota + least-used calls and the plain quota ones, batched per route and quota
    /// key; the plain least-used ones, per route (batch.rs).
    batches: Arc<Batches>,
    /// Settlements, batched per route (and, on Cluster, per client's slot).
    settles: Arc<SettleBatches>,
    /// The routes whose state is split into sub-logs (`state_shards`).
    shards: Arc<Shards>,
    /// The general script's calls that depend on their route's configuration alone.
    written: WrittenCalls,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store with a connection of its own.
    pub fn new(config: RedisStoreConfig) -> Result<RedisStore, StoreError> {
        let connection = Arc::new(RedisConnection::new(&config.url, config.timeout)?);
        Ok(RedisStore::with_connection(connection, &config.key_prefix))
    }

    /// A store on a (possibly shared) connection, with keys under `key_prefix`.
    pub fn with_connection(connection: Arc<RedisConnection>, key_prefix: &str) -> RedisStore {
        let scripts = Arc::new(Scripts::new());
        let keys = Arc::new(Keys::new(key_prefix));
        RedisStore {
            settles: Arc::new(SettleBatches::new(
                connection.clone(),
                scripts.clone(),
                keys.clone(),
            )),
            batches: Arc::new(Batches::new(
                connection.clone(),
                scripts.clone(),
                keys.clone(),
                true,
            )),
            connection,
            scripts,
            keys,
            shards: Arc::new(Shards::default()),
            written: WrittenCalls::default(),
        }
    }

    /// With `false`, every request makes its own call, and so does each settlement (for
    /// comparing latency and for debugging); by default, requests of one route that wait for
    /// a call together share one (batch.rs, settle_batch.rs).
    pub fn with_batching(mut self, on: bool) -> RedisStore {
        self.batches = Arc::new(Batches::new(
            self.connection.clone(),
            self.scripts.clone(),
            self.keys.clone(),
            on,
        ));
        self
    }

    /// This instance's index (`state.redis.instance_index`): a route with
    /// `state_shards_start: home` starts each request at sub-log `index mod S`. Instances with
    /// indices 0, 1, 2, … start at every sub-log in turn, so their requests spread over the
    /// sub-logs as evenly as the instances' loads. Without one, a `home` route takes its
    /// sub-logs in turn, as `round_robin` does. It sets the index only: routes already set
    /// ([`StateStore::shard_routes`]) stay, and start at the new own sub-log.
    pub fn with_instance_index(self, index: u32) -> RedisStore {
        self.shards.set_instance(index);
        self
    }

    /// The key schema this store writes.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// Whether calls go as `FCALL` of sluice's function library; `false` once Redis has
    /// refused functions (Redis 6, an ACL without them), and calls go as `EVALSHA`.
    pub fn uses_functions(&self) -> bool {
        self.scripts.library.functions()
    }

    /// The name of the function library this version loads (`sluice_` and a hash of its
    /// text).
    pub fn library_name(&self) -> &str {
        &self.scripts.library.name
    }

    /// One allocator call on the pool of `route`: `leading` arguments, then the excluded ids.
    async fn allocator(
        &self,
        route: &str,
        leading: &[&str],
        excluded: &[&str],
    ) -> Result<Value, StoreError> {
        let mut call = ScriptCall::new(&self.scripts.library, &self.scripts.allocator, 1);
        call.key(&self.keys.pool_parts(route));
        for a in leading {
            call.arg(*a);
        }
        call.excluded(excluded);
        self.invoke(&call).await
    }

    async fn invoke<T: redis::FromRedisValue>(
        &self,
        call: &ScriptCall<'_>,
    ) -> Result<T, StoreError> {
        self.connection
            .run(|mut conn| async move { call.invoke::<T>(&mut conn).await })
            .await
    }

    /// One assignment; `None` when the pool does not exist and must be synced first.
    async fn assign_once(&self, ask: &Assign<'_>) -> Result<Option<Assignment>, StoreError> {
        let client = ask.quota.and_then(|q| q.client);
        if matches!(ask.order, Order::LeastUsed)
            && client.is_none()
            && ask.lease.is_none()
            && ask.sticky.is_none()
            && !ask.cooldowns
            && !ask
                .members
                .iter()
                .any(|m| !m.windows.is_empty() && !ask.excluded.contains(&&*m.id))
        {
            return self.least_used_once(ask).await;
        }
        Ok(self
            .assign_script(ask, None)
            .await?
            .map(|reserved| reserved.assignment))
    }

    /// One assignment by the general script, reserving `usage` when given; `None` when the pool
    /// does not exist and must be synced first.
    async fn assign_script(
        &self,
        ask: &Assign<'_>,
        usage: Option<&Usage<'_>>,
    ) -> Result<Option<Reserved>, StoreError> {
        // Nothing of the route's to reserve or check (on a Cluster, also after a client's
        // windows decided in their own slot): no call, with or without a reservation. The call
        // would name no key, and a call without a key goes to any node, where a replica refuses
        // it (READONLY) and the route's `on_store_error` would decide a request that needs no
        // store at all.
        if let Some(assignment) = Self::trivial_preference(ask) {
            return Ok(Some(Reserved {
                assignment,
                route: None,
                member: None,
                client: None,
            }));
        }
        let client = ask.quota.and_then(|q| q.client);
        let quota = self.quota_of(ask).filter(|q| !q.windows.is_empty());
        // A lease, a sticky session, a client's windows (on Redis Cluster, in another slot) and
        // a reservation keep a call of their own: their state is not the route's alone, or
        // their reply is of another kind. Others go with the requests of their route and quota
        // key that wait for a call (batch.rs), and those whose call depends on the route's
        // configuration alone share one call written once (written.rs).
        let alone = ask.lease.is_some() || ask.sticky.is_some() || client.is_some();
        let reply: Value = if alone || usage.is_some() {
            self.invoke(&self.write_assign(ask, usage)).await?
        } else {
            let call = if WrittenCalls::fit_for(ask) {
                let fcall = self.scripts.library.functions();
                self.written.get_or_write(ask, quota.as_ref(), fcall, || {
                    self.write_assign(ask, None).into_parts()
                })
            } else {
                Arc::new(self.write_assign(ask, None).into_parts())
            };
            let (key, windows) = quota.as_ref().map_or(("", &[][..]), |q| (q.key, q.windows));
            let at_us = ask.at_us.or(ask.quota.and_then(|q| q.at_us));
            let ask = Ask::assign(ask.route, key, windows, at_us, call);
            self.batches.decide(ask).await?
        };
        let windows = quota.map_or(0, |q| q.windows.len()) + client.map_or(0, |c| c.windows.len());
        let replied = (quota.is_some() || client.is_some()).then_some(windows);
        if usage.is_none() {
            return Ok(
                scripts::parse_assign(&reply, replied)?.map(|assignment| Reserved {
                    assignment,
                    route: None,
                    member: None,
                    client: None,
                }),
            );
        }
        scripts::parse_assign_reserved(&reply, replied)
    }

    /// The call of the general script for `ask`, reserving `usage` when given.
    fn write_assign(&self, ask: &Assign<'_>, usage: Option<&Usage<'_>>) -> ScriptCall<'_> {
        let client = ask.quota.and_then(|q| q.client);
        let route = ask.route;
        let least_used = matches!(ask.order, Order::LeastUsed);
        // The route's own quota, when it has windows: a client's windows may come without one.
        let quota = self.quota_of(ask).filter(|q| !q.windows.is_empty());
        let cost = ask.quota.map_or(0, |q| q.cost);
        // The members the script needs: for least-used, those with windows (the others admit
        // anything); for a preference, every candidate, best first. Excluded ones never.
        // least_in_flight: the script orders the candidates by their leases.
        let preference: &[usize] = match ask.order {
            Order::LeastUsed => &[],
            Order::Preference(order) | Order::LeastInFlight(order) => order,
        };
        let members = || {
            let unlimited = least_used
                .then_some(ask.members.iter().enumerate())
                .into_iter()
                .flatten();
            unlimited
                .filter(|(_, m)| !m.windows.is_empty())
                .chain(
                    preference
                        .iter()
                        .filter_map(|&i| ask.members.get(i).map(|m| (i, m))),
                )
                .filter(|(_, m)| !ask.excluded.contains(&&*m.id))
        };
        // The command names its keys before its arguments, so they are counted first.
        let keys = usize::from(least_used)
            + usize::from(ask.cooldowns)
            + quota.as_ref().map_or(0, |q| 1 + q.windows.len())
            + client.map_or(0, |c| 1 + c.windows.len())
            + members()
                .filter(|(_, m)| !m.windows.is_empty())
                .map(|(_, m)| 1 + m.windows.len())
                .sum::<usize>()
            + match ask.lease {
                Some(Lease {
                    client: Some(_), ..
                }) => 4,
                Some(_) => 3,
                None => 0,
            }
            + if ask.sticky.is_some() { 3 } else { 0 };
        let mut call = ScriptCall::new(&self.scripts.library, &self.scripts.assign, keys);
        if least_used {
            call.key(&self.keys.pool_parts(route));
        }
        if ask.cooldowns {
            call.key(&self.keys.cooldowns_parts(route));
        }
        if let Some(q) = &quota {
            self.push_quota_keys(&mut call, q);
        }
        if let Some(c) = client {
            self.push_client_keys(&mut call, c);
        }
        for (_, m) in members() {
            if !m.windows.is_empty() {
                call.key(&self.keys.member_meta_parts(route, &m.id));
                for w in m.windows.iter() {
                    call.key(&self.keys.member_log_parts(route, &w.name, &m.id));
                }
            }
        }
        // The sticky keys, then the lease keys, come last (sticky.lua, leases.lua).
        if ask.sticky.is_some() {
            for which in STICKY_KEYS {
                call.key(&self.keys.lease_parts(route, which));
            }
        }
        if let Some(lease) = ask.lease {
            for which in ["}:lz", "}:lh", "}:lc"] {
                call.key(&self.keys.lease_parts(route, which));
            }
            if let Some(cap) = lease.client {
                call.key(&self.keys.client_leases_parts(cap.name));
            }
        }
        // One clock for the whole decision, as in memory.
        match ask.at_us.or(ask.quota.and_then(|q| q.at_us)) {
            Some(t) => call.arg(t),
            None => call.arg(""),
        };
        let order = match (least_used, client.is_some(), usage.is_some()) {
            (true, false, false) => "L",
            (false, false, false) => "P",
            (true, true, false) => "Lc",
            (false, true, false) => "Pc",
            (true, false, true) => "Lu",
            (false, false, true) => "Pu",
            (true, true, true) => "Lcu",
            (false, true, true) => "Pcu",
        };
        let leasing;
        let order = match (ask.sticky.is_some(), ask.lease.is_some()) {
            (false, false) => order,
            (sticky, lease) => {
                leasing = format!(
                    "{order}{}{}",
                    if sticky { "s" } else { "" },
                    if lease { "l" } else { "" }
                );
                &leasing
            }
        };
        call.arg(ask.cost)
            .arg(order)
            .arg(if ask.cooldowns { "1" } else { "0" });
        match &quota {
            Some(q) => {
                call.arg(q.windows.len()).arg(q.cost);
                match usage {
                    None => {
                        for w in q.windows {
                            call.arg(&*w.name).arg(w.limit).arg(w.length_us);
                        }
                    }
                    Some(u) => usage_args(&mut call, q.windows, u.route, u.route_periods),
                }
            }
            None => {
                call.arg("").arg(cost);
            }
        }
        if let Some(c) = client {
            call.arg(c.windows.len());
            match usage {
                None => {
                    for w in c.windows {
                        call.arg(&*w.name).arg(w.limit).arg(w.length_us);
                    }
                }
                Some(u) => usage_args(&mut call, c.windows, u.client, u.client_periods),
            }
        }
        call.excluded(if least_used { ask.excluded } else { &[] });
        // Per member: its id, then its window count and windows, in the order of its keys
        // above, or "=" when they are the previous member's (members.lua, members_step).
        call.arg(members().count());
        // A member's usage: its amounts and periods, the same for members whose windows are.
        let mine = |i: usize| {
            usage
                .and_then(|u| u.members.get(i))
                .copied()
                .unwrap_or_default()
        };
        let mut previous: Option<(&[Window], MemberUsage<'_>)> = None;
        for (i, m) in members() {
            call.arg(&*m.id);
            let this = (&*m.windows, mine(i));
            if previous.is_some_and(|(w, u)| {
                w == this.0 && u.amounts == this.1.amounts && u.periods == this.1.periods
            }) {
                call.arg("=");
                continue;
            }
            call.arg(m.windows.len());
            match usage {
                None => {
                    for w in m.windows.iter() {
                        call.arg(&*w.name).arg(w.limit).arg(w.length_us);
                    }
                }
                Some(_) => usage_args(&mut call, &m.windows, this.1.amounts, this.1.periods),
            }
            previous = Some(this);
        }
        // The sticky ask, then how many arguments it takes (sticky.lua, sticky_ask).
        if let Some(sticky) = ask.sticky {
            call.arg(sticky.session)
                .arg(sticky.ttl_us)
                .arg(sticky.max_bindings)
                .arg(3);
        }
        // The lease ask, then how many arguments it takes (leases.lua, leases_ask).
        if let Some(lease) = ask.lease {
            let max = |m: Option<u64>| m.map_or(String::new(), |m| m.to_string());
            call.arg(lease.id)
                .arg(lease.ttl_us)
                .arg(max(lease.member_max))
                .arg(max(lease.route_max))
                .arg(if matches!(ask.order, Order::LeastInFlight(_)) {
                    "I"
                } else {
                    "-"
                });
            match lease.client {
                Some(cap) => call.arg(cap.max).arg(6),
                None => call.arg(5),
            };
        }
        call
    }

    /// A reservation by the usage script, in the windows of `owner`: the route quota key's, or
    /// (`Owner::Client`, `req.key` the client's name) a client's own.
    async fn reserve_call(
        &self,
        req: &Reserve<'_>,
        owner: Owner,
    ) -> Result<Reservation, StoreError> {
        let mut call = ScriptCall::new(
            &self.scripts.library,
            &self.scripts.usage,
            1 + req.windows.len(),
        );
        if owner == Owner::Client {
            call.key(&self.keys.client_meta_parts(req.key));
            for w in req.windows {
                call.key(&self.keys.client_log_parts(req.key, &w.name));
            }
        } else {
            call.key(&self.keys.quota_meta_parts(req.route, req.key));
            for w in req.windows {
                call.key(&self.keys.quota_log_parts(req.route, &w.name, req.key));
            }
        }
        call.arg("reserve");
        match req.at_us {
            Some(t) => call.arg(t),
            None => call.arg(""),
        };
        // A fixed window's length is its period's span, and its entry lies that far before the
        // period's end (`placement`).
        usage_args(&mut call, req.windows, req.amounts, req.periods);
        let reply: Vec<i64> = self.invoke(&call).await?;
        scripts::parse_reservation(&reply, req.windows.len())
    }

    /// An assignment that reserves usage in one call (single Redis, or no client's windows).
    async fn assign_reserve_route(
        &self,
        ask: Assign<'_>,
        usage: Usage<'_>,
    ) -> Result<Reserved, StoreError> {
        if let Some(reserved) = self.assign_script(&ask, Some(&usage)).await? {
            return Ok(reserved);
        }
        // The pool is missing (first use, or Redis restarted empty), as in `assign`.
        let ids: Vec<Arc<str>> = ask.members.iter().map(|m| m.id.clone()).collect();
        self.sync_one(ask.route, &ids, ask.excluded).await?;
        self.assign_script(&ask, Some(&usage))
            .await?
            .ok_or_else(|| StoreError::Backend("the pool vanished right after its sync".into()))
    }

    /// Redis Cluster, as `decide_split`: the client's windows reserve first, in their own slot;
    /// the route assigns only when they admit, and when it then assigns nobody (or cannot be
    /// asked) the client's entry is settled to nothing. When the client refuses, the route's
    /// windows are read, charging nothing, for the answer.
    async fn reserve_split(
        &self,
        ask: Assign<'_>,
        usage: Usage<'_>,
        client: ClientWindows<'_>,
    ) -> Result<Reserved, StoreError> {
        let Some(quota) = ask.quota else {
            return Err(StoreError::Backend(
                "a client's windows without a quota".into(),
            ));
        };
        let at_us = ask.at_us.or(quota.at_us);
        let mine = Reserve {
            route: ask.route,
            key: client.name,
            windows: client.windows,
            amounts: usage.client,
            at_us,
            periods: usage.client_periods,
        };
        let reservation = self.reserve_call(&mine, Owner::Client).await?;
        let unassigned = |assignment| Reserved {
            assignment,
            route: None,
            member: None,
            client: None,
        };
        if !reservation.outcome.admitted {
            let read = if quota.windows.is_empty() {
                None
            } else {
                let read = Acquire {
                    cost: 0,
                    client: None,
                    at_us,
                    ..quota
                };
                Some(
                    self.route_acquire(&read)
                        .await
                        .unwrap_or_else(|_| untouched(quota.windows)),
                )
            };
            return Ok(unassigned(Assignment::QuotaRefused(join(
                read,
                reservation.outcome,
            ))));
        }
        let plain = Assign {
            quota: Some(Acquire {
                client: None,
                ..quota
            })
            .filter(|q| !q.windows.is_empty()),
            ..ask
        };
        let decided = self.assign_reserve_route(plain, usage).await;
        let assigned = matches!(
            decided,
            Ok(Reserved {
                assignment: Assignment::Assigned { .. },
                ..
            })
        );
        let mut mine = reservation.outcome;
        if let (Some(entry), false) = (reservation.entry, assigned) {
            let nothing = vec![0; client.windows.len()];
            let back = Settle {
                key: client.name,
                windows: client.windows,
                entry,
                reserved: usage.client,
                settled: &nothing,
                periods: usage.client_periods,
                owner: Owner::Client,
            };
            // When Redis cannot be asked, the reservation stands until it leaves the client's
            // windows: the client is refused early, never admitted over its limit.
            if settle_call(
                &self.connection,
                &self.scripts,
                &self.keys,
                ask.route,
                &[&back],
                at_us,
            )
            .await
            .is_ok()
            {
                for ((state, w), &amount) in mine
                    .windows
                    .iter_mut()
                    .zip(client.windows)
                    .zip(usage.client)
                {
                    state.remaining = state
                        .remaining
                        .saturating_add(amount.min(MAX_AMOUNT))
                        .min(w.limit);
                }
            }
        }
        let mut reserved = decided?;
        reserved.client = reservation.entry.filter(|_| assigned);
        reserved.assignment = with_client(reserved.assignment, mine);
        Ok(reserved)
    }

    /// A client's keys, as the client script and the assign script take them: its helper hash,
    /// then one log per window.
    fn push_client_keys(&self, call: &mut ScriptCall<'_>, c: ClientWindows<'_>) {
        call.key(&self.keys.client_meta_parts(c.name));
        for w in c.windows {
            call.key(&self.keys.client_log_parts(c.name, &w.name));
        }
    }

    /// A request against a client's own windows, with its route's (`with_route`, when it has
    /// any) in the same call: the client script. Returns the decision, the route's windows
    /// first, and the client's entry when it was recorded.
    async fn client_decide(
        &self,
        req: &Acquire<'_>,
        client: ClientWindows<'_>,
        with_route: bool,
    ) -> Result<(Outcome, Option<String>), StoreError> {
        let route: &[Window] = if with_route { req.windows } else { &[] };
        let keys = if route.is_empty() { 0 } else { 1 + route.len() } + 1 + client.windows.len();
        let mut call = ScriptCall::new(&self.scripts.library, &self.scripts.client, keys);
        if !route.is_empty() {
            self.push_quota_keys(&mut call, req);
        }
        self.push_client_keys(&mut call, client);
        call.arg("decide").arg(req.cost);
        match req.at_us {
            Some(t) => call.arg(t),
            None => call.arg(""),
        };
        call.arg(route.len());
        for w in route.iter().chain(client.windows) {
            call.arg(&*w.name).arg(w.limit).arg(w.length_us);
        }
        let reply: Value = self.invoke(&call).await?;
        scripts::parse_client(&reply, route.len() + client.windows.len())
    }

    /// Takes back a client's `entry`, charged by its own call (Redis Cluster) for a request
    /// that its route then refused. When Redis cannot be asked, the charge stands until it
    /// leaves the client's windows: the client is refused early, never admitted over its limit.
    async fn give_back(&self, client: ClientWindows<'_>, entry: &str) {
        let mut call = ScriptCall::new(
            &self.scripts.library,
            &self.scripts.client,
            1 + client.windows.len(),
        );
        self.push_client_keys(&mut call, client);
        call.arg("back").arg(entry);
        for w in client.windows {
            call.arg(&*w.name);
        }
        let _ = self.invoke::<Value>(&call).await;
    }

    /// Redis Cluster: a client's windows live in a slot of their own, apart from every route's,
    /// so no script can decide both. The client's go first, in a call of their own; the route
    /// decides only when they admit, and when it then refuses (or cannot be asked), the
    /// client's charge is given back. When the client refuses, the route's windows are read,
    /// charging nothing, for the answer's `RateLimit`.
    async fn decide_split<F, Fut>(
        &self,
        req: &Acquire<'_>,
        client: ClientWindows<'_>,
        route: F,
    ) -> Result<Assignment, StoreError>
    where
        F: FnOnce(bool) -> Fut,
        Fut: std::future::Future<Output = Result<Assignment, StoreError>>,
    {
        let (mine, entry) = self.client_decide(req, client, false).await?;
        if !mine.admitted {
            let read = if req.windows.is_empty() {
                None
            } else {
                let read = Acquire {
                    cost: 0,
                    client: None,
                    ..*req
                };
                Some(match self.route_acquire(&read).await {
                    Ok(outcome) => outcome,
                    // The client's refusal stands whatever the route holds.
                    Err(_) => untouched(req.windows),
                })
            };
            return Ok(Assignment::QuotaRefused(join(read, mine)));
        }
        let decided = route(!req.windows.is_empty()).await;
        let assigned = matches!(decided, Ok(Assignment::Assigned { .. }));
        let mine = match (&entry, assigned) {
            (Some(entry), false) => {
                self.give_back(client, entry).await;
                given_back(mine, client.windows, req.cost)
            }
            _ => mine,
        };
        Ok(with_client(decided?, mine))
    }

    /// One request against its route's quota alone: the quota script, with the other requests
    /// of its route and quota key that wait for a call (batch.rs).
    async fn route_acquire(&self, req: &Acquire<'_>) -> Result<Outcome, StoreError> {
        let reply = self.batches.decide(Ask::quota(req)).await?;
        let reply: Vec<i64> = redis::from_redis_value(reply)
            .map_err(|e| StoreError::Backend(format!("unexpected quota reply: {e}")))?;
        scripts::parse_quota(&reply, req.windows.len())
    }

    /// An assignment without a client's windows, or with them on a single Redis (one call).
    // `ask` by reference, here and in `assign_one`: held by value, each level of these futures
    // kept it twice (rustc stores an argument and its binding apart), and the request's future
    // grew by it at each level.
    async fn assign_route(&self, ask: &Assign<'_>) -> Result<Assignment, StoreError> {
        if let Some(a) = self.assign_once(ask).await? {
            return Ok(a);
        }
        // The pool is missing: first use, or Redis restarted empty. Counts start again from
        // the agreed floor, and the request goes on. Boxed: it happens rarely, and inline it
        // would make every request's future larger (see `StateStore::assign`).
        Box::pin(async {
            let ids: Vec<Arc<str>> = ask.members.iter().map(|m| m.id.clone()).collect();
            self.sync_one(ask.route, &ids, ask.excluded).await?;
            self.assign_once(ask)
                .await?
                .ok_or_else(|| StoreError::Backend("the pool vanished right after its sync".into()))
        })
        .await
    }

    /// One call of the lease script on `route`'s leases (lease_run.lua).
    async fn lease_call(
        &self,
        route: &str,
        op: &str,
        ttl_us: Option<u64>,
        leases: &[&str],
        at_us: Option<u64>,
    ) -> Result<Value, StoreError> {
        if leases.is_empty() && op != "read" {
            return Ok(Value::Nil);
        }
        let mut call = ScriptCall::new(&self.scripts.library, &self.scripts.lease, 3);
        for which in ["}:lz", "}:lh", "}:lc"] {
            call.key(&self.keys.lease_parts(route, which));
        }
        call.arg(op);
        match at_us {
            Some(t) => call.arg(t),
            None => call.arg(""),
        };
        if let Some(ttl) = ttl_us {
            call.arg(ttl);
        }
        for id in leases {
            call.arg(*id);
        }
        self.invoke(&call).await
    }

    /// One call of the lease script on `client`'s leases (lease_run.lua's "client_…" ops).
    async fn client_lease_call(&self, client: &str, args: &[&str]) -> Result<Value, StoreError> {
        let mut call = ScriptCall::new(&self.scripts.library, &self.scripts.lease, 1);
        call.key(&self.keys.client_leases_parts(client));
        for arg in args {
            call.arg(*arg);
        }
        self.invoke(&call).await
    }

    /// On Redis Cluster, an ask whose lease counts in a client's own leases: those live in the
    /// client's slot, so (as its windows, `decide_split`) its lease is taken first by a call of
    /// its own, and the route's step goes without it. `None` elsewhere.
    fn client_lease_split<'a>(&self, ask: &Assign<'a>) -> Option<(Lease<'a>, ClientCap<'a>)> {
        let lease = ask.lease?;
        let cap = lease.client?;
        self.connection.is_cluster().then_some((lease, cap))
    }

    /// Takes the client's part of `lease` in its own slot; false when the client holds its cap.
    async fn client_take(
        &self,
        lease: Lease<'_>,
        cap: ClientCap<'_>,
        at_us: Option<u64>,
    ) -> Result<bool, StoreError> {
        let at = at_us.map_or(String::new(), |t| t.to_string());
        let (ttl, max) = (lease.ttl_us.to_string(), cap.max.to_string());
        let args = ["client_take", &at, lease.id, &ttl, &max];
        let reply = self.client_lease_call(cap.name, &args).await?;
        Ok(matches!(reply, Value::Int(1)))
    }

    /// Gives the client's part of a lease back when the route then assigned nobody. When Redis
    /// cannot be asked, the lease counts in the client's until its ttl: the client is refused
    /// early, never admitted over its cap.
    async fn client_give_back(&self, cap: ClientCap<'_>, id: &str) {
        let _ = self
            .client_lease_call(cap.name, &["client_release", "", id])
            .await;
    }

    /// One call of the sticky script on `route`'s bindings (sticky_run.lua).
    async fn sticky_call(
        &self,
        route: &str,
        args: &[&str],
        at_us: Option<u64>,
    ) -> Result<Value, StoreError> {
        let mut call = ScriptCall::new(&self.scripts.library, &self.scripts.sticky, 3);
        for which in STICKY_KEYS {
            call.key(&self.keys.lease_parts(route, which));
        }
        call.arg(args[0]);
        match at_us {
            Some(t) => call.arg(t),
            None => call.arg(""),
        };
        for a in &args[1..] {
            call.arg(*a);
        }
        self.invoke(&call).await
    }

    /// A quota's keys, in the quota library's order: the helper hash, then one log per window.
    fn push_quota_keys(&self, call: &mut ScriptCall<'_>, q: &Acquire<'_>) {
        call.key(&self.keys.quota_meta_parts(q.route, q.key));
        for w in q.windows {
            call.key(&self.keys.quota_log_parts(q.route, &w.name, q.key));
        }
    }

    /// The route quota of `ask`, on the assignment's clock.
    fn quota_of<'a>(&self, ask: &Assign<'a>) -> Option<Acquire<'a>> {
        ask.quota.map(|q| Acquire {
            at_us: ask.at_us.or(q.at_us),
            ..q
        })
    }

    /// A least-used assignment with no member windows and no cooldowns: the allocator script,
    /// or the fused one with a route quota (fewer commands than the general script), which
    /// goes with the other requests of its route (and quota key) that wait for a call
    /// (batch.rs).
    async fn least_used_once(&self, ask: &Assign<'_>) -> Result<Option<Assignment>, StoreError> {
        let quota = self.quota_of(ask);
        let reply = match &quota {
            None => Ask::least_used(ask.route, ask.excluded),
            Some(q) => Ask::fused(q, ask.excluded),
        };
        let reply = self.batches.decide(reply).await?;
        scripts::parse_assignment(&reply, quota.map(|q| q.windows.len()))
    }

    /// A preference with nothing for the store to check (no route quota, no member windows, no
    /// cooldowns) needs no round trip: the first candidate that is not excluded.
    fn trivial_preference(ask: &Assign<'_>) -> Option<Assignment> {
        let Order::Preference(order) = ask.order else {
            return None;
        };
        if ask.quota.is_some() || ask.cooldowns || ask.lease.is_some() || ask.sticky.is_some() {
            return None;
        }
        let mut candidates = order
            .iter()
            .filter_map(|&i| ask.members.get(i))
            .filter(|m| !ask.excluded.contains(&&*m.id));
        if candidates.clone().any(|m| !m.windows.is_empty()) {
            return None;
        }
        Some(match candidates.next() {
            Some(m) => Assignment::Assigned {
                member: m.id.to_string(),
                quota: None,
            },
            None => Assignment::NoMember { quota: None },
        })
    }
}

// The calls on one log: a route without sub-logs, or one sub-log of a route with them.
impl RedisStore {
    async fn acquire_one(&self, req: Acquire<'_>) -> Result<Outcome, StoreError> {
        let Some(client) = req.client else {
            return self.route_acquire(&req).await;
        };
        if !self.connection.is_cluster() {
            return Ok(self.client_decide(&req, client, true).await?.0);
        }
        let route = |with_route: bool| async move {
            if !with_route {
                return Ok(Assignment::Assigned {
                    member: String::new(),
                    quota: None,
                });
            }
            let route = Acquire {
                client: None,
                ..req
            };
            let outcome = self.route_acquire(&route).await?;
            Ok(if outcome.admitted {
                Assignment::Assigned {
                    member: String::new(),
                    quota: Some(outcome),
                }
            } else {
                Assignment::QuotaRefused(outcome)
            })
        };
        // The route's part is a quota alone: the answer is always one of these two.
        match Box::pin(self.decide_split(&req, client, route)).await? {
            Assignment::QuotaRefused(outcome)
            | Assignment::Assigned {
                quota: Some(outcome),
                ..
            } => Ok(outcome),
            _ => Err(StoreError::Backend("a decision without its windows".into())),
        }
    }

    async fn usage_one(
        &self,
        route: &str,
        owner: Owner,
        key: &str,
        windows: &[Window],
        at_us: Option<u64>,
    ) -> Result<Vec<WindowUsage>, StoreError> {
        if windows.is_empty() {
            return Ok(Vec::new());
        }
        let mut call = ScriptCall::new(
            &self.scripts.library,
            &self.scripts.usage,
            1 + windows.len(),
        );
        match owner {
            Owner::Route => {
                call.key(&self.keys.quota_meta_parts(route, key));
                for w in windows {
                    call.key(&self.keys.quota_log_parts(route, &w.name, key));
                }
            }
            Owner::Member => {
                call.key(&self.keys.member_meta_parts(route, key));
                for w in windows {
                    call.key(&self.keys.member_log_parts(route, &w.name, key));
                }
            }
            Owner::Client => {
                call.key(&self.keys.client_meta_parts(key));
                for w in windows {
                    call.key(&self.keys.client_log_parts(key, &w.name));
                }
            }
        }
        call.arg("read");
        match at_us {
            Some(t) => call.arg(t),
            None => call.arg(""),
        };
        for w in windows {
            call.arg(&*w.name).arg(w.limit).arg(w.length_us);
        }
        let reply: Vec<i64> = self.invoke(&call).await?;
        scripts::parse_usage(&reply, windows.len())
    }

    async fn assign_one(&self, ask: &Assign<'_>) -> Result<Assignment, StoreError> {
        // Redis has no empty sorted set: an empty pool is simply one with no member.
        if ask.members.is_empty() {
            return Ok(Assignment::NoMember { quota: None });
        }
        if let Some((lease, cap)) = self.client_lease_split(ask) {
            // Boxed, as the other less usual branches are (see `StateStore::assign`).
            return Box::pin(async move {
                let at_us = ask.at_us.or(ask.quota.and_then(|q| q.at_us));
                if !self.client_take(lease, cap, at_us).await? {
                    return Ok(Assignment::ClientConcurrency { quota: None });
                }
                let rest = Assign {
                    lease: Some(Lease {
                        client: None,
                        ..lease
                    }),
                    ..*ask
                };
                // This log's own step, whatever the route: a sub-log's ask is already its share.
                let answer = self.assign_one(&rest).await;
                if !matches!(answer, Ok(Assignment::Assigned { .. })) {
                    self.client_give_back(cap, lease.id).await;
                }
                answer
            })
            .await;
        }
        let split = ask
            .quota
            .and_then(|q| q.client.map(|c| (q, c)))
            .filter(|_| self.connection.is_cluster());
        let Some((quota, client)) = split else {
            return self.assign_route(ask).await;
        };
        let route = |with_route: bool| async move {
            let plain = Acquire {
                client: None,
                ..quota
            };
            self.assign_route(&Assign {
                quota: with_route.then_some(plain),
                ..*ask
            })
            .await
        };
        Box::pin(self.decide_split(&quota, client, route)).await
    }

    async fn sync_one(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        let n = members.len().to_string();
        let mut leading = Vec::with_capacity(2 + members.len());
        leading.push("sync");
        leading.push(&n);
        leading.extend(members.iter().map(|m| &**m));
        self.allocator(route, &leading, excluded).await.map(drop)
    }

    async fn restore_to_min_one(
        &self,
        route: &str,
        member: &str,
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        self.allocator(route, &["restore", member], excluded)
            .await
            .map(drop)
    }

    // The quota script over the member's own logs, with a cost of 0: it reads, never records.
    async fn member_remaining_one(
        &self,
        route: &str,
        member: &PoolMember,
    ) -> Result<Vec<u64>, StoreError> {
        let read = Acquire {
            route,
            key: &member.id,
            windows: &member.windows,
            cost: 0,
            at_us: None,
            client: None,
        };
        let mut call = ScriptCall::new(
            &self.scripts.library,
            &self.scripts.quota,
            1 + member.windows.len(),
        );
        call.key(&self.keys.member_meta_parts(route, &member.id));
        for w in member.windows.iter() {
            call.key(&self.keys.member_log_parts(route, &w.name, &member.id));
        }
        call.quota_args(&read);
        let reply: Vec<i64> = self.invoke(&call).await?;
        let outcome = scripts::parse_quota(&reply, member.windows.len())?;
        Ok(outcome.windows.iter().map(|w| w.remaining).collect())
    }

    async fn counts_one(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let key = self.keys.pool(route);
        let pairs: Vec<(String, f64)> = self
            .connection
            .run(|mut conn| {
                let key = key.clone();
                async move {
                    redis::cmd("ZRANGE")
                        .arg(key)
                        .arg(0)
                        .arg(-1)
                        .arg("WITHSCORES")
                        .query_async(&mut conn)
                        .await
                }
            })
            .await?;
        Ok(pairs.into_iter().map(|(m, c)| (m, c as u64)).collect())
    }

    async fn cool_one(
        &self,
        route: &str,
        member: &str,
        for_us: u64,
        at_us: Option<u64>,
    ) -> Result<u64, StoreError> {
        let mut call = ScriptCall::new(&self.scripts.library, &self.scripts.cool, 1);
        call.key(&self.keys.cooldowns_parts(route))
            .arg("cool")
            .arg(member)
            .arg(for_us);
        match at_us {
            Some(t) => call.arg(t),
            None => call.arg(""),
        };
        let reply: Value = self.invoke(&call).await?;
        match reply {
            Value::Int(left) if left >= 0 => Ok(left as u64),
            other => Err(StoreError::Backend(format!(
                "unexpected cool reply {other:?}"
            ))),
        }
    }

    async fn cooldowns_one(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let mut call = ScriptCall::new(&self.scripts.library, &self.scripts.cool, 1);
        call.key(&self.keys.cooldowns_parts(route)).arg("list");
        let reply: Value = self.invoke(&call).await?;
        scripts::parse_cooldowns(&reply)
    }
}

#[async_trait]
impl StateStore for RedisStore {
    async fn acquire(&self, req: Acquire<'_>) -> Result<Outcome, StoreError> {
        match self.shards.of(req.route) {
            None => self.acquire_one(req).await,
            Some(sharded) => Box::pin(self.acquire_sharded(req, &sharded)).await,
        }
    }

    // A route with sub-logs, a client's split on a cluster and a client lease are boxed on their
    // own: a future is as large as its largest branch, and this one is allocated and copied
    // whole for every request (`async_trait` boxes it), so the usual request, on one log with
    // no client split, should not carry their size. The requests that take those branches pay
    // one allocation more, beside the several store calls each of them makes anyway.
    async fn assign(&self, ask: Assign<'_>) -> Result<Assignment, StoreError> {
        match self.shards.of(ask.route) {
            None => self.assign_one(&ask).await,
            Some(sharded) => Box::pin(self.assign_sharded(ask, &sharded)).await,
        }
    }

    fn shard_routes(&self, routes: &[(&str, u32, SubLogStart)]) -> usize {
        self.shards.set(routes)
    }

    async fn usage(
        &self,
        route: &str,
        owner: Owner,
        key: &str,
        windows: &[Window],
        at_us: Option<u64>,
    ) -> Result<Vec<WindowUsage>, StoreError> {
        if owner == Owner::Client {
            // A client's windows are its own, in no route's sub-logs.
            return self.usage_one(route, owner, key, windows, at_us).await;
        }
        self.on_each_log(
            route,
            |log| async move {
                let share = log.windows(windows);
                self.usage_one(log.name(), owner, key, &share, at_us).await
            },
            |mut sum, part| {
                for (s, p) in sum.iter_mut().zip(part) {
                    s.total = s.total.saturating_add(p.total);
                    s.open = s.open.saturating_add(p.open);
                }
                sum
            },
        )
        .await
    }

    async fn sync(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        self.on_each_log(
            route,
            |log| async move { self.sync_one(log.name(), members, excluded).await },
            |(), ()| (),
        )
        .await
    }

    async fn restore_to_min(
        &self,
        route: &str,
        member: &str,
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        self.on_each_log(
            route,
            |log| async move { self.restore_to_min_one(log.name(), member, excluded).await },
            |(), ()| (),
        )
        .await
    }

    async fn member_remaining(
        &self,
        route: &str,
        member: &PoolMember,
    ) -> Result<Vec<u64>, StoreError> {
        self.on_each_log(
            route,
            |log| async move {
                let share = log.member(member);
                self.member_remaining_one(log.name(), &share).await
            },
            |mut sum, part| {
                for (s, p) in sum.iter_mut().zip(part) {
                    *s = s.saturating_add(p);
                }
                sum
            },
        )
        .await
    }

    async fn counts(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        self.on_each_log(
            route,
            |log| async move { self.counts_one(log.name()).await },
            |a, b| by_figure(per_member(a, b, |x, y| x + y)),
        )
        .await
    }

    async fn cool(
        &self,
        route: &str,
        member: &str,
        for_us: u64,
        at_us: Option<u64>,
    ) -> Result<u64, StoreError> {
        // Every sub-log's assignments must skip the member: each keeps its own cooldowns.
        self.on_each_log(
            route,
            |log| async move { self.cool_one(log.name(), member, for_us, at_us).await },
            u64::max,
        )
        .await
    }

    async fn cooldowns(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        self.on_each_log(
            route,
            |log| async move { self.cooldowns_one(log.name()).await },
            |a, b| by_figure(per_member(a, b, u64::max)),
        )
        .await
    }
    async fn reserve(&self, req: Reserve<'_>) -> Result<Reservation, StoreError> {
        self.unsplit(req.route)?;
        check_amounts(req.windows, req.amounts)?;
        check_periods(req.windows, req.periods)?;
        if req.windows.is_empty() {
            return Ok(Reservation {
                outcome: untouched(&[]),
                entry: None,
            });
        }
        self.reserve_call(&req, Owner::Route).await
    }

    async fn settle(
        &self,
        route: &str,
        settlements: &[Settle<'_>],
        at_us: Option<u64>,
    ) -> Result<Vec<Vec<Settled>>, StoreError> {
        for s in settlements {
            check_amounts(s.windows, s.reserved)?;
            check_amounts(s.windows, s.settled)?;
            check_periods(s.windows, s.periods)?;
        }
        // One call for everything on a single Redis. On Redis Cluster, one for the route's
        // slot (its quota's and members' entries), and one per client, each in its own slot.
        let mut out = vec![Vec::new(); settlements.len()];
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (i, s) in settlements.iter().enumerate() {
            if s.windows.is_empty() {
                continue;
            }
            let slot = |j: usize| {
                let other = &settlements[groups_first(&groups, j)];
                !self.connection.is_cluster()
                    || match (s.owner, other.owner) {
                        (Owner::Client, Owner::Client) => s.key == other.key,
                        (Owner::Client, _) | (_, Owner::Client) => false,
                        _ => true,
                    }
            };
            match (0..groups.len()).find(|&j| slot(j)) {
                Some(j) => groups[j].push(i),
                None => groups.push(vec![i]),
            }
        }
        for group in groups {
            // Settlements that come due together share a call: each group goes with what other
            // requests of its route (and slot) settle meanwhile (settle_batch.rs).
            let first = &settlements[group[0]];
            let tag = match (first.owner, self.connection.is_cluster()) {
                (Owner::Client, true) => first.key,
                _ => "",
            };
            let states = if self.batches.on() {
                let items = group.iter().map(|&i| Owned::of(&settlements[i])).collect();
                self.settles.settle(route, tag, items, at_us).await?
            } else {
                let group: Vec<&Settle<'_>> = group.iter().map(|&i| &settlements[i]).collect();
                let (c, s, k) = (&self.connection, &self.scripts, &self.keys);
                settle_call(c, s, k, route, &group, at_us).await?
            };
            for (i, states) in group.into_iter().zip(states) {
                out[i] = states;
            }
        }
        Ok(out)
    }

    async fn assign_reserve(
        &self,
        ask: Assign<'_>,
        usage: Usage<'_>,
    ) -> Result<Reserved, StoreError> {
        self.unsplit(ask.route)?;
        if let Some(q) = ask.quota {
            check_amounts(q.windows, usage.route)?;
            check_periods(q.windows, usage.route_periods)?;
            if let Some(c) = q.client {
                check_amounts(c.windows, usage.client)?;
                check_periods(c.windows, usage.client_periods)?;
            }
        }
        for (m, u) in ask.members.iter().zip(usage.members) {
            check_amounts(&m.windows, u.amounts)?;
            check_periods(&m.windows, u.periods)?;
        }
        if ask.members.is_empty() {
            return Ok(Reserved {
                assignment: Assignment::NoMember { quota: None },
                route: None,
                member: None,
                client: None,
            });
        }
        if let Some((lease, cap)) = self.client_lease_split(&ask) {
            let at_us = ask.at_us.or(ask.quota.and_then(|q| q.at_us));
            if !self.client_take(lease, cap, at_us).await? {
                return Ok(Reserved {
                    assignment: Assignment::ClientConcurrency { quota: None },
                    route: None,
                    member: None,
                    client: None,
                });
            }
            let rest = Assign {
                lease: Some(Lease {
                    client: None,
                    ..lease
                }),
                ..ask
            };
            let answer = self.assign_reserve(rest, usage).await;
            if !matches!(
                answer,
                Ok(Reserved {
                    assignment: Assignment::Assigned { .. },
                    ..
                })
            ) {
                self.client_give_back(cap, lease.id).await;
            }
            return answer;
        }
        let client = ask
            .quota
            .and_then(|q| q.client)
            .filter(|c| !c.windows.is_empty());
        if let (Some(client), true) = (client, self.connection.is_cluster()) {
            return self.reserve_split(ask, usage, client).await;
        }
        self.assign_reserve_route(ask, usage).await
    }

    async fn release(&self, route: &str, leases: &[&str]) -> Result<(), StoreError> {
        let Some(sharded) = self.shards.of(route) else {
            return self
                .lease_call(route, "release", None, leases, None)
                .await
                .map(drop);
        };
        // Forgotten here before the calls, whatever they answer: a release that fails is tried
        // again by the caller with the same ids, which, unknown now, go to every sub-log; that
        // releases each where it is still held and changes nothing in the others.
        let groups = sharded.lease_groups(leases, true);
        self.lease_on_each_sub_log(&sharded, "release", None, &groups, None)
            .await
    }

    async fn renew(
        &self,
        route: &str,
        leases: &[&str],
        ttl_us: u64,
        at_us: Option<u64>,
    ) -> Result<(), StoreError> {
        let Some(sharded) = self.shards.of(route) else {
            return self
                .lease_call(route, "renew", Some(ttl_us), leases, at_us)
                .await
                .map(drop);
        };
        let groups = sharded.lease_groups(leases, false);
        self.lease_on_each_sub_log(&sharded, "renew", Some(ttl_us), &groups, at_us)
            .await
    }

    async fn release_client(&self, client: &str, leases: &[&str]) -> Result<(), StoreError> {
        if leases.is_empty() {
            return Ok(());
        }
        let mut args = vec!["client_release", ""];
        args.extend_from_slice(leases);
        self.client_lease_call(client, &args).await.map(drop)
    }

    async fn renew_client(
        &self,
        client: &str,
        leases: &[&str],
        ttl_us: u64,
        at_us: Option<u64>,
    ) -> Result<(), StoreError> {
        if leases.is_empty() {
            return Ok(());
        }
        let at = at_us.map_or(String::new(), |t| t.to_string());
        let ttl = ttl_us.to_string();
        let mut args = vec!["client_renew", &at, &ttl];
        args.extend_from_slice(leases);
        self.client_lease_call(client, &args).await.map(drop)
    }

    async fn in_flight(
        &self,
        route: &str,
        at_us: Option<u64>,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        self.on_each_log(
            route,
            |log| async move {
                let reply = self
                    .lease_call(log.name(), "read", None, &[], at_us)
                    .await?;
                scripts::parse_cooldowns(&reply)
            },
            |a, b| {
                let mut all = per_member(a, b, |x, y| x + y);
                all.sort();
                all
            },
        )
        .await
    }

    async fn unbind(&self, route: &str, session: &str, member: &str) -> Result<(), StoreError> {
        // Its own sub-log holds the session's binding, unless that one was full when it was
        // bound: every sub-log drops it if it still points to the member.
        let unbind = ["unbind", session, member];
        self.on_each_log(
            route,
            |log| async move { self.sticky_call(log.name(), &unbind, None).await.map(drop) },
            |(), ()| (),
        )
        .await
    }

    async fn sticky_counts(
        &self,
        route: &str,
        at_us: Option<u64>,
    ) -> Result<StickyCounts, StoreError> {
        self.on_each_log(
            route,
            |log| async move { self.sticky_counts_one(log.name(), at_us).await },
            |mut sum, part| {
                sum.bindings += part.bindings;
                sum.unbound += part.unbound;
                sum.moved += part.moved;
                sum
            },
        )
        .await
    }

    async fn ready(&self) -> bool {
        self.connection.ping().await
    }
}

impl RedisStore {
    async fn sticky_counts_one(
        &self,
        route: &str,
        at_us: Option<u64>,
    ) -> Result<StickyCounts, StoreError> {
        let reply: Vec<i64> =
            redis::from_redis_value(self.sticky_call(route, &["read"], at_us).await?)
                .map_err(|e| StoreError::Backend(format!("unexpected sticky reply: {e}")))?;
        match reply[..] {
            [bindings, unbound, moved] => Ok(StickyCounts {
                bindings: bindings.max(0) as u64,
                unbound: unbound.max(0) as u64,
                moved: moved.max(0) as u64,
            }),
            _ => Err(StoreError::Backend(format!(
                "sticky read returned {} values, expected 3",
                reply.len()
            ))),
        }
    }
}

/// The first settlement of group `j`.
fn groups_first(groups: &[Vec<usize>], j: usize) -> usize {
    groups[j][0]
}

/// Windows that reserve usage, as the assign script reads them: name, limit and length per
/// window (a fixed window's length is its period's span), then each one's amount, then each
/// one's score ("" for now, or where a fixed window's entry lies: `placement`).
fn usage_args(
    call: &mut ScriptCall<'_>,
    windows: &[Window],
    amounts: &[u64],
    periods: &[Option<Period>],
) {
    for (i, w) in windows.iter().enumerate() {
        call.arg(&*w.name)
            .arg(w.limit)
            .arg(placement(w, periods, i, 0).1);
    }
    for i in 0..windows.len() {
        call.arg(amounts.get(i).copied().unwrap_or(0).min(MAX_AMOUNT));
    }
    for (i, w) in windows.iter().enumerate() {
        match periods.get(i).copied().flatten() {
            Some(_) => call.arg(placement(w, periods, i, 0).0),
            None => call.arg(""),
        };
    }
}

/// The state of `windows` that nothing was charged to: each whole, nothing to wait for.
fn untouched(windows: &[Window]) -> Outcome {
    Outcome {
        admitted: true,
        retry_after_us: 0,
        windows: windows
            .iter()
            .map(|w| WindowState {
                remaining: w.limit,
                reset_us: 0,
            })
            .collect(),
    }
}

/// One decision from the route's (if it has a quota) and the client's, decided apart (Redis
/// Cluster).
/// The route's assignment with the client's own decision (made in its slot) joined to its
/// quota's, whatever the assignment was.
fn with_client(assignment: Assignment, mine: Outcome) -> Assignment {
    match assignment {
        Assignment::Assigned { member, quota } => Assignment::Assigned {
            member,
            quota: Some(join(quota, mine)),
        },
        Assignment::NoMember { quota } => Assignment::NoMember {
            quota: Some(join(quota, mine)),
        },
        Assignment::QuotaRefused(quota) => Assignment::QuotaRefused(join(Some(quota), mine)),
        Assignment::Busy {
            retry_after_us,
            quota,
        } => Assignment::Busy {
            retry_after_us,
            quota: Some(join(quota, mine)),
        },
        Assignment::Concurrency { quota } => Assignment::Concurrency {
            quota: Some(join(quota, mine)),
        },
        Assignment::ClientConcurrency { quota } => Assignment::ClientConcurrency {
            quota: Some(join(quota, mine)),
        },
    }
}

fn join(route: Option<Outcome>, client: Outcome) -> Outcome {
    match route {
        Some(route) => route.with_client(client),
        None => client,
    }
}

/// A client's decision after its charge of `cost` was given back.
fn given_back(mut outcome: Outcome, windows: &[Window], cost: u64) -> Outcome {
    for (state, w) in outcome.windows.iter_mut().zip(windows) {
        state.remaining = state.remaining.saturating_add(cost).min(w.limit);
    }
    outcome
}
