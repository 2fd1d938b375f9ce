//! Pools of API keys (SPEC §8), end to end: the real sluice binary in front of a real HTTP API
//! stub (`sluice-echo` with per-key limits at its own clock, answering 429 with Retry-After past
//! them), on the memory store, on Redis with two gateways sharing it, and on Redis Cluster.
//!
//! The stub keys requests by their `Authorization` value, which only sluice sets (from each
//! member's `headers`), so what the stub counts per key is what sluice sent per member.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use sluice_echo::{EchoOptions, EchoServer};
use sluice_testkit::RedisCluster;
use support::{
    request, url, wait_until_async, Backend, Config, Cooldown, Gateway, KeyMember, Quota, Response,
    Route, State, Store,
};

const HOST: &str = "keys.test";
const KEYS: [&str; 3] = ["key-a", "key-b", "key-c"];

/// The secret of member `name`: unique to this process, so a search for it in logs and
/// admin documents cannot match anything else.
fn secret(name: &str) -> String {
    format!("sk-{name}-{}-f00d", std::process::id())
}

fn bearer(name: &str) -> String {
    format!("Bearer {}", secret(name))
}

/// The API stub: `limit` requests per key per `window`, its own RateLimit fields, and a log of
/// every request.
async fn api(limit: u64, window: Duration) -> EchoServer {
    EchoServer::start_with(
        "api",
        SocketAddr::from(([127, 0, 0, 1], 0)),
        EchoOptions::key_limited(limit, window),
    )
    .await
    .expect("start the API stub")
}

/// Route `keys` (host `keys.test`) over `names`, each a key on `api`, each with its own window
/// of `per_key` requests per `window` when `per_key` is not 0.
fn pool(api: &EchoServer, names: &[&str], per_key: u64, window: &str) -> Route {
    names.iter().fold(Route::new("keys"), |route, name| {
        let mut member =
            KeyMember::new(url(api.local_addr()), name).header("Authorization", &bearer(name));
        if per_key > 0 {
            member = member.window("rpm", per_key, window);
        }
        route.key_member(member)
    })
}

fn start(config: &Config, store: &Store) -> Vec<Gateway> {
    (0..store.instances()).map(|_| config.start()).collect()
}

/// `n` requests at once, spread over `gateways`, each on a connection of its own.
async fn burst(gateways: &[Gateway], n: usize) -> Vec<Response> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let addr = gateways[i % gateways.len()].proxy_addr();
        tasks.push(tokio::spawn(async move {
            request(addr, "GET", HOST, &format!("/v1/models/{i}"), &[], b"").await
        }));
    }
    let mut responses = Vec::new();
    for t in tasks {
        responses.push(t.await.expect("request task"));
    }
    responses
}

/// A refusal made by sluice: `429 quota_exceeded`, with a `Retry-After` that is the
/// `retry_after_ms` of its body in whole seconds, rounded up.
#[track_caller]
fn assert_sluice_refusal(r: &Response, most_ms: u64) {
    assert_eq!(r.status, 429, "{}", r.text());
    let body = r.json();
    assert_eq!(body["type"], "urn:sluice:error:quota_exceeded", "{body}");
    let ms = body["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert!(
        ms > 0 && ms <= most_ms,
        "retry_after_ms {ms} in (0, {most_ms}]"
    );
    let seconds: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("whole seconds");
    assert_eq!(
        seconds,
        ms.div_ceil(1000).max(1),
        "Retry-After and retry_after_ms agree"
    );
    assert!(
        r.header("x-upstream").is_none(),
        "sluice answered, not the API"
    );
}

/// The member entry `name` of route `keys` in a gateway's `/status`.
async fn member_status(gw: &Gateway, name: &str) -> serde_json::Value {
    let status = gw.status().await;
    let route = status["routes"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["name"] == "keys"))
        .cloned()
        .expect("route keys in /status");
    route["members"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("member {name} in {route}"))
}

async fn waiting(gw: &Gateway) -> u64 {
    let status = gw.status().await;
    status["routes"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["name"] == "keys"))
        .and_then(|r| r["waiting"].as_u64())
        .unwrap_or(0)
}

on_both_stores!(
    a_burst_over_every_instance_never_reaches_the_api_limit,
    a_cooldown_keeps_every_instance_off_the_key,
    a_cooled_key_comes_back,
    a_key_back_from_its_cooldown_starts_at_the_least_count,
    retry_answers_from_another_key_and_sends_the_body_once_to_each,
    retry_replays_a_429_only,
    a_body_still_arriving_past_the_replay_buffer_is_not_replayed,
    waiters_are_served_in_arrival_order,
    past_max_waiting_the_answer_is_immediate,
    requests_wait_for_a_member_window,
    key_values_appear_nowhere,
);

