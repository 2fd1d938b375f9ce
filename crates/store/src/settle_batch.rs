//! Group commit for settlements: the settlements of one route (on Redis Cluster, of one slot:
//! the route's, or one client's) that reach the store while a call for them is out go together
//! in the next call, which settles them one after another (`lua/usage_run.lua`).
//!
//! Why: a settlement comes after every answer, and a call costs Redis a fixed few µs before it
//! changes anything; requests that end together (a burst, streams cut by one deploy) share it,
//! as admissions share theirs (batch.rs).
//!
//! How: as batch.rs. A lane exists while a task is sending its calls; the first settlement to
//! find none creates it and spawns the task; later ones queue in it. The task takes the waiting
//! settlements (at least one request's, at most about [`MAX_SETTLEMENTS`]), makes one call and
//! hands each request its own states, until none waits. Unlike an admission, a settlement whose
//! caller gave up is still sent: the usage happened, and a reservation left standing would
//! only refuse early.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use sluice_limiter::{
    placement, EntryId, Owner, Period, Settle, Settled, StoreError, Window, MAX_AMOUNT,
};

use crate::call::ScriptCall;
use crate::connection::RedisConnection;
use crate::keys::Keys;
use crate::scripts::{self, Scripts};

/// About the most settlements one call makes (a request's own are never split): Redis runs
/// nothing else while a script runs, so a call stays short.
pub const MAX_SETTLEMENTS: usize = 64;

/// A settlement, owned, while it waits for its call.
pub(crate) struct Owned {
    owner: Owner,
    key: String,
    windows: Vec<Window>,
    entry: EntryId,
    reserved: Vec<u64>,
    settled: Vec<u64>,
    periods: Vec<Option<Period>>,
}

impl Owned {
    pub(crate) fn of(s: &Settle<'_>) -> Owned {
        Owned {
            owner: s.owner,
            key: s.key.to_string(),
            windows: s.windows.to_vec(),
            entry: s.entry,
            reserved: s.reserved.to_vec(),
            settled: s.settled.to_vec(),
            periods: s.periods.to_vec(),
        }
    }

    fn settle(&self) -> Settle<'_> {
        Settle {
            key: &self.key,
            windows: &self.windows,
            entry: self.entry,
            reserved: &self.reserved,
            settled: &self.settled,
            periods: &self.periods,
            owner: self.owner,
        }
    }
}

/// One request's settlements waiting for their call.
struct Waiter {
    items: Vec<Owned>,
    reply: oneshot::Sender<Result<Vec<Vec<Settled>>, StoreError>>,
}

/// What a lane's settlements share: the route, the slot's tag ("" for the route's own, a
/// client's name on Cluster) and the clock.
type LaneKey = (String, String, Option<u64>);

/// The settlement lanes of one store.
pub(crate) struct SettleBatches {
    connection: Arc<RedisConnection>,
    scripts: Arc<Scripts>,
    keys: Arc<Keys>,
    lanes: Mutex<HashMap<LaneKey, Vec<Waiter>>>,
}

impl SettleBatches {
    pub(crate) fn new(
        connection: Arc<RedisConnection>,
        scripts: Arc<Scripts>,
        keys: Arc<Keys>,
    ) -> SettleBatches {
        SettleBatches {
            connection,
            scripts,
            keys,
            lanes: Mutex::new(HashMap::new()),
        }
    }

