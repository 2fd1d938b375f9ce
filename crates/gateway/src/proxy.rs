//! The Pingora `ProxyHttp` service: the request path of SPEC §3.
//!
//! A request moves through these hooks:
//! 1. `request_filter` finds the route on the table snapshot the request keeps to the end, or
//!    answers 404/405 itself;
//! 2. `upstream_peer` picks a member not yet tried, and hands Pingora a clone of its prebuilt peer;
//! 3. `fail_to_connect` reports the failure to the pool and asks Pingora to come back to
//!    `upstream_peer` while the route has retries left. Nothing was sent, so any method may retry.
//!    `error_while_proxy` forbids any retry once connected: the request may have reached the
//!    member, and for a paid API a replayed GET costs money just like a replayed POST;
//! 4. `upstream_request_filter` and `response_filter` fix up headers;
//! 5. `fail_to_proxy` turns our own failures into problem+json answers;
//! 6. `logging` writes the access log and the metrics.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::header;
use http::{HeaderValue, Method};
use pingora::modules::http::HttpModules;
use pingora::prelude::*;
use pingora::protocols::Digest;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{ErrorType, HTTPStatus};

use crate::headers::{absolute_form, append_forwarded_for, strip_hop_by_hop};
use crate::metrics::{Metrics, NO_ROUTE};
use crate::problem::{self, Problem};
use crate::server::Stores;
use sluice_allocator::AssignmentStore;
use sluice_balancer::Pick;
use sluice_limiter::QuotaStore;

use crate::config::Selection;
use crate::table::{Route, Table};

/// The proxy service. Cheap to share: everything lives behind `Arc`s.
pub struct Gateway {
    table: Arc<ArcSwap<Table>>,
    pub(crate) metrics: Arc<Metrics>,
    in_flight: Arc<AtomicUsize>,
    pub(crate) quotas: Arc<dyn QuotaStore>,
    pub(crate) allocator: Arc<dyn AssignmentStore>,
}

impl Gateway {
    /// A gateway serving whatever table is current in `table`, with its state in `stores`.
    pub fn new(
        table: Arc<ArcSwap<Table>>,
        metrics: Arc<Metrics>,
        in_flight: Arc<AtomicUsize>,
        stores: &Stores,
    ) -> Self {
        Gateway {
            table,
            metrics,
            in_flight,
            quotas: stores.quotas.clone(),
            allocator: stores.allocator.clone(),
        }
    }
}

/// Counts a request as in flight from its first hook to the drop of its context, so a graceful
/// stop can wait for exactly the requests that started.
pub struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Members a request already tried. Retries are few, so a small inline array avoids an
/// allocation per request; past it, the oldest entries are forgotten, which at worst lets a
/// very long retry chain revisit a member that the pool has meanwhile marked down anyway.
#[derive(Default)]
pub(crate) struct Tried {
    members: [u32; 8],
    len: usize,
}

impl Tried {
    fn push(&mut self, index: usize) {
        self.members[self.len % self.members.len()] = index as u32;
        self.len += 1;
    }
    fn contains(&self, index: usize) -> bool {
        self.members[..self.len.min(self.members.len())].contains(&(index as u32))
    }
    pub(crate) fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.members[..self.len.min(self.members.len())]
            .iter()
            .map(|&i| i as usize)
    }
}

/// Why the gateway itself answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Every eligible member failed to connect, or none was left to try.
    Unreachable,
    /// The pool had no eligible member for the first attempt.
    NoMember,
}

/// Per-request state.
pub struct RequestCtx {
    started: Instant,
    pub(crate) route: Option<Arc<Route>>,
    /// The member of the current attempt.
    member: Option<usize>,
    /// The current attempt is a down member's single trial.
    trial: bool,
    /// The current attempt's outcome was reported to the pool.
    reported: bool,
    pub(crate) tried: Tried,
    attempts: u32,
    pub(crate) failure: Option<Failure>,
    /// Path and authority of an absolute-form request (`GET http://host/path`), whose
    /// `uri` Pingora leaves as the bare path.
    absolute: Option<(http::uri::Authority, http::uri::PathAndQuery)>,
    /// The `RateLimit` header for the response of an admitted request.
    pub(crate) ratelimit: Option<HeaderValue>,
    /// A member chosen before `upstream_peer`: a least-used assignment or a trial.
    pub(crate) chosen: Option<Pick>,
    /// The least-used store failed: this request uses round-robin.
    pub(crate) fallback: bool,
    _in_flight: InFlight,
}

impl RequestCtx {
    fn member(&self) -> Option<&crate::table::Member> {
        Some(&self.route.as_ref()?.members[self.member?])
    }
}

