//! The unit tests of sluice's own modules in vendored crates.
//!
//! `third_party/` stays out of the workspace, so its crates' tests do not run with ours. A
//! module sluice wrote whole, with its tests, is compiled here on its own instead, so that CI
//! runs them (third_party/PATCHES.md says which patch each belongs to).

/// pingora-core's idle pool without a task per connection.
#[path = "../third_party/pingora-core/src/connectors/idle.rs"]
#[allow(dead_code)]
mod idle;

/// pingora-proxy's one-lock task pipe.
#[path = "../third_party/pingora-proxy/src/task_pipe.rs"]
#[allow(dead_code)]
mod task_pipe;
