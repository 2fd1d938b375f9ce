//! `least_used`: the member with the fewest assignments across every gateway instance, picked
//! and counted in the state store in one atomic step, fused with the route's quota.
//!
//! When the store cannot answer, the request falls back to round-robin in process: a store
//! outage must not stop traffic that the quota policy lets through.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_allocator::{Assign, Assignment, Lease, Order, PoolMember, StateStore};
use sluice_balancer::{Members, WeightedRoundRobin};
use sluice_limiter::{Acquire, StoreError};

use async_trait::async_trait;

use super::{
    assign, given_back, held, refuse_weights, Admission, Attempt, Kind, Limits, Parts, Problems,
    Reserving, RoundRobin, Selector, Tried,
};
use crate::config::{UpstreamConfig, YamlPath};
use crate::lease::LeasePlan;

/// How many members the store may name that this table does not know, for one request,
/// before the request gives up finding one it knows.
const UNKNOWN_MEMBERS: usize = 4;

/// Least-used over a pool whose counts live in the state store.
pub(crate) struct LeastUsed {
    route: Arc<str>,
    pool: Arc<Members>,
    /// Round-robin over the same members, for when the store cannot answer; only this needs
    /// a schedule.
    fallback: RoundRobin,
    /// Every member's id, in config order, as the store's `sync` takes them.
    ids: Arc<[Arc<str>]>,
    /// The same members as `assign` takes them, with their own windows (SPEC §8); built once
    /// per table rather than per request.
    members: Arc<[PoolMember]>,
    /// The route has `cooldown`: cooling members are skipped.
    cooldowns: bool,
    /// Member id → index, to map the store's answer back to a member.
    index_of: HashMap<Arc<str>, usize>,
    /// Whether this table's member list has been written to the store. It is done on the
    /// route's first assignment, from the runtime that serves requests.
    synced: AtomicBool,
    /// The leases its requests take, when it caps requests in flight.
    leases: Option<LeasePlan>,
}

