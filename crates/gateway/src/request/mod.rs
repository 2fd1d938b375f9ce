//! The request path of SPEC §3, top to bottom. Each Pingora hook makes one call:
//!
//! 1. [`admit`] (`request_filter`): find the route, then let the route's selection policy
//!    decide the quota and the first member together — or answer 404, 405, 429 or 503;
//! 2. [`forward::next_peer`] (`upstream_peer`): the member of this attempt, or after a connect
//!    failure an untried one, within the route's retries;
//! 3. `connected_to_upstream` and `fail_to_connect` report the attempt's outcome through its
//!    [`select::Attempt`] guard. A connect failure may be retried for every method, since
//!    nothing was sent; `error_while_proxy` forbids any retry once connected, since the
//!    request may have reached the member, and for a paid API a replayed GET costs money
//!    just like a replayed POST;
//! 4. [`forward::request_headers`] and [`answer::response_headers`] fix up the heads;
//! 5. [`answer::failure`] (`fail_to_proxy`) turns failures into problem+json answers;
//! 6. [`account::finish`] (`logging`) writes the access log and the metrics.
//!
//! On a usage-metered route, [`meter`] follows the request through the same hooks: admission
//! reserves, `response_filter` and `response_body_filter` read the answer as it passes, and
//! `logging` settles the reservation in one store call before step 6.
//!
//! On a busy thread, both hooks of step 4 end, and step 6 begins, by letting the other ready
//! requests go first ([`sends_together`]), so that the sends of one turn of the event loop
//! leave together.
//!
//! A request whose head Pingora cannot parse never gets that far: [`refuse::refuse`]
//! (`request_error_filter`) answers, logs and counts it.
//!
//! What a request holds is in [`RequestCtx`], and everything it holds that others wait on
//! (the in-flight count, a down member's trial) is a guard released on drop, so a request
//! that ends early cannot leak it.

mod account;
pub(crate) mod admit;
pub(crate) mod answer;
pub(crate) mod attempt;
pub(crate) mod authorize;
mod connect;
mod fallback;
mod forward;
mod meter;
mod refuse;
pub(crate) mod route;
mod sends_together;
mod store_warning;

pub use connect::Tunnels;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::HeaderValue;
use pingora::modules::http::HttpModules;
use pingora::prelude::*;
use pingora::protocols::http::ServerSession;
use pingora::protocols::Digest;
use pingora::proxy::{FailToProxy, ProxyHttp, ProxyWarnLogContext, Session};
use pingora::upstreams::peer::HttpPeer;
use sluice_allocator::StateStore;

use crate::config::MemberKind;
use crate::egress::{Denial, Resolver};
use crate::headers::{TRACEPARENT, X_REQUEST_ID};
use crate::lease::LeaseGuard;
use crate::metrics::Metrics;
use crate::select::{Attempt, Tried};
use crate::table::{Member, Route, Table};

use sends_together::send_with_the_others;

/// The proxy service. Cheap to share: everything lives behind `Arc`s.
pub struct Gateway {
    table: Arc<ArcSwap<Table>>,
    metrics: Arc<Metrics>,
    in_flight: Arc<AtomicUsize>,
    state: Arc<dyn StateStore>,
    /// `limits.max_header_bytes`.
    max_header_bytes: usize,
    /// Called once a request head is parsed; see [`Gateway::on_head_parsed`].
    head_parsed: fn(&ServerSession),
    /// Resolves the client's destination for `direct` members, for the egress guard.
    resolver: Resolver,
}

impl Gateway {
    /// A gateway serving whatever table is current in `table`, with its shared state in `state`.
    pub fn new(
        table: Arc<ArcSwap<Table>>,
        metrics: Arc<Metrics>,
        in_flight: Arc<AtomicUsize>,
        state: Arc<dyn StateStore>,
        max_header_bytes: usize,
        resolver: Resolver,
    ) -> Self {
        Gateway {
            table,
            metrics,
            in_flight,
            state,
            max_header_bytes,
            head_parsed: |_| {},
            resolver,
        }
    }

