//! The shared allocator: a sorted set per pool at `<prefix>:{<route>}:pool`, and one script.
//!
//! The pool key carries the route's hash tag, like the route's quota keys, so the fused
//! quota + least-used script touches a single Redis Cluster slot.

use std::sync::Arc;

use async_trait::async_trait;
use redis::{Script, Value};
use sluice_limiter::{
    parse_reply, push_quota_args, Acquire, RedisConnection, RedisStore, StoreError, QUOTA_LIBRARY,
};

use crate::{Assignment, AssignmentStore};

const LIBRARY: &str = include_str!("../../../lua/allocator.lua");
const DRIVER: &str = include_str!("../../../lua/allocator_run.lua");
const FUSED: &str = include_str!("../../../lua/fused_run.lua");

/// Least-used selection shared by every instance on one Redis.
pub struct RedisAllocator {
    connection: Arc<RedisConnection>,
    /// Builds the quota keys of fused calls exactly as the quota store does.
    quota_keys: RedisStore,
    allocator: Script,
    fused: Script,
    key_prefix: String,
}

impl RedisAllocator {
    /// An allocator on a (shared) connection, with keys under `key_prefix`.
    pub fn new(connection: Arc<RedisConnection>, key_prefix: &str) -> RedisAllocator {
        RedisAllocator {
            quota_keys: RedisStore::with_connection(connection.clone(), key_prefix),
            connection,
            allocator: Script::new(&format!("{LIBRARY}\n{DRIVER}")),
            fused: Script::new(&format!("{QUOTA_LIBRARY}\n{LIBRARY}\n{FUSED}")),
            key_prefix: key_prefix.to_string(),
        }
    }

    fn pool_key(&self, route: &str) -> String {
        format!("{}:{{{route}}}:pool", self.key_prefix)
    }

    async fn call(
        &self,
        script: &Script,
        keys: &[String],
        args: Args<'_>,
    ) -> Result<Value, StoreError> {
        let mut invocation = script.prepare_invoke();
        for k in keys {
            invocation.key(k);
        }
        if let Some(q) = &args.quota {
            push_quota_args(&mut invocation, q);
        }
        for a in args.leading {
            invocation.arg(*a);
        }
        invocation.arg(args.excluded.len());
        for e in args.excluded {
            invocation.arg(*e);
        }
        self.connection
            .run(|mut conn| {
                let invocation = &invocation;
                async move { invocation.invoke_async::<Value>(&mut conn).await }
            })
            .await
    }

    async fn assign_once(
        &self,
        route: &str,
        excluded: &[&str],
        quota: Option<Acquire<'_>>,
    ) -> Result<Option<Assignment>, StoreError> {
        let pool = self.pool_key(route);
        let reply = match &quota {
            None => {
                let args = Args {
                    quota: None,
                    leading: &["assign"],
                    excluded,
                };
                self.call(&self.allocator, std::slice::from_ref(&pool), args)
                    .await?
            }
            Some(q) => {
                let mut keys = self.quota_keys.keys(q.route, q.key, q.windows);
                keys.push(pool);
                let args = Args {
                    quota: Some(*q),
                    leading: &[],
                    excluded,
                };
                self.call(&self.fused, &keys, args).await?
            }
        };
        parse_assignment(reply, quota.map(|q| q.windows.len()))
    }
}

/// Arguments of one call: the quota's (fused calls), the driver's leading ones, then the
/// excluded ids with their count.
struct Args<'a> {
    quota: Option<Acquire<'a>>,
    leading: &'a [&'a str],
    excluded: &'a [&'a str],
}

fn bad(reply: &Value) -> StoreError {
    StoreError::Backend(format!("unexpected allocator reply {reply:?}"))
}

/// `{status, member, quota reply...}` → an assignment, or `None` when the pool must be synced.
fn parse_assignment(
    reply: Value,
    windows: Option<usize>,
) -> Result<Option<Assignment>, StoreError> {
    let Value::Array(items) = &reply else {
        return Err(bad(&reply));
    };
    let int = |v: &Value| match v {
        Value::Int(i) => Some(*i),
        _ => None,
    };
    let status = items.first().and_then(int).ok_or_else(|| bad(&reply))?;
    if status == 3 {
        return Ok(None);
    }
    let member = match items.get(1) {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(Value::SimpleString(s)) => s.clone(),
        _ => String::new(),
    };
    let quota = match windows {
        Some(n) => {
            let numbers: Vec<i64> = items[2..].iter().filter_map(int).collect();
            if numbers.len() != 2 + 2 * n {
                return Err(bad(&reply));
            }
            Some(parse_reply(&numbers, n)?)
        }
        None => None,
    };
    Ok(match status {
        1 => Some(Assignment::Assigned { member, quota }),
        2 => Some(Assignment::NoMember { quota }),
        0 => Some(Assignment::QuotaRefused(quota.ok_or_else(|| bad(&reply))?)),
        _ => return Err(bad(&reply)),
    })
}

#[async_trait]
impl AssignmentStore for RedisAllocator {
    async fn sync(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        let mut leading = vec!["sync"];
        let n = members.len().to_string();
        leading.push(&n);
        leading.extend(members.iter().map(|m| &**m));
        let args = Args {
            quota: None,
            leading: &leading,
            excluded,
        };
        self.call(&self.allocator, &[self.pool_key(route)], args)
            .await
            .map(drop)
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

    async fn restore_to_min(
        &self,
        route: &str,
        member: &str,
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        let args = Args {
            quota: None,
            leading: &["restore", member],
            excluded,
        };
        self.call(&self.allocator, &[self.pool_key(route)], args)
            .await
            .map(drop)
    }

    async fn counts(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let key = self.pool_key(route);
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
}
