//! TLS listeners (`listen[].tls`): real clients (curl, Python requests) with an `https://` proxy
//! URL, trusting a CA made for each test. Plain requests and CONNECT tunnels run inside the TLS
//! connection to sluice, so nothing the client sends crosses the network in cleartext; a
//! tunnel to a TLS origin is TLS inside TLS.

mod support;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::tls::{make_certificates, tls_origin};
use support::{free_port, start_backends, url, Gateway, TempDir};

/// A gateway with a TLS listener (`{PROXY}`, the harness's proxy address) and a plain one on
/// `plain_port`; route `api` (host api.test) to the origin `echo`, route `web` (host
/// localhost) to the client's own target. The egress guard lets the direct route reach
/// loopback on `origin_port`, where the test origin listens.
fn config(dir: &Path, plain_port: u16, echo: &str, origin_port: u16) -> String {
    config_with_limits(dir, plain_port, echo, origin_port, "{}")
}

/// [`config`], with `limits:` set to `limits` (YAML flow mapping).
fn config_with_limits(
    dir: &Path,
    plain_port: u16,
    echo: &str,
    origin_port: u16,
    limits: &str,
) -> String {
    let dir = dir.display();
    format!(
        r#"listen:
  - addr: "{{PROXY}}"
    tls: {{cert: "{dir}/server.pem", key: "{dir}/server.key"}}
  - "127.0.0.1:{plain_port}"
admin: {{listen: "{{ADMIN}}"}}
threads: 1
limits: {limits}
egress: {{allow_cidrs: ["127.0.0.0/8", "::1/128"], connect_ports: [{origin_port}]}}
routes:
  - name: api
    match: {{hosts: [api.test]}}
    upstream: {{members: [{{url: "{echo}"}}]}}
  - name: web
    match: {{hosts: [localhost]}}
    upstream: {{members: [{{direct: true}}]}}
"#
    )
}

