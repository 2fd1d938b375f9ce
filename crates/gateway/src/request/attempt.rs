//! Selection of each attempt's member, for requests and tunnels alike: the member admission
//! chose, then, after a connect failure, an untried one from the route's policy, within the
//! route's retry budget. How an attempt then connects is the caller's: a peer for Pingora, or
//! a connection for a tunnel.

use sluice_allocator::StateStore;

use crate::metrics::Metrics;
use crate::select::{Attempt, Tried};
use crate::table::Route;

/// Why there is no next attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoAttempt {
    /// No member was eligible for the first attempt.
    NoMember,
    /// Every attempt the budget allows was made, or no untried member is left.
    Exhausted,
}

/// The member of the next attempt: `first` (admission's choice) if it is still there, else an
/// untried member from the route's policy, pushed onto `tried`. `extra` attempts beyond the
/// route's `retries` are allowed (the one cooldown replay, which is no connect retry). When
/// the policy's store fails and it falls back to round-robin, that is counted once per request.
pub(crate) async fn next_member(
    state: &dyn StateStore,
    metrics: &Metrics,
    route: &Route,
    first: &mut Option<Attempt>,
    tried: &mut Tried,
    extra: usize,
) -> Result<Attempt, NoAttempt> {
    let budget = route.config.upstream.retries as usize + extra;
    if tried.count() > budget {
        return Err(NoAttempt::Exhausted);
    }
    let attempt = match first.take() {
        Some(first) => Some(first),
        None => {
            let fell_back = tried.fallback;
            let next = route.policy.next(state, tried).await;
            if tried.fallback && !fell_back {
                metrics.store_errors.with_label_values(&["select"]).inc();
                route.selection_fallbacks.inc();
            }
            next
        }
    };
    let Some(attempt) = attempt else {
        return Err(if tried.count() == 0 {
            NoAttempt::NoMember
        } else {
            NoAttempt::Exhausted
        });
    };
    tried.push(attempt.index());
    Ok(attempt)
}
