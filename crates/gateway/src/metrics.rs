//! Prometheus metrics (SPEC §4), in a registry of our own so tests can run several gateways
//! in one process.

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

pub use crate::request_counts::{requests_of, RouteRequests};

/// Label value for requests that matched no route.
pub const NO_ROUTE: &str = "_none";

/// Route label value, and access-log route, of requests whose head could not be parsed: they
/// never reach routing (`request::refuse`).
pub const UNPARSED: &str = "-";

/// `source` of `sluice_request_duration_seconds` for answers sluice made itself.
pub const GATEWAY: &str = "gateway";

/// `source` of `sluice_request_duration_seconds` for a member's answers.
pub const UPSTREAM: &str = "upstream";

/// The `op` values of `sluice_store_errors_total`.
pub const STORE_OPS: [&str; 4] = ["quota", "select", "cool", "settle"];

/// The allocator the binary was built with, for `sluice_build_info`.
const ALLOCATOR: &str = if cfg!(feature = "jemalloc") {
    "jemalloc"
} else if cfg!(feature = "mimalloc") {
    "mimalloc"
} else {
    "system"
};

/// Every metric sluice exports.
pub struct Metrics {
    registry: Registry,
    /// `sluice_requests_total{route,status}`
    pub requests: IntCounterVec,
    /// `sluice_request_duration_seconds{route,source}`: every request but tunnels; `source`
    /// is `upstream` when a member's response head was sent, `gateway` when sluice answered.
    pub request_duration: HistogramVec,
    /// `sluice_member_request_duration_seconds{route,member}`: requests a member answered, by
    /// that member (the last one tried).
    pub member_duration: HistogramVec,
    /// `sluice_request_duration_seconds{route="_none",source="gateway"}`, resolved once.
    pub no_route_duration: Histogram,
    /// `sluice_request_duration_seconds{route="-",source="gateway"}`, resolved once.
    pub unparsed_duration: Histogram,
    /// `sluice_requests_in_flight{route}`: requests of the route from admission (after any
    /// wait in the quota line) to the end of their answer.
    pub in_flight: IntGaugeVec,
    /// `sluice_quota_remaining{route,window}`: what is left in a route quota's window at scrape
    /// time, in the window's own unit (routes with `key: route` only: other keys are
    /// client-chosen label values).
    pub quota_remaining: GaugeVec,
    /// `sluice_quota_reserved{route,window,unit}`: the part of what the window holds that is
    /// open reservations, from every instance, in its unit (`requests` for a window of requests).
    pub quota_reserved: GaugeVec,
    /// `sluice_quota_settled{route,window,unit}`: the rest of what it holds, settled usage.
    pub quota_settled: GaugeVec,
    /// `sluice_member_quota_remaining{route,member,window}`: the same for a member's own
    /// windows.
    pub member_quota_remaining: GaugeVec,
    /// `sluice_member_quota_reserved{route,member,window,unit}`
    pub member_quota_reserved: GaugeVec,
    /// `sluice_member_quota_settled{route,member,window,unit}`
    pub member_quota_settled: GaugeVec,

