//! What a request addresses: the host sluice routes on and the path it routes, charges and
//! forwards, read from the request target (and `Host`) once, before anything else looks at them.
//!
//! **The rule: what is charged is what is served.** A cost rule `path_prefix: /v1/search` must
//! see `/v1//search`, `/v1/./search`, `/v1/%73earch` and `/v1/x/../search` as `/v1/search`,
//! because that is what the member serves for each of them. So the path is normalized, as Envoy
//! does with `normalize_path` and `merge_slashes`, and the pipeline routes, charges *and
//! forwards* the normalized path; a member then receives a path its own normalization leaves
//! unchanged, whatever that normalization is:
//!
//! - percent-escapes of unreserved characters (`A-Z a-z 0-9 - . _ ~`, RFC 3986 §2.3) are
//!   decoded, other escapes keep their meaning and get uppercase hex, and bytes that may not
//!   appear raw in a path (`"`, `{`, non-ASCII...) are percent-encoded;
//! - runs of `/` become one `/`, then `.` and `..` segments are removed (RFC 3986 §5.2.4), `%2e`
//!   spellings included; a trailing `/` is kept;
//! - what cannot be normalized without guessing what the member would make of it is refused
//!   ([`Reject::BadPath`], a 400): a `..` above the root (Envoy clamps it at the root; refusing
//!   charges nothing by mistake), `%2F` and `%5C` (a member may or may not treat them as
//!   separators, so the segments we match may not be the ones it serves), raw `\` (some servers
//!   read it as `/`), control bytes raw or escaped (`%00` truncates C strings), space, `#`, and
//!   malformed escapes. The query string is split off, not normalized: only bytes no query may
//!   hold (controls, space, `#`) and non-UTF-8 are refused.
//!
//! The host is given in the form the router matches on: lowercase, port and one trailing dot
//! removed, an IPv6 literal without its brackets and in RFC 5952 text (`[0:0::1]:8080` is
//! `::1`). Hosts are DNS-like names (`A-Z a-z 0-9 - . _`) or IP literals; a name whose last label
//! is a number must be a dotted-quad IPv4 address, because resolvers read `0x7f.1` or
//! `2130706433` as `127.0.0.1` and the router would not.
//!
//! This module knows nothing of Pingora. Pingora already refuses duplicate `Host` fields,
//! userinfo and an absolute-form authority that differs from `Host`; [`parse`] does not repeat
//! those checks, except refusing userinfo, which it must see to find the host.
//!
//! The property tests run proptest's default number of cases in CI. The long run is
//! `PROPTEST_CASES=100000 cargo test -p sluice-gateway --lib target`.

use std::borrow::Cow;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

use http::{Method, StatusCode, Version};

/// The scheme of an absolute-form target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// `http://`: an ordinary forward-proxy request.
    Http,
    /// `https://`: the client asks for TLS to the target. A request forwarded in cleartext would
    /// not be what it asked for, so the pipeline must answer 400 unless the chosen member is
    /// https.
    Https,
}

/// The form of the request target (RFC 9112 §3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `/path?query`, with the host in `Host`.
    Origin,
    /// `http://host/path?query`: sluice used as an HTTP proxy.
    Absolute,
    /// `host:port`, for CONNECT only.
    Authority,
    /// `*`, for a server-wide OPTIONS only.
    Asterisk,
}

/// A parsed request target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target<'a> {
    /// The form the client used.
    pub form: Form,
    /// `Some` exactly for [`Form::Absolute`].
    pub scheme: Option<Scheme>,
    /// `host[:port]` as the client sent it: the absolute-form or CONNECT authority, else the
    /// `Host` value (empty for an HTTP/1.0 request without one). What `Host` should carry when
    /// the host is preserved.
    pub authority: &'a str,
    /// The host to route on: lowercase, no port, no trailing dot, IPv6 without brackets in RFC
    /// 5952 form. Borrowed unless one of those changed it. Already what a route matches, so it
    /// must not be "normalized" again: `router::normalize_host` would take the last group of a
    /// bare IPv6 address (`::1`) for a port.
    pub host: Cow<'a, str>,
    /// The port as sent; `None` means the scheme's default. Always `Some` for CONNECT.
    pub port: Option<u16>,
    /// The normalized path: what routing and cost rules match and what the member receives.
    /// `*` for [`Form::Asterisk`], empty for [`Form::Authority`]. Borrowed when the client's
    /// path was already normal.
    pub path: Cow<'a, str>,
    /// The query string without its `?`, as sent.
    pub query: Option<&'a str>,
    /// Normalization changed the path, so the member must be sent [`Target::origin_form`]
    /// rather than the client's bytes. (An absolute-form target with an empty path becomes `/`
    /// without counting as a rewrite: that is how every proxy forwards it.)
    pub rewritten: bool,
    /// The client's path and query when they need no rewriting, to forward without a copy.
    sent: &'a str,
}