impl Gateway {
    pub(crate) async fn answer(
        &self,
        session: &mut Session,
        ctx: &RequestCtx,
        p: Problem,
    ) -> Result<()> {
        let route = ctx.route.as_ref().map(|r| &*r.name);
        let (header, body) = problem::render(&p, route);
        session
            .write_response_header(Box::new(header), false)
            .await?;
        session.write_response_body(Some(body), true).await
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        RequestCtx {
            started: Instant::now(),
            route: None,
            member: None,
            trial: false,
            reported: false,
            tried: Tried::default(),
            attempts: 0,
            failure: None,
            absolute: None,
            ratelimit: None,
            chosen: None,
            fallback: false,
            _in_flight: InFlight(self.in_flight.clone()),
        }
    }

    // No compression or other downstream modules: they cost time on every request.
    fn init_downstream_modules(&self, _modules: &mut HttpModules) {}

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let req = session.req_header();
        if req.method == Method::CONNECT {
            let p = Problem::method_not_allowed("CONNECT tunnels are not supported by sluice");
            self.answer(session, ctx, p).await?;
            return Ok(true);
        }
        ctx.absolute = absolute_form(req.raw_path());
        let table = self.table.load();
        let found = {
            let (host, path) = match &ctx.absolute {
                Some((authority, path)) => (authority.as_str(), path.path()),
                None => {
                    let host = req
                        .headers
                        .get(header::HOST)
                        .and_then(|h| h.to_str().ok())
                        .unwrap_or("");
                    (host, req.uri.path())
                }
            };
            table.router.find(host, path, req.method.as_str()).cloned()
        };
        let Some(route) = found else {
            self.answer(session, ctx, Problem::no_route()).await?;
            return Ok(true);
        };
        ctx.route = Some(route.clone());
        // The quota is charged here, once per request, before any member is chosen: retries
        // happen after this hook and never come back to it.
        // Cloning a parsed path bumps a reference count; it frees `ctx` for the calls below.
        let absolute_path = ctx.absolute.as_ref().map(|(_, p)| p.clone());
        let path = match &absolute_path {
            Some(p) => p.path(),
            None => session.req_header().uri.path(),
        };
        let verdict = match route.selection {
            Selection::LeastUsed => self.first_assignment(session, ctx, &route, path).await,
            // TODO(pipeline): priority picks the first healthy member in list order; until the
            // runtime side lands it is served like round_robin.
            Selection::RoundRobin | Selection::Priority => match &route.quota {
                Some(quota) => self.check_quota(session, &route, quota, path).await,
                None => return Ok(false),
            },
        };
        self.answer_verdict(session, ctx, verdict).await
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        let route = ctx.route.clone().expect("request_filter sets the route");
        loop {
            if ctx.attempts > route.config.upstream.retries {
                ctx.failure = Some(Failure::Unreachable);
                return Err(Error::explain(HTTPStatus(502), "retries exhausted"));
            }
            let now = Instant::now();
            let least_used_retry =
                route.selection == Selection::LeastUsed && !ctx.fallback && ctx.attempts > 0;
            let chosen = match ctx.chosen.take() {
                Some(pick) => Some(pick),
                None if least_used_retry => match self.next_assignment(ctx, &route).await {
                    Some(found) => found.map(|index| Pick {
                        index,
                        trial: false,
                    }),
                    None => {
                        ctx.fallback = true;
                        let tried = &ctx.tried;
                        route.pool.pick(now, |i| tried.contains(i))
                    }
                },
                None => {
                    let tried = &ctx.tried;
                    route.pool.pick(now, |i| tried.contains(i))
                }
            };
            let Some(pick) = chosen else {
                ctx.failure = Some(if ctx.attempts == 0 {
                    Failure::NoMember
                } else {
                    Failure::Unreachable
                });
                return Err(Error::explain(HTTPStatus(503), "no eligible member"));
            };
            ctx.tried.push(pick.index);
            ctx.member = Some(pick.index);
            ctx.trial = pick.trial;
            ctx.reported = false;
            ctx.attempts += 1;
            let member = &route.members[pick.index];
            match &member.peer {
                Some(peer) => return Ok(Box::new(peer.clone())),
                None => {
                    // An unresolvable host is a connect failure that never reached Pingora.
                    member.attempts_connect_failure.inc();
                    route.pool.report_connect_failure(pick.index, now);
                    ctx.reported = true;
                }
            }
        }
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        _reused: bool,
        _peer: &HttpPeer,
        #[cfg(unix)] _fd: std::os::unix::io::RawFd,
        #[cfg(windows)] _sock: std::os::windows::io::RawSocket,
        _digest: Option<&Digest>,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        // Reaching the member is what passive health cares about; a trial succeeds here.
        if let (Some(route), Some(i)) = (&ctx.route, ctx.member) {
            route.pool.report_success(i);
            ctx.reported = true;
        }
        Ok(())
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let (Some(route), Some(i)) = (&ctx.route, ctx.member) {
            route.members[i].attempts_connect_failure.inc();
            route.pool.report_connect_failure(i, Instant::now());
            ctx.reported = true;
            // Nothing reached the member, so trying another is safe for every method.
            // upstream_peer enforces the retry budget and the choice of an untried member.
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
        let Some(route) = &ctx.route else {
            return Ok(());
        };
        strip_hop_by_hop(upstream);
        if let Some((authority, path)) = &ctx.absolute {
            // Members expect origin-form targets; only proxies take absolute URIs.
            upstream.set_uri(http::Uri::from(path.clone()));
            if route.config.upstream.preserve_host && !upstream.headers.contains_key(header::HOST) {
                let host = HeaderValue::from_str(authority.as_str())
                    .or_err(ErrorType::InvalidHTTPHeader, "authority")?;
                upstream.insert_header(header::HOST, host)?;
            }
        }
        if !route.config.upstream.preserve_host {
            if let Some(m) = ctx.member() {
                upstream.insert_header(header::HOST, m.host_header.clone())?;
            }
        }
        if let Some(ip) = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip())
        {
            append_forwarded_for(upstream, ip)?;
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        strip_hop_by_hop(response);
        if let Some(ratelimit) = ctx.ratelimit.take() {
            if let Some(quota) = ctx.route.as_ref().and_then(|r| r.quota.as_ref()) {
                response.insert_header("ratelimit-policy", quota.policy.clone())?;
                response.insert_header("ratelimit", ratelimit)?;
            }
        }
        Ok(())
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        let problem = match ctx.failure {
            Some(Failure::NoMember) => Some(Problem::no_member()),
            Some(Failure::Unreachable) if ctx.member.is_some() || ctx.attempts > 0 => {
                Some(Problem::unreachable(ctx.attempts))
            }
            _ => match e.esource() {
                ErrorSource::Upstream => Some(match e.etype() {
                    ErrorType::ReadTimedout | ErrorType::WriteTimedout => {
                        Problem::upstream_timeout()
                    }
                    _ => Problem::upstream_error(),
                }),
                ErrorSource::Downstream => match e.etype() {
                    // The client is gone; there is nobody to answer.
                    ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed => {
                        None
                    }
                    _ => Some(Problem::bad_request()),
                },
                _ => Some(Problem::internal()),
            },
        };
        let status = match problem {
            // Once a response has started, all we can do is cut the connection.
            Some(p) if session.response_written().is_none() => {
                let status = p.status;
                if let Err(err) = self.answer(session, ctx, p).await {
                    tracing::debug!(error = %err, "could not send the error response");
                }
                status
            }
            Some(p) => p.status,
            None => 0,
        };
        FailToProxy {
            error_code: status,
            can_reuse_downstream: false,
        }
    }

