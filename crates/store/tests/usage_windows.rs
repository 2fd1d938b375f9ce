//! Windows that hold amounts: reservations charged at admission, each window its own amount,
//! and settlements that rewrite the same entry in place. One suite for every store: memory,
//! Redis (with and without functions) and Redis Cluster.

use std::sync::Arc;
use std::time::Duration;

use sluice_allocator::{
    Assign, Assignment, MemberUsage, MemoryStore, Order, PoolMember, StateStore, Usage,
};
use sluice_limiter::{
    Acquire, ClientWindows, EntryId, Owner, Period, Reserve, Settle, Settled, Window, WindowUsage,
    MAX_AMOUNT,
};
use sluice_store::{RedisStore, RedisStoreConfig};
use sluice_testkit::{RedisCluster, RedisServer};

const MINUTE: u64 = 60_000_000;

/// A route's windows as a usage quota has them: requests per minute, and tokens per minute in
/// millionths.
fn windows() -> Vec<Window> {
    vec![
        Window {
            name: "rpm".into(),
            limit: 10,
            length_us: MINUTE,
        },
        Window {
            name: "tpm".into(),
            limit: 1_000_000_000,
            length_us: MINUTE,
        },
    ]
}

/// Tokens, in millionths.
const fn tokens(n: u64) -> u64 {
    n * 1_000_000
}

fn redis_store(url: &str) -> RedisStore {
    RedisStore::new(RedisStoreConfig {
        url: url.into(),
        key_prefix: "sluice".into(),
        timeout: Duration::from_secs(5),
    })
    .unwrap()
}

fn cluster_store(cluster: &RedisCluster) -> RedisStore {
    let connection =
        sluice_store::RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap();
    RedisStore::with_connection(Arc::new(connection), "sluice")
}

/// What is left in each window of `key`, read without charging anything.
async fn remaining(
    store: &dyn StateStore,
    route: &str,
    key: &str,
    w: &[Window],
    at: impl Into<Option<u64>>,
) -> Vec<u64> {
    store
        .acquire(Acquire {
            route,
            key,
            windows: w,
            cost: 0,
            at_us: at.into(),
            client: None,
        })
        .await
        .unwrap()
        .windows
        .iter()
        .map(|s| s.remaining)
        .collect()
}

async fn reserve(
    store: &dyn StateStore,
    route: &str,
    key: &str,
    w: &[Window],
    amounts: &[u64],
    at: u64,
) -> sluice_limiter::Reservation {
    store
        .reserve(Reserve {
            route,
            key,
            windows: w,
            amounts,
            at_us: Some(at),
            periods: &[],
        })
        .await
        .unwrap()
}

// One argument per field of the settlement it sends, so that each call reads as one line.
#[allow(clippy::too_many_arguments)]
async fn settle_one(
    store: &dyn StateStore,
    route: &str,
    key: &str,
    w: &[Window],
    entry: EntryId,
    reserved: &[u64],
    settled: &[u64],
    at: u64,
) -> Vec<Settled> {
    let mut done = store
        .settle(
            route,
            &[Settle {
                key,
                windows: w,
                entry,
                reserved,
                settled,
                periods: &[],
                owner: Owner::Route,
            }],
            Some(at),
        )
        .await
        .unwrap();
    assert_eq!(done.len(), 1);
    done.remove(0)
}

/// Reserve, refuse what does not fit beside what the window holds, settle down and up, overrun,
/// and settle late: the same answers from every store.
async fn scenarios(store: &dyn StateStore, route: &str) {
    let w = windows();
    let t0 = 1_000_000_000_000u64;
    let first = reserve(store, route, "team", &w, &[1, tokens(600)], t0).await;
    assert!(first.outcome.admitted);
    let open = |total, open| WindowUsage { total, open };
    assert_eq!(
        store
            .usage(route, Owner::Route, "team", &w, Some(t0 + 1))
            .await
            .unwrap(),
        [open(1, 1), open(tokens(600), tokens(600))],
        "all of it an open reservation"
    );
    let e1 = first.entry.expect("an admitted reservation has an entry");
    assert_eq!(e1.at_us, t0);
    assert_eq!(
        first
            .outcome
            .windows
            .iter()
            .map(|s| s.remaining)
            .collect::<Vec<_>>(),
        [9, tokens(400)],
        "each window is charged its own amount"
    );
    // 500 tokens do not fit beside the 600 reserved: refused, until the first leaves.
    let refused = reserve(store, route, "team", &w, &[1, tokens(500)], t0 + 10).await;
    assert!(!refused.outcome.admitted);
    assert_eq!(refused.entry, None);
    assert_eq!(refused.outcome.retry_after_us, MINUTE - 10);
    assert_eq!(
        remaining(store, route, "team", &w, t0 + 20).await,
        [9, tokens(400)]
    );

    // The answer used 100 tokens: the same entry now holds 100, and the total with it.
    let done = settle_one(
        store,
        route,
        "team",
        &w,
        e1,
        &[1, tokens(600)],
        &[1, tokens(100)],
        t0 + 30,
    )
    .await;
    assert_eq!(done, [Settled::Done, Settled::Done]);
    assert_eq!(
        store
            .usage(route, Owner::Route, "team", &w, Some(t0 + 31))
            .await
            .unwrap(),
        [open(1, 0), open(tokens(100), 0)],
        "settled: nothing open"
    );
    assert_eq!(
        remaining(store, route, "team", &w, t0 + 40).await,
        [9, tokens(900)]
    );
    // A settlement of an entry already settled changes nothing.
    let again = settle_one(
        store,
        route,
        "team",
        &w,
        e1,
        &[1, tokens(600)],
        &[1, tokens(50)],
        t0 + 45,
    )
    .await;
    assert_eq!(again, [Settled::Gone, Settled::Gone]);
    assert_eq!(
        remaining(store, route, "team", &w, t0 + 46).await,
        [9, tokens(900)]
    );

    // Now 500 fits.
    let second = reserve(store, route, "team", &w, &[1, tokens(500)], t0 + 50).await;
    assert!(second.outcome.admitted);
    let e2 = second.entry.unwrap();
    assert_ne!(e2, e1);
    // Its answer used 1,200 tokens: recorded, past the limit, and said so.
    let over = settle_one(
        store,
        route,
        "team",
        &w,
        e2,
        &[1, tokens(500)],
        &[1, tokens(1_200)],
        t0 + 60,
    )
    .await;
    assert_eq!(over, [Settled::Done, Settled::Overrun]);
    assert_eq!(remaining(store, route, "team", &w, t0 + 70).await, [8, 0]);
    // The window admits nothing, not even a reservation of 0, until it slides back under.
    let full = reserve(store, route, "team", &w, &[1, 0], t0 + 80).await;
    assert!(!full.outcome.admitted);
    assert_eq!(
        full.outcome.retry_after_us,
        MINUTE - 80 + 50,
        "until the entry that took it over leaves"
    );
    let slid = reserve(store, route, "team", &w, &[1, 0], t0 + 50 + MINUTE).await;
    assert!(slid.outcome.admitted, "{slid:?}");

    // A settlement whose entry left its window changes nothing, even to a larger amount.
    let third = reserve(store, route, "late", &w, &[1, tokens(10)], t0).await;
    let e3 = third.entry.unwrap();
    let late = settle_one(
        store,
        route,
        "late",
        &w,
        e3,
        &[1, tokens(10)],
        &[1, tokens(900)],
        t0 + MINUTE,
    )
    .await;
    assert_eq!(late, [Settled::Gone, Settled::Gone]);
    let fresh = reserve(store, route, "late", &w, &[1, tokens(1_000)], t0 + MINUTE).await;
    assert!(
        fresh.outcome.admitted,
        "the late settlement charged nothing"
    );
    // The reservation that left its window unsettled left what is open too.
    assert_eq!(
        store
            .usage(route, Owner::Route, "late", &w, Some(t0 + MINUTE))
            .await
            .unwrap()[1],
        WindowUsage {
            total: tokens(1_000),
            open: tokens(1_000)
        }
    );

    // Settling to 0 (no member answered, or one answered a 429) gives everything back.
    let fourth = reserve(store, route, "zero", &w, &[1, tokens(1_000)], t0).await;
    let e4 = fourth.entry.unwrap();
    let zero = settle_one(
        store,
        route,
        "zero",
        &w,
        e4,
        &[1, tokens(1_000)],
        &[0, 0],
        t0 + 1,
    )
    .await;
    assert_eq!(zero, [Settled::Done, Settled::Done]);
    assert_eq!(
        remaining(store, route, "zero", &w, t0 + 2).await,
        [10, tokens(1_000)]
    );

    // A wrong number of amounts is an error, never a guess.
    assert!(store
        .reserve(Reserve {
            route,
            key: "team",
            windows: &w,
            amounts: &[1],
            at_us: Some(t0),
            periods: &[],
        })
        .await
        .is_err());

    // A usage far past any limit (a huge number read from an answer) is recorded, capped.
    let fifth = reserve(store, route, "huge", &w, &[1, 1], t0).await;
    let e5 = fifth.entry.unwrap();
    let huge = settle_one(
        store,
        route,
        "huge",
        &w,
        e5,
        &[1, 1],
        &[1, u64::MAX],
        t0 + 1,
    )
    .await;
    assert_eq!(huge, [Settled::Done, Settled::Overrun]);
    let after = reserve(store, route, "huge", &w, &[1, 0], t0 + 2).await;
    assert!(!after.outcome.admitted);
    // An entry settles once: a second settlement finds nothing to change.
    let back = settle_one(
        store,
        route,
        "huge",
        &w,
        e5,
        &[1, MAX_AMOUNT],
        &[1, 1],
        t0 + 3,
    )
    .await;
    assert_eq!(back, [Settled::Gone, Settled::Gone]);
}

