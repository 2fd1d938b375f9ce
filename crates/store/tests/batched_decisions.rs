//! The Redis store decides the quota + least-used requests of one route and quota key that wait
//! together in one script call (crates/store/src/batch.rs, lua/fused_run.lua), and so the plain
//! quota ones (lua/quota_run.lua) and the plain least-used ones of a route
//! (lua/allocator_run.lua); `with_batching(false)` makes a call per request. Each request must
//! be decided exactly as if it had come alone: these tests hold every answer of a batched run to
//! the memory store's sequential ones, and to the Redis store's own sequential ones, request by
//! request, over random traces (proptest) of groups of requests that arrive together, with
//! random costs, windows that fill and empty, and members left out per request.
//!
//! A group is started in one poll on a current-thread runtime (every request queues before the
//! call's task can run), so each group is exactly one call; the tests count the calls, so that a
//! store that stopped batching could not pass them.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use sluice_allocator::{Assign, Assignment, MemoryStore, Order, PoolMember, StateStore};
use sluice_limiter::{Acquire, Outcome, Window};
use sluice_store::{RedisConnection, RedisStore, RedisStoreConfig};
use sluice_testkit::{RedisCluster, RedisServer};

/// Ids whose byte order is not their config order, with prefixes of one another and a capital
/// letter (which sorts before every small one in bytes, and not in most locales' collations).
const MEMBER_IDS: [&str; 10] = [
    "http://b.test",
    "http://a.test",
    "http://c.test",
    "http://a.test:8080",
    "http://a",
    "http://B.test",
    "http://a.tes",
    "http://b.test/",
    "http://z",
    "http://0",
];

#[derive(Debug, Clone)]
struct Request {
    cost: u64,
    /// Which members this request leaves out (bit i: member i).
    excluded: u16,
}

#[derive(Debug, Clone)]
struct Group {
    /// Microseconds since the previous group; a group's requests share one clock.
    after_us: u64,
    requests: Vec<Request>,
}

#[derive(Debug, Clone)]
struct Trace {
    /// The pool: the first `members` of MEMBER_IDS.
    members: usize,
    windows: Vec<Window>,
    groups: Vec<Group>,
}

/// A pool of 3 members, or of 10; no window, or one or two of `unit` µs times 1..=8 with small
/// limits, so that groups fill them; and groups of 1 to 12 requests whose costs reach past the smallest limit (a request that can
/// never fit), a third of them with members left out, sometimes all of them.
fn trace(unit: u64) -> impl Strategy<Value = Trace> {
    (
        prop_oneof![Just(3usize), Just(10usize)],
        // No window at all is not a config sluice accepts, but the store takes it.
        prop_oneof![
            1 => Just(Vec::new()),
            8 => prop::collection::vec((1u64..=10, 1u64..=8), 1..=2),
        ],
    )
        .prop_flat_map(move |(members, spec)| {
            let windows: Vec<Window> = spec
                .iter()
                .enumerate()
                .map(|(i, &(limit, n))| Window {
                    name: format!("w{i}").into(),
                    limit,
                    length_us: n * unit,
                })
                .collect();
            let smallest = windows.iter().map(|w| w.limit).min().unwrap_or(3);
            let request = (
                prop_oneof![8 => 1..=smallest, 1 => smallest + 1..=smallest + 2],
                prop_oneof![6 => Just(0u16), 3 => 0u16..(1 << members)],
            )
                .prop_map(|(cost, excluded)| Request { cost, excluded });
            let group = (
            prop_oneof![3 => Just(0u64), 4 => 0..unit, 2 => (1u64..=9).prop_map(move |n| n * unit)],
            // Calls of fewer than 6 requests pick one by one, larger ones on a view of the pool.
            prop::collection::vec(request, 1..=12),
        )
            .prop_map(|(after_us, requests)| Group { after_us, requests });
            (Just(windows), prop::collection::vec(group, 1..12)).prop_map(
                move |(windows, groups)| Trace {
                    members,
                    windows,
                    groups,
                },
            )
        })
}

fn excluded_ids(mask: u16) -> Vec<&'static str> {
    MEMBER_IDS
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1 << i) != 0)
        .map(|(_, m)| *m)
        .collect()
}

/// Polls every future in order, each first poll before any second: the requests of a group all
/// queue before anything else runs.
async fn together<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        for (f, out) in futures.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                if let Poll::Ready(v) = f.as_mut().poll(cx) {
                    *out = Some(v);
                }
            }
        }
        if outputs.iter().all(Option::is_some) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    outputs.into_iter().map(|o| o.unwrap()).collect()
}

/// `futures` all at once (each first poll before any second), or one after another.
async fn all<F: Future>(futures: Vec<F>, at_once: bool) -> Vec<F::Output> {
    if at_once {
        return together(futures).await;
    }
    let mut outputs = Vec::new();
    for f in futures {
        outputs.push(f.await);
    }
    outputs
}

/// Polls each of `futures` once: each queues for its call (the first of a lane also starts the
/// call's task, which has not run yet), and none is answered before it.
async fn queue<F: Future + Unpin>(futures: &mut [F]) {
    std::future::poll_fn(|cx| {
        for f in futures.iter_mut() {
            assert!(
                Pin::new(&mut *f).poll(cx).is_pending(),
                "no answer before the call"
            );
        }
        Poll::Ready(())
    })
    .await;
}

/// The assignments counted in `route`'s pool, all members together.
async fn counted(store: &dyn StateStore, route: &str) -> u64 {
    store
        .counts(route)
        .await
        .unwrap()
        .iter()
        .map(|(_, c)| c)
        .sum()
}

