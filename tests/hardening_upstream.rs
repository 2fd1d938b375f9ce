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

/// What a [`scripted_member`] does with the request it reads next, on whichever connection.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Answers `200` with a 2-byte body at once.
    Answer,
    /// Answers as `Answer` does after this long.
    AnswerAfter(Duration),
    /// Sends a head announcing 10 bytes of body and 3 of them, then nothing more.
    StallBody,
    /// Never answers.
    Never,
}

/// A keep-alive member that takes its steps in the order requests reach it, and counts the
/// connections it accepts (so a test can tell a pooled connection from a new one). With `tls`,
/// it speaks TLS with that acceptor's certificate.
async fn scripted_member(
    steps: &[Step],
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    let member = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = member.local_addr().unwrap();
    let steps = Arc::new(Mutex::new(steps.to_vec()));
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = member.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let steps = steps.clone();
            match &tls {
                Some(tls) => {
                    let tls = tls.clone();
                    tokio::spawn(async move {
                        if let Ok(conn) = tls.accept(conn).await {
                            take_steps(conn, steps).await;
                        }
                    });
                }
                None => {
                    tokio::spawn(take_steps(conn, steps));
                }
            }
        }
    });
    (addr, accepted)
}

/// A [`scripted_member`]'s connection: one request head (GET, no body) at a time, each
/// answered by the next step.
async fn take_steps(
    mut conn: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    steps: std::sync::Arc<std::sync::Mutex<Vec<Step>>>,
) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        buf.drain(..end);
        let step = {
            let mut steps = steps.lock().unwrap();
            if steps.is_empty() {
                Step::Never
            } else {
                steps.remove(0)
            }
        };
        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
        match step {
            Step::Answer => {}
            Step::AnswerAfter(wait) => tokio::time::sleep(wait).await,
            Step::StallBody => {
                let head = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc";
                let _ = conn.write_all(head).await;
                let _ = conn.flush().await;
                std::future::pending::<()>().await;
            }
            Step::Never => std::future::pending::<()>().await,
        }
        if conn.write_all(ok).await.is_err() || conn.flush().await.is_err() {
            return;
        }
    }
}

/// A TLS acceptor with a certificate for 127.0.0.1 from a CA made in `dir` (`ca.pem`).
fn tls_acceptor(dir: &std::path::Path) -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    sluice_testkit::make_certificates(dir, "IP:127.0.0.1");
    let certs = CertificateDer::pem_file_iter(dir.join("server.pem"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config))
}

/// Waits until the request to `path` is logged: Pingora puts its member's connection back in
/// the pool before the access line is written, so the next request can take it.
async fn back_in_the_pool(gw: &Gateway, path: &str) {
    access_line(gw, path).await;
}

/// Waits until `since` is `at_least` old: the tests below are about what a timer does once
/// its deadline has passed, so the clock is the condition.
async fn wait_past(since: std::time::Instant, at_least: Duration) {
    let left = at_least.saturating_sub(since.elapsed());
    tokio::time::sleep(left + Duration::from_millis(50)).await;
}

/// A pooled connection keeps one read timer for its life (third_party/PATCHES.md, "read timer
/// kept with the connection"). One that idled in the pool past its timer's deadline still
/// serves its next request; a silent answer on it still gets `504 upstream_timeout`; and the
/// connection that timed out is not used again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_times_each_answer_after_idling_past_its_timer() {
    let steps = [Step::Answer, Step::Answer, Step::Never];
    let (member, accepted) = scripted_member(&steps, None).await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)).read_timeout("1s"))
        .start();
    times_each_answer_after_idling(&gw, &accepted).await;
}

/// The same over TLS: the TCP stream under the TLS one times the reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_tls_connection_times_each_answer_after_idling_past_its_timer() {
    let dir = support::TempDir::new("sluice-read-timer-tls");
    let steps = [Step::Answer, Step::Answer, Step::Never];
    let (member, accepted) = scripted_member(&steps, Some(tls_acceptor(dir.path()))).await;
    let ca = dir.path().join("ca.pem").display().to_string();
    let gw = Config::new()
        .route(
            Route::new("api")
                .member(format!("https://{member}"))
                .read_timeout("1s"),
        )
        .start_with_env(&[("SSL_CERT_FILE", &ca)]);
    times_each_answer_after_idling(&gw, &accepted).await;
}

