//! Routes with `state_shards` above 1: their sub-logs' names, each sub-log's share of a limit,
//! which sub-log a request tries first, and what this instance knows of the full ones.
//!
//! Each sub-log is a whole, exact copy of a route's state (quota logs, pool, member logs,
//! cooldowns) under a name of its own ([`keys::sub_log`]), with the share `limit / S` of every
//! limit (the remainder on the first ones), so that any window holds at most the sum of the
//! shares, the limit. A request tries the sub-logs in turn from one this instance picks
//! round-robin, or (`state_shards_start: home`) from this instance's own, its index modulo the
//! sub-logs' count (round-robin still while the instance has no index); a sub-log that refused says (in its answer) how much each window has left and
//! when its oldest entry leaves, and this instance skips it for a request whose cost does not fit
//! one of them until then: a request that finds every sub-log known full for its cost is refused
//! without a call. A hint is only ever a lower bound of when the sub-log has room, so a stale
//! one makes a request skip a sub-log with room (refused early), never admits more.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use sluice_allocator::{PoolMember, SubLogStart};
use sluice_limiter::{Outcome, Window};

use crate::keys;

/// Quota keys whose hints one route keeps at most; past it the expired ones go, and if none
/// has expired, all of them (hints only save calls).
const MAX_HINTED_KEYS: usize = 4096;

/// The routes with sub-logs, by name. Hashed by foldhash, not SipHash: SipHash of the route's
/// name was most of a lookup's cost, which every store call pays.
type Table = HashMap<Box<str>, Arc<Sharded>, foldhash::fast::RandomState>;

/// The sharded routes of the config in force.
///
/// Every store call looks its route up here, so a lookup takes no lock: a reload replaces the
/// table whole (arc-swap), and a lookup reads the table in force, marking it in use in a slot
/// of its own thread's. A read lock wrote its count, one cache line for every core, on every
/// call of every route once any route had sub-logs.
#[derive(Debug, Default)]
pub(crate) struct Shards {
    /// Whether any route has more than one sub-log: when none has, a request looks no further.
    any: AtomicBool,
    routes: ArcSwap<Table>,
    /// Held by a reload (or a change of index) while it builds the next table from the one in
    /// force, so that two at once cannot lose one's change; never by a request. It holds this
    /// instance's index (`state.redis.instance_index`), whose own sub-log of a route of S is the
    /// index modulo S; without one, a `home` route starts its requests in turn, as
    /// `round_robin` does: one index for every instance would make them all start at one
    /// sub-log, and one drawn at random would spread them unevenly and differently at each
    /// start.
    reload: Mutex<Option<u32>>,
}

impl Shards {
    /// Makes `index` this instance's; the routes in force start at their own sub-log by it
    /// from their next request.
    pub(crate) fn set_instance(&self, index: u32) {
        let mut instance = self.reload.lock().unwrap_or_else(|p| p.into_inner());
        *instance = Some(index);
        for sharded in self.routes.load().values() {
            sharded.own_by(Some(index));
        }
    }

    /// The sub-logs of `route`, when it has more than one.
    pub(crate) fn of(&self, route: &str) -> Option<Arc<Sharded>> {
        // Acquire: a request that sees a route sharded sees the table that made it so.
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        self.routes.load().get(route).cloned()
    }

    /// Makes `routes` (name, sub-logs, where a request starts) the sharded ones. A route kept
    /// with the same count keeps the sub-log of each of its leases, but forgets every refusal:
    /// the new config may have raised a limit or added members, and a hint only saves a call. A
    /// request that read the table before goes on with what it read, as one that began before
    /// the reload.
    ///
    /// Returns how many of `routes` ask to start at this instance's own sub-log (`home`) while
    /// it has no index, and so start in turn instead.
    pub(crate) fn set(&self, routes: &[(&str, u32, SubLogStart)]) -> usize {
        let instance = self.reload.lock().unwrap_or_else(|p| p.into_inner());
        let mut unindexed = 0;
        let mut map = Table::clone(&self.routes.load());
        let mut next = Table::default();
        for &(route, shards, start) in routes {
            if shards <= 1 {
                continue;
            }
            let kept = map
                .remove(route)
                .filter(|s| s.names.len() == shards as usize);
            if let Some(kept) = &kept {
                kept.hints.lock().unwrap_or_else(|p| p.into_inner()).clear();
            }
            let sharded = kept.unwrap_or_else(|| Arc::new(Sharded::new(route, shards)));
            let home = start == SubLogStart::Home;
            sharded.at_home.store(home, Ordering::Relaxed);
            sharded.own_by(*instance);
            unindexed += usize::from(home && instance.is_none());
            next.insert(route.into(), sharded);
        }
        let any = !next.is_empty();
        self.routes.store(Arc::new(next));
        self.any.store(any, Ordering::Release);
        unindexed
    }
}