/// The first `n` of MEMBER_IDS, as members and as ids.
fn pool(n: usize) -> (Vec<PoolMember>, Vec<Arc<str>>) {
    let ids = &MEMBER_IDS[..n];
    (
        ids.iter().map(|m| PoolMember::new(*m)).collect(),
        ids.iter().map(|m| Arc::from(*m)).collect(),
    )
}

/// The group's requests on `store`: all at once, or one after another.
async fn decide(
    store: &dyn StateStore,
    route: &str,
    members: &[PoolMember],
    windows: &[Window],
    group: &Group,
    now: u64,
    at_once: bool,
) -> Result<Vec<Assignment>, TestCaseError> {
    let excluded: Vec<Vec<&str>> = group
        .requests
        .iter()
        .map(|r| excluded_ids(r.excluded))
        .collect();
    let asks: Vec<Assign<'_>> = group
        .requests
        .iter()
        .zip(&excluded)
        .map(|(r, excluded)| Assign {
            route,
            members,
            order: Order::LeastUsed,
            excluded,
            quota: Some(Acquire {
                route,
                key: "k",
                windows,
                cost: r.cost,
                at_us: Some(now),
                client: None,
            }),
            cost: r.cost,
            cooldowns: false,
            at_us: Some(now),
            lease: None,
            sticky: None,
        })
        .collect();
    all(asks.into_iter().map(|a| store.assign(a)).collect(), at_once)
        .await
        .into_iter()
        .map(|r| r.map_err(|e| TestCaseError::fail(format!("store error {e}"))))
        .collect()
}

