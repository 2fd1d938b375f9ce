//! Member addresses that follow DNS (SPEC §7): a member's host name is resolved when its table
//! is built, and again each time the answer's TTL runs out, so that its address is not fixed
//! at load.
//!
//! - [`PeerCell`] holds one member's current prebuilt [`HttpPeer`] behind an `ArcSwap`: a
//!   request loads and clones it (no lookup, no lock on the hot path), and a refresh swaps in a
//!   new one when the address changed.
//! - `crate::dns_refresh::DnsRefresher` is the one background service, per process, that walks the current table
//!   and resolves every named member whose answer expired. It reads the table afresh on every
//!   pass, so reloads need nothing from it; a reload keeps the cells of unchanged members (see
//!   `table.rs`), so their addresses and schedules carry over.
//! - [`process_resolver`] makes the process's one [`Resolver`], shared with the egress guard.
//!
//! Expiry is clamped to [`MIN_REFRESH`]..[`MAX_REFRESH`]: a zero TTL does not make sluice
//! resolve in a loop, and an answer from `/etc/hosts` is still looked at again now and then. A
//! lookup that fails keeps the last good address (warning at most once per
//! [`WARN_EVERY`] per member) and is tried again after [`RETRY_AFTER`]; a member that never
//! resolved stays a connect failure until a lookup succeeds. IP literals are never resolved.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use pingora::upstreams::peer::HttpPeer;

use crate::config::{DnsConfig, MemberUrl, UpstreamConfig};
use crate::resolve::Resolver;

/// The shortest time an answer is kept, whatever its TTL.
pub const MIN_REFRESH: Duration = Duration::from_secs(1);
/// The longest time an answer is kept, whatever its TTL.
pub const MAX_REFRESH: Duration = Duration::from_secs(300);
/// After a failed lookup, when to try again.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);
/// A member whose name keeps failing to resolve is warned about at most this often.
pub const WARN_EVERY: Duration = Duration::from_secs(60);
/// How often the refresher looks at the table when nothing is due sooner (a reload may have
/// brought members that are).
pub(crate) const IDLE_PASS: Duration = Duration::from_secs(1);

/// Name servers to use instead of those of `dns.servers` and of the system's, `ip:port`
/// separated by commas: it overrides the config, for tests and for a one-off run against
/// another resolver. `/etc/hosts` still applies.
pub const DNS_SERVERS_ENV: &str = "SLUICE_DNS_SERVERS";

