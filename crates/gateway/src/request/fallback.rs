//! Fallback to other routes (a route's `fallback`): when a route cannot serve a request, the
//! request goes on to the route its `fallback` names for the reason, and is admitted there as
//! if it had come to that route: its clients check, its quota, its members and their headers.
//!
//! A route cannot serve a request when:
//! - admission refuses it: its quota (or every member's own windows or cooldown) with
//!   `quota_exceeded`, or no member is eligible (`no_member`), or it holds its `max_in_flight`
//!   requests (`concurrency_exceeded`);
//! - its member answers with a status that says it did no work: a 429, or a 503 with
//!   `Retry-After`. Then the request is sent again, which only a body that fits the 64 KiB
//!   replay buffer can be (the buffer of the cooldown replay); a larger one gets the member's
//!   answer. Any other answer means the member may have done the work: it is never re-sent.
//!
//! A request follows at most [`MAX_FALLBACK_HOPS`] hops, which `check` also enforces with
//! cycles. CONNECT tunnels do not fall back: they are admitted once (`request::connect`).

use std::sync::Arc;

use http::header;
use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::ErrorType;

use super::admit::{admit_to, Admitted};
use super::{answer, Failure, Gateway, RequestCtx};
use crate::config::{FallbackOn, MemberKind, MAX_FALLBACK_HOPS};
use crate::problem::Problem;
use crate::select::{Attempt, Tried};
use crate::table::Route;

/// The routes a request left, in order, and the refusal of the last route it went to when
/// that refusal comes after a member's answer (sent by [`answer::failure`]).
#[derive(Default)]
pub(crate) struct Trail {
    pub(crate) from: Vec<Arc<str>>,
    /// The `client_token` headers of the routes left. A token the client sent for the route it
    /// addressed is for sluice alone: the next route's members are another origin, often
    /// another provider, and must not receive it, whatever the next route identifies by.
    pub(crate) tokens: Vec<http::HeaderName>,
    refusal: Option<Problem>,
}

impl Trail {
    /// The refusal to send instead of the member's answer.
    pub(crate) fn take_refusal(&mut self) -> Option<Problem> {
        self.refusal.take()
    }
}

/// Why admission's refusal may send the request on.
pub(crate) fn reason_of_refusal(problem: &Problem, no_member: bool) -> Option<FallbackOn> {
    if no_member {
        Some(FallbackOn::NoMember)
    } else if problem.code == "quota_exceeded" {
        Some(FallbackOn::QuotaExceeded)
    } else if problem.code == "concurrency_exceeded" {
        Some(FallbackOn::ConcurrencyExceeded)
    } else {
        None
    }
}

/// Why a member's answer may send the request on: a 429, or a 503 that says when to come
/// back. A bare 503 may come from a member that failed midway through the work.
fn reason_of_status(status: u16, headers: &http::HeaderMap) -> Option<FallbackOn> {
    match status {
        429 => Some(FallbackOn::TooManyRequests),
        503 if headers.contains_key(header::RETRY_AFTER) => Some(FallbackOn::Unavailable),
        _ => None,
    }
}

/// The route the request goes on to from `route` for `reason`: the first entry of its
/// `fallback` that lists the reason, while the request has hops left. Looked up on the
/// current table, as a request routed now would be.
fn next_route(
    gateway: &Gateway,
    ctx: &RequestCtx,
    route: &Route,
    reason: FallbackOn,
) -> Option<Arc<Route>> {
    let entry = route
        .config
        .fallback
        .iter()
        .find(|e| e.on.contains(&reason))?;
    let hops = ctx.fallback.as_ref().map_or(0, |t| t.from.len());
    if hops >= MAX_FALLBACK_HOPS {
        return None;
    }
    let table = gateway.table.load();
    let next = table
        .routes
        .iter()
        .find(|r| *r.name == *entry.route.0)
        .cloned();
    next
}

/// Records the hop from `from` to `to`: in the trail the access line shows, and in
/// `sluice_fallbacks_total`.
fn record_hop(gateway: &Gateway, ctx: &mut RequestCtx, from: &Route, to: &Route, why: FallbackOn) {
    gateway
        .metrics
        .fallbacks
        .with_label_values(&[&from.name, &to.name, why.as_str()])
        .inc();
    let trail = ctx.fallback.get_or_insert_with(Default::default);
    trail.from.push(from.name.clone());
    if let Some(token) = &from.config.client_token {
        if !trail.tokens.contains(token) {
            trail.tokens.push(token.clone());
        }
    }
}

