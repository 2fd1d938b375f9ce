//! Forwarding: which member each attempt goes to, and how the request is sent there.

use http::{header, HeaderValue};
use pingora::http::RequestHeader;
use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;
use pingora::{ErrorType, HTTPStatus};

use super::{Dest, Failure, Gateway, RequestCtx};
use crate::config::MemberKind;
use crate::egress::{Guard, Refusal, Resolver};
use crate::headers::{append_forwarded_for, keep_websocket_upgrade, strip_hop_by_hop};
use crate::table::{peer_for, Route};

/// The peer of the next attempt: the member admission chose, or after a connect failure, an
/// untried one from the route's policy, within the route's retry budget.
pub(crate) async fn next_peer(gateway: &Gateway, ctx: &mut RequestCtx) -> Result<Box<HttpPeer>> {
    let Some(route) = ctx.route.clone() else {
        return Err(Error::explain(ErrorType::InternalError, "no route"));
    };
    loop {
        // The cooldown replay is not a connect retry: it does not spend the retry budget.
        let budget = route.config.upstream.retries as usize + usize::from(ctx.replayed);
        if ctx.tried.count() > budget {
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
        if member.kind == MemberKind::Direct {
            let table = gateway.table.load();
            let dest = ctx.target.dest.as_ref();
            match direct_peer(&gateway.resolver, &table.guard, &route, dest).await {
                Ok(peer) => {
                    ctx.current = Some(attempt);
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
                    // health is not touched.
                    member.attempts_connect_failure.inc();
                    drop(attempt);
                    continue;
                }
            }
        }
        match member.peer() {
            Some(peer) => {
                ctx.current = Some(attempt);
                return Ok(Box::new(peer));
            }
            None => {
                // An unresolvable host is a connect failure that never reached Pingora.
                member.attempts_connect_failure.inc();
                attempt.failed_to_connect();
            }
        }
    }
}

/// A peer at the client's own destination, for a `direct` member: the destination is
/// resolved and checked by the egress guard ([`Resolver::resolve_checked`]), and the peer is
/// built from the first checked address, so that no second lookup can change where the
/// request goes (DNS rebinding). A retry after a connect failure resolves again (from the
/// cache) and is checked again.
async fn direct_peer(
    resolver: &Resolver,
    guard: &Guard,
    route: &Route,
    dest: Option<&Dest>,
) -> Result<HttpPeer, Refusal> {
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
    Ok(peer_for(
        addr,
        dest.tls,
        dest.host.to_string(),
        &route.config.upstream,
    ))
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
    // names: a client must not choose which key is spent.
    if let Some(m) = ctx.member() {
        for (name, value) in &m.headers.0 {
            upstream.insert_header(name.clone(), value.clone())?;
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
