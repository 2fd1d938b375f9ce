use super::*;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// A parsed response as the tests need it.
#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("body is JSON")
    }
}

/// A raw client connection, so that the tests control every byte sent.
struct Client {
    stream: TcpStream,
    buffer: Vec<u8>,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Client {
        let stream = timeout(IO_TIMEOUT, TcpStream::connect(addr))
            .await
            .expect("connect timed out")
            .expect("connect");
        Client {
            stream,
            buffer: Vec::new(),
        }
    }

    async fn send(&mut self, raw: &[u8]) {
        timeout(IO_TIMEOUT, self.stream.write_all(raw))
            .await
            .expect("write timed out")
            .expect("write");
    }

    /// Reads one response framed by Content-Length (the server always sends it).
    async fn receive(&mut self) -> Reply {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut parsed = httparse::Response::new(&mut headers);
            if let httparse::Status::Complete(head_len) =
                parsed.parse(&self.buffer).expect("valid response head")
            {
                let headers: Vec<(String, String)> = parsed
                    .headers
                    .iter()
                    .map(|h| {
                        let value = String::from_utf8(h.value.to_vec()).unwrap();
                        (h.name.to_ascii_lowercase(), value)
                    })
                    .collect();
                let status = parsed.code.unwrap();
                let body_len: usize = headers
                    .iter()
                    .find(|(n, _)| n == "content-length")
                    .map_or(0, |(_, v)| v.parse().unwrap());
                while self.buffer.len() < head_len + body_len {
                    self.fill().await;
                }
                let body = self.buffer[head_len..head_len + body_len].to_vec();
                self.buffer.drain(..head_len + body_len);
                return Reply {
                    status,
                    headers,
                    body,
                };
            }
            self.fill().await;
        }
    }

    async fn fill(&mut self) {
        let mut chunk = [0u8; 4096];
        let n = timeout(IO_TIMEOUT, self.stream.read(&mut chunk))
            .await
            .expect("read timed out")
            .expect("read");
        assert!(n > 0, "server closed the connection early");
        self.buffer.extend_from_slice(&chunk[..n]);
    }

    /// True if the server closes the connection without sending anything more.
    async fn closed_by_server(&mut self) -> bool {
        let mut chunk = [0u8; 64];
        matches!(
            timeout(IO_TIMEOUT, self.stream.read(&mut chunk)).await,
            Ok(Ok(0))
        )
    }
}

async fn start(name: &str) -> EchoServer {
    EchoServer::start(name, "127.0.0.1:0".parse().unwrap())
        .await
        .expect("start echo server")
}

#[tokio::test]
async fn get_roundtrip_keeps_connection_alive() {
    let server = start("alpha").await;
    let mut client = Client::connect(server.local_addr()).await;

    client
        .send(b"GET /some/path?x=1&y=%20 HTTP/1.1\r\nHost: example.test\r\nX-Tag: one\r\nx-tag: two\r\n\r\n")
        .await;
    let first = client.receive().await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-upstream"), Some("alpha"));
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert_eq!(first.header("connection"), None);
    assert!(first.body.ends_with(b"}\n"));
    let json = first.json();
    assert_eq!(json["upstream"], "alpha");
    assert_eq!(json["method"], "GET");
    assert_eq!(json["target"], "/some/path?x=1&y=%20");
    assert_eq!(json["headers"]["host"], "example.test");
    assert_eq!(json["headers"]["x-tag"], "one, two");
    assert_eq!(json["body_len"], 0);

    client
        .send(b"GET /second HTTP/1.1\r\nHost: example.test\r\n\r\n")
        .await;
    let second = client.receive().await;
    assert_eq!(second.status, 200);
    assert_eq!(second.json()["target"], "/second");

    assert_eq!(server.requests(), 2);
    assert_eq!(server.proxied_requests(), 2);
}