/// The process's resolver: the name servers of [`DNS_SERVERS_ENV`] when it is set, else those
/// of `dns.servers`, else the system's (`/etc/resolv.conf`). Made once, at start.
pub fn process_resolver(config: &DnsConfig) -> Result<Resolver, String> {
    let servers = match std::env::var(DNS_SERVERS_ENV) {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<SocketAddr>()
                    .map_err(|e| format!("{DNS_SERVERS_ENV}: {s:?} is not an ip:port address: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?,
        _ => config.servers.iter().map(|s| s.0).collect(),
    };
    if servers.is_empty() {
        return Resolver::from_system();
    }
    let hosts = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
    Ok(Resolver::new(&servers, &hosts))
}

/// The peer settings that do not depend on the address.
#[derive(Debug, Clone, PartialEq)]
struct Template {
    tls: bool,
    sni: String,
    connect: Duration,
    read: Duration,
    write: Duration,
}

/// One member's address and prebuilt peer, refreshed as DNS says.
pub struct PeerCell {
    /// The member's URL without credentials, for logs.
    member: String,
    host: String,
    port: u16,
    /// Whether `host` is a name (an IP literal is never resolved).
    pub(crate) named: bool,
    template: Template,
    peer: ArcSwapOption<HttpPeer>,
    /// When to resolve again.
    due: Mutex<Instant>,
    /// A lookup is under way.
    pub(crate) busy: AtomicBool,
    /// When a failure was last warned about.
    warned: Mutex<Option<Instant>>,
}

impl PeerCell {
    /// A cell for `url` with `up`'s timeouts, not resolved yet (see [`PeerCell::refresh`]).
    pub fn new(url: &MemberUrl, up: &UpstreamConfig) -> PeerCell {
        let host = url
            .host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(&url.host);
        let literal = host.parse::<IpAddr>().ok();
        let cell = PeerCell {
            member: url.url.clone(),
            host: url.host.clone(),
            port: url.port,
            named: literal.is_none(),
            template: PeerCell::template_of(url, up),
            peer: ArcSwapOption::empty(),
            due: Mutex::new(Instant::now()),
            busy: AtomicBool::new(false),
            warned: Mutex::new(None),
        };
        if let Some(ip) = literal {
            cell.install(SocketAddr::new(ip, url.port));
        }
        cell
    }

    /// Whether this cell can stand for `url` under `up`: same place, same peer settings. A
    /// reload keeps such a cell, with its address and refresh schedule.
    pub fn fits(&self, url: &MemberUrl, up: &UpstreamConfig) -> bool {
        let other = PeerCell::template_of(url, up);
        self.member == url.url
            && self.host == url.host
            && self.port == url.port
            && self.template == other
    }

    fn template_of(url: &MemberUrl, up: &UpstreamConfig) -> Template {
        Template {
            tls: url.tls,
            sni: url.host.clone(),
            connect: up.connect_timeout.0,
            read: up.read_timeout.0,
            write: up.write_timeout.0,
        }
    }

    /// The current peer, ready to hand to Pingora; `None` while the host never resolved.
    pub fn peer(&self) -> Option<HttpPeer> {
        self.peer.load().as_deref().cloned()
    }

    /// The current peer in the box Pingora takes for each attempt; `None` while the host
    /// never resolved. The clone is written straight into the box: cloned on the stack, then
    /// boxed, the peer (several hundred bytes) was copied twice more on every request.
    pub fn boxed_peer(&self) -> Option<Box<HttpPeer>> {
        let current = self.peer.load();
        let peer = current.as_deref()?;
        Some(Box::write(Box::new_uninit(), peer.clone()))
    }

    /// The current address; `None` while the host never resolved.
    pub fn address(&self) -> Option<SocketAddr> {
        self.peer
            .load()
            .as_deref()
            .and_then(|p| p._address.as_inet().copied())
    }

    fn install(&self, addr: SocketAddr) {
        let t = &self.template;
        let peer = peer_with(addr, t.tls, t.sni.clone(), t.connect, t.read, t.write);
        self.peer.store(Some(Arc::new(peer)));
    }

    /// When the next lookup is due, if that is after `now`.
    pub(crate) fn not_due_until(&self, now: Instant) -> Option<Instant> {
        let due = *self.due.lock().unwrap_or_else(|p| p.into_inner());
        (due > now).then_some(due)
    }

    /// Resolves the host (a named one; literals return at once) and installs the answer.
    /// The address in use is kept while the answer still contains it, so that a name with many
    /// addresses does not make the member hop between them at every refresh.
    pub async fn refresh(&self, resolver: &Resolver) {
        if !self.named {
            return;
        }
        let next = match resolver.lookup(&self.host).await {
            Ok(found) => {
                let current = self.address();
                let addrs: Vec<SocketAddr> = found
                    .addrs
                    .iter()
                    .map(|&ip| SocketAddr::new(ip, self.port))
                    .collect();
                let keep = current.filter(|c| addrs.contains(c));
                if keep.is_none() {
                    if let Some(&new) = addrs.first() {
                        self.install(new);
                        match current {
                            Some(old) => {
                                tracing::info!(target: "sluice::dns", member = %self.member, old = %old, new = %new, "member address changed")
                            }
                            // A name that resolves at last is news; the first lookup of
                            // every member at load is not (ten thousand lines at start).
                            None if self
                                .warned
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .is_some() =>
                            {
                                tracing::info!(target: "sluice::dns", member = %self.member, address = %new, "member host resolves now")
                            }
                            None => {
                                tracing::debug!(target: "sluice::dns", member = %self.member, address = %new, "member host resolved")
                            }
                        }
                    }
                }
                *self.warned.lock().unwrap_or_else(|p| p.into_inner()) = None;
                let ttl = found
                    .valid_until
                    .map_or(MAX_REFRESH, |t| t.saturating_duration_since(Instant::now()));
                ttl.clamp(MIN_REFRESH, MAX_REFRESH)
            }
            Err(e) => {
                let now = Instant::now();
                let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
                if warned.is_none_or(|t| now.duration_since(t) >= WARN_EVERY) {
                    *warned = Some(now);
                    match self.address() {
                        Some(kept) => {
                            tracing::warn!(target: "sluice::dns", member = %self.member, error = %e, address = %kept, "member host does not resolve; keeping its last address")
                        }
                        None => {
                            tracing::warn!(target: "sluice::dns", member = %self.member, error = %e, "member host does not resolve")
                        }
                    }
                }
                RETRY_AFTER
            }
        };
        *self.due.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now() + next;
    }
}

/// How long an idle pooled connection to a member is kept.
const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A member's peer at `addr`, with the route's timeouts.
pub(crate) fn peer_with(
    addr: SocketAddr,
    tls: bool,
    sni: String,
    connect: Duration,
    read: Duration,
    write: Duration,
) -> HttpPeer {
    let mut peer = HttpPeer::new(addr, tls, sni);
    peer.options.connection_timeout = Some(connect);
    peer.options.total_connection_timeout = Some(connect);
    peer.options.read_timeout = Some(read);
    peer.options.write_timeout = Some(write);
    peer.options.idle_timeout = Some(UPSTREAM_IDLE_TIMEOUT);
    peer
}
