//! Prometheus metrics (SPEC §4), in a registry of our own so tests can run several gateways
//! in one process.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Label value for requests that matched no route.
pub const NO_ROUTE: &str = "_none";

/// Route label value, and access-log route, of requests whose head could not be parsed: they
/// never reach routing (`request::refuse`).
pub const UNPARSED: &str = "-";

/// Every metric sluice exports.
pub struct Metrics {
    registry: Registry,
    /// `sluice_requests_total{route,status}`
    pub requests: IntCounterVec,
    /// `sluice_request_duration_seconds{route}`
    pub request_duration: HistogramVec,
    /// `sluice_upstream_attempts_total{route,member,outcome}`; outcome is `ok`,
    /// `connect_failure` or `error` (failed after connecting).
    pub upstream_attempts: IntCounterVec,
    /// `sluice_quota_rejections_total{route,window}`
    pub quota_rejections: IntCounterVec,
    /// `sluice_member_healthy{route,member}`: 1 up, 0 down.
    pub member_healthy: IntGaugeVec,
    /// `sluice_config_reloads_total{result}`
    pub config_reloads: IntCounterVec,
    /// `sluice_store_errors_total{op}`
    pub store_errors: IntCounterVec,
    /// `sluice_selection_fallbacks_total{route}`
    pub selection_fallbacks: IntCounterVec,
    /// `sluice_quota_keys_refused_total{route}`
    pub quota_keys_refused: IntCounterVec,
    /// `sluice_connections_closed_total{reason}`: client connections sluice closed on a
    /// limit: `idle_timeout`, `header_timeout` or `max_connections`.
    pub connections_closed: IntCounterVec,
    /// `sluice_connections_open`: client connections open on the proxy listeners.
    pub connections_open: IntGauge,
    /// `sluice_memory_trims_total`: times sluice asked the allocator to hand freed memory back
    /// to the system after many connections closed (`limits::MemoryTrim`; glibc only).
    pub memory_trims: IntCounter,
    /// `sluice_tunnels_active{route}`: CONNECT tunnels open now.
    pub tunnels_active: IntGaugeVec,
    /// `sluice_tunnel_bytes_total{route,direction}`: bytes carried by tunnels; direction is
    /// `up` (client to member) or `down`.
    pub tunnel_bytes: IntCounterVec,
    /// `sluice_bytes_total{route,direction}`: body bytes of requests and tunnels; direction is
    /// `in` (from the client) or `out` (to the client). Present per route from the start.
    pub bytes: IntCounterVec,
    /// `sluice_member_cooldowns_total{route,member}`: cooldowns learned from a member's
    /// answers (SPEC §8).
    pub member_cooldowns: IntCounterVec,
}

