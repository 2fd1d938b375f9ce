//! sluice-gateway: the sluice egress gateway.
//!
//! This crate wires the policy crates into a Pingora proxy service; it is the only place they
//! meet Pingora. A request reads top to bottom in [`request`]: admission (route, quota and
//! first member, decided by the route's selection policy), forwarding, answers and
//! accounting. Around it:
//! - [`config`]: the YAML schema and its validation; [`router`]: request → route;
//! - [`table`]: a config made ready to serve, swapped whole on reload ([`reload`]);
//! - [`quota`]: a route's quota made ready to apply; [`state`]: opens the shared state store;
//! - [`usage`]: a route's usage units made ready to apply, and the body read for a reservation;
//! - [`cooldown`]: how long a member's answer asks it to be left alone;
//! - [`lease`]: the leases of requests in flight, released when a request ends, renewed;
//! - [`sticky`]: a request's session, which its route's assignments carry to the store;
//! - [`health`]: member health, its carry-over across reloads, and active checks;
//! - [`egress`]: the guard on destinations the client chooses; [`resolve`]: the process's
//!   resolver, behind the guard and member DNS ([`dns`]);
//! - [`admin`], [`metrics`], [`logging`], [`problem`]: what operators and clients see;
//! - [`trace`]: request ids and W3C trace context; [`otel`]: span export over OTLP;
//! - [`server`]: process life; [`limits`]: bounds on client connections.

pub mod admin;
pub mod checks;
pub mod clients;
pub mod cooldown;
pub mod demo;
pub mod dns;
pub mod dns_refresh;
pub mod egress;
pub mod extra_slots;
pub mod headers;
pub mod health;
pub mod history;
pub mod lease;
pub mod limits;
pub mod listen_tls;
pub mod logging;
pub mod metrics;
pub mod otel;
pub mod problem;
pub mod quota;
pub mod ratelimit;
pub mod reload;
pub mod request;
pub mod request_counts;
pub mod resolve;
pub mod router;
pub mod select;
pub mod server;
pub mod state;
pub mod sticky;
pub mod table;
pub mod target;
pub mod trace;
pub mod tunnel;
pub mod usage;
pub mod wait;

/// The YAML config, its own crate so that it carries no Pingora; `crate::config::X` names it.
pub use sluice_config as config;

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    sluice_testkit::architecture::assert_no_cycles(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    );
}
