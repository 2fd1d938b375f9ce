//! One behavioural suite for both quota stores.
//!
//! A deliberately naive reference model recomputes every decision from the full list of
//! admitted requests. Random traces are replayed against the model and a store, with the clock
//! given as a parameter, and every decision, remaining count, reset time and `retry_after` must
//! agree. The same suite runs against [`MemoryStore`] and [`RedisStore`] (a real `redis-server`).

use std::sync::Arc;
use std::time::Duration;

use sluice_allocator::{MemoryStore, StateStore};
use sluice_limiter::{Acquire, Window};
use sluice_store::{RedisStore, RedisStoreConfig};
use sluice_testkit::RedisServer;

mod quota_model;
use quota_model::Model;

/// xorshift64*: a reproducible trace without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn windows() -> Vec<Window> {
    vec![
        Window {
            name: "burst".into(),
            limit: 300,
            length_us: 1_000_000,
        },
        Window {
            name: "long".into(),
            limit: 1_000,
            length_us: 5_000_000,
        },
    ]
}

struct Step {
    key: &'static str,
    cost: u64,
    at_us: u64,
}

/// ≥ 10,000 requests over three keys: costs 1–100 (mostly small, some heavy), bursts inside one
/// millisecond, steady traffic, and idle gaps longer than the longest window.
fn trace(seed: u64, len: usize) -> Vec<Step> {
    let mut rng = Rng(seed);
    let mut now = 1_000_000_000u64;
    let keys = ["alpha", "beta", "gamma"];
    let mut steps = Vec::with_capacity(len);
    while steps.len() < len {
        match rng.below(100) {
            // A burst: several requests in the same millisecond, some in the same microsecond.
            0..=9 => {
                for _ in 0..(2 + rng.below(12)) {
                    now += rng.below(3) * rng.below(300);
                    steps.push(Step {
                        key: keys[rng.below(3) as usize],
                        cost: 1 + rng.below(100),
                        at_us: now,
                    });
                }
            }
            // An idle gap longer than every window.
            10 => now += 5_000_000 + rng.below(3_000_000),
            // Steady traffic.
            _ => {
                now += rng.below(40_000);
                let cost = if rng.below(10) == 0 {
                    50 + rng.below(51)
                } else {
                    1 + rng.below(10)
                };
                steps.push(Step {
                    key: keys[rng.below(3) as usize],
                    cost,
                    at_us: now,
                });
            }
        }
    }
    steps.truncate(len);
    steps
}

/// Replays a trace on `store` and the model; returns (mismatches, admitted, refused).
async fn replay(
    store: &dyn StateStore,
    route: &str,
    seed: u64,
    len: usize,
) -> (Vec<String>, usize, usize) {
    let windows = windows();
    let mut model = Model::default();
    let mut mismatches = Vec::new();
    let (mut admitted, mut refused) = (0, 0);
    for (i, step) in trace(seed, len).iter().enumerate() {
        let expected = model.decide(step.key, &windows, step.cost, step.at_us);
        let got = store
            .acquire(Acquire {
                route,
                key: step.key,
                windows: &windows,
                cost: step.cost,
                at_us: Some(step.at_us),
                client: None,
            })
            .await
            .expect("store answers");
        if got.admitted {
            admitted += 1;
        } else {
            refused += 1;
        }
        if got != expected && mismatches.len() < 5 {
            mismatches.push(format!(
                "step {i} (key {}, cost {}, t {}):\n  model {expected:?}\n  store {got:?}",
                step.key, step.cost, step.at_us
            ));
        }
    }
    (mismatches, admitted, refused)
}

async fn suite(store: &dyn StateStore, name: &str) {
    for seed in [7, 1234] {
        let (mismatches, admitted, refused) =
            replay(store, &format!("trace{seed}"), seed, 10_000).await;
        println!(
            "{name} seed {seed}: {admitted} admitted, {refused} refused, {} mismatches",
            mismatches.len()
        );
        assert!(mismatches.is_empty(), "{name}: {}", mismatches.join("\n"));
        assert!(
            admitted > 1000 && refused > 1000,
            "the trace must exercise both outcomes"
        );
    }
}

#[tokio::test]
async fn memory_store_matches_the_model() {
    suite(&MemoryStore::new(), "memory").await;
}

fn redis_store(url: &str) -> RedisStore {
    RedisStore::new(RedisStoreConfig {
        url: url.into(),
        key_prefix: "sluice".into(),
        timeout: Duration::from_secs(5),
    })
    .unwrap()
}

#[tokio::test]
async fn redis_store_matches_the_model() {
    let server = RedisServer::start();
    suite(&redis_store(&server.url()), "redis").await;
    assert_eq!(server.command_calls("evalsha"), 0, "every call an FCALL");
}

/// The same traces where Redis refuses functions: every call an `EVALSHA`.
#[tokio::test]
async fn redis_store_without_functions_matches_the_model() {
    let server = RedisServer::start();
    let store = redis_store(&server.url_without_functions());
    suite(&store, "redis, scripts").await;
    assert!(!store.uses_functions());
    assert_eq!(server.command_calls("fcall"), 0);
}

