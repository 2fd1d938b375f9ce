//! The brute-force bound on identification: failed identifications are counted per source (an
//! IPv4 address, or an IPv6 /64, since one host holds a whole /64), and a source past
//! `clients.failed_auth.limit` failures within `window` is refused with `429 auth_throttled`
//! for `cooldown`, before any credential it sends is tried.
//!
//! The table is bounded by `max_sources`, since anyone who reaches the port can spray sources.
//! At the bound a new source takes the place of the oldest source that is *not* throttled: a
//! throttled source is never forgotten for room, or a spray of new sources would unthrottle it.
//! When every source held is throttled, new sources count together in one shared overflow
//! bucket, throttled like one source: a spray from more addresses than the table holds is still
//! bounded, at the cost that, while that bucket is throttled and the table has no room, a new
//! source is refused too. Throttled sources leave the table as their cooldown ends.
//!
//! The table outlives reloads (the gateway holds one for its life), so that a reload frees no
//! throttled source; the settings in force are passed to each call, so they reload with
//! `clients`. A smaller `max_sources` takes effect as new sources come.
//!
//! One short `Mutex` guards the table: every operation is a hash lookup and at most a few queue
//! steps, with no await under it, and only failures write.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Why an identification failed: the `reason` label of `sluice_client_auth_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A token (Bearer, or a route's `client_token` header) that no client holds.
    BadToken,
    /// `Proxy-Authorization: Basic` whose name and token match no client.
    BadBasic,
    /// A verified client certificate whose names no client lists.
    UnknownCert,
    /// A known credential sent from outside its client's `cidrs`.
    WrongAddress,
    /// A credential header that cannot be read (bad base64, no colon, too long, not UTF-8).
    Malformed,
}

impl Failure {
    /// Every reason, so that each series is there from the start.
    pub const ALL: [Failure; 5] = [
        Failure::BadToken,
        Failure::BadBasic,
        Failure::UnknownCert,
        Failure::WrongAddress,
        Failure::Malformed,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::BadToken => "bad_token",
            Failure::BadBasic => "bad_basic",
            Failure::UnknownCert => "unknown_cert",
            Failure::WrongAddress => "wrong_address",
            Failure::Malformed => "malformed",
        }
    }
}

/// `clients.failed_auth`, as the throttle applies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Failures within `window` that throttle a source.
    pub limit: u32,
    /// The window failures are counted in, from a source's first failure in it.
    pub window: Duration,
    /// How long a throttled source is refused.
    pub cooldown: Duration,
    /// The most sources the table holds.
    pub max_sources: usize,
}

impl From<&crate::config::FailedAuthConfig> for Settings {
    fn from(c: &crate::config::FailedAuthConfig) -> Settings {
        Settings {
            limit: c.limit.get(),
            window: c.window.0,
            cooldown: c.cooldown.0,
            max_sources: c.max_sources.get(),
        }
    }
}

/// Where failures are counted: an IPv4 address, or the /64 of an IPv6 one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// An IPv4 address (an IPv4-mapped IPv6 address counts as its IPv4 address).
    V4(u32),
    /// The upper 64 bits of an IPv6 address.
    V6(u64),
}

