//! A route kept as sub-logs (`state_shards`) on a real Redis and a real Redis Cluster: exactly
//! the limit admitted across the sub-logs (each holds its share, on a slot of its own, on three
//! masters of the cluster), least-used counts within the sub-log count of each other, a
//! cooldown written to every sub-log, reads that sum them, a refusal without a call once every
//! sub-log is known full, one sub-log leaving every key as it was, and, with
//! `state_shards_start: home`, each instance's requests in its own sub-log until its share is
//! spent, then in the others, exactly the limit in all; there, a session's binding still in the
//! session's own sub-log, and a lease taken past the instance's own renewed and released where
//! it was taken.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use sluice_allocator::{
    Assign, Assignment, MemoryStore, Order, PoolMember, StateStore, SubLogStart,
};
use sluice_limiter::{Acquire, Window};
use sluice_store::keys::{self, sub_log};
use sluice_store::{RedisConnection, RedisStore};
use sluice_testkit::{RedisCluster, RedisServer};

const SHARDS: u32 = 3;
const RR: SubLogStart = SubLogStart::RoundRobin;
const HOME: SubLogStart = SubLogStart::Home;

fn hour(limit: u64) -> Vec<Window> {
    vec![Window {
        name: "hour".into(),
        limit,
        length_us: 3_600_000_000,
    }]
}

fn acquire<'a>(route: &'a str, windows: &'a [Window], cost: u64) -> Acquire<'a> {
    Acquire {
        route,
        key: "",
        windows,
        cost,
        at_us: None,
        client: None,
    }
}

fn least_used<'a>(
    route: &'a str,
    members: &'a [PoolMember],
    quota: Option<Acquire<'a>>,
    cooldowns: bool,
) -> Assign<'a> {
    Assign {
        route,
        members,
        order: Order::LeastUsed,
        excluded: &[],
        quota,
        cost: 1,
        cooldowns,
        at_us: None,
        lease: None,
        sticky: None,
    }
}

fn members(n: usize) -> Vec<PoolMember> {
    (0..n).map(|i| PoolMember::new(format!("m{i}"))).collect()
}

fn single(server: &RedisServer) -> RedisStore {
    RedisStore::with_connection(
        Arc::new(RedisConnection::new(&server.url(), Duration::from_secs(5)).unwrap()),
        "sluice",
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// `n` concurrent requests of cost 1 on `route`'s quota of `limit` an hour; how many were
/// admitted.
async fn burst(store: &Arc<dyn StateStore>, route: &'static str, limit: u64, n: usize) -> u64 {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let windows = hour(limit);
            store
                .acquire(acquire(route, &windows, 1))
                .await
                .unwrap()
                .admitted
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += u64::from(t.await.unwrap());
    }
    admitted
}

/// `n` concurrent least-used assignments on `route` with a quota of `limit` an hour, over
/// `pool`; how many were assigned.
async fn assign_burst(
    store: &Arc<dyn StateStore>,
    route: &'static str,
    limit: u64,
    pool: usize,
    n: usize,
) -> u64 {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let windows = hour(limit);
            let members = members(pool);
            let ask = least_used(route, &members, Some(acquire(route, &windows, 1)), false);
            matches!(
                store.assign(ask).await.unwrap(),
                Assignment::Assigned { .. }
            )
        }));
    }
    let mut assigned = 0;
    for t in tasks {
        assigned += u64::from(t.await.unwrap());
    }
    assigned
}

/// Per sub-log of `route`, what its hour log holds (requests of cost 1), read by `held`.
fn sub_logs_held(route: &str, held: impl Fn(&str) -> u64) -> Vec<u64> {
    let keys = keys::Keys::new("sluice");
    (0..SHARDS)
        .map(|i| held(&keys.quota_log(&sub_log(route, i, SHARDS), "hour", "")))
        .collect()
}

/// The integer answer of `args` on `server`.
fn integer(server: &RedisServer, args: &[&str]) -> i64 {
    server.integer(args).unwrap_or(0)
}