#[tokio::test]
async fn post_with_content_length_body() {
    let server = start("beta").await;
    let mut client = Client::connect(server.local_addr()).await;

    // Sent in pieces so the server has to deal with partial reads.
    client
        .send(b"POST /submit HTTP/1.1\r\nHost: b\r\nContent-Le")
        .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    client.send(b"ngth: 11\r\n\r\nhello").await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    client.send(b" world").await;

    let reply = client.receive().await;
    assert_eq!(reply.status, 200);
    let json = reply.json();
    assert_eq!(json["method"], "POST");
    assert_eq!(json["body_len"], 11);
    assert_eq!(json["headers"]["content-length"], "11");
}

#[tokio::test]
async fn chunked_post_is_decoded() {
    let server = start("gamma").await;
    let mut client = Client::connect(server.local_addr()).await;

    client
        .send(
            b"POST /upload HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\nhello\r\n\
              6;ext=1\r\n world\r\n\
              0\r\nx-trailer: yes\r\n\r\n",
        )
        .await;
    let reply = client.receive().await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["body_len"], 11);

    // The body must have been consumed exactly, or this request would be garbled.
    client.send(b"GET /after HTTP/1.1\r\nHost: g\r\n\r\n").await;
    assert_eq!(client.receive().await.json()["target"], "/after");
}

#[tokio::test]
async fn unsupported_transfer_encoding_is_rejected() {
    let server = start("delta").await;
    let mut client = Client::connect(server.local_addr()).await;

    client
        .send(b"POST / HTTP/1.1\r\nHost: d\r\nTransfer-Encoding: gzip, chunked\r\n\r\n")
        .await;
    let reply = client.receive().await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.header("connection"), Some("close"));
    assert!(client.closed_by_server().await);
}

#[tokio::test]
async fn healthz_follows_set_healthy() {
    let server = start("epsilon").await;
    let mut client = Client::connect(server.local_addr()).await;
    let probe = b"GET /healthz HTTP/1.1\r\nHost: e\r\n\r\n";

    client.send(probe).await;
    let healthy = client.receive().await;
    assert_eq!((healthy.status, healthy.body.as_slice()), (200, &b"ok"[..]));

    server.set_healthy(false);
    client.send(probe).await;
    let unhealthy = client.receive().await;
    assert_eq!(
        (unhealthy.status, unhealthy.body.as_slice()),
        (503, &b"unhealthy"[..])
    );

    server.set_healthy(true);
    client.send(probe).await;
    assert_eq!(client.receive().await.status, 200);

    client.send(b"GET / HTTP/1.1\r\nHost: e\r\n\r\n").await;
    client.receive().await;
    assert_eq!(server.requests(), 4);
    assert_eq!(server.proxied_requests(), 1);
}

#[tokio::test]
async fn status_path_and_delay_header() {
    let server = start("zeta").await;
    let mut client = Client::connect(server.local_addr()).await;

    client
        .send(b"GET /status/503 HTTP/1.1\r\nHost: z\r\n\r\n")
        .await;
    let reply = client.receive().await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("x-upstream"), Some("zeta"));

    let started = tokio::time::Instant::now();
    client
        .send(b"GET / HTTP/1.1\r\nHost: z\r\nx-delay-ms: 150\r\n\r\n")
        .await;
    assert_eq!(client.receive().await.status, 200);
    assert!(started.elapsed() >= Duration::from_millis(150));
}