/// Three keys of 5 requests a minute each, on the API and in sluice. A burst spread over every
/// gateway gets exactly 15 answers from the API and never one of its 429s; sluice refuses the
/// rest itself, with the exact time until a key admits again; the keys share the load evenly.
async fn a_burst_over_every_instance_never_reaches_the_api_limit(backend: Backend) {
    let store = Store::start(backend);
    let api = api(5, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS, 5, "1m")
        .least_used()
        .quota(Quota::window("route", 1000, "1m"));
    let gateways = start(&Config::new().store(&store).route(route), &store);

    // Below the limits: least-used spreads 7 requests 3/2/2.
    for r in burst(&gateways, 7).await {
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let served: Vec<u64> = KEYS.iter().map(|k| api.served(&bearer(k))).collect();
    assert_eq!(served.iter().sum::<u64>(), 7);
    let (least, most) = (served.iter().min().unwrap(), served.iter().max().unwrap());
    assert!(
        most - least <= 1,
        "per-key counts within 1 of each other: {served:?}"
    );

    let responses = burst(&gateways, 20).await;
    let admitted: Vec<&Response> = responses.iter().filter(|r| r.status == 200).collect();
    assert_eq!(admitted.len(), 8, "15 in all: 5 per key");
    for r in responses.iter().filter(|r| r.status != 200) {
        assert_sluice_refusal(r, 60_000);
    }
    for k in KEYS {
        assert_eq!(api.served(&bearer(k)), 5, "{k} was sent exactly its limit");
        assert_eq!(api.refused(&bearer(k)), 0, "the API never refused {k}");
    }
    // The API's own RateLimit items reach the client next to sluice's.
    let items = admitted[0].header_all("ratelimit");
    assert!(
        items.iter().any(|v| v.starts_with("\"api\""))
            && items.iter().any(|v| v.starts_with("\"route\"")),
        "both the API's and the route's RateLimit items: {items:?}"
    );
}

/// The API answers one key with 429 and `Retry-After` of ten days: sluice cools that key for
/// `max` (not ten days, not `default`), on every instance at once, and sends it nothing more.
async fn a_cooldown_keeps_every_instance_off_the_key(backend: Backend) {
    let store = Store::start(backend);
    let api = api(1000, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS[..2], 0, "")
        .least_used()
        .cooldown(Cooldown::new().default_for("30s").max("1m"));
    let gateways = start(&Config::new().store(&store).route(route), &store);
    api.refuse_next(&bearer("key-a"), 1, "864000").unwrap();

    // Ties go to the smallest name: the first request goes to key-a, and its 429 reaches the
    // client (no retry configured).
    let first = request(gateways[0].proxy_addr(), "GET", HOST, "/", &[], b"").await;
    assert_eq!(first.status, 429, "{}", first.text());
    assert_eq!(
        first.header("x-upstream"),
        Some("api"),
        "the API's own answer"
    );
    assert_eq!(api.refused(&bearer("key-a")), 1);

    for gw in &gateways {
        let m = member_status(gw, "key-a").await;
        let ms = m["cooling_ms"].as_u64().unwrap_or(0);
        assert!(
            ms > 30_000 && ms <= 60_000,
            "capped at max (1m), not the default (30s) nor ten days: {m}"
        );
        assert!(m["cooling_until"].is_string(), "{m}");
        assert_eq!(m["healthy"], true, "cooling is not ill health: {m}");
        let other = member_status(gw, "key-b").await;
        assert!(other["cooling_ms"].is_null(), "{other}");
    }
    for i in 0..10 {
        let r = request(
            gateways[i % gateways.len()].proxy_addr(),
            "GET",
            HOST,
            "/",
            &[],
            b"",
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(
        api.served(&bearer("key-a")),
        0,
        "no instance sent the cooling key anything"
    );
    assert_eq!(api.served(&bearer("key-b")), 10);
    assert_eq!(
        gateways[0]
            .metric(
                "sluice_member_cooldowns_total",
                &[("route", "keys"), ("member", "key-a")]
            )
            .await,
        Some(1.0)
    );
}

/// A key cooled for a second is used again once its cooldown ends.
async fn a_cooled_key_comes_back(backend: Backend) {
    let store = Store::start(backend);
    let api = api(1000, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS[..2], 0, "")
        .least_used()
        .cooldown(Cooldown::new());
    let gateways = start(&Config::new().store(&store).route(route), &store);
    api.refuse_next(&bearer("key-a"), 1, "1").unwrap();
    let first = request(gateways[0].proxy_addr(), "GET", HOST, "/", &[], b"").await;
    assert_eq!(first.status, 429);

    // key-a has the fewest assignments, so least-used goes back to it as soon as it may.
    let addrs: Vec<SocketAddr> = gateways.iter().map(Gateway::proxy_addr).collect();
    let back = wait_until_async(Duration::from_secs(20), || {
        let addrs = addrs.clone();
        let api = api.clone();
        async move {
            for addr in addrs {
                let r = request(addr, "GET", HOST, "/", &[], b"").await;
                assert_eq!(r.status, 200, "{}", r.text());
            }
            api.served(&bearer("key-a")) > 0
        }
    })
    .await;
    assert!(back, "key-a is used again after its cooldown");
}

/// A key back from its cooldown resumes at the least count of the keys that worked meanwhile,
/// rather than at its old count: otherwise it would take every request until it caught up,
/// which tends to bring the API's 429 straight back. On Redis, both gateways see it so.
async fn a_key_back_from_its_cooldown_starts_at_the_least_count(backend: Backend) {
    let store = Store::start(backend);
    let api = api(1000, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS[..2], 0, "")
        .least_used()
        .cooldown(Cooldown::new());
    let gateways = start(&Config::new().store(&store).route(route), &store);
    let addr = |i: usize| gateways[i % gateways.len()].proxy_addr();
    api.refuse_next(&bearer("key-a"), 1, "3").unwrap();
    // Ties go to the smallest name: key-a gets the first request, and its 429.
    let first = request(addr(0), "GET", HOST, "/", &[], b"").await;
    assert_eq!(first.status, 429, "{}", first.text());

    // key-b takes the traffic while key-a cools: ten assignments ahead of it.
    for i in 0..10 {
        let r = request(addr(i), "GET", HOST, "/", &[], b"").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let ended = wait_until_async(Duration::from_secs(20), || async {
        let mut over = true;
        for gw in &gateways {
            over &= member_status(gw, "key-a").await["cooling_ms"].is_null();
        }
        over
    })
    .await;
    assert!(ended, "key-a's cooldown ends");

    let before = api.served(&bearer("key-a"));
    for i in 0..6 {
        let r = request(addr(i), "GET", HOST, "/", &[], b"").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let back = api.served(&bearer("key-a")) - before;
    assert!(
        (1..=3).contains(&back),
        "key-a shares the six requests after its cooldown with key-b, not takes them all: {back}"
    );
}

/// A member that answers 429 as soon as it has a request's head, before any of its body, and
/// counts the heads it got.
async fn early_refuser() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = std::sync::Arc::new(AtomicUsize::new(0));
    let count = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let (mut buf, mut got) = (vec![0u8; 16 * 1024], Vec::new());
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                count.fetch_add(1, Ordering::SeqCst);
                let answer = "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 30\r\n\
                              Content-Length: 0\r\n\r\n";
                if conn.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
                // The rest of the body, read and dropped, so that the connection ends cleanly.
                while matches!(conn.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    (addr, heads)
}

/// A 429 that comes while a body larger than the replay buffer is still arriving is not
/// replayed, though what has arrived so far would fit: the rest cannot be held for another
/// member (SPEC §8: bodies of at most 64 KiB). The client gets the 429; the other key gets
/// nothing.
async fn a_body_still_arriving_past_the_replay_buffer_is_not_replayed(backend: Backend) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let store = Store::start(backend);
    let ((a, a_heads), (b, b_heads)) = (early_refuser().await, early_refuser().await);
    let route = Route::new("keys")
        .member(url(a))
        .member(url(b))
        .least_used()
        .cooldown(Cooldown::new().retry());
    let gateways = start(&Config::new().store(&store).route(route), &store);
    let mut client = tokio::net::TcpStream::connect(gateways[0].proxy_addr())
        .await
        .unwrap();
    let head = format!("POST /upload HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 200000\r\n\r\n");
    client.write_all(head.as_bytes()).await.unwrap();
    client.write_all(&[b'x'; 10_000]).await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = client.read(&mut buf).await.unwrap();
        assert!(n > 0, "an answer before the body is whole");
        answer.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 429"), "{text}");
    let sent = a_heads.load(Ordering::SeqCst) + b_heads.load(Ordering::SeqCst);
    assert_eq!(sent, 1, "one member got the request");
}

/// `retry: true` replays a 429 only: another status in `on_status` cools its key, but the key
/// may have done the work, so its answer goes to the client and no other key gets the request.
async fn retry_replays_a_429_only(backend: Backend) {
    let store = Store::start(backend);
    let api = api(1000, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS, 0, "")
        .least_used()
        .cooldown(Cooldown::new().on_status(&[429, 503]).retry());
    let gateways = start(&Config::new().store(&store).route(route), &store);
    let gw = &gateways[0];
    let r = request(gw.proxy_addr(), "POST", HOST, "/status/503", &[], b"{}").await;
    assert_eq!(r.status, 503, "{}", r.text());
    let sent: Vec<_> = api
        .request_log()
        .into_iter()
        .filter(|l| l.target == "/status/503")
        .collect();
    assert_eq!(sent.len(), 1, "sent to one key only: {sent:?}");
}

/// With `retry: true`, a 429 on one key is answered from another key: the client sees 200,
/// and the API got the body once with each key. A body over 64 KiB is not replayed.
async fn retry_answers_from_another_key_and_sends_the_body_once_to_each(backend: Backend) {
    let store = Store::start(backend);
    let api = api(1000, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS, 0, "")
        .least_used()
        .cooldown(Cooldown::new().retry());
    let gateways = start(&Config::new().store(&store).route(route), &store);
    let gw = &gateways[0];
    api.refuse_next(&bearer("key-a"), 1, "30").unwrap();

    let body = br#"{"model":"m","prompt":"hello"}"#.repeat(40);
    let headers = [("Content-Type", "application/json")];
    let r = request(gw.proxy_addr(), "POST", HOST, "/v1/chat", &headers, &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["headers"]["authorization"],
        bearer("key-b").as_str(),
        "answered with the next key"
    );
    let log: Vec<_> = api
        .request_log()
        .into_iter()
        .filter(|l| l.target == "/v1/chat")
        .collect();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(
        (log[0].key.as_str(), log[0].status),
        (bearer("key-a").as_str(), 429)
    );
    assert_eq!(
        (log[1].key.as_str(), log[1].status),
        (bearer("key-b").as_str(), 200)
    );
    assert!(log
        .iter()
        .all(|l| l.body_len == body.len() as u64 && l.body_sha256 == log[0].body_sha256));

    // key-a cools; key-c has the fewest assignments. Its 429 on a body too large to replay
    // reaches the client, and key-b is not tried.
    api.refuse_next(&bearer("key-c"), 1, "30").unwrap();
    let large = vec![b'x'; 70 * 1024];
    let r = request(
        gw.proxy_addr(),
        "POST",
        HOST,
        "/v1/upload",
        &headers,
        &large,
    )
    .await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("x-upstream"), Some("api"));
    let uploads: Vec<_> = api
        .request_log()
        .into_iter()
        .filter(|l| l.target == "/v1/upload")
        .collect();
    assert_eq!(uploads.len(), 1, "not replayed: {uploads:?}");
    assert_eq!(uploads[0].key, bearer("key-c"));
}

/// One request a second, and requests started one after another while the first ones wait:
/// all get 200, and reach the API in the order they arrived.
async fn waiters_are_served_in_arrival_order(backend: Backend) {
    let store = Store::start(backend);
    let api = api(1000, Duration::from_secs(60)).await;
    let route =
        pool(&api, &KEYS[..1], 0, "").quota(Quota::window("second", 1, "1s").max_wait("30s"));
    let config = Config::new().store(&store).route(route);
    let gw = config.start();
    let addr = gw.proxy_addr();
    let first = request(addr, "GET", HOST, "/seq/0", &[], b"").await;
    assert_eq!(first.status, 200);

    let mut tasks = Vec::new();
    for i in 1..=4u64 {
        tasks.push(tokio::spawn(async move {
            request(addr, "GET", HOST, &format!("/seq/{i}"), &[], b"").await
        }));
        // The next request starts once this one stands in the line, or has already left it:
        // on a loaded machine the window (1 s) may pass before all four stand in it at once.
        let queued = wait_until_async(Duration::from_secs(20), || async {
            waiting(&gw).await + api.request_log().len() as u64 > i
        })
        .await;
        assert!(queued, "request {i} waits");
    }
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let order: Vec<String> = api.request_log().into_iter().map(|l| l.target).collect();
    assert_eq!(order, ["/seq/0", "/seq/1", "/seq/2", "/seq/3", "/seq/4"]);
}

/// With `max_waiting: 2`, a third waiter is refused at once, with the exact Retry-After, while
/// the two in the line are still waiting; those two get 200. The window (8 s) is far longer than
/// the steps before the refusal take on a loaded machine.
async fn past_max_waiting_the_answer_is_immediate(backend: Backend) {
    let store = Store::start(backend);
    let api = api(1000, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS[..1], 0, "").quota(
        Quota::window("slow", 1, "8s")
            .max_wait("30s")
            .max_waiting(2),
    );
    let gw = Config::new().store(&store).route(route).start();
    let addr = gw.proxy_addr();
    assert_eq!(request(addr, "GET", HOST, "/", &[], b"").await.status, 200);
    let waiters: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { request(addr, "GET", HOST, "/", &[], b"").await }))
        .collect();
    let queued = wait_until_async(Duration::from_secs(20), || async {
        waiting(&gw).await == 2
    })
    .await;
    assert!(queued, "two requests wait");
    let refused = request(addr, "GET", HOST, "/", &[], b"").await;
    assert_sluice_refusal(&refused, 8_000);
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "the line was full when it was refused"
    );
    for w in waiters {
        assert_eq!(w.await.unwrap().status, 200);
    }
    assert_eq!(api.served(&bearer("key-a")), 3);
}

