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
    /// For 429: milliseconds until the request's cost fits, if no other traffic arrives.
    pub retry_after_ms: Option<u64>,
}

impl Problem {
    /// 404: no route matches.
    pub fn no_route() -> Problem {
        Problem {
            status: 404,
            code: "no_route",
            title: "No route matches the request",
            detail: "no route matches this host, path and method".into(),
            retry_after_ms: None,
        }
    }
    /// 405: CONNECT while no route allows it.
    pub fn method_not_allowed(detail: &str) -> Problem {
        Problem {
            status: 405,
            code: "method_not_allowed",
            title: "Method not allowed",
            detail: detail.into(),
            retry_after_ms: None,
        }
    }
    /// 429: every member is at its own quota or cooling down (SPEC §8); `retry_after_ms`
    /// is the time until the first of them admits the request.
    pub fn members_busy(retry_after_ms: u64) -> Problem {
        Problem {
            status: 429,
            code: "quota_exceeded",
            title: "Quota exceeded",
            detail: "every member of the pool is at its own quota or cooling down".into(),
            retry_after_ms: Some(retry_after_ms),
        }
    }
    /// 429: the route, or every member it could use, holds its `max_in_flight` requests;
    /// `retry_after_ms` is a guess (a release may come any moment), the interval at which a
    /// waiting request asks again.
    pub fn concurrency_exceeded(retry_after_ms: u64) -> Problem {
        Problem {
            status: 429,
            code: "concurrency_exceeded",
            title: "Concurrency exceeded",
            detail:
                "the route, or every member it could use, has its max_in_flight requests in flight"
                    .into(),
            retry_after_ms: Some(retry_after_ms),
        }
    }
    /// 429: a quota window refused the request.
    pub fn quota_exceeded(window: &str, retry_after_ms: u64) -> Problem {
        Problem {
            status: 429,
            code: "quota_exceeded",
            title: "Quota exceeded",
            detail: format!("the quota window {window:?} has no room for this request's cost"),
            retry_after_ms: Some(retry_after_ms),
        }
    }
    /// 503: the quota store is unreachable and the route fails closed.
    pub fn store_unavailable() -> Problem {
        Problem {
            status: 503,
            code: "store_unavailable",
            title: "Quota store unavailable",
            detail:
                "the quota could not be checked and the route is configured on_store_error: closed"
                    .into(),
            retry_after_ms: None,
        }
    }
    /// 429: the memory store holds as many quota keys, or log entries, as it keeps for the
    /// route, none of them idle, and this request would add one. It is refused rather than
    /// admitted unmetered.
    pub fn quota_keys_exhausted() -> Problem {
        Problem {
            status: 429,
            code: "quota_keys_exhausted",
            title: "Quota keys exhausted",
            detail: "the store is full: the route holds as many quota keys (state.memory.max_keys) or entries (state.memory.max_entries) as the memory store keeps, or Redis is at its maxmemory, each entry still counting; there is room again once some leave their windows".into(),
            retry_after_ms: None,
        }
    }
    /// 503: the pool has no eligible member.
    pub fn no_member() -> Problem {
        Problem {
            status: 503,
            code: "no_member",
            title: "No eligible upstream member",
            detail: "the route's pool is empty or all its members are down".into(),
            retry_after_ms: None,
        }
    }
    /// 502: every attempt failed to connect.
    pub fn unreachable(attempts: u32) -> Problem {
        Problem {
            status: 502,
            code: "upstream_unreachable",
            title: "Upstream unreachable",
            detail: format!("{attempts} connection attempt(s) failed"),
            retry_after_ms: None,
        }
    }
    /// 502: the last connection attempt failed its TLS handshake; `reason` says why, e.g.
    /// "certificate verify failed: unknown issuer" (a fixed phrase, `request::account`).
    pub fn upstream_tls(reason: &str) -> Problem {
        Problem {
            status: 502,
            code: "upstream_tls",
            title: "Upstream TLS handshake failed",
            detail: reason.into(),
            retry_after_ms: None,
        }
    }
    /// 403: the egress guard refuses the client's destination (SPEC §7). `reason` names the
    /// rule that refused it (e.g. "127.0.0.1 is loopback (RFC 1122)"); nothing was contacted.
    pub fn destination_denied(reason: impl Into<String>) -> Problem {
        Problem {
            status: 403,
            code: "destination_denied",
            title: "Destination denied",
            detail: reason.into(),
            retry_after_ms: None,
        }
    }
    /// 502: every proxy member tried answered the tunnel's CONNECT with a non-2xx status.
    pub fn proxy_refused(attempts: u32) -> Problem {
        Problem {
            status: 502,
            code: "proxy_refused",
            title: "Proxy refused the tunnel",
            detail: format!("{attempts} proxy member(s) refused the CONNECT"),
            retry_after_ms: None,
        }
    }
    /// 504: the member stopped answering within `read_timeout`.
    pub fn upstream_timeout() -> Problem {
        Problem {
            status: 504,
            code: "upstream_timeout",
            title: "Upstream timed out",
            detail: "the member did not answer within read_timeout".into(),
            retry_after_ms: None,
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
            retry_after_ms: None,
        }
    }
    /// 400: the request could not be read: a malformed body, a CONNECT head that does not
    /// parse, or (with [`Problem::bad_request_because`]) a head Pingora's parser refused.
    pub fn bad_request() -> Problem {
        Problem {
            status: 400,
            code: "bad_request",
            title: "Bad request",
            detail: "the request could not be read".into(),
            retry_after_ms: None,
        }
    }
    /// 400: the request head could not be read, and `detail` says why. The detail must be a
    /// phrase of the gateway's, never bytes of the request (`request::refuse`).
    pub fn bad_request_because(detail: &str) -> Problem {
        Problem {
            detail: detail.into(),
            ..Problem::bad_request()
        }
    }
    /// 400: the request target cannot be routed as sent (see [`crate::target`]).
    pub fn bad_target(reject: crate::target::Reject) -> Problem {
        Problem {
            status: 400,
            code: reject.code(),
            title: "Bad request target",
            detail: reject.reason().into(),
            retry_after_ms: None,
        }
    }
    /// 400: an `https://` target on a route whose members would get it in cleartext.
    pub fn cleartext_https() -> Problem {
        Problem {
            status: 400,
            code: "https_in_cleartext",
            title: "https target on a cleartext route",
            detail: "an https:// target would reach this route's members in cleartext; send it through a CONNECT tunnel (HTTPS_PROXY), or route it to https members".into(),
            retry_after_ms: None,
        }
    }
    /// 504: the member stopped reading the request for `write_timeout`.
    pub fn upstream_write_timeout() -> Problem {
        Problem {
            detail: "the member stopped reading the request for write_timeout".into(),
            ..Problem::upstream_timeout()
        }
    }
    /// 431: the request head is larger than `limits.max_header_bytes`.
    pub fn header_too_large(size: usize, limit: usize) -> Problem {
        Problem {
            status: 431,
            code: "header_too_large",
            title: "Request header fields too large",
            detail: format!("the request head is {size} bytes; limits.max_header_bytes is {limit}"),
            retry_after_ms: None,
        }
    }
    /// 431: the request head has more bytes or fields than Pingora reads at all (1 MiB, or more
    /// fields than its parser takes), so its size is unknown.
    pub fn header_too_large_to_read(limit: usize) -> Problem {
        Problem {
            detail: format!(
                "the request head has more bytes or fields than the gateway reads; limits.max_header_bytes is {limit}"
            ),
            ..Problem::header_too_large(0, limit)
        }
    }
    /// 503: `limits.max_connections` client connections are open.
    pub fn too_many_connections() -> Problem {
        Problem {
            status: 503,
            code: "too_many_connections",
            title: "Too many connections",
            detail: "the gateway holds limits.max_connections client connections; try again later"
                .into(),
            retry_after_ms: None,
        }
    }
    /// 508: the request carries this instance's own `Via` entry: it left here and came back,
    /// and forwarding it again would go round until a resource ran out.
    pub fn loop_detected() -> Problem {
        Problem {
            status: 508,
            code: "loop_detected",
            title: "Loop detected",
            detail: "this request already passed through this sluice instance (its Via header names it); forwarding it again would loop".into(),
            retry_after_ms: None,
        }
    }
    /// 405: a CONNECT on a route whose tunnel could not carry what the route promises;
    /// `reason` says which part of the route needs to see the requests.
    pub fn connect_not_supported(reason: &str) -> Problem {
        Problem {
            status: 405,
            code: "connect_not_supported",
            title: "CONNECT not supported on this route",
            detail: reason.into(),
            retry_after_ms: None,
        }
    }
    /// 407: a proxy-form request or a CONNECT from a caller that no client matched, or whose
    /// credential failed (SPEC §9); the answer carries `Proxy-Authenticate`.
    pub fn proxy_auth_required(detail: &str) -> Problem {
        Problem {
            status: 407,
            code: PROXY_AUTH_REQUIRED,
            title: "Proxy authentication required",
            detail: detail.into(),
            retry_after_ms: None,
        }
    }
    /// 401: the same, for a gateway-form request; the answer carries `WWW-Authenticate`.
    pub fn client_auth_required(detail: &str) -> Problem {
        Problem {
            status: 401,
            code: CLIENT_AUTH_REQUIRED,
            title: "Client authentication required",
            detail: detail.into(),
            retry_after_ms: None,
        }
    }
    /// 403: the client may not use the route.
    pub fn route_denied(client: &str, route: &str) -> Problem {
        Problem {
            status: 403,
            code: "route_denied",
            title: "Route denied",
            detail: format!("client {client:?} may not use route {route:?} (its routes)"),
            retry_after_ms: None,
        }
    }
    /// 429: too many failed identifications from the caller's address (or its IPv6 /64);
    /// refused without trying its credentials until the cooldown ends.
    pub fn auth_throttled(retry_after_ms: u64) -> Problem {
        Problem {
            status: 429,
            code: "auth_throttled",
            title: "Too many failed identifications",
            detail: "too many failed identifications from this address: wait for Retry-After"
                .into(),
            retry_after_ms: Some(retry_after_ms),
        }
    }
    /// 500: a bug in sluice.
    pub fn internal() -> Problem {
        Problem {
            status: 500,
            code: "internal",
            title: "Internal error",
            detail: "sluice failed to handle the request".into(),
            retry_after_ms: None,
        }
    }
}

