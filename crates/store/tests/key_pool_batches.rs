//! A call of the assign script that decides several key-pool requests (lua/assign_run.lua's
//! batched path) reads what its requests share once and writes it once: each member's windows,
//! the route quota, the cooldowns, a small pool's counts. It must decide every request exactly
//! as the script's call of one request does, one after another: the same member, the same
//! refusal, the same wait, and leave Redis holding the same. These tests run the same random
//! traces through two stores on one Redis, one making a call per request (batching off) and one
//! sending each group of requests together (batching on), and compare every answer and, at the
//! end, every key the two left.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use sluice_allocator::{Assign, Assignment, Order, PoolMember, StateStore};
use sluice_limiter::{Acquire, Window};
use sluice_store::{RedisStore, RedisStoreConfig};
use sluice_testkit::RedisServer;

/// Ids whose byte order is not their config order, with prefixes of one another and a capital
/// letter (which sorts before every small one in bytes).
const MEMBER_IDS: [&str; 5] = ["key-b", "key-a", "key-B", "key-a2", "key"];

/// Names as a member's default name (its URL) makes them: long shared prefixes. The script
/// compares ids eight bytes at a time where counts it raised become equal (pool_id_less): the
/// first two first differ at byte 16 (the last of the second group of eight), the next two at
/// byte 40 (the last of the fifth), where the shorter has a byte above 127 (a name is any UTF-8
/// text) and so comes after (their lengths order them the wrong way), and the last is a prefix
/// of both and differs from the first two at byte 9.
const LONG_IDS: [&str; 5] = [
    "https://eu-west2.api.provider.example/v1",
    "https://eu-west1.api.provider.example/v1",
    "https://api.provider.example/v1/keys/k-e-2",
    "https://api.provider.example/v1/keys/k-\u{e9}",
    "https://api.provider.example/v1/keys",
];

/// A pool larger than the script holds in a view (ASSIGN_VIEW_MAX in lua/assign_run.lua), which
/// it reads again for each request as a call of one request does: MEMBER_IDS, then members
/// enough to pass it.
fn large_pool_ids() -> Vec<String> {
    MEMBER_IDS
        .iter()
        .map(|id| id.to_string())
        .chain((0..31).map(|i| format!("key-{i:02}")))
        .collect()
}

/// The trace's clock unit. Redis expires idle keys in real time while the traces run on their
/// own clock: windows of ten seconds and up outlive a case.
const UNIT: u64 = 10_000_000;

#[derive(Debug, Clone)]
struct Request {
    /// A preference order (its first member and length, in the pool's config order), or
    /// least-used.
    preference: Option<(usize, usize)>,
    /// Which members this request leaves out (bit i: member i).
    excluded: u8,
    cost: u64,
}

#[derive(Debug, Clone)]
struct Group {
    /// Quarter units since the previous group; a group's requests share one clock.
    after: u64,
    /// A member cooled before the group, for so many quarter units.
    cool: Option<(usize, u64)>,
    requests: Vec<Request>,
}

#[derive(Debug, Clone)]
struct Trace {
    /// The route quota's limit, if it has one.
    route_limit: Option<u64>,
    /// Whether the route has cooldowns (the script reads them).
    cooldowns: bool,
    groups: Vec<Group>,
}

fn request() -> impl Strategy<Value = Request> {
    (
        prop_oneof![3 => Just(None), 1 => (0usize..5, 1usize..=5).prop_map(Some)],
        prop_oneof![3 => Just(0u8), 1 => 0u8..32],
        prop_oneof![3 => Just(1u64), 1 => 1u64..=4],
    )
        .prop_map(|(preference, excluded, cost)| Request {
            preference,
            excluded,
            cost,
        })
}

/// Groups of up to 40 requests (so more than one call's worth), most of them alike runs of one
/// request (as a lane's requests usually are, sent as "=" after the first), with members cooled
/// between groups, long enough or not to outlast the next ones.
fn trace() -> impl Strategy<Value = Trace> {
    let group = (
        0u64..=8,
        prop::option::weighted(0.4, (0usize..5, 1u64..=8)),
        prop::collection::vec((request(), 1usize..=8), 1..=6),
    )
        .prop_map(|(after, cool, runs)| Group {
            after,
            cool,
            requests: runs
                .into_iter()
                .flat_map(|(r, n)| std::iter::repeat_n(r, n))
                .take(40)
                .collect(),
        });
    (
        prop::option::of(4u64..=30),
        prop::bool::weighted(0.8),
        prop::collection::vec(group, 1..=8),
    )
        .prop_map(|(route_limit, cooldowns, groups)| Trace {
            route_limit,
            cooldowns,
            groups,
        })
}

