//! Defects an adversarial run found, each pinned end to end.

mod support;

use std::net::SocketAddr;

use support::{request, start_backends, Gateway, HttpClient};

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A cost rule `path_prefix: /v1/search, cost: 100` once charged `/v1//search` (and three other
/// spellings of the same resource) at cost 1, while the member served the expensive endpoint.
/// Every spelling is now charged as `/v1/search`, and the member is sent that path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_a_path_is_charged_as_what_is_served() {
    let backends = start_backends(&["api"]).await;
    let gw = Gateway::start_with_ports(&format!(
        "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nroutes:\n  - name: api\n    match:\n      hosts: [\"api.test\"]\n    upstream:\n      members:\n        - url: \"{}\"\n    quota:\n      windows:\n        - {{ name: hour, limit: 1000, window: 1h }}\n      cost:\n        rules:\n          - {{ path_prefix: \"/v1/search\", cost: 100 }}\n",
        url(backends[0].local_addr())
    ));
    let spellings = [
        "/v1/search",
        "/v1//search",
        "/v1/./search",
        "/v1/%73earch",
        "/v1/x/../search",
        "//v1/search?q=1",
        "/v1/%2e/search",
        "/v1/search/../search",
    ];
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let mut admitted = 0;
    for i in 0..20 {
        let path = spellings[i % spellings.len()];
        let r = client
            .request("GET", "api.test", path, &[], b"")
            .await
            .unwrap();
        match r.status {
            200 => {
                admitted += 1;
                assert!(
                    r.json()["target"]
                        .as_str()
                        .unwrap()
                        .starts_with("/v1/search"),
                    "{path} reached the member as {}",
                    r.json()["target"]
                );
            }
            429 => assert_eq!(r.header("x-sluice-error"), Some("quota_exceeded")),
            other => panic!("{path}: status {other}"),
        }
    }
    assert_eq!(admitted, 10, "1000 units at cost 100");
    assert_eq!(backends[0].proxied_requests(), 10);
}

/// What cannot be normalized without guessing is refused with 400 and its own code, and no
/// member is contacted. So are schemes sluice does not carry, a missing Host, and an `https://`
/// target that would reach an http member in cleartext.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_that_cannot_be_routed_safely_get_400() {
    let backends = start_backends(&["api"]).await;
    let gw = Gateway::start_with_ports(&format!(
        "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nroutes:\n  - name: any\n    upstream:\n      members:\n        - url: \"{}\"\n",
        url(backends[0].local_addr())
    ));
    let cases: [(&str, &str); 7] = [
        (
            "GET /../etc/passwd HTTP/1.1\r\nHost: api.test\r\n\r\n",
            "bad_path",
        ),
        ("GET /a%2Fb HTTP/1.1\r\nHost: api.test\r\n\r\n", "bad_path"),
        ("GET /a%00b HTTP/1.1\r\nHost: api.test\r\n\r\n", "bad_path"),
        ("GET /a%zz HTTP/1.1\r\nHost: api.test\r\n\r\n", "bad_path"),
        ("GET / HTTP/1.1\r\n\r\n", "missing_host"),
        (
            "GET ftp://api.test/x HTTP/1.1\r\nHost: api.test\r\n\r\n",
            "unsupported_scheme",
        ),
        (
            "GET https://api.test/x HTTP/1.1\r\nHost: api.test\r\n\r\n",
            "https_in_cleartext",
        ),
    ];
    for (raw, code) in cases {
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        client.write_raw(raw.as_bytes()).await.unwrap();
        let r = client.read_response(false).await.unwrap();
        assert_eq!(
            (r.status, r.header("x-sluice-error")),
            (400, Some(code)),
            "{raw:?}"
        );
    }
    assert_eq!(backends[0].requests(), 0);
    // A plain request still goes through.
    assert_eq!(
        request(gw.proxy_addr(), "GET", "api.test", "/ok", &[], b"")
            .await
            .status,
        200
    );
}

/// `key: header:X-Tenant` with 4 KB values once grew the stores by ~3 KB per distinct value
/// (Redis key names as long as the value). Long values are now hashed into a fixed-size key:
/// the same value still counts against one key, different values against different keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_quota_key_values_are_hashed_into_short_keys() {
    let redis = sluice_testkit::RedisServer::start();
    let backends = start_backends(&["api"]).await;
    let gw = Gateway::start_with_ports(&format!(
        "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nstate:\n  backend: redis\n  redis:\n    url: \"{}\"\n    timeout: 5s\nroutes:\n  - name: api\n    match:\n      hosts: [\"api.test\"]\n    upstream:\n      members:\n        - url: \"{}\"\n    quota:\n      key: header:X-Tenant\n      windows:\n        - {{ name: hour, limit: 1, window: 1h }}\n",
        redis.url(),
        url(backends[0].local_addr())
    ));
    let tenant = |c: char| c.to_string().repeat(4096);
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for (value, expect) in [(tenant('a'), 200), (tenant('a'), 429), (tenant('b'), 200)] {
        let r = client
            .request("GET", "api.test", "/", &[("x-tenant", &value)], b"")
            .await
            .unwrap();
        assert_eq!(r.status, expect);
    }
    let keys = redis.command(&["KEYS", "*"]).unwrap();
    let names: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
    assert!(names.len() >= 2, "{names:?}");
    assert!(
        names.iter().all(|k| k.len() < 128),
        "key names stay short: {:?}",
        names.iter().map(|k| k.len()).collect::<Vec<_>>()
    );
}

// --- downstream limits ---
//
// Bounds on client connections (limits:), bind failures, upstream write timeouts, the
// admin API's POST guard, pipelining, request head size and truncated responses.

mod downstream_limits {
    use std::io::Read;
    use std::net::SocketAddr;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::support::{self, request, start_backends, Gateway, HttpClient, TempDir};
    use super::url;

    /// Generous: the limits under test are 1–2 s, and a loaded machine must not fail the test.
    const DEADLINE: Duration = Duration::from_secs(20);

    /// A gateway with one route `api` to `member`, the given `limits:` body (indented lines)
    /// and extra `upstream:` lines.
    fn start(member: &str, limits: &str, upstream: &str) -> Gateway {
        Gateway::start_with_ports(&config(member, limits, upstream))
    }

