//! Below saturation a batch lane may have a second call out (crates/store/src/load.rs): a
//! request that finds its lane's call out goes at once, in a call of its own, instead of waiting
//! for that call's answer. Under load it waits, and shares the next call with the others that
//! came meanwhile; so it does below saturation once the lane's calls have grown large.
//!
//! The rule is the same for every kind of lane; it is run here on a plain quota's lane and on
//! a key pool's (the assign script's, whose member windows are the limit).
//!
//! A test binary with one test: `sluice_store::load::under_load` holds for the whole process,
//! and would change how the calls of tests running beside it are made.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_allocator::{Assign, Assignment, Order, PoolMember, StateStore};
use sluice_limiter::{Acquire, Window};
use sluice_store::{RedisStore, RedisStoreConfig};
use sluice_testkit::RedisServer;

/// The kind of lane a test's requests queue in.
#[derive(Clone, Copy, PartialEq)]
enum Lane {
    /// A route's quota alone (`quota_run.lua`).
    Quota,
    /// A key pool: least-used over one member whose own window is the limit
    /// (`assign_run.lua`).
    KeyPool,
}

/// The one member of a key pool.
const KEY: &str = "key-a";

/// A minute's window of `limit`.
fn minute(limit: u64) -> [Window; 1] {
    [Window {
        name: "minute".into(),
        limit,
        length_us: 60_000_000,
    }]
}

/// One request of cost 1 on `route` in a lane of `lane`, limited to `limit` a minute; whether it
/// was admitted.
async fn admitted(store: Arc<RedisStore>, lane: Lane, route: &'static str, limit: u64) -> bool {
    let windows = minute(limit);
    if lane == Lane::Quota {
        return store
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
            .admitted;
    }
    let members = [PoolMember {
        id: KEY.into(),
        windows: Arc::new(windows),
    }];
    let assignment = store
        .assign(Assign {
            route,
            members: &members,
            order: Order::LeastUsed,
            excluded: &[],
            quota: None,
            cost: 1,
            cooldowns: true,
            at_us: None,
            lease: None,
            sticky: None,
        })
        .await
        .expect("decided");
    matches!(assignment, Assignment::Assigned { .. })
}

/// The log that records `lane`'s admitted requests on `route`.
fn log_of(lane: Lane, route: &str) -> String {
    let keys = sluice_store::keys::Keys::new("sluice");
    match lane {
        Lane::Quota => keys.quota_log(route, "minute", "k"),
        Lane::KeyPool => keys.member_log(route, "minute", KEY),
    }
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

/// Loads sluice's library and makes `route`'s state (a first request, admitted: a key pool's
/// first call also syncs its pool), zeroes Redis's command counts, and holds every script call
/// that may write from now until `CLIENT UNPAUSE`.
async fn pause_after_a_first_request(
    server: &RedisServer,
    store: &Arc<RedisStore>,
    lane: Lane,
    route: &'static str,
    limit: u64,
) {
    assert!(admitted(store.clone(), lane, route, limit).await);
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    server
        .command(&["CLIENT", "PAUSE", "30000", "WRITE"])
        .unwrap();
}

/// Three requests on one route with a limit of `limit` (one request made before them): the
/// first's call is held in Redis (`CLIENT PAUSE WRITE` holds a script call that may write),
/// and the second and third come while it is. Returns the script calls they made and how many
/// were admitted.
fn three_requests(
    server: &RedisServer,
    lane: Lane,
    under_load: bool,
    route: &'static str,
    limit: u64,
) -> (u64, usize) {
    sluice_store::load::under_load(under_load);
    let (store, rt) = store_and_runtime(server);
    rt.block_on(async {
        pause_after_a_first_request(server, &store, lane, route, limit).await;
        let first = tokio::spawn(admitted(store.clone(), lane, route, limit));
        until("the first call is held", || {
            info_field(server, "clients", "blocked_clients") == 1
        })
        .await;
        let second = tokio::spawn(admitted(store.clone(), lane, route, limit));
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
        let third = tokio::spawn(admitted(store.clone(), lane, route, limit));
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
fn after_a_large_call(server: &RedisServer, lane: Lane, route: &'static str) -> u64 {
    sluice_store::load::under_load(false);
    let (store, rt) = store_and_runtime(server);
    let calls = rt.block_on(async {
        pause_after_a_first_request(server, &store, lane, route, 1_000).await;
        let mut requests: Vec<_> = (0..6)
            .map(|_| tokio::spawn(admitted(store.clone(), lane, route, 1_000)))
            .collect();
        until("the large call is held", || {
            info_field(server, "clients", "blocked_clients") == 1
        })
        .await;
        for _ in 0..2 {
            requests.push(tokio::spawn(admitted(store.clone(), lane, route, 1_000)));
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

/// With two calls of one lane out, the limit stays exact: a limit of 3 (one request made before)
/// admits two of the three. The same on a plain quota's lane and on a key pool's.
#[test]
fn below_saturation_a_lane_has_a_second_call_out() {
    let server = RedisServer::start();
    for (lane, name) in [(Lane::Quota, "quota"), (Lane::KeyPool, "key pool")] {
        let [loaded, idle, grown] = match lane {
            Lane::Quota => ["loaded", "idle", "grown"],
            Lane::KeyPool => ["kp-loaded", "kp-idle", "kp-grown"],
        };
        assert_eq!(
            three_requests(&server, lane, true, loaded, 1_000),
            (2, 3),
            "{name}, under load: the first alone, then the two that came while it was out, \
             together"
        );
        assert_eq!(
            three_requests(&server, lane, false, idle, 3),
            (3, 2),
            "{name}, below saturation: the second goes at once, and the third after one of \
             them; the limit holds"
        );
        assert_eq!(
            after_a_large_call(&server, lane, grown),
            2,
            "{name}, below saturation, after a call of six: the next two wait for it and go \
             together"
        );
        // Each admitted request recorded once, the first request of each route's included.
        for (route, recorded) in [(loaded, 4), (idle, 3), (grown, 9)] {
            let log = log_of(lane, route);
            assert_eq!(
                server.log_held(&log),
                recorded,
                "{name}, {route}: each admitted request recorded once"
            );
        }
    }
}