/// Many settlements, of several keys and one with no windows, in one call.
async fn batched(store: &dyn StateStore, route: &str) {
    let w = windows();
    let t0 = 2_000_000_000_000u64;
    let keys = ["a", "b", "c", "a", "b"];
    let mut entries = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let r = reserve(store, route, key, &w, &[1, tokens(100)], t0 + i as u64).await;
        entries.push(r.entry.unwrap());
    }
    let reserved = [1, tokens(100)];
    let settled: Vec<[u64; 2]> = (0..keys.len())
        .map(|i| [1, tokens(10 * (i as u64 + 1))])
        .collect();
    let mut batch: Vec<Settle<'_>> = keys
        .iter()
        .zip(&entries)
        .zip(&settled)
        .map(|((key, &entry), settled)| Settle {
            key,
            windows: &w,
            entry,
            reserved: &reserved,
            settled,
            periods: &[],
            owner: Owner::Route,
        })
        .collect();
    batch.insert(
        2,
        Settle {
            key: "none",
            windows: &[],
            entry: entries[0],
            reserved: &[],
            settled: &[],
            periods: &[],
            owner: Owner::Route,
        },
    );
    let done = store.settle(route, &batch, Some(t0 + 100)).await.unwrap();
    assert_eq!(done.len(), 6);
    assert_eq!(done[2], Vec::<Settled>::new());
    for (i, d) in done.iter().enumerate().filter(|&(i, _)| i != 2) {
        assert_eq!(d, &[Settled::Done, Settled::Done], "settlement {i}");
    }
    // a: 10 + 40, b: 20 + 50, c: 30.
    for (key, used) in [("a", 50), ("b", 70), ("c", 30)] {
        assert_eq!(
            remaining(store, route, key, &w, t0 + 200).await[1],
            tokens(1_000 - used),
            "{key}"
        );
    }
}

/// Settlements of one key in a row share the key's read and write in the store: each still
/// settles its own entry, one past the limit is an overrun, and an entry named twice settles
/// once.
async fn batched_one_key(store: &dyn StateStore, route: &str) {
    let w = windows();
    let t0 = 2_000_000_000_000u64;
    let mut entries = Vec::new();
    for i in 0..4u64 {
        let r = reserve(store, route, "k", &w, &[1, tokens(100)], t0 + i).await;
        entries.push(r.entry.unwrap());
    }
    let reserved = [1, tokens(100)];
    let settled = [
        [1, tokens(10)],
        [1, tokens(20)],
        [1, tokens(30)],
        [1, tokens(1_000)],
    ];
    let mut batch: Vec<Settle<'_>> = entries
        .iter()
        .zip(&settled)
        .map(|(&entry, settled)| Settle {
            key: "k",
            windows: &w,
            entry,
            reserved: &reserved,
            settled,
            periods: &[],
            owner: Owner::Route,
        })
        .collect();
    batch.insert(1, batch[0]);
    let done = store.settle(route, &batch, Some(t0 + 100)).await.unwrap();
    let d = [Settled::Done, Settled::Done];
    let gone = [Settled::Gone, Settled::Gone];
    assert_eq!(done[0], d);
    assert_eq!(done[1], gone, "named twice, settled once");
    assert_eq!(done[2], d);
    assert_eq!(done[3], d);
    // 10 + 20 + 30 + 1,000 tokens: past the limit of 1,000.
    assert_eq!(done[4], [Settled::Done, Settled::Overrun]);
    assert_eq!(remaining(store, route, "k", &w, t0 + 200).await[1], 0);
    let usage = store
        .usage(route, Owner::Route, "k", &w, Some(t0 + 200))
        .await
        .unwrap();
    assert_eq!(usage[1].total, tokens(1_060));
    assert_eq!(usage[1].open, 0);
}

const DAY: u64 = 86_400_000_000;

/// A calendar day as the caller cuts it (here UTC), and the window that counts in it: a fixed
/// window's length is its period's span.
fn day(start_us: u64, limit: u64) -> (Window, Period) {
    let period = Period {
        start_us,
        end_us: start_us + DAY,
    };
    let window = Window {
        name: "day".into(),
        limit,
        length_us: sluice_limiter::span(&period),
    };
    (window, period)
}

