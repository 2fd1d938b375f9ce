//! WebSocket passthrough (SPEC §7): a handshake reaches the member with `Upgrade: websocket`,
//! the connection becomes a tunnel after the member's `101`, and it is logged once when it
//! ends. Real parts only: a tokio-tungstenite echo member and client on 127.0.0.1, through the
//! real `sluice` binary.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use support::{url, Config, Gateway, Route, IO_TIMEOUT};

/// What the echo member saw of each handshake: its `Upgrade` and `Connection` headers.
type Seen = Arc<Mutex<Vec<(Option<String>, Option<String>)>>>;

/// A WebSocket echo member: each text or binary message comes back as it was; a close is
/// answered. It records the handshake headers it saw. A request that is not a WebSocket
/// handshake gets a plain `200` with a body, and is recorded too.
async fn echo_member() -> (SocketAddr, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let record = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let record = record.clone();
            tokio::spawn(async move {
                let mut peek = [0u8; 4096];
                let Ok(n) = stream.peek(&mut peek).await else {
                    return;
                };
                let head = String::from_utf8_lossy(&peek[..n]).to_ascii_lowercase();
                if !head.contains("upgrade: websocket") {
                    plain_answer(stream, &record).await;
                    return;
                }
                // The error type is tungstenite's, fixed by its `Callback` trait.
                #[allow(clippy::result_large_err)]
                let callback = |req: &Request, resp: Response| {
                    let header = |name: &str| {
                        req.headers()
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned)
                    };
                    record
                        .lock()
                        .unwrap()
                        .push((header("upgrade"), header("connection")));
                    Ok(resp)
                };
                let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, callback).await else {
                    return;
                };
                while let Some(Ok(msg)) = ws.next().await {
                    match msg {
                        // A feed: pushes without waiting for the client.
                        Message::Text(t) if t.as_str().starts_with("push ") => {
                            let n: u32 = t.as_str()[5..].parse().unwrap();
                            for i in 0..n {
                                tokio::time::sleep(Duration::from_millis(250)).await;
                                if ws.send(Message::text(format!("tick {i}"))).await.is_err() {
                                    return;
                                }
                            }
                        }
                        Message::Text(_) | Message::Binary(_) => {
                            let sent = ws.send(msg).await;
                            if sent.is_err() {
                                return;
                            }
                        }
                        Message::Close(_) => {
                            // tungstenite queues the close reply; flushing sends it.
                            let _ = ws.flush().await;
                            return;
                        }
                        _ => {}
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// Answers a request that is not a WebSocket handshake with a plain 200, and records its
/// `Upgrade` and `Connection` headers.
async fn plain_answer(mut stream: TcpStream, record: &Seen) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let header = |name: &str| {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_owned())
    };
    record
        .lock()
        .unwrap()
        .push((header("upgrade"), header("connection")));
    let _ = stream
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nplain")
        .await;
    let _ = stream.shutdown().await;
}

/// A gateway with route `ws` (host `ws.test`) over the echo member.
fn start(member: SocketAddr) -> Gateway {
    Config::new()
        .route(Route::new("ws").member(url(member)))
        .start()
}

/// A WebSocket to `ws.test` through `gw`, in gateway form.
async fn connect(gw: &Gateway) -> WebSocketStream<TcpStream> {
    let stream = TcpStream::connect(gw.proxy_addr()).await.unwrap();
    let request = "ws://ws.test/".into_client_request().unwrap();
    let (ws, response) =
        tokio::time::timeout(IO_TIMEOUT, tokio_tungstenite::client_async(request, stream))
            .await
            .expect("handshake in time")
            .expect("handshake succeeds");
    assert_eq!(response.status(), 101);
    ws
}

/// The next message, within [`IO_TIMEOUT`].
async fn next(ws: &mut WebSocketStream<TcpStream>) -> Option<Message> {
    tokio::time::timeout(IO_TIMEOUT, ws.next())
        .await
        .expect("an event in time")
        .and_then(Result::ok)
}

/// Sends several messages each way through `ws` and checks their echoes, then closes cleanly.
async fn converse<S>(ws: &mut WebSocketStream<S>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    for i in 0..5 {
        let text = format!("hello {i}");
        ws.send(Message::text(text.clone())).await.unwrap();
        let echo = tokio::time::timeout(IO_TIMEOUT, ws.next())
            .await
            .expect("echo in time")
            .expect("a message")
            .unwrap();
        assert_eq!(echo, Message::text(text));
    }
    let blob: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    ws.send(Message::binary(blob.clone())).await.unwrap();
    let echo = tokio::time::timeout(IO_TIMEOUT, ws.next())
        .await
        .expect("echo in time")
        .expect("a message")
        .unwrap();
    assert_eq!(echo, Message::binary(blob));
    ws.close(None).await.unwrap();
    // The member's close reply ends the stream.
    let rest = tokio::time::timeout(IO_TIMEOUT, async {
        while let Some(msg) = ws.next().await {
            if msg.is_err() {
                break;
            }
        }
    })
    .await;
    assert!(rest.is_ok(), "the close handshake completes");
}

/// The access lines of `gw` for the route `ws`, once `n` of them are written.
async fn access_lines(gw: &Gateway, n: usize) -> Vec<serde_json::Value> {
    let lines = || {
        gw.log_json()
            .into_iter()
            .filter(|l| l["target"] == "sluice::access" && l["route"] == "ws")
            .collect::<Vec<_>>()
    };
    support::wait_until(IO_TIMEOUT, || lines().len() >= n).await;
    lines()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_echo_through_the_gateway() {
    let (member, seen) = echo_member().await;
    let gw = start(member);

    let stream = TcpStream::connect(gw.proxy_addr()).await.unwrap();
    // Gateway form: the client talks to sluice as if it were the server of ws.test.
    let request = "ws://ws.test/chat".into_client_request().unwrap();
    let (mut ws, response) =
        tokio::time::timeout(IO_TIMEOUT, tokio_tungstenite::client_async(request, stream))
            .await
            .expect("handshake in time")
            .expect("handshake succeeds");
    assert_eq!(response.status(), 101);
    assert_eq!(response.headers()["upgrade"], "websocket");
    converse(&mut ws).await;

    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        [(Some("websocket".into()), Some("upgrade".into()))],
        "the member saw exactly the upgrade headers"
    );
    let lines = access_lines(&gw, 1).await;
    assert_eq!(lines.len(), 1, "one access line per WebSocket: {lines:?}");
    assert_eq!(lines[0]["status"], 101);
    assert_eq!(lines[0]["path"], "/chat");
    assert_eq!(lines[0]["error"], serde_json::Value::Null, "{lines:?}");
}

/// A client that sends the handshake in absolute form, as to a forward proxy (`GET
/// http://ws.test/ HTTP/1.1`), gets the same tunnel. tungstenite writes origin form only, so
/// the handshake is written here and the framing is handed to tungstenite after the 101.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_echo_in_forward_proxy_form() {
    echo_in_forward_proxy_form("http").await;
}

