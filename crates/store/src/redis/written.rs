//! Calls of `assign_run.lua` written once and shared by the requests they fit.
//!
//! Why: a least-used key-pool request (member windows, cooldowns) that goes with its lane's
//! batch, with nothing excluded, has a call that depends only on its route's configuration:
//! the pool, the cooldowns, the route quota's keys and windows, each member's keys and windows,
//! the costs. Writing it whole (each key put together from its parts, every number
//! formatted) was most of what such a request cost sluice over a plain least-used one, and in
//! a batch every request after the first then went as `=`, its call compared byte by byte
//! with the one before and thrown away (docs/benchmarks.md, "Key pools: what sluice adds").
//!
//! How: the first such request of a route writes its call and keeps it here with what it was
//! written from (its *shape*); a later request whose ask has the same shape, part by part,
//! takes the same call (an `Arc`), and the batch sends it as `=` on seeing the same pointer
//! (batch.rs). Exact: a call is shared only with an ask equal in every part the call is
//! written from, compared in full, and with calls going the same way (`FCALL` or `EVALSHA`);
//! a reload that changes a limit, a sub-log (a route of its own here) or another quota key is
//! another shape and another call. Debug builds write the call again on every hit and check
//! that it is the one kept, so every test that runs a key pool checks that the shape misses
//! nothing the call depends on.
//!
//! Bounded: a fixed table of [`ROUTES`] slots, a route in the slot its name hashes to (two
//! routes in one slot take turns: each then writes its calls as before), each route with at
//! most [`SHAPES`] calls (past it the oldest goes). A call holds its route's members, so what is
//! kept is at most that many calls of the config's own size; after a reload the old config's
//! shapes go as the new ones replace them. A route whose requests change shape all the time (a
//! quota key per caller) would pay for keeping calls that are never used again: past
//! [`MISSES`] misses it keeps one new call in [`MISSES`], and a request that finds its call
//! pays back [`MISSES`] misses, so a route that mostly misses stays throttled.
//!
//! Lock-free for a request: a slot and its route's calls are read through `arc-swap`; a new
//! route replaces its slot, and a new shape replaces that route's few calls.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use arc_swap::{ArcSwap, ArcSwapOption};
use redis::Cmd;

use sluice_allocator::{Assign, PoolMember};
use sluice_limiter::{Acquire, Window};

use crate::call::Written;

/// Slots for routes (each sub-log counts as one) whose calls are kept: far more than a config
/// has, so that two routes seldom share one.
const ROUTES: usize = 4096;
/// The most calls one route keeps: one per quota key it is asked on, and a few more while a
/// reload's new shapes replace the old.
const SHAPES: usize = 8;
/// Misses (less what hits paid back) past which a route keeps only one new call in as many.
const MISSES: u32 = 64;

/// What a shared call is written from, besides the store's key prefix and the route.
struct Shape {
    /// Whether it goes as `FCALL` (else `EVALSHA`): one written before Redis refused functions
    /// would be copied under the new head on every lone send.
    fcall: bool,
    /// The member cost, and the route quota's cost (sent even with no quota windows).
    cost: u64,
    quota_cost: u64,
    cooldowns: bool,
    /// The decision's clock: `None` for Redis `TIME` (the gateway), or a test's.
    at_us: Option<u64>,
    /// The route quota, when it has windows.
    quota: Option<QuotaShape>,
    /// Every member, as the ask gave them. `Arc` equality looks at the pointer first, so the
    /// config's own members compare at once, and a sub-log's share by value.
    members: Box<[PoolMember]>,
    call: Written,
}

/// A route quota's part of a shape: its route (a sub-log's name), key and windows.
struct QuotaShape {
    route: Box<str>,
    key: Box<str>,
    windows: Box<[Window]>,
}

impl Shape {
    fn of(ask: &Assign<'_>, quota: Option<&Acquire<'_>>, fcall: bool, call: Written) -> Shape {
        Shape {
            fcall,
            cost: ask.cost,
            quota_cost: ask.quota.map_or(0, |q| q.cost),
            cooldowns: ask.cooldowns,
            at_us: clock(ask),
            quota: quota.map(|q| QuotaShape {
                route: q.route.into(),
                key: q.key.into(),
                windows: q.windows.into(),
            }),
            members: ask.members.into(),
            call,
        }
    }

