//! The immutable routing table built from a config: routes, their pools and prebuilt peers.
//!
//! Everything a request needs is computed here, off the hot path: resolved addresses, Pingora
//! peers with their timeouts, Host header values and metric handles. A request then only clones
//! a prebuilt peer. The table is swapped in whole, so a request sees one consistent config.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroUsize;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, SystemTime};

use http::HeaderValue;
use pingora::upstreams::peer::HttpPeer;
use prometheus::{Histogram, IntCounter, IntGauge};
use sluice_balancer::{HealthObserver, HealthPolicy, MemberHealth, MemberSpec, Pool, Transition};

use sluice_allocator::AssignmentStore;
use sluice_limiter::Window;

use crate::config::{
    AdminConfig, Config, ListenAddr, MemberUrl, OnRestore, OnStoreError, QuotaConfig, QuotaKey,
    RouteConfig, Selection, StateConfig,
};
use crate::metrics::Metrics;
use crate::router::{RouteMatch, Router};

/// How long an idle pooled connection to a member is kept.
const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

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
}

/// One route, ready to serve.
pub struct Route {
    /// The route's name.
    pub name: Arc<str>,
    /// The route as configured.
    pub config: RouteConfig,
    /// Members and their health.
    pub pool: Arc<Pool>,
    /// Per-member data for proxying, indexed like `pool.members()`; shared with the previous
    /// table when the upstream is unchanged.
    pub members: Arc<[Member]>,
    /// `sluice_request_duration_seconds{route}`, resolved once.
    pub duration: Histogram,
    /// The quota gating the route, if any; shared with the previous table when unchanged.
    pub quota: Option<Arc<RouteQuota>>,
    /// How members are chosen.
    pub selection: Selection,
    /// Member id → index, to map a least-used assignment back to its member.
    pub index_of: Arc<HashMap<Arc<str>, usize>>,
    /// Every member's id, in config order, as the least-used store takes them.
    pub member_ids: Arc<[Arc<str>]>,
    /// Whether this table's member list has been written to the least-used store. It is
    /// done on the route's first assignment, from the runtime that serves requests.
    pub synced: AtomicBool,
}

