//! The connection loop: Pingora's own HTTP/1 loop, run here so that each connection takes its
//! slot, its TLS handshake and its timers first (the module's doc, in limits/mod.rs, says why).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, ServerApp};
use pingora::listeners::tls::Acceptor;
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::Stream;
use pingora::proxy::{HttpProxy, ProxyHttp};
use pingora::server::ShutdownWatch;

use super::timers::{LimitedStream, WAITING};
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
