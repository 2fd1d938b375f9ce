//! Sticky sessions end to end, through the real binary and real backends: requests of one
//! session (a header, a cookie, or the client) go to one member, whichever gateway on the
//! shared store gets them; a `rebind_on` status or a cooling member moves the session, and it
//! stays where it moved; a full binding table still serves every session (counted), never
//! refuses one.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use sluice_echo::EchoServer;
use sluice_testkit::RedisCluster;
use support::tinyproxy::Tinyproxy;
use support::{
    request, start_backends, url, wait_until_async, Backend, Config, Egress, Gateway, State, Store,
    TempDir,
};

on_both_stores!(
    a_session_stays_on_one_member_through_100_requests,
    a_listed_status_moves_the_session_and_it_stays,
    a_cooling_member_moves_the_session,
    a_full_table_still_serves_every_session,
    sessions_by_cookie_and_by_client,
    a_down_member_moves_the_session,
    a_fallback_route_keeps_its_own_sessions,
    tunnels_of_a_client_leave_through_one_proxy,
);

/// The store of a test and its gateways: two on Redis, one on memory.
struct Setup {
    _store: Option<Store>,
    _cluster: Option<RedisCluster>,
    gws: Vec<Gateway>,
    backends: Vec<EchoServer>,
}

/// `upstream` is YAML under `upstream:` (without `members:`, which the backends fill).
async fn setup(backend: Backend, selection: &str, upstream: &str) -> Setup {
    setup_with(backend, selection, upstream, "").await
}

/// [`setup`], with `more` routes (YAML items under `routes:`) after the sticky route `s`.
async fn setup_with(backend: Backend, selection: &str, upstream: &str, more: &str) -> Setup {
    let store = Store::start(backend);
    let (state, instances) = (store.state(), store.instances());
    let mut s = setup_on(state, instances, selection, upstream, more).await;
    s._store = Some(store);
    s
}

/// [`setup_with`] on `state`, with `instances` gateways.
async fn setup_on(
    state: State,
    instances: usize,
    selection: &str,
    upstream: &str,
    more: &str,
) -> Setup {
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: String = backends
        .iter()
        .map(|b| {
            format!(
                "      - {{ name: {}, url: \"{}\" }}\n",
                b.name(),
                url(b.local_addr())
            )
        })
        .collect();
    let base = Config::new().state(state).yaml();
    let base = base
        .split("routes:")
        .next()
        .expect("the builder writes routes last")
        .to_string();
    let yaml = format!(
        "{base}routes:\n  - name: s\n    match: {{ hosts: [s.test] }}\n    upstream:\n      selection: {selection}\n{upstream}      members:\n{members}{more}"
    );
    let gws = (0..instances)
        .map(|_| Gateway::start_with_ports(&yaml))
        .collect();
    Setup {
        _store: None,
        _cluster: None,
        gws,
        backends,
    }
}

/// The member that answered a request of `session` (by `X-Session-Id`) on `path`, and its status.
async fn send(gw: &Gateway, session: &str, path: &str) -> (u16, String) {
    let r = request(
        gw.proxy_addr(),
        "GET",
        "s.test",
        path,
        &[("x-session-id", session)],
        b"",
    )
    .await;
    let member = r.header("x-upstream").unwrap_or_default().to_string();
    (r.status, member)
}

async fn member_of(setup: &Setup, i: usize, session: &str) -> String {
    let (status, member) = send(&setup.gws[i % setup.gws.len()], session, "/").await;
    assert_eq!(status, 200, "request {i} of {session}");
    member
}

/// The route's `sticky` in `/status`.
async fn sticky_status(gw: &Gateway) -> serde_json::Value {
    let status = gw.status().await;
    status["routes"][0]["sticky"].clone()
}

