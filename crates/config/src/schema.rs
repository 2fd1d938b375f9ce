//! The serde types of the YAML file (SPEC §2).
//!
//! Each field type checks itself while it is parsed, so a bad value is reported at its own line
//! and column rather than at the enclosing mapping.

use std::net::SocketAddr;
use std::num::{NonZeroU16, NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use crate::urls::{MemberUrl, ProxyUrl, RedisUrl};

/// A socket address to listen on, such as `127.0.0.1:8080` or `[::1]:8080`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddr(pub SocketAddr);

impl<'de> Deserialize<'de> for ListenAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ListenAddr::parse(&s).map_err(de::Error::custom)
    }
}

impl ListenAddr {
    fn parse(s: &str) -> Result<ListenAddr, String> {
        s.parse().map(ListenAddr).map_err(|_| {
            format!("invalid listen address {s:?}: expected IP:PORT, e.g. 127.0.0.1:8080")
        })
    }
}

/// One proxy listener (`listen:` entry): a plain address, `"127.0.0.1:8080"`, or a mapping
/// `{addr: "127.0.0.1:8443", tls: {cert: cert.pem, key: key.pem}}`. With `tls`, clients reach
/// the proxy as `https://` and speak TLS to it; inside, the same HTTP/1.1 and CONNECT as on a
/// plain listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// Where to listen.
    pub addr: SocketAddr,
    /// TLS on this listener, or plain TCP when absent.
    pub tls: Option<ListenTls>,
}

impl Listener {
    /// A plain-TCP listener on `addr`.
    pub fn plain(addr: SocketAddr) -> Listener {
        Listener { addr, tls: None }
    }
}

/// `listen[].tls` — the certificate a TLS listener presents. Files are read at start (and by
/// `sluice check`); a new certificate takes a restart, like any listener change. Relative paths
/// are taken from the working directory.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenTls {
    /// PEM certificate chain, the listener's own certificate first.
    pub cert: std::path::PathBuf,
    /// PEM private key of that certificate (PKCS#8, PKCS#1 or SEC1), unencrypted.
    pub key: std::path::PathBuf,
}

impl<'de> Deserialize<'de> for Listener {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        /// The mapping form.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            addr: ListenAddr,
            #[serde(default)]
            tls: Option<ListenTls>,
        }

        struct Visit;
        impl<'de> de::Visitor<'de> for Visit {
            type Value = Listener;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an address IP:PORT, or a mapping {addr: IP:PORT, tls: {cert: FILE, key: FILE}}")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Listener, E> {
                ListenAddr::parse(s)
                    .map(|a| Listener::plain(a.0))
                    .map_err(E::custom)
            }
            fn visit_map<M: de::MapAccess<'de>>(self, m: M) -> Result<Listener, M::Error> {
                let full = Full::deserialize(de::value::MapAccessDeserializer::new(m))?;
                Ok(Listener {
                    addr: full.addr.0,
                    tls: full.tls,
                })
            }
        }
        d.deserialize_any(Visit)
    }
}

/// `admin:` — the admin API.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Where the admin API listens; loopback by default, since it exposes internals.
    #[serde(default = "default_admin_listen")]
    pub listen: ListenAddr,
    /// Name of the environment variable holding the bearer token for POST endpoints.
    #[serde(default)]
    pub token_env: Option<String>,
}

fn default_admin_listen() -> ListenAddr {
    ListenAddr("127.0.0.1:9901".parse().unwrap())
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: default_admin_listen(),
            token_env: None,
        }
    }
}

/// `limits:` — what the proxy listeners let one client connection, and all of them together,
/// hold. nginx and Envoy bound all of these by default; Pingora bounds none of them by itself
/// (see the gateway's `limits`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Most client connections open at once on the proxy listeners; past it new ones are
    /// answered 503 and closed. Absent: half of what the open-file limit leaves after a reserve,
    /// since every client connection may need an upstream one too.
    #[serde(default)]
    pub max_connections: Option<NonZeroU32>,
    /// How long a client connection may wait, idle, for its next request (nginx
    /// `keepalive_timeout`); the first request of a connection included.
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout: Dur,
    /// How long a request head may take to arrive whole, from its first byte (nginx
    /// `client_header_timeout`, but for the whole head, not per read).
    #[serde(default = "default_header_timeout")]
    pub header_timeout: Dur,
    /// The largest request head (request line and headers), in bytes; a larger one is answered
    /// `431 header_too_large`.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: NonZeroU32,
}

