//! The shared backend: every instance on one Redis (or Redis Cluster) sees the same quotas and
//! the same assignment counts. Each request costs one `EVALSHA`: the quota script, the
//! allocator script, or both fused into one.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::{Script, Value};

use crate::connection::RedisConnection;
use crate::keys::Keys;
use crate::scripts::{self, Scripts};
use crate::{Acquire, Assignment, Outcome, StateStore, StoreError};

/// How to reach a single Redis, for a store with a connection of its own.
#[derive(Debug, Clone)]
pub struct RedisStoreConfig {
    /// `redis://host:port/db`.
    pub url: String,
    /// First part of every key.
    pub key_prefix: String,
    /// Time allowed for one call, retry included; past it the caller's policy applies.
    pub timeout: Duration,
}

/// Quotas and least-used pools shared by every gateway instance that uses the same Redis.
pub struct RedisStore {
    connection: Arc<RedisConnection>,
    scripts: Scripts,
    keys: Keys,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store with a connection of its own.
    pub fn new(config: RedisStoreConfig) -> Result<RedisStore, StoreError> {
        let connection = Arc::new(RedisConnection::new(&config.url, config.timeout)?);
        Ok(RedisStore::with_connection(connection, &config.key_prefix))
    }

    /// A store on a (possibly shared) connection, with keys under `key_prefix`.
    pub fn with_connection(connection: Arc<RedisConnection>, key_prefix: &str) -> RedisStore {
        RedisStore {
            connection,
            scripts: Scripts::new(),
            keys: Keys::new(key_prefix),
        }
    }

    /// The key schema this store writes.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// One allocator call on the pool of `route`: `leading` arguments, then the excluded ids.
    async fn allocator(
        &self,
        route: &str,
        leading: &[&str],
        excluded: &[&str],
    ) -> Result<Value, StoreError> {
        let mut invocation = self.scripts.allocator.prepare_invoke();
        invocation.key(self.keys.pool(route));
        for a in leading {
            invocation.arg(*a);
        }
        scripts::push_excluded(&mut invocation, excluded);
        self.invoke(&invocation).await
    }

    async fn invoke<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        self.connection
            .run(|mut conn| async move { invocation.invoke_async::<T>(&mut conn).await })
            .await
    }

    /// One assignment; `None` when the pool does not exist and must be synced first.
    async fn assign_once(
        &self,
        route: &str,
        excluded: &[&str],
        quota: Option<Acquire<'_>>,
    ) -> Result<Option<Assignment>, StoreError> {
        let reply = match &quota {
            None => self.allocator(route, &["assign"], excluded).await?,
            Some(q) => {
                let script: &Script = &self.scripts.fused;
                let mut invocation = script.prepare_invoke();
                for key in self.keys.quota(q.route, q.key, q.windows) {
                    invocation.key(key);
                }
                invocation.key(self.keys.pool(route));
                scripts::push_quota_args(&mut invocation, q);
                scripts::push_excluded(&mut invocation, excluded);
                self.invoke(&invocation).await?
            }
        };
        scripts::parse_assignment(&reply, quota.map(|q| q.windows.len()))
    }
}

#[async_trait]
impl StateStore for RedisStore {
    async fn acquire(&self, req: Acquire<'_>) -> Result<Outcome, StoreError> {
        let mut invocation = self.scripts.quota.prepare_invoke();
        for key in self.keys.quota(req.route, req.key, req.windows) {
            invocation.key(key);
        }
        scripts::push_quota_args(&mut invocation, &req);
        let reply: Vec<i64> = self.invoke(&invocation).await?;
        scripts::parse_quota(&reply, req.windows.len())
    }

    async fn assign(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
        quota: Option<Acquire<'_>>,
    ) -> Result<Assignment, StoreError> {
        // Redis has no empty sorted set: an empty pool is simply one with no member.
        if members.is_empty() {
            return Ok(Assignment::NoMember { quota: None });
        }
        if let Some(a) = self.assign_once(route, excluded, quota).await? {
            return Ok(a);
        }
        // The pool is missing: first use, or Redis restarted empty. Counts start again from
        // the agreed floor, and the request goes on.
        self.sync(route, members, excluded).await?;
        self.assign_once(route, excluded, quota)
            .await?
            .ok_or_else(|| StoreError::Backend("the pool vanished right after its sync".into()))
    }

    async fn sync(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        let n = members.len().to_string();
        let mut leading = Vec::with_capacity(2 + members.len());
        leading.push("sync");
        leading.push(&n);
        leading.extend(members.iter().map(|m| &**m));
        self.allocator(route, &leading, excluded).await.map(drop)
    }

    async fn restore_to_min(
        &self,
        route: &str,
        member: &str,
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        self.allocator(route, &["restore", member], excluded)
            .await
            .map(drop)
    }

    async fn counts(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let key = self.keys.pool(route);
        let pairs: Vec<(String, f64)> = self
            .connection
            .run(|mut conn| {
                let key = key.clone();
                async move {
                    redis::cmd("ZRANGE")
                        .arg(key)
                        .arg(0)
                        .arg(-1)
                        .arg("WITHSCORES")
                        .query_async(&mut conn)
                        .await
                }
            })
            .await?;
        Ok(pairs.into_iter().map(|(m, c)| (m, c as u64)).collect())
    }

    async fn ready(&self) -> bool {
        self.connection.ping().await
    }
}