    fn error_while_proxy(
        &self,
        _peer: &HttpPeer,
        _session: &mut Session,
        mut e: Box<Error>,
        _ctx: &mut RequestCtx,
        _client_reused: bool,
    ) -> Box<Error> {
        // Pingora's default replays idempotent requests that fail on a reused connection.
        // Those bytes may have reached the member, so sluice never replays them.
        e.set_retry(false);
        e
    }

    // Failures are logged once, in the access log, with their cause.
    fn suppress_error_log(&self, _session: &Session, _ctx: &RequestCtx, _error: &Error) -> bool {
        true
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        let elapsed = ctx.started.elapsed();
        let status = session
            .response_written()
            .map(|r| r.status.as_u16())
            .unwrap_or(0);
        let route_name = ctx.route.as_ref().map_or(NO_ROUTE, |r| &*r.name);

        if let (Some(route), Some(i)) = (&ctx.route, ctx.member) {
            let member = &route.members[i];
            match (e, ctx.failure) {
                (_, Some(Failure::Unreachable)) | (_, Some(Failure::NoMember)) => {}
                (None, _) => member.attempts_ok.inc(),
                (Some(_), _) => member.attempts_error.inc(),
            }
            // A trial that never got as far as connecting goes back for the next request.
            if ctx.trial && !ctx.reported {
                route.pool.release_trial(i, Instant::now());
            }
            route.duration.observe(elapsed.as_secs_f64());
        }
        // A status code's text is static: no allocation for the label.
        let code = http::StatusCode::from_u16(status).ok();
        let status_label = code.as_ref().map_or("0", |c| c.as_str());
        self.metrics
            .requests
            .with_label_values(&[route_name, status_label])
            .inc();

        let req = session.req_header();
        let (authority, path) = match &ctx.absolute {
            Some((a, p)) => (a.as_str(), p.path()),
            None => (
                req.headers
                    .get(header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .unwrap_or(""),
                req.uri.path(),
            ),
        };
        let member = ctx.member().map_or("", |m| m.url.url.as_str());
        crate::logging::access(&crate::logging::AccessLine {
            route: route_name,
            method: req.method.as_str(),
            authority,
            path,
            status,
            member,
            attempts: ctx.attempts,
            duration_ms: elapsed.as_secs_f64() * 1000.0,
            // Our own failures say what they were; others name Pingora's error type.
            error: match ctx.failure {
                Some(Failure::Unreachable) => Some("upstream_unreachable"),
                Some(Failure::NoMember) => Some("no_member"),
                None => e.map(|e| e.etype().as_str()),
            },
        });
    }
}
