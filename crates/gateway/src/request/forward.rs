//! Forwarding: which member each attempt goes to, and how the request is sent there.

use http::{header, HeaderValue};
use pingora::http::RequestHeader;
use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;
use pingora::{ErrorType, HTTPStatus};

use std::net::SocketAddr;

use super::account::ConnectFailure;
use super::attempt::{next_member, NoAttempt};
use super::{Dest, DirectRest, Failure, Gateway, RequestCtx};
use crate::config::MemberKind;
use crate::egress::{Guard, Refusal, Resolver, MAX_ADDRESSES_TRIED};
use crate::headers::{
    append_forwarded_for, forward_one_content_length, keep_websocket_upgrade, strip_hop_by_hop,
    TRACEPARENT, X_REQUEST_ID,
};
use crate::table::{peer_for, Route};

/// The peer of the next attempt: the member admission chose, or after a connect failure, an
/// untried one from the route's policy, within the route's retry budget.
pub(crate) async fn next_peer(gateway: &Gateway, ctx: &mut RequestCtx) -> Result<Box<HttpPeer>> {
    let Some(route) = ctx.route.clone() else {
        return Err(Error::explain(ErrorType::InternalError, "no route"));
    };
    // The next checked address of the destination of a `direct` attempt that failed to
    // connect: the same member, the same lookup, so it costs no retry of the route's.
    if let Some(peer) = next_direct_address(ctx, &route) {
        return Ok(Box::new(peer));
    }
    if let Some(lease) = ctx.failed_lease.take() {
        lease.release().await;
    }
    loop {
        // The cooldown replay is not a connect retry: it does not spend the retry budget.
        let extra = usize::from(ctx.replayed);
        let next = next_member(
            crate::sticky::store(&gateway.state, ctx.sticky.as_ref()),
            &gateway.metrics,
            &route,
            &mut ctx.first,
            &mut ctx.tried,
            extra,
        )
        .await;
        let mut attempt = match next {
            Ok(attempt) => attempt,
            Err(NoAttempt::NoMember) => {
                ctx.failure = Some(Failure::NoMember);
                return Err(Error::explain(HTTPStatus(503), "no eligible member"));
            }
            Err(NoAttempt::Exhausted) => {
                ctx.failure = Some(Failure::Unreachable);
                return Err(Error::explain(HTTPStatus(502), "retries exhausted"));
            }
        };
        let index = attempt.index();
        let member = &route.members[index];
        if member.kind == MemberKind::Direct {
            // An `Arc`, not a guard: the lookup below waits.
            let table = gateway.table.load_full();
            let dest = ctx.target.dest.as_ref();
            match direct_peer(&gateway.resolver, &table.guard, &route, dest).await {
                Ok((peer, rest)) => {
                    ctx.current = Some(attempt);
                    ctx.direct_rest = DirectRest {
                        addrs: rest,
                        parked: None,
                    };
                    return Ok(Box::new(peer));
                }
                Err(Refusal::Denied(denial)) => {
                    // The client asked for a destination sluice must not reach: nothing was
                    // contacted, the member's health is not touched, and another member would
                    // go to the same place, so there is no retry.
                    drop(attempt);
                    ctx.failure = Some(Failure::Denied(denial));
                    return Err(Error::explain(HTTPStatus(403), "destination denied"));
                }
                Err(_) => {
                    // The client's target does not resolve: not the member's fault, so its
                    // health is not touched. Its lease is back before the next ask.
                    ctx.seen.connect_failures.push(ConnectFailure::Dns);
                    member.attempts_connect_failure.inc();
                    if let Some(lease) = attempt.take_lease() {
                        lease.release().await;
                    }
                    continue;
                }
            }
        }
        match member.peer() {
            Some(peer) => {
                ctx.current = Some(attempt);
                return Ok(peer);
            }
            None => {
                // An unresolvable host is a connect failure that never reached Pingora.
                ctx.seen.connect_failures.push(ConnectFailure::Dns);
                member.attempts_connect_failure.inc();
                attempt.failed_to_connect();
                if let Some(lease) = attempt.take_lease() {
                    lease.release().await;
                }
                if let Some(unbind) = ctx.rebind(crate::config::RebindOn::ConnectError) {
                    unbind.await;
                }
            }
        }
    }
}

/// A peer at the client's own destination, for a `direct` member: the destination is
/// resolved and checked by the egress guard ([`Resolver::resolve_checked`]), and the peer is
/// built from the first checked address; the next checked ones (at most
/// [`MAX_ADDRESSES_TRIED`] in all) come back too, last first, for [`next_direct_address`] to
/// fall back on when a connect fails. No second lookup can change where the request goes
/// (DNS rebinding). Another member's attempt resolves again (from the cache) and is checked
/// again.
async fn direct_peer(
    resolver: &Resolver,
    guard: &Guard,
    route: &Route,
    dest: Option<&Dest>,
) -> Result<(HttpPeer, Vec<SocketAddr>), Refusal> {
    let Some(dest) = dest else {
        return Err(Refusal::NoAddresses {
            host: String::new(),
        });
    };
    let timeout = route.config.upstream.connect_timeout.0;
    let checked = tokio::time::timeout(
        timeout,
        resolver.resolve_checked(guard, &dest.host, dest.port),
    )
    .await
    .map_err(|_| Refusal::LookupFailed {
        host: dest.host.to_string(),
        message: "timed out".into(),
    })??;
    let Some(&addr) = checked.first() else {
        return Err(Refusal::NoAddresses {
            host: dest.host.to_string(),
        });
    };
    let mut rest: Vec<SocketAddr> = checked
        .into_iter()
        .take(MAX_ADDRESSES_TRIED)
        .skip(1)
        .collect();
    rest.reverse();
    Ok((direct_peer_at(addr, dest, route), rest))
}

