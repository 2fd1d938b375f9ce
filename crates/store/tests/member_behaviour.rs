//! SPEC §8 in the store: members' own quota windows, cooldowns and preference orders, decided
//! with the route's quota in one atomic step. One behavioural suite, run against
//! [`MemoryStore`], [`RedisStore`] (a real `redis-server`) and a Redis Cluster; traces pass
//! their clock (`at_us`) so that every wait is checked to the microsecond.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_allocator::{Assign, Assignment, Lease, MemoryStore, Order, PoolMember, StateStore};
use sluice_limiter::{Acquire, Outcome, Window};
use sluice_store::{RedisConnection, RedisStore};
use sluice_testkit::{RedisCluster, RedisServer};

const SEC: u64 = 1_000_000;
/// Trace time zero: far from 0, so that no window's horizon is negative.
const T0: u64 = 1_000 * SEC;
/// The unit of windows and cooldowns in traces. Redis expires idle keys on its own clock
/// (`PEXPIRE` of a log's window, of the cooldowns' longest), so a trace's windows and
/// cooldowns must outlast the test in real time, or a key could vanish mid-trace.
const W: u64 = 60 * SEC;

fn window(name: &str, limit: u64, length_us: u64) -> Window {
    Window {
        name: name.into(),
        limit,
        length_us,
    }
}

fn member(id: &str, windows: &[Window]) -> PoolMember {
    PoolMember {
        id: id.into(),
        windows: windows.to_vec().into(),
    }
}

fn route_quota<'a>(route: &'a str, windows: &'a [Window], at_us: u64) -> Acquire<'a> {
    Acquire {
        route,
        key: "route",
        windows,
        cost: 1,
        at_us: Some(at_us),
        client: None,
    }
}

/// An assignment at trace time `at_us` with cooldowns on, nothing excluded and no route quota.
fn ask<'a>(route: &'a str, members: &'a [PoolMember], order: Order<'a>, at_us: u64) -> Assign<'a> {
    Assign {
        route,
        members,
        order,
        excluded: &[],
        quota: None,
        cost: 1,
        cooldowns: true,
        at_us: Some(at_us),
        lease: None,
        sticky: None,
    }
}

async fn assigned(store: &dyn StateStore, ask: Assign<'_>) -> String {
    match store.assign(ask).await.unwrap() {
        Assignment::Assigned { member, .. } => member,
        other => panic!("expected an assignment at {:?}: {other:?}", ask.at_us),
    }
}

/// The wait and route quota of a `Busy` answer.
async fn busy(store: &dyn StateStore, ask: Assign<'_>) -> (u64, Option<Outcome>) {
    match store.assign(ask).await.unwrap() {
        Assignment::Busy {
            retry_after_us,
            quota,
        } => (retry_after_us, quota),
        other => panic!("expected busy at {:?}: {other:?}", ask.at_us),
    }
}

async fn counts(store: &dyn StateStore, route: &str) -> HashMap<String, u64> {
    store.counts(route).await.unwrap().into_iter().collect()
}

fn count_map(pairs: &[(&str, u64)]) -> HashMap<String, u64> {
    pairs.iter().map(|(m, c)| (m.to_string(), *c)).collect()
}

