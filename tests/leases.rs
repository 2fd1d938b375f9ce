//! Leases end to end, through the real binary and slow real backends: a request in flight holds
//! a lease on its member until its answer is done, shared by every gateway on one store.
//! `least_in_flight` sends each request to the member with the fewest; `max_in_flight` caps a
//! member and a route (429 `concurrency_exceeded`, or a wait with `quota.max_wait`); a gateway
//! killed with its leases held gives them back at `lease_ttl`, and a request that outlives
//! `lease_ttl` keeps its lease by renewing it.

mod support;

use std::time::Duration;

use sluice_echo::EchoServer;
use sluice_testkit::RedisCluster;
use support::{
    request, start_backends, url, wait_until, wait_until_async, Backend, Config, Egress, Gateway,
    Response, State, Store,
};

on_both_stores!(
    least_in_flight_picks_the_member_with_the_fewest,
    max_in_flight_caps_what_each_member_and_the_route_see,
    at_the_cap_a_request_waits_with_max_wait,
    a_tunnel_holds_its_lease_until_it_closes,
    a_route_at_its_cap_falls_back_on_concurrency_exceeded,
    a_request_at_the_cap_is_not_refused_by_its_own_lease,
);

/// The store the gateways of a test share: memory (one gateway), a Redis or a Redis Cluster
/// (two gateways).
struct Shared {
    state: State,
    instances: usize,
    _store: Option<Store>,
    _cluster: Option<RedisCluster>,
}

impl Shared {
    fn of(backend: Backend) -> Shared {
        let store = Store::start(backend);
        Shared {
            state: store.state(),
            instances: store.instances(),
            _store: Some(store),
            _cluster: None,
        }
    }

    fn cluster() -> Shared {
        let cluster = RedisCluster::start();
        Shared {
            state: State::cluster(cluster.urls()),
            instances: 2,
            _store: None,
            _cluster: Some(cluster),
        }
    }
}

/// The config of `store` with `routes` (YAML under `routes:`).
fn config(store: &Shared, routes: &str) -> String {
    let base = Config::new().state(store.state.clone()).yaml();
    let base = base
        .split("routes:")
        .next()
        .expect("the builder writes routes last")
        .to_string();
    format!("{base}routes:\n{routes}")
}

/// The gateways that share `store`: two on Redis, one on memory.
fn gateways(store: &Shared, yaml: &str) -> Vec<Gateway> {
    (0..store.instances)
        .map(|_| Gateway::start_with_ports(yaml))
        .collect()
}

/// A request held `ms` milliseconds by the member.
async fn slow(gw: &Gateway, host: &str, ms: u64) -> Response {
    let delay = ms.to_string();
    request(
        gw.proxy_addr(),
        "GET",
        host,
        "/",
        &[("x-delay-ms", &delay)],
        b"",
    )
    .await
}

/// Leases in flight per member, as `/status` shows them.
async fn in_flight(gw: &Gateway, route: &str) -> Vec<(String, u64)> {
    let status = gw.status().await;
    let routes = status["routes"].as_array().expect("routes").clone();
    let r = routes
        .iter()
        .find(|r| r["name"] == route)
        .expect("the route is in /status");
    r["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| {
            let n = m["in_flight"].as_u64().expect("in_flight is a number");
            (m["name"].as_str().unwrap_or_default().to_string(), n)
        })
        .collect()
}

fn total(backends: &[EchoServer]) -> u64 {
    backends.iter().map(EchoServer::in_flight).sum()
}

/// Slow requests (held open) and fast ones, mixed: sent one at a time, alternating gateways,
/// each once the one before is at its member (and a fast one's lease released everywhere):
/// every pick sees exact counts, and takes a member with the fewest (ties to the smallest name),
/// so the slow ones fill the members up evenly and each fast one goes to the least loaded.
/// `/status` and the metric show the leases; once the answers are done every lease is released.
async fn least_in_flight_picks_the_member_with_the_fewest(backend: Backend) {
    least_in_flight_on(Shared::of(backend)).await;
}

