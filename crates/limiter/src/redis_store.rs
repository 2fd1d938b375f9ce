//! The shared store: the quota script in Redis, one `EVALSHA` per request.
//!
//! Every key of a route starts with `<prefix>:{<route>}:`. The hash tag puts all of a route's
//! keys in one Redis Cluster slot, so the script, which touches several of them, runs unchanged
//! on a cluster:
//! - `<prefix>:{<route>}:q:<window>:<quota key>` — a window's log;
//! - `<prefix>:{<route>}:qm:<quota key>` — the helper hash (entry sequence, running totals).
//!
//! All of them expire on their own once idle.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Script};

use crate::{quota_script, Acquire, Outcome, QuotaStore, StoreError, WindowState};

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

/// A connection to a single Redis or to a Redis Cluster. The cluster connection follows
/// `MOVED` and `ASK`, routes each script call by its keys' slot, and loads a script again on
/// whichever node answers `NOSCRIPT`; to the stores both look the same.
#[derive(Clone)]
pub enum Conn {
    /// A single Redis, through a reconnecting multiplexed connection.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

enum Target {
    Single(redis::Client),
    Cluster(Box<ClusterClient>),
}

/// One connection to Redis (a multiplexed connection, or a cluster connection), shared by
/// every store of a gateway, with the call discipline they all need: a timeout per call and
/// one retry on a broken connection.
pub struct RedisConnection {
    target: Target,
    /// Created on first use, inside a runtime that lives as long as the gateway: the
    /// connection is driven by tasks on the runtime it was created on.
    conn: OnceLock<Result<Conn, String>>,
    timeout: Duration,
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConnection")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisConnection {
    /// A connection to the Redis at `url`; it connects lazily, so it can be built while Redis is
    /// down.
    pub fn new(url: &str, timeout: Duration) -> Result<RedisConnection, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError::Backend(e.to_string()))?;
        Ok(RedisConnection {
            target: Target::Single(client),
            conn: OnceLock::new(),
            timeout,
        })
    }

    /// A connection to the Redis Cluster that `nodes` (some of its nodes) belong to; it
    /// discovers the rest, and connects lazily.
    pub fn cluster(nodes: &[String], timeout: Duration) -> Result<RedisConnection, StoreError> {
        let client = ClusterClient::builder(nodes.iter().map(String::as_str))
            .connection_timeout(timeout)
            .response_timeout(timeout)
            // Slot moves and failovers are retried inside the client, within our timeout.
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(200)
            .build()
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        Ok(RedisConnection {
            target: Target::Cluster(Box::new(client)),
            conn: OnceLock::new(),
            timeout,
        })
    }

    fn connection(&self) -> Result<Conn, StoreError> {
        self.conn
            .get_or_init(|| match &self.target {
                Target::Single(client) => {
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(self.timeout))
                        .set_response_timeout(Some(self.timeout))
                        // A request never waits longer than its own timeout anyway, so keep
                        // the reconnect backoff short: the store is usable again within about
                        // 100 ms of Redis coming back.
                        .set_number_of_retries(1)
                        .set_min_delay(Duration::from_millis(5))
                        .set_max_delay(Duration::from_millis(100));
                    ConnectionManager::new_lazy_with_config(client.clone(), config)
                        .map(Conn::Single)
                        .map_err(|e| e.to_string())
                }
                Target::Cluster(client) => {
                    let config = ClusterConfig::new()
                        .set_connection_timeout(self.timeout)
                        .set_response_timeout(self.timeout);
                    Ok(Conn::Cluster(
                        client.get_pending_async_connection_with_config(config),
                    ))
                }
            })
            .clone()
            .map_err(StoreError::Backend)
    }

    /// Runs `call` within the timeout, retrying once on a broken connection: after a Redis
    /// restart the first call on the old connection fails with a broken pipe while the manager
    /// reconnects, and no client request should fail because of that.
    pub async fn run<T, F, Fut>(&self, call: F) -> Result<T, StoreError>
    where
        F: Fn(Conn) -> Fut,
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
        match tokio::time::timeout(self.timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout),
        }
    }

    /// Whether Redis answers PING within the timeout.
    pub async fn ping(&self) -> bool {
        self.run(
            |mut conn| async move { redis::cmd("PING").query_async::<String>(&mut conn).await },
        )
        .await
        .is_ok()
    }
}

/// Quotas shared by every gateway instance that uses the same Redis.
pub struct RedisStore {
    connection: Arc<RedisConnection>,
    script: Script,
    key_prefix: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("key_prefix", &self.key_prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store with a connection of its own.
    pub fn new(config: RedisStoreConfig) -> Result<RedisStore, StoreError> {
        let connection = Arc::new(RedisConnection::new(&config.url, config.timeout)?);
        Ok(RedisStore::with_connection(connection, &config.key_prefix))
    }

    /// A store on a shared connection.
    pub fn with_connection(connection: Arc<RedisConnection>, key_prefix: &str) -> RedisStore {
        RedisStore {
            connection,
            script: Script::new(&quota_script()),
            key_prefix: key_prefix.to_string(),
        }
    }

    /// The keys of one quota key: the helper hash, then one log per window.
    pub fn keys(&self, route: &str, key: &str, windows: &[crate::Window]) -> Vec<String> {
        let mut keys = Vec::with_capacity(1 + windows.len());
        keys.push(format!("{}:{{{route}}}:qm:{key}", self.key_prefix));
        for w in windows {
            keys.push(format!(
                "{}:{{{route}}}:q:{}:{key}",
                self.key_prefix, w.name
            ));
        }
        keys
    }
}

fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal()
}

/// Appends the quota arguments (cost, clock, then name, limit, length per window) as the quota
/// library's drivers read them.
pub fn push_quota_args(invocation: &mut redis::ScriptInvocation<'_>, req: &Acquire<'_>) {
    invocation.arg(req.cost);
    match req.at_us {
        Some(t) => invocation.arg(t),
        None => invocation.arg(""),
    };
    for w in req.windows {
        invocation.arg(&*w.name).arg(w.limit).arg(w.length_us);
    }
}

#[async_trait]
impl QuotaStore for RedisStore {
    async fn acquire(&self, req: Acquire<'_>) -> Result<Outcome, StoreError> {
        let mut invocation = self.script.prepare_invoke();
        for key in self.keys(req.route, req.key, req.windows) {
            invocation.key(key);
        }
        push_quota_args(&mut invocation, &req);
        let reply: Vec<i64> = self
            .connection
            .run(|mut conn| {
                let invocation = &invocation;
                async move { invocation.invoke_async(&mut conn).await }
            })
            .await?;
        parse_reply(&reply, req.windows.len())
    }

    async fn ready(&self) -> bool {
        self.connection.ping().await
    }
}

/// Parses `{admitted, retry_after_us, remaining_i, reset_us_i...}` as the quota library replies.
pub fn parse_reply(reply: &[i64], windows: usize) -> Result<Outcome, StoreError> {
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
