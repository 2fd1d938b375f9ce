//! The connection loop: Pingora's own HTTP/1 loop, run here so that each connection takes its
//! slot, its TLS handshake and its timers first (the module's doc, in limits/mod.rs, says why).

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;

use async_trait::async_trait;
use bytes::BytesMut;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream, ServerApp};
use pingora::listeners::tls::Acceptor;
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::Stream;
use pingora::proxy::{HttpProxy, ProxyHttp};
use pingora::server::ShutdownWatch;
use tokio::io::AsyncReadExt;

use super::timers::{LimitedStream, IN_HEAD, WAITING};
use super::LimitedApp;
use crate::tunnel::First;

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
        // A trusted load balancer's PROXY header comes first, before TLS, within the same time.
        let stream = self.past_proxy_header(stream, within).await?;
        let mut stream = match acceptor {
            Some(acceptor) => {
                // Boxed, as the tunnel below: what waits for a request is no larger than that
                // wait needs, whatever a handshake or a tunnel takes while it lasts.
                let handshake = Box::pin(tls_handshake(&acceptor, stream));
                let done = tokio::time::timeout(within, handshake).await;
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
                    let header_timeout = self.limits.header_timeout;
                    if Box::pin(tunnels.serve(stream, bytes, header_timeout)).await {
                        self.closed_head.inc();
                    }
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
        // Bytes already read (to look for a CONNECT) are replayed by the stream itself.
        let mut waiting = !stream.replays();
        let mut stream: Stream = Box::new(stream);
        let mut settings: Option<HttpPersistentSettings> = None;
        let mut head = None;
        let mut reused = false;
        loop {
            // A connection that waits for its next request holds only this function's small
            // state and the stream: the head buffer is made once bytes are there, and Pingora's
            // request future (about 16 KiB) is made per request, in a box dropped when the
            // request ends. Waiting inside Pingora's `read_request` held both for the life of
            // every idle keep-alive connection.
            if waiting {
                head = Some(self.next_head(&mut stream).await?);
            }
            let mut session = ServerSession::new_http1(stream);
            if reused {
                if let Some(settings) = settings.take() {
                    settings.apply_to_session(&mut session);
                }
            } else {
                // Keep-alive without Pingora's own timer (0: no timeout): sluice waits for each
                // next request itself and times heads with its own idle and header timers.
                // Pingora's timer runs per read of a head, so a head slower than it but within
                // header_timeout would be dropped with no answer.
                session.set_keepalive(if *shutdown.borrow() { None } else { Some(0) });
                session.set_keepalive_reuses_remaining(
                    self.inner
                        .server_options()
                        .and_then(|o| o.keepalive_request_limit),
                );
                // Answer pipelined requests one after the other (RFC 9112 §9.3.2) instead of
                // closing the connection after the first answer and dropping the rest,
                // Pingora's default.
                session.set_pipelining_enabled(true);
            }
            // The first bytes read above, or those a pipelined request left behind, are where
            // Pingora's parser starts.
            if let Some(head) = head.take() {
                session.set_pipelined_prefix(head);
            }
            let result = boxed_in_place(|| request(self, session, shutdown)).await;
            let (next, next_settings) = result?.consume();
            stream = next;
            settings = next_settings;
            head = settings
                .as_mut()
                .and_then(|s| s.take_pipelined_prefix())
                .filter(|prefix| !prefix.is_empty());
            waiting = head.is_none();
            // Bytes of the next head already here start its header timer, as the first bytes
            // replayed on a new connection do: a client that sent part of a head and stalls is
            // cut at header_timeout, not kept for idle_timeout.
            phase.store(if waiting { WAITING } else { IN_HEAD }, Ordering::Release);
            reused = true;
        }
    }

    async fn cleanup(&self) {
        self.closing.close();
        self.inner.http_cleanup().await;
    }
}

/// Pingora's future for one request: many KiB, since it holds every state of the proxying.
/// What makes it is only a move of these arguments into its first state, inlined into
/// [`fill`], so that the arguments are written into the box and nothing else is copied.
#[inline(always)]
fn request<'a, SV>(
    app: &'a Arc<LimitedApp<HttpProxy<SV>>>,
    session: ServerSession,
    shutdown: &'a ShutdownWatch,
) -> impl Future<Output = Option<ReusedHttpStream>> + Send + 'a
where
    SV: ProxyHttp + Send + Sync + 'static,
    <SV as ProxyHttp>::CTX: Send + Sync,
{
    app.inner.process_new_http_unboxed(session, shutdown)
}

/// `make()`'s value in a new box, built in place: the box is allocated first and the value
/// written into it by [`fill`]. `Box::pin(make())` builds it on the stack and copies it into
/// the box, which for a request's future is a copy of many KiB per request (a `memcpy` of the
/// whole type, however little of it the first state uses).
fn boxed_in_place<F>(make: impl FnOnce() -> F) -> Pin<Box<F>> {
    let mut slot = Box::<F>::new_uninit();
    fill(&mut slot, make);
    // SAFETY: `fill` returns only once it has written the value; if `make` panics, the box is
    // dropped as the uninitialized memory it still is.
    Box::into_pin(unsafe { slot.assume_init() })
}

/// Writes `make()` into `slot`. Not inlined, so that `slot` is its own argument, with `make`
/// (a closure and the trivial constructors it calls) expected to be inlined into it: the value
/// is then built from its parts right in `slot`, which needs no elision of a copy across a
/// call. Writing the value from its caller, as `Box::write(box, make())`, left that elision to
/// the optimizer, which made it in the plain build but not in the profile-guided one: there
/// every request copied its whole future, about 16 KiB (docs/benchmarks.md, "Instructions per
/// request: what is left"). Inlining is still the optimizer's call: the disassembly of both
/// builds showed no such copy, and `scripts/profile` lists any copy of 4 KiB or more.
#[inline(never)]
fn fill<F>(slot: &mut std::mem::MaybeUninit<F>, make: impl FnOnce() -> F) {
    slot.write(make());
}

/// Room for the first read of a request head: Pingora's own first head buffer
/// (`INIT_HEADER_BUF_SIZE`), so that the reads after it go as they did.
const HEAD_BUF: usize = 4096;

impl<A> LimitedApp<A> {
    /// The first bytes of a connection's next request, in a head buffer made only when a read
    /// finds bytes there (one that has to wait frees it again). None when the connection ends
    /// instead: the client closed it, the idle timer did (the stream then reads an end of
    /// stream), a read failed, or the server is shutting down, which ends idle connections as
    /// Pingora's own wait for a head does (bytes already there are read first).
    async fn next_head(&self, stream: &mut Stream) -> Option<BytesMut> {
        let mut closing = pin!(self.closing.notified());
        let mut buf = BytesMut::new();
        let read = poll_fn(|cx| {
            if buf.capacity() == 0 {
                buf = BytesMut::with_capacity(HEAD_BUF);
            }
            match pin!(stream.read_buf(&mut buf)).poll(cx) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Ok(false)),
                Poll::Ready(Ok(_)) => return Poll::Ready(Ok(true)),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => buf = BytesMut::new(),
            }
            match self.closing.poll_closed(closing.as_mut(), cx) {
                Poll::Ready(()) => Poll::Ready(Ok(false)),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        match read {
            Ok(true) => Some(buf),
            Ok(false) => None,
            Err(e) => {
                // Dropped, not shut down: a TLS close_notify could wait forever on a client that
                // reads nothing, and no timer covers writes here. Pingora's own wait for a head
                // drops the stream as well.
                tracing::debug!(target: "sluice::server", error = %e, "reading a client's next request failed");
                None
            }
        }
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
