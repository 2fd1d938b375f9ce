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
//!   back to waiting for a request, and only the route's `read_timeout` bounds it;
//! - between requests a connection waits for the next one's first bytes here, in a small future
//!   of its own, not inside Pingora's request future: the head buffer and the request's state
//!   (many KiB) are made once bytes arrive, and dropped when the request ends, so an idle
//!   keep-alive connection holds little more than its socket (docs/benchmarks.md).
//!
//! [`MemoryTrim`] gives memory back to the system once many connections have closed: glibc's
//! malloc keeps what they freed, scattered between chunks still in use, and its own trimming only
//! releases the top of a heap (docs/benchmarks.md).
//!
//! Here: the limits, the app and its caps. The connection loop is in `serve.rs`, the stream
//! and its timers in `timers.rs`, the trimming in `trim.rs`, a trusted load balancer's PROXY
//! header in `proxy.rs`.

mod proxy;
mod serve;
#[cfg(test)]
mod tests;
mod timers;
mod trim;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use pingora::listeners::tls::{Acceptor, TlsSettings};
use pingora::protocols::{Shutdown, Stream};
use prometheus::{IntCounter, IntGauge};
use tokio::io::AsyncWriteExt;
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use crate::config::LimitsConfig;
use crate::extra_slots::ExtraSlots;
use crate::metrics::Metrics;
use crate::table::Table;

pub use timers::{head_parsed, LimitedStream};
pub use trim::MemoryTrim;

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
    /// Connections from a trusted proxy closed on a PROXY header that does not parse.
    closed_proxy_header: IntCounter,
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
    /// The table whose `clients.trusted_proxies` may open their connections with a PROXY
    /// header; None reads no header.
    table: Option<Arc<ArcSwap<Table>>>,
    /// Ends the idle connections' wait for a next request when the server shuts down.
    closing: Closing,
}

impl<A> LimitedApp<A> {
    /// Sends each connection that opens with a CONNECT to `tunnels`, which take extra slots of
    /// the cap for the descriptors a spliced tunnel adds ([`ExtraSlots`]).
    pub fn with_tunnels(mut self, tunnels: crate::request::Tunnels) -> LimitedApp<A> {
        self.tunnels = Some(tunnels.with_extra_slots(ExtraSlots::new(
            self.open.clone(),
            self.high.clone(),
            self.limits.max_connections,
        )));
        self
    }

    /// Reads the PROXY header that may open a connection from one of the current table's
    /// `clients.trusted_proxies`.
    pub fn with_trusted_proxies(mut self, table: Arc<ArcSwap<Table>>) -> LimitedApp<A> {
        self.table = Some(table);
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
            closed_proxy_header: closed("proxy_header"),
            refused: closed("max_connections"),
            refused_handshakes: closed("max_handshakes"),
            refusal_logged: AtomicU64::new(u64::MAX),
            handshake_refusal_logged: AtomicU64::new(u64::MAX),
            started: Instant::now(),
            tunnels: None,
            tls: Vec::new(),
            table: None,
            closing: Closing::default(),
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

/// Set once the server shuts down, with a wake-up for the connections waiting for a request.
/// Each connection that waits registers with a `Notify`, under that `Notify`'s lock: the
/// waiters are spread over shards by thread so that threads do not contend for one lock.
#[derive(Default)]
struct Closing {
    closed: AtomicBool,
    shards: [NotifyShard; CLOSING_SHARDS],
}

/// Shards of [`Closing`]: a power of two, at least as many as the threads usually run.
const CLOSING_SHARDS: usize = 16;

/// One shard on a cache line of its own, so that threads that use two neighbours do not share it.
#[derive(Default)]
#[repr(align(128))]
struct NotifyShard(Notify);

impl Closing {
    /// A wake-up at shutdown, registered with this thread's shard when first polled.
    fn notified(&self) -> Notified<'_> {
        static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static THREAD: usize = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
        }
        let shard = THREAD.with(|t| *t) % CLOSING_SHARDS;
        self.shards[shard].0.notified()
    }

    /// Ready once the server is shutting down. Polling `notified` registers it first, so that a
    /// shutdown is either seen in the flag or wakes this task.
    fn poll_closed(&self, notified: Pin<&mut Notified<'_>>, cx: &mut Context<'_>) -> Poll<()> {
        if notified.poll(cx).is_ready() || self.closed.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Shuts down: wakes every waiting connection, on every shard.
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for shard in &self.shards {
            shard.0.notify_waiters();
        }
    }
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