fn default_idle_timeout() -> Dur {
    Dur(Duration::from_secs(60))
}
fn default_header_timeout() -> Dur {
    Dur(Duration::from_secs(30))
}
fn default_max_header_bytes() -> NonZeroU32 {
    NonZeroU32::new(64 * 1024).unwrap()
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_connections: None,
            idle_timeout: default_idle_timeout(),
            header_timeout: default_header_timeout(),
            max_header_bytes: default_max_header_bytes(),
        }
    }
}

/// `state:` — where quota and least-used state lives.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    /// `memory` (one instance) or `redis` (shared by every instance).
    #[serde(default)]
    pub backend: StateBackend,
    /// How to reach Redis; required with `backend: redis`.
    #[serde(default)]
    pub redis: Option<RedisConfig>,
    /// Bounds of the memory store (`backend: memory`).
    #[serde(default)]
    pub memory: MemoryStateConfig,
}

/// `state.memory:` — how much the memory store may hold, since clients choose quota keys.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryStateConfig {
    /// The most quota keys one route holds; past it a request with a new key gets
    /// `429 quota_keys_exhausted`.
    #[serde(default = "default_max_keys")]
    pub max_keys: NonZeroUsize,
    /// The most log entries one route holds over all its keys and windows (one per admitted
    /// request per window, while in the window); past it a request that would add entries
    /// gets `429 quota_keys_exhausted`.
    #[serde(default = "default_max_entries")]
    pub max_entries: NonZeroUsize,
}

impl Default for MemoryStateConfig {
    fn default() -> MemoryStateConfig {
        MemoryStateConfig {
            max_keys: default_max_keys(),
            max_entries: default_max_entries(),
        }
    }
}

fn default_max_keys() -> NonZeroUsize {
    NonZeroUsize::new(100_000).unwrap_or(NonZeroUsize::MIN)
}

fn default_max_entries() -> NonZeroUsize {
    NonZeroUsize::new(2_000_000).unwrap_or(NonZeroUsize::MIN)
}

/// The state backend.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum StateBackend {
    /// In-process state, for a single instance.
    #[default]
    Memory,
    /// Redis, shared by every gateway instance that points at it.
    Redis,
}

/// `state.redis:` — the shared store.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://host:port/db` (or `rediss://`, over TLS), for a single Redis.
    #[serde(default)]
    pub url: Option<RedisUrl>,
    /// Some nodes of a Redis Cluster (`redis://host:port` each, or `rediss://` for TLS); the
    /// rest are discovered.
    #[serde(default)]
    pub cluster: Option<Vec<RedisUrl>>,
    /// First part of every key.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// Time allowed for one Redis call; past it the route's `on_store_error` applies.
    #[serde(default = "default_redis_timeout")]
    pub timeout: Dur,
    /// TLS settings for `rediss://` URLs; without them the system's root certificates are
    /// trusted.
    #[serde(default)]
    pub tls: Option<RedisTlsConfig>,
}

/// `state.redis.tls:` — how a `rediss://` Redis is trusted.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RedisTlsConfig {
    /// A PEM file of CA certificates (e.g. a private CA's); when given, the Redis server's
    /// certificate must chain to one of these, and the system's roots are not used.
    #[serde(default)]
    pub ca: Option<PathBuf>,
}

fn default_key_prefix() -> String {
    "sluice".into()
}
fn default_redis_timeout() -> Dur {
    Dur(Duration::from_millis(50))
}

/// One route.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Unique name, `[A-Za-z0-9_-]+`; it appears in logs, metrics and Redis keys.
    pub name: RouteName,
    /// Which requests the route takes.
    #[serde(rename = "match", default)]
    pub matcher: MatchConfig,
    /// Where they go.
    pub upstream: UpstreamConfig,
    /// The sliding-window quota that gates the route.
    #[serde(default)]
    pub quota: Option<QuotaConfig>,
}

