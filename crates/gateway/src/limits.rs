//! Bounds on client connections (`limits:`): how many may be open, how long one may sit idle
//! between requests, and how long a request head may take to arrive whole.
//!
//! Pingora 0.9 bounds none of these by itself:
//! - it accepts every connection it is offered, until the process runs out of file
//!   descriptors (and then the admin listener and upstream connections fail too);
//! - after a first HTTP/1.1 request it keeps a connection open with *no* idle timeout
//!   (`respect_keepalive` sets an infinite keep-alive, pingora-core 0.9.1
//!   src/protocols/http/v1/server.rs:798-815, and `read_request_buf` then reads without a timer,
//!   :225-228);
//! - its header timeouts are per read (:220-240), so a client that trickles a header line
//!   every few seconds holds a connection forever (slowloris).
//!
//! So the proxy service is wrapped here in [`LimitedApp`], a `ServerApp` that runs Pingora's own
//! HTTP/1 connection loop (the blanket `ServerApp for HttpServerApp` of pingora-core
//! src/apps/mod.rs:262-366, minus h2c and h2 by ALPN, which sluice's listeners never offer: TLS
//! listeners advertise http/1.1 only, see `crate::listen_tls`) around the proxy app, on a
//! [`LimitedStream`]:
//! - a connection first takes a slot of [`LimitedApp`]'s count; at `max_connections` it gets a
//!   `503` and is closed at once (on a TLS listener it is closed with no answer: answering would
//!   take the handshake the cap is there to refuse);
//! - before its slot, a connection to a TLS listener takes a place among those in their handshake, at
//!   most a quarter of `max_connections`, and is closed with no answer when they are all taken:
//!   clients that never finish a handshake cannot take the slots of plain clients;
//! - on a TLS listener the handshake comes next, here, inside the slot and within
//!   `min(idle_timeout, header_timeout)`, as the first bytes of a plain connection must arrive.
//!   Pingora would do it before `process_new`, outside any cap, with a fixed 60 s timeout
//!   (pingora-core 0.9.1 src/services/listening.rs:233-251): clients that open TLS connections
//!   and never finish their handshake could hold any number of sockets. So TLS listeners are
//!   plain TCP listeners to Pingora, and [`LimitedApp::with_tls`] gives their acceptors here;
//! - the stream itself runs the idle and header timers, since only it sees when bytes arrive.
//!   Between requests the idle timer runs; the first byte of a head starts the header timer,
//!   and the proxy's first hook stops it ([`head_parsed`]) once Pingora has parsed the head.
//!   Reading and answering the request are then bounded by the route's timeouts, as before.
//!   A WebSocket upgrade stays in that phase after its `101` for as long as it is open: Pingora
//!   never reuses an upgraded connection (it turns keep-alive off on a 101), so it never goes
//!   back to waiting for a request, and only the route's `read_timeout` bounds it.
//!
//! [`MemoryTrim`] gives memory back to the system once many connections have closed: glibc's
//! malloc keeps what they freed, scattered between chunks still in use, and its own trimming only
//! releases the top of a heap (docs/benchmarks.md).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, ServerApp};
use pingora::proxy::{HttpProxy, ProxyHttp};

use crate::tunnel::First;
use pingora::listeners::tls::{Acceptor, TlsSettings};
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    TimingDigest, UniqueID, UniqueIDType, ALPN,
};
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use prometheus::{IntCounter, IntGauge};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::Sleep;

use crate::config::LimitsConfig;
use crate::metrics::Metrics;

/// File descriptors kept out of the connection cap's share: the admin listener and its
/// clients, Redis, health checks, the config watcher, logs and Pingora's own.
const RESERVED_FDS: u64 = 256;

/// The share of `max_connections` that connections still in their TLS handshake may hold: a
/// quarter. Clients that open TLS connections and never finish the handshake can then take no
/// more than that, and plain clients (and TLS clients past their handshake) keep the rest. A
/// handshake takes milliseconds, so a quarter of the cap is far more than honest clients need.
const HANDSHAKE_SHARE: usize = 4;

