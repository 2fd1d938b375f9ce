//! What only the Redis store has to get right: reconnecting, reloading its library and scripts,
//! falling back from functions to scripts, timing out,
//! its key layout and the memory each admitted request costs.

use std::time::{Duration, Instant};

use std::sync::Arc;

use sluice_allocator::StateStore;
use sluice_limiter::{Acquire, StoreError, Window};
use sluice_store::{RedisConnection, RedisStore, RedisStoreConfig};
use sluice_testkit::{RedisCluster, RedisServer};

fn store(server: &RedisServer, timeout: Duration) -> RedisStore {
    store_at(server.url(), timeout)
}

fn store_at(url: String, timeout: Duration) -> RedisStore {
    RedisStore::new(RedisStoreConfig {
        url,
        key_prefix: "sluice".into(),
        timeout,
    })
    .unwrap()
}

fn one_window(limit: u64) -> Vec<Window> {
    vec![Window {
        name: "minute".into(),
        limit,
        length_us: 60_000_000,
    }]
}

async fn acquire(store: &RedisStore, windows: &[Window], cost: u64) -> Result<bool, StoreError> {
    store
        .acquire(Acquire {
            route: "api",
            key: "route",
            windows,
            cost,
            at_us: None,
            client: None,
        })
        .await
        .map(|o| o.admitted)
}

#[tokio::test]
async fn a_restarted_empty_redis_fails_no_call() {
    let mut server = RedisServer::start();
    let store = store(&server, Duration::from_secs(5));
    let w = one_window(1000);
    assert!(acquire(&store, &w, 1).await.unwrap());
    server.restart();
    // The first call after the restart meets the dead connection; the store retries it once.
    for i in 0..20 {
        assert!(
            acquire(&store, &w, 1).await.unwrap(),
            "call {i} after restart"
        );
    }
}

/// Redis is down when the call starts and back 300 ms later, well within the store's timeout:
/// the call waits for it rather than failing, so a route with `on_store_error: closed` does not
/// answer 503 for a restart that ends in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_made_while_redis_restarts_waits_for_it_within_the_timeout() {
    let mut server = RedisServer::start();
    // Far longer than the outage plus a redis-server start on a loaded machine.
    let store = store(&server, Duration::from_secs(15));
    let w = one_window(1000);
    assert!(acquire(&store, &w, 1).await.unwrap());
    server.kill();
    let restarted = std::thread::spawn(move || {
        // The outage being simulated, not a wait for a condition.
        std::thread::sleep(Duration::from_millis(300));
        server.restart();
        server
    });
    for i in 0..3 {
        assert!(
            acquire(&store, &w, 1).await.unwrap(),
            "call {i} during the restart"
        );
    }
    let _server = restarted.join().unwrap();
}

/// The library is loaded on first use, and again whenever Redis has lost it; so is a script.
/// Each call is counted once, however it had to be sent.
#[tokio::test]
async fn function_and_script_flushes_are_transparent() {
    let server = RedisServer::start();
    let store = store(&server, Duration::from_secs(5));
    let w = one_window(1000);
    assert!(acquire(&store, &w, 1).await.unwrap());
    assert!(store.uses_functions());
    let libraries = server.command(&["FUNCTION", "LIST"]).unwrap();
    assert!(libraries.contains(store.library_name()), "{libraries}");
    assert!(store.library_name().starts_with("sluice_"));
    for flush in [["FUNCTION", "FLUSH"], ["SCRIPT", "FLUSH"]] {
        assert!(server.command(&flush).unwrap().starts_with("+OK"));
        assert!(acquire(&store, &w, 1).await.unwrap(), "after {flush:?}");
    }
    assert!(store.uses_functions());
    assert_eq!(
        server.integer(&["ZCARD", "sluice:{api}:q:minute:route"]),
        Some(3)
    );
    assert_eq!(server.command_calls("evalsha"), 0);
}