/// Replays `trace` batched on `redis` (counting its calls with `calls`), sequentially on a
/// memory store and, when given, sequentially on `sequential` (another Redis store or route);
/// every answer must be the same.
async fn replay(
    redis: &RedisStore,
    sequential: Option<&RedisStore>,
    route: &str,
    trace: &Trace,
    calls: &dyn Fn() -> u64,
) -> Result<(), TestCaseError> {
    let memory = MemoryStore::new();
    let pool = &MEMBER_IDS[..trace.members];
    let members: Vec<PoolMember> = pool.iter().map(|m| PoolMember::new(*m)).collect();
    let ids: Vec<Arc<str>> = pool.iter().map(|m| Arc::from(*m)).collect();
    let alone = format!("{route}-alone");
    // The pools exist before the first group, so that no group has to sync first (which
    // would make it two calls).
    for (store, route) in [(redis, route), (redis, alone.as_str())] {
        store
            .sync(route, &ids, &[])
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    let mut now = 1_000_000_000u64;
    for (g, group) in trace.groups.iter().enumerate() {
        now += group.after_us;
        let before = calls();
        let batched = decide(redis, route, &members, &trace.windows, group, now, true).await?;
        let made = calls() - before;
        prop_assert_eq!(
            made,
            1,
            "group {} ({} requests) took {} calls",
            g,
            group.requests.len(),
            made
        );
        let expected = decide(&memory, route, &members, &trace.windows, group, now, false).await?;
        prop_assert_eq!(&batched, &expected, "group {} at {}", g, now);
        if let Some(seq) = sequential {
            let alone = decide(seq, &alone, &members, &trace.windows, group, now, false).await?;
            prop_assert_eq!(&batched, &alone, "group {} at {}, Redis alone", g, now);
        }
    }
    let mut counts = redis.counts(route).await.unwrap();
    let mut expected = memory.counts(route).await.unwrap();
    counts.sort();
    expected.sort();
    prop_assert_eq!(counts, expected, "the pools' counts");
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn fresh_route() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("batch{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// One request on a route of its own, so that the scripts are loaded (a first call that finds
/// them missing counts twice) before calls are counted.
fn warm_up(rt: &tokio::runtime::Runtime, redis: &RedisStore) {
    let members = [PoolMember::new(MEMBER_IDS[0])];
    let windows = [Window {
        name: "w".into(),
        limit: 1,
        length_us: UNIT,
    }];
    let quota = Acquire {
        route: "warm-up",
        key: "k",
        windows: &windows,
        cost: 1,
        at_us: None,
        client: None,
    };
    let assigned = rt.block_on(redis.assign(Assign {
        route: "warm-up",
        members: &members,
        order: Order::LeastUsed,
        excluded: &[],
        quota: Some(quota),
        cost: 1,
        cooldowns: false,
        at_us: None,
        lease: None,
        sticky: None,
    }));
    assert!(
        matches!(assigned, Ok(Assignment::Assigned { .. })),
        "{assigned:?}"
    );
}

fn script_calls(server: &RedisServer) -> u64 {
    server.command_calls("fcall") + server.command_calls("evalsha")
}

fn redis_store(url: String) -> RedisStore {
    RedisStore::new(RedisStoreConfig {
        url,
        key_prefix: "sluice".into(),
        timeout: Duration::from_secs(5),
    })
    .unwrap()
}

/// Runs `cases` random traces through `case`; the first that fails (shrunk) fails the test.
fn run_cases(cases: u32, case: impl Fn(Trace) -> Result<(), TestCaseError>) {
    let mut runner = TestRunner::new(Config {
        cases,
        ..Config::default()
    });
    if let Err(e) = runner.run(&trace(UNIT), case) {
        panic!("{e}");
    }
}

/// Redis expires idle logs in real time (a window and an eighth after their last entry), while
/// the traces run on their own clock: windows are half a minute and up, so that no key expires
/// within a case however slowly a loaded machine runs it. With quarter-second windows a log
/// left idle between two groups of a slow case expired, and Redis then admitted what the
/// sequential model refused.
const UNIT: u64 = 30_000_000;

#[test]
fn batched_decisions_are_the_sequential_ones() {
    let server = RedisServer::start();
    let rt = runtime();
    let (redis, alone) = (redis_store(server.url()), redis_store(server.url()));
    warm_up(&rt, &redis);
    let calls = || script_calls(&server);
    run_cases((Config::default().cases / 4).max(1), |trace| {
        rt.block_on(replay(&redis, Some(&alone), &fresh_route(), &trace, &calls))
    });
}

/// The same with `EVALSHA` (Redis without functions, or an ACL that denies them).
#[test]
fn batched_decisions_are_the_sequential_ones_by_evalsha() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url_without_functions());
    warm_up(&rt, &redis);
    let calls = || script_calls(&server);
    run_cases(16, |trace| {
        rt.block_on(replay(&redis, None, &fresh_route(), &trace, &calls))
    });
    assert!(!redis.uses_functions());
}

/// On a Redis Cluster, routes on several masters.
#[test]
fn batched_decisions_are_the_sequential_ones_on_a_cluster() {
    let cluster = RedisCluster::start();
    let rt = runtime();
    let redis = rt.block_on(async {
        RedisStore::with_connection(
            Arc::new(RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap()),
            "sluice",
        )
    });
    warm_up(&rt, &redis);
    let calls = || {
        cluster
            .nodes()
            .iter()
            .map(|n| n.command_calls("fcall") + n.command_calls("evalsha"))
            .sum::<u64>()
    };
    let masters = std::sync::Mutex::new(std::collections::HashSet::new());
    run_cases(16, |trace| {
        let route = fresh_route();
        masters
            .lock()
            .unwrap()
            .insert(cluster.master_of(&format!("{{{route}}}")));
        rt.block_on(replay(&redis, None, &route, &trace, &calls))
    });
    let masters = masters.into_inner().unwrap();
    assert!(masters.len() >= 2, "routes on several masters: {masters:?}");
}

/// A request refused after others were admitted in the same call is told how long until its
/// cost fits counting their entries too, even when Redis's clock went back since older entries
/// were written (an NTP step): the newer entries, scored earlier, are the first to leave, as
/// when each request has a call of its own.
#[test]
fn a_refusal_counts_the_admissions_of_its_own_call_on_a_clock_that_went_back() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url());
    warm_up(&rt, &redis);
    let trace = Trace {
        members: 3,
        windows: vec![Window {
            name: "w".into(),
            limit: 3,
            length_us: 4 * UNIT,
        }],
        groups: vec![],
    };
    let members: Vec<PoolMember> = MEMBER_IDS.iter().map(|m| PoolMember::new(*m)).collect();
    let ids: Vec<Arc<str>> = MEMBER_IDS.iter().map(|m| Arc::from(*m)).collect();
    let one = |n: usize| Group {
        after_us: 0,
        requests: vec![
            Request {
                cost: 1,
                excluded: 0
            };
            n
        ],
    };
    let t = 1_000_000_000u64;
    let answers = rt.block_on(async {
        let mut answers = Vec::new();
        for (route, at_once) in [("back-batched", true), ("back-alone", false)] {
            redis.sync(route, &ids, &[]).await.unwrap();
            decide(
                &redis,
                route,
                &members,
                &trace.windows,
                &one(2),
                t + 10,
                at_once,
            )
            .await
            .unwrap();
            answers.push(
                decide(&redis, route, &members, &trace.windows, &one(2), t, at_once)
                    .await
                    .unwrap(),
            );
        }
        answers
    });
    match &answers[0][1] {
        Assignment::QuotaRefused(o) => assert_eq!(o.retry_after_us, 4 * UNIT),
        other => panic!("the second request is refused: {other:?}"),
    }
    assert_eq!(answers[0], answers[1]);
}

/// A request that gives up while it waits for its call (its client left, its timeout passed) is
/// taken out of the call before it leaves: it is neither charged nor counted, and the requests
/// beside it are decided as if it had never come.
#[test]
fn a_request_that_gives_up_before_its_call_leaves_is_not_charged() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url());
    warm_up(&rt, &redis);
    let windows = [Window {
        name: "w".into(),
        limit: 10,
        length_us: 4 * UNIT,
    }];
    let members: Vec<PoolMember> = MEMBER_IDS.iter().map(|m| PoolMember::new(*m)).collect();
    let ids: Vec<Arc<str>> = MEMBER_IDS.iter().map(|m| Arc::from(*m)).collect();
    let route = "gives-up";
    let ask = Assign {
        route,
        members: &members,
        order: Order::LeastUsed,
        excluded: &[],
        quota: Some(Acquire {
            route,
            key: "k",
            windows: &windows,
            cost: 1,
            at_us: Some(1_000_000_000),
            client: None,
        }),
        cost: 1,
        cooldowns: false,
        at_us: Some(1_000_000_000),
        lease: None,
        sticky: None,
    };
    rt.block_on(async {
        redis.sync(route, &ids, &[]).await.unwrap();
        let before = script_calls(&server);
        let mut asks: Vec<_> = (0..3).map(|_| redis.assign(ask)).collect();
        queue(&mut asks).await;
        drop(asks.remove(1));
        let answers = together(asks).await;
        assert_eq!(script_calls(&server) - before, 1, "one call for both");
        let remaining: Vec<u64> = answers
            .iter()
            .map(|a| match a {
                Ok(Assignment::Assigned { quota: Some(q), .. }) => q.windows[0].remaining,
                other => panic!("assigned: {other:?}"),
            })
            .collect();
        assert_eq!(remaining, [9, 8], "two requests charged");
        assert_eq!(counted(&redis, route).await, 2, "two requests counted");
    });
}