/// The limits in force, fixed at start.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most client connections open at once.
    pub max_connections: usize,
    /// Most of those that may be in their TLS handshake at once (a share of the cap).
    pub max_handshakes: usize,
    /// Longest wait for the next request on an idle connection.
    pub idle_timeout: Duration,
    /// Longest time from the first byte of a request head to its end.
    pub header_timeout: Duration,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, logs both, and works out the limits in
/// force: without `max_connections`, half of what the descriptors allow after a reserve, since
/// each client connection may hold an upstream connection too.
pub fn prepare(config: &LimitsConfig) -> Limits {
    let before = rlimit::Resource::NOFILE.get().ok();
    let soft = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(soft) => soft,
        Err(e) => {
            tracing::warn!(target: "sluice::server", error = %e, "cannot raise the open-file limit (RLIMIT_NOFILE)");
            before.map_or(1024, |(soft, _)| soft)
        }
    };
    let hard = before.map_or(soft, |(_, hard)| hard);
    let share = usize::try_from(soft.saturating_sub(RESERVED_FDS) / 2)
        .unwrap_or(usize::MAX)
        .max(1);
    let max_connections = match config.max_connections {
        Some(n) => {
            let n = n.get() as usize;
            if n > share {
                tracing::warn!(
                    target: "sluice::server",
                    max_connections = n,
                    open_files = soft,
                    "limits.max_connections is more than the open-file limit leaves room for (two descriptors per client connection, {RESERVED_FDS} in reserve): at the cap, accepts or upstream connections may fail"
                );
            }
            n
        }
        None => share,
    };
    tracing::info!(
        target: "sluice::server",
        nofile_soft_before = before.map(|(soft, _)| soft),
        nofile_soft = soft,
        nofile_hard = hard,
        max_connections,
        "open-file limit"
    );
    Limits {
        max_connections,
        max_handshakes: (max_connections / HANDSHAKE_SHARE).max(1),
        idle_timeout: config.idle_timeout.0,
        header_timeout: config.header_timeout.0,
    }
}

/// Tells the connection that its request head has been parsed, which stops the header timer.
/// Called from the proxy's first hook. Does nothing on a stream that is not a [`LimitedStream`].
pub fn head_parsed(session: &ServerSession) {
    if let Some(stream) = session
        .stream()
        .and_then(|s| s.as_any().downcast_ref::<LimitedStream>())
    {
        stream.phase.store(IN_REQUEST, Ordering::Release);
    }
}

/// Where a connection is in its life, shared by the stream (which sees bytes arrive), the
/// proxy's hook (which sees a head parsed) and the connection loop (which sees a request end).
const WAITING: u8 = 0;
/// The first bytes of a head have arrived; the header timer runs.
const IN_HEAD: u8 = 1;
/// The head is parsed; sluice runs no timer of its own.
const IN_REQUEST: u8 = 2;
/// No timer armed yet.
const UNARMED: u8 = u8::MAX;

/// The proxy app, behind the connection cap and the idle and header timers.
pub struct LimitedApp<A> {
    inner: Arc<A>,
    limits: Limits,
    open: Arc<AtomicUsize>,
    /// Connections in their TLS handshake now.
    handshaking: Arc<AtomicUsize>,
    /// The most connections open at once since [`MemoryTrim`] last trimmed.
    high: Arc<AtomicUsize>,
    trims: IntCounter,
    gauge: IntGauge,
    closed_idle: IntCounter,
    closed_head: IntCounter,
    refused: IntCounter,
    refused_handshakes: IntCounter,
    /// When a refusal was last logged, in seconds since start; refusals come in floods.
    refusal_logged: AtomicU64,
    /// The same for refusals at the handshakes' share.
    handshake_refusal_logged: AtomicU64,
    started: Instant,
    /// Where a connection that opens with a CONNECT goes, instead of Pingora's HTTP loop.
    tunnels: Option<crate::request::Tunnels>,
    /// The TLS listeners, by address, and their acceptors: the handshake is done here.
    tls: Vec<(SocketAddr, Arc<Acceptor>)>,
}

