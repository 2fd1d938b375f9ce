//! Sticky bindings in the store: a session's member is offered first, in the same atomic step
//! as the assignment, by every instance; a member that cannot take the request moves the
//! binding; a full table leaves new sessions unbound (counted), never refused; `unbind` drops
//! a binding only while it points to the member named. One suite, run against [`MemoryStore`],
//! [`RedisStore`] (two instances on one `redis-server`, with and without functions) and a Redis
//! Cluster; traces pass their clock (`at_us`).

use std::sync::Arc;
use std::time::Duration;

use sluice_allocator::{
    Assign, Assignment, Lease, MemoryStore, Order, PoolMember, StateStore, Sticky, StickyCounts,
    BINDINGS_EXPIRED_PER_CALL,
};
use sluice_store::{RedisConnection, RedisStore};
use sluice_testkit::{RedisCluster, RedisServer};

const SEC: u64 = 1_000_000;
/// Trace time zero.
const T0: u64 = 1_000 * SEC;
const TTL: u64 = 600 * SEC;

fn members(ids: &[&str]) -> Vec<PoolMember> {
    ids.iter().map(|&id| PoolMember::new(id)).collect()
}

fn sticky(session: &str, max_bindings: u64) -> Sticky<'_> {
    Sticky {
        session,
        ttl_us: TTL,
        max_bindings,
    }
}

fn ask<'a>(
    route: &'a str,
    members: &'a [PoolMember],
    order: Order<'a>,
    sticky: Option<Sticky<'a>>,
    at_us: u64,
) -> Assign<'a> {
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
        sticky,
    }
}

async fn assigned(store: &dyn StateStore, ask: Assign<'_>) -> String {
    match store.assign(ask).await.unwrap() {
        Assignment::Assigned { member, .. } => member,
        other => panic!("expected an assignment: {other:?}"),
    }
}

/// A session stays on its first member while the policy alone would move it (least-used
/// rotates, a preference changes its mind), on both instances.
async fn a_session_stays_on_its_member(a: &dyn StateStore, b: &dyn StateStore) {
    let pool = members(&["m1", "m2", "m3"]);
    let route = "stay-lu";
    let first = assigned(
        a,
        ask(route, &pool, Order::LeastUsed, Some(sticky("s1", 100)), T0),
    )
    .await;
    for step in 1..30u64 {
        let store = if step % 2 == 0 { a } else { b };
        let s = Some(sticky("s1", 100));
        let got = assigned(store, ask(route, &pool, Order::LeastUsed, s, T0 + step)).await;
        assert_eq!(got, first, "step {step}");
    }
    // Without the session, least-used goes on to the others.
    let other = assigned(a, ask(route, &pool, Order::LeastUsed, None, T0 + 40)).await;
    assert_ne!(other, first);

    let route = "stay-pref";
    let first = assigned(
        a,
        ask(
            route,
            &pool,
            Order::Preference(&[2, 0]),
            Some(sticky("s1", 100)),
            T0,
        ),
    )
    .await;
    assert_eq!(first, "m3");
    let s = Some(sticky("s1", 100));
    let got = assigned(
        b,
        ask(route, &pool, Order::Preference(&[0, 1, 2]), s, T0 + 1),
    )
    .await;
    assert_eq!(got, "m3", "the bound member comes before the preference");
    // A member the order does not list is no candidate: the binding moves.
    let s = Some(sticky("s1", 100));
    let got = assigned(a, ask(route, &pool, Order::Preference(&[1]), s, T0 + 2)).await;
    assert_eq!(got, "m2");
    let s = Some(sticky("s1", 100));
    let got = assigned(
        b,
        ask(route, &pool, Order::Preference(&[0, 1, 2]), s, T0 + 3),
    )
    .await;
    assert_eq!(got, "m2", "moved, and stays");
    let counts = a.sticky_counts(route, Some(T0 + 4)).await.unwrap();
    assert_eq!(
        counts,
        StickyCounts {
            bindings: 1,
            unbound: 0,
            moved: 1
        }
    );
}