/// A fixed (calendar) window beside a sliding one: everything reserved in the period counts until
/// its end and not after, a refusal waits exactly for the boundary, and a settlement goes into the
/// period of its admission, or nowhere once that period is over.
async fn calendar(store: &dyn StateStore, route: &str) {
    // Midnight, 2026-12-04, UTC.
    let d = 1_796_342_400_000_000u64;
    let e = d + DAY;
    let (today, p1) = day(d, tokens(1_000));
    let rpm = windows().remove(0);
    let w = [rpm.clone(), today.clone()];
    let first_periods = [None, Some(p1)];
    let reserve_at = |amounts: [u64; 2], at: u64, periods: [Option<Period>; 2]| {
        let w = w.clone();
        async move {
            store
                .reserve(Reserve {
                    route,
                    key: "team",
                    windows: &w,
                    amounts: &amounts,
                    at_us: Some(at),
                    periods: &periods,
                })
                .await
                .unwrap()
        }
    };
    let t1 = d + 10 * 3_600_000_000;
    let r1 = reserve_at([1, tokens(600)], t1, first_periods).await;
    assert!(r1.outcome.admitted);
    assert_eq!(r1.outcome.windows[1].remaining, tokens(400));
    assert_eq!(
        r1.outcome.windows[1].reset_us,
        e - t1,
        "the day resets at its end"
    );
    let e1 = r1.entry.unwrap();
    assert_eq!(e1.at_us, t1, "the entry's time is the admission's");
    // A millisecond before midnight, 500 do not fit: retry exactly at the boundary.
    let late = reserve_at([1, tokens(500)], e - 1_000, first_periods).await;
    assert!(!late.outcome.admitted);
    assert_eq!(late.outcome.retry_after_us, 1_000);
    // Settled within the day: the day's total follows (the minute window's entry left it long
    // ago).
    let settle = |entry: EntryId,
                  reserved: [u64; 2],
                  settled: [u64; 2],
                  at: u64,
                  periods: [Option<Period>; 2]| {
        let w = w.clone();
        async move {
            store
                .settle(
                    route,
                    &[Settle {
                        key: "team",
                        windows: &w,
                        entry,
                        reserved: &reserved,
                        settled: &settled,
                        periods: &periods,
                        owner: Owner::Route,
                    }],
                    Some(at),
                )
                .await
                .unwrap()
                .remove(0)
        }
    };
    let done = settle(
        e1,
        [1, tokens(600)],
        [1, tokens(900)],
        e - 500,
        first_periods,
    )
    .await;
    assert_eq!(done, [Settled::Gone, Settled::Done]);
    // A read (cost 0, which knows no periods) sees the day as it is, and then the new day.
    assert_eq!(
        remaining(store, route, "team", &w, e - 400).await[1],
        tokens(100)
    );
    assert_eq!(
        remaining(store, route, "team", &w, e).await[1],
        tokens(1_000)
    );
    // At midnight the new day admits its whole limit.
    let (_, p2) = day(e, tokens(1_000));
    let second_periods = [None, Some(p2)];
    let r2 = reserve_at([1, tokens(1_000)], e, second_periods).await;
    assert!(r2.outcome.admitted, "{r2:?}");
    let e2 = r2.entry.unwrap();
    // The first day's entry settles no more: its period is over, and the new day is untouched.
    let gone = settle(e1, [1, tokens(900)], [1, tokens(10)], e + 5, first_periods).await;
    assert_eq!(gone, [Settled::Gone, Settled::Gone]);
    assert_eq!(remaining(store, route, "team", &w, e + 6).await[1], 0);
    // The new day's entry settles into the new day.
    let done = settle(
        e2,
        [1, tokens(1_000)],
        [1, tokens(200)],
        e + 10,
        second_periods,
    )
    .await;
    assert_eq!(done, [Settled::Done, Settled::Done]);
    assert_eq!(
        remaining(store, route, "team", &w, e + 11).await[1],
        tokens(800)
    );
    // A period whose span is not the window's length is refused, never guessed at.
    let wrong = [
        None,
        Some(Period {
            start_us: e,
            end_us: e + 2 * DAY,
        }),
    ];
    assert!(store
        .reserve(Reserve {
            route,
            key: "team",
            windows: &w,
            amounts: &[1, 1],
            at_us: Some(e + 12),
            periods: &wrong,
        })
        .await
        .is_err());
}

/// Calendar months of different lengths, in UTC: what February reserved leaves exactly at
/// February's end, though March is longer (a store that kept February's entries for March's
/// length would refuse the first three days of March for a budget already reset), and March's
/// count until March's end.
async fn calendar_months(store: &dyn StateStore, route: &str) {
    let feb = Period {
        start_us: 1_769_904_000_000_000,
        end_us: 1_772_323_200_000_000,
    };
    let mar = Period {
        start_us: feb.end_us,
        end_us: 1_775_001_600_000_000,
    };
    let apr = Period {
        start_us: mar.end_us,
        end_us: 1_777_593_600_000_000,
    };
    let month = Window {
        name: "month".into(),
        limit: tokens(1_000),
        length_us: sluice_limiter::span(&feb),
    };
    for p in [&mar, &apr] {
        assert_eq!(sluice_limiter::span(p), month.length_us, "one span a month");
    }
    let w = [month];
    let reserve_in = |amount: u64, at: u64, period: Period| {
        let w = w.clone();
        async move {
            store
                .reserve(Reserve {
                    route,
                    key: "month",
                    windows: &w,
                    amounts: &[amount],
                    at_us: Some(at),
                    periods: &[Some(period)],
                })
                .await
                .unwrap()
        }
    };
    let r = reserve_in(tokens(1_000), feb.start_us + DAY, feb).await;
    assert!(r.outcome.admitted, "{r:?}");
    assert_eq!(
        r.outcome.windows[0].reset_us,
        feb.end_us - feb.start_us - DAY
    );
    let full = reserve_in(1, feb.end_us - 1_000, feb).await;
    assert!(!full.outcome.admitted);
    assert_eq!(
        full.outcome.retry_after_us, 1_000,
        "February ends at March's start"
    );
    // The 1st of March: February's budget is gone from the count, read and reserved alike.
    assert_eq!(
        remaining(store, route, "month", &w, mar.start_us + 1).await,
        [tokens(1_000)]
    );
    let r = reserve_in(tokens(1_000), mar.start_us + 2, mar).await;
    assert!(r.outcome.admitted, "{r:?}");
    // March's own entries count to its last microsecond, and leave at its end.
    let full = reserve_in(1, mar.end_us - 1_000, mar).await;
    assert!(!full.outcome.admitted);
    assert_eq!(full.outcome.retry_after_us, 1_000);
    assert_eq!(
        remaining(store, route, "month", &w, mar.end_us - 1).await,
        [0]
    );
    let r = reserve_in(tokens(1_000), apr.start_us, apr).await;
    assert!(r.outcome.admitted, "{r:?}");
}