impl Route {
    /// Ids of the members that are down, for least-used exclusion.
    pub fn down_ids(&self) -> Vec<&str> {
        self.pool
            .down_members()
            .iter()
            .map(|&i| &*self.pool.members()[i as usize].id)
            .collect()
    }
}

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

    fn build(route: &str, q: &QuotaConfig, metrics: &Metrics) -> RouteQuota {
        let windows: Vec<Window> = q
            .windows
            .iter()
            .map(|w| Window {
                name: w.name.0.as_str().into(),
                limit: w.limit.get(),
                length_us: u64::try_from(w.window.0.as_micros()).unwrap_or(u64::MAX),
            })
            .collect();
        // Structured-field integers: a window shorter than a second is announced as 1 s.
        let policy = windows
            .iter()
            .map(|w| {
                format!(
                    "\"{}\";q={};w={}",
                    w.name,
                    w.limit,
                    w.length_us.div_ceil(1_000_000)
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        RouteQuota {
            rejections: windows
                .iter()
                .map(|w| {
                    metrics
                        .quota_rejections
                        .with_label_values(&[route, &w.name])
                })
                .collect(),
            policy: HeaderValue::from_str(&policy).expect("names are tokens, numbers are digits"),
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

/// What proxying to one member needs.
pub struct Member {
    /// The member's URL.
    pub url: MemberUrl,
    /// The prebuilt peer; `None` when the member's host did not resolve.
    pub peer: Option<HttpPeer>,
    /// Host header value for `preserve_host: false`.
    pub host_header: HeaderValue,
    /// `sluice_upstream_attempts_total` for each outcome, resolved once.
    pub attempts_ok: IntCounter,
    /// Attempt that failed to connect.
    pub attempts_connect_failure: IntCounter,
    /// Attempt that failed after connecting.
    pub attempts_error: IntCounter,
}

impl Table {
    /// Builds the table for `config`. Member host names are resolved here, asynchronously, so
    /// that no request ever waits on DNS.
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
        allocator: &Arc<dyn AssignmentStore>,
        previous: Option<&Table>,
    ) -> Table {
        let prior: HashMap<&str, &Arc<Route>> = previous
            .map(|t| t.routes.iter().map(|r| (&*r.name, r)).collect())
            .unwrap_or_default();
        let mut routes = Vec::with_capacity(config.routes.len());
        for rc in &config.routes {
            let before = prior.get(rc.name.0.as_str()).copied();
            routes.push(Arc::new(build_route(rc, metrics, allocator, before).await));
        }
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
        Table {
            router,
            routes,
            version: sha256_hex(bytes),
            loaded_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            settings: Settings::of(config),
        }
    }
}

/// The parts of a config that only a restart can change: listeners, threads and the stores.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// `listen`.
    pub listen: Vec<ListenAddr>,
    /// `admin` (its `token_env` is read at every POST, so changing it needs no restart).
    pub admin: AdminConfig,
    /// `threads`.
    pub threads: Option<NonZeroUsize>,
    /// `state`.
    pub state: StateConfig,
}

impl Settings {
    fn of(config: &Config) -> Settings {
        Settings {
            listen: config.listen.clone(),
            admin: config.admin.clone(),
            threads: config.threads,
            state: config.state.clone(),
        }
    }

    /// Whether `other` differs in something only a restart applies.
    pub fn needs_restart_for(&self, other: &Settings) -> bool {
        self.listen != other.listen
            || self.admin.listen != other.admin.listen
            || self.threads != other.threads
            || self.state != other.state
    }
}

async fn build_route(
    rc: &RouteConfig,
    metrics: &Arc<Metrics>,
    allocator: &Arc<dyn AssignmentStore>,
    before: Option<&Arc<Route>>,
) -> Route {
    let name: Arc<str> = rc.name.0.as_str().into();
    let up = &rc.upstream;
    // What did not change is shared with the previous table, not built again: a reload that
    // touches one route of ten thousand costs little more than that one route.
    let (pool, members, index_of, member_ids) = match before {
        Some(b) if b.config.upstream == *up => (
            b.pool.clone(),
            b.members.clone(),
            b.index_of.clone(),
            b.member_ids.clone(),
        ),
        _ => {
            let (pool, members) = build_pool(&name, rc, metrics, allocator, before).await;
            let index_of = pool
                .members()
                .iter()
                .enumerate()
                .map(|(i, m)| (m.id.clone(), i))
                .collect();
            let member_ids = pool.members().iter().map(|m| m.id.clone()).collect();
            (pool, members, Arc::new(index_of), member_ids)
        }
    };
    let quota = match (before, &rc.quota) {
        (Some(b), Some(q)) if b.config.quota.as_ref() == Some(q) => b.quota.clone(),
        (_, Some(q)) => Some(Arc::new(RouteQuota::build(&name, q, metrics))),
        (_, None) => None,
    };
    Route {
        quota,
        duration: match before {
            Some(b) => b.duration.clone(),
            None => metrics.request_duration.with_label_values(&[&name]),
        },
        selection: up.selection,
        index_of,
        synced: AtomicBool::new(false),
        member_ids,
        pool,
        members,
        config: rc.clone(),
        name,
    }
}

async fn build_pool(
    name: &Arc<str>,
    rc: &RouteConfig,
    metrics: &Arc<Metrics>,
    allocator: &Arc<dyn AssignmentStore>,
    before: Option<&Arc<Route>>,
) -> (Arc<Pool>, Arc<[Member]>) {
    let up = &rc.upstream;
    let policy = HealthPolicy {
        passive_fall: up.passive.fall.get(),
        cooldown: up.passive.cooldown.0,
        active: up
            .health_check
            .as_ref()
            .map(|h| (h.rise.get(), h.fall.get())),
    };
    let mut specs = Vec::with_capacity(up.members.len());
    let mut members = Vec::with_capacity(up.members.len());
    for m in &up.members {
        let labels = |outcome: &str| {
            metrics
                .upstream_attempts
                .with_label_values(&[name, &m.url.url, outcome])
        };
        let peer = resolve(&m.url).await.map(|addr| {
            let mut peer = HttpPeer::new(addr, m.url.tls, m.url.host.clone());
            peer.options.connection_timeout = Some(up.connect_timeout.0);
            peer.options.total_connection_timeout = Some(up.connect_timeout.0);
            peer.options.read_timeout = Some(up.read_timeout.0);
            peer.options.idle_timeout = Some(UPSTREAM_IDLE_TIMEOUT);
            peer
        });
        // A member that survives a reload keeps its health.
        let health = before
            .and_then(|b| b.pool.members().iter().find(|s| *s.id == *m.url.url))
            .map_or_else(|| Arc::new(MemberHealth::new()), |s| s.health.clone());
        metrics
            .member_healthy
            .with_label_values(&[name, &m.url.url])
            .set(i64::from(health.is_up()));
        specs.push(MemberSpec {
            id: m.url.url.as_str().into(),
            weight: m.weight(),
            health,
        });
        members.push(Member {
            host_header: HeaderValue::from_str(&m.url.authority())
                .unwrap_or_else(|_| HeaderValue::from_static("invalid")),
            url: m.url.clone(),
            peer,
            attempts_ok: labels("ok"),
            attempts_connect_failure: labels("connect_failure"),
            attempts_error: labels("error"),
        });
    }
    let restore = (up.selection == Selection::LeastUsed && up.on_restore == Some(OnRestore::Min))
        .then(|| RestoreToMin {
            allocator: allocator.clone(),
            pool: OnceLock::new(),
        });
    let observer = Arc::new(HealthLog {
        restore,
        route: name.clone(),
        gauges: up
            .members
            .iter()
            .map(|m| {
                let gauge = metrics
                    .member_healthy
                    .with_label_values(&[name, &m.url.url]);
                (Arc::from(m.url.url.as_str()), gauge)
            })
            .collect(),
    });
    let pool = Arc::new(Pool::new(specs, policy, observer.clone()));
    if let Some(r) = &observer.restore {
        let _ = r.pool.set(Arc::downgrade(&pool));
    }
    if let Some(b) = before {
        pool.resume_at(b.pool.cursor());
    }
    (pool, members.into())
}

/// Resolves a member's host once. An IP literal needs no lookup; a name that fails to resolve
/// leaves the member without a peer, which requests treat as a connect failure.
async fn resolve(url: &MemberUrl) -> Option<SocketAddr> {
    if let Ok(ip) = url.host.parse::<IpAddr>() {
        return Some(SocketAddr::new(ip, url.port));
    }
    match tokio::net::lookup_host((url.host.as_str(), url.port)).await {
        Ok(mut addrs) => addrs.next(),
        Err(e) => {
            tracing::warn!(target: "sluice::dns", member = %url.url, error = %e, "member host does not resolve");
            None
        }
    }
}

/// Logs health transitions, mirrors them in `sluice_member_healthy`, and applies the `min`
/// restore policy of least-used pools.
struct HealthLog {
    restore: Option<RestoreToMin>,
    route: Arc<str>,
    gauges: Vec<(Arc<str>, IntGauge)>,
}

impl HealthObserver for HealthLog {
    fn health_changed(&self, member: &MemberSpec, t: Transition, cause: &'static str) {
        let up = t == Transition::Up;
        // Transitions are rare, so a scan beats keeping a map in step with the pool.
        if let Some((_, gauge)) = self.gauges.iter().find(|(id, _)| **id == *member.id) {
            gauge.set(i64::from(up));
        }
        if let (true, Some(restore)) = (up, &self.restore) {
            restore.spawn(&self.route, &member.id);
        }
        if up {
            tracing::info!(target: "sluice::health", route = %self.route, member = %member.id, cause, "member up");
        } else {
            tracing::warn!(target: "sluice::health", route = %self.route, member = %member.id, cause, "member down");
        }
    }
}

/// Raises a restored member to the pool's least count, in the background: health transitions
/// happen on whichever thread noticed them and must not wait for Redis.
struct RestoreToMin {
    allocator: Arc<dyn AssignmentStore>,
    /// Set right after the pool is built (the pool owns this observer, hence `Weak`).
    pool: OnceLock<Weak<Pool>>,
}

impl RestoreToMin {
    fn spawn(&self, route: &Arc<str>, member: &Arc<str>) {
        let (Ok(runtime), Some(pool)) = (
            tokio::runtime::Handle::try_current(),
            self.pool.get().and_then(Weak::upgrade),
        ) else {
            return;
        };
        let excluded: Vec<String> = pool
            .down_members()
            .iter()
            .map(|&i| pool.members()[i as usize].id.to_string())
            .collect();
        let (allocator, route, member) = (self.allocator.clone(), route.clone(), member.clone());
        runtime.spawn(async move {
            let excluded: Vec<&str> = excluded.iter().map(String::as_str).collect();
            if let Err(e) = allocator.restore_to_min(&route, &member, &excluded).await {
                tracing::warn!(target: "sluice::health", route = %route, member = %member, error = %e, "could not apply on_restore: min");
            }
        });
    }
}

/// The hex sha256 of a config file's bytes: its version.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(bytes);
    let mut out = String::with_capacity(64);
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}
