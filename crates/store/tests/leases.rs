//! Leases in the store: requests in flight per member, taken in the same atomic step as the
//! assignment, released, renewed and expired; `least_in_flight` picks the member with the
//! fewest; `max_in_flight` caps a member and a route. One suite, run against [`MemoryStore`],
//! [`RedisStore`] (two instances on one `redis-server`) and a Redis Cluster; traces pass their
//! clock (`at_us`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sluice_allocator::{
    Assign, Assignment, ClientCap, Lease, MemoryStore, Order, PoolMember, StateStore, Sticky,
    LEASES_EXPIRED_PER_CALL,
};
use sluice_limiter::{Acquire, Window};
use sluice_store::{RedisConnection, RedisStore};
use sluice_testkit::{RedisCluster, RedisServer};

const SEC: u64 = 1_000_000;
/// Trace time zero.
const T0: u64 = 1_000 * SEC;
/// A lease that outlives any trace.
const LONG: u64 = 3_600 * SEC;

fn members(ids: &[&str]) -> Vec<PoolMember> {
    ids.iter().map(|&id| PoolMember::new(id)).collect()
}

fn lease(id: &str, ttl_us: u64, member_max: Option<u64>, route_max: Option<u64>) -> Lease<'_> {
    Lease {
        id,
        ttl_us,
        member_max,
        route_max,
        client: None,
    }
}

fn ask<'a>(
    route: &'a str,
    members: &'a [PoolMember],
    order: Order<'a>,
    lease: Lease<'a>,
    at_us: u64,
) -> Assign<'a> {
    Assign {
        route,
        members,
        order,
        excluded: &[],
        quota: None,
        cost: 1,
        cooldowns: false,
        at_us: Some(at_us),
        lease: Some(lease),
        sticky: None,
    }
}

async fn assigned(store: &dyn StateStore, ask: Assign<'_>) -> String {
    match store.assign(ask).await.unwrap() {
        Assignment::Assigned { member, .. } => member,
        other => panic!("expected an assignment: {other:?}"),
    }
}