impl<'a> Target<'a> {
    /// The origin-form target to send to a member: the normalized path and the query.
    /// Borrowed from the request when nothing was rewritten. Empty for CONNECT.
    pub fn origin_form(&self) -> Cow<'a, str> {
        if !self.sent.is_empty() {
            return Cow::Borrowed(self.sent);
        }
        match (&self.path, self.query) {
            (path, None) => path.clone(),
            (path, Some(query)) => {
                let mut s = String::with_capacity(path.len() + 1 + query.len());
                s.push_str(path);
                s.push('?');
                s.push_str(query);
                Cow::Owned(s)
            }
        }
    }
}

/// Why a request target is refused. Each is a 400 answered by sluice, contacting no member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// The path is not a path, or cannot be normalized safely (see the module doc).
    BadPath,
    /// The query holds control bytes, a space, `#`, or is not UTF-8.
    BadQuery,
    /// HTTP/1.1 or later without a host: no `Host` in origin-form, or an empty authority.
    MissingHost,
    /// The host or port is malformed or ambiguous: userinfo, characters outside a DNS name,
    /// a numeric name that is not a dotted quad, a bad IPv6 literal or zone, port 0 or above
    /// 65535, or a CONNECT target without a port.
    BadHost,
    /// An absolute-form scheme other than `http`, `https`, `ws` and `wss`.
    UnsupportedScheme,
}

impl Reject {
    /// Always 400: each is a malformed request.
    pub fn status(self) -> StatusCode {
        StatusCode::BAD_REQUEST
    }

    /// A stable machine-readable code, for `x-sluice-error`.
    pub fn code(self) -> &'static str {
        match self {
            Reject::BadPath => "bad_path",
            Reject::BadQuery => "bad_query",
            Reject::MissingHost => "missing_host",
            Reject::BadHost => "bad_host",
            Reject::UnsupportedScheme => "unsupported_scheme",
        }
    }

    /// A short reason for the problem's detail.
    pub fn reason(self) -> &'static str {
        match self {
            Reject::BadPath => "the request path cannot be normalized unambiguously",
            Reject::BadQuery => "the query string holds control bytes, a space or a '#'",
            Reject::MissingHost => "the request names no host",
            Reject::BadHost => "the request's host or port is malformed or ambiguous",
            Reject::UnsupportedScheme => "only http, https, ws and wss targets can be proxied",
        }
    }
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

impl std::error::Error for Reject {}

/// Reads a request target.
///
/// `raw_target` is the request-line target as received (Pingora: `req.raw_path()`, which holds
/// the whole absolute URI where `req.uri` holds only its path). `host_header` is the `Host`
/// value; for HTTP/2 pass `:authority` (Pingora: `req.uri.authority()`). In absolute form the
/// target's authority wins and `host_header` is not read: Pingora has already refused a `Host`
/// that differs from it.
pub fn parse<'a>(
    method: &Method,
    version: Version,
    raw_target: &'a [u8],
    host_header: Option<&'a [u8]>,
) -> Result<Target<'a>, Reject> {
    if method == Method::CONNECT {
        let authority = parse_authority(raw_target)?;
        let port = authority.port.ok_or(Reject::BadHost)?;
        return Ok(Target {
            form: Form::Authority,
            scheme: None,
            authority: authority.raw,
            host: authority.host,
            port: Some(port),
            path: Cow::Borrowed(""),
            query: None,
            rewritten: false,
            sent: "",
        });
    }
    match raw_target.first() {
        Some(b'/') => {
            let authority = host_from_header(version, host_header)?;
            with_path(Form::Origin, None, authority, raw_target)
        }
        Some(b'*') if raw_target == b"*" => {
            if method != Method::OPTIONS {
                return Err(Reject::BadPath);
            }
            let authority = host_from_header(version, host_header)?;
            Ok(Target {
                form: Form::Asterisk,
                scheme: None,
                authority: authority.raw,
                host: authority.host,
                port: authority.port,
                path: Cow::Borrowed("*"),
                query: None,
                rewritten: false,
                sent: "*",
            })
        }
        _ => {
            let (scheme, rest) = split_scheme(raw_target)?;
            let end = rest
                .iter()
                .position(|b| matches!(b, b'/' | b'?' | b'#'))
                .unwrap_or(rest.len());
            let authority = parse_authority(&rest[..end])?;
            with_path(Form::Absolute, Some(scheme), authority, &rest[end..])
        }
    }
}

