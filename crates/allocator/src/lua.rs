//! The allocator's Lua, as Redis runs it: the files stay in the repository's `lua/`, and are
//! compiled into this crate so that the allocator's semantics and their Redis form change
//! together. `sluice-store` assembles them with the limiter's ([`sluice_limiter::lua`]).

/// The least-used library (`lua/allocator.lua`): functions that pick, count, sync and restore
/// pool members.
pub const ALLOCATOR_LIBRARY: &str = include_str!("../../../lua/allocator.lua");
/// The member library (`lua/members.lua`): member windows, cooldowns, and the walk over
/// candidates. Uses the quota library and the least-used one.
pub const MEMBERS_LIBRARY: &str = include_str!("../../../lua/members.lua");
/// Least-used `assign`, `sync` and `restore` on one pool (`lua/allocator_run.lua`).
pub const ALLOCATOR_DRIVER: &str = include_str!("../../../lua/allocator_run.lua");
/// Quota and least-used assignment in one atomic call, for one or more requests of one route
/// and quota key (`lua/fused_run.lua`).
pub const FUSED_DRIVER: &str = include_str!("../../../lua/fused_run.lua");
/// One or more assignments (sluice-store's batch.rs) with member windows, cooldowns or a
/// preference order, with the route's quota (`lua/assign_run.lua`).
pub const ASSIGN_DRIVER: &str = include_str!("../../../lua/assign_run.lua");
/// Cooling a member, and listing the cooling members (`lua/cool_run.lua`).
pub const COOL_DRIVER: &str = include_str!("../../../lua/cool_run.lua");
/// The lease library (`lua/leases.lua`): requests in flight per member, their expiry, and the
/// fewest-leases walk. Uses the member library.
pub const LEASES_LIBRARY: &str = include_str!("../../../lua/leases.lua");
/// Releasing, renewing and reading a route's leases (`lua/lease_run.lua`).
pub const LEASE_DRIVER: &str = include_str!("../../../lua/lease_run.lua");
/// The sticky library (`lua/sticky.lua`): sessions bound to members, their expiry and their
/// counters.
pub const STICKY_LIBRARY: &str = include_str!("../../../lua/sticky.lua");
/// Unbinding a session and reading a route's bindings (`lua/sticky_run.lua`).
pub const STICKY_DRIVER: &str = include_str!("../../../lua/sticky_run.lua");
