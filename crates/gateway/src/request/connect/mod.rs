//! A CONNECT tunnel on the request path: the same steps as every request, on the same
//! [`RequestCtx`]: [`route`](super::route) (the target's host and port, the route's methods,
//! whether the route can carry a tunnel at all, `connect_ports`), [`decide`] (quota and first
//! member, charged once per tunnel), [`next_member`] (the attempts, within `retries`), the
//! gateway's [`answer`](super::answer) when it refuses, and [`account`](super::account) when
//! the tunnel ends. What is a tunnel's own is its transport, in [`crate::tunnel`]: reading the
//! CONNECT head, opening the member side, and moving the bytes.
//!
//! Why tunnels do not go through Pingora's hooks: Pingora cannot hand a hook the raw
//! downstream connection, nor open an upstream CONNECT through a forward proxy, so the
//! connection layer ([`crate::limits`]) gives a connection that opens with a CONNECT to
//! [`Tunnels::serve`] instead.

use std::net::SocketAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::HeaderValue;
use pingora::protocols::Stream;
use sluice_allocator::StateStore;

use super::account::{self, Ended};
use super::admit::{decide, Verdict};
use super::attempt::next_member;
use super::route::{self, Refused};
use super::{Failure, RequestCtx};
use crate::config::MemberKind;
use crate::egress::Resolver;
use crate::metrics::Metrics;
use crate::problem::Problem;
use crate::table::Table;
use crate::tunnel::{self, head, open};

/// What tunnels share with the request path: the table, metrics, the in-flight count, the
/// state store and the resolver.
pub struct Tunnels {
    table: Arc<ArcSwap<Table>>,
    metrics: Arc<Metrics>,
    in_flight: Arc<AtomicUsize>,
    state: Arc<dyn StateStore>,
    /// Resolves `direct` targets for the egress guard.
    resolver: Resolver,
    /// The connection cap's slots a spliced tunnel takes for its extra descriptors; None (no
    /// cap to share, as in unit tests) splices without.
    extra_slots: Option<crate::extra_slots::ExtraSlots>,
}

/// How a tunnel ended, beyond what its [`RequestCtx`] holds.
#[derive(Default)]
struct End {
    status: u16,
    /// Why it ended, when not by a gateway answer (which the context holds): the client gone,
    /// or how the byte pump stopped.
    error: Option<&'static str>,
    detail: Option<String>,
    /// Bytes up and down, once the tunnel was open.
    bytes: Option<(u64, u64)>,
}

impl Tunnels {
    /// Tunnels over the same table, metrics, in-flight count and store as the proxy.
    pub fn new(
        table: Arc<ArcSwap<Table>>,
        metrics: Arc<Metrics>,
        in_flight: Arc<AtomicUsize>,
        state: Arc<dyn StateStore>,
        resolver: Resolver,
    ) -> Tunnels {
        Tunnels {
            table,
            metrics,
            in_flight,
            state,
            resolver,
            extra_slots: None,
        }
    }

    /// Takes the slots for a spliced tunnel's extra descriptors from `slots`.
    pub(crate) fn with_extra_slots(mut self, slots: crate::extra_slots::ExtraSlots) -> Tunnels {
        self.extra_slots = Some(slots);
        self
    }

    /// Serves one connection that opens with a CONNECT, to its end. `first` holds what was
    /// already read of it; the rest of its head must come within `header_timeout`. Returns
    /// whether it was closed for that.
    pub(crate) async fn serve(
        &self,
        mut client: Stream,
        first: Vec<u8>,
        header_timeout: Duration,
    ) -> bool {
        let mut ctx = RequestCtx::new(&self.in_flight);
        let client_addr = client
            .get_socket_digest()
            .and_then(|d| d.peer_addr().and_then(|a| a.as_inet()).copied());
        let mut end = End::default();
        let mut late = false;
        let authority = match head::read(&mut client, first, header_timeout).await {
            Ok(head) => {
                ctx.seen.request_id = Some(crate::trace::request_id(
                    head.headers.get(crate::headers::X_REQUEST_ID.name()),
                ));
                self.tunnel(&mut client, &head, client_addr, &mut ctx, &mut end)
                    .await;
                head.authority
            }
            Err(head::Unread::Bad(problem)) => {
                let id = crate::trace::request_id(None);
                end.status = problem.status;
                answer(&mut client, &mut ctx, &id, problem, None, None).await;
                ctx.seen.request_id = Some(id);
                String::new()
            }
            // The client left before its head was complete.
            Err(head::Unread::Left) => String::new(),
            // Closed with no answer, as a slow request head is.
            Err(head::Unread::Late) => {
                late = true;
                String::new()
            }
        };
        // A gateway answer's code, else how the tunnel ended.
        let error = ctx.seen.answered.or(end.error);
        let detail = end.detail.take();
        let (up, down) = end.bytes.unwrap_or_default();
        account::record(
            &self.metrics,
            &ctx,
            &Ended {
                method: "CONNECT",
                authority: &authority,
                path: "",
                query: None,
                status: end.status,
                client: client_addr,
                bytes_in: up,
                bytes_out: down,
                user_agent: None,
                error,
                detail: detail.map(Into::into),
                tunnel: end.bytes,
            },
        );
        late
    }

