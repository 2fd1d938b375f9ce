//! sluice-usage: the amounts of usage-metered quotas.
//!
//! This crate has one job: turn a request and its answer into amounts a quota window holds.
//! It holds
//! - [`Millionths`], the fixed-point amount every window keeps, and [`Decimal`], the exact
//!   numbers amounts are computed from (rounding: [`amount`]);
//! - [`Amount`], what a unit's `reserve` or `settle` is made of, made once per config load
//!   from the shapes `sluice-config` checked (`Amount::from(&sluice_config::Amount)`);
//! - [`reserve`], the amount a request reserves at admission, from its headers and a bounded
//!   prefix of its body;
//! - [`ResponseScanner`], the amount an answer settles, read from its head and from its body
//!   as the body streams by (JSON, or Server-Sent Events via [`sse`]), decompressing for
//!   scanning only, within a bound; or why it cannot ([`Unsettled`]);
//! - [`json`], the path lookup both sides read JSON with, building no document.
//!
//! It knows nothing of Pingora or Redis: the gateway hands it headers and bytes, and hands the
//! amounts to the quota store.

#[cfg(test)]
mod alloc_count;
pub mod amount;
mod decode;
pub mod json;
mod reserve;
mod scan;
mod spec;
pub mod sse;

pub use amount::{Decimal, Millionths};
pub use reserve::{reserve, Request};
pub use scan::{ResponseScanner, Unsettled};
pub use spec::{Amount, HeaderName, JsonPath, Part};

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    sluice_testkit::architecture::assert_no_cycles(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    );
}
