//! The client's address behind load balancers (`clients.trusted_proxies`), and the bound on
//! failed identifications keyed by it (`clients.failed_auth`), through the real `sluice`
//! binary. The "load balancer" is the test itself on 127.0.0.1, writing a PROXY v1 or v2
//! header (made with the `ppp` crate, or by curl's `--haproxy-protocol`) and then HTTP, a
//! CONNECT or a TLS handshake; the addresses it names are only bytes, so every connection stays
//! on loopback. A client known by address alone (`office`, 203.0.113.0/24) shows which address
//! sluice took.

mod support;

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use support::tls::make_certificates;
use support::{start_backends, url, Gateway, HttpClient, Response, TempDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN: &str = "billing-token-0123456789";

/// The gateway: route `api` (host api.test, an echo member) and route `direct` (host
/// 127.0.0.1, the client's own target, for CONNECT), `clients` with `trusted_proxies` and a
/// small `failed_auth`: `office` by address, `billing` by token. `listen_tls` is the listener's
/// `tls:` block, if any.
fn start(member: SocketAddr, trusted: &[&str], listen_tls: &str) -> Gateway {
    let trusted = trusted
        .iter()
        .map(|t| format!("\"{t}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let port = member.port();
    Gateway::start_with_ports(&format!(
        r#"listen:
  - addr: "{{PROXY}}"
    {listen_tls}
admin: {{ listen: "{{ADMIN}}" }}
threads: 1
egress: {{ deny: [], connect_ports: [{port}] }}
routes:
  - name: api
    match: {{ hosts: [api.test] }}
    upstream: {{ members: [{{ url: "{member}" }}] }}
  - name: direct
    match: {{ hosts: ["127.0.0.1"] }}
    upstream: {{ members: [{{ direct: true }}] }}
clients:
  trusted_proxies: [{trusted}]
  failed_auth: {{ limit: 3, window: 1m, cooldown: 5m }}
  list:
    - name: office
      cidrs: ["203.0.113.0/24"]
      routes: [api, direct]
      destinations: ["127.0.0.1:{port}"]
    - name: billing
      tokens: ["{TOKEN}"]
      routes: [api]
"#,
        member = url(member),
    ))
}

/// A PROXY v1 header from `client` (to the gateway's port 8080).
fn v1(client: &str) -> Vec<u8> {
    let client: SocketAddr = client.parse().unwrap();
    let (family, dst) = if client.is_ipv4() {
        ("TCP4", "10.9.0.1")
    } else {
        ("TCP6", "2001:db8:9::1")
    };
    format!(
        "PROXY {family} {} {dst} {} 8080\r\n",
        client.ip(),
        client.port()
    )
    .into_bytes()
}

/// A PROXY v2 header from `client`.
fn v2(client: &str) -> Vec<u8> {
    let client: SocketAddr = client.parse().unwrap();
    let dst: SocketAddr = if client.is_ipv4() {
        "10.9.0.1:8080".parse().unwrap()
    } else {
        "[2001:db8:9::1]:8080".parse().unwrap()
    };
    ppp::v2::Builder::with_addresses(
        ppp::v2::Version::Two | ppp::v2::Command::Proxy,
        ppp::v2::Protocol::Stream,
        (client, dst),
    )
    .build()
    .unwrap()
}

/// A PROXY v2 `LOCAL` header, as a load balancer's own health check sends.
fn v2_local() -> Vec<u8> {
    ppp::v2::Builder::with_addresses(
        ppp::v2::Version::Two | ppp::v2::Command::Local,
        ppp::v2::Protocol::Unspecified,
        ppp::v2::Addresses::Unspecified,
    )
    .build()
    .unwrap()
}

/// `GET http://api.test/` in proxy form, with `headers`.
fn get(headers: &[(&str, &str)]) -> String {
    let mut head = "GET http://api.test/ HTTP/1.1\r\nHost: api.test\r\n".to_string();
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head + "\r\n"
}

/// A new connection to `gw` that opens with `preface` (a PROXY header, or nothing), then
/// sends `request`: sluice's answer, on the connection (for more requests), or the error when
/// sluice closed it.
async fn exchange(
    gw: &Gateway,
    preface: &[u8],
    request: &str,
) -> std::io::Result<(HttpClient, Response)> {
    let mut client = HttpClient::connect(gw.proxy_addr()).await?;
    client
        .write_raw(&[preface, request.as_bytes()].concat())
        .await?;
    let r = client.read_response(request.starts_with("CONNECT")).await?;
    Ok((client, r))
}

async fn status(gw: &Gateway, preface: &[u8], request: &str) -> u16 {
    exchange(gw, preface, request).await.unwrap().1.status
}

fn code(r: &Response) -> Option<&str> {
    r.header("x-sluice-error")
}

/// The access lines so far.
fn access_lines(gw: &Gateway) -> Vec<serde_json::Value> {
    gw.log_json()
        .into_iter()
        .filter(|l| l["target"] == "sluice::access")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_proxys_proxy_header_names_the_client_for_the_whole_connection() {
    let backends = start_backends(&["a"]).await;
    let gw = start(backends[0].local_addr(), &["127.0.0.1/32"], "");

    // Without a header, the connection's own address (127.0.0.1) is nobody's.
    let (_, r) = exchange(&gw, b"", &get(&[])).await.unwrap();
    assert_eq!((r.status, code(&r)), (407, Some("proxy_auth_required")));

    // v1 and v2 name an office address: identified by it, on every request of the connection.
    let (mut conn, r) = exchange(&gw, &v1("203.0.113.9:40000"), &get(&[]))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", gw.logs());
    let again = conn.send(&get(&[]), b"").await.unwrap();
    assert_eq!(again.status, 200, "the header holds for the connection");
    assert_eq!(status(&gw, &v2("203.0.113.10:1234"), &get(&[])).await, 200);
    assert_eq!(status(&gw, &v2("[2001:db8::7]:1"), &get(&[])).await, 407);

    // A header that names no client (a balancer's health check) leaves the connection's.
    assert_eq!(status(&gw, &v2_local(), &get(&[])).await, 407);

    // The access line's `client` is the address the header named.
    assert!(
        support::wait_until(Duration::from_secs(20), || access_lines(&gw)
            .iter()
            .any(|l| l["client"] == "203.0.113.9:40000"))
        .await,
        "{}",
        gw.logs()
    );
    let line = access_lines(&gw)
        .into_iter()
        .find(|l| l["client"] == "203.0.113.9:40000")
        .unwrap();
    assert_eq!(line["client_name"], "office", "{line}");

    // A header that does not parse closes the connection, with no answer.
    let garbage = b"PROXY TCP4 203.0.113.9 nonsense 1 2\r\n";
    assert!(exchange(&gw, garbage, &get(&[])).await.is_err());
    let closed = gw
        .metric(
            "sluice_connections_closed_total",
            &[("reason", "proxy_header")],
        )
        .await;
    assert_eq!(closed, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curls_proxy_protocol_header_is_read() {
    let backends = start_backends(&["a"]).await;
    let gw = start(backends[0].local_addr(), &["127.0.0.1/32"], "");
    // curl through the gateway with a PROXY header first; the status it got.
    let curl = |proxy: String| {
        let out = Command::new("curl")
            .env_remove("http_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("all_proxy")
            .env_remove("ALL_PROXY")
            .args([
                "-sS",
                "--max-time",
                "20",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
            ])
            .arg("--haproxy-protocol")
            .arg("-x")
            .arg(proxy)
            .arg("http://api.test/")
            .output()
            .expect("curl must be installed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // curl names its own address, 127.0.0.1, which is nobody's: a 407, not a 400 for a
    // request that starts with "PROXY".
    let status = curl(format!("http://{}", gw.proxy_addr()));
    assert_eq!(status, "407", "{}", gw.logs());
    let status = curl(format!("http://billing:{TOKEN}@{}", gw.proxy_addr()));
    assert_eq!(status, "200", "{}", gw.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_peers_proxy_header_and_forwarded_for_count_for_nothing() {
    let backends = start_backends(&["a"]).await;
    let gw = start(backends[0].local_addr(), &["10.9.0.0/24"], "");
    // From 127.0.0.1, not trusted: a PROXY header is the start of a bad request.
    assert_eq!(status(&gw, &v1("203.0.113.9:40000"), &get(&[])).await, 400);
    // And X-Forwarded-For is only a header.
    let r = exchange(&gw, b"", &get(&[("X-Forwarded-For", "203.0.113.9")]))
        .await
        .unwrap()
        .1;
    assert_eq!((r.status, code(&r)), (407, Some("proxy_auth_required")));
    assert_eq!(backends[0].requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_proxys_forwarded_for_names_its_last_untrusted_hop() {
    let backends = start_backends(&["a"]).await;
    let gw = start(
        backends[0].local_addr(),
        &["127.0.0.1/32", "10.9.0.0/24"],
        "",
    );
    let xff = |v: &'static str| get(&[("X-Forwarded-For", v)]);
    // The office address, then a trusted balancer that passed it on.
    assert_eq!(status(&gw, b"", &xff("203.0.113.9, 10.9.0.5")).await, 200);
    assert_eq!(status(&gw, b"", &xff("203.0.113.9")).await, 200);
    // The client wrote the office address itself; the balancer appended the real one.
    assert_eq!(
        status(&gw, b"", &xff("203.0.113.9, 198.51.100.7")).await,
        407
    );
    // The access line's `client` is that hop, an address with no port.
    let office = |gw: &Gateway| {
        access_lines(gw)
            .into_iter()
            .filter(|l| l["client_name"] == "office")
            .collect::<Vec<_>>()
    };
    assert!(
        support::wait_until(Duration::from_secs(20), || office(&gw).len() == 2).await,
        "{}",
        gw.logs()
    );
    for line in office(&gw) {
        assert_eq!(line["client"], "203.0.113.9", "{line}");
    }
    // Nothing but trusted hops: the leftmost of them, nobody's.
    assert_eq!(status(&gw, b"", &xff("10.9.0.5")).await, 407);
    // After a PROXY header, the address it named is the peer the hops are walked from.
    assert_eq!(
        status(&gw, &v1("10.9.0.6:1"), &xff("203.0.113.9")).await,
        200
    );
    assert_eq!(
        status(&gw, &v1("198.51.100.7:1"), &xff("203.0.113.9")).await,
        407
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_after_a_proxy_header_is_the_clients() {
    let backends = start_backends(&["a"]).await;
    let member = backends[0].local_addr();
    let gw = start(member, &["127.0.0.1/32"], "");
    let connect = format!("CONNECT {member} HTTP/1.1\r\nHost: {member}\r\n\r\n");
    let (_, r) = exchange(&gw, b"", &connect).await.unwrap();
    assert_eq!(r.status, 407);
    let (mut tunnel, r) = exchange(&gw, &v2("203.0.113.9:40000"), &connect)
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", gw.logs());
    let through = tunnel
        .request("GET", "api.test", "/", &[("Connection", "close")], b"")
        .await
        .unwrap();
    assert_eq!(through.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_tls_listener_the_proxy_header_comes_before_the_handshake() {
    let dir = TempDir::new("sluice-proxy-tls");
    make_certificates(dir.path());
    let backends = start_backends(&["a"]).await;
    let tls = format!(
        "tls: {{ cert: \"{}\", key: \"{}\" }}",
        dir.path().join("server.pem").display(),
        dir.path().join("server.key").display()
    );
    let gw = start(backends[0].local_addr(), &["127.0.0.1/32"], &tls);

    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(dir.path().join("ca.pem")).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let over_tls = |preface: Vec<u8>| {
        let connector = connector.clone();
        let addr = gw.proxy_addr();
        async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            tcp.write_all(&preface).await.unwrap();
            let name = ServerName::try_from("localhost").unwrap();
            let mut tls = connector.connect(name, tcp).await.unwrap();
            tls.write_all(get(&[("Connection", "close")]).as_bytes())
                .await
                .unwrap();
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(support::IO_TIMEOUT, tls.read_to_end(&mut answer)).await;
            String::from_utf8_lossy(&answer).into_owned()
        }
    };
    let answer = over_tls(v2("203.0.113.9:40000")).await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "{answer}\n{}",
        gw.logs()
    );
    let answer = over_tls(Vec::new()).await;
    assert!(answer.starts_with("HTTP/1.1 407"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_identifications_throttle_their_address_and_no_other() {
    let backends = start_backends(&["a"]).await;
    let member = backends[0].local_addr();
    let gw = start(member, &["127.0.0.1/32"], "");
    let bad = get(&[("Proxy-Authorization", "Bearer not-a-token-0123456789")]);
    let good = get(&[("Proxy-Authorization", &format!("Bearer {TOKEN}"))]);

    // Three failures (the limit) from one address are answered as failures...
    let attacker = v1("198.51.100.1:5000");
    for _ in 0..3 {
        let (_, r) = exchange(&gw, &attacker, &bad).await.unwrap();
        assert_eq!((r.status, code(&r)), (407, Some("proxy_auth_required")));
    }
    // ...then the address is refused before its credentials are tried, even a good one.
    for request in [&bad, &good] {
        let (_, r) = exchange(&gw, &attacker, request).await.unwrap();
        assert_eq!(
            (r.status, code(&r)),
            (429, Some("auth_throttled")),
            "{}",
            r.text()
        );
        let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!((1..=300).contains(&retry), "Retry-After {retry}");
    }
    // A CONNECT from it too.
    let connect = format!("CONNECT {member} HTTP/1.1\r\nHost: {member}\r\n\r\n");
    let (_, r) = exchange(&gw, &attacker, &connect).await.unwrap();
    assert_eq!(r.status, 429);
    // Another address still identifies.
    assert_eq!(status(&gw, &v1("198.51.100.2:5000"), &good).await, 200);
    assert_eq!(
        gw.metric(
            "sluice_client_auth_failures_total",
            &[("reason", "bad_token")]
        )
        .await,
        Some(3.0)
    );

    // IPv6 counts per /64: one host's addresses are one source.
    for host in ["[2001:db8::1]:1", "[2001:db8::2]:1", "[2001:db8::3]:1"] {
        assert_eq!(status(&gw, &v2(host), &bad).await, 407);
    }
    assert_eq!(status(&gw, &v2("[2001:db8::ffff]:1"), &good).await, 429);
    assert_eq!(status(&gw, &v2("[2001:db8:0:1::1]:1"), &good).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_frees_no_throttled_address() {
    let backends = start_backends(&["a"]).await;
    let gw = start(backends[0].local_addr(), &["127.0.0.1/32"], "");
    let bad = get(&[("Proxy-Authorization", "Bearer not-a-token-0123456789")]);
    let attacker = v1("198.51.100.1:5000");
    for _ in 0..3 {
        assert_eq!(status(&gw, &attacker, &bad).await, 407);
    }
    assert_eq!(status(&gw, &attacker, &bad).await, 429);
    let config = std::fs::read_to_string(gw.config_path()).unwrap();
    gw.write_config(&config.replace("limit: 3", "limit: 4"));
    let reloaded = gw.post_reload().await;
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
    assert_eq!(status(&gw, &attacker, &bad).await, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_ip_quota_counts_the_forwarded_client_not_the_balancer() {
    let backends = start_backends(&["a"]).await;
    let gw = Gateway::start_with_ports(&format!(
        r#"listen: ["{{PROXY}}"]
admin: {{ listen: "{{ADMIN}}" }}
threads: 1
routes:
  - name: api
    match: {{ hosts: [api.test] }}
    quota: {{ key: client_ip, windows: [{{ name: once, limit: 1, window: 1h }}] }}
    upstream: {{ members: [{{ url: "{member}" }}] }}
clients:
  trusted_proxies: ["127.0.0.1/32"]
  list:
    - {{ name: office, cidrs: ["203.0.113.0/24"], routes: [api] }}
"#,
        member = url(backends[0].local_addr()),
    ));
    let xff = |v: &'static str| get(&[("X-Forwarded-For", v)]);
    // Every request comes from the balancer (127.0.0.1); each office address has its own
    // window, as it would if it connected itself.
    assert_eq!(status(&gw, b"", &xff("203.0.113.9")).await, 200);
    assert_eq!(status(&gw, b"", &xff("203.0.113.9")).await, 429);
    assert_eq!(status(&gw, b"", &xff("203.0.113.10")).await, 200);
}
