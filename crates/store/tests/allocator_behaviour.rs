//! One behavioural suite for both allocators: the same expectations, run against
//! [`MemoryStore`] and [`RedisStore`] (a real `redis-server`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sluice_allocator::{Assign, Assignment, MemoryStore, Order, PoolMember, StateStore};
use sluice_limiter::{Acquire, Window};
use sluice_store::{RedisConnection, RedisStore};
use sluice_testkit::RedisServer;

const MEMBER_IDS: [&str; 3] = ["http://b.test", "http://a.test", "http://c.test"];

fn ids(list: &[&str]) -> Vec<Arc<str>> {
    list.iter().map(|m| Arc::from(*m)).collect()
}

fn members(list: &[&str]) -> Vec<PoolMember> {
    list.iter().map(|m| PoolMember::new(*m)).collect()
}

/// A plain least-used assignment (no member windows, no cooldowns), as before SPEC §8.
fn least_used<'a>(
    route: &'a str,
    members: &'a [PoolMember],
    excluded: &'a [&'a str],
    quota: Option<Acquire<'a>>,
) -> Assign<'a> {
    Assign {
        route,
        members,
        order: Order::LeastUsed,
        excluded,
        quota,
        cost: quota.map_or(1, |q| q.cost),
        cooldowns: false,
        at_us: None,
        lease: None,
        sticky: None,
    }
}

async fn pick(store: &dyn StateStore, route: &str, excluded: &[&str]) -> Option<String> {
    match store
        .assign(least_used(route, &members(&MEMBER_IDS), excluded, None))
        .await
        .unwrap()
    {
        Assignment::Assigned { member, .. } => Some(member),
        Assignment::NoMember { .. } => None,
        other => panic!("no quota was asked: {other:?}"),
    }
}

async fn counts(store: &dyn StateStore, route: &str) -> HashMap<String, u64> {
    store.counts(route).await.unwrap().into_iter().collect()
}

async fn ties_go_to_the_lexically_smallest(store: &dyn StateStore) {
    // Config order is b, a, c; ids decide.
    let order: Vec<String> = futures_join(store, "ties", 6).await;
    assert_eq!(
        order,
        [
            "http://a.test",
            "http://b.test",
            "http://c.test",
            "http://a.test",
            "http://b.test",
            "http://c.test"
        ]
    );
}

async fn futures_join(store: &dyn StateStore, route: &str, n: usize) -> Vec<String> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(pick(store, route, &[]).await.unwrap());
    }
    v
}

async fn n_picks_spread_evenly(store: &dyn StateStore) {
    for _ in 0..301 {
        pick(store, "spread", &[]).await.unwrap();
    }
    let c = counts(store, "spread").await;
    let (min, max) = (c.values().min().unwrap(), c.values().max().unwrap());
    assert!(max - min <= 1, "{c:?}");
    assert_eq!(c.values().sum::<u64>(), 301);
}

async fn an_empty_pool_has_no_member(store: &dyn StateStore) {
    let got = store
        .assign(least_used("empty", &members(&[]), &[], None))
        .await
        .unwrap();
    assert_eq!(got, Assignment::NoMember { quota: None });
}

async fn down_members_are_never_chosen_and_keep_their_count(store: &dyn StateStore) {
    for _ in 0..3 {
        pick(store, "down", &[]).await;
    }
    let down = ["http://a.test"];
    for _ in 0..10 {
        assert_ne!(pick(store, "down", &down).await.unwrap(), "http://a.test");
    }
    assert_eq!(
        counts(store, "down").await["http://a.test"],
        1,
        "a down member keeps its count"
    );
    // The only eligible member may be chosen again and again.
    let only_c = ["http://a.test", "http://b.test"];
    for _ in 0..5 {
        assert_eq!(pick(store, "down", &only_c).await.unwrap(), "http://c.test");
    }
    let all = ["http://a.test", "http://b.test", "http://c.test"];
    assert_eq!(pick(store, "down", &all).await, None);
}