/// A call of many requests picks on a view of the pool, where ids whose counts became equal
/// through its own picks are compared by bytes, as Redis orders them: a capital letter before
/// every small one, and an id before any longer id it begins.
#[test]
fn many_picks_in_one_call_order_ties_by_bytes() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url());
    warm_up(&rt, &redis);
    // Every member but these four is left out of every request.
    let only = |ids: &[&str]| -> u16 {
        let mut mask = 0;
        for (i, m) in MEMBER_IDS.iter().enumerate() {
            if !ids.contains(m) {
                mask |= 1 << i;
            }
        }
        mask
    };
    let four = ["http://a", "http://a.tes", "http://B.test", "http://b.test"];
    let group = |n: usize, ids: &[&str]| Group {
        after_us: 1,
        requests: vec![
            Request {
                cost: 1,
                excluded: only(ids),
            };
            n
        ],
    };
    let trace = Trace {
        members: 10,
        windows: vec![Window {
            name: "w".into(),
            limit: 1_000,
            length_us: 4 * UNIT,
        }],
        // "http://a" and "http://B.test" count 1, then six picks together: the two at 0 first,
        // then all four at 1 by bytes, "http://B.test" (stored 1) before "http://a.tes" (stored
        // 0, counted once by this call), "http://a" before "http://a.tes".
        groups: vec![
            group(1, &["http://a"]),
            group(1, &["http://B.test"]),
            group(6, &four),
        ],
    };
    let calls = || script_calls(&server);
    rt.block_on(replay(&redis, None, "bytes", &trace, &calls))
        .unwrap_or_else(|e| panic!("{e}"));
    let picked = rt.block_on(redis.counts("bytes")).unwrap();
    let count = |id: &str| picked.iter().find(|(m, _)| m == id).map_or(0, |(_, c)| *c);
    assert_eq!(
        four.map(count),
        [2, 2, 2, 2],
        "each of the four picked: {picked:?}"
    );
}

/// A call that finds no pool (first use, Redis restarted empty) answers every request "sync
/// first", in rows of the call's width whatever the number of windows; each request syncs the
/// pool and is decided.
#[test]
fn every_request_of_a_call_that_finds_no_pool_is_synced_and_decided() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url());
    warm_up(&rt, &redis);
    let one = [Window {
        name: "w".into(),
        limit: 100,
        length_us: 4 * UNIT,
    }];
    let members: Vec<PoolMember> = MEMBER_IDS[..3]
        .iter()
        .map(|m| PoolMember::new(*m))
        .collect();
    for windows in [&[][..], &one[..]] {
        for n in [1, 2, 7] {
            let route = fresh_route();
            let group = Group {
                after_us: 0,
                requests: vec![
                    Request {
                        cost: 1,
                        excluded: 0
                    };
                    n
                ],
            };
            let answers = rt
                .block_on(decide(
                    &redis,
                    &route,
                    &members,
                    windows,
                    &group,
                    1_000_000_000,
                    true,
                ))
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(
                answers
                    .iter()
                    .all(|a| matches!(a, Assignment::Assigned { .. })),
                "{} windows, {n} requests: {answers:?}",
                windows.len()
            );
            let counted: u64 = rt
                .block_on(redis.counts(&route))
                .unwrap()
                .iter()
                .map(|(_, c)| c)
                .sum();
            assert_eq!(counted, n as u64);
        }
    }
}

/// A quota of two windows that 40 requests overrun: costs of 1 mostly, some reads (0), some of
/// 3 and one that can never fit.
fn plain_quota_trace() -> (Vec<Window>, Vec<u64>) {
    let windows = vec![
        Window {
            name: "short".into(),
            limit: 25,
            length_us: 4 * UNIT,
        },
        Window {
            name: "long".into(),
            limit: 30,
            length_us: 8 * UNIT,
        },
    ];
    let costs = (0..40u64)
        .map(|i| match i % 10 {
            3 => 0,
            7 => 3,
            _ if i == 11 => 1_000,
            _ => 1,
        })
        .collect();
    (windows, costs)
}

/// A request of `cost` against `route`'s quota alone.
fn plain_quota<'a>(route: &'a str, windows: &'a [Window], cost: u64, now: u64) -> Acquire<'a> {
    Acquire {
        route,
        key: "k",
        windows,
        cost,
        at_us: Some(now),
        client: None,
    }
}

/// A plain least-used request on `route`, leaving out `excluded`.
fn plain_least_used<'a>(
    route: &'a str,
    members: &'a [PoolMember],
    excluded: &'a [&'a str],
) -> Assign<'a> {
    Assign {
        route,
        members,
        order: Order::LeastUsed,
        excluded,
        quota: None,
        cost: 1,
        cooldowns: false,
        at_us: None,
        lease: None,
        sticky: None,
    }
}

/// Requests of `costs` against `route`'s quota alone: all at once, or one after another.
async fn acquire_all(
    store: &dyn StateStore,
    route: &str,
    windows: &[Window],
    costs: &[u64],
    now: u64,
    at_once: bool,
) -> Vec<Outcome> {
    let asks = costs
        .iter()
        .map(|&cost| store.acquire(plain_quota(route, windows, cost, now)));
    let results = all(asks.collect(), at_once).await;
    results.into_iter().map(|r| r.expect("decided")).collect()
}

