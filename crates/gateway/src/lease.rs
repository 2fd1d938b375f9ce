//! Leases in the gateway: a request in flight holds a lease on its member in the state store
//! (taken by the store in the same step as the assignment), owned by a [`LeaseGuard`] that
//! lives as long as the request's attempt on that member. Dropping the guard, on whatever path
//! (the answer done, a tunnel or WebSocket closed, the client gone, an error, a panic
//! unwinding), hands the release to the [`Leaser`]'s task: it never blocks the request and
//! never leaks a lease; the worst a lost release costs is the lease counting until its ttl.
//!
//! The task (one per state store, on a thread of its own) also renews, in one call per route,
//! the leases older than a third of their ttl. Releases that come due together share one store
//! call per route: the ones that arrive while a call is out go in the next (group commit).
//!
//! A lease of a client with a `max_in_flight` also counts in the client's own leases
//! ([`sluice_allocator::ClientCap`]): the request's store says so ([`client_lease`]) as the
//! assignment answers, and the task then releases and renews the client's part with the
//! route's, in one more call per client.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use sluice_allocator::{Lease, StateStore};
use tokio::sync::{mpsc, oneshot};

/// How often the task looks for leases to renew (and flushes releases when nothing else wakes
/// it). `check` keeps `lease_ttl` at 1 s or more, so a renewal due at a third of it lands well
/// before the lease expires.
const TICK: Duration = Duration::from_millis(250);

/// The most releases kept for a retry while the store cannot be asked: past it they are
/// dropped and their leases count until their ttl.
const MAX_PENDING_RELEASES: usize = 100_000;

/// What a route's requests lease: the ttl and the caps, and where releases go.
#[derive(Clone)]
pub struct LeasePlan {
    /// The route's name, which a release names.
    pub route: Arc<str>,
    /// `upstream.lease_ttl`.
    pub ttl: Duration,
    /// `upstream.max_in_flight`.
    pub member_max: Option<u64>,
    /// The route's `max_in_flight`.
    pub route_max: Option<u64>,
    /// Whether the store walks the candidates fewest leases first (`least_in_flight`).
    pub fewest: bool,
    leaser: Arc<Leaser>,
}

impl LeasePlan {
    /// The plan of `route`, releasing to `state`'s leaser.
    pub fn new(
        route: Arc<str>,
        ttl: Duration,
        member_max: Option<u64>,
        route_max: Option<u64>,
        state: &Arc<dyn StateStore>,
    ) -> LeasePlan {
        LeasePlan {
            route,
            ttl,
            member_max,
            route_max,
            fewest: false,
            leaser: Leaser::for_store(state),
        }
    }

    /// A new lease id, unique across instances: this process's random id and a sequence.
    pub fn next_id(&self) -> Arc<str> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        static INSTANCE: OnceLock<String> = OnceLock::new();
        let instance = INSTANCE.get_or_init(|| format!("{:016x}", fastrand::u64(..)));
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        format!("{instance}:{seq}").into()
    }

    /// The lease ask for an assignment, under `id`.
    pub fn ask<'a>(&self, id: &'a str) -> Lease<'a> {
        Lease {
            id,
            ttl_us: u64::try_from(self.ttl.as_micros()).unwrap_or(u64::MAX),
            member_max: self.member_max,
            route_max: self.route_max,
            client: None,
        }
    }

    /// The guard of lease `id`, which the store just took: from here on, dropping it releases
    /// the lease.
    pub fn hold(&self, id: Arc<str>) -> LeaseGuard {
        self.leaser.send(Message::Taken {
            route: self.route.clone(),
            id: id.clone(),
            ttl: self.ttl,
        });
        LeaseGuard {
            leaser: self.leaser.clone(),
            route: self.route.clone(),
            id,
            released: false,
        }
    }
}

/// The longest [`LeaseGuard::release`] waits for the store to have the lease back. Past it the
/// request goes on as if the release were asynchronous, which at worst makes its next ask see
/// its own lease still counted.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// One lease held by a request: released when dropped.
pub struct LeaseGuard {
    leaser: Arc<Leaser>,
    route: Arc<str>,
    id: Arc<str>,
    /// Released already, by [`LeaseGuard::release`].
    released: bool,
}