/// `quota:` — a sliding-window quota.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    /// What one quota counts: the whole route, each value of a header, or each client address.
    #[serde(default)]
    pub key: QuotaKey,
    /// Every window must admit a request. May be empty on a route whose members have quotas
    /// and which only sets `max_wait`.
    #[serde(default)]
    pub windows: Vec<WindowConfig>,
    /// What a request costs.
    #[serde(default)]
    pub cost: CostConfig,
    /// What to do when the store cannot answer.
    #[serde(default)]
    pub on_store_error: OnStoreError,
    /// How long a request may wait for capacity (the route's windows, a member's windows, a
    /// cooldown ending) instead of being refused at once; 0 refuses at once.
    #[serde(default = "no_wait")]
    pub max_wait: Dur,
    /// The most requests that may wait at once per route, per instance.
    #[serde(default = "default_max_waiting")]
    pub max_waiting: NonZeroUsize,
}

fn no_wait() -> Dur {
    Dur(Duration::ZERO)
}

fn default_max_waiting() -> NonZeroUsize {
    NonZeroUsize::new(1000).unwrap_or(NonZeroUsize::MIN)
}

/// `quota.key`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum QuotaKey {
    /// One quota for the whole route.
    #[default]
    Route,
    /// One quota per value of this header (lowercased name). Requests without it share one.
    Header(String),
    /// One quota per client IP address.
    ClientIp,
}

impl<'de> Deserialize<'de> for QuotaKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "route" => Ok(QuotaKey::Route),
            "client_ip" => Ok(QuotaKey::ClientIp),
            _ => match s.strip_prefix("header:") {
                Some("") => Err(de::Error::custom(
                    "quota key \"header:\" needs a header name, e.g. header:X-Tenant",
                )),
                Some(name) => http::HeaderName::from_bytes(name.as_bytes())
                    .map(|h| QuotaKey::Header(h.as_str().to_string()))
                    .map_err(|_| de::Error::custom(format!("invalid header name {name:?}"))),
                None => Err(de::Error::custom(format!(
                    "invalid quota key {s:?}: expected route, header:<Name> or client_ip"
                ))),
            },
        }
    }
}

/// One window of a quota.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WindowConfig {
    /// Unique within the quota; appears in headers, metrics and Redis keys.
    pub name: RouteName,
    /// Units admitted in any interval of length `window`.
    pub limit: NonZeroU64,
    /// The window's length.
    pub window: Dur,
}

/// `quota.cost`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CostConfig {
    /// Cost of a request no rule matches.
    #[serde(default = "one_unit")]
    pub default: NonZeroU64,
    /// The first matching rule gives the cost.
    #[serde(default)]
    pub rules: Vec<CostRule>,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            default: one_unit(),
            rules: Vec::new(),
        }
    }
}

fn one_unit() -> NonZeroU64 {
    NonZeroU64::MIN
}

/// A cost rule: by path prefix and method.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CostRule {
    /// Matches paths starting with this (default `/`).
    #[serde(default = "root_prefix")]
    pub path_prefix: PathPrefix,
    /// Matches these methods (default: all).
    #[serde(default)]
    pub methods: Vec<MethodName>,
    /// The cost.
    pub cost: NonZeroU64,
}

/// `quota.on_store_error`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    /// Admit the request, uncounted.
    #[default]
    Open,
    /// Refuse it with 503 `store_unavailable`.
    Closed,
}

/// A route name: `[A-Za-z0-9_-]+`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RouteName(pub String);

impl<'de> Deserialize<'de> for RouteName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let valid = !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if valid {
            Ok(RouteName(s))
        } else {
            Err(de::Error::custom(format!(
                "invalid route name {s:?}: use letters, digits, '_' and '-' only"
            )))
        }
    }
}

/// `match:` — hosts, path prefix and methods.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MatchConfig {
    /// Exact hosts and `*.suffix` wildcards; `*` (the default) matches any host.
    #[serde(default = "any_host")]
    pub hosts: Vec<HostPattern>,
    /// The longest matching prefix wins.
    #[serde(default = "root_prefix")]
    pub path_prefix: PathPrefix,
    /// Allowed methods; empty means all.
    #[serde(default)]
    pub methods: Vec<MethodName>,
}

impl Default for MatchConfig {
    fn default() -> Self {
        MatchConfig {
            hosts: any_host(),
            path_prefix: root_prefix(),
            methods: Vec::new(),
        }
    }
}

fn any_host() -> Vec<HostPattern> {
    vec![HostPattern::Any]
}

fn root_prefix() -> PathPrefix {
    PathPrefix("/".into())
}

