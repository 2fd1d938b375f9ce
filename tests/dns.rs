//! SPEC §7: member host names follow their DNS TTL. A DNS stub on loopback answers for the
//! member's name; when its answer changes, traffic moves to the new address without a reload.

mod support;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_echo::EchoServer;
use support::{get, wait_until_async, Config, Egress, HealthCheck, HttpClient, Route};

const WAIT: Duration = Duration::from_secs(20);

/// A DNS server on loopback UDP that answers A queries for one name with its addresses, in
/// order (TTL 1 s), AAAA queries for it with no records, and NXDOMAIN for any other name, or
/// for that one too once its addresses are taken away.
struct Stub {
    addr: SocketAddr,
    addresses: Arc<Mutex<Vec<Ipv4Addr>>>,
}

impl Stub {
    async fn start(name: &'static str, address: Ipv4Addr) -> Stub {
        Stub::start_with(name, vec![address]).await
    }

    async fn start_with(name: &'static str, addresses: Vec<Ipv4Addr>) -> Stub {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let current = Arc::new(Mutex::new(addresses));
        let answer_with = current.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                let addresses = answer_with.lock().unwrap().clone();
                if let Some(out) = answer(&buf[..n], name, &addresses) {
                    let _ = socket.send_to(&out, from).await;
                }
            }
        });
        Stub {
            addr,
            addresses: current,
        }
    }

    /// From now on, answer with `address`; with `None`, NXDOMAIN.
    fn set(&self, address: Option<Ipv4Addr>) {
        *self.addresses.lock().unwrap() = address.into_iter().collect();
    }
}

/// The answer to one query: the header and question copied, then the A records, in order.
fn answer(query: &[u8], name: &str, addresses: &[Ipv4Addr]) -> Option<Vec<u8>> {
    let mut at = 12;
    let mut labels = Vec::new();
    while *query.get(at)? != 0 {
        let len = usize::from(query[at]);
        labels.push(String::from_utf8_lossy(query.get(at + 1..at + 1 + len)?).to_lowercase());
        at += 1 + len;
    }
    let question_end = at + 5;
    let qtype = u16::from_be_bytes([*query.get(at + 1)?, *query.get(at + 2)?]);
    let addresses = if labels.join(".") == name {
        addresses
    } else {
        &[]
    };
    let known = !addresses.is_empty();
    let mut out = query.get(..question_end)?.to_vec();
    out[2] = 0x84 | (query[2] & 0x01); // a response, authoritative, RD copied
    out[3] = if known { 0x80 } else { 0x83 }; // RA; no error or NXDOMAIN
    out[6..12].copy_from_slice(&[0; 6]);
    if qtype == 1 {
        out[7] = addresses.len() as u8;
        for address in addresses {
            out.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]);
            out.extend_from_slice(&1u32.to_be_bytes()); // TTL 1 s
            out.extend_from_slice(&[0, 4]);
            out.extend_from_slice(&address.octets());
        }
    }
    Some(out)
}

