//! Clients (SPEC §9): who is calling, and what each caller may use.
//!
//! [`Clients`] is the `clients` section made ready to serve, built with every table, so it
//! reloads with the routes. A request or tunnel, once routed, is first identified
//! ([`Clients::identify`], in SPEC §9's order: a verified client certificate, then
//! `Proxy-Authorization`, then the route's `client_token` header, then the client's address
//! alone), then authorized on its route and target ([`Clients::authorize`]). The request path
//! (`request::authorize`) turns the outcome into the gateway's answer, or, in `report` mode,
//! into a log field and a count.
//!
//! Tokens are kept as SHA-256 digests only, and a presented token is hashed and compared with
//! every digest in constant time (`subtle`): neither the token's length nor the place of the
//! first differing byte changes the time taken, and the table holds no token to leak.
//!
//! A credential that is presented and fails is a failure ([`Identity::Failed`]): it is never
//! passed over for the address or `anonymous`, or a wrong token would be worth as much as none.

pub mod address;
pub mod throttle;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use http::{HeaderMap, HeaderName};
use ipnet::IpNet;
use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::config::{
    ClientConfig, ClientsConfig, ClientsMode, Destination, HostPattern, RouteGrant, UnknownClients,
    ANONYMOUS,
};
pub use throttle::Failure;

/// The longest credential header read. A longer one is malformed: no token is that long, and
/// decoding kilobytes of base64 for each request would be work anyone could ask for.
pub const MAX_CREDENTIAL_BYTES: usize = 4096;

/// One client, ready to serve.
#[derive(Debug)]
pub struct Client {
    /// Its name: `client_name` in the access log.
    pub name: Arc<str>,
    /// The client as configured (its own `quota` included); `Debug` hides its tokens.
    pub config: ClientConfig,
    /// Its own quota's windows as the store takes them (empty: none), built once per table:
    /// every request it makes is charged to them, on whatever route.
    pub windows: Arc<[sluice_limiter::Window]>,
    /// Per window of `windows`, its calendar when it is a fixed (calendar) window.
    pub calendars: Arc<[Option<sluice_limiter::calendar::Calendar>]>,
    /// Per window of `windows`, the usage unit it counts, or `None` for a window of requests.
    pub units: Arc<[Option<Arc<str>>]>,
    /// The routes it may use.
    routes: Grants,
    /// Where it must connect from, when it lists `cidrs` with tokens or certs.
    cidrs: Vec<IpNet>,
    /// `sluice_client_requests_total{client=<name>}`, its handles kept once used
    /// (`crate::metrics`).
    pub(crate) requests: std::sync::OnceLock<crate::request_counts::RouteRequests>,
}

/// A client's `routes`.
#[derive(Debug)]
enum Grants {
    /// `*`.
    All,
    /// These route names.
    Some(Vec<Arc<str>>),
}

/// A calendar window's periods (as `quota::calendar_of` cuts a route's), or `None` for a
/// sliding window.
fn calendar_of(w: &crate::config::WindowConfig) -> Option<sluice_limiter::calendar::Calendar> {
    use crate::config::CalendarPeriod;
    use sluice_limiter::calendar::{Calendar, Period};
    let (period, tz) = w.calendar()?;
    let period = match period {
        CalendarPeriod::Day => Period::Day,
        CalendarPeriod::Week => Period::Week,
        CalendarPeriod::Month => Period::Month,
    };
    Some(Calendar::new(period, tz.zone))
}

impl Client {
    /// Whether its windows are reserved rather than only counted: one counts a usage unit or
    /// a calendar period.
    pub(crate) fn reserves(&self) -> bool {
        self.calendars.iter().any(Option::is_some) || self.units.iter().any(Option::is_some)
    }

    fn new(config: &ClientConfig) -> Client {
        let routes = if config.routes.contains(&RouteGrant::All) {
            Grants::All
        } else {
            Grants::Some(
                config
                    .routes
                    .iter()
                    .filter_map(|g| match g {
                        RouteGrant::Route(r) => Some(r.0.as_str().into()),
                        RouteGrant::All => None,
                    })
                    .collect(),
            )
        };
        Client {
            name: config.name.0.as_str().into(),
            config: config.clone(),
            // As `quota::window_of` builds a route's; not called, so that this module stays
            // below `quota` (and the metrics it names) in the module graph.
            windows: config
                .quota
                .iter()
                .flat_map(|q| &q.windows)
                .map(|w| sluice_limiter::Window {
                    name: w.name.0.as_str().into(),
                    // A window in a usage unit holds millionths of it, as the amounts charged
                    // to it are.
                    limit: match w.unit {
                        crate::config::WindowUnit::Requests => w.limit.get(),
                        crate::config::WindowUnit::Named(_) => {
                            w.limit.get().saturating_mul(1_000_000)
                        }
                    },
                    // A calendar window's length is its current period's, set at each
                    // admission.
                    length_us: w.window.sliding().map_or(u64::MAX, |d| {
                        u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
                    }),
                })
                .collect(),
            calendars: config
                .quota
                .iter()
                .flat_map(|q| &q.windows)
                .map(calendar_of)
                .collect(),
            units: config
                .quota
                .iter()
                .flat_map(|q| &q.windows)
                .map(|w| match &w.unit {
                    crate::config::WindowUnit::Requests => None,
                    crate::config::WindowUnit::Named(name) => Some(Arc::from(&*name.0)),
                })
                .collect(),
            routes,
            cidrs: config.cidrs.iter().map(|c| c.0).collect(),
            requests: std::sync::OnceLock::new(),
        }
    }

