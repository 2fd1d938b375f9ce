//! The in-process backend, for a single gateway instance: quota logs, least-used pools, member
//! windows and cooldowns in memory, with the same behaviour as the Redis scripts.
//!
//! Locks are always taken in one order, so no two calls can deadlock: the route's state (pool
//! and cooldowns) first, then the route quota key's shard, then the client's shard, then the
//! clients' leases, then one member log shard at a time. A plain `acquire` takes only a route quota shard (and the
//! client's), and member shards are never held together.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use sluice_limiter::{
    Acquire, EntryId, MemoryLimits, Outcome, Owner, QuotaLogs, Reservation, Reserve, Settle,
    Settled, StoreError, Window, WindowUsage,
};

use crate::memory_leases::Leases;
use crate::memory_pools::{Excluded, Pools, Route};
use crate::{Assign, Assignment, Order, PoolMember, Reserved, StateStore, StickyCounts, Usage};

/// The route name the clients' own windows are kept under, in a [`QuotaLogs`] of their own.
const CLIENTS: &str = "clients";

/// Quotas, least-used pools, member windows and cooldowns for a single gateway instance.
#[derive(Debug, Default)]
pub struct MemoryStore {
    /// The routes' quotas, by the keys clients choose.
    quotas: QuotaLogs,
    /// The members' own windows, by member id: apart from `quotas`, so that no client-chosen
    /// quota key can collide with a member's logs.
    members: QuotaLogs,
    /// The clients' own windows, by client name (under the route name [`CLIENTS`]): apart from
    /// `quotas`, since they are the client's on every route it uses.
    clients: QuotaLogs,
    pools: Pools,
    /// The leases of clients with a `max_in_flight`, by client name (each lease's "member" is
    /// its route): apart from every route's, since a client's cap counts on every route. Keyed
    /// by names the config bounds, and each table by the client's cap.
    client_leases: Mutex<HashMap<Box<str>, Leases>>,
}

/// What the walk over a route's candidates found.
enum Pick {
    /// This member admits the request; its windows recorded it (and its count, if least-used),
    /// as this entry when it reserved amounts.
    Chosen(Arc<str>, Option<EntryId>),
    /// Eligible members exist, and the first of them admits the request in this many µs.
    Busy(u64),
    /// No candidate is eligible.
    Nobody,
    /// The route holds its most leases, or every candidate not excluded holds its own.
    Capped,
    /// The calling client holds its most leases.
    ClientCapped,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// An empty store that holds at most what `limits` allow.
    pub fn with_limits(limits: MemoryLimits) -> MemoryStore {
        MemoryStore {
            quotas: QuotaLogs::with_limits(&limits),
            // Member logs are keyed by member ids, which the config bounds: a small
            // `max_keys` must not refuse a route's own members. Their entries are bounded as
            // the route's are, by `max_entries`, so that raising it (a busy pool of keys with
            // daily windows) raises theirs too.
            members: QuotaLogs::with_limits(&MemoryLimits {
                max_keys: MemoryLimits::default().max_keys.max(limits.max_keys),
                max_entries: limits.max_entries,
            }),
            // Keyed by client names, which the config bounds likewise; every client's windows
            // share one budget of `max_entries`.
            clients: QuotaLogs::with_limits(&MemoryLimits {
                max_keys: MemoryLimits::default().max_keys.max(limits.max_keys),
                max_entries: limits.max_entries,
            }),
            pools: Pools::default(),
            client_leases: Mutex::default(),
        }
    }

    /// Number of quota keys held, across all routes (for tests and status).
    pub fn quota_keys(&self) -> usize {
        self.quotas.keys()
    }

    /// Number of routes holding a least-used pool or cooldowns (for tests and status).
    pub fn pool_routes(&self) -> usize {
        self.pools.len()
    }

    /// The quota decision, synchronously: memory never waits on anything but its locks.
    pub fn decide(&self, req: Acquire<'_>) -> Result<Outcome, StoreError> {
        // A cost of 0 only reads the windows (see `Acquire::cost`).
        self.decide_then(req, || (req.cost > 0).then_some(()))
            .map(|(outcome, _)| outcome)
    }

