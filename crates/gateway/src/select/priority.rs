//! `priority`: the first healthy member in list order; the others are backups, used in turn
//! when those before them are down or fail to connect (like HAProxy's `backup` servers, or
//! Envoy's priority levels).
//!
//! On a route whose members have their own windows or cooldowns (SPEC §8), a member at its
//! limit or cooling down is passed over like a down one, by the store, in list order.

use std::sync::Arc;
use std::time::Instant;

use sluice_balancer::Members;

use super::{refuse_weights, Attempt, InProcess, Kind, Limits, Parts, Problems, Tried};
use crate::config::{UpstreamConfig, YamlPath};

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
}

impl Kind for Priority {
    const NAME: &'static str = "priority";

    fn check(up: &UpstreamConfig, at: &YamlPath, problems: &mut Problems) {
        refuse_weights(up, at, "priority follows the list order", problems);
    }

    fn build(parts: &Parts<'_>) -> Priority {
        Priority::new(
            parts.pool.clone(),
            parts.route.clone(),
            parts.active_limits(),
        )
    }
}

impl InProcess for Priority {
    fn pool(&self) -> &Arc<Members> {
        &self.pool
    }

    fn route(&self) -> &str {
        &self.route
    }

    fn limits(&self) -> Option<&Limits> {
        self.limits.as_ref()
    }

    fn pick(&self, tried: &Tried) -> Option<Attempt> {
        Priority::pick(self, tried)
    }

    /// The due trial, then every healthy untried member in list order.
    fn order(&self, tried: &Tried) -> (Vec<usize>, Option<usize>) {
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
        (order, trial)
    }
}
