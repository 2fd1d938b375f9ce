//! Adversarial HTTP/1.1 input: request smuggling shapes, oversized heads, bad
//! chunking, Host/URI disagreement, `Expect`, `Upgrade`, HTTP/1.0 without Host, garbage and NUL
//! bytes.
//!
//! Each case is written raw to a fresh connection of a real gateway in front of two echo
//! members (`api.test` → `api`, `other.test` → `other`). Whatever the gateway answers, three
//! things must hold:
//! - the answer is a defined 4xx or a close (or, for shapes HTTP allows, the one request the
//!   client sent, forwarded once);
//! - nothing the client did not send as a request of its own reaches a member: the members'
//!   request counts rise by at most what the client saw answered, and a hidden
//!   `GET /smuggled` never arrives;
//! - the gateway stays up: a plain request on a new connection right after is answered by the
//!   right member with its own target (a request left queued on a pooled upstream connection
//!   would answer it instead).
//!
//! Most refusals come from Pingora's parser, before sluice sees a request. They used to get a
//! bare Pingora 400 with no access-log line and no metric; they now get sluice's problem+json,
//! an access line and a count, on the first request of a connection and on
//! later keep-alive and pipelined ones alike: see the tests at the end, beside the 431 and the
//! two header defects the suite found, which are fixed too.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use sluice_echo::EchoServer;
use support::{metric_value, start_backends, url, wait_until, Config, Gateway, HttpClient, Route};

/// How long a probe waits for an answer. Every case here is answered or closed at once; the
/// bound only keeps a regression (a gateway waiting for bytes that never come) from hanging.
const ANSWER_WITHIN: Duration = Duration::from_secs(20);

/// A request smuggled inside another request's body. The members must never see it.
const SMUGGLED: &str = "GET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n";

struct Fixture {
    backends: Vec<EchoServer>,
    gw: Gateway,
}

/// What came back for one raw case.
struct Probe {
    name: String,
    /// The answer, if one could be read before the gateway closed the connection.
    answer: Option<support::Response>,
    /// Requests the members received because of this case.
    forwarded: u64,
    client: HttpClient,
}

impl Probe {
    fn status(&self) -> Option<u16> {
        self.answer.as_ref().map(|r| r.status)
    }

    /// Whether the gateway closed the connection (waits up to [`ANSWER_WITHIN`]).
    async fn closed(&mut self) -> bool {
        self.client.wait_closed(ANSWER_WITHIN).await
    }

    /// A defined 4xx, or a close without an answer; and no member saw anything.
    async fn assert_refused(&mut self) {
        match self.status() {
            Some(400..=499) => {}
            None => assert!(self.closed().await, "{}: no answer and no close", self.name),
            Some(other) => panic!("{}: status {other}, expected a 4xx or a close", self.name),
        }
        assert_eq!(
            self.forwarded, 0,
            "{}: a member was sent something",
            self.name
        );
    }

    /// Answered by member `api` with the echo of exactly one request for `target`.
    fn assert_forwarded_once(&self, target: &str) -> serde_json::Value {
        let answer = self
            .answer
            .as_ref()
            .unwrap_or_else(|| panic!("{}: no answer", self.name));
        assert_eq!(answer.status, 200, "{}: {}", self.name, answer.text());
        let echo = answer.json();
        assert_eq!(echo["upstream"], "api", "{}", self.name);
        assert_eq!(echo["target"], target, "{}", self.name);
        assert_eq!(
            self.forwarded, 1,
            "{}: the member saw more than the request",
            self.name
        );
        echo
    }
}

impl Fixture {
    async fn start() -> Fixture {
        let backends = start_backends(&["api", "other"]).await;
        let gw = Config::new()
            .route(Route::new("api").member(url(backends[0].local_addr())))
            .route(Route::new("other").member(url(backends[1].local_addr())))
            .start();
        Fixture { backends, gw }
    }

    fn addr(&self) -> SocketAddr {
        self.gw.proxy_addr()
    }

    fn member_requests(&self) -> u64 {
        self.backends.iter().map(EchoServer::requests).sum()
    }

    /// Writes `raw` on a new connection, reads one answer, then checks that the gateway is up
    /// and that no request was left behind on the way to a member.
    async fn probe(&self, name: &str, raw: &[u8]) -> Probe {
        let before = self.member_requests();
        let mut client = HttpClient::connect(self.addr()).await.unwrap();
        // The gateway may refuse and close before it has read everything: a failed write is
        // part of the behaviour under test, not an error of the test.
        let _ = client.write_raw(raw).await;
        let answer = tokio::time::timeout(ANSWER_WITHIN, client.read_response(false))
            .await
            .ok()
            .and_then(Result::ok);
        let forwarded = self.member_requests() - before;
        self.assert_still_serving(name).await;
        // The sentinel itself is one request; anything else that arrived meanwhile was sent
        // by the case.
        let forwarded_with_sentinel = self.member_requests() - before;
        assert_eq!(
            forwarded_with_sentinel,
            forwarded + 1,
            "{name}: a member received a request nobody was answered for"
        );
        Probe {
            name: name.to_string(),
            answer,
            forwarded,
            client,
        }
    }

