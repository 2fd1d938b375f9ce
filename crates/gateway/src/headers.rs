//! Header handling on the way through: hop-by-hop headers and `X-Forwarded-For`.

use std::net::{IpAddr, Ipv4Addr};

use http::header::{self, AsHeaderName, HeaderName};
use http::HeaderValue;
use pingora::http::{RequestHeader, ResponseHeader, StaticHeaderName};
use pingora::prelude::*;
use pingora::ErrorType;

/// The hop-by-hop headers of RFC 9110 §7.6.1 that sluice removes, besides those `Connection`
/// names. `Connection` comes first: [`strip_hop_by_hop`] reads its list only when it is there.
static HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::UPGRADE,
];

// The names sluice adds to most requests and answers, parsed once: inserting one into
// Pingora's two header maps then neither parses the name nor allocates it
// (third_party/PATCHES.md, "prebuilt header names"). They go out in lowercase, as written.
pub(crate) static X_REQUEST_ID: StaticHeaderName = StaticHeaderName::from_static("x-request-id");
pub(crate) static X_FORWARDED_FOR: StaticHeaderName =
    StaticHeaderName::from_static("x-forwarded-for");
pub(crate) static TRACEPARENT: StaticHeaderName = StaticHeaderName::from_static("traceparent");
pub(crate) static RATELIMIT: StaticHeaderName = StaticHeaderName::from_static("ratelimit");
pub(crate) static RATELIMIT_POLICY: StaticHeaderName =
    StaticHeaderName::from_static("ratelimit-policy");

/// This instance's `Via` value (RFC 9110 §7.6.3): `1.1 sluice-<random>`, drawn once per
/// process. sluice adds it to every request it forwards, and answers `508 loop_detected` to a
/// request that already carries it ([`is_own_loop`]): a request that came back to the instance
/// that sent it would otherwise go round again, each hop holding a connection, until memory or
/// file descriptors run out. The name is random so that two instances behind one balancer, or
/// one proxying through the other, never take each other for themselves.
pub(crate) fn via() -> &'static HeaderValue {
    static VIA: std::sync::LazyLock<HeaderValue> = std::sync::LazyLock::new(|| {
        let name = format!("1.1 sluice-{:016x}", fastrand::u64(..));
        HeaderValue::from_str(&name).expect("ASCII")
    });
    &VIA
}

/// Whether any `Via` entry of `headers` names this instance: the request went out from here
/// and came back.
pub(crate) fn is_own_loop(headers: &http::HeaderMap) -> bool {
    let own = via().as_bytes();
    // "1.1 sluice-…": the entry as sluice writes it, after the protocol.
    let own_name = &own[4..];
    headers.get_all(header::VIA).iter().any(|value| {
        value.as_bytes().split(|&b| b == b',').any(|entry| {
            // `received-protocol received-by [comment]`: the second token is the name.
            let mut tokens = entry
                .split(|b| b.is_ascii_whitespace())
                .filter(|t| !t.is_empty());
            tokens.next();
            tokens.next() == Some(own_name)
        })
    })
}

/// Pingora's request and response heads keep a case map beside their `HeaderMap`, so headers
/// must be removed through their own methods.
pub(crate) trait HeaderEdit {
    fn header_map(&self) -> &http::HeaderMap;
    /// A [`HeaderName`] is looked up as it is; a `&str` is parsed first.
    fn remove<'a, N: ?Sized>(&mut self, name: &'a N)
    where
        &'a N: AsHeaderName;
    /// Sets `name` to `value` alone, replacing every line of it.
    fn set(&mut self, name: HeaderName, value: HeaderValue) -> Result<()>;
}

impl HeaderEdit for RequestHeader {
    fn header_map(&self) -> &http::HeaderMap {
        &self.headers
    }
    fn remove<'a, N: ?Sized>(&mut self, name: &'a N)
    where
        &'a N: AsHeaderName,
    {
        self.remove_header(name);
    }
    fn set(&mut self, name: HeaderName, value: HeaderValue) -> Result<()> {
        self.insert_header(name, value)
    }
}