/// An excluded (down) or cooling bound member moves the binding to the policy's choice.
async fn an_ineligible_member_moves_the_binding(a: &dyn StateStore, b: &dyn StateStore) {
    let pool = members(&["m1", "m2", "m3"]);
    let route = "move";
    let order = Order::Preference(&[0, 1, 2]);
    let got = assigned(a, ask(route, &pool, order, Some(sticky("s", 100)), T0)).await;
    assert_eq!(got, "m1");
    // Down: the gateway leaves it out of the order.
    let s = Some(sticky("s", 100));
    let got = assigned(b, ask(route, &pool, Order::Preference(&[1, 2]), s, T0 + 1)).await;
    assert_eq!(got, "m2");
    let got = assigned(a, ask(route, &pool, order, Some(sticky("s", 100)), T0 + 2)).await;
    assert_eq!(
        got, "m2",
        "m1 is back, but the session stays where it moved"
    );
    // Cooling.
    b.cool(route, "m2", 10 * SEC, Some(T0 + 3)).await.unwrap();
    let got = assigned(a, ask(route, &pool, order, Some(sticky("s", 100)), T0 + 4)).await;
    assert_eq!(got, "m1");
    let got = assigned(
        b,
        ask(route, &pool, order, Some(sticky("s", 100)), T0 + 20 * SEC),
    )
    .await;
    assert_eq!(got, "m1");
    assert_eq!(
        a.sticky_counts(route, Some(T0 + 20 * SEC)).await.unwrap(),
        StickyCounts {
            bindings: 1,
            unbound: 0,
            moved: 2
        }
    );
    // Least-used: an excluded bound member is not offered.
    let route = "move-lu";
    let first = assigned(
        a,
        ask(route, &pool, Order::LeastUsed, Some(sticky("s", 100)), T0),
    )
    .await;
    let excluded = [first.as_str()];
    let moved = Assign {
        excluded: &excluded,
        ..ask(
            route,
            &pool,
            Order::LeastUsed,
            Some(sticky("s", 100)),
            T0 + 1,
        )
    };
    let second = assigned(b, moved).await;
    assert_ne!(second, first);
    let again = assigned(
        a,
        ask(
            route,
            &pool,
            Order::LeastUsed,
            Some(sticky("s", 100)),
            T0 + 2,
        ),
    )
    .await;
    assert_eq!(again, second);
}

/// At `max_bindings`, a new session is assigned all the same, unbound and counted; a session
/// already bound stays bound.
async fn a_full_table_leaves_new_sessions_unbound(a: &dyn StateStore, b: &dyn StateStore) {
    let pool = members(&["m1", "m2"]);
    let route = "full";
    let order = Order::LeastUsed;
    let s1 = assigned(a, ask(route, &pool, order, Some(sticky("s1", 1)), T0)).await;
    for step in 1..6u64 {
        let store = if step % 2 == 0 { a } else { b };
        // A new session: served by the policy (alternating), never refused.
        let s = Some(sticky("s2", 1));
        assigned(store, ask(route, &pool, order, s, T0 + 2 * step)).await;
        let s = Some(sticky("s1", 1));
        let got = assigned(store, ask(route, &pool, order, s, T0 + 2 * step + 1)).await;
        assert_eq!(got, s1, "step {step}");
    }
    assert_eq!(
        b.sticky_counts(route, Some(T0 + 20)).await.unwrap(),
        StickyCounts {
            bindings: 1,
            unbound: 5,
            moved: 0
        }
    );
    // Once s1's binding expires, s2 takes its place.
    let later = T0 + TTL + 100;
    let s2 = assigned(a, ask(route, &pool, order, Some(sticky("s2", 1)), later)).await;
    for step in 1..4u64 {
        let s = Some(sticky("s2", 1));
        let got = assigned(b, ask(route, &pool, order, s, later + step)).await;
        assert_eq!(got, s2);
    }
}

/// `unbind` drops the binding only while it points to the member named.
async fn unbind_drops_only_its_own_binding(a: &dyn StateStore, b: &dyn StateStore) {
    let pool = members(&["m1", "m2"]);
    let route = "unbind";
    let order = Order::Preference(&[0, 1]);
    assert_eq!(
        assigned(a, ask(route, &pool, order, Some(sticky("s", 100)), T0)).await,
        "m1"
    );
    b.unbind(route, "s", "m2").await.unwrap();
    let s = Some(sticky("s", 100));
    let got = assigned(b, ask(route, &pool, Order::Preference(&[1, 0]), s, T0 + 1)).await;
    assert_eq!(got, "m1", "a rebind on another member leaves the binding");
    b.unbind(route, "s", "m1").await.unwrap();
    let s = Some(sticky("s", 100));
    let got = assigned(a, ask(route, &pool, Order::Preference(&[1, 0]), s, T0 + 2)).await;
    assert_eq!(
        got, "m2",
        "unbound: the policy chooses, and the session is bound anew"
    );
    let s = Some(sticky("s", 100));
    let got = assigned(b, ask(route, &pool, order, s, T0 + 3)).await;
    assert_eq!(got, "m2");
    assert_eq!(
        a.sticky_counts(route, Some(T0 + 4)).await.unwrap(),
        StickyCounts {
            bindings: 1,
            unbound: 0,
            moved: 1
        }
    );
}

