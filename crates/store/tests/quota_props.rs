//! The quota stores against the naive model, driven by proptest: small random
//! traces (several windows, two keys, costs up to the smallest limit, bursts in one microsecond
//! and gaps past every window) that shrink to a minimal failing trace.
//!
//! `quota_behaviour` replays two long fixed traces; these are many short ones. The memory store
//! runs proptest's default case count, Redis a quarter of it on one `redis-server` for the whole
//! run. `scripts/fuzz-long` runs many more.

mod quota_model;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use quota_model::Model;
use sluice_allocator::{MemoryStore, StateStore};
use sluice_limiter::{Acquire, Window};
use sluice_store::{RedisStore, RedisStoreConfig};
use sluice_testkit::RedisServer;

#[derive(Debug, Clone)]
struct Step {
    key: &'static str,
    cost: u64,
    /// Microseconds since the previous step.
    after_us: u64,
}

#[derive(Debug, Clone)]
struct Trace {
    windows: Vec<Window>,
    steps: Vec<Step>,
}

/// Windows of `unit` µs times 1..=20, and steps whose gaps range from none (the same
/// microsecond) to past the longest window, often a whole number of units.
fn trace(unit: u64) -> impl Strategy<Value = Trace> {
    prop::collection::vec((1u64..=12, 1u64..=20), 1..=3).prop_flat_map(move |spec| {
        let windows: Vec<Window> = spec
            .iter()
            .enumerate()
            .map(|(i, &(limit, n))| Window {
                name: format!("w{i}").into(),
                limit,
                length_us: n * unit,
            })
            .collect();
        let smallest = windows.iter().map(|w| w.limit).min().unwrap();
        let step = (
            prop::sample::select(&["a", "b"][..]),
            1..=smallest,
            prop_oneof![
                2 => Just(0u64),
                6 => 0..unit,
                3 => 0..4 * unit,
                // Whole window lengths, so that entries leave exactly at a step.
                2 => (1u64..=20).prop_map(move |n| n * unit),
                1 => (20 * unit)..(30 * unit),
            ],
        )
            .prop_map(|(key, cost, after_us)| Step {
                key,
                cost,
                after_us,
            });
        (Just(windows), prop::collection::vec(step, 1..40))
            .prop_map(|(windows, steps)| Trace { windows, steps })
    })
}

/// Replays `trace` on `store` (under a route of its own) and the model; the first difference
/// fails the case.
async fn replay(store: &dyn StateStore, route: &str, trace: &Trace) -> Result<(), TestCaseError> {
    let mut model = Model::default();
    let mut now = 1_000_000_000u64;
    for (i, step) in trace.steps.iter().enumerate() {
        now += step.after_us;
        let expected = model.decide(step.key, &trace.windows, step.cost, now);
        let got = store
            .acquire(Acquire {
                route,
                key: step.key,
                windows: &trace.windows,
                cost: step.cost,
                at_us: Some(now),
                client: None,
            })
            .await
            .map_err(|e| TestCaseError::fail(format!("step {i}: store error {e:?}")))?;
        prop_assert_eq!(got, expected, "step {} at {}", i, now);
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A route name no earlier case used, so cases never see each other's entries.
fn fresh_route() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("prop{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

proptest! {
    /// Millisecond-scale windows, as configs write them.
    #[test]
    fn memory_store_agrees_with_the_model(trace in trace(1_000)) {
        runtime().block_on(replay(&MemoryStore::new(), "r", &trace))?;
    }

    /// Windows of a few microseconds: every boundary is one step away.
    #[test]
    fn memory_store_agrees_with_the_model_on_tiny_windows(trace in trace(1)) {
        runtime().block_on(replay(&MemoryStore::new(), "r", &trace))?;
    }
}

/// Redis expires idle logs in real time (`PEXPIRE` of the window length), while the traces run
/// on their own clock: windows are a quarter second and up, so that no key can expire in the
/// few milliseconds a case takes.
#[test]
fn redis_store_agrees_with_the_model() {
    let server = RedisServer::start();
    let rt = runtime();
    let store = rt.block_on(async {
        RedisStore::new(RedisStoreConfig {
            url: server.url(),
            key_prefix: "sluice".into(),
            timeout: Duration::from_secs(5),
        })
        .unwrap()
    });
    let cases = (Config::default().cases / 4).max(1);
    let mut runner = TestRunner::new(Config {
        cases,
        ..Config::default()
    });
    let result = runner.run(&trace(250_000), |trace| {
        rt.block_on(replay(&store, &fresh_route(), &trace))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
