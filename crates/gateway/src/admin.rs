//! The admin API (SPEC §4): health, readiness, metrics and status.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde_json::json;
use subtle::ConstantTimeEq;

use std::collections::HashMap;

use sluice_allocator::StateStore;

use crate::metrics::Metrics;
use crate::reload::Reloader;
use crate::table::Table;

/// Serves the admin endpoints on `admin.listen`.
pub struct AdminApi {
    table: Arc<ArcSwap<Table>>,
    metrics: Arc<Metrics>,
    state: Arc<dyn StateStore>,
    reloader: Arc<Reloader>,
    history: Arc<crate::history::History>,
}

impl AdminApi {
    /// An admin API over the current table, the metrics and the state stores.
    pub fn new(
        table: Arc<ArcSwap<Table>>,
        metrics: Arc<Metrics>,
        state: Arc<dyn StateStore>,
        reloader: Arc<Reloader>,
    ) -> AdminApi {
        AdminApi {
            history: Arc::new(crate::history::History::new(table.clone())),
            table,
            metrics,
            state,
            reloader,
        }
    }

    /// The rings `/status/history` shows, to run as the service that rolls them.
    pub fn history(&self) -> Arc<crate::history::History> {
        self.history.clone()
    }

    /// Whether a POST may run. With `admin.token_env` set, it needs `Authorization: Bearer
    /// <token>`, the token being that variable's value, compared exactly and in constant time
    /// (an unset or empty variable lets no POST through). Without a token it needs the header
    /// `X-Sluice-Admin`: a browser sends no custom header cross-site without a CORS preflight,
    /// which this API never grants, so a page on another site cannot make a visitor's browser
    /// reload the gateway (a plain HTML form can send a POST, but not that header).
    /// Returns the refusal to send, or None when the POST may run.
    fn refusal(&self, session: &ServerSession) -> Option<Response<Vec<u8>>> {
        let table = self.table.load();
        let headers = &session.req_header().headers;
        let Some(var) = &table.settings.admin.token_env else {
            return (!headers.contains_key(ADMIN_HEADER)).then(|| reply(
                StatusCode::FORBIDDEN,
                "application/json",
                r#"{"error":"forbidden: POST endpoints need the header X-Sluice-Admin (e.g. X-Sluice-Admin: 1), or configure admin.token_env"}"#,
            ));
        };
        let token = std::env::var(var).ok();
        let given = headers
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        (!bearer_matches(given, token.as_deref())).then(|| {
            reply(
                StatusCode::UNAUTHORIZED,
                "application/json",
                r#"{"error":"unauthorized: this endpoint needs Authorization: Bearer <token>"}"#,
            )
        })
    }

