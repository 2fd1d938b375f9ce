//! sluice-limiter: the sliding-window log that every quota is.
//!
//! This crate has one job: say whether a request's cost fits every window of its quota key
//! now, and how long until it does. It holds
//! - the semantics and their types: a quota is [`Window`]s, a request asks with an
//!   [`Acquire`], and the answer is an [`Outcome`] ([`WindowState`] per window);
//! - [`QuotaLogs`], the log kept in process ([`MemoryLimits`] bounds it), which the memory
//!   store of `sluice-allocator` decides with;
//! - [`lua`], the same log as Redis keeps it (`lua/quota.lua`), which `sluice-store` runs;
//! - [`calendar`], the period of a calendar window that holds an instant, in a time zone;
//! - [`StoreError`], how deciding on shared state fails: here because the memory log is the
//!   first store to fail (its bounds), and every crate above it (the allocator, the Redis store,
//!   the gateway) speaks of the same failures.
//!
//! The decision is exact: the units admitted in any interval as long as a window never exceed
//! its limit, and a refused request learns exactly how long until its cost fits.
//!
//! It knows nothing of Pingora, HTTP or Redis: the gateway turns an [`Outcome`] into headers.

pub mod calendar;
pub mod lua;
mod memory;

use std::fmt;
use std::sync::Arc;

pub use memory::{QuotaLogs, MAX_ENTRIES_PER_ROUTE, MAX_KEYS_PER_ROUTE};

/// One window of a quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// Name, unique within the quota; part of the store keys.
    pub name: Arc<str>,
    /// Units admitted per window, at least 1.
    pub limit: u64,
    /// Length in microseconds, at least 1.
    pub length_us: u64,
}

/// What is asked of the quota for one request.
#[derive(Debug, Clone, Copy)]
pub struct Acquire<'a> {
    /// The route; the store keeps each route's keys apart (and on one Redis Cluster slot).
    pub route: &'a str,
    /// The quota key within the route (`route`, a header value or a client address).
    pub key: &'a str,
    /// The windows, all of which must admit the request.
    pub windows: &'a [Window],
    /// The request's cost in units. 0 records nothing and only reports the windows' state
    /// (`StateStore::acquire` only, in `sluice-allocator`; the gateway's metrics read the quota this way).
    pub cost: u64,
    /// The time in microseconds, for tests that replay a trace. `None` (always, in the gateway)
    /// uses the store's own clock: monotonic in memory, Redis `TIME` in Redis.
    pub at_us: Option<u64>,
    /// The calling client's own windows, decided in the same step as [`Acquire::windows`]
    /// (which may then be empty: a route without a quota of its own): the request is admitted
    /// only when both admit it, and recorded in both or in neither. Its windows' states follow
    /// the route's in [`Outcome::windows`].
    pub client: Option<ClientWindows<'a>>,
}

/// A client's own quota: windows of its own, charged with the request's cost on every route
/// it uses, and shared by every instance. The stores keep them apart from every route's keys,
/// under the client's name (on Redis Cluster, in a slot of the client's own).
#[derive(Debug, Clone, Copy)]
pub struct ClientWindows<'a> {
    /// The client's name, unique in the config.
    pub name: &'a str,
    /// Its windows, at least one.
    pub windows: &'a [Window],
}

/// The state of one window after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowState {
    /// Units still available in the window, after this request if it was admitted.
    pub remaining: u64,
    /// Microseconds until the window's oldest counted request leaves it; 0 when empty.
    pub reset_us: u64,
}

/// The quota's decision for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// True when every window admitted the request, which is then recorded in all of them.
    pub admitted: bool,
    /// For a refused request, microseconds until its cost fits every window if no other traffic
    /// arrives; 0 when admitted.
    pub retry_after_us: u64,
    /// Per window, in the order of [`Acquire::windows`], then the client's
    /// ([`Acquire::client`]), when it has any.
    pub windows: Vec<WindowState>,
}

impl Outcome {
    /// This decision (a route's quota's) joined with the one its client's own windows made on
    /// the same request: admitted only when both admit it, waiting for the later of the two
    /// refusals, the client's windows after these.
    pub fn with_client(mut self, client: Outcome) -> Outcome {
        self.admitted &= client.admitted;
        self.retry_after_us = if self.admitted {
            0
        } else {
            self.retry_after_us.max(client.retry_after_us)
        };
        self.windows.extend(client.windows);
        self
    }

    /// The index of the window with the least remaining units (the first, on a tie).
    pub fn tightest(&self) -> Option<usize> {
        (0..self.windows.len()).min_by_key(|&i| self.windows[i].remaining)
    }
}

/// The largest amount a window is charged or settled with: 2^45 millionths, about 35 million
/// units. Redis keeps totals as Lua numbers (doubles), exact up to 2^53: amounts are capped well
/// below, so that a total of hundreds of them stays exact. An amount past it (a usage read as a
/// huge number) is recorded as this: more than any sensible limit, so the window stays full
/// until the entry slides out.
pub const MAX_AMOUNT: u64 = 1 << 45;

