//! Sliding-window quota logs in process: the same logs as the Redis script keeps, on a
//! monotonic clock. `sluice-allocator`'s memory store keeps its route quotas and its members'
//! own windows in two of these.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use crate::{
    check_amounts, check_periods, placement, Acquire, EntryId, Outcome, Period, Reservation,
    Reserve, Settle, Settled, StoreError, Window, WindowState, WindowUsage, MAX_AMOUNT,
};

/// Marks an entry's `seq` while it is a reservation not settled yet (entry numbers never get
/// near it), so that the log knows what part of its total is open without another field.
const OPEN: u64 = 1 << 63;

/// Independent shards, so that requests for different keys rarely meet on a lock.
const SHARDS: usize = 64;

/// The most quota keys one route may hold in memory by default, over all shards
/// ([`crate::MemoryLimits::max_keys`]). A client that chooses its key (`key: header:X-Tenant`)
/// could otherwise grow the store without bound. Past it, keys whose entries have all left
/// their windows are dropped first; if the route is still full, a request with a new key is
/// refused ([`StoreError::TooManyKeys`]). Forgetting a key that still holds admitted requests
/// would let its owner in again, and admitting the new key without a log would leave it
/// unmetered: both would lift the quota.
pub const MAX_KEYS_PER_ROUTE: usize = 100_000;

/// The most log entries one route may hold in memory by default, over all its keys and windows
/// ([`crate::MemoryLimits::max_entries`]). A key holds one entry per admitted request per
/// window, so its size is its limits', not its name's: bounding keys alone would let one key
/// with a large limit, or many keys with moderate ones, hold any amount. An entry is 24 bytes
/// (a log's buffer holds at most four times its entries, see `Log::shrink`). Past the bound,
/// once entries that left their windows are dropped, a request that would add entries is
/// refused ([`StoreError::TooManyKeys`]) rather than admitted unrecorded.
pub const MAX_ENTRIES_PER_ROUTE: usize = 2_000_000;

/// Once in this many calls, one shard (in turn) drops its entries that left their windows and its
/// idle keys. Every shard is swept once per `SWEEP_EVERY × SHARDS` calls, whichever keys the
/// traffic hits, which bounds the memory held by keys nobody uses any more, and how long such
/// entries count in their route's budget.
const SWEEP_EVERY: u64 = 256;

/// One admitted request, as remembered by each window's log.
#[derive(Debug, Clone, Copy)]
struct Entry {
    at_us: u64,
    cost: u64,
    /// Its number in the shard, which a settlement finds it by: entries are pushed in the
    /// order of their numbers, so each log is sorted by them.
    seq: u64,
}

#[derive(Debug, Default)]
struct Log {
    entries: VecDeque<Entry>,
    total: u64,
    /// The part of `total` held by open reservations (entries marked [`OPEN`]).
    open: u64,
    /// The window's length as last asked, so that a purge can expire the log on its own.
    length_us: u64,
}

impl Log {
    /// Drops the entries that left the window; returns how many.
    fn expire(&mut self, now_us: u64, length_us: u64) -> usize {
        let before = self.entries.len();
        while let Some(e) = self.entries.front() {
            if e.at_us.saturating_add(length_us) > now_us {
                break;
            }
            self.total -= e.cost;
            if e.seq & OPEN != 0 {
                self.open -= e.cost;
            }
            self.entries.pop_front();
        }
        let gone = before - self.entries.len();
        if gone > 0 {
            self.shrink();
        }
        gone
    }

    /// A log that held many entries and now holds few gives the memory back: a buffer never
    /// shrinks by itself, so the entry budget would otherwise not bound what is held.
    fn shrink(&mut self) {
        let (len, capacity) = (self.entries.len(), self.entries.capacity());
        if capacity > 64 && len < capacity / 4 {
            self.entries.shrink_to(len * 2);
        }
    }

    /// Changes `entry` from `reserved` to `settled`, with the total; see [`QuotaLogs::settle`].
    /// Expired entries must be gone already (`expire`), so that one found is in the window.
    fn settle(&mut self, entry: EntryId, reserved: u64, settled: u64, limit: u64) -> Settled {
        let (reserved, settled) = (reserved.min(MAX_AMOUNT), settled.min(MAX_AMOUNT));
        let Ok(at) = self
            .entries
            .binary_search_by_key(&entry.seq, |e| e.seq & !OPEN)
        else {
            return Settled::Gone;
        };
        let e = &mut self.entries[at];
        if e.at_us != entry.at_us || e.cost != reserved || e.seq & OPEN == 0 {
            return Settled::Gone;
        }
        e.cost = settled;
        e.seq &= !OPEN;
        self.open -= reserved;
        self.total = self.total - reserved + settled;
        if settled > reserved && self.total > limit {
            Settled::Overrun
        } else {
            Settled::Done
        }
    }

    /// Microseconds until `need` units have left the window.
    fn wait_for(&self, need: u64, now_us: u64, length_us: u64) -> u64 {
        let mut freed = 0;
        for e in &self.entries {
            freed += e.cost;
            if freed >= need {
                return e.at_us.saturating_add(length_us).saturating_sub(now_us);
            }
        }
        length_us
    }
}