async fn restore_keep_resumes_the_old_count(store: &dyn StateStore) {
    pick(store, "keep", &[]).await;
    let down = ["http://a.test"];
    for _ in 0..20 {
        pick(store, "keep", &down).await;
    }
    // Back up with `keep`: a has 1 against ~11 for the others, so it catches up first.
    let next: Vec<String> = futures_join(store, "keep", 10).await;
    assert!(next.iter().all(|m| m == "http://a.test"), "{next:?}");
}

async fn restore_min_gets_no_burst(store: &dyn StateStore) {
    pick(store, "min", &[]).await;
    let down = ["http://a.test"];
    for _ in 0..20 {
        pick(store, "min", &down).await;
    }
    store
        .restore_to_min("min", "http://a.test", &[])
        .await
        .unwrap();
    let c = counts(store, "min").await;
    assert_eq!(
        c["http://a.test"], 10,
        "raised to the least of the others: {c:?}"
    );
    // From there it takes its fair share, no more: 6 picks, 2 each.
    let next = futures_join(store, "min", 6).await;
    let a = next.iter().filter(|m| *m == "http://a.test").count();
    assert_eq!(a, 2, "{next:?}");
    // min never lowers a count.
    store
        .restore_to_min("min", "http://b.test", &[])
        .await
        .unwrap();
    assert_eq!(counts(store, "min").await["http://b.test"], 12);
}

/// `min` raises a member to the least count among the others that are not excluded: an excluded
/// member's low count is no floor (it may be down too, and about to be restored itself). In
/// Redis the excluded set of a call is also the one every call with none shares, so the restore
/// must not add to it.
async fn restore_min_ignores_the_excluded(store: &dyn StateStore) {
    let a = ["http://a.test"];
    let a_and_c = ["http://a.test", "http://c.test"];
    for _ in 0..20 {
        pick(store, "minx", &a).await;
    }
    for _ in 0..10 {
        pick(store, "minx", &a_and_c).await;
    }
    let c = counts(store, "minx").await;
    assert_eq!(
        (c["http://a.test"], c["http://b.test"], c["http://c.test"]),
        (0, 20, 10),
        "{c:?}"
    );
    store
        .restore_to_min("minx", "http://a.test", &["http://c.test"])
        .await
        .unwrap();
    assert_eq!(
        counts(store, "minx").await["http://a.test"],
        20,
        "b's count, not c's"
    );
    // Calls without exclusions still see every member: a, then c, are eligible again.
    let next = futures_join(store, "minx", 10).await;
    assert!(next.iter().all(|m| m == "http://c.test"), "{next:?}");
    let next = futures_join(store, "minx", 3).await;
    assert!(next.iter().any(|m| m == "http://a.test"), "{next:?}");
}

