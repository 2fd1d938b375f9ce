//! The serde types of `clients:` (who is calling, and what they may use) and of a TLS
//! listener's client certificates. Like the rest of the schema, each field type checks itself
//! while it is parsed; the rules across clients and routes are in `validate`.
//!
//! Tokens are secrets: no message and no `Debug` output of this file shows one.

use std::num::{NonZeroU16, NonZeroU32, NonZeroU64, NonZeroUsize};
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::{Cidr, Dur, HostPattern, RouteName, WindowConfig};

/// The client an unidentified caller becomes under `unknown: anonymous`, and what every caller
/// is without a `clients` section.
pub const ANONYMOUS: &str = "anonymous";
/// The name logs and metrics give a caller no client matched; no client may take it.
pub const UNKNOWN: &str = "unknown";

/// The shortest token: shorter ones can be guessed, since anyone who reaches the port may try.
pub const MIN_TOKEN_BYTES: usize = 16;

/// `clients:` — who may call, and what each caller may use. Absent, every caller is
/// anonymous and may use every route, as before.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClientsConfig {
    /// Refuse what is not granted, or only report it.
    #[serde(default)]
    pub mode: ClientsMode,
    /// What an unidentified caller is.
    #[serde(default)]
    pub unknown: UnknownClients,
    /// Load balancers whose PROXY protocol header or `X-Forwarded-For` names the client.
    #[serde(default)]
    pub trusted_proxies: Vec<Cidr>,
    /// The bound on failed identifications from one address.
    #[serde(default)]
    pub failed_auth: FailedAuthConfig,
    /// The clients.
    #[serde(default)]
    pub list: Vec<ClientConfig>,
}

/// `clients.mode`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ClientsMode {
    /// Refuse what a client is not granted.
    #[default]
    Enforce,
    /// Log and count what `enforce` would refuse, and let the request go on: for turning
    /// clients on in a running deployment.
    Report,
}

/// `clients.unknown`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum UnknownClients {
    /// An unidentified caller gets 407 (proxy form, CONNECT) or 401 (gateway form).
    #[default]
    Deny,
    /// An unidentified caller is the client named `anonymous`, with that client's grants.
    Anonymous,
}

/// `clients.failed_auth` — failed identifications from one address (one IPv6 /64) past which
/// it gets `429 auth_throttled`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FailedAuthConfig {
    /// Failures within `window` that throttle the address.
    #[serde(default = "default_failed_limit")]
    pub limit: NonZeroU32,
    /// The window failures are counted in.
    #[serde(default = "default_failed_window")]
    pub window: Dur,
    /// How long a throttled address stays throttled.
    #[serde(default = "default_failed_cooldown")]
    pub cooldown: Dur,
    /// The most addresses the table keeps, so that a spray of sources cannot grow it.
    #[serde(default = "default_max_sources")]
    pub max_sources: NonZeroUsize,
}

fn default_failed_limit() -> NonZeroU32 {
    NonZeroU32::new(20).unwrap_or(NonZeroU32::MIN)
}
fn default_failed_window() -> Dur {
    Dur(Duration::from_secs(60))
}
fn default_failed_cooldown() -> Dur {
    Dur(Duration::from_secs(300))
}
fn default_max_sources() -> NonZeroUsize {
    NonZeroUsize::new(65_536).unwrap_or(NonZeroUsize::MIN)
}

impl Default for FailedAuthConfig {
    fn default() -> Self {
        FailedAuthConfig {
            limit: default_failed_limit(),
            window: default_failed_window(),
            cooldown: default_failed_cooldown(),
            max_sources: default_max_sources(),
        }
    }
}

/// One client of `clients.list`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    /// Unique; in logs (`client_name`), metrics and store keys.
    pub name: ClientName,
    /// Tokens it presents: `Proxy-Authorization` Basic (`name:token`) or Bearer, or the
    /// route's `client_token` header.
    #[serde(default)]
    pub tokens: Vec<ClientToken>,
    /// Names its verified client certificate carries (URI or DNS SAN).
    #[serde(default)]
    pub certs: Vec<CertName>,
    /// Where it connects from: alone, they identify it; with tokens or certs, a further
    /// condition.
    #[serde(default)]
    pub cidrs: Vec<Cidr>,
    /// The routes it may use; `*` for all. None by default.
    #[serde(default)]
    pub routes: Vec<RouteGrant>,
    /// On `direct` and `proxy` routes, the targets it may reach. None by default.
    #[serde(default)]
    pub destinations: Vec<Destination>,
    /// Its own windows, on every route it uses.
    #[serde(default)]
    pub quota: Option<ClientQuota>,
    /// The most requests it may have in flight, across every route and instance (a lease per
    /// request, as a route's `max_in_flight`).
    #[serde(default)]
    pub max_in_flight: Option<NonZeroU64>,
}

impl ClientConfig {
    /// Whether only its address identifies it (`cidrs`, and neither tokens nor certs).
    pub fn address_only(&self) -> bool {
        self.tokens.is_empty() && self.certs.is_empty() && !self.cidrs.is_empty()
    }
}

/// `clients.list[].quota`: the client's own windows, shared by every instance.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClientQuota {
    /// Every window must admit a request of this client, on whatever route.
    pub windows: Vec<WindowConfig>,
}