/// Five members with small windows of their own (the second and third share theirs, as "=" in
/// the call; the fifth has two), so that groups fill them; members after the fifth share the
/// second's.
fn members(ids: &[String]) -> Vec<PoolMember> {
    let window = |name: &str, limit: u64, units: u64| Window {
        name: name.into(),
        limit,
        length_us: units * UNIT,
    };
    let shared: Arc<[Window]> = Arc::new([window("m", 4, 4)]);
    ids.iter()
        .enumerate()
        .map(|(i, id)| PoolMember {
            id: Arc::from(id.as_str()),
            windows: match i {
                1 | 2 | 5.. => shared.clone(),
                4 => Arc::new([window("s", 2, 2), window("m", 5, 8)]),
                _ => Arc::new([window("m", 3 + i as u64, 4)]),
            },
        })
        .collect()
}

/// Polls every future in order, each first poll before any second: the requests of a group all
/// queue before any call leaves.
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

fn excluded_ids(ids: &[String], mask: u8) -> Vec<&str> {
    (0..5)
        .filter(|i| mask & (1 << i) != 0)
        .map(|i| ids[i].as_str())
        .collect()
}

/// A route of the trace: its pool (the trace's members are its first five), its quota and
/// whether it has cooldowns.
struct Route<'a> {
    name: &'a str,
    ids: &'a [String],
    members: &'a [PoolMember],
    quota: &'a [Window],
    cooldowns: bool,
}

/// A group's requests on `store`: all at once, or one after another.
async fn decide(
    store: &RedisStore,
    route: &Route<'_>,
    requests: &[Request],
    now: u64,
    at_once: bool,
) -> Vec<Assignment> {
    let Route {
        name: route,
        ids,
        members,
        quota,
        cooldowns,
    } = *route;
    let orders: Vec<Option<Vec<usize>>> = requests
        .iter()
        .map(|r| {
            r.preference
                .map(|(first, len)| (0..len).map(|i| (first + i) % 5).collect())
        })
        .collect();
    let excluded: Vec<Vec<&str>> = requests
        .iter()
        .map(|r| excluded_ids(ids, r.excluded))
        .collect();
    let asks = requests.iter().enumerate().map(|(i, r)| {
        store.assign(Assign {
            route,
            members,
            order: match &orders[i] {
                Some(order) => Order::Preference(order),
                None => Order::LeastUsed,
            },
            excluded: &excluded[i],
            quota: (!quota.is_empty()).then_some(Acquire {
                route,
                key: "k",
                windows: quota,
                cost: r.cost,
                at_us: Some(now),
                client: None,
            }),
            cost: r.cost,
            cooldowns,
            at_us: Some(now),
            lease: None,
            sticky: None,
        })
    });
    let answers = if at_once {
        together(asks.collect()).await
    } else {
        let mut answers = Vec::new();
        for ask in asks {
            answers.push(ask.await);
        }
        answers
    };
    answers.into_iter().map(|a| a.expect("decided")).collect()
}