    /// Sets the quota gauges (`sluice_quota_remaining`, `_reserved`, `_settled` and their
    /// `sluice_member_quota_*` twins) from the store, so that they are exact when scraped: a
    /// gauge set per request would go stale as windows slide with no traffic. Every store read
    /// comes first; the gauges are then emptied and set in one step with no await between, so a
    /// window gone by a reload, or one the store could not read, leaves no stale series.
    async fn refresh_quota_gauges(&self) {
        let table = self.table.load_full();
        let mut read = Remaining::new(&*self.state);
        // (labels, unit label, what the window holds, its unit), per window read.
        let mut routes = Vec::new();
        let mut members = Vec::new();
        for r in &table.routes {
            if let Some(quota) = r.quota.as_deref() {
                if let Some(held) = read.route(r).await {
                    for (i, (w, held)) in quota.windows.iter().zip(held).enumerate() {
                        let unit = quota.unit_names.get(i).cloned().flatten();
                        routes.push(([r.name.clone(), w.name.clone()], unit, held));
                    }
                }
            }
            for m in r.members.iter() {
                if let Some(held) = read.member(&r.name, m).await {
                    for (i, (w, held)) in m.windows.iter().zip(held).enumerate() {
                        let unit = m.units.get(i).cloned().flatten();
                        members.push((
                            [r.name.clone(), m.name.clone(), w.name.clone()],
                            unit,
                            held,
                        ));
                    }
                }
            }
        }
        let metrics = &self.metrics;
        let route_gauges = [
            &metrics.quota_remaining,
            &metrics.quota_reserved,
            &metrics.quota_settled,
        ];
        let member_gauges = [
            &metrics.member_quota_remaining,
            &metrics.member_quota_reserved,
            &metrics.member_quota_settled,
        ];
        let mut in_flight = Vec::new();
        for r in table
            .routes
            .iter()
            .filter(|r| crate::select::keeps_leases(&r.config))
        {
            if let Ok(counts) = self.state.in_flight(&r.name, None).await {
                let counts: HashMap<String, u64> = counts.into_iter().collect();
                for m in r.pool.members() {
                    let n = counts.get(&*m.id).copied().unwrap_or(0);
                    in_flight.push(([r.name.clone(), m.id.clone()], n));
                }
            }
        }
        let mut sticky = Vec::new();
        for r in table
            .routes
            .iter()
            .filter(|r| r.config.upstream.sticky.is_some())
        {
            if let Ok(counts) = self.state.sticky_counts(&r.name, None).await {
                sticky.push((r.name.clone(), counts));
            }
        }
        for gauge in route_gauges.iter().chain(&member_gauges) {
            gauge.reset();
        }
        metrics.sticky_bindings.reset();
        metrics.sticky_unbound.reset();
        metrics.sticky_moved.reset();
        // The counters live in the store, shared: each scrape shows the store's totals.
        for (route, counts) in &sticky {
            let labels = [&**route];
            let gauge = i64::try_from(counts.bindings).unwrap_or(i64::MAX);
            metrics
                .sticky_bindings
                .with_label_values(&labels)
                .set(gauge);
            metrics
                .sticky_unbound
                .with_label_values(&labels)
                .inc_by(counts.unbound);
            metrics
                .sticky_moved
                .with_label_values(&labels)
                .inc_by(counts.moved);
        }
        metrics.member_in_flight.reset();
        for (labels, n) in &in_flight {
            let labels = [&*labels[0], &*labels[1]];
            metrics
                .member_in_flight
                .with_label_values(&labels)
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        set_gauges(route_gauges, routes.iter().map(|(l, u, h)| (&l[..], u, h)));
        set_gauges(
            member_gauges,
            members.iter().map(|(l, u, h)| (&l[..], u, h)),
        );
    }

    /// The `/status` document. Assignment counts of least-used routes come from the store;
    /// when it cannot answer they are `null`.
    pub async fn status(&self) -> serde_json::Value {
        let table = self.table.load_full();
        let mut routes = Vec::with_capacity(table.routes.len());
        let requests = self.metrics.requests_per_route();
        let mut read = Remaining::new(&*self.state);
        for r in &table.routes {
            let remaining = read.route(r).await;
            let mut member_left = Vec::with_capacity(r.members.len());
            for m in r.members.iter() {
                member_left.push(read.member(&r.name, m).await);
            }
            let counts: Option<HashMap<String, u64>> = if r.policy.counts() {
                self.state
                    .counts(&r.name)
                    .await
                    .ok()
                    .map(|c| c.into_iter().collect())
            } else {
                None
            };
            // Leases in flight per member, from every instance; `null` when the store cannot
            // say.
            let in_flight: Option<HashMap<String, u64>> = if crate::select::keeps_leases(&r.config)
            {
                self.state
                    .in_flight(&r.name, None)
                    .await
                    .ok()
                    .map(|c| c.into_iter().collect())
            } else {
                None
            };
            // Cooling members, from the store that every instance shares (SPEC §8).
            let cooling: HashMap<String, u64> = if r.config.upstream.cooldown.is_some() {
                self.state
                    .cooldowns(&r.name)
                    .await
                    .map(|c| c.into_iter().collect())
                    .unwrap_or_default()
            } else {
                HashMap::new()
            };
            // Sticky bindings from every instance; `null` when the store cannot say.
            let sticky = match r.config.upstream.sticky {
                Some(_) => Some(self.state.sticky_counts(&r.name, None).await.ok().map(
                    |c| json!({"bindings": c.bindings, "unbound": c.unbound, "moved": c.moved}),
                )),
                None => None,
            };
            let now = std::time::SystemTime::now();
            let members: Vec<_> = r
                .pool
                .members()
                .iter()
                .zip(r.members.iter())
                .zip(&member_left)
                .map(|((m, proxied), left)| {
                    // Header names only: their values are the member's secrets.
                    let headers: Vec<&str> =
                        proxied.headers.0.iter().map(|(n, _)| n.as_str()).collect();
                    let mut member = json!({
                        "name": &*m.id,
                        "url": proxied.url.url,
                        "healthy": m.health.is_up(),
                        "headers": headers,
                    });
                    if let Some(&us) = cooling.get(&*m.id) {
                        if let Some(until) = rfc3339_millis_after(now, us) {
                            member["cooling_until"] = until.into();
                        }
                        member["cooling_ms"] = us.div_ceil(1000).into();
                    }
                    if !proxied.windows.is_empty() {
                        // A calendar window shows its current period's length.
                        let windows = crate::quota::windows_at(
                            &proxied.windows,
                            &proxied.calendars,
                            now_us(),
                        );
                        member["quota"] =
                            windows_json(windows.iter(), &proxied.calendars, &proxied.units, left)
                                .into();
                    }
                    if crate::select::keeps_leases(&r.config) {
                        member["in_flight"] = in_flight
                            .as_ref()
                            .map(|c| c.get(&*m.id).copied().unwrap_or(0))
                            .into();
                    }
                    if r.policy.counts() {
                        member["assignments"] = counts
                            .as_ref()
                            .map(|c| c.get(&*m.id).copied().unwrap_or(0))
                            .into();
                    } else {
                        member["weight"] = m.weight.into();
                    }
                    member
                })
                .collect();
            let periods = r.quota.as_deref().map(|q| q.periods(now_us()).0);
            let quota = windows_json(
                periods.iter().flatten(),
                r.quota.as_deref().map_or(&[][..], |q| &q.calendars),
                r.quota.as_deref().map_or(&[][..], |q| &q.unit_names),
                &remaining,
            );
            let mut route = json!({
                "name": &*r.name,
                "selection": r.policy.name(),
                "members": members,
                "quota": quota,
                "waiting": r.wait_line.as_ref().map_or(0, |l| l.len()),
                "requests": requests.get(&*r.name).copied().unwrap_or(0),
                "in_flight": r.in_flight.get(),
            });
            if let Some(sticky) = sticky {
                route["sticky"] = sticky.into();
            }
            routes.push(route);
        }
        let clients = match table.clients.as_deref() {
            Some(c) => {
                let mut left = Vec::with_capacity(c.list.len());
                for client in &c.list {
                    left.push(read.client(client).await);
                }
                Some(clients_json(c, &self.metrics.client_counts(), &left))
            }
            None => None,
        };
        json!({
            "version": table.version,
            "loaded_at": table.loaded_at,
            "last_reload_error": self.reloader.last_error(),
            "routes": routes,
            "clients": clients,
        })
    }
}

/// What one window holds, as `/status` and the gauges show it: what is left (as admission
/// reads it), and, when read, what it holds apart: open reservations and settled usage.
#[derive(Debug, Clone, Copy)]
struct Held {
    remaining: u64,
    usage: Option<sluice_limiter::WindowUsage>,
}

/// What quota windows hold, read for one `/status` or one scrape without charging anything (a
/// cost of 0). After the store's first failure it asks no more: a store that is down costs one
/// timeout, not one per route and member.
struct Remaining<'a> {
    state: &'a dyn StateStore,
    failed: bool,
}