impl LeastUsed {
    pub(crate) fn new(
        route: Arc<str>,
        pool: Arc<Members>,
        fallback: RoundRobin,
        limits: &Limits,
    ) -> LeastUsed {
        let ids: Arc<[Arc<str>]> = pool.members().iter().map(|m| m.id.clone()).collect();
        let members = limits.members.clone();
        let index_of = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.clone(), i))
            .collect();
        LeastUsed {
            route,
            pool,
            fallback,
            ids,
            members,
            cooldowns: limits.cooldowns,
            index_of,
            synced: AtomicBool::new(false),
            leases: limits.leases.clone(),
        }
    }

    /// Ids of the members that are down, for exclusion.
    fn down_ids(&self) -> Vec<&str> {
        self.pool
            .down_members()
            .iter()
            .map(|&i| &*self.ids[i as usize])
            .collect()
    }

    /// A least-used assignment over this table's members, avoiding `excluded`.
    fn ask<'a>(
        &'a self,
        excluded: &'a [&'a str],
        quota: Option<Acquire<'a>>,
        cost: u64,
        lease: Option<Lease<'a>>,
    ) -> Assign<'a> {
        Assign {
            route: &self.route,
            members: &self.members,
            order: Order::LeastUsed,
            excluded,
            quota,
            cost: cost.max(1),
            cooldowns: self.cooldowns,
            at_us: None,
            lease,
            sticky: None,
        }
    }

    /// A new lease id, when the route takes leases.
    fn lease_id(&self) -> Option<Arc<str>> {
        self.leases.as_ref().map(LeasePlan::next_id)
    }

    /// The lease ask under `id`.
    fn lease_ask<'a>(&self, id: &'a Option<Arc<str>>) -> Option<Lease<'a>> {
        self.leases
            .as_ref()
            .zip(id.as_deref())
            .map(|(p, id)| p.ask(id))
    }

    /// Writes this table's member list to the store, once per route and table.
    async fn ensure_synced(&self, state: &dyn StateStore) {
        if self.synced.load(Ordering::Acquire) {
            return;
        }
        let down = self.down_ids();
        if state.sync(&self.route, &self.ids, &down).await.is_ok() {
            self.synced.store(true, Ordering::Release);
        }
    }

    /// A down member's trial request, decided by the store like any other assignment to it:
    /// the route's quota, the member's cooldown and its own windows, and its count. Only the
    /// member itself is a candidate. `None` when the member cannot take the request now
    /// (cooling, or its windows full): its trial is put off until it can, and the request goes
    /// to the members that are up.
    async fn try_trial(
        &self,
        state: &dyn StateStore,
        mut trial: Attempt,
        quota: Option<Acquire<'_>>,
        cost: u64,
        reserving: Option<Reserving<'_>>,
    ) -> Option<Admission> {
        let index = trial.index();
        let others: Vec<&str> = self
            .ids
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != index)
            .map(|(_, id)| &**id)
            .collect();
        let id = self.lease_id();
        let ask = self.ask(&others, quota, cost, self.lease_ask(&id));
        let answer = assign(state, ask, reserving).await;
        let mut lease = match &answer {
            Ok((assignment, _)) => held(self.leases.as_ref(), id, assignment),
            Err(_) => {
                given_back(self.leases.as_ref(), id);
                None
            }
        };
        match answer {
            Ok((Assignment::Assigned { member, quota }, entries)) => {
                // A member this table does not know: its lease is back before the request's
                // first attempt is asked of the store (see `attempt_for`).
                if !self.index_of.contains_key(member.as_str()) {
                    if let Some(lease) = lease.take() {
                        lease.release().await;
                    }
                }
                // Another instance may have synced a newer member list a moment ago: a
                // member this table does not know was counted there, and the trial waits.
                let first = match self.index_of.get(&*member) {
                    Some(&i) if i == index => Some(trial),
                    _ => self.attempt_for(&member),
                }
                .map(|a| a.leased(lease));
                Some(Admission::Admitted {
                    first,
                    quota,
                    entries,
                })
            }
            Ok((Assignment::QuotaRefused(outcome), _)) => Some(Admission::QuotaRefused(outcome)),
            Ok((Assignment::Concurrency { quota }, _)) => Some(Admission::Concurrency {
                quota,
                client: false,
            }),
            Ok((Assignment::ClientConcurrency { quota }, _)) => Some(Admission::Concurrency {
                quota,
                client: true,
            }),
            Ok((Assignment::Busy { retry_after_us, .. }, _)) => {
                trial.put_off(Duration::from_micros(retry_after_us));
                None
            }
            // Nowhere to go for the trial (the pool no longer lists the member): given back
            // as the attempt drops.
            Ok((Assignment::NoMember { .. }, _)) => None,
            // The store cannot say: the trial goes, and the route's on_store_error decides.
            Err(error) => Some(Admission::StoreFailed {
                error,
                first: Some(trial),
                fallback: true,
            }),
        }
    }

    /// The attempt for a member the store named; `None` for a member this table does not
    /// know. Another instance synced a newer member list a moment ago, and its newcomer, with
    /// the fewest assignments, is named often until this instance reloads too. This table has
    /// neither its address nor its windows (the ask sent only its own members'), so the
    /// request cannot go there; nor may it go to a member of this table picked in process,
    /// whose own windows the store did not charge. It goes on without a first member: its
    /// first attempt is then asked of the store as a retry is ([`Selector::next`]), charged to
    /// that member's windows, with the unknown members excluded. The route's quota stays
    /// charged once, by this assignment.
    fn attempt_for(&self, member: &str) -> Option<Attempt> {
        let index = *self.index_of.get(member)?;
        Some(Attempt::new(self.pool.clone(), index, false))
    }
}

impl Kind for LeastUsed {
    const NAME: &'static str = "least_used";
    const COUNTS: bool = true;

    fn check(up: &UpstreamConfig, at: &YamlPath, problems: &mut Problems) {
        refuse_weights(up, at, "least_used counts assignments", problems);
    }

