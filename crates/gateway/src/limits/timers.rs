//! The idle and header timers, run by the stream each client connection is wrapped in, since
//! only the stream sees when bytes arrive.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use pingora::protocols::http::ServerSession;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, ReadTimeout, Shutdown, SocketDigest,
    Ssl, Stream, TimingDigest, UniqueID, UniqueIDType, ALPN,
};
use prometheus::IntCounter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use super::{LimitedApp, Slot};

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
pub(super) const WAITING: u8 = 0;
/// The first bytes of a head have arrived; the header timer runs.
pub(super) const IN_HEAD: u8 = 1;
/// The head is parsed; sluice runs no timer of its own.
const IN_REQUEST: u8 = 2;
/// No timer armed yet.
const UNARMED: u8 = u8::MAX;

/// A client connection that runs sluice's idle and header timers, and holds its slot of the
/// connection count until it is dropped.
pub struct LimitedStream {
    inner: Stream,
    /// Bytes read off `inner` before it was wrapped, replayed first; `first_at` of them are
    /// served already.
    first: Vec<u8>,
    first_at: usize,
    pub(super) phase: Arc<AtomicU8>,
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
    pub(super) fn new<A>(
        inner: Stream,
        slot: Slot,
        app: &LimitedApp<A>,
        first: Vec<u8>,
    ) -> LimitedStream {
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

    /// Whether bytes read before the stream was made are still to be read.
    pub(super) fn replays(&self) -> bool {
        self.first_at < self.first.len()
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

/// A client connection's reads are timed by the timers above, not by Pingora's upstream read
/// timeout, so this stream leaves that to the caller.
impl ReadTimeout for LimitedStream {}