impl<'a> Remaining<'a> {
    fn new(state: &'a dyn StateStore) -> Remaining<'a> {
        Remaining {
            state,
            failed: false,
        }
    }

    /// Each window of `route`'s quota; `None` without a quota, for a quota whose key is not
    /// `route` (its keys are the clients'), or when the store cannot answer.
    async fn route(&mut self, route: &crate::table::Route) -> Option<Vec<Held>> {
        let quota = route.quota.as_deref()?;
        if quota.key != crate::config::QuotaKey::Route || self.failed {
            return None;
        }
        // A calendar window is read over its current period, as admission charges it.
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        let (windows, _) = quota.periods(now_us);
        let read = self.state.acquire(sluice_limiter::Acquire {
            route: &route.name,
            key: "route",
            windows: &windows,
            cost: 0,
            at_us: None,
            client: None,
        });
        let outcome = self.answer(read.await)?;
        let remaining: Vec<u64> = outcome.windows.iter().map(|w| w.remaining).collect();
        let usage = self
            .state
            .usage(
                &route.name,
                sluice_limiter::Owner::Route,
                "route",
                &windows,
                None,
            )
            .await;
        let usage = self.answer(usage)?;
        Some(held(remaining, Some(usage)))
    }

    /// Each of `client`'s own windows; `None` when it has none, or the store cannot answer.
    async fn client(&mut self, client: &crate::clients::Client) -> Option<Vec<Held>> {
        if client.windows.is_empty() || self.failed {
            return None;
        }
        // No route windows: the store reads the client's alone (its own slot on a cluster),
        // a calendar window over its current period.
        let windows = crate::quota::windows_at(&client.windows, &client.calendars, now_us());
        let read = self.state.acquire(sluice_limiter::Acquire {
            route: "",
            key: "",
            windows: &[],
            cost: 0,
            at_us: None,
            client: Some(sluice_limiter::ClientWindows {
                name: &client.name,
                windows: &windows,
            }),
        });
        let outcome = self.answer(read.await)?;
        let usage = self
            .state
            .usage(
                "",
                sluice_limiter::Owner::Client,
                &client.name,
                &windows,
                None,
            )
            .await;
        let usage = self.answer(usage)?;
        Some(held(
            outcome.windows.iter().map(|w| w.remaining).collect(),
            Some(usage),
        ))
    }

    /// Each of `member`'s own windows; `None` when it has none, or the store cannot answer.
    async fn member(&mut self, route: &str, member: &crate::table::Member) -> Option<Vec<Held>> {
        if member.windows.is_empty() || self.failed {
            return None;
        }
        // A calendar window is read over its current period, as admission charges it.
        let windows = crate::quota::windows_at(&member.windows, &member.calendars, now_us());
        let pool_member = sluice_allocator::PoolMember {
            id: member.name.clone(),
            windows: windows.clone(),
        };
        let read = self.state.member_remaining(route, &pool_member).await;
        let remaining = self.answer(read)?;
        let usage = self
            .state
            .usage(
                route,
                sluice_limiter::Owner::Member,
                &member.name,
                &windows,
                None,
            )
            .await;
        let usage = self.answer(usage)?;
        Some(held(remaining, Some(usage)))
    }

    fn answer<T>(&mut self, result: Result<T, sluice_limiter::StoreError>) -> Option<T> {
        self.failed |= result.is_err();
        result.ok()
    }
}

/// `now` plus `us` microseconds in RFC 3339 to the millisecond, or None past what RFC 3339
/// writes (the year 9999). The store's cooldowns reach a day at most, but the figure is read
/// back from Redis, where anything may have been written: humantime refuses such a year, and
/// its `to_string()` would then panic the admin task.
fn rfc3339_millis_after(now: std::time::SystemTime, us: u64) -> Option<String> {
    use std::fmt::Write;
    let until = now.checked_add(std::time::Duration::from_micros(us))?;
    let mut text = String::new();
    write!(text, "{}", humantime::format_rfc3339_millis(until)).ok()?;
    Some(text)
}

/// The wall clock in microseconds, which calendar periods are cut on.
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Each window's [`Held`], from what is left and what it holds (in the same order).
fn held(remaining: Vec<u64>, usage: Option<Vec<sluice_limiter::WindowUsage>>) -> Vec<Held> {
    remaining
        .into_iter()
        .enumerate()
        .map(|(i, remaining)| Held {
            remaining,
            usage: usage.as_ref().and_then(|u| u.get(i).copied()),
        })
        .collect()
}

/// `/status`'s `clients`: the mode, then each client's name, routes, counts and own quota
/// windows (with what is left of each, from `left`), and last `unknown`'s (callers nobody
/// identified). Names and route names come from the config; no
/// token, certificate name or address is shown.
fn clients_json(
    clients: &crate::clients::Clients,
    counts: &HashMap<String, crate::metrics::ClientCounts>,
    left: &[Option<Vec<Held>>],
) -> serde_json::Value {
    use crate::config::{ClientsMode, RouteGrant, UnknownClients};
    let entry = |name: &str| {
        let c = counts.get(name).copied().unwrap_or_default();
        json!({
            "name": name,
            "requests": c.requests,
            "denied": c.denied,
            "would_deny": c.would_deny,
        })
    };
    let mut list: Vec<serde_json::Value> = clients
        .list
        .iter()
        .zip(left)
        .map(|(c, left)| {
            let routes: Vec<&str> = c
                .config
                .routes
                .iter()
                .map(|g| match g {
                    RouteGrant::All => "*",
                    RouteGrant::Route(r) => r.0.as_str(),
                })
                .collect();
            let mut e = entry(&c.name);
            e["routes"] = routes.into();
            if !c.windows.is_empty() {
                let windows = crate::quota::windows_at(&c.windows, &c.calendars, now_us());
                e["quota"] = windows_json(windows.iter(), &c.calendars, &c.units, left).into();
            }
            e
        })
        .collect();
    list.push(entry(crate::config::UNKNOWN));
    json!({
        "mode": match clients.mode {
            ClientsMode::Enforce => "enforce",
            ClientsMode::Report => "report",
        },
        "unknown": match clients.config.unknown {
            UnknownClients::Deny => "deny",
            UnknownClients::Anonymous => "anonymous",
        },
        "list": list,
    })
}

/// Quota windows for `/status`, each with what is left of it when `held` is known. A window in
/// a usage unit (`units`; a window past its end is one of requests) names it, and its limit and
/// what remains are in that unit, what remains rounded down ([`crate::quota::in_own_unit`]); a
/// window of requests counts requests. A window whose usage was read shows it apart:
/// `reserved` (open reservations, from every instance) and `settled` (the rest), exact
/// ([`exact_in_unit`]).
fn windows_json<'a>(
    windows: impl Iterator<Item = &'a sluice_limiter::Window>,
    calendars: &[Option<sluice_limiter::calendar::Calendar>],
    units: &[crate::quota::UnitName],
    held: &Option<Vec<Held>>,
) -> Vec<serde_json::Value> {
    let now = now_us();
    windows
        .enumerate()
        .map(|(i, w)| {
            let unit = units.get(i).unwrap_or(&None);
            let limit = crate::quota::in_own_unit(w.limit, unit);
            // A calendar window shows its current period's length, not the span its entries
            // are kept by (`sluice_limiter::span`), which is the same for every period.
            let length_us = calendars
                .get(i)
                .and_then(|c| c.as_ref()?.bounds_at(now))
                .map_or(w.length_us, |b| b.end_us - b.start_us);
            let mut window =
                json!({"name": &*w.name, "limit": limit, "window_ms": length_us / 1000});
            if let Some(name) = unit {
                window["unit"] = (**name).into();
            }
            if let Some(h) = held.as_ref().and_then(|v| v.get(i)) {
                window["remaining"] = crate::quota::in_own_unit(h.remaining, unit).into();
                if let Some(u) = h.usage {
                    window["reserved"] = exact_in_unit(u.open, unit);
                    window["settled"] = exact_in_unit(u.total.saturating_sub(u.open), unit);
                }
            }
            window
        })
        .collect()
}

