//! CONNECT tunnels (SPEC §7): what `HTTPS_PROXY` clients send for every `https://` URL.
//!
//! Why this lives outside the Pingora proxy: Pingora 0.9 cannot hand a ProxyHttp hook the raw
//! downstream connection. `allow_connect_method_proxying` only forwards a CONNECT as if it were
//! a plain request (to a member that would have to tunnel it itself), and Pingora has no
//! upstream CONNECT through a TCP forward proxy (cloudflare/pingora#224, #290; its
//! `HttpPeer.proxy` is a Unix socket). So the listening service's app ([`crate::limits::LimitedApp`]) looks at
//! the first bytes of each new connection, handles a CONNECT itself, and hands anything else to
//! Pingora's `HttpProxy` with the [`Gateway`](crate::request::Gateway) hooks, unchanged.
//!
//! The look is a peek: Pingora's own TCP stream reads the 8 bytes and rewinds them (the way it
//! peeks for the h2c preface), so a plain request reaches Pingora byte for byte, through no
//! wrapper, and the plain-HTTP path pays one small read and nothing per later read.
//!
//! Only a CONNECT that opens its connection becomes a tunnel. One sent later on a kept-alive
//! connection reaches Pingora, which owns the connection by then; `request_filter` refuses it
//! with `405` and an `Allow` header, and clients retry on a new connection. curl, Python, Node
//! and Go clients always open a new connection for a CONNECT.
//!
//! A tunnel takes the same steps as a request, through the same code:
//! - routing by the target's host ([`crate::target::parse`] reads the authority form), with the
//!   path `/`, so a route's `path_prefix` other than `/` never takes tunnels; the route's
//!   `methods` must allow `CONNECT` (else `405` with `Allow`);
//! - the egress guard ([`crate::egress`]): the target's port must be in `connect_ports`, for
//!   every CONNECT, checked before the quota and before any lookup; a `direct` member then
//!   resolves the target, checks every address, and connects only to those. A
//!   denial is `403 destination_denied`: nothing contacted, no member failure, no retry
//!   elsewhere. `proxy` and origin members are the operator's choice, not the client's: their
//!   addresses are not checked;
//! - quota and first member in one step of the route's policy
//!   ([`crate::request::admit::decide`]): charged once per tunnel, `cost.default` or a rule
//!   with `methods: [CONNECT]`, and one least-used assignment per tunnel;
//! - a failed connection, or a `proxy` member's non-2xx answer to our CONNECT, is a connect
//!   failure: nothing of the client's was sent, so the next member comes from the policy
//!   within `retries`, as for requests.
//!
//! Then `200 Connection Established`, and bytes are copied both ways ([`pump`]) until both
//! sides close, one fails, or `read_timeout` passes with no byte either way. A tunnel counts as
//! in flight, so a graceful stop lets it run until the drain ends; the process then exits,
//! which closes it.

mod head;
mod open;
mod pump;
#[cfg(target_os = "linux")]
mod splice;
#[cfg(test)]
mod tests;

use std::net::IpAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::{HeaderValue, Method};
use pingora::protocols::Stream;
use sluice_allocator::StateStore;

use crate::egress::Resolver;
use crate::metrics::{Metrics, NO_ROUTE};
use crate::problem::Problem;
use crate::request::admit::{decide, Verdict};
use crate::request::InFlight;
use crate::select::Tried;
use crate::table::{Route, Table};
use crate::target;

/// How a new connection starts.
pub enum First {
    /// With a CONNECT; the bytes read so far.
    Connect(Vec<u8>),
    /// With anything else; the bytes read so far, to replay in front of the stream.
    Other(Vec<u8>),
    /// The client closed (or the read failed) before sending anything decisive.
    Left,
    /// Nothing decisive arrived in the time allowed: an idle connection.
    Idle,
}