/// curl with `args` and none of the caller's proxy settings: whether it succeeded, its stdout
/// and its stderr.
async fn curl(args: Vec<String>) -> (bool, String, String) {
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
        cmd.args(["-sS", "--max-time", "20"]).args(&args);
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

fn s(v: &str) -> String {
    v.to_string()
}

/// The access-log lines of tunnels.
fn tunnel_lines(gw: &Gateway) -> Vec<serde_json::Value> {
    gw.log_json()
        .into_iter()
        .filter(|l| l["target"] == "sluice::access" && l["method"] == "CONNECT")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_uses_an_https_proxy_url_for_plain_requests_and_tunnels() {
    let dir = TempDir::new("sluice-tls-listen");
    make_certificates(dir.path());
    let backends = start_backends(&["a"]).await;
    let (_origin, origin_port) = tls_origin(dir.path());
    let plain_port = free_port();
    let gw = Gateway::start_with_ports(&config(
        dir.path(),
        plain_port,
        &url(backends[0].local_addr()),
        origin_port,
    ));
    let proxy = format!("https://{}", gw.proxy_addr());
    let ca = dir.path().join("ca.pem").display().to_string();

    // A plain http:// request, sent to sluice inside TLS.
    let (ok, out, err) = curl(vec![
        s("-i"),
        s("--proxy"),
        proxy.clone(),
        s("--proxy-cacert"),
        ca.clone(),
        s("http://api.test/hello"),
    ])
    .await;
    assert!(ok, "{err}\n{}", gw.logs());
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains("x-upstream: a"), "{out}");
    assert_eq!(backends[0].requests(), 1);

    // An https:// URL: curl sends CONNECT inside its TLS connection to sluice, then TLS to the
    // origin inside the tunnel.
    let (ok, out, err) = curl(vec![
        s("-o"),
        s("/dev/null"),
        s("-w"),
        s("%{http_code}"),
        s("--proxy"),
        proxy.clone(),
        s("--proxy-cacert"),
        ca.clone(),
        s("--cacert"),
        ca.clone(),
        format!("https://localhost:{origin_port}/"),
    ])
    .await;
    assert!(ok && out == "200", "{out} {err}\n{}", gw.logs());
    assert!(
        support::wait_until(Duration::from_secs(20), || !tunnel_lines(&gw).is_empty()).await,
        "no tunnel line:\n{}",
        gw.logs()
    );
    let line = &tunnel_lines(&gw)[0];
    assert_eq!(line["route"], "web", "{line}");
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["member"], "direct", "{line}");
    assert_eq!(
        line["authority"],
        format!("localhost:{origin_port}"),
        "{line}"
    );
    assert!(line["bytes_down"].as_u64().unwrap() > 0, "{line}");

    // The plain listener next to it is unchanged.
    let (ok, out, err) = curl(vec![
        s("-o"),
        s("/dev/null"),
        s("-w"),
        s("%{http_code}"),
        s("--proxy"),
        format!("http://127.0.0.1:{plain_port}"),
        s("http://api.test/"),
    ])
    .await;
    assert!(ok && out == "200", "{out} {err}");

    // The TLS listener speaks only TLS: cleartext HTTP to it gets no answer from the route.
    let (_, out, _) = curl(vec![
        s("-o"),
        s("/dev/null"),
        s("-w"),
        s("%{http_code}"),
        s("--proxy"),
        format!("http://{}", gw.proxy_addr()),
        s("http://api.test/"),
    ])
    .await;
    assert_ne!(out, "200");
    // And a client that does not trust the listener's CA refuses it.
    let (ok, _, err) = curl(vec![s("--proxy"), proxy, s("http://api.test/")]).await;
    assert!(!ok, "curl trusted an unknown CA");
    assert!(err.contains("SSL") || err.contains("certificate"), "{err}");
    assert_eq!(backends[0].requests(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_uses_an_https_proxy_url() {
    let dir = TempDir::new("sluice-tls-listen-py");
    make_certificates(dir.path());
    let backends = start_backends(&["a"]).await;
    let (_origin, origin_port) = tls_origin(dir.path());
    let gw = Gateway::start_with_ports(&config(
        dir.path(),
        free_port(),
        &url(backends[0].local_addr()),
        origin_port,
    ));
    // requests on urllib3 2 verifies the proxy with the same `verify` bundle as the origin.
    let script = format!(
        "import requests\n\
         p = {{'http': {proxy:?}, 'https': {proxy:?}}}\n\
         print(requests.get('http://api.test/', proxies=p, verify={ca:?}, timeout=20).status_code)\n\
         print(requests.get('https://localhost:{origin_port}/', proxies=p, verify={ca:?}, timeout=20).status_code)\n",
        proxy = format!("https://{}", gw.proxy_addr()),
        ca = dir.path().join("ca.pem").display().to_string(),
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-c", &script])
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .output()
            .expect("python3 must be installed")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        gw.logs()
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200\n200\n");
    assert_eq!(backends[0].requests(), 1);
}

#[test]
fn check_names_a_missing_key_file() {
    let dir = TempDir::new("sluice-tls-listen-check");
    make_certificates(dir.path());
    let missing = dir.path().join("missing.key");
    let file = dir.path().join("sluice.yaml");
    fs::write(
        &file,
        format!(
            "listen:\n  - addr: \"127.0.0.1:8443\"\n    tls:\n      cert: {}\n      key: {}\nroutes: []\n",
            dir.path().join("server.pem").display(),
            missing.display()
        ),
    )
    .unwrap();
    let out = Command::new(support::sluice_binary())
        .args(["check", "-c"])
        .arg(&file)
        .output()
        .expect("run sluice check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_eq!(
        stderr.trim(),
        format!(
            "{}:5:12: listen[0].tls.key: cannot read {}: No such file or directory (os error 2)",
            file.display(),
            missing.display()
        )
    );

    // With the key there, the same file checks.
    let good = fs::read_to_string(&file)
        .unwrap()
        .replace("missing.key", "server.key");
    fs::write(&file, good).unwrap();
    let out = Command::new(support::sluice_binary())
        .args(["check", "-c"])
        .arg(&file)
        .output()
        .expect("run sluice check");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Reads until the peer closes (true) or `within` passes (false).
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let deadline = tokio::time::Instant::now() + within;
    let mut chunk = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// Connections in their TLS handshake hold a slot of `limits.max_connections`, at most a quarter
/// of them, and a handshake that never ends is cut by the header timeout: raw TCP connections
/// that send nothing cannot pile up on a TLS listener (Pingora alone handshakes outside any cap,
/// for up to 60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_handshakes_count_against_the_connection_cap_and_the_header_timeout() {
    const DEADLINE: Duration = Duration::from_secs(20);
    let dir = TempDir::new("sluice-tls-cap");
    make_certificates(dir.path());
    let backends = start_backends(&["a"]).await;
    let plain_port = free_port();
    let gw = Gateway::start_with_ports(&config_with_limits(
        dir.path(),
        plain_port,
        &url(backends[0].local_addr()),
        free_port(),
        // Long enough that the two silent connections still hold their slots while the test
        // reads the metrics and opens a third, however slow the machine (5 s could pass before
        // the third connection was made), and short of the 20 s the test waits for their cut.
        "{max_connections: 8, header_timeout: 12s}",
    ));
    let open = || async { gw.metric("sluice_connections_open", &[]).await };

    // Two connections that never start their handshake take the handshakes' two slots.
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(
            tokio::net::TcpStream::connect(gw.proxy_addr())
                .await
                .unwrap(),
        );
    }
    assert!(
        support::wait_until_async(DEADLINE, || async { open().await == Some(2.0) }).await,
        "the handshaking connections hold no slot: {:?}\n{}",
        open().await,
        gw.logs()
    );
    // A third is over the handshakes' share: closed at once, with no answer (an answer would
    // need TLS).
    let mut extra = tokio::net::TcpStream::connect(gw.proxy_addr())
        .await
        .unwrap();
    assert!(
        closed_within(&mut extra, DEADLINE).await,
        "a connection over the handshakes' share was kept open"
    );
    assert_eq!(
        gw.metric(
            "sluice_connections_closed_total",
            &[("reason", "max_handshakes")]
        )
        .await,
        Some(1.0)
    );
    // The silent ones are cut by the header timeout, and give their slots back.
    for stream in &mut silent {
        assert!(
            closed_within(stream, DEADLINE).await,
            "a handshake that never came kept its connection"
        );
    }
    assert!(
        support::wait_until_async(DEADLINE, || async { open().await == Some(0.0) }).await,
        "{:?}",
        open().await
    );
    assert_eq!(
        gw.metric(
            "sluice_connections_closed_total",
            &[("reason", "header_timeout")]
        )
        .await,
        Some(2.0)
    );
    // A real client is served through the freed slots.
    let ca = dir.path().join("ca.pem").display().to_string();
    let (ok, out, err) = curl(vec![
        s("-i"),
        s("--proxy"),
        format!("https://{}", gw.proxy_addr()),
        s("--proxy-cacert"),
        ca,
        s("http://api.test/hello"),
    ])
    .await;
    assert!(ok, "{err}\n{}", gw.logs());
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    // The plain listener next to it shares the cap and is served too.
    let (ok, out, err) = curl(vec![
        s("-o"),
        s("/dev/null"),
        s("-w"),
        s("%{http_code}"),
        s("--proxy"),
        format!("http://127.0.0.1:{plain_port}"),
        s("http://api.test/"),
    ])
    .await;
    assert!(ok && out == "200", "{out} {err}");
}

/// Many TLS connections that never send a ClientHello take at most the handshakes' share of
/// `limits.max_connections`: the plain listener next to them still serves its clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_tls_connections_cannot_starve_the_plain_listener() {
    const DEADLINE: Duration = Duration::from_secs(20);
    const SILENT: usize = 40;
    let dir = TempDir::new("sluice-tls-starve");
    make_certificates(dir.path());
    let backends = start_backends(&["a"]).await;
    let plain_port = free_port();
    let gw = Gateway::start_with_ports(&config_with_limits(
        dir.path(),
        plain_port,
        &url(backends[0].local_addr()),
        free_port(),
        "{max_connections: 8}",
    ));
    let mut silent = Vec::new();
    for _ in 0..SILENT {
        silent.push(
            tokio::net::TcpStream::connect(gw.proxy_addr())
                .await
                .unwrap(),
        );
    }
    // Every one of them has been either taken in or closed.
    let seen = || async {
        let metrics = gw.metrics().await;
        let open = support::metric_value(&metrics, "sluice_connections_open", &[]);
        let closed = support::metric_value(&metrics, "sluice_connections_closed_total", &[]);
        open.unwrap_or(0.0) + closed.unwrap_or(0.0)
    };
    assert!(
        support::wait_until_async(DEADLINE, || async { seen().await >= SILENT as f64 }).await,
        "the gateway did not take in the silent connections: {}",
        seen().await
    );
    let plain = std::net::SocketAddr::from(([127, 0, 0, 1], plain_port));
    let r = support::request(plain, "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        gw.metric(
            "sluice_connections_closed_total",
            &[("reason", "max_handshakes")]
        )
        .await
        .is_some_and(|n| n > 0.0),
        "{}",
        gw.metrics().await
    );
    drop(silent);
}