impl HeaderEdit for ResponseHeader {
    fn header_map(&self) -> &http::HeaderMap {
        &self.headers
    }
    fn remove<'a, N: ?Sized>(&mut self, name: &'a N)
    where
        &'a N: AsHeaderName,
    {
        self.remove_header(name);
    }
    fn set(&mut self, name: HeaderName, value: HeaderValue) -> Result<()> {
        self.insert_header(name, value)
    }
}

/// Removes the hop-by-hop headers of RFC 9110 §7.6.1, including those named in `Connection`.
/// `Transfer-Encoding`, `Trailer` and `Content-Length` are left to Pingora, which owns message
/// framing: a member's answer that names its `Content-Length` in `Connection` keeps its length
/// (as nginx ignores such a nomination), rather than reach the client unframed, cut off by
/// the connection's close.
pub(crate) fn strip_hop_by_hop(head: &mut impl HeaderEdit) {
    // One walk over the names present, rather than a hashed lookup per hop-by-hop name: a
    // head has a handful of names, and comparing a standard name is one integer compare,
    // where each lookup hashed it (seven lookups per head cost about 800 instructions).
    let mut present = [false; HOP_BY_HOP.len()];
    let mut any = false;
    for name in head.header_map().keys() {
        if let Some(i) = hop_by_hop_index(name) {
            present[i] = true;
            any = true;
        }
    }
    if !any {
        return;
    }
    if present[0] /* Connection */ && !only_keep_alive(head.header_map()) {
        // Several `Connection` fields are one list (RFC 9110 §5.3): every one of them names
        // fields to remove. The common case has one field, so the values are collected only
        // when there are more (cloning a parsed HeaderValue bumps a reference count; no copy).
        let mut values = head.header_map().get_all(header::CONNECTION).iter();
        let first = values.next().cloned();
        // Empty, and so no allocation, unless there are several fields.
        let rest: Vec<HeaderValue> = values.cloned().collect();
        for value in first.iter().chain(rest.iter()) {
            // Read as bytes, element by element: a value with one byte outside ASCII (obs-text,
            // which parsers accept) still names its other fields. An element that is not ASCII
            // cannot be a field name, so it names nothing.
            let names = value
                .as_bytes()
                .split(|&b| b == b',')
                .filter_map(|n| std::str::from_utf8(n.trim_ascii()).ok())
                .filter(|n| !n.is_empty() && n.is_ascii());
            for name in names {
                let is_framing = name.eq_ignore_ascii_case("transfer-encoding")
                    || name.eq_ignore_ascii_case("trailer")
                    || name.eq_ignore_ascii_case("content-length");
                // Listed names, `keep-alive` the usual one, go below with the rest of the
                // list, found by the walk above.
                let listed = HOP_BY_HOP
                    .iter()
                    .any(|h| name.eq_ignore_ascii_case(h.as_str()));
                if !is_framing && !listed {
                    head.remove(name);
                }
            }
        }
    }
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, p)| *p) {
        head.remove(name);
    }
}

/// The lengths of the [`HOP_BY_HOP`] names, one bit each: a head's usual names (`Date`,
/// `Server`, `Content-Type`, …) are told apart by their length alone, which a standard name
/// gives without its bytes being read, and only a name of a hop-by-hop name's length is
/// compared with the list (seven comparisons for every name of every head cost about 400
/// instructions a request).
const HOP_BY_HOP_LENGTHS: u32 = 1 << 2 | 1 << 7 | 1 << 10 | 1 << 16 | 1 << 18 | 1 << 19;

/// Where `name` is in [`HOP_BY_HOP`], if it is there.
fn hop_by_hop_index(name: &HeaderName) -> Option<usize> {
    let len = name.as_str().len();
    if len >= 32 || HOP_BY_HOP_LENGTHS & (1 << len) == 0 {
        return None;
    }
    HOP_BY_HOP.iter().position(|h| h == name)
}

