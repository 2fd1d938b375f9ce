//! Group commit for the Redis store's decisions: the requests of one lane that reach the store
//! while a call for that lane is out go together in the next call, which decides them one after
//! another, exactly as separate calls would. Four kinds of call are batched, each with its lane:
//! - quota + least-used, per route and quota key (`lua/fused_run.lua`);
//! - a quota alone, per route and quota key (`lua/quota_run.lua`);
//! - least-used alone, per route (`lua/allocator_run.lua`'s `assign`);
//! - the general assignment (member windows, cooldowns, a preference order: key pools), per
//!   route and quota key (`lua/assign_run.lua`). Each request brings its call as written alone,
//!   and the script decides them one after another on its own keys and arguments. An ask with a
//!   lease, a sticky session, a client's windows or windows that reserve usage keeps a call of
//!   its own (redis.rs).
//!
//! Why: such a call costs Redis a fixed part before it decides anything (running the script,
//! reading the quota's hash and logs or the pool, writing them back), several times what each
//! request it decides adds. Under load that fixed cost was most of Redis's share of a
//! request, and Redis shares the gateway's cores (docs/benchmarks.md).
//!
//! How:
//! - A *lane* (kind, route, quota key, windows, clock) exists while a task is sending its
//!   calls. The first request to find none creates it and spawns the task; later ones queue in
//!   it. The task takes every request waiting (at most [`MAX_BATCH`]), makes one call, hands
//!   each request its own reply, and goes on until no request waits; then the lane is removed.
//!   A call never waits for company: a lone request goes at once, as before. While the gateway
//!   is not under load (load.rs) and its calls stay small ([`SMALL_CALL`]), a lane may have two
//!   tasks, so two calls out at once ([`MAX_CALLS`]): a request that finds one call out starts
//!   the second task and goes at once too. There, waiting for the call out was most of what a
//!   request's store call added to its latency.
//! - The task, not a request, makes the call. A request that gives up (its client left, its
//!   timeout passed) cannot cancel a call that decides others too. One that gave up before its
//!   call left is taken out of it, so it is never charged. A request waits for its call to
//!   leave at most the store's timeout (then it leaves the queue, uncharged); once its call has
//!   left, it waits for that call's answer, which the call's own timeout bounds, so that it is
//!   never told "timeout" after a call that charged it answered in time. The request that
//!   makes a lane is in its first call, which leaves at once: it needs no timer of its own.
//! - A script that fails part-way (a Lua error on data it did not write there: a key of another
//!   type, a log entry of another form; Redis refuses a call for want of memory before it writes,
//!   never after) is not rolled back: what it recorded for the requests before the failure
//!   stays, and every request of the call gets the error, as a request whose own call timed out
//!   after Redis ran it. Such requests follow their route's `on_store_error`; what they were
//!   charged leaves with its window. A batched call writes each helper hash's running totals
//!   once, at its end, so such a failure can also leave a hash's totals disagreeing with its
//!   logs (a limit cut short, or entries not counted) until the logs empty.
//! - Every resource is bounded: lanes exist only while requests wait in them, a call holds at
//!   most [`MAX_BATCH`] requests, and a lane has at most [`MAX_CALLS`] calls out (a second
//!   only below saturation).
//! - With batching off (`state.redis.batch: false`, for comparing latency and for debugging),
//!   each request makes its own call of the same script, at once, from its own task.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use redis::{Arg, Value};
use tokio::sync::oneshot;

use sluice_limiter::{Acquire, StoreError, Window};

use crate::call::{ScriptCall, Written};
use crate::connection::RedisConnection;
use crate::keys::Keys;

use crate::scripts::Scripts;

/// The most requests one call decides. Redis runs nothing else while a script runs, so a call
/// stays short (docs/benchmarks.md has what a full one costs Redis), and its reply stays small.
pub const MAX_BATCH: usize = 32;

/// The most calls of one lane out at once, below saturation. Nothing depends on the order Redis
/// runs a lane's calls in: each is atomic and decides on what Redis holds when it runs. Under
/// load a lane keeps one call out, of every kind: a call's fixed part (running the script,
/// reading and writing each helper hash, log and pool it touches once) is most of what it costs
/// Redis, key pools included (`scripts/redis-script-cost --batch`: a key-pool call of 16
/// requests is about two thirds fixed part), so fewer, larger calls serve a saturated route best.
const MAX_CALLS: usize = 2;