    /// A plain request on a new connection is answered by `api`, for its own target.
    async fn assert_still_serving(&self, after: &str) {
        let r = support::request(self.addr(), "GET", "api.test", "/sentinel", &[], b"").await;
        assert_eq!(r.status, 200, "after {after}: {}", r.text());
        let echo = r.json();
        assert_eq!(
            (echo["upstream"].as_str(), echo["target"].as_str()),
            (Some("api"), Some("/sentinel")),
            "after {after}: the next request got someone else's answer"
        );
    }
}

/// `POST /a` whose body, framed as chunked, is empty, and framed by Content-Length, hides
/// [`SMUGGLED`].
fn te_cl(te_line: &str) -> String {
    let body = format!("0\r\n\r\n{SMUGGLED}");
    format!(
        "POST /a HTTP/1.1\r\nHost: api.test\r\n{te_line}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Content-Length and Transfer-Encoding together: RFC 9112 §6.1 lets a server reject the request
/// or frame it by Transfer-Encoding alone, and either way close the connection after answering.
/// Pingora does the latter: the member gets one request with an empty chunked body and no
/// Content-Length, and the bytes after the last chunk (a whole second request) are dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_with_transfer_encoding_smuggles_nothing() {
    let fx = Fixture::start().await;
    let body = format!("0\r\n\r\n{SMUGGLED}");
    let cases = [
        ("CL then TE", te_cl("Transfer-Encoding: chunked")),
        (
            "TE then CL",
            format!(
                "POST /a HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
        ),
        (
            "CL shorter than the chunked body",
            format!("POST /a HTTP/1.1\r\nHost: api.test\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n{body}"),
        ),
        ("TE in capitals", te_cl("Transfer-Encoding: CHUNKED")),
        ("TE after two spaces", te_cl("Transfer-Encoding:  chunked")),
        ("TE after a tab", te_cl("Transfer-Encoding:\tchunked")),
        ("TE identity, chunked", te_cl("Transfer-Encoding: identity, chunked")),
    ];
    for (name, raw) in cases {
        let mut p = fx.probe(name, raw.as_bytes()).await;
        if matches!(p.status(), Some(400..=499) | None) {
            p.assert_refused().await;
            continue;
        }
        let echo = p.assert_forwarded_once("/a");
        assert_eq!(
            echo["body_len"], 0,
            "{name}: the member read past the last chunk"
        );
        assert!(
            echo["headers"].get("content-length").is_none(),
            "{name}: both framings reached the member: {echo}"
        );
        assert!(
            p.closed().await,
            "{name}: the connection stayed open for the hidden request"
        );
    }
}

/// A `Connection` field that names `Content-Length` makes sluice drop that field on the way up;
/// the body, a whole request here, must still reach the member as a body (Pingora re-frames it
/// as chunked), never as a second request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_listed_content_length_smuggles_nothing() {
    let fx = Fixture::start().await;
    for listed in [
        "content-length",
        "keep-alive, Content-Length",
        "transfer-encoding",
    ] {
        let raw = format!(
            "POST /a HTTP/1.1\r\nHost: api.test\r\nConnection: {listed}\r\nContent-Length: {}\r\n\r\n{SMUGGLED}",
            SMUGGLED.len()
        );
        let p = fx.probe(listed, raw.as_bytes()).await;
        let echo = p.assert_forwarded_once("/a");
        assert_eq!(echo["body_len"], SMUGGLED.len(), "{listed}");
    }
}

/// Lengths that disagree or are not a plain decimal are refused; no member is contacted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_or_malformed_content_lengths_are_refused() {
    let fx = Fixture::start().await;
    let post = |cl_lines: &str, body: &str| {
        format!("POST /a HTTP/1.1\r\nHost: api.test\r\n{cl_lines}\r\n{body}")
    };
    let cases = [
        (
            "two different lengths",
            post("Content-Length: 5\r\nContent-Length: 6\r\n", "hello!"),
        ),
        (
            "a list of lengths",
            post("Content-Length: 5, 6\r\n", "hello!"),
        ),
        ("a negative length", post("Content-Length: -1\r\n", "hello")),
        ("a signed length", post("Content-Length: +5\r\n", "hello")),
        ("a word", post("Content-Length: abc\r\n", "hello")),
        // Present but empty: an invalid length, not an absent one.
        ("an empty length", post("Content-Length: \r\n", "hello")),
        (
            "a length past u64",
            post("Content-Length: 99999999999999999999999\r\n", "hello"),
        ),
    ];
    for (name, raw) in cases {
        fx.probe(name, raw.as_bytes()).await.assert_refused().await;
    }
    // The same length twice, or a list of it, is one length (RFC 9110 §8.6 allows either
    // refusing or using it; Pingora uses it), and the member gets it as one value
    // (RFC 9112 §6.3): hyper, the echo member's server, refuses a list with a 400.
    let cases = [
        (
            "the same length twice",
            post("Content-Length: 5\r\nContent-Length: 5\r\n", "hello"),
        ),
        (
            "a list of one length",
            post("Content-Length: 5, 5\r\n", "hello"),
        ),
        (
            "a list and a line of one length",
            post("Content-Length: 5,5\r\nContent-Length: 5\r\n", "hello"),
        ),
    ];
    for (name, raw) in cases {
        let p = fx.probe(name, raw.as_bytes()).await;
        let echo = p.assert_forwarded_once("/a");
        assert_eq!(echo["body_len"], 5, "{name}");
        assert_eq!(echo["headers"]["content-length"], "5", "{name}: {echo}");
    }
}