/// Echo backends named `first` on 127.0.0.1:P and `second` on 127.0.0.2:P, for one port P.
async fn backends_on_one_port() -> (EchoServer, EchoServer, u16) {
    for _ in 0..20 {
        let first = EchoServer::start("first", SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let port = first.local_addr().port();
        match EchoServer::start("second", SocketAddr::from(([127, 0, 0, 2], port))).await {
            Ok(second) => return (first, second, port),
            Err(_) => first.stop().await,
        }
    }
    panic!("no port free on both 127.0.0.1 and 127.0.0.2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_follows_its_name_to_a_new_address_without_a_reload() {
    let (_first, _second, port) = backends_on_one_port().await;
    let stub = Stub::start("api.test", Ipv4Addr::new(127, 0, 0, 1)).await;
    let gw = Config::new()
        .route(Route::new("api").member(format!("http://api.test:{port}")))
        .start_with_env(&[("SLUICE_DNS_SERVERS", &stub.addr.to_string())]);

    let upstream = |gw: &support::Gateway| {
        let addr = gw.proxy_addr();
        async move {
            get(addr, "api.test", "/")
                .await
                .header("x-upstream")
                .map(str::to_string)
        }
    };
    assert_eq!(
        upstream(&gw).await.as_deref(),
        Some("first"),
        "{}",
        gw.logs()
    );

    stub.set(Some(Ipv4Addr::new(127, 0, 0, 2)));
    let moved = wait_until_async(WAIT, || async {
        upstream(&gw).await.as_deref() == Some("second")
    })
    .await;
    assert!(moved, "traffic never moved to 127.0.0.2: {}", gw.logs());
    // And it stays there.
    for _ in 0..5 {
        assert_eq!(upstream(&gw).await.as_deref(), Some("second"));
    }
    let logs = gw.logs();
    assert!(
        logs.contains("member address changed") && logs.contains("127.0.0.2"),
        "the change is logged: {logs}"
    );
    // The old answer is gone from the gateway; a reload never happened.
    assert!(!logs.contains("config reloaded"), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_stops_resolving_keeps_its_last_address() {
    let (_first, _second, port) = backends_on_one_port().await;
    let stub = Stub::start("api.test", Ipv4Addr::new(127, 0, 0, 1)).await;
    let gw = Config::new()
        .route(Route::new("api").member(format!("http://api.test:{port}")))
        .start_with_env(&[("SLUICE_DNS_SERVERS", &stub.addr.to_string())]);
    let addr = gw.proxy_addr();
    assert_eq!(
        get(addr, "api.test", "/").await.header("x-upstream"),
        Some("first")
    );
    stub.set(None);
    assert!(
        gw.wait_for_log("does not resolve; keeping its last address", WAIT)
            .await,
        "{}",
        gw.logs()
    );
    assert_eq!(
        get(addr, "api.test", "/").await.header("x-upstream"),
        Some("first")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_health_check_follows_its_new_address() {
    let (first, second, port) = backends_on_one_port().await;
    // Only the first address is healthy: once the member moves, its check must say so.
    second.set_healthy(false);
    let stub = Stub::start("api.test", Ipv4Addr::new(127, 0, 0, 1)).await;
    let member = format!("http://api.test:{port}");
    let gw = Config::new()
        .route(
            Route::new("api")
                .member(member.clone())
                .health_check(HealthCheck::fast_http("100ms", 1, 1)),
        )
        .start_with_env(&[("SLUICE_DNS_SERVERS", &stub.addr.to_string())]);
    let healthy = || async {
        gw.metric("sluice_member_healthy", &[("member", &member)])
            .await
    };
    assert!(
        wait_until_async(WAIT, || async { first.requests() > 0 }).await,
        "the check never reached 127.0.0.1: {}",
        gw.logs()
    );
    assert_eq!(healthy().await, Some(1.0), "{}", gw.logs());

    stub.set(Some(Ipv4Addr::new(127, 0, 0, 2)));
    assert!(
        wait_until_async(WAIT, || async { healthy().await == Some(0.0) }).await,
        "the check did not follow the member to 127.0.0.2: {}",
        gw.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_a_members_address_and_it_goes_on_following_dns() {
    let (_first, _second, port) = backends_on_one_port().await;
    let stub = Stub::start("api.test", Ipv4Addr::new(127, 0, 0, 1)).await;
    let member = format!("http://api.test:{port}");
    let gw = Config::new()
        .route(Route::new("api").member(member.clone()))
        .start_with_env(&[("SLUICE_DNS_SERVERS", &stub.addr.to_string())]);
    let addr = gw.proxy_addr();
    let upstream = || async {
        get(addr, "api.test", "/")
            .await
            .header("x-upstream")
            .map(str::to_string)
    };
    stub.set(Some(Ipv4Addr::new(127, 0, 0, 2)));
    assert!(
        wait_until_async(WAIT, || async {
            upstream().await.as_deref() == Some("second")
        })
        .await,
        "{}",
        gw.logs()
    );

    // The route's upstream changes (retries), its member does not: the member keeps its
    // address. The name does not resolve at all meanwhile, so a member resolved again by the
    // reload would have no address.
    stub.set(None);
    assert!(
        gw.wait_for_log("does not resolve; keeping its last address", WAIT)
            .await,
        "{}",
        gw.logs()
    );
    gw.write_config_template(
        &Config::new()
            .route(Route::new("api").member(member.clone()).retries(1))
            .yaml(),
    );
    gw.signal("HUP");
    assert!(
        gw.wait_for_log("config reloaded", WAIT).await,
        "{}",
        gw.logs()
    );
    assert_eq!(upstream().await.as_deref(), Some("second"), "{}", gw.logs());

    // And the refresher follows the member in the new table.
    stub.set(Some(Ipv4Addr::new(127, 0, 0, 1)));
    assert!(
        wait_until_async(WAIT, || async {
            upstream().await.as_deref() == Some("first")
        })
        .await,
        "{}",
        gw.logs()
    );
}

/// An echo backend on 127.0.0.1:P, and nothing on 127.0.0.2:P (a connect there is refused).
async fn backend_with_a_dead_twin() -> (EchoServer, u16) {
    for _ in 0..20 {
        let live = EchoServer::start("live", SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let port = live.local_addr().port();
        if std::net::TcpStream::connect(SocketAddr::from(([127, 0, 0, 2], port))).is_err() {
            return (live, port);
        }
        live.stop().await;
    }
    panic!("no port on 127.0.0.1 whose twin on 127.0.0.2 is free");
}

/// A client-chosen destination whose name resolves to a dead address first and a live one
/// second: a `direct` member connects to the second, checked address after the first refuses,
/// with no second lookup and no harm to the member's health; a CONNECT tunnel does the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_destination_falls_back_to_its_next_checked_address() {
    let (live, port) = backend_with_a_dead_twin().await;
    let stub = Stub::start_with(
        "two.test",
        vec![Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 1)],
    )
    .await;
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(Route::new("d").hosts(&["two.test"]).direct_member())
        .start_with_env(&[("SLUICE_DNS_SERVERS", &stub.addr.to_string())]);
    let authority = format!("two.test:{port}");

    // Plain HTTP, absolute form: one attempt of the member, two connects.
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let r = client
        .send(
            &format!("GET http://{authority}/a HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
            b"",
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", gw.logs());
    assert_eq!(r.header("x-upstream"), Some("live"));
    assert_eq!(live.requests(), 1);
    let failures = gw
        .metric(
            "sluice_upstream_attempts_total",
            &[("route", "d"), ("outcome", "connect_failure")],
        )
        .await;
    // The dead address came first, as the stub answers, and was tried first.
    assert_eq!(failures, Some(1.0), "{}", gw.metrics().await);
    let status = gw.status().await;
    assert_eq!(
        status["routes"][0]["members"][0]["healthy"], true,
        "{status}"
    );
    // Access lines are written in batches: wait for this one.
    let find = || {
        gw.log_json()
            .into_iter()
            .find(|l| l["target"] == "sluice::access" && l["method"] == "GET")
    };
    support::wait_until(Duration::from_secs(20), || find().is_some()).await;
    let access = find().expect("an access line");
    assert_eq!(access["status"], 200, "{access}");

    // A CONNECT tunnel to the same name.
    let (mut tunnel, r) = support::open_tunnel(gw.proxy_addr(), &authority, true).await;
    assert_eq!(r.status, 200, "{}", gw.logs());
    let r = tunnel
        .send(
            &format!("GET /b HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
            b"",
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", gw.logs());
    assert_eq!(r.header("x-upstream"), Some("live"));
    assert_eq!(live.requests(), 2);
}

/// `dns.servers` in the config, with no environment variable: member names and client-chosen
/// destinations are resolved there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_servers_from_the_config_resolve_members_and_destinations() {
    let (_first, _second, port) = backends_on_one_port().await;
    let stub = Stub::start("api.test", Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = Config::new()
        .dns_servers(&[stub.addr])
        .egress(Egress::loopback_allowed())
        .route(
            Route::new("d")
                .hosts(&["api.test"])
                .path_prefix("/direct")
                .direct_member(),
        )
        .route(Route::new("api").member(format!("http://api.test:{port}")))
        .start();
    assert_eq!(
        get(gw.proxy_addr(), "api.test", "/")
            .await
            .header("x-upstream"),
        Some("second"),
        "{}",
        gw.logs()
    );
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let authority = format!("api.test:{port}");
    let r = client
        .send(
            &format!("GET http://{authority}/direct HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
            b"",
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", gw.logs());
    assert_eq!(r.header("x-upstream"), Some("second"));
}

/// A name that resolves to `0.0.0.0` reaches the host itself, sluice's own ports included: it
/// is refused even with the address checks off, for plain requests and tunnels alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_resolves_to_an_unspecified_address_is_refused() {
    let stub = Stub::start("zero.test", Ipv4Addr::UNSPECIFIED).await;
    let [proxy, admin] = support::free_ports::<2>();
    let yaml = Config::new()
        .dns_servers(&[stub.addr])
        .egress(Egress::default().deny(&[]).connect_ports(&[proxy, admin]))
        .route(Route::new("open").hosts(&["*"]).direct_member())
        .yaml()
        .replace("{PROXY}", &format!("127.0.0.1:{proxy}"))
        .replace("{ADMIN}", &format!("127.0.0.1:{admin}"));
    let gw = support::Gateway::start(&yaml);
    for port in [admin, proxy] {
        let authority = format!("zero.test:{port}");
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        let r = client
            .send(
                &format!("GET http://{authority}/status HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
                b"",
            )
            .await
            .unwrap();
        assert_eq!(r.status, 403, "{}\n{}", r.text(), gw.logs());
        assert!(
            r.text().contains("zero.test: 0.0.0.0 is unspecified"),
            "{}",
            r.text()
        );
        let (_, r) = support::open_tunnel(gw.proxy_addr(), &authority, false).await;
        assert_eq!(r.status, 403, "CONNECT {authority}");
    }
}