/// One route's sub-logs.
#[derive(Debug)]
pub(crate) struct Sharded {
    /// Per sub-log, the name its keys are under (sub-log 0: the route's).
    pub(crate) names: Vec<String>,
    /// The sub-log the next request tries first, modulo their count (round-robin).
    next: AtomicUsize,
    /// Whether every request starts at `own` instead (`state_shards_start: home`); a reload
    /// that keeps the route may turn it either way.
    at_home: AtomicBool,
    /// This instance's own sub-log, its index modulo their count, or [`NO_INDEX`] while the
    /// instance has none (its requests then start in turn, `home` or not).
    own: AtomicUsize,
    /// Per quota key ("" without a quota), per sub-log: the last refusal of its share of the
    /// route's quota windows, which says what each had left and until when. Only those windows' refusals are hints: they
    /// hold for every request with that key, whereas members busy hold only for the members a
    /// request could have (a retry or a down member's trial leaves out the others).
    hints: Mutex<HashMap<Box<str>, Vec<Option<Hint>>>>,
    /// The sub-log of each lease this instance took and has not released: its release and
    /// renewals go there. Only the instance that took a lease releases or renews it; one that
    /// died leaves its leases to expire in their sub-logs.
    leases: Mutex<HashMap<Box<str>, usize>>,
}

/// What this instance knows of a full sub-log.
#[derive(Debug, Clone)]
struct Hint {
    /// When the refusal was answered.
    at: Instant,
    /// The route's windows of the refused request (`refusal`'s first states; the client's own
    /// follow): the hint holds only for a request with the same, so that one decided by the
    /// config in force before a reload says nothing of the new limits.
    windows: Box<[Window]>,
    /// The refused request's cost.
    cost: u64,
    refusal: Outcome,
}

impl Hint {
    /// How long after the refusal a request of `cost` cannot fit: until the last of the route
    /// windows with less than `cost` left sees its oldest entry leave, the first time room can
    /// appear for any cost. For the refused cost or a larger one, at least as long as the
    /// call's own wait, which is exact for its cost (the route's windows only lose entries as
    /// time passes; other traffic only adds), when that wait was the route windows' alone:
    /// with no client windows in the refusal, whose own wait says nothing of another client's
    /// request under the same key. So a refusal made from the hint answers the `Retry-After` a
    /// call would have, where the oldest entry's leaving alone could say a second for a large
    /// cost that needs thirty.
    fn holds_for(&self, cost: u64) -> Option<Duration> {
        let route = self.windows.len().min(self.refusal.windows.len());
        let room = full_for(&self.refusal.windows[..route], cost)?;
        let route_alone = self.refusal.windows.len() <= self.windows.len();
        let exact = if cost >= self.cost && route_alone {
            self.refusal.retry_after_us
        } else {
            0
        };
        Some(Duration::from_micros(room.max(exact)))
    }
}

/// [`Sharded::own`] of an instance without an index.
const NO_INDEX: usize = usize::MAX;

impl Sharded {
    fn new(route: &str, shards: u32) -> Sharded {
        Sharded {
            names: (0..shards)
                .map(|i| keys::sub_log(route, i, shards))
                .collect(),
            next: AtomicUsize::new(0),
            at_home: AtomicBool::new(false),
            own: AtomicUsize::new(NO_INDEX),
            hints: Mutex::new(HashMap::new()),
            leases: Mutex::new(HashMap::new()),
        }
    }