/// A key pool whose keys have their own token windows (a provider's TPM per key): least_used
/// takes a member whose windows admit the reservation, reserves the route's windows and the
/// member's in one step, and both entries settle in one call.
async fn key_pool(store: &dyn StateStore, route: &str) {
    let tpm = |limit| Window {
        name: "tpm".into(),
        limit,
        length_us: MINUTE,
    };
    let members = [
        PoolMember {
            id: "key-a".into(),
            windows: Arc::new([tpm(tokens(1_000))]),
        },
        PoolMember {
            id: "key-b".into(),
            windows: Arc::new([tpm(tokens(1_000))]),
        },
    ];
    let route_windows = [tpm(tokens(10_000))];
    let t0 = 3_000_000_000_000u64;
    let ask = |amount: u64, at: u64| {
        let route_windows = route_windows.clone();
        let members = members.clone();
        async move {
            let each = [amount];
            let usage = [
                MemberUsage {
                    amounts: &each,
                    periods: &[],
                },
                MemberUsage {
                    amounts: &each,
                    periods: &[],
                },
            ];
            store
                .assign_reserve(
                    Assign {
                        route,
                        members: &members,
                        order: Order::LeastUsed,
                        excluded: &[],
                        quota: Some(Acquire {
                            route,
                            key: "route",
                            windows: &route_windows,
                            cost: 1,
                            at_us: Some(at),
                            client: None,
                        }),
                        cost: 1,
                        cooldowns: false,
                        at_us: Some(at),
                        lease: None,
                        sticky: None,
                    },
                    Usage {
                        route: &each,
                        route_periods: &[],
                        members: &usage,
                        client: &[],
                        client_periods: &[],
                    },
                )
                .await
                .unwrap()
        }
    };
    let chosen = |r: &sluice_allocator::Reserved| match &r.assignment {
        Assignment::Assigned { member, .. } => member.clone(),
        other => panic!("not assigned: {other:?}"),
    };
    let first = ask(tokens(600), t0).await;
    assert_eq!(chosen(&first), "key-a");
    let (r1, m1) = (first.route.unwrap(), first.member.unwrap());
    let second = ask(tokens(600), t0 + 1).await;
    assert_eq!(chosen(&second), "key-b");
    let m2 = second.member.unwrap();
    // Neither key has 500 left: busy, and nothing is charged anywhere.
    let busy = ask(tokens(500), t0 + 2).await;
    assert!(
        matches!(busy.assignment, Assignment::Busy { retry_after_us, .. } if retry_after_us == MINUTE - 2),
        "{busy:?}"
    );
    assert_eq!((busy.route, busy.member), (None, None));
    assert_eq!(
        remaining(store, route, "route", &route_windows, t0 + 3).await,
        [tokens(8_800)]
    );
    // key-b's answer used 100: settled with the route's entry of the first request, in one call.
    let reserved = [tokens(600)];
    let done = store
        .settle(
            route,
            &[
                Settle {
                    key: "key-b",
                    windows: &members[1].windows,
                    entry: m2,
                    reserved: &reserved,
                    settled: &[tokens(100)],
                    periods: &[],
                    owner: Owner::Member,
                },
                Settle {
                    key: "route",
                    windows: &route_windows,
                    entry: r1,
                    reserved: &reserved,
                    settled: &[tokens(50)],
                    periods: &[],
                    owner: Owner::Route,
                },
            ],
            Some(t0 + 4),
        )
        .await
        .unwrap();
    assert_eq!(done, [vec![Settled::Done], vec![Settled::Done]]);
    assert_eq!(
        remaining(store, route, "route", &route_windows, t0 + 5).await,
        [tokens(9_350)]
    );
    // Both keys have one request: key-a comes first on the tie, but only key-b's windows admit
    // 500 now.
    let third = ask(tokens(500), t0 + 6).await;
    assert_eq!(chosen(&third), "key-b", "{third:?}");
    // key-a's entry is a member's: settling it as the route's finds nothing.
    let wrong = store
        .settle(
            route,
            &[Settle {
                key: "key-a",
                windows: &members[0].windows,
                entry: m1,
                reserved: &reserved,
                settled: &[0],
                periods: &[],
                owner: Owner::Route,
            }],
            Some(t0 + 7),
        )
        .await
        .unwrap();
    assert_eq!(wrong, [vec![Settled::Gone]]);
}

/// A client's own token window on a key-pool route: reserved with the route's and the member's
/// in one step (on Redis Cluster, first and given back when nobody is assigned), refusing what
/// does not fit beside what it holds, and settled with the others.
async fn client_usage(store: &dyn StateStore, route: &str) {
    let tpm = |limit| Window {
        name: "tpm".into(),
        limit,
        length_us: MINUTE,
    };
    let members = [PoolMember {
        id: "key-a".into(),
        windows: Arc::new([tpm(tokens(1_000))]),
    }];
    let route_windows = [tpm(tokens(10_000))];
    let client_windows = [tpm(tokens(700))];
    // A client's windows count on every route it uses: one client per run of this scenario.
    let name = format!("billing-{route}");
    let name = name.as_str();
    let t0 = 4_000_000_000_000u64;
    let ask = |amount: u64, at: u64, excluded: &'static [&'static str]| {
        let (route_windows, client_windows, members) = (
            route_windows.clone(),
            client_windows.clone(),
            members.clone(),
        );
        async move {
            let each = [amount];
            let usage = [MemberUsage {
                amounts: &each,
                periods: &[],
            }];
            store
                .assign_reserve(
                    Assign {
                        route,
                        members: &members,
                        order: Order::LeastUsed,
                        excluded,
                        quota: Some(Acquire {
                            route,
                            key: "route",
                            windows: &route_windows,
                            cost: 1,
                            at_us: Some(at),
                            client: Some(ClientWindows {
                                name,
                                windows: &client_windows,
                            }),
                        }),
                        cost: 1,
                        cooldowns: false,
                        at_us: Some(at),
                        lease: None,
                        sticky: None,
                    },
                    Usage {
                        route: &each,
                        route_periods: &[],
                        members: &usage,
                        client: &each,
                        client_periods: &[],
                    },
                )
                .await
                .unwrap()
        }
    };
    let first = ask(tokens(400), t0, &[]).await;
    assert!(
        matches!(first.assignment, Assignment::Assigned { .. }),
        "{first:?}"
    );
    let client_entry = first.client.expect("the client's entry");
    assert!(first.route.is_some() && first.member.is_some());
    // The client holds 400 of 700: 400 more do not fit, whatever the route and key have left.
    let refused = ask(tokens(400), t0 + 1, &[]).await;
    assert!(
        matches!(&refused.assignment, Assignment::QuotaRefused(o) if o.retry_after_us == MINUTE - 1),
        "{refused:?}"
    );
    assert_eq!(
        (refused.route, refused.client, refused.member),
        (None, None, None)
    );
    // Nobody to assign (the only key excluded): the client's charge is not kept.
    let nobody = ask(tokens(100), t0 + 2, &["key-a"]).await;
    assert!(
        matches!(nobody.assignment, Assignment::NoMember { .. }),
        "{nobody:?}"
    );
    // Settled to 100: now 500 fit.
    let done = store
        .settle(
            route,
            &[Settle {
                key: name,
                windows: &client_windows,
                entry: client_entry,
                reserved: &[tokens(400)],
                settled: &[tokens(100)],
                periods: &[],
                owner: Owner::Client,
            }],
            Some(t0 + 3),
        )
        .await
        .unwrap();
    assert_eq!(done, [vec![Settled::Done]]);
    let after = ask(tokens(500), t0 + 4, &[]).await;
    assert!(
        matches!(after.assignment, Assignment::Assigned { .. }),
        "{after:?}"
    );
    // 100 + 500 of 700: 100 left, exactly, which also says the refused and unassigned
    // requests took nothing.
    let last = ask(tokens(100), t0 + 5, &[]).await;
    assert!(
        matches!(last.assignment, Assignment::Assigned { .. }),
        "{last:?}"
    );
    let over = ask(1, t0 + 6, &[]).await;
    assert!(
        matches!(over.assignment, Assignment::QuotaRefused(_)),
        "{over:?}"
    );
}

