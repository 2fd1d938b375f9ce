//! Answers made by the gateway itself: RFC 9457 problem+json with an `x-sluice-error` code.

use bytes::Bytes;
use pingora::http::ResponseHeader;

/// One gateway-made answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// HTTP status.
    pub status: u16,
    /// Stable machine-readable code, also sent as `x-sluice-error`.
    pub code: &'static str,
    /// Short, fixed summary of the code.
    pub title: &'static str,
    /// What happened to this request.
    pub detail: String,
}

impl Problem {
    /// 404: no route matches.
    pub fn no_route() -> Problem {
        Problem {
            status: 404,
            code: "no_route",
            title: "No route matches the request",
            detail: "no route matches this host, path and method".into(),
        }
    }
    /// 405: CONNECT while no route allows it.
    pub fn method_not_allowed(detail: &str) -> Problem {
        Problem {
            status: 405,
            code: "method_not_allowed",
            title: "Method not allowed",
            detail: detail.into(),
        }
    }
    /// 503: the pool has no eligible member.
    pub fn no_member() -> Problem {
        Problem {
            status: 503,
            code: "no_member",
            title: "No eligible upstream member",
            detail: "the route's pool is empty or all its members are down".into(),
        }
    }
    /// 502: every attempt failed to connect.
    pub fn unreachable(attempts: u32) -> Problem {
        Problem {
            status: 502,
            code: "upstream_unreachable",
            title: "Upstream unreachable",
            detail: format!("{attempts} connection attempt(s) failed"),
        }
    }
    /// 504: the member stopped answering within `read_timeout`.
    pub fn upstream_timeout() -> Problem {
        Problem {
            status: 504,
            code: "upstream_timeout",
            title: "Upstream timed out",
            detail: "the member did not answer within read_timeout".into(),
        }
    }
    /// 502: the member broke the exchange after the connection was made.
    pub fn upstream_error() -> Problem {
        Problem {
            status: 502,
            code: "upstream_error",
            title: "Upstream error",
            detail: "the exchange with the member failed after connecting; it was not retried"
                .into(),
        }
    }
    /// 400: the request could not be read.
    pub fn bad_request() -> Problem {
        Problem {
            status: 400,
            code: "bad_request",
            title: "Bad request",
            detail: "the request could not be read".into(),
        }
    }
    /// 500: a bug in sluice.
    pub fn internal() -> Problem {
        Problem {
            status: 500,
            code: "internal",
            title: "Internal error",
            detail: "sluice failed to handle the request".into(),
        }
    }
}

/// The response head and body for `p` on `route`.
pub fn render(p: &Problem, route: Option<&str>) -> (ResponseHeader, Bytes) {
    let body = serde_json::json!({
        "type": format!("urn:sluice:error:{}", p.code),
        "title": p.title,
        "status": p.status,
        "detail": p.detail,
        "route": route,
    });
    let body = Bytes::from(body.to_string());
    let mut h = ResponseHeader::build(p.status, Some(4)).expect("valid status");
    // These names and values are static and valid; inserting them cannot fail.
    let _ = h.insert_header("content-type", "application/problem+json");
    let _ = h.insert_header("x-sluice-error", p.code);
    let _ = h.insert_header("content-length", body.len().to_string());
    let _ = h.insert_header("cache-control", "no-store");
    (h, body)
}