/// A member's answer whose `Content-Length` is a list of one length, or that length twice,
/// reaches the client with that length once (RFC 9112 §6.3), and its body whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_listed_content_length_reaches_the_client_as_one() {
    for (name, answer) in [
        (
            "a list",
            &b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\nConnection: close\r\n\r\nhello"[..],
        ),
        (
            "two lines",
            &b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"[..],
        ),
    ] {
        let member = start_raw_member(answer).await;
        let gw = Config::new()
            .route(Route::new("api").member(url(member)))
            .start();
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(r.status, 200, "{name}");
        let lengths: Vec<&str> = r
            .headers
            .iter()
            .filter(|(n, _)| n == "content-length")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(lengths, ["5"], "{name}");
        assert_eq!(r.body, b"hello", "{name}");
    }
}

/// Transfer-Encoding spellings that a member might read differently from the gateway are
/// refused, with or without a Content-Length beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn obfuscated_transfer_encodings_are_refused() {
    let fx = Fixture::start().await;
    let chunked_only = |te_lines: &str| {
        format!("POST /a HTTP/1.1\r\nHost: api.test\r\n{te_lines}\r\n\r\n0\r\n\r\n{SMUGGLED}")
    };
    let cases = [
        ("xchunked", te_cl("Transfer-Encoding: xchunked")),
        (
            "chunked, identity",
            te_cl("Transfer-Encoding: chunked, identity"),
        ),
        (
            "identity alone",
            chunked_only("Transfer-Encoding: identity"),
        ),
        ("line led by a space", te_cl(" Transfer-Encoding: chunked")),
        ("line led by a tab", te_cl("\tTransfer-Encoding: chunked")),
        ("obs-fold", te_cl("Transfer-Encoding:\r\n chunked")),
        (
            "space before the colon",
            te_cl("Transfer-Encoding : chunked"),
        ),
        (
            "two Transfer-Encoding fields",
            chunked_only("Transfer-Encoding: chunked\r\nTransfer-Encoding: identity"),
        ),
        (
            "chunked on HTTP/1.0",
            te_cl("Transfer-Encoding: chunked").replacen("HTTP/1.1", "HTTP/1.0", 1),
        ),
    ];
    for (name, raw) in cases {
        fx.probe(name, raw.as_bytes()).await.assert_refused().await;
    }
}

/// A chunked body that cannot be framed is refused with sluice's own 400 before the member
/// receives a complete request, and the connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chunking_is_refused() {
    let fx = Fixture::start().await;
    let chunked = |body: &str| {
        format!("POST /a HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n{body}")
    };
    let cases = [
        ("size not hex", chunked("zz\r\nhello\r\n0\r\n\r\n")),
        ("no CRLF after the data", chunked("5\r\nhelloXX0\r\n\r\n")),
        (
            "data longer than the size",
            chunked("3\r\nhello\r\n0\r\n\r\n"),
        ),
        (
            "size past u64",
            chunked("ffffffffffffffffffff\r\nhello\r\n0\r\n\r\n"),
        ),
        ("negative size", chunked("-5\r\nhello\r\n0\r\n\r\n")),
    ];
    for (name, raw) in cases {
        let mut p = fx.probe(name, raw.as_bytes()).await;
        let answer = p
            .answer
            .as_ref()
            .unwrap_or_else(|| panic!("{name}: no answer"));
        assert_eq!(
            (answer.status, answer.header("x-sluice-error")),
            (400, Some("bad_request")),
            "{name}"
        );
        p.assert_refused().await;
        assert!(p.closed().await, "{name}: connection left open mid-body");
    }
}

/// Heads too large to be reasonable are refused; one that is merely large is forwarded whole,
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_heads_are_refused_or_forwarded_whole() {
    let fx = Fixture::start().await;
    let kib = |n: usize| "a".repeat(n * 1024);
    let many: String = (0..500).map(|i| format!("X-H{i}: v\r\n")).collect();
    let refused = [
        (
            "a 100 KiB request target",
            format!("GET /{} HTTP/1.1\r\nHost: api.test\r\n\r\n", kib(100)),
        ),
        (
            "500 header fields",
            format!("GET /a HTTP/1.1\r\nHost: api.test\r\n{many}\r\n"),
        ),
        (
            "a 2 MiB header field",
            format!(
                "GET /a HTTP/1.1\r\nHost: api.test\r\nX-Big: {}\r\n\r\n",
                kib(2048)
            ),
        ),
    ];
    for (name, raw) in refused {
        fx.probe(name, raw.as_bytes()).await.assert_refused().await;
    }
    // Under Pingora's 1 MiB head limit, and with no limit of sluice's own yet (see the ignored
    // test below), a 100 KiB field goes through.
    let raw = format!(
        "GET /a HTTP/1.1\r\nHost: api.test\r\nX-Big: {}\r\n\r\n",
        kib(100)
    );
    let mut p = fx.probe("a 100 KiB header field", raw.as_bytes()).await;
    if p.status() == Some(200) {
        let echo = p.assert_forwarded_once("/a");
        assert_eq!(
            echo["headers"]["x-big"].as_str().map(str::len),
            Some(100 * 1024)
        );
    } else {
        p.assert_refused().await;
    }
}

