//! A client's `max_in_flight` end to end, through the real binary and slow real backends: the
//! client's requests in flight count on every route it uses, across every gateway on one store;
//! at its cap the next is refused (429 `concurrency_exceeded`, naming the client's cap) whatever
//! the route and gateway, while other clients go on; a release lets the client in again. On a
//! Redis Cluster the client's leases live in its own slot, taken by a call of their own.

mod support;

use std::time::Duration;

use sluice_echo::EchoServer;
use sluice_testkit::RedisCluster;
use support::{
    request, start_backends, url, wait_until, wait_until_async, Backend, Config, Egress, Gateway,
    HttpClient, Response, State, Store,
};

const BILLING: &str = "billing-token-0123456789";
const SEARCH: &str = "search-token-0123456789";

on_both_stores!(
    a_clients_max_in_flight_holds_on_every_route_and_gateway,
    a_tunnel_counts_and_a_request_waits_with_max_wait,
    a_fallback_is_not_refused_by_the_clients_own_lease,
);

async fn a_clients_max_in_flight_holds_on_every_route_and_gateway(backend: Backend) {
    let store = Store::start(backend);
    capped_on(store.state(), store.instances()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_max_in_flight_holds_on_a_cluster() {
    let cluster = RedisCluster::start();
    capped_on(State::cluster(cluster.urls()), 2).await;
}

/// A request to `host` by the client holding `token`, held `ms` milliseconds by the member.
async fn call(gw: &Gateway, host: &str, token: &str, ms: u64) -> Response {
    let auth = format!("Bearer {token}");
    let delay = ms.to_string();
    request(
        gw.proxy_addr(),
        "GET",
        host,
        "/",
        &[("Proxy-Authorization", &auth), ("x-delay-ms", &delay)],
        b"",
    )
    .await
}

/// `billing` (at most 2 in flight) holds two slow requests, one on each route (and, on Redis,
/// each through its own gateway); its third is refused on both routes through every gateway,
/// and reaches no member, for as long as the two last (past their `lease_ttl`, renewed).
/// `search`, with no cap, goes on. Once the two are answered, billing is admitted again.
async fn capped_on(state: State, instances: usize) {
    let backends = start_backends(&["b1", "b2"]).await;
    let [one, two] = [0, 1].map(|i| url(backends[i].local_addr()));
    let base = Config::new().state(state).yaml();
    let base = base
        .split("routes:")
        .next()
        .expect("the builder writes routes last")
        .to_string();
    // `plain` has no lease of its own (round-robin, no cap), `lif` counts its members'. A
    // lease_ttl of 6 s, which the held requests outlive: their renewals keep them counting.
    // A renewal is due at a third of it, so a stall of up to 4 s is survived (at 1 s, a renewal
    // a loaded machine delayed by two thirds of a second lost the lease; 2 s left 1.1 s).
    let yaml = format!(
        "{base}clients:
  list:
    - name: billing
      tokens: [\"{BILLING}\"]
      routes: [\"*\"]
      max_in_flight: 2
    - name: search
      tokens: [\"{SEARCH}\"]
      routes: [\"*\"]
routes:
  - name: plain
    match: {{ hosts: [plain.test] }}
    upstream:
      lease_ttl: 6s
      members:
        - {{ name: m1, url: \"{one}\" }}
  - name: lif
    match: {{ hosts: [lif.test] }}
    upstream:
      selection: least_in_flight
      lease_ttl: 6s
      members:
        - {{ name: m2, url: \"{two}\" }}
"
    );
    let gws: Vec<Gateway> = (0..instances)
        .map(|_| Gateway::start_with_ports(&yaml))
        .collect();
    let last = gws.len() - 1;
    let held: Vec<_> = [("plain.test", 0), ("lif.test", last)]
        .into_iter()
        .map(|(host, g)| {
            let addr = gws[g].proxy_addr();
            tokio::spawn(async move {
                let auth = format!("Bearer {BILLING}");
                request(
                    addr,
                    "GET",
                    host,
                    "/",
                    &[("Proxy-Authorization", &auth), ("x-delay-ms", "20000")],
                    b"",
                )
                .await
            })
        })
        .collect();
    let total = |b: &[EchoServer]| b.iter().map(EchoServer::in_flight).sum::<u64>();
    assert!(
        wait_until(Duration::from_secs(20), || total(&backends) == 2).await,
        "both held requests reach their members"
    );
    let started = std::time::Instant::now();
    let mut rounds = 0u64;
    // Checked again and again until the holds are past two lease_ttls. They last 20 s, far
    // longer than the last round can end even on a loaded machine.
    while rounds == 0 || started.elapsed() < Duration::from_millis(12_500) {
        rounds += 1;
        for gw in &gws {
            check_refused(gw).await;
        }
    }
    assert_eq!(
        backends
            .iter()
            .map(EchoServer::proxied_requests)
            .sum::<u64>(),
        2 + 2 * rounds * gws.len() as u64,
        "the refused reached no member"
    );
    for r in held {
        assert_eq!(r.await.unwrap().status, 200);
    }
    // The releases go to the store in the background: billing is admitted again once they
    // land, through every gateway.
    for gw in &gws {
        assert!(
            wait_until_async(Duration::from_secs(20), || async {
                call(gw, "plain.test", BILLING, 0).await.status == 200
            })
            .await
        );
    }
}

/// Through `gw`, billing is refused on both routes, naming its cap; search goes.
async fn check_refused(gw: &Gateway) {
    for host in ["plain.test", "lif.test"] {
        let refused = call(gw, host, BILLING, 0).await;
        assert_eq!(refused.status, 429, "{host}: {}", refused.text());
        assert_eq!(
            refused.header("x-sluice-error"),
            Some("concurrency_exceeded")
        );
        let body = refused.json();
        let detail = body["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("billing") && detail.contains("max_in_flight of 2"),
            "{detail}"
        );
        // Another client is not limited by billing's cap.
        assert_eq!(call(gw, host, SEARCH, 0).await.status, 200, "{host}");
    }
}

/// A CONNECT tunnel to `target` through `gw`, by the client holding `token`.
async fn tunnel(gw: &Gateway, target: &str, token: &str) -> (HttpClient, Response) {
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let head = format!(
        "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Bearer {token}\r\n\r\n"
    );
    client.write_raw(head.as_bytes()).await.unwrap();
    let r = client.read_response(true).await.unwrap();
    (client, r)
}

/// With `max_in_flight: 1`, billing's open tunnel holds its one lease: a second tunnel is
/// refused, and a request on a route with `quota.max_wait` waits (on another gateway too)
/// until the tunnel closes, then goes.
async fn a_tunnel_counts_and_a_request_waits_with_max_wait(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1"]).await;
    let member = url(backends[0].local_addr());
    let target = backends[0].local_addr().to_string();
    let base = Config::new()
        .store(&store)
        .egress(Egress::loopback_allowed().connect_ports(&[backends[0].local_addr().port()]))
        .yaml();
    let base = base.split("routes:").next().unwrap_or_default().to_string();
    let yaml = format!(
        "{base}clients:
  list:
    - name: billing
      tokens: [\"{BILLING}\"]
      routes: [\"*\"]
      destinations: [\"*\"]
      max_in_flight: 1
routes:
  - name: t
    match: {{ hosts: [\"127.0.0.1\"] }}
    upstream:
      members:
        - {{ direct: true }}
  - name: waits
    match: {{ hosts: [waits.test] }}
    quota: {{ max_wait: 30s }}
    upstream:
      members:
        - {{ name: m1, url: \"{member}\" }}
"
    );
    let gws: Vec<Gateway> = (0..store.instances())
        .map(|_| Gateway::start_with_ports(&yaml))
        .collect();
    let last = gws.last().expect("a gateway");
    let (open, r) = tunnel(&gws[0], &target, BILLING).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let waiting = {
        let addr = last.proxy_addr();
        tokio::spawn(async move {
            let auth = format!("Bearer {BILLING}");
            request(
                addr,
                "GET",
                "waits.test",
                "/",
                &[("Proxy-Authorization", &auth)],
                b"",
            )
            .await
        })
    };
    let (_, refused) = tunnel(last, &target, BILLING).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(
        refused.header("x-sluice-error"),
        Some("concurrency_exceeded")
    );
    // The tunnel still holds billing's one lease: the request cannot have gone.
    assert!(!waiting.is_finished(), "the request waits for the tunnel");
    assert_eq!(backends[0].proxied_requests(), 0);
    drop(open);
    let r = waiting.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A client at `max_in_flight: 1` whose request route `a`'s member answers 429 goes on to the
/// fallback route `b`: its lease on `a`'s member is given back before `b`'s admission asks the
/// store, so the client's one request is not refused by itself.
async fn a_fallback_is_not_refused_by_the_clients_own_lease(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["a1", "b1"]).await;
    let [a, b] = [0, 1].map(|i| url(backends[i].local_addr()));
    let base = Config::new().state(store.state()).yaml();
    let base = base
        .split("routes:")
        .next()
        .expect("the builder writes routes last")
        .to_string();
    let yaml = format!(
        "{base}clients:
  list:
    - name: billing
      tokens: [\"{BILLING}\"]
      routes: [\"*\"]
      max_in_flight: 1
routes:
  - name: a
    match: {{ hosts: [a.test] }}
    upstream:
      members:
        - {{ name: a1, url: \"{a}\", headers: {{ Authorization: \"Bearer key-a\" }} }}
    fallback:
      - {{ route: b, on: [429] }}
  - name: b
    match: {{ hosts: [b.test] }}
    upstream:
      members:
        - {{ name: b1, url: \"{b}\" }}
"
    );
    let gws: Vec<Gateway> = (0..store.instances())
        .map(|_| Gateway::start_with_ports(&yaml))
        .collect();
    let gw = gws.last().expect("a gateway");
    backends[0]
        .refuse_next("Bearer key-a", 1, "5")
        .expect("script a1's refusal");
    let r = call(gw, "a.test", BILLING, 0).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-upstream"),
        Some("b1"),
        "answered by the fallback"
    );
}
