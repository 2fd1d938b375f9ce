//! The body read before admission, on real TCP connections: whole bodies within the bound are
//! read and kept for the member byte for byte; anything else is left unread, untouched.

use bytes::Bytes;
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream as L4Stream;
use sluice_usage::Millionths;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::config::Config;

/// A server session on a loopback connection whose client has sent `raw`, with the head read.
/// The client's end is returned too, so that the connection stays open.
async fn open(raw: Vec<u8>) -> (ServerSession, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client = tokio::spawn(async move {
        let mut client = TcpStream::connect(addr).await.unwrap();
        client.write_all(&raw).await.unwrap();
        client
    });
    let (stream, _) = listener.accept().await.unwrap();
    let mut session = ServerSession::new_http1(Box::new(L4Stream::from(stream)));
    assert!(session.read_request().await.unwrap(), "a request head");
    (session, client.await.unwrap())
}

fn post(headers: &str, body: &[u8]) -> Vec<u8> {
    let mut raw = format!("POST /v1/chat/completions HTTP/1.1\r\nHost: api.test\r\n{headers}\r\n")
        .into_bytes();
    raw.extend_from_slice(body);
    raw
}

fn with_length(body: &[u8]) -> Vec<u8> {
    post(&format!("Content-Length: {}\r\n", body.len()), body)
}

/// The rest of the body, as the proxy reads it after admission.
async fn rest(session: &mut ServerSession) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(chunk) = session.read_request_body().await.unwrap() {
        out.extend_from_slice(&chunk);
    }
    out
}

/// A JSON body of exactly `len` bytes: `{"max_tokens":N,"pad":"xxx…"}`.
fn json_of_len(max_tokens: u64, len: usize) -> Vec<u8> {
    let head = format!("{{\"max_tokens\":{max_tokens},\"pad\":\"");
    let pad = len - head.len() - 2;
    let mut body = head.into_bytes();
    body.extend(std::iter::repeat_n(b'x', pad));
    body.extend_from_slice(b"\"}");
    assert_eq!(body.len(), len);
    body
}

fn usage(yaml_usage: &str) -> RouteUsage {
    let yaml = format!(
        "routes:\n  - name: r\n    upstream: {{}}\n    quota:\n      windows: [{{ name: t, limit: 100000, window: 1m, unit: tokens }}]\n      usage:\n{yaml_usage}"
    );
    let config = Config::parse("t.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"));
    RouteUsage::build(
        config.routes[0]
            .quota
            .as_ref()
            .unwrap()
            .usage
            .as_ref()
            .unwrap(),
    )
}

const TOKENS: &str = "        max_request_body: 1024\n        tokens:\n          reserve: { sum: [ { json: max_tokens, default: 4096 }, { request_bytes: true, times: 0.25 } ] }\n          settle: { json: usage.total_tokens }\n";

fn units(n: u64) -> Millionths {
    Millionths::from_units(n).unwrap()
}

#[tokio::test]
async fn a_small_body_is_read_whole_and_kept_for_the_member() {
    let usage = usage(TOKENS);
    assert!(usage.reads_body);
    let body = br#"{"model":"gpt","max_tokens":300,"messages":[]}"#;
    let (mut session, _client) = open(with_length(body)).await;
    let prefix = read_prefix(&mut session, usage.max_request_body)
        .await
        .unwrap();
    assert_eq!(prefix.body.as_deref(), Some(&body[..]));
    assert_eq!(prefix.len, body.len() as u64);
    // What Pingora sends the member first, and on a replay: every byte, nothing left to read.
    assert_eq!(session.get_retry_buffer(), Some(Bytes::from_static(body)));
    assert!(session.is_body_done());
    assert!(rest(&mut session).await.is_empty());
    // 300 from the body, and a quarter of its 46 bytes.
    let reserved = usage.reserve(&prefix.request(&session.req_header().headers));
    assert_eq!(reserved, [Millionths(300_000_000 + 11_500_000)]);
}

