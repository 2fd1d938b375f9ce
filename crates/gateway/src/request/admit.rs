//! Admission: the first step of every request. It finds the route, asks the route's policy to
//! decide the quota and the first member together, and answers itself when the request may not
//! go on (404, 405, 429, 503).

use std::os::fd::RawFd;

use http::{header, HeaderValue, Method};
use pingora::prelude::*;
use pingora::proxy::Session;
use pingora::ErrorType;
use sluice_allocator::StateStore;
use sluice_limiter::{Acquire, ClientWindows, Outcome, StoreError};

use super::meter::{Meter, Planned};
use super::store_warning::warn_store_error;
use super::{answer, Failure, Forward, Gateway, RequestCtx};
use crate::clients::Client;
use crate::config::OnStoreError;
use crate::metrics::Metrics;
use crate::problem::Problem;
use crate::quota::RouteQuota;
use crate::select::{Admission, Attempt, Entries};
use crate::table::Route;
use crate::wait;

/// A 431 for a request head larger than `limits.max_header_bytes`. Pingora reads heads of up
/// to 1 MiB (and answers 400 past that) before any hook runs, so this is the first place the
/// size can be checked.
fn oversized_head(gateway: &Gateway, session: &Session) -> Option<Problem> {
    let size = session.as_http1()?.get_headers_raw_bytes().len();
    let limit = gateway.max_header_bytes;
    (size > limit).then(|| Problem::header_too_large(size, limit))
}