    /// Makes the instance's own sub-log that of `index` (none without one).
    fn own_by(&self, index: Option<u32>) {
        let own = index.map_or(NO_INDEX, |i| i as usize % self.names.len().max(1));
        self.own.store(own, Ordering::Relaxed);
    }

    /// The number of sub-logs.
    pub(crate) fn len(&self) -> usize {
        self.names.len()
    }

    /// The sub-logs in the order the next request tries them: from this instance's own
    /// (`home`, with an index), or from the next in turn; either way on through the others in
    /// turn, so a request refused by its first goes on exactly as from any other.
    pub(crate) fn order(&self) -> impl Iterator<Item = usize> {
        let n = self.names.len();
        let own = self.own.load(Ordering::Relaxed);
        let first = if self.at_home.load(Ordering::Relaxed) && own != NO_INDEX {
            own
        } else {
            self.next.fetch_add(1, Ordering::Relaxed) % n
        };
        (0..n).map(move |k| (first + k) % n)
    }

    /// The sub-log a sticky session starts at, whatever the instance's own: its binding lives
    /// there (the session is already a hash, and every instance reads the same).
    pub(crate) fn session_sub_log(&self, session: &str) -> usize {
        usize::from(keys::crc16(session.as_bytes())) % self.names.len()
    }

    /// Lease `id` was taken in sub-log `i`.
    pub(crate) fn leased(&self, id: &str, i: usize) {
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        leases.insert(id.into(), i);
    }

    /// `ids` grouped by sub-log, in the order of [`Sharded::names`]; a lease this instance does
    /// not know (taken before a reload that split the route, say) goes to every sub-log, where
    /// releasing or renewing one that is not there changes nothing. With `forget`, the leases
    /// are released and forgotten here.
    pub(crate) fn lease_groups<'a>(&self, ids: &[&'a str], forget: bool) -> Vec<Vec<&'a str>> {
        let mut groups = vec![Vec::new(); self.names.len()];
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        for &id in ids {
            let known = if forget {
                leases.remove(id)
            } else {
                leases.get(id).copied()
            };
            match known.filter(|&i| i < groups.len()) {
                Some(i) => groups[i].push(id),
                None => groups.iter_mut().for_each(|g| g.push(id)),
            }
        }
        groups
    }

    /// The refusal sub-log `i` last answered for `key` and how long it still holds for a
    /// request of `cost` on the route's `windows`, if that cost is known not to fit there now.
    /// A refusal of a larger cost says nothing of a smaller one that fits what its windows had
    /// left, nor one under other windows of a request under the new limits.
    pub(crate) fn known_full(
        &self,
        key: &str,
        i: usize,
        cost: u64,
        windows: &[Window],
    ) -> Option<(Duration, Outcome)> {
        self.known_full_at(key, i, cost, windows, Instant::now())
    }

    /// [`Sharded::known_full`] at `now`. The refusal's window states are brought to `now`: each
    /// window's oldest entry is that much closer to leaving (the `RateLimit` field's `t=`), as
    /// a call now would answer; what each has left is as the refusal found it.
    fn known_full_at(
        &self,
        key: &str,
        i: usize,
        cost: u64,
        windows: &[Window],
        now: Instant,
    ) -> Option<(Duration, Outcome)> {
        let hints = self.hints.lock().unwrap_or_else(|p| p.into_inner());
        let hint = hints.get(key)?.get(i)?.as_ref()?;
        if *hint.windows != *windows {
            return None;
        }
        let until = hint.at + hint.holds_for(cost)?;
        let left = until.checked_duration_since(now)?;
        if left.is_zero() {
            return None;
        }
        let passed =
            u64::try_from(now.saturating_duration_since(hint.at).as_micros()).unwrap_or(u64::MAX);
        let mut outcome = hint.refusal.clone();
        let waits = u64::try_from(left.as_micros()).unwrap_or(u64::MAX);
        for w in &mut outcome.windows {
            if w.reset_us > 0 {
                // Until the oldest entry leaves, exact. Past it, the next one's is unknown here:
                // a window with too little left for this cost is said to free enough when the
                // request fits (as `Retry-After` says), not in a microsecond, which a client
                // reading `RateLimit` would take for "now".
                w.reset_us = match w.reset_us.checked_sub(passed) {
                    Some(reset) if reset > 0 => reset,
                    _ if w.remaining < cost => waits,
                    _ => 1,
                };
            }
        }
        Some((left, outcome))
    }

    /// Sub-log `i`'s quota windows refused `key` with `refusal`, a request on the route's
    /// `windows` (whole, not the sub-log's share), whose states come first in `refusal`.
    pub(crate) fn full(
        &self,
        key: &str,
        i: usize,
        windows: &[Window],
        cost: u64,
        refusal: &Outcome,
    ) {
        let at = Instant::now();
        let mut hints = self.hints.lock().unwrap_or_else(|p| p.into_inner());
        if hints.len() >= MAX_HINTED_KEYS && !hints.contains_key(key) {
            let now = Instant::now();
            // A hint holds longest for the largest cost.
            let live = |h: &Hint| h.holds_for(u64::MAX).is_some_and(|d| h.at + d > now);
            hints.retain(|_, v| v.iter().flatten().any(live));
            if hints.len() >= MAX_HINTED_KEYS {
                hints.clear();
            }
        }
        let n = self.names.len();
        let slots = hints.entry(key.into()).or_insert_with(|| vec![None; n]);
        if let Some(slot) = slots.get_mut(i) {
            *slot = Some(Hint {
                at,
                windows: windows.into(),
                cost,
                refusal: refusal.clone(),
            });
        }
    }
}

