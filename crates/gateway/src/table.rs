//! The immutable routing table built from a config: routes, their pools and prebuilt peers.
//!
//! Everything a request needs is computed here, off the hot path: resolved addresses, Pingora
//! peers with their timeouts, Host header values and metric handles. A request then only clones
//! a prebuilt peer. The table is swapped in whole, so a request sees one consistent config;
//! member addresses alone change under it, as their DNS TTLs expire (see [`crate::dns`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::SystemTime;

use http::HeaderValue;
use pingora::upstreams::peer::HttpPeer;
use prometheus::{Histogram, IntCounter, IntGauge};
use sluice_allocator::{PoolMember, StateStore, SubLogStart};
use sluice_balancer::Members;
use sluice_limiter::Window;

use crate::config::{
    AdminConfig, Config, DnsConfig, LimitsConfig, Listener, MemberHeaders, MemberKind, MemberUrl,
    RouteConfig, ShardsStart, StateConfig, UpstreamConfig,
};
use crate::dns::PeerCell;
use crate::egress::{Guard, Resolver};
use crate::metrics::Metrics;
use crate::quota::RouteQuota;
use crate::router::{RouteMatch, Router};
use crate::select::{Limits, Policy};
use crate::wait::WaitLine;

/// A config made ready to serve.
pub struct Table {
    /// Request → route.
    pub router: Router<Arc<Route>>,
    /// Routes in config order.
    pub routes: Vec<Arc<Route>>,
    /// sha256 of the config file bytes, hex.
    pub version: String,
    /// When this table was loaded, RFC 3339.
    pub loaded_at: String,
    /// What only a restart changes.
    pub settings: Settings,
    /// The egress guard for destinations the client chooses (CONNECT targets, `direct`
    /// members), from `egress`; rebuilt with the table, so a reload applies it.
    pub guard: Guard,
    /// The listeners the process runs with (proxy and admin): the first table's settings,
    /// carried over by every reload, since only a restart changes them.
    pub(crate) own_listeners: Arc<[SocketAddr]>,
    /// `clients`, ready to serve; rebuilt with the table, so a reload applies it. `None`
    /// without a `clients` section: every caller may use every route, as before.
    pub clients: Option<Arc<crate::clients::Clients>>,
}

/// One route, ready to serve.
pub struct Route {
    /// The route's name.
    pub name: Arc<str>,
    /// The route as configured.
    pub config: RouteConfig,
    /// Members and their health.
    pub pool: Arc<Members>,
    /// Per-member data for proxying, indexed like `pool.members()`; shared with the previous
    /// table when the upstream is unchanged.
    pub members: Arc<[Member]>,
    /// How members are chosen, with the quota.
    pub(crate) policy: Policy,
    /// `sluice_request_duration_seconds{route,source="upstream"}`, resolved once.
    pub duration: Histogram,
    /// `sluice_request_duration_seconds{route,source="gateway"}`, resolved once.
    pub duration_gateway: Histogram,
    /// `sluice_requests_in_flight{route}`, resolved once.
    pub in_flight: IntGauge,
    /// `sluice_selection_fallbacks_total{route}`, resolved once.
    pub selection_fallbacks: IntCounter,
    /// `sluice_bytes_total{route,direction}`: `in`, then `out`, resolved once.
    pub bytes: [prometheus::IntCounter; 2],
    /// `sluice_requests_total{route,status}`, the common statuses' handles kept once used.
    pub requests: crate::metrics::RouteRequests,
    /// The quota gating the route, if any; shared with the previous table when unchanged.
    pub quota: Option<Arc<RouteQuota>>,
    /// How members are chosen, as configured.

    /// The waiting line of a route with `quota.max_wait` (see [`crate::wait`]); shared with
    /// the previous table when the quota is unchanged, so a reload keeps the line's order.
    pub wait_line: Option<Arc<WaitLine>>,
    /// `sluice_quota_rejections_total{route,window="members"}`: refusals because every member
    /// was at its own quota or cooling down.
    pub members_busy: IntCounter,
    /// What the route's requests add to `/status/history`; carried over by reloads, like
    /// the metrics.
    pub history: Arc<crate::history::live::Live>,
}

