//! One typed builder for the gateway configs of the end-to-end tests.
//!
//! A test says what it needs (`Config::new().route(Route::new("api").member(url))`) and
//! [`Config::yaml`] writes the YAML, with `{PROXY}` and `{ADMIN}` where the harness puts free
//! ports ([`Config::start`] does both). Only a test that is *about* YAML text (a reload of a
//! broken file, say) edits the text itself.
//!
//! Optional settings are left out of the YAML unless a test sets them, so every test still runs
//! on sluice's own defaults for the rest.

use serde::Serialize;

use super::store::Store;
use super::Gateway;

/// A whole gateway config: proxy and admin on free ports of 127.0.0.1, one worker thread.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    listen: Vec<String>,
    admin: Admin,
    threads: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    state: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    egress: Option<Egress>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dns: Option<Dns>,
    routes: Vec<Route>,
}

/// The `dns:` block.
#[derive(Debug, Clone, Serialize)]
struct Dns {
    servers: Vec<String>,
}

/// The `egress:` block; what a test leaves `None` keeps sluice's default.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Egress {
    #[serde(skip_serializing_if = "Option::is_none")]
    deny: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    allow_cidrs: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    connect_ports: Option<Vec<u16>>,
}

impl Egress {
    /// `allow_cidrs:`.
    pub fn allow_cidrs(mut self, cidrs: &[&str]) -> Egress {
        self.allow_cidrs = Some(cidrs.iter().map(|c| c.to_string()).collect());
        self
    }

    /// `deny:`.
    pub fn deny(mut self, deny: &[&str]) -> Egress {
        self.deny = Some(deny.iter().map(|c| c.to_string()).collect());
        self
    }

    /// `connect_ports:`.
    pub fn connect_ports(mut self, ports: &[u16]) -> Egress {
        self.connect_ports = Some(ports.to_vec());
        self
    }

    /// `allow_cidrs` for loopback, the tests' own origins: `127.0.0.0/8` and `::1/128`.
    pub fn loopback_allowed() -> Egress {
        Egress::default().allow_cidrs(&["127.0.0.0/8", "::1/128"])
    }
}

#[derive(Debug, Clone, Serialize)]
struct Admin {
    listen: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_env: Option<String>,
}

/// The `state:` block.
#[derive(Debug, Clone, Serialize)]
pub struct State {
    backend: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    redis: Option<RedisState>,
}

#[derive(Debug, Clone, Serialize)]
struct RedisState {
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<RedisTls>,
    #[serde(skip_serializing_if = "Option::is_none")]
    batch: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    instance_index: Option<u32>,
}

/// `state.redis.tls:`.
#[derive(Debug, Clone, Serialize)]
struct RedisTls {
    ca: String,
}

/// The Redis call timeout the tests use unless they say otherwise: generous, so that a loaded
/// test machine (2 cores shared with compilers) never turns a slow answer into a store error,
/// which `on_store_error: open` would silently admit uncounted. A Redis that is down fails
/// at once (connection refused), whatever this is.
pub const REDIS_TIMEOUT: &str = "5s";

impl State {
    /// `backend: memory`.
    pub fn memory() -> State {
        State {
            backend: "memory",
            redis: None,
        }
    }

    /// `backend: redis` on one Redis at `url`, with [`REDIS_TIMEOUT`].
    pub fn redis(url: impl Into<String>) -> State {
        State {
            backend: "redis",
            redis: Some(RedisState {
                url: Some(url.into()),
                cluster: None,
                timeout: Some(REDIS_TIMEOUT.into()),
                tls: None,
                batch: None,
                instance_index: None,
            }),
        }
    }

    /// `backend: redis` on the Redis Cluster reachable through `nodes`, with [`REDIS_TIMEOUT`].
    pub fn cluster(nodes: impl IntoIterator<Item = impl Into<String>>) -> State {
        State {
            backend: "redis",
            redis: Some(RedisState {
                url: None,
                cluster: Some(nodes.into_iter().map(Into::into).collect()),
                timeout: Some(REDIS_TIMEOUT.into()),
                tls: None,
                batch: None,
                instance_index: None,
            }),
        }
    }

    /// Sets `state.redis.timeout` (a redis backend only).
    pub fn timeout(mut self, timeout: &str) -> State {
        self.redis
            .as_mut()
            .expect("a timeout needs backend: redis")
            .timeout = Some(timeout.into());
        self
    }

    /// Sets `state.redis.batch` (a redis backend only).
    pub fn batch(mut self, on: bool) -> State {
        self.redis
            .as_mut()
            .expect("batch needs backend: redis")
            .batch = Some(on);
        self
    }