/// The host a request is routed by is never ambiguous: an absolute URI that names another host
/// than `Host`, two `Host` fields, a list, userinfo or a NUL in it are refused, and `other`
/// never gets a request meant for `api` (or the reverse).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_disagreements_are_refused() {
    let fx = Fixture::start().await;
    let cases = [
        (
            "absolute URI and another Host",
            "GET http://api.test/x HTTP/1.1\r\nHost: other.test\r\n\r\n",
        ),
        (
            "two different Host fields",
            "GET /x HTTP/1.1\r\nHost: api.test\r\nHost: other.test\r\n\r\n",
        ),
        (
            "the same Host twice",
            "GET /x HTTP/1.1\r\nHost: api.test\r\nHost: api.test\r\n\r\n",
        ),
        (
            "a list in Host",
            "GET /x HTTP/1.1\r\nHost: api.test, other.test\r\n\r\n",
        ),
        (
            "userinfo in Host",
            "GET /x HTTP/1.1\r\nHost: other.test@api.test\r\n\r\n",
        ),
        (
            "NUL in Host",
            "GET /x HTTP/1.1\r\nHost: api.test\0.other.test\r\n\r\n",
        ),
    ];
    for (name, raw) in cases {
        fx.probe(name, raw.as_bytes()).await.assert_refused().await;
    }
    assert_eq!(fx.backends[1].requests(), 0);
}

/// `Expect: 100-continue` with the body sent at once (as curl does after its wait) is forwarded
/// once, body and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_forwarded_once() {
    let fx = Fixture::start().await;
    let raw = "POST /x HTTP/1.1\r\nHost: api.test\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello";
    let p = fx.probe("Expect: 100-continue", raw.as_bytes()).await;
    assert_eq!(p.assert_forwarded_once("/x")["body_len"], 5);
    // The same to a host with no route: refused without contacting anyone.
    let raw = "POST /x HTTP/1.1\r\nHost: nowhere.test\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello";
    let mut p = fx.probe("Expect to no route", raw.as_bytes()).await;
    assert_eq!(
        p.answer.as_ref().and_then(|r| r.header("x-sluice-error")),
        Some("no_route")
    );
    p.assert_refused().await;
}

/// `Upgrade` requests reach the member as one request (the echo member answers 200, not 101, so
/// the connection never becomes a tunnel).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_requests_reach_the_member_once() {
    let fx = Fixture::start().await;
    let cases = [
        (
            "websocket",
            "GET /ws HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
            "/ws",
        ),
        (
            "h2c",
            "GET /x HTTP/1.1\r\nHost: api.test\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
            "/x",
        ),
    ];
    for (name, raw, target) in cases {
        fx.probe(name, raw.as_bytes())
            .await
            .assert_forwarded_once(target);
    }
}

/// HTTP/1.0 needs no Host: without one and without an absolute URI there is nothing to route
/// by (404 `no_route`); with an absolute URI it routes by the URI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_1_0_without_host() {
    let fx = Fixture::start().await;
    let mut p = fx
        .probe("HTTP/1.0, no Host", b"GET /x HTTP/1.0\r\n\r\n")
        .await;
    assert_eq!(
        p.answer.as_ref().and_then(|r| r.header("x-sluice-error")),
        Some("no_route")
    );
    p.assert_refused().await;
    fx.probe(
        "HTTP/1.0, absolute URI, no Host",
        b"GET http://api.test/x HTTP/1.0\r\n\r\n",
    )
    .await
    .assert_forwarded_once("/x");
}

/// What is not an HTTP/1.x request, or carries NUL or bare CR bytes, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_nul_bytes_are_refused() {
    let fx = Fixture::start().await;
    let cases: [(&str, &[u8]); 15] = [
        ("a word", b"GARBAGE\r\n\r\n"),
        ("a method alone", b"GET\r\n\r\n"),
        ("HTTP/9.9", b"GET / HTTP/9.9\r\nHost: api.test\r\n\r\n"),
        ("the HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        (
            "a token after the version",
            b"GET / HTTP/1.1 x\r\nHost: api.test\r\n\r\n",
        ),
        (
            "a TLS ClientHello",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03hello",
        ),
        ("random binary", b"\x00\xff\xfe\x80\x81\r\n\r\n"),
        (
            "a field without a colon",
            b"GET /x HTTP/1.1\r\nHost: api.test\r\nNoColon\r\n\r\n",
        ),
        (
            "a space in a field name",
            b"GET /x HTTP/1.1\r\nHost: api.test\r\nX A: b\r\n\r\n",
        ),
        (
            "a bare CR in a value",
            b"GET /x HTTP/1.1\r\nHost: api.test\r\nX-A: a\rb\r\n\r\n",
        ),
        (
            "NUL in a value",
            b"GET /x HTTP/1.1\r\nHost: api.test\r\nX-A: a\0b\r\n\r\n",
        ),
        (
            "NUL in a name",
            b"GET /x HTTP/1.1\r\nHost: api.test\r\nX\0A: b\r\n\r\n",
        ),
        (
            "NUL in the target",
            b"GET /a\0b HTTP/1.1\r\nHost: api.test\r\n\r\n",
        ),
        (
            "NUL in the method",
            b"G\0T /a HTTP/1.1\r\nHost: api.test\r\n\r\n",
        ),
        (
            "an encoded NUL in the target",
            b"GET /a%00b HTTP/1.1\r\nHost: api.test\r\n\r\n",
        ),
    ];
    for (name, raw) in cases {
        fx.probe(name, raw).await.assert_refused().await;
    }
}