/// Plain least-used requests on `route`, each leaving out its own members: all at once, or one
/// after another.
async fn least_used_all(
    store: &dyn StateStore,
    route: &str,
    members: &[PoolMember],
    excluded: &[Vec<&str>],
    at_once: bool,
) -> Vec<Assignment> {
    let asks = excluded
        .iter()
        .map(|excluded| store.assign(plain_least_used(route, members, excluded)));
    let results = all(asks.collect(), at_once).await;
    results.into_iter().map(|r| r.expect("decided")).collect()
}

/// One plain quota request and one plain least-used request, so that their scripts are loaded
/// (by EVALSHA each is loaded on its first call) before calls are counted.
fn warm_up_plain(rt: &tokio::runtime::Runtime, redis: &RedisStore) {
    let (windows, _) = plain_quota_trace();
    let (members, _) = pool(1);
    let route = "warm-up-plain";
    rt.block_on(acquire_all(redis, route, &windows, &[1], 1, false));
    rt.block_on(least_used_all(redis, route, &members, &[vec![]], false));
}

/// 40 requests of a route with a quota and no selection, arriving together, are decided as the
/// memory store decides them one after another (the limit admits exactly its units), in two
/// calls of at most MAX_BATCH requests when batching is on, and in one call each when off. Each
/// window's log holds exactly the units admitted; a call's admissions share its clock and so
/// their log entries (lua/quota.lua), so batched calls leave fewer entries than requests.
fn plain_quota_requests_share_calls(server: &RedisServer, url: String, batching: bool) {
    let rt = runtime();
    let redis = redis_store(url).with_batching(batching);
    warm_up_plain(&rt, &redis);
    let (windows, costs) = plain_quota_trace();
    let route = fresh_route();
    let now = 1_000_000_000;
    let before = script_calls(server);
    let batched = rt.block_on(acquire_all(&redis, &route, &windows, &costs, now, true));
    let made = script_calls(server) - before;
    let memory = MemoryStore::new();
    let expected = rt.block_on(acquire_all(&memory, &route, &windows, &costs, now, false));
    assert_eq!(batched, expected, "batching {batching}");
    let units: u64 = costs
        .iter()
        .zip(&batched)
        .filter(|(_, o)| o.admitted)
        .map(|(c, _)| c)
        .sum();
    assert_eq!(units, 25, "the short window's limit, exactly");
    assert_eq!(made, if batching { 2 } else { 40 }, "batching {batching}");
    let recorded = costs
        .iter()
        .zip(&batched)
        .filter(|(&c, o)| o.admitted && c > 0)
        .count() as i64;
    let keys = sluice_store::keys::Keys::new("sluice");
    for window in &windows {
        let log = keys.quota_log(&route, &window.name, "k");
        assert_eq!(
            server.log_held(&log),
            25,
            "{log}: every unit admitted, once"
        );
        let entries = server.integer(&["ZCARD", &log]).unwrap();
        if batching {
            assert!(
                entries < recorded,
                "{log}: {entries} entries, {recorded} requests"
            );
        } else {
            assert_eq!(entries, recorded, "{log}: a call's entry each");
        }
    }
}

#[test]
fn plain_quota_requests_that_wait_together_share_a_call() {
    let server = RedisServer::start();
    plain_quota_requests_share_calls(&server, server.url(), true);
    plain_quota_requests_share_calls(&server, server.url_without_functions(), true);
}

#[test]
fn plain_quota_requests_make_a_call_each_with_batching_off() {
    let server = RedisServer::start();
    plain_quota_requests_share_calls(&server, server.url(), false);
}

/// A quota of no window (not a config sluice accepts, but the store takes it) is answered with
/// no window's state, for a request alone in its call and for several in one: the scripts'
/// reply tables are made with room for a window, and that room must not reach the answer.
#[test]
fn a_quota_of_no_window_answers_with_none() {
    let server = RedisServer::start();
    let rt = runtime();
    let memory = MemoryStore::new();
    for batching in [true, false] {
        let redis = redis_store(server.url()).with_batching(batching);
        let route = fresh_route();
        for costs in [&[1u64][..], &[0], &[1, 2, 0, 1]] {
            let got = rt.block_on(acquire_all(&redis, &route, &[], costs, 1_000, true));
            let expected = rt.block_on(acquire_all(&memory, &route, &[], costs, 1_000, false));
            assert_eq!(got, expected, "costs {costs:?}, batching {batching}");
        }
    }
}

