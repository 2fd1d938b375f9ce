//! Requests whose head Pingora's parser refuses: a garbage request line,
//! invalid bytes in a field, conflicting framing (two different `Content-Length`s, a final
//! `Transfer-Encoding` other than chunked), a `Host` that disagrees with the request target.
//!
//! Pingora rejects these while reading the head, before any `ProxyHttp` hook with a `Session`
//! runs, and used to answer a bare `400` with `Server: Pingora`. Its `request_error_filter`
//! hook (a patch of ours, `third_party/PATCHES.md`) hands them here instead, for every request
//! of a connection, keep-alive and pipelined ones included. They get the gateway's own
//! problem+json, one access-log line with route `-` and a `detail` saying what was wrong, and a
//! count in `sluice_requests_total{route="-"}`. Pingora closes the connection afterwards: what
//! follows a head that cannot be read has no trustworthy framing.
//!
//! The detail is one of a fixed set of phrases, never bytes of the request: Pingora's error
//! context quotes the raw head (`buf: ...`), which may hold credentials.

use std::time::{Duration, Instant};

use pingora::prelude::*;
use pingora::protocols::http::ServerSession;

use super::Gateway;
use crate::headers::X_REQUEST_ID;
use crate::metrics::UNPARSED;
use crate::problem::{self, Problem};

/// How long the answer may take to write: a client that does not read gets cut, not waited on.
const WRITE_WITHIN: Duration = Duration::from_secs(1);

/// Answers, logs and counts a request whose head Pingora refused with `e`.
pub(crate) async fn refuse(gateway: &Gateway, session: &mut ServerSession, e: &Error) {
    let started = Instant::now();
    let problem = problem_for(e, gateway.max_header_bytes);
    let (mut head, body) = problem::render(&problem, None);
    // The head did not parse, so the client's own id cannot be trusted: a new one.
    let request_id = crate::trace::request_id(None);
    let _ = head.insert_header(&X_REQUEST_ID, request_id.clone());
    // A failure to write leaves nobody to answer; the status below says what was sent.
    let _ = tokio::time::timeout(WRITE_WITHIN, session.write_error_response(head, body)).await;
    // The status sent, 0 when none could be (as for every access line). A head sent whose
    // body then failed (a HEAD request's, or a client gone) still counts as sent.
    let status = session.response_written().map_or(0, |r| r.status.as_u16());
    let code = http::StatusCode::from_u16(status).ok();
    gateway
        .metrics
        .requests
        .with_label_values(&[UNPARSED, code.as_ref().map_or("0", |c| c.as_str())])
        .inc();
    gateway
        .metrics
        .unparsed_duration
        .observe(started.elapsed().as_secs_f64());
    crate::logging::access(&crate::logging::AccessLine {
        route: UNPARSED,
        // Nothing of the head is trusted enough to log: it did not parse.
        method: "",
        authority: "",
        path: "",
        status,
        member: "",
        attempts: 0,
        duration_ms: started.elapsed().as_secs_f64() * 1000.0,
        client: session.client_addr().and_then(|a| a.as_inet()).copied(),
        request_id: request_id.to_str().ok(),
        error: Some(problem.code),
        detail: Some(&problem.detail),
        ..Default::default()
    });
}

/// The answer to a head refused with `e`: `431 header_too_large` for a head over Pingora's own
/// size or field-count limit (sluice's smaller `limits.max_header_bytes` is checked once a head
/// parses), `400 bad_request` otherwise.
fn problem_for(e: &Error, max_header_bytes: usize) -> Problem {
    let context = e.context.as_ref().map_or("", |c| c.as_str());
    let parse = e
        .cause
        .as_deref()
        .and_then(|c| c.downcast_ref::<httparse::Error>());
    if context.starts_with("Request header larger than")
        || parse == Some(&httparse::Error::TooManyHeaders)
    {
        return Problem::header_too_large_to_read(max_header_bytes);
    }
    Problem::bad_request_because(detail(context, parse))
}