async fn least_in_flight_on(store: Shared) {
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: String = backends
        .iter()
        .enumerate()
        .map(|(i, b)| {
            format!(
                "      - {{ name: m{}, url: \"{}\" }}\n",
                i + 1,
                url(b.local_addr())
            )
        })
        .collect();
    let yaml = config(
        &store,
        &format!(
            "  - name: lif\n    match: {{ hosts: [lif.test] }}\n    upstream:\n      selection: least_in_flight\n      members:\n{members}"
        ),
    );
    let gws = gateways(&store, &yaml);
    let mut held = Vec::new();
    let mut counts = [0u64; 3];
    let fewest = |counts: &[u64; 3]| (0..3).min_by_key(|&m| (counts[m], m)).unwrap();
    for i in 0..7 {
        // A fast request first, through the other gateway: it goes to the least loaded member,
        // and its lease is released before the next pick.
        if i > 0 {
            let gw = &gws[(i + 1) % gws.len()];
            let before: Vec<u64> = backends.iter().map(EchoServer::proxied_requests).collect();
            assert_eq!(slow(gw, "lif.test", 0).await.status, 200);
            let least = fewest(&counts);
            let after: Vec<u64> = backends.iter().map(EchoServer::proxied_requests).collect();
            let went: Vec<usize> = (0..3).filter(|&m| after[m] > before[m]).collect();
            assert_eq!(went, [least], "fast request {i} with {counts:?} in flight");
            let want: Vec<(String, u64)> =
                (0..3).map(|m| (format!("m{}", m + 1), counts[m])).collect();
            for gw in &gws {
                assert!(
                    wait_until_async(Duration::from_secs(20), || async {
                        in_flight(gw, "lif").await == want
                    })
                    .await,
                    "the fast request's lease released: {:?}",
                    in_flight(gw, "lif").await
                );
            }
        }
        let gw = &gws[i % gws.len()];
        let addr = gw.proxy_addr();
        // Held 15 s: the whole sequence of seven, with its /status polls, must end before the
        // first of them does, on a loaded machine too.
        held.push(tokio::spawn(async move {
            request(
                addr,
                "GET",
                "lif.test",
                "/",
                &[("x-delay-ms", "15000")],
                b"",
            )
            .await
        }));
        assert!(
            wait_until(Duration::from_secs(20), || total(&backends) == i as u64 + 1).await,
            "request {i} reached its member"
        );
        // The fewest, ties to the smallest name.
        let least = fewest(&counts);
        assert_eq!(
            backends[least].in_flight(),
            counts[least] + 1,
            "request {i} went to m{}: {counts:?}",
            least + 1
        );
        counts[least] += 1;
    }
    assert_eq!(counts, [3, 2, 2]);
    for gw in &gws {
        let seen = in_flight(gw, "lif").await;
        let want: Vec<(String, u64)> = (0..3).map(|m| (format!("m{}", m + 1), counts[m])).collect();
        assert_eq!(seen, want, "/status of every gateway");
        let metric = gw
            .metric(
                "sluice_member_in_flight",
                &[("route", "lif"), ("member", "m1")],
            )
            .await;
        assert_eq!(metric, Some(3.0));
    }
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    // Every answer is done: each lease is released, on every gateway's view.
    for gw in &gws {
        assert!(
            wait_until_async(Duration::from_secs(20), || async {
                in_flight(gw, "lif").await.iter().all(|(_, n)| *n == 0)
            })
            .await,
            "every lease released: {:?}",
            in_flight(gw, "lif").await
        );
    }
}

/// Members m1..m3 all on one backend, `upstream.max_in_flight: 2` and the route's
/// `max_in_flight: 3`; a burst of slow requests over every gateway: each member sees at most 2,
/// the backend at most 3, and the requests over the caps get 429 `concurrency_exceeded`.
async fn max_in_flight_caps_what_each_member_and_the_route_see(backend: Backend) {
    max_in_flight_on(Shared::of(backend)).await;
}

