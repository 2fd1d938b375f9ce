//! A route's quota, made ready to apply: its windows as the state store takes them, what a
//! request costs, what it is counted under, and the metric handles of its refusals.

use std::sync::atomic::{AtomicU64, Ordering};

use http::HeaderValue;
use pingora::proxy::Session;
use prometheus::IntCounter;
use sluice_limiter::Window;

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
    /// The second (Unix time) of the latest warning that the route's key table is full.
    keys_warned_at: AtomicU64,
    /// The units the route's windows may count in besides requests (`quota.usage`).
    pub usage: Option<crate::usage::RouteUsage>,
    /// Per window, the index of its unit in [`RouteUsage::units`](crate::usage::RouteUsage),
    /// or `None` for a window of requests.
    pub units: Vec<Option<usize>>,
    /// Per window, its calendar when it is a fixed window.
    pub calendars: Vec<Option<sluice_limiter::calendar::Calendar>>,
    /// Per window, the unit it is reported in ([`unit_of`]).
    pub unit_names: Vec<UnitName>,
}

// A window's unit lives with the headers that announce it, below this module.
pub(crate) use crate::ratelimit::{in_own_unit, UnitName};

/// The unit of a configured window, as `/status` and the `RateLimit` headers name it.
pub(crate) fn unit_of(w: &crate::config::WindowConfig) -> UnitName {
    match &w.unit {
        crate::config::WindowUnit::Requests => None,
        crate::config::WindowUnit::Named(name) => Some(std::sync::Arc::from(&*name.0)),
    }
}

/// Quota key values longer than this are replaced by their hash. The client chooses a header's
/// value; without a bound, 4 KB values cost the stores 4 KB per key (35,000 values grew the
/// memory store by 144 MB) and Redis key names as long.
pub const MAX_KEY_LEN: usize = 64;