/// Shapes HTTP allows a server to accept (bare LF line ends, empty lines before the request
/// line) or that Pingora repairs (a space in the target, sent on percent-encoded) are forwarded
/// as the one request they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lenient_shapes_are_forwarded_as_one_request() {
    let fx = Fixture::start().await;
    let cases: [(&str, &[u8], &str); 3] = [
        ("bare LF", b"GET /x HTTP/1.1\nHost: api.test\n\n", "/x"),
        (
            "empty lines first",
            b"\r\n\r\nGET /x HTTP/1.1\r\nHost: api.test\r\n\r\n",
            "/x",
        ),
        (
            "a space in the target",
            b"GET /a b HTTP/1.1\r\nHost: api.test\r\n\r\n",
            "/a%20b",
        ),
    ];
    for (name, raw, target) in cases {
        let mut p = fx.probe(name, raw).await;
        if p.status() == Some(200) {
            p.assert_forwarded_once(target);
        } else {
            p.assert_refused().await;
        }
    }
}

/// Random mutations of three well-formed requests (bytes that matter to framing inserted,
/// ranges deleted, lines duplicated) never make a member receive a request whose answer the
/// client did not get: after each case, the member's request count has risen by exactly the
/// number of its answers the client read. Each case ends with a `Connection: close` request of
/// its own, so the gateway serves everything it will serve and then closes. (A client that
/// half-closes instead is taken for gone: Pingora drops the exchange, even after the member
/// answered.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_requests_never_smuggle() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config as Cases, TestRunner};

    let fx = Fixture::start().await;
    let bases: [&[u8]; 3] = [
        b"POST /a HTTP/1.1\r\nHost: api.test\r\nContent-Length: 5\r\n\r\nhello",
        b"POST /a HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"GET /a HTTP/1.1\r\nHost: api.test\r\nX-A: 1\r\n\r\n",
    ];
    let pieces: &[&[u8]] = &[
        b" ",
        b"\t",
        b"\r",
        b"\n",
        b"\r\n",
        b":",
        b",",
        b"0",
        b"\0",
        b"chunked",
        b"Content-Length: 0\r\n",
        b"Content-Length: 50\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Host: other.test\r\n",
        b"0\r\n\r\n",
        SMUGGLED.as_bytes(),
    ];
    #[derive(Debug, Clone)]
    enum Edit {
        Insert(prop::sample::Index, usize),
        Delete(prop::sample::Index, usize),
        Duplicate(prop::sample::Index, prop::sample::Index),
    }
    let edit = prop_oneof![
        (any::<prop::sample::Index>(), 0..pieces.len()).prop_map(|(at, p)| Edit::Insert(at, p)),
        (any::<prop::sample::Index>(), 1usize..8).prop_map(|(at, n)| Edit::Delete(at, n)),
        (any::<prop::sample::Index>(), any::<prop::sample::Index>())
            .prop_map(|(a, b)| Edit::Duplicate(a, b)),
    ];
    let strategy = (0..bases.len(), prop::collection::vec(edit, 1..4));
    let apply = |base: usize, edits: &[Edit]| {
        let mut bytes = bases[base].to_vec();
        for e in edits {
            match e {
                Edit::Insert(at, p) => {
                    let at = at.index(bytes.len() + 1);
                    bytes.splice(at..at, pieces[*p].iter().copied());
                }
                Edit::Delete(at, n) if !bytes.is_empty() => {
                    let at = at.index(bytes.len());
                    bytes.drain(at..(at + n).min(bytes.len()));
                }
                Edit::Duplicate(a, b) if !bytes.is_empty() => {
                    let (a, b) = (a.index(bytes.len()), b.index(bytes.len()));
                    let copy = bytes[a.min(b)..a.max(b)].to_vec();
                    bytes.splice(a.max(b)..a.max(b), copy);
                }
                _ => {}
            }
        }
        bytes
    };
    // A quarter of proptest's case count: each case is a connection to a real gateway.
    let cases = (Cases::default().cases / 4).max(1);
    let mut runner = TestRunner::new(Cases {
        cases,
        ..Cases::default()
    });
    let handle = tokio::runtime::Handle::current();
    let result = tokio::task::block_in_place(|| {
        runner.run(&strategy, |(base, edits)| {
            let raw = apply(base, &edits);
            let (answered, forwarded, reset) = handle.block_on(async {
                let before = fx.member_requests();
                let mut client = HttpClient::connect(fx.addr()).await.unwrap();
                // One write: the gateway may close after a refusal, and bytes arriving after that
                // would make the kernel reset the connection, destroying answers already sent.
                let mut all = raw.clone();
                all.extend_from_slice(
                    b"GET /end HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n",
                );
                let _ = client.write_raw(&all).await;
                let (mut answered, mut reset) = (0, false);
                // Bounded: the input holds at most a handful of requests. A body that swallows
                // the last request leaves the gateway waiting for more; the short wait ends
                // that. But while the member has had more requests than were answered, an
                // answer is due, and a loaded machine may take longer than that to bring it.
                for _ in 0..8 {
                    let due = fx.member_requests() - before > answered;
                    let wait = Duration::from_secs(if due { 20 } else { 2 });
                    match tokio::time::timeout(wait, client.read_response(false)).await {
                        Ok(Ok(r)) => answered += u64::from(r.header("x-upstream").is_some()),
                        Ok(Err(e)) => {
                            reset = e.kind() == std::io::ErrorKind::ConnectionReset;
                            break;
                        }
                        // Nothing came; unless an answer is due after all, nothing will.
                        Err(_) if fx.member_requests() - before > answered => {}
                        Err(_) => break,
                    }
                }
                fx.assert_still_serving("a mutated request").await;
                (answered, fx.member_requests() - before - 1, reset)
            });
            // A reset may have destroyed answers the gateway did send: nothing to conclude.
            prop_assume!(!reset);
            prop_assert_eq!(forwarded, answered, "{:?}", String::from_utf8_lossy(&raw));
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A member that answers every request with `response`, then closes.
async fn start_raw_member(response: &'static [u8]) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = conn.write_all(response).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    addr
}

/// A member's answer loses its hop-by-hop fields on the way to the client too, including those
/// its `Connection` field names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_fields_of_a_members_answer_are_removed() {
    let member = start_raw_member(
        b"HTTP/1.1 200 OK\r\nConnection: x-secret\r\nKeep-Alive: timeout=5\r\nX-Secret: v\r\nX-Other: o\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)))
        .start();
    let r = support::request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!((r.status, r.text().as_str()), (200, "ok"));
    assert_eq!(r.header("x-other"), Some("o"));
    assert_eq!(r.header("x-secret"), None, "{:?}", r.headers);
    assert_eq!(r.header("keep-alive"), None, "{:?}", r.headers);
}

/// An interim answer is no start of the final one: a member that sends `100 Continue` and then
/// fails leaves the gateway its own final answer to give (502), not a connection cut after the
/// 100 (RFC 9110 §15.2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_after_an_interim_answer_still_gets_a_final_answer() {
    let member = start_raw_member(b"HTTP/1.1 100 Continue\r\n\r\n").await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)))
        .start();
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    client
        .write_raw(
            b"POST /x HTTP/1.1\r\nHost: api.test\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello",
        )
        .await
        .unwrap();
    let r = client.read_response(false).await.expect("a final answer");
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("upstream_error"));
}