/// An amount the store keeps for a window, in the window's own unit and exact: requests as they
/// are, a usage unit's millionths as a number with up to 6 decimals (an integer when whole).
/// Amounts are below 2^53 millionths, so the nearest double prints back as the same decimal.
fn exact_in_unit(amount: u64, unit: &crate::quota::UnitName) -> serde_json::Value {
    match unit {
        Some(_) if !amount.is_multiple_of(1_000_000) => {
            serde_json::Value::from(amount as f64 / 1e6)
        }
        _ => crate::quota::in_own_unit(amount, unit).into(),
    }
}

/// The same amount for a gauge.
fn gauge_in_unit(amount: u64, unit: &crate::quota::UnitName) -> f64 {
    match unit {
        Some(_) => amount as f64 / 1e6,
        None => amount as f64,
    }
}

/// Sets, per window read, the three gauges `[remaining, reserved, settled]` of its labels; the
/// last two also carry the window's unit (`requests` for a window of requests). A gauge is
/// exact in the unit: the store's millionths divided, never rounded up.
fn set_gauges<'a>(
    [remaining, reserved, settled]: [&prometheus::GaugeVec; 3],
    windows: impl Iterator<
        Item = (
            &'a [std::sync::Arc<str>],
            &'a crate::quota::UnitName,
            &'a Held,
        ),
    >,
) {
    for (labels, unit, held) in windows {
        let labels: Vec<&str> = labels.iter().map(|l| &**l).collect();
        remaining
            .with_label_values(&labels)
            .set(gauge_in_unit(held.remaining, unit));
        let Some(u) = held.usage else {
            continue;
        };
        let mut with_unit = labels.clone();
        with_unit.push(unit.as_deref().unwrap_or(REQUESTS));
        reserved
            .with_label_values(&with_unit)
            .set(gauge_in_unit(u.open, unit));
        settled
            .with_label_values(&with_unit)
            .set(gauge_in_unit(u.total.saturating_sub(u.open), unit));
    }
}

