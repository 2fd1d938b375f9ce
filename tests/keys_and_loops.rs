//! A member's key goes to that member's own origin and nowhere else, whatever the client
//! points at; and sluice never proxies to itself: not to an address it listens on, not to an
//! unspecified address, and not round a loop that only its `Via` name shows (SPEC §3, §7).
//!
//! Every listener here records every byte it receives, so the tests read what reached it,
//! not what sluice says it sent.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use support::{Config, Egress, Gateway, HttpClient, KeyMember, Route, TempDir};

const WAIT: Duration = Duration::from_secs(20);
const KEY: &str = "sk-NEVER-FOLLOWS-THE-CLIENT";

/// A listener on 127.0.0.1 that keeps every byte of every connection and answers each head
/// with a small `200`.
#[derive(Clone)]
struct Recorder {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<u8>>>,
    connections: Arc<Mutex<usize>>,
}

impl Recorder {
    async fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let recorder = Recorder {
            addr: listener.local_addr().unwrap(),
            seen: Arc::default(),
            connections: Arc::default(),
        };
        let r = recorder.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                *r.connections.lock().unwrap() += 1;
                let seen = r.seen.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let mut head = Vec::new();
                    loop {
                        let n = match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        seen.lock().unwrap().extend_from_slice(&buf[..n]);
                        head.extend_from_slice(&buf[..n]);
                        if head.windows(4).any(|w| w == b"\r\n\r\n") {
                            head.clear();
                            let answer = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                            if stream.write_all(answer.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        recorder
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }

    fn connections(&self) -> usize {
        *self.connections.lock().unwrap()
    }
}

/// `sluice check` on a raw YAML file: its exit code and everything it printed.
fn check_yaml(yaml: &str) -> (bool, String) {
    let dir = TempDir::new("sluice-check");
    let file = dir.path().join("sluice.yaml");
    std::fs::write(&file, yaml).unwrap();
    let out = std::process::Command::new(support::sluice_binary())
        .args(["check", "-c"])
        .arg(&file)
        .env("OPENAI_KEY", KEY)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `check` refuses a key on a member whose destination the client chooses: `direct` and
/// `proxy` members, under a wildcard route that takes any host and port. The key never
/// appears in what it prints.
#[test]
fn check_refuses_headers_on_direct_and_proxy_members() {
    for member in [
        "{direct: true, headers: {Authorization: \"Bearer ${OPENAI_KEY}\"}}",
        "{proxy: \"http://127.0.0.1:3128\", headers: {Authorization: \"Bearer ${OPENAI_KEY}\"}}",
    ] {
        let yaml = format!(
            "listen: [\"127.0.0.1:0\"]\nroutes:\n  - name: open\n    match: {{hosts: [\"*\"]}}\n    upstream:\n      members:\n        - {member}\n"
        );
        let (ok, text) = check_yaml(&yaml);
        assert!(!ok, "check accepted {member}: {text}");
        assert!(
            text.contains("routes[0].upstream.members[0].headers"),
            "{text}"
        );
        assert!(!text.contains(KEY), "the key was printed: {text}");
    }
}

/// Every shape a client can give its target, sent to a gateway that has a key pool under a
/// wildcard host and a `direct` route for everything else. The key reaches the pool's own
/// origin for each request routed there, and never the listener the client named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_key_reaches_only_its_own_origin() {
    let origin = Recorder::start().await;
    let elsewhere = Recorder::start().await;
    let spy = elsewhere.addr.port();
    let gw = Config::new()
        .egress(Egress::loopback_allowed().connect_ports(&[spy]))
        .route(
            Route::new("keys")
                .hosts(&["api.test", "*.api.test"])
                .key_member(
                    KeyMember::new(format!("http://{}", origin.addr), "key-a")
                        .header("Authorization", &format!("Bearer {KEY}")),
                ),
        )
        .route(Route::new("open").hosts(&["*"]).direct_member())
        .start();

    let shapes = [
        // A wildcard subdomain, on the listener's port.
        format!("GET http://evil.api.test:{spy}/ HTTP/1.1\r\nHost: evil.api.test:{spy}\r\n\r\n"),
        // Another port on the pool's own host.
        format!("GET http://api.test:{spy}/ HTTP/1.1\r\nHost: api.test:{spy}\r\n\r\n"),
        // Gateway form, with the listener's port in Host.
        format!("GET / HTTP/1.1\r\nHost: api.test:{spy}\r\n\r\n"),
        // Absolute form naming the listener itself: the direct route, which has no key.
        format!(
            "GET http://127.0.0.1:{spy}/ HTTP/1.1\r\nHost: 127.0.0.1:{spy}\r\nAuthorization: Bearer client-own\r\n\r\n"
        ),
        // A Host that differs from the absolute-form target.
        format!("GET http://api.test/ HTTP/1.1\r\nHost: 127.0.0.1:{spy}\r\n\r\n"),
        format!("GET http://127.0.0.1:{spy}/ HTTP/1.1\r\nHost: api.test\r\n\r\n"),
    ];
    for shape in &shapes {
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        // A refusal or an answer: either way, what matters is where the key went.
        let _ = client.send(shape, b"").await;
    }
    // CONNECT to the pool's hosts is refused: a tunnel could carry no key, and to an origin
    // it would carry the client's bytes to a server that stands in for another.
    for authority in [format!("api.test:{spy}"), format!("x.api.test:{spy}")] {
        let (_, r) = support::open_tunnel(gw.proxy_addr(), &authority, false).await;
        assert_eq!(r.status, 405, "{authority}: {}", r.text());
        assert_eq!(r.header("x-sluice-error"), Some("connect_not_supported"));
        assert!(r.header("allow").is_some_and(|a| !a.contains("CONNECT")));
    }
    // A CONNECT to the listener through the direct route: a tunnel, the client's bytes only.
    let authority = format!("127.0.0.1:{spy}");
    let (mut client, r) = support::open_tunnel(gw.proxy_addr(), &authority, true).await;
    assert_eq!(r.status, 200, "{}", gw.logs());
    client
        .write_raw(b"GET /through HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(
        support::wait_until(WAIT, || elsewhere.text().contains("GET /through")).await,
        "the tunnel's bytes never arrived: {}",
        elsewhere.text()
    );

    // The pool's origin got its key, once per request routed to it.
    let at_origin = origin.text();
    assert!(
        at_origin.matches(KEY).count() >= 3,
        "the origin did not get its key: {at_origin}"
    );
    // The listener the client chose saw requests, and never the key.
    let at_spy = elsewhere.text();
    assert!(elsewhere.connections() >= 1 && at_spy.contains("client-own"));
    assert!(
        !at_spy.contains(KEY),
        "the key followed the client: {at_spy}"
    );
    assert!(!gw.logs().contains(KEY), "the key is in the log");
}

/// With the guard off (`deny: []`) or `0.0.0.0/8` allowed, a client still cannot make sluice
/// connect to itself: unspecified addresses, in every spelling, and sluice's own listeners are
/// refused before anything is contacted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unspecified_addresses_and_own_listeners_are_never_reached() {
    for egress in [
        Egress::default().deny(&[]),
        Egress::default().allow_cidrs(&["0.0.0.0/8", "127.0.0.0/8", "::/128"]),
    ] {
        // CONNECT may target sluice's own ports, so that only the address checks stand.
        let [proxy, admin] = support::free_ports::<2>();
        let yaml = Config::new()
            .egress(egress.connect_ports(&[443, proxy, admin]))
            .route(Route::new("open").hosts(&["*"]).direct_member())
            .yaml()
            .replace("{PROXY}", &format!("127.0.0.1:{proxy}"))
            .replace("{ADMIN}", &format!("127.0.0.1:{admin}"));
        let gw = Gateway::start(&yaml);
        let targets = [
            format!("GET http://0.0.0.0:{admin}/status HTTP/1.1\r\nHost: 0.0.0.0:{admin}\r\n\r\n"),
            format!(
                "POST http://0.0.0.0:{admin}/reload HTTP/1.1\r\nHost: 0.0.0.0:{admin}\r\nContent-Length: 0\r\n\r\n"
            ),
            format!("GET http://0.0.0.0:{proxy}/ HTTP/1.1\r\nHost: 0.0.0.0:{proxy}\r\n\r\n"),
            format!("GET http://0.1.2.3:{proxy}/ HTTP/1.1\r\nHost: 0.1.2.3:{proxy}\r\n\r\n"),
            format!(
                "GET http://[::ffff:0.0.0.0]:{proxy}/ HTTP/1.1\r\nHost: [::ffff:0.0.0.0]:{proxy}\r\n\r\n"
            ),
            format!("GET http://[::]:{admin}/status HTTP/1.1\r\nHost: [::]:{admin}\r\n\r\n"),
            format!(
                "GET http://127.0.0.1:{admin}/status HTTP/1.1\r\nHost: 127.0.0.1:{admin}\r\n\r\n"
            ),
            // Unspecified on a port nothing of sluice's listens on: still the host itself.
            "GET http://0.0.0.0:1/ HTTP/1.1\r\nHost: 0.0.0.0:1\r\n\r\n".to_string(),
        ];
        for target in &targets {
            let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
            let r = client.send(target, b"").await.unwrap();
            assert_eq!(r.status, 403, "{target}: {}\n{}", r.text(), gw.logs());
            assert_eq!(r.header("x-sluice-error"), Some("destination_denied"));
        }
        for authority in [
            format!("0.0.0.0:{admin}"),
            format!("[::ffff:0.0.0.0]:{proxy}"),
            format!("127.0.0.1:{proxy}"),
        ] {
            let (_, r) = support::open_tunnel(gw.proxy_addr(), &authority, false).await;
            assert_eq!(r.status, 403, "{authority}: {}", r.text());
            assert_eq!(r.header("x-sluice-error"), Some("destination_denied"));
        }
        // Every one of them was answered by the gateway, and none made a second request.
        let access = || -> Vec<serde_json::Value> {
            gw.log_json()
                .into_iter()
                .filter(|l| l["target"] == "sluice::access")
                .collect()
        };
        let expected = targets.len() + 3;
        support::wait_until(WAIT, || access().len() >= expected).await;
        let lines = access();
        assert_eq!(
            lines.len(),
            expected,
            "one access line per request, no hop through sluice: {lines:?}"
        );
        assert!(lines.iter().all(|l| l["status"] == 403), "{lines:?}");
    }
}

/// A loop no address shows: the route's member is sluice itself (an origin member, or a
/// forward proxy member, pointing at its own proxy port). The request goes round once, the
/// second pass finds sluice's own `Via` name and answers `508 loop_detected`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_comes_back_is_answered_508() {
    let template = "listen: [\"{PROXY}\"]\nadmin: {listen: \"{ADMIN}\"}\nthreads: 1\negress: {allow_cidrs: [\"127.0.0.0/8\"]}\nroutes:\n  - name: self\n    match: {hosts: [\"self.test\"]}\n    upstream:\n      members: [{url: \"http://{PROXY}\"}]\n  - name: via-proxy\n    match: {hosts: [\"*\"]}\n    upstream:\n      members: [{proxy: \"http://{PROXY}\"}]\n";
    let gw = Gateway::start_with_ports(template);
    let r = support::get(gw.proxy_addr(), "self.test", "/").await;
    assert_eq!(r.status, 508, "{}\n{}", r.text(), gw.logs());
    assert_eq!(r.header("x-sluice-error"), Some("loop_detected"));

    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let r = client
        .send(
            "GET http://elsewhere.test/ HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n",
            b"",
        )
        .await
        .unwrap();
    assert_eq!(r.status, 508, "{}", r.text());

    // A tunnel through a proxy member that is sluice: its CONNECT carries the name too.
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let r = client
        .send(
            "CONNECT elsewhere.test:443 HTTP/1.1\r\nHost: elsewhere.test:443\r\n\r\n",
            b"",
        )
        .await
        .unwrap();
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("proxy_refused"));

    // Each request made exactly one hop back: two access lines each, one of them the 508.
    let access = || -> Vec<serde_json::Value> {
        gw.log_json()
            .into_iter()
            .filter(|l| l["target"] == "sluice::access")
            .collect()
    };
    support::wait_until(WAIT, || access().len() >= 6).await;
    let lines = access();
    assert_eq!(lines.len(), 6, "{lines:?}");
    let detected = lines
        .iter()
        .filter(|l| l["error"] == "loop_detected")
        .count();
    assert_eq!(detected, 3, "{lines:?}");
}