    /// Whether the client may use the route named `route`.
    pub fn may_use(&self, route: &str) -> bool {
        match &self.routes {
            Grants::All => true,
            Grants::Some(names) => names.iter().any(|n| &**n == route),
        }
    }

    /// Whether the client may reach `host` (lowercase, IPv6 without brackets) on `port`, on a
    /// route whose members reach the client's target.
    pub fn may_reach(&self, host: &str, port: u16) -> bool {
        self.config
            .destinations
            .iter()
            .any(|d| destination_matches(d, host, port))
    }

    /// Whether `addr` is inside the client's `cidrs`, for a client that lists them. An
    /// IPv4-mapped IPv6 peer (a dual-stack listener) is the IPv4 address it maps, as for
    /// [`Clients::by_address`].
    fn connects_from(&self, addr: Option<IpAddr>) -> bool {
        self.cidrs.is_empty()
            || addr.is_some_and(|a| {
                let canonical = a.to_canonical();
                self.cidrs
                    .iter()
                    .any(|c| c.contains(&canonical) || c.contains(&a))
            })
    }
}

fn destination_matches(d: &Destination, host: &str, port: u16) -> bool {
    if d.port.is_some_and(|p| p.get() != port) {
        return false;
    }
    let host = host.trim_end_matches('.');
    match &d.host {
        HostPattern::Any => true,
        HostPattern::Exact(h) => host.eq_ignore_ascii_case(h),
        HostPattern::Wildcard(suffix) => {
            host.len() > suffix.len() + 1 && {
                let (head, tail) = host.split_at(host.len() - suffix.len());
                head.ends_with('.') && tail.eq_ignore_ascii_case(suffix)
            }
        }
    }
}

/// Who a caller is.
#[derive(Debug, Clone)]
pub enum Identity {
    /// This client.
    Known(Arc<Client>),
    /// Nothing identified the caller, and it presented no credential.
    Unknown,
    /// A credential was presented and failed; the caller is no one, whatever its address.
    Failed(Failure),
}

/// What a caller presents.
#[derive(Clone, Copy)]
pub struct Presented<'a> {
    /// The names of its verified client certificate, on a TLS listener with `client_ca`.
    pub cert_names: Option<&'a [String]>,
    /// The request head (`Proxy-Authorization`, the route's `client_token` header).
    pub headers: &'a HeaderMap,
    /// The route's `client_token` header name, if it has one.
    pub client_token: Option<&'a HeaderName>,
    /// The client's address.
    pub addr: Option<IpAddr>,
}

/// Why a caller may not go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No identity (none presented, or one that failed): 407 or 401.
    AuthRequired(Option<Failure>),
    /// The client may not use the route: 403 `route_denied`.
    RouteDenied,
    /// The client may not reach the target: 403 `destination_denied`.
    DestinationDenied,
}

/// What authorization decided.
#[derive(Debug)]
pub struct Decision {
    /// The caller's identity as the request carries it: the client, or `anonymous` for an
    /// unidentified caller under `unknown: anonymous`; none when it failed or is unknown.
    pub client: Option<Arc<Client>>,
    /// Why it may not go on, if it may not (in `report` mode it goes on all the same).
    pub refusal: Option<Refusal>,
}

/// The route and target a caller asks for, as authorization reads them.
#[derive(Clone, Copy)]
pub struct Asked<'a> {
    /// The route's name.
    pub route: &'a str,
    /// The client's own target, on a route whose members reach it (`direct`, `proxy`):
    /// host (lowercase, IPv6 without brackets) and port.
    pub target: Option<(&'a str, u16)>,
}