    /// Routes, admits, connects and pumps one tunnel; `ctx` and `end` say what happened.
    async fn tunnel(
        &self,
        client: &mut Stream,
        head: &head::Head,
        client_addr: Option<SocketAddr>,
        ctx: &mut RequestCtx,
        end: &mut End,
    ) {
        let id = ctx
            .seen
            .request_id
            .clone()
            .unwrap_or_else(|| crate::trace::request_id(None));
        // An `Arc`, not a guard: the tunnel waits (for capacity, for its connection), and it
        // lets the table go once connected, so that a tunnel open for hours does not keep a
        // replaced table alive.
        let table = self.table.load_full();
        let routing = route::Head {
            method: &http::Method::CONNECT,
            version: head.version,
            raw_target: head.authority.as_bytes(),
            host: head.headers.get(http::header::HOST).map(|h| h.as_bytes()),
            headers: &head.headers,
        };
        let (target, route) = match route::route(&table, &routing) {
            Ok(routed) => routed,
            Err(refused) => {
                let Refused {
                    problem,
                    route,
                    allow,
                    ..
                } = *refused;
                end.status = problem.status;
                ctx.route = route;
                answer(client, ctx, &id, problem, None, allow).await;
                return;
            }
        };
        ctx.route = Some(route.clone());
        // Who is calling, and whether it may: the step requests take too.
        let ssl = client.get_ssl_digest();
        let caller = super::authorize::Caller {
            cert_names: ssl.as_deref().and_then(crate::listen_tls::peer_names_of),
            headers: &head.headers,
            addr: client_addr.map(|a| a.ip()),
        };
        let authorized = super::authorize::authorize(
            table.clients.as_ref(),
            &self.metrics,
            &route,
            &target,
            &caller,
            ctx,
        );
        drop(ssl);
        if let Err(problem) = authorized {
            end.status = problem.status;
            answer(client, ctx, &id, problem, None, None).await;
            return;
        }

        let quota = route.quota.as_deref();
        let cost = quota.map_or(1, |q| q.cost("/", "CONNECT"));
        let mut key_buf = String::new();
        // The client's address, a trusted proxy's X-Forwarded-For hop included.
        let client_ip = ctx.seen.forwarded_client.or(client_addr.map(|a| a.ip()));
        // The client identified, held apart from `ctx`, which admission changes.
        let caller = ctx.client.clone();
        let identified = caller.as_deref().map(|c| &*c.name);
        let key = quota.map_or("", |q| {
            q.key_for(&head.headers, client_ip, identified, &mut key_buf)
        });
        // The client's socket: one that hangs up while waiting for capacity leaves the line.
        let fd = Some(client.id());
        // On a usage-metered route a tunnel reserves what a request without a body would.
        let reserved = quota
            .and_then(|q| q.usage.as_ref())
            .map_or(Vec::new(), |u| {
                let prefix = crate::usage::Prefix::unread(&head.headers);
                u.reserve(&prefix.request(&head.headers))
            });
        let mut planned = super::meter::Planned::plan(&route, caller.as_deref(), &reserved, cost);
        // A sticky route's session: one exit per session over a proxy pool, tunnels included;
        // and the client's max_in_flight, which a tunnel counts in as a request does.
        let cap = caller
            .as_deref()
            .and_then(|c| Some((&*c.name, c.config.max_in_flight?.get())));
        ctx.sticky = (route.config.upstream.sticky.is_some() || cap.is_some())
            .then(|| {
                let sticky_caller = crate::sticky::Caller {
                    name: identified.filter(|&n| n != crate::config::ANONYMOUS),
                    addr: client_ip,
                    cap,
                };
                crate::sticky::Sticky::of(&self.state, &route, &head.headers, &sticky_caller)
            })
            .flatten();
        match decide(
            crate::sticky::store(&self.state, ctx.sticky.as_ref()),
            &self.metrics,
            &route,
            key,
            caller.as_deref(),
            cost,
            fd,
            &mut planned,
            &reserved,
            false,
        )
        .await
        {
            Verdict::Go {
                first,
                ratelimit,
                fallback,
                // A tunnel's answer cannot be read: its reservation stands, as for any
                // answer whose amount is unknown.
                entries: _,
            } => {
                ctx.admitted(first, ratelimit, fallback, cost);
                // A retry places a member's calendar windows in their periods too.
                ctx.tried.members = planned
                    .as_ref()
                    .and_then(super::meter::Planned::for_retries);
            }
            Verdict::Answer {
                problem,
                ratelimit,
                no_member,
            } => {
                end.status = problem.status;
                if no_member {
                    ctx.failure = Some(Failure::NoMember);
                }
                answer(client, ctx, &id, problem, ratelimit, None).await;
                return;
            }
            Verdict::Left => {
                end.error = Some("client_gone");
                return;
            }
        }

        // Attempts: the admitted member, then untried ones from the policy, within retries.
        let up = &route.config.upstream;
        let egress = open::Egress {
            resolver: &self.resolver,
            guard: &table.guard,
        };
        let mut all_refused = true;
        let mut denied = None;
        let upstream = loop {
            let mut attempt = match next_member(
                crate::sticky::store(&self.state, ctx.sticky.as_ref()),
                &self.metrics,
                &route,
                &mut ctx.first,
                &mut ctx.tried,
                0,
            )
            .await
            {
                Ok(attempt) => attempt,
                Err(_) => break None,
            };
            let member = &route.members[attempt.index()];
            match open::connect(member, &target, up, &egress).await {
                Ok(conn) => {
                    attempt.connected();
                    // The attempt (and the lease on its member) lives as long as the tunnel.
                    break Some((conn, attempt));
                }
                Err(failure) if failure.denied.is_some() => {
                    // The client's destination is denied: nothing was contacted, the member's
                    // health is not touched, and no other member is tried (a `direct` one
                    // would go to the same place).
                    drop(attempt);
                    denied = failure.denied;
                    break None;
                }
                Err(failure) => {
                    member.attempts_connect_failure.inc();
                    all_refused &= failure.refused;
                    ctx.seen.connect_failures.push(failure.reason);
                    tracing::debug!(target: "sluice::tunnel", route = %route.name, member = %member.name, %failure, "tunnel attempt failed");
                    if member.kind == MemberKind::Direct || failure.target_failed {
                        // The client's target failed, not the member: health is not touched.
                    } else {
                        attempt.failed_to_connect();
                        if let Some(unbind) = ctx.rebind(crate::config::RebindOn::ConnectError) {
                            unbind.await;
                        }
                    }
                    // Back before the next ask, which must not count it against the caps.
                    if let Some(lease) = attempt.take_lease() {
                        lease.release().await;
                    }
                }
            }
        };
        drop(table);
        let Some((upstream, _attempt)) = upstream else {
            let attempts = ctx.tried.count() as u32;
            let problem = if let Some(denial) = denied {
                ctx.failure = Some(Failure::Denied(denial));
                Problem::destination_denied(crate::egress::describe(&target.host, &denial))
            } else if attempts == 0 {
                ctx.failure = Some(Failure::NoMember);
                Problem::no_member()
            } else if all_refused {
                Problem::proxy_refused(attempts)
            } else {
                ctx.failure = Some(Failure::Unreachable);
                let mut p = Problem::unreachable(attempts);
                if !ctx.seen.connect_failures.is_empty() {
                    let why = account::describe_failures(&ctx.seen.connect_failures);
                    p.detail = format!("{attempts} connection attempt(s) failed: {why}");
                    end.detail = Some(why);
                }
                p
            };
            end.status = problem.status;
            let ratelimit = ctx.ratelimit.take();
            answer(client, ctx, &id, problem, ratelimit, None).await;
            return;
        };
        if let Some(m) = ctx.member() {
            m.attempts_ok.inc();
        }

        if !head::established(client, &id, &route, ctx.ratelimit.take()).await {
            end.error = Some("client_gone");
            return;
        }
        end.status = 200;
        // A guard, not inc/dec around the pump: a tunnel whose task is dropped mid-way (its
        // connection's task cancelled, or a panic unwinding) must still leave the gauge.
        let _active = crate::metrics::GaugeGuard::enter(
            &self
                .metrics
                .tunnels_active
                .with_label_values(&[&route.name]),
        );
        let counters = tunnel::Counters {
            up: self
                .metrics
                .tunnel_bytes
                .with_label_values(&[&route.name, "up"]),
            down: self
                .metrics
                .tunnel_bytes
                .with_label_values(&[&route.name, "down"]),
        };
        let pumped = tunnel::carry(
            client,
            upstream,
            &head.early,
            up.read_timeout.0,
            &counters,
            self.extra_slots.as_ref(),
        )
        .await;
        end.bytes = Some((pumped.up, pumped.down));
        end.error = pumped.ended;
    }
}

/// Answers the CONNECT with the gateway's own problem, as a request would be answered, and
/// closes the connection.
async fn answer(
    client: &mut Stream,
    ctx: &mut RequestCtx,
    id: &HeaderValue,
    problem: Problem,
    ratelimit: Option<HeaderValue>,
    allow: Option<HeaderValue>,
) {
    ctx.seen.answered = Some(problem.code);
    let route = ctx.route.as_deref();
    match super::answer::problem_head(&problem, route, Some(id), ratelimit, allow) {
        Ok((head, body)) => head::answer(client, head, body).await,
        Err(e) => tracing::debug!(error = %e, "could not build the CONNECT's answer"),
    }
}

#[cfg(test)]
mod tests;
