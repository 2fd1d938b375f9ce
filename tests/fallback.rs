//! A route's `fallback`, end to end: the real sluice binary in front of real backends, one per
//! route, each counting what it got, on the memory store and on Redis. A request goes on to
//! the next route when its own cannot serve it (its quota refuses, or its member answers 429,
//! or 503 with `Retry-After`), once, with the next route's own quota; an answer from a member
//! that may have done the work (a 500) is never sent again.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use sluice_echo::{EchoOptions, EchoServer};
use support::{request, url, Backend, Config, Gateway, Quota, Route, Store};

const DEADLINE: Duration = Duration::from_secs(20);

/// A backend that counts and logs every request, and answers 429 when a test scripts it
/// (`refuse_next` on the empty key: sluice sends no `Authorization`).
async fn backend(name: &str) -> EchoServer {
    let options = EchoOptions::key_limited(1_000_000, Duration::from_secs(60));
    EchoServer::start_with(name, SocketAddr::from(([127, 0, 0, 1], 0)), options)
        .await
        .expect("start a backend")
}

/// The access line of the request to `path`.
async fn access_line(gw: &Gateway, path: &str) -> serde_json::Value {
    let needle = format!("\"path\":\"{path}\"");
    assert!(gw.wait_for_log(&needle, DEADLINE).await, "{path} is logged");
    gw.log_json()
        .into_iter()
        .find(|l| l["target"] == "sluice::access" && l["path"] == path)
        .unwrap_or_else(|| panic!("the access line of {path}"))
}

/// Route `a` falls back to `b` on a 429 of its only member: the request reaches each backend
/// once, the client gets `b`'s answer, and the body `b` got is the one the client sent. A 500
/// is never re-sent, and neither is a body past the 64 KiB replay buffer.
async fn a_429_goes_once_to_the_fallback_route(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    let (a, b) = (backend("a").await, backend("b").await);
    let config = Config::new().store(&store).routes([
        Route::new("a")
            .member(url(a.local_addr()))
            .fallback("b", &["429", "503"]),
        Route::new("b").member(url(b.local_addr())),
    ]);
    let gw = config.start();
    a.refuse_next("", 1, "5").unwrap();

    let body = br#"{"model":"m","prompt":"hello"}"#.repeat(40);
    let headers = [("Content-Type", "application/json")];
    let r = request(gw.proxy_addr(), "POST", "a.test", "/chat", &headers, &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("b"));
    assert_eq!((a.proxied_requests(), b.proxied_requests()), (1, 1));
    let got = b.request_log();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].body_len, body.len() as u64, "the whole body went on");
    assert_eq!(got[0].body_sha256, a.request_log()[0].body_sha256);
    let line = access_line(&gw, "/chat").await;
    assert_eq!(line["route"], "b", "{line}");
    assert_eq!(line["fallback_from"], serde_json::json!(["a"]), "{line}");
    let hops = gw
        .metric(
            "sluice_fallbacks_total",
            &[("from", "a"), ("to", "b"), ("reason", "429")],
        )
        .await;
    assert_eq!(hops, Some(1.0));

    // A 500: the member may have done the work.
    let r = request(gw.proxy_addr(), "GET", "a.test", "/status/500", &[], b"").await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("a"));
    assert_eq!((a.proxied_requests(), b.proxied_requests()), (2, 1));

    // A 429 to a body too large to replay: the member's answer is the client's.
    a.refuse_next("", 1, "5").unwrap();
    let large = vec![b'x'; 70 * 1024];
    let r = request(gw.proxy_addr(), "POST", "a.test", "/big", &headers, &large).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("a"));
    assert_eq!((a.proxied_requests(), b.proxied_requests()), (3, 1));
}