/// Sub-log `i` of `shards`' share of a limit: the quotient, one more on the first `limit mod
/// shards` sub-logs. The shares add up to the limit.
pub(crate) fn share(limit: u64, i: usize, shards: usize) -> u64 {
    let (i, s) = (i as u64, shards as u64);
    limit / s + u64::from(i < limit % s)
}

/// `windows` with sub-log `i`'s share of each limit.
pub(crate) fn split(windows: &[Window], i: usize, shards: usize) -> Vec<Window> {
    windows
        .iter()
        .map(|w| Window {
            name: w.name.clone(),
            limit: share(w.limit, i, shards),
            length_us: w.length_us,
        })
        .collect()
}

/// `members` with sub-log `i`'s share of each of their windows.
pub(crate) fn split_members(members: &[PoolMember], i: usize, shards: usize) -> Vec<PoolMember> {
    members.iter().map(|m| split_member(m, i, shards)).collect()
}

/// `member` with sub-log `i`'s share of each of its windows.
fn split_member(member: &PoolMember, i: usize, shards: usize) -> PoolMember {
    PoolMember {
        id: member.id.clone(),
        windows: if member.windows.is_empty() {
            member.windows.clone()
        } else {
            split(&member.windows, i, shards).into()
        },
    }
}

/// One of a route's logs, as a call that goes to each of them sees it: the route's own, whole,
/// when it has no sub-logs, else one sub-log with its share of every limit. A sub-log holds on to
/// its route's [`Sharded`], so that a call a reload overtakes still ends on the logs it began on.
pub(crate) enum Log<'r> {
    Whole(&'r str),
    Sub(Arc<Sharded>, usize),
}

impl Log<'_> {
    /// The name its keys are under.
    pub(crate) fn name(&self) -> &str {
        match self {
            Log::Whole(route) => route,
            Log::Sub(sharded, i) => &sharded.names[*i],
        }
    }

    /// `windows` with this log's share of each limit (borrowed as they are on a whole log).
    pub(crate) fn windows<'w>(&self, windows: &'w [Window]) -> Cow<'w, [Window]> {
        match self {
            Log::Whole(_) => Cow::Borrowed(windows),
            Log::Sub(sharded, i) => Cow::Owned(split(windows, *i, sharded.len())),
        }
    }

    /// `member` with this log's share of each of its windows.
    pub(crate) fn member<'m>(&self, member: &'m PoolMember) -> Cow<'m, PoolMember> {
        match self {
            Log::Whole(_) => Cow::Borrowed(member),
            Log::Sub(sharded, i) => Cow::Owned(split_member(member, *i, sharded.len())),
        }
    }
}