/// least_used walks the pool in its order and skips members whose windows are full; when all
/// are, the answer is the exact wait until the first of them admits, and nothing is recorded.
async fn least_used_skips_full_members(store: &dyn StateStore) {
    let route = "lu-mq";
    let members = [
        member("b", &[window("rpm", 1, W)]),
        member("a", &[window("rpm", 2, W)]),
        member("c", &[window("rpm", 1, 2 * W)]),
    ];
    let rq = [window("r", 100, 10 * W)];
    let at = |t: u64| Assign {
        quota: Some(route_quota(route, &rq, T0 + t)),
        ..ask(route, &members, Order::LeastUsed, T0 + t)
    };
    assert_eq!(assigned(store, at(0)).await, "a");
    assert_eq!(assigned(store, at(10)).await, "b");
    assert_eq!(assigned(store, at(20)).await, "c");
    // All at 1: a (ties go to the smallest id) has room for one more.
    assert_eq!(assigned(store, at(30)).await, "a");
    // b and c (count 1) are full, a (count 2) too. a's first entry leaves soonest.
    let (wait, quota) = busy(store, at(40)).await;
    assert_eq!(wait, W - 40, "a's entry at 0 leaves at W");
    let quota = quota.expect("the route quota's state");
    assert!(quota.admitted);
    assert_eq!(
        quota.windows[0].remaining, 96,
        "Busy charges no route quota"
    );
    assert_eq!(
        counts(store, route).await,
        count_map(&[("a", 2), ("b", 1), ("c", 1)])
    );
    // Without a, b's entry (at 10) is the first to leave.
    let no_a = ["a"];
    let (wait, _) = busy(
        store,
        Assign {
            excluded: &no_a,
            ..at(41)
        },
    )
    .await;
    assert_eq!(wait, W + 10 - 41);
    // Nothing eligible at all is not busy: no member.
    let all = ["a", "b", "c"];
    match store
        .assign(Assign {
            excluded: &all,
            ..at(42)
        })
        .await
        .unwrap()
    {
        Assignment::NoMember { quota: Some(q) } => assert_eq!(q.windows[0].remaining, 96),
        other => panic!("{other:?}"),
    }
    assert_eq!(busy(store, at(W - 1)).await.0, 1);
    // Exactly then, a admits again (b, first in the pool's order, still refuses).
    assert_eq!(assigned(store, at(W)).await, "a");
    assert_eq!(
        counts(store, route).await,
        count_map(&[("a", 3), ("b", 1), ("c", 1)])
    );

    // A route quota that refuses records nothing in the members' windows.
    let route = "lu-mq-refused";
    let one = [window("r", 1, 10 * W)];
    let members = [member("x", &[window("rpm", 2, 100 * W)])];
    let at = |t: u64| Assign {
        quota: Some(route_quota(route, &one, T0 + t)),
        ..ask(route, &members, Order::LeastUsed, T0 + t)
    };
    assert_eq!(assigned(store, at(0)).await, "x");
    match store.assign(at(W)).await.unwrap() {
        Assignment::QuotaRefused(o) => assert_eq!(o.retry_after_us, 9 * W),
        other => panic!("{other:?}"),
    }
    // At 10 W the route has room, and x its second unit: the refusal charged x nothing.
    assert_eq!(assigned(store, at(10 * W)).await, "x");
    assert_eq!(counts(store, route).await, count_map(&[("x", 2)]));
}

/// A preference order (round_robin's, priority's) skips full and cooling members; a cooling
/// member with full windows admits once both allow.
async fn preference_with_windows_and_cooldowns(store: &dyn StateStore) {
    let route = "pref";
    let members = [
        member("x", &[window("rpm", 1, 10 * W)]),
        member("y", &[]),
        member("z", &[window("rpm", 1, 10 * W)]),
    ];
    let order = [0, 2, 1];
    let rq = [window("r", 100, 100 * W)];
    let at = |t: u64| Assign {
        quota: Some(route_quota(route, &rq, T0 + t)),
        ..ask(route, &members, Order::Preference(&order), T0 + t)
    };
    assert_eq!(assigned(store, at(0)).await, "x");
    assert_eq!(assigned(store, at(1)).await, "z");
    assert_eq!(assigned(store, at(2)).await, "y");
    assert_eq!(assigned(store, at(3)).await, "y", "y has no windows");
    assert_eq!(store.cool(route, "y", W, Some(T0 + 3)).await.unwrap(), W);
    let (wait, quota) = busy(store, at(4)).await;
    assert_eq!(
        wait,
        W - 1,
        "y's cooldown ends before x's or z's windows free up"
    );
    assert_eq!(quota.unwrap().windows[0].remaining, 96);
    // A route without `cooldown` ignores them.
    assert_eq!(
        assigned(
            store,
            Assign {
                cooldowns: false,
                ..at(4)
            }
        )
        .await,
        "y"
    );
    assert_eq!(
        assigned(store, at(W + 3)).await,
        "y",
        "cooled until W + 3, exclusive"
    );

    // Cooling and full windows together: the later of the two counts.
    let s = 2 * W;
    assert_eq!(
        store
            .cool(route, "x", 20 * W, Some(T0 + s + 5))
            .await
            .unwrap(),
        20 * W
    );
    assert_eq!(
        store.cool(route, "z", 10, Some(T0 + s + 6)).await.unwrap(),
        10
    );
    assert_eq!(
        store
            .cool(route, "y", 30 * W, Some(T0 + s + 7))
            .await
            .unwrap(),
        30 * W
    );
    // x: max(20 W − 3, 10 W − s − 8); z: max(8, 10 W + 1 − s − 8); y: 30 W − 1.
    let (wait, quota) = busy(store, at(s + 8)).await;
    assert_eq!(
        wait,
        10 * W - s - 7,
        "z, whose windows outlast its cooldown"
    );
    assert_eq!(quota.unwrap().windows[0].remaining, 94);
    let no_z = ["z"];
    let (wait, _) = busy(
        store,
        Assign {
            excluded: &no_z,
            ..at(s + 9)
        },
    )
    .await;
    assert_eq!(wait, 20 * W - 4, "x, whose cooldown outlasts its windows");
    assert_eq!(assigned(store, at(10 * W + 1)).await, "z");

    // Nothing to check in the store: the first candidate that is not excluded.
    let only_y = [1];
    let plain = Assign {
        cooldowns: false,
        ..ask("pref-plain", &members, Order::Preference(&only_y), T0)
    };
    assert_eq!(assigned(store, plain).await, "y");
    let no_y = ["y"];
    assert_eq!(
        store
            .assign(Assign {
                excluded: &no_y,
                ..plain
            })
            .await
            .unwrap(),
        Assignment::NoMember { quota: None }
    );
    // No candidate at all, with a quota: no member, and the quota untouched.
    let rq1 = [window("r", 1, W)];
    for t in 0..3 {
        match store
            .assign(Assign {
                quota: Some(route_quota("pref-none", &rq1, T0 + t)),
                ..ask("pref-none", &members, Order::Preference(&[]), T0 + t)
            })
            .await
            .unwrap()
        {
            Assignment::NoMember { quota: Some(q) } => assert_eq!(q.windows[0].remaining, 1),
            other => panic!("{other:?}"),
        }
    }
    // Preferences count nothing in a pool.
    assert!(counts(store, route).await.is_empty());
}