    /// Whether a call written for `ask` (going as `FCALL` when `fcall`) would be this one,
    /// part for part.
    fn fits(&self, ask: &Assign<'_>, quota: Option<&Acquire<'_>>, fcall: bool) -> bool {
        self.fcall == fcall
            && self.cost == ask.cost
            && self.quota_cost == ask.quota.map_or(0, |q| q.cost)
            && self.cooldowns == ask.cooldowns
            && self.at_us == clock(ask)
            && match (&self.quota, quota) {
                (None, None) => true,
                (Some(s), Some(q)) => {
                    *s.route == *q.route && *s.key == *q.key && *s.windows == *q.windows
                }
                _ => false,
            }
            && *self.members == *ask.members
    }
}

/// The clock a call is written with (as `write_assign` writes it).
fn clock(ask: &Assign<'_>) -> Option<u64> {
    ask.at_us.or(ask.quota.and_then(|q| q.at_us))
}

/// One route's kept calls.
struct Calls {
    route: Box<str>,
    kept: ArcSwap<Vec<Arc<Shape>>>,
    /// Misses, less [`MISSES`] for each request that found its call here.
    misses: AtomicU32,
}

/// The calls kept, by route.
pub(crate) struct WrittenCalls {
    /// A route's calls in the slot its name hashes to.
    slots: Box<[ArcSwapOption<Calls>]>,
    hasher: foldhash::fast::RandomState,
}

impl Default for WrittenCalls {
    fn default() -> WrittenCalls {
        WrittenCalls::with_slots(ROUTES)
    }
}