/// A burst of calls that all find the library missing (a fresh Redis, a restart without
/// persistence, `FUNCTION FLUSH`) loads it once, not once per call: the others wait for that
/// load and send their call again. Fifty routes, so that fifty calls are out at once (a
/// route's requests would share one call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_calls_that_find_the_library_missing_loads_it_once() {
    let server = RedisServer::start();
    let store = Arc::new(store(&server, Duration::from_secs(5)));
    let routes: Vec<String> = (0..50).map(|i| format!("api{i}")).collect();
    for round in ["first use", "after FUNCTION FLUSH"] {
        if round != "first use" {
            assert!(server
                .command(&["FUNCTION", "FLUSH"])
                .unwrap()
                .starts_with("+OK"));
        }
        let before = server.command_calls("function|load");
        let calls: Vec<_> = routes
            .iter()
            .map(|route| {
                let store = store.clone();
                let route = route.clone();
                tokio::spawn(async move {
                    let w = one_window(1000);
                    store
                        .acquire(Acquire {
                            route: &route,
                            key: "route",
                            windows: &w,
                            cost: 1,
                            at_us: None,
                            client: None,
                        })
                        .await
                        .map(|o| o.admitted)
                })
            })
            .collect();
        for call in calls {
            let admitted = call.await.unwrap();
            assert!(matches!(admitted, Ok(true)), "{round}: {admitted:?}");
        }
        let loads = server.command_calls("function|load") - before;
        // One load; a call whose function went missing just as another's load ended may
        // load once more, which is harmless.
        assert!((1..=2).contains(&loads), "{round}: {loads} loads");
    }
    assert!(store.uses_functions());
}

/// A Redis that refuses functions (Redis 6 has none; here an ACL denies them) gets every call
/// as `EVALSHA`, from the first, and counts each once.
#[tokio::test]
async fn without_functions_calls_go_as_scripts() {
    let server = RedisServer::start();
    let store = store_at(server.url_without_functions(), Duration::from_secs(5));
    let w = one_window(3);
    for i in 0..3 {
        assert!(acquire(&store, &w, 1).await.unwrap(), "call {i}");
        assert!(!store.uses_functions());
    }
    assert!(!acquire(&store, &w, 1).await.unwrap(), "the limit holds");
    assert_eq!(
        server.integer(&["ZCARD", "sluice:{api}:q:minute:route"]),
        Some(3)
    );
    assert_eq!(server.command_calls("evalsha"), 5, "4 calls, one NOSCRIPT");
    assert_eq!(server.command_calls("fcall"), 0);
}

/// An ACL refusal of a command inside the library (here `ZADD`) is the call's error: the store
/// neither gives up on functions nor sends the call again as a script, since the function may
/// have run part way.
#[tokio::test]
async fn a_refusal_inside_a_function_is_not_a_refusal_of_functions() {
    let server = RedisServer::start();
    let store = store_at(
        server.user_url("no-zadd", &["-zadd"]),
        Duration::from_secs(5),
    );
    let err = acquire(&store, &one_window(10), 1).await.unwrap_err();
    assert!(err.to_string().contains("can't run this command"), "{err}");
    assert!(store.uses_functions());
    assert_eq!(server.command_calls("evalsha"), 0);
    assert_eq!(server.command_calls("eval"), 0);
}