    /// Decides `req` on its route's quota and, when it has one, its client's own windows, in
    /// one step: `then` runs (as in [`QuotaLogs::decide_then`]) only when both admit it, under
    /// both keys' locks, and the request is recorded in both only when it returns `Some`.
    fn decide_then<T>(
        &self,
        req: Acquire<'_>,
        then: impl FnOnce() -> Option<T>,
    ) -> Result<(Outcome, Option<T>), StoreError> {
        let Some(client) = req.client else {
            return self.quotas.decide_then(req, then);
        };
        let now = req.at_us.unwrap_or_else(|| self.quotas.now_us());
        let mine = Acquire {
            route: CLIENTS,
            key: client.name,
            windows: client.windows,
            cost: req.cost,
            at_us: Some(now),
            client: None,
        };
        if req.windows.is_empty() {
            return self.clients.decide_then(mine, then);
        }
        let route = Acquire {
            at_us: Some(now),
            client: None,
            ..req
        };
        let mut decided = None;
        let (outcome, taken) = self.quotas.decide_then(route, || {
            let (outcome, taken) = match self.clients.decide_then(mine, then) {
                Ok(decision) => decision,
                Err(error) => {
                    decided = Some(Err(error));
                    return None;
                }
            };
            decided = Some(Ok(outcome));
            taken
        })?;
        let client = match decided {
            Some(decision) => decision?,
            // The route refused: the client's windows are read for the answer, charging nothing.
            None => self.clients.decide_then(mine, || None::<()>)?.0,
        };
        Ok((outcome.with_client(client), taken))
    }