async fn max_in_flight_on(store: Shared) {
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let [one, two, three] = [0, 1, 2].map(|i| url(backends[i].local_addr()));
    let yaml = config(
        &store,
        &format!(
            "  - name: members
    match: {{ hosts: [members.test] }}
    upstream:
      max_in_flight: 2
      members:
        - {{ name: m1, url: \"{one}\" }}
        - {{ name: m2, url: \"{two}\" }}
  - name: route
    match: {{ hosts: [route.test] }}
    max_in_flight: 3
    upstream:
      selection: least_in_flight
      max_in_flight: 2
      members:
        - {{ name: a, url: \"{three}\" }}
        - {{ name: b, url: \"{three}\" }}
        - {{ name: c, url: \"{three}\" }}
"
        ),
    );
    let gws = gateways(&store, &yaml);
    for (host, cap, on) in [
        ("members.test", 4, &backends[..2]),
        ("route.test", 3, &backends[2..]),
    ] {
        let burst: Vec<_> = (0..12)
            .map(|i| {
                let addr = gws[i % gws.len()].proxy_addr();
                // Held 3 s: the twelve must overlap, however slowly a loaded machine sends
                // them, for some to find the caps full.
                tokio::spawn(async move {
                    request(addr, "GET", host, "/", &[("x-delay-ms", "3000")], b"").await
                })
            })
            .collect();
        let mut ok = 0;
        for r in burst {
            let r = r.await.unwrap();
            match r.status {
                200 => ok += 1,
                429 => assert_eq!(
                    r.header("x-sluice-error"),
                    Some("concurrency_exceeded"),
                    "{host}: {}",
                    r.text()
                ),
                other => panic!("{host}: unexpected {other}: {}", r.text()),
            }
        }
        assert!(
            (1..12).contains(&ok),
            "{host}: {ok} of 12 admitted, the rest refused"
        );
        // Each member on members.test has a backend of its own, capped at 2; the route's three
        // members share one, which only the route's cap of 3 bounds.
        let member_cap = if on.len() == 2 { 2 } else { cap };
        for b in on {
            assert!(
                b.peak_in_flight() <= member_cap,
                "{host}: {} saw {} at once, cap {member_cap}",
                b.name(),
                b.peak_in_flight()
            );
        }
        let peaks: u64 = on.iter().map(EchoServer::peak_in_flight).sum();
        assert!(peaks <= cap, "{host}: {peaks} > {cap}");
        // The leases are back once the answers are done: the next request goes.
        assert!(
            wait_until_async(Duration::from_secs(20), || async {
                slow(&gws[0], host, 0).await.status == 200
            })
            .await
        );
    }
}

/// With `quota.max_wait`, a request at the cap waits for a release instead: every request of
/// the burst is answered 200, and no member ever sees more than its cap.
async fn at_the_cap_a_request_waits_with_max_wait(backend: Backend) {
    let store = Shared::of(backend);
    let backends = start_backends(&["b1"]).await;
    let one = url(backends[0].local_addr());
    let yaml = config(
        &store,
        &format!(
            "  - name: waits
    match: {{ hosts: [waits.test] }}
    quota: {{ max_wait: 20s }}
    upstream:
      selection: least_in_flight
      max_in_flight: 2
      members:
        - {{ name: m1, url: \"{one}\" }}
"
        ),
    );
    let gws = gateways(&store, &yaml);
    let burst: Vec<_> = (0..8)
        .map(|i| {
            let addr = gws[i % gws.len()].proxy_addr();
            tokio::spawn(async move {
                request(
                    addr,
                    "GET",
                    "waits.test",
                    "/",
                    &[("x-delay-ms", "300")],
                    b"",
                )
                .await
            })
        })
        .collect();
    for r in burst {
        let r = r.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert!(
        backends[0].peak_in_flight() <= 2,
        "{}",
        backends[0].peak_in_flight()
    );
    assert_eq!(backends[0].proxied_requests(), 8);
}

/// A gateway killed with a lease held leaves it in Redis until `lease_ttl`; then the capacity
/// comes back for the other gateway. Meanwhile a request that outlives `lease_ttl` on the
/// survivor keeps its lease, renewed at a third of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateways_leases_expire_and_long_requests_renew() {
    let store = Shared::of(Backend::Redis);
    let backends = start_backends(&["b1", "b2"]).await;
    let [one, two] = [0, 1].map(|i| url(backends[i].local_addr()));
    let yaml = config(
        &store,
        &format!(
            "  - name: crash
    match: {{ hosts: [crash.test] }}
    upstream:
      selection: least_in_flight
      lease_ttl: 10s
      max_in_flight: 1
      members:
        - {{ name: m1, url: \"{one}\" }}
  - name: renew
    match: {{ hosts: [renew.test] }}
    upstream:
      lease_ttl: 6s
      max_in_flight: 1
      members:
        - {{ name: m1, url: \"{two}\" }}
"
        ),
    );
    let mut gws = gateways(&store, &yaml);
    let survivor = gws.pop().unwrap();
    let doomed = gws.pop().unwrap();
    let addr = doomed.proxy_addr();
    let _held = tokio::spawn(async move {
        let _ = support::try_request(
            addr,
            "GET",
            "crash.test",
            "/",
            &[("x-delay-ms", "30000")],
            b"",
        )
        .await;
    });
    assert!(wait_until(Duration::from_secs(20), || backends[0].in_flight() == 1).await);
    doomed.signal("KILL");
    // The dead gateway's lease lives 10 s: long enough that this request finds it even when a
    // loaded machine delays it, short enough to wait for below.
    let refused = slow(&survivor, "crash.test", 0).await;
    assert_eq!(refused.status, 429, "the dead gateway's lease still counts");
    assert_eq!(
        refused.header("x-sluice-error"),
        Some("concurrency_exceeded")
    );
    assert!(
        wait_until_async(Duration::from_secs(30), || async {
            slow(&survivor, "crash.test", 0).await.status == 200
        })
        .await,
        "the lease expired at lease_ttl and capacity came back"
    );

    // A request held 20 s on a route whose leases live 6 s: renewed at a third of the ttl, its
    // lease outlives the ttl while it runs (a renewal survives a stall of up to 4 s; with 2 s
    // leases, 1.1 s). The hold is far longer than the steps below take even on a loaded
    // machine, so the request is still at its member when they check.
    let addr = survivor.proxy_addr();
    let long = tokio::spawn(async move {
        request(
            addr,
            "GET",
            "renew.test",
            "/",
            &[("x-delay-ms", "20000")],
            b"",
        )
        .await
    });
    assert!(wait_until(Duration::from_secs(20), || backends[1].in_flight() == 1).await);
    let redis = store
        ._store
        .as_ref()
        .and_then(Store::redis)
        .expect("a Redis store");
    let expiry = || {
        redis
            .zrange_with_scores("sluice:{renew}:lz")
            .first()
            .map(|(_, score)| *score)
    };
    let taken = expiry().expect("the lease is in Redis");
    // Renewed until its expiry is a whole ttl past the first: each renewal found it alive (an
    // expired lease is dropped before renewals, never taken back), so it outlived its ttl.
    assert!(
        wait_until(Duration::from_secs(30), || {
            expiry().is_some_and(|e| e >= taken + 6_000_000.0)
        })
        .await,
        "the lease was renewed past its ttl: {taken} -> {:?}",
        expiry()
    );
    assert_eq!(
        backends[1].in_flight(),
        1,
        "the long request is still at its member"
    );
    let second = slow(&survivor, "renew.test", 0).await;
    assert_eq!(
        second.status,
        429,
        "the renewed lease still counts: {}",
        second.text()
    );
    assert_eq!(long.await.unwrap().status, 200);
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            slow(&survivor, "renew.test", 0).await.status == 200
        })
        .await
    );
}

/// A CONNECT tunnel holds its lease until it closes: with `max_in_flight: 1`, a second tunnel
/// is refused while the first is open, and goes once it has closed.
async fn a_tunnel_holds_its_lease_until_it_closes(backend: Backend) {
    let store = Shared::of(backend);
    let backends = start_backends(&["b1"]).await;
    let target = backends[0].local_addr().to_string();
    let base = Config::new()
        .state(store.state.clone())
        .egress(Egress::loopback_allowed().connect_ports(&[backends[0].local_addr().port()]))
        .yaml();
    let base = base.split("routes:").next().unwrap_or_default().to_string();
    let yaml = format!(
        "{base}routes:
  - name: t
    match: {{ hosts: [\"127.0.0.1\"] }}
    upstream:
      max_in_flight: 1
      members:
        - {{ direct: true }}
"
    );
    let gws = gateways(&store, &yaml);
    let (mut tunnel, r) = support::open_tunnel(gws[0].proxy_addr(), &target, true).await;
    assert_eq!(r.status, 200);
    let r = tunnel.request("GET", &target, "/", &[], b"").await.unwrap();
    assert_eq!(r.status, 200, "the tunnel carries requests");
    let last = gws.last().expect("a gateway");
    let (_, refused) = support::open_tunnel(last.proxy_addr(), &target, false).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(
        refused.header("x-sluice-error"),
        Some("concurrency_exceeded")
    );
    drop(tunnel);
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            let (_, r) = support::open_tunnel(last.proxy_addr(), &target, true).await;
            r.status == 200
        })
        .await,
        "the lease was released when the tunnel closed"
    );
}

/// The same on a Redis Cluster shared by two gateways: a route's leases live in its slot, and
/// each pick and each cap is still one atomic step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_in_flight_on_a_cluster() {
    least_in_flight_on(Shared::cluster()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_on_a_cluster() {
    max_in_flight_on(Shared::cluster()).await;
}

/// A route at its `max_in_flight` hands the request to its `fallback` when that lists
/// `concurrency_exceeded`: with A's one slot held, the next request is answered by B's member.
async fn a_route_at_its_cap_falls_back_on_concurrency_exceeded(backend: Backend) {
    let store = Shared::of(backend);
    let backends = start_backends(&["a1", "b1"]).await;
    let [a, b] = [0, 1].map(|i| url(backends[i].local_addr()));
    let yaml = config(
        &store,
        &format!(
            "  - name: a
    match: {{ hosts: [a.test] }}
    max_in_flight: 1
    upstream:
      members:
        - {{ name: a1, url: \"{a}\" }}
    fallback:
      - {{ route: b, on: [concurrency_exceeded] }}
  - name: b
    match: {{ hosts: [b.test] }}
    upstream:
      members:
        - {{ name: b1, url: \"{b}\" }}
"
        ),
    );
    let gws = gateways(&store, &yaml);
    let addr = gws[0].proxy_addr();
    let held = tokio::spawn(async move {
        // Held far longer than the next request takes even on a loaded machine: it must find
        // the one slot taken.
        request(addr, "GET", "a.test", "/", &[("x-delay-ms", "10000")], b"").await
    });
    assert!(wait_until(Duration::from_secs(20), || backends[0].in_flight() == 1).await);
    let last = gws.last().expect("a gateway");
    let r = slow(last, "a.test", 0).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("b1"));
    assert_eq!(held.await.unwrap().header("x-upstream"), Some("a1"));
    let counted = last
        .metric(
            "sluice_fallbacks_total",
            &[
                ("from", "a"),
                ("to", "b"),
                ("reason", "concurrency_exceeded"),
            ],
        )
        .await;
    assert_eq!(counted, Some(1.0));
}

/// During a store outage a capped route follows its `on_store_error` (open without a quota):
/// requests go without a lease, and once Redis is back the cap holds again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_store_outage_a_capped_route_follows_on_store_error() {
    let mut redis = sluice_testkit::RedisServer::start();
    let backends = start_backends(&["b1"]).await;
    let one = url(backends[0].local_addr());
    let routes = format!(
        "  - name: open
    match: {{ hosts: [open.test] }}
    upstream:
      max_in_flight: 1
      members:
        - {{ name: m1, url: \"{one}\" }}
  - name: closed
    match: {{ hosts: [closed.test] }}
    quota: {{ max_wait: 1s, on_store_error: closed }}
    upstream:
      max_in_flight: 1
      members:
        - {{ name: m1, url: \"{one}\" }}
"
    );
    // The tests' generous call timeout: a killed Redis refuses connections at once, and a short
    // one would let a slow call on a loaded machine admit a request unleased once it is back.
    let base = Config::new().state(State::redis(redis.url())).yaml();
    let base = base.split("routes:").next().unwrap_or_default().to_string();
    let gw = Gateway::start_with_ports(&format!("{base}routes:\n{routes}"));
    assert_eq!(slow(&gw, "open.test", 0).await.status, 200);
    redis.kill();
    assert_eq!(
        slow(&gw, "open.test", 0).await.status,
        200,
        "open: admitted unleased"
    );
    let r = slow(&gw, "closed.test", 0).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("store_unavailable"));
    redis.restart();
    // Back: once /status reads the leases again, the cap holds again.
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            let status = gw.status().await;
            status["routes"][0]["members"][0]["in_flight"].is_u64()
        })
        .await,
        "the store answers again"
    );
    let addr = gw.proxy_addr();
    let held = tokio::spawn(async move {
        request(
            addr,
            "GET",
            "open.test",
            "/",
            &[("x-delay-ms", "10000")],
            b"",
        )
        .await
    });
    assert!(wait_until(Duration::from_secs(20), || backends[0].in_flight() == 1).await);
    let refused = slow(&gw, "open.test", 0).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(held.await.unwrap().status, 200);
}

/// A request that moves on to another member asks the store again, and its own lease must not
/// count against the cap that ask checks. The route allows one request in flight, and each
/// request here is the only one: a member that fails to connect is retried on the next, and a
/// member's 429 is replayed to the next (`cooldown.retry`), each time without the request
/// being refused by the lease it took for the member before.
async fn a_request_at_the_cap_is_not_refused_by_its_own_lease(backend: Backend) {
    let store = Shared::of(backend);
    let backends = start_backends(&["b1", "b2"]).await;
    let [one, two] = [0, 1].map(|i| url(backends[i].local_addr()));
    let dead = support::dead_url();
    let yaml = config(
        &store,
        &format!(
            "  - name: retry
    match: {{ hosts: [retry.test] }}
    max_in_flight: 1
    upstream:
      selection: priority
      retries: 1
      passive: {{ fall: 1000 }}
      members:
        - {{ name: dead, url: \"{dead}\" }}
        - {{ name: b1, url: \"{one}\" }}
  - name: replay
    match: {{ hosts: [replay.test] }}
    max_in_flight: 1
    upstream:
      selection: priority
      members:
        - {{ name: b1, url: \"{one}\", headers: {{ Authorization: \"Bearer key-1\" }} }}
        - {{ name: b2, url: \"{two}\", headers: {{ Authorization: \"Bearer key-2\" }} }}
      cooldown: {{ on_status: [429], default: 1s, retry: true }}
"
        ),
    );
    let gws = gateways(&store, &yaml);
    let gw = gws.last().expect("a gateway");
    // The dead member stays up (its `fall` is far off), so each request tries it first. The
    // release at a request's end is not waited for: each waits until the one before it is
    // released everywhere.
    let released = || async {
        for g in &gws {
            for route in ["retry", "replay"] {
                if in_flight(g, route).await.iter().any(|(_, n)| *n > 0) {
                    return false;
                }
            }
        }
        true
    };
    for _ in 0..5 {
        assert!(wait_until_async(Duration::from_secs(20), released).await);
        let r = slow(gw, "retry.test", 0).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-upstream"), Some("b1"));
    }
    backends[0]
        .refuse_next("Bearer key-1", 1, "1")
        .expect("script b1's refusal");
    assert!(wait_until_async(Duration::from_secs(20), released).await);
    let r = slow(gw, "replay.test", 0).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("b2"), "replayed to b2");
}

/// A TCP relay to `target` whose replies (the bytes coming back) wait `delay` milliseconds each
/// while it is set: Redis runs each call at once, and its answer comes late. Returns the
/// relay's address and the delay to set.
async fn slow_replies(
    target: std::net::SocketAddr,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let delay = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let shared = delay.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                continue;
            };
            let (mut client_rx, mut client_tx) = client.into_split();
            let (mut server_rx, mut server_tx) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut client_rx, &mut server_tx).await;
            });
            let delay = shared.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match server_rx.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let ms = delay.load(Ordering::SeqCst);
                    if ms > 0 {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    if client_tx.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, delay)
}

/// A store call whose answer comes after its timeout may still have run, and taken its lease:
/// the request is answered by the route's `on_store_error` (here `closed`: 503), and the lease
/// it may hold is released as soon as the store answers again, not kept until `lease_ttl`
/// (a minute here). The route's one slot is free again for the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_a_timed_out_call_took_is_released() {
    use std::sync::atomic::Ordering;
    let redis = sluice_testkit::RedisServer::start();
    let (relay, delay) = slow_replies(redis.addr()).await;
    let backends = start_backends(&["b1"]).await;
    let one = url(backends[0].local_addr());
    let routes = format!(
        "  - name: capped
    match: {{ hosts: [capped.test] }}
    quota: {{ max_wait: 1s, on_store_error: closed }}
    upstream:
      max_in_flight: 1
      lease_ttl: 60s
      members:
        - {{ name: m1, url: \"{one}\" }}
"
    );
    let state = State::redis(format!("redis://{relay}")).timeout("1s");
    let base = Config::new().state(state).yaml();
    let base = base.split("routes:").next().unwrap_or_default().to_string();
    let gw = Gateway::start_with_ports(&format!("{base}routes:\n{routes}"));
    // Warm: the library is loaded, and a lease taken and released.
    let warm = wait_until_async(Duration::from_secs(20), || async {
        slow(&gw, "capped.test", 0).await.status == 200
    })
    .await;
    assert!(warm, "served while Redis answers in time");
    // Each answer now comes three times the call's timeout late.
    delay.store(3_000, Ordering::SeqCst);
    let r = slow(&gw, "capped.test", 0).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("store_unavailable"));
    delay.store(0, Ordering::SeqCst);
    let served = wait_until_async(Duration::from_secs(20), || async {
        slow(&gw, "capped.test", 0).await.status == 200
    })
    .await;
    assert!(served, "the slot is free again well before lease_ttl");
}