    /// Tells the connection layer when a request head has been parsed (it stops the
    /// connection's header timer).
    pub fn on_head_parsed(mut self, hook: fn(&ServerSession)) -> Self {
        self.head_parsed = hook;
        self
    }
}

/// Counts a request as in flight from its first hook to the drop of its context, so a graceful
/// stop can wait for exactly the requests that started.
pub struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    pub(crate) fn enter(count: &Arc<AtomicUsize>) -> InFlight {
        count.fetch_add(1, Ordering::AcqRel);
        InFlight(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why the gateway itself answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Every eligible member failed to connect, or none was left to try.
    Unreachable,
    /// The pool had no eligible member for the first attempt.
    NoMember,
    /// The egress guard refused the client's destination (a `direct` member): 403, nothing
    /// contacted, no other member tried.
    Denied(Denial),
    /// After a member's answer that did no work, the fallback route refused the request: its
    /// refusal, kept in the request's fallback trail, is the answer.
    Refused,
}

/// Admission's refusal of a request on a route with a `fallback`: the answer the route gives,
/// unless its fallback takes the request.
pub(crate) struct Refusal {
    pub(crate) problem: crate::problem::Problem,
    pub(crate) ratelimit: Option<HeaderValue>,
    /// The answer is `no_member`.
    pub(crate) no_member: bool,
}

/// Per-request state.
pub struct RequestCtx {
    started: Instant,
    /// The route, on the table the request started with.
    route: Option<Arc<Route>>,
    /// The first member, chosen at admission; taken by the first attempt.
    first: Option<Attempt>,
    /// The attempt in progress.
    current: Option<Attempt>,
    /// The lease of an attempt that failed to connect, released (and waited for) before the
    /// retry asks the store: the retry's ask must not count the request's own lease against
    /// the caps. Pingora's `fail_to_connect` hook cannot wait; `upstream_peer` can.
    failed_lease: Option<LeaseGuard>,
    /// Every member tried.
    tried: Tried,
    /// The checked addresses of a `direct` attempt's destination not tried yet.
    direct_rest: DirectRest,
    failure: Option<Failure>,
    /// How the request's target goes upstream, when it differs from what the client sent.
    target: Forward,
    /// The `RateLimit` header value for the answer.
    ratelimit: Option<HeaderValue>,
    /// The request asks for a WebSocket upgrade, and it is passed to the member
    /// ([`crate::headers::is_websocket_upgrade`]).
    websocket: bool,
    /// The request was sent once more after a member's cooldown status (`cooldown.retry`):
    /// the one replay sluice allows (SPEC §8), so it happens at most once.
    replayed: bool,
    /// A replay was just decided; `error_while_proxy` lets Pingora retry for it alone.
    replay_pending: bool,
    /// What the access line and the request's span report beyond the above.
    seen: Seen,
    /// A member's response head went to the client (`response_filter`): the answer is the
    /// member's, not the gateway's, for `sluice_request_duration_seconds{source}`.
    upstream_answered: bool,
    /// `sluice_requests_in_flight{route}`, held from admission (after any wait in the quota
    /// line) to the end of the request.
    route_in_flight: Option<crate::metrics::GaugeGuard>,
    /// The client identified (SPEC §9): `anonymous` for an unidentified caller under
    /// `unknown: anonymous`; none without a `clients` section, or when nobody was identified.
    pub(crate) client: Option<Arc<crate::clients::Client>>,
    /// What the request reserves in each unit of its route's `quota.usage`, in the order of
    /// its units; empty on a route without usage units.
    pub(crate) reserved: Vec<sluice_usage::Millionths>,
    /// An admitted request's reservation on a usage-metered route, until its answer ends.
    pub(crate) meter: Option<Box<meter::Meter>>,
    /// The routes the request left for their `fallback`, once it left one.
    pub(crate) fallback: Option<Box<fallback::Trail>>,
    /// Admission's refusal on a route with a `fallback`, for [`fallback::after_refusal`].
    pub(crate) refusal: Option<Box<Refusal>>,
    /// The request's session on a sticky route: the store it is admitted and retried through.
    pub(crate) sticky: Option<Arc<crate::sticky::Sticky>>,
    _in_flight: InFlight,
}

/// What a request shows operators: its ids and trace context (set as soon as its head is
/// parsed), and the timings and addresses of its upstream exchange.
#[derive(Default)]
pub(crate) struct Seen {
    /// `X-Request-Id`: the client's, or sluice's ([`crate::trace::request_id`]).
    request_id: Option<HeaderValue>,
    trace: Option<crate::trace::TraceContext>,
    /// The address of the last attempt's connection.
    upstream_addr: Option<SocketAddr>,
    /// When the current attempt asked for its connection.
    attempt_started: Option<Instant>,
    /// The last attempt's connect time (TCP and TLS); none for a pooled connection.
    connect: Option<Duration>,
    /// From the request head to the member's response head.
    ttfb: Option<Duration>,
    /// The code of the gateway's own answer, when it made one.
    answered: Option<&'static str>,
    /// `would_deny` when `clients.mode: report` let a refusal go.
    authz: Option<&'static str>,
    /// The clients step ran: the request counts in `sluice_client_requests_total`, as its
    /// client's or `unknown`'s.
    clients: bool,
    /// The client's address when a trusted proxy's `X-Forwarded-For` named it: the access
    /// line's `client` (with no port) instead of the connection's.
    forwarded_client: Option<std::net::IpAddr>,
    /// Why each connection attempt failed, in order (for `502 upstream_unreachable` and its
    /// access line): at most one per attempt, and attempts are bounded by the route's retries
    /// and a direct destination's addresses.
    connect_failures: Vec<account::ConnectFailure>,
}

/// What the member is sent instead of the client's target, read from [`crate::target`]: the
/// origin-form target when the client used absolute form or its path was normalized, and the
/// authority of an absolute-form request (for `Host`, and the log). Empty in the common case,
/// an origin-form request with a normal path, which costs no allocation.
#[derive(Default)]
pub(crate) struct Forward {
    /// The authority of an absolute-form request (`GET http://host/path`).
    authority: Option<Box<str>>,
    /// The origin-form target to send, when it is not the client's own.
    uri: Option<http::uri::PathAndQuery>,
    /// The client's own destination, on routes whose members reach it (`proxy`, `direct`).
    dest: Option<Dest>,
}

/// The rest of a `direct` attempt's checked addresses ([`forward::next_peer`]).
#[derive(Default)]
pub(crate) struct DirectRest {
    /// Not tried yet, the next one last. Empty when the destination had one address.
    addrs: Vec<std::net::SocketAddr>,
    /// The attempt, kept after a connect failure while an address is left.
    parked: Option<Attempt>,
}

/// Where the client's request is headed, for `proxy` and `direct` members.
pub(crate) struct Dest {
    /// Host as routed: lowercase, IPv6 without brackets.
    host: Box<str>,
    port: u16,
    /// The target is `https://`: a direct member connects with TLS.
    tls: bool,
    /// `host[:port]` as sent, for the absolute form a proxy gets.
    authority: Box<str>,
}

impl Dest {
    fn of(target: &crate::target::Target<'_>) -> Dest {
        let tls = target.scheme == Some(crate::target::Scheme::Https);
        Dest {
            host: (*target.host).into(),
            port: target.port.unwrap_or(if tls { 443 } else { 80 }),
            tls,
            authority: target.authority.into(),
        }
    }
}

impl Forward {
    fn of(target: &crate::target::Target<'_>) -> Forward {
        use crate::target::Form;
        let absolute = target.form == Form::Absolute;
        let uri = (absolute || target.rewritten)
            .then(|| http::uri::PathAndQuery::try_from(&*target.origin_form()).ok())
            .flatten();
        Forward {
            authority: absolute.then(|| target.authority.into()),
            uri,
            dest: None,
        }
    }

    /// The authority and path for the log: as routed.
    fn authority_and_path<'a>(&'a self, req: &'a RequestHeader) -> (&'a str, &'a str) {
        let authority = match &self.authority {
            Some(a) => a,
            None => req
                .headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or(""),
        };
        let path = match &self.uri {
            Some(uri) => uri.path(),
            None => req.uri.path(),
        };
        (authority, path)
    }
}

