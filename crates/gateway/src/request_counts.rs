//! Request counters by status for one label value (a route's `sluice_requests_total`, a
//! client's `sluice_client_requests_total`), with the common statuses' handles kept: apart
//! from [`crate::metrics`], so that what holds such counters (a route, a client) need not
//! depend on everything the metrics know.

use prometheus::{IntCounter, IntCounterVec};

/// Statuses whose `sluice_requests_total{route,status}` every route has from the start: a
/// member's success and what sluice itself answers on a route (429 quota, 502 unreachable,
/// 503 no member, 504 member timeout).
const PRESET_STATUSES: [u16; 5] = [200, 429, 502, 503, 504];

/// Statuses common enough to keep a resolved `sluice_requests_total` handle for, per route.
const COMMON_STATUSES: [u16; 16] = [
    200, 201, 204, 206, 301, 302, 304, 400, 401, 403, 404, 429, 500, 502, 503, 504,
];

/// `sluice_requests_total{route,status}` for one route (or `sluice_client_requests_total
/// {client,status}` for one client), with the handles of the common statuses
/// resolved on their first use and kept: counting a request is then an atomic increment, not a
/// label lookup (hashing both labels, a read lock on the vector's map) per request. Handles
/// other than [`PRESET_STATUSES`] are created lazily, so such a status shows in the exposition
/// only once a request had it. Other statuses fall back to the lookup.
pub struct RouteRequests {
    /// The route's name (or the client's).
    route: std::sync::Arc<str>,
    common: [std::sync::OnceLock<IntCounter>; COMMON_STATUSES.len()],
}

impl std::fmt::Debug for RouteRequests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RouteRequests").field(&self.route).finish()
    }
}

impl RouteRequests {
    /// The counters of route `route`, those of [`PRESET_STATUSES`] created at 0.
    pub fn new(route: std::sync::Arc<str>, vec: &IntCounterVec) -> RouteRequests {
        let requests = RouteRequests {
            route,
            common: Default::default(),
        };
        for status in PRESET_STATUSES {
            requests.handle(vec, status);
        }
        requests
    }

    fn handle(&self, vec: &IntCounterVec, status: u16) -> Option<&IntCounter> {
        let i = COMMON_STATUSES.iter().position(|&s| s == status)?;
        Some(self.common[i].get_or_init(|| requests_of(vec, &self.route, status)))
    }

    /// Counts one request answered with `status` (0 when none was sent).
    pub fn inc(&self, vec: &IntCounterVec, status: u16) {
        match self.handle(vec, status) {
            Some(counter) => counter.inc(),
            None => requests_of(vec, &self.route, status).inc(),
        }
    }
}

/// The `sluice_requests_total` handle of `route` and `status` (0: none was sent), by lookup.
pub fn requests_of(vec: &IntCounterVec, route: &str, status: u16) -> IntCounter {
    // A status code's text is static: no allocation for the label.
    let code = http::StatusCode::from_u16(status).ok();
    vec.with_label_values(&[route, code.as_ref().map_or("0", |c| c.as_str())])
}