/// The logs of one quota key: one per window, by window name.
#[derive(Debug, Default)]
struct KeyState {
    logs: Vec<(Arc<str>, Log)>,
    last_us: u64,
    longest_us: u64,
}

impl KeyState {
    /// Entries held, over every window.
    fn entries(&self) -> usize {
        self.logs.iter().map(|(_, log)| log.entries.len()).sum()
    }

    /// Whether every entry has left its window.
    fn idle(&self, now: u64) -> bool {
        self.last_us + self.longest_us <= now
    }
}

/// What one route holds over every shard: the keys and entries its bounds
/// ([`crate::MemoryLimits`]) count. The bounds are the route's, not a shard's: a route with one
/// key (the usual quota) keeps all its entries in one shard, and a share of the bound per shard
/// would refuse it at a fraction of its limit.
#[derive(Debug, Default)]
struct RouteBudget {
    keys: AtomicUsize,
    entries: AtomicUsize,
}

impl RouteBudget {
    /// Takes room for `n` more of `count`, unless that would pass `max`: checked and taken in
    /// one step, so that shards deciding at once neither pass the bound together nor refuse
    /// each other on a count one of them is about to give back.
    fn take(count: &AtomicUsize, n: usize, max: usize) -> bool {
        count
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                (c + n <= max).then_some(c + n)
            })
            .is_ok()
    }
}

/// Room taken in a route's budget for a request's entries, given back when dropped unless
/// `keep` says they were recorded: also when the request's `then` unwinds.
struct Room<'a> {
    count: &'a AtomicUsize,
    n: usize,
}

impl Room<'_> {
    fn keep(mut self) {
        self.n = 0;
    }
}

impl Drop for Room<'_> {
    fn drop(&mut self) {
        if self.n > 0 {
            self.count.fetch_sub(self.n, Ordering::Relaxed);
        }
    }
}

/// Entries held by one route's keys in one shard, over every window, kept in step with the
/// route's budget.
#[derive(Debug)]
struct Entries {
    here: usize,
    budget: Arc<RouteBudget>,
}

impl Entries {
    fn sub(&mut self, n: usize) {
        if n > 0 {
            self.here -= n;
            self.budget.entries.fetch_sub(n, Ordering::Relaxed);
        }
    }
}

/// The keys of one route in one shard.
#[derive(Debug)]
struct RouteKeys {
    keys: HashMap<Box<str>, KeyState>,
    /// Entries held by these keys' logs, over every window: what the entry budget counts.
    entries: Entries,
}

impl RouteKeys {
    fn new(budget: Arc<RouteBudget>) -> RouteKeys {
        RouteKeys {
            keys: HashMap::new(),
            entries: Entries { here: 0, budget },
        }
    }

    /// Drops the keys whose every entry has left its window.
    fn drop_idle(&mut self, now: u64) {
        let (mut dropped, mut keys) = (0, 0);
        self.keys.retain(|_, s| {
            let keep = !s.idle(now);
            if !keep {
                dropped += s.entries();
                keys += 1;
            }
            keep
        });
        self.entries.sub(dropped);
        self.entries.budget.keys.fetch_sub(keys, Ordering::Relaxed);
    }

    /// Drops every entry that left its window, and the keys left with none.
    fn purge(&mut self, now: u64) {
        let mut gone = 0;
        for state in self.keys.values_mut() {
            for (_, log) in &mut state.logs {
                gone += log.expire(now, log.length_us);
            }
        }
        self.entries.sub(gone);
        self.drop_idle(now);
    }
}

