//! The serde types of one route: `match`, `upstream` and its members, health checks, `quota`
//! and cooldowns. Like the rest of the schema, each field type checks itself while it is
//! parsed, so a bad value is reported at its own line and column.

use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::{CalendarPeriod, Dur, TimeZoneName, UsageConfig, WindowSpan, WindowUnit};
use crate::urls::{MemberUrl, ProxyUrl};

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
    /// Gateway form: the request header whose token identifies the client (`Bearer <token>`
    /// or the bare token), lowercased. It is removed before the request goes on, whether or
    /// not it identified anyone.
    #[serde(default, deserialize_with = "client_token_header")]
    pub client_token: Option<http::HeaderName>,
    /// The routes a request goes on to, in order, when this one cannot serve it.
    #[serde(default)]
    pub fallback: Vec<super::FallbackConfig>,
    /// The most requests in flight on the route at once, across every instance (leases).
    #[serde(default)]
    pub max_in_flight: Option<NonZeroU64>,
    /// How many sub-logs the route's state is split into on Redis, each under a hash tag of its
    /// own (on a Redis Cluster, spread over the masters) with its share of every limit; 1 (the
    /// default) keeps the one log and the keys of a route without it. The memory store keeps
    /// one log whatever it says.
    #[serde(default = "one_shard")]
    pub state_shards: NonZeroU32,
    /// Which sub-log a request tries first (with `state_shards` above 1): the next in turn, or
    /// the instance's own (`state.redis.instance_index` modulo `state_shards`), so that an
    /// instance's requests share one batch lane while that sub-log has room.
    #[serde(default)]
    pub state_shards_start: ShardsStart,
}

/// `state_shards_start`: the sub-log a request of a route kept as sub-logs tries first. The
/// others follow in turn either way, so it decides where calls go, never what is admitted.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ShardsStart {
    /// Each instance takes the sub-logs in turn.
    #[default]
    RoundRobin,
    /// Every request of an instance starts at the instance's own sub-log.
    Home,
}

fn one_shard() -> NonZeroU32 {
    NonZeroU32::MIN
}

/// `client_token`: a header name a client may carry its token in. Not one that sluice or
/// Pingora owns (the connection, the framing, `Host`), and not `Proxy-Authorization`, which
/// identifies clients in any case.
fn client_token_header<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<http::HeaderName>, D::Error> {
    let name = String::deserialize(d)?;
    let header = http::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| de::Error::custom(format!("invalid header name {name:?}")))?;
    if RESERVED_HEADERS.contains(&header.as_str()) || header == http::header::PROXY_AUTHORIZATION {
        return Err(de::Error::custom(format!(
            "{name:?} cannot carry a client token: it belongs to the connection or the message framing, or (proxy-authorization) identifies clients already"
        )));
    }
    Ok(Some(header))
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
    /// The units that windows may count in besides requests, and how their amounts are read.
    #[serde(default)]
    pub usage: Option<UsageConfig>,
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
    /// One quota per identified client (`clients`), which a header cannot spoof.
    Client,
}

impl<'de> Deserialize<'de> for QuotaKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "route" => Ok(QuotaKey::Route),
            "client_ip" => Ok(QuotaKey::ClientIp),
            "client" => Ok(QuotaKey::Client),
            _ => match s.strip_prefix("header:") {
                Some("") => Err(de::Error::custom(
                    "quota key \"header:\" needs a header name, e.g. header:X-Tenant",
                )),
                Some(name) => http::HeaderName::from_bytes(name.as_bytes())
                    .map(|h| QuotaKey::Header(h.as_str().to_string()))
                    .map_err(|_| de::Error::custom(format!("invalid header name {name:?}"))),
                None => Err(de::Error::custom(format!(
                    "invalid quota key {s:?}: expected route, header:<Name>, client_ip or client"
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
    /// Units admitted in any interval of length `window`, or in each calendar period.
    pub limit: NonZeroU64,
    /// The window's length, or its calendar period.
    pub window: WindowSpan,
    /// What the window counts: requests (charged by `cost`), or a unit of the route's
    /// `quota.usage`.
    #[serde(default)]
    pub unit: WindowUnit,
    /// The time zone of a calendar window's boundaries; UTC when absent.
    #[serde(default)]
    pub tz: Option<TimeZoneName>,
}

impl WindowConfig {
    /// A calendar window's period and time zone (UTC unless `tz` says otherwise).
    pub fn calendar(&self) -> Option<(CalendarPeriod, TimeZoneName)> {
        match self.window {
            WindowSpan::Calendar(p) => Some((p, self.tz.clone().unwrap_or_else(TimeZoneName::utc))),
            WindowSpan::Sliding(_) => None,
        }
    }
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
        HostPattern::parse(&String::deserialize(d)?).map_err(de::Error::custom)
    }
}

impl HostPattern {
    /// `s` as a host pattern: `*`, `*.domain`, a DNS name or an IP address, without a port.
    pub(crate) fn parse(s: &str) -> Result<HostPattern, String> {
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
                Err(format!("invalid wildcard host {s:?}"))
            }
        } else if let Some(v6) = ipv6(&lower) {
            // One spelling for every way of writing the address, the one the router looks up.
            Ok(HostPattern::Exact(v6.to_string()))
        } else if lower.contains(':') {
            Err(format!(
                "invalid host {s:?}: give the host without a port; ports are ignored when matching"
            ))
        } else if valid_name(&lower) {
            Ok(HostPattern::Exact(lower))
        } else {
            Err(format!(
                "invalid host {s:?}: expected a DNS name, an IP address, \"*.domain\" or \"*\""
            ))
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
    /// How long a request's lease on its member lives unless renewed: what a lease of an
    /// instance that died keeps counting for.
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl: Dur,
    /// The most requests in flight on one member at once, across every instance (leases).
    #[serde(default)]
    pub max_in_flight: Option<NonZeroU64>,
    /// Requests of one session go to one member (bindings shared in the store).
    #[serde(default)]
    pub sticky: Option<super::StickyConfig>,
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
fn default_lease_ttl() -> Dur {
    Dur(Duration::from_secs(30))
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
