//! Least-used selection end to end: the spread, `/status` counts, fairness across every gateway
//! sharing the store (also with a member that fails every request), down members, restore
//! policies, and, on Redis only, one Redis command per request, the round-robin fallback when
//! Redis is gone, and a member only another instance knows.

mod support;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sluice_testkit::RedisServer;
use support::{
    dead_url, request, start_backends, url, Backend, Config, Gateway, HealthCheck, HttpClient,
    KeyMember, Passive, Quota, Route, State, Store,
};

// Every behaviour that does not need Redis itself runs on both stores; the Redis-only ones
// below say why.
on_both_stores!(
    spreads_evenly_and_status_shows_counts,
    concurrent_clients_keep_counts_within_one,
    failed_requests_still_count_so_a_failing_member_stays_within_one,
    down_members_are_skipped_and_no_member_costs_no_quota,
    on_restore_min_gives_a_revived_member_no_burst,
    on_restore_keep_lets_a_revived_member_catch_up,
    a_down_members_trial_obeys_its_windows_and_is_counted,
);

/// The least-used route `pool` (host `pool.test`) over `members`, with two retries.
fn pool(members: &[String]) -> Route {
    Route::new("pool").least_used().retries(2).members(members)
}

fn spread(counts: impl IntoIterator<Item = u64>) -> u64 {
    let v: Vec<u64> = counts.into_iter().collect();
    v.iter().max().unwrap() - v.iter().min().unwrap()
}

/// Assignment counts from the pool's sorted set.
fn redis_counts(redis: &RedisServer) -> HashMap<String, u64> {
    redis
        .zrange_with_scores("sluice:{pool}:pool")
        .into_iter()
        .map(|(m, c)| (m, c as u64))
        .collect()
}

/// Assignment counts as `/status` shows them, by member URL.
async fn status_counts(gw: &Gateway) -> HashMap<String, u64> {
    let status = gw.status().await;
    status["routes"][0]["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| {
            (
                m["url"].as_str().expect("url").to_string(),
                m["assignments"].as_u64().expect("assignments"),
            )
        })
        .collect()
}