impl Drop for RouteKeys {
    /// What a shard stops holding leaves the route's budget.
    fn drop(&mut self) {
        let budget = &self.entries.budget;
        budget.keys.fetch_sub(self.keys.len(), Ordering::Relaxed);
        budget
            .entries
            .fetch_sub(self.entries.here, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
struct Shard {
    /// route → quota key → state; two levels so that lookups borrow `&str` and never allocate.
    routes: HashMap<Arc<str>, RouteKeys>,
    /// The last entry number given out. Per shard rather than per key, so that a key dropped
    /// and made again never numbers an entry as a forgotten one was: a late settlement of the
    /// forgotten entry finds nothing.
    seq: u64,
}

/// Every quota log of one gateway instance.
#[derive(Debug)]
pub struct QuotaLogs {
    shards: Box<[Mutex<Shard>]>,
    epoch: Instant,
    /// The wall clock at `epoch`, in µs since the Unix epoch: the clock runs from it, so that a
    /// calendar period (given in Unix time) and the store's time agree, while it stays monotonic.
    epoch_us: u64,
    calls: AtomicU64,
    /// Each route's budget, shared by its keys in every shard. A shard takes a route's budget
    /// from here once, when the route's first key there is made.
    budgets: Mutex<HashMap<Arc<str>, Arc<RouteBudget>>>,
    /// The most keys one route may hold.
    max_keys: usize,
    /// The most log entries one route may hold, over all its keys and windows.
    max_entries: usize,
}

impl Default for QuotaLogs {
    fn default() -> Self {
        QuotaLogs::new()
    }
}

impl QuotaLogs {
    /// No logs yet, with the default bounds.
    pub fn new() -> QuotaLogs {
        QuotaLogs::with_limits(&crate::MemoryLimits::default())
    }

    /// No logs yet, with these bounds.
    pub fn with_limits(limits: &crate::MemoryLimits) -> QuotaLogs {
        QuotaLogs {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            epoch: Instant::now(),
            epoch_us: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
            calls: AtomicU64::new(0),
            budgets: Mutex::new(HashMap::new()),
            max_keys: limits.max_keys.max(1),
            max_entries: limits.max_entries.max(1),
        }
    }

    /// `route`'s budget, made on its first use.
    fn budget(&self, route: &str) -> Arc<RouteBudget> {
        let mut budgets = self.budgets.lock().unwrap_or_else(|p| p.into_inner());
        match budgets.get(route) {
            Some(b) => b.clone(),
            None => budgets.entry(route.into()).or_default().clone(),
        }
    }

    /// Number of quota keys held, across all routes (for tests and status).
    pub fn keys(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap_or_else(|p| p.into_inner());
                s.routes.values().map(|r| r.keys.len()).sum::<usize>()
            })
            .sum()
    }

    /// The store's clock in µs: the Unix time these logs were made at, then monotonic.
    pub fn now_us(&self) -> u64 {
        self.epoch_us + self.epoch.elapsed().as_micros() as u64
    }

    fn shard(&self, route: &str, key: &str) -> &Mutex<Shard> {
        let mut h = DefaultHasher::new();
        route.hash(&mut h);
        key.hash(&mut h);
        &self.shards[(h.finish() as usize) % self.shards.len()]
    }

    /// Decides on one request and records it if admitted.
    pub fn decide(&self, req: Acquire<'_>) -> Result<Outcome, StoreError> {
        // A cost of 0 only reads the windows (see `Acquire::cost`).
        self.decide_then(req, || (req.cost > 0).then_some(()))
            .map(|(outcome, _)| outcome)
    }

    /// Decides on one request; when every window admits it, asks `then` (under the key's lock,
    /// so nothing can slip in between) and records the request only if `then` returns `Some`.
    /// This is how a least-used assignment and its quota become one atomic step: the quota is
    /// never charged for a request that found no member, and never left uncharged for one
    /// that did.
    pub fn decide_then<T>(
        &self,
        req: Acquire<'_>,
        then: impl FnOnce() -> Option<T>,
    ) -> Result<(Outcome, Option<T>), StoreError> {
        let ask = Ask {
            route: req.route,
            key: req.key,
            windows: req.windows,
            amounts: Amounts::Each(req.cost),
            at_us: req.at_us,
            periods: &[],
        };
        self.ask_then(ask, then)
            .map(|(outcome, taken, _)| (outcome, taken))
    }

    /// Decides on a reservation, each window charged its own amount, and records it in every
    /// window when each admits it.
    pub fn reserve(&self, req: Reserve<'_>) -> Result<Reservation, StoreError> {
        self.reserve_then(req, || Some(())).map(|(r, _)| r)
    }

    /// [`QuotaLogs::reserve`], with `then` as in [`QuotaLogs::decide_then`]: the reservation is
    /// recorded only when `then` returns `Some`.
    pub fn reserve_then<T>(
        &self,
        req: Reserve<'_>,
        then: impl FnOnce() -> Option<T>,
    ) -> Result<(Reservation, Option<T>), StoreError> {
        check_amounts(req.windows, req.amounts)?;
        check_periods(req.windows, req.periods)?;
        let ask = Ask {
            route: req.route,
            key: req.key,
            windows: req.windows,
            amounts: Amounts::Per(req.amounts),
            at_us: req.at_us,
            periods: req.periods,
        };
        let (outcome, taken, entry) = self.ask_then(ask, then)?;
        Ok((Reservation { outcome, entry }, taken))
    }

    /// Settles reservations of `route`: each entry, in each window, changes from its reserved
    /// amount to its settled one, and the window's total with it, at once. An entry that left its
    /// window (or was never there: another amount, another number) changes nothing. Returns, per
    /// settlement, what happened in each of its windows.
    pub fn settle(
        &self,
        route: &str,
        settlements: &[Settle<'_>],
        at_us: Option<u64>,
    ) -> Result<Vec<Vec<Settled>>, StoreError> {
        for s in settlements {
            check_amounts(s.windows, s.reserved)?;
            check_amounts(s.windows, s.settled)?;
            check_periods(s.windows, s.periods)?;
        }
        let now = at_us.unwrap_or_else(|| self.now_us());
        let mut out = Vec::with_capacity(settlements.len());
        for s in settlements {
            let mut shard = self
                .shard(route, s.key)
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let route_keys = shard.routes.get_mut(route);
            let RouteKeys { keys, entries } = match route_keys {
                Some(r) => r,
                None => {
                    out.push(vec![Settled::Gone; s.windows.len()]);
                    continue;
                }
            };
            let mut state = keys.get_mut(s.key);
            let mut done = Vec::with_capacity(s.windows.len());
            for (i, w) in s.windows.iter().enumerate() {
                let log = state
                    .as_deref_mut()
                    .and_then(|st| st.logs.iter_mut().find(|(name, _)| *name == w.name));
                let (at, length) = placement(w, s.periods, i, s.entry.at_us);
                done.push(match log {
                    Some((_, log)) => {
                        entries.sub(log.expire(now, length));
                        let entry = EntryId {
                            at_us: at,
                            ..s.entry
                        };
                        log.settle(entry, s.reserved[i], s.settled[i], w.limit)
                    }
                    None => Settled::Gone,
                });
            }
            out.push(done);
        }
        Ok(out)
    }

    /// What each of `windows` of `key` holds now, and how much of it is open reservations;
    /// records nothing, makes no key.
    pub fn usage(
        &self,
        route: &str,
        key: &str,
        windows: &[Window],
        at_us: Option<u64>,
    ) -> Vec<WindowUsage> {
        let now = at_us.unwrap_or_else(|| self.now_us());
        let mut shard = self
            .shard(route, key)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(RouteKeys { keys, entries }) = shard.routes.get_mut(route) else {
            return vec![WindowUsage::default(); windows.len()];
        };
        let mut state = keys.get_mut(key);
        windows
            .iter()
            .map(|w| {
                let log = state
                    .as_deref_mut()
                    .and_then(|st| st.logs.iter_mut().find(|(name, _)| *name == w.name));
                match log {
                    Some((_, log)) => {
                        entries.sub(log.expire(now, w.length_us));
                        WindowUsage {
                            total: log.total,
                            open: log.open,
                        }
                    }
                    None => WindowUsage::default(),
                }
            })
            .collect()
    }

    /// Decides on one request, each window charged its amount; when every window admits it,
    /// asks `then` and records the request only if `then` returns `Some`, returning its entry.
    fn ask_then<T>(
        &self,
        req: Ask<'_>,
        then: impl FnOnce() -> Option<T>,
    ) -> Result<(Outcome, Option<T>, Option<EntryId>), StoreError> {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        if call % SWEEP_EVERY == SWEEP_EVERY - 1 {
            let turn = (call / SWEEP_EVERY) as usize % self.shards.len();
            let mut shard = self.shards[turn].lock().unwrap_or_else(|p| p.into_inner());
            sweep(&mut shard, req.at_us.unwrap_or_else(|| self.now_us()));
        }
        let mut shard = self
            .shard(req.route, req.key)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // The clock is read under the key's lock, as a script reads Redis's `TIME` inside its
        // call: a request that waited for the lock is recorded after the one that held it, so
        // each log's entries stay in time order and expire from its front.
        let now = req.at_us.unwrap_or_else(|| self.now_us());
        let Shard { routes, seq } = &mut *shard;
        if !req.amounts.records()
            && !routes
                .get(req.route)
                .is_some_and(|r| r.keys.contains_key(req.key))
        {
            // A read of a key nothing was charged to (the admin API's, at every scrape): what
            // an empty log answers, and no key or route made for it, as a script makes none.
            let mut scratch = Entries {
                here: 0,
                budget: Arc::default(),
            };
            let mut state = KeyState::default();
            return decide(
                &mut state,
                &mut scratch,
                &mut 0,
                self.max_entries,
                &req,
                now,
                then,
            );
        }
        let route = match routes.get_mut(req.route) {
            Some(route) => route,
            None => routes
                .entry(req.route.into())
                .or_insert_with(|| RouteKeys::new(self.budget(req.route))),
        };
        // A new key takes its place in the route's budget first.
        let mut placed = false;
        if !route.keys.contains_key(req.key) {
            if !RouteBudget::take(&route.entries.budget.keys, 1, self.max_keys) {
                // Idle keys of other shards leave as those shards are swept.
                route.drop_idle(now);
                if !RouteBudget::take(&route.entries.budget.keys, 1, self.max_keys) {
                    return Err(StoreError::TooManyKeys);
                }
            }
            placed = true;
        }
        // What this request would add: one entry per window. When that would pass the budget,
        // the entries in this shard that already left their windows go first (every key's, not
        // only this one's); what is left is refused in `decide`, before anything is recorded.
        let adds = if req.amounts.records() {
            req.windows.len()
        } else {
            0
        };
        if route.entries.budget.entries.load(Ordering::Relaxed) + adds > self.max_entries {
            route.purge(now);
        }
        let RouteKeys { keys, entries } = route;
        let state = match keys.get_mut(req.key) {
            Some(state) => state,
            None => {
                // A key the purge found idle and dropped gave its place back: taken again.
                if !placed && !RouteBudget::take(&entries.budget.keys, 1, self.max_keys) {
                    return Err(StoreError::TooManyKeys);
                }
                keys.entry(req.key.into()).or_default()
            }
        };
        decide(state, entries, seq, self.max_entries, &req, now, then)
    }
}

/// A request as the logs decide it: an [`Acquire`] or a [`Reserve`].
#[derive(Debug, Clone, Copy)]
struct Ask<'a> {
    route: &'a str,
    key: &'a str,
    windows: &'a [Window],
    amounts: Amounts<'a>,
    at_us: Option<u64>,
    /// Per window, its period if it is fixed; empty when every window slides.
    periods: &'a [Option<Period>],
}

/// What each window of an [`Ask`] is charged.
#[derive(Debug, Clone, Copy)]
enum Amounts<'a> {
    /// The same cost in every window (an [`Acquire`]); 0 reads and records nothing.
    Each(u64),
    /// Its own amount per window (a [`Reserve`]), recorded whatever it is.
    Per(&'a [u64]),
}

impl Amounts<'_> {
    fn of(&self, window: usize) -> u64 {
        match self {
            Amounts::Each(cost) => *cost,
            Amounts::Per(amounts) => amounts.get(window).map_or(0, |&a| a.min(MAX_AMOUNT)),
        }
    }