/// Round-robin alone would spread a session's requests over the three members: each session
/// stays on its first member through 100 requests, alternating gateways. Counted in `/status`
/// and the metrics of every gateway.
async fn a_session_stays_on_one_member_through_100_requests(backend: Backend) {
    let s = setup(
        backend,
        "round_robin",
        "      sticky: { key: \"header:X-Session-Id\" }\n",
    )
    .await;
    let mut firsts = BTreeSet::new();
    for session in ["alpha", "beta"] {
        let first = member_of(&s, 0, session).await;
        for i in 1..100 {
            assert_eq!(
                member_of(&s, i, session).await,
                first,
                "request {i} of {session}"
            );
        }
        firsts.insert(first);
    }
    // Without a session, round-robin as usual.
    let mut plain = BTreeSet::new();
    for _ in 0..3 {
        let r = request(s.gws[0].proxy_addr(), "GET", "s.test", "/", &[], b"").await;
        plain.insert(r.header("x-upstream").unwrap_or_default().to_string());
    }
    assert_eq!(plain.len(), 3, "{plain:?}");
    for gw in &s.gws {
        let sticky = sticky_status(gw).await;
        assert_eq!(sticky["bindings"], 2, "{sticky}");
        assert_eq!(sticky["unbound"], 0, "{sticky}");
        let bindings = gw.metric("sluice_sticky_bindings", &[("route", "s")]).await;
        assert_eq!(bindings, Some(2.0));
    }
    // The session key never reaches a log or the store: only its hash.
    for gw in &s.gws {
        assert!(
            !gw.logs().contains("alpha"),
            "the session key is in the log"
        );
    }
}

/// `rebind_on: [403]`, least-used: the session's member answers 403, so the session is routed
/// by the policy again (to the least used, another member) and stays there.
async fn a_listed_status_moves_the_session_and_it_stays(backend: Backend) {
    let s = setup(
        backend,
        "least_used",
        "      sticky: { key: \"header:X-Session-Id\", rebind_on: [403] }\n",
    )
    .await;
    let first = member_of(&s, 0, "s").await;
    for i in 1..5 {
        assert_eq!(member_of(&s, i, "s").await, first);
    }
    let (status, member) = send(&s.gws[1 % s.gws.len()], "s", "/status/403").await;
    assert_eq!((status, member.as_str()), (403, first.as_str()));
    let moved = member_of(&s, 0, "s").await;
    assert_ne!(moved, first, "a 403 moves the session");
    for i in 1..20 {
        assert_eq!(
            member_of(&s, i, "s").await,
            moved,
            "request {i} after the move"
        );
    }
    // A status not listed does not.
    let (status, _) = send(&s.gws[0], "s", "/status/500").await;
    assert_eq!(status, 500);
    assert_eq!(member_of(&s, 1, "s").await, moved);
    let sticky = sticky_status(&s.gws[0]).await;
    assert_eq!(sticky["moved"], 1, "{sticky}");
}

/// A bound member that cools (its 429 under `cooldown`) is not the session's any more: the
/// next request goes to another member, and the session stays there after the cooldown. The
/// cooldown (5 s) is far longer than a loaded machine takes between the 429 and the next request,
/// which must find b1 still cooling.
async fn a_cooling_member_moves_the_session(backend: Backend) {
    let s = setup(
        backend,
        "priority",
        "      cooldown: { on_status: [429], default: 5s }\n      sticky: { key: \"header:X-Session-Id\", rebind_on: [] }\n",
    )
    .await;
    // Priority sends everything to b1 first; the session's binding is b1.
    assert_eq!(member_of(&s, 0, "s").await, "b1");
    let (status, member) = send(&s.gws[0], "s", "/status/429").await;
    assert_eq!((status, member.as_str()), (429, "b1"));
    let moved = member_of(&s, 1, "s").await;
    assert_ne!(moved, "b1", "b1 cools: the session moves");
    // Once the cooldown is over, priority would go back to b1; the session stays.
    let gw = &s.gws[0];
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            let r = request(gw.proxy_addr(), "GET", "s.test", "/", &[], b"").await;
            r.header("x-upstream") == Some("b1")
        })
        .await,
        "b1 takes requests again"
    );
    for i in 0..10 {
        assert_eq!(member_of(&s, i, "s").await, moved);
    }
}

