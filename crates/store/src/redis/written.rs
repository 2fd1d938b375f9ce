//! Calls of `assign_run.lua` written once and shared by the requests they fit.
//!
//! Why: a least-used key-pool request (member windows, cooldowns) that goes with its lane's
//! batch, with nothing excluded, has a call that depends only on its route's configuration:
//! the pool, the cooldowns, the route quota's keys and windows, each member's keys and windows,
//! the costs. Writing it (about ten keys put together from their parts, twenty numbers
//! formatted) was most of what such a request cost sluice over a plain least-used one, and in
//! a batch every request after the first then went as `=`, its call compared byte by byte
//! with the one before and thrown away.
//!
//! How: the first such request of a route writes its call and keeps it here with what it was
//! written from (its *shape*); a later request whose ask has the same shape, part by part,
//! takes the same call (an `Arc`), and the batch sends it as `=` on seeing the same pointer
//! (batch.rs). Exact: a call is shared only with an ask equal in every part the call is
//! written from, compared in full (a member's id and windows by pointer first, the config's
//! own `Arc`s, then by value), so a reload, a sub-log's share of the limits or another quota
//! key is another shape and another call.
//!
//! Bounded: at most [`ROUTES`] routes (past it the table starts over), each with at most
//! [`SHAPES`] calls (past it the oldest goes). A route whose requests change shape all the
//! time (a quota key per caller) only writes its call as before, plus keeping it.
//!
//! Lock-free for a request: the table and each route's calls are read through `arc-swap`; a
//! route's first call replaces the table, and a new shape replaces that route's few calls.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use redis::Cmd;

use sluice_allocator::{Assign, PoolMember};
use sluice_limiter::{Acquire, Window};

use crate::call::Written;

/// The most routes (sub-logs count as routes) whose calls are kept.
const ROUTES: usize = 1024;
/// The most calls one route keeps: a route has one per sub-log and quota key it is asked on.
const SHAPES: usize = 8;