async fn in_flight(store: &dyn StateStore, route: &str, at_us: u64) -> BTreeMap<String, u64> {
    store
        .in_flight(route, Some(at_us))
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// A small deterministic generator, so that the trace is the same on every store.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// Two instances take and release leases in turn: every pick is a member whose count was the
/// least at that moment (ties to the smallest id), and the store's counts are the model's.
async fn least_in_flight_takes_the_fewest(a: &dyn StateStore, b: &dyn StateStore) {
    let route = "lif";
    let pool = members(&["m1", "m2", "m3"]);
    let mut model: BTreeMap<String, u64> = BTreeMap::new();
    let mut held: Vec<(String, String)> = Vec::new();
    let mut rng = Lcg(7);
    for step in 0..120u64 {
        let store = if step % 2 == 0 { a } else { b };
        if held.is_empty() || rng.next(3) > 0 {
            let id = format!("i{}-{step}", step % 2);
            let least = ["m1", "m2", "m3"]
                .iter()
                .map(|m| (model.get(*m).copied().unwrap_or(0), *m))
                .min()
                .map(|(_, m)| m.to_string());
            let member = assigned(
                store,
                ask(
                    route,
                    &pool,
                    Order::LeastInFlight(&[0, 1, 2]),
                    lease(&id, LONG, None, None),
                    T0 + step,
                ),
            )
            .await;
            assert_eq!(Some(&member), least.as_ref(), "step {step}: {model:?}");
            *model.entry(member.clone()).or_insert(0) += 1;
            held.push((id, member));
        } else {
            let (id, member) = held.remove(rng.next(held.len() as u64) as usize);
            store.release(route, &[&id]).await.unwrap();
            let n = model.get_mut(&member).unwrap();
            *n -= 1;
            if *n == 0 {
                model.remove(&member);
            }
        }
        assert_eq!(
            in_flight(store, route, T0 + step).await,
            model,
            "step {step}"
        );
    }
    // Releasing every lease at once, some of them twice, and one never taken.
    let mut ids: Vec<&str> = held.iter().map(|(id, _)| &**id).collect();
    ids.push("never");
    ids.extend(held.iter().take(2).map(|(id, _)| &**id));
    a.release(route, &ids).await.unwrap();
    assert!(in_flight(b, route, T0 + 200).await.is_empty());
}

/// A member at its `max_in_flight` is not a candidate; when every one is, the answer is
/// `Concurrency` and nothing is taken; a release makes room on that member.
async fn a_member_at_its_cap_is_skipped(a: &dyn StateStore, b: &dyn StateStore) {
    let pool = members(&["m1", "m2"]);
    for (route, order) in [
        ("cap-lif", Order::LeastInFlight(&[0, 1])),
        ("cap-pref", Order::Preference(&[1, 0])),
        ("cap-lu", Order::LeastUsed),
    ] {
        let mut got = Vec::new();
        for i in 0..4 {
            let id = format!("c{i}");
            let store = if i % 2 == 0 { a } else { b };
            got.push(
                assigned(
                    store,
                    ask(route, &pool, order, lease(&id, LONG, Some(2), None), T0),
                )
                .await,
            );
        }
        got.sort();
        assert_eq!(got, ["m1", "m1", "m2", "m2"], "{route}");
        let full = a
            .assign(ask(
                route,
                &pool,
                order,
                lease("c4", LONG, Some(2), None),
                T0,
            ))
            .await
            .unwrap();
        assert_eq!(full, Assignment::Concurrency { quota: None }, "{route}");
        let counts = in_flight(b, route, T0).await;
        assert_eq!(
            counts.values().sum::<u64>(),
            4,
            "{route}: the refused took nothing"
        );
        // c0 went first: on m1 for least_in_flight and least_used, on m2 by preference.
        b.release(route, &["c0"]).await.unwrap();
        let freed = if route == "cap-pref" { "m2" } else { "m1" };
        let member = assigned(
            a,
            ask(route, &pool, order, lease("c5", LONG, Some(2), None), T0),
        )
        .await;
        assert_eq!(member, freed, "{route}");
    }
}

/// The route at its `max_in_flight` assigns nobody, and charges nothing to its quota.
async fn the_route_at_its_cap_refuses(a: &dyn StateStore, b: &dyn StateStore) {
    let route = "cap-route";
    let pool = members(&["m1", "m2", "m3"]);
    let windows = [Window {
        name: "m".into(),
        limit: 100,
        length_us: 3_600 * SEC,
    }];
    let quota = Acquire {
        route,
        key: "route",
        windows: &windows,
        cost: 1,
        at_us: Some(T0),
        client: None,
    };
    let with_quota = |id: &'static str| Assign {
        quota: Some(quota),
        ..ask(
            route,
            &pool,
            Order::LeastInFlight(&[0, 1, 2]),
            lease(id, LONG, None, Some(2)),
            T0,
        )
    };
    assigned(a, with_quota("r0")).await;
    assigned(b, with_quota("r1")).await;
    let remaining = |a: &Assignment| match a {
        Assignment::Concurrency { quota: Some(q) } => q.windows[0].remaining,
        other => panic!("expected concurrency: {other:?}"),
    };
    let first = a.assign(with_quota("r2")).await.unwrap();
    assert_eq!(
        remaining(&first),
        98,
        "two admitted, the refused not charged"
    );
    let again = b.assign(with_quota("r3")).await.unwrap();
    assert_eq!(remaining(&again), 98);
    a.release(route, &["r1"]).await.unwrap();
    assert_eq!(assigned(b, with_quota("r4")).await, "m2");
}

/// A lease nobody releases (its instance died) expires at its ttl, and its capacity comes back;
/// a renewed one lives a ttl from its renewal; a lease that expired is not renewed back.
async fn leases_expire_and_renew(a: &dyn StateStore, b: &dyn StateStore) {
    let route = "expiry";
    let pool = members(&["m1"]);
    let take = |id: &'static str, at: u64| {
        ask(
            route,
            &pool,
            Order::LeastInFlight(&[0]),
            lease(id, SEC, Some(2), None),
            at,
        )
    };
    assigned(a, take("e0", T0)).await;
    assigned(a, take("e1", T0)).await;
    assert!(matches!(
        b.assign(take("e2", T0 + SEC / 2)).await.unwrap(),
        Assignment::Concurrency { .. }
    ));
    b.renew(route, &["e1"], SEC, Some(T0 + SEC / 2))
        .await
        .unwrap();
    // e0 expired at T0 + 1 s: there is room for one again; e1 lives until T0 + 1.5 s.
    assigned(b, take("e3", T0 + SEC + 1)).await;
    assert_eq!(
        in_flight(a, route, T0 + SEC + 1).await,
        BTreeMap::from([("m1".to_string(), 2)])
    );
    assert_eq!(
        in_flight(a, route, T0 + 3 * SEC / 2 + 1).await,
        BTreeMap::from([("m1".to_string(), 1)])
    );
    // e1 expired: renewing it takes nothing again.
    a.renew(route, &["e1"], LONG, Some(T0 + 2 * SEC))
        .await
        .unwrap();
    assert!(in_flight(b, route, T0 + 3 * SEC).await.is_empty());
}