/// Admits the request or answers it. Returns whether the request was answered here.
pub(crate) async fn admit(
    gateway: &Gateway,
    session: &mut Session,
    ctx: &mut RequestCtx,
) -> Result<bool> {
    if let Some(p) = oversized_head(gateway, session) {
        // What follows the head cannot be trusted to be framed as the client meant: close.
        session.set_keepalive(None);
        answer::problem(session, ctx, p).await?;
        return Ok(true);
    }
    let req = session.req_header();
    // What Pingora would refuse only as it builds the member's request, after admission has
    // charged the request and chosen a member (who would be counted as failing): refused here,
    // for nothing.
    if let Some(why) = crate::headers::connection_refusal(&req.headers) {
        answer::problem(session, ctx, Problem::bad_request_because(why)).await?;
        return Ok(true);
    }
    if req.method == Method::CONNECT {
        // A CONNECT that opens a connection never gets here: crate::tunnel takes it first.
        // One that follows other requests on a kept-alive connection cannot become a tunnel
        // once Pingora owns the connection, so it is refused; the client retries on a new
        // connection, as curl and every HTTPS_PROXY client do for a CONNECT.
        let p = Problem::method_not_allowed(
            "CONNECT opens a tunnel only as the first request of a connection",
        );
        let allow = HeaderValue::from_static(super::route::EVERY_METHOD_BUT_CONNECT);
        answer::problem_with_allow(session, ctx, p, allow).await?;
        return Ok(true);
    }

    // What the request addresses, read once, and its route: the step tunnels take too. The
    // request keeps its route to its end, not the table: the table's guard is let go at once,
    // since what follows may wait (for capacity, for the client), and a guard held that long
    // would keep a replaced table alive.
    let head = super::route::Head {
        method: &req.method,
        version: req.version,
        raw_target: req.raw_path(),
        host: req
            .headers
            .get(header::HOST)
            .map(|h| h.as_bytes())
            .or_else(|| req.uri.authority().map(|a| a.as_str().as_bytes())),
        headers: &req.headers,
    };
    let table = gateway.table.load();
    let routed = super::route::route(&table, &head);
    let (target, route) = match routed {
        Ok(routed) => routed,
        Err(refused) => {
            drop(table);
            if let Some(target) = &refused.target {
                ctx.target = Forward::of(target);
            }
            ctx.route = refused.route;
            match refused.allow {
                Some(allow) => {
                    answer::problem_with_allow(session, ctx, refused.problem, allow).await?
                }
                None => answer::problem(session, ctx, refused.problem).await?,
            }
            return Ok(true);
        }
    };
    ctx.target = Forward::of(&target);
    if route.members.iter().any(|m| m.kind.reaches_target()) {
        ctx.target.dest = Some(super::Dest::of(&target));
    }
    // Who is calling, and whether it may: on the table that routed the request. Without a
    // `clients` section nothing of the caller is read, so the request costs what it did.
    let authorized = match table.clients.as_ref() {
        None => Ok(()),
        Some(clients) => {
            let caller = super::authorize::Caller {
                cert_names: crate::listen_tls::peer_names(session),
                headers: &req.headers,
                addr: session
                    .client_addr()
                    .and_then(|a| a.as_inet())
                    .map(|a| a.ip()),
            };
            let clients = Some(clients);
            super::authorize::authorize(clients, &gateway.metrics, &route, &target, &caller, ctx)
        }
    };
    drop(table);
    if let Err(problem) = authorized {
        ctx.route = Some(route);
        answer::problem(session, ctx, problem).await?;
        return Ok(true);
    }
    let cost = route
        .quota
        .as_deref()
        .map_or(1, |q| q.cost(&target.path, req.method.as_str()));
    ctx.route = Some(route.clone());
    // A reservation that reads the body reads it now, before admission, which charges it to
    // the route's usage windows.
    if let Some(usage) = route.quota.as_deref().and_then(|q| q.usage.as_ref()) {
        let prefix = if usage.reads_body {
            crate::usage::read_prefix(session.as_downstream_mut(), usage.max_request_body).await?
        } else {
            crate::usage::Prefix::unread(&session.req_header().headers)
        };
        ctx.reserved = usage.reserve(&prefix.request(&session.req_header().headers));
    }

    // Quota and first member, decided together. This is the only place a request is charged:
    // retries happen after this hook and never come back to it.
    let reserved = std::mem::take(&mut ctx.reserved);
    match admit_to(gateway, session, ctx, &route, cost, reserved, false).await {
        Admitted::Go => Ok(false),
        Admitted::Refused {
            problem,
            ratelimit,
            no_member,
        } => {
            // A route that cannot serve the request may name another that can: the refusal
            // is left to its `fallback`, which `request_filter` follows next.
            if !route.config.fallback.is_empty() {
                ctx.refusal = Some(Box::new(super::Refusal {
                    problem,
                    ratelimit,
                    no_member,
                }));
                return Ok(false);
            }
            ctx.ratelimit = ratelimit;
            if no_member {
                ctx.failure = Some(Failure::NoMember);
            }
            answer::problem(session, ctx, problem).await?;
            Ok(true)
        }
        Admitted::Left => Err(Error::explain(
            ErrorType::ConnectionClosed,
            "the client hung up while waiting for capacity",
        )
        .into_down()),
    }
}

/// What admitting a request on a route decided.
pub(crate) enum Admitted {
    /// Admitted: `ctx` holds the route's first member and the request's reservation.
    Go,
    /// Refused, with the answer the route gives.
    Refused {
        problem: Problem,
        ratelimit: Option<HeaderValue>,
        no_member: bool,
    },
    /// The client hung up while it waited for capacity, or before its body was whole.
    Left,
}

