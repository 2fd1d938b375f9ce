//! Quotas end to end: headers and 429s exactly as SPEC §3 says, Retry-After that is exact,
//! cost rules and per-tenant keys, one charge per request whatever the retries, Redis faults
//! handled by each route's policy, and exactness across two gateways sharing one Redis.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_testkit::RedisServer;
use support::{free_port, request, start_backends, Gateway, HttpClient, Response};

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A gateway config: `state` is the `state:` block (empty for memory); `routes` the routes.
fn config(state: &str, routes: &str) -> String {
    format!("listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\n{state}routes:\n{routes}")
}

fn redis_state(redis: &RedisServer) -> String {
    format!(
        "state:\n  backend: redis\n  redis:\n    url: \"{}\"\n    timeout: 1s\n",
        redis.url()
    )
}

/// A route `name` on host `<name>.test` over `members`, with `quota` (YAML under `quota:`).
fn route(name: &str, members: &[String], upstream_extra: &str, quota: &str) -> String {
    let mut r = format!(
        "  - name: {name}\n    match:\n      hosts: [\"{name}.test\"]\n    upstream:\n{upstream_extra}      members:\n"
    );
    for m in members {
        r.push_str(&format!("        - url: \"{m}\"\n"));
    }
    r.push_str("    quota:\n");
    r.push_str(quota);
    r
}

/// The RateLimit-Policy list and the RateLimit item, parsed as RFC 8941 structured fields.
fn parse_policy(r: &Response) -> Vec<(String, i64, i64)> {
    let raw = r.header("ratelimit-policy").expect("RateLimit-Policy");
    let list: sfv::List = sfv::Parser::new(raw)
        .parse()
        .expect("a structured-field list");
    list.iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => (
                item.bare_item
                    .as_string()
                    .expect("a string")
                    .as_str()
                    .to_string(),
                item.params
                    .get("q")
                    .and_then(|v| v.as_integer())
                    .expect("q")
                    .into(),
                item.params
                    .get("w")
                    .and_then(|v| v.as_integer())
                    .expect("w")
                    .into(),
            ),
            other => panic!("not an item: {other:?}"),
        })
        .collect()
}

fn parse_ratelimit(r: &Response) -> (String, i64, i64) {
    let raw = r.header("ratelimit").expect("RateLimit");
    let item: sfv::Item = sfv::Parser::new(raw)
        .parse()
        .expect("a structured-field item");
    (
        item.bare_item
            .as_string()
            .expect("a string")
            .as_str()
            .to_string(),
        item.params
            .get("r")
            .and_then(|v| v.as_integer())
            .expect("r")
            .into(),
        item.params
            .get("t")
            .and_then(|v| v.as_integer())
            .expect("t")
            .into(),
    )
}

const TWO_WINDOWS: &str = "      windows:\n        - {name: burst, limit: 5, window: 10s}\n        - {name: daily, limit: 100, window: 1d}\n";

