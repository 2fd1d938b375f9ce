//! The one connection to Redis that a gateway holds, and the call discipline every store
//! operation follows: a timeout per call, and one retry after a broken connection.
//!
//! A single Redis is reached through a reconnecting multiplexed connection, a cluster through
//! the cluster client. Both connect lazily, so a gateway starts (and applies each route's
//! `on_store_error`) while Redis is down.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{IntoConnectionInfo, RedisError};

use sluice_limiter::StoreError;

/// Whether `url` asks for TLS (`rediss://`).
fn is_tls(url: &str) -> bool {
    url.get(..9)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("rediss://"))
}

/// Makes ring the process's rustls crypto provider unless one is set already: the Redis client
/// builds its TLS configs with the process default, and would panic (inside a connection task)
/// if the build enabled no provider, or more than one, and none were chosen.
fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may have installed one meanwhile; then that one is used.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Every connection to Redis sends each command as soon as it is written. The client's default
/// leaves Nagle's algorithm on: a command written while another is unacknowledged waits in the
/// kernel for the acknowledgement, which Redis sends with its reply. On a network link that is
/// a round trip more for every call that overlaps another, and on a multiplexed connection
/// under load nearly every call does. Redis sets `TCP_NODELAY` on its side, as redis-py, Jedis
/// and go-redis do on theirs. (On loopback, where a reply comes within microseconds, the
/// benchmark did not move either way: docs/benchmarks.md.)
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

/// The client's TLS settings for a private CA: no client certificate, and `ca_pem` in place of
/// the system's roots.
fn certificates(ca_pem: &[u8]) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(ca_pem.to_vec()),
    }
}