    /// Sets `state.redis.instance_index` (a redis backend only).
    pub fn instance_index(mut self, index: u32) -> State {
        self.redis
            .as_mut()
            .expect("an instance index needs backend: redis")
            .instance_index = Some(index);
        self
    }

    /// Sets `state.redis.tls.ca` (a redis backend only; the URLs should be `rediss://`).
    pub fn tls_ca(mut self, ca: impl AsRef<std::path::Path>) -> State {
        self.redis.as_mut().expect("a CA needs backend: redis").tls = Some(RedisTls {
            ca: ca.as_ref().display().to_string(),
        });
        self
    }
}

impl Default for Config {
    fn default() -> Config {
        Config::new()
    }
}

impl Config {
    /// No route yet, no `state:` block (the memory store), one proxy thread.
    pub fn new() -> Config {
        Config {
            listen: vec!["{PROXY}".into()],
            admin: Admin {
                listen: "{ADMIN}".into(),
                token_env: None,
            },
            threads: 1,
            state: None,
            egress: None,
            dns: None,
            routes: Vec::new(),
        }
    }

    /// `threads:`.
    pub fn threads(mut self, threads: u32) -> Config {
        self.threads = threads;
        self
    }

    /// The `state:` block.
    pub fn state(mut self, state: State) -> Config {
        self.state = Some(state);
        self
    }

    /// The `state:` block for `store`, see [`Store::state`].
    pub fn store(self, store: &Store) -> Config {
        self.state(store.state())
    }

    /// The `egress:` block.
    pub fn egress(mut self, egress: Egress) -> Config {
        self.egress = Some(egress);
        self
    }

    /// `dns.servers:`.
    pub fn dns_servers(mut self, servers: &[std::net::SocketAddr]) -> Config {
        self.dns = Some(Dns {
            servers: servers.iter().map(|s| s.to_string()).collect(),
        });
        self
    }

    /// `admin.token_env:`.
    pub fn admin_token_env(mut self, name: &str) -> Config {
        self.admin.token_env = Some(name.into());
        self
    }

    /// Adds a route.
    pub fn route(mut self, route: Route) -> Config {
        self.routes.push(route);
        self
    }

    /// Adds several routes.
    pub fn routes(mut self, routes: impl IntoIterator<Item = Route>) -> Config {
        self.routes.extend(routes);
        self
    }

    /// The YAML text, with `{PROXY}` and `{ADMIN}` left for the harness to fill in.
    pub fn yaml(&self) -> String {
        serde_yaml::to_string(self).expect("a test config serialises")
    }