    /// Walks the candidates of `ask` in order, and takes the first that is not excluded, not
    /// cooling (when the route has cooldowns) and whose windows admit the cost. Runs under the
    /// route's lock (and the route quota key's, when it has a quota).
    fn walk(
        &self,
        route: &mut Route,
        ask: &Assign<'_>,
        excluded: &Excluded<'_>,
        now: u64,
        usage: Option<&Usage<'_>>,
    ) -> Result<Pick, StoreError> {
        // Expired sticky bindings go first, before either cap is checked, as the script's
        // `sticky_ask` comes before `leases_ask`: a bounded number a call, so a call that stops
        // at a cap has still dropped them, on both stores.
        if ask.sticky.is_some() {
            route.sticky.expire(now);
        }
        // The client's leases stay locked until the walk ends, so that no other route's
        // assignment can take the client's last lease between the check and the take.
        let cap = ask.lease.and_then(|l| l.client);
        let mut client_leases =
            cap.map(|_| self.client_leases.lock().unwrap_or_else(|p| p.into_inner()));
        // Both sets drop their expired leases before either cap is checked, as `leases_ask`
        // does before `leases_full`: each drops a bounded number a call, so a call that stops
        // at the route's cap must still have dropped the client's, or the two stores would
        // count different leases for the client's next call.
        if let Some(lease) = ask.lease {
            route.leases.expire(now);
            // A client with no leases yet has nothing to drop: no key is made for it here (the
            // take below makes it), so a call that stops at a cap allocates nothing.
            if let Some(mine) = cap
                .zip(client_leases.as_mut())
                .and_then(|(cap, all)| all.get_mut(cap.name))
            {
                mine.expire(now);
            }
            if lease
                .route_max
                .is_some_and(|max| route.leases.total() >= max)
            {
                return Ok(Pick::Capped);
            }
        }
        if let (Some(cap), Some(all)) = (cap, client_leases.as_ref()) {
            if all
                .get(cap.name)
                .is_some_and(|mine| mine.total() >= cap.max)
            {
                return Ok(Pick::ClientCapped);
            }
        }
        let member_max = ask.lease.and_then(|l| l.member_max);
        if ask.cooldowns {
            let least_used = matches!(ask.order, Order::LeastUsed);
            let capped = |route: &Route, id: &str| {
                member_max.is_some_and(|max| route.leases.count(id) >= max)
            };
            route.settle_cooldowns(excluded, capped, now, least_used);
        }
        // The session's member, when it is still a candidate of this order: offered first.
        let bound = ask.sticky.and_then(|sticky| {
            let id = route.sticky.bound(sticky.session, now)?;
            let index = ask.members.iter().position(|m| m.id == id);
            let candidate = match ask.order {
                Order::LeastUsed => route.counts.by_member.contains_key(&id),
                Order::Preference(order) | Order::LeastInFlight(order) => {
                    index.is_some_and(|i| order.contains(&i))
                }
            };
            candidate.then_some((id, index))
        });
        let mut eligible = false;
        let mut capped = false;
        let mut wait: Option<u64> = None;
        let cooling = &route.cooling;
        let leases = &route.leases;
        let mut entry = None;
        // Offers one candidate (the member at `index` of `ask.members`, when it is one); true
        // when it is taken (its windows recorded).
        let mut offer = |id: &str, windows: &[Window], index: Option<usize>| {
            if excluded.contains(id) {
                return Ok::<bool, StoreError>(false);
            }
            // A member at its most leases waits for a release, like the route at its own.
            if member_max.is_some_and(|max| leases.count(id) >= max) {
                capped = true;
                return Ok(false);
            }
            eligible = true;
            let left = if ask.cooldowns {
                cooling
                    .get(id)
                    .filter(|&&until| until > now)
                    .map(|u| u - now)
            } else {
                None
            };
            let waits = if windows.is_empty() {
                match left {
                    None => return Ok(true),
                    Some(left) => left,
                }
            } else {
                // A cooling member is checked, never recorded: it admits once both its cooldown
                // and its windows allow, whichever is later.
                let (outcome, taken) = match usage {
                    None => self.members.decide_then(
                        Acquire {
                            route: ask.route,
                            key: id,
                            windows,
                            cost: ask.cost,
                            at_us: Some(now),
                            client: None,
                        },
                        || left.is_none().then_some(()),
                    )?,
                    Some(usage) => {
                        let mine = index
                            .and_then(|i| usage.members.get(i))
                            .copied()
                            .unwrap_or_default();
                        let req = Reserve {
                            route: ask.route,
                            key: id,
                            windows,
                            amounts: mine.amounts,
                            at_us: Some(now),
                            periods: mine.periods,
                        };
                        let (reservation, taken) = self
                            .members
                            .reserve_then(req, || left.is_none().then_some(()))?;
                        entry = reservation.entry;
                        (reservation.outcome, taken)
                    }
                };
                if taken.is_some() {
                    return Ok(true);
                }
                left.unwrap_or(0).max(outcome.retry_after_us)
            };
            wait = Some(wait.map_or(waits, |w| w.min(waits)));
            Ok(false)
        };
        let mut chosen_id = None;
        if let Some((id, index)) = bound {
            let windows = index.map_or(&[][..], |i| &ask.members[i].windows[..]);
            if offer(&id, windows, index)? {
                if matches!(ask.order, Order::LeastUsed) {
                    let count = route.counts.by_member.get(&id).copied().unwrap_or(0);
                    route.counts.set(&id, count + 1);
                }
                chosen_id = Some(id);
            }
        }
        match ask.order {
            _ if chosen_id.is_some() => {}
            Order::LeastUsed => {
                let any_windows = ask.members.iter().any(|m| !m.windows.is_empty());
                let mut chosen = None;
                for (count, id) in &route.counts.order {
                    let index = match any_windows {
                        true => ask.members.iter().position(|m| m.id == *id),
                        false => None,
                    };
                    let windows = index.map_or(&[][..], |i| &ask.members[i].windows[..]);
                    if offer(id, windows, index)? {
                        chosen = Some((*count, id.clone()));
                        break;
                    }
                }
                if let Some((count, id)) = chosen {
                    route.counts.set(&id, count + 1);
                    chosen_id = Some(id);
                }
            }
            Order::Preference(order) => {
                for &i in order {
                    let Some(m) = ask.members.get(i) else {
                        continue;
                    };
                    if offer(&m.id, &m.windows, Some(i))? {
                        chosen_id = Some(m.id.clone());
                        break;
                    }
                }
            }
            Order::LeastInFlight(candidates) => {
                // Fewest leases first, then the lexically smallest id: the order of the
                // Redis script's sort.
                let mut order: Vec<(u64, &Arc<str>, usize)> = candidates
                    .iter()
                    .filter_map(|&i| ask.members.get(i).map(|m| (leases.count(&m.id), &m.id, i)))
                    .collect();
                order.sort_unstable();
                for (_, id, i) in order {
                    if offer(id, &ask.members[i].windows, Some(i))? {
                        chosen_id = Some(id.clone());
                        break;
                    }
                }
            }
        }
        if let Some(id) = chosen_id {
            if let Some(sticky) = ask.sticky {
                let expiry = now.saturating_add(sticky.ttl_us);
                route
                    .sticky
                    .bind(sticky.session, &id, expiry, sticky.max_bindings);
            }
            if let Some(lease) = ask.lease {
                let expiry = now.saturating_add(lease.ttl_us);
                route.leases.take(lease.id, &id, expiry);
                if let (Some(cap), Some(all)) = (lease.client, client_leases.as_mut()) {
                    let on: Arc<str> = ask.route.into();
                    all.entry(cap.name.into())
                        .or_default()
                        .take(lease.id, &on, expiry);
                }
            }
            return Ok(Pick::Chosen(id, entry));
        }
        Ok(match wait {
            Some(wait) if eligible => Pick::Busy(wait),
            _ if capped => Pick::Capped,
            _ => Pick::Nobody,
        })
    }
}

