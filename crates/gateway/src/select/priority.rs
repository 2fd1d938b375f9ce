//! `priority`: the first healthy member in list order; the others are backups, used in turn
//! when those before them are down or fail to connect (like HAProxy's `backup` servers, or
//! Envoy's priority levels).
//!
//! On a route whose members have their own windows or cooldowns (SPEC §8), a member at its
//! limit or cooling down is passed over like a down one, by the store, in list order.

use std::sync::Arc;
use std::time::Instant;

use sluice_balancer::Members;
use sluice_state::{Acquire, StateStore};

use super::{charge, choose_among, Admission, Attempt, Limits, Selector, Tried};

/// Priority over a pool; the quota, if any, is charged in the store.
pub(crate) struct Priority {
    pool: Arc<Members>,
    route: Arc<str>,
    /// Member windows and cooldowns, when the route has any.
    limits: Option<Limits>,
}

impl Priority {
    pub(crate) fn new(pool: Arc<Members>, route: Arc<str>, limits: Option<Limits>) -> Priority {
        Priority {
            pool,
            route,
            limits,
        }
    }

    /// A down member due for its trial (passive-only pools) goes first: without it a primary
    /// that was ejected once would never be tried again, and its backups would keep the
    /// traffic for good.
    fn due_trial(&self, tried: &Tried) -> Option<usize> {
        let index = self.pool.take_due_trial(Instant::now())?;
        if !tried.contains(index) {
            return Some(index);
        }
        self.pool.release_trial(index, Instant::now());
        None
    }

    fn pick(&self, tried: &Tried) -> Option<Attempt> {
        if let Some(index) = self.due_trial(tried) {
            return Some(Attempt::new(self.pool.clone(), index, true));
        }
        let index = self
            .pool
            .members()
            .iter()
            .enumerate()
            .position(|(i, m)| m.health.is_up() && !tried.contains(i))?;
        Some(Attempt::new(self.pool.clone(), index, false))
    }

    /// The store's choice among the due trial, then every healthy untried member in list order.
    async fn choose(
        &self,
        state: &dyn StateStore,
        limits: &Limits,
        tried: &Tried,
        quota: Option<Acquire<'_>>,
        cost: u64,
    ) -> Admission {
        let trial = self.due_trial(tried);
        let mut order: Vec<usize> = trial.into_iter().collect();
        order.extend(
            self.pool
                .members()
                .iter()
                .enumerate()
                .filter(|(i, m)| m.health.is_up() && !tried.contains(*i))
                .map(|(i, _)| i),
        );
        if order.is_empty() {
            return Admission::NoMember { quota: None };
        }
        choose_among(
            state,
            &self.route,
            &self.pool,
            limits,
            &order,
            trial,
            quota,
            cost,
        )
        .await
    }
}

impl Selector for Priority {
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
