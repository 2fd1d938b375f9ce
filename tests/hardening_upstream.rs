//! Failures on the way to a member, and how the client, the access log and the gateway's own
//! log tell them: the right code for each, and the reason for each attempt.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::{
    dead_url, request, url, Config, Cooldown, Egress, Gateway, HttpClient, KeyMember, Route,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const HOST: &str = "api.test";
const DEADLINE: Duration = Duration::from_secs(20);

/// A member that reads each request and answers `answer` (nothing at all when empty), then
/// holds the connection open.
async fn member_answering(answer: &'static [u8]) -> SocketAddr {
    let member = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = member.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut conn, _)) = member.accept().await {
            let mut head = [0u8; 4096];
            let _ = conn.read(&mut head).await;
            if !answer.is_empty() {
                let _ = conn.write_all(answer).await;
            }
            held.push(conn);
        }
    });
    addr
}

/// The access line of the request to `path`, once it is written.
async fn access_line(gw: &Gateway, path: &str) -> serde_json::Value {
    let needle = format!("\"path\":\"{path}\"");
    assert!(gw.wait_for_log(&needle, DEADLINE).await, "{path} is logged");
    gw.log_json()
        .into_iter()
        .find(|l| l["target"] == "sluice::access" && l["path"] == path)
        .unwrap_or_else(|| panic!("the access line of {path}"))
}

/// A member that never answers: the client gets `504 upstream_timeout`, and the access log
/// says the same, not that a response was cut short (the 504 is the gateway's own head).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_timeout_is_logged_as_upstream_timeout() {
    let member = member_answering(b"").await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)).read_timeout("500ms"))
        .start();
    let r = request(gw.proxy_addr(), "GET", HOST, "/silent", &[], b"").await;
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("upstream_timeout"));
    let line = access_line(&gw, "/silent").await;
    assert_eq!(line["status"], 504, "{line}");
    assert_eq!(line["error"], "upstream_timeout", "{line}");
}

/// A member that answers with bytes that are not HTTP: the client gets `502`, and the access
/// log says the answer could not be read, not that it was cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_is_not_http_is_logged_as_upstream_bad_response() {
    let member = member_answering(b"this is not HTTP at all\r\n\r\n").await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)))
        .start();
    let r = request(gw.proxy_addr(), "GET", HOST, "/garbage", &[], b"").await;
    assert_eq!(r.status, 502, "{}", r.text());
    let line = access_line(&gw, "/garbage").await;
    assert_eq!(line["status"], 502, "{line}");
    assert_eq!(line["error"], "upstream_bad_response", "{line}");
}

/// A listener whose accept queue is full: connections to it are neither accepted nor
/// refused, the kernel drops their SYNs, so connecting times out. The connections that
/// filled it are returned with it, to be kept open.
async fn full_listener() -> (SocketAddr, tokio::net::TcpListener, Vec<TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut filled = Vec::new();
    for _ in 0..16 {
        match tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => filled.push(stream),
            // A connect that hangs: the queue is full.
            Err(_) => return (addr, listener, filled),
            Ok(Err(e)) => panic!("connect to the listener: {e}"),
        }
    }
    panic!("the accept queue never filled");
}

/// A DNS server on loopback that answers every query with NXDOMAIN: no name resolves.
async fn nxdomain_dns_server() -> SocketAddr {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = socket.recv_from(&mut buf).await {
            let query = &buf[..n];
            // The header and the question, up to the end of its name and its type and class.
            let mut at = 12;
            while at < n && query[at] != 0 {
                at += 1 + usize::from(query[at]);
            }
            let Some(question) = query.get(..at + 5) else {
                continue;
            };
            let mut out = question.to_vec();
            out[2] = 0x84 | (query[2] & 0x01); // a response, authoritative, RD copied
            out[3] = 0x83; // RA, NXDOMAIN
            out[6..12].copy_from_slice(&[0; 6]);
            let _ = socket.send_to(&out, from).await;
        }
    });
    addr
}