/// An interim answer (`103 Early Hints`) passes, and the final answer after it carries the
/// route's `RateLimit` fields, as every answer on a route with a quota does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_final_answer_after_an_interim_one_carries_the_ratelimit_fields() {
    let member = start_raw_member(
        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    let gw = Config::new()
        .route(
            Route::new("api")
                .member(url(member))
                .quota(support::Quota::window("minute", 100, "1m")),
        )
        .start();
    let r = support::request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!((r.status, r.text().as_str()), (200, "ok"));
    assert!(r.header("ratelimit").is_some(), "{:?}", r.headers);
    assert!(r.header("ratelimit-policy").is_some(), "{:?}", r.headers);
}

/// An HTTP/1.0 client gets neither chunked framing nor an interim answer (RFC 9112 §6.1, RFC
/// 9110 §15.2): a member's chunked answer reaches it delimited by the connection's close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_client_gets_no_chunks_and_no_interim_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let member = start_raw_member(
        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n3\r\n!!!\r\n0\r\n\r\n",
    )
    .await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)))
        .start();
    let mut conn = tokio::net::TcpStream::connect(gw.proxy_addr())
        .await
        .unwrap();
    conn.write_all(b"GET / HTTP/1.0\r\nHost: api.test\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut got))
        .await
        .expect("the answer ends with the connection")
        .unwrap();
    let text = String::from_utf8_lossy(&got).to_string();
    let (head, body) = text.split_once("\r\n\r\n").expect("a head");
    assert!(head.starts_with("HTTP/1.1 200"), "{text}");
    // One head only: the 103 did not come first (its status line, not any "103" in the text:
    // the request id is random hex).
    assert_eq!(text.matches("HTTP/1.").count(), 1, "{text}");
    assert!(
        !head.to_ascii_lowercase().contains("transfer-encoding"),
        "{text}"
    );
    assert_eq!(body, "ok!!!", "{text}");
}