/// Route `a`'s quota (1 a minute) refuses the second request, which `b` serves under its own
/// quota (2 a minute); past both, the client gets `b`'s refusal.
async fn a_refusing_quota_hands_over_to_the_fallback_routes_quota(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    let (a, b) = (backend("a").await, backend("b").await);
    let config = Config::new().store(&store).routes([
        Route::new("a")
            .member(url(a.local_addr()))
            .quota(Quota::window("minute", 1, "1m"))
            .fallback("b", &["quota_exceeded"]),
        Route::new("b")
            .member(url(b.local_addr()))
            .quota(Quota::window("minute", 2, "1m")),
    ]);
    let gw = config.start();
    let mut served = Vec::new();
    for i in 0..4 {
        let r = request(
            gw.proxy_addr(),
            "GET",
            "a.test",
            &format!("/q{i}"),
            &[],
            b"",
        )
        .await;
        served.push((r.status, r.header("x-upstream").map(str::to_string)));
    }
    let upstream = |s: &str| Some(s.to_string());
    assert_eq!(
        served,
        [
            (200, upstream("a")),
            (200, upstream("b")),
            (200, upstream("b")),
            (429, None)
        ]
    );
    assert_eq!((a.proxied_requests(), b.proxied_requests()), (1, 2));
    let refused = access_line(&gw, "/q3").await;
    assert_eq!(refused["route"], "b", "b's quota refused it: {refused}");
    assert_eq!(refused["error"], "quota_exceeded", "{refused}");
    assert_eq!(refused["fallback_from"], serde_json::json!(["a"]));
}

/// A chain: `a`'s member answers 429, `b`'s quota is spent, so `c` serves, and the access line
/// names both routes left.
async fn a_chain_goes_on_through_each_route(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    let (a, b, c) = (backend("a").await, backend("b").await, backend("c").await);
    let config = Config::new().store(&store).routes([
        Route::new("a")
            .member(url(a.local_addr()))
            .fallback("b", &["429"]),
        Route::new("b")
            .member(url(b.local_addr()))
            .quota(Quota::window("minute", 1, "1m"))
            .fallback("c", &["quota_exceeded"]),
        Route::new("c").member(url(c.local_addr())),
    ]);
    let gw = config.start();
    let first = request(gw.proxy_addr(), "GET", "b.test", "/spend", &[], b"").await;
    assert_eq!(first.header("x-upstream"), Some("b"), "{}", first.text());

    a.refuse_next("", 1, "5").unwrap();
    let r = request(gw.proxy_addr(), "GET", "a.test", "/chain", &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("c"));
    let counts = (
        a.proxied_requests(),
        b.proxied_requests(),
        c.proxied_requests(),
    );
    assert_eq!(counts, (1, 1, 1), "b's only request is /spend");
    let line = access_line(&gw, "/chain").await;
    assert_eq!(line["route"], "c", "{line}");
    assert_eq!(
        line["fallback_from"],
        serde_json::json!(["a", "b"]),
        "{line}"
    );
}

/// After `a`'s member answers 429, `b`'s quota refuses the request: the client gets `b`'s
/// refusal, not `a`'s 429, and nothing more reaches either backend.
async fn after_a_429_the_fallback_routes_refusal_is_the_answer(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    let (a, b) = (backend("a").await, backend("b").await);
    let config = Config::new().store(&store).routes([
        Route::new("a")
            .member(url(a.local_addr()))
            .fallback("b", &["429"]),
        Route::new("b")
            .member(url(b.local_addr()))
            .quota(Quota::window("minute", 1, "1m")),
    ]);
    let gw = config.start();
    let spend = request(gw.proxy_addr(), "GET", "b.test", "/spend", &[], b"").await;
    assert_eq!(spend.header("x-upstream"), Some("b"), "{}", spend.text());

    a.refuse_next("", 1, "5").unwrap();
    let r = request(gw.proxy_addr(), "GET", "a.test", "/refused", &[], b"").await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("x-upstream"), None, "sluice's answer, not a's");
    assert_eq!(r.json()["error"]["code"], "quota_exceeded", "{}", r.text());
    assert_eq!(r.json()["route"], "b", "{}", r.text());
    assert!(r.header("retry-after").is_some());
    assert_eq!((a.proxied_requests(), b.proxied_requests()), (1, 1));
    let line = access_line(&gw, "/refused").await;
    assert_eq!(line["route"], "b", "{line}");
    assert_eq!(line["status"], 429, "{line}");
    assert_eq!(line["error"], "quota_exceeded", "{line}");
    assert_eq!(line["fallback_from"], serde_json::json!(["a"]), "{line}");
}

