//! Quotas end to end: headers and 429s exactly as SPEC §3 says, Retry-After that is exact,
//! cost rules and per-tenant keys, one charge per request whatever the retries, Redis faults
//! handled by each route's policy, and exactness across two gateways sharing one Redis.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_testkit::RedisServer;
use support::{
    dead_url, request, start_backends, url, Backend, Config, Gateway, HttpClient, Quota, Response,
    Route, Store,
};

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

// Every behaviour below that does not need Redis itself runs on both stores; the rest are
// Redis-only for the reason given at each.
on_both_stores!(
    headers_and_429_match_the_spec,
    retry_after_is_exact,
    cost_rules_and_per_tenant_keys,
    a_request_is_charged_once_whatever_the_retries,
    concurrent_clients_are_admitted_exactly_the_limit,
);

/// A gateway on `store` with one route `api` (host `api.test`) over `members` with `quota`.
fn api_gateway(store: &Store, members: &[String], quota: Quota) -> Gateway {
    Config::new()
        .store(store)
        .route(Route::new("api").members(members).quota(quota))
        .start()
}

async fn headers_and_429_match_the_spec(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1"]).await;
    let gw = api_gateway(
        &store,
        &[url(backends[0].local_addr())],
        Quota::window("burst", 5, "10s").and_window("daily", 100, "1d"),
    );
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

/// `retry_after_ms` is the exact time until the refused request fits: it is refused until then
/// and admitted from then on. Checked by sending it again and again (a refusal consumes
/// nothing) until it is admitted, not by sleeping for `retry_after_ms` and hoping.
async fn retry_after_is_exact(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1"]).await;
    let gw = api_gateway(
        &store,
        &[url(backends[0].local_addr())],
        // Long enough that the third request below still finds both admissions in the window
        // however slow the machine (at 1 s, a stall of 0.7 s let it in; at 4 s, a stall of 3 s
        // would).
        Quota::window("short", 2, "10s"),
    );
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    async fn get(client: &mut HttpClient) -> Response {
        client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap()
    }
    assert_eq!(get(&mut client).await.status, 200);
    // Not a synchronisation: this spaces the two admissions, so that the refused request fits
    // when the older one leaves the window (10 s after it), well before the newer one does.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(get(&mut client).await.status, 200);
    let sent = Instant::now();
    let refused = get(&mut client).await;
    let answered = Instant::now();
    assert_eq!(refused.status, 429);
    let r = refused.json()["retry_after_ms"].as_u64().unwrap();
    let r_dur = Duration::from_millis(r);
    // The store decided at some instant in [sent, answered], and retry_after_ms is rounded up
    // to the millisecond, so the request fits from some instant F with
    //   sent + r - 1 ms < F <= answered + r.
    // These bounds only widen when the machine is slow (every delay moves a request's `sent`
    // earlier or its `answered` later relative to the store's decision), so they cannot fail
    // because of load; they fail only if retry_after_ms is wrong.
    let fits_by = answered + r_dur;
    let fits_after = sent + r_dur.saturating_sub(Duration::from_millis(1));
    let deadline = fits_by + Duration::from_secs(5);
    let mut polls = 0;
    loop {
        polls += 1;
        let sent_i = Instant::now();
        let again = get(&mut client).await;
        let answered_i = Instant::now();
        if again.status == 200 {
            assert!(
                answered_i > fits_after,
                "admitted before retry_after_ms ({r}) had passed: it was too long"
            );
            break;
        }
        assert_eq!(again.status, 429, "{}", again.text());
        assert!(
            sent_i <= fits_by,
            "still refused (poll {polls}) after retry_after_ms ({r}) had passed: it was too short"
        );
        assert!(Instant::now() < deadline, "never admitted again");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(backends[0].proxied_requests(), 3);
}

async fn cost_rules_and_per_tenant_keys(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1"]).await;
    let gw = api_gateway(
        &store,
        &[url(backends[0].local_addr())],
        Quota::window("minute", 10, "1m")
            .key("header:X-Tenant")
            .cost_default(1)
            .cost_rule("/search", &["GET"], 5),
    );
    let addr = gw.proxy_addr();
    let send = |tenant: &'static str, method: &'static str, path: &'static str| async move {
        request(addr, method, "api.test", path, &[("X-Tenant", tenant)], b"").await
    };
    assert_eq!(parse_ratelimit(&send("a", "GET", "/search?q=1").await).1, 5);
    assert_eq!(
        parse_ratelimit(&send("a", "POST", "/search").await).1,
        4,
        "the rule is GET only"
    );
    assert_eq!(parse_ratelimit(&send("a", "GET", "/other").await).1, 3);
    assert_eq!(
        send("a", "GET", "/search").await.status,
        429,
        "5 units do not fit in 3"
    );
    assert_eq!(
        parse_ratelimit(&send("a", "GET", "/x").await).1,
        2,
        "the refusal consumed nothing"
    );
    assert_eq!(
        parse_ratelimit(&send("b", "GET", "/search").await).1,
        5,
        "tenant b has its own quota"
    );
}

async fn a_request_is_charged_once_whatever_the_retries(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1"]).await;
    let gw = Config::new()
        .store(&store)
        .route(
            Route::new("api")
                .member(dead_url())
                .member(url(backends[0].local_addr()))
                .retries(2)
                .quota(Quota::window("minute", 10, "1m")),
        )
        .start();
    // Round-robin starts on the dead member: two attempts, one charge.
    let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 200);
    assert_eq!(parse_ratelimit(&r).1, 9);
    let logs = support::wait_until(Duration::from_secs(20), || {
        gw.logs().contains("\"attempts\":2")
    })
    .await;
    assert!(logs, "the request took two attempts: {}", gw.logs());
}