/// Normalizes an origin-form path (no query). Borrows when `path` is already normal, which
/// is the common case; see the module doc for the rule.
pub fn normalize_path(path: &str) -> Result<Cow<'_, str>, Reject> {
    normalize_bytes(path.as_bytes())
}

struct Authority<'a> {
    raw: &'a str,
    host: Cow<'a, str>,
    port: Option<u16>,
}

fn with_path<'a>(
    form: Form,
    scheme: Option<Scheme>,
    authority: Authority<'a>,
    path_and_query: &'a [u8],
) -> Result<Target<'a>, Reject> {
    let (raw_path, query) = match path_and_query.iter().position(|&b| b == b'?') {
        Some(q) => (
            &path_and_query[..q],
            Some(check_query(&path_and_query[q + 1..])?),
        ),
        None => (path_and_query, None),
    };
    let path = if raw_path.is_empty() && form == Form::Absolute {
        Cow::Borrowed("/")
    } else {
        normalize_bytes(raw_path)?
    };
    let rewritten = matches!(path, Cow::Owned(_));
    // Unrewritten, the path is ASCII and the query checked UTF-8, so this cannot fail.
    let sent = if rewritten || raw_path.is_empty() {
        ""
    } else {
        std::str::from_utf8(path_and_query).unwrap_or("")
    };
    Ok(Target {
        form,
        scheme,
        authority: authority.raw,
        host: authority.host,
        port: authority.port,
        path,
        query,
        rewritten,
        sent,
    })
}

/// The scheme of an absolute-form target and what follows its `://`.
fn split_scheme(target: &[u8]) -> Result<(Scheme, &[u8]), Reject> {
    let colon = target
        .iter()
        .position(|&b| b == b':')
        .ok_or(Reject::BadPath)?;
    let (name, rest) = (&target[..colon], &target[colon + 1..]);
    // RFC 3986 §3.1: scheme = ALPHA *( ALPHA / DIGIT / "+" / "-" / "." ). Without `//` this is
    // no URI a proxy is asked for (`example.com:80` outside CONNECT, `mailto:x`): not a path.
    let is_scheme = name.first().is_some_and(u8::is_ascii_alphabetic)
        && name
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'));
    let rest = match rest.strip_prefix(b"//") {
        Some(rest) if is_scheme => rest,
        _ => return Err(Reject::BadPath),
    };
    // `ws://` and `wss://` are what WebSocket clients put in the absolute form through a
    // proxy (aiohttp's `ws_connect`): the same request as `http://` and `https://` with an
    // `Upgrade` (RFC 6455 §3), proxied the same way.
    if name.eq_ignore_ascii_case(b"http") || name.eq_ignore_ascii_case(b"ws") {
        Ok((Scheme::Http, rest))
    } else if name.eq_ignore_ascii_case(b"https") || name.eq_ignore_ascii_case(b"wss") {
        Ok((Scheme::Https, rest))
    } else {
        Err(Reject::UnsupportedScheme)
    }
}

fn host_from_header(version: Version, value: Option<&[u8]>) -> Result<Authority<'_>, Reject> {
    // Field values carry no surrounding whitespace (RFC 9110 §5.5), whatever the parser left.
    let value = value.map(|v| v.trim_ascii()).filter(|v| !v.is_empty());
    match value {
        Some(v) => parse_authority(v),
        // HTTP/1.0 predates Host: such a request can still match a `*` route.
        None if matches!(version, Version::HTTP_09 | Version::HTTP_10) => Ok(Authority {
            raw: "",
            host: Cow::Borrowed(""),
            port: None,
        }),
        None => Err(Reject::MissingHost),
    }
}

