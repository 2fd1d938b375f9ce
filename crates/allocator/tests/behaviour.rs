//! One behavioural suite for both allocators: the same expectations, run against
//! [`MemoryAllocator`] and [`RedisAllocator`] (a real `redis-server`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sluice_allocator::{Assignment, AssignmentStore, MemoryAllocator, RedisAllocator};
use sluice_limiter::{Acquire, MemoryStore, RedisConnection, Window};
use sluice_testkit::RedisServer;

const MEMBER_IDS: [&str; 3] = ["http://b.test", "http://a.test", "http://c.test"];

fn ids(list: &[&str]) -> Vec<Arc<str>> {
    list.iter().map(|m| Arc::from(*m)).collect()
}

async fn pick(store: &dyn AssignmentStore, route: &str, excluded: &[&str]) -> Option<String> {
    match store
        .assign(route, &ids(&MEMBER_IDS), excluded, None)
        .await
        .unwrap()
    {
        Assignment::Assigned { member, .. } => Some(member),
        Assignment::NoMember { .. } => None,
        other => panic!("no quota was asked: {other:?}"),
    }
}

async fn counts(store: &dyn AssignmentStore, route: &str) -> HashMap<String, u64> {
    store.counts(route).await.unwrap().into_iter().collect()
}

async fn ties_go_to_the_lexically_smallest(store: &dyn AssignmentStore) {
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

async fn futures_join(store: &dyn AssignmentStore, route: &str, n: usize) -> Vec<String> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(pick(store, route, &[]).await.unwrap());
    }
    v
}

async fn n_picks_spread_evenly(store: &dyn AssignmentStore) {
    for _ in 0..301 {
        pick(store, "spread", &[]).await.unwrap();
    }
    let c = counts(store, "spread").await;
    let (min, max) = (c.values().min().unwrap(), c.values().max().unwrap());
    assert!(max - min <= 1, "{c:?}");
    assert_eq!(c.values().sum::<u64>(), 301);
}

async fn an_empty_pool_has_no_member(store: &dyn AssignmentStore) {
    let got = store.assign("empty", &ids(&[]), &[], None).await.unwrap();
    assert_eq!(got, Assignment::NoMember { quota: None });
}

async fn down_members_are_never_chosen_and_keep_their_count(store: &dyn AssignmentStore) {
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

async fn restore_keep_resumes_the_old_count(store: &dyn AssignmentStore) {
    pick(store, "keep", &[]).await;
    let down = ["http://a.test"];
    for _ in 0..20 {
        pick(store, "keep", &down).await;
    }
    // Back up with `keep`: a has 1 against ~11 for the others, so it catches up first.
    let next: Vec<String> = futures_join(store, "keep", 10).await;
    assert!(next.iter().all(|m| m == "http://a.test"), "{next:?}");
}

async fn restore_min_gets_no_burst(store: &dyn AssignmentStore) {
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

async fn membership_follows_the_config(store: &dyn AssignmentStore) {
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
    for _ in 0..30 {
        assert_ne!(
            store
                .assign(
                    "members",
                    &ids(&["http://a.test", "http://b.test", "http://d.test"]),
                    &[],
                    None
                )
                .await
                .unwrap(),
            Assignment::Assigned {
                member: "http://c.test".into(),
                quota: None
            }
        );
    }
}

async fn quota_first_and_nothing_half_done(store: &dyn AssignmentStore) {
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
    };
    let all = ["http://a.test", "http://b.test", "http://c.test"];
    // No eligible member: no quota consumed.
    for t in 0..5 {
        match store
            .assign("fused", &ids(&MEMBER_IDS), &all, Some(q(t)))
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
                .assign("fused", &ids(&MEMBER_IDS), &[], Some(q(t)))
                .await
                .unwrap(),
            Assignment::Assigned { quota: Some(_), .. }
        ));
    }
    // Quota refused: nothing assigned.
    let before = counts(store, "fused").await;
    match store
        .assign("fused", &ids(&MEMBER_IDS), &[], Some(q(20)))
        .await
        .unwrap()
    {
        Assignment::QuotaRefused(o) => assert!(!o.admitted && o.retry_after_us > 0),
        other => panic!("{other:?}"),
    }
    assert_eq!(counts(store, "fused").await, before);
    assert_eq!(before.values().sum::<u64>(), 2);
}

async fn concurrent_picks_stay_within_one(store: Arc<dyn AssignmentStore>) {
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..50 {
                store
                    .assign("busy", &ids(&MEMBER_IDS), &[], None)
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

async fn suite(store: Arc<dyn AssignmentStore>) {
    ties_go_to_the_lexically_smallest(&*store).await;
    n_picks_spread_evenly(&*store).await;
    an_empty_pool_has_no_member(&*store).await;
    down_members_are_never_chosen_and_keep_their_count(&*store).await;
    restore_keep_resumes_the_old_count(&*store).await;
    restore_min_gets_no_burst(&*store).await;
    membership_follows_the_config(&*store).await;
    quota_first_and_nothing_half_done(&*store).await;
    concurrent_picks_stay_within_one(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_allocator_behaves() {
    suite(Arc::new(MemoryAllocator::new(Arc::new(MemoryStore::new())))).await;
}

fn redis_allocator(server: &RedisServer) -> RedisAllocator {
    let connection = RedisConnection::new(&server.url(), Duration::from_secs(2)).unwrap();
    RedisAllocator::new(Arc::new(connection), "sluice")
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
    };
    // Warm up: the first call syncs the pool and loads the script.
    store
        .assign("rt", &ids(&MEMBER_IDS), &[], Some(q))
        .await
        .unwrap();
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let monitor = server.monitor();
    for _ in 0..100 {
        store
            .assign("rt", &ids(&MEMBER_IDS), &[], Some(q))
            .await
            .unwrap();
    }
    let sent = monitor.stop();
    // commandstats also counts what the script runs inside Redis; MONITOR tells the two apart.
    assert_eq!(server.command_calls("evalsha"), 100);
    assert_eq!(sent.len(), 100, "exactly one command per request: {sent:?}");
    assert!(sent.iter().all(|c| c == "EVALSHA"), "{sent:?}");
    assert_eq!(server.integer(&["ZCARD", "sluice:{rt}:pool"]), Some(3));

    // Redis restarts empty: the pool is synced again on the way and no call fails.
    server.restart();
    for _ in 0..10 {
        assert!(matches!(
            store
                .assign("rt", &ids(&MEMBER_IDS), &[], Some(q))
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
    let connection = RedisConnection::cluster(&cluster.urls(), Duration::from_secs(2)).unwrap();
    suite(Arc::new(RedisAllocator::new(
        Arc::new(connection),
        "sluice",
    )))
    .await;
    let routes = [
        "ties", "spread", "down", "keep", "min", "members", "fused", "busy",
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