async fn spreads_evenly_and_status_shows_counts(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = Config::new().store(&store).route(pool(&members)).start();
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..30 {
        assert_eq!(
            client
                .request("GET", "pool.test", "/", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    assert_eq!(
        backends
            .iter()
            .map(|b| b.proxied_requests())
            .collect::<Vec<_>>(),
        [10, 10, 10]
    );
    let status = gw.status().await;
    let route = &status["routes"][0];
    assert_eq!(route["selection"], "least_used");
    let shown = route["members"].as_array().unwrap();
    assert_eq!(shown.len(), 3);
    for m in shown {
        assert_eq!(m["assignments"], 10, "{m}");
    }
    if let Some(redis) = store.redis() {
        assert_eq!(redis_counts(redis), status_counts(&gw).await);
    }
}

/// 32 concurrent clients on every gateway that shares the store (one on memory, two on
/// Redis), 5,120 requests in all; with `with_failing_member`, one member hangs up on every
/// request it gets.
async fn clients_stay_fair(backend: Backend, with_failing_member: bool) {
    let store = Store::start(backend);
    let n_good = if with_failing_member { 4 } else { 5 };
    let names = ["m1", "m2", "m3", "m4", "m5"];
    let backends = start_backends(&names[..n_good]).await;
    let mut members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let failing = if with_failing_member {
        let (addr, got) = support::start_hang_up_member().await;
        members.push(url(addr));
        Some(got)
    } else {
        None
    };
    let config = Config::new().store(&store).route(pool(&members));
    let gateways: Vec<Gateway> = (0..store.instances()).map(|_| config.start()).collect();

    let mut tasks = Vec::new();
    for c in 0..32 {
        let addr = gateways[c % gateways.len()].proxy_addr();
        tasks.push(tokio::spawn(async move {
            let mut statuses = HashMap::new();
            for _ in 0..160 {
                // A fresh connection per request: the failing member breaks the connection.
                let status = support::try_request(addr, "GET", "pool.test", "/", &[], b"")
                    .await
                    .map(|r| r.status)
                    .unwrap_or(0);
                *statuses.entry(status).or_insert(0u64) += 1;
            }
            statuses
        }));
    }
    let mut statuses: HashMap<u16, u64> = HashMap::new();
    for t in tasks {
        for (s, n) in t.await.unwrap() {
            *statuses.entry(s).or_default() += n;
        }
    }
    let counts = status_counts(&gateways[0]).await;
    let mut received: Vec<u64> = backends.iter().map(|b| b.proxied_requests()).collect();
    if let Some(got) = &failing {
        received.push(got.load(Ordering::SeqCst));
    }
    println!("statuses {statuses:?}; counts {counts:?}; received {received:?}");
    if let Some(redis) = store.redis() {
        assert_eq!(
            redis_counts(redis),
            counts,
            "/status shows the Redis counts"
        );
        for gw in &gateways[1..] {
            assert_eq!(status_counts(gw).await, counts, "every gateway sees them");
        }
    }
    assert_eq!(counts.len(), members.len());
    assert_eq!(
        counts.values().sum::<u64>(),
        5120,
        "every request is one assignment"
    );
    assert!(spread(counts.values().copied()) <= 1, "counts {counts:?}");
    assert!(
        spread(received.iter().copied()) <= 1,
        "received {received:?}"
    );
    assert_eq!(
        received.iter().sum::<u64>(),
        5120,
        "every request reached exactly one member"
    );
    if with_failing_member {
        assert!(received[4] > 0);
        assert_eq!(
            statuses.get(&502).copied(),
            Some(received[4]),
            "failures are not retried"
        );
        assert_eq!(statuses.get(&200).copied(), Some(5120 - received[4]));
    } else {
        assert_eq!(statuses.get(&200).copied(), Some(5120));
    }
}

async fn concurrent_clients_keep_counts_within_one(backend: Backend) {
    clients_stay_fair(backend, false).await;
}

async fn failed_requests_still_count_so_a_failing_member_stays_within_one(backend: Backend) {
    clients_stay_fair(backend, true).await;
}

async fn down_members_are_skipped_and_no_member_costs_no_quota(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["alive"]).await;
    let dead = dead_url();
    let members = [dead.clone(), url(backends[0].local_addr())];
    let gw = Config::new()
        .store(&store)
        .route(
            pool(&members)
                .passive(Passive::cooldown("1h"))
                .quota(Quota::window("minute", 100, "1m")),
        )
        .start();
    // Whichever member is the lexically smaller, connect failures are retried on a new
    // assignment and the dead member is ejected.
    for _ in 0..10 {
        let r = request(gw.proxy_addr(), "POST", "pool.test", "/", &[], b"x").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(backends[0].proxied_requests(), 10);
    let status = gw.status().await;
    let dead_member = status["routes"][0]["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["url"] == dead.as_str())
        .unwrap()
        .clone();
    assert_eq!(dead_member["healthy"], false);
    assert!(
        dead_member["assignments"].as_u64().unwrap() <= 1,
        "ejected after one failure"
    );

    // With every member down: 503 no_member, and the quota is not charged.
    backends[0].stop().await;
    // A pooled connection may serve one more request; the next connect fails and ejects it.
    // Every request answered otherwise than 503 was admitted, and charged.
    let mut charged = 10;
    let mut r = request(gw.proxy_addr(), "GET", "pool.test", "/", &[], b"").await;
    for _ in 0..5 {
        if r.status == 503 {
            break;
        }
        charged += 1;
        r = request(gw.proxy_addr(), "GET", "pool.test", "/", &[], b"").await;
    }
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("no_member"));
    // A route with a quota reports it on every response, this one included, so compare real
    // values: two absent headers would prove nothing.
    let remaining = |r: &support::Response| -> u64 {
        let header = r
            .header("ratelimit")
            .unwrap_or_else(|| panic!("a 503 on a quota route carries RateLimit: {:?}", r.headers));
        header
            .split(';')
            .find_map(|p| p.trim().strip_prefix("r="))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no r= in RateLimit: {header}"))
    };
    assert_eq!(remaining(&r), 100 - charged, "nothing charged for the 503");
    let again = request(gw.proxy_addr(), "GET", "pool.test", "/", &[], b"").await;
    assert_eq!(again.status, 503);
    assert_eq!(remaining(&again), 100 - charged, "no quota consumed");
}

/// A down member's trial request is an assignment like any other: counted in the pool, and
/// charged to the member's own windows, which it must fit. Member `a` (2 requests an hour of
/// its own) fails its first request, comes back, and gets its trial: that spends its second
/// request, so it gets nothing more this hour, and its count is 2.
async fn a_down_members_trial_obeys_its_windows_and_is_counted(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b"]).await;
    let port = support::free_port();
    let a_url = format!("http://127.0.0.1:{port}");
    let gw = Config::new()
        .store(&store)
        .route(
            Route::new("pool")
                .least_used()
                .retries(1)
                .passive(Passive::cooldown("1s"))
                .key_member(KeyMember::new(a_url, "a").window("hour", 2, "1h"))
                .key_member(KeyMember::new(url(backends[0].local_addr()), "b")),
        )
        .start();
    let send = || async {
        let r = request(gw.proxy_addr(), "GET", "pool.test", "/", &[], b"").await;
        assert_eq!(r.status, 200, "{}", r.text());
    };
    let assignments = |status: serde_json::Value, name: &str| {
        status["routes"][0]["members"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["name"] == name))
            .and_then(|m| m["assignments"].as_u64())
            .unwrap_or_else(|| panic!("member {name} in {status}"))
    };
    // Ties go to the smallest name: `a` is assigned first, fails to connect, goes down, and
    // the retry goes to `b`.
    send().await;
    assert_eq!(assignments(gw.status().await, "a"), 1);
    let a = sluice_echo::EchoServer::start("a", ([127, 0, 0, 1], port).into())
        .await
        .expect("start member a on its port");
    let tried = support::wait_until_async(Duration::from_secs(20), || async {
        send().await;
        a.proxied_requests() > 0
    })
    .await;
    assert!(tried, "a gets its trial once its cooldown is over");
    assert_eq!(
        assignments(gw.status().await, "a"),
        2,
        "the trial is counted in the pool"
    );
    for _ in 0..5 {
        send().await;
    }
    assert_eq!(
        a.proxied_requests(),
        1,
        "the trial spent a's second request of the hour"
    );
}

/// The memory store drops a least-used pool when a reload removes its route: reloads that
/// come and go would otherwise grow the store for good. Seen from outside: a route that comes
/// back starts a fresh pool, its counts at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_route_removed_by_a_reload_drops_its_pool() {
    let backends = start_backends(&["b1", "b2"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let with_pool = Config::new()
        .route(pool(&members))
        .route(Route::new("other").members(&members));
    let without_pool = Config::new().route(Route::new("other").members(&members));
    let gw = with_pool.start();
    for _ in 0..4 {
        let r = request(gw.proxy_addr(), "GET", "pool.test", "/", &[], b"").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(status_counts(&gw).await.values().sum::<u64>(), 4);
    let reload = |config: &Config| {
        gw.write_config_template(&config.yaml());
        async {
            let r = gw.post_reload().await;
            assert_eq!(r.status, 200, "{}", r.text());
        }
    };
    reload(&without_pool).await;
    assert_eq!(
        request(gw.proxy_addr(), "GET", "pool.test", "/", &[], b"")
            .await
            .status,
        404,
        "the route is gone"
    );
    reload(&with_pool).await;
    assert_eq!(
        status_counts(&gw).await.values().sum::<u64>(),
        0,
        "the route came back to a fresh pool: the old one was dropped"
    );
}

/// Takes the second of two members down with its active check, sends 20 requests, brings it
/// back, and returns how many of the next 10 requests it took, and every backend's total.
async fn restored_member_after_an_outage(
    backend: Backend,
    on_restore: &'static str,
) -> (u64, Vec<u64>) {
    let store = Store::start(backend);
    let backends = start_backends(&["steady", "flaky"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = Config::new()
        .store(&store)
        .route(
            pool(&members)
                .on_restore(on_restore)
                .health_check(HealthCheck::fast_http("100ms", 1, 1)),
        )
        .start();
    let flaky = members[1].clone();
    let healthy = |want: f64| {
        let (gw, flaky) = (&gw, flaky.clone());
        async move {
            support::wait_until_async(Duration::from_secs(20), || {
                let flaky = flaky.clone();
                async move {
                    gw.metric("sluice_member_healthy", &[("member", &flaky)])
                        .await
                        == Some(want)
                }
            })
            .await
        }
    };
    backends[1].set_healthy(false);
    assert!(healthy(0.0).await, "the active check takes the member down");
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..20 {
        assert_eq!(
            client
                .request("GET", "pool.test", "/", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    backends[1].set_healthy(true);
    // The pool marks the member eligible before the gauge says "up", so from here on it can be
    // chosen; `min` then raises its count in a background task: wait for the count, not for
    // a moment. (`keep` changes nothing, so there is nothing to wait for.)
    assert!(healthy(1.0).await, "and brings it back");
    if on_restore == "min" {
        let raised = support::wait_until_async(Duration::from_secs(20), || async {
            status_counts(&gw).await.get(&flaky) == Some(&20)
        })
        .await;
        assert!(
            raised,
            "min raises the revived member to the least count: {:?}",
            status_counts(&gw).await
        );
    }
    let before = backends[1].proxied_requests();
    for _ in 0..10 {
        assert_eq!(
            client
                .request("GET", "pool.test", "/", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    (
        backends[1].proxied_requests() - before,
        backends.iter().map(|b| b.proxied_requests()).collect(),
    )
}

async fn on_restore_min_gives_a_revived_member_no_burst(backend: Backend) {
    let (revived_share, totals) = restored_member_after_an_outage(backend, "min").await;
    assert_eq!(
        revived_share, 5,
        "an even share of the next ten: {totals:?}"
    );
}

async fn on_restore_keep_lets_a_revived_member_catch_up(backend: Backend) {
    let (revived_share, totals) = restored_member_after_an_outage(backend, "keep").await;
    assert_eq!(
        revived_share, 10,
        "it resumes from its old count and takes them all: {totals:?}"
    );
}

// Redis-only: what Redis is sent, and what happens when Redis goes away.

fn redis_pool_gateway(redis: &RedisServer, route: Route) -> Gateway {
    Config::new()
        .state(State::redis(redis.url()))
        .route(route)
        .start()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_redis_command_per_request_on_a_quota_and_least_used_route() {
    let redis = RedisServer::start();
    let backends = start_backends(&["b1", "b2"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = redis_pool_gateway(
        &redis,
        pool(&members).quota(Quota::window("minute", 10000, "1m")),
    );
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    // Warm up: the first request syncs the pool and loads the script.
    for _ in 0..3 {
        assert_eq!(
            client
                .request("GET", "pool.test", "/", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    redis.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let monitor = redis.monitor();
    for _ in 0..50 {
        let r = client
            .request("GET", "pool.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        assert!(r.header("ratelimit").is_some());
    }
    let sent = monitor.stop();
    assert_eq!(
        redis.command_calls("fcall"),
        50,
        "INFO commandstats: one FCALL per request"
    );
    assert_eq!(sent.len(), 50, "MONITOR: nothing else was sent: {sent:?}");
    assert!(sent.iter().all(|c| c == "FCALL"));
    // The quota and the counts moved together.
    assert_eq!(redis.log_held("sluice:{pool}:q:minute:route"), 53);
    assert_eq!(redis_counts(&redis).values().sum::<u64>(), 53);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_falls_back_to_round_robin_without_failing_a_request() {
    let mut redis = RedisServer::start();
    let backends = start_backends(&["b1", "b2"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = redis_pool_gateway(&redis, pool(&members));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..4 {
        assert_eq!(
            client
                .request("GET", "pool.test", "/", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    redis.kill();
    for i in 0..10 {
        let r = client
            .request("GET", "pool.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200, "request {i} during the outage");
    }
    let fallbacks = gw
        .metric("sluice_selection_fallbacks_total", &[("route", "pool")])
        .await
        .unwrap_or(0.0);
    assert!(fallbacks >= 10.0, "fallbacks {fallbacks}");
    assert_eq!(
        backends.iter().map(|b| b.proxied_requests()).sum::<u64>(),
        14
    );
    assert!(gw.logs().contains("falling back") || gw.logs().contains("on_store_error"));

    // Back, and empty: the pool is synced again and nothing fails.
    redis.restart();
    let mut failed = 0;
    for _ in 0..20 {
        if client
            .request("GET", "pool.test", "/", &[], b"")
            .await
            .unwrap()
            .status
            != 200
        {
            failed += 1;
        }
    }
    assert_eq!(failed, 0);
    assert!(support::wait_until(Duration::from_secs(20), || redis_counts(&redis).len() == 2).await);
    redis.command(&["SCRIPT", "FLUSH"]).unwrap();
    redis.command(&["FUNCTION", "FLUSH"]).unwrap();
    for _ in 0..10 {
        assert_eq!(
            client
                .request("GET", "pool.test", "/", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
}

/// Two instances share Redis, and one has reloaded a config that adds member `a`: its sync puts
/// `a` in the pool at the least count, so the store names `a` to the instance that has not
/// reloaded yet too. That instance cannot send the request to `a` (it knows neither its address
/// nor its windows), and must not send it to one of its own members unmetered either: `b` and
/// `c` (one request an hour each) get one request each, whoever asks, and the requests named to
/// `a` go to `d`, which has no windows, every one of them served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_member_another_instance_added_is_no_way_around_member_windows() {
    let redis = RedisServer::start();
    let backends = start_backends(&["a", "b", "c", "d"]).await;
    let member = |i: usize, name: &str| KeyMember::new(url(backends[i].local_addr()), name);
    let route = |with_a: bool| {
        let mut route = Route::new("pool").least_used();
        if with_a {
            route = route.key_member(member(0, "a"));
        }
        route
            .key_member(member(1, "b").window("hour", 1, "1h"))
            .key_member(member(2, "c").window("hour", 1, "1h"))
            .key_member(member(3, "d"))
    };
    let stale = redis_pool_gateway(&redis, route(false));
    let reloaded = redis_pool_gateway(&redis, route(true));
    let send = |gw: &Gateway| {
        let addr = gw.proxy_addr();
        async move {
            let r = request(addr, "GET", "pool.test", "/", &[], b"").await;
            assert_eq!(r.status, 200, "{}", r.text());
        }
    };
    // The stale instance syncs first (b, c, d) and takes `b`; the reloaded one syncs after it,
    // adding `a`, and takes `a`; the stale one then takes `c` and `d`.
    send(&stale).await;
    send(&reloaded).await;
    assert_eq!(
        backends[0].proxied_requests(),
        1,
        "the reloaded instance took a"
    );
    send(&stale).await;
    send(&stale).await;
    // Every count is 1 now, and ties go to the smallest id: the store names `a` first.
    for _ in 0..6 {
        send(&stale).await;
    }
    let proxied: Vec<u64> = backends.iter().map(|b| b.proxied_requests()).collect();
    assert_eq!(
        proxied,
        [1, 1, 1, 7],
        "b and c kept to their one request an hour; the rest went to d"
    );
}