/// A host pattern, lowercased.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// `*`: any host.
    Any,
    /// `api.example.com`.
    Exact(String),
    /// `*.example.com`, stored as `example.com`: any subdomain, not the domain itself.
    Wildcard(String),
}

impl<'de> Deserialize<'de> for HostPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let lower = s.trim_end_matches('.').to_ascii_lowercase();
        let valid_name = |h: &str| {
            !h.is_empty()
                && h.split('.').all(|label| {
                    !label.is_empty()
                        && label
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                })
        };
        if lower == "*" {
            Ok(HostPattern::Any)
        } else if let Some(suffix) = lower.strip_prefix("*.") {
            if valid_name(suffix) {
                Ok(HostPattern::Wildcard(suffix.to_string()))
            } else {
                Err(de::Error::custom(format!("invalid wildcard host {s:?}")))
            }
        } else if let Some(v6) = ipv6(&lower) {
            // One spelling for every way of writing the address, the one the router looks up.
            Ok(HostPattern::Exact(v6.to_string()))
        } else if lower.contains(':') {
            Err(de::Error::custom(format!(
                "invalid host {s:?}: give the host without a port; ports are ignored when matching"
            )))
        } else if valid_name(&lower) {
            Ok(HostPattern::Exact(lower))
        } else {
            Err(de::Error::custom(format!(
                "invalid host {s:?}: expected a DNS name, an IP address, \"*.domain\" or \"*\""
            )))
        }
    }
}

/// An IPv6 literal, bare (`::1`) or in brackets (`[::1]`), as a host is written.
pub(crate) fn ipv6(host: &str) -> Option<std::net::Ipv6Addr> {
    let bare = match host.strip_prefix('[') {
        Some(rest) => rest.strip_suffix(']')?,
        None => host,
    };
    bare.parse().ok()
}

/// A path prefix; must start with `/`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PathPrefix(pub String);

impl<'de> Deserialize<'de> for PathPrefix {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.starts_with('/') {
            Ok(PathPrefix(s))
        } else {
            Err(de::Error::custom(format!(
                "invalid path_prefix {s:?}: it must start with '/'"
            )))
        }
    }
}

/// An HTTP method name, uppercase.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MethodName(pub String);

impl<'de> Deserialize<'de> for MethodName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let token = !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if token {
            Ok(MethodName(s.to_ascii_uppercase()))
        } else {
            Err(de::Error::custom(format!("invalid method {s:?}")))
        }
    }
}

/// `upstream:` — the pool and how to talk to it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// How a member is chosen.
    #[serde(default)]
    pub selection: Selection,
    /// The pool; may be empty (the route then answers 503).
    #[serde(default)]
    pub members: Vec<MemberConfig>,
    /// Send the client's Host upstream (true) or the member's authority (false).
    #[serde(default = "yes")]
    pub preserve_host: bool,
    /// Time allowed to open a connection (TCP and TLS).
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: Dur,
    /// Time allowed between two reads from the member.
    #[serde(default = "default_read_timeout")]
    pub read_timeout: Dur,
    /// Time allowed for one write to the member (a member that stops reading an upload).
    #[serde(default = "default_read_timeout")]
    pub write_timeout: Dur,
    /// More attempts on other members after a connect failure or connect timeout.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// Active checks; without them only passive checks run.
    #[serde(default)]
    pub health_check: Option<HealthCheckConfig>,
    /// Passive checks on live traffic.
    #[serde(default)]
    pub passive: PassiveConfig,
    /// least_used only: what a restored member's count becomes.
    #[serde(default)]
    pub on_restore: Option<OnRestore>,
    /// Cooldowns learned from the members' answers (SPEC §8).
    #[serde(default)]
    pub cooldown: Option<CooldownConfig>,
}

fn yes() -> bool {
    true
}
fn default_connect_timeout() -> Dur {
    Dur(Duration::from_secs(2))
}
fn default_read_timeout() -> Dur {
    Dur(Duration::from_secs(30))
}
fn default_retries() -> u32 {
    2
}

/// `upstream.selection`: the name of the policy that chooses a member (default `round_robin`).
///
/// The config reads only the name. Which names exist, and what each asks of a route, belong to
/// the policies themselves (the gateway's `select` module, through [`super::Rules`]), so that a
/// new policy needs no change here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection(Arc<str>);