    fn config(member: &str, limits: &str, upstream: &str) -> String {
        let limits = if limits.is_empty() {
            String::new()
        } else {
            format!("limits:\n{limits}")
        };
        format!(
            "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\n{limits}routes:\n  - name: api\n    upstream:\n      members:\n        - url: \"{member}\"\n{upstream}"
        )
    }

    /// Reads until the peer closes the connection (EOF or reset) or `within` passes; true if it
    /// closed. Whatever the peer sends before closing is returned through `got`.
    async fn closed_within(stream: &mut TcpStream, within: Duration, got: &mut Vec<u8>) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        let mut chunk = [0u8; 4096];
        loop {
            match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// A keep-alive connection left idle after its request, and a connection that never sends
    /// anything, are both closed once `limits.idle_timeout` passes. They used to stay open
    /// forever (Pingora's keep-alive after an HTTP/1.1 request has no timer).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_connections_are_closed_after_the_idle_timeout() {
        let backends = start_backends(&["api"]).await;
        // Not shorter: the request below must reach the gateway before its fresh connection
        // counts as idle, however slow the machine.
        let gw = start(&url(backends[0].local_addr()), "  idle_timeout: 3s\n", "");

        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        assert!(
            client.wait_closed(DEADLINE).await,
            "an idle keep-alive connection stayed open"
        );

        let mut silent = TcpStream::connect(gw.proxy_addr()).await.unwrap();
        let mut got = Vec::new();
        assert!(
            closed_within(&mut silent, DEADLINE, &mut got).await,
            "a connection that never sent a request stayed open"
        );
        assert!(
            got.is_empty(),
            "an idle connection is closed without an answer"
        );
        let closed = gw
            .metric(
                "sluice_connections_closed_total",
                &[("reason", "idle_timeout")],
            )
            .await;
        assert_eq!(closed, Some(2.0));
    }