/// What proxying to one member needs.
pub struct Member {
    /// The member's identity (SPEC §8): its name, by default its URL.
    pub name: Arc<str>,
    /// The member's URL (for a proxy, without credentials).
    pub url: MemberUrl,
    /// Set on every request to the member; values are secrets.
    pub headers: MemberHeaders,
    /// The member's own quota windows (SPEC §8), as the store takes them; empty when none.
    pub windows: Arc<[Window]>,
    /// The unit of each of `windows`, as `/status` reports it.
    pub units: Arc<[crate::quota::UnitName]>,
    /// Per window of `windows`, its calendar when it is a fixed (calendar) window.
    pub calendars: Arc<[Option<sluice_limiter::calendar::Calendar>]>,
    /// Origin, proxy or direct.
    pub kind: MemberKind,
    /// The member's address and prebuilt peer, kept fresh by [`crate::dns_refresh::DnsRefresher`];
    /// `None` for a direct member, which has no address of its own. Shared with the previous
    /// table when the member is unchanged.
    pub cell: Option<Arc<PeerCell>>,
    /// Host header value for `preserve_host: false`.
    pub host_header: HeaderValue,
    /// `sluice_upstream_attempts_total` for each outcome, resolved once.
    pub attempts_ok: IntCounter,
    /// Attempt that failed to connect.
    pub attempts_connect_failure: IntCounter,
    /// Attempt that failed after connecting.
    pub attempts_error: IntCounter,
    /// `sluice_member_cooldowns_total{route,member}`, resolved once.
    pub cooldowns: IntCounter,
    /// `sluice_member_request_duration_seconds{route,member}`, resolved once.
    pub duration: Histogram,
}

impl Member {
    /// The current peer, boxed as Pingora takes it; `None` for a direct member and while the
    /// host never resolved.
    pub fn peer(&self) -> Option<Box<HttpPeer>> {
        self.cell.as_ref().and_then(|c| c.boxed_peer())
    }

    /// The current address; `None` for a direct member and while the host never resolved.
    pub fn address(&self) -> Option<SocketAddr> {
        self.cell.as_ref().and_then(|c| c.address())
    }
}

impl Table {
    /// Builds the table for `config`. Member host names are resolved here, with `resolver`
    /// (the process's one), so that no request ever waits on DNS; a member that the previous
    /// table already had, unchanged, keeps its address and its refresh schedule.
    ///
    /// With a `previous` table (a reload), state carries over by route name: a route whose
    /// upstream is unchanged keeps its pool (health, schedule, round-robin position) and peers
    /// as they are; a changed one gets a new pool in which every surviving member keeps its
    /// health, and round-robin goes on from where it was. Quota and least-used state live in
    /// the stores, keyed by route and window names, so they carry over by themselves.
    pub async fn build(
        config: &Config,
        bytes: &[u8],
        metrics: &Arc<Metrics>,
        state: &Arc<dyn StateStore>,
        resolver: &Resolver,
        previous: Option<&Table>,
    ) -> Table {
        let prior: HashMap<&str, &Arc<Route>> = previous
            .map(|t| t.routes.iter().map(|r| (&*r.name, r)).collect())
            .unwrap_or_default();
        let mut routes = Vec::with_capacity(config.routes.len());
        // Which routes' state is split into sub-logs (Redis), and where their requests start:
        // before any request of this table.
        let shards: Vec<(&str, u32, SubLogStart)> = config
            .routes
            .iter()
            .map(|r| {
                let start = match r.state_shards_start {
                    ShardsStart::RoundRobin => SubLogStart::RoundRobin,
                    ShardsStart::Home => SubLogStart::Home,
                };
                (r.name.0.as_str(), r.state_shards.get(), start)
            })
            .collect();
        let unindexed = state.shard_routes(&shards);
        if unindexed > 0 {
            // `check` wants the index with any `home` route, but the running store's index is
            // the one it started with: state settings apply at a restart.
            tracing::warn!(
                target: "sluice::reload",
                routes = unindexed,
                "state_shards_start: home needs state.redis.instance_index at start, and this instance started without one: those routes take their sub-logs in turn (round_robin) until a restart"
            );
        }
        // A client's max_in_flight counts the leases of its requests on every route.
        let capped = config
            .clients
            .as_ref()
            .is_some_and(|c| c.list.iter().any(|c| c.max_in_flight.is_some()));
        for rc in &config.routes {
            let before = prior.get(rc.name.0.as_str()).copied();
            routes.push(Arc::new(
                build_route(rc, metrics, state, resolver, before, capped).await,
            ));
        }
        let own_listeners = match previous {
            Some(p) => p.own_listeners.clone(),
            None => {
                let settings = Settings::of(config);
                let proxy = settings.listen.iter().map(|l| l.addr);
                proxy.chain([settings.admin.listen.0]).collect()
            }
        };
        let router = Router::new(routes.iter().map(|r| {
            let m = &r.config.matcher;
            (
                RouteMatch {
                    hosts: m.hosts.clone(),
                    path_prefix: m.path_prefix.clone(),
                    methods: m.methods.clone(),
                },
                r.clone(),
            )
        }));
        let clients = config.clients.as_ref().map(|c| {
            let mut clients = crate::clients::Clients::new(c);
            // Failed identifications outlive a reload: it must free no throttled address.
            if let Some(before) = previous.and_then(|p| p.clients.as_ref()) {
                clients.throttle = before.throttle.clone();
            }
            Arc::new(clients)
        });
        metrics.clients_listed(clients.as_deref());
        Table {
            router,
            routes,
            version: sha256_hex(bytes),
            loaded_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            settings: Settings::of(config),
            guard: Guard::from(&config.egress).with_own_listeners(own_listeners.iter().copied()),
            own_listeners,
            clients,
        }
    }
}

