//! Sticky sessions (`upstream.sticky`, SPEC §11): requests of one session go to one member.
//!
//! The binding (session → member) lives in the store, shared by every instance, and is looked
//! up and moved in the same atomic step as the request's admission and selection
//! ([`sluice_allocator::Sticky`]): no extra round trip. A request's [`Sticky`] is the store it
//! is admitted and retried through: it adds the session to each of its route's assignments and
//! passes everything else on, so no selection policy needs to know about sessions.
//!
//! The session key (a header, a cookie, or the client) is hashed (BLAKE3) before it goes
//! anywhere: it may be a secret, and neither the store nor a log ever sees it.
//!
//! A member that answers a `rebind_on` status, or fails to connect, loses the session's
//! binding (one small store call, which drops it only while it still points there): the next
//! request of the session is routed by the policy and bound anew.
//!
//! The same per-request store carries the calling client's `max_in_flight`
//! ([`sluice_allocator::ClientCap`]), on every route: each lease an assignment takes then
//! counts in the client's own leases too, in the same step, and no selection policy needs to
//! know about clients either.

use std::net::IpAddr;
use std::sync::Arc;

use async_trait::async_trait;
use http::HeaderMap;
use sluice_allocator::{
    Assign, Assignment, ClientCap, Lease, PoolMember, Reserved, StateStore, StickyCounts,
    SubLogStart, Usage,
};
use sluice_limiter::{
    Acquire, Outcome, Owner, Reservation, Reserve, Settle, Settled, StoreError, Window, WindowUsage,
};

use crate::config::{RebindOn, StickyKey};
use crate::table::Route;

/// The store as one request sees it: each assignment on a sticky route carries the request's
/// session, and each lease (on any route) the calling client's cap.
pub struct Sticky {
    inner: Arc<dyn StateStore>,
    route: Arc<str>,
    /// The session key's hash, in hex; none when the route is not sticky or the request names
    /// no session.
    session: Option<Box<str>>,
    ttl_us: u64,
    max_bindings: u64,
    /// The client's name and its `max_in_flight`, when it has one.
    client: Option<(Arc<str>, u64)>,
}

/// The store a request is admitted and retried through: its [`Sticky`] when it has one.
pub(crate) fn store<'a>(
    state: &'a Arc<dyn StateStore>,
    sticky: Option<&'a Arc<Sticky>>,
) -> &'a dyn StateStore {
    match sticky {
        Some(s) => &**s,
        None => &**state,
    }
}

/// Who is calling, as the `client` key reads it.
pub(crate) struct Caller<'a> {
    /// The client identified (`clients`), if any.
    pub(crate) name: Option<&'a str>,
    /// The client identified (`anonymous` too) and its `max_in_flight`, when it has one.
    pub(crate) cap: Option<(&'a str, u64)>,
    /// Else its address (a trusted proxy's `X-Forwarded-For`, or the connection's).
    pub(crate) addr: Option<IpAddr>,
}

impl Sticky {
    /// The store of a request on `route`: its session, when the route is sticky and the
    /// request names one (a request without its header or cookie is routed by the policy
    /// alone), and its client's cap. `None` when it has neither.
    pub(crate) fn of(
        state: &Arc<dyn StateStore>,
        route: &Route,
        headers: &HeaderMap,
        caller: &Caller<'_>,
    ) -> Option<Arc<Sticky>> {
        let client = caller.cap;
        let config = route.config.upstream.sticky.as_ref();
        let session = config.and_then(|config| Sticky::session(&config.key, headers, caller));
        if session.is_none() && client.is_none() {
            return None;
        }
        Some(Arc::new(Sticky {
            inner: state.clone(),
            route: route.name.clone(),
            session,
            ttl_us: config.map_or(0, |c| {
                u64::try_from(c.ttl.0.as_micros()).unwrap_or(u64::MAX)
            }),
            max_bindings: config.map_or(0, |c| c.max_bindings.get()),
            client: client.map(|(name, max)| (name.into(), max)),
        }))
    }