/// `cool` never shortens a cooldown, least_used skips cooling members even when they are the
/// least used, and a cooldown ends exactly when it said.
async fn cooldowns_on_a_trace_clock(store: &dyn StateStore) {
    let route = "cool";
    assert_eq!(store.cool(route, "m", W, Some(T0)).await.unwrap(), W);
    assert_eq!(
        store.cool(route, "m", 10, Some(T0 + 1)).await.unwrap(),
        W - 1
    );
    assert_eq!(
        store.cool(route, "m", 5 * W, Some(T0 + 2)).await.unwrap(),
        5 * W
    );
    assert_eq!(
        store.cool(route, "m", 0, Some(T0 + 3)).await.unwrap(),
        5 * W - 1
    );
    assert_eq!(store.cool(route, "n", 0, Some(T0 + 3)).await.unwrap(), 0);
    assert_eq!(
        store
            .cool(route, "m", 0, Some(T0 + 5 * W + 2))
            .await
            .unwrap(),
        0
    );

    let route = "lu-cool";
    let members = [member("a", &[]), member("b", &[])];
    let at = |t: u64| ask(route, &members, Order::LeastUsed, T0 + t);
    assert_eq!(store.cool(route, "a", W, Some(T0)).await.unwrap(), W);
    assert_eq!(assigned(store, at(1)).await, "b");
    assert_eq!(
        assigned(store, at(2)).await,
        "b",
        "a is the least used, but cooling"
    );
    assert_eq!(store.cool(route, "b", 50, Some(T0 + 3)).await.unwrap(), 50);
    let (wait, quota) = busy(store, at(4)).await;
    assert_eq!((wait, quota), (49, None));
    assert_eq!(counts(store, route).await, count_map(&[("a", 0), ("b", 2)]));
    assert_eq!(assigned(store, at(53)).await, "b");
    assert_eq!(assigned(store, at(W)).await, "a");
}

