//! `priority`: the first healthy member in list order; the others are backups, used in turn
//! when those before them are down or fail to connect (like HAProxy's `backup` servers, or
//! Envoy's priority levels).

use std::sync::Arc;
use std::time::Instant;

use sluice_balancer::Members;
use sluice_state::{Acquire, StateStore};

use super::{charge, Admission, Attempt, Selector, Tried};

/// Priority over a pool; the quota, if any, is charged in the store.
pub(crate) struct Priority {
    pool: Arc<Members>,
}

impl Priority {
    pub(crate) fn new(pool: Arc<Members>) -> Priority {
        Priority { pool }
    }

    fn pick(&self, tried: &Tried) -> Option<Attempt> {
        // A down member due for its trial (passive-only pools) goes first: without it a
        // primary that was ejected once would never be tried again, and its backups would
        // keep the traffic for good.
        if let Some(index) = self.pool.take_due_trial(Instant::now()) {
            if !tried.contains(index) {
                return Some(Attempt::new(self.pool.clone(), index, true));
            }
            self.pool.release_trial(index, Instant::now());
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

impl Selector for Priority {
    async fn admit(&self, state: &dyn StateStore, quota: Option<Acquire<'_>>) -> Admission {
        let first = self.pick(&Tried::default());
        charge(state, quota, first).await
    }

    async fn next(&self, _state: &dyn StateStore, tried: &mut Tried) -> Option<Attempt> {
        self.pick(tried)
    }
}