/// The socket address of `peer`, when it is an IP one.
fn peer_addr(peer: &HttpPeer) -> Option<SocketAddr> {
    use pingora::upstreams::peer::Peer;
    peer.address().as_inet().copied()
}

impl RequestCtx {
    /// Admission let the request go: its first member when the policy picked it, the
    /// `RateLimit` item of its answer, whether selection fell back to round-robin, and its
    /// cost (which a retry charges to another member's own windows).
    pub(crate) fn admitted(
        &mut self,
        first: Option<Attempt>,
        ratelimit: Option<HeaderValue>,
        fallback: bool,
        cost: u64,
    ) {
        self.first = first;
        self.ratelimit = ratelimit;
        self.tried.fallback = fallback;
        self.tried.cost = cost;
    }

    /// The context of a request or tunnel that starts now, counted in `in_flight`.
    pub(crate) fn new(in_flight: &Arc<AtomicUsize>) -> RequestCtx {
        RequestCtx {
            started: Instant::now(),
            route: None,
            first: None,
            current: None,
            failed_lease: None,
            tried: Tried::default(),
            direct_rest: DirectRest::default(),
            failure: None,
            target: Forward::default(),
            ratelimit: None,
            websocket: false,
            replayed: false,
            replay_pending: false,
            seen: Seen::default(),
            upstream_answered: false,
            route_in_flight: None,
            client: None,
            reserved: Vec::new(),
            meter: None,
            fallback: None,
            refusal: None,
            sticky: None,
            _in_flight: InFlight::enter(in_flight),
        }
    }