/// A client's `max_in_flight` counts its leases on every route, apart from the route's caps: at
/// its cap the client is refused (`ClientConcurrency`, nothing taken) on any route, through
/// either instance, while another client goes on; a route that refuses gives the client's part
/// back (on a cluster, taken first in the client's slot); a release, or the ttl, makes room, and
/// a renewal keeps a lease counting.
async fn a_client_at_its_cap_is_refused_on_every_route(a: &dyn StateStore, b: &dyn StateStore) {
    let pool = members(&["m1", "m2"]);
    let capped = |name: &'static str, max: u64| Some(ClientCap { name, max });
    let take = |route: &'static str, id: &'static str, client, route_max, at: u64| {
        let mut lease = lease(id, 10 * SEC, None, route_max);
        lease.client = client;
        ask(route, &pool, Order::Preference(&[0, 1]), lease, at)
    };
    assigned(a, take("ca", "k0", capped("c", 2), None, T0)).await;
    assigned(b, take("cb", "k1", capped("c", 2), None, T0)).await;
    for (store, route) in [(a, "ca"), (b, "cb"), (a, "cc")] {
        assert_eq!(
            store
                .assign(take(route, "k2", capped("c", 2), None, T0))
                .await
                .unwrap(),
            Assignment::ClientConcurrency { quota: None },
            "{route}"
        );
    }
    // The refused took nothing on its route.
    assert_eq!(
        in_flight(b, "ca", T0).await,
        BTreeMap::from([("m1".to_string(), 1)])
    );
    assert!(in_flight(b, "cc", T0).await.is_empty());
    // Another client, and a request without a cap, are not limited by c's.
    assigned(b, take("ca", "d0", capped("d", 2), None, T0)).await;
    assigned(a, take("ca", "n0", None, None, T0)).await;
    // A route at its own cap refuses c's request, and c's part is given back: c, at one lease
    // of its two, is still admitted elsewhere afterwards.
    b.release_client("c", &["k1"]).await.unwrap();
    b.release("cb", &["k1"]).await.unwrap();
    assert_eq!(
        a.assign(take("ca", "k3", capped("c", 2), Some(3), T0))
            .await
            .unwrap(),
        Assignment::Concurrency { quota: None }
    );
    assigned(a, take("cc", "k4", capped("c", 2), None, T0)).await;
    assert_eq!(
        b.assign(take("cb", "k5", capped("c", 2), None, T0))
            .await
            .unwrap(),
        Assignment::ClientConcurrency { quota: None }
    );
    // k4 renewed at T0 + 5 s lives until T0 + 15 s; k0 expires at T0 + 10 s and frees one.
    a.renew_client("c", &["k4"], 10 * SEC, Some(T0 + 5 * SEC))
        .await
        .unwrap();
    assigned(b, take("cb", "k6", capped("c", 2), None, T0 + 11 * SEC)).await;
    assert_eq!(
        a.assign(take("cb", "k7", capped("c", 2), None, T0 + 11 * SEC))
            .await
            .unwrap(),
        Assignment::ClientConcurrency { quota: None }
    );
    // Both released: room for two again.
    a.release_client("c", &["k4", "k6", "never"]).await.unwrap();
    assigned(b, take("cb", "k8", capped("c", 2), None, T0 + 11 * SEC)).await;
    assigned(a, take("ca", "k9", capped("c", 2), None, T0 + 11 * SEC)).await;
    // With a sticky session too (its keys and the client's both in the one step): bound, and
    // counted in the client's leases, which are now full.
    let mut sticky = take("cs", "k10", capped("e", 1), None, T0);
    sticky.sticky = Some(Sticky {
        session: "s1",
        ttl_us: LONG,
        max_bindings: 10,
    });
    assigned(b, sticky).await;
    let counts = a.sticky_counts("cs", Some(T0)).await.unwrap();
    assert_eq!(counts.bindings, 1);
    assert_eq!(
        a.assign(take("ca", "k11", capped("e", 1), None, T0))
            .await
            .unwrap(),
        Assignment::ClientConcurrency { quota: None }
    );
}