/// Where one admitted reservation lies in its quota key's logs: the same entry in each window.
/// The caller keeps it to settle the request later ([`Settle`]). Its time tells a settlement
/// that comes after the entry left its window (or after the key was forgotten and its numbers
/// began again) from one that may still change it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EntryId {
    /// The entry's number within its quota key (memory: within the store's shard).
    pub seq: u64,
    /// The admission time in microseconds, on the store's clock.
    pub at_us: u64,
}

/// The period of a fixed (calendar) window: from `start_us` to `end_us`, in microseconds since
/// the Unix epoch, the period that holds now. The caller cuts periods (a day, a week or a month
/// in a time zone); the store only counts within one: every entry recorded in the period counts
/// until its end and not a microsecond longer, so a full window admits again exactly at the
/// boundary, which is what a refusal's `retry_after_us` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Period {
    /// The period's first microsecond.
    pub start_us: u64,
    /// The first microsecond after it; greater than `start_us`.
    pub end_us: u64,
}

impl From<calendar::Bounds> for Period {
    /// The period a [`calendar::Calendar`] cut, as a reservation gives it to the store.
    fn from(b: calendar::Bounds) -> Period {
        Period {
            start_us: b.start_us,
            end_us: b.end_us,
        }
    }
}

/// Checks that `periods` is empty (every window slides) or names one period, or none, per window,
/// and that a fixed window's `length_us` is its period's [`span`]: then a read through
/// [`Acquire`] (cost 0, which knows no periods) expires its entries exactly at the period's end
/// too. Charging a fixed window through [`Acquire`] would place the entry at now, counting it
/// past the boundary: fixed windows are charged through [`Reserve`] only.
pub fn check_periods(windows: &[Window], periods: &[Option<Period>]) -> Result<(), StoreError> {
    if !periods.is_empty() && periods.len() != windows.len() {
        return Err(StoreError::Backend(format!(
            "{} periods for {} windows",
            periods.len(),
            windows.len()
        )));
    }
    for (w, p) in windows.iter().zip(periods) {
        if let Some(p) = p {
            if p.end_us <= p.start_us || span(p) != w.length_us {
                return Err(StoreError::Backend(format!(
                    "window {}: period {p:?} for a length of {} µs",
                    w.name, w.length_us
                )));
            }
        }
    }
    Ok(())
}

/// Where window `i`'s entry lies and how long it counts: a sliding window's at `at_us`, for its
/// length; a fixed window's [`span`] before its period's end, for that span, so that it leaves
/// exactly at the period's end.
pub fn placement(w: &Window, periods: &[Option<Period>], i: usize, at_us: u64) -> (u64, u64) {
    match periods.get(i).copied().flatten() {
        Some(p) => {
            let span = span(&p);
            (p.end_us.saturating_sub(span), span)
        }
        None => (at_us, w.length_us),
    }
}

/// How long a fixed window's entries count, from where they lie ([`placement`]), and so the
/// `length_us` its windows carry while `period` is the current one.
///
/// A store expires a log by one length, the one the current call carries, and a log of a fixed
/// window still holds the entries of the period before until something reads it. Were that
/// length the period's own, entries of a shorter period before a longer one (February's, read
/// on the 1st of March; the day before a 25-hour day) would count on into the new period, for
/// as long as the lengths differ, and a request there would be refused for a budget already
/// reset. So every period of a kind counts for one length, the longest such a period runs with
/// two hours to spare for a change of offset, and its entries lie that far before its end:
/// each leaves exactly at its own period's end, whatever the period being read. The kind is
/// told by the period's length, and the ranges of the tz database's days (22 to 26 hours),
/// weeks and months do not overlap; a period longer than a month's span counts for its own
/// length. A day longer than 26 hours (a zone moving its clock by more than two hours at once,
/// which no zone does) would be counted as a week, for that day only.
pub fn span(period: &Period) -> u64 {
    const HOUR: u64 = 3_600_000_000;
    const SPANS: [u64; 3] = [26 * HOUR, (7 * 24 + 2) * HOUR, (31 * 24 + 2) * HOUR];
    let own = period.end_us.saturating_sub(period.start_us);
    SPANS.into_iter().find(|&s| own <= s).unwrap_or(own)
}

/// A reservation: one request against one quota key whose windows each take their own amount
/// (a requests window its cost, a usage window the units reserved, in millionths). Admitted only
/// when each amount fits beside what its window holds; then recorded in every window, whatever
/// the amount (0 included), so that its settlement can find it.
#[derive(Debug, Clone, Copy)]
pub struct Reserve<'a> {
    /// The route; as [`Acquire::route`].
    pub route: &'a str,
    /// The quota key within the route; as [`Acquire::key`].
    pub key: &'a str,
    /// The windows, all of which must admit their amount.
    pub windows: &'a [Window],
    /// Per window, in the order of `windows`, the amount it is charged (capped at
    /// [`MAX_AMOUNT`]). A length other than `windows`' is an error, not a guess.
    pub amounts: &'a [u64],
    /// As [`Acquire::at_us`].
    pub at_us: Option<u64>,
    /// Per window, its period when it is a fixed (calendar) window; empty when every window
    /// slides. A fixed window's `length_us` must be its period's [`span`].
    pub periods: &'a [Option<Period>],
}

