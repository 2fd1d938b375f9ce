//! `rediss://`: the gateway keeps its shared state in a Redis it reaches over TLS, trusting a
//! private CA given as `state.redis.tls.ca`. Against a real `redis-server` with a TLS port and
//! certificates made for each test; the test inspects Redis through its plain port.

mod support;

use sluice_testkit::RedisServer;
use support::{start_backends, url, Config, HttpClient, Quota, Route, State};

/// The quota log of route `api`, window `minute`, key `route`.
const LOG: &str = "sluice:{api}:q:minute:route";

fn api_config(state: State, member: String) -> Config {
    Config::new().state(state).route(
        Route::new("api")
            .members([member])
            .quota(Quota::window("minute", 3, "1m").on_store_error("closed")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_route_counts_in_a_rediss_redis() {
    let redis = RedisServer::start_tls();
    let backends = start_backends(&["b1"]).await;
    let config = api_config(
        State::redis(redis.tls_url()).tls_ca(redis.ca_file()),
        url(backends[0].local_addr()),
    );
    config.check().expect("check accepts rediss:// with a CA");
    let gw = config.start();

    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        statuses.push(r.status);
    }
    // `on_store_error: closed` would answer 503 had Redis not been reached.
    assert_eq!(statuses, [200, 200, 200, 429], "{}", gw.logs());
    assert_eq!(redis.log_held(LOG), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_ca_the_redis_certificate_is_refused() {
    let redis = RedisServer::start_tls();
    let backends = start_backends(&["b1"]).await;
    // The system's roots do not include the test's CA, so the handshake fails and the route's
    // on_store_error (closed) applies; nothing is counted.
    let gw = api_config(
        State::redis(redis.tls_url()).timeout("1s"),
        url(backends[0].local_addr()),
    )
    .start();
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let r = client
        .request("GET", "api.test", "/", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", gw.logs());
    assert_eq!(redis.log_held(LOG), 0);
}

#[test]
fn check_names_a_missing_ca_file() {
    let missing =
        std::env::temp_dir().join(format!("sluice-no-such-ca-{}.pem", std::process::id()));
    let err = api_config(
        State::redis("rediss://:s3cret@127.0.0.1:6380/0").tls_ca(&missing),
        "http://127.0.0.1:9".into(),
    )
    .check()
    .expect_err("a missing CA file is refused");
    assert!(err.contains("state.redis.tls.ca"), "{err}");
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
}
