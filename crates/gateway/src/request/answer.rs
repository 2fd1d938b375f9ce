//! What the client gets back: the gateway's own problem+json answers, and the fix-ups of a
//! member's response, including the `RateLimit` headers (their syntax is in
//! [`crate::ratelimit`]).

use std::time::SystemTime;

use bytes::Bytes;

use http::{header, HeaderValue};
use pingora::http::ResponseHeader;
use pingora::prelude::*;
use pingora::proxy::{FailToProxy, Session};
use pingora::ErrorType;
use sluice_limiter::Outcome;

use super::account::ConnectFailure;
use super::{Failure, RequestCtx};
use crate::headers::{
    forward_one_content_length, strip_hop_by_hop, RATELIMIT, RATELIMIT_POLICY, X_REQUEST_ID,
};
use crate::problem::{self, Problem};
use crate::quota::RouteQuota;
use crate::select::Attempt;
use crate::table::Route;

/// The `RateLimit` item of a request on a route with a quota; `key` is the request's quota
/// key, which a per-key quota announces as the partition key.
pub(crate) fn ratelimit(quota: &RouteQuota, outcome: &Outcome, key: &str) -> Option<HeaderValue> {
    let partition = (quota.key != crate::config::QuotaKey::Route).then_some(key);
    crate::ratelimit::item(&quota.windows, &quota.unit_names, outcome, partition)
}

/// Adds the route's `RateLimit-Policy` and the request's `RateLimit` to a response head, as
/// field lines of their own: a member's own items stay (see [`crate::ratelimit`]).
fn add_ratelimit(head: &mut ResponseHeader, quota: &RouteQuota, value: HeaderValue) -> Result<()> {
    head.append_header(&RATELIMIT_POLICY, quota.policy.clone())?;
    head.append_header(&RATELIMIT, value)?;
    Ok(())
}

/// Sends a gateway-made answer, with the request's `RateLimit` headers when it has them.
pub(crate) async fn problem(session: &mut Session, ctx: &mut RequestCtx, p: Problem) -> Result<()> {
    problem_and(session, ctx, p, None).await
}

/// [`problem`] for a 405, with its `Allow` header (RFC 9110 §15.5.6).
pub(crate) async fn problem_with_allow(
    session: &mut Session,
    ctx: &mut RequestCtx,
    p: Problem,
    allow: HeaderValue,
) -> Result<()> {
    problem_and(session, ctx, p, Some(allow)).await
}

async fn problem_and(
    session: &mut Session,
    ctx: &mut RequestCtx,
    p: Problem,
    allow: Option<HeaderValue>,
) -> Result<()> {
    let ratelimit = ctx.ratelimit.take();
    let (head, body) = problem_head(
        &p,
        ctx.route.as_deref(),
        ctx.seen.request_id.as_ref(),
        ratelimit,
        allow,
    )?;
    ctx.seen.answered = Some(p.code);
    keep_if_body_small(session);
    session.write_response_header(Box::new(head), false).await?;
    session.write_response_body(Some(body), true).await
}

/// The head and body of a gateway-made answer, for requests and tunnels alike: the problem
/// (`crate::problem::render`), the request's id, `Allow` for a 405, the route's
/// `RateLimit-Policy` and the request's `RateLimit` when it has them, and `Retry-After` for a
/// refusal that says when to come back.
pub(crate) fn problem_head(
    p: &Problem,
    route: Option<&Route>,
    request_id: Option<&HeaderValue>,
    ratelimit: Option<HeaderValue>,
    allow: Option<HeaderValue>,
) -> Result<(ResponseHeader, Bytes)> {
    let (mut head, body) = problem::render(p, route.map(|r| &*r.name));
    if let Some(id) = request_id {
        head.insert_header(&X_REQUEST_ID, id.clone())?;
    }
    if let Some(allow) = allow {
        head.insert_header(header::ALLOW, allow)?;
    }
    // The challenge says how to identify (RFC 9110 §11.6.1, §11.7.1).
    match p.code {
        problem::PROXY_AUTH_REQUIRED => {
            head.insert_header(header::PROXY_AUTHENTICATE, "Basic realm=\"sluice\"")?
        }
        problem::CLIENT_AUTH_REQUIRED => head.insert_header(header::WWW_AUTHENTICATE, "Bearer")?,
        _ => {}
    }
    if let (Some(quota), Some(value)) = (route.and_then(|r| r.quota.as_deref()), ratelimit) {
        add_ratelimit(&mut head, quota, value)?;
    }
    if let Some(retry_after_ms) = p.retry_after_ms {
        // Whole seconds, rounded up, at least 1 (SPEC §3).
        head.insert_header(header::RETRY_AFTER, retry_after_ms.div_ceil(1000).max(1))?;
    }
    Ok((head, body))
}