/// The answer to a [`Reserve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The decision, as for an [`Acquire`]; `remaining` in each window's own unit.
    pub outcome: Outcome,
    /// The entry recorded when admitted: what settles it.
    pub entry: Option<EntryId>,
}

/// The settlement of one reservation: its entry in each window becomes `settled`. The
/// settlements of one route go to the store together, in one call.
#[derive(Debug, Clone, Copy)]
pub struct Settle<'a> {
    /// The quota key the reservation was made on.
    pub key: &'a str,
    /// The windows, as reserved (by name: a window renamed or removed since is not settled).
    pub windows: &'a [Window],
    /// The entry the reservation recorded.
    pub entry: EntryId,
    /// Per window, the amount reserved: with `entry`, what identifies the entry.
    pub reserved: &'a [u64],
    /// Per window, the amount the answer used (0 for a request no member answered, or answered
    /// with a status that did no work). Capped at [`MAX_AMOUNT`].
    pub settled: &'a [u64],
    /// The periods the reservation was made with ([`Reserve::periods`]): a fixed window settles
    /// into the period of the admission, and not at all once that period is over.
    pub periods: &'a [Option<Period>],
    /// Whose windows hold the entry.
    pub owner: Owner,
}

/// Whose windows a reservation's entry is in, which says where a [`Settle`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The route's quota; [`Settle::key`] is the quota key.
    Route,
    /// A member's own windows, reserved by an assignment; [`Settle::key`] is the member's id.
    Member,
    /// A client's own windows ([`ClientWindows`]); [`Settle::key`] is the client's name.
    Client,
}

/// What one window holds, read for status pages and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowUsage {
    /// Everything the window holds: settled usage plus open reservations (requests windows:
    /// their costs).
    pub total: u64,
    /// The part of `total` that is reservations not settled yet, across every instance.
    pub open: u64,
}

/// What a settlement did in one window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The entry was not there: it left the window, or the window was emptied. Nothing changed.
    Gone,
    /// The entry and the window's total now hold the settled amount.
    Done,
    /// As `Done`, and the settlement took more than was reserved and left the window holding
    /// more than its limit: it admits nothing until enough slides out.
    Overrun,
}

/// Checks that a reservation or settlement names one amount per window.
pub fn check_amounts(windows: &[Window], amounts: &[u64]) -> Result<(), StoreError> {
    if windows.len() == amounts.len() {
        Ok(())
    } else {
        Err(StoreError::Backend(format!(
            "{} amounts for {} windows",
            amounts.len(),
            windows.len()
        )))
    }
}

/// How much a [`QuotaLogs`] (and so a memory store) may hold, so that clients who choose their
/// quota keys cannot grow it without bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryLimits {
    /// The most quota keys one route holds (about: the bound is kept per shard of the store).
    /// Past it, a request with a new key gets [`StoreError::TooManyKeys`], once no key whose
    /// windows are empty is left to drop.
    pub max_keys: usize,
    /// The most log entries one route holds, over all its keys and windows (about, likewise):
    /// one per admitted request per window, still in the window. Past it, once the entries
    /// that left their windows are dropped, a request that would add entries gets
    /// [`StoreError::TooManyKeys`].
    pub max_entries: usize,
}

impl Default for MemoryLimits {
    fn default() -> MemoryLimits {
        MemoryLimits {
            max_keys: memory::MAX_KEYS_PER_ROUTE,
            max_entries: memory::MAX_ENTRIES_PER_ROUTE,
        }
    }
}

/// A failure to reach or use the store. The caller applies its route's `on_store_error`.
#[derive(Debug, Clone)]
pub enum StoreError {
    /// The store did not answer within its timeout.
    Timeout,
    /// The store answered with an error, or the connection failed.
    Backend(String),
    /// The store is full: the route holds as many quota keys, or log entries, as the memory
    /// store allows, each still counting, or Redis refused a write at its `maxmemory`. A
    /// request with a new key, or one that would add entries, is not decided. This is no
    /// outage: the store works, and what it holds keeps being read. The gateway refuses a
    /// request a quota must count rather than admit it unmetered.
    TooManyKeys,
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Timeout => f.write_str("state store timed out"),
            StoreError::Backend(e) => write!(f, "state store failed: {e}"),
            StoreError::TooManyKeys => f.write_str(
                "the store is full: the route holds as many quota keys, or entries, as the memory store keeps, or Redis is at its maxmemory",
            ),
        }
    }
}

impl std::error::Error for StoreError {}

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    sluice_testkit::architecture::assert_no_cycles(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    );
}

/// What a calendar cut is the period a reservation gives the store, bound for bound.
#[cfg(test)]
#[test]
fn a_calendars_bounds_are_a_period() {
    let b = calendar::Bounds {
        start_us: 10,
        end_us: 20,
    };
    assert_eq!(
        Period::from(b),
        Period {
            start_us: 10,
            end_us: 20
        }
    );
}