impl<A> LimitedApp<A> {
    /// Sends each connection that opens with a CONNECT to `tunnels`.
    pub fn with_tunnels(mut self, tunnels: crate::request::Tunnels) -> LimitedApp<A> {
        self.tunnels = Some(tunnels);
        self
    }

    /// Does the TLS handshake, with `settings`, of each connection to the listener at `addr`
    /// (which Pingora must listen on as plain TCP).
    pub fn with_tls(mut self, addr: SocketAddr, settings: TlsSettings) -> LimitedApp<A> {
        self.tls.push((addr, Arc::new(settings.build())));
        self
    }

    /// The acceptor of the TLS listener `stream` came in on, if it came in on one: its local
    /// address, or a wildcard listener on its port.
    fn acceptor_for(&self, stream: &Stream) -> Option<Arc<Acceptor>> {
        if self.tls.is_empty() {
            return None;
        }
        let digest = stream.get_socket_digest()?;
        let local = *digest.local_addr()?.as_inet()?;
        let exact = self.tls.iter().find(|(addr, _)| *addr == local);
        let wildcard = || {
            self.tls
                .iter()
                .find(|(addr, _)| addr.port() == local.port() && addr.ip().is_unspecified())
        };
        exact.or_else(wildcard).map(|(_, a)| a.clone())
    }

    /// Wraps `inner`.
    pub fn new(inner: A, limits: Limits, metrics: &Metrics) -> LimitedApp<A> {
        let closed = |reason: &str| metrics.connections_closed.with_label_values(&[reason]);
        LimitedApp {
            inner: Arc::new(inner),
            limits,
            open: Arc::new(AtomicUsize::new(0)),
            handshaking: Arc::new(AtomicUsize::new(0)),
            high: Arc::new(AtomicUsize::new(0)),
            trims: metrics.memory_trims.clone(),
            gauge: metrics.connections_open.clone(),
            closed_idle: closed("idle_timeout"),
            closed_head: closed("header_timeout"),
            refused: closed("max_connections"),
            refused_handshakes: closed("max_handshakes"),
            refusal_logged: AtomicU64::new(u64::MAX),
            handshake_refusal_logged: AtomicU64::new(u64::MAX),
            started: Instant::now(),
            tunnels: None,
            tls: Vec::new(),
        }
    }

    /// The background service that gives memory back after many of these connections closed.
    pub fn memory_trim(&self) -> MemoryTrim {
        MemoryTrim {
            open: self.open.clone(),
            high: self.high.clone(),
            trims: self.trims.clone(),
        }
    }

    /// Takes a connection slot, or None at the cap.
    fn take_slot(&self) -> Option<Slot> {
        let mut open = self.open.load(Ordering::Relaxed);
        loop {
            if open >= self.limits.max_connections {
                return None;
            }
            match self.open.compare_exchange_weak(
                open,
                open + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    self.high.fetch_max(open + 1, Ordering::Relaxed);
                    self.gauge.inc();
                    return Some(Slot {
                        open: self.open.clone(),
                        gauge: self.gauge.clone(),
                    });
                }
                Err(now) => open = now,
            }
        }
    }

    /// Takes a place among the connections in their TLS handshake, or None when their share of
    /// the cap is taken.
    fn take_handshake(&self) -> Option<Handshaking> {
        let taken = self
            .handshaking
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < self.limits.max_handshakes).then_some(n + 1)
            })
            .is_ok();
        taken.then(|| Handshaking(self.handshaking.clone()))
    }

    /// Closes, with no answer (an answer would take the handshake), a TLS connection that
    /// finds the handshakes' share of the cap taken.
    async fn refuse_handshake(&self, mut stream: Stream) {
        self.refused_handshakes.inc();
        let now = self.started.elapsed().as_secs();
        if self.handshake_refusal_logged.swap(now, Ordering::Relaxed) != now {
            tracing::warn!(
                target: "sluice::server",
                max_handshakes = self.limits.max_handshakes,
                "TLS connection refused: a quarter of limits.max_connections are in their TLS handshake (logged at most once a second)"
            );
        }
        Shutdown::shutdown(&mut *stream).await;
    }

    /// Answers a connection over the cap with a 503 and closes it, without reading anything:
    /// the point is to spend as little as possible on it. On a TLS listener (`tls`) it is closed
    /// with no answer, since answering would take a handshake.
    async fn refuse(&self, mut stream: Stream, tls: bool) {
        self.refused.inc();
        let now = self.started.elapsed().as_secs();
        if self.refusal_logged.swap(now, Ordering::Relaxed) != now {
            tracing::warn!(
                target: "sluice::server",
                max_connections = self.limits.max_connections,
                "connection refused: limits.max_connections client connections are open (logged at most once a second)"
            );
        }
        if tls {
            Shutdown::shutdown(&mut *stream).await;
            return;
        }
        let (_, body) =
            crate::problem::render(&crate::problem::Problem::too_many_connections(), None);
        let head = format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nx-sluice-error: too_many_connections\r\nretry-after: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let write = async {
            stream.write_all(head.as_bytes()).await?;
            stream.write_all(&body).await?;
            stream.flush().await
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
        Shutdown::shutdown(&mut *stream).await;
    }
}