/// Two keys of one request a second each and `max_wait`: four requests at once all get 200,
/// and the API never answers 429: the waiters wait for a member's own window.
async fn requests_wait_for_a_member_window(backend: Backend) {
    let store = Store::start(backend);
    // The API's window is a quarter of sluice's: the time a request takes to reach it varies
    // (by more than half a second on a loaded machine), and sluice's own window must be what
    // holds, not a race between two clocks.
    let api = api(1, Duration::from_millis(500)).await;
    let route = pool(&api, &KEYS[..2], 1, "2s")
        .least_used()
        .quota(Quota::waiting_only("30s"));
    let gw = Config::new().store(&store).route(route).start();
    for r in burst(std::slice::from_ref(&gw), 4).await {
        assert_eq!(r.status, 200, "{}", r.text());
    }
    for k in &KEYS[..2] {
        assert_eq!(api.refused(&bearer(k)), 0, "the API never refused {k}");
        assert_eq!(api.served(&bearer(k)), 2);
    }
}

/// Key values never appear in the access log, the gateway's own log, `/status` or `/metrics`,
/// after ordinary requests, a cooldown and a replay; nor in `sluice check` for a broken config.
async fn key_values_appear_nowhere(backend: Backend) {
    let store = Store::start(backend);
    let api = api(1000, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS, 1000, "1m")
        .least_used()
        .cooldown(Cooldown::new().retry());
    let config = Config::new().store(&store).route(route);
    let gateways = start(&config, &store);
    api.refuse_next(&bearer("key-a"), 1, "30").unwrap();
    for r in burst(&gateways, 6).await {
        assert_eq!(r.status, 200, "{}", r.text());
    }
    for gw in &gateways {
        let status = gw.status().await.to_string();
        let metrics = gw.metrics().await;
        let logs = gw.logs();
        for k in KEYS {
            let s = secret(k);
            assert!(!status.contains(&s), "/status shows {k}'s key");
            assert!(!metrics.contains(&s), "/metrics shows {k}'s key");
            assert!(!logs.contains(&s), "the log shows {k}'s key");
        }
        assert!(
            status.contains("authorization"),
            "header names are shown: {status}"
        );
    }
    // A broken config: a bad window next to the keys.
    let broken = Config::new().route(
        pool(&api, &KEYS, 1000, "1m")
            .least_used()
            .quota(Quota::window("w", 1, "1ns")),
    );
    let err = broken.check().expect_err("the config is broken");
    for k in KEYS {
        assert!(
            !err.contains(&secret(k)),
            "check output shows {k}'s key: {err}"
        );
    }
}