/// Quota and first member of a request on `route`, decided together in one step of its policy
/// (its sticky session and its client's cap carried), charging `cost` and the units `reserved`;
/// when admitted, `ctx` takes the first member and the meter that settles the reservation. The
/// one admission a request has, on its own route or on a route it falls back to.
///
/// `client_counted`: the client's own windows of requests counted this request already, at its
/// admission on a route it left after a member's answer (a fallback): one request is counted
/// once. Its windows in usage units reserve again, since the route left settled them to 0.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn admit_to(
    gateway: &Gateway,
    session: &Session,
    ctx: &mut RequestCtx,
    route: &std::sync::Arc<Route>,
    cost: u64,
    reserved: Vec<sluice_usage::Millionths>,
    client_counted: bool,
) -> Admitted {
    let mut key_buf = String::new();
    // The client identified, held apart from `ctx`, which admission changes.
    let caller = ctx.client.clone();
    let key = route.quota.as_deref().map_or("", |q| {
        let forwarded = ctx.seen.forwarded_client;
        q.key_of(
            session,
            forwarded,
            caller.as_deref().map(|c| &*c.name),
            &mut key_buf,
        )
    });
    let client = session.as_downstream().stream().map(|s| s.id());
    let mut planned = Planned::plan(route, caller.as_deref(), &reserved, cost);
    if let Some(plan) = planned.as_mut().filter(|_| client_counted) {
        plan.client_counted();
    }
    // A sticky route's session: admission and every retry of the request carry it.
    ctx.sticky = sticky_of(gateway, session, ctx, route);
    let verdict = decide(
        crate::sticky::store(&gateway.state, ctx.sticky.as_ref()),
        &gateway.metrics,
        route,
        key,
        caller.as_deref(),
        cost,
        client,
        &mut planned,
        &reserved,
        client_counted,
    )
    .await;
    match verdict {
        Verdict::Go {
            first,
            ratelimit,
            fallback,
            entries,
        } => {
            ctx.admitted(first, ratelimit, fallback, cost);
            ctx.tried.members = planned.as_ref().and_then(Planned::for_retries);
            ctx.meter = planned.map(|planned| {
                Box::new(Meter {
                    key: key.into(),
                    planned,
                    reserved,
                    cost,
                    entries,
                    scanner: None,
                    status: None,
                    sent: false,
                    sent_to: None,
                    retried: Vec::new(),
                    cut: false,
                })
            });
            Admitted::Go
        }
        Verdict::Answer {
            problem,
            ratelimit,
            no_member,
        } => Admitted::Refused {
            problem,
            ratelimit,
            no_member,
        },
        Verdict::Left => Admitted::Left,
    }
}

/// The store of a request on `route`: with its session, when the route is sticky and the
/// request names one, and its client's `max_in_flight`.
pub(crate) fn sticky_of(
    gateway: &Gateway,
    session: &Session,
    ctx: &RequestCtx,
    route: &Route,
) -> Option<std::sync::Arc<crate::sticky::Sticky>> {
    let cap = ctx
        .client
        .as_deref()
        .and_then(|c| Some((&*c.name, c.config.max_in_flight?.get())));
    if route.config.upstream.sticky.is_none() && cap.is_none() {
        return None;
    }
    // `anonymous` is everyone unidentified: each of them is a session of its own address.
    let name = ctx
        .client
        .as_deref()
        .map(|c| &*c.name)
        .filter(|&n| n != crate::config::ANONYMOUS);
    let addr = ctx.seen.forwarded_client.or_else(|| {
        session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip())
    });
    let caller = crate::sticky::Caller { name, addr, cap };
    let headers = &session.req_header().headers;
    crate::sticky::Sticky::of(&gateway.state, route, headers, &caller)
}

/// What admission decided about a request, apart from how the answer is sent: shared by
/// requests and CONNECT tunnels, so both are charged and assigned the same way.
pub(crate) enum Verdict {
    /// The request goes on, to `first` when the policy picked it here.
    Go {
        first: Option<Attempt>,
        /// The `RateLimit` header value for the answer.
        ratelimit: Option<HeaderValue>,
        /// least_used fell back to round-robin for this request.
        fallback: bool,
        /// What settles the request, when its route reserves.
        entries: Entries,
    },
    /// The gateway answers itself: 429, 503.
    Answer {
        problem: Problem,
        ratelimit: Option<HeaderValue>,
        /// The answer is `no_member` (for the access log).
        no_member: bool,
    },
    /// The client hung up while it waited for capacity: nothing was charged, and there is
    /// nobody to answer.
    Left,
}