impl LeaseGuard {
    /// The lease's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Releases the lease now and waits until the store has it back (its client's part too).
    /// For a request that moves on and asks the store again (a retry after a connect failure,
    /// a cooldown replay, a fallback): its own lease must not count against the caps that
    /// ask checks, or a request at its route's, member's or client's `max_in_flight` would be
    /// refused by itself. Dropping the guard releases too, but without waiting.
    pub async fn release(mut self) {
        self.released = true;
        let (done, wait) = oneshot::channel();
        self.leaser.send(Message::Released {
            route: self.route.clone(),
            id: self.id.clone(),
            done: Some(done),
        });
        let _ = tokio::time::timeout(RELEASE_WAIT, wait).await;
    }
}

impl std::fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("route", &self.route)
            .field("id", &self.id)
            .finish()
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if !self.released {
            self.leaser.send(Message::Released {
                route: self.route.clone(),
                id: self.id.clone(),
                done: None,
            });
        }
    }
}

/// Lease `id`, just taken by an assignment on `state`, also counts in `client`'s own leases:
/// its release and renewals go to the client's too. Sent before the lease's guard exists, on
/// the same channel, so the task knows it when the guard's messages come.
pub(crate) fn client_lease(state: &Arc<dyn StateStore>, id: &str, client: &Arc<str>) {
    Leaser::for_store(state).send(Message::Client {
        id: id.into(),
        client: client.clone(),
    });
}

enum Message {
    Client {
        id: Arc<str>,
        client: Arc<str>,
    },
    Taken {
        route: Arc<str>,
        id: Arc<str>,
        ttl: Duration,
    },
    Released {
        route: Arc<str>,
        id: Arc<str>,
        /// Told once the store has been asked to release it ([`LeaseGuard::release`]).
        done: Option<oneshot::Sender<()>>,
    },
}

/// The task that releases and renews the leases of one state store.
pub struct Leaser {
    tx: mpsc::UnboundedSender<Message>,
}

impl Leaser {
    /// The leaser of `state`: one per store, shared by every route and table that uses it. Its
    /// task runs on a thread of its own, so that it outlives any runtime that asked for it.
    fn for_store(state: &Arc<dyn StateStore>) -> Arc<Leaser> {
        static LEASERS: Mutex<Vec<(usize, Weak<Leaser>)>> = Mutex::new(Vec::new());
        let key = Arc::as_ptr(state) as *const () as usize;
        let mut leasers = LEASERS.lock().unwrap_or_else(|p| p.into_inner());
        leasers.retain(|(_, w)| w.strong_count() > 0);
        if let Some(leaser) = leasers
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return leaser;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let store = state.clone();
        let spawned = std::thread::Builder::new()
            .name("sluice-leases".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match runtime {
                    Ok(runtime) => runtime.block_on(run(store, rx)),
                    Err(error) => tracing::error!(
                        target: "sluice::lease",
                        %error,
                        "no runtime for lease releases: leases count until their ttl"
                    ),
                }
            });
        if let Err(error) = spawned {
            tracing::error!(
                target: "sluice::lease",
                %error,
                "no thread for lease releases: leases count until their ttl"
            );
        }
        let leaser = Arc::new(Leaser { tx });
        leasers.push((key, Arc::downgrade(&leaser)));
        leaser
    }

    /// Never blocks; when the task is gone the lease counts until its ttl.
    fn send(&self, message: Message) {
        let _ = self.tx.send(message);
    }
}

/// A lease the task renews.
struct Live {
    route: Arc<str>,
    /// The client whose own leases it also counts in.
    client: Option<Arc<str>>,
    ttl: Duration,
    renewed: Instant,
}

