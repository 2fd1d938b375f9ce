//! Usage-metered quotas are exact across every instance, end to end: the real `sluice` binary
//! in front of the OpenAI stub, on the memory store (one gateway), on one redis-server shared
//! by two gateways, and on a real Redis Cluster shared by two gateways.
//!
//! - After a burst of concurrent requests, the window holds the sum of what they used.
//! - While answers are held in flight, it holds what settled plus what the held ones reserved.
//! - With more concurrent requests than fit, exactly as many as fit are admitted, the rest
//!   refused `429 quota_exceeded`.
//!
//! What a window holds is read from `/status`, which reads the store (and, on Redis, from the
//! window's key itself), never inferred from timing. Also here: a route that meters usage
//! refuses CONNECT tunnels and does not open WebSockets, whose answers sluice cannot read.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use sluice_echo::openai::OpenAiStub;
use sluice_testkit::RedisCluster;
use support::{
    request, url, wait_until_async, Backend, Config, Egress, Gateway, Route, State, Store,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// How long a condition may take to hold on a loaded machine.
const WAIT: Duration = Duration::from_secs(20);

/// The gateways of one test, the stub behind them, and the route they share.
struct Bench {
    gateways: Vec<Gateway>,
    stub: OpenAiStub,
    route: String,
}

/// `instances` gateways on `state`, each with route `route` (host `<route>.test`) over one
/// OpenAI stub, whose window `tpm` holds `limit` tokens a minute, reserving the request's
/// `max_tokens` (default 100) and settling `usage.total_tokens`.
async fn bench(state: State, instances: usize, route: &str, limit: u64) -> Bench {
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let base = Config::new()
        .state(state)
        .route(
            Route::new(route)
                .hosts(&[&format!("{route}.test")])
                .member(url(stub.local_addr())),
        )
        .yaml();
    let mut config: Value = serde_yaml::from_str(&base).unwrap();
    config["routes"][0]["quota"] = tokens_quota(limit);
    let yaml = serde_yaml::to_string(&config).unwrap();
    let gateways = (0..instances)
        .map(|_| Gateway::start_with_ports(&yaml))
        .collect();
    Bench {
        gateways,
        stub,
        route: route.to_string(),
    }
}

/// A quota of one sliding window of `limit` tokens a minute.
fn tokens_quota(limit: u64) -> Value {
    serde_yaml::from_str(&format!(
        r#"
windows:
  - {{ name: tpm, limit: {limit}, window: 1m, unit: tokens }}
usage:
  tokens:
    reserve: {{ json: "max_tokens", default: 100 }}
    settle: {{ json: "usage.total_tokens" }}
"#
    ))
    .unwrap()
}

impl Bench {
    /// What the window holds now, in tokens, as gateway `i`'s `/status` reads it from the store.
    async fn held_by(&self, i: usize) -> u64 {
        let status = self.gateways[i].status().await;
        let route = status["routes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == self.route.as_str())
            .unwrap()
            .clone();
        let window = &route["quota"][0];
        assert_eq!(window["unit"], "tokens", "{window}");
        let limit = window["limit"].as_u64().unwrap();
        limit - window["remaining"].as_u64().unwrap_or(limit)
    }

    /// Waits until every gateway reads `tokens` in the window, and fails saying what they read.
    async fn holds(&self, tokens: u64) {
        let all = || async {
            let mut read = Vec::new();
            for i in 0..self.gateways.len() {
                read.push(self.held_by(i).await);
            }
            read
        };
        let ok =
            wait_until_async(WAIT, || async { all().await.iter().all(|&t| t == tokens) }).await;
        if !ok {
            panic!(
                "the window holds {:?} tokens (per gateway), not {tokens}",
                all().await
            );
        }
    }

    /// A chat completion through gateway `i` reserving `max_tokens` and using `used` tokens
    /// (prompt and completion split), sent on a task of its own.
    fn chat(
        &self,
        i: usize,
        max_tokens: u64,
        used: u64,
    ) -> tokio::task::JoinHandle<support::Response> {
        let addr = self.gateways[i % self.gateways.len()].proxy_addr();
        let host = format!("{}.test", self.route);
        tokio::spawn(async move {
            let body = json!({"model": "m", "max_tokens": max_tokens, "messages": []}).to_string();
            let prompt = (used / 3).to_string();
            let completion = (used - used / 3).to_string();
            request(
                addr,
                "POST",
                &host,
                "/v1/chat/completions",
                &[
                    ("Content-Type", "application/json"),
                    ("Accept-Encoding", "identity"),
                    ("x-stub-prompt-tokens", &prompt),
                    ("x-stub-completion-tokens", &completion),
                ],
                body.as_bytes(),
            )
            .await
        })
    }
}

/// A burst of concurrent requests with known, different usages through every gateway: once
/// all are answered, the window holds exactly the sum of what they used.
async fn a_burst_totals_the_settled_usages(bench: Bench) {
    let used: Vec<u64> = (0..24).map(|i| 7 + 13 * i).collect();
    let tasks: Vec<_> = used
        .iter()
        .enumerate()
        .map(|(i, &u)| bench.chat(i, 500, u))
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    bench.holds(used.iter().sum()).await;
}

/// With answers held in flight, the window holds what settled plus what the held requests
/// reserved; once released, what they used replaces their reservations.
async fn held_answers_count_their_reservations(bench: Bench) {
    let settled: Vec<u64> = vec![11, 29, 40];
    for (i, &u) in settled.iter().enumerate() {
        assert_eq!(bench.chat(i, 300, u).await.unwrap().status, 200);
    }
    let settled_sum: u64 = settled.iter().sum();
    bench.holds(settled_sum).await;

    bench.stub.hold();
    let reserved: Vec<u64> = (0..6).map(|i| 50 + 17 * i).collect();
    let used: Vec<u64> = (0..6).map(|i| 5 + 3 * i).collect();
    let tasks: Vec<_> = reserved
        .iter()
        .zip(&used)
        .enumerate()
        .map(|(i, (&r, &u))| bench.chat(i, r, u))
        .collect();
    let stub = &bench.stub;
    assert!(
        wait_until_async(WAIT, || async { stub.held() == tasks.len() }).await,
        "{} of {} held",
        stub.held(),
        tasks.len()
    );
    bench
        .holds(settled_sum + reserved.iter().sum::<u64>())
        .await;

    stub.release();
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 200);
    }
    bench.holds(settled_sum + used.iter().sum::<u64>()).await;
}