#[test]
fn sub_logs_admit_exactly_the_limit_on_a_single_redis() {
    let server = RedisServer::start();
    let rt = runtime();
    const LIMIT: u64 = 40;
    let store: Arc<dyn StateStore> = Arc::new(rt.block_on(async { single(&server) }));
    store.shard_routes(&[("api", SHARDS, RR), ("pool", SHARDS, RR)]);
    // A read sums the sub-logs' shares: the whole limit, before any request.
    let windows = hour(LIMIT);
    let read = rt
        .block_on(store.acquire(acquire("api", &windows, 0)))
        .unwrap();
    assert_eq!(read.windows[0].remaining, LIMIT);
    let admitted = rt.block_on(burst(&store, "api", LIMIT, 150));
    assert_eq!(admitted, LIMIT, "exactly the limit, across the sub-logs");
    // Each sub-log holds its share (40 = 14 + 13 + 13), no more.
    let held = sub_logs_held("api", |k| server.log_held(k));
    assert_eq!(held, [14, 13, 13], "each sub-log filled to its share");
    // A read sums them: nothing is left.
    let read = rt
        .block_on(store.acquire(acquire("api", &windows, 0)))
        .unwrap();
    assert_eq!(read.windows[0].remaining, 0);
    // Every sub-log is known full now: a refusal without a call.
    let calls = || server.command_calls("fcall") + server.command_calls("evalsha");
    let before = calls();
    let refused = rt
        .block_on(store.acquire(acquire("api", &windows, 1)))
        .unwrap();
    assert!(!refused.admitted && refused.retry_after_us > 0);
    assert_eq!(calls(), before, "no call once every sub-log is known full");

    // The same for assignments, and least-used counts stay within the sub-logs' count.
    let assigned = rt.block_on(assign_burst(&store, "pool", LIMIT, 4, 150));
    assert_eq!(assigned, LIMIT);
    let counts: HashMap<String, u64> = rt
        .block_on(store.counts("pool"))
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(counts.values().sum::<u64>(), LIMIT, "{counts:?}");
    let (lo, hi) = (
        counts.values().min().unwrap(),
        counts.values().max().unwrap(),
    );
    assert!(hi - lo <= u64::from(SHARDS), "{counts:?}");
}

#[test]
fn a_cooldown_reaches_every_sub_log_and_reads_sum_them() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR), ("keys", SHARDS, RR)]);
    let pool = members(2);
    // Sync the pools by assigning once in each sub-log.
    for _ in 0..SHARDS {
        let answer = rt
            .block_on(store.assign(least_used("api", &pool, None, true)))
            .unwrap();
        assert!(matches!(answer, Assignment::Assigned { .. }), "{answer:?}");
    }
    let left = rt
        .block_on(store.cool("api", "m0", 60_000_000, None))
        .unwrap();
    assert!(left > 0);
    let keys = keys::Keys::new("sluice");
    for i in 0..SHARDS {
        let cool = keys.cooldowns(&sub_log("api", i, SHARDS));
        let score = server.command(&["ZSCORE", &cool, "m0"]).unwrap();
        assert!(
            score.trim().parse::<f64>().is_ok_and(|until| until > 0.0),
            "sub-log {i} cools m0: {cool} {score:?}"
        );
    }
    assert_eq!(
        rt.block_on(store.cooldowns("api"))
            .unwrap()
            .iter()
            .map(|(m, _)| m.as_str())
            .collect::<Vec<_>>(),
        ["m0"]
    );
    // Every sub-log now skips m0: the next assignments all go to m1.
    for _ in 0..(2 * SHARDS) {
        match rt
            .block_on(store.assign(least_used("api", &pool, None, true)))
            .unwrap()
        {
            Assignment::Assigned { member, .. } => assert_eq!(member, "m1"),
            other => panic!("{other:?}"),
        }
    }
    // Member windows split and sum the same way.
    let limited = vec![PoolMember {
        id: "k".into(),
        windows: hour(10).into(),
    }];
    let mut assigned = 0;
    for _ in 0..30 {
        let ask = least_used("keys", &limited, None, false);
        if matches!(
            rt.block_on(store.assign(ask)).unwrap(),
            Assignment::Assigned { .. }
        ) {
            assigned += 1;
        }
    }
    assert_eq!(
        assigned, 10,
        "a member's window holds its limit across sub-logs"
    );
    assert_eq!(
        rt.block_on(store.member_remaining("keys", &limited[0]))
            .unwrap(),
        [0]
    );
}

/// A sub-log that cannot take a cooldown (here its key holds another type; in production its
/// master out of reach) does not keep the others from taking it: the call says it failed, and
/// every other sub-log cools the member all the same.
#[test]
fn a_cooldown_reaches_the_other_sub_logs_when_one_fails() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR)]);
    let keys = keys::Keys::new("sluice");
    // The first sub-log after the route's own fails; the last one must still hear.
    let broken = keys.cooldowns(&sub_log("api", 1, SHARDS));
    assert!(server
        .command(&["SET", &broken, "not a sorted set"])
        .unwrap()
        .starts_with("+OK"));
    assert!(rt
        .block_on(store.cool("api", "m0", 60_000_000, None))
        .is_err());
    for i in [0, 2] {
        let cool = keys.cooldowns(&sub_log("api", i, SHARDS));
        let score = server.command(&["ZSCORE", &cool, "m0"]).unwrap();
        assert!(
            score.trim().parse::<f64>().is_ok_and(|until| until > 0.0),
            "sub-log {i} cools m0: {cool} {score:?}"
        );
    }
}

