//! A route's quota, made ready to apply: its windows as the state store takes them, what a
//! request costs, what it is counted under, and the metric handles of its refusals.

use http::HeaderValue;
use pingora::proxy::Session;
use prometheus::IntCounter;
use sluice_state::Window;

use crate::config::{OnStoreError, QuotaConfig, QuotaKey};
use crate::metrics::Metrics;

/// A route's quota, ready to apply.
pub struct RouteQuota {
    /// The windows, as the store takes them.
    pub windows: Vec<Window>,
    /// What one quota counts.
    pub key: QuotaKey,
    /// What a request costs when no rule matches.
    pub default_cost: u64,
    /// Cost rules, first match wins.
    pub rules: Vec<CostRule>,
    /// Policy when the store fails.
    pub on_store_error: OnStoreError,
    /// The `RateLimit-Policy` header value, which never changes for a route.
    pub policy: HeaderValue,
    /// `sluice_quota_rejections_total{route,window}`, per window.
    pub rejections: Vec<IntCounter>,
}

/// A cost rule, ready to match.
pub struct CostRule {
    prefix: Box<str>,
    methods: Box<[Box<str>]>,
    cost: u64,
}

impl RouteQuota {
    /// The cost of a request to `path` with `method`.
    pub fn cost(&self, path: &str, method: &str) -> u64 {
        self.rules
            .iter()
            .find(|r| {
                path.starts_with(&*r.prefix)
                    && (r.methods.is_empty() || r.methods.iter().any(|m| &**m == method))
            })
            .map_or(self.default_cost, |r| r.cost)
    }

    /// The quota key of a request: `route`, a header's value, or the client address. Only the
    /// client address needs a buffer of its own.
    pub(crate) fn key_of<'a>(&self, session: &'a Session, buf: &'a mut String) -> &'a str {
        let client = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        self.key_for(&session.req_header().headers, client, buf)
    }

    /// [`RouteQuota::key_of`] from a request's headers and client address, for requests that
    /// Pingora does not parse (CONNECT tunnels).
    pub(crate) fn key_for<'a>(
        &self,
        headers: &'a http::HeaderMap,
        client: Option<std::net::IpAddr>,
        buf: &'a mut String,
    ) -> &'a str {
        match &self.key {
            QuotaKey::Route => "route",
            QuotaKey::Header(name) => headers
                .get(name.as_str())
                .and_then(|v| v.to_str().ok())
                .unwrap_or(""),
            QuotaKey::ClientIp => {
                if let Some(ip) = client {
                    *buf = ip.to_string();
                }
                buf
            }
        }
    }

    /// Builds the quota of `route` from its config.
    pub fn build(route: &str, q: &QuotaConfig, metrics: &Metrics) -> RouteQuota {
        let windows: Vec<Window> = q
            .windows
            .iter()
            .map(|w| Window {
                name: w.name.0.as_str().into(),
                limit: w.limit.get(),
                length_us: u64::try_from(w.window.0.as_micros()).unwrap_or(u64::MAX),
            })
            .collect();
        RouteQuota {
            rejections: windows
                .iter()
                .map(|w| {
                    metrics
                        .quota_rejections
                        .with_label_values(&[route, &w.name])
                })
                .collect(),
            policy: crate::request::answer::ratelimit_policy(&windows),
            windows,
            key: q.key.clone(),
            default_cost: q.cost.default.get(),
            rules: q
                .cost
                .rules
                .iter()
                .map(|r| CostRule {
                    prefix: r.path_prefix.0.as_str().into(),
                    methods: r.methods.iter().map(|m| m.0.as_str().into()).collect(),
                    cost: r.cost.get(),
                })
                .collect(),
            on_store_error: q.on_store_error,
        }
    }
}