/// The same with a `ws://` target, as aiohttp's `ws_connect` sends it through a proxy: the
/// same request as `http://`, proxied the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_echo_in_forward_proxy_form_with_a_ws_target() {
    echo_in_forward_proxy_form("ws").await;
}

async fn echo_in_forward_proxy_form(scheme: &str) {
    let (member, seen) = echo_member().await;
    let gw = start(member);

    let mut stream = TcpStream::connect(gw.proxy_addr()).await.unwrap();
    let head = format!(
        "GET {scheme}://ws.test/feed HTTP/1.1\r\nHost: ws.test\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    // Read the head byte by byte, so no frame byte is taken with it.
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(IO_TIMEOUT, stream.read(&mut byte))
            .await
            .expect("answer in time")
            .unwrap();
        assert_eq!(n, 1, "connection closed in the head: {head:?}");
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap().to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    // RFC 6455 §1.3: the accept value of the sample key.
    assert!(
        head.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );
    assert!(head.contains("connection: upgrade"), "{head}");
    let mut ws = WebSocketStream::from_raw_socket(stream, Role::Client, None).await;
    converse(&mut ws).await;

    assert_eq!(
        seen.lock().unwrap().clone(),
        [(Some("websocket".into()), Some("upgrade".into()))]
    );
    let lines = access_lines(&gw, 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["status"], 101);
    assert_eq!(lines[0]["path"], "/feed");
}

/// An `h2c` upgrade is not passed: the member gets a plain request, without `Upgrade`, and the
/// client gets the member's plain answer on a connection that stays HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_upgrade_is_not_passed() {
    let (member, seen) = echo_member().await;
    let gw = start(member);

    let mut stream = TcpStream::connect(gw.proxy_addr()).await.unwrap();
    stream
        .write_all(
            b"GET /x HTTP/1.1\r\nHost: ws.test\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    while !answer.ends_with(b"plain") {
        let n = tokio::time::timeout(IO_TIMEOUT, stream.read(&mut chunk))
            .await
            .expect("answer in time")
            .unwrap();
        assert!(
            n > 0,
            "closed early: {:?}",
            String::from_utf8_lossy(&answer)
        );
        answer.extend_from_slice(&chunk[..n]);
    }
    let answer = String::from_utf8_lossy(&answer).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    assert!(!answer.contains("upgrade"), "{answer}");

    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].0, None, "the member saw no Upgrade");
    assert!(
        !seen[0]
            .1
            .as_deref()
            .unwrap_or("")
            .to_ascii_lowercase()
            .contains("upgrade"),
        "the member saw no Connection: upgrade: {seen:?}"
    );
    let lines = access_lines(&gw, 1).await;
    assert_eq!(lines[0]["status"], 200);
}