/// Whether the head's `Connection` is one field of `keep-alive` alone, which most members send
/// on every answer: it names only a field that is on the list already, so there is no list to
/// read.
fn only_keep_alive(headers: &http::HeaderMap) -> bool {
    let mut values = headers.get_all(header::CONNECTION).iter();
    values
        .next()
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"keep-alive"))
        && values.next().is_none()
}

/// The most a replay sends again: Pingora keeps this much of a request's body to send it to
/// another member (its replay buffer), and SPEC §8 and §11 replay bodies of at most this size.
pub(crate) const REPLAYABLE_BODY: u64 = 64 * 1024;

/// Whether the request's body can be sent again whole, from the replay buffer, to another
/// member: it has not passed the buffer, and it will not, being complete or framed within it.
/// A body still arriving, of a length that may pass the buffer, is not replayed, though what
/// has arrived so far fits: the decision cannot wait for the rest.
pub(crate) fn body_fits_a_replay(session: &mut pingora::protocols::http::ServerSession) -> bool {
    if session.retry_buffer_truncated() {
        return false;
    }
    session.is_body_done()
        || content_length(&session.req_header().headers).is_some_and(|n| n <= REPLAYABLE_BODY)
}

/// The `Content-Length` that frames a message, by the rule Pingora's HTTP/1 parser frames it
/// with (RFC 9112 §6.3, RFC 9110 §8.6): every value of every `Content-Length` line, split at
/// commas, must be plain decimal digits and all equal, and then that value frames the body
/// (`5, 5` or two lines of `5` are `5`). `None` when there is no such line, or when the values
/// disagree or one is invalid, which Pingora refused before sluice saw the message. What sluice
/// reads of a body (usage reservations, draining) must agree with what Pingora frames, or a
/// client could send a body that is served but not charged.
pub(crate) fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    let mut length = None;
    for line in headers.get_all(header::CONTENT_LENGTH) {
        for value in line.as_bytes().split(|&b| b == b',') {
            let value = value.trim_ascii();
            if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let n = std::str::from_utf8(value).ok()?.parse::<u64>().ok()?;
            match length {
                None => length = Some(n),
                Some(prev) if prev != n => return None,
                Some(_) => {}
            }
        }
    }
    length
}

/// Forwards a `Content-Length` sent as a list of equal values, or as several equal lines, as
/// the one `Content-Length: N` it frames the body with (RFC 9112 §6.3: a proxy that accepts
/// such a list must forward one value). The next hop may read a list its own way: hyper's
/// server, for one, refuses `5, 5` with a 400. A plain single length is left as it is; so is
/// a message with `Transfer-Encoding`, which that framing rules (Pingora drops a request's
/// `Content-Length` then).
pub(crate) fn forward_one_content_length(head: &mut impl HeaderEdit) -> Result<()> {
    let map = head.header_map();
    let mut lines = map.get_all(header::CONTENT_LENGTH).iter();
    let Some(first) = lines.next() else {
        return Ok(());
    };
    let listed = lines.next().is_some() || first.as_bytes().contains(&b',');
    if !listed || map.contains_key(header::TRANSFER_ENCODING) {
        return Ok(());
    }
    // Pingora refused a list that does not reconcile before sluice saw the message.
    let Some(length) = content_length(map) else {
        return Ok(());
    };
    head.set(header::CONTENT_LENGTH, HeaderValue::from(length))
}

/// Whether a request asks for a WebSocket upgrade that sluice passes to the member: a GET over
/// HTTP/1.1 whose `Connection` names `upgrade` and whose `Upgrade` offers `websocket`
/// (RFC 6455 §4.1, RFC 9110 §7.8). Other upgrades (`h2c`, TLS) are stripped like any
/// hop-by-hop header, as nginx does by default: the member answers the plain request, and a
/// member that would switch to h2c behind sluice's back would leave the two sides speaking
/// different protocols.
pub(crate) fn is_websocket_upgrade(req: &RequestHeader) -> bool {
    let has_token = |name: header::HeaderName, token: &str| {
        req.headers.get_all(name).iter().any(|v| {
            v.to_str().is_ok_and(|v| {
                v.split(',').any(|t| {
                    // `Upgrade` tokens may carry a version: `websocket/13`.
                    let t = t.trim();
                    let t = t.split_once('/').map_or(t, |(name, _)| name);
                    t.eq_ignore_ascii_case(token)
                })
            })
        })
    };
    req.method == http::Method::GET
        && req.version == http::Version::HTTP_11
        && has_token(header::CONNECTION, "upgrade")
        && has_token(header::UPGRADE, "websocket")
}