/// With limit L, S already settled and R reserved per request, N > L/R concurrent requests
/// held in flight: exactly ⌊(L − S)/R⌋ are admitted, and the rest refused `quota_exceeded`,
/// whichever gateway each went through.
async fn admission_never_exceeds_the_limit(bench: Bench, limit: u64) {
    let settled = 130;
    assert_eq!(bench.chat(0, 200, settled).await.unwrap().status, 200);
    bench.holds(settled).await;

    let reservation = 100;
    let n = 15;
    let fit = usize::try_from((limit - settled) / reservation).unwrap();
    assert!(n > fit, "more requests than fit");
    bench.stub.hold();
    let tasks: Vec<_> = (0..n).map(|i| bench.chat(i, reservation, 1)).collect();
    let stub = &bench.stub;
    // The admitted requests wait at the stub; the refused ones are answered at once.
    let refused = Arc::new(Mutex::new(Vec::new()));
    let mut pending = Vec::new();
    for t in tasks {
        let refused = refused.clone();
        pending.push(tokio::spawn(async move {
            let r = t.await.unwrap();
            if r.status != 200 {
                refused
                    .lock()
                    .unwrap()
                    .push((r.status, r.header("x-sluice-error").map(str::to_string)));
            }
            r.status
        }));
    }
    let split = wait_until_async(WAIT, || async {
        stub.held() == fit && refused.lock().unwrap().len() == n - fit
    })
    .await;
    assert!(
        split,
        "{} held, refused {:?}, {fit} should fit",
        stub.held(),
        refused.lock().unwrap()
    );
    // From the store's record: the admitted ones' reservations, beside what had settled.
    bench
        .holds(settled + reservation * u64::try_from(fit).unwrap())
        .await;
    for (status, code) in refused.lock().unwrap().iter() {
        assert_eq!(*status, 429);
        assert_eq!(code.as_deref(), Some("quota_exceeded"));
    }

    stub.release();
    let mut admitted = 0;
    for p in pending {
        if p.await.unwrap() == 200 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, fit);
    // Each admitted request used 1 token.
    bench.holds(settled + u64::try_from(fit).unwrap()).await;
}

