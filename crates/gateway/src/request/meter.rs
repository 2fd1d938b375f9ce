//! A request on a usage-metered route, from its reservation to its settlement: what admission
//! charges each window, the entries it recorded, the scan of the answer as it passes, and the
//! one store call that rewrites the entries when the answer ends.

use sluice_allocator::StateStore;
use sluice_limiter::{Owner, Period, Settle, Settled, Window, MAX_AMOUNT};
use sluice_usage::{Millionths, ResponseScanner};

use crate::metrics::Metrics;
use crate::quota::RouteQuota;
use crate::select::{Entries, Reserving};

/// What a request reserves in its route's windows, decided before admission.
pub(crate) struct Planned {
    /// The route's windows, a calendar window's length its current period's.
    pub(crate) windows: Vec<Window>,
    /// Per window, its period; empty when every window slides.
    pub(crate) periods: Vec<Option<Period>>,
    /// Per window, its amount: millionths of its unit, or the request's cost.
    pub(crate) amounts: Vec<u64>,
    /// Per member of the route (in pool order), per window of its own, its amount.
    pub(crate) members: Vec<Vec<u64>>,
    /// Per member, per window of its own, the index of its unit (`None`: requests).
    member_units: Vec<Vec<Option<usize>>>,
}

impl Planned {
    /// The reservation of a request whose units reserve `reserved` and whose cost is `cost`,
    /// in the periods that hold now.
    pub(crate) fn new(
        route: &crate::table::Route,
        quota: &RouteQuota,
        reserved: &[Millionths],
        cost: u64,
    ) -> Planned {
        let member_units: Vec<Vec<Option<usize>>> = route
            .config
            .upstream
            .members
            .iter()
            .map(|m| quota.units_of(m.quota.as_ref().map_or(&[][..], |q| &q.windows[..])))
            .collect();
        let members = member_units
            .iter()
            .map(|units| amounts_of(units, reserved, cost))
            .collect();
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        let (windows, periods) = quota.periods(now_us);
        Planned {
            windows,
            periods,
            amounts: quota.amounts(reserved, cost),
            members,
            member_units,
        }
    }

    /// As the policy hands it to the store.
    pub(crate) fn reserving(&self) -> Reserving<'_> {
        Reserving {
            amounts: &self.amounts,
            periods: &self.periods,
            members: &self.members,
        }
    }
}

/// Per window, its unit's amount, or `cost` for a window of requests.
fn amounts_of(units: &[Option<usize>], amounts: &[Millionths], cost: u64) -> Vec<u64> {
    units
        .iter()
        .map(|u| u.map_or(cost, |i| amounts.get(i).map_or(0, |m| m.0)))
        .collect()
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

    /// A chunk of the answer's body, as it goes to the client.
    pub(crate) fn body(&mut self, chunk: &[u8]) {
        if let Some(s) = self.scanner.as_mut().filter(|s| s.wants_body()) {
            s.feed(chunk);
        }
    }

    /// Settles the reservation in one store call: each unit window's entry becomes what the
    /// answer used (0 when no member answered, or answered with a status in `zero_on`), or
    /// keeps its reservation when the amount cannot be read. Windows of requests keep the
    /// request's cost.
    pub(crate) async fn settle(
        self,
        state: &dyn StateStore,
        metrics: &Metrics,
        route: &str,
        quota: &RouteQuota,
        client: Option<&crate::clients::Client>,
        members: &[crate::table::Member],
    ) {
        let Some(usage) = quota.usage.as_ref() else {
            return;
        };
        let settled: Vec<Millionths> = match (self.status, self.scanner) {
            // No member answered, or its answer did no work.
            (None, _) | (Some(_), None) => vec![Millionths(0); usage.units.len()],
            (Some(_), Some(scanner)) => scanner
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
        let route_settled = amounts_of(&quota.units, &settled, self.cost);
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
        // The chosen member's own windows settle like the route's; the client's count
        // requests: its entry keeps the cost, and settling it closes the reservation.
        let member = self.entries.member.as_ref().and_then(|(id, entry)| {
            let i = members.iter().position(|m| m.name == *id)?;
            Some((&members[i], i, *entry))
        });
        let no_units = Vec::new();
        let (member_reserved, member_settled) = match member {
            Some((_, i, _)) => (
                self.planned.members.get(i).cloned().unwrap_or_default(),
                amounts_of(
                    self.planned.member_units.get(i).unwrap_or(&no_units),
                    &settled,
                    self.cost,
                ),
            ),
            None => (Vec::new(), Vec::new()),
        };
        if let Some((m, _, entry)) = member {
            settlements.push(Settle {
                key: &m.name,
                windows: &m.windows,
                entry,
                reserved: &member_reserved,
                settled: &member_settled,
                periods: &[],
                owner: Owner::Member,
            });
        }
        let client_costs = client.map_or(Vec::new(), |c| vec![self.cost; c.windows.len()]);
        if let (Some(entry), Some(c)) = (self.entries.client, client) {
            settlements.push(Settle {
                key: &c.name,
                windows: &c.windows,
                entry,
                reserved: &client_costs,
                settled: &client_costs,
                periods: &[],
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