/// A `Connection` field that nominates what may not be removed (the request's `Host` or its
/// `X-Forwarded-*`), a token that is no token, or too many of them, is refused with `400`
/// before admission: nothing is charged, and no member is chosen, contacted or blamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_field_that_cannot_go_upstream_costs_nothing() {
    let backends = start_backends(&["api"]).await;
    let gw = Config::new()
        .route(
            Route::new("api")
                .member(url(backends[0].local_addr()))
                .quota(support::Quota::window("minute", 100, "1m")),
        )
        .start();
    for connection in [
        "x-forwarded-for",
        "Host",
        "\"x-secret\"",
        "a, b, c, d, e, f, g, h, i, j, k",
    ] {
        let r = support::request(
            gw.proxy_addr(),
            "GET",
            "api.test",
            "/",
            &[("Connection", connection)],
            b"",
        )
        .await;
        assert_eq!(r.status, 400, "{connection}: {}", r.text());
        assert_eq!(r.header("x-sluice-error"), Some("bad_request"));
    }
    assert_eq!(backends[0].requests(), 0, "no member was contacted");
    let r = support::request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 200);
    let ratelimit = r.header("ratelimit").unwrap_or_default();
    assert!(
        ratelimit.contains("r=99"),
        "only this request was charged: {ratelimit}"
    );
}

/// A member's answer that names its own `Content-Length` in `Connection` keeps its length: the
/// client gets a framed answer on a connection that stays open for its next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_connection_listed_content_length_keeps_the_answer_framed() {
    let member = start_raw_member(
        b"HTTP/1.1 200 OK\r\nConnection: content-length\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)))
        .start();
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for path in ["/one", "/two"] {
        let r = client
            .request("GET", "api.test", path, &[], b"")
            .await
            .expect("an answer on the same connection");
        assert_eq!((r.status, r.text().as_str()), (200, "ok"));
        assert_eq!(r.header("content-length"), Some("2"), "{:?}", r.headers);
    }
}

// ---------------------------------------------------------------------------------------------
// Known gaps, kept visible: run with `cargo test --test adversarial -- --ignored`.
// ---------------------------------------------------------------------------------------------

/// Requests Pingora's parser refuses never reach sluice's routing. They get sluice's
/// problem+json `400 bad_request` (not Pingora's bare 400), one access-log line with route `-`
/// and a detail that quotes nothing of the request, and a count in `sluice_requests_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parser_rejections_are_answered_logged_and_counted() {
    let fx = Fixture::start().await;
    let cases: [(&str, String); 5] = [
        (
            "two different lengths",
            "POST /a HTTP/1.1\r\nHost: api.test\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!".into(),
        ),
        ("xchunked", te_cl("Transfer-Encoding: xchunked")),
        (
            "two different Host fields",
            "GET /x HTTP/1.1\r\nHost: api.test\r\nHost: other.test\r\n\r\n".into(),
        ),
        ("a word", "GARBAGE\r\n\r\n".into()),
        (
            "NUL in a value",
            "GET /x HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer s3cr3t\0b\r\n\r\n"
                .into(),
        ),
    ];
    let counted = |metrics: &str| {
        metric_value(metrics, "sluice_requests_total", &[("status", "400")]).unwrap_or(0.0)
    };
    let before = counted(&fx.gw.metrics().await);
    for (name, raw) in &cases {
        let p = fx.probe(name, raw.as_bytes()).await;
        let answer = p
            .answer
            .as_ref()
            .unwrap_or_else(|| panic!("{name}: no answer"));
        assert_eq!(answer.status, 400, "{name}");
        assert_eq!(
            answer.header("content-type"),
            Some("application/problem+json"),
            "{name}"
        );
        assert_eq!(
            answer.header("x-sluice-error"),
            Some("bad_request"),
            "{name}"
        );
        assert_eq!(
            answer.header("server"),
            None,
            "{name}: Pingora's own answer"
        );
        assert_eq!(answer.json()["status"], 400, "{name}");
    }
    let refusals = || {
        fx.gw
            .log_json()
            .into_iter()
            .filter(|l| l["target"] == "sluice::access" && l["status"] == 400)
            .collect::<Vec<_>>()
    };
    let logged = wait_until(Duration::from_secs(20), || refusals().len() == cases.len()).await;
    assert!(logged, "one access-log line per refusal:\n{}", fx.gw.logs());
    for line in refusals() {
        assert_eq!(line["route"], "-", "{line}");
        assert_eq!(line["error"], "bad_request", "{line}");
        assert!(
            line["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{line}"
        );
    }
    assert!(
        !fx.gw.logs().contains("s3cr3t"),
        "a header value reached the log:\n{}",
        fx.gw.logs()
    );
    assert_eq!(counted(&fx.gw.metrics().await) - before, cases.len() as f64);
}