/// Puts back the two hop-by-hop headers a WebSocket upgrade needs on its next hop, after
/// [`strip_hop_by_hop`] removed them with the rest: exactly `Upgrade: websocket` and
/// `Connection: upgrade` (RFC 9110 §7.8), whatever else the client listed.
pub(crate) fn keep_websocket_upgrade(head: &mut RequestHeader) -> Result<()> {
    head.insert_header(header::UPGRADE, HeaderValue::from_static("websocket"))?;
    head.insert_header(header::CONNECTION, HeaderValue::from_static("upgrade"))
}

/// Appends the client's address to `X-Forwarded-For`. Several fields are one list (RFC 9110
/// §5.3), so they become one field, in order, with the address last.
pub(crate) fn append_forwarded_for(upstream: &mut RequestHeader, ip: IpAddr) -> Result<()> {
    use std::io::Write;
    // The address first, on the stack, so that the value is allocated once at its final size:
    // a `Vec` with room to spare becomes `Bytes` through a second allocation.
    let mut addr = [0u8; 45];
    let addr_len = match ip {
        IpAddr::V4(v4) => ipv4_text(&mut addr, v4),
        IpAddr::V6(_) => {
            let mut rest = &mut addr[..];
            let _ = write!(rest, "{ip}");
            45 - rest.len()
        }
    };
    let addr = &addr[..addr_len];
    let prior = upstream.headers.get_all(X_FORWARDED_FOR.name());
    let value = if prior.iter().next().is_none() {
        HeaderValue::from_bytes(addr)
    } else {
        let prior_len: usize = prior.iter().map(|p| p.len() + 2).sum();
        let mut value = Vec::with_capacity(prior_len + addr.len());
        for p in prior.iter() {
            value.extend_from_slice(p.as_bytes());
            value.extend_from_slice(b", ");
        }
        value.extend_from_slice(addr);
        HeaderValue::from_maybe_shared(bytes::Bytes::from(value))
    }
    .or_err(ErrorType::InvalidHTTPHeader, "x-forwarded-for")?;
    upstream.insert_header(&X_FORWARDED_FOR, value)
}

/// Writes an IPv4 address as its `Display` does into `out` (15 bytes or more) and returns the
/// length: `write!` costs several times as much, and this runs for every request (here and in
/// the access log). IPv6, rarer, goes through `Display`.
pub(crate) fn ipv4_text(out: &mut [u8], ip: Ipv4Addr) -> usize {
    let mut n = 0;
    for (i, octet) in ip.octets().into_iter().enumerate() {
        if i > 0 {
            out[n] = b'.';
            n += 1;
        }
        if octet >= 100 {
            out[n] = b'0' + octet / 100;
            n += 1;
        }
        if octet >= 10 {
            out[n] = b'0' + octet / 10 % 10;
            n += 1;
        }
        out[n] = b'0' + octet % 10;
        n += 1;
    }
    n
}

#[cfg(test)]
mod proptests;

/// An informational status that another answer follows: every 1xx but `101 Switching
/// Protocols`, which is the last answer on its connection.
pub(crate) fn is_interim(status: http::StatusCode) -> bool {
    status.is_informational() && status != http::StatusCode::SWITCHING_PROTOCOLS
}

/// Whether the client has had the head of a final answer: after one, all a failure can do is
/// cut the connection; after an interim one alone, the final answer is still owed.
pub(crate) fn final_head_written(session: &pingora::proxy::Session) -> bool {
    session
        .response_written()
        .is_some_and(|r| !is_interim(r.status))
}