/// Releases that come due together go in one call, and so may a client's: each lease named is
/// released once, whatever else the call names (a lease named twice, one released before, one
/// never taken), and the counts are those of releasing each alone. A call may name more leases
/// than one Redis command takes (`LEASES_PER_COMMAND`, lua/leases.lua).
async fn many_released_at_once(a: &dyn StateStore, b: &dyn StateStore) {
    let route = "many";
    let pool = members(&["m1", "m2", "m3"]);
    let ids: Vec<String> = (0..1100).map(|i| format!("r{i}")).collect();
    let cap = |max| Some(ClientCap { name: "bulk", max });
    for (i, id) in ids.iter().enumerate() {
        let store = if i % 2 == 0 { a } else { b };
        let mut lease = lease(id, LONG, None, None);
        lease.client = cap(2_000);
        let order = Order::LeastInFlight(&[0, 1, 2]);
        assigned(store, ask(route, &pool, order, lease, T0)).await;
    }
    // Fewest first, ties to the smallest id: r0 on m1, r1 on m2, r2 on m3, r3 on m1...
    let counts = |m1: u64, m2: u64, m3: u64| {
        BTreeMap::from([
            ("m1".to_string(), m1),
            ("m2".to_string(), m2),
            ("m3".to_string(), m3),
        ])
    };
    assert_eq!(in_flight(a, route, T0).await, counts(367, 367, 366));
    b.release(route, &["r0"]).await.unwrap();
    a.release(route, &["r0", "r1", "r1", "never", "r2", "r3", "r4"])
        .await
        .unwrap();
    assert_eq!(in_flight(b, route, T0).await, counts(365, 365, 365));
    let mut all: Vec<&str> = ids.iter().map(|id| &**id).collect();
    all.extend(["r5", "never"]);
    b.release(route, &all).await.unwrap();
    assert!(in_flight(a, route, T0).await.is_empty());
    // The route's own count is empty too: a cap of one admits one request and refuses the next.
    let solo = |id| {
        ask(
            route,
            &pool,
            Order::LeastInFlight(&[0, 1, 2]),
            lease(id, LONG, None, Some(1)),
            T0,
        )
    };
    assigned(a, solo("solo")).await;
    assert!(matches!(
        b.assign(solo("second")).await.unwrap(),
        Assignment::Concurrency { .. }
    ));
    a.release(route, &["solo"]).await.unwrap();
    // The client's part, all at once too: its set is empty, so a cap of one admits one request
    // and refuses the next.
    a.release_client("bulk", &all).await.unwrap();
    let take = |id| {
        let mut lease = lease(id, LONG, None, None);
        lease.client = cap(1);
        ask(route, &pool, Order::LeastInFlight(&[0, 1, 2]), lease, T0)
    };
    assigned(b, take("one")).await;
    assert_eq!(
        a.assign(take("two")).await.unwrap(),
        Assignment::ClientConcurrency { quota: None }
    );
    assert_eq!(
        in_flight(a, route, T0).await,
        BTreeMap::from([("m1".to_string(), 1)])
    );
}