/// The first bytes of a new connection, and whether they open a CONNECT. Reads until the
/// bytes can no longer be the start of `CONNECT ` (one read, for nearly every request) or are
/// it; the caller replays them in front of the stream.
pub async fn first_bytes(stream: &mut Stream, within: Duration) -> First {
    use tokio::io::AsyncReadExt;
    const CONNECT: &[u8] = b"CONNECT ";
    let read = async {
        let mut buf = Vec::with_capacity(1024);
        loop {
            match stream.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return First::Left,
                Ok(_) => {}
            }
            let n = buf.len().min(CONNECT.len());
            if buf[..n] != CONNECT[..n] {
                return First::Other(buf);
            }
            if n == CONNECT.len() {
                return First::Connect(buf);
            }
        }
    };
    tokio::time::timeout(within, read)
        .await
        .unwrap_or(First::Idle)
}

/// What tunnels share with the request path: the table, metrics, the in-flight count and the
/// state store.
pub struct Tunnels {
    table: Arc<ArcSwap<Table>>,
    metrics: Arc<Metrics>,
    in_flight: Arc<AtomicUsize>,
    state: Arc<dyn StateStore>,
    /// Resolves `direct` targets for the egress guard.
    resolver: Resolver,
}

impl Tunnels {
    /// Tunnels over the same table, metrics, in-flight count and store as the proxy.
    pub fn new(
        table: Arc<ArcSwap<Table>>,
        metrics: Arc<Metrics>,
        in_flight: Arc<AtomicUsize>,
        state: Arc<dyn StateStore>,
        resolver: Resolver,
    ) -> Tunnels {
        Tunnels {
            table,
            metrics,
            in_flight,
            state,
            resolver,
        }
    }

    /// Serves one connection that opens with a CONNECT, to its end.
    pub(crate) async fn serve(&self, mut client: Stream, first: Vec<u8>) {
        let started = Instant::now();
        let _in_flight = InFlight::enter(&self.in_flight);
        let client_addr = client
            .get_socket_digest()
            .and_then(|d| d.peer_addr().and_then(|a| a.as_inet()).copied());
        let client_ip = client_addr.map(|a| a.ip());
        let mut end = End {
            client: client_addr,
            ..End::default()
        };
        let authority = match head::read(&mut client, first).await {
            Ok(head) => {
                end.request_id = Some(crate::trace::request_id(
                    head.headers.get(crate::headers::X_REQUEST_ID.name()),
                ));
                self.tunnel(&mut client, &head, client_ip, &mut end).await;
                head.authority
            }
            Err(Some(problem)) => {
                end.status = problem.status;
                let id = crate::trace::request_id(None);
                head::answer(&mut client, &id, &problem, None, None, None).await;
                end.request_id = Some(id);
                String::new()
            }
            // The client left before its head was complete.
            Err(None) => String::new(),
        };
        self.account(&end, &authority, started.elapsed());
    }