/// A WebSocket handshake the member refuses (here, a member that is not a WebSocket server
/// and answers 200) stays a plain exchange: the client gets the 200, not a tunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_handshake_is_a_plain_answer() {
    let backends = support::start_backends(&["plain"]).await;
    let gw = Config::new()
        .route(Route::new("ws").member(url(backends[0].local_addr())))
        .start();
    let stream = TcpStream::connect(gw.proxy_addr()).await.unwrap();
    let request = "ws://ws.test/".into_client_request().unwrap();
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_tungstenite::client_async(request, stream),
    )
    .await
    .expect("answer in time");
    match result {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status(), 200)
        }
        other => panic!("expected a refused handshake, got {other:?}"),
    }
}

/// The idle rule (docs/https-proxy.md, "WebSockets"): an open WebSocket closes when the member sends nothing
/// for the route's `read_timeout`; a client that only listens is not cut while the member
/// pushes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_websocket_closes_after_read_timeout_and_a_feed_does_not() {
    let (member, _seen) = echo_member().await;
    // A read_timeout of 5 s against a push every 250 ms: a member a loaded machine delays
    // still pushes well within it (at 2 s, a stall of 1.75 s in the test's own runtime, which
    // runs the member, would have cut the feed).
    let gw = Config::new()
        .route(Route::new("ws").member(url(member)).read_timeout("5s"))
        .start();

    // A feed: the client sends once, then only listens for 10 s, two read_timeouts.
    let mut ws = connect(&gw).await;
    ws.send(Message::text("push 40")).await.unwrap();
    for i in 0..40 {
        assert_eq!(
            next(&mut ws).await,
            Some(Message::text(format!("tick {i}")))
        );
    }
    // Timed from before the last message: the member's echo of it, the last byte the gateway
    // reads, comes later, so however slow the machine the close cannot come sooner than
    // read_timeout after this. (Timed from the echo's arrival, a slow read of it shortened
    // what the test saw.)
    let started = std::time::Instant::now();
    ws.send(Message::text("still here")).await.unwrap();
    assert_eq!(next(&mut ws).await, Some(Message::text("still here")));

    // Silence both ways: closed after read_timeout (and within `next`'s own timeout).
    assert_eq!(
        next(&mut ws).await,
        None,
        "the gateway closes an idle WebSocket"
    );
    let idle = started.elapsed();
    assert!(idle >= Duration::from_secs(5), "closed after {idle:?}");
    let lines = access_lines(&gw, 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["status"], 101);
    assert_eq!(lines[0]["error"], "idle_timeout", "{lines:?}");
}