async fn membership_follows_the_config(store: &dyn StateStore) {
    for _ in 0..9 {
        pick(store, "members", &[]).await;
    }
    // d joins at the current minimum (3), c leaves.
    store
        .sync(
            "members",
            &ids(&["http://a.test", "http://b.test", "http://d.test"]),
            &[],
        )
        .await
        .unwrap();
    let c = counts(store, "members").await;
    assert_eq!(c.get("http://d.test"), Some(&3));
    assert!(!c.contains_key("http://c.test"));
    // A later instance syncing the same members changes nothing.
    store
        .sync(
            "members",
            &ids(&["http://a.test", "http://b.test", "http://d.test"]),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(counts(store, "members").await, c);
    // A member that left does not come back by being restored (a health check that began
    // before the reload): restoring raises counts in the pool, and adds nothing to it.
    store
        .restore_to_min("members", "http://c.test", &[])
        .await
        .unwrap();
    assert_eq!(counts(store, "members").await, c);
    for _ in 0..30 {
        assert_ne!(
            store
                .assign(least_used(
                    "members",
                    &members(&["http://a.test", "http://b.test", "http://d.test"]),
                    &[],
                    None
                ))
                .await
                .unwrap(),
            Assignment::Assigned {
                member: "http://c.test".into(),
                quota: None
            }
        );
    }
}

async fn quota_first_and_nothing_half_done(store: &dyn StateStore) {
    let windows = vec![Window {
        name: "w".into(),
        limit: 2,
        length_us: 60_000_000,
    }];
    let q = |at| Acquire {
        route: "fused",
        key: "route",
        windows: &windows,
        cost: 1,
        at_us: Some(at),
        client: None,
    };
    let all = ["http://a.test", "http://b.test", "http://c.test"];
    // No eligible member: no quota consumed.
    for t in 0..5 {
        match store
            .assign(least_used("fused", &members(&MEMBER_IDS), &all, Some(q(t))))
            .await
            .unwrap()
        {
            Assignment::NoMember { quota: Some(o) } => assert_eq!(o.windows[0].remaining, 2),
            other => panic!("{other:?}"),
        }
    }
    for t in 10..12 {
        assert!(matches!(
            store
                .assign(least_used("fused", &members(&MEMBER_IDS), &[], Some(q(t))))
                .await
                .unwrap(),
            Assignment::Assigned { quota: Some(_), .. }
        ));
    }
    // Quota refused: nothing assigned.
    let before = counts(store, "fused").await;
    match store
        .assign(least_used("fused", &members(&MEMBER_IDS), &[], Some(q(20))))
        .await
        .unwrap()
    {
        Assignment::QuotaRefused(o) => assert!(!o.admitted && o.retry_after_us > 0),
        other => panic!("{other:?}"),
    }
    assert_eq!(counts(store, "fused").await, before);
    assert_eq!(before.values().sum::<u64>(), 2);
}

async fn concurrent_picks_stay_within_one(store: Arc<dyn StateStore>) {
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..50 {
                store
                    .assign(least_used("busy", &members(&MEMBER_IDS), &[], None))
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let c = counts(&*store, "busy").await;
    let (min, max) = (c.values().min().unwrap(), c.values().max().unwrap());
    assert!(max - min <= 1, "{c:?}");
    assert_eq!(c.values().sum::<u64>(), 1600);
}

/// Fused assignments and plain quota calls on one quota key, at once: every request admitted
/// by either path is counted, so exactly `limit` get through. (The memory store once checked
/// the quota, then recorded it in a second call whose answer it ignored; a plain call that
/// slipped in between got a request assigned but never counted.)
async fn quota_and_assignment_are_one_step(store: Arc<dyn StateStore>) {
    const LIMIT: u64 = 300;
    let windows: &'static [Window] = Box::leak(Box::new([Window {
        name: "w".into(),
        limit: LIMIT,
        length_us: 3_600_000_000,
    }]));
    let q = move || Acquire {
        route: "onestep",
        key: "route",
        windows,
        cost: 1,
        at_us: None,
        client: None,
    };
    let mut tasks = Vec::new();
    for fused in [true, false].into_iter().cycle().take(16) {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0u64;
            for _ in 0..60 {
                let ok = if fused {
                    matches!(
                        store
                            .assign(least_used("onestep", &members(&MEMBER_IDS), &[], Some(q())))
                            .await
                            .unwrap(),
                        Assignment::Assigned { .. }
                    )
                } else {
                    store.acquire(q()).await.unwrap().admitted
                };
                admitted += u64::from(ok);
            }
            admitted
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(admitted, LIMIT, "960 attempts against a limit of {LIMIT}");
    let last = store.acquire(q()).await.unwrap();
    assert!(!last.admitted);
    assert_eq!(last.windows[0].remaining, 0);
}

