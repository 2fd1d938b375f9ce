//! The client's address: the connection's own, unless the connection comes from one of
//! `clients.trusted_proxies` (load balancers in front of sluice). From those, and only from
//! those:
//! - a PROXY protocol header (v1 or v2) that opens the connection names the client; it is read
//!   here, in the connection layer, before TLS and HTTP ([`read_proxy_header`]), and the
//!   connection's peer address becomes the one it names, for every request and tunnel on it;
//! - otherwise each request's `X-Forwarded-For` names it: its last hop that is not itself a
//!   trusted proxy ([`TrustedProxies::client_ip`]), since every hop to the right of that was
//!   appended by a proxy sluice trusts, and anything to the left the client could write.
//!
//! From any other peer neither is read: a PROXY header is then the start of a bad request, and
//! `X-Forwarded-For` only a header passed on.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ppp::PartialResult;
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::config::Cidr;

/// The longest PROXY header read: a v1 header is at most 107 bytes; a v2 header carries its
/// addresses and the load balancer's TLVs (a cloud endpoint id, a TLS version), far less than
/// this. A longer one closes the connection.
pub const MAX_PROXY_HEADER: usize = 1024;

/// `clients.trusted_proxies`, as matched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrustedProxies<'a>(pub &'a [Cidr]);

impl TrustedProxies<'_> {
    /// Whether there is none (the common case: no address is read from the connection).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `ip` is one of them. An IPv4-mapped IPv6 address is its IPv4 address, as a
    /// dual-stack listener reports IPv4 peers.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.0.iter().any(|net| net.0.contains(&ip))
    }

    /// The client address of a request from `peer` (the connection's address, which a PROXY
    /// header has already replaced) carrying the `X-Forwarded-For` values `forwarded_for`, in
    /// the order they came: `peer` itself unless it is trusted; else the rightmost hop that is
    /// not trusted. Walking right to left stops at a hop that does not parse (nothing left of
    /// it can be told apart from what the client wrote), and then, as when every hop is
    /// trusted, the address is the leftmost trusted hop seen.
    pub fn client_ip<'v, I>(&self, peer: IpAddr, forwarded_for: I) -> IpAddr
    where
        I: DoubleEndedIterator<Item = &'v [u8]>,
    {
        if self.is_empty() || !self.contains(peer) {
            return peer;
        }
        let mut client = peer;
        for value in forwarded_for.rev() {
            for hop in value.rsplit(|&b| b == b',') {
                let Some(ip) = parse_hop(hop) else {
                    return client;
                };
                client = ip;
                if !self.contains(ip) {
                    return ip;
                }
            }
        }
        client
    }
}

/// One `X-Forwarded-For` hop: an address, bracketed or not, with or without a port.
fn parse_hop(hop: &[u8]) -> Option<IpAddr> {
    let hop = std::str::from_utf8(hop).ok()?.trim();
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(sa) = hop.parse::<SocketAddr>() {
        return Some(sa.ip());
    }
    hop.strip_prefix('[')?.strip_suffix(']')?.parse().ok()
}

/// What opened a connection from a trusted proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyHeader {
    /// No PROXY header: the bytes read are the start of the connection's own traffic.
    Absent,
    /// A header naming the client's address.
    Client(SocketAddr),
    /// A header that names no client (v2 `LOCAL`, as a load balancer's health check sends,
    /// v1 `UNKNOWN`, or an address family that is no IP): the connection's own address stands.
    Unaddressed,
    /// A header that does not parse, or is longer than [`MAX_PROXY_HEADER`].
    Invalid,
    /// The peer closed the connection, or the read failed, before the header was whole.
    Left,
    /// Part of a header, and not the rest within the time allowed.
    Late,
    /// Nothing at all within the time allowed.
    Idle,
}

/// Reads the PROXY header that may open `stream`, within `within`: what it says, and the bytes
/// read past it (all of them, when there is none), which the caller puts back in front of the
/// stream.
pub async fn read_proxy_header<S>(stream: &mut S, within: Duration) -> (ProxyHeader, Vec<u8>)
where
    S: AsyncRead + Unpin + ?Sized,
{
    let mut buf = Vec::with_capacity(256);
    let read = async {
        loop {
            if let Some(done) = parse_proxy_header(&buf) {
                return done;
            }
            // Never more than the bound, however much the peer has sent.
            let room = MAX_PROXY_HEADER + 1 - buf.len();
            let mut chunk = (&mut *stream).take(room as u64);
            match chunk.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return (ProxyHeader::Left, 0),
                Ok(_) => {}
            }
        }
    };
    match tokio::time::timeout(within, read).await {
        Ok((header, used)) => {
            let rest = match header {
                ProxyHeader::Absent | ProxyHeader::Client(_) | ProxyHeader::Unaddressed => {
                    buf.split_off(used)
                }
                _ => Vec::new(),
            };
            (header, rest)
        }
        Err(_) if buf.is_empty() => (ProxyHeader::Idle, Vec::new()),
        Err(_) => (ProxyHeader::Late, Vec::new()),
    }
}

/// What `buf` opens with, and how many of its bytes that took; None while more bytes could
/// change the answer.
pub fn parse_proxy_header(buf: &[u8]) -> Option<(ProxyHeader, usize)> {
    const V1: &[u8] = b"PROXY ";
    // The longest v1 line, CRLF included.
    const V1_MAX: usize = 107;
    let v2 = ppp::v2::PROTOCOL_PREFIX;
    let could_be = |prefix: &[u8]| {
        let n = buf.len().min(prefix.len());
        buf[..n] == prefix[..n]
    };
    if buf.is_empty() {
        return None;
    }
    if could_be(v2) {
        let header = ppp::v2::Header::try_from(buf);
        if let Err(ppp::v2::ParseError::Partial(_, length)) = &header {
            if 16 + length > MAX_PROXY_HEADER {
                return Some((ProxyHeader::Invalid, 0));
            }
        }
        if header.is_incomplete() {
            return None;
        }
        let Ok(header) = header else {
            return Some((ProxyHeader::Invalid, 0));
        };
        let used = header.len();
        if header.command == ppp::v2::Command::Local {
            return Some((ProxyHeader::Unaddressed, used));
        }
        let client = match header.addresses {
            ppp::v2::Addresses::IPv4(a) => SocketAddr::from((a.source_address, a.source_port)),
            ppp::v2::Addresses::IPv6(a) => SocketAddr::from((a.source_address, a.source_port)),
            _ => return Some((ProxyHeader::Unaddressed, used)),
        };
        return Some((ProxyHeader::Client(client), used));
    }
    if could_be(V1) {
        // A v1 line ends with CRLF: parsed before that, a port cut short by the read would
        // parse as a bad one.
        if !buf.contains(&b'\n') && buf.len() < V1_MAX {
            return None;
        }
        let header = ppp::v1::Header::try_from(buf);
        if header.is_incomplete() && buf.len() < V1_MAX {
            return None;
        }
        let Ok(header) = header else {
            return Some((ProxyHeader::Invalid, 0));
        };
        let used = header.header.len();
        let client = match header.addresses {
            ppp::v1::Addresses::Tcp4(a) => SocketAddr::from((a.source_address, a.source_port)),
            ppp::v1::Addresses::Tcp6(a) => SocketAddr::from((a.source_address, a.source_port)),
            ppp::v1::Addresses::Unknown => return Some((ProxyHeader::Unaddressed, used)),
        };
        return Some((ProxyHeader::Client(client), used));
    }
    Some((ProxyHeader::Absent, 0))
}

#[cfg(test)]
#[path = "address/tests.rs"]
mod tests;
