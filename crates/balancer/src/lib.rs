//! sluice-balancer: choose a member of an upstream pool.
//!
//! This crate has one job: given a pool of weighted members and what is known of their health,
//! say which member the next request goes to. It provides
//! - [`Schedule`]: a precomputed smooth weighted round-robin order, read lock-free on the hot path;
//! - [`MemberHealth`]: the per-member state machine fed by active probes and by passive
//!   observations of live traffic (fall, rise, cooldown and a single trial request);
//! - [`Pool`]: members, their health and a health-aware schedule together;
//! - [`Probe`] and [`spawn_active_check`]: the background loop that runs one active check per member.
//!
//! It knows nothing of Pingora or HTTP: the gateway plugs its own probes in through [`Probe`] and
//! learns about health changes through [`HealthObserver`].

mod health;
mod pool;
mod probe;
mod schedule;

pub use health::{HealthPolicy, MemberHealth, Transition};
pub use pool::{HealthObserver, MemberSpec, Pick, Pool};
pub use probe::{report_to, spawn_active_check, ActiveCheck, Probe, ProbeReport, TcpProbe};
pub use schedule::Schedule;