    /// Routes, admits, connects and pumps one tunnel; `end` says what happened.
    async fn tunnel(
        &self,
        client: &mut Stream,
        head: &head::Head,
        client_ip: Option<IpAddr>,
        end: &mut End,
    ) {
        let id = end
            .request_id
            .clone()
            .unwrap_or_else(|| crate::trace::request_id(None));
        let id = &id;
        // A CONNECT that carries this instance's own Via left here and came back (through a
        // proxy member that leads back to sluice): another hop would only go round again.
        if crate::headers::is_own_loop(&head.headers) {
            let p = Problem::loop_detected();
            end.status = p.status;
            end.error = Some(p.code);
            head::answer(client, id, &p, None, None, None).await;
            return;
        }
        let host = head.headers.get(http::header::HOST).map(|h| h.as_bytes());
        let target = match target::parse(
            &Method::CONNECT,
            head.version,
            head.authority.as_bytes(),
            host,
        ) {
            Ok(t) => t,
            Err(reject) => {
                let p = Problem::bad_target(reject);
                end.status = p.status;
                head::answer(client, id, &p, None, None, None).await;
                return;
            }
        };
        // An `Arc`, not a guard: the tunnel waits (for capacity, for its connection), and it
        // lets the table go once connected, so that a tunnel open for hours does not keep a
        // replaced table alive.
        let table = self.table.load_full();
        let Some(route) = table
            .router
            .find_normalized(&target.host, "/", "CONNECT")
            .cloned()
        else {
            let (p, allow) = match table.router.find_any_method(&target.host, "/") {
                Some(r) => {
                    end.route = Some(r.clone());
                    (
                        Problem::method_not_allowed("this route's methods do not include CONNECT"),
                        allow_header(r),
                    )
                }
                None => (Problem::no_route(), None),
            };
            end.status = p.status;
            head::answer(client, id, &p, end.route.as_deref(), None, allow).await;
            return;
        };
        end.route = Some(route.clone());

        // A tunnel carries bytes sluice cannot read: refused on a route that must see each
        // request, before anything is charged or contacted.
        if let Some(reason) = connect_refusal(&route) {
            let p = Problem::connect_not_supported(reason);
            end.status = p.status;
            end.error = Some(p.code);
            head::answer(
                client,
                id,
                &p,
                Some(&route),
                None,
                allow_without_connect(&route),
            )
            .await;
            return;
        }

        // egress.connect_ports, for every CONNECT whatever its member kind (SPEC §7): before
        // the quota is charged and before any lookup.
        if let Err(denied) = table.guard.check_connect_port(target.port.unwrap_or(443)) {
            let p = Problem::destination_denied(denied.to_string());
            end.status = p.status;
            end.error = Some("destination_denied");
            head::answer(client, id, &p, Some(&route), None, None).await;
            return;
        }

        let quota = route.quota.as_deref();
        let cost = quota.map_or(1, |q| q.cost("/", "CONNECT"));
        let mut key_buf = String::new();
        let key = quota.map_or("", |q| q.key_for(&head.headers, client_ip, &mut key_buf));
        // The client's socket: one that hangs up while waiting for capacity leaves the line.
        let fd = Some(client.id());
        let (first, ratelimit, fallback) =
            match decide(&*self.state, &self.metrics, &route, key, cost, fd).await {
                Verdict::Go {
                    first,
                    ratelimit,
                    fallback,
                } => (first, ratelimit, fallback),
                Verdict::Answer {
                    problem,
                    ratelimit,
                    no_member,
                } => {
                    end.status = problem.status;
                    if no_member {
                        end.error = Some("no_member");
                    }
                    head::answer(client, id, &problem, Some(&route), ratelimit, None).await;
                    return;
                }
                Verdict::Left => {
                    end.error = Some("client_gone");
                    return;
                }
            };

        // Attempts: the admitted member, then untried ones from the policy, within retries.
        let up = &route.config.upstream;
        let mut tried = Tried::default();
        tried.fallback = fallback;
        let mut next = first;
        let mut all_refused = true;
        // Why each attempt failed, for the 502's detail.
        let mut failures = Vec::new();
        let egress = open::Egress {
            resolver: &self.resolver,
            guard: &table.guard,
        };
        let mut denied = None;
        let upstream = loop {
            if tried.count() > up.retries as usize {
                break None;
            }
            let attempt = match next.take() {
                Some(a) => Some(a),
                None => {
                    let fell_back = tried.fallback;
                    let a = route.policy.next(&*self.state, &mut tried).await;
                    if tried.fallback && !fell_back {
                        self.metrics
                            .store_errors
                            .with_label_values(&["select"])
                            .inc();
                        route.selection_fallbacks.inc();
                    }
                    a
                }
            };
            let Some(mut attempt) = attempt else {
                break None;
            };
            let index = attempt.index();
            tried.push(index);
            end.member = Some(index);
            let member = &route.members[index];
            match open::connect(member, &target, up, &egress).await {
                Ok(conn) => {
                    attempt.connected();
                    break Some(conn);
                }
                Err(failure) if failure.denied.is_some() => {
                    // The client's destination is denied: nothing was contacted, the member's
                    // health is not touched, and no other member is tried (a `direct` one
                    // would go to the same place).
                    drop(attempt);
                    denied = failure.denied;
                    break None;
                }
                Err(failure) => {
                    member.attempts_connect_failure.inc();
                    all_refused &= failure.refused;
                    failures.push(failure.reason);
                    tracing::debug!(target: "sluice::tunnel", route = %route.name, member = %member.name, %failure, "tunnel attempt failed");
                    if member.kind == crate::config::MemberKind::Direct {
                        // The client's target failed, not the member: health is not touched.
                        drop(attempt);
                    } else {
                        attempt.failed_to_connect();
                    }
                }
            }
        };
        drop(table);
        end.attempts = tried.count() as u32;
        end.tried = tried.iter().collect();
        let Some(upstream) = upstream else {
            let attempts = tried.count() as u32;
            let (p, code) = if let Some(denial) = denied {
                let reason = crate::egress::describe(&target.host, &denial);
                (Problem::destination_denied(reason), "destination_denied")
            } else if attempts == 0 {
                (Problem::no_member(), "no_member")
            } else if all_refused {
                (Problem::proxy_refused(attempts), "proxy_refused")
            } else {
                let mut p = Problem::unreachable(attempts);
                if !failures.is_empty() {
                    let why = crate::request::describe_failures(&failures);
                    p.detail = format!("{attempts} connection attempt(s) failed: {why}");
                    end.detail = Some(why);
                }
                (p, "upstream_unreachable")
            };
            end.status = p.status;
            end.error = Some(code);
            head::answer(client, id, &p, Some(&route), ratelimit, None).await;
            return;
        };
        if let Some(m) = end.member.map(|i| &route.members[i]) {
            m.attempts_ok.inc();
        }

        if !head::established(client, id, &route, ratelimit).await {
            end.error = Some("client_gone");
            return;
        }
        end.status = 200;
        // A guard, not inc/dec around the pump: a tunnel whose task is dropped mid-way (its
        // connection's task cancelled, or a panic unwinding) must still leave the gauge.
        let _active = crate::metrics::GaugeGuard::enter(
            &self
                .metrics
                .tunnels_active
                .with_label_values(&[&route.name]),
        );
        let counters = pump::Counters {
            up: self
                .metrics
                .tunnel_bytes
                .with_label_values(&[&route.name, "up"]),
            down: self
                .metrics
                .tunnel_bytes
                .with_label_values(&[&route.name, "down"]),
        };
        // Both sides plain TCP: splice(2), with no copy through user space; else the copy loop.
        let mut early_up = head.early.to_vec();
        #[cfg(target_os = "linux")]
        let client_socket = splice::client_socket(client, &mut early_up);
        #[cfg(not(target_os = "linux"))]
        let client_socket: Option<std::convert::Infallible> = None;
        let idle = up.read_timeout.0;
        let pumped = match client_socket {
            #[cfg(target_os = "linux")]
            Some(socket) => {
                splice::pump(
                    socket,
                    upstream.stream,
                    &early_up,
                    &upstream.early,
                    idle,
                    &counters,
                )
                .await
            }
            #[cfg(not(target_os = "linux"))]
            Some(never) => match never {},
            None => {
                pump::pump(
                    client,
                    upstream.stream,
                    &early_up,
                    &upstream.early,
                    idle,
                    &counters,
                )
                .await
            }
        };
        end.bytes = Some((pumped.up, pumped.down));
        end.error = pumped.ended;
    }

