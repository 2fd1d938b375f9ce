//! Admission: the first step of every request. It finds the route, asks the route's policy to
//! decide the quota and the first member together, and answers itself when the request may not
//! go on (404, 405, 429, 503).

use std::sync::atomic::{AtomicU64, Ordering};

use http::{header, Method};
use pingora::prelude::*;
use pingora::proxy::Session;
use sluice_state::{Acquire, StoreError};

use super::select::Admission;
use super::{answer, Failure, Forward, Gateway, RequestCtx};
use crate::config::OnStoreError;
use crate::problem::Problem;
use crate::target::{self, Scheme};

/// Store failures are logged at most once a second: during an outage every request fails the
/// same way, and the metric counts them all.
static LAST_STORE_WARNING: AtomicU64 = AtomicU64::new(0);

pub(crate) fn warn_store_error(route: &str, error: &StoreError, what: &str) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST_STORE_WARNING.swap(now, Ordering::Relaxed) != now {
        tracing::warn!(target: "sluice::store", route, %error, "state store failed; {what}");
    }
}

/// A 431 for a request head larger than `limits.max_header_bytes`. Pingora reads heads of up
/// to 1 MiB (and answers 400 past that) before any hook runs, so this is the first place the
/// size can be checked.
fn oversized_head(gateway: &Gateway, session: &Session) -> Option<Problem> {
    let size = session.as_http1()?.get_headers_raw_bytes().len();
    let limit = gateway.max_header_bytes;
    (size > limit).then(|| Problem::header_too_large(size, limit))
}

/// Admits the request or answers it. Returns whether the request was answered here.
pub(crate) async fn admit(
    gateway: &Gateway,
    session: &mut Session,
    ctx: &mut RequestCtx,
) -> Result<bool> {
    if let Some(p) = oversized_head(gateway, session) {
        // What follows the head cannot be trusted to be framed as the client meant: close.
        session.set_keepalive(None);
        answer::problem(session, ctx, p).await?;
        return Ok(true);
    }
    let req = session.req_header();
    if req.method == Method::CONNECT {
        let p = Problem::method_not_allowed("CONNECT tunnels are not supported by sluice");
        answer::problem(session, ctx, p).await?;
        return Ok(true);
    }

    // What the request addresses, read once: the host to route on and the normalized path
    // that is routed, charged and forwarded (what is charged is what is served).
    let host_header = req
        .headers
        .get(header::HOST)
        .map(|h| h.as_bytes())
        .or_else(|| req.uri.authority().map(|a| a.as_str().as_bytes()));
    let target = match target::parse(&req.method, req.version, req.raw_path(), host_header) {
        Ok(target) => target,
        Err(reject) => {
            answer::problem(session, ctx, Problem::bad_target(reject)).await?;
            return Ok(true);
        }
    };

    ctx.target = Forward::of(&target);

    // Route: by host, path and method, on the table this request keeps to its end.
    let table = gateway.table.load();
    let method = req.method.as_str();
    let Some(route) = table
        .router
        .find_normalized(&target.host, &target.path, method)
        .cloned()
    else {
        answer::problem(session, ctx, Problem::no_route()).await?;
        return Ok(true);
    };
    if target.scheme == Some(Scheme::Https) && !route.members.iter().all(|m| m.url.tls) {
        ctx.route = Some(route);
        answer::problem(session, ctx, Problem::cleartext_https()).await?;
        return Ok(true);
    }
    let cost = route
        .quota
        .as_deref()
        .map_or(0, |q| q.cost(&target.path, method));
    ctx.route = Some(route.clone());

    // Quota and first member, decided together. This is the only place a request is charged:
    // retries happen after this hook and never come back to it.
    let mut key_buf = String::new();
    let acquire = route.quota.as_deref().map(|q| Acquire {
        route: &route.name,
        key: q.key_of(session, &mut key_buf),
        windows: &q.windows,
        cost,
        at_us: None,
    });
    let admission = route.policy.admit(&*gateway.state, acquire).await;

    let quota = route.quota.as_deref();
    match admission {
        Admission::Admitted {
            first,
            quota: outcome,
        } => {
            ctx.first = first;
            ctx.ratelimit = quota
                .zip(outcome.as_ref())
                .and_then(|(q, o)| answer::ratelimit(q, o));
            Ok(false)
        }
        Admission::QuotaRefused(outcome) => {
            // Only a route with a quota is ever refused.
            let p = match quota {
                Some(q) => {
                    ctx.ratelimit = answer::ratelimit(q, &outcome);
                    answer::quota_refusal(q, cost, &outcome)
                }
                None => Problem::internal(),
            };
            answer::problem(session, ctx, p).await?;
            Ok(true)
        }
        Admission::NoMember { quota: outcome } => {
            ctx.failure = Some(Failure::NoMember);
            ctx.ratelimit = quota
                .zip(outcome.as_ref())
                .and_then(|(q, o)| answer::ratelimit(q, o));
            answer::problem(session, ctx, Problem::no_member()).await?;
            Ok(true)
        }
        Admission::StoreFailed {
            error,
            first,
            fallback,
        } => {
            let op = if fallback { "select" } else { "quota" };
            gateway.metrics.store_errors.with_label_values(&[op]).inc();
            if matches!(error, StoreError::TooManyKeys) {
                gateway
                    .metrics
                    .quota_keys_refused
                    .with_label_values(&[&route.name])
                    .inc();
            }
            if fallback {
                ctx.tried.fallback = true;
                route.selection_fallbacks.inc();
            }
            // Open when the route has no quota: only selection is at stake then, and it fell
            // back.
            match quota.map(|q| q.on_store_error) {
                Some(OnStoreError::Closed) => {
                    warn_store_error(&route.name, &error, "the route fails closed");
                    answer::problem(session, ctx, Problem::store_unavailable()).await?;
                    Ok(true)
                }
                _ => {
                    warn_store_error(
                        &route.name,
                        &error,
                        "admitting the request (on_store_error: open)",
                    );
                    ctx.first = first;
                    Ok(false)
                }
            }
        }
    }
}
