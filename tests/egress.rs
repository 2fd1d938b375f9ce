//! SPEC §7 end to end: real clients (curl) using sluice as their HTTPS proxy, CONNECT tunnels to
//! real TLS origins (`openssl s_server`, with a CA made per test), and real forward proxies
//! (Debian's `tinyproxy`) as `proxy` members.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use support::tinyproxy::Tinyproxy;
use support::tls::{make_certificates, tls_origin};
use support::{start_backends, Config, Egress, Gateway, HttpClient, Quota, Route, TempDir};

const WAIT: Duration = Duration::from_secs(20);

/// A forward proxy that answers every CONNECT with `status`, counting them.
async fn refusing_proxy(status: u16) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicU64::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                if head.starts_with(b"CONNECT ") {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
                let answer = format!(
                    "HTTP/1.1 {status} Refused\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                let _ = s.write_all(answer.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    (addr, count)
}

/// curl with `args` and `env`, and none of the caller's proxy settings; returns whether it
/// succeeded, and its stdout and stderr.
async fn curl(args: Vec<String>, env: Vec<(String, String)>) -> (bool, String, String) {
    tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new("curl");
        for var in [
            "http_proxy",
            "https_proxy",
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "all_proxy",
            "ALL_PROXY",
            "no_proxy",
            "NO_PROXY",
        ] {
            cmd.env_remove(var);
        }
        cmd.args(["-sS", "--max-time", "20"]).args(&args).envs(env);
        let out = cmd.output().expect("curl must be installed");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

/// `curl -x sluice https://localhost:port/` trusting the test CA: the HTTP status, or a panic
/// with curl's error.
async fn curl_https_via(gw: &Gateway, dir: &Path, host: &str, port: u16) -> String {
    let (ok, out, err) = curl(
        vec![
            "-o".into(),
            "/dev/null".into(),
            "-w".into(),
            "%{http_code}".into(),
            "--cacert".into(),
            dir.join("ca.pem").display().to_string(),
            "-x".into(),
            format!("http://{}", gw.proxy_addr()),
            format!("https://{host}:{port}/"),
        ],
        vec![],
    )
    .await;
    assert!(ok, "curl failed: {err}\n{}", gw.logs());
    out
}

/// Access lines of tunnels.
fn tunnel_lines(gw: &Gateway) -> Vec<serde_json::Value> {
    gw.log_json()
        .into_iter()
        .filter(|l| l["target"] == "sluice::access" && l["method"] == "CONNECT")
        .collect()
}

async fn wait_tunnel_lines(gw: &Gateway, n: usize) -> Vec<serde_json::Value> {
    support::wait_until(WAIT, || tunnel_lines(gw).len() >= n).await;
    tunnel_lines(gw)
}

/// Opens a CONNECT to `authority` through the gateway and reads the answer's head.
async fn connect(gw: &Gateway, authority: &str) -> (HttpClient, support::Response) {
    support::open_tunnel(gw.proxy_addr(), authority, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_reaches_a_tls_origin_through_a_direct_route() {
    let dir = TempDir::new("egress-direct");
    make_certificates(dir.path());
    let (_origin, port) = tls_origin(dir.path());
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(Route::new("web").hosts(&["localhost"]).direct_member())
        .start();

    assert_eq!(
        curl_https_via(&gw, dir.path(), "localhost", port).await,
        "200"
    );
    // The same with HTTPS_PROXY in the environment instead of -x.
    let (ok, out, err) = curl(
        vec![
            "-o".into(),
            "/dev/null".into(),
            "-w".into(),
            "%{http_code}".into(),
            "--cacert".into(),
            dir.path().join("ca.pem").display().to_string(),
            format!("https://localhost:{port}/"),
        ],
        vec![("HTTPS_PROXY".into(), format!("http://{}", gw.proxy_addr()))],
    )
    .await;
    assert!(ok && out == "200", "{out} {err}");

    let lines = wait_tunnel_lines(&gw, 2).await;
    assert_eq!(lines.len(), 2, "{lines:#?}");
    for l in &lines {
        assert_eq!(l["route"], "web");
        assert_eq!(l["status"], 200);
        assert_eq!(l["member"], "direct");
        assert_eq!(l["authority"], format!("localhost:{port}"));
        assert!(l["bytes_up"].as_u64().unwrap() > 0, "{l}");
        assert!(l["bytes_down"].as_u64().unwrap() > 0, "{l}");
        assert!(l["duration_ms"].is_number());
    }
    let up: u64 = lines.iter().map(|l| l["bytes_up"].as_u64().unwrap()).sum();
    let down: u64 = lines
        .iter()
        .map(|l| l["bytes_down"].as_u64().unwrap())
        .sum();
    let metric = |direction: &str| {
        let gw = &gw;
        let direction = direction.to_string();
        async move {
            gw.metric(
                "sluice_tunnel_bytes_total",
                &[("route", "web"), ("direction", &direction)],
            )
            .await
        }
    };
    assert_eq!(metric("up").await, Some(up as f64));
    assert_eq!(metric("down").await, Some(down as f64));
    assert_eq!(
        gw.metric("sluice_tunnels_active", &[("route", "web")])
            .await,
        Some(0.0)
    );
    assert_eq!(
        gw.metric(
            "sluice_requests_total",
            &[("route", "web"), ("status", "200")]
        )
        .await,
        Some(2.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_members_carry_tunnels_and_plain_http_least_used_exactly() {
    const PASSWORD: &str = "pr0xy-s3cret";
    let dir = TempDir::new("egress-proxies");
    make_certificates(dir.path());
    let (_origin, port) = tls_origin(dir.path());
    let backends = start_backends(&["plain"]).await;
    let plain = backends[0].local_addr();
    let with_auth = Tinyproxy::start(dir.path(), "auth", Some(("sluice", PASSWORD)));
    let open = Tinyproxy::start(dir.path(), "open", None);
    // The plain requests below name 127.0.0.1, which the guard checks for proxy members too.
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(
            Route::new("egress")
                .hosts(&["localhost", "127.0.0.1"])
                .least_used()
                .proxy_member(format!(
                    "http://sluice:{PASSWORD}@127.0.0.1:{}",
                    with_auth.port
                ))
                .proxy_member(open.url()),
        )
        .start();

    for _ in 0..6 {
        assert_eq!(
            curl_https_via(&gw, dir.path(), "localhost", port).await,
            "200"
        );
    }
    // least_used: one assignment per tunnel, so exactly 3 CONNECTs each.
    let connect_line = format!("CONNECT localhost:{port} ");
    assert_eq!(with_auth.wait_requests(&connect_line, 3).await, 3);
    assert_eq!(open.wait_requests(&connect_line, 3).await, 3);

    // Plain http:// through the same members: absolute form at the proxy, then the origin.
    for i in 0..4 {
        let (ok, out, err) = curl(
            vec![
                "-x".into(),
                format!("http://{}", gw.proxy_addr()),
                format!("http://127.0.0.1:{}/plain/{i}?q=1", plain.port()),
            ],
            vec![],
        )
        .await;
        assert!(ok, "{err}");
        let json: serde_json::Value = serde_json::from_str(&out).expect(&out);
        assert_eq!(json["upstream"], "plain");
        assert_eq!(json["target"], format!("/plain/{i}?q=1"));
    }
    let get_line = format!("GET http://127.0.0.1:{}/plain/", plain.port());
    assert_eq!(with_auth.wait_requests(&get_line, 2).await, 2);
    assert_eq!(open.wait_requests(&get_line, 2).await, 2);
    assert_eq!(backends[0].requests(), 4);

    // The password is nowhere to be read: not in logs, /status or /metrics, not even encoded.
    let encoded = {
        // base64("sluice:pr0xy-s3cret"), as Proxy-Authorization carries it.
        "c2x1aWNlOnByMHh5LXMzY3JldA=="
    };
    let status = gw.status().await.to_string();
    let metrics = gw.metrics().await;
    for (what, text) in [
        ("logs", gw.logs()),
        ("/status", status.clone()),
        ("/metrics", metrics),
    ] {
        assert!(!text.contains(PASSWORD), "{what} shows the password");
        assert!(
            !text.contains(encoded),
            "{what} shows the encoded credentials"
        );
    }
    assert!(
        status.contains(&format!("\"http://127.0.0.1:{}\"", with_auth.port)),
        "{status}"
    );
    let lines = wait_tunnel_lines(&gw, 6).await;
    assert!(lines.iter().all(|l| l["status"] == 200));
    assert_eq!(
        lines
            .iter()
            .filter(|l| l["member"] == format!("http://127.0.0.1:{}", with_auth.port))
            .count(),
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quota_is_charged_once_per_tunnel() {
    let backends = start_backends(&["b"]).await;
    let target = backends[0].local_addr().to_string();
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[backends[0].local_addr().port()]))
        .route(
            Route::new("q")
                .hosts(&["127.0.0.1"])
                .direct_member()
                .quota(Quota::window("minute", 2, "1m")),
        )
        .start();

    let (mut first, r) = connect(&gw, &target).await;
    assert_eq!(r.status, 200);
    assert!(r.header("ratelimit").is_some());
    // Several requests in one tunnel are one charge.
    for _ in 0..3 {
        let r = first.request("GET", &target, "/", &[], b"").await.unwrap();
        assert_eq!(r.status, 200);
    }
    let (_second, r) = connect(&gw, &target).await;
    assert_eq!(r.status, 200);
    let (_third, r) = connect(&gw, &target).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-sluice-error"), Some("quota_exceeded"));
    let retry_after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    assert_eq!(backends[0].requests(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_refuses_connect_is_retried_on_another() {
    let dir = TempDir::new("egress-refusals");
    make_certificates(dir.path());
    let (_origin, port) = tls_origin(dir.path());
    let good = Tinyproxy::start(dir.path(), "good", None);
    // Wrong credentials: this one answers 407.
    let strict = Tinyproxy::start(dir.path(), "strict", Some(("sluice", "right")));
    let (refuser, refused) = refusing_proxy(502).await;
    // CONNECT 127.0.0.1 below: the guard checks an address for proxy members too.
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port, 443]))
        .route(
            Route::new("r407")
                .hosts(&["localhost"])
                .proxy_member(format!("http://sluice:wrong@127.0.0.1:{}", strict.port))
                .proxy_member(good.url())
                .retries(1),
        )
        .route(
            Route::new("r502")
                .hosts(&["127.0.0.1"])
                .proxy_member(format!("http://{refuser}"))
                .proxy_member(good.url())
                .retries(1),
        )
        .route(
            Route::new("none")
                .hosts(&["none.test"])
                .proxy_member(format!("http://{refuser}")),
        )
        .start();

    for _ in 0..4 {
        assert_eq!(
            curl_https_via(&gw, dir.path(), "localhost", port).await,
            "200"
        );
        assert_eq!(
            curl_https_via(&gw, dir.path(), "127.0.0.1", port).await,
            "200"
        );
    }
    // Round-robin starts with the refusing member, so each refused at least once.
    assert!(strict.wait_requests("CONNECT ", 1).await >= 1);
    assert!(refused.load(Ordering::SeqCst) >= 1);
    assert_eq!(good.wait_requests("CONNECT ", 8).await, 8);

    // When every member refuses: 502 proxy_refused.
    let before = refused.load(Ordering::SeqCst);
    let (_c, r) = connect(&gw, "none.test:443").await;
    assert_eq!(r.status, 502);
    assert_eq!(r.header("x-sluice-error"), Some("proxy_refused"));
    assert_eq!(refused.load(Ordering::SeqCst), before + 1);
}

/// A destination the client writes as an address passes the egress guard whatever the member
/// kind: through a proxy beside sluice, `127.0.0.1:<admin port>` would reach sluice's own admin
/// API. A CONNECT and a plain request to a denied address are refused (403
/// `destination_denied`) before the proxy is contacted; a name goes on, for the proxy to
/// resolve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_through_a_proxy_member_passes_the_egress_guard() {
    let dir = TempDir::new("egress-proxy-guard");
    make_certificates(dir.path());
    let (_origin, port) = tls_origin(dir.path());
    let proxy = Tinyproxy::start(dir.path(), "guarded", None);
    let gw = Config::new()
        .egress(Egress::default().connect_ports(&[port, 9901]))
        .route(Route::new("out").hosts(&["*"]).proxy_member(proxy.url()))
        .start();
    let admin_port = gw.admin_addr().port();
    for authority in [
        format!("127.0.0.1:{port}"),
        "169.254.169.254:9901".to_string(),
        format!("[::ffff:127.0.0.1]:{port}"),
    ] {
        let (_c, r) = connect(&gw, &authority).await;
        assert_eq!(r.status, 403, "{authority}: {}", r.text());
        assert_eq!(r.header("x-sluice-error"), Some("destination_denied"));
    }
    let (ok, out, err) = curl(
        vec![
            "-s".into(),
            "-o".into(),
            "/dev/null".into(),
            "-w".into(),
            "%{http_code}".into(),
            "-x".into(),
            format!("http://{}", gw.proxy_addr()),
            format!("http://127.0.0.1:{admin_port}/status"),
        ],
        vec![],
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(out, "403");
    // A name is the proxy's to resolve: this one reaches the origin through it.
    assert_eq!(
        curl_https_via(&gw, dir.path(), "localhost", port).await,
        "200"
    );
    assert_eq!(proxy.wait_requests("CONNECT localhost:", 1).await, 1);
    // The proxy logs requests in order, and the one above is there: the refused ones never came.
    for line in ["CONNECT 127", "CONNECT 169", "CONNECT [", "GET http://127"] {
        assert!(proxy.requests(line).is_empty(), "{line}");
    }
}

/// The client chooses a tunnel's target, so a target that refuses or does not exist must not
/// count against the proxies that answered for it: otherwise one client could eject every
/// proxy of the route in turn, and every other caller would get `503 no_member`. Both proxies
/// refuse a CONNECT to a closed port (so the client gets `502 proxy_refused`), a long cooldown
/// would keep an ejected one out for the rest of the test, and the next tunnel still goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_fails_does_not_eject_the_proxies_that_answered_for_it() {
    let dir = TempDir::new("egress-target-fails");
    make_certificates(dir.path());
    let (_origin, port) = tls_origin(dir.path());
    let closed = support::refused_port();
    let one = Tinyproxy::start(dir.path(), "one", None);
    let two = Tinyproxy::start(dir.path(), "two", None);
    let gw = Config::new()
        .egress(Egress::default().connect_ports(&[port, closed]))
        .route(
            Route::new("out")
                .hosts(&["localhost"])
                .proxy_member(one.url())
                .proxy_member(two.url())
                .passive(support::Passive::cooldown("10m"))
                .retries(1),
        )
        .start();
    for _ in 0..3 {
        let (_c, r) = connect(&gw, &format!("localhost:{closed}")).await;
        assert_eq!(r.status, 502, "{}", gw.logs());
        assert_eq!(r.header("x-sluice-error"), Some("proxy_refused"));
    }
    assert!(one.wait_requests("CONNECT ", 1).await >= 1);
    assert!(two.wait_requests("CONNECT ", 1).await >= 1);
    assert_eq!(
        curl_https_via(&gw, dir.path(), "localhost", port).await,
        "200",
        "{}",
        gw.logs()
    );
    let status = gw.status().await;
    for m in status["routes"][0]["members"].as_array().unwrap() {
        assert_eq!(m["healthy"], true, "{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_lets_an_open_tunnel_work_until_it_closes() {
    let backends = start_backends(&["b"]).await;
    let target = backends[0].local_addr().to_string();
    let mut gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[backends[0].local_addr().port()]))
        .route(Route::new("t").hosts(&["127.0.0.1"]).direct_member())
        .start();
    let (mut tunnel, r) = connect(&gw, &target).await;
    assert_eq!(r.status, 200);
    let r = tunnel
        .request("GET", &target, "/before", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200);

    gw.sigterm();
    assert!(gw.wait_for_log("stopping", WAIT).await);
    // Draining: the tunnel still carries requests, and the gateway waits for it.
    let r = tunnel
        .request("GET", &target, "/during", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["target"], "/during");
    assert!(gw.is_running());

    drop(tunnel);
    let status = gw.wait_exit_async(WAIT).await.expect("the gateway exits");
    assert!(status.success(), "{status:?}");
    let lines = tunnel_lines(&gw);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert_eq!(lines[0]["status"], 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_through_a_direct_member_reaches_the_clients_target() {
    let backends = start_backends(&["a", "b"]).await;
    let gw = Config::new()
        .egress(Egress::loopback_allowed())
        .route(Route::new("d").hosts(&["127.0.0.1"]).direct_member())
        .start();
    // The client names the destination; the direct member goes where it says.
    for b in &backends {
        let addr = b.local_addr();
        let (ok, out, err) = curl(
            vec![
                "-x".into(),
                format!("http://{}", gw.proxy_addr()),
                format!("http://{addr}/x?y=1"),
            ],
            vec![],
        )
        .await;
        assert!(ok, "{err}");
        let json: serde_json::Value = serde_json::from_str(&out).expect(&out);
        assert_eq!(json["target"], "/x?y=1");
        assert_eq!(json["headers"]["host"], addr.to_string());
    }
    assert_eq!(backends[0].requests(), 1);
    assert_eq!(backends[1].requests(), 1);
    // A target nobody listens on is the target's failure: the member stays healthy.
    let dead = support::dead_url().replace("http://", "");
    let (_, out, _) = curl(
        vec![
            "-o".into(),
            "/dev/null".into(),
            "-w".into(),
            "%{http_code}".into(),
            "-x".into(),
            format!("http://{}", gw.proxy_addr()),
            format!("http://{dead}/"),
        ],
        vec![],
    )
    .await;
    assert_eq!(out, "502");
    let status = gw.status().await;
    assert_eq!(
        status["routes"][0]["members"][0]["healthy"], true,
        "{status}"
    );
    let addr = backends[0].local_addr();
    let (ok, _, err) = curl(
        vec![
            "-x".into(),
            format!("http://{}", gw.proxy_addr()),
            format!("http://{addr}/"),
        ],
        vec![],
    )
    .await;
    assert!(ok, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_with_no_bytes_for_read_timeout_is_closed() {
    let backends = start_backends(&["b"]).await;
    let target = backends[0].local_addr().to_string();
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[backends[0].local_addr().port()]))
        .route(
            // Long enough that the request below, sent right after the tunnel opens, never
            // finds it closed on a loaded machine.
            Route::new("idle")
                .hosts(&["127.0.0.1"])
                .direct_member()
                .read_timeout("3s"),
        )
        .start();
    let (mut tunnel, r) = connect(&gw, &target).await;
    assert_eq!(r.status, 200);
    let r = tunnel.request("GET", &target, "/", &[], b"").await.unwrap();
    assert_eq!(r.status, 200);
    // Then silence both ways: sluice closes the tunnel.
    assert!(tunnel.wait_closed(WAIT).await, "the idle tunnel stays open");
    let lines = wait_tunnel_lines(&gw, 1).await;
    assert_eq!(lines[0]["error"], "idle_timeout", "{lines:#?}");
    assert!(lines[0]["bytes_down"].as_u64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_reaches_a_tls_origin_with_https_proxy_set() {
    let dir = TempDir::new("egress-python");
    make_certificates(dir.path());
    let (_origin, port) = tls_origin(dir.path());
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(Route::new("web").hosts(&["localhost"]).direct_member())
        .start();
    // The standard library's client: it reads HTTPS_PROXY and tunnels with CONNECT.
    let script = format!(
        "import ssl, urllib.request\n\
         ctx = ssl.create_default_context(cafile={ca:?})\n\
         with urllib.request.urlopen('https://localhost:{port}/', context=ctx, timeout=20) as r:\n\
         \x20   print(r.status)\n",
        ca = dir.path().join("ca.pem").display().to_string(),
    );
    let proxy = format!("http://{}", gw.proxy_addr());
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-c", &script])
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .env("HTTPS_PROXY", &proxy)
            .env("https_proxy", &proxy)
            .output()
            .expect("python3 must be installed")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "200");
    let lines = wait_tunnel_lines(&gw, 1).await;
    assert_eq!(lines[0]["status"], 200);
    assert_eq!(lines[0]["authority"], format!("localhost:{port}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_sent_right_behind_the_connect_head_go_up_first() {
    let backends = start_backends(&["b"]).await;
    let target = backends[0].local_addr().to_string();
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[backends[0].local_addr().port()]))
        .route(Route::new("eager").hosts(&["127.0.0.1"]).direct_member())
        .start();
    // A client that does not wait for the 200 (as some TLS stacks do with their ClientHello).
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    client
        .write_raw(
            format!(
                "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n\
                 GET /eager HTTP/1.1\r\nHost: {target}\r\nContent-Length: 0\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let r = client.read_response(true).await.unwrap();
    assert_eq!(r.status, 200);
    let r = client.read_response(false).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["target"], "/eager");
}

// ---- The egress guard (SPEC §7): client-chosen destinations that sluice must not reach. ----

/// A TCP listener on 127.0.0.1 that counts the connections it accepts: the proof that a
/// denied destination was not contacted.
async fn counting_listener() -> (u16, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = Arc::new(AtomicU64::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    (port, count)
}

/// `curl -x sluice URL`: for an `https://` URL the status sluice gave the CONNECT
/// (`%{http_connect}`), for an `http://` URL the response's status; and the body.
async fn curl_status_via(gw: &Gateway, url: &str) -> (String, String) {
    let https = url.starts_with("https://");
    let write_out = if https {
        "\n%{http_connect}"
    } else {
        "\n%{http_code}"
    };
    let (_, out, _) = curl(
        vec![
            "-w".into(),
            write_out.into(),
            "-x".into(),
            format!("http://{}", gw.proxy_addr()),
            url.into(),
        ],
        vec![],
    )
    .await;
    let (body, status) = out.rsplit_once('\n').unwrap_or(("", &out));
    (status.to_string(), body.to_string())
}

/// Asserts a raw CONNECT to `authority` gets 403 `destination_denied` whose detail mentions
/// `reason`.
async fn assert_connect_denied(gw: &Gateway, authority: &str, reason: &str) {
    // A refusal has a problem+json body, unlike a 200.
    let (_, r) = support::open_tunnel(gw.proxy_addr(), authority, false).await;
    assert_eq!(r.status, 403, "CONNECT {authority}\n{}", gw.logs());
    assert_eq!(r.header("x-sluice-error"), Some("destination_denied"));
    let body = String::from_utf8_lossy(&r.body);
    assert!(body.contains(reason), "CONNECT {authority}: {body}");
}

/// Access lines whose error is `destination_denied`, for `authority`.
fn denied_lines(gw: &Gateway, authority: &str) -> usize {
    gw.log_json()
        .into_iter()
        .filter(|l| l["target"] == "sluice::access" && l["authority"] == authority)
        .filter(|l| l["error"] == "destination_denied" && l["status"] == 403)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_in_any_form_is_denied_and_never_contacted() {
    let (port, contacted) = counting_listener().await;
    // Default guard (deny: [private]); the listener's port is a CONNECT port, so only the
    // address can refuse it.
    let gw = Config::new()
        .egress(Egress::default().connect_ports(&[port]))
        .route(Route::new("any").hosts(&["*"]).direct_member())
        .start();

    for (authority, reason) in [
        (format!("127.0.0.1:{port}"), "127.0.0.1 is loopback"),
        (
            format!("[::ffff:127.0.0.1]:{port}"),
            "::ffff:127.0.0.1 carries 127.0.0.1",
        ),
        // A name that resolves (/etc/hosts) to a denied address.
        (
            format!("localhost:{port}"),
            "localhost: 127.0.0.1 is loopback",
        ),
    ] {
        // A real client: curl's CONNECT gets 403.
        let (status, _) = curl_status_via(&gw, &format!("https://{authority}/")).await;
        assert_eq!(status, "403", "curl CONNECT {authority}\n{}", gw.logs());
        assert_connect_denied(&gw, &authority, reason).await;
        // Plain HTTP through the same direct member: the same guard, per request.
        let (status, body) = curl_status_via(&gw, &format!("http://{authority}/")).await;
        assert_eq!(status, "403", "curl GET {authority}\n{}", gw.logs());
        assert!(body.contains("destination_denied"), "{body}");
        assert!(body.contains(reason), "{body}");
        assert!(
            support::wait_until(WAIT, || denied_lines(&gw, &authority) >= 3).await,
            "{authority}: {}",
            gw.logs()
        );
    }
    assert_eq!(
        contacted.load(Ordering::SeqCst),
        0,
        "a denied target was contacted"
    );
    // A denial is the client's destination, not the member's failure.
    let status = gw.status().await;
    assert_eq!(
        status["routes"][0]["members"][0]["healthy"], true,
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_and_cgnat_addresses_are_denied() {
    let gw = Config::new()
        .route(Route::new("any").hosts(&["*"]).direct_member())
        .start();
    for (authority, reason) in [
        ("169.254.169.254:443", "169.254.169.254 is link-local"),
        ("100.64.0.1:443", "100.64.0.1 is cgnat"),
    ] {
        let (status, _) = curl_status_via(&gw, &format!("https://{authority}/")).await;
        assert_eq!(status, "403", "curl CONNECT {authority}\n{}", gw.logs());
        assert_connect_denied(&gw, authority, reason).await;
        assert!(
            support::wait_until(WAIT, || denied_lines(&gw, authority) >= 2).await,
            "{authority}: {}",
            gw.logs()
        );
    }
    // Plain HTTP to the metadata service: refused the same way.
    let (status, body) = curl_status_via(&gw, "http://169.254.169.254/latest/meta-data/").await;
    assert_eq!(status, "403", "{body}");
    assert!(body.contains("link-local"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_port_outside_connect_ports_is_denied_before_any_lookup() {
    let (port, contacted) = counting_listener().await;
    // Loopback allowed, so only the port can refuse; connect_ports stays [443].
    let gw = Config::new()
        .egress(Egress::loopback_allowed())
        .route(Route::new("any").hosts(&["*"]).direct_member())
        .start();
    for authority in [format!("127.0.0.1:{port}"), "127.0.0.1:22".to_string()] {
        let (status, _) = curl_status_via(&gw, &format!("https://{authority}/")).await;
        assert_eq!(status, "403", "curl CONNECT {authority}\n{}", gw.logs());
        let port = authority.rsplit(':').next().unwrap();
        assert_connect_denied(&gw, &authority, &format!("port {port} is not in")).await;
    }
    // A name that does not exist is refused for its port before it is looked up: 403, not 502.
    assert_connect_denied(&gw, "nowhere.invalid:25", "port 25 is not in").await;
    // connect_ports is about CONNECT only: plain HTTP to the same address and port goes.
    let (status, _) = curl_status_via(&gw, &format!("http://127.0.0.1:{port}/")).await;
    assert_ne!(status, "403");
    assert_eq!(contacted.load(Ordering::SeqCst), 1);
}

/// The default `connect_ports` is 443 and 80: clients that CONNECT for `http://` and `ws://`
/// targets too (Node's fetch, Python's websockets) are not refused for the port. With the
/// default guard, loopback is what refuses 127.0.0.1:80; nothing listens there and nothing is
/// contacted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_port_80_passes_the_default_connect_ports() {
    let gw = Config::new()
        .route(Route::new("any").hosts(&["*"]).direct_member())
        .start();
    assert_connect_denied(&gw, "127.0.0.1:80", "127.0.0.1 is loopback").await;
    assert_connect_denied(&gw, "127.0.0.1:443", "127.0.0.1 is loopback").await;
    assert_connect_denied(
        &gw,
        "127.0.0.1:22",
        "port 22 is not in egress.connect_ports",
    )
    .await;
}

/// A route that charges by path must see each request, which a tunnel hides: its CONNECT is
/// refused with `405 connect_not_supported`, `Allow` and the reason, before anything is charged
/// or contacted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_that_charges_by_path_refuses_tunnels() {
    let (port, contacted) = counting_listener().await;
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(
            Route::new("paid")
                .hosts(&["*"])
                .direct_member()
                .quota(Quota::window("day", 10, "1d").cost_rule("/v1/search", &["GET"], 5)),
        )
        .start();
    let (mut client, r) = connect(&gw, &format!("127.0.0.1:{port}")).await;
    assert_eq!(r.status, 405, "{}", gw.logs());
    assert_eq!(r.header("x-sluice-error"), Some("connect_not_supported"));
    assert!(r.header("allow").is_some_and(|a| !a.contains("CONNECT")));
    let r = client.read_response(false).await;
    drop((client, r));
    assert_eq!(contacted.load(Ordering::SeqCst), 0);
    // Nothing was charged: the day's 10 units are all left for plain requests.
    let status = gw.status().await;
    assert_eq!(status["routes"][0]["quota"][0]["remaining"], 10, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_destination_still_goes_through() {
    let (port, contacted) = counting_listener().await;
    let gw = Config::new()
        .egress(
            Egress::default()
                .allow_cidrs(&["127.0.0.1/32"])
                .connect_ports(&[port]),
        )
        .route(Route::new("any").hosts(&["*"]).direct_member())
        .start();
    let (mut tunnel, r) = connect(&gw, &format!("127.0.0.1:{port}")).await;
    assert_eq!(r.status, 200, "{}", gw.logs());
    tunnel.write_raw(b"ping").await.unwrap();
    // The kernel completes the connection before the listener's task counts its accept.
    support::wait_until(WAIT, || contacted.load(Ordering::SeqCst) == 1).await;
    assert_eq!(contacted.load(Ordering::SeqCst), 1);
    // Outside the allowed CIDR, loopback is still denied.
    assert_connect_denied(&gw, &format!("127.0.0.2:{port}"), "127.0.0.2 is loopback").await;
    assert_eq!(contacted.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_and_httpx_reach_a_tls_origin_through_sluice() {
    let Some(python) = support::test_python() else {
        return;
    };
    let dir = TempDir::new("egress-requests-httpx");
    make_certificates(dir.path());
    let (_origin, port) = tls_origin(dir.path());
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(Route::new("web").hosts(&["localhost"]).direct_member())
        .start();
    let proxy = format!("http://{}", gw.proxy_addr());
    let ca = dir.path().join("ca.pem").display().to_string();
    let url = format!("https://localhost:{port}/");
    let script = format!(
        "import requests, httpx\n\
         r = requests.get({url:?}, proxies={{'https': {proxy:?}}}, verify={ca:?}, timeout=20)\n\
         print('requests', r.status_code)\n\
         with httpx.Client(proxy={proxy:?}, verify={ca:?}, timeout=20) as c:\n\
         \x20   print('httpx', c.get({url:?}).status_code)\n"
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new(&python)
            .args(["-c", &script])
            // Only the proxies the script names.
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy")
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .output()
            .expect("run SLUICE_TEST_PYTHON")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        gw.logs()
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "requests 200\nhttpx 200"
    );
    let lines = wait_tunnel_lines(&gw, 2).await;
    assert_eq!(lines.len(), 2, "{lines:#?}");
    for l in &lines {
        assert_eq!(l["status"], 200);
        assert_eq!(l["member"], "direct");
        assert_eq!(l["authority"], format!("localhost:{port}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_never_connects_to_its_own_listeners_and_a_reload_rebuilds_the_guard() {
    let (port, contacted) = counting_listener().await;
    let config = Config::new()
        .egress(Egress::loopback_allowed())
        .route(Route::new("any").hosts(&["*"]).direct_member());
    let gw = config.start();
    // Plain HTTP (no connect_ports) to sluice's own admin and proxy listeners, although
    // allow_cidrs covers loopback: a loop is never wanted.
    for own in [gw.admin_addr(), gw.proxy_addr()] {
        let (status, body) = curl_status_via(&gw, &format!("http://{own}/status")).await;
        assert_eq!(status, "403", "{own}: {body}");
        assert!(body.contains("sluice's own listener"), "{body}");
    }
    let (status, _) = curl_status_via(&gw, &format!("http://127.0.0.1:{port}/")).await;
    assert_ne!(status, "403");
    assert_eq!(contacted.load(Ordering::SeqCst), 1);

    // A reload without the loopback exception: the new table's guard denies it.
    let reloaded = Config::new().route(Route::new("any").hosts(&["*"]).direct_member());
    gw.write_config_template(&reloaded.yaml());
    assert!(
        gw.wait_for_log("config reloaded", WAIT).await,
        "{}",
        gw.logs()
    );
    let (status, body) = curl_status_via(&gw, &format!("http://127.0.0.1:{port}/")).await;
    assert_eq!(status, "403", "{body}");
    assert_eq!(contacted.load(Ordering::SeqCst), 1);
}

/// Moves `size` bytes both ways through a tunnel to an echo listener, sent right behind the
/// CONNECT head (so some sit in the gateway's read buffer when the tunnel opens), and checks
/// every byte and the access line's counts.
async fn echo_through_a_tunnel(gw: &Gateway, port: u16, size: usize) {
    let payload: Vec<u8> = (0..size as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let stream = tokio::net::TcpStream::connect(gw.proxy_addr())
        .await
        .unwrap();
    let (mut read, mut write) = stream.into_split();
    let sent = payload.clone();
    let writer = tokio::spawn(async move {
        let head = format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
        let mut first = head.into_bytes();
        first.extend_from_slice(&sent[..sent.len().min(200_000)]);
        write.write_all(&first).await.unwrap();
        for chunk in sent[sent.len().min(200_000)..].chunks(300_000) {
            write.write_all(chunk).await.unwrap();
        }
        // End of the upload: the echo listener then closes, and so does the tunnel.
        write.shutdown().await.unwrap();
    });
    let mut got = Vec::with_capacity(size + 1024);
    let mut chunk = vec![0u8; 256 * 1024];
    let reading = async {
        loop {
            let n = read.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(60), reading)
        .await
        .expect("the tunnel carried everything and closed");
    writer.await.unwrap();
    let end = got
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head")
        + 4;
    assert!(got.starts_with(b"HTTP/1.1 200"), "{:?}", &got[..end]);
    assert!(got[end..] == payload[..], "the bytes came back changed");
    let line = wait_tunnel_lines(gw, 1).await.pop().unwrap();
    assert_eq!(line["bytes_up"], size as u64, "{line}");
    assert_eq!(line["bytes_down"], size as u64, "{line}");
}

/// A plain-TCP tunnel moves its bytes with splice(2) on Linux; `SLUICE_TUNNEL_SPLICE=0` uses the
/// copy loop. Both carry every byte, in order, both ways, bytes that arrived with the head
/// included, and count them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_carries_every_byte_both_ways_with_splice_and_with_the_copy_loop() {
    let (port, _) = counting_listener().await;
    let config = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(Route::new("bulk").hosts(&["127.0.0.1"]).direct_member());
    let gw = config.start();
    echo_through_a_tunnel(&gw, port, 8 << 20).await;
    let gw = config.start_with_env(&[("SLUICE_TUNNEL_SPLICE", "0")]);
    echo_through_a_tunnel(&gw, port, 8 << 20).await;
}

/// A CONNECT to `127.0.0.1:port` (an echo listener) through `gw`, answered 200, that has
/// carried `ping` both ways; the client side of the open tunnel.
async fn open_echo_tunnel(gw: &Gateway, port: u16) -> HttpClient {
    let (mut client, r) = connect(gw, &format!("127.0.0.1:{port}")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    echo_ping(&mut client).await;
    client
}

/// Sends `ping` down an open echo tunnel and reads it back.
async fn echo_ping(client: &mut HttpClient) {
    client.write_raw(b"ping").await.unwrap();
    assert_eq!(client.read_raw(4).await.unwrap(), b"ping");
}

/// A new client of `gw` is refused at the connection cap: `503 too_many_connections`, closed.
async fn refused_at_the_cap(gw: &Gateway) {
    let mut over = tokio::net::TcpStream::connect(gw.proxy_addr())
        .await
        .unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(WAIT, over.read_to_end(&mut got))
        .await
        .expect("the connection over the cap is closed")
        .unwrap();
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 503 "), "{got:?}");
    assert!(got.contains("too_many_connections"), "{got:?}");
}

/// A plain tunnel moved by splice(2) holds five descriptors more than the two the connection
/// cap counts a connection for (a duplicate of the client socket and a pipe each way), so it
/// takes three more slots of `limits.max_connections` while it lasts, and a tunnel that finds
/// fewer free is copied instead: the gateway's descriptors stay within what the cap was sized
/// for, where tunnels a client held open would otherwise use up the open-file limit at two
/// sevenths of the cap. With a cap of 5, a spliced tunnel (4 slots) and a copied one (1) fill
/// it: both carry bytes, the next client is refused, and the spliced tunnel's slots come back
/// when it ends. A tunnel that is copied holds one slot, whatever the cap has free.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spliced_tunnel_takes_connection_slots_for_its_extra_descriptors() {
    let (port, _) = counting_listener().await;
    let config = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(Route::new("bulk").hosts(&["127.0.0.1"]).direct_member());
    let gw =
        Gateway::start_with_ports(&format!("{}limits:\n  max_connections: 5\n", config.yaml()));
    let spliced = open_echo_tunnel(&gw, port).await;
    let mut copied = open_echo_tunnel(&gw, port).await;
    refused_at_the_cap(&gw).await;
    echo_ping(&mut copied).await;

    // The spliced tunnel ends with its client: its four slots come back, enough for another
    // spliced tunnel.
    drop(spliced);
    let target = format!("127.0.0.1:{port}");
    let freed = support::wait_until_async(WAIT, || async {
        connect(&gw, &target).await.1.status == 200
    })
    .await;
    assert!(freed, "the ended tunnel did not give its slots back");
    echo_ping(&mut copied).await;

    // Tunnels that are copied (here because splicing is switched off; a TLS listener's are
    // too) take no extra slot: five fill a cap of 5, and the sixth client is refused.
    let gw = Gateway::start_with_ports_and_env(
        &format!("{}limits:\n  max_connections: 5\n", config.yaml()),
        &[("SLUICE_TUNNEL_SPLICE", "0")],
    );
    let mut tunnels = Vec::new();
    for _ in 0..5 {
        tunnels.push(open_echo_tunnel(&gw, port).await);
    }
    refused_at_the_cap(&gw).await;
    for t in &mut tunnels {
        echo_ping(t).await;
    }
}