    /// Runs `sluice check` on this config (placeholders filled with free ports) and returns its
    /// verdict: `Ok` if it printed `ok`, else what it wrote on stderr.
    pub fn check(&self) -> Result<(), String> {
        let dir = super::TempDir::new("sluice-builder-check");
        let file = dir.path().join("sluice.yaml");
        let [proxy, admin] = super::free_ports::<2>();
        let yaml = self
            .yaml()
            .replace("{PROXY}", &format!("127.0.0.1:{proxy}"))
            .replace("{ADMIN}", &format!("127.0.0.1:{admin}"));
        std::fs::write(&file, yaml).expect("write the config");
        let out = std::process::Command::new(super::sluice_binary())
            .args(["check", "-c"])
            .arg(&file)
            .output()
            .expect("run sluice check");
        let stdout = String::from_utf8_lossy(&out.stdout);
        if out.status.success() && stdout.trim() == "ok" {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// Starts a gateway on this config, on free ports ([`Gateway::start_with_ports`]).
    pub fn start(&self) -> Gateway {
        Gateway::start_with_ports(&self.yaml())
    }

    /// Like [`Config::start`], with extra environment variables for the process.
    pub fn start_with_env(&self, env: &[(&str, &str)]) -> Gateway {
        Gateway::start_with_ports_and_env(&self.yaml(), env)
    }
}

/// One route. [`Route::new`] matches host `<name>.test`, has no member and no quota.
#[derive(Debug, Clone, Serialize)]
pub struct Route {
    name: String,
    #[serde(rename = "match")]
    matcher: Match,
    upstream: Upstream,
    #[serde(skip_serializing_if = "Option::is_none")]
    quota: Option<Quota>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    fallback: Vec<Fallback>,
    #[serde(skip_serializing_if = "Option::is_none")]
    state_shards: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    state_shards_start: Option<String>,
}

/// One entry of a route's `fallback`.
#[derive(Debug, Clone, Serialize)]
struct Fallback {
    route: String,
    on: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
struct Match {
    hosts: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    path_prefix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    methods: Option<Vec<String>>,
}

#[derive(Debug, Clone, Serialize)]
struct Upstream {
    #[serde(skip_serializing_if = "Option::is_none")]
    selection: Option<&'static str>,
    members: Vec<Member>,
    #[serde(skip_serializing_if = "Option::is_none")]
    preserve_host: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    connect_timeout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    read_timeout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retries: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    health_check: Option<HealthCheck>,
    #[serde(skip_serializing_if = "Option::is_none")]
    passive: Option<Passive>,
    #[serde(skip_serializing_if = "Option::is_none")]
    on_restore: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cooldown: Option<Cooldown>,
}

/// `upstream.cooldown` (SPEC §8): only what a test sets is written.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Cooldown {
    #[serde(skip_serializing_if = "Option::is_none")]
    on_status: Option<Vec<u16>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    default: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry: Option<bool>,
}

impl Cooldown {
    /// `cooldown: {}`: the defaults (429, 30s, 15m, no retry).
    pub fn new() -> Cooldown {
        Cooldown::default()
    }
    /// `on_status:`.
    pub fn on_status(mut self, statuses: &[u16]) -> Cooldown {
        self.on_status = Some(statuses.to_vec());
        self
    }
    /// `default:`.
    pub fn default_for(mut self, d: &str) -> Cooldown {
        self.default = Some(d.into());
        self
    }
    /// `max:`.
    pub fn max(mut self, d: &str) -> Cooldown {
        self.max = Some(d.into());
        self
    }
    /// `retry: true`.
    pub fn retry(mut self) -> Cooldown {
        self.retry = Some(true);
        self
    }
}

/// A member of a key pool (SPEC §8): a name, headers and its own windows.
#[derive(Debug, Clone)]
pub struct KeyMember {
    url: String,
    name: String,
    headers: Vec<(String, String)>,
    windows: Vec<QuotaWindow>,
}

impl KeyMember {
    /// Member `name` at `url`, with no headers and no windows yet.
    pub fn new(url: impl Into<String>, name: &str) -> KeyMember {
        KeyMember {
            url: url.into(),
            name: name.into(),
            headers: Vec::new(),
            windows: Vec::new(),
        }
    }
    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> KeyMember {
        self.headers.push((name.into(), value.into()));
        self
    }
    /// Adds a window to the member's own quota.
    pub fn window(mut self, name: &str, limit: u64, window: &str) -> KeyMember {
        self.windows.push(QuotaWindow {
            name: name.into(),
            limit,
            window: window.into(),
        });
        self
    }
}

#[derive(Debug, Clone, Serialize)]
struct Member {
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    proxy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    direct: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    weight: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    headers: Option<std::collections::BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    quota: Option<MemberQuota>,
}

#[derive(Debug, Clone, Serialize)]
struct MemberQuota {
    windows: Vec<QuotaWindow>,
}

impl Member {
    fn url(url: String, weight: Option<u32>) -> Member {
        Member {
            url: Some(url),
            proxy: None,
            direct: None,
            weight,
            name: None,
            headers: None,
            quota: None,
        }
    }
}

impl Route {
    /// Route `name` on host `<name>.test`, round-robin (the default) over no member yet.
    pub fn new(name: &str) -> Route {
        Route {
            name: name.into(),
            matcher: Match {
                hosts: vec![format!("{name}.test")],
                path_prefix: None,
                methods: None,
            },
            upstream: Upstream {
                selection: None,
                members: Vec::new(),
                preserve_host: None,
                connect_timeout: None,
                read_timeout: None,
                retries: None,
                health_check: None,
                passive: None,
                on_restore: None,
                cooldown: None,
            },
            quota: None,
            fallback: Vec::new(),
            state_shards: None,
            state_shards_start: None,
        }
    }

    /// `match.hosts`, replacing `<name>.test`.
    pub fn hosts(mut self, hosts: &[&str]) -> Route {
        self.matcher.hosts = hosts.iter().map(|h| h.to_string()).collect();
        self
    }

    /// `match.path_prefix`.
    pub fn path_prefix(mut self, prefix: &str) -> Route {
        self.matcher.path_prefix = Some(prefix.into());
        self
    }

    /// `match.methods`.
    pub fn methods(mut self, methods: &[&str]) -> Route {
        self.matcher.methods = Some(methods.iter().map(|m| m.to_string()).collect());
        self
    }

    /// Adds a member.
    pub fn member(mut self, url: impl Into<String>) -> Route {
        self.upstream.members.push(Member::url(url.into(), None));
        self
    }

    /// Adds a `proxy:` member: a forward proxy at `url` (`http://[user:pass@]host:port`).
    pub fn proxy_member(mut self, url: impl Into<String>) -> Route {
        self.upstream.members.push(Member {
            url: None,
            proxy: Some(url.into()),
            direct: None,
            weight: None,
            name: None,
            headers: None,
            quota: None,
        });
        self
    }

    /// Adds a `direct: true` member: the client's own target.
    pub fn direct_member(mut self) -> Route {
        self.upstream.members.push(Member {
            url: None,
            proxy: None,
            direct: Some(true),
            weight: None,
            name: None,
            headers: None,
            quota: None,
        });
        self
    }

    /// Adds members.
    pub fn members(self, urls: impl IntoIterator<Item = impl Into<String>>) -> Route {
        urls.into_iter().fold(self, Route::member)
    }

    /// Adds a member with a round-robin `weight`.
    pub fn weighted_member(mut self, url: impl Into<String>, weight: u32) -> Route {
        self.upstream
            .members
            .push(Member::url(url.into(), Some(weight)));
        self
    }

    /// Adds a key-pool member: a name, headers and its own windows.
    pub fn key_member(mut self, m: KeyMember) -> Route {
        let mut member = Member::url(m.url, None);
        member.name = Some(m.name);
        member.headers = (!m.headers.is_empty()).then(|| m.headers.into_iter().collect());
        member.quota = (!m.windows.is_empty()).then_some(MemberQuota { windows: m.windows });
        self.upstream.members.push(member);
        self
    }

    /// `upstream.cooldown:`.
    pub fn cooldown(mut self, cooldown: Cooldown) -> Route {
        self.upstream.cooldown = Some(cooldown);
        self
    }

    /// `selection: priority`.
    pub fn priority(mut self) -> Route {
        self.upstream.selection = Some("priority");
        self
    }

    /// `selection: least_used`.
    pub fn least_used(mut self) -> Route {
        self.upstream.selection = Some("least_used");
        self
    }

    /// `on_restore:` (`keep` or `min`; least_used only).
    pub fn on_restore(mut self, policy: &'static str) -> Route {
        self.upstream.on_restore = Some(policy);
        self
    }

    /// `retries:`.
    pub fn retries(mut self, retries: u32) -> Route {
        self.upstream.retries = Some(retries);
        self
    }

    /// `preserve_host:`.
    pub fn preserve_host(mut self, preserve: bool) -> Route {
        self.upstream.preserve_host = Some(preserve);
        self
    }

    /// `connect_timeout:`.
    pub fn connect_timeout(mut self, timeout: &str) -> Route {
        self.upstream.connect_timeout = Some(timeout.into());
        self
    }

    /// `read_timeout:`.
    pub fn read_timeout(mut self, timeout: &str) -> Route {
        self.upstream.read_timeout = Some(timeout.into());
        self
    }

    /// `health_check:`.
    pub fn health_check(mut self, check: HealthCheck) -> Route {
        self.upstream.health_check = Some(check);
        self
    }

    /// `passive:`.
    pub fn passive(mut self, passive: Passive) -> Route {
        self.upstream.passive = Some(passive);
        self
    }

    /// `quota:`.
    pub fn quota(mut self, quota: Quota) -> Route {
        self.quota = Some(quota);
        self
    }

    /// `state_shards`: the route's state kept as `n` sub-logs on Redis.
    pub fn state_shards(mut self, n: u32) -> Route {
        self.state_shards = Some(n);
        self
    }

    /// `state_shards_start`: `round_robin` or `home`.
    pub fn state_shards_start(mut self, start: &str) -> Route {
        self.state_shards_start = Some(start.into());
        self
    }

    /// Adds a `fallback` entry: on to `route` for each reason of `on` (`quota_exceeded`,
    /// `no_member`, `429`, `503`).
    pub fn fallback(mut self, route: &str, on: &[&str]) -> Route {
        self.fallback.push(Fallback {
            route: route.into(),
            on: on.iter().map(|s| s.to_string()).collect(),
        });
        self
    }
}

/// `upstream.health_check`: only what a test sets is written.
#[derive(Debug, Clone, Serialize)]
pub struct HealthCheck {
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rise: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fall: Option<u32>,
}

impl HealthCheck {
    /// `kind: http` with `path`.
    pub fn http(path: &str) -> HealthCheck {
        HealthCheck {
            kind: "http",
            path: Some(path.into()),
            interval: None,
            timeout: None,
            rise: None,
            fall: None,
        }
    }

    /// `kind: tcp`.
    pub fn tcp() -> HealthCheck {
        HealthCheck {
            kind: "tcp",
            path: None,
            interval: None,
            timeout: None,
            rise: None,
            fall: None,
        }
    }

    /// A check that reacts fast, as the tests want: every `interval`, `rise` and `fall` as
    /// given. Its timeout is long (5 s): the tests take members down with a 503 or a refused
    /// connection, which fail at once, while with `fall: 1` a short timeout would take a
    /// healthy member out whenever a loaded machine delays one answer.
    pub fn fast_http(interval: &str, rise: u32, fall: u32) -> HealthCheck {
        HealthCheck::http("/healthz")
            .interval(interval)
            .timeout("5s")
            .rise(rise)
            .fall(fall)
    }

    pub fn interval(mut self, interval: &str) -> HealthCheck {
        self.interval = Some(interval.into());
        self
    }

    pub fn timeout(mut self, timeout: &str) -> HealthCheck {
        self.timeout = Some(timeout.into());
        self
    }

    pub fn rise(mut self, rise: u32) -> HealthCheck {
        self.rise = Some(rise);
        self
    }

    pub fn fall(mut self, fall: u32) -> HealthCheck {
        self.fall = Some(fall);
        self
    }
}

/// `upstream.passive`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Passive {
    #[serde(skip_serializing_if = "Option::is_none")]
    fall: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cooldown: Option<String>,
}

impl Passive {
    /// `passive: {cooldown: <cooldown>}`.
    pub fn cooldown(cooldown: &str) -> Passive {
        Passive {
            fall: None,
            cooldown: Some(cooldown.into()),
        }
    }