/// The `unit` label of a window of requests.
const REQUESTS: &str = "requests";

/// The header a POST needs when no admin token is configured (see `AdminApi::authorized`).
const ADMIN_HEADER: &str = "x-sluice-admin";

/// Whether an `Authorization` value is `Bearer <token>`, byte for byte (no trimming: a padded
/// token is another token), compared in constant time. Their digests are compared, not the
/// bytes: `ct_eq` on slices answers at once when the lengths differ, which would tell a caller
/// the token's length. No token, or an empty one, matches nothing.
fn bearer_matches(authorization: Option<&[u8]>, token: Option<&str>) -> bool {
    let Some(token) = token.filter(|t| !t.is_empty()) else {
        return false;
    };
    authorization
        .and_then(|v| v.strip_prefix(b"Bearer "))
        .is_some_and(|given| {
            let (given, token) = (blake3::hash(given), blake3::hash(token.as_bytes()));
            bool::from(given.as_bytes().ct_eq(token.as_bytes()))
        })
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Vec<u8>>) -> Response<Vec<u8>> {
    let body = body.into();
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(body)
        .expect("valid response")
}

/// The dashboard: one page, compiled in, that polls `/status` from the browser.
const DASHBOARD: &str = include_str!("dashboard.html");

/// `GET /`: the dashboard. Its policy lets it load nothing from elsewhere and talk only to
/// this listener, and no other site may frame it.
fn dashboard() -> Response<Vec<u8>> {
    let mut page = reply(StatusCode::OK, "text/html; charset=utf-8", DASHBOARD);
    let headers = page.headers_mut();
    headers.insert(
        http::header::CONTENT_SECURITY_POLICY,
        http::HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'",
        ),
    );
    headers.insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-store"),
    );
    page
}

