//! The serde types of the YAML file (SPEC §2).
//!
//! Each field type checks itself while it is parsed, so a bad value is reported at its own line
//! and column rather than at the enclosing mapping.

use std::net::SocketAddr;
use std::num::{NonZeroU16, NonZeroU32, NonZeroUsize};
use std::path::PathBuf;
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use crate::urls::RedisUrl;

mod clients;
mod fallback;
mod route;
mod sticky;
mod usage;
pub use clients::*;
pub use fallback::*;
pub use route::*;
pub use sticky::*;
pub use usage::*;

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
#[serde(try_from = "RawListenTls")]
pub struct ListenTls {
    /// PEM certificate chain, the listener's own certificate first.
    pub cert: std::path::PathBuf,
    /// PEM private key of that certificate (PKCS#8, PKCS#1 or SEC1), unencrypted.
    pub key: std::path::PathBuf,
    /// PEM bundle of the CAs that sign client certificates; absent, none is asked for.
    pub client_ca: Option<std::path::PathBuf>,
    /// With `client_ca`: whether a client must present a certificate (the default) or may
    /// present none.
    pub client_cert: ClientCertMode,
}

/// `listen[].tls` as written: `client_cert` means nothing without `client_ca`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawListenTls {
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    #[serde(default)]
    client_ca: Option<std::path::PathBuf>,
    #[serde(default)]
    client_cert: Option<ClientCertMode>,
}

impl TryFrom<RawListenTls> for ListenTls {
    type Error = String;
    fn try_from(raw: RawListenTls) -> Result<ListenTls, String> {
        if raw.client_ca.is_none() && raw.client_cert.is_some() {
            return Err(
                "client_cert needs client_ca: the CA bundle client certificates are checked against"
                    .into(),
            );
        }
        Ok(ListenTls {
            cert: raw.cert,
            key: raw.key,
            client_ca: raw.client_ca,
            client_cert: raw.client_cert.unwrap_or_default(),
        })
    }
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
    /// Whether the requests of a route that wait for a Redis call together share one; `false`
    /// makes one call per request, for comparing latency and for debugging.
    #[serde(default = "default_batch")]
    pub batch: bool,
    /// This instance's index among the gateways sharing the Redis (0, 1, 2, … each its own):
    /// a route with `state_shards_start: home` starts its requests at sub-log `index mod
    /// state_shards`.
    #[serde(default)]
    pub instance_index: Option<u32>,
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

fn default_batch() -> bool {
    true
}

fn default_key_prefix() -> String {
    "sluice".into()
}
fn default_redis_timeout() -> Dur {
    Dur(Duration::from_millis(50))
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