impl Metrics {
    /// Creates and registers all metrics.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let requests = counter(
            "sluice_requests_total",
            "Requests answered, by route and status.",
            &["route", "status"],
        );
        // Present from the start, so a rate over them needs no first refusal.
        for status in ["400", "431"] {
            requests.with_label_values(&[UNPARSED, status]);
        }
        let upstream_attempts = counter(
            "sluice_upstream_attempts_total",
            "Attempts to send a request to a member, by outcome.",
            &["route", "member", "outcome"],
        );
        let quota_rejections = counter(
            "sluice_quota_rejections_total",
            "Requests refused by a quota window.",
            &["route", "window"],
        );
        let quota_keys_refused = counter(
            "sluice_quota_keys_refused_total",
            "Requests with a new quota key refused because their route holds as many keys as the memory store keeps.",
            &["route"],
        );
        let config_reloads = counter(
            "sluice_config_reloads_total",
            "Config reloads, by result.",
            &["result"],
        );
        let store_errors = counter(
            "sluice_store_errors_total",
            "Failed calls to the state store.",
            &["op"],
        );
        let selection_fallbacks = counter(
            "sluice_selection_fallbacks_total",
            "Requests routed by in-process round-robin because the least-used store failed.",
            &["route"],
        );
        let connections_closed = counter(
            "sluice_connections_closed_total",
            "Client connections closed by a limit, by reason.",
            &["reason"],
        );
        let connections_open = IntGauge::new(
            "sluice_connections_open",
            "Client connections open on the proxy listeners.",
        )
        .expect("valid metric");
        registry
            .register(Box::new(connections_open.clone()))
            .expect("unique metric");
        let memory_trims = IntCounter::new(
            "sluice_memory_trims_total",
            "Times sluice asked the allocator to hand freed memory back to the system, after many client connections closed.",
        )
        .expect("valid metric");
        registry
            .register(Box::new(memory_trims.clone()))
            .expect("unique metric");
        let tunnel_bytes = counter(
            "sluice_tunnel_bytes_total",
            "Bytes carried by CONNECT tunnels: up is client to member, down the other way.",
            &["route", "direction"],
        );
        let bytes = counter(
            "sluice_bytes_total",
            "Body bytes from clients (in) and to clients (out), requests and tunnels, by route.",
            &["route", "direction"],
        );
        let member_cooldowns = counter(
            "sluice_member_cooldowns_total",
            "Cooldowns learned from a member's answers (a status in cooldown.on_status).",
            &["route", "member"],
        );
        let tunnels_active = IntGaugeVec::new(
            Opts::new("sluice_tunnels_active", "CONNECT tunnels open now."),
            &["route"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(tunnels_active.clone()))
            .expect("unique metric");
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "sluice_request_duration_seconds",
                "Time from request head to the end of the response, by route.",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0,
            ]),
            &["route"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(request_duration.clone()))
            .expect("unique metric");
        let member_healthy = IntGaugeVec::new(
            Opts::new(
                "sluice_member_healthy",
                "1 when the member is up, 0 when down.",
            ),
            &["route", "member"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(member_healthy.clone()))
            .expect("unique metric");
        Metrics {
            registry,
            requests,
            request_duration,
            upstream_attempts,
            quota_rejections,
            member_healthy,
            config_reloads,
            store_errors,
            selection_fallbacks,
            quota_keys_refused,
            connections_closed,
            connections_open,
            memory_trims,
            tunnels_active,
            tunnel_bytes,
            bytes,
            member_cooldowns,
        }
    }

    /// The Prometheus text exposition of all metrics.
    pub fn render(&self) -> String {
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Statuses common enough to keep a resolved `sluice_requests_total` handle for, per route.
const COMMON_STATUSES: [u16; 16] = [
    200, 201, 204, 206, 301, 302, 304, 400, 401, 403, 404, 429, 500, 502, 503, 504,
];

/// `sluice_requests_total{route,status}` for one route, with the handles of the common statuses
/// resolved on their first use and kept: counting a request is then an atomic increment, not a
/// label lookup (hashing both labels, a read lock on the vector's map) per request. Handles
/// are created lazily, so a status shows in the exposition only once a request had it, as with
/// `with_label_values` per request. Other statuses fall back to the lookup.
pub struct RouteRequests {
    route: std::sync::Arc<str>,
    common: [std::sync::OnceLock<IntCounter>; COMMON_STATUSES.len()],
}

impl RouteRequests {
    /// The counters of route `route`.
    pub fn new(route: std::sync::Arc<str>) -> RouteRequests {
        RouteRequests {
            route,
            common: Default::default(),
        }
    }

    /// Counts one request answered with `status` (0 when none was sent).
    pub fn inc(&self, vec: &IntCounterVec, status: u16) {
        if let Some(i) = COMMON_STATUSES.iter().position(|&s| s == status) {
            self.common[i]
                .get_or_init(|| requests_of(vec, &self.route, status))
                .inc();
        } else {
            requests_of(vec, &self.route, status).inc();
        }
    }
}

/// The `sluice_requests_total` handle of `route` and `status` (0: none was sent), by lookup.
pub fn requests_of(vec: &IntCounterVec, route: &str, status: u16) -> IntCounter {
    // A status code's text is static: no allocation for the label.
    let code = http::StatusCode::from_u16(status).ok();
    vec.with_label_values(&[route, code.as_ref().map_or("0", |c| c.as_str())])
}
