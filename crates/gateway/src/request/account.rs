//! Accounting: the last step of every request, whatever its fate. It writes the access-log
//! line and the request's metrics.

use std::borrow::Cow;

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
        detail: detail.as_deref(),
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

/// The access line's `error` (one of sluice's codes, docs/operations.md "Access log") and `detail` (Pingora's
/// error type, the reason of a TLS failure, or why each connection attempt failed; never
/// request bytes).
fn error_of(
    session: &Session,
    e: Option<&Error>,
    ctx: &RequestCtx,
    status: u16,
) -> (Option<&'static str>, Option<Cow<'static, str>>) {
    match ctx.failure {
        Some(Failure::Unreachable) => {
            // The last attempt's failure decides the code, all of them the detail.
            return match ctx.seen.connect_failures.last() {
                Some(ConnectFailure::Tls(reason)) => (Some("upstream_tls"), Some((*reason).into())),
                _ => (
                    Some("upstream_unreachable"),
                    Some(describe_failures(&ctx.seen.connect_failures).into()),
                ),
            };
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
    let detail = Some(kind.as_str().into());
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

/// sluice's code for a Pingora error (docs/operations.md, "Access log", has the table).
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

/// Why one connection attempt failed, as the client and the access log are told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnectFailure {
    /// The member (or the client's destination) refused the connection.
    Refused,
    /// No answer within `connect_timeout`.
    TimedOut,
    /// Its name did not resolve.
    Dns,
    /// The connection was reset, or closed, while it was being made.
    Reset,
    /// No route to the host.
    NoRoute,
    /// The TLS handshake failed, for this reason ([`tls_failure`]).
    Tls(&'static str),
    /// Anything else.
    Other,
}

impl std::fmt::Display for ConnectFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectFailure::Refused => f.write_str("refused"),
            ConnectFailure::TimedOut => f.write_str("timed out"),
            ConnectFailure::Dns => f.write_str("DNS: the name did not resolve"),
            ConnectFailure::Reset => f.write_str("reset"),
            ConnectFailure::NoRoute => f.write_str("no route to host"),
            ConnectFailure::Tls(reason) => write!(f, "TLS: {reason}"),
            ConnectFailure::Other => f.write_str("connection failed"),
        }
    }
}

/// Why a connect failed, from Pingora's error: its type, else the system's error under it.
pub(crate) fn connect_failure(e: &Error) -> ConnectFailure {
    use std::io::ErrorKind;
    let io = io_kind(e);
    if matches!(
        io,
        Some(ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe)
    ) {
        return ConnectFailure::Reset;
    }
    if let Some(reason) = tls_failure(e) {
        return ConnectFailure::Tls(reason);
    }
    match (e.etype(), io) {
        (ErrorType::ConnectRefused, _) | (_, Some(ErrorKind::ConnectionRefused)) => {
            ConnectFailure::Refused
        }
        (ErrorType::ConnectTimedout, _) | (_, Some(ErrorKind::TimedOut)) => {
            ConnectFailure::TimedOut
        }
        (ErrorType::ConnectNoRoute, _) | (_, Some(ErrorKind::HostUnreachable)) => {
            ConnectFailure::NoRoute
        }
        (ErrorType::ConnectionClosed, _) | (_, Some(ErrorKind::UnexpectedEof)) => {
            ConnectFailure::Reset
        }
        _ => ConnectFailure::Other,
    }
}

/// The kind of the system error under `e`, if there is one.
fn io_kind(e: &Error) -> Option<std::io::ErrorKind> {
    let mut cause = e.cause.as_deref();
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        cause = c.downcast_ref::<Error>().and_then(|e| e.cause.as_deref());
    }
    None
}

/// The reasons of `failures`, in order: `refused; timed out`.
pub(crate) fn describe_failures(failures: &[ConnectFailure]) -> String {
    let mut out = String::new();
    for (i, f) in failures.iter().enumerate() {
        if i > 0 {
            out.push_str("; ");
        }
        use std::fmt::Write;
        let _ = write!(out, "{f}");
    }
    out
}

/// The reason a connect failure was the TLS handshake's, as a fixed phrase: Pingora keeps
/// rustls's error only as text in the error's context (`TLS connect() failed: ... invalid peer
/// certificate: UnknownIssuer, SNI: ...`), which may also name the host.
fn tls_failure(e: &Error) -> Option<&'static str> {
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

    #[test]
    fn connect_failures_say_why() {
        let io = |kind| std::io::Error::from(kind);
        let cases = [
            (
                Error::explain(ErrorType::ConnectRefused, "x"),
                ConnectFailure::Refused,
            ),
            (
                Error::explain(ErrorType::ConnectTimedout, "x"),
                ConnectFailure::TimedOut,
            ),
            (
                Error::because(
                    ErrorType::ConnectError,
                    "x",
                    io(std::io::ErrorKind::ConnectionReset),
                ),
                ConnectFailure::Reset,
            ),
            (
                Error::because(
                    ErrorType::ConnectError,
                    "x",
                    io(std::io::ErrorKind::ConnectionRefused),
                ),
                ConnectFailure::Refused,
            ),
            (
                Error::explain(ErrorType::TLSHandshakeFailure, "received corrupt message"),
                ConnectFailure::Tls("the member does not speak TLS"),
            ),
        ];
        for (e, want) in cases {
            assert_eq!(connect_failure(&e), want, "{e}");
        }
        assert_eq!(
            describe_failures(&[ConnectFailure::Refused, ConnectFailure::Dns]),
            "refused; DNS: the name did not resolve"
        );
    }
}
