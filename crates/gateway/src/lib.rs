//! sluice-gateway: the sluice egress gateway.
//!
//! This crate wires the policy crates into a Pingora proxy service. It owns the config
//! ([`config`]), routing ([`router`]), the table a request runs on ([`table`]), the
//! `ProxyHttp` implementation ([`proxy`]), the admin API ([`admin`]), health probes over
//! Pingora's connector ([`health`]) and process life ([`server`]). The balancer knows nothing
//! of Pingora; this crate is the only place the two meet.

pub mod admin;
mod admission;
pub mod config;
pub mod demo;
pub mod headers;
pub mod health;
pub mod logging;
pub mod metrics;
pub mod problem;
pub mod proxy;
pub mod reload;
pub mod router;
pub mod server;
pub mod table;
pub mod target;