impl Selection {
    /// The policy named `name`.
    pub fn named(name: &str) -> Selection {
        Selection(name.into())
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Selection {
    fn default() -> Self {
        Selection::named("round_robin")
    }
}

impl<'de> Deserialize<'de> for Selection {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        let word = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !word {
            return Err(de::Error::custom(format!(
                "{name:?} is not a policy name (lowercase letters, digits and _)"
            )));
        }
        Ok(Selection(name.into()))
    }
}

/// What a least-used member's count becomes when it is restored.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OnRestore {
    /// Resume with the old count.
    #[default]
    Keep,
    /// Start at the pool's current minimum among eligible members, so it is not flooded.
    Min,
}

/// One member of a pool (SPEC §7): an origin server (`url:`), a forward proxy the client's
/// target is reached through (`proxy:`), or the client's target itself (`direct: true`).
///
/// `url` is the member's identity and address whatever its kind, so that logs, metrics,
/// `/status`, health and the least-used store need not care: the origin's URL, the proxy's URL
/// without its credentials, or `direct` (no address: the target is the client's).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(try_from = "RawMember")]
pub struct MemberConfig {
    /// Where to connect, for origins and proxies (for a proxy, without its credentials).
    pub url: MemberUrl,
    /// The member's identity in logs, metrics, `/status` and the least-used pool (SPEC §8):
    /// `name` when given, else the URL (without credentials), else `direct`.
    pub name: Arc<str>,
    /// Whether `name` was written, rather than taken from the URL.
    pub named: bool,
    /// What the member is.
    pub kind: MemberKind,
    /// Round-robin weight (1 when absent); round_robin only.
    pub weight: Option<NonZeroU32>,
    /// Headers set on every request sent to this member, replacing the client's: an API key
    /// per member turns a pool into a pool of keys.
    pub headers: MemberHeaders,
    /// The member's own windows: the provider's limits on this key or proxy.
    pub quota: Option<MemberQuota>,
}

/// `members[].headers`: set on every request to the member. Values are secrets: marked
/// sensitive, and shown nowhere (`Debug` and `/status` list the names only).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct MemberHeaders(pub Vec<(http::HeaderName, http::HeaderValue)>);

impl std::fmt::Debug for MemberHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(n, _)| n))
            .finish()
    }
}

/// Headers a member's `headers` may not set: they belong to the connection or to the message
/// framing, which sluice and Pingora own; changing them per member would desynchronize the
/// request from its body, or break the hop.
const RESERVED_HEADERS: &[&str] = &[
    "connection",
    "content-length",
    "host",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

impl<'de> Deserialize<'de> for MemberHeaders {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = indexmap_like(d)?;
        let mut out: Vec<(http::HeaderName, http::HeaderValue)> = Vec::with_capacity(raw.len());
        for (name, value) in raw {
            let header = http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| de::Error::custom(format!("invalid header name {name:?}")))?;
            if RESERVED_HEADERS.contains(&header.as_str()) {
                return Err(de::Error::custom(format!(
                    "header {name:?} cannot be set per member: it belongs to the connection or the message framing"
                )));
            }
            if out.iter().any(|(n, _)| *n == header) {
                return Err(de::Error::custom(format!("header {name:?} is given twice")));
            }
            // The value is a secret: the message says what is wrong with it, never what it is.
            let mut value = http::HeaderValue::from_str(&value).map_err(|_| {
                de::Error::custom(format!(
                    "the value of header {name:?} is not a valid header value (control characters or non-ASCII bytes)"
                ))
            })?;
            value.set_sensitive(true);
            out.push((header, value));
        }
        Ok(MemberHeaders(out))
    }
}

/// A mapping of strings in document order (serde_yaml's `Mapping` keeps it), with every value
/// read as a string: `X-Retries: 3` is the header value "3".
fn indexmap_like<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, String)>, D::Error> {
    let map = serde_yaml::Mapping::deserialize(d)?;
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let scalar = |v: serde_yaml::Value| -> Option<String> {
            match v {
                serde_yaml::Value::String(s) => Some(s),
                serde_yaml::Value::Number(n) => Some(n.to_string()),
                serde_yaml::Value::Bool(b) => Some(b.to_string()),
                _ => None,
            }
        };
        let Some(name) = scalar(k) else {
            return Err(de::Error::custom("a header name must be a string"));
        };
        let Some(value) = scalar(v) else {
            return Err(de::Error::custom(format!(
                "the value of header {name:?} must be a string"
            )));
        };
        out.push((name, value));
    }
    Ok(out)
}