/// A member chosen in process (round robin, priority) is reserved for as a preference of one:
/// the route's and the client's windows reserve in the same step, and a refusal charges nothing.
async fn in_process_choice(store: &dyn StateStore, route: &str) {
    let tpm = |limit| Window {
        name: "tpm".into(),
        limit,
        length_us: MINUTE,
    };
    let members = [PoolMember::new("only")];
    let route_windows = [tpm(tokens(500))];
    let client_windows = [tpm(tokens(10_000))];
    let name = format!("solo-{route}");
    let t0 = 6_000_000_000_000u64;
    let ask = |amount: u64, at: u64| {
        let each = [amount];
        let (members, route_windows, client_windows, name) = (
            members.clone(),
            route_windows.clone(),
            client_windows.clone(),
            name.clone(),
        );
        async move {
            store
                .assign_reserve(
                    Assign {
                        route,
                        members: &members,
                        order: Order::Preference(&[0]),
                        excluded: &[],
                        quota: Some(Acquire {
                            route,
                            key: "route",
                            windows: &route_windows,
                            cost: 1,
                            at_us: Some(at),
                            client: Some(ClientWindows {
                                name: &name,
                                windows: &client_windows,
                            }),
                        }),
                        cost: 1,
                        cooldowns: false,
                        at_us: Some(at),
                        lease: None,
                        sticky: None,
                    },
                    Usage {
                        route: &each,
                        route_periods: &[],
                        members: &[],
                        client: &each,
                        client_periods: &[],
                    },
                )
                .await
                .unwrap()
        }
    };
    let first = ask(tokens(400), t0).await;
    assert!(
        matches!(first.assignment, Assignment::Assigned { .. }),
        "{first:?}"
    );
    assert!(first.route.is_some() && first.client.is_some() && first.member.is_none());
    let refused = ask(tokens(200), t0 + 1).await;
    assert!(
        matches!(refused.assignment, Assignment::QuotaRefused(_)),
        "{refused:?}"
    );
    assert_eq!(
        store
            .usage(route, Owner::Client, &name, &client_windows, Some(t0 + 2))
            .await
            .unwrap(),
        [WindowUsage {
            total: tokens(400),
            open: tokens(400)
        }],
        "the route's refusal charged the client nothing"
    );
}

#[tokio::test]
async fn memory_reserves_and_settles() {
    let store = MemoryStore::new();
    scenarios(&store, "usage").await;
    batched(&store, "usage").await;
    batched_one_key(&store, "usage1").await;
    calendar(&store, "calendar").await;
    calendar_months(&store, "months").await;
    key_pool(&store, "pool").await;
    client_usage(&store, "clients").await;
    in_process_choice(&store, "solo").await;
}

#[tokio::test]
async fn redis_reserves_and_settles() {
    let server = RedisServer::start();
    let store = redis_store(&server.url());
    scenarios(&store, "usage").await;
    batched(&store, "usage").await;
    batched_one_key(&store, "usage1").await;
    calendar(&store, "calendar").await;
    calendar_months(&store, "months").await;
    key_pool(&store, "pool").await;
    client_usage(&store, "clients").await;
    in_process_choice(&store, "solo").await;
    // The helper hash lost (evicted, deleted): what is open is counted again from the log.
    let w = windows();
    let lost = reserve(&store, "usage", "lost", &w, &[1, tokens(300)], 9_000_000).await;
    assert!(lost.outcome.admitted);
    assert_eq!(server.integer(&["DEL", "sluice:{usage}:qm:lost"]), Some(1));
    assert_eq!(
        store
            .usage("usage", Owner::Route, "lost", &w, Some(9_000_001))
            .await
            .unwrap(),
        [
            WindowUsage { total: 1, open: 1 },
            WindowUsage {
                total: tokens(300),
                open: tokens(300)
            }
        ]
    );
    let again = reserve(&store, "usage", "lost", &w, &[1, tokens(100)], 9_000_002).await;
    assert_eq!(again.outcome.windows[1].remaining, tokens(600));
    assert_eq!(
        store
            .usage("usage", Owner::Route, "lost", &w, Some(9_000_003))
            .await
            .unwrap()[1],
        WindowUsage {
            total: tokens(400),
            open: tokens(400)
        }
    );
    // A batch of settlements is one call.
    let before = server.command_calls("fcall");
    batched(&store, "usage2").await;
    let reserves_and_reads = 5 + 3;
    assert_eq!(
        server.command_calls("fcall") - before,
        reserves_and_reads + 1,
        "five settlements, one call"
    );
    assert_eq!(server.command_calls("evalsha"), 0);
}

#[tokio::test]
async fn redis_without_functions_reserves_and_settles() {
    let server = RedisServer::start();
    let store = redis_store(&server.url_without_functions());
    scenarios(&store, "usage").await;
    batched(&store, "usage").await;
    batched_one_key(&store, "usage1").await;
    calendar(&store, "calendar").await;
    calendar_months(&store, "months").await;
    key_pool(&store, "pool").await;
    client_usage(&store, "clients").await;
    assert!(!store.uses_functions());
}

#[tokio::test]
async fn redis_cluster_reserves_and_settles() {
    let cluster = RedisCluster::start();
    let store = cluster_store(&cluster);
    for route in ["usage", "other", "third"] {
        scenarios(&store, route).await;
        batched(&store, route).await;
        batched_one_key(&store, &format!("{route}-one")).await;
        calendar(&store, route).await;
        calendar_months(&store, &format!("{route}-months")).await;
        key_pool(&store, route).await;
        // A pool of its own: the key pool above left two members in the route's.
        client_usage(&store, &format!("{route}-clients")).await;
        in_process_choice(&store, &format!("{route}-solo")).await;
    }
}