    /// The tunnel's access line and request metric.
    fn account(&self, end: &End, authority: &str, elapsed: Duration) {
        let route_name = end.route.as_ref().map_or(NO_ROUTE, |r| &*r.name);
        let status = http::StatusCode::from_u16(end.status).ok();
        self.metrics
            .requests
            .with_label_values(&[route_name, status.as_ref().map_or("0", |s| s.as_str())])
            .inc();
        // sluice_request_duration_seconds is left to requests: a tunnel's lifetime (minutes,
        // often) would drown their latencies. The access line has it.
        let member = end
            .route
            .as_ref()
            .zip(end.member)
            .and_then(|(r, i)| r.members.get(i))
            .map_or("", |m| &*m.name);
        let (up, down) = end.bytes.unwrap_or_default();
        if let Some(route) = &end.route {
            route.bytes[0].inc_by(up);
            route.bytes[1].inc_by(down);
        }
        let each_tried = |put: &mut dyn FnMut(&str)| {
            if let Some(route) = &end.route {
                for &i in &end.tried {
                    if let Some(m) = route.members.get(i) {
                        put(&m.name);
                    }
                }
            }
        };
        crate::logging::access(&crate::logging::AccessLine {
            route: route_name,
            method: "CONNECT",
            authority,
            path: "",
            status: end.status,
            member,
            members_tried: Some(&each_tried),
            attempts: end.attempts,
            duration_ms: elapsed.as_secs_f64() * 1000.0,
            client: end.client,
            bytes_in: up,
            bytes_out: down,
            request_id: end.request_id.as_ref().and_then(|v| v.to_str().ok()),
            error: end.error,
            detail: end.detail.as_deref(),
            tunnel: end.bytes,
            ..Default::default()
        });
    }
}