/// `value`, or for a value longer than [`MAX_KEY_LEN`], `sha256:` and the first 128 bits of
/// its SHA-256 in hex: a fixed size, and no collision that anyone can find.
fn bounded_key<'a>(value: &'a str, buf: &'a mut String) -> &'a str {
    if value.len() <= MAX_KEY_LEN {
        return value;
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(value.as_bytes());
    buf.clear();
    buf.push_str("sha256:");
    buf.push_str(&hex::encode(&digest[..16]));
    buf
}

/// A configured window as the store takes it (a route's or a member's).
pub(crate) fn window_of(w: &crate::config::WindowConfig) -> Window {
    // A window in a usage unit holds millionths of it, as the amounts charged to it are.
    let scale = match w.unit {
        crate::config::WindowUnit::Requests => 1,
        crate::config::WindowUnit::Named(_) => 1_000_000,
    };
    Window {
        name: w.name.0.as_str().into(),
        limit: w.limit.get().saturating_mul(scale),
        // A calendar window's length is its current period's, set at each admission
        // ([`RouteQuota::periods`]).
        length_us: w.window.sliding().map_or(u64::MAX, |d| {
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
        }),
    }
}

/// A calendar window's periods as the stores cut them (`sluice_limiter::calendar`), or `None`
/// for a sliding window.
pub fn calendar_of(w: &crate::config::WindowConfig) -> Option<sluice_limiter::calendar::Calendar> {
    use crate::config::CalendarPeriod;
    use sluice_limiter::calendar::{Calendar, Period};
    let (period, tz) = w.calendar()?;
    let period = match period {
        CalendarPeriod::Day => Period::Day,
        CalendarPeriod::Week => Period::Week,
        CalendarPeriod::Month => Period::Month,
    };
    Some(Calendar::new(period, tz.zone))
}

/// `windows` as read at `now_us` (wall clock, microseconds): each calendar window's length is
/// its current period's span (`calendars`, per window; `sluice_limiter::span`), so that a read
/// that knows no period (cost 0, for `/status` and metrics) counts exactly the period's entries.
/// Sliding windows, and every window when none is a calendar window, are as they are.
pub(crate) fn windows_at(
    windows: &std::sync::Arc<[Window]>,
    calendars: &[Option<sluice_limiter::calendar::Calendar>],
    now_us: u64,
) -> std::sync::Arc<[Window]> {
    if calendars.iter().all(Option::is_none) {
        return windows.clone();
    }
    windows
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let bounds = calendars.get(i).and_then(|c| c.as_ref()?.bounds_at(now_us));
            match bounds {
                Some(b) => Window {
                    length_us: sluice_limiter::span(&sluice_limiter::Period::from(b)),
                    ..w.clone()
                },
                None => w.clone(),
            }
        })
        .collect()
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

    /// The quota key of a request: `route`, a header's value, the client address, or the
    /// name of the client identified (`identified`). Only the client address and long header
    /// values need a buffer of their own. `forwarded` is the client address a trusted proxy's
    /// `X-Forwarded-For` gave, which is the client's where the connection's is the proxy's.
    pub(crate) fn key_of<'a>(
        &self,
        session: &'a Session,
        forwarded: Option<std::net::IpAddr>,
        identified: Option<&'a str>,
        buf: &'a mut String,
    ) -> &'a str {
        let client = forwarded.or_else(|| {
            session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|a| a.ip())
        });
        self.key_for(&session.req_header().headers, client, identified, buf)
    }

    /// [`RouteQuota::key_of`] from a request's headers and client address, for requests that
    /// Pingora does not parse (CONNECT tunnels).
    pub(crate) fn key_for<'a>(
        &self,
        headers: &'a http::HeaderMap,
        client: Option<std::net::IpAddr>,
        identified: Option<&'a str>,
        buf: &'a mut String,
    ) -> &'a str {
        match &self.key {
            QuotaKey::Route => "route",
            QuotaKey::Header(name) => {
                let value = headers
                    .get(name.as_str())
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                bounded_key(value, buf)
            }
            QuotaKey::ClientIp => {
                if let Some(ip) = client {
                    *buf = ip.to_string();
                }
                buf
            }
            // The identity, which no header can spoof. A caller that `mode: report` lets
            // through unidentified counts under `unknown`, which no client may be named: not
            // as `anonymous`, a client of its own with its own grants.
            QuotaKey::Client => identified.unwrap_or(crate::config::UNKNOWN),
        }
    }

    /// Logs that a request was refused because the route's key table (its keys or their
    /// entries) is full: at most once a second per route, since a client spraying keys makes
    /// every request of its own fail this way (`sluice_quota_keys_refused_total` counts them
    /// all).
    pub(crate) fn warn_keys_exhausted(&self, route: &str) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if self.keys_warned_at.swap(now, Ordering::Relaxed) != now {
            tracing::warn!(
                target: "sluice::quota",
                route,
                "the route holds as many quota keys, or entries, as the store keeps; requests that would add one get 429 quota_keys_exhausted"
            );
        }
    }

    /// Whether admission reserves (and the answer settles) rather than only counting: the
    /// route's windows count usage units or calendar periods.
    pub fn reserves(&self) -> bool {
        // A calendar window's entry lies at its period's start, which only a reservation
        // places; counting would place it at now, and it would outlive its period.
        self.usage.is_some() || self.calendars.iter().any(Option::is_some)
    }

    /// The windows as reserved at `now_us` (wall clock, microseconds), and their periods: a
    /// calendar window's length is the span of the period it is in now (`sluice_limiter::span`).
    /// `None` periods (empty) when every window slides.
    pub fn periods(&self, now_us: u64) -> (Vec<Window>, Vec<Option<sluice_limiter::Period>>) {
        let mut windows = self.windows.clone();
        if self.calendars.iter().all(Option::is_none) {
            return (windows, Vec::new());
        }
        let periods = self
            .calendars
            .iter()
            .zip(&mut windows)
            .map(|(c, w)| {
                let bounds = c.as_ref()?.bounds_at(now_us)?;
                let period = sluice_limiter::Period::from(bounds);
                w.length_us = sluice_limiter::span(&period);
                Some(period)
            })
            .collect();
        (windows, periods)
    }

    /// What a request reserves in each window: its unit's amount (`reserved`, per unit of
    /// [`RouteQuota::usage`]), or `cost` for a window of requests.
    pub fn amounts(&self, reserved: &[sluice_usage::Millionths], cost: u64) -> Vec<u64> {
        self.units
            .iter()
            .map(|u| u.map_or(cost, |i| reserved.get(i).map_or(0, |m| m.0)))
            .collect()
    }

    /// Per window of `windows` (a member's own, as configured), the index of its unit in
    /// [`RouteQuota::usage`], or `None` for a window of requests.
    pub fn units_of(&self, windows: &[crate::config::WindowConfig]) -> Vec<Option<usize>> {
        windows
            .iter()
            .map(|w| match (&w.unit, &self.usage) {
                (crate::config::WindowUnit::Named(name), Some(usage)) => {
                    usage.units.iter().position(|u| u.name == name.0)
                }
                _ => None,
            })
            .collect()
    }

    /// Builds the quota of `route` from its config.
    pub fn build(route: &str, q: &QuotaConfig, metrics: &Metrics) -> RouteQuota {
        let windows: Vec<Window> = q.windows.iter().map(window_of).collect();
        let unit_names: Vec<UnitName> = q.windows.iter().map(unit_of).collect();
        RouteQuota {
            rejections: windows
                .iter()
                .map(|w| {
                    metrics
                        .quota_rejections
                        .with_label_values(&[route, &w.name])
                })
                .collect(),
            policy: crate::ratelimit::policy(&windows, &unit_names),
            unit_names,
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
            keys_warned_at: AtomicU64::new(0),
            usage: q.usage.as_ref().map(crate::usage::RouteUsage::build),
            units: q
                .windows
                .iter()
                .map(|w| match (&w.unit, &q.usage) {
                    (crate::config::WindowUnit::Named(name), Some(usage)) => {
                        usage.units.iter().position(|u| u.name == *name)
                    }
                    _ => None,
                })
                .collect(),
            calendars: q.windows.iter().map(calendar_of).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar_windows_cut_periods_in_their_zone() {
        let yaml = "routes:\n  - name: r\n    upstream: {}\n    quota:\n      windows:\n        - { name: m, limit: 9, window: calendar_month, tz: Asia/Tokyo }\n        - { name: w, limit: 9, window: calendar_week }\n        - { name: s, limit: 9, window: 1m }\n";
        let config = crate::config::Config::parse("t.yaml", yaml).unwrap_or_else(|e| panic!("{e}"));
        let windows = &config.routes[0].quota.as_ref().unwrap().windows;
        // 2025-03-31T16:00Z is already 1 April in Tokyo (UTC+9), still March in UTC.
        let at_us = 1_743_436_800_000_000;
        let month = calendar_of(&windows[0]).unwrap().bounds_at(at_us).unwrap();
        assert_eq!(
            month.start_us, 1_743_433_200_000_000,
            "2025-03-31T15:00Z, Tokyo's 1 April"
        );
        let week = calendar_of(&windows[1]).unwrap();
        assert_eq!(week.period(), sluice_limiter::calendar::Period::Week);
        assert_eq!(
            week.bounds_at(at_us).unwrap().start_us,
            1_743_379_200_000_000,
            "Monday 2025-03-31T00:00Z, in UTC when no tz is given"
        );
        assert!(calendar_of(&windows[2]).is_none());
    }

    #[test]
    fn windows_read_at_an_instant_take_their_periods_span() {
        let yaml = "routes:\n  - name: r\n    upstream: {}\n    quota:\n      windows:\n        - { name: d, limit: 9, window: calendar_day, tz: Asia/Tokyo }\n        - { name: m, limit: 9, window: calendar_month }\n        - { name: s, limit: 9, window: 1m }\n";
        let config = crate::config::Config::parse("t.yaml", yaml).unwrap_or_else(|e| panic!("{e}"));
        let configured = &config.routes[0].quota.as_ref().unwrap().windows;
        let windows: std::sync::Arc<[Window]> = configured.iter().map(window_of).collect();
        let calendars: Vec<_> = configured.iter().map(calendar_of).collect();
        assert_eq!(windows[0].length_us, u64::MAX, "no period until one is cut");
        // 2025-02-10T12:00Z: a Tokyo day of 24 hours, and February of 28 days in UTC, each read
        // by its kind's span (the same in March: February's entries leave at its end).
        let hour = 3_600_000_000;
        for at_us in [1_739_188_800_000_000, 1_741_780_800_000_000] {
            let read = windows_at(&windows, &calendars, at_us);
            let lengths: Vec<u64> = read.iter().map(|w| w.length_us).collect();
            assert_eq!(lengths, [26 * hour, (31 * 24 + 2) * hour, 60_000_000]);
        }
        let sliding: std::sync::Arc<[Window]> = windows[2..].iter().cloned().collect();
        assert!(std::sync::Arc::ptr_eq(
            &windows_at(&sliding, &calendars[2..], 1_739_188_800_000_000),
            &sliding
        ));
    }

    #[test]
    fn long_key_values_become_a_fixed_size_hash() {
        let mut buf = String::new();
        assert_eq!(bounded_key("acme", &mut buf), "acme");
        let long = "x".repeat(4096);
        let key = bounded_key(&long, &mut buf).to_string();
        assert_eq!(key.len(), "sha256:".len() + 32);
        let other = format!("{}y", "x".repeat(4095));
        assert_ne!(bounded_key(&other, &mut buf), key);
        assert_eq!(
            bounded_key(&long, &mut buf),
            key,
            "the same value, the same key"
        );
    }
}