/// Admission refused the request on a route with a `fallback`: when the route falls back for
/// the reason, the request is admitted on the next route instead (and on, along the chain);
/// else the refusal is the answer. Returns whether the request was answered, as
/// [`super::admit::admit`] does.
pub(crate) async fn after_refusal(
    gateway: &Gateway,
    session: &mut Session,
    ctx: &mut RequestCtx,
    refusal: super::Refusal,
) -> Result<bool> {
    let next = reason_of_refusal(&refusal.problem, refusal.no_member).and_then(|reason| {
        let route = ctx.route.clone()?;
        let next = next_route(gateway, ctx, &route, reason)?;
        Some((route, next, reason))
    });
    if let Some((route, next, reason)) = next {
        return follow(gateway, session, ctx, route, next, reason, false).await;
    }
    // As admission answers a refusal on a route without a fallback.
    ctx.ratelimit = refusal.ratelimit;
    if refusal.no_member {
        ctx.failure = Some(Failure::NoMember);
    }
    answer::problem(session, ctx, refusal.problem).await?;
    Ok(true)
}

/// A member of the request's route answered with `response`. When the status says it did no
/// work and the route falls back for it, the request is admitted on the next route and
/// Pingora sends it again from its replay buffer: `Err` then, which
/// [`super::Gateway::error_while_proxy`] turns into that retry (or, when the next route
/// refuses, into that route's refusal).
pub(crate) async fn after_answer(
    gateway: &Gateway,
    session: &mut Session,
    response: &pingora::http::ResponseHeader,
    ctx: &mut RequestCtx,
) -> Result<()> {
    let status = response.status.as_u16();
    // The common case, a route without fallback, costs one read.
    let Some(route) = ctx.route.as_ref().filter(|r| !r.config.fallback.is_empty()) else {
        return Ok(());
    };
    let Some(reason) = reason_of_status(status, &response.headers) else {
        return Ok(());
    };
    // Past the replay buffer the body is gone (or, still arriving, may go): the member's answer
    // is all the client can get.
    if !crate::headers::body_fits_a_replay(session.as_downstream_mut()) {
        return Ok(());
    }
    let route = route.clone();
    let Some(next) = next_route(gateway, ctx, &route, reason) else {
        return Ok(());
    };
    // The member did no work: what the request reserved on this route settles to 0 (no
    // answer was read), before the next route reserves its own.
    if let Some(mut meter) = ctx.meter.take() {
        meter.did_no_work(status);
        // Entries a retry on this route reserved in other members settle with it.
        meter.retried = std::mem::take(&mut ctx.tried.retried);
        let client = ctx.client.as_deref();
        let (state, metrics) = (&*gateway.state, &gateway.metrics);
        meter
            .settle(
                state,
                metrics,
                &route.name,
                route.quota.as_deref(),
                client,
                &route.members,
            )
            .await;
    }
    // The member answered: its lease is given back before the next route's admission, which
    // must not count it against the client's `max_in_flight` (or the next route's caps).
    if let Some(lease) = ctx.current.as_mut().and_then(Attempt::take_lease) {
        lease.release().await;
    }
    tracing::info!(
        target: "sluice::fallback",
        route = %route.name,
        next = %next.name,
        status,
        request_id = ctx.seen.request_id.as_ref().and_then(|v| v.to_str().ok()),
        "the member did no work; the request goes to the fallback route"
    );
    match follow(gateway, session, ctx, route, next, reason, true).await {
        Ok(false) => {
            ctx.replay_pending = true;
            Err(Error::explain(
                ErrorType::HTTPStatus(status),
                "the member did no work; the request goes to the fallback route",
            ))
        }
        Ok(true) => Err(Error::explain(
            ErrorType::HTTPStatus(status),
            "the member did no work, and the fallback route refused the request",
        )),
        Err(e) => Err(e),
    }
}

/// Takes the request from `from` to `next` for `reason`, and on along the chain while each
/// route refuses it for a reason its own `fallback` lists. Returns whether the request was
/// answered: before any member (`at_answer` false) the refusal is sent here; after a member's
/// answer it is kept in the trail for [`answer::failure`].
async fn follow(
    gateway: &Gateway,
    session: &mut Session,
    ctx: &mut RequestCtx,
    mut from: Arc<Route>,
    mut next: Arc<Route>,
    mut reason: FallbackOn,
    at_answer: bool,
) -> Result<bool> {
    // After a member's answer, the client the route left charged the request to its windows
    // (the one its admission identified): that client is not charged again.
    let charged = at_answer
        .then(|| ctx.client.as_ref().map(|c| c.name.clone()))
        .flatten();
    loop {
        record_hop(gateway, ctx, &from, &next, reason);
        // The request belongs to the next route from here: its answer, its log line and its
        // members. The members tried on the route it left are not the next route's.
        ctx.route = Some(next.clone());
        ctx.route_in_flight = Some(crate::metrics::GaugeGuard::enter(&next.in_flight));
        ctx.tried = Tried::default();
        ctx.first = None;
        ctx.failure = None;
        ctx.ratelimit = None;
        let (problem, ratelimit, no_member) =
            match admit_on(gateway, session, ctx, &next, at_answer, charged.as_deref()).await {
                Admitted::Go => return Ok(false),
                Admitted::Left => {
                    return Err(Error::explain(
                        ErrorType::ConnectionClosed,
                        "the client hung up while waiting for capacity, or mid-body",
                    )
                    .into_down())
                }
                Admitted::Refused {
                    problem,
                    ratelimit,
                    no_member,
                } => (problem, ratelimit, no_member),
            };
        if let Some(why) = reason_of_refusal(&problem, no_member) {
            if let Some(after) = next_route(gateway, ctx, &next, why) {
                (from, next, reason) = (next, after, why);
                continue;
            }
        }
        ctx.ratelimit = ratelimit;
        if no_member {
            ctx.failure = Some(Failure::NoMember);
        }
        if at_answer {
            ctx.failure = Some(Failure::Refused);
            if let Some(trail) = ctx.fallback.as_mut() {
                trail.refusal = Some(problem);
            }
        } else {
            answer::problem(session, ctx, problem).await?;
        }
        return Ok(true);
    }
}