/// Charges `cost` to the route's quota under `key`, and to the own windows of `caller` (the
/// client identified, if any), and picks the first member, in one step of the route's policy;
/// on a route with `max_wait`, waits for capacity rather than refusing (see [`crate::wait`]).
///
/// `client` is the socket of the client: one that hangs up while it waits leaves the line at
/// once, uncharged ([`Verdict::Left`]). `planned` is what the request reserves on a route
/// whose windows count usage units or calendar periods (`reserved`, its units' amounts): cut
/// again in the periods that hold now before a call to the store, if a period it was cut in
/// has ended ([`fresh`]).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn decide(
    state: &dyn StateStore,
    metrics: &Metrics,
    route: &Route,
    key: &str,
    caller: Option<&Client>,
    cost: u64,
    client: Option<RawFd>,
    planned: &mut Option<Planned>,
    reserved: &[sluice_usage::Millionths],
    client_counted: bool,
) -> Verdict {
    let admit = async |planned: &mut Option<Planned>| {
        fresh(planned, route, caller, reserved, cost, client_counted);
        admit_once(
            state,
            route,
            key,
            caller,
            cost,
            planned.as_ref(),
            client_counted,
        )
        .await
    };
    let Some(line) = route.wait_line.as_deref() else {
        let admission = admit(planned).await;
        return verdict(metrics, route, key, caller, cost, admission);
    };
    let deadline = tokio::time::Instant::now() + line.max_wait;
    // Newcomers go straight to the store only while nobody waits: arrival order.
    let mut refusal = None;
    if line.is_empty() {
        let admission = admit(planned).await;
        if retry_after(&admission).is_none() {
            return verdict(metrics, route, key, caller, cost, admission);
        }
        refusal = Some(admission);
    }
    // Served in turn across clients: the identified client's name, or else the quota key.
    let fair_key = caller.map_or(key, |c| &*c.name);
    let Some(mut place) = line.join(fair_key) else {
        // The line is full: answered at once. Not by asking the store: capacity that frees
        // now is owed to the requests already waiting, and the newcomer would take it.
        return match refusal {
            Some(r) => verdict(metrics, route, key, caller, cost, r),
            None => line_full(metrics, route, line),
        };
    };
    // The first refusal already says whether waiting could help, and until when.
    let mut first_wake = None;
    if let Some(r) = refusal {
        let wait = retry_after(&r).unwrap_or_default();
        match wait::wake_at(tokio::time::Instant::now(), wait, deadline) {
            Some(wake) => first_wake = Some(wake),
            None => return verdict(metrics, route, key, caller, cost, r),
        }
    }
    // Only the waits race the client's hang-up, never a call to the store: a call cut short
    // could still charge, for nobody.
    let gone = wait::hung_up(client);
    tokio::pin!(gone);
    let turn = tokio::select! {
        biased;
        () = &mut gone => return Verdict::Left,
        turn = place.turn(deadline) => turn,
    };
    match turn {
        wait::Turn::Held => {}
        // Room made for a client with fewer waiters: answered as a full line would have.
        wait::Turn::PushedOut => return line_full(metrics, route, line),
        wait::Turn::TimedOut => {
            // max_wait passed in the line: one last look, which may still admit.
            let admission = admit(planned).await;
            return verdict(metrics, route, key, caller, cost, admission);
        }
    }
    let mut wake = first_wake;
    loop {
        if let Some(wake) = wake {
            line.asks_at(wake);
            tokio::select! {
                biased;
                () = &mut gone => return Verdict::Left,
                () = tokio::time::sleep_until(wake) => {}
            }
        }
        let admission = admit(planned).await;
        let Some(wait) = retry_after(&admission) else {
            return verdict(metrics, route, key, caller, cost, admission);
        };
        match wait::wake_at(tokio::time::Instant::now(), wait, deadline) {
            Some(at) => wake = Some(at),
            None => return verdict(metrics, route, key, caller, cost, admission),
        }
    }
}