/// `members[].quota`: the member's own windows, shared by every instance like a route's.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MemberQuota {
    /// Every window must admit a request sent to this member.
    pub windows: Vec<WindowConfig>,
}

/// `upstream.cooldown`: what a member's own answers teach (SPEC §8).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CooldownConfig {
    /// Statuses that cool the member down.
    #[serde(default = "default_on_status")]
    pub on_status: Vec<u16>,
    /// The cooldown when the answer says nothing about when to come back.
    #[serde(default = "default_member_cooldown")]
    pub default: Dur,
    /// The most an answer may ask for.
    #[serde(default = "default_cooldown_max")]
    pub max: Dur,
    /// Send a request answered with one of `on_status` once more, to another member.
    #[serde(default)]
    pub retry: bool,
}

fn default_on_status() -> Vec<u16> {
    vec![429]
}
fn default_member_cooldown() -> Dur {
    Dur(Duration::from_secs(30))
}
fn default_cooldown_max() -> Dur {
    Dur(Duration::from_secs(15 * 60))
}

/// What a member is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberKind {
    /// An origin server: requests and tunnels go to its host and port.
    Origin,
    /// A forward proxy: plain HTTP goes to it in absolute form, tunnels as `CONNECT`.
    Proxy {
        /// `Proxy-Authorization: Basic …` from the URL's credentials, marked sensitive (its
        /// `Debug` does not show it).
        authorization: Option<http::HeaderValue>,
    },
    /// The client's own target.
    Direct,
}

impl MemberKind {
    /// Whether the member is the server the request names (proxy and direct), rather than an
    /// origin that stands in for it.
    pub fn reaches_target(&self) -> bool {
        !matches!(self, MemberKind::Origin)
    }
}

/// A member as written: exactly one of `url`, `proxy` and `direct: true`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMember {
    #[serde(default)]
    url: Option<MemberUrl>,
    #[serde(default)]
    proxy: Option<ProxyUrl>,
    #[serde(default)]
    direct: Option<bool>,
    #[serde(default)]
    weight: Option<NonZeroU32>,
    #[serde(default)]
    name: Option<MemberName>,
    #[serde(default)]
    headers: MemberHeaders,
    #[serde(default)]
    quota: Option<MemberQuota>,
}

/// An explicit member name: it goes into log lines, metric labels and Redis keys, so it is a
/// short token.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MemberName(String);

impl<'de> Deserialize<'de> for MemberName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let ok = !s.is_empty()
            && s.len() <= 128
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'));
        if ok {
            Ok(MemberName(s))
        } else {
            Err(de::Error::custom(format!(
                "invalid member name {s:?}: use 1 to 128 of A-Z a-z 0-9 _ - . :"
            )))
        }
    }
}

impl TryFrom<RawMember> for MemberConfig {
    type Error = String;
    fn try_from(raw: RawMember) -> Result<Self, String> {
        let direct = raw.direct == Some(true);
        let (url, kind) = match (raw.url, raw.proxy, direct) {
            (Some(url), None, false) => (url, MemberKind::Origin),
            (None, Some(p), false) => (
                p.url,
                MemberKind::Proxy {
                    authorization: p.authorization,
                },
            ),
            (None, None, true) => (MemberUrl::direct(), MemberKind::Direct),
            (None, None, false) if raw.direct == Some(false) => {
                return Err("direct: false is not a member; give url, proxy or direct: true".into())
            }
            (None, None, false) => {
                return Err("a member needs one of url, proxy or direct: true".into())
            }
            _ => return Err("a member is one of url, proxy or direct: true, not several".into()),
        };
        let named = raw.name.is_some();
        let name: Arc<str> = match raw.name {
            Some(MemberName(n)) => n.into(),
            None => url.url.as_str().into(),
        };
        Ok(MemberConfig {
            url,
            name,
            named,
            kind,
            weight: raw.weight,
            headers: raw.headers,
            quota: raw.quota,
        })
    }
}

impl MemberConfig {
    /// The round-robin weight.
    pub fn weight(&self) -> u32 {
        self.weight.map_or(1, NonZeroU32::get)
    }
}

fn one() -> NonZeroU32 {
    NonZeroU32::MIN
}

