//! Accounting: the last step of every request, whatever its fate. It writes the access-log
//! line and the request's metrics.

use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::ErrorType;

use super::{Failure, Gateway, RequestCtx};
use crate::metrics::NO_ROUTE;

/// Whether the member's response was cut after its head reached the client (a body shorter
/// than its `Content-Length`, a connection closed mid-chunk). The status already sent says
/// nothing of it; the client can only see its connection cut. A head the gateway wrote
/// itself (its 504 for a read timeout, its 502 for an answer that is not HTTP) is no member's
/// response cut short.
fn truncated(session: &Session, e: &Error, ctx: &RequestCtx) -> bool {
    ctx.upstream_answered
        && ctx.seen.answered.is_none()
        && session.response_written().is_some()
        && e.esource() == &ErrorSource::Upstream
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

    let bytes_in = session.as_downstream().body_bytes_read() as u64;
    let bytes_out = session.as_downstream().body_bytes_sent() as u64;
    if let Some(route) = &ctx.route {
        route.bytes[0].inc_by(bytes_in);
        route.bytes[1].inc_by(bytes_out);
    }

    let req = session.req_header();
    let (authority, path) = ctx.target.authority_and_path(req);
    let member = ctx.member().map_or("", |m| &*m.name);
    let (error, detail) = error_of(session, e, ctx, status);
    let members = ctx.route.as_ref().map(|r| &r.members);
    let each_tried = |put: &mut dyn FnMut(&str)| {
        if let Some(members) = members {
            for i in ctx.tried.iter() {
                if let Some(m) = members.get(i) {
                    put(&m.name);
                }
            }
        }
    };
    let seen = &ctx.seen;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    crate::logging::access(&crate::logging::AccessLine {
        route: route_name,
        method: req.method.as_str(),
        authority,
        path,
        query: req.uri.query(),
        status,
        member,
        members_tried: Some(&each_tried),
        attempts: ctx.tried.count() as u32,
        duration_ms: ms(elapsed),
        client: session.client_addr().and_then(|a| a.as_inet()).copied(),
        bytes_in,
        bytes_out,
        upstream_addr: seen.upstream_addr,
        connect_ms: seen.connect.map(ms),
        ttfb_ms: seen.ttfb.map(ms),
        user_agent: req
            .headers
            .get(http::header::USER_AGENT)
            .and_then(|v| v.to_str().ok()),
        request_id: seen.request_id.as_ref().and_then(|v| v.to_str().ok()),
        trace: seen.trace.map(|t| (t.trace_id, t.span_id)),
        error,
        detail,
        tunnel: None,
    });
    if let Some(trace) = seen.trace.filter(|t| t.sampled() && crate::otel::enabled()) {
        crate::otel::export(&crate::otel::Finished {
            trace,
            started: std::time::SystemTime::now() - elapsed,
            method: req.method.as_str(),
            route: route_name,
            authority,
            path,
            member,
            status,
            attempts: ctx.tried.count() as u32,
            error,
            request_id: seen.request_id.as_ref().and_then(|v| v.to_str().ok()),
        });
    }
}

/// The access line's `error` (one of sluice's codes, README "Errors") and `detail` (Pingora's
/// error type, or the reason of a TLS failure; never request bytes).
fn error_of(
    session: &Session,
    e: Option<&Error>,
    ctx: &RequestCtx,
    status: u16,
) -> (Option<&'static str>, Option<&'static str>) {
    match ctx.failure {
        Some(Failure::Unreachable) => {
            return match ctx.seen.tls_failure {
                Some(reason) => (Some("upstream_tls"), Some(reason)),
                None => (Some("upstream_unreachable"), ctx.seen.connect_error),
            }
        }
        Some(Failure::NoMember) => return (Some("no_member"), None),
        Some(Failure::Denied(_)) => return (Some("destination_denied"), None),
        None => {}
    }
    let Some(e) = e else {
        // The gateway's own answers (404, 429, ...) carry their problem code.
        return (ctx.seen.answered, None);
    };
    let kind = e.etype();
    let detail = Some(kind.as_str());
    let code = if status == 101 && ctx.websocket && kind == &ErrorType::ReadTimedout {
        // An open WebSocket that went quiet for read_timeout: closed by the idle rule, like a
        // tunnel, not cut short.
        "idle_timeout"
    } else if truncated(session, e, ctx) {
        "upstream_truncated"
    } else {
        code_of(e)
    };
    (Some(code), detail)
}