/// What route `a`'s token window holds, from `/status`.
async fn a_holds(gw: &Gateway) -> u64 {
    let status = gw.status().await;
    let route = status["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "a")
        .unwrap()
        .clone();
    let w = &route["quota"][0];
    let limit = w["limit"].as_u64().unwrap();
    limit - w["remaining"].as_u64().unwrap_or(limit)
}

/// Routes `a` and `b` over backends `a` and `b`, `a` falling back to `b` on a 429, as a YAML
/// value a test adds to.
fn a_429_to_b(store: &Store, a: &EchoServer, b: &EchoServer) -> serde_json::Value {
    let base = Config::new()
        .store(store)
        .routes([
            Route::new("a")
                .member(url(a.local_addr()))
                .fallback("b", &["429"]),
            Route::new("b").member(url(b.local_addr())),
        ])
        .yaml();
    serde_yaml::from_str(&base).unwrap()
}

/// On a usage-metered route, the request that leaves after its member's 429 settles its
/// reservation there to 0: the member did no work, and `b` serves it.
async fn the_route_left_settles_its_reservation_to_zero(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    let (a, b) = (backend("a").await, backend("b").await);
    let mut config = a_429_to_b(&store, &a, &b);
    config["routes"][0]["quota"] = serde_yaml::from_str(
        r#"
windows: [{ name: tpm, limit: 1000, window: 1m, unit: tokens }]
usage:
  tokens:
    reserve: { json: "max_tokens", default: 100 }
    settle: { json: "usage.total_tokens" }
"#,
    )
    .unwrap();
    let gw = Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());

    a.refuse_next("", 1, "5").unwrap();
    let body = br#"{"model":"m","max_tokens":70}"#;
    let headers = [("Content-Type", "application/json")];
    let r = request(gw.proxy_addr(), "POST", "a.test", "/chat", &headers, body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("b"));
    assert!(
        support::wait_until_async(DEADLINE, || async { a_holds(&gw).await == 0 }).await,
        "a's window holds {} tokens, not 0",
        a_holds(&gw).await
    );
}

/// One request is one request to its client's own quota, whichever routes it goes through: a
/// client allowed 2 requests a minute has one answered by `b` after `a`'s 429, and its second
/// is served too. Both with plain routes and with routes that meter tokens (where the client's
/// windows go through the request's reservation, and settle with it).
async fn a_fallback_counts_the_request_once_in_the_clients_windows(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    for metered in [false, true] {
        let (a, b) = (backend("a").await, backend("b").await);
        let mut config = a_429_to_b(&store, &a, &b);
        let name = if metered { "metered" } else { "plain" };
        config["clients"] = serde_yaml::from_str(&format!(
            r#"
list:
  - name: {name}
    tokens: ["{name}-token-0123456789"]
    routes: ["*"]
    quota: {{ windows: [{{ name: rpm, limit: 2, window: 1m }}] }}
"#
        ))
        .unwrap();
        if metered {
            let quota: serde_json::Value = serde_yaml::from_str(
                r#"
windows: [{ name: tpm, limit: 1000, window: 1m, unit: tokens }]
usage:
  tokens:
    reserve: { json: "max_tokens", default: 100 }
    settle: { json: "usage.total_tokens" }
"#,
            )
            .unwrap();
            config["routes"][0]["quota"] = quota.clone();
            config["routes"][1]["quota"] = quota;
        }
        let gw = Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());
        let auth = format!("Bearer {name}-token-0123456789");
        let headers = [
            ("Proxy-Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
        ];
        let body = br#"{"model":"m","max_tokens":70}"#;
        a.refuse_next("", 1, "5").unwrap();
        let r = request(gw.proxy_addr(), "POST", "a.test", "/one", &headers, body).await;
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        assert_eq!(r.header("x-upstream"), Some("b"));
        // Once the request has settled (nothing reserved any more), it holds one.
        let window = || async {
            let status = gw.status().await;
            status["clients"]["list"][0]["quota"][0].clone()
        };
        let settled = support::wait_until_async(DEADLINE, || async {
            window().await["reserved"].as_f64() == Some(0.0)
        })
        .await;
        assert!(settled, "{name}: {}", window().await);
        assert_eq!(window().await["remaining"], 1, "{name}: {}", window().await);
        let r = request(gw.proxy_addr(), "POST", "a.test", "/two", &headers, body).await;
        assert_eq!(r.status, 200, "{name}: the second of 2: {}", r.text());
        assert_eq!(r.header("x-upstream"), Some("a"));
        let r = request(gw.proxy_addr(), "POST", "a.test", "/three", &headers, body).await;
        assert_eq!(r.status, 429, "{name}: the third of 2: {}", r.text());
    }
}