/// `health_check:` — active checks.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckConfig {
    /// tcp: a connection opens; http: a GET of `path` answers 2xx; connect (proxy members): a
    /// `CONNECT target` answers 2xx.
    pub kind: CheckKind,
    /// Path for http checks.
    #[serde(default)]
    pub path: Option<PathPrefix>,
    /// `host:port` that connect checks ask the proxy for a tunnel to.
    #[serde(default)]
    pub target: Option<String>,
    /// Time between probes.
    #[serde(default = "default_interval")]
    pub interval: Dur,
    /// A slower probe fails.
    #[serde(default = "default_check_timeout")]
    pub timeout: Dur,
    /// Consecutive successes to mark a member up.
    #[serde(default = "default_rise")]
    pub rise: NonZeroU32,
    /// Consecutive failures to mark it down.
    #[serde(default = "default_fall")]
    pub fall: NonZeroU32,
}

fn default_interval() -> Dur {
    Dur(Duration::from_secs(2))
}
fn default_check_timeout() -> Dur {
    Dur(Duration::from_secs(1))
}
fn default_rise() -> NonZeroU32 {
    NonZeroU32::new(2).unwrap()
}
fn default_fall() -> NonZeroU32 {
    NonZeroU32::new(3).unwrap()
}

/// Kind of active check.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum CheckKind {
    /// A TCP connection opens.
    Tcp,
    /// An HTTP GET answers 2xx.
    Http,
    /// A forward proxy answers `CONNECT target` with 2xx.
    Connect,
}

/// `passive:` — ejection on live traffic.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PassiveConfig {
    /// Consecutive connect failures that mark a member down.
    #[serde(default = "one")]
    pub fall: NonZeroU32,
    /// Without active checks: time until a down member gets one trial request.
    #[serde(default = "default_cooldown")]
    pub cooldown: Dur,
}

fn default_cooldown() -> Dur {
    Dur(Duration::from_secs(10))
}

impl Default for PassiveConfig {
    fn default() -> Self {
        PassiveConfig {
            fall: one(),
            cooldown: default_cooldown(),
        }
    }
}

/// A positive duration written as `250ms`, `5s`, `1m`, `1h` or `1d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let parsed = humantime::parse_duration(s.trim()).map_err(|e| {
            de::Error::custom(format!(
                "invalid duration {s:?}: {e}; write it like 250ms, 5s, 1m, 1h or 1d"
            ))
        })?;
        if parsed.is_zero() {
            return Err(de::Error::custom(format!(
                "invalid duration {s:?}: it must be greater than zero"
            )));
        }
        Ok(Dur(parsed))
    }
}

/// `egress:` — the guard on destinations the client chooses (SPEC §7), made ready to use by
/// the gateway's `egress::Guard::from`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EgressConfig {
    /// What is denied: `private` (the non-global classes) and CIDRs; `[]` turns the address
    /// checks off.
    #[serde(default = "default_deny")]
    pub deny: Vec<DenyEntry>,
    /// Exceptions to `deny`: an address in one of these is allowed, whatever `deny` says.
    #[serde(default)]
    pub allow_cidrs: Vec<Cidr>,
    /// The ports a CONNECT may target; `[]` refuses every CONNECT.
    #[serde(default = "default_connect_ports")]
    pub connect_ports: Vec<NonZeroU16>,
}

fn default_deny() -> Vec<DenyEntry> {
    vec![DenyEntry::Private]
}

/// 443, and 80: Node's fetch, got with hpagent and Python's websockets open a CONNECT for
/// `http://` and `ws://` targets too.
fn default_connect_ports() -> Vec<NonZeroU16> {
    vec![NonZeroU16::new(443).unwrap(), NonZeroU16::new(80).unwrap()]
}

impl Default for EgressConfig {
    fn default() -> Self {
        EgressConfig {
            deny: default_deny(),
            allow_cidrs: Vec::new(),
            connect_ports: default_connect_ports(),
        }
    }
}

/// `log:` — what access lines carry. Read at start: a change takes a restart.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// Log the query string, with the values of secret-looking parameters redacted
    /// (docs/operations.md, "Access log"). Off: the path alone.
    #[serde(default)]
    pub query: bool,
}

/// `tracing:` — span export. Read at start: a change takes a restart.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// Export one span per request over OTLP/HTTP; absent: no export.
    #[serde(default)]
    pub otlp: Option<OtlpConfig>,
}