#[test]
fn one_sub_log_keeps_every_key_of_a_route_without_them() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", 1, RR)]);
    let windows = hour(5);
    let pool = members(2);
    rt.block_on(store.assign(least_used(
        "api",
        &pool,
        Some(acquire("api", &windows, 1)),
        true,
    )))
    .unwrap();
    rt.block_on(store.cool("api", "m0", 1_000_000, None))
        .unwrap();
    let all = server.command(&["KEYS", "*"]).unwrap();
    assert!(all.contains("sluice:{api}:pool"), "{all}");
    assert!(all.contains("sluice:{api}:q:hour:"), "{all}");
    assert!(all.contains("sluice:{api}:cool"), "{all}");
    assert!(!all.contains('#'), "no sub-log keys: {all}");
}

#[test]
fn the_memory_store_keeps_one_exact_log() {
    let rt = runtime();
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    store.shard_routes(&[("api", SHARDS, RR), ("home", SHARDS, HOME)]);
    assert_eq!(rt.block_on(burst(&store, "api", 40, 150)), 40);
    assert_eq!(rt.block_on(burst(&store, "home", 40, 150)), 40);
}

/// Two instances, of indices 0 and 1, on a route whose requests start at the instance's own
/// sub-log (`state_shards_start: home`), `held` reading each sub-log's hour log: each instance's
/// requests land in its own sub-log while it has room (so they share its batch lane); past its
/// share they go on to the others in turn, sub-log 2 (no instance's own) among them, and the
/// route admits exactly its limit, no more, under a concurrent burst from both.
fn each_instance_starts_at_its_own_sub_log(
    rt: &tokio::runtime::Runtime,
    stores: &[Arc<dyn StateStore>; 2],
    held: impl Fn() -> Vec<u64>,
) {
    const LIMIT: u64 = 40;
    for store in stores {
        store.shard_routes(&[("api", SHARDS, HOME)]);
    }
    let windows = hour(LIMIT);
    let one = |store: &Arc<dyn StateStore>| {
        rt.block_on(store.acquire(acquire("api", &windows, 1)))
            .unwrap()
            .admitted
    };
    for _ in 0..5 {
        assert!(one(&stores[0]));
    }
    assert_eq!(
        held(),
        [5, 0, 0],
        "instance 0's requests in its own sub-log"
    );
    for _ in 0..4 {
        assert!(one(&stores[1]));
    }
    assert_eq!(held(), [5, 4, 0], "instance 1's in its own");
    // Instance 0 fills its own share (14 = 40 / 3 and the remainder), then goes on in turn.
    for _ in 0..9 {
        assert!(one(&stores[0]));
    }
    assert_eq!(held(), [14, 4, 0]);
    assert!(one(&stores[0]), "admitted by the next sub-log in turn");
    assert_eq!(held(), [14, 5, 0]);
    // Both at once, far past the limit: exactly what is left, each sub-log to its share.
    let admitted = rt.block_on(async {
        let (a, b) = tokio::join!(
            burst(&stores[0], "api", LIMIT, 75),
            burst(&stores[1], "api", LIMIT, 75)
        );
        a + b
    });
    assert_eq!(admitted, LIMIT - 19, "exactly the limit in all, never more");
    assert_eq!(held(), [14, 13, 13], "each sub-log filled to its share");
    let read = rt
        .block_on(stores[1].acquire(acquire("api", &windows, 0)))
        .unwrap();
    assert_eq!(read.windows[0].remaining, 0);
    assert!(!one(&stores[0]) && !one(&stores[1]));
    assert_eq!(held(), [14, 13, 13]);
}

#[test]
fn each_instance_starts_at_its_own_sub_log_on_a_single_redis() {
    let server = RedisServer::start();
    let rt = runtime();
    let stores = rt.block_on(async {
        [0, 1].map(|i| Arc::new(single(&server).with_instance_index(i)) as Arc<dyn StateStore>)
    });
    each_instance_starts_at_its_own_sub_log(&rt, &stores, || {
        sub_logs_held("api", |k| server.log_held(k))
    });
}