    /// On a kept-alive connection the next request is served, and once it has waited for its
    /// next one for `limits.idle_timeout` the connection is closed, as a fresh one is.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_alive_connection_serves_its_next_request_then_is_closed_when_idle() {
        let backends = start_backends(&["api"]).await;
        // Not shorter: each request must reach the gateway before its connection counts as
        // idle, however slow the machine.
        let gw = start(&url(backends[0].local_addr()), "  idle_timeout: 3s\n", "");
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        for i in 0..3 {
            let r = client
                .request("GET", "api.test", &format!("/k{i}"), &[], b"")
                .await
                .unwrap_or_else(|e| panic!("request {i}: {e}"));
            assert_eq!(r.status, 200);
        }
        assert!(
            client.wait_closed(DEADLINE).await,
            "an idle keep-alive connection stayed open"
        );
        assert_eq!(backends[0].proxied_requests(), 3);
        let closed = gw
            .metric(
                "sluice_connections_closed_total",
                &[("reason", "idle_timeout")],
            )
            .await;
        assert_eq!(closed, Some(1.0));
    }

    /// A kept-alive connection whose next head stops halfway, after `first` (the bytes written
    /// before the answer is read) and `then` (written after it), is cut at the header timeout,
    /// not left to the (much longer) idle timeout, and counted as such.
    async fn a_stalled_next_head_is_cut_at_the_header_timeout(first: &[u8], then: &[u8]) {
        let backends = start_backends(&["api"]).await;
        let gw = start(
            &url(backends[0].local_addr()),
            "  idle_timeout: 60s\n  header_timeout: 1s\n",
            "",
        );
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        client.write_raw(first).await.unwrap();
        let r = client.read_response(false).await.unwrap();
        assert_eq!(r.status, 200);
        client.write_raw(then).await.unwrap();
        assert!(
            client.wait_closed(DEADLINE).await,
            "a stalled head on a kept-alive connection kept it open"
        );
        assert_eq!(backends[0].proxied_requests(), 1);
        let cut = gw
            .metric(
                "sluice_connections_closed_total",
                &[("reason", "header_timeout")],
            )
            .await;
        assert_eq!(cut, Some(1.0));
    }

    /// The first bytes of the next head, sent after the answer, start the header timer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_alive_connection_whose_next_head_stalls_is_cut_at_the_header_timeout() {
        a_stalled_next_head_is_cut_at_the_header_timeout(
            b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n",
            b"GET /second HTTP/1.1\r\nHost: api.t",
        )
        .await;
    }

    /// Part of the next head sent with a request (pipelined) starts that head's timer too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pipelined_part_of_a_head_that_stalls_is_cut_at_the_header_timeout() {
        a_stalled_next_head_is_cut_at_the_header_timeout(
            b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\nGET /second HTTP/1.1\r\nHost: api.t",
            b"",
        )
        .await;
    }

    /// A CONNECT head is a request head: one that stalls after its first line is cut at
    /// header_timeout too (not at a fixed minute), and counted as such.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_connect_head_is_cut_at_the_header_timeout() {
        let backends = start_backends(&["api"]).await;
        let gw = start(
            &url(backends[0].local_addr()),
            "  idle_timeout: 60s\n  header_timeout: 1s\n",
            "",
        );
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        client
            .write_raw(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api")
            .await
            .unwrap();
        assert!(
            client.wait_closed(DEADLINE).await,
            "a stalled CONNECT head kept its connection open"
        );
        // Counted as the connection's task ends, a moment after the close.
        let counted = support::wait_until_async(DEADLINE, || async {
            gw.metric(
                "sluice_connections_closed_total",
                &[("reason", "header_timeout")],
            )
            .await
                == Some(1.0)
        })
        .await;
        assert!(counted, "{}", gw.metrics().await);
    }

    /// A first head that comes slower than idle_timeout but within header_timeout is served:
    /// the header timer is the head's, whatever the idle one is.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_head_slower_than_the_idle_timeout_but_within_the_header_timeout_is_served() {
        let backends = start_backends(&["api"]).await;
        let gw = start(
            &url(backends[0].local_addr()),
            "  idle_timeout: 1s\n  header_timeout: 20s\n",
            "",
        );
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        client.write_raw(b"GET / HTTP/1.1\r\nHost: ").await.unwrap();
        // Part of the scenario, not a synchronisation: the head pauses for longer than the
        // idle timeout (and anything derived from it), far within the header timeout.
        tokio::time::sleep(Duration::from_secs(4)).await;
        client.write_raw(b"api.test\r\n\r\n").await.unwrap();
        let r = client.read_response(false).await.unwrap();
        assert_eq!(r.status, 200);
    }

    /// A graceful stop closes the connections that wait for a request at once, with no answer,
    /// while a request in flight goes on: idle keep-alive clients learn of the stop, and the
    /// drain waits only for requests.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_graceful_stop_closes_idle_connections_while_a_request_runs() {
        let backends = start_backends(&["api"]).await;
        let gw = Gateway::start_with_ports_and_env(
            &config(&url(backends[0].local_addr()), "", ""),
            &[("SLUICE_DRAIN_PERIOD", "120s")],
        );
        let mut idle = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        let r = idle
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        let addr = gw.proxy_addr();
        // Longer than the test waits for the idle connection to close: the process cannot have
        // exited by then.
        let slow = tokio::spawn(async move {
            support::try_request(
                addr,
                "GET",
                "api.test",
                "/slow",
                &[("x-delay-ms", "60000")],
                b"",
            )
            .await
        });
        assert!(support::wait_until(DEADLINE, || backends[0].requests() == 2).await);
        gw.sigterm();
        assert!(
            idle.wait_closed(DEADLINE).await,
            "an idle keep-alive connection stayed open through a graceful stop"
        );
        assert!(!slow.is_finished(), "the request in flight was cut");
        slow.abort();
    }

    /// Slowloris: a head trickled one header line every half second never completes, and every
    /// read is well within any per-read timeout. The whole head must arrive within
    /// `limits.header_timeout`, so the connection is closed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_head_trickled_line_by_line_is_cut_at_the_header_timeout() {
        let backends = start_backends(&["api"]).await;
        let gw = start(
            &url(backends[0].local_addr()),
            "  idle_timeout: 30s\n  header_timeout: 2s\n",
            "",
        );
        let mut stream = TcpStream::connect(gw.proxy_addr()).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: api.test\r\n")
            .await
            .unwrap();
        let started = Instant::now();
        let mut got = Vec::new();
        let mut closed = false;
        while started.elapsed() < DEADLINE {
            if stream.write_all(b"X-Slow: 1\r\n").await.is_err()
                || closed_within(&mut stream, Duration::from_millis(500), &mut got).await
            {
                closed = true;
                break;
            }
        }
        assert!(
            closed,
            "a head still incomplete after {DEADLINE:?} kept its connection"
        );
        assert_eq!(backends[0].requests(), 0);
        let cut = gw
            .metric(
                "sluice_connections_closed_total",
                &[("reason", "header_timeout")],
            )
            .await;
        assert_eq!(cut, Some(1.0));
        // A head that arrives in time is served as before.
        assert_eq!(
            request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"")
                .await
                .status,
            200
        );
    }

    /// At `limits.max_connections` a new client gets a 503 and is closed at once, while the admin
    /// API, outside the cap, still answers; a slot freed is usable again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_the_connection_cap_new_clients_are_refused_and_admin_still_answers() {
        let backends = start_backends(&["api"]).await;
        let gw = start(&url(backends[0].local_addr()), "  max_connections: 3\n", "");
        let mut held = Vec::new();
        for _ in 0..3 {
            let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
            let r = client
                .request("GET", "api.test", "/", &[], b"")
                .await
                .unwrap();
            assert_eq!(r.status, 200);
            held.push(client);
        }

        let mut extra = TcpStream::connect(gw.proxy_addr()).await.unwrap();
        let mut got = Vec::new();
        assert!(
            closed_within(&mut extra, DEADLINE, &mut got).await,
            "a connection over the cap was kept open"
        );
        let got = String::from_utf8_lossy(&got);
        assert!(got.starts_with("HTTP/1.1 503 "), "{got:?}");
        assert!(
            got.contains("x-sluice-error: too_many_connections"),
            "{got:?}"
        );

        assert_eq!(gw.admin("/healthz").await.status, 200);
        assert_eq!(
            gw.metric(
                "sluice_connections_closed_total",
                &[("reason", "max_connections")]
            )
            .await,
            Some(1.0)
        );

        drop(held.pop());
        let freed = support::wait_until_async(DEADLINE, || async {
            support::try_request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"")
                .await
                .is_ok_and(|r| r.status == 200)
        })
        .await;
        assert!(freed, "a closed connection did not give its slot back");
    }

    /// Runs `sluice run` on `config_yaml` and waits for it to exit; None if it is still running
    /// after `within` (then it is killed).
    fn run_until_exit(config_yaml: &str, within: Duration) -> Option<(i32, String)> {
        let dir = TempDir::new("sluice-bind");
        let config = dir.path().join("sluice.yaml");
        std::fs::write(&config, config_yaml).unwrap();
        let mut child = Command::new(support::sluice_binary())
            .arg("run")
            .arg("-c")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
        status.map(|s| (s.code().unwrap_or(-1), stderr))
    }

    /// With the proxy port, or the admin port, taken, sluice exits 1 at once with a message naming
    /// the address. It used to log "started", retry for 30 s, panic a thread and stay up with
    /// `/healthz` answering 200.
    #[test]
    fn a_taken_port_stops_the_start_with_exit_1() {
        for taken in ["listen", "admin.listen"] {
            let occupant = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let busy = occupant.local_addr().unwrap();
            let free = SocketAddr::from(([127, 0, 0, 1], support::free_port()));
            let (proxy, admin) = match taken {
                "listen" => (busy, free),
                _ => (free, busy),
            };
            let yaml = format!(
                "listen: [\"{proxy}\"]\nadmin:\n  listen: \"{admin}\"\nthreads: 1\nroutes: []\n"
            );
            let (code, stderr) =
                run_until_exit(&yaml, Duration::from_secs(30)).unwrap_or_else(|| {
                    panic!("{taken} {busy} taken: sluice was still running after 30 s")
                });
            assert_eq!(code, 1, "{taken} taken: {stderr}");
            assert!(
                stderr.contains(&format!("cannot listen on {busy} ({taken})")),
                "{taken} taken: {stderr}"
            );
            drop(occupant);
        }
    }

    /// A member that takes connections, reads the first bytes of each (the request head) and then
    /// neither reads nor answers again, keeping them open.
    async fn silent_member() -> std::net::SocketAddr {
        let member = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = member.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut conn, _)) = member.accept().await {
                let mut head = [0u8; 1024];
                let _ = conn.read(&mut head).await;
                held.push(conn);
            }
        });
        addr
    }

    /// A member that reads the request head and then stops reading: the upload is cut after
    /// `write_timeout` (then, as Pingora does, sluice waits up to `read_timeout` for an early
    /// answer from the member) with `504 upstream_timeout` and an access-log line. Without a write
    /// timeout the blocked write pinned the request and both connections for minutes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_member_that_stops_reading_an_upload_gets_a_504_after_write_timeout() {
        let member_addr = silent_member().await;
        let gw = start(
            &url(member_addr),
            "",
            "      read_timeout: 2s\n      write_timeout: 1s\n",
        );

        let body_len = 16 * 1024 * 1024;
        let client = TcpStream::connect(gw.proxy_addr()).await.unwrap();
        let (mut rx, mut tx) = client.into_split();
        tokio::spawn(async move {
            let head = format!(
                "POST /upload HTTP/1.1\r\nHost: api.test\r\nContent-Length: {body_len}\r\n\r\n"
            );
            let _ = tx.write_all(head.as_bytes()).await;
            let chunk = vec![b'x'; 64 * 1024];
            for _ in 0..body_len / chunk.len() {
                if tx.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            // Hold the write half until the test ends.
            std::future::pending::<()>().await;
        });
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        let answered = tokio::time::timeout(DEADLINE, async {
            loop {
                match rx.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&chunk[..n]),
                }
                if got.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
        })
        .await;
        assert!(
            answered.is_ok(),
            "no answer {DEADLINE:?} after the member stopped reading"
        );
        let got = String::from_utf8_lossy(&got);
        assert!(got.starts_with("HTTP/1.1 504 "), "{got:?}");
        assert!(got.contains("x-sluice-error: upstream_timeout"), "{got:?}");
        assert!(
            gw.wait_for_log("\"path\":\"/upload\"", DEADLINE).await,
            "no access-log line"
        );
        let line = gw
            .log_json()
            .into_iter()
            .find(|l| l["path"] == "/upload")
            .expect("access-log line");
        assert_eq!(line["status"], 504, "{line}");
        assert!(line["error"].is_string(), "{line}");
    }

    /// A member that takes requests and never answers: each gets `504 upstream_timeout` once
    /// `read_timeout` has passed, requests that wait together as well as those that come after
    /// them. Pingora's timers share one per 10 ms bucket, and a thread now finds its last
    /// buckets before searching its tree (third_party/PATCHES.md, "recent timer buckets"): a
    /// timer given out from there must still fire.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_to_a_member_that_never_answers_get_504_after_read_timeout() {
        let member_addr = silent_member().await;
        let gw = start(&url(member_addr), "", "      read_timeout: 1s\n");
        for wave in 0..2 {
            let waiting: Vec<_> = (0..4)
                .map(|i| {
                    let proxy = gw.proxy_addr();
                    tokio::spawn(async move {
                        let path = format!("/never/{wave}/{i}");
                        let answer = tokio::time::timeout(
                            DEADLINE,
                            request(proxy, "GET", "api.test", &path, &[], b""),
                        )
                        .await;
                        (path, answer)
                    })
                })
                .collect();
            for task in waiting {
                let (path, answer) = task.await.unwrap();
                let r = answer.unwrap_or_else(|_| panic!("{path}: no answer in {DEADLINE:?}"));
                assert_eq!(r.status, 504, "{path}: {}", r.text());
                assert_eq!(
                    r.header("x-sluice-error"),
                    Some("upstream_timeout"),
                    "{path}"
                );
            }
        }
    }

    /// Five pipelined requests on one connection get five answers, in order. Pingora's default
    /// answered the first with `Connection: keep-alive`, then closed the connection and silently
    /// dropped the other four.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipelined_requests_are_all_answered_in_order() {
        let backends = start_backends(&["api"]).await;
        let gw = start(&url(backends[0].local_addr()), "", "");
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        let mut batch = String::new();
        for i in 0..5 {
            batch.push_str(&format!("GET /p{i} HTTP/1.1\r\nHost: api.test\r\n\r\n"));
        }
        client.write_raw(batch.as_bytes()).await.unwrap();
        for i in 0..5 {
            let r = client
                .read_response(false)
                .await
                .unwrap_or_else(|e| panic!("answer {i} of 5: {e}"));
            assert_eq!(r.status, 200);
            assert_eq!(r.json()["target"], format!("/p{i}"));
        }
        assert_eq!(backends[0].proxied_requests(), 5);
    }

    /// One kept-alive connection carries many requests one after the other, including ones the
    /// gateway answers itself, and each gets its own answer. It pins sluice's connection loop,
    /// which awaits each request through pingora-proxy's unboxed entry point
    /// (third_party/PATCHES.md) rather than the boxed trait method.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_alive_connection_serves_request_after_request() {
        let backends = start_backends(&["api"]).await;
        let gw = Gateway::start_with_ports(&format!(
            "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nroutes:\n  - name: api\n    match: {{hosts: [api.test]}}\n    upstream:\n      members:\n        - url: \"{}\"\n",
            url(backends[0].local_addr())
        ));
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        let mut proxied = 0;
        for i in 0..60 {
            // Every tenth request matches no route: the gateway answers it, and the
            // connection must still serve the next one.
            let host = if i % 10 == 9 { "nope.test" } else { "api.test" };
            let head = if host == "nope.test" {
                format!("GET /k{i} HTTP/1.1\r\nHost: {host}\r\n\r\n")
            } else {
                let body = format!("body {i}");
                format!(
                    "POST /k{i} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
            };
            client.write_raw(head.as_bytes()).await.unwrap();
            let r = client
                .read_response(false)
                .await
                .unwrap_or_else(|e| panic!("answer {i}: {e}"));
            if host == "nope.test" {
                assert_eq!(r.status, 404, "request {i}");
            } else {
                proxied += 1;
                assert_eq!(r.status, 200, "request {i}");
                assert_eq!(r.json()["target"], format!("/k{i}"));
            }
        }
        assert_eq!(backends[0].proxied_requests(), proxied);
    }

    /// A gateway-made answer to a request with a small body keeps the connection, as nginx and
    /// HAProxy do: sluice reads the body and throws it away, and the next request on the same
    /// connection is served. A body too large to be worth reading (declared past 64 KiB), one
    /// the client holds back for `100 Continue`, or one that stops coming closes the connection
    /// instead.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gateway_answer_to_a_request_with_a_small_body_keeps_the_connection() {
        let backends = start_backends(&["api"]).await;
        let gw = Gateway::start_with_ports(&format!(
            "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nroutes:\n  - name: api\n    match: {{hosts: [api.test]}}\n    upstream:\n      members:\n        - url: \"{}\"\n",
            url(backends[0].local_addr())
        ));
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        for (i, body) in ["x".repeat(10), "y".repeat(40_000)].iter().enumerate() {
            // Sent whole before the answer comes, and split: the body arrives after the head.
            let head = format!(
                "POST /a{i} HTTP/1.1\r\nHost: nope.test\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            client.write_raw(head.as_bytes()).await.unwrap();
            client.write_raw(body.as_bytes()).await.unwrap();
            let r = client.read_response(false).await.unwrap();
            assert_eq!(r.status, 404, "body of {} bytes", body.len());
            assert_ne!(r.header("connection"), Some("close"));
            let r = client
                .request("GET", "api.test", &format!("/after{i}"), &[], b"")
                .await
                .unwrap_or_else(|e| panic!("the connection after a {}-byte body: {e}", body.len()));
            assert_eq!(r.status, 200);
            assert_eq!(r.json()["target"], format!("/after{i}"));
        }

        // Each of these is answered, then closed: declared past 64 KiB (not waited for);
        // waiting for 100 Continue (the body never comes, so nothing is read); a small body
        // that stops coming (the connection held for 2 s at most).
        let closing = [
            (
                "POST /big HTTP/1.1\r\nHost: nope.test\r\nContent-Length: 1000000\r\n\r\n",
                10,
                "closed after a large body",
            ),
            (
                "POST /wait HTTP/1.1\r\nHost: nope.test\r\nContent-Length: 10\r\nExpect: 100-continue\r\n\r\n",
                10,
                "closed after Expect",
            ),
            (
                "POST /stall HTTP/1.1\r\nHost: nope.test\r\nContent-Length: 10\r\n\r\nabc",
                30,
                "closed after a stalled body",
            ),
        ];
        for (head, within, what) in closing {
            let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
            client.write_raw(head.as_bytes()).await.unwrap();
            assert_eq!(client.read_response(false).await.unwrap().status, 404);
            assert!(
                client.wait_closed(Duration::from_secs(within)).await,
                "{what}"
            );
        }
        assert_eq!(backends[0].requests(), 2);
    }

    /// Request heads above `limits.max_header_bytes` (64 KiB by default) get `431
    /// header_too_large` and reach no member; 100 KB and 900 KB heads used to be forwarded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn oversized_request_heads_get_431() {
        let backends = start_backends(&["api"]).await;
        let gw = start(&url(backends[0].local_addr()), "", "");
        for size in [100_000, 900_000] {
            let value = "a".repeat(size);
            let r = request(
                gw.proxy_addr(),
                "GET",
                "api.test",
                "/",
                &[("X-Big", &value)],
                b"",
            )
            .await;
            assert_eq!(
                (r.status, r.header("x-sluice-error")),
                (431, Some("header_too_large")),
                "{size}-byte header"
            );
            assert_eq!(r.header("content-type"), Some("application/problem+json"));
        }
        assert_eq!(backends[0].requests(), 0);
        let value = "a".repeat(60_000);
        let r = request(
            gw.proxy_addr(),
            "GET",
            "api.test",
            "/",
            &[("X-Big", &value)],
            b"",
        )
        .await;
        assert_eq!(r.status, 200, "a 60 KB head is within the default");

        // The limit is configurable.
        let gw = start(
            &url(backends[0].local_addr()),
            "  max_header_bytes: 200000\n",
            "",
        );
        let value = "a".repeat(100_000);
        let r = request(
            gw.proxy_addr(),
            "GET",
            "api.test",
            "/",
            &[("X-Big", &value)],
            b"",
        )
        .await;
        assert_eq!(r.status, 200);
    }

    /// A member that announces 1000 bytes, sends 10 and closes: the client's connection is cut
    /// (it cannot be told otherwise once the head is sent), and the access log and the metrics
    /// say the attempt failed, instead of a clean 200.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_response_cut_mid_body_is_logged_and_counted_as_an_error() {
        let member = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let member_addr = member.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = member.accept().await {
                tokio::spawn(async move {
                    let mut head = [0u8; 4096];
                    let _ = conn.read(&mut head).await;
                    let _ = conn
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789")
                        .await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        let member = url(member_addr);
        let gw = start(&member, "", "");
        let outcome =
            support::try_request(gw.proxy_addr(), "GET", "api.test", "/cut", &[], b"").await;
        assert!(outcome.is_err(), "the client must see the cut: {outcome:?}");

        assert!(gw.wait_for_log("\"path\":\"/cut\"", DEADLINE).await);
        let logs = gw.logs();
        let line = logs
            .lines()
            .find(|l| l.contains("\"path\":\"/cut\""))
            .unwrap();
        assert!(line.contains("\"error\":\"upstream_truncated\""), "{line}");
        let errors = gw
            .metric(
                "sluice_upstream_attempts_total",
                &[("route", "api"), ("member", &member), ("outcome", "error")],
            )
            .await;
        assert_eq!(errors, Some(1.0));
        let ok = gw
            .metric(
                "sluice_upstream_attempts_total",
                &[("route", "api"), ("member", &member), ("outcome", "ok")],
            )
            .await
            .unwrap_or(0.0);
        assert_eq!(ok, 0.0);
    }

    /// `POST /reload` with a token configured: the token must match exactly. The old compare
    /// trimmed what the client sent, so `Bearer  s3cret` (or a padded token) passed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_admin_token_must_match_exactly() {
        let template = "listen: [\"{PROXY}\"]\nadmin:\n  listen: \"{ADMIN}\"\n  token_env: SLUICE_TEST_TOKEN\nthreads: 1\nroutes: []\n";
        let gw = Gateway::start_with_ports_and_env(template, &[("SLUICE_TEST_TOKEN", "s3cret")]);
        let post = |auth: &'static str| {
            let addr = gw.admin_addr();
            async move {
                request(
                    addr,
                    "POST",
                    "admin",
                    "/reload",
                    &[("Authorization", auth)],
                    b"",
                )
                .await
                .status
            }
        };
        assert_eq!(post("Bearer  s3cret").await, 401);
        assert_eq!(post("Bearer s3cret\t x").await, 401);
        assert_eq!(post("Bearer s3cre").await, 401);
        assert_eq!(post("Bearer s3cret").await, 200);
    }

    /// Without a token, a POST needs the `X-Sluice-Admin` header, which a cross-site HTML form
    /// cannot send: a page on another site can no longer make a visitor's browser reload the
    /// gateway.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admin_post_without_a_token_needs_the_admin_header() {
        let template =
            "listen: [\"{PROXY}\"]\nadmin:\n  listen: \"{ADMIN}\"\nthreads: 1\nroutes: []\n";
        let gw = Gateway::start_with_ports(template);
        let form = [("Content-Type", "application/x-www-form-urlencoded")];
        let r = request(gw.admin_addr(), "POST", "admin", "/reload", &form, b"a=1").await;
        assert_eq!(r.status, 403, "{}", r.text());
        let r = gw.post_reload().await;
        assert_eq!(r.status, 200, "{}", r.text());
    }

    /// An admin API on a non-loopback address without a token is warned about at start.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_exposed_admin_without_a_token_is_warned_about() {
        let [proxy, admin] = support::free_ports::<2>();
        let yaml = format!(
            "listen: [\"127.0.0.1:{proxy}\"]\nadmin:\n  listen: \"0.0.0.0:{admin}\"\nthreads: 1\nroutes: []\n"
        );
        let gw = Gateway::start(&yaml);
        assert!(
            gw.wait_for_log("non-loopback address without admin.token_env", DEADLINE)
                .await,
            "{}",
            gw.logs()
        );
        let loopback = Gateway::start_with_ports(
            "listen: [\"{PROXY}\"]\nadmin:\n  listen: \"{ADMIN}\"\nthreads: 1\nroutes: []\n",
        );
        assert!(loopback.wait_for_log("sluice started", DEADLINE).await);
        assert!(!loopback.logs().contains("non-loopback"));
    }

    /// The start logs the open-file limits it found and set.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_open_file_limit_is_raised_and_logged() {
        let gw = Gateway::start_with_ports(
            "listen: [\"{PROXY}\"]\nadmin:\n  listen: \"{ADMIN}\"\nthreads: 1\nroutes: []\n",
        );
        assert!(gw.wait_for_log("open-file limit", DEADLINE).await);
        let line = gw
            .log_json()
            .into_iter()
            .find(|l| l.to_string().contains("open-file limit"))
            .unwrap();
        let text = line.to_string();
        assert!(
            text.contains("nofile_soft") && text.contains("nofile_hard"),
            "{text}"
        );
    }
}

