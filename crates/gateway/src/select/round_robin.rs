//! `round_robin`: smooth weighted round-robin over the healthy members, in process.

use std::sync::Arc;
use std::time::Instant;

use sluice_balancer::WeightedRoundRobin;
use sluice_state::{Acquire, StateStore};

use super::{charge, Admission, Attempt, Selector, Tried};

/// Round-robin over a pool's schedule; the quota, if any, is charged in the store.
pub(crate) struct RoundRobin {
    schedule: Arc<WeightedRoundRobin>,
}

impl RoundRobin {
    pub(crate) fn new(schedule: Arc<WeightedRoundRobin>) -> RoundRobin {
        RoundRobin { schedule }
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

impl Selector for RoundRobin {
    async fn admit(&self, state: &dyn StateStore, quota: Option<Acquire<'_>>) -> Admission {
        // The member is chosen before the quota is charged, so that a request with nowhere
        // to go costs nothing.
        let first = self.pick(&Tried::default());
        charge(state, quota, first).await
    }

    async fn next(&self, _state: &dyn StateStore, tried: &mut Tried) -> Option<Attempt> {
        self.pick(tried)
    }
}