async fn headers_and_429_match_the_spec(state: &str) {
    let backends = start_backends(&["b1"]).await;
    let gw = Gateway::start_with_ports(&config(
        state,
        &route("api", &[url(backends[0].local_addr())], "", TWO_WINDOWS),
    ));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for i in 0..5 {
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(
            parse_policy(&r),
            [("burst".into(), 5, 10), ("daily".into(), 100, 86400)]
        );
        let (name, remaining, reset) = parse_ratelimit(&r);
        assert_eq!((name.as_str(), remaining), ("burst", 4 - i));
        assert!((1..=10).contains(&reset), "t={reset}");
    }
    let refused = client
        .request("GET", "api.test", "/", &[], b"")
        .await
        .unwrap();
    assert_eq!(refused.status, 429);
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(refused.header("x-sluice-error"), Some("quota_exceeded"));
    let body = refused.json();
    assert_eq!(body["status"], 429);
    assert_eq!(body["route"], "api");
    assert_eq!(body["type"], "urn:sluice:error:quota_exceeded");
    let retry_ms = body["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert!(retry_ms > 0 && retry_ms <= 10_000, "{retry_ms}");
    let retry_after: u64 = refused
        .header("retry-after")
        .unwrap()
        .parse()
        .expect("whole seconds");
    assert_eq!(
        retry_after,
        retry_ms.div_ceil(1000).max(1),
        "Retry-After is retry_after_ms rounded up"
    );
    assert_eq!(parse_ratelimit(&refused).1, 0);
    assert_eq!(parse_policy(&refused).len(), 2);
    assert_eq!(
        backends[0].proxied_requests(),
        5,
        "a refused request contacts no member"
    );
    assert_eq!(
        gw.metric(
            "sluice_quota_rejections_total",
            &[("route", "api"), ("window", "burst")]
        )
        .await,
        Some(1.0)
    );
    assert_eq!(
        gw.status().await["routes"][0]["quota"][1]["window_ms"],
        86_400_000
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_headers_and_429_match_the_spec() {
    headers_and_429_match_the_spec("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_headers_and_429_match_the_spec() {
    let redis = RedisServer::start();
    headers_and_429_match_the_spec(&redis_state(&redis)).await;
}

async fn retry_after_is_exact(state: &str) {
    let backends = start_backends(&["b1"]).await;
    let quota = "      windows:\n        - {name: second, limit: 2, window: 1s}\n";
    let gw = Gateway::start_with_ports(&config(
        state,
        &route("api", &[url(backends[0].local_addr())], "", quota),
    ));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    assert_eq!(
        client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap()
            .status,
        200
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap()
            .status,
        200
    );
    let refused = client
        .request("GET", "api.test", "/", &[], b"")
        .await
        .unwrap();
    assert_eq!(refused.status, 429);
    let r = refused.json()["retry_after_ms"].as_u64().unwrap();
    // With no other traffic, the same request fits R + 50 ms later.
    tokio::time::sleep(Duration::from_millis(r + 50)).await;
    let again = client
        .request("GET", "api.test", "/", &[], b"")
        .await
        .unwrap();
    assert_eq!(again.status, 200, "retry_after_ms was {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_retry_after_is_exact() {
    retry_after_is_exact("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_retry_after_is_exact() {
    let redis = RedisServer::start();
    retry_after_is_exact(&redis_state(&redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_rules_and_per_tenant_keys() {
    let backends = start_backends(&["b1"]).await;
    let quota = "      key: \"header:X-Tenant\"\n      windows:\n        - {name: minute, limit: 10, window: 1m}\n      cost:\n        default: 1\n        rules:\n          - {path_prefix: /search, methods: [GET], cost: 5}\n";
    let gw = Gateway::start_with_ports(&config(
        "",
        &route("api", &[url(backends[0].local_addr())], "", quota),
    ));
    let a = [("X-Tenant", "a")];
    let b = [("X-Tenant", "b")];
    let send = |headers: &'static [(&'static str, &'static str)],
                method: &'static str,
                path: &'static str| {
        let addr = gw.proxy_addr();
        async move { request(addr, method, "api.test", path, headers, b"").await }
    };
    let a: &'static [(&str, &str)] = Box::leak(Box::new(a));
    let b: &'static [(&str, &str)] = Box::leak(Box::new(b));
    assert_eq!(parse_ratelimit(&send(a, "GET", "/search?q=1").await).1, 5);
    assert_eq!(
        parse_ratelimit(&send(a, "POST", "/search").await).1,
        4,
        "the rule is GET only"
    );
    assert_eq!(parse_ratelimit(&send(a, "GET", "/other").await).1, 3);
    assert_eq!(
        send(a, "GET", "/search").await.status,
        429,
        "5 units do not fit in 3"
    );
    assert_eq!(
        parse_ratelimit(&send(a, "GET", "/x").await).1,
        2,
        "the refusal consumed nothing"
    );
    assert_eq!(
        parse_ratelimit(&send(b, "GET", "/search").await).1,
        5,
        "tenant b has its own quota"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_charged_once_whatever_the_retries() {
    let backends = start_backends(&["b1"]).await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let quota = "      windows:\n        - {name: minute, limit: 10, window: 1m}\n";
    let gw = Gateway::start_with_ports(&config(
        "",
        &route(
            "api",
            &[dead, url(backends[0].local_addr())],
            "      retries: 2\n",
            quota,
        ),
    ));
    // Round-robin starts on the dead member: two attempts, one charge.
    let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 200);
    assert_eq!(parse_ratelimit(&r).1, 9);
    let logs = support::wait_until(Duration::from_secs(5), || {
        gw.logs().contains("\"attempts\":2")
    })
    .await;
    assert!(logs, "the request took two attempts: {}", gw.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_follows_each_routes_policy_and_recovers() {
    let mut redis = RedisServer::start();
    let backends = start_backends(&["b1"]).await;
    let member = [url(backends[0].local_addr())];
    let quota = |policy: &str| {
        format!("      windows:\n        - {{name: minute, limit: 1000, window: 1m}}\n      on_store_error: {policy}\n")
    };
    let routes = route("open", &member, "", &quota("open"))
        + &route("closed", &member, "", &quota("closed"));
    let mut gw = Gateway::start_with_ports(&config(&redis_state(&redis), &routes));
    assert_eq!(
        request(gw.proxy_addr(), "GET", "open.test", "/", &[], b"")
            .await
            .status,
        200
    );
    assert_eq!(
        request(gw.proxy_addr(), "GET", "closed.test", "/", &[], b"")
            .await
            .status,
        200
    );
    assert_eq!(gw.admin("/readyz").await.status, 200);

    redis.kill();
    for _ in 0..5 {
        let open = request(gw.proxy_addr(), "GET", "open.test", "/", &[], b"").await;
        assert_eq!(open.status, 200, "an open route keeps serving");
        assert!(
            open.header("ratelimit").is_none(),
            "no quota state to report"
        );
        let closed = request(gw.proxy_addr(), "GET", "closed.test", "/", &[], b"").await;
        assert_eq!(closed.status, 503);
        assert_eq!(closed.header("x-sluice-error"), Some("store_unavailable"));
    }
    assert_eq!(gw.admin("/readyz").await.status, 503);
    assert!(
        gw.metric("sluice_store_errors_total", &[("op", "quota")])
            .await
            .unwrap_or(0.0)
            >= 10.0
    );

    redis.restart();
    let recovered = support::wait_until_async(Duration::from_secs(5), || async {
        request(gw.proxy_addr(), "GET", "closed.test", "/", &[], b"")
            .await
            .status
            == 200
    })
    .await;
    assert!(
        recovered,
        "the closed route serves again once Redis is back"
    );
    assert_eq!(gw.admin("/readyz").await.status, 200);
    assert!(gw.is_running(), "no panic: {}", gw.logs());
    assert!(!gw.logs().contains("panicked"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_empty_or_flushed_fails_no_request() {
    let mut redis = RedisServer::start();
    let backends = start_backends(&["b1"]).await;
    let quota = "      windows:\n        - {name: minute, limit: 1000, window: 1m}\n      on_store_error: closed\n";
    let gw = Gateway::start_with_ports(&config(
        &redis_state(&redis),
        &route("api", &[url(backends[0].local_addr())], "", quota),
    ));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..5 {
        assert_eq!(
            client
                .request("GET", "api.test", "/", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    redis.restart();
    for i in 0..20 {
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200, "request {i} after the restart: {}", r.text());
    }
    assert!(redis
        .command(&["SCRIPT", "FLUSH"])
        .unwrap()
        .starts_with("+OK"));
    for i in 0..20 {
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(
            r.status,
            200,
            "request {i} after SCRIPT FLUSH: {}",
            r.text()
        );
    }
    // The restart emptied the quota: 40 requests counted since.
    assert_eq!(
        redis.integer(&["ZCARD", "sluice:{api}:q:minute:route"]),
        Some(40)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_sharing_redis_never_exceed_a_window() {
    const WINDOW_US: f64 = 500_000.0;
    const LIMIT: u64 = 50;
    let redis = RedisServer::start();
    let backends = start_backends(&["b1", "b2"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let quota = "      windows:\n        - {name: short, limit: 50, window: 500ms}\n      cost:\n        rules:\n          - {path_prefix: /heavy, cost: 5}\n";
    let yaml = config(&redis_state(&redis), &route("api", &members, "", quota));
    let gateways = [
        Gateway::start_with_ports(&yaml),
        Gateway::start_with_ports(&yaml),
    ];

    // Sample the log often enough (10 times per window) that every entry is seen before it
    // leaves; members are unique, so the union is the full admission history.
    let seen: Arc<Mutex<HashMap<String, f64>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (seen, stop, redis_addr) = (seen.clone(), stop.clone(), redis.addr());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let log =
                    sluice_testkit::zrange_with_scores_at(redis_addr, "sluice:{api}:q:short:route");
                let mut seen = seen.lock().unwrap();
                for (m, s) in log {
                    seen.insert(m, s);
                }
                drop(seen);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };

    // 64 concurrent clients, 32 per gateway, for 3 seconds or 200 requests each.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for c in 0..64 {
        let addr = gateways[c % 2].proxy_addr();
        tasks.push(tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            let (mut ok, mut refused, mut other) = (0u64, 0u64, 0u64);
            for i in 0..200 {
                if Instant::now() > deadline {
                    break;
                }
                let path = if (i + c) % 7 == 0 { "/heavy" } else { "/light" };
                match client.request("GET", "api.test", path, &[], b"").await {
                    Ok(r) if r.status == 200 => ok += 1,
                    Ok(r) if r.status == 429 => {
                        refused += 1;
                        // A polite client backs off a little; it also keeps the load bounded.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    _ => other += 1,
                }
            }
            (ok, refused, other)
        }));
    }
    let (mut ok, mut refused, mut other) = (0, 0, 0);
    for t in tasks {
        let (o, r, x) = t.await.unwrap();
        ok += o;
        refused += r;
        other += x;
    }
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();

    let mut entries: Vec<(f64, u64)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(m, &s)| (s, m.rsplit(':').next().unwrap().parse().unwrap()))
        .collect();
    entries.sort_by(|a, b| a.0.total_cmp(&b.0));
    println!(
        "admitted {ok}, refused {refused}, other {other}; {} log entries",
        entries.len()
    );
    assert_eq!(other, 0, "every request is answered 200 or 429");
    assert_eq!(
        entries.len() as u64,
        ok,
        "every admitted request is in the log, and only those"
    );
    let received: u64 = backends.iter().map(|b| b.proxied_requests()).sum();
    assert_eq!(
        received, ok,
        "the backends received exactly the admitted requests"
    );
    // Every interval [t, t + window) starting at an admission holds at most LIMIT units.
    let mut worst = 0;
    let mut end = 0;
    let mut sum = 0;
    for start in 0..entries.len() {
        while end < entries.len() && entries[end].0 < entries[start].0 + WINDOW_US {
            sum += entries[end].1;
            end += 1;
        }
        worst = worst.max(sum);
        sum -= entries[start].1;
    }
    println!("largest admitted cost in any 500 ms: {worst} (limit {LIMIT})");
    assert!(worst <= LIMIT, "a window admitted {worst} > {LIMIT}");
    assert!(refused > 0 && ok > 100, "the test must push the quota");
}