#[async_trait]
impl ServeHttp for AdminApi {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let req = session.req_header();
        let get = req.method == http::Method::GET;
        match (get, req.uri.path()) {
            (true, "/") => dashboard(),
            (true, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n"),
            // A config is loaded by the time this service listens; what is left to check is
            // the store (always ready in memory, a PING for Redis).
            (true, "/readyz") => {
                if self.state.ready().await {
                    reply(StatusCode::OK, "text/plain", "ready\n")
                } else {
                    reply(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "text/plain",
                        "state store unreachable\n",
                    )
                }
            }
            (true, "/metrics") => {
                self.refresh_quota_gauges().await;
                reply(
                    StatusCode::OK,
                    "text/plain; version=0.0.4",
                    self.metrics.render(),
                )
            }
            (true, "/status") => {
                let mut body = serde_json::to_vec_pretty(&self.status().await).unwrap_or_default();
                body.push(b'\n');
                reply(StatusCode::OK, "application/json", body)
            }
            // Counts and latencies per route: no secret, so no token, as `/status`.
            (true, "/status/history") => reply(
                StatusCode::OK,
                "application/json",
                self.history.json().to_string(),
            ),
            (false, "/reload") if req.method == http::Method::POST => {
                if let Some(refusal) = self.refusal(session) {
                    return refusal;
                }
                match self.reloader.reload("admin").await {
                    Ok(version) => reply(
                        StatusCode::OK,
                        "application/json",
                        json!({ "version": version }).to_string(),
                    ),
                    Err(error) => reply(
                        StatusCode::BAD_REQUEST,
                        "application/json",
                        json!({ "error": error }).to_string(),
                    ),
                }
            }
            (_, "/reload")
            | (false, "/" | "/healthz" | "/readyz" | "/metrics" | "/status" | "/status/history") => {
                reply(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "application/json",
                    r#"{"error":"method not allowed"}"#,
                )
            }
            _ => reply(
                StatusCode::NOT_FOUND,
                "application/json",
                r#"{"error":"not found"}"#,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{bearer_matches, exact_in_unit, gauge_in_unit};

    #[test]
    fn amounts_show_exactly_in_their_unit() {
        let usd = Some(std::sync::Arc::from("usd"));
        // Whole units are integers, as limits are; requests are as they are.
        assert_eq!(exact_in_unit(10_000_000, &usd).to_string(), "10");
        assert_eq!(exact_in_unit(7, &None).to_string(), "7");
        // Fractions print back as the decimal the millionths are, up to the largest amount.
        for (millionths, decimal) in [
            (700, 0.0007),
            (70, 0.00007),
            (1, 0.000001),
            (999_930_000, 999.93),
            ((1 << 53) - 1, 9_007_199_254.740_991),
        ] {
            let shown = exact_in_unit(millionths, &usd).to_string();
            assert_eq!(shown.parse::<f64>().unwrap(), decimal, "{shown}");
            assert_eq!(gauge_in_unit(millionths, &usd), decimal);
        }
    }

    #[test]
    fn only_the_exact_token_matches() {
        let token = Some("s3cret");
        assert!(bearer_matches(Some(b"Bearer s3cret"), token));
        for wrong in [
            &b"Bearer s3cret "[..],
            b"Bearer  s3cret",
            b"Bearer s3cret\t",
            b"Bearer s3cre",
            b"bearer s3cret",
            b"s3cret",
        ] {
            assert!(!bearer_matches(Some(wrong), token), "{wrong:?}");
        }
        assert!(!bearer_matches(None, token));
        assert!(!bearer_matches(Some(b"Bearer "), Some("")));
        assert!(!bearer_matches(Some(b"Bearer x"), None));
    }
}