#[async_trait]
impl StateStore for MemoryStore {
    async fn acquire(&self, request: Acquire<'_>) -> Result<Outcome, StoreError> {
        self.decide(request)
    }

    async fn reserve(&self, request: Reserve<'_>) -> Result<Reservation, StoreError> {
        if request.windows.is_empty() {
            return Ok(Reservation {
                outcome: Outcome {
                    admitted: true,
                    retry_after_us: 0,
                    windows: Vec::new(),
                },
                entry: None,
            });
        }
        self.quotas.reserve(request)
    }

    async fn settle(
        &self,
        route: &str,
        settlements: &[Settle<'_>],
        at_us: Option<u64>,
    ) -> Result<Vec<Vec<Settled>>, StoreError> {
        // Members' and clients' entries are in logs of their own; each answer goes back in its
        // place.
        if settlements.iter().all(|s| s.owner == Owner::Route) {
            return self.quotas.settle(route, settlements, at_us);
        }
        let now = at_us.unwrap_or_else(|| self.quotas.now_us());
        let of = |owner: Owner| -> Vec<Settle<'_>> {
            settlements
                .iter()
                .filter(|s| s.owner == owner)
                .copied()
                .collect()
        };
        let mut quotas = self
            .quotas
            .settle(route, &of(Owner::Route), Some(now))?
            .into_iter();
        let mut members = self
            .members
            .settle(route, &of(Owner::Member), Some(now))?
            .into_iter();
        let mut clients = self
            .clients
            .settle(CLIENTS, &of(Owner::Client), Some(now))?
            .into_iter();
        Ok(settlements
            .iter()
            .map(|s| match s.owner {
                Owner::Route => quotas.next(),
                Owner::Member => members.next(),
                Owner::Client => clients.next(),
            })
            .map(Option::unwrap_or_default)
            .collect())
    }

