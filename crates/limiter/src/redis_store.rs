//! The shared store: the quota script in Redis, one `EVALSHA` per request.
//!
//! Every key of a route starts with `<prefix>:{<route>}:`. The hash tag puts all of a route's
//! keys in one Redis Cluster slot, so the script, which touches several of them, runs unchanged
//! on a cluster:
//! - `<prefix>:{<route>}:q:<window>:<quota key>` — a window's log;
//! - `<prefix>:{<route>}:qm:<quota key>` — the helper hash (entry sequence, running totals).
//!
//! All of them expire on their own once idle.

use std::sync::OnceLock;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};

use crate::{Acquire, Outcome, QuotaStore, StoreError, WindowState, QUOTA_SCRIPT};

/// How to reach Redis.
#[derive(Debug, Clone)]
pub struct RedisStoreConfig {
    /// `redis://host:port/db`.
    pub url: String,
    /// First part of every key.
    pub key_prefix: String,
    /// Time allowed for one call, retry included; past it the caller's policy applies.
    pub timeout: Duration,
}

/// Quotas shared by every gateway instance that uses the same Redis.
pub struct RedisStore {
    client: redis::Client,
    /// Created on first use, inside the runtime that serves requests: the connection manager
    /// drives its connection from a task on the runtime it was created on.
    connection: OnceLock<Result<ConnectionManager, String>>,
    script: Script,
    config: RedisStoreConfig,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store for `config`; it connects lazily, so it can be built while Redis is down.
    pub fn new(config: RedisStoreConfig) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(config.url.as_str())
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        Ok(RedisStore {
            client,
            connection: OnceLock::new(),
            script: Script::new(QUOTA_SCRIPT),
            config,
        })
    }

    /// The script's SHA1, as Redis knows it.
    pub fn script_sha(&self) -> &str {
        self.script.get_hash()
    }

    fn connection(&self) -> Result<ConnectionManager, StoreError> {
        self.connection
            .get_or_init(|| {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.config.timeout))
                    .set_response_timeout(Some(self.config.timeout))
                    // A request never waits longer than its own timeout anyway, so keep the
                    // reconnect backoff short: the store is usable again within about
                    // 100 ms of Redis coming back.
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(5))
                    .set_max_delay(Duration::from_millis(100));
                ConnectionManager::new_lazy_with_config(self.client.clone(), config)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(StoreError::Backend)
    }

    /// Runs `call` with the store's timeout, retrying once on a broken connection: after a
    /// Redis restart the first call on the old connection fails with a broken pipe while the
    /// manager reconnects, and no client request should fail because of that.
    async fn with_retry<T, F, Fut>(&self, call: F) -> Result<T, StoreError>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        let attempt = async {
            let first = call(self.connection()?).await;
            match first {
                Err(e) if is_connection_error(&e) => call(self.connection()?).await,
                other => other,
            }
            .map_err(|e| StoreError::Backend(e.to_string()))
        };
        match tokio::time::timeout(self.config.timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout),
        }
    }

    fn key(&self, route: &str, kind: &str, rest: &str) -> String {
        format!("{}:{{{route}}}:{kind}:{rest}", self.config.key_prefix)
    }
}

fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal()
}

#[async_trait]
impl QuotaStore for RedisStore {
    async fn acquire(&self, req: Acquire<'_>) -> Result<Outcome, StoreError> {
        let mut invocation = self.script.prepare_invoke();
        invocation.key(self.key(req.route, "qm", req.key));
        for w in req.windows {
            invocation.key(self.key(req.route, "q", &format!("{}:{}", w.name, req.key)));
        }
        invocation.arg(req.cost);
        match req.at_us {
            Some(t) => invocation.arg(t),
            None => invocation.arg(""),
        };
        for w in req.windows {
            invocation.arg(&*w.name).arg(w.limit).arg(w.length_us);
        }
        let reply: Vec<i64> = self
            .with_retry(|mut conn| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut conn).await }
            })
            .await?;
        parse_reply(&reply, req.windows.len())
    }

    async fn ready(&self) -> bool {
        self.with_retry(|mut conn| async move {
            redis::cmd("PING").query_async::<String>(&mut conn).await
        })
        .await
        .is_ok()
    }
}

fn parse_reply(reply: &[i64], windows: usize) -> Result<Outcome, StoreError> {
    if reply.len() != 2 + 2 * windows {
        return Err(StoreError::Backend(format!(
            "quota script returned {} values, expected {}",
            reply.len(),
            2 + 2 * windows
        )));
    }
    let non_negative = |v: i64| v.max(0) as u64;
    Ok(Outcome {
        admitted: reply[0] == 1,
        retry_after_us: non_negative(reply[1]),
        windows: reply[2..]
            .chunks_exact(2)
            .map(|c| WindowState {
                remaining: non_negative(c[0]),
                reset_us: non_negative(c[1]),
            })
            .collect(),
    })
}