    /// Whether an admitted request adds entries.
    fn records(&self) -> bool {
        match self {
            Amounts::Each(cost) => *cost > 0,
            Amounts::Per(_) => true,
        }
    }
}

/// Decides on one request for the key whose logs are `state`. `entries` is the route's count
/// of entries in this shard, kept up to date with the route's budget; a request that would take
/// the route past `max_entries` is refused with [`StoreError::TooManyKeys`] once it is known to
/// be admissible, before `then` runs, so that nothing anywhere is recorded for it.
fn decide<T>(
    state: &mut KeyState,
    entries: &mut Entries,
    seq: &mut u64,
    max_entries: usize,
    req: &Ask<'_>,
    now: u64,
    then: impl FnOnce() -> Option<T>,
) -> Result<(Outcome, Option<T>, Option<EntryId>), StoreError> {
    state.last_us = now;
    state.longest_us = (0..req.windows.len())
        .map(|i| placement(&req.windows[i], req.periods, i, now).1)
        .max()
        .unwrap_or(0);
    // Windows are few; a linear search by name keeps state across config reloads that
    // reorder, add or remove windows.
    for w in req.windows {
        if !state.logs.iter().any(|(name, _)| *name == w.name) {
            state.logs.push((w.name.clone(), Log::default()));
        }
    }
    let mut dropped = 0;
    state.logs.retain(|(name, log)| {
        let keep = req.windows.iter().any(|w| w.name == *name);
        if !keep {
            dropped += log.entries.len();
        }
        keep
    });
    entries.sub(dropped);

    let mut admitted = true;
    let mut retry_after_us = 0;
    let mut windows = Vec::with_capacity(req.windows.len());
    for (i, w) in req.windows.iter().enumerate() {
        let log = &mut state
            .logs
            .iter_mut()
            .find(|(name, _)| *name == w.name)
            .expect("added above")
            .1;
        let length = placement(w, req.periods, i, now).1;
        log.length_us = length;
        entries.sub(log.expire(now, length));
        let cost = req.amounts.of(i);
        if log.total + cost > w.limit {
            admitted = false;
            let wait = if cost > w.limit {
                length
            } else {
                log.wait_for(log.total + cost - w.limit, now, length)
            };
            retry_after_us = retry_after_us.max(wait);
        }
    }
    // Room for the request's entries is taken before `then`, and given back if it records
    // nothing.
    let mut room = None;
    if admitted && req.amounts.records() {
        let n = req.windows.len();
        if !RouteBudget::take(&entries.budget.entries, n, max_entries) {
            return Err(StoreError::TooManyKeys);
        }
        room = Some(Room {
            count: &entries.budget.entries,
            n,
        });
    }
    let taken = if admitted { then() } else { None };
    let record = taken.is_some();
    if let (Some(room), true) = (room, record) {
        room.keep();
    }
    let entry = record.then(|| {
        *seq += 1;
        EntryId {
            seq: *seq,
            at_us: now,
        }
    });
    for (i, w) in req.windows.iter().enumerate() {
        let log = &mut state
            .logs
            .iter_mut()
            .find(|(name, _)| *name == w.name)
            .expect("added above")
            .1;
        let (at, length) = placement(w, req.periods, i, now);
        if let Some(entry) = entry {
            let cost = req.amounts.of(i);
            let open = matches!(req.amounts, Amounts::Per(_));
            log.entries.push_back(Entry {
                at_us: at,
                cost,
                seq: if open { entry.seq | OPEN } else { entry.seq },
            });
            log.total += cost;
            if open {
                log.open += cost;
            }
            // Its room in the budget was taken above.
            entries.here += 1;
        }
        windows.push(WindowState {
            remaining: w.limit.saturating_sub(log.total),
            reset_us: log
                .entries
                .front()
                .map_or(0, |e| e.at_us.saturating_add(length).saturating_sub(now)),
        });
    }
    let outcome = Outcome {
        admitted,
        retry_after_us,
        windows,
    };
    Ok((outcome, taken, entry))
}

