//! `least_in_flight`: the member with the fewest requests in flight across every gateway
//! instance, ties to the lexically smallest id. The counts are the route's leases in the state
//! store, and the store picks and takes the lease in one atomic step, with the route's quota,
//! member windows and cooldowns as for any other policy, so two instances never both take the
//! same minimum.
//!
//! Unlike `least_used`, which counts assignments for good, a lease ends with its request: a
//! member that answers slowly holds more, and gets fewer new requests.

use std::sync::Arc;
use std::time::Instant;

use sluice_balancer::Members;

use super::{refuse_weights, Attempt, InProcess, Kind, Limits, Parts, Problems, Tried};
use crate::config::{UpstreamConfig, YamlPath};

/// Least-in-flight over a pool whose leases live in the state store.
pub(crate) struct LeastInFlight {
    pool: Arc<Members>,
    route: Arc<str>,
    /// The route's member windows, cooldowns and leases (walked fewest leases first).
    limits: Option<Limits>,
}

impl LeastInFlight {
    /// A down member due for its trial (passive-only pools): without it a member that was
    /// ejected once would never be tried again.
    fn due_trial(&self, tried: &Tried) -> Option<usize> {
        let index = self.pool.take_due_trial(Instant::now())?;
        if !tried.contains(index) {
            return Some(index);
        }
        self.pool.release_trial(index, Instant::now());
        None
    }
}

impl Kind for LeastInFlight {
    const NAME: &'static str = "least_in_flight";
    const LEASES: bool = true;

    fn check(up: &UpstreamConfig, at: &YamlPath, problems: &mut Problems) {
        refuse_weights(
            up,
            at,
            "least_in_flight follows the leases in flight",
            problems,
        );
    }

    fn build(parts: &Parts<'_>) -> LeastInFlight {
        let mut limits = parts.active_limits();
        if let Some(plan) = limits.as_mut().and_then(|l| l.leases.as_mut()) {
            plan.fewest = true;
        }
        LeastInFlight {
            pool: parts.pool.clone(),
            route: parts.route.clone(),
            limits,
        }
    }
}

impl InProcess for LeastInFlight {
    fn pool(&self) -> &Arc<Members> {
        &self.pool
    }

    fn route(&self) -> &str {
        &self.route
    }

    fn limits(&self) -> Option<&Limits> {
        self.limits.as_ref()
    }

    /// Without leases (a table built without a store plan) there are no counts: the first
    /// healthy untried member.
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

    /// The candidates: the due trial and every healthy untried member; the store orders them
    /// by their leases.
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