/// The same on a 3-master cluster, where each instance's own sub-log is on a master of its
/// own.
#[test]
fn each_instance_starts_at_its_own_sub_log_on_a_cluster() {
    let cluster = RedisCluster::start();
    let rt = runtime();
    let stores = rt.block_on(async {
        [0, 1].map(|i| {
            let connection =
                RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap();
            Arc::new(
                RedisStore::with_connection(Arc::new(connection), "sluice").with_instance_index(i),
            ) as Arc<dyn StateStore>
        })
    });
    let keys = keys::Keys::new("sluice");
    let masters: HashSet<u16> = (0..SHARDS)
        .map(|i| {
            let log = keys.quota_log(&sub_log("api", i, SHARDS), "hour", "");
            cluster.master_of(&log).unwrap()
        })
        .collect();
    assert_eq!(masters.len(), 3, "three masters");
    each_instance_starts_at_its_own_sub_log(&rt, &stores, || {
        sub_logs_held("api", |k| {
            let port = cluster.master_of(k).unwrap();
            cluster.nodes()[cluster.index_of(port)].log_held(k)
        })
    });
}

/// On a cluster made by `redis-cli --cluster create`, three sub-logs sit on three masters, and
/// the route admits exactly its limit.
#[test]
fn sub_logs_spread_over_the_masters_of_a_cluster_and_admit_exactly_the_limit() {
    let cluster = RedisCluster::start();
    let rt = runtime();
    const LIMIT: u64 = 40;
    let store: Arc<dyn StateStore> = Arc::new(rt.block_on(async {
        RedisStore::with_connection(
            Arc::new(RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap()),
            "sluice",
        )
    }));
    store.shard_routes(&[("api", SHARDS, RR), ("pool", SHARDS, RR)]);
    let admitted = rt.block_on(burst(&store, "api", LIMIT, 150));
    assert_eq!(admitted, LIMIT, "exactly the limit, across the sub-logs");
    let keys = keys::Keys::new("sluice");
    let logs: Vec<String> = (0..SHARDS)
        .map(|i| keys.quota_log(&sub_log("api", i, SHARDS), "hour", ""))
        .collect();
    let masters: HashSet<u16> = logs.iter().map(|k| cluster.master_of(k).unwrap()).collect();
    assert_eq!(masters.len(), 3, "three masters: {logs:?}");
    // The cluster's own slot for each key is the one the table aimed at.
    let node = &cluster.nodes()[0];
    let slots: HashSet<i64> = logs
        .iter()
        .map(|k| node.integer(&["CLUSTER", "KEYSLOT", k]).unwrap())
        .collect();
    assert_eq!(slots.len(), 3);
    let held = sub_logs_held("api", |k| {
        let port = cluster.master_of(k).unwrap();
        cluster.nodes()[cluster.index_of(port)].log_held(k)
    });
    assert_eq!(held, [14, 13, 13], "each sub-log filled to its share");

    let assigned = rt.block_on(assign_burst(&store, "pool", LIMIT, 4, 150));
    assert_eq!(assigned, LIMIT);
    let counts: Vec<u64> = rt
        .block_on(store.counts("pool"))
        .unwrap()
        .into_iter()
        .map(|(_, c)| c)
        .collect();
    assert_eq!(counts.iter().sum::<u64>(), LIMIT);
    assert!(
        counts.iter().max().unwrap() - counts.iter().min().unwrap() <= u64::from(SHARDS),
        "{counts:?}"
    );
}

/// The lease keys of sub-log `i` of `route`: expiries (`lz`).
fn lease_expiries(route: &str, i: u32) -> String {
    format!("sluice:{{{}}}:lz", sub_log(route, i, SHARDS))
}

