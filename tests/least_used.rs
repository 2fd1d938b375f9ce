//! Least-used selection end to end: the spread, `/status` counts, fairness across two gateways
//! sharing Redis (also with a member that fails every request), one Redis command per request,
//! and the round-robin fallback when Redis is gone.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sluice_testkit::RedisServer;
use support::{free_port, request, start_backends, Gateway, HttpClient};

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

fn config(state: &str, members: &[String], extra: &str) -> String {
    let mut yaml = format!(
        "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\n{state}routes:\n  - name: pool\n    match:\n      hosts: [\"pool.test\"]\n    upstream:\n      selection: least_used\n      retries: 2\n      members:\n"
    );
    for m in members {
        yaml.push_str(&format!("        - url: \"{m}\"\n"));
    }
    yaml.push_str(extra);
    yaml
}

fn redis_state(redis: &RedisServer) -> String {
    format!(
        "state:\n  backend: redis\n  redis:\n    url: \"{}\"\n    timeout: 1s\n",
        redis.url()
    )
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_least_used_spreads_evenly_and_status_shows_counts() {
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = Gateway::start_with_ports(&config("", &members, ""));
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
    for m in route["members"].as_array().unwrap() {
        assert_eq!(m["assignments"], 10, "{m}");
    }
}

async fn two_gateways_stay_fair(with_failing_member: bool) {
    let redis = RedisServer::start();
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
    let yaml = config(&redis_state(&redis), &members, "");
    let gateways = [
        Gateway::start_with_ports(&yaml),
        Gateway::start_with_ports(&yaml),
    ];

    // 32 concurrent clients, 16 per gateway, 5,120 requests in all.
    let mut tasks = Vec::new();
    for c in 0..32 {
        let addr = gateways[c % 2].proxy_addr();
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
    let counts = redis_counts(&redis);
    let mut received: Vec<u64> = backends.iter().map(|b| b.proxied_requests()).collect();
    if let Some(got) = &failing {
        received.push(got.load(Ordering::SeqCst));
    }
    println!("statuses {statuses:?}; redis counts {counts:?}; received {received:?}");
    assert_eq!(counts.len(), members.len());
    assert_eq!(
        counts.values().sum::<u64>(),
        5120,
        "every request is one assignment"
    );
    assert!(
        spread(counts.values().copied()) <= 1,
        "redis counts {counts:?}"
    );
    assert!(
        spread(received.iter().copied()) <= 1,
        "received {received:?}"
    );
    if with_failing_member {
        assert_eq!(
            statuses.get(&502).copied(),
            Some(received[4]),
            "failures are not retried"
        );
    } else {
        assert_eq!(statuses.get(&200).copied(), Some(5120));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_sharing_redis_keep_counts_within_one() {
    two_gateways_stay_fair(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_requests_still_count_so_a_failing_member_stays_within_one() {
    two_gateways_stay_fair(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_redis_command_per_request_on_a_quota_and_least_used_route() {
    let redis = RedisServer::start();
    let backends = start_backends(&["b1", "b2"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let quota = "    quota:\n      windows:\n        - {name: minute, limit: 10000, window: 1m}\n";
    let gw = Gateway::start_with_ports(&config(&redis_state(&redis), &members, quota));
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
        redis.command_calls("evalsha"),
        50,
        "INFO commandstats: one EVALSHA per request"
    );
    assert_eq!(sent.len(), 50, "MONITOR: nothing else was sent: {sent:?}");
    assert!(sent.iter().all(|c| c == "EVALSHA"));
    // The quota and the counts moved together.
    assert_eq!(
        redis.integer(&["ZCARD", "sluice:{pool}:q:minute:route"]),
        Some(53)
    );
    assert_eq!(redis_counts(&redis).values().sum::<u64>(), 53);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_falls_back_to_round_robin_without_failing_a_request() {
    let mut redis = RedisServer::start();
    let backends = start_backends(&["b1", "b2"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = Gateway::start_with_ports(&config(&redis_state(&redis), &members, ""));
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
    assert!(support::wait_until(Duration::from_secs(5), || redis_counts(&redis).len() == 2).await);
    redis.command(&["SCRIPT", "FLUSH"]).unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_members_are_skipped_and_no_member_costs_no_quota() {
    let backends = start_backends(&["alive"]).await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let members = [dead.clone(), url(backends[0].local_addr())];
    let quota = "    quota:\n      windows:\n        - {name: minute, limit: 100, window: 1m}\n";
    let gw = Gateway::start_with_ports(&config(
        "",
        &members,
        &format!("      passive:\n        cooldown: 1h\n{quota}"),
    ));
    // The dead member is the lexically smaller... or not; either way connect failures are
    // retried on a new assignment and the member is ejected.
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
    let mut r = request(gw.proxy_addr(), "GET", "pool.test", "/", &[], b"").await;
    for _ in 0..5 {
        if r.status == 503 {
            break;
        }
        r = request(gw.proxy_addr(), "GET", "pool.test", "/", &[], b"").await;
    }
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("no_member"));
    let remaining_before = r.header("ratelimit").map(str::to_string);
    let again = request(gw.proxy_addr(), "GET", "pool.test", "/", &[], b"").await;
    assert_eq!(
        again.header("ratelimit").map(str::to_string),
        remaining_before,
        "no quota consumed"
    );
}

async fn restored_member_after_an_outage(on_restore: &str) -> (u64, Vec<u64>) {
    let backends = start_backends(&["steady", "flaky"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let checks = format!(
        "      on_restore: {on_restore}\n      health_check:\n        kind: http\n        path: /healthz\n        interval: 100ms\n        timeout: 500ms\n        rise: 1\n        fall: 1\n"
    );
    let gw = Gateway::start_with_ports(&config("", &members, &checks));
    let flaky = members[1].clone();
    let healthy = |want: f64| {
        let (gw, flaky) = (&gw, flaky.clone());
        async move {
            support::wait_until_async(Duration::from_secs(10), || {
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
    assert!(healthy(1.0).await, "and brings it back");
    // The restore hook runs in the background; give it a moment.
    tokio::time::sleep(Duration::from_millis(200)).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_restore_min_gives_a_revived_member_no_burst() {
    let (revived_share, totals) = restored_member_after_an_outage("min").await;
    assert_eq!(
        revived_share, 5,
        "an even share of the next ten: {totals:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_restore_keep_lets_a_revived_member_catch_up() {
    let (revived_share, totals) = restored_member_after_an_outage("keep").await;
    assert_eq!(
        revived_share, 10,
        "it resumes from its old count and takes them all: {totals:?}"
    );
}