async fn on_store(backend: Backend, route: &str, limit: u64) -> (Store, Bench) {
    let store = Store::start(backend);
    let bench = bench(store.state(), store.instances(), route, limit).await;
    (store, bench)
}

async fn a_burst_through_every_gateway_totals_exactly(backend: Backend) {
    let (_store, bench) = on_store(backend, "burst", 1_000_000).await;
    a_burst_totals_the_settled_usages(bench).await;
}

async fn in_flight_total_is_settled_plus_reserved(backend: Backend) {
    let (_store, bench) = on_store(backend, "held", 1_000_000).await;
    held_answers_count_their_reservations(bench).await;
}

async fn concurrent_admission_stops_exactly_at_the_limit(backend: Backend) {
    let (_store, bench) = on_store(backend, "admit", 1000).await;
    admission_never_exceeds_the_limit(bench, 1000).await;
}

/// On Redis, the window's own log holds the same total as `/status` reads: one entry
/// `<seq>:<amount>` per request (SPEC §6, crates/store/src/keys.rs), each amount in millionths
/// of a token, rewritten in place by its settlement.
async fn the_window_log_holds_each_settled_usage(backend: Backend) {
    let (store, bench) = on_store(backend, "log", 1_000_000).await;
    let used = [3, 5, 8, 13];
    for (i, u) in used.into_iter().enumerate() {
        assert_eq!(bench.chat(i, 50, u).await.unwrap().status, 200);
    }
    bench.holds(used.iter().sum()).await;
    let Some(redis) = store.redis() else {
        return;
    };
    let log = sluice_store::keys::Keys::new("sluice").quota_log("log", "tpm", "route");
    let mut amounts: Vec<u64> = redis
        .zrange_with_scores(&log)
        .iter()
        .map(|(entry, _)| {
            let (_, amount) = entry.rsplit_once(':').expect("<seq>:<amount>");
            amount.parse::<u64>().unwrap() / 1_000_000
        })
        .collect();
    amounts.sort_unstable();
    assert_eq!(amounts, used, "entries of {log}");
}

on_both_stores!(
    a_burst_through_every_gateway_totals_exactly,
    in_flight_total_is_settled_plus_reserved,
    concurrent_admission_stops_exactly_at_the_limit,
    the_window_log_holds_each_settled_usage,
    a_connect_on_a_metered_route_is_refused,
    a_connect_on_a_route_whose_members_meter_usage_is_refused,
    a_websocket_handshake_on_a_metered_route_stays_a_plain_request,
);

/// The same behaviours with two gateways on a real Redis Cluster (3 masters, 3 replicas).
mod cluster {
    use super::*;