/// A client granted `a` but not `b` gets from `b` what it would get sent there directly: `403
/// route_denied`, after `a`'s 429; `b`'s member sees nothing. A client granted both is served
/// by `b`.
async fn the_fallback_route_checks_the_client_as_its_own(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    let (a, b) = (backend("a").await, backend("b").await);
    let mut config = a_429_to_b(&store, &a, &b);
    config["clients"] = serde_yaml::from_str(
        r#"
list:
  - { name: only-a, tokens: ["only-a-token-0123456789"], routes: [a] }
  - { name: both, tokens: ["both-token-0123456789ab"], routes: [a, b] }
"#,
    )
    .unwrap();
    let gw = Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());
    let as_client = |token: &'static str| [("Proxy-Authorization", format!("Bearer {token}"))];

    a.refuse_next("", 1, "5").unwrap();
    let only_a = as_client("only-a-token-0123456789");
    let headers = [(only_a[0].0, only_a[0].1.as_str())];
    let r = request(gw.proxy_addr(), "GET", "a.test", "/only-a", &headers, b"").await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "route_denied", "{}", r.text());
    assert_eq!((a.proxied_requests(), b.proxied_requests()), (1, 0));

    a.refuse_next("", 1, "5").unwrap();
    let both = as_client("both-token-0123456789ab");
    let headers = [(both[0].0, both[0].1.as_str())];
    let r = request(gw.proxy_addr(), "GET", "a.test", "/both", &headers, b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("b"));
    assert_eq!((a.proxied_requests(), b.proxied_requests()), (2, 1));
}

/// A token the client sent in route `a`'s `client_token` header is for sluice alone: `a`'s
/// member does not get it, and after `a`'s 429 neither does `b`'s, though `b` identifies by no
/// header of its own (its member is another origin, perhaps another provider). In `report`
/// mode the client goes on to `b`, which it is not granted.
async fn the_route_lefts_client_token_does_not_go_on(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    let (a, b) = (backend("a").await, backend("b").await);
    let mut config = a_429_to_b(&store, &a, &b);
    config["routes"][0]["client_token"] = "authorization".into();
    config["clients"] = serde_yaml::from_str(
        r#"
mode: report
list:
  - { name: svc, tokens: ["svc-token-0123456789ab"], routes: [a] }
"#,
    )
    .unwrap();
    let gw = Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());

    a.refuse_next("", 1, "5").unwrap();
    let headers = [("Authorization", "Bearer svc-token-0123456789ab")];
    let r = request(gw.proxy_addr(), "GET", "a.test", "/token", &headers, b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("b"));
    assert_eq!((a.proxied_requests(), b.proxied_requests()), (1, 1));
    assert_eq!(a.request_log()[0].key, "", "the token is removed on `a`");
    assert_eq!(b.request_log()[0].key, "", "and stays removed on `b`");
}

