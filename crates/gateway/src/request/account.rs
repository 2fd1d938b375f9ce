//! Accounting: the last step of every request, whatever its fate. It writes the access-log
//! line and the request's metrics.

use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::ErrorType;

use super::{Failure, Gateway, RequestCtx};
use crate::metrics::NO_ROUTE;

/// Whether the member's response was cut after its head reached the client (a body shorter
/// than its `Content-Length`, a connection closed mid-chunk). The status already sent says
/// nothing of it; the client can only see its connection cut.
fn truncated(session: &Session, e: &Error) -> bool {
    session.response_written().is_some() && e.esource() == &ErrorSource::Upstream
}

pub(crate) fn finish(gateway: &Gateway, session: &Session, e: Option<&Error>, ctx: &RequestCtx) {
    let elapsed = ctx.started.elapsed();
    let status = session
        .response_written()
        .map(|r| r.status.as_u16())
        .unwrap_or(0);
    let route_name = ctx.route.as_ref().map_or(NO_ROUTE, |r| &*r.name);

    let secs = elapsed.as_secs_f64();
    // Through the route's kept handles: no label lookup per request.
    match &ctx.route {
        Some(route) => {
            let member = ctx.member();
            if let Some(member) = member {
                match (e, ctx.failure) {
                    (_, Some(Failure::Unreachable | Failure::NoMember | Failure::Denied(_))) => {}
                    (None, _) => member.attempts_ok.inc(),
                    (Some(_), _) => member.attempts_error.inc(),
                }
            }
            match member.filter(|_| ctx.upstream_answered) {
                Some(member) => {
                    route.duration.observe(secs);
                    member.duration.observe(secs);
                }
                None => route.duration_gateway.observe(secs),
            }
            route.requests.inc(&gateway.metrics.requests, status);
        }
        None => {
            gateway.metrics.no_route_duration.observe(secs);
            crate::metrics::requests_of(&gateway.metrics.requests, NO_ROUTE, status).inc();
        }
    }

    let req = session.req_header();
    let (authority, path) = ctx.target.authority_and_path(req);
    let member = ctx.member().map_or("", |m| &*m.name);
    crate::logging::access(&crate::logging::AccessLine {
        route: route_name,
        method: req.method.as_str(),
        authority,
        path,
        status,
        member,
        attempts: ctx.tried.count() as u32,
        duration_ms: elapsed.as_secs_f64() * 1000.0,
        // Our own failures say what they were; others name Pingora's error type.
        error: match ctx.failure {
            Some(Failure::Unreachable) => Some("upstream_unreachable"),
            Some(Failure::NoMember) => Some("no_member"),
            Some(Failure::Denied(_)) => Some("destination_denied"),
            None => e.map(|e| {
                if status == 101 && ctx.websocket && e.etype() == &ErrorType::ReadTimedout {
                    // An open WebSocket that went quiet for read_timeout: closed by the idle
                    // rule, like a tunnel, not cut short.
                    "idle_timeout"
                } else if truncated(session, e) {
                    "upstream_truncated"
                } else {
                    e.etype().as_str()
                }
            }),
        },
        detail: None,
        tunnel: None,
    });
}