/// What was wrong with the head, in a fixed phrase.
fn detail(context: &str, parse: Option<&httparse::Error>) -> &'static str {
    if let Some(parse) = parse {
        return match parse {
            httparse::Error::Token => "the request line is malformed",
            httparse::Error::Version => "the HTTP version is malformed or not supported",
            httparse::Error::HeaderName => "a header field name has invalid characters",
            httparse::Error::HeaderValue => "a header field value has invalid characters",
            httparse::Error::NewLine => "a line of the request head does not end properly",
            httparse::Error::Status | httparse::Error::TooManyHeaders => {
                "the request head is malformed"
            }
        };
    }
    // Pingora 0.9.1's own phrases (pingora-core src/protocols/http/authority.rs, v1/server.rs,
    // v1/common.rs; pingora-http src/lib.rs): kept when they quote nothing of the request.
    // Those that do quote a value are matched by their start and given a phrase of ours.
    const OWN: &[&str] = &[
        "multiple Host header fields",
        "Host header differs from URI authority",
        "Host header differs from request-target authority",
        "Host header differs from CONNECT request target",
        "userinfo in Host header",
        "userinfo in URI authority",
        "userinfo in request target",
        "ambiguous HTTP absolute-form request target",
        "ambiguous CONNECT request target",
        "unparseable absolute-form authority",
        "missing Host header for absolute-form CONNECT request target",
        "missing Host header for malformed CONNECT request target",
        "invalid Content-Length header",
        "invalid Content-Length header encoding",
        "invalid Transfer-Encoding header",
        "HTTP/1.0 requests cannot include Transfer-Encoding header",
        "non-chunked final Transfer-Encoding",
        "invalid method",
    ];
    if let Some(own) = OWN.iter().find(|own| **own == context) {
        return own;
    }
    if context.starts_with("invalid Content-Length header value")
        || context.starts_with("negative Content-Length header value")
        || (context.starts_with("Content-Length ") && context.ends_with("platform maximum"))
    {
        return "invalid Content-Length header";
    }
    if context.starts_with("invalid uri") {
        return "the request target is not a valid URI";
    }
    "the request head is malformed"
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora::ErrorType::InvalidHTTPHeader;

    #[test]
    fn the_detail_never_quotes_the_request() {
        // Pingora's context for a parse failure quotes the head; only the cause is used.
        let e = Error::because(
            InvalidHTTPHeader,
            "buf: GET / HTTP/1.1\\r\\nAuthorization: Bearer secret",
            httparse::Error::HeaderValue,
        );
        let p = problem_for(&e, 65536);
        assert_eq!(
            (p.status, p.code, &*p.detail),
            (
                400,
                "bad_request",
                "a header field value has invalid characters"
            )
        );
        let e = Error::explain(
            InvalidHTTPHeader,
            "invalid Content-Length header value: secret",
        );
        assert_eq!(
            problem_for(&e, 65536).detail,
            "invalid Content-Length header"
        );
        let e = Error::explain(InvalidHTTPHeader, "invalid uri /secret");
        assert!(!problem_for(&e, 65536).detail.contains("secret"));
        let e = Error::explain(InvalidHTTPHeader, "something new: secret");
        assert_eq!(
            problem_for(&e, 65536).detail,
            "the request head is malformed"
        );
    }

    #[test]
    fn pingoras_own_phrases_are_kept() {
        let e = Error::explain(InvalidHTTPHeader, "multiple Host header fields");
        assert_eq!(problem_for(&e, 65536).detail, "multiple Host header fields");
    }

    #[test]
    fn a_head_over_pingoras_limits_gets_431() {
        let e = Error::explain(InvalidHTTPHeader, "Request header larger than 1048575");
        let p = problem_for(&e, 65536);
        assert_eq!((p.status, p.code), (431, "header_too_large"));
        let e = Error::because(InvalidHTTPHeader, "buf: x", httparse::Error::TooManyHeaders);
        assert_eq!(problem_for(&e, 65536).status, 431);
    }
}