/// The server side of a TLS handshake on a connection Pingora accepted as plain TCP; None if
/// it fails.
async fn tls_handshake(acceptor: &Acceptor, stream: Stream) -> Option<Stream> {
    let l4 = stream.into_any().downcast::<L4Stream>().ok()?;
    match acceptor.tls_handshake(*l4).await {
        Ok(tls) => Some(Box::new(tls)),
        Err(e) => {
            tracing::debug!(target: "sluice::server", error = %e, "TLS handshake with a client failed");
            None
        }
    }
}

/// How often [`MemoryTrim`] looks at the connection count.
const TRIM_EVERY: Duration = Duration::from_secs(5);
/// How many connections must have closed since the last look for a trim: with about 100 KiB
/// held per connection, 256 of them are some 25 MiB.
const TRIM_AFTER_CLOSED: usize = 256;

/// Every [`TRIM_EVERY`], if at least [`TRIM_AFTER_CLOSED`] fewer connections are open than the
/// most that were open since the last trim, calls glibc's `malloc_trim(0)`, which hands the
/// free pages of every heap back to the system (5,000 idle connections that had come and gone
/// left ~95 KiB each behind, all of it returned by a trim). So at most one trim per period,
/// only after a large net drop (a slow one too), never on a steady load however busy; it takes
/// the allocator's locks for a few milliseconds at most. What fewer than [`TRIM_AFTER_CLOSED`]
/// connections freed since the last trim may stay. Built with the `jemalloc` allocator, the
/// same trigger purges jemalloc's arenas instead. mimalloc and other C libraries: nothing.
pub struct MemoryTrim {
    open: Arc<AtomicUsize>,
    high: Arc<AtomicUsize>,
    /// `sluice_memory_trims_total`.
    trims: IntCounter,
}

impl MemoryTrim {
    /// Whether enough connections closed since the last trim; if so, the count starts again
    /// from the connections open now.
    fn due(&self) -> bool {
        let open = self.open.load(Ordering::Relaxed);
        let high = self.high.load(Ordering::Relaxed);
        if high.saturating_sub(open) < TRIM_AFTER_CLOSED {
            return false;
        }
        // A connection taken in between may be forgotten: the next drop is then seen a little
        // smaller, no more.
        self.high.store(open, Ordering::Relaxed);
        true
    }
}

#[async_trait]
impl BackgroundService for MemoryTrim {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut every = tokio::time::interval(TRIM_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = shutdown.changed() => return,
            }
            if self.due()
                && cfg!(any(
                    all(target_os = "linux", target_env = "gnu"),
                    feature = "jemalloc"
                ))
            {
                // This service has its runtime thread to itself: blocking it blocks nobody.
                let trimmed = malloc_trim();
                self.trims.inc();
                tracing::debug!(target: "sluice::server", trimmed, "memory handed back after connections closed");
            }
        }
    }
}