/// Drops the entries that left their windows, and the keys left with none.
fn sweep(shard: &mut Shard, now: u64) {
    // Purged, not only rid of idle keys: a key still in use may hold entries long out of their
    // windows, until it is asked about again, and they count in its route's budget, which
    // requests in every other shard share.
    for route in shard.routes.values_mut() {
        route.purge(now);
    }
    shard.routes.retain(|_, route| !route.keys.is_empty());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Window;

    fn windows() -> Vec<Window> {
        vec![Window {
            name: "w".into(),
            limit: 10,
            length_us: 1_000,
        }]
    }

    /// A request on route `r`, key `k`, of `cost` in each of `windows`, at `at_us`.
    fn on_k(windows: &[Window], cost: u64, at_us: Option<u64>) -> Acquire<'_> {
        Acquire {
            route: "r",
            key: "k",
            windows,
            cost,
            at_us,
            client: None,
        }
    }

    /// A read (cost 0) of a key nothing was charged to answers as an empty log would, and
    /// makes no key: the admin API reads every route's windows at every scrape.
    #[test]
    fn a_read_makes_no_key() {
        let logs = QuotaLogs::new();
        let w = windows();
        let read = on_k(&w, 0, Some(0));
        let outcome = logs.decide(read).unwrap();
        assert!(outcome.admitted);
        assert_eq!(outcome.windows[0].remaining, 10);
        assert_eq!(logs.keys(), 0, "a read made a key");
        // Once charged, the key is read as it is.
        logs.decide(Acquire { cost: 3, ..read }).unwrap();
        assert_eq!(logs.decide(read).unwrap().windows[0].remaining, 7);
        assert_eq!(logs.keys(), 1);
    }

    /// A request that waits for its key's lock is recorded at the time it got the lock, not
    /// at the time it asked: otherwise an entry could go in behind a later one, and the log,
    /// which expires from its front, would hold it past its window.
    #[test]
    fn the_clock_is_read_under_the_key_lock() {
        let logs = Arc::new(QuotaLogs::new());
        let held = logs.shard("r", "k").lock().unwrap();
        let asker = {
            let logs = logs.clone();
            std::thread::spawn(move || {
                let w = windows();
                logs.decide(on_k(&w, 1, None)).unwrap()
            })
        };
        // The asker has counted its call, the step before it reads the clock or locks.
        while logs.calls.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        // A microsecond later than any time the asker could have read before it counted its
        // call: the clock is read in whole microseconds.
        let counted_by = logs.now_us();
        while logs.now_us() == counted_by {
            std::hint::spin_loop();
        }
        let released_at = logs.now_us();
        drop(held);
        assert!(asker.join().unwrap().admitted);
        let shard = logs.shard("r", "k").lock().unwrap();
        let entry_at = shard.routes["r"].keys["k"].logs[0].1.entries[0].at_us;
        assert!(
            entry_at >= released_at,
            "recorded at {entry_at}, before the lock was let go at {released_at}"
        );
    }

    /// What makes a least-used assignment and its quota one step: `then` runs while the key's
    /// lock is held, so no other decision on the key can come between the check and the record.
    #[test]
    fn then_runs_under_the_key_lock() {
        let logs = QuotaLogs::new();
        let w = windows();
        let req = on_k(&w, 1, Some(0));
        let (outcome, held) = logs
            .decide_then(req, || Some(logs.shard("r", "k").try_lock().is_err()))
            .unwrap();
        assert!(outcome.admitted);
        assert_eq!(
            held,
            Some(true),
            "the key's shard is locked while `then` runs"
        );
        // A refused `then` records nothing.
        let (_, none) = logs.decide_then(req, || None::<()>).unwrap();
        assert_eq!(none, None);
        assert_eq!(
            logs.decide(req).unwrap().windows[0].remaining,
            8,
            "two recorded, not three"
        );
    }

    /// A calendar window not cut to its period (a status read that knows no period) has the
    /// longest length there is: its entries never leave, and nothing overflows.
    #[test]
    fn an_endless_window_holds_its_entries_without_overflow() {
        let logs = QuotaLogs::new();
        let w = vec![Window {
            name: "month".into(),
            limit: 2,
            length_us: u64::MAX,
        }];
        let ask = |cost, at_us| Acquire {
            route: "r",
            key: "k",
            windows: &w,
            cost,
            at_us: Some(at_us),
            client: None,
        };
        assert!(logs.decide(ask(2, 1_000)).unwrap().admitted);
        let refused = logs.decide(ask(1, 5_000)).unwrap();
        assert!(!refused.admitted);
        assert_eq!(refused.windows[0].remaining, 0);
        assert_eq!(
            refused.retry_after_us,
            u64::MAX - 5_000,
            "saturated at the end of time"
        );
        assert_eq!(
            logs.decide(ask(0, 9_000)).unwrap().windows[0].reset_us,
            u64::MAX - 9_000
        );
    }

    #[test]
    fn a_route_holds_a_bounded_number_of_keys() {
        let store = QuotaLogs::new();
        let w = windows();
        fn ask<'a>(w: &'a [Window], key: &'a str, at_us: u64) -> Acquire<'a> {
            Acquire {
                route: "r",
                key,
                windows: w,
                cost: 1,
                at_us: Some(at_us),
                client: None,
            }
        }
        let mut refused = 0;
        for i in 0..(MAX_KEYS_PER_ROUTE + 5_000) {
            match store.decide(ask(&w, &format!("k{i}"), 0)) {
                Ok(o) => assert!(o.admitted),
                Err(StoreError::TooManyKeys) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        }
        // The bound is the route's, over every shard: exactly, not a share per shard.
        assert_eq!(refused, 5_000);
        assert_eq!(store.keys(), MAX_KEYS_PER_ROUTE);
        // Other routes are not affected, and a key already held still answers.
        assert!(store
            .decide(Acquire {
                route: "other",
                ..ask(&w, "k1", 0)
            })
            .is_ok());
        assert!(store.decide(ask(&w, "k1", 0)).is_ok());
        // Once the entries have left their windows, new keys take the idle ones' place.
        assert!(store.decide(ask(&w, "fresh", 10_000)).is_ok());
    }

    impl QuotaLogs {
        /// The entries every route's count says it holds, and those its logs really hold; the
        /// routes' budgets must say the same, and hold as many keys as the shards do.
        fn entry_counts(&self) -> (usize, usize) {
            let mut counted = 0;
            let mut held = 0;
            let mut keys = 0;
            for shard in self.shards.iter() {
                let shard = shard.lock().unwrap();
                for route in shard.routes.values() {
                    counted += route.entries.here;
                    held += route.keys.values().map(KeyState::entries).sum::<usize>();
                    keys += route.keys.len();
                }
            }
            let budgets = self.budgets.lock().unwrap();
            let load = |f: fn(&RouteBudget) -> &AtomicUsize| {
                budgets
                    .values()
                    .map(|b| f(b).load(Ordering::Relaxed))
                    .sum::<usize>()
            };
            assert_eq!(load(|b| &b.entries), counted, "the budgets' entries");
            assert_eq!(load(|b| &b.keys), keys, "the budgets' keys");
            (counted, held)
        }
    }

    /// A route with one key (the usual quota) may fill the route's whole budget, though its
    /// entries all live in one shard.
    #[test]
    fn one_key_holds_the_whole_budget() {
        let limits = crate::MemoryLimits {
            max_keys: MAX_KEYS_PER_ROUTE,
            max_entries: 1_000,
        };
        let store = QuotaLogs::with_limits(&limits);
        let w = [Window {
            name: "h".into(),
            limit: 10_000,
            length_us: 3_600_000_000,
        }];
        let ask = |at_us| Acquire {
            route: "r",
            key: "",
            windows: &w,
            cost: 1,
            at_us: Some(at_us),
            client: None,
        };
        for i in 0..1_000 {
            assert!(store.decide(ask(i)).unwrap().admitted, "request {i}");
        }
        assert!(matches!(
            store.decide(ask(1_000)),
            Err(StoreError::TooManyKeys)
        ));
        assert_eq!(store.entry_counts(), (1_000, 1_000));
    }

    /// Entries out of their windows in another shard's key, still in use, leave the route's
    /// budget by the time every shard has been swept: a request in this shard is refused only
    /// until then.
    #[test]
    fn a_sweep_frees_the_budget_other_shards_hold() {
        let limits = crate::MemoryLimits {
            max_keys: MAX_KEYS_PER_ROUTE,
            max_entries: 10,
        };
        let store = QuotaLogs::with_limits(&limits);
        let w = windows();
        let ask = |key: &str, at_us| {
            store.decide(Acquire {
                route: "r",
                key,
                windows: &w,
                cost: 1,
                at_us: Some(at_us),
                client: None,
            })
        };
        let b = "b";
        let a = (0..)
            .map(|i| format!("a{i}"))
            .find(|a| !std::ptr::eq(store.shard("r", a), store.shard("r", b)))
            .unwrap();
        // b fills the budget; its last entry keeps it in use past its first nine's windows.
        for t in 0..9 {
            assert!(ask(b, t).unwrap().admitted);
        }
        assert!(ask(b, 900).unwrap().admitted);
        assert!(matches!(ask(&a, 1_500), Err(StoreError::TooManyKeys)));
        let mut calls = 1;
        while ask(&a, 1_500).is_err() {
            calls += 1;
            assert!(
                calls <= SWEEP_EVERY * SHARDS as u64 + 1,
                "b's entries out of their window still count after every shard was swept"
            );
        }
        assert_eq!(store.entry_counts(), (2, 2));
    }

    /// The budgets are the route's over every shard, and each route's own: keys that land in
    /// different shards share one, and another route has its own.
    #[test]
    fn the_budget_spans_the_shards() {
        let limits = crate::MemoryLimits {
            max_keys: 40,
            max_entries: 50,
        };
        let store = QuotaLogs::with_limits(&limits);
        let w = windows();
        let ask = |route, key: &str| {
            store.decide(Acquire {
                route,
                key,
                windows: &w,
                cost: 1,
                at_us: Some(0),
                client: None,
            })
        };
        // 40 keys, 5 requests each in turn: 50 entries admitted, then every key is refused.
        let mut admitted = 0;
        for round in 0..5 {
            for k in 0..40 {
                match ask("r", &format!("k{k}")) {
                    Ok(o) => {
                        assert!(o.admitted);
                        admitted += 1;
                    }
                    Err(StoreError::TooManyKeys) => assert!(round > 0, "k{k} refused at once"),
                    Err(e) => panic!("{e}"),
                }
            }
        }
        assert_eq!(admitted, 50);
        assert_eq!(store.keys(), 40);
        assert!(matches!(ask("r", "k41"), Err(StoreError::TooManyKeys)));
        assert!(ask("other", "k41").unwrap().admitted);
        assert_eq!(store.entry_counts(), (51, 51));
    }

    /// A key with a large limit cannot hold more entries than the route's budget: past it, a
    /// request that would add entries is refused, never admitted unrecorded, until entries
    /// leave their windows. A read (cost 0) still answers.
    #[test]
    fn a_route_holds_a_bounded_number_of_entries() {
        let limits = crate::MemoryLimits {
            max_keys: MAX_KEYS_PER_ROUTE,
            max_entries: 10,
        };
        let store = QuotaLogs::with_limits(&limits);
        let w = [
            Window {
                name: "a".into(),
                limit: 1_000,
                length_us: 1_000,
            },
            Window {
                name: "b".into(),
                limit: 1_000,
                length_us: 2_000,
            },
        ];
        let ask = |cost: u64, at_us: u64| Acquire {
            route: "r",
            key: "k",
            windows: &w,
            cost,
            at_us: Some(at_us),
            client: None,
        };
        // Two windows: two entries a request, ten in the route.
        for i in 0..5 {
            assert!(store.decide(ask(1, i)).unwrap().admitted);
        }
        assert!(matches!(
            store.decide(ask(1, 5)),
            Err(StoreError::TooManyKeys)
        ));
        assert_eq!(store.entry_counts(), (10, 10));
        assert_eq!(
            store.decide(ask(0, 6)).unwrap().windows[0].remaining,
            995,
            "the refusal recorded nothing, and reads still answer"
        );
        // At 1,000 µs the first entry has left window a only: one entry freed, not enough.
        assert!(matches!(
            store.decide(ask(1, 1_000)),
            Err(StoreError::TooManyKeys)
        ));
        // At 2,001 µs every request has left window a, and the first two window b: seven
        // entries freed, room for three more requests.
        for _ in 0..3 {
            assert!(store.decide(ask(1, 2_001)).unwrap().admitted);
        }
        assert!(store.decide(ask(1, 2_001)).is_err());
        assert_eq!(store.entry_counts(), (9, 9));
    }

    /// The entry count follows every way entries leave: windows passing, a window removed from
    /// the quota, idle keys swept.
    #[test]
    fn the_entry_count_matches_the_logs() {
        let store = QuotaLogs::new();
        let two = [
            Window {
                name: "a".into(),
                limit: 50,
                length_us: 100,
            },
            Window {
                name: "b".into(),
                limit: 50,
                length_us: 1_000,
            },
        ];
        for t in 0..2_000u64 {
            let key = format!("k{}", t % 37);
            let windows = if t % 5 == 0 { &two[..1] } else { &two[..] };
            let _ = store.decide(Acquire {
                route: if t % 2 == 0 { "r" } else { "s" },
                key: &key,
                windows,
                cost: 1 + t % 3,
                at_us: Some(t * 7),
                client: None,
            });
            let (counted, held) = store.entry_counts();
            assert_eq!(counted, held, "at {t}");
        }
        for _ in 0..(SWEEP_EVERY * SHARDS as u64) {
            let _ = store.decide(Acquire {
                route: "r",
                key: "k0",
                windows: &two,
                cost: 1,
                at_us: Some(1_000_000),
                client: None,
            });
        }
        assert_eq!(store.entry_counts().0, store.entry_counts().1);
    }

    #[test]
    fn idle_keys_are_swept() {
        let store = QuotaLogs::new();
        let w = windows();
        for i in 0..100 {
            let key = format!("k{i}");
            let _ = store.decide(Acquire {
                route: "r",
                key: &key,
                windows: &w,
                cost: 1,
                at_us: Some(0),
                client: None,
            });
        }
        assert_eq!(store.keys(), 100);
        // Calls on one key, long after the window, make every shard sweep in turn.
        for _ in 0..(SWEEP_EVERY * SHARDS as u64) {
            let _ = store.decide(Acquire {
                route: "r",
                key: "k0",
                windows: &w,
                cost: 1,
                at_us: Some(5_000),
                client: None,
            });
        }
        assert!(store.keys() <= 1, "idle keys remain: {}", store.keys());
    }
}