    async fn on_cluster(route: &str, limit: u64) -> (RedisCluster, Bench) {
        let cluster = RedisCluster::start();
        let bench = bench(State::cluster(cluster.urls()), 2, route, limit).await;
        (cluster, bench)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_through_two_gateways_totals_exactly() {
        let (_cluster, bench) = on_cluster("burst", 1_000_000).await;
        a_burst_totals_the_settled_usages(bench).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_flight_total_is_settled_plus_reserved() {
        let (_cluster, bench) = on_cluster("held", 1_000_000).await;
        held_answers_count_their_reservations(bench).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_admission_stops_exactly_at_the_limit() {
        let (_cluster, bench) = on_cluster("admit", 1000).await;
        admission_never_exceeds_the_limit(bench, 1000).await;
    }
}

/// A listener that counts the connections it accepts and echoes what they send.
async fn counting_listener() -> (u16, Arc<Mutex<u32>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = Arc::new(Mutex::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            *seen.lock().unwrap() += 1;
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    (port, count)
}

/// A gateway on `store` with route `metered` (every host) over a `direct` member, tunnels to
/// `port` allowed, and `quota` set on the route by `set`.
fn tunnel_gateway(store: &Store, port: u16, set: impl FnOnce(&mut Value)) -> Gateway {
    let base = Config::new()
        .store(store)
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(Route::new("metered").hosts(&["*"]).direct_member())
        .yaml();
    let mut config: Value = serde_yaml::from_str(&base).unwrap();
    set(&mut config["routes"][0]);
    Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap())
}

/// A tunnel's answers cannot be read, so its one reservation would stand for any number of
/// unmetered answers: a CONNECT is refused `405 connect_not_supported`, with the reason, before
/// anything is reserved or contacted.
async fn assert_tunnel_refused(gw: &Gateway, port: u16, contacted: &Mutex<u32>) {
    let (client, r) =
        support::open_tunnel(gw.proxy_addr(), &format!("127.0.0.1:{port}"), true).await;
    drop(client);
    assert_eq!(r.status, 405, "{}", gw.logs());
    assert_eq!(r.header("x-sluice-error"), Some("connect_not_supported"));
    assert!(r.header("allow").is_some_and(|a| !a.contains("CONNECT")));
    assert_eq!(*contacted.lock().unwrap(), 0, "nothing contacted");
}

async fn a_connect_on_a_metered_route_is_refused(backend: Backend) {
    let store = Store::start(backend);
    let (port, contacted) = counting_listener().await;
    let gw = tunnel_gateway(&store, port, |route| route["quota"] = tokens_quota(1000));
    assert_tunnel_refused(&gw, port, &contacted).await;
    // Nothing was reserved: the window is whole.
    let status = gw.status().await;
    assert_eq!(
        status["routes"][0]["quota"][0]["remaining"], 1000,
        "{status}"
    );
}

async fn a_connect_on_a_route_whose_members_meter_usage_is_refused(backend: Backend) {
    let store = Store::start(backend);
    let (port, contacted) = counting_listener().await;
    let gw = tunnel_gateway(&store, port, |route| {
        let mut quota = tokens_quota(1000);
        let windows = quota["windows"].take();
        quota["windows"] = json!([]);
        route["quota"] = quota;
        route["upstream"]["members"][0]["quota"] = json!({ "windows": windows });
    });
    assert_tunnel_refused(&gw, port, &contacted).await;
}

/// A member that records the head of each request, and answers a WebSocket handshake `101`
/// (then holds the connection), anything else a plain `200`.
async fn upgrading_member() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut chunk = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
                let upgrade = head.contains("upgrade: websocket");
                seen.lock().unwrap().push(head);
                let answer: &[u8] = if upgrade {
                    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
                } else {
                    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nplain"
                };
                let _ = conn.write_all(answer).await;
                // Held open: an upgraded connection stays until the client leaves.
                let _ = conn.read(&mut chunk).await;
            });
        }
    });
    (addr, heads)
}

/// A WebSocket's messages are answers sluice cannot read: on a route that meters usage the
/// handshake goes to the member as a plain request, without `Upgrade`, so no socket opens.
async fn a_websocket_handshake_on_a_metered_route_stays_a_plain_request(backend: Backend) {
    let store = Store::start(backend);
    let (member, heads) = upgrading_member().await;
    let base = Config::new()
        .store(&store)
        .route(Route::new("ws").hosts(&["ws.test"]).member(url(member)))
        .yaml();
    let mut config: Value = serde_yaml::from_str(&base).unwrap();
    config["routes"][0]["quota"] = tokens_quota(1000);
    let gw = Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());
    let r = request(
        gw.proxy_addr(),
        "GET",
        "ws.test",
        "/socket",
        &[
            ("Connection", "Upgrade"),
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("Sec-WebSocket-Version", "13"),
        ],
        b"",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(!heads[0].contains("upgrade: websocket"), "{}", heads[0]);
}
