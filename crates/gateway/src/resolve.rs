//! Name resolution for the process: the system's name servers (or those of `dns.servers`) and
//! `/etc/hosts`, A and AAAA together, cached as the records' TTLs say.
//!
//! Two callers with different trust: member DNS ([`crate::dns`]) resolves the names the operator
//! wrote, with [`Resolver::lookup`]; the egress guard resolves the names a client chose, with
//! `Resolver::resolve_checked` (in [`crate::egress`]), which refuses a name if any of its
//! addresses is denied. This module knows neither; it only turns names into addresses.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::{Hosts, TokioResolver};

/// The addresses of a name, and until when they hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    /// Every address, A and AAAA records together, each once, in the resolver's order.
    pub addrs: Vec<IpAddr>,
    /// When the shortest TTL among the records runs out: ask again after this. `None` for an
    /// IP literal, which never changes.
    pub valid_until: Option<Instant>,
}

/// A name that could not be turned into addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupError {
    /// The name exists in no form, or has no A or AAAA records.
    NoAddresses {
        /// The name.
        host: String,
    },
    /// The lookup failed: no name server answered, a timeout, a malformed name...
    Failed {
        /// The name.
        host: String,
        /// The resolver's message.
        message: String,
    },
}

impl fmt::Display for LookupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LookupError::NoAddresses { host } => write!(f, "{host} has no IP address"),
            LookupError::Failed { host, message } => {
                write!(f, "cannot resolve {host}: {message}")
            }
        }
    }
}

impl std::error::Error for LookupError {}

/// The resolver: the system's name servers and `/etc/hosts`, A and AAAA together,
/// with a cache that keeps each answer for its records' TTL. Cheap to clone (one cache); make
/// one per process so the cache outlives config reloads.
#[derive(Clone)]
pub struct Resolver {
    inner: Arc<TokioResolver>,
}

impl fmt::Debug for Resolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Resolver").finish_non_exhaustive()
    }
}

/// Entries the cache keeps; hickory's default, 32, is too few for a gateway.
const CACHE_SIZE: usize = 4096;

impl Resolver {
    /// The system's resolver: `/etc/resolv.conf` (name servers, search domains, timeouts) and
    /// `/etc/hosts`, both read once, here. Fails if `/etc/resolv.conf` cannot be read.
    pub fn from_system() -> Result<Resolver, String> {
        let mut builder = TokioResolver::builder_tokio()
            .map_err(|e| format!("cannot read the system resolver config: {e}"))?;
        tune(builder.options_mut());
        Ok(Resolver {
            inner: Arc::new(builder.build()),
        })
    }

    /// A resolver that asks `name_servers` (UDP, then TCP for truncated answers) and knows
    /// `hosts` (in `/etc/hosts` syntax) and `localhost` (RFC 6761); with no name server it
    /// knows only those. For tests, local resolver stubs, and hosts whose egress DNS is not
    /// the system's.
    pub fn new(name_servers: &[SocketAddr], hosts: &str) -> Resolver {
        let mut table = Hosts::default();
        // Reading from a string cannot fail; lines it cannot parse are skipped.
        let _ = table.read_hosts_conf(hosts.as_bytes());
        let servers: Vec<NameServerConfig> = name_servers
            .iter()
            .flat_map(|&addr| {
                [
                    NameServerConfig::new(addr, Protocol::Udp),
                    NameServerConfig::new(addr, Protocol::Tcp),
                ]
            })
            .collect();
        let mut builder = TokioResolver::builder_with_config(
            ResolverConfig::from_parts(None, Vec::new(), servers),
            TokioConnectionProvider::default(),
        );
        tune(builder.options_mut());
        builder.options_mut().use_hosts_file = ResolveHosts::Never;
        let mut resolver = builder.build();
        resolver.set_hosts(Arc::new(table));
        Resolver {
            inner: Arc::new(resolver),
        }
    }

    /// Every address of `host` (a name, or an IP literal with or without brackets, which is
    /// returned as is), and until when they hold. No guard here: member names, which the
    /// operator wrote, use this too, to be resolved again when `valid_until` passes.
    pub async fn lookup(&self, host: &str) -> Result<Lookup, LookupError> {
        if let Some(ip) = literal(host) {
            return Ok(Lookup {
                addrs: vec![ip],
                valid_until: None,
            });
        }
        let found = self.inner.lookup_ip(host).await.map_err(|e| {
            if e.is_no_records_found() || e.is_nx_domain() {
                LookupError::NoAddresses {
                    host: host.to_string(),
                }
            } else {
                LookupError::Failed {
                    host: host.to_string(),
                    message: e.to_string(),
                }
            }
        })?;
        let mut addrs = Vec::new();
        for ip in found.iter() {
            if !addrs.contains(&ip) {
                addrs.push(ip);
            }
        }
        if addrs.is_empty() {
            return Err(LookupError::NoAddresses {
                host: host.to_string(),
            });
        }
        Ok(Lookup {
            addrs,
            valid_until: Some(found.valid_until()),
        })
    }
}

/// The resolver options sluice needs on top of the system's.
fn tune(options: &mut ResolverOpts) {
    // Every address, so that every address is checked (the system default, IPv4 then IPv6,
    // would hide the AAAA records whenever there are A records).
    options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    options.cache_size = CACHE_SIZE;
    options.use_hosts_file = ResolveHosts::Always;
}

/// `host` as an IP address, if it is one: `10.0.0.1`, `::1` or `[::1]`.
pub(crate) fn literal(host: &str) -> Option<IpAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse().ok()
}