/// Every key under `prefix`, by its name after the prefix: its type and content, and whether it
/// expires. A helper hash's `x:` fields are left out: they hold when its logs were last made to
/// live, on Redis's own clock, which runs on between the two stores' calls. A quota log is read
/// as what it counts: the cost it holds at each time. The requests one call records share its
/// clock and so one entry (lua/quota.lua), where calls of one request each leave an entry of
/// their own at the same time: the names differ, what each window holds and when it leaves may
/// not.
fn keys_of(conn: &mut redis::Connection, prefix: &str) -> BTreeMap<String, String> {
    let names: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query(conn)
        .unwrap();
    let mut out = BTreeMap::new();
    for name in names {
        let kind: String = redis::cmd("TYPE").arg(&name).query(conn).unwrap();
        let content = match kind.as_str() {
            "hash" => {
                let fields: BTreeMap<String, String> =
                    redis::cmd("HGETALL").arg(&name).query(conn).unwrap();
                fields
                    .into_iter()
                    .filter(|(f, _)| !f.starts_with("x:"))
                    .map(|(f, v)| format!("{f}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            }
            "zset" => {
                let entries: Vec<(String, String)> = redis::cmd("ZRANGE")
                    .arg(&name)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(conn)
                    .unwrap();
                let short = &name[prefix.len()..];
                if short.contains(":q:") || short.contains(":mq:") {
                    log_content(entries)
                } else {
                    entries
                        .into_iter()
                        .map(|(m, s)| format!("{m}@{s}"))
                        .collect::<Vec<_>>()
                        .join(",")
                }
            }
            other => panic!("{name}: a key of type {other}"),
        };
        let ttl: i64 = redis::cmd("PTTL").arg(&name).query(conn).unwrap();
        let expires = if ttl > 0 { "expires" } else { "lives" };
        let short = name[prefix.len()..].to_string();
        out.insert(short, format!("{kind} {expires} {content}"));
    }
    out
}

/// A quota log's entries (`<seq>:<cost>`, scored by time) as the cost it holds at each time.
fn log_content(entries: Vec<(String, String)>) -> String {
    let mut at: BTreeMap<u64, u64> = BTreeMap::new();
    for (member, score) in entries {
        let (_, cost) = member
            .split_once(':')
            .unwrap_or_else(|| panic!("a log entry {member:?}"));
        *at.entry(score.parse().expect("a score in µs")).or_default() +=
            cost.parse::<u64>().expect("a cost");
    }
    at.into_iter()
        .map(|(score, cost)| format!("{cost}@{score}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn store(url: &str, prefix: &str, batching: bool) -> RedisStore {
    RedisStore::new(RedisStoreConfig {
        url: url.to_string(),
        key_prefix: prefix.into(),
        timeout: Duration::from_secs(5),
    })
    .unwrap()
    .with_batching(batching)
}

fn fresh_route() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("kp{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Runs `trace` through a store with a call per request and one whose groups share calls, and
/// compares their answers and what they left in Redis.
fn compare(
    rt: &tokio::runtime::Runtime,
    server: &RedisServer,
    url: &str,
    ids: &[String],
    trace: &Trace,
) -> Result<(), TestCaseError> {
    let members = members(ids);
    let synced: Vec<Arc<str>> = members.iter().map(|m| m.id.clone()).collect();
    let quota: Vec<Window> = trace
        .route_limit
        .map(|limit| Window {
            name: "r".into(),
            limit,
            length_us: 6 * UNIT,
        })
        .into_iter()
        .collect();
    let route = fresh_route();
    let alone = store(url, "alone", false);
    let batched = store(url, "batched", true);
    let mut now = 1_000_000_000_000u64;
    for store in [&alone, &batched] {
        rt.block_on(store.sync(&route, &synced, &[])).unwrap();
        // Loads the script (a first call that finds it missing counts twice).
        let warm = format!("{route}-warm");
        rt.block_on(store.sync(&warm, &synced, &[])).unwrap();
        let one = [Request {
            preference: None,
            excluded: 0,
            cost: 1,
        }];
        let warm = Route {
            name: &warm,
            ids,
            members: &members,
            quota: &quota,
            cooldowns: true,
        };
        rt.block_on(decide(store, &warm, &one, now, false));
    }
    let on = Route {
        name: &route,
        ids,
        members: &members,
        quota: &quota,
        cooldowns: trace.cooldowns,
    };
    for (g, group) in trace.groups.iter().enumerate() {
        now += group.after * UNIT / 4;
        if let Some((member, quarters)) = group.cool {
            for store in [&alone, &batched] {
                rt.block_on(store.cool(&route, &ids[member], quarters * UNIT / 4, Some(now)))
                    .unwrap();
            }
        }
        let one_by_one = rt.block_on(decide(&alone, &on, &group.requests, now, false));
        let middle = server.command_calls("fcall") + server.command_calls("evalsha");
        let together = rt.block_on(decide(&batched, &on, &group.requests, now, true));
        let after = server.command_calls("fcall") + server.command_calls("evalsha");
        // Together, a call per MAX_BATCH requests (a call each would fail this whenever a
        // group has two requests that reach the script).
        // A least-used request that leaves out every member with windows, on a route without
        // cooldowns, is a plain least-used one (the allocator script's lane, its own count).
        let general = trace.cooldowns
            || group
                .requests
                .iter()
                .all(|r| r.preference.is_some() || r.excluded != 31);
        prop_assert!(
            !general || after - middle <= group.requests.len().div_ceil(32) as u64,
            "group {}: {} requests took {} calls",
            g,
            group.requests.len(),
            after - middle
        );
        prop_assert_eq!(&together, &one_by_one, "group {}", g);
    }
    let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    let left_alone = keys_of(&mut conn, &format!("alone:{{{route}}}"));
    let left_batched = keys_of(&mut conn, &format!("batched:{{{route}}}"));
    prop_assert!(left_alone.contains_key(":pool"), "{:?}", left_alone);
    prop_assert_eq!(left_batched, left_alone, "what the calls left in Redis");
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn run(url: impl Fn(&RedisServer) -> String, ids: &[&str], cases: u32) {
    let ids: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
    let server = RedisServer::start();
    let url = url(&server);
    let rt = runtime();
    // The same traces on every run, so that a failure in CI replays on a developer's machine:
    // the workspace's `PROPTEST_RNG_SEED` (.cargo/config.toml), or this seed if the test runs
    // without it. A failing case's seed is also kept in
    // key_pool_batches.proptest-regressions beside this file, and run first from then on.
    let config = Config::default();
    let rng_seed = match config.rng_seed {
        RngSeed::Random => RngSeed::Fixed(0x6b65_795f_706f_6f6c),
        chosen => chosen,
    };
    let mut runner = TestRunner::new(Config {
        cases,
        rng_seed,
        source_file: Some(file!()),
        ..config
    });
    if let Err(e) = runner.run(&trace(), |t| compare(&rt, &server, &url, &ids, &t)) {
        panic!("{e}");
    }
}

#[test]
fn batched_key_pool_calls_decide_and_leave_what_calls_of_one_request_do() {
    run(RedisServer::url, &MEMBER_IDS, 128);
}

/// The same by `EVALSHA` (Redis without functions), where the script is run whole per call.
#[test]
fn batched_key_pool_calls_decide_and_leave_what_calls_of_one_request_do_by_evalsha() {
    run(RedisServer::url_without_functions, &MEMBER_IDS, 32);
}

/// The same on ids that share long prefixes, which the script orders itself where its picks
/// made counts equal.
#[test]
fn batched_key_pool_calls_order_long_shared_prefix_ids_as_redis_does() {
    run(RedisServer::url, &LONG_IDS, 48);
}

/// The same on a pool larger than a view, which the batched call reads again for each request,
/// as a call of one request does.
#[test]
fn batched_key_pool_calls_on_a_pool_larger_than_a_view_decide_as_calls_of_one_request_do() {
    let ids = large_pool_ids();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    run(RedisServer::url, &ids, 24);
}

/// Least-used key-pool requests of one shape share one written call, and a batch sends all but
/// the first as `=` on seeing it (crates/store/src/redis/written.rs). Each must still be decided
/// on its own; and a request of another shape (the same members reloaded with another limit,
/// another cost) must not be decided by the call written for the first.
#[test]
fn key_pool_requests_sharing_a_written_call_are_each_decided_and_another_shape_gets_its_own() {
    let server = RedisServer::start();
    let rt = runtime();
    let store = store(&server.url(), "written", true);
    let route = fresh_route();
    // Two members, each with a window far longer than the test, of `limit`: fresh `Arc`s each
    // time, as a reload makes them.
    let pool = |limit: u64| -> Vec<PoolMember> {
        ["a", "b"]
            .iter()
            .map(|id| PoolMember {
                id: (*id).into(),
                windows: Arc::new([Window {
                    name: "m".into(),
                    limit,
                    length_us: 100 * UNIT,
                }]),
            })
            .collect()
    };
    // (assigned, busy) of `n` alike requests at once.
    let decide = |members: &[PoolMember], cost: u64, n: usize| {
        let answers = rt.block_on(together(
            (0..n)
                .map(|_| {
                    store.assign(Assign {
                        route: &route,
                        members,
                        order: Order::LeastUsed,
                        excluded: &[],
                        quota: None,
                        cost,
                        cooldowns: true,
                        at_us: None,
                        lease: None,
                        sticky: None,
                    })
                })
                .collect(),
        ));
        let mut counts = (0, 0);
        for answer in answers {
            match answer.expect("decided") {
                Assignment::Assigned { .. } => counts.0 += 1,
                Assignment::Busy { .. } => counts.1 += 1,
                other => panic!("{other:?}"),
            }
        }
        counts
    };
    let three = pool(3);
    // Ten at once on one call's shape: three fit each member.
    assert_eq!(decide(&three, 1, 10), (6, 4));
    // The members reloaded with a limit of 6: each has 3 left, so four more fit. A call written
    // for the limit of 3 would refuse them all.
    let six = pool(6);
    let before = server.command_calls("fcall");
    assert_eq!(decide(&six, 1, 4), (4, 0));
    // They went together: all four queue before the lane's task first runs, so one call.
    assert_eq!(server.command_calls("fcall") - before, 1);
    // One unit is left on each: a cost of 2 fits neither (a call written for a cost of 1 would
    // assign two), and a cost of 1 fits both.
    assert_eq!(decide(&six, 2, 2), (0, 2));
    // Redis loses the library: a lone request's shared call, sent as written, is refused, the
    // library loaded again, and the same call sent once more (two FCALLs counted, one of them
    // refused before it ran: the request is decided once).
    assert!(server
        .command(&["FUNCTION", "FLUSH"])
        .unwrap()
        .starts_with("+OK"));
    let before = server.command_calls("fcall");
    assert_eq!(decide(&six, 1, 1), (1, 0));
    assert_eq!(server.command_calls("fcall"), before + 2);
    assert_eq!(decide(&six, 1, 2), (1, 1));
}