/// A bad request after a good one on the same connection, sent after the first answer
/// (keep-alive) or in the same write (pipelined), gets the same treatment as a first one: the
/// good one is answered by its member, the bad one by sluice's problem+json, logged and counted,
/// and then the connection closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_requests_on_a_connection_are_refused_the_same_way() {
    let fx = Fixture::start().await;
    let good = "GET /first HTTP/1.1\r\nHost: api.test\r\n\r\n";
    let bad = "GET /x HTTP/1.1\r\nHost: api.test\r\nHost: other.test\r\n\r\n";
    let counted = |metrics: &str| {
        metric_value(
            metrics,
            "sluice_requests_total",
            &[("route", "-"), ("status", "400")],
        )
        .unwrap_or(0.0)
    };
    let before = counted(&fx.gw.metrics().await);
    for pipelined in [false, true] {
        let mut client = HttpClient::connect(fx.addr()).await.unwrap();
        if pipelined {
            client
                .write_raw(format!("{good}{bad}").as_bytes())
                .await
                .unwrap();
        } else {
            client.write_raw(good.as_bytes()).await.unwrap();
        }
        let first = client.read_response(false).await.unwrap();
        assert_eq!(
            first.status,
            200,
            "pipelined: {pipelined}: {}",
            first.text()
        );
        assert_eq!(first.json()["target"], "/first");
        if !pipelined {
            client.write_raw(bad.as_bytes()).await.unwrap();
        }
        let second = client.read_response(false).await.unwrap();
        assert_eq!(second.status, 400, "pipelined: {pipelined}");
        assert_eq!(second.header("x-sluice-error"), Some("bad_request"));
        assert_eq!(
            second.json()["detail"],
            "multiple Host header fields",
            "pipelined: {pipelined}"
        );
        assert!(
            client.wait_closed(ANSWER_WITHIN).await,
            "pipelined: {pipelined}"
        );
    }
    let logged = wait_until(Duration::from_secs(20), || {
        fx.gw
            .log_json()
            .iter()
            .filter(|l| l["target"] == "sluice::access" && l["route"] == "-" && l["status"] == 400)
            .count()
            == 2
    })
    .await;
    assert!(logged, "one access-log line per refusal:\n{}", fx.gw.logs());
    assert_eq!(counted(&fx.gw.metrics().await) - before, 2.0);
}

/// A refused HEAD request gets the head of the answer and no body (RFC 9110 §9.3.2), and its
/// access line still says 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_head_request_gets_no_body() {
    let fx = Fixture::start().await;
    let mut client = HttpClient::connect(fx.addr()).await.unwrap();
    client
        .write_raw(b"HEAD /x HTTP/1.1\r\nHost: api.test\r\nHost: other.test\r\n\r\n")
        .await
        .unwrap();
    let answer = client.read_response(true).await.unwrap();
    assert_eq!(answer.status, 400);
    assert_eq!(answer.header("x-sluice-error"), Some("bad_request"));
    // Nothing follows the head: the next thing the connection does is close.
    assert!(client.wait_closed(ANSWER_WITHIN).await);
    let logged = wait_until(Duration::from_secs(20), || {
        fx.gw
            .log_json()
            .iter()
            .any(|l| l["target"] == "sluice::access" && l["route"] == "-" && l["status"] == 400)
    })
    .await;
    assert!(logged, "{}", fx.gw.logs());
}

/// A 100 KiB header block, above `limits.max_header_bytes` (64 KiB by default), gets 431.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_header_block_gets_431() {
    let fx = Fixture::start().await;
    let raw = format!(
        "GET /a HTTP/1.1\r\nHost: api.test\r\nX-Big: {}\r\n\r\n",
        "a".repeat(100 * 1024)
    );
    let mut p = fx.probe("a 100 KiB header field", raw.as_bytes()).await;
    assert_eq!(p.status(), Some(431));
    p.assert_refused().await;
}

/// Several `X-Forwarded-For` fields are one list (RFC 9110 §5.3): once only the first reached
/// the member (`1.1.1.1` then `2.2.2.2` went up as `1.1.1.1, 127.0.0.1`). See also
/// `headers::proptests::forwarded_for_keeps_every_prior_field`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_x_forwarded_for_field_is_kept() {
    let fx = Fixture::start().await;
    let raw = "GET /a HTTP/1.1\r\nHost: api.test\r\nX-Forwarded-For: 1.1.1.1\r\nX-Forwarded-For: 2.2.2.2\r\n\r\n";
    let p = fx.probe("two X-Forwarded-For fields", raw.as_bytes()).await;
    let echo = p.assert_forwarded_once("/a");
    assert_eq!(
        echo["headers"]["x-forwarded-for"],
        "1.1.1.1, 2.2.2.2, 127.0.0.1"
    );
}

/// RFC 9110 §5.3: several `Connection` fields are one list. sluice strips only what the first
/// names, so a member answering `Connection: keep-alive` then `Connection: x-secret` hands the
/// client `X-Secret`. (On requests Pingora strips every nominated field itself.) See also
/// `headers::proptests::every_connection_field_counts`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_field_of_a_members_answer_counts() {
    let member = start_raw_member(
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nConnection: x-secret\r\nX-Secret: v\r\nContent-Length: 2\r\n\r\nok",
    )
    .await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)))
        .start();
    let r = support::request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-secret"), None, "{:?}", r.headers);
}