/// Requests through `gw` to a member scripted `[Answer, Answer, Never]` that counts its
/// connections in `accepted`, with `read_timeout: 1s`.
async fn times_each_answer_after_idling(gw: &Gateway, accepted: &std::sync::atomic::AtomicUsize) {
    use std::sync::atomic::Ordering;
    let r = request(gw.proxy_addr(), "GET", HOST, "/first", &[], b"").await;
    // The first answer's read started waiting before it came, so its deadline is before this.
    let answered = std::time::Instant::now();
    assert_eq!(r.status, 200, "{}", r.text());
    back_in_the_pool(gw, "/first").await;
    // The timer of the first answer's read would have rung by now.
    wait_past(answered, Duration::from_millis(1500)).await;
    let r = request(gw.proxy_addr(), "GET", HOST, "/after-idle", &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "the pooled connection");
    back_in_the_pool(gw, "/after-idle").await;
    let r = request(gw.proxy_addr(), "GET", HOST, "/silent", &[], b"").await;
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("upstream_timeout"));
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "still the pooled connection"
    );
    let line = access_line(gw, "/silent").await;
    assert_eq!(line["error"], "upstream_timeout", "{line}");
    // The member's script is spent: it never answers again, so a new connection times out too.
    let r = request(gw.proxy_addr(), "GET", HOST, "/next", &[], b"").await;
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "a connection that timed out is not pooled"
    );
}

/// Each read gets the whole `read_timeout`, timed from when it starts to wait, on a pooled
/// connection too: the timer kept with the connection is moved later, not left at the deadline
/// of the connection's last read. Here the second answer comes 2 s after the first read's
/// deadline and 2 s before its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_read_on_a_pooled_connection_gets_the_whole_read_timeout() {
    use std::sync::atomic::Ordering;
    let (member, accepted) = scripted_member(
        &[Step::Answer, Step::AnswerAfter(Duration::from_secs(4))],
        None,
    )
    .await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)).read_timeout("6s"))
        .start();
    let r = request(gw.proxy_addr(), "GET", HOST, "/first", &[], b"").await;
    // The first read's deadline is less than 6 s from here, and /slow's wait starts 4 s on.
    let answered = std::time::Instant::now();
    assert_eq!(r.status, 200, "{}", r.text());
    back_in_the_pool(&gw, "/first").await;
    wait_past(answered, Duration::from_secs(4)).await;
    let r = request(gw.proxy_addr(), "GET", HOST, "/slow", &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "the pooled connection");
}

/// A member that sends its head and part of its body, then goes quiet: the body's read times
/// out after `read_timeout` on the pooled connection's timer, the client's connection is cut
/// (its `200` is already sent), and the access log says the answer was cut short by a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stalls_is_cut_after_read_timeout() {
    use std::sync::atomic::Ordering;
    let (member, accepted) = scripted_member(&[Step::Answer, Step::StallBody], None).await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)).read_timeout("1s"))
        .start();
    let r = request(gw.proxy_addr(), "GET", HOST, "/first", &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    back_in_the_pool(&gw, "/first").await;
    let mut client = TcpStream::connect(gw.proxy_addr()).await.unwrap();
    client
        .write_all(b"GET /stall HTTP/1.1\r\nHost: api.test\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let closed = tokio::time::timeout(DEADLINE, client.read_to_end(&mut got)).await;
    assert!(
        closed.is_ok(),
        "the client's connection is cut once the body's read times out"
    );
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 200 "), "{got:?}");
    assert!(got.ends_with("\r\n\r\nabc"), "{got:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "the pooled connection");
    let line = access_line(&gw, "/stall").await;
    assert_eq!(line["error"], "upstream_truncated", "{line}");
    assert_eq!(line["detail"], "ReadTimedout", "{line}");
}