/// The parts of a config that only a restart can change: listeners, threads and the stores.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// `listen`, with each TLS listener's certificate paths (the files are read at start only).
    pub listen: Vec<Listener>,
    /// `admin` (its `token_env` is read at every POST, so changing it needs no restart).
    pub admin: AdminConfig,
    /// `threads`.
    pub threads: Option<NonZeroUsize>,
    /// `state`.
    pub state: StateConfig,
    /// `limits`.
    pub limits: LimitsConfig,
    /// `dns` (the process's one resolver is made at start).
    pub dns: DnsConfig,
    /// `log` and `tracing` (the log and the exporter are set up at start).
    pub log: crate::config::LogConfig,
    pub tracing: crate::config::TracingConfig,
}

impl Settings {
    fn of(config: &Config) -> Settings {
        Settings {
            listen: config.listen.clone(),
            admin: config.admin.clone(),
            threads: config.threads,
            state: config.state.clone(),
            limits: config.limits.clone(),
            dns: config.dns.clone(),
            log: config.log.clone(),
            tracing: config.tracing.clone(),
        }
    }

    /// Whether `other` differs in something only a restart applies.
    pub fn needs_restart_for(&self, other: &Settings) -> bool {
        self.listen != other.listen
            || self.admin.listen != other.admin.listen
            || self.threads != other.threads
            || self.state != other.state
            || self.limits != other.limits
            || self.dns != other.dns
            || self.log != other.log
            || self.tracing != other.tracing
    }
}

async fn build_route(
    rc: &RouteConfig,
    metrics: &Arc<Metrics>,
    state: &Arc<dyn StateStore>,
    resolver: &Resolver,
    before: Option<&Arc<Route>>,
    capped: bool,
) -> Route {
    let name: Arc<str> = rc.name.0.as_str().into();
    let up = &rc.upstream;
    // What did not change is shared with the previous table, not built again: a reload that
    // touches one route of ten thousand costs little more than that one route.
    let (pool, members) = match before {
        Some(b) if b.config.upstream == *up => (b.pool.clone(), b.members.clone()),
        _ => {
            let pool = crate::health::pool_for(&name, rc, metrics, state, before.map(|b| &*b.pool));
            let cells = before.map(|b| &*b.members);
            (
                pool,
                build_members(&name, rc, metrics, resolver, cells).await,
            )
        }
    };
    let quota = match (before, &rc.quota) {
        (Some(b), Some(q)) if b.config.quota.as_ref() == Some(q) => b.quota.clone(),
        (_, Some(q)) => Some(Arc::new(RouteQuota::build(&name, q, metrics))),
        (_, None) => None,
    };
    let wait_line = match (before, &rc.quota) {
        (Some(b), Some(q)) if b.config.quota.as_ref() == Some(q) => b.wait_line.clone(),
        (_, Some(q)) if !q.max_wait.0.is_zero() => {
            Some(Arc::new(WaitLine::new(q.max_wait.0, q.max_waiting.get())))
        }
        _ => None,
    };
    Route {
        history: before.map_or_else(Default::default, |b| b.history.clone()),
        wait_line,
        members_busy: metrics
            .quota_rejections
            .with_label_values(&[&name, "members"]),
        quota,
        duration: match before {
            Some(b) => b.duration.clone(),
            None => metrics
                .request_duration
                .with_label_values(&[&name, crate::metrics::UPSTREAM]),
        },
        duration_gateway: match before {
            Some(b) => b.duration_gateway.clone(),
            None => metrics
                .request_duration
                .with_label_values(&[&name, crate::metrics::GATEWAY]),
        },
        in_flight: match before {
            Some(b) => b.in_flight.clone(),
            None => metrics.in_flight.with_label_values(&[&name]),
        },
        selection_fallbacks: metrics.selection_fallbacks.with_label_values(&[&name]),
        requests: crate::metrics::RouteRequests::new(name.clone(), &metrics.requests),
        bytes: ["in", "out"].map(|d| metrics.bytes.with_label_values(&[&name, d])),
        // A new policy per table: least-used writes this table's member list to the store on
        // the route's first request.
        policy: Policy::new(
            &up.selection,
            &name,
            &pool,
            before.map(|b| &b.policy),
            Limits {
                members: members
                    .iter()
                    .map(|m| PoolMember {
                        id: m.name.clone(),
                        windows: m.windows.clone(),
                    })
                    .collect(),
                cooldowns: up.cooldown.is_some(),
                leases: lease_plan(&name, rc, state, capped),
                sticky: up.sticky.is_some(),
            },
        ),
        pool,
        members,
        config: rc.clone(),
        name,
    }
}

