//! `round_robin`: smooth weighted round-robin over the healthy members, in process.
//!
//! On a route whose members have their own windows or cooldowns (SPEC §8), the schedule still
//! decides the order, but the store makes the choice: the scheduled member first, then the
//! others in pool order, the first one not cooling and whose windows admit the request.

use std::sync::Arc;
use std::time::Instant;

use sluice_balancer::{Members, WeightedRoundRobin};

use super::{Attempt, InProcess, Kind, Limits, Parts, Tried};

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
}

impl Kind for RoundRobin {
    const NAME: &'static str = "round_robin";

    fn build(parts: &Parts<'_>) -> RoundRobin {
        RoundRobin::new(parts.schedule(), parts.route.clone(), parts.active_limits())
    }
}

impl InProcess for RoundRobin {
    fn schedule(&self) -> Option<&Arc<WeightedRoundRobin>> {
        Some(&self.schedule)
    }

    fn pool(&self) -> &Arc<Members> {
        self.schedule.members()
    }

    fn route(&self) -> &str {
        &self.route
    }

    fn limits(&self) -> Option<&Limits> {
        self.limits.as_ref()
    }

    fn pick(&self, tried: &Tried) -> Option<Attempt> {
        RoundRobin::pick(self, tried)
    }

    /// The scheduled member, then every other healthy untried member, in pool order after it.
    fn order(&self, tried: &Tried) -> (Vec<usize>, Option<usize>) {
        let Some(first) = self.schedule.pick(Instant::now(), |i| tried.contains(i)) else {
            return (Vec::new(), None);
        };
        let pool = self.schedule.members();
        let n = pool.members().len();
        let mut order = Vec::with_capacity(n);
        order.push(first.index);
        order.extend(
            (1..n)
                .map(|k| (first.index + k) % n)
                .filter(|&i| pool.members()[i].health.is_up() && !tried.contains(i)),
        );
        (order, first.trial.then_some(first.index))
    }
}