impl WrittenCalls {
    fn with_slots(n: usize) -> WrittenCalls {
        WrittenCalls {
            slots: (0..n.max(1)).map(|_| ArcSwapOption::empty()).collect(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// Whether `ask` may share a call: a least-used one with nothing excluded, no client, lease
    /// or sticky session (a preference's order, the excluded ids and those parts change from
    /// one request to the next, or keep a call of their own).
    pub(crate) fn fit_for(ask: &Assign<'_>) -> bool {
        matches!(ask.order, sluice_allocator::Order::LeastUsed)
            && ask.excluded.is_empty()
            && ask.lease.is_none()
            && ask.sticky.is_none()
            && ask.quota.is_none_or(|q| q.client.is_none())
    }

    /// The call for `ask` (whose route quota, with windows, is `quota`; calls going as `FCALL`
    /// when `fcall`): one kept for its shape, or the one `write` writes, kept for the next.
    pub(crate) fn get_or_write(
        &self,
        ask: &Assign<'_>,
        quota: Option<&Acquire<'_>>,
        fcall: bool,
        write: impl Fn() -> (Cmd, usize),
    ) -> Written {
        let slot = &self.slots[self.hasher.hash_one(ask.route) as usize % self.slots.len()];
        let calls = match &*slot.load() {
            Some(calls) if *calls.route == *ask.route => {
                if let Some(shape) = calls.kept.load().iter().find(|s| s.fits(ask, quota, fcall)) {
                    // Read before written: most hits find nothing to pay back.
                    let misses = calls.misses.load(Ordering::Relaxed);
                    if misses != 0 {
                        calls
                            .misses
                            .store(misses.saturating_sub(MISSES), Ordering::Relaxed);
                    }
                    check(&shape.call, &write);
                    return shape.call.clone();
                }
                calls.clone()
            }
            // No route here yet, or another one: this one takes the slot.
            _ => {
                let calls = Arc::new(Calls {
                    route: ask.route.into(),
                    kept: ArcSwap::default(),
                    misses: AtomicU32::new(0),
                });
                slot.store(Some(calls.clone()));
                calls
            }
        };
        let missed = calls.misses.fetch_add(1, Ordering::Relaxed);
        if missed >= MISSES && missed % MISSES != 0 {
            return Arc::new(write());
        }
        self.keep(&calls, ask, quota, fcall, &write)
    }

    /// Writes `ask`'s call and keeps it in `calls`, unless another request kept one of the
    /// same shape meanwhile: then that one.
    fn keep(
        &self,
        calls: &Calls,
        ask: &Assign<'_>,
        quota: Option<&Acquire<'_>>,
        fcall: bool,
        write: &impl Fn() -> (Cmd, usize),
    ) -> Written {
        let call: Written = Arc::new(write());
        // The head it was written with, which `fcall` may no longer be: Redis may have refused
        // functions since the caller looked.
        let written_fcall = matches!(
            call.0.args_iter().next(),
            Some(redis::Arg::Simple(head)) if head == b"FCALL"
        );
        let shape = Arc::new(Shape::of(ask, quota, written_fcall, call.clone()));
        let mut taken = None;
        calls.kept.rcu(|kept| {
            if let Some(same) = kept.iter().find(|s| s.fits(ask, quota, fcall)) {
                taken = Some(same.call.clone());
                return kept.clone();
            }
            taken = None;
            let mut next = Vec::with_capacity(SHAPES);
            next.extend(
                kept.iter()
                    .skip((kept.len() + 1).saturating_sub(SHAPES))
                    .cloned(),
            );
            next.push(shape.clone());
            Arc::new(next)
        });
        match taken {
            Some(same) => {
                check(&same, write);
                same
            }
            None => call,
        }
    }

    /// How many calls are kept, for tests.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.slots
            .iter()
            .filter_map(|s| s.load_full())
            .map(|c| c.kept.load().len())
            .sum()
    }
}

/// Debug builds: the call `write` writes now is the one kept (its key count, keys and
/// arguments: the head, `FCALL` or `EVALSHA`, may have changed since the caller looked), so a
/// part of the ask that the call depends on and `Shape::fits` does not compare fails every
/// test that runs a key pool.
fn check(kept: &Written, write: &impl Fn() -> (Cmd, usize)) {
    if cfg!(debug_assertions) {
        let (again, keys) = write();
        let args = |cmd: &Cmd| -> Vec<Vec<u8>> {
            cmd.args_iter()
                .skip(2)
                .map(|a| match a {
                    redis::Arg::Simple(b) => b.to_vec(),
                    _ => b"<not bytes>".to_vec(),
                })
                .collect()
        };
        assert_eq!(keys, kept.1, "a shared call's key count");
        assert_eq!(
            args(&again),
            args(&kept.0),
            "a shared call is not the one its ask writes"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_allocator::Order;

    fn window(name: &str, limit: u64) -> Window {
        Window {
            name: name.into(),
            limit,
            length_us: 1_000_000,
        }
    }

    fn members(limit: u64) -> Vec<PoolMember> {
        ["a", "b"]
            .iter()
            .map(|id| PoolMember {
                id: (*id).into(),
                windows: Arc::new([window("m", limit)]),
            })
            .collect()
    }

    /// The parts of an ask a test varies, one at a time.
    #[derive(Clone)]
    struct Parts {
        route: String,
        key: String,
        quota_limit: Option<u64>,
        quota_cost: u64,
        cost: u64,
        cooldowns: bool,
        at_us: Option<u64>,
        members: Vec<PoolMember>,
    }

    fn base() -> Parts {
        Parts {
            route: "pool".into(),
            key: "route".into(),
            quota_limit: Some(10),
            quota_cost: 1,
            cost: 1,
            cooldowns: true,
            at_us: None,
            members: members(3),
        }
    }

    /// Asks `calls` for the call of `p`, written from every part of it: two shapes write two
    /// different calls, so the debug check fails a hit on a shape that does not fit.
    fn ask(calls: &WrittenCalls, p: &Parts) -> Written {
        let windows: Vec<Window> = p.quota_limit.map(|l| window("q", l)).into_iter().collect();
        let quota = Acquire {
            route: &p.route,
            key: &p.key,
            windows: &windows,
            cost: p.quota_cost,
            at_us: None,
            client: None,
        };
        let ask = Assign {
            route: &p.route,
            members: &p.members,
            order: Order::LeastUsed,
            excluded: &[],
            quota: Some(quota),
            cost: p.cost,
            cooldowns: p.cooldowns,
            at_us: p.at_us,
            lease: None,
            sticky: None,
        };
        assert!(WrittenCalls::fit_for(&ask));
        let quota = Some(quota).filter(|q| !q.windows.is_empty());
        // What the call is written from, as write_assign would write it (the debug check
        // compares a kept call with the one its ask writes again).
        let write = || {
            let mut cmd = Cmd::new();
            cmd.arg("FCALL").arg("assign").arg(1).arg(&*p.route);
            cmd.arg(&*p.key).arg(p.quota_limit).arg(p.quota_cost);
            cmd.arg(p.cost).arg(p.cooldowns).arg(p.at_us);
            for m in &p.members {
                cmd.arg(&*m.id);
                for w in m.windows.iter() {
                    cmd.arg(&*w.name).arg(w.limit).arg(w.length_us);
                }
            }
            (cmd, 1)
        };
        calls.get_or_write(&ask, quota.as_ref(), true, write)
    }

    #[test]
    fn an_ask_of_the_same_shape_takes_the_call_written_for_the_first() {
        let calls = WrittenCalls::default();
        let first = ask(&calls, &base());
        assert!(Arc::ptr_eq(&first, &ask(&calls, &base())));
        // Members equal in value but not the same `Arc`s (a sub-log's share, a reload that
        // changed nothing) are the same shape.
        let equal = ask(
            &calls,
            &Parts {
                members: members(3),
                ..base()
            },
        );
        assert!(Arc::ptr_eq(&first, &equal));
        assert_eq!(calls.len(), 1);
    }

    #[test]
    fn an_ask_that_differs_in_any_part_gets_a_call_of_its_own() {
        let with = |f: fn(&mut PoolMember)| {
            let mut m = members(3);
            f(&mut m[1]);
            m
        };
        let variants = [
            Parts {
                route: "other".into(),
                ..base()
            },
            Parts {
                key: "tenant-1".into(),
                ..base()
            },
            Parts {
                quota_limit: Some(11),
                ..base()
            },
            Parts {
                quota_limit: None,
                ..base()
            },
            Parts {
                quota_cost: 2,
                ..base()
            },
            Parts { cost: 2, ..base() },
            Parts {
                cooldowns: false,
                ..base()
            },
            Parts {
                at_us: Some(5),
                ..base()
            },
            Parts {
                members: members(4),
                ..base()
            },
            Parts {
                members: with(|m| m.id = "c".into()),
                ..base()
            },
            Parts {
                members: with(|m| m.windows = Arc::new([window("n", 3)])),
                ..base()
            },
            Parts {
                members: with(|m| {
                    m.windows = Arc::new([Window {
                        length_us: 2_000_000,
                        ..window("m", 3)
                    }])
                }),
                ..base()
            },
            Parts {
                members: with(|m| m.windows = Arc::new([window("m", 3), window("h", 9)])),
                ..base()
            },
            Parts {
                members: members(3)[..1].to_vec(),
                ..base()
            },
        ];
        for (i, variant) in variants.iter().enumerate() {
            let calls = WrittenCalls::default();
            let first = ask(&calls, &base());
            let other = ask(&calls, variant);
            assert!(!Arc::ptr_eq(&first, &other), "variant {i}");
            // Both stay kept, each for its own shape.
            assert!(Arc::ptr_eq(&first, &ask(&calls, &base())), "variant {i}");
            assert!(Arc::ptr_eq(&other, &ask(&calls, variant)), "variant {i}");
        }
    }

    #[test]
    fn a_call_written_before_redis_refused_functions_is_not_shared_after() {
        let calls = WrittenCalls::default();
        let p = base();
        let members = p.members.clone();
        let ask = Assign {
            route: "pool",
            members: &members,
            order: Order::LeastUsed,
            excluded: &[],
            quota: None,
            cost: 1,
            cooldowns: true,
            at_us: None,
            lease: None,
            sticky: None,
        };
        let head = |head: &'static str| {
            move || {
                let mut cmd = Cmd::new();
                cmd.arg(head).arg("assign").arg(0);
                (cmd, 0)
            }
        };
        let fcall = calls.get_or_write(&ask, None, true, head("FCALL"));
        let evalsha = calls.get_or_write(&ask, None, false, head("EVALSHA"));
        assert!(!Arc::ptr_eq(&fcall, &evalsha));
        assert!(Arc::ptr_eq(
            &evalsha,
            &calls.get_or_write(&ask, None, false, head("EVALSHA"))
        ));
        // A call written as EVALSHA by a request that still thought calls went as FCALL (Redis
        // refused functions in between) is kept for what it is: no FCALL ask takes it.
        let calls = WrittenCalls::default();
        let raced = calls.get_or_write(&ask, None, true, head("EVALSHA"));
        assert!(!Arc::ptr_eq(
            &raced,
            &calls.get_or_write(&ask, None, true, head("FCALL"))
        ));
        assert!(Arc::ptr_eq(
            &raced,
            &calls.get_or_write(&ask, None, false, head("EVALSHA"))
        ));
    }

    #[test]
    fn asks_that_leave_members_out_or_carry_their_own_state_do_not_share_calls() {
        let members = members(3);
        let order = [0, 1];
        let base = Assign {
            route: "pool",
            members: &members,
            order: Order::LeastUsed,
            excluded: &[],
            quota: None,
            cost: 1,
            cooldowns: true,
            at_us: None,
            lease: None,
            sticky: None,
        };
        assert!(WrittenCalls::fit_for(&base));
        let excluded = ["a"];
        assert!(!WrittenCalls::fit_for(&Assign {
            excluded: &excluded,
            ..base
        }));
        assert!(!WrittenCalls::fit_for(&Assign {
            order: Order::Preference(&order),
            ..base
        }));
        let windows = [window("c", 5)];
        assert!(!WrittenCalls::fit_for(&Assign {
            quota: Some(Acquire {
                route: "pool",
                key: "route",
                windows: &[],
                cost: 1,
                at_us: None,
                client: Some(sluice_limiter::ClientWindows {
                    name: "svc",
                    windows: &windows,
                }),
            }),
            ..base
        }));
    }

    /// A quota key per caller: past SHAPES the oldest go, past MISSES misses only one in MISSES
    /// is kept, and a request that finds its call pays back MISSES of them.
    #[test]
    fn a_route_keeps_at_most_its_shapes_and_stops_keeping_what_is_never_found() {
        let calls = WrittenCalls::default();
        let caller = |i: usize| Parts {
            key: format!("caller-{i}"),
            ..base()
        };
        let firsts: Vec<Written> = (0..SHAPES + 5).map(|i| ask(&calls, &caller(i))).collect();
        assert_eq!(calls.len(), SHAPES);
        // The newest are kept; the oldest was dropped and is written again.
        assert!(Arc::ptr_eq(
            &firsts[SHAPES + 4],
            &ask(&calls, &caller(SHAPES + 4))
        ));
        assert!(!Arc::ptr_eq(&firsts[0], &ask(&calls, &caller(0))));
        // That hit made the misses start over: caller 0's was the first. MISSES more, the last
        // of which is kept (one in MISSES is), and past them a call written is not kept.
        for i in 1..=MISSES as usize {
            ask(&calls, &caller(1000 + i));
        }
        let unkept = ask(&calls, &caller(5000));
        assert!(!Arc::ptr_eq(&unkept, &ask(&calls, &caller(5000))));
        // A request that finds its call pays back MISSES misses: the route keeps again.
        let newest = caller(1000 + MISSES as usize);
        let kept = ask(&calls, &newest);
        assert!(Arc::ptr_eq(&kept, &ask(&calls, &newest)));
        let next = ask(&calls, &caller(6000));
        assert!(Arc::ptr_eq(&next, &ask(&calls, &caller(6000))));
        assert_eq!(calls.len(), SHAPES);
    }

    #[test]
    fn routes_in_one_slot_take_turns_and_every_call_fits_its_own() {
        // One slot: every route shares it.
        let calls = WrittenCalls::with_slots(1);
        let route = |name: &str| Parts {
            route: name.into(),
            ..base()
        };
        let a = ask(&calls, &route("a"));
        assert!(Arc::ptr_eq(&a, &ask(&calls, &route("a"))));
        let b = ask(&calls, &route("b"));
        assert!(!Arc::ptr_eq(&a, &b));
        assert!(Arc::ptr_eq(&b, &ask(&calls, &route("b"))));
        // "a" lost the slot to "b": written again, and kept again.
        let again = ask(&calls, &route("a"));
        assert!(!Arc::ptr_eq(&a, &again));
        assert!(Arc::ptr_eq(&again, &ask(&calls, &route("a"))));
        assert_eq!(calls.len(), 1);
    }
}