    /// The latest attempt's member answered `what`: the call that makes a sticky session leave
    /// it, when the route's `rebind_on` says so.
    fn rebind(
        &self,
        what: crate::config::RebindOn,
    ) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let (sticky, route) = (self.sticky.as_ref()?, self.route.as_ref()?);
        sticky.unbinding(route, self.tried.last(), what)
    }

    /// The member of the latest attempt.
    fn member(&self) -> Option<&Member> {
        self.route.as_ref()?.members.get(self.tried.last()?)
    }
}

impl ProxyHttp for Gateway {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx::new(&self.in_flight)
    }

    // No compression or other downstream modules: they cost time on every request.
    fn init_downstream_modules(&self, _modules: &mut HttpModules) {}

    // The head is parsed: the connection's header timer stops (the hook comes from the
    // connection layer, `limits`, which this module does not know).
    async fn early_request_filter(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        (self.head_parsed)(session.as_downstream());
        let headers = &session.req_header().headers;
        ctx.seen.request_id = Some(crate::trace::request_id(headers.get(X_REQUEST_ID.name())));
        ctx.seen.trace = crate::trace::TraceContext::of(
            headers.get(TRACEPARENT.name()),
            crate::otel::enabled(),
            crate::otel::sample,
        );
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let mut answered = admit::admit(self, session, ctx).await;
        if let Some(refusal) = ctx.refusal.take() {
            answered = fallback::after_refusal(self, session, ctx, *refusal).await;
        }
        if let Some(route) = &ctx.route {
            ctx.route_in_flight = Some(crate::metrics::GaugeGuard::enter(&route.in_flight));
        }
        answered
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        let peer = forward::next_peer(self, ctx).await;
        ctx.seen.attempt_started = Some(Instant::now());
        peer
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        reused: bool,
        peer: &HttpPeer,
        #[cfg(unix)] _fd: std::os::unix::io::RawFd,
        #[cfg(windows)] _sock: std::os::windows::io::RawSocket,
        _digest: Option<&Digest>,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if let Some(attempt) = &mut ctx.current {
            attempt.connected();
            // An earlier attempt's connect failure is no longer what happened to the request.
            ctx.failure = None;
        }
        ctx.seen.upstream_addr = peer_addr(peer);
        ctx.seen.connect = (!reused)
            .then(|| ctx.seen.attempt_started.map(|t| t.elapsed()))
            .flatten();
        Ok(())
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        ctx.seen.upstream_addr = peer_addr(peer);
        ctx.seen.connect = None;
        ctx.seen.connect_failures.push(account::connect_failure(&e));
        if let Some(mut attempt) = ctx.current.take() {
            if let Some(member) = ctx.member() {
                member.attempts_connect_failure.inc();
            }
            if ctx.member().is_some_and(|m| m.kind == MemberKind::Direct) {
                // The client's target failed, not the member: its health is not touched. With
                // a checked address left, next_peer tries it on the same attempt.
                if !ctx.direct_rest.addrs.is_empty() {
                    ctx.direct_rest.parked = Some(attempt);
                } else {
                    ctx.failed_lease = attempt.take_lease();
                }
            } else {
                attempt.failed_to_connect();
                ctx.failed_lease = attempt.take_lease();
                // Pingora's hook cannot wait: the retry, if any, moves the binding anyway.
                if let Some(unbind) = ctx.rebind(crate::config::RebindOn::ConnectError) {
                    tokio::spawn(unbind);
                }
            }
            // Nothing reached the member, so trying another is safe for every method.
            // next_peer enforces the retry budget and the choice of an untried member.
            e.set_retry(true);
            ctx.failure = Some(Failure::Unreachable);
        }
        e
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        // A WebSocket's messages are answers sluice cannot read, so on a route that meters
        // usage its handshake goes as a plain request (`Upgrade` removed, as for h2c): no
        // socket opens whose spending one reservation would hide.
        ctx.websocket = crate::headers::is_websocket_upgrade(session.req_header())
            && !ctx
                .route
                .as_ref()
                .is_some_and(|r| route::meters_usage(&r.config));
        forward::request_headers(session, upstream, ctx)?;
        if let Some(meter) = ctx.meter.as_deref_mut() {
            meter.sending(ctx.tried.last());
        }
        send_with_the_others().await;
        Ok(())
    }

    // A member's answer, before anything of it reaches the client: a cooldown status cools
    // the member, and may send the request to another member instead.
    async fn upstream_response_filter(
        &self,
        session: &mut Session,
        response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        ctx.seen.ttfb = Some(ctx.started.elapsed());
        let status = crate::config::RebindOn::Status(response.status.as_u16());
        if let Some(unbind) = ctx.rebind(status) {
            unbind.await;
        }
        // A replay to another member of the route comes first; the route's fallback, when the
        // route has no other member to try.
        answer::learn_cooldown(self, session, response, ctx).await?;
        fallback::after_answer(self, session, response, ctx).await
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        // An interim answer (100 Continue, 103 Early Hints) goes on as it is, less what belongs
        // to the connection: the final answer that follows is the one the request is metered,
        // counted and rate-limited by, and the one that carries the `RateLimit` fields.
        if crate::headers::is_interim(response.status) {
            // An HTTP/1.0 client knows no interim answers (RFC 9110 §15.2): not sent to it.
            if session.req_header().version == http::Version::HTTP_10 {
                session.as_downstream_mut().set_ignore_info_resp(true);
            }
            crate::headers::strip_hop_by_hop(response);
            return Ok(());
        }
        ctx.upstream_answered = true;
        if let (Some(meter), Some(quota)) = (
            ctx.meter.as_deref_mut(),
            ctx.route.as_ref().and_then(|r| r.quota.as_deref()),
        ) {
            // Read before `response_headers` changes the head: the member's own headers and
            // `Content-Encoding` say how its body is read.
            meter.answer_began(quota, response.status.as_u16(), &response.headers);
        }
        answer::response_headers(session, response, ctx)?;
        send_with_the_others().await;
        Ok(())
    }

    // The member's answer as it goes to the client, unchanged: read for its amount on a
    // usage-metered route.
    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<bytes::Bytes>,
        _end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Duration>> {
        if let (Some(meter), Some(chunk)) = (ctx.meter.as_deref_mut(), body.as_ref()) {
            meter.body(chunk);
        }
        Ok(None)
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        answer::failure(session, e, ctx).await
    }

    fn error_while_proxy(
        &self,
        _peer: &HttpPeer,
        _session: &mut Session,
        mut e: Box<Error>,
        ctx: &mut RequestCtx,
        _client_reused: bool,
    ) -> Box<Error> {
        // Pingora's default replays idempotent requests that fail on a reused connection.
        // Those bytes may have reached the member, so sluice never replays them; the one
        // exception is a member's cooldown status with `cooldown.retry` (SPEC §8), decided in
        // `upstream_response_filter`: the member said it did no work.
        e.set_retry(std::mem::take(&mut ctx.replay_pending));
        e
    }

    // What Pingora's own warnings say of the request (a retried connect failure): never the
    // query or a header value, and the request id to find its access line.
    fn request_summary(&self, session: &Session, ctx: &RequestCtx) -> String {
        let req = session.req_header();
        let id = ctx.seen.request_id.as_ref().and_then(|v| v.to_str().ok());
        format!(
            "{} {}, request_id: {}",
            req.method,
            req.uri.path(),
            id.unwrap_or("-")
        )
    }

    // A cooldown replay or a fallback is no failure: Pingora would warn "Fail to proxy:
    // HTTPStatus(429)" for it, so its own line is left out, and `learn_cooldown` and
    // `fallback` log them at info instead.
    // A retried connect failure keeps Pingora's warning.
    fn suppress_proxy_warn_log(
        &self,
        _session: &Session,
        ctx: &RequestCtx,
        error: &Error,
        context: ProxyWarnLogContext,
    ) -> bool {
        matches!(context, ProxyWarnLogContext::UpstreamRetry)
            && (ctx.replayed || ctx.fallback.is_some())
            && matches!(error.etype(), pingora::ErrorType::HTTPStatus(_))
    }

    // Failures are logged once, in the access log, with their cause.
    fn suppress_error_log(&self, _session: &Session, _ctx: &RequestCtx, _error: &Error) -> bool {
        true
    }

    // A head Pingora's parser refused (a hook of our pingora-proxy patch): the gateway's own
    // answer, access line and count instead of Pingora's bare 400.
    async fn request_error_filter(&self, session: &mut ServerSession, e: &Error) -> Result<bool> {
        refuse::refuse(self, session, e).await;
        Ok(true)
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        send_with_the_others().await;
        if let (Some(mut meter), Some(route)) = (ctx.meter.take(), ctx.route.clone()) {
            // A route without a quota of its own may still have reserved: in its members' or
            // its client's calendar or unit windows, and its retries in other members'.
            meter.retried = std::mem::take(&mut ctx.tried.retried);
            // A request that ends in an error after its answer began was cut short.
            meter.cut = e.is_some();
            let (client, state, metrics) =
                (ctx.client.clone(), self.state.clone(), self.metrics.clone());
            // The settlement goes on its own: the client's next request on this connection
            // does not wait a store round trip for it (until it lands, the window holds the
            // reservation, which only ever refuses early). It counts as in flight, so a
            // graceful stop waits for it as for a request.
            let held = InFlight::enter(&self.in_flight);
            tokio::spawn(async move {
                let _held = held;
                let quota = route.quota.as_deref();
                meter
                    .settle(
                        &*state,
                        &metrics,
                        &route.name,
                        quota,
                        client.as_deref(),
                        &route.members,
                    )
                    .await;
            });
        }
        account::finish(self, session, e, ctx);
    }
}