/// A route's `max_in_flight` splits into one share per sub-log; a lease is released (and
/// renewed) in the sub-log that took it, and its room there is taken again.
#[test]
fn a_lease_goes_back_to_the_sub_log_that_took_it() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR)]);
    let pool = members(3);
    let take = |id: &str| {
        let ask = Assign {
            lease: Some(sluice_allocator::Lease {
                id,
                ttl_us: 60_000_000,
                member_max: None,
                route_max: Some(6),
                client: None,
            }),
            ..least_used("api", &pool, None, false)
        };
        rt.block_on(store.assign(ask)).unwrap()
    };
    for k in 0..6 {
        let answer = take(&format!("l{k}"));
        assert!(matches!(answer, Assignment::Assigned { .. }), "{answer:?}");
    }
    assert!(
        matches!(take("l-over"), Assignment::Concurrency { .. }),
        "six leases: two in each sub-log's share"
    );
    let held = |i: u32| integer(&server, &["ZCARD", &lease_expiries("api", i)]);
    assert_eq!((0..SHARDS).map(held).collect::<Vec<_>>(), [2, 2, 2]);
    let in_flight: u64 = rt
        .block_on(store.in_flight("api", None))
        .unwrap()
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert_eq!(in_flight, 6);
    // l0's sub-log, as Redis holds it.
    let home = (0..SHARDS)
        .find(|&i| {
            !server
                .command(&["ZSCORE", &lease_expiries("api", i), "l0"])
                .unwrap()
                .is_empty()
        })
        .expect("l0 is held somewhere");
    // One call each, to that sub-log alone.
    let calls = || server.command_calls("fcall") + server.command_calls("evalsha");
    let before = calls();
    rt.block_on(store.renew("api", &["l0"], 60_000_000, None))
        .unwrap();
    rt.block_on(store.release("api", &["l0"])).unwrap();
    assert_eq!(
        calls() - before,
        2,
        "a renewal and a release, one call each"
    );
    for i in 0..SHARDS {
        assert_eq!(held(i), if i == home { 1 } else { 2 }, "sub-log {i}");
    }
    // Its room is there again, and only there.
    assert!(matches!(take("l6"), Assignment::Assigned { .. }));
    assert_eq!(held(home), 2);
    assert!(matches!(take("l7"), Assignment::Concurrency { .. }));
    let all: Vec<String> = (1..7).map(|k| format!("l{k}")).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    rt.block_on(store.release("api", &all)).unwrap();
    assert_eq!((0..SHARDS).map(held).collect::<Vec<_>>(), [0, 0, 0]);
}

/// On a `home` route (which `check` refuses with leases, since they share no call, but which
/// the store must still keep exact), a lease the instance's own sub-log refuses at its share
/// is taken in the next one, a refused call first each time (a sub-log at its share of leases
/// is not remembered as full); its renewal and release go to that spill-over sub-log, one call
/// each, and its room is taken again there, not in the instance's own.
#[test]
fn a_lease_taken_past_the_instances_own_sub_log_goes_back_there() {
    let server = RedisServer::start();
    let rt = runtime();
    // Instance 4: its own sub-log is 1, the spill-over one 2.
    let redis = rt.block_on(async { single(&server).with_instance_index(4) });
    let store: &dyn StateStore = &redis;
    let pool = members(3);
    // Every sub-log's pool made (a first assignment there syncs it), taken in turn; then home,
    // by a reload that keeps the sub-logs: the calls below are the leases' own.
    store.shard_routes(&[("api", SHARDS, RR)]);
    for _ in 0..SHARDS {
        let answer = rt
            .block_on(store.assign(least_used("api", &pool, None, false)))
            .unwrap();
        assert!(matches!(answer, Assignment::Assigned { .. }), "{answer:?}");
    }
    store.shard_routes(&[("api", SHARDS, HOME)]);
    let (own, next) = (1, 2);
    let calls = || server.command_calls("fcall") + server.command_calls("evalsha");
    let take = |id: &str| {
        let ask = Assign {
            lease: Some(sluice_allocator::Lease {
                id,
                ttl_us: 60_000_000,
                member_max: None,
                route_max: Some(6),
                client: None,
            }),
            ..least_used("api", &pool, None, false)
        };
        let before = calls();
        let answer = rt.block_on(store.assign(ask)).unwrap();
        assert!(matches!(answer, Assignment::Assigned { .. }), "{answer:?}");
        calls() - before
    };
    let held = |i: u32| integer(&server, &["ZCARD", &lease_expiries("api", i)]);
    let expiry = |i: u32, id: &str| {
        let score = server
            .command(&["ZSCORE", &lease_expiries("api", i), id])
            .unwrap();
        score.trim().parse::<f64>().ok()
    };
    // Two leases, the own sub-log's share of six: one call each, there.
    assert_eq!((take("l0"), take("l1")), (1, 1));
    assert_eq!((0..SHARDS).map(held).collect::<Vec<_>>(), [0, 2, 0]);
    // The third: refused by the own sub-log, taken by the next.
    assert_eq!(take("spill"), 2, "a refused call in the own sub-log first");
    assert_eq!((0..SHARDS).map(held).collect::<Vec<_>>(), [0, 2, 1]);
    let taken = expiry(next, "spill").expect("the lease is in the spill-over sub-log");
    assert_eq!(expiry(own, "spill"), None);
    // Renewed for an hour and released there, one call each.
    let before = calls();
    rt.block_on(store.renew("api", &["spill"], 3_600_000_000, None))
        .unwrap();
    let renewed = expiry(next, "spill").expect("still held there");
    assert!(
        renewed >= taken - 60_000_000.0 + 3_600_000_000.0,
        "renewed in the sub-log that took it: {taken} then {renewed}"
    );
    rt.block_on(store.release("api", &["spill"])).unwrap();
    assert_eq!(
        calls() - before,
        2,
        "a renewal and a release, one call each"
    );
    assert_eq!((0..SHARDS).map(held).collect::<Vec<_>>(), [0, 2, 0]);
    // Its room is taken again in the spill-over sub-log, past the own one at its share.
    assert_eq!(take("again"), 2);
    assert!(expiry(next, "again").is_some());
    rt.block_on(store.release("api", &["l0", "l1", "again"]))
        .unwrap();
    assert_eq!((0..SHARDS).map(held).collect::<Vec<_>>(), [0, 0, 0]);
}