/// A client name: 1 to 64 of `[A-Za-z0-9_.-]`, since it goes into log lines, metric labels
/// and store keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClientName(pub String);

impl<'de> Deserialize<'de> for ClientName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        if ok {
            Ok(ClientName(s))
        } else {
            Err(de::Error::custom(format!(
                "invalid client name {s:?}: use 1 to 64 of A-Z a-z 0-9 _ - ."
            )))
        }
    }
}

/// A client's token. A secret: its `Debug` hides it, and no message quotes it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientToken(pub String);

impl std::fmt::Debug for ClientToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientToken(<redacted>)")
    }
}

impl<'de> Deserialize<'de> for ClientToken {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // serde's own messages quote a scalar of the wrong type ("invalid type: integer
        // `1234…`"); this visitor answers every kind without showing the value.
        struct Visit;
        const NOT_A_STRING: &str =
            "a token must be a string; put it between quotes (its value is not shown)";
        impl de::Visitor<'_> for Visit {
            type Value = ClientToken;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a token (a string of at least 16 bytes)")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ClientToken, E> {
                if s.len() < MIN_TOKEN_BYTES {
                    return Err(E::custom(format!(
                        "a token must be at least {MIN_TOKEN_BYTES} bytes long, and this one has {}; a short token can be guessed (its value is not shown)",
                        s.len()
                    )));
                }
                if s.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
                    return Err(E::custom(
                        "a token must be printable ASCII without spaces, since clients send it in a header (its value is not shown)",
                    ));
                }
                Ok(ClientToken(s.to_string()))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<ClientToken, E> {
                Err(E::custom(NOT_A_STRING))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<ClientToken, E> {
                Err(E::custom(NOT_A_STRING))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<ClientToken, E> {
                Err(E::custom(NOT_A_STRING))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<ClientToken, E> {
                Err(E::custom(NOT_A_STRING))
            }
            fn visit_unit<E: de::Error>(self) -> Result<ClientToken, E> {
                Err(E::custom("a token must not be empty"))
            }
        }
        d.deserialize_any(Visit)
    }
}

/// A name a client certificate carries: a URI SAN (`spiffe://corp.example/ns/billing/sa/api`)
/// or a DNS SAN (`billing.corp.example`, lowercased, as DNS names compare without case).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CertName(pub String);

impl<'de> Deserialize<'de> for CertName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() || s.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(de::Error::custom(format!(
                "invalid certificate name {s:?}: expected a URI SAN such as spiffe://corp.example/ns/a/sa/b, or a DNS name"
            )));
        }
        if s.contains("://") {
            Ok(CertName(s))
        } else {
            Ok(CertName(s.to_ascii_lowercase()))
        }
    }
}

/// One entry of a client's `routes`: a route name, or `*` for every route.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RouteGrant {
    /// `*`: every route.
    All,
    /// The route of that name.
    Route(RouteName),
}

impl<'de> Deserialize<'de> for RouteGrant {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "*" {
            return Ok(RouteGrant::All);
        }
        let valid = !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if valid {
            Ok(RouteGrant::Route(RouteName(s)))
        } else {
            Err(de::Error::custom(format!(
                "invalid route {s:?}: a route name, or \"*\" for every route"
            )))
        }
    }
}

/// One entry of a client's `destinations`: a host pattern (`api.github.com`, `*.stripe.com`,
/// `*`), with or without a port (`api.github.com:443`, `[2001:db8::1]:443`). Without a port,
/// any port the route and `egress.connect_ports` allow.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Destination {
    /// The host, as a route's `match.hosts` writes it.
    pub host: HostPattern,
    /// The only port allowed, when given.
    pub port: Option<NonZeroU16>,
}

impl Destination {
    fn parse(s: &str) -> Result<Destination, String> {
        let bad_port = || format!("invalid destination {s:?}: the port must be 1 to 65535");
        // `[v6]:port`, `host:port`; a bare IPv6 address has colons but no port.
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            match rest.split_once("]:") {
                Some((v6, port)) => (format!("[{v6}]"), Some(port)),
                None => (s.to_string(), None),
            }
        } else {
            match s.rsplit_once(':') {
                Some((host, port)) if !host.contains(':') => (host.to_string(), Some(port)),
                _ => (s.to_string(), None),
            }
        };
        let port = match port {
            None => None,
            Some(p) => Some(p.parse::<NonZeroU16>().map_err(|_| bad_port())?),
        };
        let host = HostPattern::parse(&host).map_err(|why| {
            why.replace(
                "give the host without a port; ports are ignored when matching",
                "write host:port, or the host alone for any port",
            )
        })?;
        Ok(Destination { host, port })
    }
}

impl<'de> Deserialize<'de> for Destination {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Destination::parse(&String::deserialize(d)?).map_err(de::Error::custom)
    }
}

/// `listen[].tls.client_cert`: what a TLS listener with `client_ca` asks of clients.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ClientCertMode {
    /// Every client presents a certificate that `client_ca` signed, or the handshake fails.
    #[default]
    Required,
    /// A client may present none, and is then identified in other ways; a certificate that
    /// fails verification still ends the handshake (rustls cannot fall back).
    Optional,
}