    async fn assign(&self, ask: Assign<'_>) -> Result<Assignment, StoreError> {
        // As in Redis, where an empty sorted set cannot exist.
        if ask.members.is_empty() {
            return Ok(Assignment::NoMember { quota: None });
        }
        let excluded = Excluded::new(ask.excluded);
        let route = self.pools.route(ask.route);
        let mut route = route.lock().unwrap_or_else(|p| p.into_inner());
        // Read under the route's lock, which every assignment on the route takes first: the
        // entries its members' and quota's logs get are then in time order (see
        // `QuotaLogs::ask_then`).
        let now = ask
            .at_us
            .or(ask.quota.and_then(|q| q.at_us))
            .unwrap_or_else(|| self.quotas.now_us());
        // A pool with no member is one that was never synced, as in Redis.
        if matches!(ask.order, Order::LeastUsed) && route.counts.by_member.is_empty() {
            let ids = ask.members.iter().map(|m: &PoolMember| &m.id);
            route.counts.sync(ids, &excluded);
        }
        let Some(q) = ask.quota else {
            return Ok(match self.walk(&mut route, &ask, &excluded, now, None)? {
                Pick::Chosen(id, _) => Assignment::Assigned {
                    member: id.to_string(),
                    quota: None,
                },
                Pick::Busy(retry_after_us) => Assignment::Busy {
                    retry_after_us,
                    quota: None,
                },
                Pick::Nobody => Assignment::NoMember { quota: None },
                Pick::Capped => Assignment::Concurrency { quota: None },
                Pick::ClientCapped => Assignment::ClientConcurrency { quota: None },
            });
        };
        // The quota goes first, and records the request in the same step as the assignment,
        // under the quota key's lock (the route's lock is held too): nothing can be admitted
        // between the check and the record.
        let mut missed = None;
        let q = Acquire {
            at_us: Some(now),
            ..q
        };
        let (outcome, member) = self.decide_then(q, || {
            match self.walk(&mut route, &ask, &excluded, now, None) {
                Ok(Pick::Chosen(id, _)) => Some(id),
                other => {
                    missed = Some(other);
                    None
                }
            }
        })?;
        Ok(match (member, missed) {
            (Some(id), _) => Assignment::Assigned {
                member: id.to_string(),
                quota: Some(outcome),
            },
            (None, Some(Err(error))) => return Err(error),
            (None, Some(Ok(Pick::Busy(retry_after_us)))) => Assignment::Busy {
                retry_after_us,
                quota: Some(outcome),
            },
            (None, Some(Ok(Pick::Capped))) => Assignment::Concurrency {
                quota: Some(outcome),
            },
            (None, Some(Ok(Pick::ClientCapped))) => Assignment::ClientConcurrency {
                quota: Some(outcome),
            },
            (None, _) if !outcome.admitted => Assignment::QuotaRefused(outcome),
            (None, _) => Assignment::NoMember {
                quota: Some(outcome),
            },
        })
    }

    async fn usage(
        &self,
        route: &str,
        owner: Owner,
        key: &str,
        windows: &[Window],
        at_us: Option<u64>,
    ) -> Result<Vec<WindowUsage>, StoreError> {
        // One clock for the three logs, as in an assignment.
        let at_us = Some(at_us.unwrap_or_else(|| self.quotas.now_us()));
        Ok(match owner {
            Owner::Route => self.quotas.usage(route, key, windows, at_us),
            Owner::Member => self.members.usage(route, key, windows, at_us),
            Owner::Client => self.clients.usage(CLIENTS, key, windows, at_us),
        })
    }