/// Admission of the request on `route`, the steps [`super::admit::admit`] takes once it has
/// routed a request: the clients check, the usage reservation, and the quota and first member
/// in one step of the route's policy.
async fn admit_on(
    gateway: &Gateway,
    session: &mut Session,
    ctx: &mut RequestCtx,
    route: &Arc<Route>,
    at_answer: bool,
    charged: Option<&str>,
) -> Admitted {
    let refused = |problem| Admitted::Refused {
        problem,
        ratelimit: None,
        no_member: false,
    };
    let body_done = at_answer || session.as_downstream_mut().is_body_done();
    let req = session.req_header();
    let host = req
        .headers
        .get(header::HOST)
        .map(|h| h.as_bytes())
        .or_else(|| req.uri.authority().map(|a| a.as_str().as_bytes()));
    // It parsed when the request was routed; read again here, since the first read borrowed
    // the session that admission went on to use.
    let Ok(target) = crate::target::parse(&req.method, req.version, req.raw_path(), host) else {
        return refused(Problem::internal());
    };
    // The checks routing makes of a route's members, for this route's.
    let https = target.scheme == Some(crate::target::Scheme::Https);
    let tls_to_target = |m: &crate::table::Member| m.url.tls || m.kind == MemberKind::Direct;
    if https && !route.members.iter().all(tls_to_target) {
        return refused(Problem::cleartext_https());
    }
    ctx.target.dest = route
        .members
        .iter()
        .any(|m| m.kind.reaches_target())
        .then(|| super::Dest::of(&target));
    let table = gateway.table.load();
    // The egress guard, as routing applies it: a destination written as an address that the
    // route left never reached a member that checks it.
    let port = if https { 443 } else { 80 };
    if let Some(problem) = super::route::literal_denied(&table, route, &target, port) {
        return refused(problem);
    }
    if let Some(clients) = table.clients.as_ref() {
        let caller = super::authorize::Caller {
            cert_names: crate::listen_tls::peer_names(session),
            headers: &req.headers,
            addr: session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|a| a.ip()),
        };
        let metrics = &gateway.metrics;
        let authorized =
            super::authorize::authorize(Some(clients), metrics, route, &target, &caller, ctx);
        if let Err(problem) = authorized {
            return refused(problem);
        }
    }
    drop(table);
    let cost = route
        .quota
        .as_deref()
        .map_or(1, |q| q.cost(&target.path, req.method.as_str()));
    let mut reserved = Vec::new();
    if let Some(usage) = route.quota.as_deref().and_then(|q| q.usage.as_ref()) {
        let unread = crate::usage::Prefix::unread(&req.headers);
        let downstream = session.as_downstream();
        // A body read already (by the route left, or sent to its member) is whole in the
        // replay buffer; one not read yet is read now, as admission would.
        let prefix = if body_done {
            let buffered = downstream.get_retry_buffer();
            let whole = !downstream.retry_buffer_truncated() && usage.reads_body;
            crate::usage::Prefix {
                body: buffered.filter(|_| whole),
                len: unread.len,
            }
        } else if usage.reads_body {
            // A body that cannot be read whole leaves nothing to admit: the client is gone.
            match crate::usage::read_prefix(session.as_downstream_mut(), usage.max_request_body)
                .await
            {
                Ok(prefix) => prefix,
                Err(_) => return Admitted::Left,
            }
        } else {
            unread
        };
        reserved = usage.reserve(&prefix.request(&session.req_header().headers));
    }
    // The client's windows of requests counted this request on the route it left, when this
    // route identifies the same client (each route identifies by its own `client_token`): one
    // request is counted once by each client that it is charged to.
    let counted = charged.is_some() && charged == ctx.client.as_ref().map(|c| &*c.name);
    admit_to(gateway, session, ctx, route, cost, reserved, counted).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn only_answers_that_did_no_work_send_a_request_on() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(
            reason_of_status(429, &headers),
            Some(FallbackOn::TooManyRequests)
        );
        assert_eq!(reason_of_status(503, &headers), None, "a bare 503");
        assert_eq!(reason_of_status(500, &headers), None);
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        assert_eq!(
            reason_of_status(503, &headers),
            Some(FallbackOn::Unavailable)
        );
        assert_eq!(reason_of_status(502, &headers), None);
    }
}
