//! Opens the state store the config asks for: in memory, or shared through Redis (a single
//! Redis or a Redis Cluster).

use std::sync::Arc;

use sluice_allocator::{MemoryStore, StateStore};
use sluice_limiter::MemoryLimits;
use sluice_store::{RedisConnection, RedisStore};

use crate::config::{Config, StateBackend};

/// The state store for `config`. The Redis client connects lazily, so the gateway starts (and
/// applies each route's `on_store_error`) even while Redis is down; only a URL the client
/// cannot use at all is an error here.
pub fn open(config: &Config) -> Result<Arc<dyn StateStore>, String> {
    let (StateBackend::Redis, Some(redis)) = (&config.state.backend, &config.state.redis) else {
        return Ok(Arc::new(MemoryStore::with_limits(MemoryLimits {
            max_keys: config.state.memory.max_keys.get(),
            max_entries: config.state.memory.max_entries.get(),
        })));
    };
    // The CA file is read once, here: like the rest of `state`, it applies at the next restart.
    let ca = match redis.tls.as_ref().and_then(|t| t.ca.as_ref()) {
        Some(path) => Some(
            crate::config::load_ca(path)
                .map_err(|why| format!("state.redis.tls.ca: CA file {}: {why}", path.display()))?,
        ),
        None => None,
    };
    let connection = match &redis.cluster {
        Some(nodes) => {
            let nodes: Vec<String> = nodes.iter().map(|n| n.0.clone()).collect();
            RedisConnection::cluster_with_ca(&nodes, redis.timeout.0, ca.as_deref())
        }
        None => {
            let url = redis.url.as_ref().map(|u| u.0.as_str()).unwrap_or_default();
            RedisConnection::new_with_ca(url, redis.timeout.0, ca.as_deref())
        }
    }
    .map_err(|e| format!("cannot use the Redis of state.redis: {e}"))?;
    // Without an index (read here only), a `home` route a reload brings in takes its
    // sub-logs in turn until a restart, and the reload says so (table.rs).
    let store = RedisStore::with_connection(Arc::new(connection), &redis.key_prefix)
        .with_batching(redis.batch);
    Ok(Arc::new(match redis.instance_index {
        Some(index) => store.with_instance_index(index),
        None => store,
    }))
}
