//! sluice-balancer: choose a member of an upstream pool.
//!
//! This crate has one job: given a pool of weighted members and what is known of their health,
//! say which member the next request goes to. It provides
//! - [`Schedule`]: a precomputed smooth weighted round-robin order, read lock-free on the hot path;
//! - [`MemberHealth`]: the per-member state machine fed by active probes and by passive
//!   observations of live traffic (fall, rise, cooldown and a single trial request);
//! - [`Members`]: a pool's member set and its health, kept apart from any selection so that
//!   policies that need no schedule (priority, least-used) carry none;
//! - [`WeightedRoundRobin`]: a [`Schedule`] and its cursor over the healthy members of a
//!   [`Members`], rebuilt through [`Rebuild`] whenever that set changes;
//! - [`Probe`] and [`spawn_active_check`]: the background loop that runs one active check per member.
//!
//! It knows nothing of Pingora or HTTP: the gateway plugs its own probes in through [`Probe`] and
//! learns about health changes through [`HealthObserver`].

mod health;
mod members;
mod probe;
mod round_robin;
mod schedule;

pub use health::{HealthPolicy, MemberHealth, Transition};
pub use members::{HealthObserver, MemberSpec, Members, Rebuild};
pub use probe::{report_to, spawn_active_check, ActiveCheck, Probe, ProbeReport, TcpProbe};
pub use round_robin::{Pick, WeightedRoundRobin};
pub use schedule::Schedule;

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    sluice_testkit::architecture::assert_no_cycles(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    );
}