/// How long a sub-log that refused `cost` with these window states (its share of the route's
/// windows, in order) cannot admit it: until the last of the windows that refused it sees its
/// oldest entry leave. `None` when none of them refused (the refusal was the client's own
/// windows').
pub(crate) fn full_for(states: &[sluice_limiter::WindowState], cost: u64) -> Option<u64> {
    states
        .iter()
        .filter(|w| w.remaining < cost)
        .map(|w| w.reset_us)
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    const RR: SubLogStart = SubLogStart::RoundRobin;

    #[test]
    fn shares_add_up_to_the_limit_and_differ_by_at_most_one() {
        for limit in [1u64, 2, 3, 7, 10, 100, 1_000_003] {
            for s in 1..=16usize {
                if limit < s as u64 {
                    continue;
                }
                let shares: Vec<u64> = (0..s).map(|i| share(limit, i, s)).collect();
                assert_eq!(shares.iter().sum::<u64>(), limit, "{limit} / {s}");
                let (lo, hi) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
                assert!(hi - lo <= 1 && *lo >= 1, "{shares:?}");
            }
        }
        assert_eq!(
            (0..3).map(|i| share(10, i, 3)).collect::<Vec<_>>(),
            [4, 3, 3]
        );
    }

    #[test]
    fn hints_say_full_until_they_pass_and_the_order_turns() {
        let s = Sharded::new("api", 3);
        assert_eq!(s.names[0], "api");
        let refused = |remaining, reset_us| Outcome {
            admitted: false,
            retry_after_us: 1,
            windows: vec![sluice_limiter::WindowState {
                remaining,
                reset_us,
            }],
        };
        let w = [Window {
            name: "m".into(),
            limit: 30,
            length_us: 60_000_000,
        }];
        assert!(s.known_full("k", 1, 1, &w).is_none());
        s.full("k", 1, &w, 1, &refused(0, 60_000_000));
        assert!(s.known_full("k", 1, 1, &w).is_some());
        assert!(s.known_full("other", 1, 1, &w).is_none());
        assert!(s.known_full("k", 0, 1, &w).is_none());
        s.full("k", 2, &w, 1, &refused(0, 1));
        std::thread::sleep(Duration::from_millis(2));
        assert!(s.known_full("k", 2, 1, &w).is_none());
        // 5 left: a cost of 6 does not fit, one of 5 does.
        s.full("k", 0, &w, 6, &refused(5, 60_000_000));
        assert!(s.known_full("k", 0, 6, &w).is_some());
        assert!(s.known_full("k", 0, 5, &w).is_none());
        // A hint holds only for the windows it was refused under, not those of a config
        // reloaded since.
        let raised = [Window {
            limit: 60,
            ..w[0].clone()
        }];
        assert!(s.known_full("k", 0, 6, &raised).is_none());
        // The client's own windows (after the route's) say nothing.
        s.full("k", 0, &[], 6, &refused(0, 60_000_000));
        assert!(s.known_full("k", 0, 6, &[]).is_none());
        let firsts: Vec<usize> = (0..3).map(|_| s.order().next().unwrap()).collect();
        assert_eq!(firsts, [0, 1, 2]);
        assert_eq!(s.order().collect::<Vec<_>>(), [0, 1, 2]);
    }

    /// A refusal made from a hint answers what a call would: for the refused cost (or a larger
    /// one) the call's own exact wait, not just the time until the oldest entry leaves, unless
    /// the wait was a client's windows' too; and its windows' resets brought to the time of
    /// asking.
    #[test]
    fn a_hint_answers_the_exact_wait_and_resets_as_of_now() {
        let s = Sharded::new("api", 3);
        let w = [Window {
            name: "m".into(),
            limit: 300,
            length_us: 60_000_000,
        }];
        // Sub-log 1 refused a cost of 50 with 10 left: its oldest entry leaves in 0.6 s, but 50
        // fit only in 30 s.
        let refusal = |client: bool| Outcome {
            admitted: false,
            retry_after_us: 30_000_000,
            windows: std::iter::repeat_n(
                sluice_limiter::WindowState {
                    remaining: 10,
                    reset_us: 600_000,
                },
                if client { 2 } else { 1 },
            )
            .collect(),
        };
        s.full("k", 1, &w, 50, &refusal(false));
        let at = s.hints.lock().unwrap()["k"][1].as_ref().unwrap().at;
        let later = at + Duration::from_millis(100);
        let (left, outcome) = s.known_full_at("k", 1, 50, &w, later).unwrap();
        assert_eq!(left, Duration::from_micros(29_900_000));
        assert_eq!(outcome.windows[0].reset_us, 500_000);
        assert_eq!(outcome.windows[0].remaining, 10);
        // A larger cost waits at least as long; a smaller one that does not fit either only
        // until the oldest entry leaves; one that fits is not refused.
        assert_eq!(
            s.known_full_at("k", 1, 80, &w, later).unwrap().0,
            Duration::from_micros(29_900_000)
        );
        assert_eq!(
            s.known_full_at("k", 1, 20, &w, later).unwrap().0,
            Duration::from_micros(500_000)
        );
        assert!(s.known_full_at("k", 1, 10, &w, later).is_none());
        // Past the oldest entry's leaving, the refused cost is still known not to fit.
        let after = at + Duration::from_secs(1);
        assert!(s.known_full_at("k", 1, 20, &w, after).is_none());
        let (left, outcome) = s.known_full_at("k", 1, 50, &w, after).unwrap();
        assert_eq!(left, Duration::from_secs(29));
        // Its oldest entry has left; the window frees room for the request when it fits, not
        // in a microsecond (a client reading `RateLimit` would retry at once).
        assert_eq!(outcome.windows[0].reset_us, 29_000_000);
        // One less than the refused cost: only until the oldest entry leaves.
        assert_eq!(
            s.known_full_at("k", 1, 49, &w, later).unwrap().0,
            Duration::from_micros(500_000)
        );
        // A wait that was a client's windows' too says nothing of another client's request.
        s.full("k", 2, &w, 50, &refusal(true));
        let at = s.hints.lock().unwrap()["k"][2].as_ref().unwrap().at;
        assert_eq!(
            s.known_full_at("k", 2, 50, &w, at + Duration::from_millis(100))
                .unwrap()
                .0,
            Duration::from_micros(500_000)
        );
    }

    #[test]
    fn a_reload_keeps_a_route_of_the_same_count_and_forgets_its_refusals() {
        let shards = Shards::default();
        assert!(shards.of("api").is_none());
        shards.set(&[("api", 3, RR), ("one", 1, RR), ("two", 2, RR)]);
        assert!(shards.of("one").is_none());
        let api = shards.of("api").unwrap();
        api.leased("a", 2);
        let w = [Window {
            name: "m".into(),
            limit: 30,
            length_us: 60_000_000,
        }];
        let refused = Outcome {
            admitted: false,
            retry_after_us: 1,
            windows: vec![sluice_limiter::WindowState {
                remaining: 0,
                reset_us: 60_000_000,
            }],
        };
        api.full("k", 1, &w, 1, &refused);
        let two = shards.of("two").unwrap();
        shards.set(&[("api", 3, RR), ("two", 3, RR)]);
        // The same sub-logs, with their leases, and no refusal.
        let kept = shards.of("api").unwrap();
        assert!(Arc::ptr_eq(&api, &kept));
        assert!(kept.known_full("k", 1, 1, &w).is_none());
        assert_eq!(
            kept.lease_groups(&["a"], false),
            [vec![], vec![], vec!["a"]]
        );
        // Another count: other sub-logs. A request that read the table before still has its own.
        let three = shards.of("two").unwrap();
        assert!(!Arc::ptr_eq(&two, &three) && three.len() == 3 && two.len() == 2);
        shards.set(&[]);
        assert!(shards.of("api").is_none() && shards.of("two").is_none());
        shards.set(&[("api", 3, RR)]);
        assert!(!Arc::ptr_eq(&api, &shards.of("api").unwrap()));
    }

    #[test]
    fn home_starts_every_request_at_the_instances_own_sub_log_then_goes_on_in_turn() {
        // Instance 4 of a route of 3 sub-logs: its own is 4 mod 3.
        let shards = Shards::default();
        shards.set_instance(4);
        assert_eq!(
            shards.set(&[("api", 3, SubLogStart::Home), ("rr", 3, RR)]),
            0
        );
        let api = shards.of("api").unwrap();
        for _ in 0..4 {
            assert_eq!(api.order().collect::<Vec<_>>(), [1, 2, 0]);
        }
        // Round-robin on the same instance, for another route.
        let rr = shards.of("rr").unwrap();
        let firsts: Vec<usize> = (0..3).map(|_| rr.order().next().unwrap()).collect();
        assert_eq!(firsts, [0, 1, 2]);
        // A reload may turn a kept route either way, with its sub-logs and leases.
        api.leased("l", 2);
        shards.set(&[("api", 3, RR)]);
        let kept = shards.of("api").unwrap();
        assert!(Arc::ptr_eq(&api, &kept));
        let firsts: Vec<usize> = (0..3).map(|_| kept.order().next().unwrap()).collect();
        assert_eq!(firsts, [0, 1, 2]);
        shards.set(&[("api", 3, SubLogStart::Home)]);
        assert_eq!(kept.order().next(), Some(1));
        assert_eq!(
            kept.lease_groups(&["l"], false),
            [vec![], vec![], vec!["l"]]
        );
        // Another count: its own is the index modulo the new count.
        shards.set(&[("api", 2, SubLogStart::Home)]);
        assert_eq!(
            shards.of("api").unwrap().order().collect::<Vec<_>>(),
            [0, 1]
        );
    }

    #[test]
    fn home_without_an_instance_index_takes_the_sub_logs_in_turn() {
        let shards = Shards::default();
        // Both routes ask for home; neither has an instance's own sub-log to start at.
        let asked = [("api", 3, SubLogStart::Home), ("two", 2, SubLogStart::Home)];
        assert_eq!(shards.set(&asked), 2, "both start in turn, and say so");
        let api = shards.of("api").unwrap();
        for _ in 0..2 {
            let firsts: Vec<usize> = (0..3).map(|_| api.order().next().unwrap()).collect();
            assert_eq!(
                firsts,
                [0, 1, 2],
                "as round_robin: each sub-log first in turn"
            );
        }
        assert_eq!(api.order().collect::<Vec<_>>(), [0, 1, 2]);
        // An index set later reaches the routes in force, which it keeps, leases and all.
        api.leased("l", 2);
        shards.set_instance(5);
        let kept = shards.of("api").unwrap();
        assert!(Arc::ptr_eq(&api, &kept));
        assert_eq!(kept.order().collect::<Vec<_>>(), [2, 0, 1]);
        assert_eq!(shards.of("two").unwrap().order().next(), Some(1));
        assert_eq!(
            kept.lease_groups(&["l"], false),
            [vec![], vec![], vec!["l"]]
        );
        assert_eq!(shards.set(&asked), 0);
        assert_eq!(kept.order().next(), Some(2));
    }

    #[test]
    fn a_lease_goes_back_to_its_sub_log_and_is_forgotten_on_release() {
        let s = Sharded::new("api", 3);
        s.leased("a", 2);
        s.leased("b", 0);
        assert_eq!(
            s.lease_groups(&["a", "b"], false),
            [vec!["b"], vec![], vec!["a"]]
        );
        assert_eq!(
            s.lease_groups(&["a", "b"], true),
            [vec!["b"], vec![], vec!["a"]]
        );
        // Released: unknown now, so a late renewal goes everywhere and changes nothing.
        assert_eq!(
            s.lease_groups(&["a"], false),
            [vec!["a"], vec!["a"], vec!["a"]]
        );
        assert_eq!(s.session_sub_log("x"), s.session_sub_log("x"));
    }

    #[test]
    fn only_the_routes_windows_that_refused_say_how_long() {
        use sluice_limiter::WindowState;
        let w = |remaining, reset_us| WindowState {
            remaining,
            reset_us,
        };
        assert_eq!(full_for(&[w(5, 10), w(0, 30), w(1, 20)], 2), Some(30));
        assert_eq!(full_for(&[w(5, 10)], 2), None);
    }
}