/// A call refused at the route's lease cap has still dropped expired bindings (a bounded
/// number a call), as the script does before it checks the cap: the next read finds what is
/// left of them, on both stores.
async fn a_call_at_a_cap_drops_expired_bindings(a: &dyn StateStore, b: &dyn StateStore) {
    let route = "sticky-capped";
    let pool = members(&["m1"]);
    let short = |session: &'static str| Sticky {
        session,
        ttl_us: SEC,
        max_bindings: 1_000,
    };
    let extra = 6;
    let sessions: Vec<&'static str> = (0..BINDINGS_EXPIRED_PER_CALL as u64 + extra)
        .map(|i| &*Box::leak(format!("s{i}").into_boxed_str()))
        .collect();
    for session in &sessions {
        assigned(
            a,
            ask(
                route,
                &pool,
                Order::Preference(&[0]),
                Some(short(session)),
                T0,
            ),
        )
        .await;
    }
    // The route at its cap of one lease, held for long.
    let lease = |id: &'static str| Lease {
        id,
        ttl_us: TTL,
        member_max: None,
        route_max: Some(1),
        client: None,
    };
    let leased = |id: &'static str, at: u64| Assign {
        lease: Some(lease(id)),
        ..ask(
            route,
            &pool,
            Order::Preference(&[0]),
            Some(short("later")),
            at,
        )
    };
    assigned(a, leased("l0", T0)).await;
    let at = T0 + 2 * SEC;
    assert!(matches!(
        b.assign(leased("l1", at)).await.unwrap(),
        Assignment::Concurrency { .. }
    ));
    // Every binding (the 70, and "later"'s) expired at T0 + 1 s. The refused call dropped
    // BINDINGS_EXPIRED_PER_CALL of them, and this read drops the other 7 (had the call dropped
    // none, the read would leave 7).
    assert_eq!(a.sticky_counts(route, Some(at)).await.unwrap().bindings, 0);
}

async fn suite(a: Arc<dyn StateStore>, b: Arc<dyn StateStore>) {
    a_session_stays_on_its_member(&*a, &*b).await;
    an_ineligible_member_moves_the_binding(&*a, &*b).await;
    a_full_table_leaves_new_sessions_unbound(&*a, &*b).await;
    unbind_drops_only_its_own_binding(&*a, &*b).await;
    a_call_at_a_cap_drops_expired_bindings(&*a, &*b).await;
}

fn redis_store(url: &str) -> Arc<dyn StateStore> {
    let connection = RedisConnection::new(url, Duration::from_secs(5)).unwrap();
    Arc::new(RedisStore::with_connection(Arc::new(connection), "sluice"))
}

#[tokio::test]
async fn memory_sticky() {
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    suite(store.clone(), store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sticky() {
    let server = RedisServer::start();
    suite(redis_store(&server.url()), redis_store(&server.url())).await;
    // The keys live as long as their longest binding, and a minute more.
    let ttl = server.integer(&["PTTL", "sluice:{full}:sz"]).unwrap();
    assert!(ttl > 600_000 && ttl <= 660_000, "{ttl}");
}

/// Every sticky key expires, whichever of them Redis deleted and a later call made anew: the
/// bindings go empty (deleted) while the counters live on with an expiry as long as theirs or
/// longer (a route whose bindings lasted longer before a reload), and an unbind may make the
/// counters anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sticky_keys_always_expire() {
    let server = RedisServer::start();
    let store = redis_store(&server.url());
    let pool = members(&["m1", "m2"]);
    let (route, order) = ("reborn", Order::LeastUsed);
    let pttl = |key: &str| server.integer(&["PTTL", &format!("sluice:{{reborn}}:{key}")]);
    assigned(&*store, ask(route, &pool, order, Some(sticky("s1", 1)), T0)).await;
    // The table is full: s2 goes unbound, which makes the counters.
    assigned(
        &*store,
        ask(route, &pool, order, Some(sticky("s2", 1)), T0 + 1),
    )
    .await;
    server
        .command(&["PEXPIRE", "sluice:{reborn}:sc", "36000000"])
        .unwrap();
    // s1's binding is over: dropping it empties the bindings, and s3's bind makes them anew.
    let later = T0 + TTL + 100;
    let s3 = assigned(
        &*store,
        ask(route, &pool, order, Some(sticky("s3", 1)), later),
    )
    .await;
    for key in ["sz", "sh", "sc"] {
        let ttl = pttl(key).unwrap();
        assert!(ttl > 0, "{key} has no expiry: {ttl}");
    }
    // An unbind counts a move, making the counters anew if they were gone.
    server.command(&["DEL", "sluice:{reborn}:sc"]).unwrap();
    store.unbind(route, "s3", &s3).await.unwrap();
    let ttl = pttl("sc").unwrap();
    assert!(
        ttl > 0,
        "the counters made by an unbind have no expiry: {ttl}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sticky_without_functions() {
    let server = RedisServer::start();
    let url = server.url_without_functions();
    suite(redis_store(&url), redis_store(&url)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_sticky() {
    let cluster = RedisCluster::start();
    let store = || -> Arc<dyn StateStore> {
        let connection = RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap();
        Arc::new(RedisStore::with_connection(Arc::new(connection), "sluice"))
    };
    suite(store(), store()).await;
}