    async fn assign_reserve(
        &self,
        ask: Assign<'_>,
        usage: Usage<'_>,
    ) -> Result<Reserved, StoreError> {
        let unassigned = |assignment| Reserved {
            assignment,
            route: None,
            member: None,
            client: None,
        };
        if ask.members.is_empty() {
            return Ok(unassigned(Assignment::NoMember { quota: None }));
        }
        let excluded = Excluded::new(ask.excluded);
        let route = self.pools.route(ask.route);
        let mut route = route.lock().unwrap_or_else(|p| p.into_inner());
        // Read under the route's lock, which every assignment on the route takes first: the
        // entries its members' and quota's logs get are then in time order (see
        // `QuotaLogs::ask_then`).
        let now = ask
            .at_us
            .or(ask.quota.and_then(|q| q.at_us))
            .unwrap_or_else(|| self.quotas.now_us());
        if matches!(ask.order, Order::LeastUsed) && route.counts.by_member.is_empty() {
            let ids = ask.members.iter().map(|m: &PoolMember| &m.id);
            route.counts.sync(ids, &excluded);
        }
        let client = ask
            .quota
            .and_then(|q| q.client)
            .filter(|c| !c.windows.is_empty());
        let Some(q) = ask
            .quota
            .filter(|q| !q.windows.is_empty() || client.is_some())
        else {
            return Ok(
                match self.walk(&mut route, &ask, &excluded, now, Some(&usage))? {
                    Pick::Chosen(id, member) => Reserved {
                        assignment: Assignment::Assigned {
                            member: id.to_string(),
                            quota: None,
                        },
                        route: None,
                        member,
                        client: None,
                    },
                    Pick::Busy(retry_after_us) => unassigned(Assignment::Busy {
                        retry_after_us,
                        quota: None,
                    }),
                    Pick::Nobody => unassigned(Assignment::NoMember { quota: None }),
                    Pick::Capped => unassigned(Assignment::Concurrency { quota: None }),
                    Pick::ClientCapped => unassigned(Assignment::ClientConcurrency { quota: None }),
                },
            );
        };
        // As in `assign`: the route's windows, then the client's, reserve in the same step as the
        // walk, under their keys' locks, and only when a member is chosen.
        let mut missed = None;
        let mut walk = || match self.walk(&mut route, &ask, &excluded, now, Some(&usage)) {
            Ok(Pick::Chosen(id, member)) => Some((id, member)),
            other => {
                missed = Some(other);
                None
            }
        };
        let mine = client.map(|c| Reserve {
            route: CLIENTS,
            key: c.name,
            windows: c.windows,
            amounts: usage.client,
            at_us: Some(now),
            periods: usage.client_periods,
        });
        // The client's decision when its windows were asked (the route's admitted), or its
        // error; with its entry.
        let mut decided = None;
        let both = || match mine {
            None => walk().map(|chosen| (chosen, None)),
            Some(mine) => match self.clients.reserve_then(mine, walk) {
                Ok((reservation, chosen)) => {
                    let entry = reservation.entry;
                    decided = Some(Ok(reservation.outcome));
                    chosen.map(|chosen| (chosen, entry))
                }
                Err(error) => {
                    decided = Some(Err(error));
                    None
                }
            },
        };
        let reserve = Reserve {
            route: q.route,
            key: q.key,
            windows: q.windows,
            amounts: usage.route,
            at_us: Some(now),
            periods: usage.route_periods,
        };
        let (reservation, chosen) = self.quotas.reserve_then(reserve, both)?;
        let mut outcome = reservation.outcome;
        if let Some(mine) = mine {
            let client = match decided {
                Some(decision) => decision?,
                // The route refused: the client's windows are read for the answer, charging
                // nothing.
                None => self.clients.reserve_then(mine, || None::<()>)?.0.outcome,
            };
            outcome = outcome.with_client(client);
        }
        Ok(match (chosen, missed) {
            (Some(((id, member), client)), _) => Reserved {
                assignment: Assignment::Assigned {
                    member: id.to_string(),
                    quota: Some(outcome),
                },
                route: reservation.entry.filter(|_| !q.windows.is_empty()),
                member,
                client,
            },
            (None, Some(Err(error))) => return Err(error),
            (None, Some(Ok(Pick::Busy(retry_after_us)))) => unassigned(Assignment::Busy {
                retry_after_us,
                quota: Some(outcome),
            }),
            (None, Some(Ok(Pick::Capped))) => unassigned(Assignment::Concurrency {
                quota: Some(outcome),
            }),
            (None, Some(Ok(Pick::ClientCapped))) => unassigned(Assignment::ClientConcurrency {
                quota: Some(outcome),
            }),
            (None, _) if !outcome.admitted => unassigned(Assignment::QuotaRefused(outcome)),
            (None, _) => unassigned(Assignment::NoMember {
                quota: Some(outcome),
            }),
        })
    }

    async fn sync(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        let route = self.pools.route(route);
        route
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .counts
            .sync(members.iter(), &Excluded::new(excluded));
        Ok(())
    }

