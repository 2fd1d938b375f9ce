//! Running one end-to-end behaviour on both state stores.
//!
//! A behaviour is written once, as `async fn behaviour(backend: Backend)`, and
//! [`on_both_stores!`](crate::on_both_stores) turns it into two tests, `memory::behaviour` and
//! `redis::behaviour`, so `cargo test --workspace` runs it on the memory store and on a real
//! `redis-server` of its own.

use sluice_testkit::RedisServer;

use super::config::State;

/// Which store a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `state.backend: memory`: one gateway, its own state.
    Memory,
    /// `state.backend: redis`, on a fresh `redis-server` started for the test.
    Redis,
}

/// The store of one test: nothing to start for memory, a real `redis-server` for Redis (killed
/// when the `Store` is dropped).
pub struct Store {
    backend: Backend,
    redis: Option<RedisServer>,
}

impl Store {
    /// Starts what `backend` needs.
    pub fn start(backend: Backend) -> Store {
        Store {
            backend,
            redis: (backend == Backend::Redis).then(RedisServer::start),
        }
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The Redis server; `None` on the memory store.
    pub fn redis(&self) -> Option<&RedisServer> {
        self.redis.as_ref()
    }

    /// The config's `state:` block for this store.
    pub fn state(&self) -> State {
        match &self.redis {
            None => State::memory(),
            Some(redis) => State::redis(redis.url()),
        }
    }

    /// How many gateways can share this store's state: two on Redis, one on memory (each
    /// gateway has a memory store of its own). Behaviours that hold "for every instance
    /// together" run on this many gateways.
    pub fn instances(&self) -> usize {
        match self.backend {
            Backend::Memory => 1,
            Backend::Redis => 2,
        }
    }
}

/// `on_both_stores!(a, b)` for behaviours `async fn a(backend: Backend)` and `b` defined in the
/// test file generates `mod memory { #[tokio::test] async fn a() ... }` and the same `mod redis`,
/// so each behaviour runs, and fails, under its own name on each store.
#[macro_export]
macro_rules! on_both_stores {
    ($($name:ident),+ $(,)?) => {
        /// The behaviours on the memory store.
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::Memory).await;
                }
            )+
        }

        /// The same behaviours on a real Redis.
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::Backend::Redis).await;
                }
            )+
        }
    };
}
