//! `round_robin`: smooth weighted round-robin over the healthy members, in process.

use std::sync::Arc;
use std::time::Instant;

use sluice_balancer::Pool;
use sluice_state::{Acquire, StateStore};

use super::{charge, Admission, Attempt, Selector, Tried};

/// Round-robin over a pool; the quota, if any, is charged in the store.
pub(crate) struct RoundRobin {
    pool: Arc<Pool>,
}

impl RoundRobin {
    pub(crate) fn new(pool: Arc<Pool>) -> RoundRobin {
        RoundRobin { pool }
    }

    /// The next member not tried yet. A down member whose cooldown is over gets its single
    /// trial first (the pool decides that).
    pub(crate) fn pick(pool: &Arc<Pool>, tried: &Tried) -> Option<Attempt> {
        let pick = pool.pick(Instant::now(), |i| tried.contains(i))?;
        Some(Attempt::new(pool.clone(), pick.index, pick.trial))
    }
}

impl Selector for RoundRobin {
    async fn admit(&self, state: &dyn StateStore, quota: Option<Acquire<'_>>) -> Admission {
        // The member is chosen before the quota is charged, so that a request with nowhere
        // to go costs nothing.
        let first = RoundRobin::pick(&self.pool, &Tried::default());
        charge(state, quota, first).await
    }

    async fn next(&self, _state: &dyn StateStore, tried: &mut Tried) -> Option<Attempt> {
        RoundRobin::pick(&self.pool, tried)
    }
}