/// With the `jemalloc` allocator: purges the unused dirty pages of every arena
/// (`arena.<MALLCTL_ARENAS_ALL>.purge`), which jemalloc's own decay only does when the process
/// allocates (docs/benchmarks.md). True if the purge ran.
#[cfg(feature = "jemalloc")]
fn malloc_trim() -> bool {
    // MALLCTL_ARENAS_ALL is 4096 in jemalloc 5.
    const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
    // SAFETY: a NUL-terminated name and no old or new value, as the purge command takes.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        ) == 0
    }
}

/// glibc's `malloc_trim(0)`: true if memory was handed back.
#[cfg(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc")))]
fn malloc_trim() -> bool {
    // SAFETY: malloc_trim takes no pointer and may be called at any time from any thread.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(any(all(target_os = "linux", target_env = "gnu"), feature = "jemalloc")))]
fn malloc_trim() -> bool {
    false
}

/// One connection in its TLS handshake, counted until dropped.
struct Handshaking(Arc<AtomicUsize>);

impl Drop for Handshaking {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One open client connection, counted until dropped.
struct Slot {
    open: Arc<AtomicUsize>,
    gauge: IntGauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        self.gauge.dec();
    }
}

// For Pingora's proxy app only, not any `HttpServerApp`: each request is awaited through its
// unboxed entry point (third_party/PATCHES.md, "unboxed request future"), so that a request
// costs no allocation and no memcpy of its whole future, as the boxed trait method would.
#[async_trait]
impl<SV> ServerApp for LimitedApp<HttpProxy<SV>>
where
    SV: ProxyHttp + Send + Sync + 'static,
    <SV as ProxyHttp>::CTX: Send + Sync,
{
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let acceptor = self.acceptor_for(&stream);
        // Handshakes have a share of the cap of their own, so that connections that never
        // finish theirs cannot take the slots of everyone else.
        let handshaking = match acceptor {
            Some(_) => match self.take_handshake() {
                Some(h) => Some(h),
                None => {
                    self.refuse_handshake(stream).await;
                    return None;
                }
            },
            None => None,
        };
        let Some(slot) = self.take_slot() else {
            self.refuse(stream, acceptor.is_some()).await;
            return None;
        };
        // A client that sends nothing is idle; one whose head (here: handshake) is slow is
        // late. A handshake bounded by both, as the first bytes of a plain connection are.
        let within = self.limits.idle_timeout.min(self.limits.header_timeout);
        let mut stream = match acceptor {
            Some(acceptor) => {
                let done = tokio::time::timeout(within, tls_handshake(&acceptor, stream)).await;
                drop(handshaking);
                match done {
                    Ok(Some(stream)) => stream,
                    // A failed handshake (not TLS, a bad client hello, a client that left):
                    // rustls has said why to the client, if it could.
                    Ok(None) => return None,
                    Err(_) => {
                        self.closed_head.inc();
                        return None;
                    }
                }
            }
            None => stream,
        };
        let mut first = Vec::new();
        if let Some(tunnels) = &self.tunnels {
            // A tunnel holds its connection slot (`slot` lives to the end of this function)
            // for as long as it is open. A new connection that sends nothing is idle.
            let within = self.limits.idle_timeout.min(self.limits.header_timeout);
            match crate::tunnel::first_bytes(&mut stream, within).await {
                First::Connect(bytes) => {
                    tunnels.serve(stream, bytes).await;
                    return None;
                }
                First::Other(bytes) => first = bytes,
                // A client that connects and leaves is no idle connection of ours to count.
                First::Left => return None,
                First::Idle => {
                    self.closed_idle.inc();
                    return None;
                }
            }
        }
        let stream = LimitedStream::new(stream, slot, self, first);
        let phase = stream.phase.clone();
        let mut session = ServerSession::new_http1(Box::new(stream));
        // Pingora's own keep-alive timer is per read; sluice's idle timer is the one that
        // counts, and this one only backs it up.
        session.set_keepalive(if *shutdown.borrow() {
            None
        } else {
            Some(self.limits.idle_timeout.as_secs().max(1) + 1)
        });
        session.set_keepalive_reuses_remaining(
            self.inner
                .server_options()
                .and_then(|o| o.keepalive_request_limit),
        );
        // Answer pipelined requests one after the other (RFC 9112 §9.3.2) instead of closing
        // the connection after the first answer and dropping the rest, Pingora's default.
        session.set_pipelining_enabled(true);
        let mut result = self.inner.process_new_http_unboxed(session, shutdown).await;
        while let Some((stream, settings)) = result.map(|r| r.consume()) {
            phase.store(WAITING, Ordering::Release);
            let mut session = ServerSession::new_http1(stream);
            if let Some(settings) = settings {
                settings.apply_to_session(&mut session);
            }
            result = self.inner.process_new_http_unboxed(session, shutdown).await;
        }
        None
    }

    async fn cleanup(&self) {
        self.inner.http_cleanup().await;
    }
}