impl Source {
    /// The source `ip` counts under.
    pub fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(v4) => Source::V4(u32::from(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source::V4(u32::from(v4)),
                None => Source::V6((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

/// The failures of one source.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Failures since `since`.
    failures: u32,
    /// The start of the window being counted.
    since: Instant,
    /// Refused until then, when throttled.
    until: Option<Instant>,
    /// Which queue item is this entry's live one (older items are stale).
    seq: u64,
}

impl Entry {
    fn new(now: Instant, seq: u64) -> Entry {
        Entry {
            failures: 0,
            since: now,
            until: None,
            seq,
        }
    }

    /// How long it is still refused, if it is.
    fn refused_for(&self, now: Instant) -> Option<Duration> {
        self.until
            .and_then(|until| until.checked_duration_since(now))
            .filter(|left| !left.is_zero())
    }

    /// Counts one failure at `now`: true when it throttles the entry anew. A failure after
    /// the window, or after a cooldown, starts a new window.
    fn fail(&mut self, now: Instant, s: &Settings) -> bool {
        if self.refused_for(now).is_some() {
            return false;
        }
        let window_over = now.saturating_duration_since(self.since) >= s.window;
        if self.until.is_some() || window_over {
            *self = Entry::new(now, self.seq);
        }
        self.failures = self.failures.saturating_add(1);
        if self.failures >= s.limit {
            self.until = Some(now + s.cooldown);
            return true;
        }
        false
    }

    /// Whether it says nothing any more: neither refused nor counting a live window.
    fn is_spent(&self, now: Instant, s: &Settings) -> bool {
        match self.until {
            Some(_) => self.refused_for(now).is_none(),
            None => now.saturating_duration_since(self.since) >= s.window,
        }
    }
}

/// The sources and their order.
#[derive(Debug)]
struct Table {
    entries: HashMap<Source, Entry>,
    /// Sources not throttled, oldest window first: the ones to give up for room.
    counting: VecDeque<(Source, u64)>,
    /// Throttled sources, in the order they were throttled, so soonest free first.
    throttled: VecDeque<(Source, u64)>,
    /// Failures of new sources while the table is full of throttled ones.
    overflow: Entry,
    next_seq: u64,
}

/// Failed identifications per source, and the sources they throttle.
#[derive(Debug)]
pub struct Throttle {
    table: Mutex<Table>,
    /// Whether the table may refuse anyone: set under the lock by every failure, so that
    /// while no identification has failed (the common case) a check takes no lock.
    armed: std::sync::atomic::AtomicBool,
}

impl Default for Throttle {
    fn default() -> Throttle {
        Throttle::new()
    }
}

impl Throttle {
    /// An empty table.
    pub fn new() -> Throttle {
        Throttle {
            table: Mutex::new(Table {
                entries: HashMap::new(),
                counting: VecDeque::new(),
                throttled: VecDeque::new(),
                overflow: Entry::new(Instant::now(), 0),
                next_seq: 1,
            }),
            armed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// How long `ip` is still refused, or None when it may try its credentials.
    pub fn check(&self, ip: IpAddr, s: &Settings) -> Option<Duration> {
        self.check_at(ip, s, Instant::now())
    }

    /// Counts a failed identification from `ip`: how long it is now refused, when this
    /// failure throttled it.
    pub fn fail(&self, ip: IpAddr, s: &Settings) -> Option<Duration> {
        self.fail_at(ip, s, Instant::now())
    }

    /// How many sources the table holds now.
    pub fn sources(&self) -> usize {
        self.lock().entries.len()
    }

    /// [`Throttle::check`] at `now`.
    pub fn check_at(&self, ip: IpAddr, s: &Settings, now: Instant) -> Option<Duration> {
        // Nothing has failed since the table was made: nobody can be refused.
        if !self.armed.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let mut t = self.lock();
        match t.entries.get(&Source::of(ip)) {
            Some(entry) => entry.refused_for(now),
            None => {
                let refused = t.overflow.refused_for(now)?;
                (!t.has_room(s, now)).then_some(refused)
            }
        }
    }

    /// [`Throttle::fail`] at `now`.
    pub fn fail_at(&self, ip: IpAddr, s: &Settings, now: Instant) -> Option<Duration> {
        let mut t = self.lock();
        // Under the lock, before the count: a check that sees the flag unset ran before this
        // failure, and one after it takes the lock and sees the count.
        self.armed.store(true, std::sync::atomic::Ordering::Release);
        let source = Source::of(ip);
        if !t.entries.contains_key(&source) {
            t.forget_spent(s, now);
            let mut full = false;
            // One at a time, or more after a reload lowered the bound.
            while t.entries.len() >= s.max_sources {
                if !t.evict(now) {
                    full = true;
                    break;
                }
            }
            if full {
                // Every source held is throttled: count this one with the other newcomers.
                t.overflow.fail(now, s);
                return t.overflow.refused_for(now);
            }
            let seq = t.seq();
            t.entries.insert(source, Entry::new(now, seq));
            t.counting.push_back((source, seq));
        }
        let settings = *s;
        let entry = t.entries.get_mut(&source)?;
        if let Some(left) = entry.refused_for(now) {
            // Already throttled (a failure that raced its check): it stays where it is.
            return Some(left);
        }
        let restarted =
            entry.until.is_some() || now.saturating_duration_since(entry.since) >= settings.window;
        let throttled = entry.fail(now, &settings);
        let refused = entry.refused_for(now);
        if throttled {
            let seq = t.seq();
            t.set_seq(source, seq);
            t.throttled.push_back((source, seq));
        } else if restarted {
            // A new window: the entry is now the youngest of those counting.
            let seq = t.seq();
            t.set_seq(source, seq);
            t.counting.push_back((source, seq));
        }
        t.compact();
        refused
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // Nothing under the lock can panic halfway through a change that matters: a poisoned
        // table is still a table.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Table {
    fn seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    fn set_seq(&mut self, source: Source, seq: u64) {
        if let Some(e) = self.entries.get_mut(&source) {
            e.seq = seq;
        }
    }

    fn is_live(&self, (source, seq): (Source, u64)) -> bool {
        self.entries.get(&source).is_some_and(|e| e.seq == seq)
    }

    /// Drops the stale items at the front of both queues.
    fn drop_stale_fronts(&mut self) {
        while let Some(&item) = self.counting.front() {
            if self.is_live(item) {
                break;
            }
            self.counting.pop_front();
        }
        while let Some(&item) = self.throttled.front() {
            if self.is_live(item) {
                break;
            }
            self.throttled.pop_front();
        }
    }

    /// Forgets, from the front of both queues, the sources whose window or cooldown is over:
    /// they count as new ones anyway.
    fn forget_spent(&mut self, s: &Settings, now: Instant) {
        for throttled in [false, true] {
            loop {
                self.drop_stale_fronts();
                let queue = if throttled {
                    &self.throttled
                } else {
                    &self.counting
                };
                let Some(&(source, _)) = queue.front() else {
                    break;
                };
                let spent = self
                    .entries
                    .get(&source)
                    .is_some_and(|e| e.is_spent(now, s));
                if !spent {
                    break;
                }
                self.entries.remove(&source);
            }
        }
    }

    /// Whether a new source could take a place: there is room, or a source not throttled (or
    /// whose cooldown is over) to give up.
    fn has_room(&mut self, s: &Settings, now: Instant) -> bool {
        if self.entries.len() < s.max_sources {
            return true;
        }
        self.drop_stale_fronts();
        if !self.counting.is_empty() {
            return true;
        }
        self.throttled
            .front()
            .and_then(|(s, _)| self.entries.get(s))
            .is_some_and(|e| e.refused_for(now).is_none())
    }

    /// Gives up one source for room: the oldest not throttled, else the throttled one whose
    /// cooldown is over first. False when none could be given up.
    fn evict(&mut self, now: Instant) -> bool {
        self.drop_stale_fronts();
        if let Some((source, _)) = self.counting.pop_front() {
            self.entries.remove(&source);
            return true;
        }
        let Some(&(source, _)) = self.throttled.front() else {
            return false;
        };
        let free = self
            .entries
            .get(&source)
            .is_some_and(|e| e.refused_for(now).is_none());
        if free {
            self.throttled.pop_front();
            self.entries.remove(&source);
            return true;
        }
        false
    }

    /// Keeps the queues' stale items from growing past the table: when they outnumber the
    /// live ones, they go, at a cost spread over the failures that made them.
    fn compact(&mut self) {
        if self.counting.len() + self.throttled.len() <= 2 * self.entries.len() + 64 {
            return;
        }
        let entries = &self.entries;
        let live =
            |&(source, seq): &(Source, u64)| entries.get(&source).is_some_and(|e| e.seq == seq);
        self.counting.retain(live);
        self.throttled.retain(live);
    }
}

#[cfg(test)]
#[path = "throttle/tests.rs"]
mod tests;
