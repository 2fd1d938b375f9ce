//! Below saturation a batch lane may have a second call out (crates/store/src/load.rs): a
//! request that finds its lane's call out goes at once, in a call of its own, instead of waiting
//! for that call's answer. Under load it waits, and shares the next call with the others that
//! came meanwhile; so it does below saturation once the lane's calls have grown large.
//!
//! A test binary with one test: `sluice_store::load::under_load` holds for the whole process,
//! and would change how the calls of tests running beside it are made.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_allocator::StateStore;
use sluice_limiter::{Acquire, Window};
use sluice_store::{RedisStore, RedisStoreConfig};
use sluice_testkit::RedisServer;

/// One request of cost 1 against `route`'s quota (a minute's window of `limit`), alone: a
/// plain quota lane.
async fn admitted(store: Arc<RedisStore>, route: &'static str, limit: u64) -> bool {
    let windows = [Window {
        name: "minute".into(),
        limit,
        length_us: 60_000_000,
    }];
    store
        .acquire(Acquire {
            route,
            key: "k",
            windows: &windows,
            cost: 1,
            at_us: None,
            client: None,
        })
        .await
        .expect("decided")
        .admitted
}

/// Waits, up to a deadline, until `holds` says yes about what Redis reports.
async fn until(what: &str, holds: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !holds() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn info_field(server: &RedisServer, section: &str, field: &str) -> u64 {
    let info = server.command(&["INFO", section]).expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Bytes a client held by the pause has received and not run: a second call sent on the
/// store's one connection while the first is held.
fn queued_behind_the_held_call(server: &RedisServer) -> u64 {
    let clients = server.command(&["CLIENT", "LIST"]).expect("CLIENT LIST");
    clients
        .lines()
        .filter(|l| l.contains("flags=b"))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|f| f.strip_prefix("qbuf="))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum()
}

/// A Redis store on `server` whose calls may wait long (the tests hold them in Redis), and a
/// current-thread runtime, on which spawned requests run in the order they were spawned.
fn store_and_runtime(server: &RedisServer) -> (Arc<RedisStore>, tokio::runtime::Runtime) {
    let store = Arc::new(
        RedisStore::new(RedisStoreConfig {
            url: server.url(),
            key_prefix: "sluice".into(),
            timeout: Duration::from_secs(30),
        })
        .unwrap(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (store, rt)
}

/// Loads sluice's library (a first call), zeroes Redis's command counts, and holds every
/// script call that may write from now until `CLIENT UNPAUSE`.
async fn pause_with_library_loaded(server: &RedisServer, store: &Arc<RedisStore>) {
    assert!(admitted(store.clone(), "warm-up", 1_000).await);
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    server
        .command(&["CLIENT", "PAUSE", "30000", "WRITE"])
        .unwrap();
}

/// Three requests on one route with a quota of `limit`: the first's call is held in Redis
/// (`CLIENT PAUSE WRITE` holds a script call that may write), and the second and third come
/// while it is. Returns the script calls they made and how many were admitted.
fn three_requests(
    server: &RedisServer,
    under_load: bool,
    route: &'static str,
    limit: u64,
) -> (u64, usize) {
    sluice_store::load::under_load(under_load);
    let (store, rt) = store_and_runtime(server);
    rt.block_on(async {
        pause_with_library_loaded(server, &store).await;
        let first = tokio::spawn(admitted(store.clone(), route, limit));
        until("the first call is held", || {
            info_field(server, "clients", "blocked_clients") == 1
        })
        .await;
        let second = tokio::spawn(admitted(store.clone(), route, limit));
        if under_load {
            // It queues behind the call out; let it get there.
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
        } else {
            until(
                "the second call reaches Redis while the first is held",
                || queued_behind_the_held_call(server) > 0,
            )
            .await;
        }
        let third = tokio::spawn(admitted(store.clone(), route, limit));
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        server.command(&["CLIENT", "UNPAUSE"]).unwrap();
        let mut admitted = 0;
        for request in [first, second, third] {
            admitted += usize::from(request.await.unwrap());
        }
        sluice_store::load::under_load(true);
        (server.command_calls("fcall"), admitted)
    })
}

/// Below saturation, six requests at once (one call: they all queue before its task runs),
/// held in Redis, then two more: the lane's calls have grown past small, so the two queue
/// behind the call out and share the next one, as under load. Returns the script calls.
fn after_a_large_call(server: &RedisServer, route: &'static str) -> u64 {
    sluice_store::load::under_load(false);
    let (store, rt) = store_and_runtime(server);
    let calls = rt.block_on(async {
        pause_with_library_loaded(server, &store).await;
        let mut requests: Vec<_> = (0..6)
            .map(|_| tokio::spawn(admitted(store.clone(), route, 1_000)))
            .collect();
        until("the large call is held", || {
            info_field(server, "clients", "blocked_clients") == 1
        })
        .await;
        for _ in 0..2 {
            requests.push(tokio::spawn(admitted(store.clone(), route, 1_000)));
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
        }
        server.command(&["CLIENT", "UNPAUSE"]).unwrap();
        for request in requests {
            assert!(request.await.unwrap(), "every request is admitted");
        }
        server.command_calls("fcall")
    });
    sluice_store::load::under_load(true);
    calls
}

/// With two calls of one lane out, the quota stays exact: a limit of 2 admits two of the three.
#[test]
fn below_saturation_a_lane_has_a_second_call_out() {
    let server = RedisServer::start();
    assert_eq!(
        three_requests(&server, true, "loaded", 1_000),
        (2, 3),
        "under load: the first alone, then the two that came while it was out, together"
    );
    assert_eq!(
        three_requests(&server, false, "idle", 2),
        (3, 2),
        "below saturation: the second goes at once, and the third after one of them; the \
         limit of 2 holds"
    );
    assert_eq!(
        after_a_large_call(&server, "grown"),
        2,
        "below saturation, after a call of six: the next two wait for it and go together"
    );
    for (route, recorded) in [("loaded", 3), ("idle", 2), ("grown", 8)] {
        let log = format!("sluice:{{{route}}}:q:minute:k");
        assert_eq!(
            server.log_held(&log),
            recorded,
            "{route}: each admitted request recorded once"
        );
    }
}