/// Plain least-used requests of one route arriving together (40 alike, then groups that pick
/// one by one and on a view of the pool, with members left out) are decided as the memory store
/// decides them one after another: after the 40, the members' counts differ by at most one. In
/// one call per MAX_BATCH requests when batching is on, one call each when off.
fn plain_least_used_requests_share_calls(server: &RedisServer, url: String, batching: bool) {
    let rt = runtime();
    let redis = redis_store(url).with_batching(batching);
    warm_up_plain(&rt, &redis);
    let memory = MemoryStore::new();
    let route = fresh_route();
    let (members, ids) = pool(3);
    rt.block_on(redis.sync(&route, &ids, &[])).unwrap();
    let groups: [Vec<Vec<&str>>; 3] = [
        vec![Vec::new(); 40],
        (0..4u16).map(|i| excluded_ids(i * 3 % 8)).collect(),
        (0..12u16).map(|i| excluded_ids(i * 3 % 8)).collect(),
    ];
    for (g, excluded) in groups.iter().enumerate() {
        let before = script_calls(server);
        let batched = rt.block_on(least_used_all(&redis, &route, &members, excluded, true));
        let made = script_calls(server) - before;
        let expected = rt.block_on(least_used_all(&memory, &route, &members, excluded, false));
        assert_eq!(batched, expected, "group {g}, batching {batching}");
        let calls = if batching {
            excluded.len().div_ceil(32)
        } else {
            excluded.len()
        };
        assert_eq!(made, calls as u64, "group {g}, batching {batching}");
        if g == 0 {
            let counts = rt.block_on(redis.counts(&route)).unwrap();
            let counts: Vec<u64> = counts.into_iter().map(|(_, c)| c).collect();
            assert_eq!(counts.iter().sum::<u64>(), 40, "{counts:?}");
            let (least, most) = (counts.iter().min(), counts.iter().max());
            assert!(most.unwrap() - least.unwrap() <= 1, "{counts:?}");
        }
    }
}

#[test]
fn plain_least_used_requests_that_wait_together_share_a_call() {
    let server = RedisServer::start();
    plain_least_used_requests_share_calls(&server, server.url(), true);
    plain_least_used_requests_share_calls(&server, server.url_without_functions(), true);
}

#[test]
fn plain_least_used_requests_make_a_call_each_with_batching_off() {
    let server = RedisServer::start();
    plain_least_used_requests_share_calls(&server, server.url(), false);
}

/// A plain quota or plain least-used request that gives up while it waits for its call is taken
/// out of the call before it leaves: neither charged nor counted.
#[test]
fn a_plain_request_that_gives_up_before_its_call_leaves_is_not_charged() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url());
    warm_up_plain(&rt, &redis);
    let windows = [Window {
        name: "w".into(),
        limit: 10,
        length_us: 4 * UNIT,
    }];
    let (members, ids) = pool(MEMBER_IDS.len());
    let route = "plain-gives-up";
    let quota = plain_quota(route, &windows, 1, 1_000_000_000);
    let assign = plain_least_used(route, &members, &[]);
    rt.block_on(async {
        redis.sync(route, &ids, &[]).await.unwrap();
        let before = script_calls(&server);
        let mut acquires: Vec<_> = (0..3).map(|_| redis.acquire(quota)).collect();
        let mut assigns: Vec<_> = (0..3).map(|_| redis.assign(assign)).collect();
        queue(&mut acquires).await;
        queue(&mut assigns).await;
        drop(acquires.remove(1));
        drop(assigns.remove(1));
        let remaining: Vec<u64> = together(acquires)
            .await
            .into_iter()
            .map(|o| o.unwrap().windows[0].remaining)
            .collect();
        assert_eq!(remaining, [9, 8], "two requests charged");
        let assigned = together(assigns).await;
        assert!(assigned
            .iter()
            .all(|a| matches!(a, Ok(Assignment::Assigned { .. }))));
        assert_eq!(script_calls(&server) - before, 2, "one call of each kind");
        assert_eq!(counted(&redis, route).await, 2, "two requests counted");
    });
}

/// Plain least-used requests whose call finds no pool (first use, Redis restarted empty) are
/// each told to sync it, in rows of two, and each is then decided.
#[test]
fn every_plain_least_used_request_of_a_call_that_finds_no_pool_is_decided() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url());
    warm_up_plain(&rt, &redis);
    let (members, _) = pool(3);
    for n in [1, 2, 7] {
        let route = fresh_route();
        let excluded = vec![Vec::new(); n];
        let answers = rt.block_on(least_used_all(&redis, &route, &members, &excluded, true));
        assert!(
            answers
                .iter()
                .all(|a| matches!(a, Assignment::Assigned { .. })),
            "{n} requests: {answers:?}"
        );
        assert_eq!(rt.block_on(counted(&redis, &route)), n as u64);
    }
}

/// With batching off, quota + least-used requests that arrive together make a call each, and are
/// decided as the memory store decides them one after another.
#[test]
fn fused_requests_make_a_call_each_with_batching_off() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url()).with_batching(false);
    warm_up(&rt, &redis);
    let route = fresh_route();
    let windows = vec![Window {
        name: "w".into(),
        limit: 3,
        length_us: 4 * UNIT,
    }];
    let group = Group {
        after_us: 0,
        requests: (0..5)
            .map(|i| Request {
                cost: 1,
                excluded: i,
            })
            .collect(),
    };
    let (members, ids) = pool(3);
    rt.block_on(redis.sync(&route, &ids, &[])).unwrap();
    let now = 1_000_000_000;
    let before = script_calls(&server);
    let batched = rt
        .block_on(decide(
            &redis, &route, &members, &windows, &group, now, true,
        ))
        .unwrap();
    assert_eq!(script_calls(&server) - before, 5, "a call each");
    let memory = MemoryStore::new();
    let expected = rt
        .block_on(decide(
            &memory, &route, &members, &windows, &group, now, false,
        ))
        .unwrap();
    assert_eq!(batched, expected);
}