/// The largest unread request body a gateway-made answer reads and throws away to keep the
/// connection, and the time it gives the client to send it.
const DISCARD_BYTES: usize = 64 * 1024;
const DISCARD_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// Keeps the connection for the client's next request after a gateway-made answer to a request
/// whose body is still unread, as nginx and HAProxy do: Pingora then reads the body to its end
/// and throws it away before it reuses the connection (its default is to close as soon as an
/// answer goes out before the body was read). Only a body that is small (a `Content-Length` of
/// at most [`DISCARD_BYTES`]) and already on its way is worth it: a larger or chunked one, or one
/// the client holds back until `100 Continue`, still closes the connection, and so does a body
/// that takes longer than [`DISCARD_TIME`] to arrive.
fn keep_if_body_small(session: &mut Session) {
    if session.is_body_done() {
        return;
    }
    let headers = &session.req_header().headers;
    let expects_continue = headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let small = crate::headers::content_length(headers)
        .is_some_and(|length| length <= DISCARD_BYTES as u64);
    if expects_continue || !small || headers.contains_key(header::TRANSFER_ENCODING) {
        return;
    }
    let downstream = session.as_downstream_mut();
    downstream.set_close_on_response_before_downstream_finish(false);
    downstream.set_total_drain_timeout(Some(DISCARD_TIME));
}

/// The 429 for a quota refusal: the first window that refused names it, and each window that
/// refused counts it.
pub(crate) fn quota_refusal(quota: &RouteQuota, cost: u64, outcome: &Outcome) -> Problem {
    let mut refused_by = "";
    for (i, w) in outcome.windows.iter().enumerate() {
        if w.remaining < cost {
            if let Some(counter) = quota.rejections.get(i) {
                counter.inc();
            }
            if refused_by.is_empty() {
                refused_by = quota.windows.get(i).map_or("", |w| &w.name);
            }
        }
    }
    Problem::quota_exceeded(refused_by, outcome.retry_after_us.div_ceil(1000))
}

/// A member answered with `response`. A status the route's `cooldown` watches cools the member
/// in the store, so that no instance sends it anything until the time its answer asked for
/// (capped at `max`, `default` when it said nothing). With `retry: true`, a request whose body
/// fits the 64 KiB replay buffer is then sent once more, to another member: the member's
/// answer is dropped unseen, and Pingora replays the buffered body.
pub(crate) async fn learn_cooldown(
    gateway: &super::Gateway,
    session: &mut Session,
    response: &ResponseHeader,
    ctx: &mut RequestCtx,
) -> Result<()> {
    // The common case, a route without cooldowns or an answer that is not a cooldown status,
    // costs two reads and no reference count.
    let status = response.status.as_u16();
    let watched = ctx.route.as_ref().is_some_and(|r| {
        r.config
            .upstream
            .cooldown
            .as_ref()
            .is_some_and(|c| c.on_status.contains(&status))
    });
    if !watched {
        return Ok(());
    }
    let Some(route) = ctx.route.clone() else {
        return Ok(());
    };
    let Some(cooldown) = &route.config.upstream.cooldown else {
        return Ok(());
    };
    let Some(member) = ctx.tried.last().and_then(|i| route.members.get(i)) else {
        return Ok(());
    };
    let cool_for = crate::cooldown::duration(cooldown, &response.headers, SystemTime::now());
    if !cool_for.is_zero() {
        let for_us = u64::try_from(cool_for.as_micros()).unwrap_or(u64::MAX);
        match gateway
            .state
            .cool(&route.name, &member.name, for_us, None)
            .await
        {
            Ok(_) => {
                member.cooldowns.inc();
                tracing::info!(
                    target: "sluice::cooldown",
                    route = %route.name,
                    member = %member.name,
                    status,
                    cooldown_ms = cool_for.as_millis() as u64,
                    "member cooling down"
                );
            }
            Err(error) => {
                gateway
                    .metrics
                    .store_errors
                    .with_label_values(&["cool"])
                    .inc();
                super::store_warning::warn_store_error(
                    &route.name,
                    &error,
                    "the cooldown is not shared",
                );
            }
        }
    }
    // Only a 429 is replayed: it says the member did no work (SPEC §8). Another status in
    // `on_status` (a 500, a 503) cools the member, but the member may have done the work, and
    // the client gets its answer.
    if cooldown.retry
        && status == 429
        && !ctx.replayed
        && crate::headers::body_fits_a_replay(session.as_downstream_mut())
    {
        // The next member is chosen now: a replay with nowhere to go would turn the member's
        // answer into a 503, and the client is better served by the answer itself.
        // The member answered: its lease is given back before the next ask, which must not
        // count it against the route's, the members' or the client's `max_in_flight`.
        if let Some(lease) = ctx.current.as_mut().and_then(Attempt::take_lease) {
            lease.release().await;
        }
        let state = crate::sticky::store(&gateway.state, ctx.sticky.as_ref());
        if let Some(next) = route.policy.next(state, &mut ctx.tried).await {
            tracing::info!(
                target: "sluice::cooldown",
                route = %route.name,
                member = %member.name,
                next = %route.members.get(next.index()).map_or("", |m| &*m.name),
                status,
                request_id = ctx.seen.request_id.as_ref().and_then(|v| v.to_str().ok()),
                "replaying the request to another member (cooldown.retry)"
            );
            ctx.first = Some(next);
            if let Some(meter) = ctx.meter.as_deref_mut() {
                meter.replaying();
            }
            ctx.replayed = true;
            ctx.replay_pending = true;
            return Err(Error::explain(
                ErrorType::HTTPStatus(status),
                "cooldown status; the request goes to another member (cooldown.retry)",
            ));
        }
    }
    Ok(())
}