/// `max_bindings: 1`: the first session is bound; every later one is served all the same,
/// routed by the policy, and counted as unbound.
async fn a_full_table_still_serves_every_session(backend: Backend) {
    let s = setup(
        backend,
        "round_robin",
        "      sticky: { key: \"header:X-Session-Id\", max_bindings: 1 }\n",
    )
    .await;
    let first = member_of(&s, 0, "first").await;
    for i in 0..10 {
        member_of(&s, i, &format!("other-{i}")).await;
        assert_eq!(member_of(&s, i + 1, "first").await, first);
    }
    for gw in &s.gws {
        let sticky = sticky_status(gw).await;
        assert_eq!(sticky["bindings"], 1, "{sticky}");
        assert_eq!(sticky["unbound"], 10, "{sticky}");
        let unbound = gw
            .metric("sluice_sticky_unbound_total", &[("route", "s")])
            .await;
        assert_eq!(unbound, Some(10.0));
    }
}

/// A cookie names the session; so does the client (here, its address: every request of the
/// test comes from 127.0.0.1).
async fn sessions_by_cookie_and_by_client(backend: Backend) {
    let s = setup(
        backend,
        "round_robin",
        "      sticky: { key: \"cookie:sid\" }\n",
    )
    .await;
    for sid in ["one", "two", "three"] {
        let cookie = format!("theme=dark; sid={sid}");
        let mut seen = BTreeSet::new();
        for i in 0..12 {
            let gw = &s.gws[i % s.gws.len()];
            let r = request(
                gw.proxy_addr(),
                "GET",
                "s.test",
                "/",
                &[("cookie", &cookie)],
                b"",
            )
            .await;
            assert_eq!(r.status, 200);
            seen.insert(r.header("x-upstream").unwrap_or_default().to_string());
        }
        assert_eq!(seen.len(), 1, "session {sid}: {seen:?}");
    }
    drop(s);
    let s = setup(backend, "round_robin", "      sticky: { key: client }\n").await;
    let mut seen = BTreeSet::new();
    for i in 0..12 {
        let gw = &s.gws[i % s.gws.len()];
        let r = request(gw.proxy_addr(), "GET", "s.test", "/", &[], b"").await;
        assert_eq!(r.status, 200);
        seen.insert(r.header("x-upstream").unwrap_or_default().to_string());
    }
    assert_eq!(seen.len(), 1, "{seen:?}");
}

/// The session's member stops listening: a request fails to connect there and is retried on
/// another member (the binding moves with it), and the session stays on its new member.
async fn a_down_member_moves_the_session(backend: Backend) {
    let s = setup(
        backend,
        "round_robin",
        "      sticky: { key: \"header:X-Session-Id\" }\n",
    )
    .await;
    let first = member_of(&s, 0, "s").await;
    let down = s
        .backends
        .iter()
        .find(|b| b.name() == first)
        .expect("the member is a backend");
    down.stop().await;
    // A connection a gateway pooled before the stop still answers once (with `Connection:
    // close`); the first request that connects anew fails there and is retried elsewhere.
    let mut moved = first.clone();
    for i in 1..10 {
        moved = member_of(&s, i, "s").await;
        if moved != first {
            break;
        }
    }
    assert_ne!(moved, first, "retried on another member");
    for i in 0..20 {
        assert_eq!(
            member_of(&s, i, "s").await,
            moved,
            "request {i} after the move"
        );
    }
}