#[tokio::test]
async fn an_unreachable_redis_errors_within_the_timeout() {
    let mut server = RedisServer::start();
    let store = store(&server, Duration::from_millis(100));
    // Room for every attempt below: a call that outlasts the timeout may still have counted.
    let w = one_window(1_000);
    // The first call also loads the library, which a loaded machine may delay past 100 ms: it
    // is tried until it answers, as after the restart below.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !matches!(acquire(&store, &w, 1).await, Ok(true)) {
        assert!(
            Instant::now() < deadline,
            "the store must answer while Redis is up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.kill();
    for _ in 0..5 {
        let started = Instant::now();
        assert!(acquire(&store, &w, 1).await.is_err());
        // Generous bound: this guards against hanging, it does not measure speed.
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    assert!(!store.ready().await);
    server.restart();
    // Calls made while the client reconnects may still fail (the route's policy covers them),
    // and so may any call a loaded machine delays past the 100 ms timeout; within a moment the
    // store answers again.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut recovered = false;
    while !recovered && Instant::now() < deadline {
        recovered = matches!(acquire(&store, &w, 1).await, Ok(true));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(recovered, "the store must recover after Redis returns");
    // A ping has the same 100 ms, which a loaded machine may delay past.
    while !store.ready().await {
        assert!(
            Instant::now() < deadline,
            "the store must be ready after Redis returns"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn keys_share_the_route_hash_tag_and_expire_when_idle() {
    let server = RedisServer::start();
    let store = store(&server, Duration::from_secs(5));
    // Long enough that the log has not expired yet when its TTL is read below, however slow
    // the machine (at 300 ms, a stall that long between the two reads -2: the key is gone).
    let w = vec![Window {
        name: "short".into(),
        limit: 10,
        length_us: 3_000_000,
    }];
    assert!(acquire(&store, &w, 3).await.unwrap());
    let keys = server.command(&["KEYS", "*"]).unwrap();
    assert!(keys.contains("sluice:{api}:q:short:route"), "{keys}");
    assert!(keys.contains("sluice:{api}:qm:route"), "{keys}");
    let ttl = server
        .integer(&["PTTL", "sluice:{api}:q:short:route"])
        .unwrap();
    // A log lives until its newest entry leaves the window, and at most an eighth longer: its
    // expiry is pushed back about eight times per window, not on every request (lua/quota.lua).
    assert!(
        ttl > 0 && ttl <= 3_000 * 9 / 8 + 1,
        "log TTL {ttl} (ms, rounded up)"
    );
    // Poll for it rather than sleeping past the TTL: Redis expires keys lazily and in an
    // active cycle, and a loaded machine may run that cycle late.
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.integer(&["DBSIZE"]) != Some(0) {
        assert!(
            Instant::now() < deadline,
            "idle keys vanish on their own: {}",
            server.command(&["KEYS", "*"]).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn one_log_entry_per_request_whatever_its_cost() {
    let server = RedisServer::start();
    let store = store(&server, Duration::from_secs(5));
    let mut report = Vec::new();
    for cost in [1u64, 100] {
        let w = vec![Window {
            name: format!("c{cost}").into(),
            limit: 1_000_000,
            length_us: 86_400_000_000,
        }];
        let n = 1000;
        for _ in 0..n {
            assert!(acquire(&store, &w, cost).await.unwrap());
        }
        let log = format!("sluice:{{api}}:q:c{cost}:route");
        assert_eq!(server.integer(&["ZCARD", &log]), Some(n));
        let bytes = server
            .integer(&["MEMORY", "USAGE", &log, "SAMPLES", "0"])
            .unwrap();
        report.push((cost, bytes as f64 / n as f64));
    }
    println!("bytes per admitted request (cost, bytes): {report:?}");
    for (cost, per_request) in report {
        assert!(
            per_request <= 150.0,
            "cost {cost}: {per_request} bytes per request"
        );
    }
}

/// A running total in a helper hash (HINCRBY by 0 answers an integer and changes nothing).
fn total(server: &RedisServer, meta: &str, field: &str) -> Option<i64> {
    server.integer(&["HINCRBY", meta, field, "0"])
}

/// The quota script trusts its helper hash for running totals and entry numbers, and checks
/// each log's oldest entry rather than the whole log. Either key vanishing between two calls
/// (deleted, evicted) must never admit over a limit, nor block what fits.
#[tokio::test]
async fn a_vanished_log_or_helper_hash_keeps_the_quota_exact() {
    let server = RedisServer::start();
    let store = store(&server, Duration::from_secs(5));
    let w = vec![
        Window {
            name: "a".into(),
            limit: 10,
            length_us: 3_600_000_000,
        },
        Window {
            name: "b".into(),
            limit: 1_000,
            length_us: 86_400_000_000,
        },
    ];
    for _ in 0..3 {
        assert!(acquire(&store, &w, 3).await.unwrap());
    }
    assert!(!acquire(&store, &w, 3).await.unwrap(), "9 + 3 > 10");

    // The helper hash goes: the logs still hold 9 units.
    server.command(&["DEL", "sluice:{api}:qm:route"]).unwrap();
    assert!(
        !acquire(&store, &w, 3).await.unwrap(),
        "9 + 3 > 10, hash or not"
    );
    assert!(acquire(&store, &w, 1).await.unwrap(), "9 + 1 fits");
    assert!(!acquire(&store, &w, 1).await.unwrap(), "10 + 1 > 10");
    // Rebuilt, and new entries numbered after the old ones (none overwritten).
    assert_eq!(total(&server, "sluice:{api}:qm:route", "s:a"), Some(10));
    assert_eq!(
        server.integer(&["ZCARD", "sluice:{api}:q:a:route"]),
        Some(4)
    );
    assert_eq!(
        server.integer(&["ZCARD", "sluice:{api}:q:b:route"]),
        Some(4)
    );

    // Window a's log goes: its stale total of 10 must not refuse what now fits.
    server.command(&["DEL", "sluice:{api}:q:a:route"]).unwrap();
    assert!(acquire(&store, &w, 10).await.unwrap(), "a is empty again");
    assert!(!acquire(&store, &w, 1).await.unwrap(), "10 + 1 > 10");
    assert_eq!(
        server.integer(&["ZCARD", "sluice:{api}:q:a:route"]),
        Some(1)
    );
    assert_eq!(total(&server, "sluice:{api}:qm:route", "s:b"), Some(20));
}

/// The window of the expiry tests: `ten`, ten minutes (`TEN_MINUTES_MS`).
const TEN_MINUTES_MS: u64 = 600_000;

fn ten_minutes(limit: u64) -> Vec<Window> {
    vec![Window {
        name: "ten".into(),
        limit,
        length_us: TEN_MINUTES_MS * 1000,
    }]
}

/// Expiries are pushed back only when they would come too soon (lua/quota.lua), not on every
/// request: a busy log still outlives its newest entry by its window, its helper hash outlives
/// it, and the running total is exactly what the log holds, entries of any cost.
#[tokio::test]
async fn a_busy_log_outlives_its_newest_entry_with_few_expiry_writes() {
    let server = RedisServer::start();
    let store = store(&server, Duration::from_secs(5));
    let w = ten_minutes(1_000_000);
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let mut units = 0;
    for i in 0..200u64 {
        let cost = 1 + i % 5;
        assert!(acquire(&store, &w, cost).await.unwrap());
        units += cost;
    }
    let last = Instant::now();
    let log = "sluice:{api}:q:ten:route";
    let meta = "sluice:{api}:qm:route";
    let log_ttl = server.integer(&["PTTL", log]).unwrap();
    let since = last.elapsed().as_millis() as i64;
    assert!(
        log_ttl >= TEN_MINUTES_MS as i64 - since - 1 && log_ttl <= TEN_MINUTES_MS as i64 * 9 / 8,
        "log TTL {log_ttl}"
    );
    let log_end = server.integer(&["PEXPIRETIME", log]).unwrap();
    let meta_end = server.integer(&["PEXPIRETIME", meta]).unwrap();
    assert!(
        meta_end >= log_end,
        "the hash expires at {meta_end}, its log at {log_end}"
    );
    // 200 requests well within an eighth of the window: one expiry for the log, one for the
    // hash, set by the first.
    assert_eq!(server.command_calls("pexpire"), 2);
    assert_eq!(total(&server, meta, "s:ten"), Some(units as i64));
    let logged: u64 = server
        .zrange_with_scores(log)
        .iter()
        .map(|(entry, _)| entry.rsplit(':').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(logged, units);
}

/// During a rolling upgrade an older sluice shares the store: it numbers entries without the
/// helper hash's `v` and sets a log's expiry to exactly one window from its own write. The next
/// write of this version must not trust the expiry it remembers, or its entry could vanish with
/// the log before leaving the window.
#[tokio::test]
async fn an_older_sluice_sharing_the_store_cannot_cut_a_log_short() {
    let server = RedisServer::start();
    let store = store(&server, Duration::from_secs(5));
    let w = ten_minutes(1_000);
    let log = "sluice:{api}:q:ten:route";
    let meta = "sluice:{api}:qm:route";
    for _ in 0..3 {
        assert!(acquire(&store, &w, 1).await.unwrap());
    }
    // What an older sluice's admitted request does to the keys, bar its entry.
    server.command(&["HINCRBY", meta, "seq", "1"]).unwrap();
    server.command(&["HINCRBY", meta, "s:ten", "0"]).unwrap();
    server
        .command(&["PEXPIRE", log, &(TEN_MINUTES_MS / 2).to_string()])
        .unwrap();
    assert!(acquire(&store, &w, 1).await.unwrap());
    let ttl = server.integer(&["PTTL", log]).unwrap();
    assert!(ttl > TEN_MINUTES_MS as i64 - 60_000, "log TTL {ttl}");
    let log_end = server.integer(&["PEXPIRETIME", log]).unwrap();
    let meta_end = server.integer(&["PEXPIRETIME", meta]).unwrap();
    assert!(meta_end >= log_end, "hash {meta_end}, log {log_end}");
}

/// Whether each of this process's TCP sockets connected to 127.0.0.1:`port` has `TCP_NODELAY`
/// set, read from the sockets themselves (every file descriptor in `/proc/self/fd`).
#[cfg(target_os = "linux")]
fn nodelay_of_sockets_to(port: u16) -> Vec<bool> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: getpeername and getsockopt only write into the buffers passed with their
        // lengths; on a descriptor that is not a socket, or was closed meanwhile (another test's),
        // they fail and the descriptor is skipped.
        unsafe {
            let mut peer: libc::sockaddr_in = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            if libc::getpeername(fd, (&raw mut peer).cast(), &mut len) != 0
                || i32::from(peer.sin_family) != libc::AF_INET
                || u16::from_be(peer.sin_port) != port
                || u32::from_be(peer.sin_addr.s_addr) != u32::from(std::net::Ipv4Addr::LOCALHOST)
            {
                continue;
            }
            let mut on: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            if libc::getsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                (&raw mut on).cast(),
                &mut len,
            ) == 0
            {
                found.push(on != 0);
            }
        }
    }
    found
}

/// A command leaves as soon as it is written. The client's default keeps Nagle's algorithm on,
/// and on a connection that nearly always has a command in flight that held each command back
/// until Redis had answered the one before it.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn commands_to_redis_are_sent_without_delay() {
    let server = RedisServer::start();
    let store = store(&server, Duration::from_secs(5));
    assert!(acquire(&store, &one_window(10), 1).await.unwrap());
    let sockets = nodelay_of_sockets_to(server.port());
    assert!(!sockets.is_empty(), "the store's connection to Redis");
    assert!(sockets.iter().all(|&on| on), "TCP_NODELAY: {sockets:?}");
}

/// The same for every node of a cluster that the store reached.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_to_a_cluster_are_sent_without_delay() {
    let cluster = RedisCluster::start();
    let connection = RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap();
    let store = RedisStore::with_connection(Arc::new(connection), "sluice");
    assert!(acquire(&store, &one_window(10), 1).await.unwrap());
    let master = cluster
        .master_of("sluice:{api}:qm:route")
        .expect("a master serves the key");
    let sockets = nodelay_of_sockets_to(master);
    assert!(
        !sockets.is_empty(),
        "the store's connection to the key's master"
    );
    assert!(sockets.iter().all(|&on| on), "TCP_NODELAY: {sockets:?}");
}

/// A command is still sent while other tasks keep the runtime busy, so that it never runs out
/// of ready tasks: the client defers its writes to the end of the runtime's turn
/// (third_party/redis, "one write per runtime turn"), and the runtime's periodic check of its
/// drivers ends a turn that would not end.
#[test]
fn a_command_is_sent_while_the_runtime_stays_busy() {
    let server = RedisServer::start();
    let connection =
        Arc::new(RedisConnection::new(&server.url(), Duration::from_secs(10)).unwrap());
    // Pingora's runtime: Tokio's multi-thread scheduler, here with one worker.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async move {
        tokio::spawn(async move {
            assert!(connection.ping().await, "Redis answers");
            // Two tasks that wake each other without end: the run queue is never empty.
            let (to_b, mut at_b) = tokio::sync::mpsc::unbounded_channel::<()>();
            let (to_a, mut at_a) = tokio::sync::mpsc::unbounded_channel::<()>();
            to_a.send(()).unwrap();
            let a = tokio::spawn(async move {
                while at_a.recv().await.is_some() {
                    if to_b.send(()).is_err() {
                        break;
                    }
                }
            });
            let b = tokio::spawn(async move {
                while at_b.recv().await.is_some() {
                    if to_a.send(()).is_err() {
                        break;
                    }
                }
            });
            for _ in 0..100 {
                assert!(
                    connection.ping().await,
                    "answered while the runtime is busy"
                );
            }
            a.abort();
            b.abort();
        })
        .await
        .unwrap()
    });
}

/// After an outage longer than the call timeout, with no call made while Redis came back, the
/// first call answers: it is not failed by the refusal the client kept from its last reconnect
/// attempt, made while Redis was down.
#[tokio::test]
async fn the_first_call_after_a_long_outage_answers() {
    let mut server = RedisServer::start();
    // Generous: a loaded machine must not turn a slow answer into the failure looked for.
    let store = store(&server, Duration::from_secs(5));
    let w = one_window(1_000);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !matches!(acquire(&store, &w, 1).await, Ok(true)) {
        assert!(
            Instant::now() < deadline,
            "the store answers while Redis is up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.kill();
    assert!(acquire(&store, &w, 1).await.is_err());
    // Part of the scenario, not a synchronisation: the outage outlasts the call timeout.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(acquire(&store, &w, 1).await.is_err(), "still down");
    server.restart();
    // Redis answers PING again; nothing has called the store since it failed.
    assert!(
        matches!(acquire(&store, &w, 1).await, Ok(true)),
        "the first call after Redis is back answers"
    );
}