/// A route with no member to offer hands the request over before anything is sent.
async fn no_member_goes_to_the_fallback_route(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    let b = backend("b").await;
    let config = Config::new().store(&store).routes([
        Route::new("a").fallback("b", &["no_member"]),
        Route::new("b").member(url(b.local_addr())),
    ]);
    let gw = config.start();
    let r = request(gw.proxy_addr(), "GET", "a.test", "/empty", &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("b"));
    let line = access_line(&gw, "/empty").await;
    assert_eq!(line["fallback_from"], serde_json::json!(["a"]), "{line}");
    let hops = gw
        .metric(
            "sluice_fallbacks_total",
            &[("from", "a"), ("to", "b"), ("reason", "no_member")],
        )
        .await;
    assert_eq!(hops, Some(1.0));
}

/// Provisioned, then on demand: the provisioned member's 429 cools it, and while it cools its
/// route offers no member, so later requests go to `b` before anything reaches `a`.
async fn a_cooling_member_sends_later_requests_on_before_it(backend_kind: Backend) {
    let store = Store::start(backend_kind);
    let (a, b) = (backend("a").await, backend("b").await);
    let config = Config::new().store(&store).routes([
        Route::new("a")
            .member(url(a.local_addr()))
            .cooldown(support::Cooldown::new())
            .fallback("b", &["429", "quota_exceeded"]),
        Route::new("b").member(url(b.local_addr())),
    ]);
    let gw = config.start();
    a.refuse_next("", 1, "60").unwrap();
    for i in 0..3 {
        let r = request(
            gw.proxy_addr(),
            "GET",
            "a.test",
            &format!("/c{i}"),
            &[],
            b"",
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-upstream"), Some("b"));
    }
    assert_eq!((a.proxied_requests(), b.proxied_requests()), (1, 3));
    let cooling = gw
        .metric(
            "sluice_fallbacks_total",
            &[("from", "a"), ("to", "b"), ("reason", "quota_exceeded")],
        )
        .await;
    assert_eq!(cooling, Some(2.0));
}

on_both_stores!(
    a_429_goes_once_to_the_fallback_route,
    a_refusing_quota_hands_over_to_the_fallback_routes_quota,
    a_chain_goes_on_through_each_route,
    after_a_429_the_fallback_routes_refusal_is_the_answer,
    the_route_left_settles_its_reservation_to_zero,
    the_fallback_route_checks_the_client_as_its_own,
    the_route_lefts_client_token_does_not_go_on,
    a_fallback_counts_the_request_once_in_the_clients_windows,
    no_member_goes_to_the_fallback_route,
    a_cooling_member_sends_later_requests_on_before_it,
);

/// `sluice check` refuses a cycle, naming it.
#[test]
fn check_refuses_a_fallback_cycle() {
    let config = Config::new().routes([
        Route::new("a")
            .member("http://127.0.0.1:1")
            .fallback("b", &["429"]),
        Route::new("b")
            .member("http://127.0.0.1:1")
            .fallback("a", &["quota_exceeded"]),
    ]);
    let refused = config.check().expect_err("a cycle is refused");
    assert!(refused.contains("fallback cycle: a -> b -> a"), "{refused}");
}

/// The egress guard holds on the route a request falls back to: after route `a`'s member
/// answered 429, a destination the client wrote as a loopback address is refused on `b`, whose
/// proxy member would carry it anywhere, before the proxy is contacted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fallback_route_checks_an_address_destination() {
    let dir = support::TempDir::new("fallback-guard");
    let proxy = support::tinyproxy::Tinyproxy::start(dir.path(), "proxy", None);
    let a = backend("a").await;
    let gw = Config::new()
        .routes([
            Route::new("a")
                .hosts(&["127.0.0.1"])
                .member(url(a.local_addr()))
                .fallback("b", &["429"]),
            Route::new("b").hosts(&["b.test"]).proxy_member(proxy.url()),
        ])
        .start();
    a.refuse_next("", 1, "5").unwrap();
    let target = format!("http://{}/x", a.local_addr());
    let mut client = support::HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let r = client
        .send(
            &format!("GET {target} HTTP/1.1\r\nHost: {}\r\n\r\n", a.local_addr()),
            b"",
        )
        .await
        .unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("destination_denied"));
    assert!(
        proxy.requests("GET").is_empty(),
        "the proxy was not contacted"
    );
}