/// The `clients` section, ready to serve.
pub struct Clients {
    /// `enforce` or `report`.
    pub mode: ClientsMode,
    unknown: UnknownClients,
    /// Every client, in config order.
    pub list: Vec<Arc<Client>>,
    /// The digest of every token, with its client's index in `list`.
    tokens: Vec<([u8; 32], u32)>,
    /// Certificate name → client index.
    certs: HashMap<String, usize>,
    /// The CIDRs of the clients known by address alone, with the client's index.
    by_address: Vec<(IpNet, usize)>,
    /// The client named `anonymous`, if listed.
    anonymous: Option<Arc<Client>>,
    /// The section as configured, to tell whether a reload changed it.
    pub config: ClientsConfig,
    /// Failed identifications per address; the table carries it over from the one it
    /// replaces, so that a reload frees no throttled address.
    pub throttle: Arc<throttle::Throttle>,
}

impl std::fmt::Debug for Clients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clients")
            .field("mode", &self.mode)
            .field("clients", &self.list.len())
            .finish_non_exhaustive()
    }
}

/// The SHA-256 digest of a token.
/// A digest as the four words it is compared by.
fn words(d: &[u8; 32]) -> [u64; 4] {
    std::array::from_fn(|i| u64::from_ne_bytes(d[i * 8..i * 8 + 8].try_into().unwrap_or_default()))
}

fn digest(token: &[u8]) -> [u8; 32] {
    // BLAKE3, not SHA-256: either keeps the table free of tokens and the comparison free of
    // their lengths, and BLAKE3 hashes a token in a few hundred instructions where SHA-256
    // without the CPU's SHA extensions takes thousands, on every identified request.
    blake3::hash(token).into()
}

impl Clients {
    /// The section made ready to serve.
    pub fn new(config: &ClientsConfig) -> Clients {
        let list: Vec<Arc<Client>> = config
            .list
            .iter()
            .map(|c| Arc::new(Client::new(c)))
            .collect();
        let mut tokens = Vec::new();
        let mut certs = HashMap::new();
        let mut by_address = Vec::new();
        for (i, c) in config.list.iter().enumerate() {
            for t in &c.tokens {
                tokens.push((digest(t.0.as_bytes()), i as u32));
            }
            for name in &c.certs {
                certs
                    .entry(crate::listen_tls::canonical_name(&name.0))
                    .or_insert(i);
            }
            if c.address_only() {
                by_address.extend(c.cidrs.iter().map(|n| (n.0, i)));
            }
        }
        let anonymous = list.iter().find(|c| &*c.name == ANONYMOUS).cloned();
        Clients {
            mode: config.mode,
            unknown: config.unknown,
            list,
            tokens,
            certs,
            by_address,
            anonymous,
            config: config.clone(),
            throttle: Arc::default(),
        }
    }

    /// The client holding `token`, compared on digests in constant time: every digest is
    /// compared, whatever matched before, and a digest's length does not depend on the token's.
    fn by_token(&self, token: &[u8]) -> Option<&Arc<Client>> {
        let presented = words(&digest(token));
        let mut found = subtle::Choice::from(0);
        let mut index = 0u32;
        for (d, i) in &self.tokens {
            // Four words, not 32 bytes: the same constant-time comparison in an eighth of the
            // steps.
            let same = words(d).ct_eq(&presented);
            index.conditional_assign(i, same);
            found |= same;
        }
        bool::from(found)
            .then(|| self.list.get(index as usize))
            .flatten()
    }

    /// Who presented `p`, in SPEC §9's order; the first credential presented decides.
    pub fn identify(&self, p: &Presented<'_>) -> Identity {
        let found = self.credential(p);
        match found {
            Some(Ok(client)) if !client.connects_from(p.addr) => {
                Identity::Failed(Failure::WrongAddress)
            }
            Some(Ok(client)) => Identity::Known(client.clone()),
            Some(Err(failure)) => Identity::Failed(failure),
            None => match p.addr.and_then(|a| self.by_address(a)) {
                Some(client) => Identity::Known(client.clone()),
                None => Identity::Unknown,
            },
        }
    }

    /// The client of the first credential `p` presents, or why it failed; `None` when it
    /// presents none.
    fn credential(&self, p: &Presented<'_>) -> Option<Result<&Arc<Client>, Failure>> {
        if let Some(names) = p.cert_names {
            // A verified certificate is presented even when it names no client: that is a
            // failure, not a reason to look at the headers.
            let client = names
                .iter()
                .find_map(|n| self.certs.get(n.as_str()))
                .and_then(|&i| self.list.get(i));
            return Some(client.ok_or(Failure::UnknownCert));
        }
        let mut values = p.headers.get_all(http::header::PROXY_AUTHORIZATION).iter();
        if let Some(value) = values.next() {
            if values.next().is_some() {
                return Some(Err(Failure::Malformed));
            }
            return Some(self.proxy_authorization(value.as_bytes()));
        }
        let name = p.client_token?;
        let mut values = p.headers.get_all(name).iter();
        let value = values.next()?;
        if values.next().is_some() {
            return Some(Err(Failure::Malformed));
        }
        Some(self.client_token(value.as_bytes()))
    }

