//! A client's own windows in the store: decided with the route's quota, the member windows and
//! the selection in one atomic step, on every policy's path (`acquire`, a least-used pool, a
//! preference with member windows and cooldowns). One behavioural suite, run against
//! [`MemoryStore`], [`RedisStore`] on a real `redis-server` (with functions, and as `EVALSHA`)
//! and on a real Redis Cluster, where the client's windows live in a slot of their own; then
//! what each costs in calls to Redis.

use std::sync::Arc;
use std::time::Duration;

use sluice_allocator::{Assign, Assignment, MemoryStore, Order, PoolMember, StateStore};
use sluice_limiter::{Acquire, ClientWindows, Outcome, Window};
use sluice_store::{RedisConnection, RedisStore, RedisStoreConfig};
use sluice_testkit::{RedisCluster, RedisServer};

const SEC: u64 = 1_000_000;
/// Trace time zero: far from 0, so that no window's horizon is negative.
const T0: u64 = 1_000 * SEC;
/// Windows outlast the test in real time: Redis expires idle keys on its own clock.
const W: u64 = 60 * SEC;

fn window(name: &str, limit: u64, length_us: u64) -> Window {
    Window {
        name: name.into(),
        limit,
        length_us,
    }
}

/// A request of `cost` on `route`'s quota (`windows`, keyed `route`), by `client`, at `at_us`.
fn ask<'a>(
    route: &'a str,
    windows: &'a [Window],
    client: Option<ClientWindows<'a>>,
    cost: u64,
    at_us: u64,
) -> Acquire<'a> {
    Acquire {
        route,
        key: "route",
        windows,
        cost,
        at_us: Some(at_us),
        client,
    }
}

fn client<'a>(name: &'a str, windows: &'a [Window]) -> ClientWindows<'a> {
    ClientWindows { name, windows }
}

fn remaining(outcome: &Outcome) -> Vec<u64> {
    outcome.windows.iter().map(|w| w.remaining).collect()
}

/// What is left in `name`'s windows at `at_us`, charging nothing.
async fn client_left(
    store: &dyn StateStore,
    name: &str,
    windows: &[Window],
    at_us: u64,
) -> Vec<u64> {
    let read = ask("any", &[], Some(client(name, windows)), 0, at_us);
    remaining(&store.acquire(read).await.unwrap())
}

fn assign<'a>(
    route: &'a str,
    members: &'a [PoolMember],
    order: Order<'a>,
    quota: Acquire<'a>,
    cooldowns: bool,
) -> Assign<'a> {
    Assign {
        route,
        members,
        order,
        excluded: &[],
        quota: Some(quota),
        cost: quota.cost,
        cooldowns,
        at_us: quota.at_us,
        lease: None,
        sticky: None,
    }
}