/// Settlements that come due together share one call, as admissions do: requests settling at
/// once (each its own `settle`) on one route are one script call, and each gets its own states.
#[tokio::test]
async fn redis_settlements_that_come_due_together_share_a_call() {
    let server = RedisServer::start();
    let store = Arc::new(redis_store(&server.url()));
    let w: Arc<[Window]> = windows().into();
    let t0 = 5_000_000_000_000u64;
    let mut entries = Vec::new();
    for i in 0..10u64 {
        let r = reserve(&*store, "together", "team", &w, &[1, tokens(10)], t0 + i).await;
        entries.push(r.entry.unwrap());
    }
    let before = server.command_calls("fcall");
    // On this test's one thread, every task queues its settlement before any call leaves.
    let mut tasks = tokio::task::JoinSet::new();
    for (i, entry) in entries.into_iter().enumerate() {
        let (store, w) = (store.clone(), w.clone());
        tasks.spawn(async move {
            let settled = [1, tokens(i as u64)];
            store
                .settle(
                    "together",
                    &[Settle {
                        key: "team",
                        windows: &w,
                        entry,
                        reserved: &[1, tokens(10)],
                        settled: &settled,
                        periods: &[],
                        owner: Owner::Route,
                    }],
                    Some(t0 + 100),
                )
                .await
                .unwrap()
        });
    }
    while let Some(done) = tasks.join_next().await {
        assert_eq!(done.unwrap(), [vec![Settled::Done, Settled::Done]]);
    }
    assert_eq!(
        server.command_calls("fcall") - before,
        1,
        "ten settlements, one call"
    );
    // 0 + 1 + ... + 9 tokens settled.
    assert_eq!(
        remaining(&*store, "together", "team", &w, t0 + 200).await[1],
        tokens(1_000 - 45)
    );
}

/// xorshift64*: reproducible amounts without a dependency.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// What one concurrent request did: its reservation, and its settlement if it got one.
struct Done {
    admitted: bool,
    reserved: u64,
    settled: Option<u64>,
}

/// One call on each of `stores`, on a route of its own, before the requests that run at once.
/// A store's first call finds Redis without its function library and loads it (`FUNCTION LOAD`,
/// on every master of a cluster, then on each replica); made by hundreds of requests at once,
/// each of them loads it again, and on a loaded 2-core machine those loads on six cluster nodes
/// outlast the requests' 5 s timeout. What the tests below check is what the requests are charged
/// at once, not how the library gets loaded.
async fn load_library(stores: &[Arc<dyn StateStore>]) {
    for store in stores {
        remaining(&**store, "load-library", "team", &windows(), None).await;
    }
}

/// Requests on `stores` (two gateways sharing one Redis, or one memory store) at once, on the
/// stores' own clocks: each reserves, and most settle, above or below their reservation.
async fn concurrent(
    stores: &[Arc<dyn StateStore>],
    route: &str,
    w: &[Window],
    n: u64,
) -> Vec<Done> {
    load_library(stores).await;
    let w: Arc<[Window]> = w.into();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let store = stores[i as usize % stores.len()].clone();
        let (w, route) = (w.clone(), route.to_string());
        tasks.spawn(async move {
            let mut rng = Rng(0x9e37_79b9 + i);
            let reserved = tokens(100 + rng.below(900));
            let r = store
                .reserve(Reserve {
                    route: &route,
                    key: "team",
                    windows: &w,
                    amounts: &[1, reserved],
                    at_us: None,
                    periods: &[],
                })
                .await
                .unwrap();
            let Some(entry) = r.entry else {
                return Done {
                    admitted: false,
                    reserved,
                    settled: None,
                };
            };
            // One in five stays in flight.
            let settled = (rng.below(5) != 0).then(|| rng.below(tokens(1_500)));
            if let Some(settled) = settled {
                let done = store
                    .settle(
                        &route,
                        &[Settle {
                            key: "team",
                            windows: &w,
                            entry,
                            reserved: &[1, reserved],
                            settled: &[1, settled],
                            periods: &[],
                            owner: Owner::Route,
                        }],
                        None,
                    )
                    .await
                    .unwrap();
                assert_ne!(done[0][1], Settled::Gone, "settled within its window");
            }
            Done {
                admitted: true,
                reserved,
                settled,
            }
        });
    }
    let mut done = Vec::new();
    while let Some(d) = tasks.join_next().await {
        done.push(d.unwrap());
    }
    done
}

/// What the window holds by the outcomes: settled amounts, plus reservations still in flight.
fn expected_total(done: &[Done]) -> u64 {
    done.iter()
        .filter(|d| d.admitted)
        .map(|d| d.settled.unwrap_or(d.reserved))
        .sum()
}

/// What is open by the outcomes: the reservations of requests not settled.
fn expected_open(done: &[Done]) -> u64 {
    done.iter()
        .filter(|d| d.admitted && d.settled.is_none())
        .map(|d| d.reserved)
        .sum()
}

/// A window with room for everything: the total is exact, whatever the interleaving.
fn roomy() -> Vec<Window> {
    vec![
        Window {
            name: "rpm".into(),
            limit: 1_000_000,
            length_us: 10 * MINUTE,
        },
        Window {
            name: "tpm".into(),
            limit: tokens(1_000_000_000),
            length_us: 10 * MINUTE,
        },
    ]
}

/// A window that refuses some: without settlements, the reservations admitted never add up past
/// it, and some were refused.
fn tight() -> Vec<Window> {
    vec![
        Window {
            name: "rpm".into(),
            limit: 1_000_000,
            length_us: 10 * MINUTE,
        },
        Window {
            name: "tpm".into(),
            limit: tokens(20_000),
            length_us: 10 * MINUTE,
        },
    ]
}

/// Reservations only, on a tight window: none is admitted that did not fit.
async fn reservations_fit(stores: &[Arc<dyn StateStore>], route: &str) -> u64 {
    let w = tight();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..120u64 {
        let store = stores[i as usize % stores.len()].clone();
        let (w, route) = (w.clone(), route.to_string());
        tasks.spawn(async move {
            let amount = tokens(100 + (i * 37) % 400);
            let r = store
                .reserve(Reserve {
                    route: &route,
                    key: "team",
                    windows: &w,
                    amounts: &[1, amount],
                    at_us: None,
                    periods: &[],
                })
                .await
                .unwrap();
            (r.outcome.admitted, amount)
        });
    }
    let (mut admitted, mut refused) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        match r.unwrap() {
            (true, amount) => admitted += amount,
            (false, _) => refused += 1,
        }
    }
    assert!(refused > 0, "the trace must refuse some");
    assert!(
        admitted <= w[1].limit,
        "{admitted} admitted past {}",
        w[1].limit
    );
    admitted
}

/// Sum of the amounts a log's entries hold ("<seq>:<amount>"), and the hash's running total.
fn redis_record(node: &RedisServer, route: &str, window: &str) -> (u64, u64) {
    let log = format!("sluice:{{{route}}}:q:{window}:team");
    let meta = format!("sluice:{{{route}}}:qm:team");
    let sum = node
        .zrange_with_scores(&log)
        .iter()
        .map(|(m, _)| m.rsplit(':').next().unwrap().parse::<u64>().unwrap())
        .sum();
    let total = node
        .integer(&["HINCRBY", &meta, &format!("s:{window}"), "0"])
        .unwrap() as u64;
    (sum, total)
}

#[tokio::test]
async fn memory_totals_are_exact_under_concurrency() {
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    let w = roomy();
    let done = concurrent(std::slice::from_ref(&store), "exact", &w, 300).await;
    let left = remaining(&*store, "exact", "team", &w, None).await;
    assert_eq!(w[1].limit - left[1], expected_total(&done));
    assert_eq!(
        store
            .usage("exact", Owner::Route, "team", &w, None)
            .await
            .unwrap()[1],
        WindowUsage {
            total: expected_total(&done),
            open: expected_open(&done)
        }
    );
    assert_eq!(w[0].limit - left[0], 300);
    let admitted = reservations_fit(std::slice::from_ref(&store), "fit").await;
    let left = remaining(&*store, "fit", "team", &tight(), None).await;
    assert_eq!(tight()[1].limit - left[1], admitted);
}

