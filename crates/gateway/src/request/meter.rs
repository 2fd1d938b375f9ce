//! A request on a usage-metered route, from its reservation to its settlement: what admission
//! charges each window, the entries it recorded, the scan of the answer as it passes, and the
//! one store call that rewrites the entries when the answer ends.

use std::sync::Arc;

use sluice_allocator::StateStore;
use sluice_limiter::{Owner, Period, Settle, Settled, Window, MAX_AMOUNT};
use sluice_usage::{Millionths, ResponseScanner};

use crate::clients::Client;
use crate::metrics::Metrics;
use crate::quota::RouteQuota;
use crate::select::{Entries, MemberPlan, Reserving};

/// What a request reserves in its route's windows, its members' and its client's, decided
/// before admission.
pub(crate) struct Planned {
    /// The route's windows, a calendar window's length its current period's.
    pub(crate) windows: Vec<Window>,
    /// Per window, its period; empty when every window slides.
    pub(crate) periods: Vec<Option<Period>>,
    /// Per window, its amount: millionths of its unit, or the request's cost.
    pub(crate) amounts: Vec<u64>,
    /// What the members' own windows are charged, and their periods.
    pub(crate) members: Arc<MemberPlan>,
    /// Per member, per window of its own, the index of its unit (`None`: requests).
    member_units: Vec<Vec<Option<usize>>>,
    /// The client's own windows, a calendar window's length its current period's; empty
    /// when no client with windows calls.
    pub(crate) client_windows: Vec<Window>,
    /// Per window of the client's, its period; empty when every window slides.
    pub(crate) client_periods: Vec<Option<Period>>,
    /// Per window of the client's, its amount.
    pub(crate) client_amounts: Vec<u64>,
    /// Per window of the client's, what it counts.
    client_units: Vec<ClientUnit>,
}

/// What one of a client's windows counts on the route of a request.
#[derive(Debug, Clone, Copy)]
enum ClientUnit {
    /// Requests: the request's cost.
    Requests,
    /// A unit the route meters: its amount, by the route's reserve and settle rules (the
    /// index of the unit in the route's `quota.usage`).
    Metered(usize),
    /// A unit the route does not meter: nothing. The entry is recorded with 0, like any
    /// reservation, so that the window decides on the request with the others.
    Unmetered,
}