/// Every behaviour, on one store. Route and client names are unique to each part, so that the
/// suite can run on one Redis beside others.
async fn suite(store: Arc<dyn StateStore>, tag: &str) {
    let store = &*store;
    let name = |s: &str| format!("{tag}-{s}");

    // acquire: the client's windows and the route's, together. The client's follow the
    // route's in the answer.
    let (route, me) = (name("acq"), name("billing"));
    let rq = [window("rpm", 10, W)];
    let cq = [window("daily", 3, W), window("burst", 100, W)];
    for i in 0..3 {
        let o = store
            .acquire(ask(&route, &rq, Some(client(&me, &cq)), 1, T0 + i))
            .await
            .unwrap();
        assert!(o.admitted, "request {i}: {o:?}");
        assert_eq!(remaining(&o), [9 - i, 2 - i, 99 - i]);
    }
    let refused = store
        .acquire(ask(&route, &rq, Some(client(&me, &cq)), 1, T0 + 10))
        .await
        .unwrap();
    assert!(!refused.admitted, "the client's daily window is full");
    assert_eq!(remaining(&refused), [7, 0, 97], "nothing was charged");
    assert_eq!(
        refused.retry_after_us,
        W - 10,
        "until the client's oldest entry leaves"
    );
    // Another client on the same route is not refused by the first one's windows.
    let other = name("search");
    let o = store
        .acquire(ask(&route, &rq, Some(client(&other, &cq)), 1, T0 + 11))
        .await
        .unwrap();
    assert!(o.admitted);
    assert_eq!(remaining(&o), [6, 2, 99]);

    // The route refuses: the client's windows are not charged.
    let (route, me) = (name("full"), name("ci"));
    let tight = [window("rpm", 2, W)];
    let cq = [window("daily", 100, W)];
    for i in 0..2 {
        let o = store
            .acquire(ask(&route, &tight, Some(client(&me, &cq)), 1, T0 + i))
            .await
            .unwrap();
        assert!(o.admitted);
    }
    let refused = store
        .acquire(ask(&route, &tight, Some(client(&me, &cq)), 1, T0 + 5))
        .await
        .unwrap();
    assert!(!refused.admitted);
    assert_eq!(refused.retry_after_us, W - 5, "the route's wait");
    assert_eq!(remaining(&refused), [0, 98]);
    assert_eq!(client_left(store, &me, &cq, T0 + 6).await, [98]);

    // A client's windows are its own on every route it uses, with or without a route quota.
    let me = name("shared");
    let cq = [window("daily", 3, W)];
    let (a, b) = (name("route-a"), name("route-b"));
    let rq = [window("rpm", 100, W)];
    assert!(
        store
            .acquire(ask(&a, &rq, Some(client(&me, &cq)), 2, T0))
            .await
            .unwrap()
            .admitted
    );
    let o = store
        .acquire(ask(&b, &[], Some(client(&me, &cq)), 1, T0 + 1))
        .await
        .unwrap();
    assert!(o.admitted, "no route quota: the client's alone");
    assert_eq!(remaining(&o), [0]);
    let o = store
        .acquire(ask(&b, &[], Some(client(&me, &cq)), 1, T0 + 2))
        .await
        .unwrap();
    assert!(!o.admitted);
    assert_eq!(
        o.retry_after_us,
        W - 2,
        "until the first entry (route a's) leaves"
    );
    let o = store
        .acquire(ask(&a, &rq, Some(client(&me, &cq)), 1, T0 + 3))
        .await
        .unwrap();
    assert!(!o.admitted, "refused on route a too");
    assert_eq!(remaining(&o), [98, 0]);
    // Once the window has passed, the client is admitted again.
    assert!(
        store
            .acquire(ask(&a, &rq, Some(client(&me, &cq)), 3, T0 + W + 1))
            .await
            .unwrap()
            .admitted
    );

    // least_used: the client's windows, the route's quota and the pool, in one step.
    let (route, me) = (name("lu"), name("batch"));
    let members = [PoolMember::new("m1"), PoolMember::new("m2")];
    let rq = [window("rpm", 100, W)];
    let cq = [window("daily", 2, W)];
    for i in 0..2 {
        let quota = ask(&route, &rq, Some(client(&me, &cq)), 1, T0 + i);
        match store
            .assign(assign(&route, &members, Order::LeastUsed, quota, false))
            .await
            .unwrap()
        {
            Assignment::Assigned { quota: Some(o), .. } => {
                assert_eq!(remaining(&o), [99 - i, 1 - i])
            }
            other => panic!("{other:?}"),
        }
    }
    let quota = ask(&route, &rq, Some(client(&me, &cq)), 1, T0 + 2);
    match store
        .assign(assign(&route, &members, Order::LeastUsed, quota, false))
        .await
        .unwrap()
    {
        Assignment::QuotaRefused(o) => {
            assert_eq!(remaining(&o), [98, 0]);
            assert_eq!(o.retry_after_us, W - 2);
        }
        other => panic!("the client's windows refuse: {other:?}"),
    }
    let counts: u64 = store
        .counts(&route)
        .await
        .unwrap()
        .iter()
        .map(|(_, c)| c)
        .sum();
    assert_eq!(counts, 2, "a refused request is assigned nowhere");
    // Without a route quota: the client's windows alone, with the pool.
    let route = name("lu-bare");
    let me = name("bare");
    let quota = ask(&route, &[], Some(client(&me, &cq)), 2, T0);
    assert!(matches!(
        store
            .assign(assign(&route, &members, Order::LeastUsed, quota, false))
            .await
            .unwrap(),
        Assignment::Assigned { .. }
    ));
    let quota = ask(&route, &[], Some(client(&me, &cq)), 1, T0 + 1);
    assert!(matches!(
        store
            .assign(assign(&route, &members, Order::LeastUsed, quota, false))
            .await
            .unwrap(),
        Assignment::QuotaRefused(_)
    ));

    // A preference with member windows and cooldowns: a member whose windows refuse makes the
    // request busy, and then the client is not charged either.
    let (route, me) = (name("pref"), name("etl"));
    let members = [PoolMember {
        id: "k1".into(),
        windows: vec![window("rpm", 1, W)].into(),
    }];
    let cq = [window("daily", 5, W)];
    let order = [0];
    let quota = ask(&route, &[], Some(client(&me, &cq)), 1, T0);
    match store
        .assign(assign(
            &route,
            &members,
            Order::Preference(&order),
            quota,
            true,
        ))
        .await
        .unwrap()
    {
        Assignment::Assigned {
            member,
            quota: Some(o),
        } => {
            assert_eq!(member, "k1");
            assert_eq!(remaining(&o), [4]);
        }
        other => panic!("{other:?}"),
    }
    let quota = ask(&route, &[], Some(client(&me, &cq)), 1, T0 + 1);
    match store
        .assign(assign(
            &route,
            &members,
            Order::Preference(&order),
            quota,
            true,
        ))
        .await
        .unwrap()
    {
        Assignment::Busy {
            retry_after_us,
            quota: Some(o),
        } => {
            assert_eq!(retry_after_us, W - 1);
            assert_eq!(remaining(&o), [4], "busy: the client is not charged");
        }
        other => panic!("the member's window is full: {other:?}"),
    }
    assert_eq!(client_left(store, &me, &cq, T0 + 2).await, [4]);
}

