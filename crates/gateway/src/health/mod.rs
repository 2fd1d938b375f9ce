//! Member health, in one place: the pool a route's members share, how health carries over a
//! reload, and what happens when a member goes up or down.
//!
//! The balancer crate owns the state machine ([`sluice_balancer::MemberHealth`]) and the
//! member set that every selection policy reads ([`Members`]); this module wires them to the
//! gateway:
//! - [`pool_for`] builds a route's pool, with each surviving member's health carried over from
//!   the table it replaces (its round-robin position is the selection policy's to carry);
//! - [`HealthLog`] logs transitions, mirrors them in `sluice_member_healthy`, and applies
//!   least-used's `on_restore: min`.
//!
//! The active checks themselves, which probe members over Pingora's connector, are in
//! [`crate::checks`]: they read the table, which is built from this module.

use std::sync::{Arc, OnceLock, Weak};

use prometheus::IntGauge;
use sluice_allocator::StateStore;
use sluice_balancer::{
    HealthObserver, HealthPolicy, MemberHealth, MemberSpec, Members, Transition,
};

use crate::config::{OnRestore, RouteConfig};
use crate::metrics::Metrics;

/// The pool of a route's members. A member that survives a reload (same id in the route it
/// replaces) keeps its health.
pub(crate) fn pool_for(
    name: &Arc<str>,
    rc: &RouteConfig,
    metrics: &Metrics,
    state: &Arc<dyn StateStore>,
    before: Option<&Members>,
) -> Arc<Members> {
    let up = &rc.upstream;
    let policy = HealthPolicy {
        passive_fall: up.passive.fall.get(),
        cooldown: up.passive.cooldown.0,
        active: up
            .health_check
            .as_ref()
            .map(|h| (h.rise.get(), h.fall.get())),
    };
    let mut gauges = Vec::with_capacity(up.members.len());
    let specs = up
        .members
        .iter()
        .map(|m| {
            let id: Arc<str> = m.name.clone();
            let health = before
                .and_then(|b| b.members().iter().find(|s| s.id == id))
                .map_or_else(|| Arc::new(MemberHealth::new()), |s| s.health.clone());
            let gauge = metrics.member_healthy.with_label_values(&[name, &id]);
            gauge.set(i64::from(health.is_up()));
            gauges.push((id.clone(), gauge));
            MemberSpec {
                id,
                weight: m.weight(),
                health,
            }
        })
        .collect();
    // `check` lets only a policy that counts assignments have `on_restore`.
    let restore = (up.on_restore == Some(OnRestore::Min)).then(|| RestoreToMin {
        state: state.clone(),
        pool: OnceLock::new(),
    });
    let observer = Arc::new(HealthLog {
        restore,
        route: name.clone(),
        gauges,
    });
    let pool = Arc::new(Members::new(specs, policy, observer.clone()));
    if let Some(r) = &observer.restore {
        let _ = r.pool.set(Arc::downgrade(&pool));
    }
    pool
}

/// Logs health transitions, mirrors them in `sluice_member_healthy`, and applies the `min`
/// restore policy of least-used pools.
pub(crate) struct HealthLog {
    restore: Option<RestoreToMin>,
    route: Arc<str>,
    gauges: Vec<(Arc<str>, IntGauge)>,
}

impl HealthObserver for HealthLog {
    fn health_changed(&self, member: &MemberSpec, t: Transition, cause: &'static str) {
        let up = t == Transition::Up;
        // Transitions are rare, so a scan beats keeping a map in step with the pool.
        if let Some((_, gauge)) = self.gauges.iter().find(|(id, _)| **id == *member.id) {
            gauge.set(i64::from(up));
        }
        if let (true, Some(restore)) = (up, &self.restore) {
            restore.spawn(&self.route, &member.id);
        }
        if up {
            tracing::info!(target: "sluice::health", route = %self.route, member = %member.id, cause, "member up");
        } else {
            tracing::warn!(target: "sluice::health", route = %self.route, member = %member.id, cause, "member down");
        }
    }
}

/// Raises a restored member to the pool's least count, in the background: health transitions
/// happen on whichever thread noticed them and must not wait for Redis.
struct RestoreToMin {
    state: Arc<dyn StateStore>,
    /// Set right after the pool is built (the pool owns this observer, hence `Weak`).
    pool: OnceLock<Weak<Members>>,
}

impl RestoreToMin {
    fn spawn(&self, route: &Arc<str>, member: &Arc<str>) {
        let (Ok(runtime), Some(pool)) = (
            tokio::runtime::Handle::try_current(),
            self.pool.get().and_then(Weak::upgrade),
        ) else {
            return;
        };
        let excluded: Vec<String> = pool
            .down_members()
            .iter()
            .map(|&i| pool.members()[i as usize].id.to_string())
            .collect();
        let (state, route, member) = (self.state.clone(), route.clone(), member.clone());
        runtime.spawn(async move {
            let excluded: Vec<&str> = excluded.iter().map(String::as_str).collect();
            if let Err(e) = state.restore_to_min(&route, &member, &excluded).await {
                tracing::warn!(target: "sluice::health", route = %route, member = %member, error = %e, "could not apply on_restore: min");
            }
        });
    }
}