/// The burst and the cooldown on a Redis Cluster, with two gateways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_cluster_member_limits_and_cooldowns_hold() {
    let cluster = RedisCluster::start();
    let api = api(5, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS, 5, "1m")
        .least_used()
        .cooldown(Cooldown::new().max("1m"));
    let config = Config::new()
        .state(State::cluster(cluster.urls()).timeout(support::config::REDIS_TIMEOUT))
        .route(route);
    let gateways = [config.start(), config.start()];
    api.refuse_next(&bearer("key-a"), 1, "600").unwrap();
    let first = request(gateways[0].proxy_addr(), "GET", HOST, "/", &[], b"").await;
    assert_eq!(first.status, 429, "the API's 429 on key-a");
    // key-a cools for a minute: the other two keys take 5 each, then sluice refuses.
    let responses = burst(&gateways, 14).await;
    assert_eq!(responses.iter().filter(|r| r.status == 200).count(), 10);
    for r in responses.iter().filter(|r| r.status != 200) {
        assert_sluice_refusal(r, 60_000);
    }
    assert_eq!(api.served(&bearer("key-a")), 0);
    for k in &KEYS[1..] {
        assert_eq!(api.served(&bearer(k)), 5);
        assert_eq!(api.refused(&bearer(k)), 0);
    }
}