/// A small deterministic generator (xorshift), so that the key-pool traces need no shrinking to
/// read: each seed is one trace.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A key pool of five members with windows of their own (small limits, so that they fill and
/// refuse; the second and third share theirs, as "=" in the call), with or without a route
/// quota.
fn key_pool(route_quota: bool) -> (Vec<PoolMember>, Vec<Window>) {
    let window = |limit: u64, n: u64| Window {
        name: format!("m{n}").into(),
        limit,
        length_us: n * UNIT,
    };
    let shared: Arc<[Window]> = Arc::new([window(3, 4)]);
    let members = MEMBER_IDS[..5]
        .iter()
        .enumerate()
        .map(|(i, id)| PoolMember {
            id: Arc::from(*id),
            windows: match i {
                1 | 2 => shared.clone(),
                4 => Arc::new([window(2, 2), window(4, 8)]),
                _ => Arc::new([window(2 + i as u64, 4)]),
            },
        })
        .collect();
    let quota = if route_quota {
        vec![window(9, 6)]
    } else {
        Vec::new()
    };
    (members, quota)
}

/// One key-pool request: least-used or a preference order of its own, members left out, a cost.
#[derive(Debug, Clone)]
struct PoolAsk {
    preference: Option<Vec<usize>>,
    excluded: Vec<&'static str>,
    cost: u64,
}

fn pool_asks(dice: &mut Dice, n: usize) -> Vec<PoolAsk> {
    (0..n)
        .map(|_| PoolAsk {
            preference: (dice.below(2) == 0).then(|| {
                let mut order: Vec<usize> = (0..5).collect();
                order.rotate_left(dice.below(5) as usize);
                order.truncate(1 + dice.below(5) as usize);
                order
            }),
            excluded: if dice.below(3) == 0 {
                excluded_ids(dice.below(32) as u16)
            } else {
                Vec::new()
            },
            cost: [1, 1, 1, 2, 5][dice.below(5) as usize],
        })
        .collect()
}

/// `asks` on `store`'s `route` (cooldowns on), all at once or one after another.
async fn pool_decide(
    store: &dyn StateStore,
    route: &str,
    members: &[PoolMember],
    quota: &[Window],
    asks: &[PoolAsk],
    now: u64,
    at_once: bool,
) -> Vec<Assignment> {
    let futures = asks.iter().map(|a| {
        store.assign(Assign {
            route,
            members,
            order: match &a.preference {
                Some(order) => Order::Preference(order),
                None => Order::LeastUsed,
            },
            excluded: &a.excluded,
            quota: (!quota.is_empty()).then_some(Acquire {
                route,
                key: "k",
                windows: quota,
                cost: a.cost,
                at_us: Some(now),
                client: None,
            }),
            cost: a.cost,
            cooldowns: true,
            at_us: Some(now),
            lease: None,
            sticky: None,
        })
    });
    let results = all(futures.collect(), at_once).await;
    results.into_iter().map(|r| r.expect("decided")).collect()
}

/// Key-pool requests (member windows, cooldowns, preference orders: the general assignment
/// script) of one route arriving together are decided as the memory store decides them one
/// after another, over traces of groups with members cooled between them; a group of up to
/// MAX_BATCH requests is one call with batching on, and each request a call of its own when off.
fn key_pool_requests_share_calls(server: &RedisServer, url: String, batching: bool) {
    let redis = redis_store(url).with_batching(batching);
    key_pool_calls(&runtime(), redis, &|| script_calls(server), batching);
}

fn key_pool_calls(
    rt: &tokio::runtime::Runtime,
    redis: RedisStore,
    script_calls: &dyn Fn() -> u64,
    batching: bool,
) {
    for route_quota in [false, true] {
        let (members, quota) = key_pool(route_quota);
        let ids: Vec<Arc<str>> = members.iter().map(|m| m.id.clone()).collect();
        for seed in 1..=6u64 {
            let route = fresh_route();
            let memory = MemoryStore::new();
            rt.block_on(redis.sync(&route, &ids, &[])).unwrap();
            // Loads the script (a first call that finds it missing counts twice).
            let warm = format!("{route}-warm");
            rt.block_on(redis.sync(&warm, &ids, &[])).unwrap();
            let one = pool_asks(&mut Dice(seed), 1);
            rt.block_on(pool_decide(&redis, &warm, &members, &quota, &one, 1, false));
            let mut dice = Dice(seed * 7919);
            let mut now = 1_000_000_000u64;
            let mut answered = 0;
            for g in 0..10 {
                now += [0, UNIT / 3, UNIT, 3 * UNIT][dice.below(4) as usize];
                if dice.below(4) == 0 {
                    let member = MEMBER_IDS[dice.below(5) as usize];
                    let for_us = (1 + dice.below(6)) * UNIT / 2;
                    for store in [&redis as &dyn StateStore, &memory] {
                        rt.block_on(store.cool(&route, member, for_us, Some(now)))
                            .unwrap();
                    }
                }
                let n = if g == 9 {
                    40
                } else {
                    1 + dice.below(12) as usize
                };
                let asks = pool_asks(&mut dice, n);
                let before = script_calls();
                let batched = rt.block_on(pool_decide(
                    &redis, &route, &members, &quota, &asks, now, true,
                ));
                let made = script_calls() - before;
                let expected = rt.block_on(pool_decide(
                    &memory, &route, &members, &quota, &asks, now, false,
                ));
                assert_eq!(
                    batched, expected,
                    "seed {seed}, group {g}, route quota {route_quota}, batching {batching}: {asks:?}"
                );
                let calls = if batching { n.div_ceil(32) } else { n };
                assert_eq!(made, calls as u64, "seed {seed}, group {g}, {n} requests");
                answered += batched
                    .iter()
                    .filter(|a| matches!(a, Assignment::Assigned { .. }))
                    .count();
            }
            assert!(answered > 0, "seed {seed}: some requests were assigned");
            let mut counts = rt.block_on(redis.counts(&route)).unwrap();
            let mut expected = rt.block_on(memory.counts(&route)).unwrap();
            counts.sort();
            expected.sort();
            assert_eq!(counts, expected, "seed {seed}: the pools' counts");
        }
    }
}