    fn build(parts: &Parts<'_>) -> LeastUsed {
        // The fallback (store down) is plain round-robin: without the store there are no
        // shared windows or cooldowns to apply.
        let fallback = RoundRobin::new(parts.schedule(), parts.route.clone(), None);
        LeastUsed::new(
            parts.route.clone(),
            parts.pool.clone(),
            fallback,
            parts.limits,
        )
    }
}

#[async_trait]
impl Selector for LeastUsed {
    fn schedule(&self) -> Option<&Arc<WeightedRoundRobin>> {
        Some(self.fallback.schedule())
    }

    async fn admit(
        &self,
        state: &dyn StateStore,
        quota: Option<Acquire<'_>>,
        cost: u64,
        reserving: Option<Reserving<'_>>,
    ) -> Admission {
        self.ensure_synced(state).await;
        // A passive-only pool gives a due member its trial here, as round-robin does.
        if let Some(index) = self.pool.take_due_trial(Instant::now()) {
            let trial = Attempt::new(self.pool.clone(), index, true);
            if let Some(admission) = self.try_trial(state, trial, quota, cost, reserving).await {
                return admission;
            }
        }
        let down = self.down_ids();
        let id = self.lease_id();
        let ask = self.ask(&down, quota, cost, self.lease_ask(&id));
        match assign(state, ask, reserving).await {
            Ok((assignment, entries)) => {
                let mut lease = held(self.leases.as_ref(), id, &assignment);
                if let Assignment::Assigned { member, .. } = &assignment {
                    // A member this table does not know: its lease is back before the request's
                    // first attempt is asked of the store (see `attempt_for`), which must not
                    // count it against the caps.
                    if !self.index_of.contains_key(member.as_str()) {
                        if let Some(lease) = lease.take() {
                            lease.release().await;
                        }
                    }
                }
                Admission::of(assignment, entries, |member| {
                    self.attempt_for(member).map(|a| a.leased(lease))
                })
            }
            Err(error) => {
                given_back(self.leases.as_ref(), id);
                Admission::StoreFailed {
                    error,
                    first: None,
                    fallback: true,
                }
            }
        }
    }

    async fn next(&self, state: &dyn StateStore, tried: &mut Tried) -> Option<Attempt> {
        if tried.fallback {
            return self.fallback.pick(tried);
        }
        let mut excluded = self.down_ids();
        excluded.extend(tried.iter().map(|i| &*self.ids[i]));
        // Members the store named that this table does not know (see `attempt_for`): each is
        // excluded from the next ask. The pool holds a handful of them at most (a reload's
        // newcomers); the bound keeps a store that keeps naming them from holding the request.
        let mut unknown: Vec<String> = Vec::new();
        loop {
            let mut asked = excluded.clone();
            asked.extend(unknown.iter().map(String::as_str));
            let id = self.lease_id();
            let ask = self.ask(&asked, None, tried.cost, self.lease_ask(&id));
            match assign(state, ask, tried.reserving()).await {
                Ok((assignment @ Assignment::Assigned { .. }, entries)) => {
                    let lease = held(self.leases.as_ref(), id, &assignment);
                    let Assignment::Assigned { member, .. } = assignment else {
                        return None;
                    };
                    if let Some(attempt) = self.attempt_for(&member) {
                        tried.reserved(&entries);
                        return Some(attempt.leased(lease));
                    }
                    // An unknown member's lease is back before the next ask, which must not
                    // count it. Its own windows were not sent, so it has no entry to settle.
                    if let Some(lease) = lease {
                        lease.release().await;
                    }
                    if unknown.len() >= UNKNOWN_MEMBERS {
                        return None;
                    }
                    unknown.push(member);
                }
                Ok(_) => return None,
                // A full store refuses (the member's windows could not be charged): no
                // unmetered retry. With nothing to charge, it falls back as below.
                Err(StoreError::TooManyKeys) if super::counts_in_windows(&ask) => {
                    given_back(self.leases.as_ref(), id);
                    return None;
                }
                Err(error) => {
                    given_back(self.leases.as_ref(), id);
                    tracing::debug!(route = %self.route, %error, "least-used retry falls back to round-robin");
                    tried.fallback = true;
                    return self.fallback.pick(tried);
                }
            }
        }
    }
}