/// A burst of 40 requests over two gateways sharing a Redis, against three keys of 10 a minute
/// each (one request per gateway taken before): exactly 28 more reach the API, 10 per key, and sluice refuses the
/// rest itself. With `state.redis.batch: false`, each request is one script call of its own;
/// with batching on (the default), requests waiting together share calls, so there are never
/// more calls than requests (how many fewer depends on the machine's timing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_on_redis_counts_exactly_with_batching_on_and_off() {
    for batch in [false, true] {
        let redis = sluice_testkit::RedisServer::start();
        let api = api(1_000, Duration::from_secs(60)).await;
        let route = pool(&api, &KEYS, 10, "1m")
            .least_used()
            .cooldown(Cooldown::new().max("1m"));
        let config = Config::new()
            .state(State::redis(redis.url()).batch(batch))
            .route(route);
        let gateways = [config.start(), config.start()];
        // Each gateway's first request loads sluice's library (or scripts) and syncs the pool.
        for gw in &gateways {
            let r = request(gw.proxy_addr(), "GET", HOST, "/", &[], b"").await;
            assert_eq!(r.status, 200, "{}", r.text());
        }
        redis.command(&["CONFIG", "RESETSTAT"]).unwrap();
        let responses = burst(&gateways, 40).await;
        let calls = redis.command_calls("fcall") + redis.command_calls("evalsha");
        let admitted = responses.iter().filter(|r| r.status == 200).count();
        assert_eq!(admitted, 28, "batch {batch}: 30 in all, 10 per key");
        for r in responses.iter().filter(|r| r.status != 200) {
            assert_sluice_refusal(r, 60_000);
        }
        for k in KEYS {
            assert_eq!(
                api.served(&bearer(k)),
                10,
                "batch {batch}: {k} got its limit"
            );
        }
        if batch {
            assert!(
                calls <= 40,
                "batch {batch}: {calls} script calls for 40 requests"
            );
        } else {
            assert_eq!(calls, 40, "batch {batch}: one script call per request");
        }
        eprintln!("batch {batch}: {calls} script calls for 40 requests");
    }
}