/// The leases a route's requests take, when its policy needs them, it caps requests in
/// flight, or some client caps its own (`capped`): the store then chooses on every route, and
/// each request's lease counts in its client's.
fn lease_plan(
    name: &Arc<str>,
    rc: &RouteConfig,
    state: &Arc<dyn StateStore>,
    capped: bool,
) -> Option<crate::lease::LeasePlan> {
    let up = &rc.upstream;
    let member_max = up.max_in_flight.map(|n| n.get());
    let route_max = rc.max_in_flight.map(|n| n.get());
    (capped || crate::select::keeps_leases(rc)).then(|| {
        crate::lease::LeasePlan::new(name.clone(), up.lease_ttl.0, member_max, route_max, state)
    })
}

/// What proxying to each member needs: its address cell and metric handles. A member of
/// `before` with the same URL and peer settings lends its cell, already resolved.
async fn build_members(
    name: &str,
    rc: &RouteConfig,
    metrics: &Metrics,
    resolver: &Resolver,
    before: Option<&[Member]>,
) -> Arc<[Member]> {
    let up = &rc.upstream;
    let mut members = Vec::with_capacity(up.members.len());
    for m in &up.members {
        let labels = |outcome: &str| {
            metrics
                .upstream_attempts
                .with_label_values(&[name, &m.name, outcome])
        };
        // A direct member has no address of its own: each request resolves its target.
        let cell = match m.kind {
            MemberKind::Direct => None,
            _ => {
                let kept = before
                    .into_iter()
                    .flatten()
                    .filter_map(|b| b.cell.as_ref())
                    .find(|c| c.fits(&m.url, up))
                    .cloned();
                Some(match kept {
                    Some(cell) => cell,
                    None => {
                        let cell = Arc::new(PeerCell::new(&m.url, up));
                        cell.refresh(resolver).await;
                        cell
                    }
                })
            }
        };
        members.push(Member {
            host_header: HeaderValue::from_str(&m.url.authority())
                .unwrap_or_else(|_| HeaderValue::from_static("invalid")),
            name: m.name.clone(),
            url: m.url.clone(),
            headers: m.headers.clone(),
            windows: m
                .quota
                .iter()
                .flat_map(|q| &q.windows)
                .map(crate::quota::window_of)
                .collect(),
            units: m
                .quota
                .iter()
                .flat_map(|q| &q.windows)
                .map(crate::quota::unit_of)
                .collect(),
            calendars: m
                .quota
                .iter()
                .flat_map(|q| &q.windows)
                .map(crate::quota::calendar_of)
                .collect(),
            kind: m.kind.clone(),
            cell,
            attempts_ok: labels("ok"),
            attempts_connect_failure: labels("connect_failure"),
            attempts_error: labels("error"),
            cooldowns: metrics.member_cooldowns.with_label_values(&[name, &m.name]),
            duration: metrics.member_duration.with_label_values(&[name, &m.name]),
        });
    }
    members.into()
}

/// A Pingora peer at `addr` with the upstream's timeouts; `sni` is the TLS server name.
pub(crate) fn peer_for(addr: SocketAddr, tls: bool, sni: String, up: &UpstreamConfig) -> HttpPeer {
    crate::dns::peer_with(
        addr,
        tls,
        sni,
        up.connect_timeout.0,
        up.read_timeout.0,
        up.write_timeout.0,
    )
}

/// The hex sha256 of a config file's bytes: its version.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}