/// The most fields a request's `Connection` may nominate, less one (Pingora's bound).
const MAX_NOMINATIONS: usize = 10;

/// Why Pingora refuses a request's `Connection` field when it removes the fields it nominates
/// from the member's request, if it does: too many nominations, one that is not an HTTP token
/// (RFC 9110 §5.6.2) or names a pseudo-header, or one that names a field the request's identity
/// travels in (`Host`, `X-Forwarded-*`). Pingora checks this only after admission, so the
/// gateway checks the same first. Nothing is allocated: a request's `Connection` is usually
/// one token or none.
pub(crate) fn connection_refusal(headers: &http::HeaderMap) -> Option<&'static str> {
    let tokens = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|token| !token.is_empty());
    for (n, token) in tokens.enumerate() {
        if n + 1 >= MAX_NOMINATIONS {
            return Some("too many Connection header nominations");
        }
        if token.starts_with(b":") || !token.iter().all(|&b| is_tchar(b)) {
            return Some("invalid token nominated by the Connection header");
        }
        let protected = [
            "host",
            "x-forwarded-for",
            "x-forwarded-host",
            "x-forwarded-proto",
        ];
        if protected
            .iter()
            .any(|p| token.eq_ignore_ascii_case(p.as_bytes()))
        {
            return Some("protected header cannot be nominated by the Connection header");
        }
    }
    None
}

