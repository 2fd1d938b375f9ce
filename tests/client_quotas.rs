//! Per-client quotas end to end: a client's own windows on every route it uses, decided with
//! the route's quota (a route that refuses charges the client nothing), `quota.key: client`
//! keyed by identity, and on Redis the client's windows shared by two gateways at one store
//! call per request; on a Redis Cluster, two calls, and the client's charge given back when
//! the route refuses.

mod support;

use sluice_testkit::RedisCluster;
use support::{
    start_backends, url, Backend, Config, Egress, Gateway, HttpClient, KeyMember, Quota, Response,
    Route, State, Store,
};

const BILLING: &str = "billing-token-0123456789";
const SEARCH: &str = "search-token-0123456789";

/// `config` with a `clients` section: `billing`, whose own quota is `daily` windows of
/// `limit` requests, and `search`, with no quota of its own; both may use every route and
/// reach every destination.
fn with_clients(config: &Config, limit: u64) -> String {
    format!(
        "{}clients:
  list:
    - name: billing
      tokens: [\"{BILLING}\"]
      routes: [\"*\"]
      destinations: [\"*\"]
      quota: {{ windows: [{{ name: daily, limit: {limit}, window: 1h }}] }}
    - name: search
      tokens: [\"{SEARCH}\"]
      routes: [\"*\"]
      destinations: [\"*\"]
",
        config.yaml()
    )
}

/// A request to `host` by the client holding `token`.
async fn call(client: &mut HttpClient, host: &str, token: &str) -> Response {
    let auth = format!("Bearer {token}");
    client
        .request("GET", host, "/", &[("Proxy-Authorization", &auth)], b"")
        .await
        .unwrap()
}

on_both_stores!(
    a_clients_own_quota_holds_on_every_route,
    a_route_that_refuses_charges_the_client_nothing,
    quota_key_client_counts_per_identity,
    tunnels_and_requests_share_the_clients_windows,
    websocket_upgrades_are_charged_like_requests,
    every_policy_charges_the_clients_windows,
);

/// `billing`'s three requests a day count on every route it uses, with or without a quota of
/// the route's own; the fourth is refused on each, naming the client's window, without reaching
/// a member. `search` is not limited by `billing`'s windows.
async fn a_clients_own_quota_holds_on_every_route(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1"]).await;
    let member = url(backends[0].local_addr());
    let config = Config::new().store(&store).routes([
        Route::new("api")
            .member(&member)
            .quota(Quota::window("rpm", 100, "1m")),
        Route::new("other").member(&member),
    ]);
    let gw = Gateway::start_with_ports(&with_clients(&config, 3));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for host in ["api.test", "other.test", "api.test"] {
        assert_eq!(call(&mut client, host, BILLING).await.status, 200, "{host}");
    }
    let refused = call(&mut client, "api.test", BILLING).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-sluice-error"), Some("quota_exceeded"));
    let body = refused.json();
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("billing") && detail.contains("daily"),
        "{detail}"
    );
    let retry_ms = body["retry_after_ms"].as_u64().unwrap();
    assert!(retry_ms > 0 && retry_ms <= 3_600_000, "{retry_ms}");
    assert!(refused.header("retry-after").is_some());
    // The route's RateLimit is the route's own window: untouched by the refusal.
    assert_eq!(refused.header("ratelimit"), Some("\"rpm\";r=98;t=60"));
    assert_eq!(call(&mut client, "other.test", BILLING).await.status, 429);
    assert_eq!(
        backends[0].proxied_requests(),
        3,
        "a refused request reaches no member"
    );
    for host in ["api.test", "other.test"] {
        assert_eq!(call(&mut client, host, SEARCH).await.status, 200);
    }
}

/// Every selection policy charges the client's windows, with or without member windows: the
/// client's quota travels with the route's to the store, whatever the policy does with it.
/// `billing` may make two requests per route; once it has, each route refuses the next.
async fn every_policy_charges_the_clients_windows(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1", "b2"]).await;
    let [a, b] = [0, 1].map(|i| url(backends[i].local_addr()));
    let routes = [
        Route::new("rr").member(&a).member(&b),
        Route::new("lu").least_used().member(&a).member(&b),
        Route::new("pr").priority().member(&a).member(&b),
        Route::new("kp")
            .least_used()
            .key_member(KeyMember::new(&a, "k1").window("rpm", 1_000, "1m"))
            .key_member(KeyMember::new(&b, "k2").window("rpm", 1_000, "1m")),
    ];
    let hosts = ["rr.test", "lu.test", "pr.test", "kp.test"];
    let config = Config::new().store(&store).routes(routes);
    let gw = Gateway::start_with_ports(&with_clients(&config, 2 * hosts.len() as u64));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for host in hosts {
        for _ in 0..2 {
            assert_eq!(call(&mut client, host, BILLING).await.status, 200, "{host}");
        }
    }
    for host in hosts {
        assert_eq!(call(&mut client, host, BILLING).await.status, 429, "{host}");
    }
}

/// A request that its route refuses is not charged to the client's own windows: it has the
/// same requests left as before it.
async fn a_route_that_refuses_charges_the_client_nothing(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1"]).await;
    let member = url(backends[0].local_addr());
    let config = Config::new().store(&store).routes([
        Route::new("tight")
            .member(&member)
            .quota(Quota::window("rpm", 1, "1m")),
        Route::new("other").member(&member),
    ]);
    let gw = Gateway::start_with_ports(&with_clients(&config, 3));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    assert_eq!(call(&mut client, "tight.test", BILLING).await.status, 200);
    for _ in 0..3 {
        let refused = call(&mut client, "tight.test", BILLING).await;
        assert_eq!(refused.status, 429);
        let detail = refused.json()["detail"].as_str().unwrap().to_string();
        assert!(detail.contains("\"rpm\""), "the route's window: {detail}");
    }
    // One of billing's three used: two left.
    for _ in 0..2 {
        assert_eq!(call(&mut client, "other.test", BILLING).await.status, 200);
    }
    assert_eq!(call(&mut client, "other.test", BILLING).await.status, 429);
}

/// `quota.key: client` keeps one quota per identified client: `billing` and `search` each get
/// the route's two requests, and a header cannot make one of them another.
async fn quota_key_client_counts_per_identity(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1"]).await;
    let config = Config::new().store(&store).route(
        Route::new("api")
            .member(url(backends[0].local_addr()))
            .quota(Quota::window("rpm", 2, "1m").key("client")),
    );
    let gw = Gateway::start_with_ports(&with_clients(&config, 1_000));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for token in [BILLING, SEARCH] {
        for _ in 0..2 {
            assert_eq!(call(&mut client, "api.test", token).await.status, 200);
        }
        let refused = call(&mut client, "api.test", token).await;
        assert_eq!(refused.status, 429);
        let ratelimit = refused.header("ratelimit").unwrap();
        assert!(ratelimit.contains(";pk="), "keyed: {ratelimit}");
    }
    assert_eq!(backends[0].proxied_requests(), 4);
}

/// A CONNECT tunnel is charged to its client's windows once, like a request, and one the
/// windows refuse is a 429 on the CONNECT itself.
async fn tunnels_and_requests_share_the_clients_windows(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["target"]).await;
    let target = backends[0].local_addr();
    let config = Config::new()
        .store(&store)
        .egress(Egress::loopback_allowed().connect_ports(&[target.port()]))
        .routes([
            Route::new("out").hosts(&["127.0.0.1"]).direct_member(),
            Route::new("api").member(url(target)),
        ]);
    let gw = Gateway::start_with_ports(&with_clients(&config, 2));
    let connect = |token: &str| {
        format!(
            "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Bearer {token}\r\n\r\n"
        )
    };
    let mut tunnel = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    tunnel.write_raw(connect(BILLING).as_bytes()).await.unwrap();
    assert_eq!(tunnel.read_response(true).await.unwrap().status, 200);
    drop(tunnel);
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    assert_eq!(call(&mut client, "api.test", BILLING).await.status, 200);
    let mut refused = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    refused
        .write_raw(connect(BILLING).as_bytes())
        .await
        .unwrap();
    let r = refused.read_response(false).await.unwrap();
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-sluice-error"), Some("quota_exceeded"));
    assert!(r.header("retry-after").is_some());
    let mut other = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    other.write_raw(connect(SEARCH).as_bytes()).await.unwrap();
    assert_eq!(other.read_response(true).await.unwrap().status, 200);
}

/// A WebSocket echo member on 127.0.0.1: each message comes back as it was.
async fn websocket_member() -> std::net::SocketAddr {
    use futures_util::{SinkExt, StreamExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                    return;
                };
                while let Some(Ok(message)) = ws.next().await {
                    if message.is_close() || ws.send(message).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// A WebSocket handshake through the gateway by the client holding `token`: the status it
/// got, after one message echoed when it is 101.
async fn websocket(gw: &Gateway, token: &str) -> u16 {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::{Error, Message};
    let mut request = "ws://ws.test/".into_client_request().unwrap();
    request.headers_mut().insert(
        "proxy-authorization",
        format!("Bearer {token}").parse().unwrap(),
    );
    let stream = tokio::net::TcpStream::connect(gw.proxy_addr())
        .await
        .unwrap();
    match tokio_tungstenite::client_async(request, stream).await {
        Ok((mut ws, response)) => {
            ws.send(Message::text("hello")).await.unwrap();
            let echoed = ws.next().await.unwrap().unwrap();
            assert_eq!(echoed, Message::text("hello"));
            response.status().as_u16()
        }
        Err(Error::Http(response)) => response.status().as_u16(),
        Err(other) => panic!("the handshake failed: {other}"),
    }
}

/// A WebSocket upgrade is admitted like any request: charged once to its client's windows,
/// and refused with a 429 once they are full.
async fn websocket_upgrades_are_charged_like_requests(backend: Backend) {
    let store = Store::start(backend);
    let member = websocket_member().await;
    let config = Config::new()
        .store(&store)
        .route(Route::new("ws").member(url(member)));
    let gw = Gateway::start_with_ports(&with_clients(&config, 2));
    assert_eq!(websocket(&gw, BILLING).await, 101);
    assert_eq!(websocket(&gw, BILLING).await, 101);
    assert_eq!(websocket(&gw, BILLING).await, 429);
    assert_eq!(websocket(&gw, SEARCH).await, 101);
}

/// On Redis, two gateways share `billing`'s windows exactly, and a request with a client's own
/// quota still costs one store call: one script call per request, checked with `INFO
/// commandstats` on the real `redis-server`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_a_clients_quota_at_one_store_call_a_request() {
    let store = Store::start(Backend::Redis);
    let redis = store.redis().unwrap();
    let backends = start_backends(&["b1"]).await;
    let config = Config::new().store(&store).route(
        Route::new("api")
            .member(url(backends[0].local_addr()))
            .quota(Quota::window("rpm", 1_000, "1m")),
    );
    let yaml = with_clients(&config, 4);
    let gateways = [
        Gateway::start_with_ports(&yaml),
        Gateway::start_with_ports(&yaml),
    ];
    let mut clients = Vec::new();
    for gw in &gateways {
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        // Each gateway's first call loads sluice's library (or scripts) into Redis.
        assert_eq!(call(&mut client, "api.test", SEARCH).await.status, 200);
        clients.push(client);
    }
    redis.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let mut statuses = Vec::new();
    for i in 0..6 {
        statuses.push(call(&mut clients[i % 2], "api.test", BILLING).await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429]);
    let calls = redis.command_calls("fcall") + redis.command_calls("evalsha");
    assert_eq!(calls, 6, "one script call per request");
}

/// On a Redis Cluster a client's windows are in a slot of their own: a request costs two script
/// calls (the client's, then the route's), and one its route refuses costs a third, which gives
/// the client's charge back: the client's log holds exactly the admitted requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_two_calls_and_the_give_back() {
    let cluster = RedisCluster::start();
    let backends = start_backends(&["b1"]).await;
    let config = Config::new().state(State::cluster(cluster.urls())).route(
        Route::new("api")
            .member(url(backends[0].local_addr()))
            .quota(Quota::window("rpm", 3, "1m")),
    );
    let gw = Gateway::start_with_ports(&with_clients(&config, 100));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    // The first request loads sluice's library on every master.
    assert_eq!(call(&mut client, "api.test", BILLING).await.status, 200);
    let log = "sluice:{client:billing}:cq:daily";
    let master = cluster.master_of(log).expect("a master serves the client");
    let node = &cluster.nodes()[cluster.index_of(master)];
    let entries = || node.log_held(log);
    let calls = || -> u64 {
        cluster
            .nodes()
            .iter()
            .map(|n| n.command_calls("fcall") + n.command_calls("evalsha"))
            .sum()
    };
    assert_eq!(entries(), 1);
    for n in cluster.nodes() {
        n.command(&["CONFIG", "RESETSTAT"]).unwrap();
    }
    for _ in 0..2 {
        assert_eq!(call(&mut client, "api.test", BILLING).await.status, 200);
    }
    assert_eq!(calls(), 4, "two calls a request");
    assert_eq!(entries(), 3);
    for n in cluster.nodes() {
        n.command(&["CONFIG", "RESETSTAT"]).unwrap();
    }
    let refused = call(&mut client, "api.test", BILLING).await;
    assert_eq!(refused.status, 429, "the route's window is full");
    assert_eq!(calls(), 3, "the client's, the route's and the give-back");
    assert_eq!(entries(), 3, "the client's count did not move");
}