    /// The hash of the request's session key, if it names one.
    fn session(key: &StickyKey, headers: &HeaderMap, caller: &Caller<'_>) -> Option<Box<str>> {
        let mut hasher = blake3::Hasher::new();
        match key {
            StickyKey::Header(name) => {
                let value = headers.get(name.as_str())?.as_bytes();
                if value.is_empty() {
                    return None;
                }
                hasher.update(value);
            }
            StickyKey::Cookie(name) => {
                hasher.update(cookie(headers, name)?);
            }
            StickyKey::Client => match (caller.name, caller.addr) {
                (Some(name), _) => {
                    hasher.update(b"c:");
                    hasher.update(name.as_bytes());
                }
                (None, Some(addr)) => {
                    hasher.update(b"a:");
                    hasher.update(addr.to_string().as_bytes());
                }
                (None, None) => return None,
            },
        }
        // 128 bits name a session well enough, at half the store's memory.
        let hex = hasher.finalize().to_hex();
        Some(hex[..32].into())
    }

    /// The member at `index` of `route` answered `what`: when the route's `rebind_on` lists
    /// it, the call that drops the session's binding to the member. The caller awaits it
    /// where it can, so that the session's next request finds the binding gone.
    pub(crate) fn unbinding(
        self: &Arc<Self>,
        route: &Route,
        index: Option<usize>,
        what: RebindOn,
    ) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let config = route.config.upstream.sticky.as_ref()?;
        if !config.rebind_on.contains(&what) || *route.name != *self.route {
            return None;
        }
        self.session.as_ref()?;
        let member = index.and_then(|i| route.members.get(i))?;
        let sticky = self.clone();
        let member = member.name.clone();
        Some(async move {
            let session = sticky.session.as_deref().unwrap_or_default();
            if let Err(error) = sticky.inner.unbind(&sticky.route, session, &member).await {
                tracing::debug!(
                    target: "sluice::sticky",
                    route = %sticky.route,
                    %error,
                    "the session's binding could not be dropped; it expires at its ttl"
                );
            }
        })
    }

    fn with<'a>(&'a self, ask: Assign<'a>) -> Assign<'a> {
        // The client's cap goes with every lease, whatever the route.
        let lease = match (ask.lease, &self.client) {
            (Some(lease), Some((name, max))) => Some(Lease {
                client: Some(ClientCap { name, max: *max }),
                ..lease
            }),
            (lease, _) => lease,
        };
        let session = self.session.as_deref();
        // Another route (a fallback's): its own stickiness is its own request's.
        let sticky = match session.filter(|_| ask.route == &*self.route) {
            Some(session) => Some(sluice_allocator::Sticky {
                session,
                ttl_us: self.ttl_us,
                max_bindings: self.max_bindings,
            }),
            None => ask.sticky,
        };
        Assign {
            sticky,
            lease,
            ..ask
        }
    }

    /// After an assignment that took a lease counted in the client's own (or may have: a call
    /// the store failed, whose lease is then released as soon as it is known): the lease's
    /// release and renewals go to the client's too.
    fn taken(&self, ask: &Assign<'_>, assigned: bool) {
        if let (true, Some(lease), Some((client, _))) = (assigned, ask.lease, &self.client) {
            crate::lease::client_lease(&self.inner, lease.id, client);
        }
    }
}

/// The value of cookie `name` in the request's `Cookie` headers, if any and not empty.
fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a [u8]> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b';'))
        .filter_map(|pair| {
            let at = pair.iter().position(|&b| b == b'=')?;
            let (n, v) = (pair[..at].trim_ascii(), pair[at + 1..].trim_ascii());
            (n == name.as_bytes() && !v.is_empty()).then_some(v)
        })
        .next()
}

#[async_trait]
impl StateStore for Sticky {
    async fn acquire(&self, request: Acquire<'_>) -> Result<Outcome, StoreError> {
        self.inner.acquire(request).await
    }

    async fn reserve(&self, request: Reserve<'_>) -> Result<Reservation, StoreError> {
        self.inner.reserve(request).await
    }

    async fn assign_reserve(
        &self,
        ask: Assign<'_>,
        usage: Usage<'_>,
    ) -> Result<Reserved, StoreError> {
        let answer = self.inner.assign_reserve(self.with(ask), usage).await;
        let assigned = matches!(
            answer,
            Ok(Reserved {
                assignment: Assignment::Assigned { .. },
                ..
            }) | Err(_)
        );
        self.taken(&ask, assigned);
        answer
    }