fn redis_store(url: &str) -> Arc<dyn StateStore> {
    Arc::new(
        RedisStore::new(RedisStoreConfig {
            url: url.into(),
            key_prefix: "sluice".into(),
            timeout: Duration::from_secs(5),
        })
        .unwrap(),
    )
}

fn cluster_store(cluster: &RedisCluster) -> Arc<dyn StateStore> {
    let connection = RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap();
    Arc::new(RedisStore::with_connection(Arc::new(connection), "sluice"))
}

#[tokio::test]
async fn memory_client_windows_behave() {
    suite(Arc::new(MemoryStore::new()), "mem").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_client_windows_behave() {
    let server = RedisServer::start();
    suite(redis_store(&server.url()), "fcall").await;
    suite(redis_store(&server.url_without_functions()), "evalsha").await;
    assert!(server.command_calls("evalsha") > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_client_windows_behave() {
    let cluster = RedisCluster::start();
    suite(cluster_store(&cluster), "cluster").await;
}

/// Script calls (`FCALL` or `EVALSHA`) Redis ran since the last reset.
fn script_calls(server: &RedisServer) -> u64 {
    server.command_calls("fcall") + server.command_calls("evalsha")
}

/// On a single Redis a client's windows cost no call of their own: one script call per
/// request, whether it is admitted, refused by the client or refused by the route, on every
/// path (a quota alone, least-used, a preference with member windows), as `FCALL` and as
/// `EVALSHA`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_one_call_per_request_with_a_client_quota() {
    let server = RedisServer::start();
    for (url, command) in [
        (server.url(), "fcall"),
        (server.url_without_functions(), "evalsha"),
    ] {
        let store = redis_store(&url);
        let rq = [window("rpm", 1_000, W)];
        let cq = [window("daily", 1_000, W)];
        let members = [PoolMember::new("m1"), PoolMember::new("m2")];
        let limited = [PoolMember {
            id: "k1".into(),
            windows: vec![window("rpm", 1_000, W)].into(),
        }];
        let order = [0];
        let route = format!("one-{command}");
        let me = format!("me-{command}");
        let quota = |at| Acquire {
            at_us: None,
            ..ask(&route, &rq, Some(client(&me, &cq)), 1, at)
        };
        // Warm up: the first calls load the library or scripts and sync the pool.
        store.acquire(quota(0)).await.unwrap();
        store
            .assign(assign(&route, &members, Order::LeastUsed, quota(0), false))
            .await
            .unwrap();
        server.command(&["CONFIG", "RESETSTAT"]).unwrap();
        for _ in 0..20 {
            assert!(store.acquire(quota(0)).await.unwrap().admitted);
            let lu = assign(&route, &members, Order::LeastUsed, quota(0), false);
            assert!(matches!(
                store.assign(lu).await.unwrap(),
                Assignment::Assigned { .. }
            ));
            let pref = assign(&route, &limited, Order::Preference(&order), quota(0), true);
            assert!(matches!(
                store.assign(pref).await.unwrap(),
                Assignment::Assigned { .. }
            ));
        }
        assert_eq!(
            server.command_calls(command),
            60,
            "one {command} per request"
        );
        assert_eq!(script_calls(&server), 60);
        // Refused, by the client's windows or by the route's: still one call each.
        let full = [window("daily", 1, W)];
        let spent = format!("spent-{command}");
        let quota = Acquire {
            at_us: None,
            ..ask(&route, &rq, Some(client(&spent, &full)), 1, 0)
        };
        assert!(store.acquire(quota).await.unwrap().admitted);
        server.command(&["CONFIG", "RESETSTAT"]).unwrap();
        assert!(!store.acquire(quota).await.unwrap().admitted);
        let lu = assign(&route, &members, Order::LeastUsed, quota, false);
        assert!(matches!(
            store.assign(lu).await.unwrap(),
            Assignment::QuotaRefused(_)
        ));
        assert_eq!(script_calls(&server), 2);
    }
}

/// On a Redis Cluster a client's windows live in their own slot: an admitted request costs two
/// calls (the client's first), and when the route then refuses, the client's charge is given
/// back, so its windows' counts do not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_two_calls_and_the_give_back() {
    let cluster = RedisCluster::start();
    let store = cluster_store(&cluster);
    let calls = || -> u64 { cluster.nodes().iter().map(script_calls).sum() };
    let reset = || {
        for node in cluster.nodes() {
            node.command(&["CONFIG", "RESETSTAT"]).unwrap();
        }
    };
    let rq = [window("rpm", 3, W)];
    let cq = [window("daily", 100, W)];
    let members = [PoolMember::new("m1"), PoolMember::new("m2")];
    let quota = |route| Acquire {
        at_us: None,
        ..ask(route, &rq, Some(client("team", &cq)), 1, 0)
    };
    // The client's keys and the routes' are in different slots.
    let (client_slot, route_slot) = (cluster.slot("{client:team}"), cluster.slot("{gb-acquire}"));
    assert_ne!(client_slot, route_slot);
    // Warm up: the library on every master, the pool synced.
    store.acquire(quota("gb-warm")).await.unwrap();
    store
        .assign(assign(
            "gb-assign",
            &members,
            Order::LeastUsed,
            quota("gb-assign"),
            false,
        ))
        .await
        .unwrap();
    let log = "sluice:{client:team}:cq:daily";
    let master = cluster.master_of(log).expect("a master serves the client");
    let entries = || cluster.nodes()[cluster.index_of(master)].log_held(log);
    assert_eq!(entries(), 2);

    reset();
    for _ in 0..2 {
        assert!(store.acquire(quota("gb-acquire")).await.unwrap().admitted);
        assert!(matches!(
            store
                .assign(assign(
                    "gb-assign",
                    &members,
                    Order::LeastUsed,
                    quota("gb-assign"),
                    false
                ))
                .await
                .unwrap(),
            Assignment::Assigned { .. }
        ));
    }
    assert_eq!(calls(), 8, "two calls per admitted request");
    assert_eq!(entries(), 6);

    // gb-acquire has one request left, gb-assign none: each refusal gives the client's charge
    // back.
    assert!(store.acquire(quota("gb-acquire")).await.unwrap().admitted);
    assert_eq!(entries(), 7);
    reset();
    let refused = store.acquire(quota("gb-acquire")).await.unwrap();
    assert!(!refused.admitted);
    assert_eq!(refused.windows[1].remaining, 93, "as before the request");
    let refused = store
        .assign(assign(
            "gb-assign",
            &members,
            Order::LeastUsed,
            quota("gb-assign"),
            false,
        ))
        .await
        .unwrap();
    assert!(
        matches!(refused, Assignment::QuotaRefused(_)),
        "{refused:?}"
    );
    assert_eq!(entries(), 7, "the client's count did not move");
    assert_eq!(
        calls(),
        6,
        "the client's, the route's and the give-back, twice"
    );
}