#[test]
fn key_pool_requests_that_wait_together_share_a_call() {
    let server = RedisServer::start();
    key_pool_requests_share_calls(&server, server.url(), true);
}

/// The same by `EVALSHA`, where the script's `KEYS` and `ARGV` are replaced per request.
#[test]
fn key_pool_requests_that_wait_together_share_a_call_by_evalsha() {
    let server = RedisServer::start();
    key_pool_requests_share_calls(&server, server.url_without_functions(), true);
}

/// On a Redis Cluster: every key of such a call is in its route's slot.
#[test]
fn key_pool_requests_that_wait_together_share_a_call_on_a_cluster() {
    let cluster = RedisCluster::start();
    let rt = runtime();
    let redis = rt.block_on(async {
        RedisStore::with_connection(
            Arc::new(RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap()),
            "sluice",
        )
    });
    let calls = || {
        cluster
            .nodes()
            .iter()
            .map(|n| n.command_calls("fcall") + n.command_calls("evalsha"))
            .sum::<u64>()
    };
    key_pool_calls(&rt, redis, &calls, true);
}

#[test]
fn key_pool_requests_make_a_call_each_with_batching_off() {
    let server = RedisServer::start();
    key_pool_requests_share_calls(&server, server.url(), false);
}

/// A key-pool request that gives up while it waits for its call is taken out of the call before
/// it leaves: neither its member's window nor the route's quota is charged.
#[test]
fn a_key_pool_request_that_gives_up_before_its_call_leaves_is_not_charged() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url());
    let (members, quota) = key_pool(true);
    let ids: Vec<Arc<str>> = members.iter().map(|m| m.id.clone()).collect();
    let route = "pool-gives-up";
    let asks = vec![
        PoolAsk {
            preference: Some(vec![3]),
            excluded: Vec::new(),
            cost: 2,
        };
        3
    ];
    rt.block_on(async {
        redis.sync(route, &ids, &[]).await.unwrap();
        pool_decide(
            &redis,
            "pool-warm-up",
            &members,
            &quota,
            &asks[..1],
            1,
            false,
        )
        .await;
        let before = script_calls(&server);
        let mut futures: Vec<_> = asks
            .iter()
            .map(|a| {
                Box::pin(pool_decide(
                    &redis,
                    route,
                    &members,
                    &quota,
                    std::slice::from_ref(a),
                    1_000_000_000,
                    false,
                ))
            })
            .collect();
        queue(&mut futures).await;
        drop(futures.remove(1));
        let answers: Vec<Assignment> = together(futures).await.into_iter().flatten().collect();
        assert_eq!(script_calls(&server) - before, 1, "one call for both");
        let remaining: Vec<u64> = answers
            .iter()
            .map(|a| match a {
                Assignment::Assigned { quota: Some(q), .. } => q.windows[0].remaining,
                other => panic!("assigned: {other:?}"),
            })
            .collect();
        // The member's window (limit 5) admitted both: it was charged 4, not 6.
        assert_eq!(remaining, [7, 5], "two requests charged to the route");
    });
}

/// Under load (the store's default until the gateway says otherwise: crates/store/src/load.rs)
/// a key-pool lane keeps one call out, as every lane does: while Redis holds the first (paused
/// for writes), the requests that come wait, to share the next call. Each is still decided as
/// the memory store decides them one after another. (Below saturation a lane may have a second
/// call out: tests/load.rs, a binary of its own, since the switch holds for the process.)
#[test]
fn under_load_a_key_pool_lane_keeps_one_call_out() {
    let server = RedisServer::start();
    let rt = runtime();
    let redis = redis_store(server.url());
    let (members, quota) = key_pool(false);
    let ids: Vec<Arc<str>> = members.iter().map(|m| m.id.clone()).collect();
    let route = "one-out";
    let asks = pool_asks(&mut Dice(5), 4);
    let now = 1_000_000_000;
    let answers = rt.block_on(async {
        redis.sync(route, &ids, &[]).await.unwrap();
        pool_decide(
            &redis,
            "one-out-warm-up",
            &members,
            &quota,
            &asks[..1],
            1,
            false,
        )
        .await;
        let before = script_calls(&server);
        server
            .command(&["CLIENT", "PAUSE", "30000", "WRITE"])
            .unwrap();
        let mut futures: Vec<_> = asks
            .iter()
            .map(|a| {
                Box::pin(pool_decide(
                    &redis,
                    route,
                    &members,
                    &quota,
                    std::slice::from_ref(a),
                    now,
                    false,
                ))
            })
            .collect();
        // The first request's task takes it into a call, which Redis holds; the other three
        // wait in the lane.
        for at in [0..1, 1..4] {
            queue(&mut futures[at]).await;
            for _ in 0..8 {
                tokio::task::yield_now().await;
            }
        }
        server.command(&["CLIENT", "UNPAUSE"]).unwrap();
        let answers: Vec<Assignment> = together(futures).await.into_iter().flatten().collect();
        assert_eq!(script_calls(&server) - before, 2, "alone, then together");
        answers
    });
    let memory = MemoryStore::new();
    let expected = rt.block_on(pool_decide(
        &memory, route, &members, &quota, &asks, now, false,
    ));
    assert_eq!(answers, expected);
}