/// A `tchar` of RFC 9110 §5.6.2.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_go_and_framing_stays() {
        let mut req = RequestHeader::build("GET", b"/", None).unwrap();
        for (k, v) in [
            ("connection", "keep-alive, x-private, transfer-encoding"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic x"),
            ("transfer-encoding", "chunked"),
            ("x-kept", "yes"),
        ] {
            req.insert_header(k, v).unwrap();
        }
        strip_hop_by_hop(&mut req);
        let mut left: Vec<&str> = req.headers.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, ["transfer-encoding", "x-kept"]);
    }

    #[test]
    fn content_length_is_reconciled_as_pingora_frames_it() {
        let cases: [(&[&str], Option<u64>); 11] = [
            (&[], None),
            (&["5"], Some(5)),
            (&[" 5 "], Some(5)),
            (&["5, 5"], Some(5)),
            (&["5,5, 5"], Some(5)),
            (&["5", "5"], Some(5)),
            (&["5, 6"], None),
            (&["5", "6"], None),
            (&["+5"], None),
            (&["5,"], None),
            (&["99999999999999999999999"], None),
        ];
        for (lines, expected) in cases {
            let mut headers = http::HeaderMap::new();
            for line in lines {
                headers.append(header::CONTENT_LENGTH, HeaderValue::from_static(line));
            }
            assert_eq!(content_length(&headers), expected, "{lines:?}");
        }
    }

    #[test]
    fn a_listed_content_length_is_forwarded_as_one() {
        let cases: [(&[&str], &[&str]); 6] = [
            (&["5, 5"], &["5"]),
            (&["5", "5"], &["5"]),
            (&["5,5", "5"], &["5"]),
            (&["5"], &["5"]),
            (&[" 5"], &[" 5"]),
            (&[], &[]),
        ];
        for (lines, forwarded) in cases {
            let mut req = RequestHeader::build("POST", b"/", None).unwrap();
            let mut resp = ResponseHeader::build(200, None).unwrap();
            for line in lines {
                req.append_header("Content-Length", *line).unwrap();
                resp.append_header("Content-Length", *line).unwrap();
            }
            forward_one_content_length(&mut req).unwrap();
            forward_one_content_length(&mut resp).unwrap();
            for map in [&req.headers, &resp.headers] {
                let got: Vec<&[u8]> = map
                    .get_all(header::CONTENT_LENGTH)
                    .iter()
                    .map(HeaderValue::as_bytes)
                    .collect();
                let want: Vec<&[u8]> = forwarded.iter().map(|v| v.as_bytes()).collect();
                assert_eq!(got, want, "{lines:?}");
            }
        }
        // Transfer-Encoding frames the message: the lengths are left to Pingora.
        let mut resp = ResponseHeader::build(200, None).unwrap();
        resp.append_header("Content-Length", "5, 5").unwrap();
        resp.append_header("Transfer-Encoding", "chunked").unwrap();
        forward_one_content_length(&mut resp).unwrap();
        assert_eq!(resp.headers[header::CONTENT_LENGTH], "5, 5");
    }

    fn request(method: &str, headers: &[(&str, &str)]) -> RequestHeader {
        let mut req = RequestHeader::build(method, b"/", None).unwrap();
        for (k, v) in headers {
            req.append_header(k.to_string(), *v).unwrap();
        }
        req
    }

    #[test]
    fn only_websocket_upgrades_pass() {
        let ws = [
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "WebSocket"),
        ];
        assert!(is_websocket_upgrade(&request("GET", &ws)));
        let versioned = [("connection", "upgrade"), ("upgrade", "websocket/13")];
        assert!(is_websocket_upgrade(&request("GET", &versioned)));
        // Several fields are one list.
        let split = [
            ("connection", "keep-alive"),
            ("connection", "upgrade"),
            ("upgrade", "h2c, websocket"),
        ];
        assert!(is_websocket_upgrade(&request("GET", &split)));
        assert!(!is_websocket_upgrade(&request("POST", &ws)));
        let h2c = [
            ("connection", "upgrade, http2-settings"),
            ("upgrade", "h2c"),
        ];
        assert!(!is_websocket_upgrade(&request("GET", &h2c)));
        let unlisted = [("connection", "keep-alive"), ("upgrade", "websocket")];
        assert!(!is_websocket_upgrade(&request("GET", &unlisted)));
        let mut old = request("GET", &ws);
        old.set_version(http::Version::HTTP_10);
        assert!(!is_websocket_upgrade(&old));

        let mut req = request(
            "GET",
            &[
                ("connection", "upgrade, x-private"),
                ("x-private", "1"),
                ("upgrade", "websocket, h2c"),
            ],
        );
        strip_hop_by_hop(&mut req);
        keep_websocket_upgrade(&mut req).unwrap();
        let mut left: Vec<(&str, &str)> = req
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
            .collect();
        left.sort_unstable();
        assert_eq!(left, [("connection", "upgrade"), ("upgrade", "websocket")]);
    }

    #[test]
    fn only_this_instances_own_via_entry_is_a_loop() {
        let own = via().to_str().unwrap().to_string();
        let name = own.strip_prefix("1.1 ").unwrap();
        assert!(name.starts_with("sluice-"), "{own}");
        let loops = |values: &[&str]| {
            let mut map = http::HeaderMap::new();
            for v in values {
                map.append(header::VIA, HeaderValue::from_str(v).unwrap());
            }
            is_own_loop(&map)
        };
        assert!(!loops(&[]));
        assert!(loops(&[&own]));
        assert!(loops(&[&format!("1.0 fred, 1.1 {name} (sluice)")]));
        assert!(loops(&["HTTP/1.1 squid", &format!("  2 {name}")]));
        // Another instance, a prefix of the name, or the name as a comment: not this one.
        assert!(!loops(&["1.1 sluice-0000000000000000"]));
        assert!(!loops(&[&format!("1.1 {}", &name[..name.len() - 1])]));
        assert!(!loops(&[&format!("1.1 proxy ({name})")]));
    }

    #[test]
    fn forwarded_for_is_appended() {
        let mut req = RequestHeader::build("GET", b"/", None).unwrap();
        append_forwarded_for(&mut req, "10.0.0.1".parse().unwrap()).unwrap();
        append_forwarded_for(&mut req, "::1".parse().unwrap()).unwrap();
        assert_eq!(req.headers["x-forwarded-for"], "10.0.0.1, ::1");
    }
}