/// `host[:port]`, as in an absolute URI, a CONNECT target or `Host`.
fn parse_authority(raw: &[u8]) -> Result<Authority<'_>, Reject> {
    let raw_str = std::str::from_utf8(raw).map_err(|_| Reject::BadHost)?;
    if raw.is_empty() {
        return Err(Reject::MissingHost);
    }
    // RFC 9110 §4.2.4: userinfo hides the real host (`http://good.example@evil.example/`).
    if raw.contains(&b'@') {
        return Err(Reject::BadHost);
    }
    let (host, port) = if let Some(v6) = raw_str.strip_prefix('[') {
        let close = v6.find(']').ok_or(Reject::BadHost)?;
        let port = match &v6[close + 1..] {
            "" => None,
            rest => Some(rest.strip_prefix(':').ok_or(Reject::BadHost)?),
        };
        (ipv6_host(&v6[..close])?, port)
    } else {
        // Colons found by bytes: `str`'s searches cost more than they save on a few bytes.
        let mut colons = raw.iter().enumerate().filter(|(_, &b)| b == b':');
        let (name, port) = match colons.next() {
            Some((i, _)) => (&raw_str[..i], Some(&raw_str[i + 1..])),
            None => (raw_str, None),
        };
        // A second colon is a bare IPv6 address or a doubled port: either way, not a host.
        if colons.next().is_some() {
            return Err(Reject::BadHost);
        }
        if name.is_empty() {
            return Err(Reject::MissingHost);
        }
        (name_host(name)?, port)
    };
    let port = match port {
        // RFC 3986 §3.2.3 allows an empty port: it means the default.
        None | Some("") => None,
        Some(p) if p.bytes().all(|b| b.is_ascii_digit()) => match p.parse::<u16>() {
            Ok(0) | Err(_) => return Err(Reject::BadHost),
            Ok(n) => Some(n),
        },
        Some(_) => return Err(Reject::BadHost),
    };
    Ok(Authority {
        raw: raw_str,
        host,
        port,
    })
}

fn ipv6_host(literal: &str) -> Result<Cow<'_, str>, Reject> {
    // Zone ids (`%25eth0`) and IPvFuture fail to parse: neither names a host to route on.
    let addr: Ipv6Addr = literal.parse().map_err(|_| Reject::BadHost)?;
    // One address, one spelling: `0:0::1` and `::1` must hit the same route.
    let canonical = addr.to_string();
    Ok(if canonical == literal {
        Cow::Borrowed(literal)
    } else {
        Cow::Owned(canonical)
    })
}

/// The last label of a host name, or `None` unless every byte is a letter, digit, `-`, `_` or
/// a dot between two non-empty labels. One pass over the bytes: a host is a few bytes, for
/// which `str`'s searches cost more than they save.
fn last_label(name: &str) -> Option<&str> {
    let mut after_dot = true;
    let mut last_dot = None;
    for (i, &b) in name.as_bytes().iter().enumerate() {
        if b == b'.' {
            if after_dot {
                return None;
            }
            last_dot = Some(i);
            after_dot = true;
        } else if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_') {
            after_dot = false;
        } else {
            return None;
        }
    }
    // Empty, or ending in an empty label.
    if after_dot {
        return None;
    }
    Some(last_dot.map_or(name, |i| &name[i + 1..]))
}

fn name_host(name: &str) -> Result<Cow<'_, str>, Reject> {
    let trimmed = name.strip_suffix('.').unwrap_or(name);
    let last = last_label(trimmed).ok_or(Reject::BadHost)?;
    // WHATWG URL parsing and inet_aton read a name ending in a number as IPv4 (`0x7f.1`,
    // `2130706433`, `127.1`); only the dotted quad is one spelling we can match.
    let numeric = last.bytes().all(|b| b.is_ascii_digit())
        || last
            .strip_prefix("0x")
            .or_else(|| last.strip_prefix("0X"))
            .is_some_and(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()));
    if numeric && trimmed.parse::<Ipv4Addr>().is_err() {
        return Err(Reject::BadHost);
    }
    Ok(if trimmed.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(trimmed.to_ascii_lowercase())
    } else {
        Cow::Borrowed(trimmed)
    })
}

fn check_query(query: &[u8]) -> Result<&str, Reject> {
    if query
        .iter()
        .any(|&b| b < 0x20 || b == 0x7f || b == b' ' || b == b'#')
    {
        return Err(Reject::BadQuery);
    }
    std::str::from_utf8(query).map_err(|_| Reject::BadQuery)
}

