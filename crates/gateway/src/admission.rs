//! Admission: what a route's quota and selection policy decide before a request goes
//! upstream. Quota verdicts and their headers, least-used assignments (fused with the quota in
//! one store call), and what a store failure means for the request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use http::header;
use http::HeaderValue;
use pingora::prelude::*;
use pingora::proxy::Session;
use sluice_allocator::Assignment;
use sluice_balancer::Pick;
use sluice_limiter::{Acquire, Outcome, StoreError};

use crate::config::{OnStoreError, QuotaKey};
use crate::problem::{self, Problem};
use crate::proxy::{Failure, Gateway, RequestCtx};
use crate::table::{Route, RouteQuota};

/// What the quota says about one request.
pub(crate) enum Verdict {
    /// Go on; add this `RateLimit` header to the response (none when the store failed open).
    Admit(Option<HeaderValue>),
    /// Answer 429, with these `RateLimit` and `Retry-After` values.
    Refuse(Problem, HeaderValue, u64),
    /// Answer 503: the store failed and the route fails closed.
    Unavailable,
    /// Answer 503: no member is eligible (the quota recorded nothing).
    NoMember,
}

/// Store failures are logged at most once a second: during an outage every request fails the
/// same way, and the metric counts them all.
static LAST_STORE_WARNING: AtomicU64 = AtomicU64::new(0);

fn warn_store_error(route: &str, error: &StoreError, what: &str) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST_STORE_WARNING.swap(now, Ordering::Relaxed) != now {
        tracing::warn!(target: "sluice::store", route, %error, "state store failed; {what}");
    }
}

/// `"<window>";r=<remaining>;t=<seconds>` for the window with the least room.
fn ratelimit_header(quota: &RouteQuota, outcome: &Outcome) -> Option<HeaderValue> {
    let i = outcome.tightest()?;
    let w = &outcome.windows[i];
    let value = format!(
        "\"{}\";r={};t={}",
        quota.windows[i].name,
        w.remaining,
        w.reset_us.div_ceil(1_000_000)
    );
    HeaderValue::from_str(&value).ok()
}

/// The quota key of a request: `route`, a header's value, or the client address. Only the
/// client address needs a buffer of its own.
fn quota_key<'a>(session: &'a Session, quota: &RouteQuota, buf: &'a mut String) -> &'a str {
    match &quota.key {
        QuotaKey::Route => "route",
        QuotaKey::Header(name) => session
            .req_header()
            .headers
            .get(name.as_str())
            .and_then(|v| v.to_str().ok())
            .unwrap_or(""),
        QuotaKey::ClientIp => {
            if let Some(ip) = session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|a| a.ip())
            {
                *buf = ip.to_string();
            }
            buf
        }
    }
}

/// What a quota outcome means for the request.
fn verdict(quota: &RouteQuota, cost: u64, outcome: &Outcome) -> Verdict {
    if outcome.admitted {
        return Verdict::Admit(ratelimit_header(quota, outcome));
    }
    let mut refused_by = "";
    for (i, w) in outcome.windows.iter().enumerate() {
        if w.remaining < cost {
            quota.rejections[i].inc();
            if refused_by.is_empty() {
                refused_by = &quota.windows[i].name;
            }
        }
    }
    let retry_ms = outcome.retry_after_us.div_ceil(1000);
    let retry_after_s = outcome.retry_after_us.div_ceil(1_000_000).max(1);
    let header = ratelimit_header(quota, outcome).unwrap_or_else(|| HeaderValue::from_static(""));
    Verdict::Refuse(
        Problem::quota_exceeded(refused_by, retry_ms),
        header,
        retry_after_s,
    )
}

impl Gateway {
    /// The verdict of the route's store failing, by the quota's `on_store_error` (open when the
    /// route has no quota: only selection is at stake then, and it falls back).
    pub(crate) fn store_failed(&self, route: &Route, op: &str, e: &StoreError) -> Verdict {
        self.metrics.store_errors.with_label_values(&[op]).inc();
        warn_store_error(&route.name, e, "applying on_store_error");
        match route.quota.as_ref().map(|q| q.on_store_error) {
            Some(OnStoreError::Closed) => Verdict::Unavailable,
            _ => Verdict::Admit(None),
        }
    }

    pub(crate) async fn check_quota(
        &self,
        session: &Session,
        route: &Route,
        quota: &RouteQuota,
        path: &str,
    ) -> Verdict {
        let mut buf = String::new();
        let key = quota_key(session, quota, &mut buf);
        let cost = quota.cost(path, session.req_header().method.as_str());
        let asked = Acquire {
            route: &route.name,
            key,
            windows: &quota.windows,
            cost,
            at_us: None,
        };
        match self.quotas.acquire(asked).await {
            Ok(outcome) => verdict(quota, cost, &outcome),
            Err(e) => self.store_failed(route, "quota", &e),
        }
    }

    /// Writes the member list of this table to the least-used store, once per route and table.
    pub(crate) async fn ensure_synced(&self, route: &Route) {
        if route.synced.load(Ordering::Acquire) {
            return;
        }
        let down = route.down_ids();
        if self
            .allocator
            .sync(&route.name, &route.member_ids, &down)
            .await
            .is_ok()
        {
            route.synced.store(true, Ordering::Release);
        }
    }