/// A client connection that runs sluice's idle and header timers, and holds its slot of the
/// connection count until it is dropped.
pub struct LimitedStream {
    inner: Stream,
    /// Bytes read off `inner` before it was wrapped, replayed first; `first_at` of them are
    /// served already.
    first: Vec<u8>,
    first_at: usize,
    phase: Arc<AtomicU8>,
    /// The phase `timer` was armed for.
    armed: u8,
    /// One timer per connection (no allocation per request). It is not re-armed at each phase
    /// change: a phase change only sets `deadline`, and the timer is moved only when a read is
    /// about to wait and the timer would ring after `deadline`, or when it rang before it.
    /// On a keep-alive connection the timer then stays put across requests (each phase change
    /// used to re-arm it: twice per request, a timer-wheel removal and insertion each).
    timer: Pin<Box<Sleep>>,
    /// When the current phase's limit runs out.
    deadline: tokio::time::Instant,
    /// Whether `deadline` counts for the current phase.
    timing: bool,
    idle_timeout: Duration,
    header_timeout: Duration,
    closed_idle: IntCounter,
    closed_head: IntCounter,
    _slot: Slot,
}

impl std::fmt::Debug for LimitedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimitedStream")
            .field("inner", &self.inner)
            .field("phase", &self.phase)
            .finish()
    }
}

impl LimitedStream {
    /// `first`: bytes already read off `inner` (to look for a CONNECT), served first.
    fn new<A>(inner: Stream, slot: Slot, app: &LimitedApp<A>, first: Vec<u8>) -> LimitedStream {
        // Bytes already read are the start of a head: its deadline runs from now.
        let phase = if first.is_empty() { WAITING } else { IN_HEAD };
        LimitedStream {
            inner,
            first,
            first_at: 0,
            phase: Arc::new(AtomicU8::new(phase)),
            armed: UNARMED,
            timer: Box::pin(tokio::time::sleep(app.limits.idle_timeout)),
            deadline: tokio::time::Instant::now() + app.limits.idle_timeout,
            timing: false,
            idle_timeout: app.limits.idle_timeout,
            header_timeout: app.limits.header_timeout,
            closed_idle: app.closed_idle.clone(),
            closed_head: app.closed_head.clone(),
            _slot: slot,
        }
    }

    /// Sets the deadline of the current phase when the phase changed since it was last set.
    fn follow_phase(&mut self) {
        let phase = self.phase.load(Ordering::Acquire);
        if phase == self.armed {
            return;
        }
        self.armed = phase;
        let limit = match phase {
            WAITING => Some(self.idle_timeout),
            IN_HEAD => Some(self.header_timeout),
            _ => None,
        };
        self.timing = limit.is_some();
        if let Some(limit) = limit {
            self.deadline = tokio::time::Instant::now() + limit;
        }
    }