#[tokio::test]
async fn redis_totals_are_exact_across_two_gateways() {
    let server = RedisServer::start();
    let stores: Vec<Arc<dyn StateStore>> = (0..2)
        .map(|_| Arc::new(redis_store(&server.url())) as Arc<dyn StateStore>)
        .collect();
    let done = concurrent(&stores, "exact", &roomy(), 300).await;
    let (sum, total) = redis_record(&server, "exact", "tpm");
    assert_eq!(sum, total, "the running total is the log's");
    assert_eq!(total, expected_total(&done));
    assert_eq!(
        stores[1]
            .usage("exact", Owner::Route, "team", &roomy(), None)
            .await
            .unwrap()[1],
        WindowUsage {
            total,
            open: expected_open(&done)
        },
        "what is open is exactly the reservations in flight"
    );
    assert_eq!(redis_record(&server, "exact", "rpm"), (300, 300));
    let admitted = reservations_fit(&stores, "fit").await;
    assert_eq!(redis_record(&server, "fit", "tpm"), (admitted, admitted));
}

#[tokio::test]
async fn redis_cluster_totals_are_exact() {
    let cluster = RedisCluster::start();
    let stores: Vec<Arc<dyn StateStore>> = (0..2)
        .map(|_| Arc::new(cluster_store(&cluster)) as Arc<dyn StateStore>)
        .collect();
    let done = concurrent(&stores, "exact", &roomy(), 200).await;
    let node = &cluster.nodes()[cluster.index_of(cluster.master_of("{exact}").unwrap())];
    let (sum, total) = redis_record(node, "exact", "tpm");
    assert_eq!(sum, total);
    assert_eq!(total, expected_total(&done));
    assert_eq!(
        stores[0]
            .usage("exact", Owner::Route, "team", &roomy(), None)
            .await
            .unwrap()[1]
            .open,
        expected_open(&done)
    );
    let admitted = reservations_fit(&stores, "fit").await;
    let node = &cluster.nodes()[cluster.index_of(cluster.master_of("{fit}").unwrap())];
    assert_eq!(redis_record(node, "fit", "tpm"), (admitted, admitted));
}

/// A key pool with roomy token windows on the route and on each of three keys.
fn pool() -> (Vec<Window>, Vec<PoolMember>) {
    let tpm = || Window {
        name: "tpm".into(),
        limit: tokens(1_000_000_000),
        length_us: 10 * MINUTE,
    };
    let members = ["key-a", "key-b", "key-c"]
        .into_iter()
        .map(|id| PoolMember {
            id: id.into(),
            windows: Arc::new([tpm()]),
        })
        .collect();
    (vec![tpm()], members)
}

/// Requests on `stores` at once, each assigned a key of the pool with its reservation in the
/// route's window and the key's, most then settling both entries in one call.
async fn concurrent_pool(stores: &[Arc<dyn StateStore>], route: &str, n: u64) -> Vec<Done> {
    let (route_windows, members) = pool();
    load_library(stores).await;
    let (route_windows, members): (Arc<[Window]>, Arc<[PoolMember]>) =
        (route_windows.into(), members.into());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let store = stores[i as usize % stores.len()].clone();
        let (route_windows, members, route) =
            (route_windows.clone(), members.clone(), route.to_string());
        tasks.spawn(async move {
            let mut rng = Rng(0x51ce + i);
            let reserved = tokens(100 + rng.below(900));
            let each = [reserved];
            let usage = [MemberUsage {
                amounts: &each,
                periods: &[],
            }; 3];
            let r = store
                .assign_reserve(
                    Assign {
                        route: &route,
                        members: &members,
                        order: Order::LeastUsed,
                        excluded: &[],
                        quota: Some(Acquire {
                            route: &route,
                            key: "team",
                            windows: &route_windows,
                            cost: 1,
                            at_us: None,
                            client: None,
                        }),
                        cost: 1,
                        cooldowns: false,
                        at_us: None,
                        lease: None,
                        sticky: None,
                    },
                    Usage {
                        route: &each,
                        route_periods: &[],
                        members: &usage,
                        client: &[],
                        client_periods: &[],
                    },
                )
                .await
                .unwrap();
            let Assignment::Assigned { member, .. } = &r.assignment else {
                panic!("{r:?}");
            };
            let settled = (rng.below(5) != 0).then(|| rng.below(tokens(1_500)));
            if let Some(settled) = settled {
                let m = members.iter().find(|m| *m.id == **member).unwrap();
                let done = store
                    .settle(
                        &route,
                        &[
                            Settle {
                                key: "team",
                                windows: &route_windows,
                                entry: r.route.unwrap(),
                                reserved: &each,
                                settled: &[settled],
                                periods: &[],
                                owner: Owner::Route,
                            },
                            Settle {
                                key: member,
                                windows: &m.windows,
                                entry: r.member.unwrap(),
                                reserved: &each,
                                settled: &[settled],
                                periods: &[],
                                owner: Owner::Member,
                            },
                        ],
                        None,
                    )
                    .await
                    .unwrap();
                assert_eq!(done, [vec![Settled::Done], vec![Settled::Done]]);
            }
            Done {
                admitted: true,
                reserved,
                settled,
            }
        });
    }
    let mut done = Vec::new();
    while let Some(d) = tasks.join_next().await {
        done.push(d.unwrap());
    }
    done
}

/// What the pool's windows hold by the store's own totals: the route's, and its keys' together.
async fn pool_totals(store: &dyn StateStore, route: &str) -> (u64, u64) {
    let (route_windows, members) = pool();
    let left = remaining(store, route, "team", &route_windows, None).await;
    let mut keys = 0;
    for m in &members {
        keys += m.windows[0].limit - store.member_remaining(route, m).await.unwrap()[0];
    }
    (route_windows[0].limit - left[0], keys)
}

#[tokio::test]
async fn memory_key_pool_totals_are_exact_under_concurrency() {
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    let done = concurrent_pool(std::slice::from_ref(&store), "pool", 300).await;
    let expected = expected_total(&done);
    assert_eq!(pool_totals(&*store, "pool").await, (expected, expected));
}

#[tokio::test]
async fn redis_key_pool_totals_are_exact_across_two_gateways() {
    let server = RedisServer::start();
    let stores: Vec<Arc<dyn StateStore>> = (0..2)
        .map(|_| Arc::new(redis_store(&server.url())) as Arc<dyn StateStore>)
        .collect();
    let done = concurrent_pool(&stores, "pool", 300).await;
    let expected = expected_total(&done);
    assert_eq!(pool_totals(&*stores[0], "pool").await, (expected, expected));
    // Each key's running total is its log's.
    for id in ["key-a", "key-b", "key-c"] {
        let log = format!("sluice:{{pool}}:mq:tpm:{id}");
        let sum: u64 = server
            .zrange_with_scores(&log)
            .iter()
            .map(|(m, _)| m.rsplit(':').next().unwrap().parse::<u64>().unwrap())
            .sum();
        let total = server
            .integer(&[
                "HINCRBY",
                &format!("sluice:{{pool}}:mqm:{id}"),
                "s:tpm",
                "0",
            ])
            .unwrap() as u64;
        assert_eq!(sum, total, "{id}");
    }
}