    async fn settle(
        &self,
        route: &str,
        settlements: &[Settle<'_>],
        at_us: Option<u64>,
    ) -> Result<Vec<Vec<Settled>>, StoreError> {
        self.inner.settle(route, settlements, at_us).await
    }

    async fn usage(
        &self,
        route: &str,
        owner: Owner,
        key: &str,
        windows: &[Window],
        at_us: Option<u64>,
    ) -> Result<Vec<WindowUsage>, StoreError> {
        self.inner.usage(route, owner, key, windows, at_us).await
    }

    async fn assign(&self, ask: Assign<'_>) -> Result<Assignment, StoreError> {
        let answer = self.inner.assign(self.with(ask)).await;
        self.taken(
            &ask,
            matches!(answer, Ok(Assignment::Assigned { .. }) | Err(_)),
        );
        answer
    }

    async fn sync(
        &self,
        route: &str,
        members: &[Arc<str>],
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        self.inner.sync(route, members, excluded).await
    }

    async fn restore_to_min(
        &self,
        route: &str,
        member: &str,
        excluded: &[&str],
    ) -> Result<(), StoreError> {
        self.inner.restore_to_min(route, member, excluded).await
    }

    async fn member_remaining(
        &self,
        route: &str,
        member: &PoolMember,
    ) -> Result<Vec<u64>, StoreError> {
        self.inner.member_remaining(route, member).await
    }

    async fn counts(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        self.inner.counts(route).await
    }

    async fn cool(
        &self,
        route: &str,
        member: &str,
        for_us: u64,
        at_us: Option<u64>,
    ) -> Result<u64, StoreError> {
        self.inner.cool(route, member, for_us, at_us).await
    }

    async fn cooldowns(&self, route: &str) -> Result<Vec<(String, u64)>, StoreError> {
        self.inner.cooldowns(route).await
    }

    async fn retain_routes(&self, routes: &[&str]) {
        self.inner.retain_routes(routes).await
    }

    fn shard_routes(&self, routes: &[(&str, u32, SubLogStart)]) -> usize {
        self.inner.shard_routes(routes)
    }

    async fn release(&self, route: &str, leases: &[&str]) -> Result<(), StoreError> {
        self.inner.release(route, leases).await
    }

    async fn renew(
        &self,
        route: &str,
        leases: &[&str],
        ttl_us: u64,
        at_us: Option<u64>,
    ) -> Result<(), StoreError> {
        self.inner.renew(route, leases, ttl_us, at_us).await
    }

    async fn release_client(&self, client: &str, leases: &[&str]) -> Result<(), StoreError> {
        self.inner.release_client(client, leases).await
    }

    async fn renew_client(
        &self,
        client: &str,
        leases: &[&str],
        ttl_us: u64,
        at_us: Option<u64>,
    ) -> Result<(), StoreError> {
        self.inner.renew_client(client, leases, ttl_us, at_us).await
    }

    async fn in_flight(
        &self,
        route: &str,
        at_us: Option<u64>,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        self.inner.in_flight(route, at_us).await
    }

    async fn unbind(&self, route: &str, session: &str, member: &str) -> Result<(), StoreError> {
        self.inner.unbind(route, session, member).await
    }

    async fn sticky_counts(
        &self,
        route: &str,
        at_us: Option<u64>,
    ) -> Result<StickyCounts, StoreError> {
        self.inner.sticky_counts(route, at_us).await
    }

    async fn ready(&self) -> bool {
        self.inner.ready().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cookie_is_read_from_any_cookie_header() {
        let mut h = HeaderMap::new();
        h.append(http::header::COOKIE, "a=1; sid= ; b=2".parse().unwrap());
        h.append(http::header::COOKIE, "sidx=9;sid=abc".parse().unwrap());
        assert_eq!(cookie(&h, "sid"), Some(&b"abc"[..]));
        assert_eq!(cookie(&h, "b"), Some(&b"2"[..]));
        assert_eq!(cookie(&h, "c"), None);
    }
}