/// Microseconds since the Unix epoch, the clock calendar periods are cut on.
pub(crate) fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl Planned {
    /// The reservation of a request on `route` by `caller` whose units reserve `reserved` and
    /// whose cost is `cost`, in the periods that hold now; `None` when nothing of it needs a
    /// reservation (every window counts requests and slides), which then only counts.
    pub(crate) fn plan(
        route: &crate::table::Route,
        caller: Option<&Client>,
        reserved: &[Millionths],
        cost: u64,
    ) -> Option<Planned> {
        Planned::plan_at(route, caller, reserved, cost, now_us())
    }

    /// [`Planned::plan`] in the periods that hold at `now` (wall clock, microseconds).
    pub(crate) fn plan_at(
        route: &crate::table::Route,
        caller: Option<&Client>,
        reserved: &[Millionths],
        cost: u64,
        now: u64,
    ) -> Option<Planned> {
        let quota = route.quota.as_deref();
        let usage = quota.and_then(|q| q.usage.as_ref());
        let member_configs = &route.config.upstream.members;
        let member_calendars = route
            .members
            .iter()
            .any(|m| m.calendars.iter().any(Option::is_some));
        let client = caller.filter(|c| !c.windows.is_empty());
        // Checked before anything is allocated: most requests only count.
        let needed = quota.is_some_and(RouteQuota::reserves)
            || member_calendars
            || client.is_some_and(Client::reserves);
        if !needed {
            return None;
        }
        // Per member, its windows' periods now (empty when they all slide).
        let member_periods: Vec<Vec<Option<Period>>> = route
            .members
            .iter()
            .map(|m| periods_of(&m.calendars, now))
            .collect();
        let member_units: Vec<Vec<Option<usize>>> = member_configs
            .iter()
            .map(|m| {
                let windows = m.quota.as_ref().map_or(&[][..], |q| &q.windows[..]);
                match quota {
                    Some(q) => q.units_of(windows),
                    None => vec![None; windows.len()],
                }
            })
            .collect();
        let member_windows = route
            .members
            .iter()
            .zip(&member_periods)
            .map(|(m, periods)| cut(&m.windows, periods))
            .collect();
        let (windows, periods) = quota.map_or((Vec::new(), Vec::new()), |q| q.periods(now));
        let (client_windows, client_periods, client_units) = match client {
            None => (Vec::new(), Vec::new(), Vec::new()),
            Some(c) => {
                let periods = periods_of(&c.calendars, now);
                let units = c
                    .units
                    .iter()
                    .map(|u| match (u, usage) {
                        (None, _) => ClientUnit::Requests,
                        (Some(name), Some(usage)) => usage
                            .units
                            .iter()
                            .position(|unit| unit.name == *name)
                            .map_or(ClientUnit::Unmetered, ClientUnit::Metered),
                        (Some(_), None) => ClientUnit::Unmetered,
                    })
                    .collect();
                (cut(&c.windows, &periods).to_vec(), periods, units)
            }
        };
        Some(Planned {
            amounts: quota.map_or(Vec::new(), |q| q.amounts(reserved, cost)),
            windows,
            periods,
            members: Arc::new(MemberPlan {
                amounts: member_units
                    .iter()
                    .map(|units| amounts_of(units, reserved, cost))
                    .collect(),
                periods: member_periods,
                windows: member_windows,
            }),
            member_units,
            client_amounts: client_amounts(&client_units, reserved, cost),
            client_windows,
            client_periods,
            client_units,
        })
    }

    /// The client's windows of requests counted the request already (a fallback after a
    /// member's answer, see `admit::admit_to`): they are charged 0 here.
    pub(crate) fn client_counted(&mut self) {
        for (amount, unit) in self.client_amounts.iter_mut().zip(&self.client_units) {
            if matches!(unit, ClientUnit::Requests) {
                *amount = 0;
            }
        }
    }

    /// As the policy hands it to the store.
    pub(crate) fn reserving(&self) -> Reserving<'_> {
        Reserving {
            amounts: &self.amounts,
            periods: &self.periods,
            members: &self.members,
            client: &self.client_amounts,
            client_periods: &self.client_periods,
        }
    }

    /// What a retry reserves in the next member's own windows, when a member has windows of
    /// its own: the request's planned amounts, as admission reserved in the first member's, so
    /// that a retry goes only to a member whose windows admit the reservation, and its entry
    /// settles from the answer like the first one's.
    pub(crate) fn for_retries(&self) -> Option<Arc<MemberPlan>> {
        let plan = &self.members;
        plan.windows
            .iter()
            .any(|w| !w.is_empty())
            .then(|| plan.clone())
    }
}

impl Planned {
    /// Whether a period this plan charges in (the route's, the client's, a member's) is over
    /// at `now_us` (wall clock, microseconds).
    pub(crate) fn ended(&self, now_us: u64) -> bool {
        let over =
            |periods: &[Option<Period>]| periods.iter().flatten().any(|p| p.end_us <= now_us);
        over(&self.periods)
            || over(&self.client_periods)
            || self.members.periods.iter().any(|m| over(m))
    }
}

/// Per window of `calendars`, its period at `now_us`; empty when every window slides.
fn periods_of(
    calendars: &[Option<sluice_limiter::calendar::Calendar>],
    now_us: u64,
) -> Vec<Option<Period>> {
    let periods: Vec<Option<Period>> = calendars
        .iter()
        .map(|c| {
            c.as_ref()
                .and_then(|c| c.bounds_at(now_us))
                .map(Period::from)
        })
        .collect();
    if periods.iter().all(Option::is_none) {
        Vec::new()
    } else {
        periods
    }
}

/// `windows`, each fixed window's length its period's span (`sluice_limiter::span`; `periods`
/// empty: as they are).
fn cut(windows: &Arc<[Window]>, periods: &[Option<Period>]) -> Arc<[Window]> {
    if periods.is_empty() {
        return windows.clone();
    }
    windows
        .iter()
        .zip(periods)
        .map(|(w, p)| match p {
            Some(p) => Window {
                length_us: sluice_limiter::span(p),
                ..w.clone()
            },
            None => w.clone(),
        })
        .collect()
}

/// Per window, its unit's amount, or `cost` for a window of requests.
fn amounts_of(units: &[Option<usize>], amounts: &[Millionths], cost: u64) -> Vec<u64> {
    units
        .iter()
        .map(|u| u.map_or(cost, |i| amounts.get(i).map_or(0, |m| m.0)))
        .collect()
}

/// Per window of a client's, its amount: its unit's, 0 for a unit the route does not meter,
/// or `cost` for a window of requests.
fn client_amounts(units: &[ClientUnit], amounts: &[Millionths], cost: u64) -> Vec<u64> {
    units
        .iter()
        .map(|u| match u {
            ClientUnit::Requests => cost,
            ClientUnit::Metered(i) => amounts.get(*i).map_or(0, |m| m.0),
            ClientUnit::Unmetered => 0,
        })
        .collect()
}