/// Scenario checks that read better spelled out than as a trace; both stores.
async fn scenarios(store: &dyn StateStore) {
    let w = vec![Window {
        name: "w".into(),
        limit: 10,
        length_us: 1_000_000,
    }];
    let ask = |key: &'static str, cost: u64, at: u64| Acquire {
        route: "scenario",
        key,
        windows: Box::leak(Box::new(w.clone())),
        cost,
        at_us: Some(at),
        client: None,
    };
    // Two requests in the same microsecond are two entries, not one.
    assert!(store.acquire(ask("same", 4, 500)).await.unwrap().admitted);
    let second = store.acquire(ask("same", 4, 500)).await.unwrap();
    assert!(second.admitted);
    assert_eq!(second.windows[0].remaining, 2);
    // A refused request consumes nothing: the remaining count is unchanged after it.
    let refused = store.acquire(ask("same", 5, 600)).await.unwrap();
    assert!(!refused.admitted);
    assert_eq!(refused.windows[0].remaining, 2);
    assert_eq!(
        refused.retry_after_us,
        500 + 1_000_000 - 600,
        "until the first entry leaves"
    );
    assert!(store.acquire(ask("same", 2, 700)).await.unwrap().admitted);
    // Exactly at the retry time the request fits; a microsecond before it does not.
    assert!(
        !store
            .acquire(ask("same", 4, 1_000_499))
            .await
            .unwrap()
            .admitted
    );
    assert!(
        store
            .acquire(ask("same", 4, 1_000_500))
            .await
            .unwrap()
            .admitted
    );
    // Keys are independent.
    assert_eq!(
        store.acquire(ask("other", 10, 700)).await.unwrap().windows[0].remaining,
        0
    );
    // A cost of 0 reads the window (the metrics' scrape) and records nothing, however often.
    for _ in 0..3 {
        let peek = store.acquire(ask("peek", 0, 800)).await.unwrap();
        assert_eq!(peek.windows[0].remaining, 10);
    }
    assert!(store.acquire(ask("peek", 7, 900)).await.unwrap().admitted);
    let peek = store.acquire(ask("peek", 0, 1_000)).await.unwrap();
    assert_eq!(peek.windows[0].remaining, 3);
    // It reads the window as it slides: once the entry leaves, everything is left.
    let later = store.acquire(ask("peek", 0, 1_000_900)).await.unwrap();
    assert_eq!(later.windows[0].remaining, 10);
}

#[tokio::test]
async fn scenarios_hold_for_memory() {
    scenarios(&MemoryStore::new()).await;
}

#[tokio::test]
async fn scenarios_hold_for_redis() {
    let server = RedisServer::start();
    scenarios(&redis_store(&server.url())).await;
}

#[tokio::test]
async fn all_windows_or_none() {
    let server = RedisServer::start();
    for store in [
        Arc::new(MemoryStore::new()) as Arc<dyn StateStore>,
        Arc::new(redis_store(&server.url())) as Arc<dyn StateStore>,
    ] {
        let w = windows();
        let ask = |cost, at| Acquire {
            route: "atomic",
            key: "k",
            windows: &w,
            cost,
            at_us: Some(at),
            client: None,
        };
        // Fill the short window (limit 300); the long one (limit 1000) still has room.
        for t in 0..3 {
            assert!(store.acquire(ask(100, t)).await.unwrap().admitted);
        }
        let refused = store.acquire(ask(50, 10)).await.unwrap();
        assert!(!refused.admitted);
        // The long window recorded nothing for the refused request.
        assert_eq!(refused.windows[1].remaining, 700);
    }
}

/// The same suite on a real Redis Cluster (3 masters, 3 replicas). Routes hash to different
/// slots, so their keys live on different masters; each script call stays on one.
#[tokio::test]
async fn redis_cluster_store_matches_the_model() {
    let cluster = sluice_testkit::RedisCluster::start();
    let connection =
        sluice_store::RedisConnection::cluster(&cluster.urls(), Duration::from_secs(5)).unwrap();
    let store = RedisStore::with_connection(Arc::new(connection), "sluice");
    suite(&store, "cluster").await;
    scenarios(&store).await;
    let masters: std::collections::HashSet<u16> = ["trace7", "trace1234", "scenario"]
        .iter()
        .filter_map(|r| cluster.master_of(&format!("{{{r}}}")))
        .collect();
    assert!(
        masters.len() >= 2,
        "the routes' keys must span masters: {masters:?}"
    );
    // Every master got the library, and any master that loses it (a node replaced, a FUNCTION
    // FLUSH) gets it again on the first call it serves, counted once.
    assert!(store.uses_functions());
    let masters: Vec<&sluice_testkit::RedisServer> = masters
        .iter()
        .map(|&port| &cluster.nodes()[cluster.index_of(port)])
        .collect();
    for node in &masters {
        let libraries = node.command(&["FUNCTION", "LIST"]).unwrap();
        assert!(libraries.contains(store.library_name()), "{libraries}");
        assert!(node
            .command(&["FUNCTION", "FLUSH"])
            .unwrap()
            .starts_with("+OK"));
    }
    let w = [Window {
        name: "m".into(),
        limit: 10,
        length_us: 60_000_000,
    }];
    for route in ["trace7", "trace1234", "scenario"] {
        let ask = Acquire {
            route,
            key: "after-flush",
            windows: &w,
            cost: 1,
            at_us: None,
            client: None,
        };
        assert!(store.acquire(ask).await.unwrap().admitted, "{route}");
        let master = cluster.master_of(&format!("{{{route}}}")).unwrap();
        let node = &cluster.nodes()[cluster.index_of(master)];
        let log = format!("sluice:{{{route}}}:q:m:after-flush");
        assert_eq!(node.integer(&["ZCARD", &log]), Some(1), "{log}");
    }
    assert_eq!(
        masters
            .iter()
            .map(|n| n.command_calls("evalsha"))
            .sum::<u64>(),
        0
    );
}