    async fn restore_to_min(
        &self,
        route: &str,
        member: &str,
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        // A route with no pool has no count to raise.
        let Some(route) = self.pools.get(route) else {
            return Ok(());
        };
        let counts = &mut route.lock().unwrap_or_else(|p| p.into_inner()).counts;
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

    async fn member_remaining(
        &self,
        route: &str,
        member: &PoolMember,
    ) -> Result<Vec<u64>, StoreError> {
        let outcome = self.members.decide(Acquire {
            route,
            key: &member.id,
            windows: &member.windows,
            cost: 0,
            at_us: None,
            client: None,
        })?;
        Ok(outcome.windows.iter().map(|w| w.remaining).collect())
    }

    async fn counts(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let Some(route) = self.pools.get(route) else {
            return Ok(Vec::new());
        };
        let route = route.lock().unwrap_or_else(|p| p.into_inner());
        Ok(route
            .counts
            .order
            .iter()
            .map(|(c, id)| (id.to_string(), *c))
            .collect())
    }

    async fn cool(
        &self,
        route: &str,
        member: &str,
        for_us: u64,
        at_us: Option<u64>,
    ) -> Result<u64, StoreError> {
        let now = at_us.unwrap_or_else(|| self.quotas.now_us());
        let route = self.pools.route(route);
        let cooling = &mut route.lock().unwrap_or_else(|p| p.into_inner()).cooling;
        // As the Redis script: a cooldown only ever grows, and one that is over stays until an
        // assignment settles it (`Route::settle_cooldowns`).
        if for_us > 0 {
            let until = now.saturating_add(for_us);
            match cooling.get_mut(member) {
                Some(current) => *current = (*current).max(until),
                None => {
                    cooling.insert(member.into(), until);
                }
            }
        }
        Ok(cooling
            .get(member)
            .map_or(0, |until| until.saturating_sub(now)))
    }

    async fn retain_routes(&self, routes: &[&str]) {
        self.pools.retain(routes);
    }

    async fn unbind(&self, route: &str, session: &str, member: &str) -> Result<(), StoreError> {
        if let Some(route) = self.pools.get(route) {
            let mut route = route.lock().unwrap_or_else(|p| p.into_inner());
            route.sticky.unbind(session, member);
        }
        Ok(())
    }

    async fn sticky_counts(
        &self,
        route: &str,
        at_us: Option<u64>,
    ) -> Result<StickyCounts, StoreError> {
        let now = at_us.unwrap_or_else(|| self.quotas.now_us());
        let Some(route) = self.pools.get(route) else {
            return Ok(StickyCounts::default());
        };
        let mut route = route.lock().unwrap_or_else(|p| p.into_inner());
        route.sticky.expire(now);
        Ok(route.sticky.counts())
    }

    async fn release(&self, route: &str, leases: &[&str]) -> Result<(), StoreError> {
        let Some(route) = self.pools.get(route) else {
            return Ok(());
        };
        let mut route = route.lock().unwrap_or_else(|p| p.into_inner());
        for id in leases {
            route.leases.release(id);
        }
        Ok(())
    }

    async fn renew(
        &self,
        route: &str,
        leases: &[&str],
        ttl_us: u64,
        at_us: Option<u64>,
    ) -> Result<(), StoreError> {
        let now = at_us.unwrap_or_else(|| self.quotas.now_us());
        let Some(route) = self.pools.get(route) else {
            return Ok(());
        };
        let mut route = route.lock().unwrap_or_else(|p| p.into_inner());
        // An expired lease is dropped first, so that a renewal cannot bring it back.
        route.leases.expire(now);
        for id in leases {
            route.leases.renew(id, now.saturating_add(ttl_us));
        }
        Ok(())
    }

    async fn release_client(&self, client: &str, leases: &[&str]) -> Result<(), StoreError> {
        let mut all = self.client_leases.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mine) = all.get_mut(client) {
            for id in leases {
                mine.release(id);
            }
            if mine.total() == 0 {
                all.remove(client);
            }
        }
        Ok(())
    }