/// sluice's code for a Pingora error (README "Errors" has the table).
fn code_of(e: &Error) -> &'static str {
    use ErrorType::*;
    let kind = e.etype();
    match e.esource() {
        ErrorSource::Upstream => match kind {
            ReadTimedout | WriteTimedout => "upstream_timeout",
            ConnectionClosed | ReadError | WriteError => "upstream_closed",
            TLSHandshakeFailure | TLSHandshakeTimedout | InvalidCert | HandshakeError => {
                "upstream_tls"
            }
            ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError | BindError
            | SocketError | ConnectProxyFailure => "upstream_unreachable",
            InvalidHTTPHeader | H1Error | H2Error | InvalidH2 | H2Downgrade => {
                "upstream_bad_response"
            }
            HTTPStatus(_) => "upstream_error",
            _ => "upstream_error",
        },
        ErrorSource::Downstream => match kind {
            ConnectionClosed | ReadError | WriteError => "client_closed",
            ReadTimedout | WriteTimedout => "client_timeout",
            _ => "bad_request",
        },
        _ => "internal",
    }
}

/// The reason a connect failure was the TLS handshake's, as a fixed phrase: Pingora keeps
/// rustls's error only as text in the error's context (`TLS connect() failed: ... invalid peer
/// certificate: UnknownIssuer, SNI: ...`), which may also name the host.
pub(super) fn tls_failure(e: &Error) -> Option<&'static str> {
    use ErrorType::*;
    if !matches!(
        e.etype(),
        TLSHandshakeFailure | TLSHandshakeTimedout | InvalidCert | HandshakeError
    ) {
        return None;
    }
    if e.etype() == &TLSHandshakeTimedout {
        return Some("the TLS handshake timed out");
    }
    let context = e.context.as_ref().map_or("", |c| c.as_str());
    const REASONS: &[(&str, &str)] = &[
        ("UnknownIssuer", "certificate verify failed: unknown issuer"),
        ("NotValidForName", "certificate verify failed: wrong name"),
        (
            "not valid for name",
            "certificate verify failed: wrong name",
        ),
        ("NotValidYet", "certificate verify failed: not yet valid"),
        ("not valid yet", "certificate verify failed: not yet valid"),
        ("Expired", "certificate verify failed: expired"),
        ("expired", "certificate verify failed: expired"),
        ("Revoked", "certificate verify failed: revoked"),
        ("BadSignature", "certificate verify failed: bad signature"),
        ("invalid peer certificate", "certificate verify failed"),
        ("AlertReceived", "the member sent a TLS alert"),
        ("received fatal alert", "the member sent a TLS alert"),
        (
            "PeerIncompatible",
            "no TLS version or cipher suite in common",
        ),
        (
            "peer is incompatible",
            "no TLS version or cipher suite in common",
        ),
        ("InvalidMessage", "the member does not speak TLS"),
        ("corrupt message", "the member does not speak TLS"),
    ];
    Some(
        REASONS
            .iter()
            .find(|(needle, _)| context.contains(needle))
            .map_or("the TLS handshake failed", |(_, reason)| reason),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failures_get_a_fixed_reason() {
        let e = Error::explain(
            ErrorType::TLSHandshakeFailure,
            "TLS connect() failed: TLSHandshakeFailure context: tls connect error cause: invalid peer certificate: UnknownIssuer, SNI: secret.example",
        );
        assert_eq!(
            tls_failure(&e),
            Some("certificate verify failed: unknown issuer")
        );
        let e = Error::explain(
            ErrorType::TLSHandshakeFailure,
            "invalid peer certificate: certificate expired: verification time 2, but certificate is not valid after 1",
        );
        assert_eq!(tls_failure(&e), Some("certificate verify failed: expired"));
        let e = Error::explain(ErrorType::ConnectRefused, "refused");
        assert_eq!(tls_failure(&e), None);
    }
}