/// The task: applies what guards send, then releases (one call per route) and renews what is
/// due, until every guard and plan is gone.
async fn run(state: Arc<dyn StateStore>, mut rx: mpsc::UnboundedReceiver<Message>) {
    let mut live: HashMap<Arc<str>, Live> = HashMap::new();
    let mut releases: HashMap<Arc<str>, Vec<Arc<str>>> = HashMap::new();
    // Lease id → its client, from the request's store, until the lease's guard says Taken.
    let mut owners: HashMap<Arc<str>, Arc<str>> = HashMap::new();
    // The clients' parts of released leases, by client.
    let mut client_releases: HashMap<Arc<str>, Vec<Arc<str>>> = HashMap::new();
    let mut pending = 0usize;
    let mut open = true;
    while open || pending > 0 {
        let first = match tokio::time::timeout(TICK, rx.recv()).await {
            Ok(Some(message)) => Some(message),
            Ok(None) => {
                open = false;
                None
            }
            Err(_) => None,
        };
        // Everything that arrived meanwhile goes in the same calls.
        let rest = std::iter::from_fn(|| rx.try_recv().ok());
        let mut waiting = Vec::new();
        for message in first.into_iter().chain(rest) {
            match message {
                Message::Client { id, client } => {
                    // Bounded as the leases are: each is taken before its guard exists.
                    if owners.len() < MAX_PENDING_RELEASES {
                        owners.insert(id, client);
                    }
                }
                Message::Taken { route, id, ttl } => {
                    let renewed = Instant::now();
                    let client = owners.remove(&id);
                    live.insert(
                        id,
                        Live {
                            route,
                            client,
                            ttl,
                            renewed,
                        },
                    );
                }
                Message::Released { route, id, done } => {
                    waiting.extend(done);
                    let client = live.remove(&id).and_then(|l| l.client);
                    if pending < MAX_PENDING_RELEASES {
                        if let Some(client) = client {
                            client_releases.entry(client).or_default().push(id.clone());
                            pending += 1;
                        }
                        releases.entry(route).or_default().push(id);
                        pending += 1;
                    }
                }
            }
        }
        let mut failed = false;
        for (route, ids) in releases.iter_mut() {
            let refs: Vec<&str> = ids.iter().map(|id| &**id).collect();
            match state.release(route, &refs).await {
                Ok(()) => {
                    pending -= ids.len();
                    ids.clear();
                }
                Err(error) => {
                    failed = true;
                    tracing::debug!(target: "sluice::lease", %route, %error, "release failed; retried");
                }
            }
        }
        releases.retain(|_, ids| !ids.is_empty());
        for (client, ids) in client_releases.iter_mut() {
            let refs: Vec<&str> = ids.iter().map(|id| &**id).collect();
            match state.release_client(client, &refs).await {
                Ok(()) => {
                    pending -= ids.len();
                    ids.clear();
                }
                Err(error) => {
                    failed = true;
                    tracing::debug!(target: "sluice::lease", %error, "a client's release failed; retried");
                }
            }
        }
        client_releases.retain(|_, ids| !ids.is_empty());
        // Asked, whatever the answer: a failed release is retried, and the lease counts until
        // then, as it would until its ttl.
        for done in waiting {
            let _ = done.send(());
        }
        if failed && !open {
            // Shutting down with the store out: the leases expire at their ttl.
            break;
        }
        renew_due(&*state, &mut live).await;
    }
}

/// Renews, one call per route and ttl, the leases older than a third of their ttl.
async fn renew_due(state: &dyn StateStore, live: &mut HashMap<Arc<str>, Live>) {
    let now = Instant::now();
    let mut due: HashMap<(Arc<str>, Duration), Vec<Arc<str>>> = HashMap::new();
    let mut clients_due: HashMap<(Arc<str>, Duration), Vec<Arc<str>>> = HashMap::new();
    for (id, lease) in live.iter() {
        if now.duration_since(lease.renewed) >= lease.ttl / 3 {
            due.entry((lease.route.clone(), lease.ttl))
                .or_default()
                .push(id.clone());
            if let Some(client) = &lease.client {
                clients_due
                    .entry((client.clone(), lease.ttl))
                    .or_default()
                    .push(id.clone());
            }
        }
    }
    // The clients' parts first: a failed one is tried again at the next tick, as the route's
    // renewal of the same leases then is too (it is not marked renewed).
    let mut failed: Vec<Arc<str>> = Vec::new();
    for ((client, ttl), ids) in clients_due {
        let refs: Vec<&str> = ids.iter().map(|id| &**id).collect();
        let ttl_us = u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX);
        if let Err(error) = state.renew_client(&client, &refs, ttl_us, None).await {
            tracing::debug!(target: "sluice::lease", %error, "a client's renewal failed; retried");
            failed.extend(ids);
        }
    }
    for ((route, ttl), ids) in due {
        let refs: Vec<&str> = ids.iter().map(|id| &**id).collect();
        let ttl_us = u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX);
        match state.renew(&route, &refs, ttl_us, None).await {
            Ok(()) => {
                for id in ids.iter().filter(|id| !failed.contains(id)) {
                    if let Some(lease) = live.get_mut(id) {
                        lease.renewed = now;
                    }
                }
            }
            // During an outage the request goes on (as admission's on_store_error let it);
            // the renewal is tried again at the next tick.
            Err(error) => {
                tracing::debug!(target: "sluice::lease", %route, %error, "renewal failed; retried")
            }
        }
    }
}