/// What a path byte becomes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Stays as it is: unreserved, sub-delims, `:`, `@` (RFC 3986 pchar) and `/`.
    Keep,
    /// Starts a percent-escape.
    Percent,
    /// May not appear raw in a path but means the same encoded (`"`, `{`, non-ASCII...).
    Encode,
    /// Refused: control bytes, space, `#`, `?`, `\`.
    Refuse,
}

const CLASS: [Class; 256] = {
    let mut table = [Class::Encode; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = if c.is_ascii_alphanumeric() {
            Class::Keep
        } else {
            match c {
                b'-' | b'.' | b'_' | b'~' | b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*'
                | b'+' | b',' | b';' | b'=' | b':' | b'@' | b'/' => Class::Keep,
                b'%' => Class::Percent,
                0..=0x20 | 0x7f | b'#' | b'?' | b'\\' => Class::Refuse,
                _ => Class::Encode,
            }
        };
        b += 1;
    }
    table
};

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn normalize_bytes(path: &[u8]) -> Result<Cow<'_, str>, Reject> {
    if path.first() != Some(&b'/') {
        return Err(Reject::BadPath);
    }
    if is_normal(path) {
        // `is_normal` admits ASCII only.
        return std::str::from_utf8(path)
            .map(Cow::Borrowed)
            .map_err(|_| Reject::BadPath);
    }
    let out = rebuild(path)?;
    // Uppercase escapes that were already uppercase, say, need no copy.
    Ok(if out.as_bytes() == path {
        Cow::Borrowed(std::str::from_utf8(path).map_err(|_| Reject::BadPath)?)
    } else {
        Cow::Owned(out)
    })
}

/// The fast path: no escape, no byte to encode or refuse, no empty or dot segment but a
/// trailing `/`. `path` starts with `/`.
fn is_normal(path: &[u8]) -> bool {
    let mut segment_start = 1;
    for i in 1..=path.len() {
        if i == path.len() || path[i] == b'/' {
            let segment = &path[segment_start..i];
            if segment == b"." || segment == b".." || (segment.is_empty() && i < path.len()) {
                return false;
            }
            segment_start = i + 1;
        } else if CLASS[path[i] as usize] != Class::Keep {
            return false;
        }
    }
    true
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn push_escape(out: &mut String, b: u8) {
    out.push('%');
    out.push(HEX[usize::from(b >> 4)] as char);
    out.push(HEX[usize::from(b & 15)] as char);
}

fn hex_value(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// The slow path: one segment at a time into `out`, which always reads `(/segment)*`, so
/// `..` pops back to the last `/`.
fn rebuild(path: &[u8]) -> Result<String, Reject> {
    let mut out = String::with_capacity(path.len() + 8);
    // The output ends in `/` when the input's last segment was empty, `.` or `..`.
    let mut trailing_slash = false;
    // Slashes are merged first, as nginx does: `/a//../b` is `/b`.
    for raw in path[1..].split(|&b| b == b'/') {
        if raw.is_empty() {
            trailing_slash = true;
            continue;
        }
        let start = out.len();
        out.push('/');
        push_segment(&mut out, raw)?;
        match &out[start + 1..] {
            "." => {
                out.truncate(start);
                trailing_slash = true;
            }
            ".." => {
                out.truncate(start);
                // Above the root: refused rather than clamped, so nothing is charged as a
                // path the member may read differently.
                let parent = out.rfind('/').ok_or(Reject::BadPath)?;
                out.truncate(parent);
                trailing_slash = true;
            }
            _ => trailing_slash = false,
        }
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Ok(out)
}

fn push_segment(out: &mut String, segment: &[u8]) -> Result<(), Reject> {
    let mut i = 0;
    while i < segment.len() {
        let b = segment[i];
        match CLASS[b as usize] {
            Class::Keep => out.push(b as char),
            Class::Encode => push_escape(out, b),
            Class::Refuse => return Err(Reject::BadPath),
            Class::Percent => {
                let hi = segment.get(i + 1).copied().and_then(hex_value);
                let lo = segment.get(i + 2).copied().and_then(hex_value);
                let (Some(hi), Some(lo)) = (hi, lo) else {
                    return Err(Reject::BadPath);
                };
                let decoded = (hi << 4) | lo;
                if is_unreserved(decoded) {
                    out.push(decoded as char);
                } else if decoded < 0x20 || decoded == 0x7f || decoded == b'/' || decoded == b'\\' {
                    return Err(Reject::BadPath);
                } else {
                    push_escape(out, decoded);
                }
                i += 3;
                continue;
            }
        }
        i += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