/// Fixes up a member's response head on its way to the client.
pub(crate) fn response_headers(
    session: &mut Session,
    response: &mut ResponseHeader,
    ctx: &mut RequestCtx,
) -> Result<()> {
    // A 101 to a WebSocket upgrade keeps the member's `Upgrade` and `Connection: upgrade`: the
    // client needs them to accept the switch (RFC 6455 §4.2.2). Pingora then carries the
    // connection as a tunnel until either side closes it.
    let switching = ctx.websocket && response.status == http::StatusCode::SWITCHING_PROTOCOLS;
    let upgrade = switching
        .then(|| response.headers.get(header::UPGRADE).cloned())
        .flatten();
    strip_hop_by_hop(response);
    forward_one_content_length(response)?;
    // An HTTP/1.0 client reads no chunked framing (RFC 9112 §6.1), which Pingora puts on an
    // answer without a length: its answer ends when the connection closes, as nginx does.
    if session.req_header().version == http::Version::HTTP_10
        && response.headers.contains_key(header::TRANSFER_ENCODING)
    {
        response.remove_header(&header::TRANSFER_ENCODING);
        session.set_keepalive(None);
    }
    if switching {
        if let Some(upgrade) = upgrade {
            response.insert_header(header::UPGRADE, upgrade)?;
        }
        response.insert_header(header::CONNECTION, HeaderValue::from_static("upgrade"))?;
        // Idle rule of an open WebSocket, as nginx's: it closes when the member sends nothing
        // for the route's `read_timeout` (the peer's read timeout, which Pingora applies to
        // every read of the upgraded body too). The client's silence alone does not close
        // it: a feed that only pushes is normal. Without this, client-to-member bytes would
        // be read under Pingora's fixed 60 s downstream read timeout, and a listening client
        // would be cut after a minute whatever the route says. A member that pings keeps the
        // connection open and, through the client's pongs, checks the client is still there.
        session.set_read_timeout(None);
    }
    if let (Some(quota), Some(value)) = (
        ctx.route.as_ref().and_then(|r| r.quota.as_deref()),
        ctx.ratelimit.take(),
    ) {
        add_ratelimit(response, quota, value)?;
    }
    if let Some(id) = &ctx.seen.request_id {
        response.insert_header(&X_REQUEST_ID, id.clone())?;
    }
    Ok(())
}

/// Turns a failure to proxy into the gateway's own answer, when one can still be sent.
pub(crate) async fn failure(session: &mut Session, e: &Error, ctx: &mut RequestCtx) -> FailToProxy {
    let attempts = ctx.tried.count() as u32;
    let problem = match ctx.failure {
        Some(Failure::NoMember) => Some(Problem::no_member()),
        Some(Failure::Refused) => ctx.fallback.as_mut().and_then(|t| t.take_refusal()),
        Some(Failure::Denied(denial)) => {
            let host = ctx.target.dest.as_ref().map_or("", |d| &*d.host);
            Some(Problem::destination_denied(crate::egress::describe(
                host, &denial,
            )))
        }
        // The last attempt's failure decides the code, all of them the detail.
        Some(Failure::Unreachable) if attempts > 0 => {
            Some(match ctx.seen.connect_failures.last() {
                Some(ConnectFailure::Tls(reason)) => Problem::upstream_tls(reason),
                None => Problem::unreachable(attempts),
                Some(_) => Problem {
                    detail: format!(
                        "{attempts} connection attempt(s) failed: {}",
                        super::account::describe_failures(&ctx.seen.connect_failures)
                    ),
                    ..Problem::unreachable(attempts)
                },
            })
        }
        _ => match e.esource() {
            ErrorSource::Upstream => Some(match e.etype() {
                ErrorType::ReadTimedout => Problem::upstream_timeout(),
                ErrorType::WriteTimedout => Problem::upstream_write_timeout(),
                _ => Problem::upstream_error(),
            }),
            ErrorSource::Downstream => match e.etype() {
                // The client is gone; there is nobody to answer.
                ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed => None,
                _ => Some(Problem::bad_request()),
            },
            _ => Some(Problem::internal()),
        },
    };
    let status = match problem {
        // Once a response has started, all we can do is cut the connection. (An interim 100
        // or 103 is no start: the final answer is still owed.)
        Some(p) if !crate::headers::final_head_written(session) => {
            let status = p.status;
            if let Err(err) = self::problem(session, ctx, p).await {
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