#[tokio::test]
async fn redis_cluster_key_pool_totals_are_exact() {
    let cluster = RedisCluster::start();
    let stores: Vec<Arc<dyn StateStore>> = (0..2)
        .map(|_| Arc::new(cluster_store(&cluster)) as Arc<dyn StateStore>)
        .collect();
    let done = concurrent_pool(&stores, "pool", 200).await;
    let expected = expected_total(&done);
    assert_eq!(pool_totals(&*stores[1], "pool").await, (expected, expected));
}

/// A reservation's entry costs Redis no more than a request's did: at most 150 bytes per
/// admitted request, with amounts in millionths.
#[tokio::test]
async fn redis_memory_per_reservation_is_bounded() {
    let server = RedisServer::start();
    let store = redis_store(&server.url());
    let w = [Window {
        name: "tpm".into(),
        limit: tokens(1_000_000_000),
        length_us: 24 * 60 * MINUTE,
    }];
    let n = 1000;
    for i in 0..n {
        let r = reserve(&store, "mem", "team", &w, &[tokens(4_096)], 1_000_000 + i).await;
        let e = r.entry.unwrap();
        // Half are settled, to amounts with a fraction.
        if i % 2 == 0 {
            let done = settle_one(
                &store,
                "mem",
                "team",
                &w,
                e,
                &[tokens(4_096)],
                &[1_234_567_891],
                1_000_000 + i,
            )
            .await;
            assert_eq!(done, [Settled::Done]);
        }
    }
    let log = "sluice:{mem}:q:tpm:team";
    let meta = "sluice:{mem}:qm:team";
    assert_eq!(server.integer(&["ZCARD", log]), Some(n as i64));
    let bytes = server
        .integer(&["MEMORY", "USAGE", log, "SAMPLES", "0"])
        .unwrap()
        + server
            .integer(&["MEMORY", "USAGE", meta, "SAMPLES", "0"])
            .unwrap();
    let per = bytes as f64 / n as f64;
    println!("{per} bytes per reservation");
    assert!(per <= 150.0, "{per} bytes per reservation");
}

/// A settlement keeps the expiry of the logs it rewrites: a key whose only entry settles
/// (a usage quota keyed by client address, say) must still leave Redis once its window has
/// passed, as SPEC §6 says every key does.
#[tokio::test]
async fn redis_a_settlement_keeps_the_logs_expiry() {
    let server = RedisServer::start();
    let store = redis_store(&server.url());
    let w = windows();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let r = reserve(&store, "ttl", "k", &w, &[1, tokens(300)], now).await;
    let entry = r.entry.expect("admitted, with an entry");
    let done = settle_one(
        &store,
        "ttl",
        "k",
        &w,
        entry,
        &[1, tokens(300)],
        &[1, tokens(120)],
        now + 1,
    )
    .await;
    assert_eq!(done, [Settled::Done, Settled::Done]);
    for window in ["rpm", "tpm"] {
        let key = format!("sluice:{{ttl}}:q:{window}:k");
        let ttl = server.integer(&["PTTL", &key]).unwrap();
        assert!(ttl > 0, "{key} has no expiry ({ttl})");
    }
}

/// On a Redis Cluster a client's windows reserve in their own slot first. When the route then
/// has nothing of its own to reserve or check (no windows, no member windows, a member chosen
/// in process), it makes no call: a script call that names no key goes to any node, and a
/// replica refuses one that writes (READONLY), so the route's `on_store_error` would decide
/// about half of these requests. Every FCALL a node ran is in its slow log (logged from 0 µs),
/// and every one a replica refused counts in its `rejected_calls`: neither may be keyless.
#[tokio::test]
async fn redis_cluster_a_route_with_nothing_to_check_makes_no_keyless_call() {
    let cluster = RedisCluster::start();
    for node in cluster.nodes() {
        for args in [
            &["CONFIG", "SET", "slowlog-log-slower-than", "0"][..],
            &["CONFIG", "SET", "slowlog-max-len", "100000"],
            &["SLOWLOG", "RESET"],
            &["CONFIG", "RESETSTAT"],
        ] {
            node.command(args).expect("configure a node");
        }
    }
    let store = cluster_store(&cluster);
    let members = [PoolMember::new("only")];
    let client_windows = [Window {
        name: "day".into(),
        limit: 10_000,
        length_us: 24 * 60 * MINUTE,
    }];
    let t0 = 7_000_000_000_000u64;
    for i in 0..20 {
        let reserved = store
            .assign_reserve(
                Assign {
                    route: "bare",
                    members: &members,
                    order: Order::Preference(&[0]),
                    excluded: &[],
                    quota: Some(Acquire {
                        route: "bare",
                        key: "route",
                        windows: &[],
                        cost: 1,
                        at_us: Some(t0 + i),
                        client: Some(ClientWindows {
                            name: "solo",
                            windows: &client_windows,
                        }),
                    }),
                    cost: 1,
                    cooldowns: false,
                    at_us: Some(t0 + i),
                    lease: None,
                    sticky: None,
                },
                Usage {
                    route: &[],
                    route_periods: &[],
                    members: &[],
                    client: &[1],
                    client_periods: &[],
                },
            )
            .await
            .unwrap();
        assert!(
            matches!(&reserved.assignment, Assignment::Assigned { member, .. } if member == "only"),
            "{reserved:?}"
        );
        assert!(reserved.client.is_some(), "the client's reservation");
    }
    let mut keyed = 0;
    for node in cluster.nodes() {
        let client = redis::Client::open(node.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let log: Vec<Vec<String>> = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(-1)
            .query_async::<Vec<redis::Value>>(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .map(|entry| {
                let redis::Value::Array(fields) = entry else {
                    panic!("a slow log entry: {entry:?}")
                };
                // id, time, duration, then the command's arguments.
                redis::from_redis_value(fields[3].clone()).unwrap()
            })
            .collect();
        for args in &log {
            if args
                .first()
                .is_some_and(|c| c.eq_ignore_ascii_case("fcall"))
            {
                assert_ne!(args.get(2).map(String::as_str), Some("0"), "{args:?}");
                keyed += 1;
            }
        }
        let stats = node.command(&["INFO", "commandstats"]).unwrap();
        let rejected = stats
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_fcall:"))
            .and_then(|s| s.split(',').find_map(|f| f.strip_prefix("rejected_calls=")))
            .map_or(0, |n| n.trim().parse::<u64>().unwrap());
        assert_eq!(rejected, 0, "FCALLs a node refused: {stats}");
    }
    // The client's reservations, a call each (the first may find the library missing, and be
    // sent again once it is loaded), all naming the client's keys.
    assert!((20..=21).contains(&keyed), "{keyed} FCALLs");
}
