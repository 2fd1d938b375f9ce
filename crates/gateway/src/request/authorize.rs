//! Identification and authorization (SPEC §9): the step right after routing, for plain
//! requests, WebSocket upgrades and CONNECT tunnels alike, so that all three answer the same.
//!
//! Without a `clients` section the step does nothing. With one, the caller is identified
//! ([`crate::clients::Clients::identify`]) and its route and target checked; a refusal is the
//! gateway's own answer (407, 401, 403), or, in `report` mode, an `"authz": "would_deny"` in
//! the access line and a count, and the request goes on.

use std::net::IpAddr;
use std::sync::Arc;

use http::HeaderMap;

use super::RequestCtx;
use crate::clients::address::TrustedProxies;
use crate::clients::throttle::Settings as FailedAuth;
use crate::clients::{Asked, Clients, Decision, Identity, Presented, Refusal};
use crate::config::ClientsMode;
use crate::metrics::{client_label, Metrics};
use crate::problem::Problem;
use crate::table::Route;
use crate::target::{Form, Scheme, Target};

/// What the caller presents, besides its request head.
pub(crate) struct Caller<'a> {
    /// The names of its verified client certificate, on a TLS listener with `client_ca`.
    pub(crate) cert_names: Option<&'a [String]>,
    /// The request head.
    pub(crate) headers: &'a HeaderMap,
    /// The client's address.
    pub(crate) addr: Option<IpAddr>,
}

const X_FORWARDED_FOR: http::HeaderName = http::HeaderName::from_static("x-forwarded-for");

/// The access line's `authz` when `report` mode let a refusal go.
pub(crate) const WOULD_DENY: &str = "would_deny";

/// Identifies the caller of `route` and checks what it asks for. `Ok` lets the request go on,
/// with its client (if any) on `ctx`; `Err` is the gateway's answer.
pub(crate) fn authorize(
    clients: Option<&Arc<Clients>>,
    metrics: &Metrics,
    route: &Route,
    target: &Target<'_>,
    caller: &Caller<'_>,
    ctx: &mut RequestCtx,
) -> Result<(), Problem> {
    let Some(clients) = clients else {
        return Ok(());
    };
    ctx.seen.clients = true;
    // The client's address: the connection's (which a trusted proxy's PROXY header has already
    // made the client's), or, from a trusted proxy, the last untrusted X-Forwarded-For hop.
    let trusted = TrustedProxies(&clients.config.trusted_proxies);
    let addr = caller.addr.map(|peer| {
        // Looked up only where it can count: from a trusted proxy.
        if !trusted.contains(peer) {
            return peer;
        }
        let forwarded = caller.headers.get_all(X_FORWARDED_FOR).iter();
        trusted.client_ip(peer, forwarded.map(|v| v.as_bytes()))
    });
    if addr != caller.addr {
        ctx.seen.forwarded_client = addr;
    }
    let failed_auth = FailedAuth::from(&clients.config.failed_auth);
    // An address past its failures is refused before its credentials are tried, so that a
    // guess then tells it nothing.
    let throttled = addr.and_then(|a| clients.throttle.check(a, &failed_auth));
    if let (Some(left), ClientsMode::Enforce) = (throttled, clients.mode) {
        let problem = Problem::auth_throttled(left.as_millis() as u64);
        metrics
            .client_denials
            .with_label_values(&["enforce", problem.code, client_label(None)])
            .inc();
        return Err(problem);
    }
    let identity = clients.identify(&Presented {
        cert_names: caller.cert_names,
        headers: caller.headers,
        client_token: route.config.client_token.as_ref(),
        addr,
    });
    if let Identity::Failed(failure) = &identity {
        metrics
            .client_auth_failures
            .with_label_values(&[failure.as_str()])
            .inc();
        if let Some(addr) = addr {
            clients.throttle.fail(addr, &failed_auth);
        }
    }
    // Only where the client chooses the target (`direct` and `proxy` members) do its
    // `destinations` apply: an origin member is where the route goes, whatever the target.
    let reaches_target = route.members.iter().any(|m| m.kind.reaches_target());
    let asked = Asked {
        route: &route.name,
        target: reaches_target.then(|| (&*target.host, port_of(target))),
    };
    let Decision { client, refusal } = clients.authorize(identity, &asked);
    ctx.client = client;
    let problem = match (throttled, refusal) {
        // Only `report` mode gets here throttled: it lets the request go on, as for any refusal.
        (Some(left), _) => Problem::auth_throttled(left.as_millis() as u64),
        (None, Some(refusal)) => problem_of(refusal, route, target, ctx),
        (None, None) => return Ok(()),
    };
    let client = client_label(ctx.client.as_deref());
    match clients.mode {
        ClientsMode::Enforce => {
            metrics
                .client_denials
                .with_label_values(&["enforce", problem.code, client])
                .inc();
            Err(problem)
        }
        ClientsMode::Report => {
            metrics
                .client_denials
                .with_label_values(&["report", problem.code, client])
                .inc();
            ctx.seen.authz = Some(WOULD_DENY);
            Ok(())
        }
    }
}

/// The port the client's target is on: as written (a CONNECT always writes it), or its
/// scheme's.
fn port_of(target: &Target<'_>) -> u16 {
    let default = if target.scheme == Some(Scheme::Https) {
        443
    } else {
        80
    };
    target.port.unwrap_or(default)
}

/// The answer to `refusal`. No detail quotes what the caller sent.
fn problem_of(refusal: Refusal, route: &Route, target: &Target<'_>, ctx: &RequestCtx) -> Problem {
    let client = ctx.client.as_ref().map_or("", |c| &*c.name);
    match refusal {
        Refusal::AuthRequired(failure) => {
            let failed = failure.map(|f| match f {
                crate::clients::Failure::BadToken => "the token presented belongs to no client",
                crate::clients::Failure::BadBasic => {
                    "the name and token of Proxy-Authorization match no client"
                }
                crate::clients::Failure::UnknownCert => {
                    "the client certificate names no listed client"
                }
                crate::clients::Failure::WrongAddress => {
                    "the client may not connect from this address (its cidrs)"
                }
                crate::clients::Failure::Malformed => "the credential header cannot be read",
            });
            // Proxy form and CONNECT speak to sluice as a proxy (407, Proxy-Authorization);
            // gateway form speaks to it as a server (401, the route's header).
            if target.form == Form::Origin {
                let detail = match (failed, &route.config.client_token) {
                    (Some(why), _) => why.to_string(),
                    (None, Some(header)) => {
                        format!("identify with your sluice token in the {header} header")
                    }
                    (None, None) => "identify with Proxy-Authorization, a client certificate, or from a listed address".to_string(),
                };
                Problem::client_auth_required(&detail)
            } else {
                Problem::proxy_auth_required(failed.unwrap_or(
                    "identify with Proxy-Authorization (http://name:token@sluice), a client certificate, or from a listed address",
                ))
            }
        }
        Refusal::RouteDenied => Problem::route_denied(client, &route.name),
        Refusal::DestinationDenied => Problem::destination_denied(format!(
            "client {client:?} may not reach {}:{} (its destinations)",
            target.host,
            port_of(target)
        )),
    }
}