/// A least-used member back from its cooldown starts at the least count of the members that
/// could take requests meanwhile (not one still cooling), settled by the first assignment after
/// the cooldown ends, even when another member was cooled in between; never lowered.
async fn a_member_back_from_its_cooldown_starts_at_the_least_count(store: &dyn StateStore) {
    let route = "lu-back";
    let members = [member("a", &[]), member("b", &[]), member("c", &[])];
    let at = |t: u64| ask(route, &members, Order::LeastUsed, T0 + t);
    store.cool(route, "a", W, Some(T0)).await.unwrap();
    store.cool(route, "c", 10 * W, Some(T0)).await.unwrap();
    for t in 1..=4 {
        assert_eq!(assigned(store, at(t)).await, "b");
    }
    // c still cools at W: a rises to b's count, not c's 0, and wins the tie by its name.
    assert_eq!(assigned(store, at(W)).await, "a");
    assert_eq!(
        counts(store, route).await,
        count_map(&[("a", 5), ("b", 4), ("c", 0)])
    );
    assert_eq!(assigned(store, at(W + 1)).await, "b");

    // c's cooldown is over at 10W, and settled by the next assignment even though b is cooled
    // in between: c rises to a's 5 (b cools), and a wins the tie.
    store
        .cool(route, "b", 5, Some(T0 + 10 * W + 1))
        .await
        .unwrap();
    assert_eq!(assigned(store, at(10 * W + 2)).await, "a");
    assert_eq!(
        counts(store, route).await,
        count_map(&[("a", 6), ("b", 5), ("c", 5)])
    );
    assert_eq!(assigned(store, at(10 * W + 3)).await, "c");
    // b's cooldown ended at 10W + 6: it rises to 6, and a wins the three-way tie.
    assert_eq!(assigned(store, at(10 * W + 10)).await, "a");
    assert_eq!(
        counts(store, route).await,
        count_map(&[("a", 7), ("b", 6), ("c", 6)])
    );
}

/// A member at its most leases (`upstream.max_in_flight`) cannot take requests, so it does not
/// set the count a member back from its cooldown starts at, though its own count is the least:
/// the two stores exclude it at the same point.
async fn a_member_at_its_lease_cap_does_not_set_the_count_of_one_back(store: &dyn StateStore) {
    let route = "lu-capback";
    let members = [member("a", &[]), member("b", &[]), member("c", &[])];
    let at = |t: u64| ask(route, &members, Order::LeastUsed, T0 + t);
    let leased = |id: &'static str, t: u64| Assign {
        lease: Some(Lease {
            id,
            ttl_us: 10 * W,
            member_max: Some(1),
            route_max: None,
            client: None,
        }),
        ..at(t)
    };
    store.cool(route, "a", W, Some(T0)).await.unwrap();
    assert_eq!(assigned(store, at(1)).await, "b");
    assert_eq!(assigned(store, at(2)).await, "c");
    assert_eq!(assigned(store, at(3)).await, "b");
    // c takes its one lease, and is then at its cap with the least count of the two.
    assert_eq!(assigned(store, leased("l1", 4)).await, "c");
    assert_eq!(assigned(store, at(5)).await, "b");
    assert_eq!(
        counts(store, route).await,
        count_map(&[("a", 0), ("b", 3), ("c", 2)])
    );
    // a's cooldown is over: it rises to b's 3, the least of the members that could take
    // requests (c, at its cap, could not), and wins the tie by its name.
    assert_eq!(assigned(store, leased("l2", W)).await, "a");
    assert_eq!(
        counts(store, route).await,
        count_map(&[("a", 4), ("b", 3), ("c", 2)])
    );
}