/// One member's entry of a request, as it settles.
struct MemberEntry {
    /// The member's index in the route's pool.
    index: usize,
    entry: sluice_limiter::EntryId,
    /// Per window of the member's own, what was reserved and what it settles to.
    reserved: Vec<u64>,
    settled: Vec<u64>,
}

/// An admitted request's reservation, kept on its context until its answer ends.
pub(crate) struct Meter {
    /// The quota key it was reserved under.
    pub(crate) key: Box<str>,
    /// What was reserved.
    pub(crate) planned: Planned,
    /// Per unit of the route, its reservation.
    pub(crate) reserved: Vec<Millionths>,
    /// The request's cost, which the member's and the client's own windows hold.
    pub(crate) cost: u64,
    /// The entries that settle it.
    pub(crate) entries: Entries,
    /// The scan of the member's answer, from its head on.
    pub(crate) scanner: Option<ResponseScanner>,
    /// The status of the member's answer that went to the client.
    pub(crate) status: Option<u16>,
    /// Whether the request's head went to a member: from then on the member may have done the
    /// work (and billed it) even when no answer comes back, so the reservation is no longer
    /// given back.
    pub(crate) sent: bool,
    /// The member (its index in the route's pool) the head went to last, whose answer settles
    /// its own windows: every other member the request went to did no work.
    pub(crate) sent_to: Option<usize>,
    /// The entries retries reserved in other members' own windows, with each member's id:
    /// settled like the first member's entry.
    pub(crate) retried: Vec<(Arc<str>, sluice_limiter::EntryId)>,
    /// The answer was cut before its end (the member failed or the client left after its
    /// head): what was read of it is no measure of the work, so the reservation stands.
    pub(crate) cut: bool,
}

impl Meter {
    /// The member's answer begins: its amounts are read from it as it passes.
    pub(crate) fn answer_began(
        &mut self,
        quota: &RouteQuota,
        status: u16,
        headers: &http::HeaderMap,
    ) {
        let Some(usage) = quota.usage.as_ref() else {
            return;
        };
        self.status = Some(status);
        // An answer that did no work settles to 0: no need to read it.
        self.scanner = (!usage.zero_on.contains(&status))
            .then(|| ResponseScanner::new(&usage.settles, usage.max_response_body, headers));
    }

    /// The request goes to `member` (again, after a replay or a fallback): an earlier
    /// member's answer no longer says what this request used.
    pub(crate) fn sending(&mut self, member: Option<usize>) {
        self.sent = true;
        self.sent_to = member;
        self.status = None;
        self.scanner = None;
    }

    /// The member's answer is dropped and the request replayed to another member: the
    /// member said it did no work (a cooldown status), so its windows settle to 0, and the
    /// request is as if no member got it until the replay goes out.
    pub(crate) fn replaying(&mut self) {
        self.sent = false;
        self.sent_to = None;
        self.status = None;
        self.scanner = None;
    }

    /// The member answered `status`, which says it did no work (a fallback leaves the route
    /// for it): the request settles to 0 here, whatever the route's `zero_on`.
    pub(crate) fn did_no_work(&mut self, status: u16) {
        self.status = Some(status);
        self.scanner = None;
    }

    /// A chunk of the answer's body, as it goes to the client.
    pub(crate) fn body(&mut self, chunk: &[u8]) {
        if let Some(s) = self.scanner.as_mut().filter(|s| s.wants_body()) {
            s.feed(chunk);
        }
    }