async fn suite(store: Arc<dyn StateStore>) {
    ties_go_to_the_lexically_smallest(&*store).await;
    n_picks_spread_evenly(&*store).await;
    an_empty_pool_has_no_member(&*store).await;
    down_members_are_never_chosen_and_keep_their_count(&*store).await;
    restore_keep_resumes_the_old_count(&*store).await;
    restore_min_gets_no_burst(&*store).await;
    restore_min_ignores_the_excluded(&*store).await;
    membership_follows_the_config(&*store).await;
    quota_first_and_nothing_half_done(&*store).await;
    quota_and_assignment_are_one_step(store.clone()).await;
    concurrent_picks_stay_within_one(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_allocator_behaves() {
    suite(Arc::new(MemoryStore::new())).await;
}

fn redis_allocator(server: &RedisServer) -> RedisStore {
    let connection = RedisConnection::new(&server.url(), Duration::from_secs(5)).unwrap();
    RedisStore::with_connection(Arc::new(connection), "sluice")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_allocator_behaves() {
    let server = RedisServer::start();
    suite(Arc::new(redis_allocator(&server))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_one_script_call_per_fused_request_and_recovery_after_restart() {
    let mut server = RedisServer::start();
    let store = redis_allocator(&server);
    let windows = vec![Window {
        name: "w".into(),
        limit: 1000,
        length_us: 60_000_000,
    }];
    let q = Acquire {
        route: "rt",
        key: "route",
        windows: &windows,
        cost: 1,
        at_us: None,
        client: None,
    };
    // Warm up: the first call syncs the pool and loads the script.
    store
        .assign(least_used("rt", &members(&MEMBER_IDS), &[], Some(q)))
        .await
        .unwrap();
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let monitor = server.monitor();
    for _ in 0..100 {
        store
            .assign(least_used("rt", &members(&MEMBER_IDS), &[], Some(q)))
            .await
            .unwrap();
    }
    let sent = monitor.stop();
    // commandstats also counts what the script runs inside Redis; MONITOR tells the two apart.
    assert_eq!(server.command_calls("fcall"), 100);
    assert_eq!(sent.len(), 100, "exactly one command per request: {sent:?}");
    assert!(sent.iter().all(|c| c == "FCALL"), "{sent:?}");
    assert_eq!(server.integer(&["ZCARD", "sluice:{rt}:pool"]), Some(3));

    // Redis restarts empty: the pool is synced again on the way and no call fails.
    server.restart();
    for _ in 0..10 {
        assert!(matches!(
            store
                .assign(least_used("rt", &members(&MEMBER_IDS), &[], Some(q)))
                .await
                .unwrap(),
            Assignment::Assigned { .. }
        ));
    }
    let c: u64 = store
        .counts("rt")
        .await
        .unwrap()
        .iter()
        .map(|(_, c)| c)
        .sum();
    assert_eq!(c, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_allocator_behaves() {
    let cluster = sluice_testkit::RedisCluster::start();
    let connection = RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap();
    suite(Arc::new(RedisStore::with_connection(
        Arc::new(connection),
        "sluice",
    )))
    .await;
    let routes = [
        "ties", "spread", "down", "keep", "min", "members", "fused", "busy", "onestep",
    ];
    let masters: std::collections::HashSet<u16> = routes
        .iter()
        .filter_map(|r| cluster.master_of(&format!("{{{r}}}")))
        .collect();
    assert!(
        masters.len() >= 2,
        "the pools span several masters: {masters:?}"
    );
}

/// Polls a future that never waits (the memory store's never do) to completion.
fn now<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("the memory store never waits"),
    }
}

/// The race of `quota_and_assignment_are_one_step`, made tight: two threads released together
/// thousands of times, one assigning with the quota and one charging the same quota key
/// directly, on a fresh key with a limit of 1 each round. Exactly one of them may win a round.
#[test]
fn memory_fused_assignment_and_plain_quota_never_both_win() {
    use std::sync::atomic::{AtomicU64, Ordering};
    const ROUNDS: u64 = 20_000;
    let store = MemoryStore::new();
    let windows = [Window {
        name: "w".into(),
        limit: 1,
        length_us: 3_600_000_000,
    }];
    let members = members(&MEMBER_IDS);
    let arrived = AtomicU64::new(0);
    let keys: Vec<String> = (0..ROUNDS).map(|i| format!("k{i}")).collect();
    let wins: Vec<Vec<bool>> = std::thread::scope(|s| {
        let run = |fused: bool| {
            let (store, windows, members, arrived, keys) =
                (&store, &windows, &members, &arrived, &keys);
            move || {
                let mut won = Vec::with_capacity(ROUNDS as usize);
                for (round, key) in keys.iter().enumerate() {
                    arrived.fetch_add(1, Ordering::AcqRel);
                    // Spin, for a tight start; yield now and then, so that a loaded machine
                    // still schedules the other thread.
                    let mut spins = 0u32;
                    while arrived.load(Ordering::Acquire) < 2 * (round as u64 + 1) {
                        spins += 1;
                        if spins.is_multiple_of(256) {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                    let q = Acquire {
                        route: "race",
                        key,
                        windows,
                        cost: 1,
                        at_us: None,
                        client: None,
                    };
                    won.push(if fused {
                        matches!(
                            now(store.assign(least_used("race", members, &[], Some(q)))).unwrap(),
                            Assignment::Assigned { .. }
                        )
                    } else {
                        now(store.acquire(q)).unwrap().admitted
                    });
                }
                won
            }
        };
        let a = s.spawn(run(true));
        let b = s.spawn(run(false));
        vec![a.join().unwrap(), b.join().unwrap()]
    });
    let both = (0..ROUNDS as usize)
        .filter(|&i| wins[0][i] && wins[1][i])
        .count();
    let neither = (0..ROUNDS as usize)
        .filter(|&i| !wins[0][i] && !wins[1][i])
        .count();
    assert_eq!(
        (both, neither),
        (0, 0),
        "rounds where both won (over-admission) or neither did"
    );
}

/// The least-used script as the store assembles it (crates/store/src/scripts.rs): the library,
/// then the driver.
fn allocator_script() -> String {
    let lua = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lua");
    let read = |name: &str| std::fs::read_to_string(lua.join(name)).expect("lua/ is readable");
    format!("{}\n{}", read("allocator.lua"), read("allocator_run.lua"))
}

/// A batched least-used call whose last request says it excludes more members than the call
/// names (only a broken caller sends that) is refused before anything is written: the picks of
/// the requests before it, which go one by one in a call this small, must not count.
#[test]
fn a_batch_that_names_too_few_excluded_members_writes_nothing() {
    let server = RedisServer::start();
    let pool = "sluice:{malformed}:pool";
    server
        .command(&["ZADD", pool, "0", "http://a.test", "0", "http://b.test"])
        .unwrap();
    let script = allocator_script();
    // Three requests: none excluded, none excluded, then one that counts `count` ids and
    // names one.
    let batch = |count: &str| {
        server.command(&[
            "EVAL",
            &script,
            "1",
            pool,
            "assign",
            "0",
            "0",
            count,
            "http://a.test",
        ])
    };
    let refused = batch("3");
    let error = refused.expect_err("refused").to_string();
    assert!(
        error.contains("excludes more members than the call names"),
        "{error}"
    );
    assert_eq!(
        server.zrange_with_scores(pool),
        vec![
            ("http://a.test".to_string(), 0.0),
            ("http://b.test".to_string(), 0.0)
        ],
        "no pick counted"
    );
    // The same requests, well formed, are decided.
    let decided = batch("1").unwrap();
    assert_eq!(
        decided.split_whitespace().collect::<Vec<_>>(),
        // Integers as the test kit writes them.
        [
            ":1",
            "http://a.test",
            ":1",
            "http://b.test",
            ":1",
            "http://b.test"
        ],
    );
}
