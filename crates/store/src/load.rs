//! Whether the gateway is under load, and what the store does differently when it is not.
//!
//! Under load, the store trades latency for throughput: the Redis client holds a write until
//! the rest of the runtime's turn has run, so that the commands of one turn leave together (one
//! system call and one wake-up of Redis for many), and a batch lane keeps one call out at a
//! time, so that the requests arriving meanwhile share the next one (Redis's fixed cost per
//! call is most of a small call's). Below saturation there is little to write or decide
//! together, and both waits only add to a request's latency: the write goes at once, and a
//! lane may have a second call out.
//!
//! The gateway decides, from how busy its workers have been (it batches its own sends on the
//! same terms), and tells the store through [`under_load`]. Until it does, the store behaves as
//! under load, the choice that costs Redis least.

use std::sync::atomic::{AtomicBool, Ordering};

static UNDER_LOAD: AtomicBool = AtomicBool::new(true);

/// Tells the store whether the gateway is under load; it holds for every store and every
/// connection to Redis of the process.
pub fn under_load(on: bool) {
    UNDER_LOAD.store(on, Ordering::Relaxed);
    redis::aio::set_flush_deferral(on);
}

/// What the gateway last said (true until it has said anything).
pub(crate) fn is_under_load() -> bool {
    UNDER_LOAD.load(Ordering::Relaxed)
}