/// A plan cut in a period that has ended, cut again in the periods that hold now. A request
/// that waited for capacity is woken at a boundary (its refusal said the period ends then), and
/// a gateway's wall clock may lag the store's: charged in a period already over, its entries
/// would leave the store's windows at once, admitted and counted nowhere.
fn fresh(
    planned: &mut Option<Planned>,
    route: &Route,
    caller: Option<&Client>,
    reserved: &[sluice_usage::Millionths],
    cost: u64,
    client_counted: bool,
) {
    // Most routes plan nothing: no clock read for them.
    let Some(plan) = planned.as_ref() else {
        return;
    };
    let now = super::meter::now_us();
    if plan.ended(now) {
        *planned = Planned::plan_at(route, caller, reserved, cost, now);
        if let Some(plan) = planned.as_mut().filter(|_| client_counted) {
            plan.client_counted();
        }
    }
}

/// The 429 of a request that finds the line full, counted under `window="max_waiting"`. It
/// comes back when the head of the line asks again, the first moment the line may move.
fn line_full(metrics: &Metrics, route: &Route, line: &wait::WaitLine) -> Verdict {
    metrics
        .quota_rejections
        .with_label_values(&[&route.name, "max_waiting"])
        .inc();
    let ms = u64::try_from(line.until_next_ask(tokio::time::Instant::now()).as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    Verdict::Answer {
        problem: Problem {
            detail: format!(
                "{} requests already wait for this route's capacity (quota.max_waiting)",
                line.max_waiting
            ),
            ..Problem::quota_exceeded("", ms)
        },
        ratelimit: None,
        no_member: false,
    }
}

/// The time until capacity, for the refusals that waiting can cure: the route's quota, and
/// members that are all at their own limits or cooling down.
fn retry_after(admission: &Admission) -> Option<std::time::Duration> {
    match admission {
        Admission::QuotaRefused(outcome) => {
            Some(std::time::Duration::from_micros(outcome.retry_after_us))
        }
        Admission::Busy { retry_after_us, .. } => {
            Some(std::time::Duration::from_micros(*retry_after_us))
        }
        // No store call says when a lease is released anywhere: the head of the line asks again
        // at this bounded interval.
        Admission::Concurrency { .. } => Some(CONCURRENCY_POLL),
        _ => None,
    }
}

/// How often a request waiting at a `max_in_flight` cap asks the store again: the most a
/// release elsewhere waits to be seen, besides one store round trip.
pub(crate) const CONCURRENCY_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// One decision of the route's policy.
async fn admit_once(
    state: &dyn StateStore,
    route: &Route,
    key: &str,
    caller: Option<&Client>,
    cost: u64,
    planned: Option<&Planned>,
    client_counted: bool,
) -> Admission {
    // A quota with no windows only sets max_wait (for member quotas): nothing to charge.
    // Reserved windows are the planned ones, a calendar window's length its period's.
    let windows = match planned {
        Some(p) => &p.windows[..],
        None => route.quota.as_deref().map_or(&[][..], |q| &q.windows[..]),
    };
    // The client's own windows are charged in the same step, on every policy: they travel
    // with the route's quota, which the policy hands the store as it is.
    // Counted already (see `admit_to`): a plan charges its windows of requests 0, and without
    // a plan every window of the client's counts requests.
    let client = caller
        .filter(|c| !c.windows.is_empty())
        .filter(|_| !(client_counted && planned.is_none()))
        .map(|c| ClientWindows {
            name: &c.name,
            // Planned for this caller: a calendar window's length is its period's.
            windows: planned.map_or(&c.windows[..], |p| &p.client_windows[..]),
        });
    let acquire = (!windows.is_empty() || client.is_some()).then_some(Acquire {
        route: &route.name,
        key,
        windows,
        cost,
        at_us: None,
        client,
    });
    let reserving = planned.map(Planned::reserving);
    route.policy.admit(state, acquire, cost, reserving).await
}

/// The 429 of a request its quota refused: naming the route's window that refused it, or else
/// the client's (whose states follow the route's in `outcome`).
fn quota_refusal(
    quota: Option<&RouteQuota>,
    caller: Option<&Client>,
    cost: u64,
    outcome: &Outcome,
) -> Problem {
    let route_windows = quota.map_or(0, |q| q.windows.len());
    let full = |states: &[sluice_limiter::WindowState]| states.iter().any(|w| w.remaining < cost);
    if let Some(q) = quota.filter(|_| full(outcome.windows.get(..route_windows).unwrap_or(&[]))) {
        return answer::quota_refusal(q, cost, outcome);
    }
    let client_full = caller.and_then(|c| {
        let states = outcome.windows.get(route_windows..).unwrap_or(&[]);
        let windows = c.windows.iter().zip(states);
        // A window in a usage unit holds millionths, which no request cost compares with: the
        // route's windows had room, so the client's with the least left refused.
        windows
            .clone()
            .find(|(_, s)| s.remaining < cost)
            .or_else(|| windows.min_by_key(|(_, s)| s.remaining))
            .map(|(w, _)| (c, w))
    });
    match (client_full, quota) {
        (Some((c, w)), _) => Problem {
            detail: format!(
                "the quota window {:?} of client {:?} has no room for this request's cost",
                w.name, c.name
            ),
            ..Problem::quota_exceeded(&w.name, outcome.retry_after_us.div_ceil(1000))
        },
        (None, Some(q)) => answer::quota_refusal(q, cost, outcome),
        (None, None) => Problem::internal(),
    }
}

/// What an admission means for the request.
fn verdict(
    metrics: &Metrics,
    route: &Route,
    key: &str,
    caller: Option<&Client>,
    cost: u64,
    admission: Admission,
) -> Verdict {
    let quota = route.quota.as_deref();
    let ratelimit_of = |outcome: Option<&sluice_limiter::Outcome>| {
        quota
            .zip(outcome)
            .and_then(|(q, o)| answer::ratelimit(q, o, key))
    };
    match admission {
        Admission::Admitted {
            first,
            quota: outcome,
            entries,
        } => Verdict::Go {
            first,
            ratelimit: ratelimit_of(outcome.as_ref()),
            fallback: false,
            entries,
        },
        Admission::QuotaRefused(outcome) => {
            // Only a route with a quota, or a client with windows, is ever refused.
            let problem = quota_refusal(quota, caller, cost, &outcome);
            Verdict::Answer {
                problem,
                ratelimit: ratelimit_of(Some(&outcome)),
                no_member: false,
            }
        }
        Admission::Busy {
            retry_after_us,
            quota: outcome,
        } => {
            route.members_busy.inc();
            Verdict::Answer {
                problem: Problem::members_busy(retry_after_us.div_ceil(1000)),
                ratelimit: ratelimit_of(outcome.as_ref()),
                no_member: false,
            }
        }
        Admission::Concurrency {
            quota: outcome,
            client,
        } => {
            metrics
                .quota_rejections
                .with_label_values(&[&route.name, "max_in_flight"])
                .inc();
            let ms = u64::try_from(CONCURRENCY_POLL.as_millis()).unwrap_or(1);
            let mut problem = Problem::concurrency_exceeded(ms);
            // Only a client with a cap is refused for its own.
            if let Some(c) = caller.filter(|_| client) {
                let cap = c.config.max_in_flight.map_or(0, |n| n.get());
                problem.detail = format!(
                    "client {:?} has its max_in_flight of {cap} requests in flight",
                    &*c.name
                );
            }
            Verdict::Answer {
                problem,
                ratelimit: ratelimit_of(outcome.as_ref()),
                no_member: false,
            }
        }
        Admission::NoMember { quota: outcome } => Verdict::Answer {
            problem: Problem::no_member(),
            ratelimit: ratelimit_of(outcome.as_ref()),
            no_member: true,
        },
        // A full store (the memory store's key table, Redis at its maxmemory) is no outage, so
        // on_store_error does not apply: admitting the request would leave it unmetered, which
        // lifts the quota for whoever sprays keys. A request no window counts (a route without
        // quota windows, client windows or member windows, on a full Redis) has nothing to
        // leave unmetered: it goes on as on any store failure, its member chosen in process
        // (`select::counts_in_windows`).
        Admission::StoreFailed {
            error: StoreError::TooManyKeys,
            ..
        } if quota.is_some_and(|q| !q.windows.is_empty())
            || caller.is_some_and(|c| !c.windows.is_empty())
            || route.members.iter().any(|m| !m.windows.is_empty()) =>
        {
            metrics
                .quota_keys_refused
                .with_label_values(&[&route.name])
                .inc();
            if let Some(q) = quota {
                q.warn_keys_exhausted(&route.name);
            }
            Verdict::Answer {
                problem: Problem::quota_keys_exhausted(),
                ratelimit: None,
                no_member: false,
            }
        }
        Admission::StoreFailed {
            error,
            first,
            fallback,
        } => {
            let op = if fallback { "select" } else { "quota" };
            metrics.store_errors.with_label_values(&[op]).inc();
            if fallback {
                route.selection_fallbacks.inc();
            }
            // Open when the route has no quota: only selection is at stake then, and it fell
            // back.
            match quota.map(|q| q.on_store_error) {
                Some(OnStoreError::Closed) => {
                    warn_store_error(&route.name, &error, "the route fails closed");
                    Verdict::Answer {
                        problem: Problem::store_unavailable(),
                        ratelimit: None,
                        no_member: false,
                    }
                }
                _ => {
                    warn_store_error(
                        &route.name,
                        &error,
                        "admitting the request (on_store_error: open)",
                    );
                    Verdict::Go {
                        first,
                        ratelimit: None,
                        fallback,
                        entries: Entries::default(),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::Config;
    use crate::table::Table;

    /// A plan cut in a period that has ended (a request woken at the boundary it waited for,
    /// or a gateway whose clock lags) is cut again before the store is asked: the request is
    /// charged in the day that holds now, not in the day before, where its entry would leave
    /// the window as it is written, admitted and counted nowhere.
    #[tokio::test]
    async fn a_plan_whose_period_ended_is_charged_in_the_current_one() {
        let text = "listen: [\"127.0.0.1:1\"]\n\
                    admin: { listen: \"127.0.0.1:2\" }\n\
                    routes:\n\
                    \x20 - name: r\n\
                    \x20   match: { hosts: [r.test] }\n\
                    \x20   upstream: { members: [{ url: \"http://127.0.0.1:9\" }] }\n\
                    \x20   quota: { windows: [{ name: day, limit: 10, window: calendar_day }] }\n";
        let config = Config::parse("t.yaml", text).unwrap_or_else(|e| panic!("{e}"));
        let metrics = Arc::new(Metrics::new());
        let state = crate::state::open(&config).unwrap();
        let resolver = crate::dns::process_resolver(&config.dns).unwrap();
        let table = Table::build(&config, text.as_bytes(), &metrics, &state, &resolver, None).await;
        let route = table.routes[0].clone();
        let now = super::super::meter::now_us();
        let mut planned = Planned::plan_at(&route, None, &[], 1, now - 86_400_000_000);
        assert!(planned.as_ref().is_some_and(|p| p.ended(now)));

        let verdict = decide(
            &*state,
            &metrics,
            &route,
            "k",
            None,
            1,
            None,
            &mut planned,
            &[],
            false,
        )
        .await;
        assert!(matches!(verdict, Verdict::Go { .. }));
        let quota = route.quota.as_deref().unwrap();
        let (windows, _) = quota.periods(super::super::meter::now_us());
        let read = state
            .acquire(Acquire {
                route: &route.name,
                key: "k",
                windows: &windows,
                cost: 0,
                at_us: None,
                client: None,
            })
            .await
            .unwrap();
        assert_eq!(read.windows[0].remaining, 9, "charged in today's window");
    }
}