/// A sub-log whose lease calls fail (here its expiries key holds another type; in production
/// its master out of reach) keeps neither a renewal nor a release from the others: each call
/// says it failed, and the leases in every other sub-log are renewed, then released, all the
/// same. Renewed only while sub-log 0 answered, they would expire there while still in flight,
/// and their room would be taken again past `max_in_flight`.
#[test]
fn a_renewal_and_a_release_reach_the_other_sub_logs_when_one_fails() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR)]);
    let pool = members(3);
    let ids: Vec<String> = (0..6).map(|k| format!("l{k}")).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    for id in &ids {
        let ask = Assign {
            lease: Some(sluice_allocator::Lease {
                id,
                ttl_us: 60_000_000,
                member_max: None,
                route_max: Some(6),
                client: None,
            }),
            ..least_used("api", &pool, None, false)
        };
        let answer = rt.block_on(store.assign(ask)).unwrap();
        assert!(matches!(answer, Assignment::Assigned { .. }), "{answer:?}");
    }
    // Each lease's expiry (µs), by sub-log, as Redis holds it.
    let expiries = |i: u32| -> HashMap<String, i64> {
        server
            .zrange_with_scores(&lease_expiries("api", i))
            .into_iter()
            .map(|(id, at)| (id, at as i64))
            .collect()
    };
    let taken: Vec<HashMap<String, i64>> = (0..SHARDS).map(expiries).collect();
    assert_eq!(
        taken.iter().map(HashMap::len).collect::<Vec<_>>(),
        [2, 2, 2],
        "two leases in each sub-log's share"
    );
    // The first sub-log fails; the ones after it must still hear. Its leases are kept aside,
    // to be put back when it answers again.
    let first = lease_expiries("api", 0);
    let aside = format!("{first}:aside");
    for args in [
        ["RENAME", &first, &aside],
        ["SET", &first, "not a sorted set"],
    ] {
        assert!(
            server.command(&args).unwrap().starts_with("+OK"),
            "{args:?}"
        );
    }
    // Renewed for an hour: each expiry that moves is an hour from the renewal, which comes
    // after the minute from the taking, however long the machine took in between.
    assert!(rt
        .block_on(store.renew("api", &ids, 3_600_000_000, None))
        .is_err());
    for i in 1..SHARDS {
        let renewed = expiries(i);
        for (id, before) in &taken[i as usize] {
            let after = renewed.get(id).copied().unwrap_or(0);
            assert!(
                after >= before - 60_000_000 + 3_600_000_000,
                "sub-log {i} renews {id}: {before} then {after}"
            );
        }
    }
    let held = |i: u32| integer(&server, &["ZCARD", &lease_expiries("api", i)]);
    assert!(rt.block_on(store.release("api", &ids)).is_err());
    for i in 1..SHARDS {
        assert_eq!(held(i), 0, "sub-log {i} releases its leases");
    }
    // Forgotten by the failed release, sub-log 0's leases go to every sub-log when it is tried
    // again, and are released where they are once their sub-log answers.
    assert_eq!(server.integer(&["DEL", &first]), Some(1));
    assert!(server
        .command(&["RENAME", &aside, &first])
        .unwrap()
        .starts_with("+OK"));
    assert_eq!(held(0), 2);
    rt.block_on(store.release("api", &ids)).unwrap();
    assert_eq!((0..SHARDS).map(held).collect::<Vec<_>>(), [0, 0, 0]);
    let in_flight: u64 = rt
        .block_on(store.in_flight("api", None))
        .unwrap()
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert_eq!(in_flight, 0);
}