/// A proxy pool: every tunnel of one client leaves through the same proxy, on every gateway,
/// where least-used alone would spread them over the three.
async fn tunnels_of_a_client_leave_through_one_proxy(backend: Backend) {
    let store = Store::start(backend);
    let dir = TempDir::new("sticky-proxies");
    let proxies: Vec<Tinyproxy> = ["p1", "p2", "p3"]
        .iter()
        .map(|name| Tinyproxy::start(dir.path(), name, None))
        .collect();
    let backends = start_backends(&["origin"]).await;
    let target = backends[0].local_addr().to_string();
    let members: String = proxies
        .iter()
        .enumerate()
        .map(|(i, p)| format!("        - {{ proxy: \"{}\", name: p{} }}\n", p.url(), i + 1))
        .collect();
    let base = Config::new()
        .state(store.state())
        .egress(Egress::loopback_allowed().connect_ports(&[backends[0].local_addr().port()]))
        .yaml();
    let base = base.split("routes:").next().unwrap_or_default().to_string();
    let yaml = format!(
        "{base}routes:\n  - name: t\n    match: {{ hosts: [\"127.0.0.1\"] }}\n    upstream:\n      selection: least_used\n      sticky: {{ key: client }}\n      members:\n{members}"
    );
    let gws: Vec<Gateway> = (0..store.instances())
        .map(|_| Gateway::start_with_ports(&yaml))
        .collect();
    for i in 0..6 {
        let gw = &gws[i % gws.len()];
        let (mut tunnel, r) = support::open_tunnel(gw.proxy_addr(), &target, true).await;
        assert_eq!(r.status, 200, "tunnel {i}");
        let r = tunnel.request("GET", &target, "/", &[], b"").await.unwrap();
        assert_eq!(r.status, 200, "tunnel {i} carries a request");
    }
    let line = format!("CONNECT {target} ");
    let mut counts: Vec<usize> = Vec::new();
    for p in &proxies {
        counts.push(p.requests(&line).len());
    }
    let total: usize = counts.iter().sum();
    if total < 6 {
        // tinyproxy writes its log line a moment after the tunnel opens.
        let busiest = proxies
            .iter()
            .max_by_key(|p| p.requests(&line).len())
            .expect("proxies");
        busiest.wait_requests(&line, 6).await;
        counts = proxies.iter().map(|p| p.requests(&line).len()).collect();
    }
    counts.sort_unstable();
    assert_eq!(counts, [0, 0, 6], "one exit for the client");
}

/// A request that route `a` hands to its fallback `s` (a sticky route) is admitted with its
/// session on `s`: it stays on one member there too.
async fn a_fallback_route_keeps_its_own_sessions(backend: Backend) {
    let s = setup_with(
        backend,
        "round_robin",
        "      sticky: { key: \"header:X-Session-Id\" }\n",
        "  - name: a\n    match: { hosts: [a.test] }\n    upstream: { members: [] }\n    fallback: [{ route: s, on: [no_member] }]\n",
    )
    .await;
    let mut seen = BTreeSet::new();
    for i in 0..12 {
        let gw = &s.gws[i % s.gws.len()];
        let r = request(
            gw.proxy_addr(),
            "GET",
            "a.test",
            "/",
            &[("x-session-id", "f")],
            b"",
        )
        .await;
        assert_eq!(r.status, 200, "request {i}");
        seen.insert(r.header("x-upstream").unwrap_or_default().to_string());
    }
    assert_eq!(seen.len(), 1, "{seen:?}");
}

/// Two gateways on a Redis Cluster: a route's bindings live in its slot, and each session still
/// stays on one member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_stays_on_one_member_on_a_cluster() {
    let cluster = RedisCluster::start();
    let sticky = "      sticky: { key: \"header:X-Session-Id\" }\n";
    let mut s = setup_on(State::cluster(cluster.urls()), 2, "round_robin", sticky, "").await;
    s._cluster = Some(cluster);
    for session in ["alpha", "beta", "gamma"] {
        let first = member_of(&s, 0, session).await;
        for i in 1..30 {
            assert_eq!(
                member_of(&s, i, session).await,
                first,
                "request {i} of {session}"
            );
        }
    }
    let sticky = sticky_status(&s.gws[1]).await;
    assert_eq!(sticky["bindings"], 3, "{sticky}");
}