/// Many clients at once on every gateway that shares the store (one on memory, two on Redis)
/// against a long window: exactly `limit` requests are admitted, never one more.
async fn concurrent_clients_are_admitted_exactly_the_limit(backend: Backend) {
    const LIMIT: u64 = 40;
    let store = Store::start(backend);
    let backends = start_backends(&["b1", "b2"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let config = Config::new().store(&store).route(
        Route::new("api")
            .members(&members)
            .quota(Quota::window("hour", LIMIT, "1h")),
    );
    let gateways: Vec<Gateway> = (0..store.instances()).map(|_| config.start()).collect();
    let mut tasks = Vec::new();
    for c in 0..16 {
        let addr = gateways[c % gateways.len()].proxy_addr();
        tasks.push(tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            let mut statuses = Vec::new();
            for _ in 0..10 {
                let r = client.request("GET", "api.test", "/", &[], b"").await;
                statuses.push(r.map_or(0, |r| r.status));
            }
            statuses
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.extend(t.await.unwrap());
    }
    let admitted = statuses.iter().filter(|&&s| s == 200).count() as u64;
    let refused = statuses.iter().filter(|&&s| s == 429).count() as u64;
    assert_eq!(
        admitted + refused,
        160,
        "every request is answered 200 or 429"
    );
    assert_eq!(admitted, LIMIT, "exactly the limit is admitted");
    assert_eq!(
        backends.iter().map(|b| b.proxied_requests()).sum::<u64>(),
        LIMIT,
        "and only the admitted requests reach a member"
    );
}

// Redis-only from here: a Redis outage, a Redis restart, and two gateways sharing one Redis
// have no memory-store counterpart.

fn redis_gateway(redis: &RedisServer, routes: impl IntoIterator<Item = Route>) -> Gateway {
    Config::new()
        .state(support::State::redis(redis.url()))
        .routes(routes)
        .start()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_follows_each_routes_policy_and_recovers() {
    let mut redis = RedisServer::start();
    let backends = start_backends(&["b1"]).await;
    let member = url(backends[0].local_addr());
    let quota = |policy| Quota::window("minute", 1000, "1m").on_store_error(policy);
    let mut gw = redis_gateway(
        &redis,
        [
            Route::new("open").member(&member).quota(quota("open")),
            Route::new("closed").member(&member).quota(quota("closed")),
        ],
    );
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
    let recovered = support::wait_until_async(Duration::from_secs(20), || async {
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
    let gw = redis_gateway(
        &redis,
        [Route::new("api")
            .member(url(backends[0].local_addr()))
            .quota(Quota::window("minute", 1000, "1m").on_store_error("closed"))],
    );
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
    for flush in ["SCRIPT", "FUNCTION"] {
        assert!(redis.command(&[flush, "FLUSH"]).unwrap().starts_with("+OK"));
        for i in 0..20 {
            let r = client
                .request("GET", "api.test", "/", &[], b"")
                .await
                .unwrap();
            assert_eq!(
                r.status,
                200,
                "request {i} after {flush} FLUSH: {}",
                r.text()
            );
        }
    }
    // The restart emptied the quota: 60 requests counted since, each once.
    assert_eq!(redis.log_held("sluice:{api}:q:minute:route"), 60);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_sharing_redis_never_exceed_a_window() {
    const WINDOW_US: f64 = 500_000.0;
    const LIMIT: u64 = 50;
    let redis = RedisServer::start();
    let backends = start_backends(&["b1", "b2"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    // The window under test, and a long one that never refuses anything here but keeps the
    // whole history: every admitted request is written to every window's log, so at the end
    // the `history` log holds the admission time (Redis TIME, µs) of every admitted request,
    // while the short window's own log has long dropped most of them.
    let quota = Quota::window("short", LIMIT, "500ms")
        .and_window("history", 1_000_000, "1h")
        .cost_rule("/heavy", &[], 5);
    let config = Config::new()
        .state(support::State::redis(redis.url()))
        .route(Route::new("api").members(&members).quota(quota));
    let gateways = [config.start(), config.start()];

    // 64 concurrent clients, 32 per gateway, for at least 3 seconds (six windows) and until
    // more than 100 requests were admitted and some refused between them, so that the quota is
    // pushed whatever the machine's speed: a run of a fixed length admitted too few when the
    // machine stalled, and one of a fixed count ended within a window on a fast build. At most
    // 1,000 requests each and 60 s in all.
    let started = Instant::now();
    let admitted = Arc::new(AtomicU64::new(0));
    let refusals = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..64 {
        let addr = gateways[c % 2].proxy_addr();
        let (admitted, refusals) = (admitted.clone(), refusals.clone());
        tasks.push(tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            let (mut ok, mut units, mut refused, mut other) = (0u64, 0u64, 0u64, 0u64);
            for i in 0..1000 {
                let pushed = admitted.load(Ordering::Relaxed) > 100
                    && refusals.load(Ordering::Relaxed) > 0
                    && started.elapsed() > Duration::from_secs(3);
                if pushed || started.elapsed() > Duration::from_secs(60) {
                    break;
                }
                let (path, cost) = if (i + c) % 7 == 0 {
                    ("/heavy", 5)
                } else {
                    ("/light", 1)
                };
                match client.request("GET", "api.test", path, &[], b"").await {
                    Ok(r) if r.status == 200 => {
                        ok += 1;
                        units += cost;
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(r) if r.status == 429 => {
                        refused += 1;
                        refusals.fetch_add(1, Ordering::Relaxed);
                        // Not a synchronisation: a polite client backs off a little, which
                        // also keeps the load bounded.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    _ => other += 1,
                }
            }
            (ok, units, refused, other)
        }));
    }
    let (mut ok, mut units, mut refused, mut other) = (0, 0, 0, 0);
    for t in tasks {
        let (o, u, r, x) = t.await.unwrap();
        ok += o;
        units += u;
        refused += r;
        other += x;
    }

    // Every client has its answer, so every admission is in the logs: one entry per admission
    // time, of the summed cost of the requests admitted then (one store call's, lua/quota.lua).
    let mut entries: Vec<(f64, u64)> = redis
        .zrange_with_scores("sluice:{api}:q:history:route")
        .into_iter()
        .map(|(m, s)| (s, m.rsplit(':').next().unwrap().parse().unwrap()))
        .collect();
    entries.sort_by(|a, b| a.0.total_cmp(&b.0));
    println!(
        "admitted {ok}, refused {refused}, other {other}; {} log entries",
        entries.len()
    );
    assert_eq!(other, 0, "every request is answered 200 or 429");
    assert_eq!(
        entries.iter().map(|e| e.1).sum::<u64>(),
        units,
        "every admitted request is in the log, and only those"
    );
    let received: u64 = backends.iter().map(|b| b.proxied_requests()).sum();
    assert_eq!(
        received, ok,
        "the backends received exactly the admitted requests"
    );
    // Every interval [t, t + window) starting at an admission holds at most LIMIT units; the
    // worst interval of any length-window interval starts at an admission.
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

/// The memory store's key table, once full of keys that still count, refuses a request with a
/// new key with `429 quota_keys_exhausted`, whatever `on_store_error` says: a full table is no
/// outage, and admitting the key unmetered would lift the quota for anyone who sprays keys.
/// The keys it holds keep their quota. On a route whose quota is decided alone (round-robin)
/// and on one where it is fused with the least-used pick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_full_key_table_refuses_new_keys_and_never_admits_one_unmetered() {
    let backends = start_backends(&["b1"]).await;
    let member = url(backends[0].local_addr());
    let quota = || {
        Quota::window("hour", 2, "1h")
            .key("header:X-Tenant")
            .on_store_error("open")
    };
    let config = Config::new().routes([
        Route::new("api").member(member.clone()).quota(quota()),
        Route::new("pool")
            .member(member.clone())
            .least_used()
            .quota(quota()),
    ]);
    // A small table, so that it fills in a few requests.
    const MAX_KEYS: usize = 64;
    let yaml = format!(
        "{}state:\n  backend: memory\n  memory:\n    max_keys: {MAX_KEYS}\n",
        config.yaml()
    );
    let gw = Gateway::start_with_ports(&yaml);
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for route in ["api", "pool"] {
        let host = format!("{route}.test");
        let (mut held, mut refused) = (0, 0);
        for i in 0..(3 * MAX_KEYS) {
            let tenant = format!("tenant-{i}");
            let headers = [("X-Tenant", tenant.as_str())];
            let mut answers = Vec::new();
            for _ in 0..3 {
                let r = client
                    .request("GET", &host, "/", &headers, b"")
                    .await
                    .unwrap();
                answers.push((r.status, r.header("x-sluice-error").map(str::to_string)));
                if r.status == 429 && r.header("x-sluice-error") == Some("quota_keys_exhausted") {
                    assert_eq!(r.header("content-type"), Some("application/problem+json"));
                    assert_eq!(r.json()["type"], "urn:sluice:error:quota_keys_exhausted");
                }
            }
            let exhausted = (429, Some("quota_keys_exhausted".to_string()));
            if answers[0].0 == 200 {
                held += 1;
                assert_eq!(
                    answers,
                    [
                        (200, None),
                        (200, None),
                        (429, Some("quota_exceeded".into()))
                    ],
                    "{route}: a key the store holds keeps exactly its quota ({tenant})"
                );
            } else {
                refused += 1;
                assert_eq!(
                    answers,
                    [exhausted.clone(), exhausted.clone(), exhausted],
                    "{route}: a new key is refused while the table is full, never admitted \
                     unmetered ({tenant})"
                );
            }
        }
        // The table is the route's, whichever shards of the store its keys fall in.
        assert_eq!(held, MAX_KEYS, "{route}: {held} keys held");
        assert!(refused > 0, "{route}: the table never filled");
        assert_eq!(
            gw.metric("sluice_quota_keys_refused_total", &[("route", route)])
                .await,
            Some(3.0 * refused as f64),
            "{route}: every refusal is counted"
        );
    }
    assert_eq!(
        gw.metric("sluice_store_errors_total", &[("op", "quota")])
            .await
            .unwrap_or(0.0),
        0.0,
        "a full key table is not a store failure"
    );
    assert!(
        gw.wait_for_log("as many quota keys, or entries", Duration::from_secs(20))
            .await,
        "the refusals are logged"
    );
}

/// The memory store bounds a route's log entries too, not only its keys: one key with a large
/// limit fills the budget (`state.memory.max_entries`), the whole of it, and past it a request
/// is refused with `429 quota_keys_exhausted`, never admitted unrecorded, whatever
/// `on_store_error` says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_entry_budget_refuses_rather_than_admits_unrecorded() {
    let backends = start_backends(&["b1"]).await;
    let config = Config::new().route(
        Route::new("api")
            .member(url(backends[0].local_addr()))
            .quota(Quota::window("hour", 1_000, "1h").on_store_error("open")),
    );
    // 64 entries a route, all of them for its one key, whose logs live in one of the store's
    // shards.
    const MAX_ENTRIES: usize = 64;
    let yaml = format!(
        "{}state:\n  backend: memory\n  memory:\n    max_entries: {MAX_ENTRIES}\n",
        config.yaml()
    );
    let gw = Gateway::start_with_ports(&yaml);
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for i in 0..MAX_ENTRIES {
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
    }
    for _ in 0..3 {
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_keys_exhausted(&r);
    }
    assert_eq!(
        backends[0].proxied_requests(),
        MAX_ENTRIES as u64,
        "only the recorded requests went"
    );
    assert_eq!(
        gw.metric("sluice_quota_keys_refused_total", &[("route", "api")])
            .await,
        Some(3.0)
    );
}

/// Redis at its `maxmemory` (with `noeviction`) refuses every write, before it writes anything:
/// that is a full store, as the memory store's key table is, not an outage. A request a quota
/// must count is refused with `429 quota_keys_exhausted`, never admitted unmetered, even where
/// `on_store_error` is `open` (otherwise whoever filled Redis, by spraying quota keys say,
/// lifted every quota). Routes without windows have nothing to meter (a least-used one, a
/// round-robin one with cooldowns): their requests go on with their member chosen in process,
/// as on any store failure. Once Redis has room, the quota counts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_refuses_what_a_quota_counts_rather_than_admit_it_unmetered() {
    let redis = RedisServer::start();
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let config = Config::new()
        .state(support::State::redis(redis.url()))
        .route(
            Route::new("api")
                .member(url(backends[0].local_addr()))
                .quota(Quota::window("hour", 1_000, "1h").on_store_error("open")),
        )
        .route(
            Route::new("pool")
                .member(url(backends[1].local_addr()))
                .least_used(),
        )
        .route(
            Route::new("cool")
                .member(url(backends[2].local_addr()))
                .cooldown(support::Cooldown::new().max("1m")),
        );
    let gw = config.start();
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for host in ["api.test", "pool.test", "cool.test"] {
        let r = client.request("GET", host, "/", &[], b"").await.unwrap();
        assert_eq!(r.status, 200, "{host}: {}", r.text());
    }
    redis
        .command(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
        .unwrap();
    redis.command(&["CONFIG", "SET", "maxmemory", "1"]).unwrap();
    for _ in 0..3 {
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_keys_exhausted(&r);
        let r = client
            .request("GET", "pool.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200, "pool.test: {}", r.text());
        let r = client
            .request("GET", "cool.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200, "cool.test: {}", r.text());
    }
    assert_eq!(
        backends[0].proxied_requests(),
        1,
        "only the counted request reached the quota's member"
    );
    assert_eq!(backends[1].proxied_requests(), 4);
    assert_eq!(backends[2].proxied_requests(), 4);
    assert_eq!(
        gw.metric("sluice_quota_keys_refused_total", &[("route", "api")])
            .await,
        Some(3.0)
    );
    redis.command(&["CONFIG", "SET", "maxmemory", "0"]).unwrap();
    let r = client
        .request("GET", "api.test", "/", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(backends[0].proxied_requests(), 2);
}

/// `r` is the refusal of a full store: `429 quota_keys_exhausted`.
fn assert_keys_exhausted(r: &Response) {
    assert_eq!(
        (r.status, r.header("x-sluice-error")),
        (429, Some("quota_keys_exhausted")),
        "{}",
        r.text()
    );
}
