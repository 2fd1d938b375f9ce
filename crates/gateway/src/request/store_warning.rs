//! Warnings of state-store failures, bounded: during an outage every request fails the same
//! way, so each route logs at most one line a second (the metric counts them all). Each route
//! has its own second, so that one busy route's failures cannot hide another's. Admission and
//! the cooldowns learned from members' answers both warn through here.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, PoisonError};

use sluice_limiter::StoreError;

/// When each route was last warned about.
static STORE_WARNINGS: LazyLock<WarnLimiter> = LazyLock::new(WarnLimiter::default);

pub(crate) fn warn_store_error(route: &str, error: &StoreError, what: &str) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if STORE_WARNINGS.allow(route, now) {
        tracing::warn!(target: "sluice::store", route, %error, "state store failed; {what}");
    }
}

/// The most routes [`WarnLimiter`] keeps a second for. Routes come from the config, so this
/// is only reached by a very large one; past it, the routes not yet warned about in the
/// current second wait for the next, and a second never has more lines than this.
const MAX_WARNED_ROUTES: usize = 1024;

/// When each route was last warned about, in whole seconds.
#[derive(Default)]
struct WarnLimiter {
    last: Mutex<HashMap<Box<str>, u64>>,
}

impl WarnLimiter {
    /// Whether `route` may be warned about in the second `now`; if so, it is not again in
    /// that second.
    fn allow(&self, route: &str, now: u64) -> bool {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(at) = last.get_mut(route) {
            return std::mem::replace(at, now) != now;
        }
        if last.len() >= MAX_WARNED_ROUTES {
            last.retain(|_, at| *at == now);
            if last.len() >= MAX_WARNED_ROUTES {
                return false;
            }
        }
        last.insert(route.into(), now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_warnings_are_limited_per_route() {
        let limiter = WarnLimiter::default();
        assert!(limiter.allow("a", 5));
        assert!(
            !limiter.allow("a", 5),
            "a is rate-limited within its second"
        );
        assert!(
            limiter.allow("b", 5),
            "b's failure is logged while a is rate-limited"
        );
        assert!(!limiter.allow("b", 5));
        assert!(limiter.allow("a", 6), "the next second logs a again");
    }

    #[test]
    fn the_routes_kept_are_bounded() {
        let limiter = WarnLimiter::default();
        for i in 0..MAX_WARNED_ROUTES {
            assert!(limiter.allow(&format!("r{i}"), 7));
        }
        assert!(!limiter.allow("one-more", 7), "a full second logs no more");
        assert!(limiter.allow("one-more", 8), "the next second makes room");
        assert!(limiter.last.lock().unwrap().len() <= MAX_WARNED_ROUTES);
    }
}