/// A client that closes its side mid-body leaves a body that cannot be read whole: that is an
/// error, so that nothing is charged for it and nothing of it goes to a member (Pingora's reader
/// counts such a body as finished, and would let the cut-short request through).
#[tokio::test]
async fn a_body_cut_short_by_the_client_is_an_error() {
    let usage = usage(TOKENS);
    let mut raw = post("Content-Length: 500\r\n", b"");
    raw.extend_from_slice(br#"{"max_tokens":300,"#);
    let (mut session, client) = open(raw).await;
    drop(client);
    let read = read_prefix(&mut session, usage.max_request_body).await;
    assert!(read.is_err(), "{read:?}");
}

/// A length sent as a list of equal values or as equal lines frames the body as that one
/// length, as Pingora serves it (RFC 9112 §6.3): the body is read and charged like one with a
/// plain `Content-Length`, not taken for absent.
#[tokio::test]
async fn a_listed_or_repeated_length_is_read_as_the_one_length() {
    let usage = usage(TOKENS);
    let body = br#"{"model":"gpt","max_tokens":300,"messages":[]}"#;
    let n = body.len();
    for lengths in [
        format!("Content-Length: {n}, {n}\r\n"),
        format!("Content-Length: {n},{n}\r\nContent-Length: {n}\r\n"),
        format!("Content-Length: {n}\r\nContent-Length: {n}\r\n"),
    ] {
        let (mut session, _client) = open(post(&lengths, body)).await;
        let prefix = read_prefix(&mut session, usage.max_request_body)
            .await
            .unwrap();
        assert_eq!(prefix.body.as_deref(), Some(&body[..]), "{lengths:?}");
        assert_eq!(prefix.len, n as u64, "{lengths:?}");
        assert_eq!(session.get_retry_buffer(), Some(Bytes::from_static(body)));
        let reserved = usage.reserve(&prefix.request(&session.req_header().headers));
        assert_eq!(
            reserved,
            [Millionths(300_000_000 + 11_500_000)],
            "{lengths:?}"
        );
    }
}

#[tokio::test]
async fn a_body_exactly_at_the_bound_is_read_and_one_byte_more_is_not() {
    let usage = usage(TOKENS);
    let body = json_of_len(7, 1024);
    let (mut session, _client) = open(with_length(&body)).await;
    let prefix = read_prefix(&mut session, 1024).await.unwrap();
    assert_eq!(prefix.body.as_deref(), Some(&body[..]));
    assert_eq!(session.get_retry_buffer().as_deref(), Some(&body[..]));
    assert_eq!(
        usage.reserve(&prefix.request(&session.req_header().headers)),
        [units(7 + 256)]
    );

    let body = json_of_len(7, 1025);
    let (mut session, _client) = open(with_length(&body)).await;
    let prefix = read_prefix(&mut session, 1024).await.unwrap();
    assert_eq!(
        prefix,
        Prefix {
            body: None,
            len: 1025
        }
    );
    // Nothing was taken from the connection: the proxy reads the body as it came.
    assert_eq!(rest(&mut session).await, body);
    // The default, and the prompt estimate from Content-Length (1025 / 4, rounded up).
    assert_eq!(
        usage.reserve(&prefix.request(&session.req_header().headers)),
        [Millionths(4_096_000_000 + 256_250_000)]
    );
}

#[tokio::test]
async fn the_largest_bound_keeps_every_byte_for_the_member() {
    // 64 KiB, the most `check` allows: the replay buffer's size, and not one byte past it.
    let bound = crate::config::MAX_REQUEST_BODY as usize;
    let body = json_of_len(9, bound);
    let (mut session, _client) = open(with_length(&body)).await;
    let prefix = read_prefix(&mut session, bound).await.unwrap();
    assert_eq!(prefix.body.as_deref(), Some(&body[..]));
    assert!(!session.retry_buffer_truncated());
    assert_eq!(session.get_retry_buffer().as_deref(), Some(&body[..]));
}

#[tokio::test]
async fn a_chunked_body_is_left_to_stream() {
    let usage = usage(TOKENS);
    let raw = post(
        "Transfer-Encoding: chunked\r\n",
        b"5\r\n{\"max\r\n9\r\n_tokens\":\r\n3\r\n12}\r\n0\r\n\r\n",
    );
    let (mut session, _client) = open(raw).await;
    let prefix = read_prefix(&mut session, 1024).await.unwrap();
    assert_eq!(prefix, Prefix { body: None, len: 0 });
    assert_eq!(rest(&mut session).await, b"{\"max_tokens\":12}");
    assert_eq!(
        usage.reserve(&prefix.request(&session.req_header().headers)),
        [units(4096)]
    );
}

#[tokio::test]
async fn a_body_that_is_not_json_is_read_and_takes_the_default() {
    let usage = usage(TOKENS);
    for body in [
        &b"max_tokens=5"[..],
        b"{\"max_tokens\":",
        b"{\"max_tokens\":-3}",
        b"",
    ] {
        let (mut session, _client) = open(with_length(body)).await;
        let prefix = read_prefix(&mut session, 1024).await.unwrap();
        assert_eq!(prefix.body.as_deref(), Some(body));
        let estimate = body.len() as u64 * 250_000;
        assert_eq!(
            usage.reserve(&prefix.request(&session.req_header().headers)),
            [Millionths(4_096_000_000 + estimate)],
            "{body:?}"
        );
    }
}

#[tokio::test]
async fn bodies_held_for_100_continue_or_encoded_are_not_read() {
    let body = br#"{"max_tokens":1}"#;
    // The client sends the head only, as it waits for 100 Continue: read_prefix returns
    // without waiting for a body that will not come.
    let raw = post(
        &format!("Content-Length: {}\r\nExpect: 100-continue\r\n", body.len()),
        b"",
    );
    let (mut session, _client) = open(raw).await;
    let prefix = read_prefix(&mut session, 1024).await.unwrap();
    assert_eq!(
        prefix,
        Prefix {
            body: None,
            len: body.len() as u64
        }
    );

    let raw = post(
        &format!(
            "Content-Length: {}\r\nContent-Encoding: gzip\r\n",
            body.len()
        ),
        body,
    );
    let (mut session, _client) = open(raw).await;
    let prefix = read_prefix(&mut session, 1024).await.unwrap();
    assert_eq!(prefix.body, None);
    assert_eq!(rest(&mut session).await, body);
}

#[test]
fn nested_sums_and_every_shape_become_the_usage_crates_amounts() {
    let usage = usage(
        "        tokens:\n          reserve: { sum: [ { value: 0.1 }, { sum: [ { json: a.b, default: 2, times: 0.5 } ] } ] }\n          settle: { sum: [ { header: X-Cost }, { json: usage.total_tokens, times: 0.000002 } ] }\n",
    );
    let unit = &usage.units[0];
    assert_eq!(&*unit.name, "tokens");
    assert_eq!(unit.reserve.parts().len(), 2, "nested sums are flattened");
    assert!(unit.reserve.reads_body());
    let headers = http::HeaderMap::new();
    let body = br#"{"a":{"b":3}}"#;
    let request = sluice_usage::Request {
        body: Some(body),
        body_len: body.len() as u64,
        headers: &headers,
    };
    // 0.1 + 3 x 0.5, exactly.
    assert_eq!(usage.reserve(&request), [Millionths(1_600_000)]);
    assert_eq!(unit.settle.parts().len(), 2);
    assert!(unit.settle.reads_body());
}