/// A session's binding lives in its own sub-log (its hash mod the count), so it finds its
/// member there every time; the counts sum the sub-logs.
#[test]
fn a_session_keeps_its_member_through_its_own_sub_log() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR)]);
    let pool = members(3);
    let ask = |session| Assign {
        sticky: Some(sluice_allocator::Sticky {
            session,
            ttl_us: 60_000_000,
            max_bindings: 99,
        }),
        ..least_used("api", &pool, None, false)
    };
    let member = |session| match rt.block_on(store.assign(ask(session))).unwrap() {
        Assignment::Assigned { member, .. } => member,
        other => panic!("{other:?}"),
    };
    let first = member("s1");
    for _ in 0..6 {
        assert_eq!(member("s1"), first);
        member("other");
    }
    let home = u32::from(keys::crc16(b"s1")) % SHARDS;
    let bound = server
        .command(&[
            "HGET",
            &format!("sluice:{{{}}}:sh", sub_log("api", home, SHARDS)),
            "s1",
        ])
        .unwrap();
    assert_eq!(bound, first, "the binding is in the session's own sub-log");
    assert_eq!(
        rt.block_on(store.sticky_counts("api", None))
            .unwrap()
            .bindings,
        2
    );
    rt.block_on(store.unbind("api", "s1", &first)).unwrap();
    assert_eq!(
        rt.block_on(store.sticky_counts("api", None))
            .unwrap()
            .bindings,
        1
    );
}

/// On a `home` route (which `check` refuses with sticky sessions, but which the store must still
/// keep right), a session starts at its own sub-log, not the instance's: its binding lives
/// there, where every instance looks for it, and nothing of it is in the instance's own.
#[test]
fn a_session_on_a_home_route_keeps_its_binding_in_its_own_sub_log() {
    let server = RedisServer::start();
    let rt = runtime();
    let session = u32::from(keys::crc16(b"s1")) % SHARDS;
    // An instance whose own sub-log is another one.
    let own = (session + 1) % SHARDS;
    let redis = rt.block_on(async { single(&server).with_instance_index(own) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, HOME)]);
    let pool = members(3);
    let ask = Assign {
        sticky: Some(sluice_allocator::Sticky {
            session: "s1",
            ttl_us: 60_000_000,
            max_bindings: 99,
        }),
        ..least_used("api", &pool, None, false)
    };
    let member = || match rt.block_on(store.assign(ask)).unwrap() {
        Assignment::Assigned { member, .. } => member,
        other => panic!("{other:?}"),
    };
    let first = member();
    for _ in 0..3 {
        assert_eq!(member(), first);
    }
    let bindings = |i: u32| format!("sluice:{{{}}}:sh", sub_log("api", i, SHARDS));
    let bound = server.command(&["HGET", &bindings(session), "s1"]).unwrap();
    assert_eq!(bound, first, "the binding is in the session's own sub-log");
    assert_eq!(
        integer(&server, &["HLEN", &bindings(own)]),
        0,
        "nothing in the instance's own sub-log"
    );
    assert_eq!(
        rt.block_on(store.sticky_counts("api", None))
            .unwrap()
            .bindings,
        1
    );
}

/// A least-used assignment on `route` over `pool` that leaves out `excluded`.
fn excluding<'a>(route: &'a str, pool: &'a [PoolMember], excluded: &'a [&'a str]) -> Assign<'a> {
    Assign {
        excluded,
        ..least_used(route, pool, None, false)
    }
}

#[test]
fn members_busy_for_one_request_leave_no_hint_for_the_others() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR)]);
    // m0 holds one request an hour in each sub-log; m1 has no windows.
    let pool = vec![
        PoolMember {
            id: "m0".into(),
            windows: hour(u64::from(SHARDS)).into(),
        },
        PoolMember::new("m1"),
    ];
    for _ in 0..SHARDS {
        let answer = rt
            .block_on(store.assign(excluding("api", &pool, &["m1"])))
            .unwrap();
        assert!(matches!(answer, Assignment::Assigned { .. }), "{answer:?}");
    }
    // A request that may only have m0 (a retry, a down member's trial) finds every sub-log busy.
    let busy = rt
        .block_on(store.assign(excluding("api", &pool, &["m1"])))
        .unwrap();
    assert!(matches!(busy, Assignment::Busy { .. }), "{busy:?}");
    // That says nothing of m1: the next request that may have it gets it.
    match rt
        .block_on(store.assign(excluding("api", &pool, &[])))
        .unwrap()
    {
        Assignment::Assigned { member, .. } => assert_eq!(member, "m1"),
        other => panic!("m1 has room: {other:?}"),
    }
}