/// A call sent again under the same lease id (its answer was lost on a dropped connection, and
/// the Redis client sent it once more) takes the lease once, on the member chosen last: one
/// release gives back exactly what was taken, and no member is left a slot short.
async fn a_lease_asked_again_is_taken_once(a: &dyn StateStore, b: &dyn StateStore) {
    let pool = members(&["m1", "m2"]);
    let route = "again";
    let held = |counts: BTreeMap<String, u64>| -> Vec<(String, u64)> {
        counts.into_iter().filter(|&(_, n)| n > 0).collect()
    };
    let once = |order| ask(route, &pool, order, lease("r1", LONG, Some(5), None), T0);
    assert_eq!(assigned(a, once(Order::Preference(&[0, 1]))).await, "m1");
    // The same call again: the same member, counted once.
    assert_eq!(assigned(b, once(Order::Preference(&[0, 1]))).await, "m1");
    assert_eq!(held(in_flight(a, route, T0).await), [("m1".into(), 1)]);
    // Sent again, it may choose another member: the lease moves there.
    assert_eq!(assigned(b, once(Order::Preference(&[1, 0]))).await, "m2");
    assert_eq!(held(in_flight(a, route, T0).await), [("m2".into(), 1)]);
    a.release(route, &["r1"]).await.unwrap();
    assert_eq!(held(in_flight(b, route, T0).await), []);
}

/// Expired leases leave at most `LEASES_EXPIRED_PER_CALL` a call, on both stores: bounded
/// work per call, and the rest count until a later call drops them (which only refuses early).
async fn expired_leases_leave_a_bounded_number_a_call(a: &dyn StateStore, b: &dyn StateStore) {
    let route = "expire-bound";
    let pool = members(&["m1"]);
    let extra = 6;
    let total = LEASES_EXPIRED_PER_CALL as u64 + extra;
    let ids: Vec<String> = (0..total).map(|i| format!("x{i}")).collect();
    for id in &ids {
        let take = ask(
            route,
            &pool,
            Order::LeastInFlight(&[0]),
            lease(id, SEC, None, None),
            T0,
        );
        assigned(a, take).await;
    }
    // All have expired at T0 + 2 s. One call drops LEASES_EXPIRED_PER_CALL of them: `extra`
    // still count, so a cap of `extra` refuses, through either instance.
    let capped = |id: &'static str| {
        ask(
            route,
            &pool,
            Order::LeastInFlight(&[0]),
            lease(id, LONG, None, Some(extra)),
            T0 + 2 * SEC,
        )
    };
    assert!(matches!(
        b.assign(capped("c0")).await.unwrap(),
        Assignment::Concurrency { .. }
    ));
    // The next call drops the rest, and there is room.
    assert_eq!(assigned(a, capped("c1")).await, "m1");
    assert_eq!(
        in_flight(b, route, T0 + 2 * SEC).await,
        BTreeMap::from([("m1".to_string(), 1)])
    );
}

/// A call refused at the route's cap has still dropped the client's expired leases (a bounded
/// number, as every call does), as the one Redis script does before it checks either cap: the
/// client's next call on another route then finds what is left of them, on both stores. Not
/// on a Redis Cluster, whose client leases are taken in a call of their own, before the
/// route's (docs/clients.md).
async fn a_call_at_the_routes_cap_drops_the_clients_expired_leases(
    a: &dyn StateStore,
    b: &dyn StateStore,
) {
    let pool = members(&["m1"]);
    fn take<'a>(
        pool: &'a [PoolMember],
        route: &'a str,
        id: &'a str,
        ttl: u64,
        max: u64,
        route_max: Option<u64>,
        at: u64,
    ) -> Assign<'a> {
        let mut lease = lease(id, ttl, None, route_max);
        lease.client = Some(ClientCap { name: "burst", max });
        ask(route, pool, Order::Preference(&[0]), lease, at)
    }
    // 70 of the client's leases, expired by T0 + 2 s.
    let extra = 6;
    let ids: Vec<String> = (0..LEASES_EXPIRED_PER_CALL as u64 + extra)
        .map(|i| format!("b{i}"))
        .collect();
    for id in &ids {
        assigned(a, take(&pool, "spread", id, SEC, 1_000, None, T0)).await;
    }
    // `full` is at its cap of 1 with a lease that lives on.
    assigned(
        a,
        ask(
            "full",
            &pool,
            Order::Preference(&[0]),
            lease("f0", LONG, None, Some(1)),
            T0,
        ),
    )
    .await;
    let at = T0 + 2 * SEC;
    assert!(matches!(
        b.assign(take(&pool, "full", "f1", LONG, extra, Some(1), at))
            .await
            .unwrap(),
        Assignment::Concurrency { .. }
    ));
    // That call dropped 64 of the client's 70; this one drops the last 6, and the client,
    // capped at 6, has room.
    assert_eq!(
        assigned(a, take(&pool, "other", "o1", LONG, extra, None, at)).await,
        "m1"
    );
}