/// On the store's own clock: `cooldowns` lists what cools, soonest first, and a cooldown ends
/// by itself (polled with a deadline; no timing is asserted).
async fn cooldowns_on_the_store_clock(store: &dyn StateStore) {
    let route = "cool-now";
    let left = store.cool(route, "k1", 60 * SEC, None).await.unwrap();
    assert!(left > 59 * SEC && left <= 60 * SEC, "{left}");
    store.cool(route, "k2", 30 * SEC, None).await.unwrap();
    let listed = store.cooldowns(route).await.unwrap();
    let names: Vec<&str> = listed.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(names, ["k2", "k1"], "{listed:?}");
    assert!(
        listed[0].1 > 25 * SEC && listed[0].1 <= 30 * SEC,
        "{listed:?}"
    );
    assert!(
        listed[1].1 > 55 * SEC && listed[1].1 <= 60 * SEC,
        "{listed:?}"
    );
    assert!(store.cooldowns("cool-none").await.unwrap().is_empty());

    let route = "cool-ends";
    let members = [member("only", &[])];
    let now = Assign {
        at_us: None,
        ..ask(route, &members, Order::LeastUsed, 0)
    };
    store.cool(route, "only", 300_000, None).await.unwrap();
    let (wait, _) = busy(store, now).await;
    assert!(wait > 0 && wait <= 300_000, "{wait}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.assign(now).await.unwrap() {
            Assignment::Assigned { member, .. } => {
                assert_eq!(member, "only");
                break;
            }
            Assignment::Busy { .. } => {
                assert!(Instant::now() < deadline, "the cooldown never ended");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(store.cooldowns(route).await.unwrap().is_empty());
}

/// Per-member limits under contention, from two stores (two instances) at once, on two routes:
/// one where the route quota binds (40 < 45 units of member capacity), one where the members'
/// windows do. Half the tasks pick least-used, half by a preference. Returns, per route, how
/// many assignments each member got.
async fn hammered(
    a: Arc<dyn StateStore>,
    b: Arc<dyn StateStore>,
) -> HashMap<(&'static str, String), u64> {
    const HOUR: u64 = 3_600 * SEC;
    let members: Arc<[PoolMember]> = Arc::from(vec![
        member("m1", &[window("rpm", 10, HOUR)]),
        member(
            "m2",
            &[window("rpm", 15, HOUR), window("rpd", 100, 24 * HOUR)],
        ),
        member("m3", &[window("rpm", 20, HOUR)]),
    ]);
    let mut tasks = Vec::new();
    for (route, limit) in [("hammer", 40u64), ("hammer-members", 1_000)] {
        for i in 0..8 {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let members = members.clone();
            tasks.push(tokio::spawn(async move {
                let rq = [window("r", limit, HOUR)];
                let mut got = Vec::new();
                for _ in 0..10 {
                    let preference = [2, 0, 1];
                    let order = if i < 4 {
                        Order::LeastUsed
                    } else {
                        Order::Preference(&preference)
                    };
                    let ask = Assign {
                        route,
                        members: &members,
                        order,
                        excluded: &[],
                        quota: Some(Acquire {
                            route,
                            key: "route",
                            windows: &rq,
                            cost: 1,
                            at_us: None,
                            client: None,
                        }),
                        cost: 1,
                        cooldowns: true,
                        at_us: None,
                        lease: None,
                        sticky: None,
                    };
                    match store.assign(ask).await.unwrap() {
                        Assignment::Assigned { member, .. } => got.push(member),
                        Assignment::QuotaRefused(_) | Assignment::Busy { .. } => {}
                        other => panic!("{other:?}"),
                    }
                }
                (route, got)
            }));
        }
    }
    let mut by_member: HashMap<(&'static str, String), u64> = HashMap::new();
    for t in tasks {
        let (route, got) = t.await.unwrap();
        for m in got {
            *by_member.entry((route, m)).or_default() += 1;
        }
    }
    let total = |route: &str| -> u64 {
        by_member
            .iter()
            .filter(|((r, _), _)| *r == route)
            .map(|(_, n)| n)
            .sum()
    };
    assert_eq!(
        total("hammer"),
        40,
        "the route quota is exact: {by_member:?}"
    );
    for (m, limit) in [("m1", 10), ("m2", 15), ("m3", 20)] {
        let n = by_member
            .get(&("hammer", m.to_string()))
            .copied()
            .unwrap_or(0);
        assert!(n <= limit, "{m}: {n} > {limit}");
        assert_eq!(
            by_member[&("hammer-members", m.to_string())],
            limit,
            "{m} filled exactly: {by_member:?}"
        );
    }
    assert_eq!(total("hammer-members"), 45);
    by_member
}

/// `member_remaining` reads a member's windows on the store's clock and records nothing.
async fn member_remaining_reads_without_recording(store: &dyn StateStore) {
    let route = "remaining";
    let members = [
        member("m", &[window("rpm", 3, W), window("rpd", 10, 2 * W)]),
        member("bare", &[]),
    ];
    assert_eq!(
        store.member_remaining(route, &members[0]).await.unwrap(),
        [3, 10]
    );
    let mut now = ask(route, &members, Order::Preference(&[0]), 0);
    now.at_us = None;
    assert_eq!(assigned(store, now).await, "m");
    for _ in 0..2 {
        assert_eq!(
            store.member_remaining(route, &members[0]).await.unwrap(),
            [2, 9]
        );
    }
    assert_eq!(assigned(store, now).await, "m");
    assert_eq!(
        store.member_remaining(route, &members[0]).await.unwrap(),
        [1, 8]
    );
    assert!(store
        .member_remaining(route, &members[1])
        .await
        .unwrap()
        .is_empty());
}

/// Members that share their windows (the Redis store sends them once, "=" for the next member)
/// each keep their own: a run of equal windows, then a different one, then equal again.
async fn members_sharing_windows_keep_their_own(store: &dyn StateStore) {
    let route = "shared-windows";
    let one = [window("rpm", 1, 10 * W)];
    let two = [window("rpm", 2, 10 * W), window("rph", 3, 20 * W)];
    let members = [
        member("p", &one),
        member("q", &one),
        member("r", &two),
        member("s", &two),
        member("t", &one),
    ];
    let order = [0, 1, 2, 3, 4];
    let at = |t: u64| ask(route, &members, Order::Preference(&order), T0 + t);
    let mut got = Vec::new();
    for t in 0..7 {
        got.push(assigned(store, at(t)).await);
    }
    assert_eq!(got, ["p", "q", "r", "r", "s", "s", "t"]);
    // Every member is full now; p's entry at 0 is the first to leave.
    assert_eq!(busy(store, at(7)).await.0, 10 * W - 7);
}

async fn suite(store: Arc<dyn StateStore>) {
    members_sharing_windows_keep_their_own(&*store).await;
    member_remaining_reads_without_recording(&*store).await;
    least_used_skips_full_members(&*store).await;
    preference_with_windows_and_cooldowns(&*store).await;
    cooldowns_on_a_trace_clock(&*store).await;
    a_member_back_from_its_cooldown_starts_at_the_least_count(&*store).await;
    a_member_at_its_lease_cap_does_not_set_the_count_of_one_back(&*store).await;
    cooldowns_on_the_store_clock(&*store).await;
}

fn redis_store(url: &str) -> Arc<dyn StateStore> {
    let connection = RedisConnection::new(url, Duration::from_secs(5)).unwrap();
    Arc::new(RedisStore::with_connection(Arc::new(connection), "sluice"))
}

/// Reads a member's complete log (not a sample of it) and sums the costs of its entries.
fn logged_units(addr: SocketAddr, key: &str) -> u64 {
    sluice_testkit::zrange_with_scores_at(addr, key)
        .iter()
        .map(|(entry, _)| {
            entry
                .rsplit(':')
                .next()
                .and_then(|c| c.parse::<u64>().ok())
                .expect("entries are <seq>:<cost>")
        })
        .sum()
}

/// Every member's log holds exactly what was assigned to it, within its limit, and the route's
/// log exactly what the route admitted. `addr_of` names the node holding a key.
fn check_logs(
    by_member: &HashMap<(&'static str, String), u64>,
    addr_of: impl Fn(&str) -> SocketAddr,
) {
    for route in ["hammer", "hammer-members"] {
        let mut total = 0;
        for (m, limit) in [("m1", 10), ("m2", 15), ("m3", 20)] {
            let key = format!("sluice:{{{route}}}:mq:rpm:{m}");
            let units = logged_units(addr_of(&key), &key);
            let assigned = by_member.get(&(route, m.to_string())).copied().unwrap_or(0);
            assert_eq!(units, assigned, "{key}");
            assert!(units <= limit, "{key}: {units} > {limit}");
            total += units;
        }
        let key = format!("sluice:{{{route}}}:mq:rpd:m2");
        let assigned = by_member
            .get(&(route, "m2".to_string()))
            .copied()
            .unwrap_or(0);
        assert_eq!(logged_units(addr_of(&key), &key), assigned, "{key}");
        let key = format!("sluice:{{{route}}}:q:r:route");
        assert_eq!(logged_units(addr_of(&key), &key), total, "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_members_behave() {
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    suite(store.clone()).await;
    hammered(store.clone(), store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_members_behave() {
    let server = RedisServer::start();
    suite(redis_store(&server.url())).await;
    // Two instances, each with its own connection, on one Redis.
    let by_member = hammered(redis_store(&server.url()), redis_store(&server.url())).await;
    check_logs(&by_member, |_| server.addr());
    // The cooldowns key lives a day longer than its longest cooldown (a cooldown that is over
    // waits there for the assignment that settles it), member logs and their helper hashes as
    // long as their windows (and at most an eighth longer: lua/quota.lua pushes an expiry back
    // only when it would come too soon).
    const DAY_MS: i64 = 86_400_000;
    // Set by the 60 s cooldown of `cooldowns_on_the_store_clock`, the suite and the hammering
    // ago: more than a day is left however long those took on a loaded machine (under a
    // minute), and never more than the day and the cooldown.
    let ttl = server.integer(&["PTTL", "sluice:{cool-now}:cool"]).unwrap();
    assert!(ttl > DAY_MS && ttl <= DAY_MS + 60_000, "{ttl}");
    for (key, longest_ms) in [
        ("sluice:{hammer}:mq:rpm:m1", 3_600_000),
        ("sluice:{hammer}:mqm:m1", 3_600_000),
        ("sluice:{hammer}:mq:rpd:m2", 24 * 3_600_000),
        ("sluice:{hammer}:mqm:m2", 24 * 3_600_000),
    ] {
        let ttl = server.integer(&["PTTL", key]).unwrap();
        assert!(
            ttl > longest_ms - 60_000 && ttl <= longest_ms * 9 / 8,
            "{key}: {ttl}"
        );
    }
}

/// The same suite where Redis refuses functions (Redis 6, or an ACL without them): every call
/// goes as `EVALSHA` of the scripts assembled from the same files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_members_behave_without_functions() {
    let server = RedisServer::start();
    let url = server.url_without_functions();
    suite(redis_store(&url)).await;
    let by_member = hammered(redis_store(&url), redis_store(&url)).await;
    check_logs(&by_member, |_| server.addr());
    assert_eq!(server.command_calls("fcall"), 0);
    assert!(server.command_calls("evalsha") > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_members_behave() {
    let cluster = RedisCluster::start();
    let store = || -> Arc<dyn StateStore> {
        let connection = RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap();
        Arc::new(RedisStore::with_connection(Arc::new(connection), "sluice"))
    };
    suite(store()).await;
    let by_member = hammered(store(), store()).await;
    check_logs(&by_member, |key| {
        let port = cluster.master_of(key).expect("a master serves the key");
        cluster.nodes()[cluster.index_of(port)].addr()
    });
    let routes = [
        "lu-mq",
        "pref",
        "lu-cool",
        "cool-ends",
        "hammer",
        "hammer-members",
    ];
    let masters: std::collections::HashSet<u16> = routes
        .iter()
        .filter_map(|r| cluster.master_of(&format!("{{{r}}}")))
        .collect();
    assert!(
        masters.len() >= 2,
        "the routes span several masters: {masters:?}"
    );
}

/// One `FCALL` per assignment from the client, whatever it decides: least-used with a route
/// quota, member windows and cooldowns (one member cooling, one full), and the same with a
/// preference order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_one_command_per_assignment_with_windows_and_cooldowns() {
    let server = RedisServer::start();
    let store = redis_store(&server.url());
    let members = [
        member("k1", &[window("rpm", 1_000, 60 * SEC)]),
        member(
            "k2",
            &[
                window("rpm", 1_000, 60 * SEC),
                window("rpd", 5, 3_600 * SEC),
            ],
        ),
        member("k3", &[window("rpm", 1_000, 60 * SEC)]),
    ];
    let rq = [window("r", 100_000, 60 * SEC)];
    let preference = [1, 2, 0];
    let ask = |order| Assign {
        route: "cmd",
        members: &members,
        order,
        excluded: &[],
        quota: Some(Acquire {
            route: "cmd",
            key: "route",
            windows: &rq,
            cost: 1,
            at_us: None,
            client: None,
        }),
        cost: 1,
        cooldowns: true,
        at_us: None,
        lease: None,
        sticky: None,
    };
    // Warm up: the first call syncs the pool and loads the script.
    assigned(&*store, ask(Order::LeastUsed)).await;
    store.cool("cmd", "k3", 600 * SEC, None).await.unwrap();
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let monitor = server.monitor();
    let mut got = HashMap::<String, u64>::new();
    for _ in 0..100 {
        *got.entry(assigned(&*store, ask(Order::LeastUsed)).await)
            .or_default() += 1;
        *got.entry(assigned(&*store, ask(Order::Preference(&preference))).await)
            .or_default() += 1;
    }
    let sent = monitor.stop();
    assert_eq!(server.command_calls("fcall"), 200);
    assert_eq!(
        sent.len(),
        200,
        "exactly one command per assignment: {sent:?}"
    );
    assert!(sent.iter().all(|c| c == "FCALL"), "{sent:?}");
    // k3 cools, k2 is full after 5 (its daily window): k1 takes the rest.
    assert_eq!(got.get("k3"), None, "{got:?}");
    assert_eq!(got.get("k2"), Some(&5), "{got:?}");
    assert_eq!(got.get("k1"), Some(&195), "{got:?}");
}

/// What a key-pool assignment costs Redis, counted rather than timed (the key-pool benchmark
/// compares it with plain least-used on a loaded machine): least-used over members with a
/// window each, cooldowns read, nobody cooling, nothing refused. The script runs 8 commands:
/// TIME, the pool's first members, EXISTS on the cooldowns, the chosen member's hash (HMGET)
/// and oldest log entry, its new entry (ZADD), its hash (HSET) and the pool count (ZINCRBY).
/// Expiries are set once per eighth of a window, not per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_key_pool_assignment_runs_eight_commands() {
    let server = RedisServer::start();
    let store = redis_store(&server.url());
    let members = [
        member("k1", &[window("rpm", 1_000_000, 3_600 * SEC)]),
        member("k2", &[window("rpm", 1_000_000, 3_600 * SEC)]),
        member("k3", &[window("rpm", 1_000_000, 3_600 * SEC)]),
    ];
    let ask = || Assign {
        at_us: None,
        ..ask("kp-cost", &members, Order::LeastUsed, 0)
    };
    // Warm up: the first calls sync the pool, load the script and set the expiries.
    for _ in 0..3 {
        assigned(&*store, ask()).await;
    }
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let n = 300;
    for _ in 0..n {
        assigned(&*store, ask()).await;
    }
    let info = server.command(&["INFO", "commandstats"]).unwrap();
    let mut run = HashMap::<String, u64>::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(":calls="))
        else {
            continue;
        };
        let calls: u64 = rest.split(',').next().unwrap().parse().unwrap();
        // Not the script's: this test's own connections to read the counts.
        if !["fcall", "config|resetstat", "info", "quit"].contains(&name) {
            run.insert(name.to_string(), calls);
        }
    }
    assert_eq!(server.command_calls("fcall"), n);
    assert_eq!(run.values().sum::<u64>(), 8 * n, "{run:?}");
    assert_eq!(run.get("pexpire"), None, "{run:?}");
    assert_eq!(
        counts(&*store, "kp-cost").await.values().sum::<u64>(),
        n + 3
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

/// Two threads released together thousands of times on a fresh route each round, one picking
/// least-used and one by preference, for the one unit of the only member's window: exactly one
/// may win a round, and the other must be told Busy (the memory store's walk is one step under
/// the route's lock).
#[test]
fn memory_member_window_is_never_shared_by_two_winners() {
    use std::sync::atomic::{AtomicU64, Ordering};
    const ROUNDS: usize = 5_000;
    let store = MemoryStore::new();
    let members = [member("only", &[window("rpm", 1, 3_600 * SEC)])];
    let routes: Vec<String> = (0..ROUNDS).map(|i| format!("race-{i}")).collect();
    let arrived = AtomicU64::new(0);
    let outcomes: Vec<Vec<Assignment>> = std::thread::scope(|s| {
        let run = |least_used: bool| {
            let (store, members, routes, arrived) = (&store, &members, &routes, &arrived);
            move || {
                let mut got = Vec::with_capacity(ROUNDS);
                for (round, route) in routes.iter().enumerate() {
                    arrived.fetch_add(1, Ordering::AcqRel);
                    let mut spins = 0u32;
                    while arrived.load(Ordering::Acquire) < 2 * (round as u64 + 1) {
                        spins += 1;
                        if spins.is_multiple_of(256) {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                    let order = if least_used {
                        Order::LeastUsed
                    } else {
                        Order::Preference(&[0])
                    };
                    let ask = Assign {
                        at_us: None,
                        ..ask(route, members, order, 0)
                    };
                    got.push(now(store.assign(ask)).unwrap());
                }
                got
            }
        };
        let a = s.spawn(run(true));
        let b = s.spawn(run(false));
        vec![a.join().unwrap(), b.join().unwrap()]
    });
    let won = |o: &Assignment| matches!(o, Assignment::Assigned { .. });
    for (round, (a, b)) in outcomes[0].iter().zip(&outcomes[1]).enumerate() {
        assert!(won(a) != won(b), "round {round}: {a:?} / {b:?}");
        let lost = if won(a) { b } else { a };
        assert!(
            matches!(lost, Assignment::Busy { .. }),
            "round {round}: {lost:?}"
        );
    }
}
