//! The quota's Lua, as Redis runs it: the files stay in the repository's `lua/`, next to the
//! other libraries they are assembled with (`sluice-store`'s `scripts.rs`), and are compiled
//! into this crate so that the limiter's semantics and their Redis form change together.

/// The quota library (`lua/quota.lua`): functions that check and record a quota.
pub const LIBRARY: &str = include_str!("../../../lua/quota.lua");
/// The quota driver (`lua/quota_run.lua`): one or more requests against one quota key.
pub const DRIVER: &str = include_str!("../../../lua/quota_run.lua");
/// The client quota driver (`lua/client_run.lua`): one request against its route's quota and
/// its client's own windows together, or (Redis Cluster) the client's alone, and their give-back.
pub const CLIENT_DRIVER: &str = include_str!("../../../lua/client_run.lua");
/// The usage driver (`lua/usage_run.lua`): a reservation whose windows each take an amount of
/// their own, and the batched settlements that rewrite those entries.
pub const USAGE_DRIVER: &str = include_str!("../../../lua/usage_run.lua");