    fn lanes(&self) -> MutexGuard<'_, HashMap<LaneKey, Vec<Waiter>>> {
        // Nothing panics while holding the lock; if something ever did, the map is still whole.
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Settles `items` (one slot's, of `route`) in the next call of their lane; their states, in
    /// order.
    pub(crate) async fn settle(
        self: &Arc<Self>,
        route: &str,
        tag: &str,
        items: Vec<Owned>,
        at_us: Option<u64>,
    ) -> Result<Vec<Vec<Settled>>, StoreError> {
        let (tx, rx) = oneshot::channel();
        let key: LaneKey = (route.to_string(), tag.to_string(), at_us);
        let waiter = Waiter { items, reply: tx };
        let spawn = {
            let mut lanes = self.lanes();
            match lanes.get_mut(&key) {
                Some(waiting) => {
                    waiting.push(waiter);
                    false
                }
                None => {
                    lanes.insert(key.clone(), vec![waiter]);
                    true
                }
            }
        };
        if spawn {
            let batches = self.clone();
            tokio::spawn(async move { batches.run(key).await });
        }
        // The call has the store's timeout; waiting for the call before it may take as long
        // again.
        match tokio::time::timeout(2 * self.connection.timeout(), rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(StoreError::Backend(
                "the batched settlement ended without a reply".into(),
            )),
            Err(_) => Err(StoreError::Timeout),
        }
    }

    /// The lane's task: one call after another while settlements wait.
    async fn run(self: Arc<Self>, key: LaneKey) {
        while let Some(batch) = self.take(&key) {
            let all: Vec<Settle<'_>> = batch
                .iter()
                .flat_map(|w| w.items.iter().map(Owned::settle))
                .collect();
            let refs: Vec<&Settle<'_>> = all.iter().collect();
            let result = settle_call(
                &self.connection,
                &self.scripts,
                &self.keys,
                &key.0,
                &refs,
                key.2,
            )
            .await;
            match result {
                Ok(states) => {
                    let mut states = states.into_iter();
                    for w in batch {
                        let mine = states.by_ref().take(w.items.len()).collect();
                        let _ = w.reply.send(Ok(mine));
                    }
                }
                Err(error) => {
                    for w in batch {
                        let _ = w.reply.send(Err(error.clone()));
                    }
                }
            }
        }
    }

    /// The settlements of the next call: whole requests' while they fit, at least one. `None`
    /// once none waits; the lane is then removed, under the same lock.
    fn take(&self, key: &LaneKey) -> Option<Vec<Waiter>> {
        let mut lanes = self.lanes();
        let waiting = lanes.get_mut(key)?;
        if waiting.is_empty() {
            lanes.remove(key);
            return None;
        }
        let mut n = 0;
        let mut count = 0;
        while n < waiting.len() && (n == 0 || count + waiting[n].items.len() <= MAX_SETTLEMENTS) {
            count += waiting[n].items.len();
            n += 1;
        }
        Some(waiting.drain(..n).collect())
    }
}

/// One call of the usage script that settles `batch`, whose keys share a slot.
pub(crate) async fn settle_call(
    connection: &RedisConnection,
    scripts: &Scripts,
    keys: &Keys,
    route: &str,
    batch: &[&Settle<'_>],
    at_us: Option<u64>,
) -> Result<Vec<Vec<Settled>>, StoreError> {
    let count = batch.iter().map(|s| 1 + s.windows.len()).sum();
    let mut call = ScriptCall::new(&scripts.library, &scripts.usage, count);
    for s in batch {
        match s.owner {
            Owner::Route => {
                call.key(&keys.quota_meta_parts(route, s.key));
                for w in s.windows {
                    call.key(&keys.quota_log_parts(route, &w.name, s.key));
                }
            }
            Owner::Member => {
                call.key(&keys.member_meta_parts(route, s.key));
                for w in s.windows {
                    call.key(&keys.member_log_parts(route, &w.name, s.key));
                }
            }
            Owner::Client => {
                call.key(&keys.client_meta_parts(s.key));
                for w in s.windows {
                    call.key(&keys.client_log_parts(s.key, &w.name));
                }
            }
        }
    }
    call.arg("settle");
    match at_us {
        Some(t) => call.arg(t),
        None => call.arg(""),
    };
    call.arg(batch.len());
    for s in batch {
        call.arg(s.entry.seq).arg(s.windows.len());
        for (i, w) in s.windows.iter().enumerate() {
            let length = placement(w, s.periods, i, s.entry.at_us).1;
            call.arg(&*w.name).arg(w.limit).arg(length);
        }
        for (i, w) in s.windows.iter().enumerate() {
            let at = placement(w, s.periods, i, s.entry.at_us).0;
            call.arg(at)
                .arg(s.reserved[i].min(MAX_AMOUNT))
                .arg(s.settled[i].min(MAX_AMOUNT));
        }
    }
    let call = &call;
    let reply: Vec<i64> = connection
        .run(|mut conn| async move { call.invoke::<Vec<i64>>(&mut conn).await })
        .await?;
    let counts: Vec<usize> = batch.iter().map(|s| s.windows.len()).collect();
    scripts::parse_settled(&reply, &counts)
}
