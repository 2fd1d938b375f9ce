//! A trusted load balancer's PROXY protocol header, read first on its connections: before the
//! TLS handshake (the header comes before TLS) and before the first request or CONNECT. The
//! client address it names becomes the connection's peer address, so that everything reading
//! it (identification, the throttle, the access log's `client`, `X-Forwarded-For` upstream)
//! sees the client, not the balancer. `crate::clients::address` says which peers are trusted
//! and how a header is parsed.

use std::os::fd::AsRawFd;
use std::time::Duration;

use pingora::protocols::l4::socket::SocketAddr as PeerAddr;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::{GetSocketDigest, SocketDigest, Stream};

use super::LimitedApp;
use crate::clients::address::{read_proxy_header, ProxyHeader, TrustedProxies};

impl<A> LimitedApp<A> {
    /// `stream`, past the PROXY header that opens it when its peer is a trusted proxy, with
    /// the client's address as its peer address; the bytes read past the header are put back.
    /// None when the connection is to be closed: a header that does not parse, a peer that
    /// leaves or stalls in the middle of one. A peer that is not trusted is not read from: a
    /// PROXY header from it is the start of a bad request, as any other garbage.
    pub(super) async fn past_proxy_header(
        &self,
        stream: Stream,
        within: Duration,
    ) -> Option<Stream> {
        let Some(table) = &self.table else {
            return Some(stream);
        };
        let trusted = {
            let peer = stream
                .get_socket_digest()
                .and_then(|d| d.peer_addr().and_then(|a| a.as_inet()).map(|a| a.ip()));
            let table = table.load();
            let proxies = table
                .clients
                .as_ref()
                .map(|c| &c.config.trusted_proxies[..]);
            peer.zip(proxies)
                .is_some_and(|(peer, proxies)| TrustedProxies(proxies).contains(peer))
        };
        if !trusted || stream.as_any().downcast_ref::<L4Stream>().is_none() {
            return Some(stream);
        }
        let mut l4 = stream.into_any().downcast::<L4Stream>().ok()?;
        let (header, rest) = read_proxy_header(&mut *l4, within).await;
        match header {
            ProxyHeader::Absent | ProxyHeader::Unaddressed => {}
            ProxyHeader::Client(client) => {
                // A digest of its own, with the client as peer; the local address stays the
                // socket's (the listener it came in on decides TLS and more).
                let local = l4.get_socket_digest().and_then(|d| d.local_addr().cloned());
                let digest = SocketDigest::from_raw_fd(l4.as_raw_fd());
                let _ = digest.peer_addr.set(Some(PeerAddr::Inet(client)));
                if let Some(local) = local {
                    let _ = digest.local_addr.set(Some(local));
                }
                l4.set_socket_digest(digest);
            }
            ProxyHeader::Invalid => {
                self.closed_proxy_header.inc();
                tracing::debug!(target: "sluice::server", "closed a trusted proxy's connection: its PROXY header does not parse or is too long");
                return None;
            }
            ProxyHeader::Late => {
                self.closed_head.inc();
                return None;
            }
            ProxyHeader::Idle => {
                self.closed_idle.inc();
                return None;
            }
            ProxyHeader::Left => return None,
        }
        l4.rewind(&rest);
        Some(l4)
    }
}