    /// The first member of a least-used request, and its quota, in one store call. Returns the
    /// verdict; on admission `ctx.chosen` holds the member (or `ctx.fallback` is set).
    pub(crate) async fn first_assignment(
        &self,
        session: &Session,
        ctx: &mut RequestCtx,
        route: &Route,
        path: &str,
    ) -> Verdict {
        // A passive-only pool gives a due member its trial here, like round-robin does.
        if let Some(index) = route.pool.take_due_trial(Instant::now()) {
            ctx.chosen = Some(Pick { index, trial: true });
            return match &route.quota {
                Some(q) => self.check_quota(session, route, q, path).await,
                None => Verdict::Admit(None),
            };
        }
        self.ensure_synced(route).await;
        let down = route.down_ids();
        let mut buf = String::new();
        let asked = route.quota.as_ref().map(|q| {
            let key = quota_key(session, q, &mut buf);
            let cost = q.cost(path, session.req_header().method.as_str());
            (q, cost, key)
        });
        let acquire = asked.map(|(q, cost, key)| Acquire {
            route: &route.name,
            key,
            windows: &q.windows,
            cost,
            at_us: None,
        });
        match self
            .allocator
            .assign(&route.name, &route.member_ids, &down, acquire)
            .await
        {
            Ok(Assignment::Assigned { member, quota }) => {
                // A member this table does not know (another instance synced a newer list
                // a moment ago) is counted; this request takes round-robin instead.
                ctx.chosen = route.index_of.get(member.as_str()).map(|&index| Pick {
                    index,
                    trial: false,
                });
                Verdict::Admit(match (&route.quota, quota) {
                    (Some(q), Some(o)) => ratelimit_header(q, &o),
                    _ => None,
                })
            }
            Ok(Assignment::NoMember { quota }) => {
                ctx.failure = Some(Failure::NoMember);
                ctx.ratelimit = match (&route.quota, quota) {
                    (Some(q), Some(o)) => ratelimit_header(q, &o),
                    _ => None,
                };
                Verdict::NoMember
            }
            Ok(Assignment::QuotaRefused(outcome)) => {
                let (q, cost, _) = asked.expect("a refusal implies a quota");
                verdict(q, cost, &outcome)
            }
            Err(e) => {
                ctx.fallback = true;
                self.metrics
                    .selection_fallbacks
                    .with_label_values(&[&route.name])
                    .inc();
                self.store_failed(route, "select", &e)
            }
        }
    }

    /// A least-used retry: a new assignment, excluding the members this request tried.
    pub(crate) async fn next_assignment(
        &self,
        ctx: &mut RequestCtx,
        route: &Route,
    ) -> Option<Option<usize>> {
        let mut excluded = route.down_ids();
        for i in ctx.tried.iter() {
            excluded.push(&route.pool.members()[i].id);
        }
        match self
            .allocator
            .assign(&route.name, &route.member_ids, &excluded, None)
            .await
        {
            Ok(Assignment::Assigned { member, .. }) => {
                Some(route.index_of.get(member.as_str()).copied())
            }
            Ok(_) => Some(None),
            Err(e) => {
                self.metrics
                    .store_errors
                    .with_label_values(&["select"])
                    .inc();
                self.metrics
                    .selection_fallbacks
                    .with_label_values(&[&route.name])
                    .inc();
                warn_store_error(&route.name, &e, "falling back to round-robin");
                None
            }
        }
    }

    /// Answers a verdict that ends the request; returns whether it did.
    pub(crate) async fn answer_verdict(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        verdict: Verdict,
    ) -> Result<bool> {
        let route = ctx.route.clone().expect("set before any verdict");
        match verdict {
            Verdict::Admit(header) => {
                ctx.ratelimit = header;
                Ok(false)
            }
            Verdict::Refuse(problem, ratelimit, retry_after_s) => {
                let (mut head, body) = problem::render(&problem, Some(&route.name));
                head.insert_header(header::RETRY_AFTER, retry_after_s)?;
                if let Some(q) = &route.quota {
                    head.insert_header("ratelimit-policy", q.policy.clone())?;
                }
                head.insert_header("ratelimit", ratelimit)?;
                session.write_response_header(Box::new(head), false).await?;
                session.write_response_body(Some(body), true).await?;
                Ok(true)
            }
            Verdict::Unavailable => {
                self.answer(session, ctx, Problem::store_unavailable())
                    .await?;
                Ok(true)
            }
            Verdict::NoMember => {
                let (mut head, body) = problem::render(&Problem::no_member(), Some(&route.name));
                if let (Some(q), Some(r)) = (&route.quota, ctx.ratelimit.take()) {
                    head.insert_header("ratelimit-policy", q.policy.clone())?;
                    head.insert_header("ratelimit", r)?;
                }
                session.write_response_header(Box::new(head), false).await?;
                session.write_response_body(Some(body), true).await?;
                Ok(true)
            }
        }
    }
}