#[test]
fn a_large_refused_cost_leaves_room_for_a_small_one() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR)]);
    // 300 an hour: 100 in each sub-log, 99 left in each after one unit there.
    let windows = hour(300);
    for _ in 0..SHARDS {
        let one = rt
            .block_on(store.acquire(acquire("api", &windows, 1)))
            .unwrap();
        assert!(one.admitted);
    }
    assert_eq!(sub_logs_held("api", |k| server.log_held(k)), [1, 1, 1]);
    let big = rt
        .block_on(store.acquire(acquire("api", &windows, 100)))
        .unwrap();
    assert!(!big.admitted, "no sub-log holds 100 more");
    // The big refusal does not stand for a small cost, which fits in any sub-log.
    for _ in 0..SHARDS {
        let small = rt
            .block_on(store.acquire(acquire("api", &windows, 1)))
            .unwrap();
        assert!(small.admitted, "{small:?}");
    }
    // A cost that did not fit is still refused without a call, with a wait of its own.
    let calls = || server.command_calls("fcall") + server.command_calls("evalsha");
    let before = calls();
    let again = rt
        .block_on(store.acquire(acquire("api", &windows, 100)))
        .unwrap();
    assert!(!again.admitted && again.retry_after_us > 0);
    assert_eq!(calls(), before, "the same cost is known not to fit");
}

#[test]
fn a_reload_forgets_what_the_sub_logs_refused() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR)]);
    let small = hour(u64::from(SHARDS));
    for _ in 0..SHARDS {
        assert!(
            rt.block_on(store.acquire(acquire("api", &small, 1)))
                .unwrap()
                .admitted
        );
    }
    let full = rt
        .block_on(store.acquire(acquire("api", &small, 1)))
        .unwrap();
    assert!(!full.admitted, "every sub-log at its share");
    // A reload that keeps the sub-logs but raises the limit: the next request is admitted.
    store.shard_routes(&[("api", SHARDS, RR)]);
    let raised = hour(u64::from(2 * SHARDS));
    let after = rt
        .block_on(store.acquire(acquire("api", &raised, 1)))
        .unwrap();
    assert!(after.admitted, "the raised limit has room: {after:?}");
}

#[test]
fn a_quota_call_after_every_sub_log_was_busy_gets_an_answer() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR)]);
    let pool = vec![PoolMember {
        id: "m0".into(),
        windows: hour(u64::from(SHARDS)).into(),
    }];
    for _ in 0..SHARDS {
        let answer = rt
            .block_on(store.assign(excluding("api", &pool, &[])))
            .unwrap();
        assert!(matches!(answer, Assignment::Assigned { .. }), "{answer:?}");
    }
    let busy = rt
        .block_on(store.assign(excluding("api", &pool, &[])))
        .unwrap();
    assert!(matches!(busy, Assignment::Busy { .. }), "{busy:?}");
    // The same route and key asked of its quota alone (a reload to round-robin, say): every
    // sub-log busy is no refusal of the quota, so the request is answered by a call, never
    // failed for want of one (which `on_store_error: open` would admit uncounted).
    let windows = hour(30);
    let answer = rt.block_on(store.acquire(acquire("api", &windows, 1)));
    assert!(answer.as_ref().is_ok_and(|o| o.admitted), "{answer:?}");
}

#[test]
fn a_refusal_under_the_old_limits_says_nothing_of_the_new() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = rt.block_on(async { single(&server) });
    let store: &dyn StateStore = &redis;
    store.shard_routes(&[("api", SHARDS, RR)]);
    let small = hour(u64::from(SHARDS));
    for _ in 0..=SHARDS {
        rt.block_on(store.acquire(acquire("api", &small, 1)))
            .unwrap();
    }
    // A request still decided by the config in force before a reload is refused after the
    // reload forgot the hints (it raced the swap), and leaves a hint: a request under the new,
    // raised limit does not take it for its own.
    store.shard_routes(&[("api", SHARDS, RR)]);
    let late = rt
        .block_on(store.acquire(acquire("api", &small, 1)))
        .unwrap();
    assert!(!late.admitted);
    let raised = hour(u64::from(2 * SHARDS));
    let after = rt
        .block_on(store.acquire(acquire("api", &raised, 1)))
        .unwrap();
    assert!(after.admitted, "the raised limit has room: {after:?}");
}