    /// Settles the reservation in one store call: each unit window's entry becomes what the
    /// answer used (0 when no member got the request, or answered with a status in `zero_on`),
    /// or keeps its reservation when the amount cannot be read or no answer came back. Windows
    /// of requests keep the request's cost.
    pub(crate) async fn settle(
        self,
        state: &dyn StateStore,
        metrics: &Metrics,
        route: &str,
        quota: Option<&RouteQuota>,
        client: Option<&crate::clients::Client>,
        members: &[crate::table::Member],
    ) {
        let usage = quota.and_then(|q| q.usage.as_ref());
        let settled: Vec<Millionths> = match (usage, self.status, self.scanner) {
            (None, _, _) => Vec::new(),
            // The request went to a member and no answer came back (the client left first,
            // or the member failed): it may have done the work, so the reservation stands.
            (Some(_), None, _) if self.sent => {
                metrics
                    .usage_unsettled
                    .with_label_values(&[route, "no_answer"])
                    .inc();
                self.reserved.clone()
            }
            // No member got the request, or its answer did no work.
            (Some(usage), None, _) | (Some(usage), Some(_), None) => {
                vec![Millionths(0); usage.units.len()]
            }
            // The answer began and was cut: a body read in part holds no amount, or one that
            // is not the last (a stream's running total), and a part's `default` would stand
            // for an answer that never came.
            (Some(_), Some(_), Some(_)) if self.cut => {
                metrics
                    .usage_unsettled
                    .with_label_values(&[route, "no_answer"])
                    .inc();
                self.reserved.clone()
            }
            (Some(_), Some(_), Some(scanner)) => scanner
                .finish()
                .into_iter()
                .zip(&self.reserved)
                .map(|(outcome, &reserved)| match outcome {
                    Ok(m) => Millionths(m.0.min(MAX_AMOUNT)),
                    Err(reason) => {
                        metrics
                            .usage_unsettled
                            .with_label_values(&[route, reason.as_str()])
                            .inc();
                        reserved
                    }
                })
                .collect(),
        };
        let route_settled = quota.map_or(Vec::new(), |q| amounts_of(&q.units, &settled, self.cost));
        let mut settlements = Vec::with_capacity(3);
        if let Some(entry) = self.entries.route {
            settlements.push(Settle {
                key: &self.key,
                windows: &self.planned.windows,
                entry,
                reserved: &self.planned.amounts,
                settled: &route_settled,
                periods: &self.planned.periods,
                owner: Owner::Route,
            });
        }
        // Each member the request reserved in (admission's, then each retry's) settles its own
        // windows like the route's, and the client's: a window of requests keeps the cost
        // (settling it closes the reservation), a unit's becomes what the answer used for the
        // member the request went to last, and 0 for any other: it never got the request, or
        // its answer was dropped for a replay.
        let plan = &self.planned.members;
        let no_work = settled.iter().map(|_| Millionths(0)).collect::<Vec<_>>();
        let no_units = Vec::new();
        let member_entries: Vec<MemberEntry> = self
            .entries
            .member
            .iter()
            .chain(&self.retried)
            .filter_map(|(id, entry)| {
                let i = members.iter().position(|m| m.name == *id)?;
                let units = self.planned.member_units.get(i).unwrap_or(&no_units);
                let used = if self.sent_to == Some(i) {
                    &settled
                } else {
                    &no_work
                };
                Some(MemberEntry {
                    index: i,
                    entry: *entry,
                    reserved: plan.amounts.get(i).cloned().unwrap_or_default(),
                    settled: amounts_of(units, used, self.cost),
                })
            })
            .collect();
        for e in &member_entries {
            let m = &members[e.index];
            settlements.push(Settle {
                key: &m.name,
                windows: plan.windows.get(e.index).unwrap_or(&m.windows),
                entry: e.entry,
                reserved: &e.reserved,
                settled: &e.settled,
                periods: plan.periods.get(e.index).map_or(&[][..], |p| &p[..]),
                owner: Owner::Member,
            });
        }
        // A window of requests keeps what it was charged: the cost, or 0 when the request was
        // counted on the route it fell back from.
        let client_settled: Vec<u64> = client_amounts(&self.planned.client_units, &settled, 0)
            .into_iter()
            .zip(&self.planned.client_units)
            .zip(&self.planned.client_amounts)
            .map(|((amount, unit), &charged)| match unit {
                ClientUnit::Requests => charged,
                _ => amount,
            })
            .collect();
        if let (Some(entry), Some(c)) = (self.entries.client, client) {
            settlements.push(Settle {
                key: &c.name,
                windows: &self.planned.client_windows,
                entry,
                reserved: &self.planned.client_amounts,
                settled: &client_settled,
                periods: &self.planned.client_periods,
                owner: Owner::Client,
            });
        }
        if settlements.is_empty() {
            return;
        }
        match state.settle(route, &settlements, None).await {
            Ok(done) => {
                let overrun = done.iter().flatten().any(|s| *s == Settled::Overrun);
                if overrun {
                    metrics.usage_overrun.with_label_values(&[route]).inc();
                }
            }
            Err(error) => {
                // The reservation stands, which is what a crash would leave.
                metrics.store_errors.with_label_values(&["settle"]).inc();
                tracing::warn!(target: "sluice::quota", route, %error, "a usage settlement failed; the reservation stands");
            }
        }
    }
}
