//! `round_robin`: smooth weighted round-robin over the healthy members, in process.
//!
//! On a route whose members have their own windows or cooldowns (SPEC §8), the schedule still
//! decides the order, but the store makes the choice: the scheduled member first, then the
//! others in pool order, the first one not cooling and whose windows admit the request.

use std::sync::Arc;
use std::time::Instant;

use sluice_balancer::WeightedRoundRobin;
use sluice_state::{Acquire, StateStore};

use super::{charge, choose_among, Admission, Attempt, Limits, Selector, Tried};

/// Round-robin over a pool's schedule; the quota, if any, is charged in the store.
pub(crate) struct RoundRobin {
    schedule: Arc<WeightedRoundRobin>,
    route: Arc<str>,
    /// Member windows and cooldowns, when the route has any.
    limits: Option<Limits>,
}

impl RoundRobin {
    pub(crate) fn new(
        schedule: Arc<WeightedRoundRobin>,
        route: Arc<str>,
        limits: Option<Limits>,
    ) -> RoundRobin {
        RoundRobin {
            schedule,
            route,
            limits,
        }
    }

    /// The schedule, whose position a replacing table carries on from.
    pub(crate) fn schedule(&self) -> &Arc<WeightedRoundRobin> {
        &self.schedule
    }

    /// The next member not tried yet. A down member whose cooldown is over gets its single
    /// trial first (the schedule decides that).
    pub(crate) fn pick(&self, tried: &Tried) -> Option<Attempt> {
        let pick = self.schedule.pick(Instant::now(), |i| tried.contains(i))?;
        Some(Attempt::new(
            self.schedule.members().clone(),
            pick.index,
            pick.trial,
        ))
    }

    /// The store's choice among the scheduled member and then every other healthy untried
    /// member, in pool order after it.
    async fn choose(
        &self,
        state: &dyn StateStore,
        limits: &Limits,
        tried: &Tried,
        quota: Option<Acquire<'_>>,
        cost: u64,
    ) -> Admission {
        let pool = self.schedule.members();
        let Some(first) = self.schedule.pick(Instant::now(), |i| tried.contains(i)) else {
            return Admission::NoMember { quota: None };
        };
        let n = pool.members().len();
        let mut order = Vec::with_capacity(n);
        order.push(first.index);
        order.extend(
            (1..n)
                .map(|k| (first.index + k) % n)
                .filter(|&i| pool.members()[i].health.is_up() && !tried.contains(i)),
        );
        let trial = first.trial.then_some(first.index);
        choose_among(state, &self.route, pool, limits, &order, trial, quota, cost).await
    }
}

impl Selector for RoundRobin {
    async fn admit(
        &self,
        state: &dyn StateStore,
        quota: Option<Acquire<'_>>,
        cost: u64,
    ) -> Admission {
        if let Some(limits) = &self.limits {
            return self
                .choose(state, limits, &Tried::default(), quota, cost)
                .await;
        }
        // The member is chosen before the quota is charged, so that a request with nowhere
        // to go costs nothing.
        let first = self.pick(&Tried::default());
        charge(state, quota, first).await
    }

    async fn next(&self, state: &dyn StateStore, tried: &mut Tried) -> Option<Attempt> {
        match &self.limits {
            None => self.pick(tried),
            Some(limits) => self
                .choose(state, limits, tried, None, tried.cost)
                .await
                .into_attempt(),
        }
    }
}