    /// Sets `fall`.
    pub fn fall(mut self, fall: u32) -> Passive {
        self.fall = Some(fall);
        self
    }
}

/// A route's `quota:`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Quota {
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<String>,
    windows: Vec<QuotaWindow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cost: Option<Cost>,
    #[serde(skip_serializing_if = "Option::is_none")]
    on_store_error: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_wait: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_waiting: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
struct QuotaWindow {
    name: String,
    limit: u64,
    window: String,
}

#[derive(Debug, Clone, Default, Serialize)]
struct Cost {
    #[serde(skip_serializing_if = "Option::is_none")]
    default: Option<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    rules: Vec<CostRule>,
}

#[derive(Debug, Clone, Serialize)]
struct CostRule {
    path_prefix: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    methods: Option<Vec<String>>,
    cost: u64,
}

impl Quota {
    /// A quota with one window.
    pub fn window(name: &str, limit: u64, window: &str) -> Quota {
        Quota::default().and_window(name, limit, window)
    }

    /// Adds a window.
    pub fn and_window(mut self, name: &str, limit: u64, window: &str) -> Quota {
        self.windows.push(QuotaWindow {
            name: name.into(),
            limit,
            window: window.into(),
        });
        self
    }

    /// `key:` (`route`, `header:<Name>` or `client_ip`).
    pub fn key(mut self, key: &str) -> Quota {
        self.key = Some(key.into());
        self
    }

