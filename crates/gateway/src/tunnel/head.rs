//! The tunnel's HTTP/1 heads: the client's CONNECT, and what sluice answers to it.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderName, HeaderValue, Version};
use pingora::protocols::Stream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use pingora::http::ResponseHeader;

use crate::problem::Problem;
use crate::table::Route;

/// The longest CONNECT head sluice reads.
const MAX_HEAD: usize = 16 * 1024;
/// The most header fields in it.
const MAX_HEADERS: usize = 64;

/// A CONNECT request head.
pub(crate) struct Head {
    pub(crate) version: Version,
    /// The request target: `host:port`.
    pub(crate) authority: String,
    pub(crate) headers: HeaderMap,
    /// Bytes the client sent after the head without waiting for the answer (a TLS
    /// ClientHello, say): they go up first once the tunnel is open.
    pub(crate) early: Bytes,
}

/// Why no head was read.
pub(crate) enum Unread {
    /// The client left before its head was whole.
    Left,
    /// The head was not whole within `limits.header_timeout`.
    Late,
    /// Something that is not a CONNECT head sluice can serve: the answer.
    Bad(Problem),
}

/// Reads the CONNECT head, which must be whole within `within` (`limits.header_timeout`, as for
/// any request head). `first` holds what was already read of the connection.
pub(crate) async fn read(
    stream: &mut Stream,
    first: Vec<u8>,
    within: Duration,
) -> Result<Head, Unread> {
    let mut buf = BytesMut::with_capacity(first.len().max(1024));
    buf.extend_from_slice(&first);
    let read = async {
        if let Some(head) = parse(&mut buf)? {
            return Ok(head);
        }
        loop {
            match stream.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return Err(None),
                Ok(_) => {}
            }
            if let Some(head) = parse(&mut buf)? {
                return Ok(head);
            }
            if buf.len() > MAX_HEAD {
                return Err(Some(Problem::bad_request()));
            }
        }
    };
    match tokio::time::timeout(within, read).await {
        Ok(Ok(head)) => Ok(head),
        Ok(Err(Some(problem))) => Err(Unread::Bad(problem)),
        Ok(Err(None)) => Err(Unread::Left),
        Err(_) => Err(Unread::Late),
    }
}

/// The head, once `buf` holds all of it.
fn parse(buf: &mut BytesMut) -> Result<Option<Head>, Option<Problem>> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut fields);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(Some(Problem::bad_request())),
    };
    if req.method != Some("CONNECT") {
        return Err(Some(Problem::bad_request()));
    }
    let version = match req.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let authority = req.path.unwrap_or_default().to_string();
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    for f in req.headers.iter() {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(f.name.as_bytes()),
            HeaderValue::from_bytes(f.value),
        ) else {
            return Err(Some(Problem::bad_request()));
        };
        headers.append(name, value);
    }
    let early = buf.split_off(len).freeze();
    Ok(Some(Head {
        version,
        authority,
        headers,
        early,
    }))
}

/// Writes sluice's own answer to the CONNECT (a head and body made the way every request's
/// answer is, `crate::request::answer::problem_head`) and closes the connection.
pub(crate) async fn answer(stream: &mut Stream, head: ResponseHeader, body: Bytes) {
    let mut out = BytesMut::with_capacity(512 + body.len());
    status_line(
        &mut out,
        head.status.as_u16(),
        head.status.canonical_reason(),
    );
    for (name, value) in head.headers.iter() {
        field(&mut out, name, value);
    }
    field(
        &mut out,
        &header::CONNECTION,
        &HeaderValue::from_static("close"),
    );
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    let _ = stream.write_all(&out).await;
    let _ = stream.flush().await;
    let _ = stream.shutdown().await;
}

/// Sends `200 Connection Established`, with the request id and the route's RateLimit headers.
/// False when the client is gone.
pub(crate) async fn established(
    stream: &mut Stream,
    id: &HeaderValue,
    route: &Route,
    ratelimit: Option<HeaderValue>,
) -> bool {
    let mut out = BytesMut::with_capacity(256);
    status_line(&mut out, 200, Some("Connection Established"));
    field(&mut out, &HeaderName::from_static("x-request-id"), id);
    if let (Some(q), Some(value)) = (route.quota.as_deref(), ratelimit) {
        field(
            &mut out,
            &HeaderName::from_static("ratelimit-policy"),
            &q.policy,
        );
        field(&mut out, &HeaderName::from_static("ratelimit"), &value);
    }
    out.extend_from_slice(b"\r\n");
    stream.write_all(&out).await.is_ok() && stream.flush().await.is_ok()
}

fn status_line(out: &mut BytesMut, status: u16, reason: Option<&str>) {
    out.extend_from_slice(format!("HTTP/1.1 {status} {}\r\n", reason.unwrap_or("")).as_bytes());
}

fn field(out: &mut BytesMut, name: &HeaderName, value: &HeaderValue) {
    out.extend_from_slice(name.as_str().as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_and_its_early_bytes() {
        let mut buf = BytesMut::from(
            &b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\nX-Tenant: a\r\n\r\n\x16\x03\x01"[..],
        );
        let head = parse(&mut buf).unwrap().unwrap();
        assert_eq!(head.authority, "api.test:443");
        assert_eq!(head.version, Version::HTTP_11);
        assert_eq!(head.headers["x-tenant"], "a");
        assert_eq!(&head.early[..], b"\x16\x03\x01");
    }

    #[test]
    fn a_partial_head_waits_and_a_bad_one_is_refused() {
        assert!(parse(&mut BytesMut::from(
            &b"CONNECT api.test:443 HTTP/1.1\r\nHost"[..]
        ))
        .unwrap()
        .is_none());
        assert!(parse(&mut BytesMut::from(&b"CONNECT a b c\r\n\r\n"[..])).is_err());
    }
}