/// What a shared call is written from, besides the store's key prefix and the route.
struct Shape {
    /// The member cost, and the route quota's cost (sent even with no quota windows).
    cost: u64,
    quota_cost: u64,
    cooldowns: bool,
    /// The decision's clock: `None` for Redis `TIME` (the gateway), or a test's.
    at_us: Option<u64>,
    /// The route quota, when it has windows.
    quota: Option<QuotaShape>,
    /// Every member, as the ask gave them (the config's `Arc`s, kept alive here, so that a
    /// pointer seen equal is the same member and not a freed one's address reused).
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
    fn of(ask: &Assign<'_>, quota: Option<&Acquire<'_>>, call: Written) -> Shape {
        Shape {
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

    /// Whether a call written for `ask` would be this one, part for part.
    fn fits(&self, ask: &Assign<'_>, quota: Option<&Acquire<'_>>) -> bool {
        self.cost == ask.cost
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
            && self.members.len() == ask.members.len()
            && self.members.iter().zip(ask.members).all(|(a, b)| {
                (Arc::ptr_eq(&a.id, &b.id) || a.id == b.id)
                    && (Arc::ptr_eq(&a.windows, &b.windows) || a.windows == b.windows)
            })
    }
}

/// The clock a call is written with (as `assign_script` writes it).
fn clock(ask: &Assign<'_>) -> Option<u64> {
    ask.at_us.or(ask.quota.and_then(|q| q.at_us))
}

type Calls = ArcSwap<Vec<Arc<Shape>>>;
type Table = HashMap<Box<str>, Arc<Calls>, foldhash::fast::RandomState>;

/// The calls kept, by route.
#[derive(Default)]
pub(crate) struct WrittenCalls {
    routes: ArcSwap<Table>,
}

impl WrittenCalls {
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

    /// The call for `ask` (whose route quota, with windows, is `quota`): one kept for its
    /// shape, or the one `write` writes, kept for the next.
    pub(crate) fn get_or_write(
        &self,
        ask: &Assign<'_>,
        quota: Option<&Acquire<'_>>,
        write: impl FnOnce() -> (Cmd, usize),
    ) -> Written {
        let table = self.routes.load();
        let calls = table.get(ask.route).cloned();
        drop(table);
        if let Some(calls) = &calls {
            if let Some(shape) = calls.load().iter().find(|s| s.fits(ask, quota)) {
                return shape.call.clone();
            }
        }
        let call: Written = Arc::new(write());
        let shape = Arc::new(Shape::of(ask, quota, call.clone()));
        let calls = calls.unwrap_or_else(|| self.route(ask.route));
        calls.rcu(|kept| {
            let mut next = Vec::with_capacity(SHAPES);
            next.extend(
                kept.iter()
                    .skip((kept.len() + 1).saturating_sub(SHAPES))
                    .cloned(),
            );
            next.push(shape.clone());
            next
        });
        call
    }

    /// `route`'s calls, made empty when the route has none yet.
    fn route(&self, route: &str) -> Arc<Calls> {
        let mut made = None;
        self.routes.rcu(|table| {
            if let Some(calls) = table.get(route) {
                made = Some(calls.clone());
                return table.clone();
            }
            let mut next = if table.len() >= ROUTES {
                Table::default()
            } else {
                (**table).clone()
            };
            let calls = Arc::new(Calls::default());
            next.insert(route.into(), calls.clone());
            made = Some(calls);
            Arc::new(next)
        });
        made.unwrap_or_default()
    }

    /// How many calls are kept, for tests.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.routes.load().values().map(|c| c.load().len()).sum()
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

    /// Asks `calls` for the call of `p`; whether it was written (not found kept).
    fn ask(calls: &WrittenCalls, p: &Parts) -> (Written, bool) {
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
        let mut wrote = false;
        let call = calls.get_or_write(&ask, quota.as_ref(), || {
            wrote = true;
            (Cmd::new(), 0)
        });
        (call, wrote)
    }

    #[test]
    fn an_ask_of_the_same_shape_takes_the_call_written_for_the_first() {
        let calls = WrittenCalls::default();
        let (first, wrote) = ask(&calls, &base());
        assert!(wrote);
        let (again, wrote) = ask(&calls, &base());
        assert!(!wrote);
        assert!(Arc::ptr_eq(&first, &again));
        // Members equal in value but not the same `Arc`s (a sub-log's share, a reload that
        // changed nothing) are the same shape.
        let (equal, wrote) = ask(
            &calls,
            &Parts {
                members: members(3),
                ..base()
            },
        );
        assert!(!wrote);
        assert!(Arc::ptr_eq(&first, &equal));
        assert_eq!(calls.len(), 1);
    }

    #[test]
    fn an_ask_that_differs_in_any_part_gets_a_call_of_its_own() {
        let renamed = {
            let mut m = members(3);
            m[1].id = "c".into();
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
                members: renamed,
                ..base()
            },
            Parts {
                members: members(3)[..1].to_vec(),
                ..base()
            },
        ];
        for (i, variant) in variants.iter().enumerate() {
            let calls = WrittenCalls::default();
            let (first, _) = ask(&calls, &base());
            let (other, wrote) = ask(&calls, variant);
            assert!(wrote, "variant {i} took the base's call");
            assert!(!Arc::ptr_eq(&first, &other), "variant {i}");
            // Both stay kept, each for its own shape.
            let (again, wrote) = ask(&calls, &base());
            assert!(!wrote && Arc::ptr_eq(&first, &again), "variant {i}");
        }
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

    #[test]
    fn the_calls_kept_are_bounded() {
        let calls = WrittenCalls::default();
        // A quota key per caller: past SHAPES the oldest go.
        let keys: Vec<String> = (0..SHAPES + 5).map(|i| format!("caller-{i}")).collect();
        for key in &keys {
            let key = key.clone();
            ask(&calls, &Parts { key, ..base() });
        }
        assert_eq!(calls.len(), SHAPES);
        // The newest are kept; the first is written again.
        let newest = keys[SHAPES + 4].clone();
        assert!(
            !ask(
                &calls,
                &Parts {
                    key: newest,
                    ..base()
                }
            )
            .1
        );
        let oldest = keys[0].clone();
        assert!(
            ask(
                &calls,
                &Parts {
                    key: oldest,
                    ..base()
                }
            )
            .1
        );
        // Past ROUTES routes the table starts over.
        for i in 0..ROUTES {
            let route = format!("route-{i}");
            ask(&calls, &Parts { route, ..base() });
        }
        assert!(calls.routes.load().len() <= ROUTES);
        assert!(calls.len() <= ROUTES);
    }
}
