//! sluice-store: run the limiter and the allocator over Redis, shared by every instance.
//!
//! This crate has one job: keep the state of `sluice-limiter` and `sluice-allocator` in Redis
//! (or Redis Cluster), so that every gateway instance decides on the same quotas, counts,
//! member windows and cooldowns. [`RedisStore`] implements `sluice_allocator::StateStore` with
//! the same behaviour as its memory backend, and the same behavioural suites run against both
//! (and against Redis Cluster), in this crate's `tests/`. It is the only place that knows
//! - the Redis connection and its call discipline (timeout, one retry after a reconnect),
//!   in [`connection`];
//! - the Redis key schema (SPEC §6), in [`keys`];
//! - how the Lua scripts in `lua/` are assembled and answered, in [`scripts`], and how one
//!   call is written and sent (`FCALL`, or `EVALSHA`), in `call.rs`;
//! - the calls that decide every request of a route (and quota key) waiting together, in
//!   `batch.rs`, and the settlements', in `settle_batch.rs`;
//! - what it does differently below saturation (a write to Redis at once, a second call out
//!   per batch lane), as the gateway tells it, in [`load`];
//! - a route kept as several sub-logs (`state_shards`): what this instance knows of them, in
//!   `shards.rs`, and how a call goes to one of them or to each, in `redis/sub_logs.rs`.
//!
//! At most one script call per request (requests that wait together share one), time from
//! Redis `TIME`.
//!
//! It knows nothing of Pingora or HTTP.

mod batch;
mod call;
pub mod connection;
pub mod keys;
pub mod load;
mod redis;
pub mod scripts;
mod settle_batch;
mod shards;

pub use connection::RedisConnection;
pub use redis::{RedisStore, RedisStoreConfig};

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    sluice_testkit::architecture::assert_no_cycles(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    );
}