/// A connection to a single Redis or to a Redis Cluster. The cluster connection follows
/// `MOVED` and `ASK`, routes each script call by its keys' slot, and sends `FUNCTION LOAD` to
/// every master (a script is loaded again on whichever node answers `NOSCRIPT`); to the stores
/// both look the same.
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
    // Boxed like the cluster client: with TLS parameters a client is a few hundred bytes.
    Single(Box<redis::Client>),
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
    /// Since when (microseconds after `epoch`, plus one; 0 when Redis answers) every call has
    /// met a broken or refused connection. Within a timeout of it, calls wait for Redis to come
    /// back; past it, Redis is taken as down and calls fail at their first refusal, so an outage
    /// costs each request one attempt rather than a whole timeout.
    down_since: AtomicU64,
    epoch: Instant,
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
    /// down. A `rediss://` URL connects over TLS and trusts the system's root certificates.
    pub fn new(url: &str, timeout: Duration) -> Result<RedisConnection, StoreError> {
        RedisConnection::new_with_ca(url, timeout, None)
    }

    /// As [`RedisConnection::new`], and with `ca_pem` (PEM certificates, e.g. a private CA's)
    /// the only certificates a `rediss://` server's chain may end at. A CA needs a `rediss://`
    /// URL: given with `redis://` it is an error rather than silently unused.
    pub fn new_with_ca(
        url: &str,
        timeout: Duration,
        ca_pem: Option<&[u8]>,
    ) -> Result<RedisConnection, StoreError> {
        if ca_pem.is_some() && !is_tls(url) {
            return Err(StoreError::Backend(
                "a TLS CA is given, so the URL must be rediss://".into(),
            ));
        }
        if is_tls(url) {
            ensure_crypto_provider();
        }
        let info = url
            .into_connection_info()
            .map(|info| info.set_tcp_settings(tcp_settings()));
        let client = match ca_pem {
            None => info.and_then(redis::Client::open),
            Some(ca) => info.and_then(|info| redis::Client::build_with_tls(info, certificates(ca))),
        }
        .map_err(|e| StoreError::Backend(e.to_string()))?;
        Ok(RedisConnection::with_target(
            Target::Single(Box::new(client)),
            timeout,
        ))
    }

    /// A connection to the Redis Cluster that `nodes` (some of its nodes) belong to; it
    /// discovers the rest, and connects lazily. With `rediss://` nodes, every node (discovered
    /// ones too) is reached over TLS.
    pub fn cluster(nodes: &[String], timeout: Duration) -> Result<RedisConnection, StoreError> {
        RedisConnection::cluster_with_ca(nodes, timeout, None)
    }

    /// As [`RedisConnection::cluster`], and with `ca_pem` the only certificates the nodes'
    /// chains may end at (see [`RedisConnection::new_with_ca`]).
    pub fn cluster_with_ca(
        nodes: &[String],
        timeout: Duration,
        ca_pem: Option<&[u8]>,
    ) -> Result<RedisConnection, StoreError> {
        if ca_pem.is_some() && !nodes.iter().all(|n| is_tls(n)) {
            return Err(StoreError::Backend(
                "a TLS CA is given, so every cluster node URL must be rediss://".into(),
            ));
        }
        if nodes.iter().any(|n| is_tls(n)) {
            ensure_crypto_provider();
        }
        let mut builder = ClusterClient::builder(nodes.iter().map(String::as_str))
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .tcp_settings(tcp_settings())
            // Slot moves and failovers are retried inside the client, within our timeout.
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(200);
        if let Some(ca) = ca_pem {
            builder = builder.certs(certificates(ca));
        }
        let client = builder
            .build()
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        Ok(RedisConnection::with_target(
            Target::Cluster(Box::new(client)),
            timeout,
        ))
    }

    fn with_target(target: Target, timeout: Duration) -> RedisConnection {
        RedisConnection {
            target,
            conn: OnceLock::new(),
            timeout,
            down_since: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn connection(&self) -> Result<Conn, StoreError> {
        self.conn
            .get_or_init(|| match &self.target {
                Target::Single(client) => {
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(self.timeout))
                        // No response timeout of the client's own: `run` already bounds every
                        // call by the same timeout, and a second timer per call cost about 0.9k
                        // instructions a request. The client's timeout did nothing more than
                        // ours (no reconnect on it), and when it fired first it surfaced as an
                        // I/O error that `run` then retried until its own timeout anyway.
                        .set_response_timeout(None)
                        // A request never waits longer than its own timeout anyway, so keep
                        // the reconnect backoff short: the store is usable again within about
                        // 100 ms of Redis coming back.
                        .set_number_of_retries(1)
                        .set_min_delay(Duration::from_millis(5))
                        .set_max_delay(Duration::from_millis(100));
                    ConnectionManager::new_lazy_with_config(redis::Client::clone(client), config)
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

    /// Whether this is a Redis Cluster: a script may then touch the keys of one slot only.
    pub fn is_cluster(&self) -> bool {
        matches!(self.target, Target::Cluster(_))
    }

    /// The time allowed for one call, retry included.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs `call` within the timeout, retrying on a broken or refused connection until the
    /// timeout: after a Redis restart the first call on the old connection fails with a broken
    /// pipe while the manager reconnects, and a call made while Redis is starting is refused.
    /// No client request should fail because of a restart that ends within the timeout.
    /// Nothing is retried once Redis has answered, so a script never runs twice.
    pub async fn run<T, F, Fut>(&self, call: F) -> Result<T, StoreError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        let attempt = async {
            let mut pause = Duration::from_millis(2);
            loop {
                match call(self.connection()?).await {
                    Err(e) if is_connection_error(&e) => {
                        if self.down_for() > self.timeout {
                            return Err(StoreError::Backend(e.to_string()));
                        }
                        // The manager reconnects in the background; give it a moment, a little
                        // longer each time. The outer timeout ends the loop.
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(50));
                    }
                    other => {
                        self.down_since.store(0, Ordering::Relaxed);
                        return other.map_err(answered_error);
                    }
                }
            }
        };
        match tokio::time::timeout(self.timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout),
        }
    }

    /// How long every call has met a broken or refused connection; starts the count if none has.
    fn down_for(&self) -> Duration {
        let now = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX - 1) + 1;
        let since =
            match self
                .down_since
                .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => now,
                Err(since) => since,
            };
        Duration::from_micros(now.saturating_sub(since))
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

/// The store error for an error Redis answered with. Redis at its `maxmemory` (with
/// `noeviction`, as operations.md asks) refuses every call that would write, before it
/// writes anything: a script without flags (every `FCALL`) is refused whole, and an
/// `EVALSHA` script at its first write. That is a full store, not an outage, so it is
/// [`StoreError::TooManyKeys`], as the memory store's full table is: the gateway refuses what
/// a quota must count rather than apply the route's `on_store_error: open` and admit it
/// unmetered, which would lift every quota for whoever filled Redis (a client spraying
/// quota keys, say).
///
/// Redis 7 answers with the error code `OOM`; Redis 6 wraps an OOM raised inside a script in
/// an `ERR Error running script` whose text carries Redis's own OOM message.
pub(crate) fn answered_error(e: RedisError) -> StoreError {
    let oom = e.code() == Some("OOM")
        || e.detail()
            .is_some_and(|d| d.contains("OOM command not allowed"));
    if oom {
        StoreError::TooManyKeys
    } else {
        StoreError::Backend(e.to_string())
    }
}

fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal()
}