#[tokio::test]
async fn client_connection_close_is_honoured() {
    let server = start("eta").await;
    let mut client = Client::connect(server.local_addr()).await;

    client
        .send(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        .await;
    let reply = client.receive().await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("connection"), Some("close"));
    assert!(client.closed_by_server().await);
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order() {
    let server = start("kappa").await;
    let mut client = Client::connect(server.local_addr()).await;

    client
        .send(b"POST /one HTTP/1.1\r\nHost: k\r\nContent-Length: 3\r\n\r\nabcGET /two HTTP/1.1\r\nHost: k\r\n\r\n")
        .await;
    let first = client.receive().await.json();
    assert_eq!(
        (&first["target"], &first["body_len"]),
        (&"/one".into(), &3.into())
    );
    assert_eq!(client.receive().await.json()["target"], "/two");
}

#[tokio::test]
async fn http_1_0_closes_unless_keep_alive_is_requested() {
    let server = start("lambda").await;

    let mut keep = Client::connect(server.local_addr()).await;
    keep.send(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        .await;
    assert_eq!(
        keep.receive().await.header("connection"),
        Some("keep-alive")
    );
    keep.send(b"GET /b HTTP/1.0\r\n\r\n").await;
    assert_eq!(keep.receive().await.header("connection"), Some("close"));
    assert!(keep.closed_by_server().await);
}

#[tokio::test]
async fn stop_refuses_new_connections_and_drains_keep_alive() {
    let server = start("theta").await;
    let addr = server.local_addr();

    let mut idle = Client::connect(addr).await;
    idle.send(b"GET /before HTTP/1.1\r\nHost: t\r\n\r\n").await;
    assert_eq!(idle.receive().await.header("connection"), None);

    server.stop().await;

    let refused = TcpStream::connect(addr).await.expect_err("listener closed");
    assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);

    // The idle connection was left open and answers one last time.
    idle.send(b"GET /after HTTP/1.1\r\nHost: t\r\n\r\n").await;
    let last = idle.receive().await;
    assert_eq!(last.status, 200);
    assert_eq!(last.header("connection"), Some("close"));
    assert_eq!(last.json()["target"], "/after");
    assert!(idle.closed_by_server().await);

    // Stopping twice is harmless.
    server.stop().await;
    assert_eq!(server.requests(), 2);
}

/// A client the kernel accepted (its handshake done, its request sent) but the server had
/// not yet taken when it was told to stop is still answered, once, not reset. The test
/// runtime has one thread, and nothing yields between the blocking connect and `stop`, so
/// the accept loop first runs when it is already stopping.
#[tokio::test]
async fn stop_answers_connections_still_in_the_backlog() {
    let server = start("iota").await;
    let mut waiting = std::net::TcpStream::connect(server.local_addr()).expect("connect");
    std::io::Write::write_all(&mut waiting, b"GET /queued HTTP/1.1\r\nHost: t\r\n\r\n")
        .expect("write");
    waiting.set_nonblocking(true).expect("non-blocking");
    server.stop().await;
    let mut queued = Client {
        stream: TcpStream::from_std(waiting).expect("into tokio"),
        buffer: Vec::new(),
    };
    let last = queued.receive().await;
    assert_eq!(last.status, 200);
    assert_eq!(last.header("connection"), Some("close"));
    assert_eq!(last.json()["target"], "/queued");
    assert!(queued.closed_by_server().await);
}

// --- the key-limited API stub -------------------------------------------------------

/// Long enough that no window can expire while a test runs.
const WINDOW: Duration = Duration::from_secs(60);

async fn start_keyed(name: &str, options: EchoOptions) -> EchoServer {
    EchoServer::start_with(name, "127.0.0.1:0".parse().unwrap(), options)
        .await
        .expect("start echo server")
}

fn get_with_key(key: Option<&str>) -> Vec<u8> {
    let auth = key.map_or(String::new(), |k| format!("Authorization: {k}\r\n"));
    format!("GET /v1/things HTTP/1.1\r\nHost: api\r\n{auth}\r\n").into_bytes()
}

#[tokio::test]
async fn key_limit_holds_per_key_with_retry_after_and_ratelimit_fields() {
    let api = start_keyed("api", EchoOptions::key_limited(3, WINDOW)).await;
    let mut client = Client::connect(api.local_addr()).await;

    for remaining in [2, 1, 0] {
        client.send(&get_with_key(Some("Bearer key-aaaa"))).await;
        let reply = client.receive().await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-upstream"), Some("api"));
        assert_eq!(reply.json()["headers"]["authorization"], "Bearer key-aaaa");
        assert_eq!(reply.header("ratelimit-policy"), Some("\"api\";q=3;w=60"));
        let ratelimit = reply.header("ratelimit").expect("RateLimit on a 200");
        let prefix = format!("\"api\";r={remaining};t=");
        let t: u64 = ratelimit
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{ratelimit:?} should start with {prefix:?}"))
            .parse()
            .expect("t is whole seconds");
        assert!((1..=60).contains(&t), "{ratelimit}");
    }

    client.send(&get_with_key(Some("Bearer key-aaaa"))).await;
    let refused = client.receive().await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-upstream"), Some("api"));
    assert_eq!(refused.header("content-type"), Some("application/json"));
    let retry_after: u64 = refused
        .header("retry-after")
        .expect("Retry-After on the 429")
        .parse()
        .expect("whole seconds");
    // The oldest request leaves the 60 s window at most 60 s from now, at least 1 s.
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    assert_eq!(
        refused.json(),
        serde_json::json!({"error": "rate_limited", "key_hint": "aaaa"})
    );
    assert_eq!(
        refused.header("ratelimit"),
        Some(format!("\"api\";r=0;t={retry_after}").as_str())
    );

    // Other keys, and the key-less requests, have windows of their own.
    client.send(&get_with_key(Some("Bearer key-bbbb"))).await;
    assert_eq!(client.receive().await.status, 200);
    for _ in 0..3 {
        client.send(&get_with_key(None)).await;
        assert_eq!(client.receive().await.status, 200);
    }
    client.send(&get_with_key(None)).await;
    let keyless = client.receive().await;
    assert_eq!(keyless.status, 429);
    assert_eq!(keyless.json()["key_hint"], "");

    // Health probes are neither counted nor limited.
    client
        .send(b"GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n")
        .await;
    assert_eq!(client.receive().await.status, 200);

    assert_eq!(api.served("Bearer key-aaaa"), 3);
    assert_eq!(api.refused("Bearer key-aaaa"), 1);
    assert_eq!(api.served("Bearer key-zzzz"), 0);
    assert_eq!(
        api.keys(),
        vec![
            (String::new(), 3, 1),
            ("Bearer key-aaaa".to_string(), 3, 1),
            ("Bearer key-bbbb".to_string(), 1, 0),
        ]
    );
}

#[tokio::test]
async fn scripted_refusals_say_exactly_what_they_were_given() {
    let api = start_keyed("api", EchoOptions::key_limited(100, WINDOW)).await;
    let mut client = Client::connect(api.local_addr()).await;
    let key = "Bearer sk-cool";
    api.refuse_next(key, 2, "864000").unwrap();
    api.refuse_next(key, 1, "Wed, 21 Oct 2037 07:28:00 GMT")
        .unwrap();
    api.refuse_next_with_ratelimit(key, 1, "\"api\";r=0;t=7")
        .unwrap();

    for expected in ["864000", "864000", "Wed, 21 Oct 2037 07:28:00 GMT"] {
        client.send(&get_with_key(Some(key))).await;
        let reply = client.receive().await;
        assert_eq!(reply.status, 429);
        assert_eq!(reply.header("retry-after"), Some(expected));
        assert_eq!(reply.header("ratelimit"), None);
        assert_eq!(reply.json()["key_hint"], "cool");
    }
    client.send(&get_with_key(Some(key))).await;
    let ratelimited = client.receive().await;
    assert_eq!(ratelimited.status, 429);
    assert_eq!(ratelimited.header("retry-after"), None);
    assert_eq!(ratelimited.header("ratelimit"), Some("\"api\";r=0;t=7"));

    // Scripted refusals were not counted in the window: all 100 are left.
    client.send(&get_with_key(Some(key))).await;
    let served = client.receive().await;
    assert_eq!(served.status, 200);
    assert!(
        served
            .header("ratelimit")
            .is_some_and(|v| v.starts_with("\"api\";r=99;")),
        "{:?}",
        served.header("ratelimit")
    );
    // Another key was never affected.
    client.send(&get_with_key(Some("Bearer other"))).await;
    assert_eq!(client.receive().await.status, 200);

    assert_eq!((api.served(key), api.refused(key)), (1, 4));
    assert!(api.refuse_next(key, 1, "2\r\nx-evil: 1").is_err());
    assert!(api.refuse_next(key, 1, "").is_err());
}

#[tokio::test]
async fn refusals_work_without_a_key_limit_too() {
    let server = start("plain").await;
    let mut client = Client::connect(server.local_addr()).await;
    server.refuse_next("Bearer k", 1, "2").unwrap();

    client.send(&get_with_key(Some("Bearer k"))).await;
    assert_eq!(client.receive().await.header("retry-after"), Some("2"));
    // x-force-429 is the same refusal, asked for by the request itself.
    client
        .send(b"GET / HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer k\r\nx-force-429: 5\r\n\r\n")
        .await;
    let forced = client.receive().await;
    assert_eq!(forced.status, 429);
    assert_eq!(forced.header("retry-after"), Some("5"));
    assert_eq!(forced.header("x-upstream"), Some("plain"));

    client.send(&get_with_key(Some("Bearer k"))).await;
    let served = client.receive().await;
    assert_eq!(served.status, 200);
    // Without a key limit there are no RateLimit fields, and no request log.
    assert_eq!(served.header("ratelimit"), None);
    assert_eq!(served.header("ratelimit-policy"), None);
    assert_eq!(server.keys(), vec![("Bearer k".to_string(), 1, 2)]);
    assert!(server.request_log().is_empty());
}

#[tokio::test]
async fn the_request_log_tells_which_body_went_to_which_key() {
    let api = start_keyed("api", EchoOptions::key_limited(1, WINDOW)).await;
    let mut client = Client::connect(api.local_addr()).await;

    client
        .send(b"POST /v1/chat HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer a\r\nContent-Length: 11\r\n\r\nhello world")
        .await;
    assert_eq!(client.receive().await.status, 200);
    // Refused by the window, but logged: the body did reach the API.
    client
        .send(
            b"POST /v1/chat HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer a\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        )
        .await;
    assert_eq!(client.receive().await.status, 429);
    // Larger than what is kept: the hash still covers all of it.
    let big = vec![b'x'; MAX_KEPT_BODY + 10];
    let mut raw = format!(
        "PUT /big HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer b\r\nContent-Length: {}\r\n\r\n",
        big.len()
    )
    .into_bytes();
    raw.extend_from_slice(&big);
    client.send(&raw).await;
    assert_eq!(client.receive().await.status, 200);
    client
        .send(b"GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n")
        .await;
    client.receive().await;

    let log = api.request_log();
    assert_eq!(log.len(), 3, "{log:?}");
    let hello_sha = "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9";
    for (entry, status) in log[..2].iter().zip([200, 429]) {
        assert_eq!(entry.key, "Bearer a");
        assert_eq!(
            (entry.method.as_str(), entry.target.as_str()),
            ("POST", "/v1/chat")
        );
        assert_eq!(entry.status, status);
        assert_eq!(entry.body_len, 11);
        assert_eq!(entry.body, b"hello world");
        assert_eq!(entry.body_sha256, hello_sha);
    }
    let big_entry = &log[2];
    assert_eq!(
        (big_entry.key.as_str(), big_entry.status),
        ("Bearer b", 200)
    );
    assert_eq!(big_entry.body_len, big.len() as u64);
    assert_eq!(big_entry.body, &big[..MAX_KEPT_BODY]);
    use sha2::Digest;
    assert_eq!(
        big_entry.body_sha256,
        hex::encode(sha2::Sha256::digest(&big))
    );
}

#[tokio::test]
async fn a_zero_key_limit_is_refused() {
    for limit in [(0, WINDOW), (1, Duration::ZERO)] {
        let options = EchoOptions {
            key_limit: Some(limit),
            ..EchoOptions::default()
        };
        let err = EchoServer::start_with("api", "127.0.0.1:0".parse().unwrap(), options)
            .await
            .expect_err("a zero limit or window");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}

#[tokio::test]
async fn request_in_flight_during_stop_completes_with_close() {
    let server = start("iota").await;
    let mut client = Client::connect(server.local_addr()).await;

    // The answer is held long enough for the stop to come while it is in flight: the stop
    // is sent as soon as the server has the request, not after a guessed pause.
    client
        .send(b"GET / HTTP/1.1\r\nHost: i\r\nx-delay-ms: 2000\r\n\r\n")
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while server.requests() == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(server.requests(), 1, "the request never arrived");
    server.stop().await;

    let reply = client.receive().await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("connection"), Some("close"));
}