/// `502 upstream_unreachable` says why each attempt failed, in the problem's detail and in the
/// access line: a refused port, then a connect that timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_answer_says_why_each_attempt_failed() {
    let (slow, _listener, _filled) = full_listener().await;
    let gw = Config::new()
        .route(
            Route::new("api")
                .priority()
                .member(dead_url())
                .member(url(slow))
                .retries(1)
                .connect_timeout("300ms"),
        )
        .start();
    let r = request(gw.proxy_addr(), "GET", HOST, "/down", &[], b"").await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("upstream_unreachable"));
    assert_eq!(
        r.json()["detail"],
        "2 connection attempt(s) failed: refused; timed out",
        "{}",
        r.text()
    );
    let line = access_line(&gw, "/down").await;
    assert_eq!(line["error"], "upstream_unreachable", "{line}");
    assert_eq!(line["detail"], "refused; timed out", "{line}");
}

/// A TLS handshake that fails, then a name that does not resolve: each reason is given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_dns_failures_are_named_too() {
    let plain = support::start_backends(&["plain"]).await;
    let tls_member = format!("https://{}", plain[0].local_addr());
    let gw = Config::new()
        .route(
            Route::new("api")
                .priority()
                .member(tls_member)
                .member("http://nowhere.test:80")
                .retries(1)
                // Both attempts fail at once; a loaded machine that delays either past a short
                // timeout would make its reason "timed out".
                .connect_timeout("10s"),
        )
        .start_with_env(&[(
            "SLUICE_DNS_SERVERS",
            &nxdomain_dns_server().await.to_string(),
        )]);
    let r = request(gw.proxy_addr(), "GET", HOST, "/both", &[], b"").await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("upstream_unreachable"));
    let detail = r.json()["detail"].as_str().unwrap_or_default().to_string();
    assert_eq!(
        detail,
        "2 connection attempt(s) failed: TLS: the member does not speak TLS; DNS: the name did not resolve",
    );
    let line = access_line(&gw, "/both").await;
    assert_eq!(
        line["detail"], "TLS: the member does not speak TLS; DNS: the name did not resolve",
        "{line}"
    );
}

/// A cooldown replay (`retry: true`) that succeeds is logged at info, as the replay it is,
/// not as Pingora's warning about a failure to proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cooldown_replay_is_no_warning() {
    let api = sluice_echo::EchoServer::start_with(
        "api",
        SocketAddr::from(([127, 0, 0, 1], 0)),
        sluice_echo::EchoOptions::key_limited(1000, Duration::from_secs(60)),
    )
    .await
    .unwrap();
    let route = ["key-a", "key-b"]
        .iter()
        .fold(Route::new("api").least_used(), |route, name| {
            route.key_member(
                KeyMember::new(url(api.local_addr()), name)
                    .header("Authorization", &format!("Bearer {name}")),
            )
        })
        .cooldown(Cooldown::new().retry());
    let gw = Config::new().route(route).start();
    api.refuse_next("Bearer key-a", 1, "30").unwrap();
    let r = request(gw.proxy_addr(), "GET", HOST, "/replayed", &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(api.refused("Bearer key-a"), 1, "key-a answered 429 first");
    access_line(&gw, "/replayed").await;
    let lines = gw.log_json();
    let replay = lines
        .iter()
        .find(|l| l["message"] == "replaying the request to another member (cooldown.retry)")
        .unwrap_or_else(|| panic!("the replay is logged: {}", gw.logs()));
    assert_eq!(replay["level"], "INFO", "{replay}");
    assert_eq!(replay["status"], 429, "{replay}");
    let warnings: Vec<_> = lines.iter().filter(|l| l["level"] == "WARN").collect();
    assert!(warnings.is_empty(), "no warning for a replay: {warnings:?}");
}

/// A CONNECT whose every attempt fails says why too, in its 502 and its access line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_tunnel_says_why() {
    let port = support::free_port();
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(
            Route::new("out")
                .hosts(&["127.0.0.1"])
                .direct_member()
                .methods(&["CONNECT"]),
        )
        .start();
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let target = format!("127.0.0.1:{port}");
    client
        .write_raw(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let r = client.read_response(false).await.unwrap();
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("upstream_unreachable"));
    assert_eq!(
        r.json()["detail"],
        "1 connection attempt(s) failed: refused",
        "{}",
        r.text()
    );
    assert!(gw.wait_for_log("\"method\":\"CONNECT\"", DEADLINE).await);
    let line = gw
        .log_json()
        .into_iter()
        .find(|l| l["target"] == "sluice::access" && l["method"] == "CONNECT")
        .unwrap();
    assert_eq!(line["error"], "upstream_unreachable", "{line}");
    assert_eq!(line["detail"], "refused", "{line}");
}