/// The upstream connection pool's handoff, with a member that is raw TCP so that the test sees
/// each connection: keep-alive reuse, a member closing its idle connections, and response bodies
/// that arrive with their head or after it (pingora-core's body buffer, third_party/PATCHES.md).
mod upstream_pool {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::watch;

    use super::support::{wait_until, Gateway, HttpClient};

    const DEADLINE: Duration = Duration::from_secs(20);
    /// Large enough that the member's second write is read after the head, into the body buffer.
    const BIG: usize = 300_000;
    static BIG_BODY: [u8; BIG] = [b'b'; BIG];

    /// A keep-alive HTTP/1.1 member that counts the connections it accepts and closes every idle
    /// one when told to, the way a member's own keep-alive timeout does.
    struct Member {
        addr: std::net::SocketAddr,
        accepted: Arc<AtomicUsize>,
        closed: Arc<AtomicUsize>,
        close_idle: watch::Sender<u64>,
    }

    impl Member {
        async fn start() -> Member {
            Member::start_closing(Close::Whole).await
        }

        async fn start_closing(close: Close) -> Member {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let accepted = Arc::new(AtomicUsize::new(0));
            let closed = Arc::new(AtomicUsize::new(0));
            let (close_idle, rx) = watch::channel(0);
            let (acc, clo) = (accepted.clone(), closed.clone());
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    acc.fetch_add(1, Ordering::SeqCst);
                    let mut rx = rx.clone();
                    rx.mark_unchanged();
                    let clo = clo.clone();
                    tokio::spawn(async move {
                        serve(stream, &mut rx, close).await;
                        clo.fetch_add(1, Ordering::SeqCst);
                    });
                }
            });
            Member {
                addr,
                accepted,
                closed,
                close_idle,
            }
        }

        fn accepted(&self) -> usize {
            self.accepted.load(Ordering::SeqCst)
        }

        /// Closes every connection waiting for its next request; returns once all are closed:
        /// with [`Close::Whole`] the closes (FINs) are then queued at sluice's end, and with
        /// [`Close::Half`] sluice has closed its end too.
        async fn close_idle_connections(&self) {
            self.close_idle.send_modify(|generation| *generation += 1);
            let accepted = self.accepted();
            assert!(
                wait_until(DEADLINE, || self.closed.load(Ordering::SeqCst) == accepted).await,
                "the member's idle connections did not close"
            );
        }
    }

    /// sluice (`threads: 1`) with one route, `api.test`, to the member at `addr`.
    fn gateway_to(addr: std::net::SocketAddr) -> Gateway {
        Gateway::start_with_ports(&format!(
            "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nroutes:\n  - name: api\n    match: {{hosts: [api.test]}}\n    upstream:\n      members:\n        - url: \"http://{}\"\n",
            addr
        ))
    }

    /// `n` requests for `/small` on `client`, each answered 200.
    async fn get_small(client: &mut HttpClient, n: usize) {
        for i in 0..n {
            let r = client
                .request("GET", "api.test", "/small", &[], b"")
                .await
                .unwrap();
            assert_eq!(r.status, 200, "request {i}");
        }
    }

    /// Reads one request head, line by line into `line`; whether a line of it starts with
    /// `prefix` (a request line), or `None` once the peer closed or the read failed.
    async fn read_head(
        reader: &mut BufReader<TcpStream>,
        line: &mut String,
        prefix: &str,
    ) -> Option<bool> {
        let mut found = false;
        loop {
            line.clear();
            match reader.read_line(line).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
            found |= line.starts_with(prefix);
            if line == "\r\n" {
                return Some(found);
            }
        }
    }

    /// How many sockets of this machine hold a TCP connection to `port` in one of `states`
    /// (`/proc/net/tcp`'s hex codes: 01 established, 08 closed by the peer only). A member's
    /// close reaches sluice's socket when the kernel gets to it, which on a loaded machine can
    /// be after the next request has taken the pooled connection; the tests wait for it here.
    fn connections_to(port: u16, states: &[&str]) -> usize {
        ["/proc/net/tcp", "/proc/net/tcp6"]
            .iter()
            .filter_map(|table| std::fs::read_to_string(table).ok())
            .map(|text| {
                text.lines()
                    .skip(1)
                    .filter(|line| {
                        let fields: Vec<&str> = line.split_whitespace().collect();
                        let remote_port = fields
                            .get(2)
                            .and_then(|a| a.rsplit(':').next())
                            .and_then(|p| u16::from_str_radix(p, 16).ok());
                        remote_port == Some(port)
                            && fields.get(3).is_some_and(|st| states.contains(st))
                    })
                    .count()
            })
            .sum()
    }

    /// How the member closes an idle connection.
    #[derive(Clone, Copy)]
    enum Close {
        /// Both ways at once.
        Whole,
        /// Its sending side only; then it waits for sluice to close the other.
        Half,
    }

    /// Answers `GET /small` with a body written together with its head and `GET /big` with one
    /// written mostly after it, until told to close while idle or the peer closes.
    async fn serve(stream: TcpStream, close_idle: &mut watch::Receiver<u64>, close: Close) {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        loop {
            // Only between requests: a request already begun is answered first.
            tokio::select! {
                next = reader.fill_buf() => match next {
                    Ok([]) | Err(_) => return,
                    Ok(_) => {}
                },
                _ = close_idle.changed() => {
                    if let Close::Half = close {
                        let stream = reader.get_mut();
                        if stream.shutdown().await.is_ok() {
                            // Until sluice closes its end: anything it sends is not answered.
                            let mut rest = Vec::new();
                            let _ = stream.read_to_end(&mut rest).await;
                        }
                    }
                    return;
                }
            }
            let Some(big) = read_head(&mut reader, &mut line, "GET /big ").await else {
                return;
            };
            let stream = reader.get_mut();
            let result = if big {
                let mut first =
                    format!("HTTP/1.1 200 OK\r\nContent-Length: {BIG}\r\n\r\n").into_bytes();
                first.extend_from_slice(&BIG_BODY[..100]);
                match stream.write_all(&first).await {
                    Ok(()) => stream.write_all(&BIG_BODY[100..]).await,
                    Err(e) => Err(e),
                }
            } else {
                stream
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsmall\n")
                    .await
            };
            if result.is_err() {
                return;
            }
        }
    }

    /// Requests one after the other through sluice (`threads: 1`) reuse one upstream
    /// connection; after the member closes it while idle, the next requests all succeed on a
    /// new connection, which is then reused in turn. Bodies that came with the head and bodies
    /// read after it reach the client whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pooled_connections_are_reused_and_dropped_once_the_member_closes_them() {
        let member = Member::start().await;
        let gw = gateway_to(member.addr);
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        for round in 1..=3 {
            for i in 0..20 {
                let path = if i % 5 == 4 { "/big" } else { "/small" };
                let r = client
                    .request("GET", "api.test", path, &[], b"")
                    .await
                    .unwrap_or_else(|e| panic!("round {round}, request {i}: {e}"));
                assert_eq!(r.status, 200, "round {round}, request {i}");
                if path == "/big" {
                    assert!(
                        r.body.len() == BIG && r.body.iter().all(|&b| b == b'b'),
                        "round {round}, request {i}: {} body bytes",
                        r.body.len()
                    );
                } else {
                    assert_eq!(r.body, b"small\n", "round {round}, request {i}");
                }
            }
            assert_eq!(
                member.accepted(),
                round,
                "one upstream connection per round, reused for its 20 requests"
            );
            member.close_idle_connections().await;
            // Once sluice has let the connection go, the next request cannot find it (before,
            // the member's close would race that request, as it would anywhere).
            assert!(
                wait_until(DEADLINE, || connections_to(
                    member.addr.port(),
                    &["01", "08"]
                ) == 0)
                .await,
                "round {round}: sluice kept the connection the member closed"
            );
        }
        // No request was sent on a closed connection and retried: one new connection (a line
        // with a connect time) per round, no upstream error.
        assert!(
            wait_until(DEADLINE, || gw.log_json().len() >= 60).await,
            "access-log lines missing"
        );
        let lines = gw.log_json();
        let connected = lines.iter().filter(|l| l["connect_ms"].is_number()).count();
        assert_eq!(connected, 3, "{lines:?}");
        assert!(lines.iter().all(|l| l["error"].is_null()), "{lines:?}");
    }

    /// A connection that waits in sluice's pool is closed by sluice once the member closes its
    /// side, with no request coming to find out: pooled connections do not hold descriptors
    /// the member is done with (pingora-core's idle pool sweeper, third_party/PATCHES.md).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_connections_the_member_half_closes_are_closed_without_a_request() {
        let member = Member::start_closing(Close::Half).await;
        let gw = gateway_to(member.addr);
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        get_small(&mut client, 3).await;
        assert_eq!(member.accepted(), 1, "one upstream connection, reused");
        // Returns once sluice has closed the connection, or fails after the deadline.
        member.close_idle_connections().await;
        // The client's own connection is still open, and the next request gets a new one,
        // which is closed in turn: the sweeper stopped with the pool empty and started again.
        let r = client
            .request("GET", "api.test", "/small", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(member.accepted(), 2);
        member.close_idle_connections().await;
    }

    /// With two idle connections to a member, one the member has closed: the next request
    /// takes the other, newest first, and opens none (`reused_stream` passes over a connection
    /// that fails its check, third_party/PATCHES.md "idle pool").
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_closed_idle_connection_is_passed_over_for_an_open_one() {
        use tokio::sync::Notify;

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let held = Arc::new(AtomicUsize::new(0));
        let held_closed = Arc::new(AtomicUsize::new(0));
        let answer_held = Arc::new(Notify::new());
        let close_held = Arc::new(Notify::new());
        {
            let (accepted, held, held_closed) =
                (accepted.clone(), held.clone(), held_closed.clone());
            let (answer_held, close_held) = (answer_held.clone(), close_held.clone());
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let (held, held_closed) = (held.clone(), held_closed.clone());
                    let (answer_held, close_held) = (answer_held.clone(), close_held.clone());
                    tokio::spawn(async move {
                        let mut reader = BufReader::new(stream);
                        let mut line = String::new();
                        loop {
                            let Some(hold) = read_head(&mut reader, &mut line, "GET /hold ").await
                            else {
                                return;
                            };
                            if hold {
                                held.fetch_add(1, Ordering::SeqCst);
                                answer_held.notified().await;
                            }
                            let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n";
                            if reader.get_mut().write_all(answer).await.is_err() {
                                return;
                            }
                            if hold {
                                // This connection, and only this one, is closed once idle.
                                close_held.notified().await;
                                drop(reader);
                                held_closed.fetch_add(1, Ordering::SeqCst);
                                return;
                            }
                        }
                    });
                }
            });
        }
        let gw = gateway_to(addr);
        // One request held at the member while another goes through: two connections.
        let proxy = gw.proxy_addr();
        let holding = tokio::spawn(async move {
            let mut client = HttpClient::connect(proxy).await.unwrap();
            client
                .request("GET", "api.test", "/hold", &[], b"")
                .await
                .unwrap()
        });
        assert!(wait_until(DEADLINE, || held.load(Ordering::SeqCst) == 1).await);
        let mut client = HttpClient::connect(proxy).await.unwrap();
        let r = client
            .request("GET", "api.test", "/small", &[], b"")
            .await
            .unwrap();
        assert_eq!((r.status, accepted.load(Ordering::SeqCst)), (200, 2));
        answer_held.notify_one();
        assert_eq!(holding.await.unwrap().status, 200);
        // Both are idle in the pool now (the held one released last, so newest), and the
        // member closes the held one.
        assert!(
            wait_until(DEADLINE, || gw.log_json().len() >= 2).await,
            "access-log lines missing"
        );
        close_held.notify_one();
        assert!(wait_until(DEADLINE, || held_closed.load(Ordering::SeqCst) == 1).await);
        // The member's close has reached sluice's end: of its two connections, one is open.
        assert!(
            wait_until(DEADLINE, || connections_to(addr.port(), &["01"]) == 1).await,
            "the member's close never reached sluice"
        );
        get_small(&mut client, 3).await;
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "the open connection was reused; none was opened"
        );
        assert!(
            wait_until(DEADLINE, || gw.log_json().len() >= 5).await,
            "access-log lines missing"
        );
        let lines = gw.log_json();
        assert!(lines.iter().all(|l| l["error"].is_null()), "{lines:?}");
    }

    /// Whether an upstream connection goes back to the pool is decided by the member's answer
    /// (RFC 9112 §9.3, §6.1): `Connection: close` and an HTTP/1.0 answer without keep-alive
    /// end it, HTTP/1.0 with `Connection: keep-alive` keeps it, unless it came chunked. Pingora
    /// reads this when it parses the head, and hands the head itself to the proxy
    /// (third_party/PATCHES.md, "response head handed out without a copy"). Every member keeps
    /// its end open, so a connection sluice wrongly reused would serve the next request: the
    /// count of connections tells.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_member_s_answer_decides_whether_its_connection_is_reused() {
        const CASES: [(&str, &[u8], usize); 6] = [
            ("http11", b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n", 1),
            (
                "close",
                b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 3\r\n\r\nok\n",
                3,
            ),
            ("http10", b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n", 3),
            (
                "http10-keepalive",
                b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=30\r\nContent-Length: 3\r\n\r\nok\n",
                1,
            ),
            (
                "http10-chunked",
                b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nok\n\r\n0\r\n\r\n",
                3,
            ),
            (
                "http11-keepalive-timeout",
                b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5, max=100\r\nContent-Length: 3\r\n\r\nok\n",
                1,
            ),
        ];
        let mut routes = String::new();
        let mut members = Vec::new();
        for (name, answer, _) in CASES {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let accepted = Arc::new(AtomicUsize::new(0));
            let acc = accepted.clone();
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    acc.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(async move {
                        let mut reader = BufReader::new(stream);
                        let mut line = String::new();
                        while read_head(&mut reader, &mut line, "GET ").await.is_some() {
                            if reader.get_mut().write_all(answer).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            });
            routes.push_str(&format!(
                "  - name: {name}\n    match: {{hosts: [{name}.test]}}\n    upstream:\n      members:\n        - url: \"http://{addr}\"\n"
            ));
            members.push(accepted);
        }
        let gw = Gateway::start_with_ports(&format!(
            "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nroutes:\n{routes}"
        ));
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        for ((name, _, connections), accepted) in CASES.iter().zip(&members) {
            let host = format!("{name}.test");
            for i in 0..3 {
                let r = client.request("GET", &host, "/", &[], b"").await.unwrap();
                assert_eq!(
                    (r.status, &r.body[..]),
                    (200, &b"ok\n"[..]),
                    "{name}, request {i}"
                );
            }
            assert_eq!(
                accepted.load(Ordering::SeqCst),
                *connections,
                "{name}: upstream connections for three requests"
            );
        }
    }
}