    /// Whether the current phase's deadline has passed, given that the timer rang: a timer
    /// that rang early (set for an earlier deadline) is moved to the current one.
    fn rang_and_due(&mut self) -> bool {
        if tokio::time::Instant::now() >= self.deadline {
            return true;
        }
        let deadline = self.deadline;
        self.timer.as_mut().reset(deadline);
        false
    }

    /// Before a read waits: the timer must ring no later than the deadline. Ready with the
    /// expiry when it is due.
    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.timer.deadline() > self.deadline {
            let deadline = self.deadline;
            self.timer.as_mut().reset(deadline);
        }
        // A timer moved by `rang_and_due` is polled again, so that it wakes this task.
        while self.timer.as_mut().poll(cx).is_ready() {
            if self.rang_and_due() {
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }

    /// What a read returns once the current phase's timer has fired: end of stream for an idle
    /// connection (Pingora then closes it quietly), an error for a head that is late.
    fn expired(&mut self) -> io::Result<()> {
        self.timing = false;
        if self.armed == WAITING {
            self.closed_idle.inc();
            Ok(())
        } else {
            self.closed_head.inc();
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the request head did not arrive within limits.header_timeout",
            ))
        }
    }
}

impl AsyncRead for LimitedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.first_at < this.first.len() {
            let n = buf.remaining().min(this.first.len() - this.first_at);
            buf.put_slice(&this.first[this.first_at..this.first_at + n]);
            this.first_at += n;
            if this.first_at == this.first.len() {
                this.first = Vec::new();
                this.first_at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        this.follow_phase();
        // Checked before reading too: a client that trickles bytes keeps every read ready.
        if this.timing && this.timer.is_elapsed() && this.rang_and_due() {
            return Poll::Ready(this.expired());
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before
                    && this
                        .phase
                        .compare_exchange(WAITING, IN_HEAD, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    // The first bytes of a head: the whole head must now arrive in time.
                    this.follow_phase();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                if this.timing && this.poll_deadline(cx).is_ready() {
                    Poll::Ready(this.expired())
                } else {
                    Poll::Pending
                }
            }
            other => other,
        }
    }
}

impl AsyncWrite for LimitedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[async_trait]
impl Shutdown for LimitedStream {
    async fn shutdown(&mut self) {
        Shutdown::shutdown(&mut *self.inner).await
    }
}

impl UniqueID for LimitedStream {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

// On a TLS listener the inner stream is Pingora's rustls stream, already past its handshake:
// its digest is passed on; `get_ssl` (an OpenSSL handle) keeps its default, None, as with rustls.
impl Ssl for LimitedStream {
    fn get_ssl_digest(&self) -> Option<Arc<pingora::protocols::tls::SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for LimitedStream {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for LimitedStream {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest)
    }
}

impl GetSocketDigest for LimitedStream {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest)
    }
}

#[async_trait]
impl Peek for LimitedStream {
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_is_due_only_after_a_large_drop_and_once_per_drop() {
        let trim = MemoryTrim {
            open: Arc::new(AtomicUsize::new(0)),
            high: Arc::new(AtomicUsize::new(0)),
            trims: IntCounter::new("t", "t").unwrap(),
        };
        let (open, high) = (trim.open.clone(), trim.high.clone());
        let set = |now: usize, peak: usize| {
            open.store(now, Ordering::Relaxed);
            high.fetch_max(peak, Ordering::Relaxed);
        };
        // A steady load, however large: no trim.
        set(5000, 5000);
        assert!(!trim.due());
        // A small drop: none either.
        set(5000 - TRIM_AFTER_CLOSED + 1, 5000);
        assert!(!trim.due());
        // A slow decline adds up.
        set(5000 - TRIM_AFTER_CLOSED, 5000);
        assert!(trim.due());
        assert!(!trim.due());
        // 5,000 came and went: one trim, then none until the count rises and falls again.
        set(0, 5000);
        assert!(trim.due());
        assert!(!trim.due());
        set(0, TRIM_AFTER_CLOSED);
        assert!(trim.due());
    }
}
