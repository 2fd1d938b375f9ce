//! Routes whose state is kept in sub-logs (`state_shards`, shards.rs), on Redis: a request goes
//! to one sub-log at a time, with its share of the limits, until one admits it; what every
//! sub-log must hear (a cooldown, a sync, an unbinding) and the reads of them all go to each at
//! once, and their answers are joined. What this instance knows of the sub-logs (their names,
//! hints, leases) is shards.rs's; the calls on one log are the store's own (redis.rs).

use std::collections::HashMap;

use sluice_allocator::{Assign, Assignment, Lease};
use sluice_limiter::{Acquire, Outcome, StoreError};

use super::RedisStore;
use crate::shards::{self, Log, Sharded};

impl RedisStore {
    /// Runs `op` on each log of `route`: its own when it has no sub-logs, else every sub-log at
    /// once, their answers joined by `sum` (a read's figures added up; `|(), ()| ()` for a write
    /// that answers nothing). All at once, waiting for all, so that each sub-log hears of a
    /// cooldown, a sync or an unbinding however the others fare: one after another, a sub-log out
    /// of reach kept the ones after it from hearing at all, and S calls cost S round trips before
    /// the request (or the status page) could be answered. The first error in the sub-logs' order
    /// is the answer, once every call has ended.
    pub(super) async fn on_each_log<'r, T, F, Fut>(
        &self,
        route: &'r str,
        mut op: F,
        mut sum: impl FnMut(T, T) -> T,
    ) -> Result<T, StoreError>
    where
        F: FnMut(Log<'r>) -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let Some(sharded) = self.shards.of(route) else {
            return op(Log::Whole(route)).await;
        };
        let mut total = None;
        let each = (0..sharded.len()).map(|i| op(Log::Sub(sharded.clone(), i)));
        for part in futures_util::future::join_all(each).await {
            let part = part?;
            total = Some(match total {
                None => part,
                Some(total) => sum(total, part),
            });
        }
        total.ok_or_else(|| StoreError::Backend("a route without sub-logs".into()))
    }

    /// A lease operation (`"renew"`, `"release"`) on each sub-log of `sharded`, each with its
    /// own group of lease ids (`groups`, from [`Sharded::lease_groups`], in the sub-logs'
    /// order), all at once and each to its end, as [`RedisStore::on_each_log`] does and for the
    /// same reason: one after another, a sub-log out of reach failed every renewal before the
    /// sub-logs after it were asked, so their leases expired while still in flight and their
    /// room was taken again past the route's `max_in_flight` (and a failed release held theirs
    /// until the ttl). The first error in the sub-logs' order is the answer, once every call has
    /// ended.
    pub(super) async fn lease_on_each_sub_log(
        &self,
        sharded: &Sharded,
        op: &str,
        ttl_us: Option<u64>,
        groups: &[Vec<&str>],
        at_us: Option<u64>,
    ) -> Result<(), StoreError> {
        let each = sharded
            .names
            .iter()
            .zip(groups)
            .map(|(name, ids)| self.lease_call(name, op, ttl_us, ids, at_us));
        for answer in futures_util::future::join_all(each).await {
            answer?;
        }
        Ok(())
    }

    /// A call that sub-logs do not split (reservations: their settlements would need the
    /// sub-log), refused on a route with them; config validation refuses such routes first.
    pub(super) fn unsplit(&self, route: &str) -> Result<(), StoreError> {
        match self.shards.of(route) {
            None => Ok(()),
            Some(_) => Err(StoreError::Backend(format!(
                "route {route} keeps its state in sub-logs (state_shards), which do not take reservations"
            ))),
        }
    }

    /// A request on a route with sub-logs: a read (cost 0) reads every sub-log at once
    /// ([`RedisStore::on_each_log`]) and sums; else the sub-logs in turn from the route's start
    /// ([`Sharded::order`]), skipping those known full, until one admits it or every one
    /// refused. A sub-log is charged only when it
    /// admits: a request is charged once.
    pub(super) async fn acquire_sharded(
        &self,
        req: Acquire<'_>,
        sharded: &Sharded,
    ) -> Result<Outcome, StoreError> {
        let n = sharded.len();
        let mine = req.windows.len();
        if req.cost == 0 {
            return self
                .on_each_log(
                    req.route,
                    |log| async move {
                        let share = match &log {
                            Log::Whole(_) => req.windows.to_vec(),
                            Log::Sub(sharded, i) => shards::split(req.windows, *i, sharded.len()),
                        };
                        self.acquire_one(Acquire {
                            route: log.name(),
                            windows: &share,
                            ..req
                        })
                        .await
                    },
                    |mut sum, part| {
                        sum.admitted &= part.admitted;
                        sum.retry_after_us = sum.retry_after_us.max(part.retry_after_us);
                        for (s, p) in sum.windows.iter_mut().zip(&part.windows).take(mine) {
                            s.remaining = s.remaining.saturating_add(p.remaining);
                            s.reset_us = match (s.reset_us, p.reset_us) {
                                (0, r) | (r, 0) => r,
                                (a, b) => a.min(b),
                            };
                        }
                        sum
                    },
                )
                .await;
        }
        let mut refused: Option<Outcome> = None;
        for i in sharded.order() {
            let outcome = match sharded.known_full(req.key, i, req.cost, req.windows) {
                Some((left, mut outcome)) => {
                    outcome.retry_after_us = micros(left);
                    outcome
                }
                None => {
                    let share = shards::split(req.windows, i, n);
                    let outcome = self
                        .acquire_one(Acquire {
                            route: &sharded.names[i],
                            windows: &share,
                            ..req
                        })
                        .await?;
                    if outcome.admitted {
                        return Ok(outcome);
                    }
                    let states = &outcome.windows[..mine.min(outcome.windows.len())];
                    // Refused by the client's own windows alone: no other sub-log admits.
                    if shards::full_for(states, req.cost).is_none() {
                        return Ok(outcome);
                    }
                    sharded.full(req.key, i, req.windows, req.cost, &outcome);
                    outcome
                }
            };
            if refused
                .as_ref()
                .is_none_or(|r| outcome.retry_after_us < r.retry_after_us)
            {
                refused = Some(outcome);
            }
        }
        refused.ok_or_else(|| StoreError::Backend("a route without sub-logs".into()))
    }

    /// An assignment on a route with sub-logs: the sub-logs in turn (a session's from its own),
    /// skipping those known full, each with its share of the route's windows, of the members',
    /// and of the caps on leases and bindings, until one assigns. A sub-log whose route windows
    /// refuse is known full until its answer says; one whose members are all busy, or at its
    /// share of leases, is passed over (busy members say nothing of the members another request
    /// may have, so that is not remembered); any other answer (no member, refused by the
    /// client's own windows or cap) is the request's. A lease taken is remembered with its
    /// sub-log, where its release and renewals go.
    pub(super) async fn assign_sharded(
        &self,
        ask: Assign<'_>,
        sharded: &Sharded,
    ) -> Result<Assignment, StoreError> {
        let n = sharded.len();
        let key = ask.quota.map_or("", |q| q.key);
        let windows = ask.quota.map_or(&[][..], |q| q.windows);
        let mine = windows.len();
        let cost = ask.quota.map_or(ask.cost, |q| q.cost);
        // A session starts at its own sub-log, where its binding is, whatever the instance's
        // own; others where the route starts its requests (the next in turn, or this
        // instance's own).
        let order: Vec<usize> = match ask.sticky {
            Some(sticky) => {
                let first = sharded.session_sub_log(sticky.session);
                (0..n).map(|k| (first + k) % n).collect()
            }
            None => sharded.order().collect(),
        };
        let mut refused: Option<(u64, Assignment)> = None;
        for i in order {
            let answer = match sharded.known_full(key, i, cost, windows) {
                Some((left, mut outcome)) => {
                    outcome.retry_after_us = micros(left);
                    Assignment::QuotaRefused(outcome)
                }
                None => {
                    let name = &sharded.names[i];
                    let share = ask.quota.map(|q| shards::split(q.windows, i, n));
                    let members = shards::split_members(ask.members, i, n);
                    let quota = ask.quota.map(|q| Acquire {
                        route: name,
                        windows: share.as_deref().unwrap_or_default(),
                        ..q
                    });
                    // Each sub-log keeps its share of the caps on leases and bindings.
                    let part = |cap: u64| shards::share(cap, i, n).max(1);
                    let lease = ask.lease.map(|l| Lease {
                        member_max: l.member_max.map(part),
                        route_max: l.route_max.map(part),
                        ..l
                    });
                    let sticky = ask.sticky.map(|st| sluice_allocator::Sticky {
                        max_bindings: part(st.max_bindings),
                        ..st
                    });
                    let answer = self
                        .assign_one(&Assign {
                            route: name,
                            members: &members,
                            quota,
                            lease,
                            sticky,
                            ..ask
                        })
                        .await?;
                    match &answer {
                        Assignment::Assigned { .. } => {
                            if let Some(lease) = ask.lease {
                                sharded.leased(lease.id, i);
                            }
                            return Ok(answer);
                        }
                        Assignment::QuotaRefused(o) => {
                            let states = &o.windows[..mine.min(o.windows.len())];
                            // Refused by the client's own windows alone: no other sub-log admits.
                            if shards::full_for(states, cost).is_none() {
                                return Ok(answer);
                            }
                            sharded.full(key, i, windows, cost, o);
                        }
                        // Its members are busy, or it holds its share of leases: another may
                        // have room.
                        Assignment::Busy { .. } | Assignment::Concurrency { .. } => {}
                        _ => return Ok(answer),
                    }
                    answer
                }
            };
            let wait = match &answer {
                Assignment::QuotaRefused(o) => o.retry_after_us,
                Assignment::Busy { retry_after_us, .. } => *retry_after_us,
                _ => u64::MAX,
            };
            if refused.as_ref().is_none_or(|(w, _)| wait < *w) {
                refused = Some((wait, answer));
            }
        }
        refused
            .map(|(_, answer)| answer)
            .ok_or_else(|| StoreError::Backend("a route without sub-logs".into()))
    }
}

/// Whole microseconds of `d`, at least 1.
fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// Two logs' (member, figure) lists as one, a member's figures in both joined by `join`, in no
/// particular order.
pub(super) fn per_member(
    a: Vec<(String, u64)>,
    b: Vec<(String, u64)>,
    join: impl Fn(u64, u64) -> u64,
) -> Vec<(String, u64)> {
    let mut all: HashMap<String, u64> = HashMap::new();
    for (member, figure) in a.into_iter().chain(b) {
        let joined = all.entry(member).or_default();
        *joined = join(*joined, figure);
    }
    all.into_iter().collect()
}

/// (member, figure) pairs, smallest figure first, then by member.
pub(super) fn by_figure(mut all: Vec<(String, u64)>) -> Vec<(String, u64)> {
    all.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
    all
}