/// `tracing.otlp:` — where spans go, and how many.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OtlpConfig {
    /// The receiver's base URL, `http://host:port` (OTLP/HTTP, protobuf); spans are POSTed to
    /// `<endpoint>/v1/traces`.
    pub endpoint: String,
    /// The share of new traces (requests without a sampled `traceparent`) exported, 0 to 1. A
    /// request with a valid `traceparent` follows its sampled flag.
    #[serde(default = "default_sample_ratio")]
    pub sample_ratio: f64,
    /// Spans held for export at most; past it new spans are dropped, never waited for.
    #[serde(default = "default_max_queue")]
    pub max_queue: NonZeroU32,
    /// `service.name` of the spans.
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

fn default_sample_ratio() -> f64 {
    1.0
}
fn default_max_queue() -> NonZeroU32 {
    NonZeroU32::new(2048).unwrap()
}
fn default_service_name() -> String {
    "sluice".into()
}

/// `dns:` — the name servers sluice asks for member host names and for the destinations
/// clients choose (SPEC §7). Read at start: a change takes a restart.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DnsConfig {
    /// Name servers asked instead of `/etc/resolv.conf`'s, in order (UDP, TCP for truncated
    /// answers); `/etc/hosts` still applies. Empty: the system's resolver.
    #[serde(default)]
    pub servers: Vec<NameServer>,
}

/// One name server of `dns.servers`: `IP:PORT`, `[IPv6]:PORT`, or an IP alone for port 53.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameServer(pub SocketAddr);

impl NameServer {
    fn parse(s: &str) -> Result<NameServer, String> {
        let s = s.trim();
        let addr = match s.parse::<SocketAddr>() {
            Ok(addr) => addr,
            Err(_) => match s.parse::<std::net::IpAddr>() {
                Ok(ip) => SocketAddr::new(ip, 53),
                Err(_) => {
                    return Err(format!(
                        "invalid name server {s:?}: expected IP:PORT such as 127.0.0.1:5353 or [::1]:53, or an IP for port 53"
                    ))
                }
            },
        };
        if addr.port() == 0 {
            return Err(format!("invalid name server {s:?}: port 0"));
        }
        if addr.ip().is_unspecified() || addr.ip().is_multicast() {
            return Err(format!(
                "invalid name server {s:?}: {} is not an address a query can be sent to",
                addr.ip()
            ));
        }
        Ok(NameServer(addr))
    }
}

impl<'de> Deserialize<'de> for NameServer {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        NameServer::parse(&String::deserialize(d)?).map_err(de::Error::custom)
    }
}

/// One entry of `egress.deny`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenyEntry {
    /// `private`: every address that is not globally reachable (see the gateway's `egress`).
    Private,
    /// A CIDR such as `198.51.100.0/24`, or a single address.
    Cidr(Cidr),
}

impl<'de> Deserialize<'de> for DenyEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "private" {
            return Ok(DenyEntry::Private);
        }
        if !s.contains(['.', ':']) {
            return Err(de::Error::custom(format!(
                "invalid deny entry {s:?}: expected private, a CIDR such as 198.51.100.0/24, or an IP address"
            )));
        }
        Cidr::parse(&s)
            .map(DenyEntry::Cidr)
            .map_err(de::Error::custom)
    }
}

/// A CIDR (`10.20.0.0/16`, `fd00::/8`), or a single address standing for itself (`/32`,
/// `/128`). Host bits after the prefix are refused: `10.0.0.1/8` is more likely a typo than a
/// way to write `10.0.0.0/8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr(pub ipnet::IpNet);

impl Cidr {
    fn parse(s: &str) -> Result<Cidr, String> {
        let net = match s.parse::<ipnet::IpNet>() {
            Ok(net) => net,
            Err(_) => match s.parse::<std::net::IpAddr>() {
                Ok(ip) => ipnet::IpNet::from(ip),
                Err(_) => {
                    return Err(format!(
                        "invalid CIDR {s:?}: expected ADDRESS/PREFIX such as 10.20.0.0/16 or fd00::/8, or one address"
                    ))
                }
            },
        };
        if net.addr() != net.network() {
            return Err(format!(
                "invalid CIDR {s:?}: bits are set after the /{} prefix; did you mean {}?",
                net.prefix_len(),
                net.trunc()
            ));
        }
        Ok(Cidr(net))
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Cidr::parse(&String::deserialize(d)?).map_err(de::Error::custom)
    }
}