    /// `sluice_upstream_attempts_total{route,member,outcome}`; outcome is `ok`,
    /// `connect_failure` or `error` (failed after connecting).
    pub upstream_attempts: IntCounterVec,
    /// `sluice_quota_rejections_total{route,window}`
    pub quota_rejections: IntCounterVec,
    /// `sluice_member_healthy{route,member}`: 1 up, 0 down.
    pub member_healthy: IntGaugeVec,
    /// `sluice_member_in_flight{route,member}`: leases in flight on a member, across every
    /// instance, read from the store at scrape time.
    pub member_in_flight: IntGaugeVec,
    /// `sluice_sticky_bindings{route}`: sticky sessions bound, across every instance, read
    /// from the store at scrape time.
    pub sticky_bindings: IntGaugeVec,
    /// `sluice_sticky_unbound_total{route}`: new sessions a full binding table left unbound,
    /// and `sluice_sticky_moved_total{route}`: bindings moved off their member; both counted
    /// in the store (every instance's), read at scrape time.
    pub sticky_unbound: IntCounterVec,
    pub sticky_moved: IntCounterVec,
    /// `sluice_config_reloads_total{result}`
    pub config_reloads: IntCounterVec,
    /// `sluice_store_errors_total{op}`
    pub store_errors: IntCounterVec,
    /// `sluice_selection_fallbacks_total{route}`
    pub selection_fallbacks: IntCounterVec,
    /// `sluice_fallbacks_total{from,to,reason}`
    pub fallbacks: IntCounterVec,
    /// `sluice_quota_keys_refused_total{route}`
    pub quota_keys_refused: IntCounterVec,
    /// `sluice_usage_unsettled_total{route,reason}`: answers whose amount could not be read,
    /// so their reservation stands.
    pub usage_unsettled: IntCounterVec,
    /// `sluice_usage_overrun_total{route}`: settlements that took a window past its limit.
    pub usage_overrun: IntCounterVec,
    /// `sluice_client_denials_total{mode,code,client}`: what `clients` refused
    /// (`mode="enforce"`), or would have refused and let go (`mode="report"`), by answer code
    /// and by client ([`client_label`]).
    pub client_denials: IntCounterVec,
    /// `sluice_client_requests_total{client,status}`: the requests and tunnels of each client
    /// ([`client_label`]), with a `clients` section only.
    pub client_requests: IntCounterVec,
    /// `sluice_client_requests_total{client="unknown"}`, kept once used.
    unknown_client: std::sync::OnceLock<RouteRequests>,
    /// `sluice_client_auth_failures_total{reason}`: failed identifications, by why they
    /// failed (`crate::clients::throttle::Failure`); each counts toward its address's
    /// `failed_auth` bound.
    pub client_auth_failures: IntCounterVec,
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
            registered(
                &registry,
                IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
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
        let usage_unsettled = counter(
            "sluice_usage_unsettled_total",
            "Answers on usage-metered routes whose amount could not be read: the reservation stands.",
            &["route", "reason"],
        );
        let usage_overrun = counter(
            "sluice_usage_overrun_total",
            "Settlements that took a usage window past its limit.",
            &["route"],
        );
        let quota_keys_refused = counter(
            "sluice_quota_keys_refused_total",
            "Requests refused because the store is full: their route holds as many quota keys or entries as the memory store keeps, or Redis is at its maxmemory.",
            &["route"],
        );
        let client_denials = counter(
            "sluice_client_denials_total",
            "Requests and tunnels clients refused (mode=enforce) or would have refused and let go (mode=report), by answer code and client.",
            &["mode", "code", "client"],
        );
        let client_requests = counter(
            "sluice_client_requests_total",
            "Requests and tunnels answered, by client (a listed name, or unknown) and status.",
            &["client", "status"],
        );
        let client_auth_failures = counter(
            "sluice_client_auth_failures_total",
            "Failed identifications of callers (clients), by reason.",
            &["reason"],
        );
        // Present from the start, so a rate over them needs no first failure.
        for failure in crate::clients::throttle::Failure::ALL {
            client_auth_failures.with_label_values(&[failure.as_str()]);
        }
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
        // Labels from the config's route names and a fixed set of reasons: bounded.
        let fallbacks = counter(
            "sluice_fallbacks_total",
            "Requests that went on to a route's fallback, by the route left, the route taken and why.",
            &["from", "to", "reason"],
        );
        let connections_closed = counter(
            "sluice_connections_closed_total",
            "Client connections closed by a limit, by reason.",
            &["reason"],
        );
        let connections_open = registered(
            &registry,
            IntGauge::new(
                "sluice_connections_open",
                "Client connections open on the proxy listeners.",
            )
            .expect("valid metric"),
        );
        let memory_trims = registered(
            &registry,
            IntCounter::new(
                "sluice_memory_trims_total",
                "Times sluice asked the allocator to hand freed memory back to the system, after many client connections closed.",
            )
            .expect("valid metric"),
        );
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
        let tunnels_active = registered(
            &registry,
            IntGaugeVec::new(
                Opts::new("sluice_tunnels_active", "CONNECT tunnels open now."),
                &["route"],
            )
            .expect("valid metric"),
        );
        let histogram = |name: &str, help: &str, labels: &[&str]| {
            let buckets = vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0,
            ];
            let opts = HistogramOpts::new(name, help).buckets(buckets);
            registered(
                &registry,
                HistogramVec::new(opts, labels).expect("valid metric"),
            )
        };
        let request_duration = histogram(
            "sluice_request_duration_seconds",
            "Time from request head to the end of the response, by route and by who answered: upstream (a member) or gateway (sluice itself).",
            &["route", "source"],
        );
        let no_route_duration = request_duration.with_label_values(&[NO_ROUTE, GATEWAY]);
        let unparsed_duration = request_duration.with_label_values(&[UNPARSED, GATEWAY]);
        let member_duration = histogram(
            "sluice_member_request_duration_seconds",
            "Time from request head to the end of the response, for requests a member answered, by that member.",
            &["route", "member"],
        );
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            registered(
                &registry,
                IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        let member_healthy = gauge(
            "sluice_member_healthy",
            "1 when the member is up, 0 when down.",
            &["route", "member"],
        );
        let member_in_flight = gauge(
            "sluice_member_in_flight",
            "Leases in flight on the member when scraped, from every instance (routes that keep leases).",
            &["route", "member"],
        );
        let sticky_bindings = gauge(
            "sluice_sticky_bindings",
            "Sticky sessions bound to a member when scraped, from every instance (routes with upstream.sticky).",
            &["route"],
        );
        let sticky_unbound = counter(
            "sluice_sticky_unbound_total",
            "New sticky sessions routed without a binding because the route's table was full (max_bindings), from every instance.",
            &["route"],
        );
        let sticky_moved = counter(
            "sluice_sticky_moved_total",
            "Sticky bindings moved off their member: it could not take the request, or answered a rebind_on status or failed to connect, from every instance.",
            &["route"],
        );
        let in_flight = gauge(
            "sluice_requests_in_flight",
            "Requests of the route being answered now.",
            &["route"],
        );
        let float_gauge = |name: &str, help: &str, labels: &[&str]| {
            registered(
                &registry,
                GaugeVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        let quota_remaining = float_gauge(
            "sluice_quota_remaining",
            "What is left in a window of the route's quota when scraped, in the window's unit (quotas with key: route).",
            &["route", "window"],
        );
        let quota_reserved = float_gauge(
            "sluice_quota_reserved",
            "Open reservations in a window of the route's quota when scraped, from every instance, in the window's unit.",
            &["route", "window", "unit"],
        );
        let quota_settled = float_gauge(
            "sluice_quota_settled",
            "Settled usage in a window of the route's quota when scraped, in the window's unit.",
            &["route", "window", "unit"],
        );
        let member_quota_remaining = float_gauge(
            "sluice_member_quota_remaining",
            "What is left in a window of a member's own quota when scraped, in the window's unit.",
            &["route", "member", "window"],
        );
        let member_quota_reserved = float_gauge(
            "sluice_member_quota_reserved",
            "Open reservations in a window of a member's own quota when scraped, from every instance, in the window's unit.",
            &["route", "member", "window", "unit"],
        );
        let member_quota_settled = float_gauge(
            "sluice_member_quota_settled",
            "Settled usage in a window of a member's own quota when scraped, in the window's unit.",
            &["route", "member", "window", "unit"],
        );
        let build_info = gauge(
            "sluice_build_info",
            "Always 1; the labels say which build is running.",
            &["version", "allocator"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), ALLOCATOR])
            .set(1);
        // process_cpu_seconds_total, process_resident_memory_bytes, open fds... from /proc.
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("unique metric");
        // Process-wide counters kept by the log writer and the span exporter.
        registered(&registry, crate::logging::LINES_DROPPED.clone());
        registered(&registry, crate::otel::SPANS_DROPPED.clone());
        registered(&registry, crate::otel::SPANS_FAILED.clone());
        // Every label value known up front starts at 0, so that a rate() or an alert over
        // them needs no first event.
        for op in STORE_OPS {
            store_errors.with_label_values(&[op]);
        }
        for result in ["ok", "error"] {
            config_reloads.with_label_values(&[result]);
        }
        for reason in [
            "idle_timeout",
            "header_timeout",
            "max_connections",
            "max_handshakes",
        ] {
            connections_closed.with_label_values(&[reason]);
        }
        requests.with_label_values(&[NO_ROUTE, "404"]);
        Metrics {
            registry,
            requests,
            request_duration,
            member_duration,
            no_route_duration,
            unparsed_duration,
            in_flight,
            quota_remaining,
            quota_reserved,
            quota_settled,
            member_quota_remaining,
            member_quota_reserved,
            member_quota_settled,
            upstream_attempts,
            quota_rejections,
            member_healthy,
            member_in_flight,
            sticky_bindings,
            sticky_unbound,
            sticky_moved,
            config_reloads,
            store_errors,
            selection_fallbacks,
            fallbacks,
            quota_keys_refused,
            usage_unsettled,
            usage_overrun,
            client_denials,
            client_requests,
            unknown_client: std::sync::OnceLock::new(),
            client_auth_failures,
            connections_closed,
            connections_open,
            memory_trims,
            tunnels_active,
            tunnel_bytes,
            bytes,
            member_cooldowns,
        }
    }

    /// `sluice_requests_total` summed per route, for `/status`.
    pub fn requests_per_route(&self) -> std::collections::HashMap<String, u64> {
        use prometheus::core::Collector;
        let mut sums = std::collections::HashMap::new();
        for family in self.requests.collect() {
            for m in family.get_metric() {
                let route = m.get_label().iter().find(|l| l.get_name() == "route");
                if let Some(route) = route {
                    *sums.entry(route.get_value().to_string()).or_default() +=
                        m.get_counter().get_value() as u64;
                }
            }
        }
        sums
    }

    /// Counts a request or tunnel that went through the clients step in
    /// `sluice_client_requests_total`, through the client's kept handles.
    pub fn count_client(&self, client: Option<&crate::clients::Client>, status: u16) {
        let requests = match client {
            Some(c) => c.requests(&self.client_requests),
            None => self.unknown_client(),
        };
        requests.inc(&self.client_requests, status);
    }

    fn unknown_client(&self) -> &RouteRequests {
        self.unknown_client.get_or_init(|| {
            RouteRequests::new(crate::config::UNKNOWN.into(), &self.client_requests)
        })
    }

    /// Makes the client series of a new table's `clients` what the metrics show: each listed
    /// client's, and `unknown`'s, are there from the start (at 0), and those of clients no
    /// longer listed go, so the `client` label stays bounded by the list however many
    /// reloads there were.
    pub fn clients_listed(&self, clients: Option<&crate::clients::Clients>) {
        let list = clients.map_or(&[][..], |c| &c.list[..]);
        if let Some(clients) = clients {
            self.unknown_client();
            // The refusals of callers nobody identified, in the mode in force, start at 0, so
            // that a rate or an alert over them needs no first refusal.
            let mode = match clients.mode {
                crate::config::ClientsMode::Enforce => "enforce",
                crate::config::ClientsMode::Report => "report",
            };
            for code in [
                "proxy_auth_required",
                "client_auth_required",
                "auth_throttled",
            ] {
                self.client_denials
                    .with_label_values(&[mode, code, crate::config::UNKNOWN]);
            }
        }
        for c in list {
            c.requests(&self.client_requests);
        }
        // `unknown`'s handles are kept for the process's life: its series stay.
        let names: std::collections::HashSet<&str> = list.iter().map(|c| &*c.name).collect();
        let listed = |name: &str| name == crate::config::UNKNOWN || names.contains(name);
        for vec in [&self.client_requests, &self.client_denials] {
            for labels in label_sets(vec) {
                let client = labels.iter().find(|(k, _)| k == "client");
                if client.is_some_and(|(_, v)| !listed(v)) {
                    let values: std::collections::HashMap<&str, &str> = labels
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    let _ = vec.remove(&values);
                }
            }
        }
    }

    /// Each client's counts for `/status`: requests, refusals (`enforce`) and refusals let
    /// go (`report`), by client label.
    pub fn client_counts(&self) -> std::collections::HashMap<String, ClientCounts> {
        use prometheus::core::Collector;
        let mut counts: std::collections::HashMap<String, ClientCounts> = Default::default();
        let label = |m: &prometheus::proto::Metric, name: &str| {
            m.get_label()
                .iter()
                .find(|l| l.get_name() == name)
                .map(|l| l.get_value().to_string())
        };
        for family in self.client_requests.collect() {
            for m in family.get_metric() {
                if let Some(client) = label(m, "client") {
                    counts.entry(client).or_default().requests +=
                        m.get_counter().get_value() as u64;
                }
            }
        }
        for family in self.client_denials.collect() {
            for m in family.get_metric() {
                let (Some(client), Some(mode)) = (label(m, "client"), label(m, "mode")) else {
                    continue;
                };
                let entry = counts.entry(client).or_default();
                let n = m.get_counter().get_value() as u64;
                if mode == "report" {
                    entry.would_deny += n;
                } else {
                    entry.denied += n;
                }
            }
        }
        counts
    }

    /// The Prometheus text exposition of all metrics.
    pub fn render(&self) -> String {
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_default()
    }
}

/// A client's counts, for `/status`.
#[derive(Debug, Default, Clone, Copy)]
pub struct ClientCounts {
    /// Requests and tunnels answered.
    pub requests: u64,
    /// Refused by `clients` (`mode: enforce`).
    pub denied: u64,
    /// Would have been refused, and went on (`mode: report`).
    pub would_deny: u64,
}

/// The `client` label of a caller: its client's name, or `unknown`. Never anything the caller
/// sent: a name comes from the config, so the label's values are bounded by the list.
pub fn client_label(client: Option<&crate::clients::Client>) -> &str {
    client.map_or(crate::config::UNKNOWN, |c| &*c.name)
}

/// The label sets of every series `vec` holds now.
fn label_sets(vec: &IntCounterVec) -> Vec<Vec<(String, String)>> {
    use prometheus::core::Collector;
    vec.collect()
        .iter()
        .flat_map(|f| f.get_metric())
        .map(|m| {
            m.get_label()
                .iter()
                .map(|l| (l.get_name().to_string(), l.get_value().to_string()))
                .collect()
        })
        .collect()
}

/// `metric`, registered in `registry`; names are fixed, so a clash is a bug.
fn registered<M: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: M,
) -> M {
    registry
        .register(Box::new(metric.clone()))
        .expect("unique metric");
    metric
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Holds a gauge one higher while it lives: a request in flight, released however it ends.
pub struct GaugeGuard(IntGauge);

impl GaugeGuard {
    /// Raises `gauge` until the guard drops.
    pub fn enter(gauge: &IntGauge) -> GaugeGuard {
        gauge.inc();
        GaugeGuard(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl crate::clients::Client {
    /// `sluice_client_requests_total{client=<its name>}`, the handles kept in the client, which
    /// a reload builds anew.
    pub fn requests(&self, vec: &IntCounterVec) -> &RouteRequests {
        self.requests
            .get_or_init(|| RouteRequests::new(self.name.clone(), vec))
    }
}