    /// `cost.default:`.
    pub fn cost_default(mut self, cost: u64) -> Quota {
        self.cost.get_or_insert_with(Cost::default).default = Some(cost);
        self
    }

    /// Adds a cost rule; no `methods` (an empty slice) means every method.
    pub fn cost_rule(mut self, path_prefix: &str, methods: &[&str], cost: u64) -> Quota {
        self.cost
            .get_or_insert_with(Cost::default)
            .rules
            .push(CostRule {
                path_prefix: path_prefix.into(),
                methods: (!methods.is_empty())
                    .then(|| methods.iter().map(|m| m.to_string()).collect()),
                cost,
            });
        self
    }

    /// A quota with no window of its own, only there to set `max_wait` for members' quotas.
    pub fn waiting_only(max_wait: &str) -> Quota {
        Quota::default().max_wait(max_wait)
    }

    /// `max_wait:`.
    pub fn max_wait(mut self, d: &str) -> Quota {
        self.max_wait = Some(d.into());
        self
    }

    /// `max_waiting:`.
    pub fn max_waiting(mut self, n: u64) -> Quota {
        self.max_waiting = Some(n);
        self
    }

    /// `on_store_error:` (`open` or `closed`).
    pub fn on_store_error(mut self, policy: &'static str) -> Quota {
        self.on_store_error = Some(policy);
        self
    }
}