    async fn renew_client(
        &self,
        client: &str,
        leases: &[&str],
        ttl_us: u64,
        at_us: Option<u64>,
    ) -> Result<(), StoreError> {
        let now = at_us.unwrap_or_else(|| self.quotas.now_us());
        let mut all = self.client_leases.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mine) = all.get_mut(client) {
            mine.expire(now);
            for id in leases {
                mine.renew(id, now.saturating_add(ttl_us));
            }
        }
        Ok(())
    }

    async fn in_flight(
        &self,
        route: &str,
        at_us: Option<u64>,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        let now = at_us.unwrap_or_else(|| self.quotas.now_us());
        let Some(route) = self.pools.get(route) else {
            return Ok(Vec::new());
        };
        let mut route = route.lock().unwrap_or_else(|p| p.into_inner());
        route.leases.expire(now);
        Ok(route.leases.counts())
    }

    async fn cooldowns(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let now = self.quotas.now_us();
        let Some(route) = self.pools.get(route) else {
            return Ok(Vec::new());
        };
        let route = route.lock().unwrap_or_else(|p| p.into_inner());
        let mut cooling: Vec<(u64, &Arc<str>)> = route
            .cooling
            .iter()
            .filter(|(_, &until)| until > now)
            .map(|(id, &until)| (until, id))
            .collect();
        // Soonest to end first, then by id: the order of the Redis sorted set.
        cooling.sort_unstable();
        Ok(cooling
            .into_iter()
            .map(|(until, id)| (id.to_string(), until - now))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route that left the config (a reload) leaves nothing behind in the pools; the routes
    /// that stay keep their counts and cooldowns, and reading a route that left creates nothing.
    #[tokio::test]
    async fn a_route_that_left_drops_its_pool_and_cooldowns() {
        let store = MemoryStore::new();
        let members = [PoolMember::new("a"), PoolMember::new("b")];
        for route in ["stays", "goes"] {
            let ask = Assign {
                route,
                members: &members,
                order: Order::LeastUsed,
                excluded: &[],
                quota: None,
                cost: 1,
                cooldowns: true,
                at_us: None,
                lease: None,
                sticky: None,
            };
            store.assign(ask).await.unwrap();
            store.cool(route, "b", 60_000_000, None).await.unwrap();
        }
        assert_eq!(store.pool_routes(), 2);
        store.retain_routes(&["stays"]).await;
        assert_eq!(store.pool_routes(), 1);
        assert!(store.counts("goes").await.unwrap().is_empty());
        assert!(store.cooldowns("goes").await.unwrap().is_empty());
        store.restore_to_min("goes", "a", &[]).await.unwrap();
        assert_eq!(store.pool_routes(), 1, "reads create nothing");
        assert_eq!(
            store.counts("stays").await.unwrap(),
            [("b".to_string(), 0), ("a".to_string(), 1)]
        );
        assert_eq!(store.cooldowns("stays").await.unwrap().len(), 1);
    }

    /// `max_entries` bounds the members' own windows as it bounds the route's: set low, a
    /// member's window fills it, and the next request is refused, never let through uncounted;
    /// so set high, it lets them hold as much as the route may (a key pool's daily windows).
    #[tokio::test]
    async fn max_entries_bounds_the_members_windows_too() {
        let store = MemoryStore::with_limits(MemoryLimits {
            max_keys: 10,
            max_entries: 5,
        });
        let windows: Arc<[sluice_limiter::Window]> = Arc::new([sluice_limiter::Window {
            name: "day".into(),
            limit: 1_000,
            length_us: 86_400_000_000,
        }]);
        let members = [PoolMember {
            id: "key".into(),
            windows,
        }];
        let ask = Assign {
            route: "pool",
            members: &members,
            order: Order::LeastUsed,
            excluded: &[],
            quota: None,
            cost: 1,
            cooldowns: false,
            at_us: Some(1_000_000),
            lease: None,
            sticky: None,
        };
        for _ in 0..5 {
            assert!(matches!(
                store.assign(ask).await,
                Ok(Assignment::Assigned { .. })
            ));
        }
        assert!(matches!(
            store.assign(ask).await,
            Err(StoreError::TooManyKeys)
        ));
    }
}