/// A cooldown is read back from Redis, where anything may have been written (by hand, by a
/// tool, by a test clock on a live prefix). One that ends past the year 9999, which RFC 3339
/// cannot write, leaves `/status` answering: the member shows its `cooling_ms`, without a
/// `cooling_until` (formatting that date panicked the admin task, and `/status` stayed
/// broken for as long as the entry lasted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cooldown_past_the_year_9999_in_redis_leaves_status_answering() {
    let redis = sluice_testkit::RedisServer::start();
    let api = api(1_000, Duration::from_secs(60)).await;
    let route = pool(&api, &KEYS[..2], 0, "")
        .least_used()
        .cooldown(Cooldown::new().max("1m"));
    let gw = Config::new()
        .state(State::redis(redis.url()))
        .route(route)
        .start();
    // About the year 30,000, in µs since the epoch.
    redis
        .command(&["ZADD", "sluice:{keys}:cool", "900000000000000000", "key-a"])
        .unwrap();
    let m = member_status(&gw, "key-a").await;
    // Some 28,000 years in ms.
    assert!(
        m["cooling_ms"].as_u64().unwrap_or(0) > 800_000_000_000_000,
        "{m}"
    );
    assert!(m["cooling_until"].is_null(), "{m}");
    let other = member_status(&gw, "key-b").await;
    assert!(other["cooling_ms"].is_null(), "{other}");
    // The metrics, which read the same cooldowns, answer too.
    assert_eq!(gw.admin("/metrics").await.status, 200);
}