/// How a tunnel ended, for its access line.
#[derive(Default)]
struct End {
    route: Option<Arc<Route>>,
    status: u16,
    member: Option<usize>,
    attempts: u32,
    error: Option<&'static str>,
    bytes: Option<(u64, u64)>,
    client: Option<std::net::SocketAddr>,
    request_id: Option<HeaderValue>,
    /// The members tried, in order (at most the route's retries + 1).
    tried: Vec<usize>,
    /// More on `error`: why each connection attempt failed.
    detail: Option<String>,
}

/// Why a CONNECT cannot be served on `route`, if it cannot (SPEC §7). Inside a tunnel sluice
/// sees no request, so a route that must see each one cannot carry a tunnel:
/// - origin members stand in for the client's target: a tunnel to one would carry TLS for a
///   name the member does not serve (or plain HTTP that the client takes for TLS), and their
///   `headers` (a key) cannot be added to bytes sluice does not write;
/// - cost rules by path charge each request by what it asks for; a tunnel is charged once.
fn connect_refusal(route: &Route) -> Option<&'static str> {
    let origins = !route.members.is_empty()
        && route
            .members
            .iter()
            .all(|m| m.kind == crate::config::MemberKind::Origin);
    if origins {
        return Some("this route's members are origin servers, which sluice must send each request to itself; CONNECT tunnels need a direct or proxy member. Send the request to sluice as plain http://, or in gateway form");
    }
    let by_path = route
        .config
        .quota
        .as_ref()
        .is_some_and(|q| q.cost.rules.iter().any(|r| r.path_prefix.0 != "/"));
    if by_path {
        return Some("this route charges requests by path, which a tunnel would hide; send the requests to sluice as plain http://, or in gateway form");
    }
    None
}

/// `Allow` for a route that refuses CONNECT: its methods, or every method but CONNECT.
fn allow_without_connect(route: &Route) -> Option<HeaderValue> {
    let methods = &route.config.matcher.methods;
    if methods.is_empty() {
        return Some(HeaderValue::from_static(
            "GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS",
        ));
    }
    let listed: Vec<&str> = methods
        .iter()
        .map(|m| m.0.as_str())
        .filter(|m| *m != "CONNECT")
        .collect();
    HeaderValue::from_str(&listed.join(", ")).ok()
}

/// `Allow` for a route that does not allow CONNECT: its methods (it has some, or it would
/// allow CONNECT).
fn allow_header(route: &Route) -> Option<HeaderValue> {
    let methods: Vec<&str> = route
        .config
        .matcher
        .methods
        .iter()
        .map(|m| m.0.as_str())
        .collect();
    HeaderValue::from_str(&methods.join(", ")).ok()
}