/// The code of a 407, whose answer carries `Proxy-Authenticate`.
pub const PROXY_AUTH_REQUIRED: &str = "proxy_auth_required";
/// The code of a 401, whose answer carries `WWW-Authenticate`.
pub const CLIENT_AUTH_REQUIRED: &str = "client_auth_required";

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
    /// The TLS handshake failed, for this reason: a fixed phrase, never the peer's text.
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

/// The response head and body for `p` on `route`.
pub fn render(p: &Problem, route: Option<&str>) -> (ResponseHeader, Bytes) {
    // The problem fields (RFC 9457), and `error` in the shape the OpenAI, Anthropic and Stripe
    // SDKs read: they show `error.message` and would otherwise print a bare status. The message
    // names sluice, so nobody takes the gateway's refusal for the provider's.
    let mut body = serde_json::json!({
        "type": format!("urn:sluice:error:{}", p.code),
        "title": p.title,
        "status": p.status,
        "detail": p.detail,
        "route": route,
        "error": {
            "message": format!("sluice: {}: {}", p.title, p.detail),
            "type": p.code,
            "code": p.code,
        },
    });
    if let Some(ms) = p.retry_after_ms {
        body["retry_after_ms"] = ms.into();
    }
    let body = Bytes::from(body.to_string());
    let mut h = ResponseHeader::build(p.status, Some(4)).expect("valid status");
    // These names and values are static and valid; inserting them cannot fail.
    let _ = h.insert_header("content-type", "application/problem+json");
    let _ = h.insert_header("x-sluice-error", p.code);
    let _ = h.insert_header("content-length", body.len().to_string());
    let _ = h.insert_header("cache-control", "no-store");
    (h, body)
}