/// Below saturation, a lane starts a second call only while its calls stay this small. Calls
/// that grow past it mean requests pile up while one is out, because of their rate or of
/// Redis's pace (several gateways that are each idle can keep one Redis busy): then one call at
/// a time serves them with less of Redis's time, as under load.
const SMALL_CALL: usize = 4;

/// Which script a lane's calls run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// A route quota and least-used together (`fused_run.lua`).
    Fused,
    /// A route quota alone (`quota_run.lua`).
    Quota,
    /// Least-used alone (`allocator_run.lua`'s `assign`).
    LeastUsed,
    /// The general assignment (`assign_run.lua`), each request's call written whole.
    Assign,
}

/// One request for a batched call, as its caller holds it.
pub(crate) struct Ask<'a> {
    kind: Kind,
    route: &'a str,
    key: &'a str,
    windows: &'a [Window],
    at_us: Option<u64>,
    cost: u64,
    excluded: &'a [&'a str],
    /// [`Kind::Assign`]: the request's own call, as `ScriptCall::into_parts` gives it (shared
    /// by the requests whose call depends on their route's configuration alone: written.rs).
    call: Option<Written>,
}

impl<'a> Ask<'a> {
    /// Quota `q` and its route's pool, least-used, `excluded` left out.
    pub(crate) fn fused(q: &Acquire<'a>, excluded: &'a [&'a str]) -> Ask<'a> {
        Ask {
            kind: Kind::Fused,
            route: q.route,
            key: q.key,
            windows: q.windows,
            at_us: q.at_us,
            cost: q.cost,
            excluded,
            call: None,
        }
    }

    /// Quota `q` alone.
    pub(crate) fn quota(q: &Acquire<'a>) -> Ask<'a> {
        Ask {
            kind: Kind::Quota,
            ..Ask::fused(q, &[])
        }
    }

    /// `route`'s pool alone, least-used, `excluded` left out.
    pub(crate) fn least_used(route: &'a str, excluded: &'a [&'a str]) -> Ask<'a> {
        Ask {
            kind: Kind::LeastUsed,
            route,
            key: "",
            windows: &[],
            at_us: None,
            cost: 0,
            excluded,
            call: None,
        }
    }

    /// A general assignment on `route` (against quota key `key` with `windows`, on the clock
    /// `at_us`), whose call of `assign_run.lua` alone is `call`.
    pub(crate) fn assign(
        route: &'a str,
        key: &'a str,
        windows: &'a [Window],
        at_us: Option<u64>,
        call: Written,
    ) -> Ask<'a> {
        Ask {
            kind: Kind::Assign,
            route,
            key,
            windows,
            at_us,
            cost: 0,
            excluded: &[],
            call: Some(call),
        }
    }
}

/// What a lane's requests share, and so what one call is for.
struct LaneId {
    kind: Kind,
    route: String,
    key: String,
    windows: Vec<Window>,
    at_us: Option<u64>,
}

impl LaneId {
    fn of(ask: &Ask<'_>) -> LaneId {
        LaneId {
            kind: ask.kind,
            route: ask.route.to_string(),
            key: ask.key.to_string(),
            windows: ask.windows.to_vec(),
            at_us: ask.at_us,
        }
    }

    fn is(&self, ask: &Ask<'_>) -> bool {
        self.kind == ask.kind
            && self.route == ask.route
            && self.key == ask.key
            && self.at_us == ask.at_us
            && self.windows == ask.windows
    }

    /// How many values each request's reply holds in the call's flat reply; 0 when the reply
    /// holds one array per request (their lengths differ).
    fn width(&self) -> usize {
        match self.kind {
            Kind::Fused => 4 + 2 * self.windows.len(),
            Kind::Quota => 2 + 2 * self.windows.len(),
            Kind::LeastUsed => 2,
            Kind::Assign => 0,
        }
    }

    /// The most calls of this lane out at once.
    fn calls(&self) -> usize {
        if crate::load::is_under_load() {
            1
        } else {
            MAX_CALLS
        }
    }
}

/// A request waiting for its call.
struct Waiter {
    /// Tells this request apart in its lane, so that it can leave the queue when its time
    /// runs out there.
    ticket: u64,
    cost: u64,
    excluded: Vec<String>,
    /// [`Kind::Assign`]: the request's call alone and its key count.
    call: Option<Written>,
    reply: oneshot::Sender<Result<Value, StoreError>>,
}

struct Lane {
    id: Arc<LaneId>,
    waiting: Vec<Waiter>,
    /// Tasks sending this lane's calls, each one call at a time. A new one starts only while
    /// there are fewer than `id.calls()` (which changes with the load, so a lane may briefly
    /// have more until one ends).
    tasks: usize,
    /// How many requests the lane's last call took.
    last: usize,
}

/// How lanes are found. foldhash, not the standard SipHash: SipHash was most of a lookup's cost,
/// and every batched request looks its lane up two or three times. foldhash resists crafted
/// collisions only by its per-process seed, and the quota key in a lane's id may come from a
/// client's header; that is enough here, since ids with one hash still share a bucket, told apart
/// by [`LaneId::is`], and a lane lives only while its requests wait: colliding ids cost a scan
/// of requests already in flight, nothing that grows. The quality variant, for the better low
/// bits the map's probing uses.
type Hasher = foldhash::quality::RandomState;

/// The lanes of one store, by a hash of their id (a lookup allocates nothing; a lane's id is
/// copied once, when it is created).
pub(crate) struct Batches {
    connection: Arc<RedisConnection>,
    scripts: Arc<Scripts>,
    keys: Arc<Keys>,
    lanes: Mutex<HashMap<u64, Vec<Lane>, Hasher>>,
    hasher: Hasher,
    /// The next [`Waiter::ticket`].
    tickets: AtomicU64,
    /// Off: one call per request (`state.redis.batch: false`).
    on: bool,
}

impl Batches {
    pub(crate) fn new(
        connection: Arc<RedisConnection>,
        scripts: Arc<Scripts>,
        keys: Arc<Keys>,
        on: bool,
    ) -> Batches {
        Batches {
            connection,
            scripts,
            keys,
            lanes: Mutex::new(HashMap::default()),
            hasher: Hasher::default(),
            tickets: AtomicU64::new(0),
            on,
        }
    }

    /// Whether requests that wait together share a call.
    pub(crate) fn on(&self) -> bool {
        self.on
    }

    fn lanes(&self) -> MutexGuard<'_, HashMap<u64, Vec<Lane>, Hasher>> {
        // Nothing panics while holding the lock; if something ever did, the map is still whole.
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn hash(&self, ask: &Ask<'_>) -> u64 {
        self.hasher
            .hash_one((ask.kind, ask.route, ask.key, ask.at_us))
    }

    /// Decides one request in the next call of its lane. The reply is the request's own, as its
    /// script gives it for a call of one request.
    pub(crate) async fn decide(self: &Arc<Self>, mut ask: Ask<'_>) -> Result<Value, StoreError> {
        let (tx, mut rx) = oneshot::channel();
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let waiter = Waiter {
            ticket,
            cost: ask.cost,
            excluded: ask.excluded.iter().map(|e| e.to_string()).collect(),
            call: ask.call.take(),
            reply: tx,
        };
        let received = |r: Result<_, oneshot::error::RecvError>| {
            r.unwrap_or_else(|_| {
                Err(StoreError::Backend(
                    "the batched call ended without a reply".into(),
                ))
            })
        };
        if !self.on {
            // Its own call, made here: no lane, no queue, and the call's timeout is the bound.
            let id = LaneId::of(&ask);
            let reply = self.call(&id, std::slice::from_ref(&waiter)).await;
            deliver(vec![waiter], id.width(), reply);
            return received(rx.await);
        }
        let hash = self.hash(&ask);
        let mut first = false;
        if let Some((id, new)) = self.enqueue(hash, &ask, waiter) {
            first = new;
            // The guard is made before the task is spawned: a task dropped before it first
            // runs (its runtime shutting down) still removes its lane.
            let guard = LaneGuard {
                batches: self.clone(),
                hash,
                id,
                ended: false,
            };
            tokio::spawn(async move { guard.run().await });
        }
        if first {
            // The request that made its lane is alone at the front of its queue, so the task
            // just spawned takes it into its first call, and that call's own timeout bounds the
            // wait. A timer of its own would wait on nothing else, and each costs a timer entry
            // and often a wake-up of the runtime's driver (a system call).
            return received(rx.await);
        }
        // A request waits for its call to leave for at most the store's timeout, as long as a
        // call of its own may take; past it, one still in the queue leaves it, uncharged.
        match tokio::time::timeout(self.connection.timeout(), &mut rx).await {
            Ok(r) => received(r),
            Err(_) if self.withdraw(hash, ticket) => Err(StoreError::Timeout),
            // Its call has left and may charge it: the answer says what it was charged, and
            // the call's own timeout bounds the wait for it. Giving up here would answer a
            // request as refused (or admit it uncounted) that the store may have charged.
            Err(_) => received(rx.await),
        }
    }

    /// Takes the request with `ticket` out of its lane's queue; false if its call has left.
    fn withdraw(&self, hash: u64, ticket: u64) -> bool {
        let mut lanes = self.lanes();
        let Some(bucket) = lanes.get_mut(&hash) else {
            return false;
        };
        for lane in bucket.iter_mut() {
            if let Some(at) = lane.waiting.iter().position(|w| w.ticket == ticket) {
                // In order: the others keep their turn.
                lane.waiting.remove(at);
                return true;
            }
        }
        false
    }

    /// Queues `waiter` in its lane (`hash` is the ask's); the lane's id when a task must be
    /// spawned for it (the lane is new, or has fewer tasks than it may have calls out), and
    /// whether the lane is new (the waiter is then its only one).
    fn enqueue(&self, hash: u64, ask: &Ask<'_>, waiter: Waiter) -> Option<(Arc<LaneId>, bool)> {
        let mut lanes = self.lanes();
        let bucket = lanes.entry(hash).or_default();
        match bucket.iter_mut().find(|lane| lane.id.is(ask)) {
            Some(lane) => {
                lane.waiting.push(waiter);
                let room = lane.last <= SMALL_CALL;
                if lane.tasks < lane.id.calls() && room {
                    lane.tasks += 1;
                    return Some((lane.id.clone(), false));
                }
                None
            }
            None => {
                let id = Arc::new(LaneId::of(ask));
                bucket.push(Lane {
                    id: id.clone(),
                    waiting: vec![waiter],
                    tasks: 1,
                    last: 0,
                });
                Some((id, true))
            }
        }
    }

    /// The requests of the next call: those waiting, up to [`MAX_BATCH`], less any that gave up.
    /// `None` once none waits: the calling task ends, and the lane's last task removes it,
    /// under the same lock, so that the next request creates a new one.
    fn take(&self, hash: u64, id: &Arc<LaneId>) -> Option<Vec<Waiter>> {
        let mut lanes = self.lanes();
        let bucket = lanes.get_mut(&hash)?;
        let at = bucket.iter().position(|l| Arc::ptr_eq(&l.id, id))?;
        let lane = &mut bucket[at];
        if lane.waiting.is_empty() {
            lane.tasks = lane.tasks.saturating_sub(1);
            if lane.tasks > 0 {
                return None;
            }
            bucket.swap_remove(at);
            if bucket.is_empty() {
                lanes.remove(&hash);
            }
            return None;
        }
        let n = lane.waiting.len().min(MAX_BATCH);
        lane.last = n;
        Some(
            lane.waiting
                .drain(..n)
                .filter(|w| !w.reply.is_closed())
                .collect(),
        )
    }

    /// One call of the lane's script for `batch`, laid out as its driver reads several requests.
    async fn call(&self, id: &LaneId, batch: &[Waiter]) -> Result<Value, StoreError> {
        let (library, keys) = (&self.scripts.library, &self.keys);
        let mut call = match id.kind {
            // Its reply: status, member and wait, then the route quota's when it has one.
            Kind::Assign => {
                let quota = match id.windows.len() {
                    0 => 0,
                    n => 2 + 2 * n,
                };
                return self.assign_call(batch, 3 + quota).await;
            }
            Kind::Fused | Kind::Quota => {
                let (script, pool) = match id.kind {
                    Kind::Fused => (&self.scripts.fused, 1),
                    _ => (&self.scripts.quota, 0),
                };
                let mut call = ScriptCall::new(library, script, 1 + id.windows.len() + pool);
                call.key(&keys.quota_meta_parts(&id.route, &id.key));
                for w in &id.windows {
                    call.key(&keys.quota_log_parts(&id.route, &w.name, &id.key));
                }
                if pool == 1 {
                    call.key(&keys.pool_parts(&id.route));
                } else {
                    // quota_run.lua reads the first request's cost before the clock.
                    call.arg(batch.first().map_or(0, |w| w.cost));
                }
                match id.at_us {
                    Some(t) => call.arg(t),
                    None => call.arg(""),
                };
                for w in &id.windows {
                    call.arg(&*w.name).arg(w.limit).arg(w.length_us);
                }
                call
            }
            Kind::LeastUsed => {
                let mut call = ScriptCall::new(library, &self.scripts.allocator, 1);
                call.key(&keys.pool_parts(&id.route));
                call.arg("assign");
                call
            }
        };
        match id.kind {
            Kind::Fused => {
                call.arg(batch.len());
                for w in batch {
                    call.arg(w.cost);
                    call.excluded(&w.excluded);
                }
            }
            Kind::Quota => {
                for w in batch.iter().skip(1) {
                    call.arg(w.cost);
                }
            }
            Kind::LeastUsed => {
                for w in batch {
                    call.excluded(&w.excluded);
                }
            }
            Kind::Assign => {}
        }
        let call = &call;
        self.connection
            .run(|mut conn| async move { call.invoke::<Value>(&mut conn).await })
            .await
    }

    /// One call of `assign_run.lua` for `batch`: a lone request's call as it was written, or
    /// each request's keys, one request after another, and after `*` each request's key count,
    /// argument count and arguments, or `=` for a request whose keys and arguments are those of
    /// the request before it (its keys are not sent again). A lane's requests usually are
    /// alike, and every argument costs Redis about as much as a small command. Requests that
    /// share one written call (written.rs) are alike on sight; others are compared. The batched
    /// reply is flat, `width` values per request; the answer holds one array per request.
    async fn assign_call(&self, batch: &[Waiter], width: usize) -> Result<Value, StoreError> {
        // A lone request's call goes as it was written, not copied (written.rs shares it).
        let alone = match batch {
            [w] => w
                .call
                .as_ref()
                .and_then(|c| ScriptCall::written(&self.scripts.library, &self.scripts.assign, c)),
            _ => None,
        };
        if let Some(call) = &alone {
            let reply = self
                .connection
                .run(|mut conn| async move { call.invoke::<Value>(&mut conn).await })
                .await?;
            return Ok(Value::Array(vec![reply]));
        }
        let rows = rows(batch)?;
        let total: usize = rows.iter().flatten().map(|(keys, _)| keys.len()).sum();
        let mut call = ScriptCall::new(&self.scripts.library, &self.scripts.assign, total);
        if let [Some((keys, args))] = rows.as_slice() {
            for k in keys {
                call.raw_key(k);
            }
            for a in args {
                call.arg(a);
            }
        } else {
            for (keys, _) in rows.iter().flatten() {
                for k in keys {
                    call.raw_key(k);
                }
            }
            call.arg("*");
            for row in &rows {
                let Some((keys, args)) = row else {
                    call.arg("=");
                    continue;
                };
                call.arg(keys.len()).arg(args.len());
                for a in args {
                    call.arg(a);
                }
            }
        }
        let call = &call;
        let reply = self
            .connection
            .run(|mut conn| async move { call.invoke::<Value>(&mut conn).await })
            .await?;
        if batch.len() == 1 {
            return Ok(Value::Array(vec![reply]));
        }
        match reply {
            Value::Array(values) if values.len() == batch.len() * width => {
                let mut values = values.into_iter();
                Ok(Value::Array(
                    (0..batch.len())
                        .map(|_| Value::Array(values.by_ref().take(width).collect()))
                        .collect(),
                ))
            }
            _ => Err(StoreError::Backend(format!(
                "the batched assignment did not answer each of the {} requests",
                batch.len()
            ))),
        }
    }
}

/// A request's call as written alone: its keys, then its arguments.
type Parts<'a> = (Vec<&'a [u8]>, Vec<&'a [u8]>);

/// Each request's keys and arguments in a batched assignment, or `None` where they are the
/// request's before it (sent as `=`, which `assign_run.lua` reads as the last ones written
/// out): the same shared call (written.rs), seen by its pointer, or one equal to the last
/// written out.
fn rows(batch: &[Waiter]) -> Result<Vec<Option<Parts<'_>>>, StoreError> {
    let mut rows: Vec<Option<Parts<'_>>> = Vec::with_capacity(batch.len());
    let mut previous: Option<&Written> = None;
    let mut written: Option<usize> = None;
    for w in batch {
        let Some(call) = &w.call else {
            return Err(StoreError::Backend(
                "an assignment came to its batch without its call".into(),
            ));
        };
        if previous.is_some_and(|p| Arc::ptr_eq(p, call)) {
            rows.push(None);
            continue;
        }
        previous = Some(call);
        let this = parts(call);
        if written.is_some_and(|at| rows[at].as_ref() == Some(&this)) {
            rows.push(None);
            continue;
        }
        written = Some(rows.len());
        rows.push(Some(this));
    }
    Ok(rows)
}

/// The keys and arguments of `call` (after the command's name, the function's or script's,
/// and the key count).
fn parts(call: &Written) -> Parts<'_> {
    let (cmd, keys) = &**call;
    let all = cmd.args_iter();
    // Sized up front: a key-pool call has many keys and arguments, and collecting them grew
    // each `Vec` by doubling.
    let mut out = (
        Vec::with_capacity(*keys),
        Vec::with_capacity(all.len().saturating_sub(3 + keys)),
    );
    for (i, a) in all.skip(3).enumerate() {
        if let Arg::Simple(bytes) = a {
            if i < *keys {
                out.0.push(bytes);
            } else {
                out.1.push(bytes);
            }
        }
    }
    out
}

/// Hands each request its own reply (the script's flat reply, cut into rows of `width`
/// values, one per request, in order), or the call's error to every one (each then follows its
/// route's `on_store_error`).
fn deliver(batch: Vec<Waiter>, width: usize, reply: Result<Value, StoreError>) {
    let n = batch.len();
    match reply {
        Ok(Value::Array(values)) if width == 0 && values.len() == n => {
            for (w, row) in batch.into_iter().zip(values) {
                let _ = w.reply.send(Ok(row));
            }
        }
        Ok(Value::Array(values)) if values.len() == n * width => {
            let mut values = values.into_iter();
            for w in batch {
                let row: Vec<Value> = values.by_ref().take(width).collect();
                // A request that gave up meanwhile no longer listens.
                let _ = w.reply.send(Ok(Value::Array(row)));
            }
        }
        other => {
            let error = match other {
                Err(e) => e,
                Ok(_) => StoreError::Backend(format!(
                    "the batched script did not answer each of the {n} requests"
                )),
            };
            for w in batch {
                let _ = w.reply.send(Err(error.clone()));
            }
        }
    }
}

/// A lane's task, which leaves its lane however it ends: when no request waits (`take`, which
/// removes the lane with its last task), or, if the task is dropped first (its runtime shut
/// down, maybe before it ever ran), on drop, so that requests do not queue behind a task that is
/// gone. A lane removed already, or replaced by a new one of the same id, is left alone.
struct LaneGuard {
    batches: Arc<Batches>,
    hash: u64,
    id: Arc<LaneId>,
    /// Set when `take` has counted this task out.
    ended: bool,
}

impl LaneGuard {
    /// One call after another while requests wait.
    async fn run(mut self) {
        let (batches, hash, id) = (&self.batches, self.hash, &self.id);
        while let Some(batch) = batches.take(hash, id) {
            if batch.is_empty() {
                continue;
            }
            let reply = batches.call(id, &batch).await;
            deliver(batch, id.width(), reply);
        }
        self.ended = true;
    }
}

impl Drop for LaneGuard {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let mut lanes = self.batches.lanes();
        if let Some(bucket) = lanes.get_mut(&self.hash) {
            if let Some(at) = bucket.iter().position(|l| Arc::ptr_eq(&l.id, &self.id)) {
                // Those still waiting get an error from their dropped senders at once.
                bucket.swap_remove(at);
            }
            if bucket.is_empty() {
                lanes.remove(&self.hash);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::Pin;
    use std::task::Poll;

    fn waiters(
        n: usize,
    ) -> (
        Vec<Waiter>,
        Vec<oneshot::Receiver<Result<Value, StoreError>>>,
    ) {
        (0..n)
            .map(|_| {
                let (tx, rx) = oneshot::channel();
                let w = Waiter {
                    ticket: 0,
                    cost: 1,
                    excluded: Vec::new(),
                    call: None,
                    reply: tx,
                };
                (w, rx)
            })
            .unzip()
    }

    /// A call of `keys` keys, then `args`.
    fn written(keys: &[&str], args: &[&str]) -> Written {
        let mut cmd = redis::Cmd::new();
        cmd.arg("FCALL").arg("assign").arg(keys.len());
        for a in keys.iter().chain(args) {
            cmd.arg(*a);
        }
        Arc::new((cmd, keys.len()))
    }

    /// What `rows` makes of requests bringing `calls`: for each, `None` (sent as `=`) or its
    /// keys and arguments.
    fn rows_of(calls: &[&Written]) -> Vec<Option<(Vec<String>, Vec<String>)>> {
        let (mut batch, _replies) = waiters(calls.len());
        for (w, c) in batch.iter_mut().zip(calls) {
            w.call = Some(Arc::clone(c));
        }
        let text = |v: &Vec<&[u8]>| -> Vec<String> {
            v.iter()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .collect()
        };
        rows(&batch)
            .unwrap()
            .iter()
            .map(|r| r.as_ref().map(|(k, a)| (text(k), text(a))))
            .collect()
    }

    /// `=` stands for the last keys and arguments written out (lua/assign_run.lua), whether
    /// the request before shared that call or only wrote an equal one.
    #[test]
    fn a_request_is_sent_as_equal_only_when_its_call_is_the_last_written_out() {
        let a = written(&["k1", "k2"], &["L", "1"]);
        let equal_to_a = written(&["k1", "k2"], &["L", "1"]);
        let b = written(&["k1", "k3"], &["L", "1"]);
        let row = |keys: &[&str], args: &[&str]| {
            Some((
                keys.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                args.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            ))
        };
        let ra = row(&["k1", "k2"], &["L", "1"]);
        let rb = row(&["k1", "k3"], &["L", "1"]);
        assert_eq!(
            rows_of(&[&a, &a, &equal_to_a, &b, &a]),
            vec![ra.clone(), None, None, rb.clone(), ra.clone()]
        );
        assert_eq!(
            rows_of(&[&a, &b, &a, &a]),
            vec![ra.clone(), rb.clone(), ra.clone(), None]
        );
        // A call equal to one written out earlier, but not the last, is written out again.
        assert_eq!(
            rows_of(&[&equal_to_a, &b, &equal_to_a]),
            vec![ra.clone(), rb, ra]
        );
        // A request without its call makes the batch fail, not a malformed call.
        let (batch, _replies) = waiters(1);
        assert!(rows(&batch).is_err());
    }

    #[test]
    fn each_request_gets_its_own_row() {
        let (batch, mut replies) = waiters(2);
        let flat = (0..8).map(Value::Int).collect();
        deliver(batch, 4, Ok(Value::Array(flat)));
        for (i, rx) in replies.iter_mut().enumerate() {
            let row = rx.try_recv().unwrap().unwrap();
            let first = 4 * i as i64;
            assert_eq!(
                row,
                Value::Array((first..first + 4).map(Value::Int).collect())
            );
        }
    }

    /// A reply of the wrong shape (another program's script under our name, a proxy that mangles
    /// arrays) is an error for every request of the call, never a panic or a row of another's.
    #[test]
    fn a_reply_of_the_wrong_shape_is_an_error_for_each_request() {
        let shapes = [
            Value::Nil,
            Value::Int(1),
            Value::Array(vec![]),
            Value::Array((0..7).map(Value::Int).collect()),
            Value::Array((0..9).map(Value::Int).collect()),
        ];
        for shape in shapes {
            let (batch, mut replies) = waiters(2);
            deliver(batch, 4, Ok(shape.clone()));
            for rx in replies.iter_mut() {
                assert!(
                    matches!(rx.try_recv(), Ok(Err(StoreError::Backend(_)))),
                    "{shape:?}"
                );
            }
        }
        let (batch, mut replies) = waiters(3);
        deliver(batch, 4, Err(StoreError::Timeout));
        for rx in replies.iter_mut() {
            assert!(matches!(rx.try_recv(), Ok(Err(StoreError::Timeout))));
        }
    }

    const TIMEOUT: std::time::Duration = std::time::Duration::from_millis(50);

    /// A store whose lane for a plain quota request of route "r" exists with no task behind
    /// it (none is ever spawned: the lane is there), so that a test makes the calls leave.
    /// Nothing connects: the connection is lazy, and no call is made.
    fn parked() -> (Arc<Batches>, Vec<Window>) {
        let connection = RedisConnection::new("redis://127.0.0.1:1", TIMEOUT).unwrap();
        let batches = Arc::new(Batches::new(
            Arc::new(connection),
            Arc::new(Scripts::new()),
            Arc::new(Keys::new("sluice")),
            true,
        ));
        let windows = vec![Window {
            name: "w".into(),
            limit: 10,
            length_us: 1_000_000,
        }];
        (batches, windows)
    }

    fn quota<'a>(windows: &'a [Window]) -> Acquire<'a> {
        Acquire {
            route: "r",
            key: "k",
            windows,
            cost: 1,
            at_us: None,
            client: None,
        }
    }

    fn park(batches: &Batches, ask: &Ask<'_>) -> (u64, Arc<LaneId>) {
        let (hash, id) = (batches.hash(ask), Arc::new(LaneId::of(ask)));
        batches.lanes().entry(hash).or_default().push(Lane {
            id: id.clone(),
            waiting: Vec::new(),
            tasks: 1,
            last: 0,
        });
        (hash, id)
    }

    /// Polls `f` once.
    async fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *f).poll(cx))).await
    }

    /// A request whose time runs out while it waits in its lane leaves the queue: no call will
    /// carry it, so nothing charges it.
    #[tokio::test(start_paused = true)]
    async fn a_request_whose_time_runs_out_in_the_queue_leaves_it() {
        let (batches, windows) = parked();
        let q = quota(&windows);
        let (hash, id) = park(&batches, &Ask::quota(&q));
        let reply = batches.decide(Ask::quota(&q)).await;
        assert!(matches!(reply, Err(StoreError::Timeout)), "{reply:?}");
        assert!(batches.take(hash, &id).is_none(), "the queue is empty");
    }

    /// A request whose call has left waits for that call's answer past its own time: the call
    /// may charge it, and its answer says so. Told "timeout" instead, the request would be
    /// refused (or admitted uncounted) after the store charged it.
    #[tokio::test(start_paused = true)]
    async fn a_request_whose_call_has_left_waits_for_its_answer() {
        let (batches, windows) = parked();
        let q = quota(&windows);
        let (hash, id) = park(&batches, &Ask::quota(&q));
        let mut decided = Box::pin(batches.decide(Ask::quota(&q)));
        assert!(poll_once(&mut decided).await.is_pending(), "queued");
        let batch = batches.take(hash, &id).expect("its call leaves");
        assert_eq!(batch.len(), 1);
        tokio::time::advance(TIMEOUT * 3).await;
        assert!(
            poll_once(&mut decided).await.is_pending(),
            "past its time, it waits for the call that carries it"
        );
        let row = vec![Value::Int(1), Value::Int(0), Value::Int(9), Value::Int(7)];
        deliver(batch, 4, Ok(Value::Array(row.clone())));
        assert_eq!(decided.await.unwrap(), Value::Array(row));
    }
}