    /// `Proxy-Authorization: Basic base64(name:token)` or `Bearer token`.
    fn proxy_authorization(&self, value: &[u8]) -> Result<&Arc<Client>, Failure> {
        if value.len() > MAX_CREDENTIAL_BYTES {
            return Err(Failure::Malformed);
        }
        let (scheme, rest) = split_scheme(value).ok_or(Failure::Malformed)?;
        if scheme.eq_ignore_ascii_case(b"basic") {
            // Decoded on the stack when short, as `name:token` nearly always is; only a long
            // value pays for an allocation (and a large buffer would pay for zeroing it).
            let mut small = [0u8; 192];
            let mut large = Vec::new();
            let buf: &mut [u8] = if rest.len() / 4 * 3 + 3 <= small.len() {
                &mut small
            } else {
                large.resize(rest.len() / 4 * 3 + 3, 0);
                &mut large
            };
            let len = STANDARD
                .decode_slice(rest, buf)
                .map_err(|_| Failure::Malformed)?;
            // Bytes, not text: a name is compared with the client's and a token hashed, so
            // neither needs to be valid UTF-8 to be refused.
            let decoded = &buf[..len];
            let colon = decoded
                .iter()
                .position(|&b| b == b':')
                .ok_or(Failure::Malformed)?;
            let (name, token) = (&decoded[..colon], &decoded[colon + 1..]);
            let client = self.by_token(token).ok_or(Failure::BadBasic)?;
            // The name is the client's own, or left out (`http://:token@sluice`); another
            // client's name with this token is a mistake worth refusing.
            if !name.is_empty() && name != client.name.as_bytes() {
                return Err(Failure::BadBasic);
            }
            Ok(client)
        } else if scheme.eq_ignore_ascii_case(b"bearer") {
            self.by_token(rest).ok_or(Failure::BadToken)
        } else {
            Err(Failure::Malformed)
        }
    }

    /// The route's `client_token` header: `Bearer token`, or the bare token.
    fn client_token(&self, value: &[u8]) -> Result<&Arc<Client>, Failure> {
        if value.len() > MAX_CREDENTIAL_BYTES {
            return Err(Failure::Malformed);
        }
        let token = match split_scheme(value) {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case(b"bearer") => rest,
            _ => value.trim_ascii(),
        };
        if token.is_empty() {
            return Err(Failure::Malformed);
        }
        self.by_token(token).ok_or(Failure::BadToken)
    }

    /// The client known by address alone whose `cidrs` hold `addr`.
    fn by_address(&self, addr: IpAddr) -> Option<&Arc<Client>> {
        // An IPv4-mapped IPv6 peer (a dual-stack listener) is the IPv4 client it maps.
        let addr = match addr {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
            v4 => v4,
        };
        self.by_address
            .iter()
            .find(|(net, _)| net.contains(&addr))
            .and_then(|&(_, i)| self.list.get(i))
    }

    /// Whether `identity` may use what it asks for; the identity the request carries on.
    pub fn authorize(&self, identity: Identity, asked: &Asked<'_>) -> Decision {
        let client = match identity {
            Identity::Known(client) => client,
            Identity::Failed(failure) => {
                return Decision {
                    client: None,
                    refusal: Some(Refusal::AuthRequired(Some(failure))),
                }
            }
            Identity::Unknown => match (&self.unknown, &self.anonymous) {
                (UnknownClients::Anonymous, Some(anonymous)) => anonymous.clone(),
                _ => {
                    return Decision {
                        client: None,
                        refusal: Some(Refusal::AuthRequired(None)),
                    }
                }
            },
        };
        let refusal = if !client.may_use(asked.route) {
            Some(Refusal::RouteDenied)
        } else if asked
            .target
            .is_some_and(|(host, port)| !client.may_reach(host, port))
        {
            Some(Refusal::DestinationDenied)
        } else {
            None
        };
        Decision {
            client: Some(client),
            refusal,
        }
    }
}

/// `scheme SP credentials`, with the credentials trimmed; `None` without both.
fn split_scheme(value: &[u8]) -> Option<(&[u8], &[u8])> {
    let value = value.trim_ascii();
    let at = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = value.split_at(at);
    let rest = rest.trim_ascii();
    (!scheme.is_empty() && !rest.is_empty()).then_some((scheme, rest))
}