async fn suite(a: Arc<dyn StateStore>, b: Arc<dyn StateStore>) {
    a_lease_asked_again_is_taken_once(&*a, &*b).await;
    least_in_flight_takes_the_fewest(&*a, &*b).await;
    a_member_at_its_cap_is_skipped(&*a, &*b).await;
    the_route_at_its_cap_refuses(&*a, &*b).await;
    leases_expire_and_renew(&*a, &*b).await;
    a_client_at_its_cap_is_refused_on_every_route(&*a, &*b).await;
    many_released_at_once(&*a, &*b).await;
    expired_leases_leave_a_bounded_number_a_call(&*a, &*b).await;
}

fn redis_store(url: &str) -> Arc<dyn StateStore> {
    let connection = RedisConnection::new(url, Duration::from_secs(5)).unwrap();
    Arc::new(RedisStore::with_connection(Arc::new(connection), "sluice"))
}

#[tokio::test]
async fn memory_leases() {
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    suite(store.clone(), store.clone()).await;
    a_call_at_the_routes_cap_drops_the_clients_expired_leases(&*store, &*store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_leases() {
    let server = RedisServer::start();
    suite(redis_store(&server.url()), redis_store(&server.url())).await;
    a_call_at_the_routes_cap_drops_the_clients_expired_leases(
        &*redis_store(&server.url()),
        &*redis_store(&server.url()),
    )
    .await;
    // The lease keys live as long as their longest lease, and a minute more.
    let ttl = server.integer(&["PTTL", "sluice:{lif}:lz"]);
    assert_eq!(
        ttl,
        Some(-2),
        "every lease of the route was released: no key"
    );
    let ttl = server.integer(&["PTTL", "sluice:{cap-route}:lz"]).unwrap();
    assert!(ttl > 3_600_000 && ttl <= 3_660_000, "{ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_leases_without_functions() {
    let server = RedisServer::start();
    let url = server.url_without_functions();
    suite(redis_store(&url), redis_store(&url)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_leases() {
    let cluster = RedisCluster::start();
    let store = || -> Arc<dyn StateStore> {
        let connection = RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap();
        Arc::new(RedisStore::with_connection(Arc::new(connection), "sluice"))
    };
    suite(store(), store()).await;
}

/// What leases cost Redis, counted from its own command statistics: taking one is part of the
/// assignment's one call; releasing any number of a route's is one call of a few commands, one
/// more per member whose count drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lease_calls_and_commands() {
    let server = RedisServer::start();
    let store = redis_store(&server.url());
    let pool = members(&["m1", "m2"]);
    let route = "cost";
    let ids: Vec<String> = (0..10).map(|i| format!("x{i}")).collect();
    // Warm up: the library is loaded, the keys exist.
    assigned(
        &*store,
        ask(
            route,
            &pool,
            Order::LeastInFlight(&[0, 1]),
            lease("w", LONG, None, None),
            T0,
        ),
    )
    .await;
    let calls = |name: &str| server.command_calls(name);
    let before = calls("fcall");
    for id in &ids {
        assigned(
            &*store,
            ask(
                route,
                &pool,
                Order::LeastInFlight(&[0, 1]),
                lease(id, LONG, None, None),
                T0,
            ),
        )
        .await;
    }
    assert_eq!(
        calls("fcall") - before,
        10,
        "one call per assignment, its lease included"
    );
    let commands = ["zrem", "hget", "hmget", "hdel", "hincrby", "zadd", "hset"];
    let counts = || commands.map(calls);
    let (before, fcalls) = (counts(), calls("fcall"));
    let refs: Vec<&str> = ids.iter().map(|s| &**s).collect();
    store.release(route, &refs).await.unwrap();
    assert_eq!(calls("fcall") - fcalls, 1, "ten releases, one call");
    let after = counts();
    let spent: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    // However many leases: one HMGET of their members, one HDEL of them, one ZREM, and per
    // member one HINCRBY of its count; one HDEL more for m2, whose count drops to 0 ("w" stays
    // on m1).
    assert_eq!(spent, [1, 0, 1, 1 + 1, 2, 0, 0], "{commands:?}");
}