fn direct_peer_at(addr: SocketAddr, dest: &Dest, route: &Route) -> HttpPeer {
    peer_for(
        addr,
        dest.tls,
        dest.host.to_string(),
        &route.config.upstream,
    )
}

/// After a `direct` attempt failed to connect ([`super::Gateway`]'s `fail_to_connect` parks its
/// attempt in [`DirectRest`]): the peer at the destination's next checked address, on the same
/// attempt, as happy-eyeballs-lite clients do (curl tries each address in turn). Nothing was
/// sent on the failed connection, so this is safe for every method; the member's health is not
/// touched, since the destination is the client's.
fn next_direct_address(ctx: &mut RequestCtx, route: &Route) -> Option<HttpPeer> {
    let attempt = ctx.direct_rest.parked.take()?;
    let addr = ctx.direct_rest.addrs.pop()?;
    let dest = ctx.target.dest.as_ref()?;
    ctx.current = Some(attempt);
    Some(direct_peer_at(addr, dest, route))
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
    // Proxy-Authorization goes with the hop-by-hop headers, whoever it identified.
    strip_hop_by_hop(upstream);
    forward_one_content_length(upstream)?;
    // A sluice token is for sluice alone, whether or not it identified anyone; a member's
    // `headers` then put the provider's key in its place (virtual keys). After a fallback, the
    // tokens of the routes the request left go too: the client sent them for those routes.
    if let Some(name) = &route.config.client_token {
        upstream.remove_header(name);
    }
    for name in ctx.fallback.iter().flat_map(|t| &t.tokens) {
        upstream.remove_header(name);
    }
    // The head is the client's as Pingora parsed it, with room for 8 more headers
    // (third_party/PATCHES.md, "request head handed upstream with room"); on a retry, a copy
    // with none. Room for what is added below, so that each map grows at most once, not at
    // every other insert ("header map reserve"): `Host` or `Proxy-Authorization`, the member's
    // own headers, the request id, `traceparent`, `Via` and `X-Forwarded-For`; `Upgrade` and
    // `Connection` for a WebSocket.
    let adding = 4
        + ctx.member().map_or(0, |m| m.headers.0.len())
        + usize::from(ctx.seen.trace.is_some())
        + 2 * usize::from(ctx.websocket);
    upstream.reserve_headers(adding)?;
    if ctx.websocket {
        // Pingora carries the connection as a bidirectional body once the member answers
        // 101, provided the request it sent carries `Upgrade` (pingora-core 0.9.1
        // protocols/http/v1/client.rs `is_upgrade_req`; a 101 to a request that is an upgrade
        // on one side only is refused, pingora-proxy src/lib.rs
        // `reject_mismatched_h1_upgrade_101`).
        keep_websocket_upgrade(upstream)?;
    }
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
    match ctx.member().map(|m| &m.kind) {
        Some(MemberKind::Proxy { authorization }) => {
            // A forward proxy gets the absolute form, and sluice's own credentials for it.
            let dest = ctx.target.dest.as_ref();
            let authority = dest.map_or("", |d| &d.authority);
            let mut target = String::with_capacity(8 + authority.len() + 64);
            target.push_str("http://");
            target.push_str(authority);
            match &ctx.target.uri {
                Some(uri) => target.push_str(uri.as_str()),
                None => target.push_str(upstream.uri.path_and_query().map_or("/", |p| p.as_str())),
            }
            upstream.set_raw_path(target.as_bytes())?;
            if let Some(auth) = authorization {
                upstream.insert_header(header::PROXY_AUTHORIZATION, auth.clone())?;
            }
        }
        // Proxy and direct members reach the client's own target: its Host stays.
        Some(MemberKind::Direct) => {}
        Some(MemberKind::Origin) if !preserve_host => {
            if let Some(m) = ctx.member() {
                upstream.insert_header(header::HOST, m.host_header.clone())?;
            }
        }
        _ => {}
    }
    // The member's own headers (its API key) replace whatever the client sent under the same
    // names: a client must not choose which key is spent. Only toward an origin member's own
    // url: `check` refuses headers on members that reach the client's target, and this holds
    // even if a config got past it, since a key must never follow the client's choice.
    if let Some(m) = ctx.member().filter(|m| m.kind == MemberKind::Origin) {
        for (name, value) in &m.headers.0 {
            upstream.insert_header(name.clone(), value.clone())?;
        }
    }
    // The member sees the same request id as the client and the log, and sluice's span as
    // its parent; `tracestate` goes on as the client sent it.
    // A client's own id is usually there already: a lookup is much cheaper than an insert
    // into Pingora's two header maps.
    if let Some(id) = &ctx.seen.request_id {
        if upstream.headers.get(X_REQUEST_ID.name()) != Some(id) {
            upstream.insert_header(&X_REQUEST_ID, id.clone())?;
        }
    }
    if let Some(trace) = &ctx.seen.trace {
        upstream.insert_header(&TRACEPARENT, trace.traceparent())?;
    }
    // sluice's own name, after any the client's request carries: a request that comes back
    // to this instance is answered 508 instead of going round again.
    upstream.append_header(header::VIA, crate::headers::via().clone())?;
    if let Some(ip) = session
        .client_addr()
        .and_then(|a| a.as_inet())
        .map(|a| a.ip())
    {
        append_forwarded_for(upstream, ip)?;
    }
    Ok(())
}
