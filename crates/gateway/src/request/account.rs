//! Accounting: the last step of every request, whatever its fate. It writes the access-log
//! line and the request's metrics.

use std::borrow::Cow;

use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::ErrorType;

use super::{Failure, Gateway, RequestCtx};
use crate::metrics::{Metrics, NO_ROUTE};
pub(crate) use crate::problem::{describe_failures, ConnectFailure};

/// Whether the member's response was cut after its head reached the client (a body shorter
/// than its `Content-Length`, a connection closed mid-chunk). The status already sent says
/// nothing of it; the client can only see its connection cut. A head the gateway wrote
/// itself (its 504 for a read timeout, its 502 for an answer that is not HTTP) is no member's
/// response cut short.
fn truncated(session: &Session, e: &Error, ctx: &RequestCtx) -> bool {
    ctx.upstream_answered
        && ctx.seen.answered.is_none()
        && crate::headers::final_head_written(session)
        && e.esource() == &ErrorSource::Upstream
}

/// The last step of a request that went through Pingora: its durations and the members'
/// attempt counts, which only a request has (a tunnel lives for minutes, which would drown
/// the latencies; its member is counted when it connects), then [`record`].
pub(crate) fn finish(gateway: &Gateway, session: &Session, e: Option<&Error>, ctx: &RequestCtx) {
    let secs = ctx.started.elapsed().as_secs_f64();
    let status = session
        .response_written()
        .map(|r| r.status.as_u16())
        .unwrap_or(0);
    match &ctx.route {
        Some(route) => {
            let member = ctx.member();
            if let Some(member) = member {
                match (e, ctx.failure) {
                    (
                        _,
                        Some(
                            Failure::Unreachable
                            | Failure::NoMember
                            | Failure::Denied(_)
                            | Failure::Refused,
                        ),
                    ) => {}
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
        }
        None => gateway.metrics.no_route_duration.observe(secs),
    }
    let req = session.req_header();
    let (authority, path) = ctx.target.authority_and_path(req);
    let (error, detail) = error_of(session, e, ctx, status);
    record(
        &gateway.metrics,
        ctx,
        &Ended {
            method: req.method.as_str(),
            authority,
            path,
            query: req.uri.query(),
            status,
            client: session.client_addr().and_then(|a| a.as_inet()).copied(),
            bytes_in: session.as_downstream().body_bytes_read() as u64,
            bytes_out: session.as_downstream().body_bytes_sent() as u64,
            user_agent: req
                .headers
                .get(http::header::USER_AGENT)
                .and_then(|v| v.to_str().ok()),
            error,
            detail,
            tunnel: None,
        },
    );
}

/// What the last step needs to know of a request or tunnel that its [`RequestCtx`] does not
/// hold: what the client sent and got.
pub(crate) struct Ended<'a> {
    pub(crate) method: &'a str,
    /// As routed: the absolute form's or CONNECT's authority, else `Host`.
    pub(crate) authority: &'a str,
    /// As routed and charged; empty for a tunnel.
    pub(crate) path: &'a str,
    pub(crate) query: Option<&'a str>,
    /// The status the client got; 0 when it got none.
    pub(crate) status: u16,
    pub(crate) client: Option<std::net::SocketAddr>,
    /// Body bytes read from and sent to the client (a tunnel's bytes up and down).
    pub(crate) bytes_in: u64,
    pub(crate) bytes_out: u64,
    pub(crate) user_agent: Option<&'a str>,
    /// One of sluice's codes, and more on it (never request bytes).
    pub(crate) error: Option<&'static str>,
    pub(crate) detail: Option<Cow<'static, str>>,
    /// A tunnel's bytes up and down, once it was open.
    pub(crate) tunnel: Option<(u64, u64)>,
}

/// The last step of every request and tunnel, whatever its fate: the request and byte
/// counts, the access-log line and the span.
pub(crate) fn record(metrics: &Metrics, ctx: &RequestCtx, ended: &Ended<'_>) {
    let elapsed = ctx.started.elapsed();
    let route_name = ctx.route.as_ref().map_or(NO_ROUTE, |r| &*r.name);
    // Through the route's kept handles: no label lookup per request.
    match &ctx.route {
        Some(route) => {
            route.requests.inc(&metrics.requests, ended.status);
            // A tunnel's life is no latency to chart.
            let latency = ended.tunnel.is_none().then_some(elapsed);
            route.history.record(ended.status, latency);
            route.bytes[0].inc_by(ended.bytes_in);
            route.bytes[1].inc_by(ended.bytes_out);
        }
        None => crate::metrics::requests_of(&metrics.requests, NO_ROUTE, ended.status).inc(),
    }
    if ctx.seen.clients {
        metrics.count_client(ctx.client.as_deref(), ended.status);
    }
    let member = ctx.member().map_or("", |m| &*m.name);
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
    let each_left = |put: &mut dyn FnMut(&str)| {
        for name in ctx.fallback.iter().flat_map(|t| &t.from) {
            put(name);
        }
    };
    let seen = &ctx.seen;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    let request_id = seen.request_id.as_ref().and_then(|v| v.to_str().ok());
    crate::logging::access(&crate::logging::AccessLine {
        route: route_name,
        method: ended.method,
        authority: ended.authority,
        path: ended.path,
        query: ended.query,
        status: ended.status,
        member,
        members_tried: Some(&each_tried),
        fallback_from: ctx.fallback.is_some().then_some(&each_left),
        attempts: ctx.tried.count() as u32,
        duration_ms: ms(elapsed),
        // Port 0: a trusted proxy's `X-Forwarded-For` names an address, not a socket.
        client: seen
            .forwarded_client
            .map(|ip| std::net::SocketAddr::new(ip, 0))
            .or(ended.client),
        bytes_in: ended.bytes_in,
        bytes_out: ended.bytes_out,
        upstream_addr: seen.upstream_addr,
        connect_ms: seen.connect.map(ms),
        ttfb_ms: seen.ttfb.map(ms),
        user_agent: ended.user_agent,
        request_id,
        trace: seen.trace.map(|t| (t.trace_id, t.span_id)),
        error: ended.error,
        detail: ended.detail.as_deref(),
        tunnel: ended.tunnel,
        client_name: ctx.client.as_ref().map(|c| &*c.name),
        authz: seen.authz,
    });
    if let Some(trace) = seen.trace.filter(|t| t.sampled() && crate::otel::enabled()) {
        crate::otel::export(&crate::otel::Finished {
            trace,
            started: std::time::SystemTime::now() - elapsed,
            method: ended.method,
            route: route_name,
            authority: ended.authority,
            path: ended.path,
            member,
            status: ended.status,
            attempts: ctx.tried.count() as u32,
            error: ended.error,
            request_id,
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
        // The fallback route's own answer, after a member's that did no work.
        Some(Failure::Refused) => return (ctx.seen.answered, None),
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
