//! Forwarding: which member each attempt goes to, and how the request is sent there.

use http::{header, HeaderValue};
use pingora::http::RequestHeader;
use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;
use pingora::{ErrorType, HTTPStatus};

use super::{Failure, Gateway, RequestCtx};
use crate::headers::{append_forwarded_for, strip_hop_by_hop};

/// The peer of the next attempt: the member admission chose, or after a connect failure, an
/// untried one from the route's policy, within the route's retry budget.
pub(crate) async fn next_peer(gateway: &Gateway, ctx: &mut RequestCtx) -> Result<Box<HttpPeer>> {
    let Some(route) = ctx.route.clone() else {
        return Err(Error::explain(ErrorType::InternalError, "no route"));
    };
    loop {
        if ctx.tried.count() > route.config.upstream.retries as usize {
            ctx.failure = Some(Failure::Unreachable);
            return Err(Error::explain(HTTPStatus(502), "retries exhausted"));
        }
        let attempt = match ctx.first.take() {
            Some(first) => Some(first),
            None => {
                let fell_back = ctx.tried.fallback;
                let next = route.policy.next(&*gateway.state, &mut ctx.tried).await;
                if ctx.tried.fallback && !fell_back {
                    gateway
                        .metrics
                        .store_errors
                        .with_label_values(&["select"])
                        .inc();
                    route.selection_fallbacks.inc();
                }
                next
            }
        };
        let Some(mut attempt) = attempt else {
            ctx.failure = Some(if ctx.tried.count() == 0 {
                Failure::NoMember
            } else {
                Failure::Unreachable
            });
            return Err(Error::explain(HTTPStatus(503), "no eligible member"));
        };
        let index = attempt.index();
        ctx.tried.push(index);
        let member = &route.members[index];
        match &member.peer {
            Some(peer) => {
                ctx.current = Some(attempt);
                return Ok(Box::new(peer.clone()));
            }
            None => {
                // An unresolvable host is a connect failure that never reached Pingora.
                member.attempts_connect_failure.inc();
                attempt.failed_to_connect();
            }
        }
    }
}

/// Fixes up the request head on its way to the member.
pub(crate) fn request_headers(
    session: &Session,
    upstream: &mut RequestHeader,
    ctx: &RequestCtx,
) -> Result<()> {
    let Some(route) = &ctx.route else {
        return Ok(());
    };
    strip_hop_by_hop(upstream);
    let preserve_host = route.config.upstream.preserve_host;
    // Members expect origin-form targets, normalized as routed and charged.
    if let Some(uri) = &ctx.target.uri {
        upstream.set_uri(http::Uri::from(uri.clone()));
    }
    if let Some(authority) = &ctx.target.authority {
        if preserve_host && !upstream.headers.contains_key(header::HOST) {
            let host = HeaderValue::from_str(authority)
                .or_err(ErrorType::InvalidHTTPHeader, "authority")?;
            upstream.insert_header(header::HOST, host)?;
        }
    }
    if !preserve_host {
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
