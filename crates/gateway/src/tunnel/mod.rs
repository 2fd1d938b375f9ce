//! CONNECT tunnels (SPEC §7), the transport half: what `HTTPS_PROXY` clients send for every
//! `https://` URL. A tunnel takes the same steps as any request, on the request path
//! ([`crate::request::Tunnels`]); what lives here is what only a tunnel does with bytes:
//! - [`first_bytes`]: a peek at a new connection's first bytes, to tell a CONNECT from
//!   anything else;
//! - [`head`]: reading the CONNECT head, and writing sluice's answer to it;
//! - [`open`]: opening the member side (the member itself, the client's target for a `direct`
//!   member after the egress guard, or a CONNECT through a `proxy` member);
//! - [`carry`]: moving the bytes both ways until both sides close, one fails, or
//!   `read_timeout` passes with no byte either way.
//!
//! Why this does not live in Pingora's proxy: Pingora 0.9 cannot hand a ProxyHttp hook the raw
//! downstream connection. `allow_connect_method_proxying` only forwards a CONNECT as if it were
//! a plain request (to a member that would have to tunnel it itself), and Pingora has no
//! upstream CONNECT through a TCP forward proxy (cloudflare/pingora#224, #290; its
//! `HttpPeer.proxy` is a Unix socket). So the listening service's app
//! ([`crate::limits::LimitedApp`]) peeks at the first bytes of each new connection, gives a
//! CONNECT to the request path's tunnel flavour, and hands anything else to Pingora's
//! `HttpProxy` with the [`Gateway`](crate::request::Gateway) hooks, unchanged.
//!
//! The peek is a real read: Pingora's own TCP stream reads the 8 bytes and rewinds them (the
//! way it peeks for the h2c preface), so a plain request reaches Pingora byte for byte, through
//! no wrapper, and the plain-HTTP path pays one small read and nothing per later read.
//!
//! Only a CONNECT that opens its connection becomes a tunnel. One sent later on a kept-alive
//! connection reaches Pingora, which owns the connection by then, and is refused with `405`
//! and an `Allow` header; clients retry on a new connection. curl, Python, Node and Go
//! clients always open a new connection for a CONNECT.

pub(crate) mod head;
pub(crate) mod open;
mod pump;
#[cfg(target_os = "linux")]
mod splice;

use std::time::Duration;

use pingora::protocols::Stream;

pub(crate) use pump::{Counters, Pumped};

/// How a new connection starts.
pub enum First {
    /// With a CONNECT; the bytes read so far.
    Connect(Vec<u8>),
    /// With anything else; the bytes read so far, to replay in front of the stream.
    Other(Vec<u8>),
    /// The client closed (or the read failed) before sending anything decisive.
    Left,
    /// Nothing decisive arrived in the time allowed: an idle connection.
    Idle,
}

/// The first bytes of a new connection, and whether they open a CONNECT. Reads until the
/// bytes can no longer be the start of `CONNECT ` (one read, for nearly every request) or are
/// it; the caller replays them in front of the stream.
pub async fn first_bytes(stream: &mut Stream, within: Duration) -> First {
    use tokio::io::AsyncReadExt;
    const CONNECT: &[u8] = b"CONNECT ";
    let read = async {
        let mut buf = Vec::with_capacity(1024);
        loop {
            match stream.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return First::Left,
                Ok(_) => {}
            }
            let n = buf.len().min(CONNECT.len());
            if buf[..n] != CONNECT[..n] {
                return First::Other(buf);
            }
            if n == CONNECT.len() {
                return First::Connect(buf);
            }
        }
    };
    tokio::time::timeout(within, read)
        .await
        .unwrap_or(First::Idle)
}

/// The connection cap's slots a spliced tunnel takes on top of its own: the cap counts two
/// descriptors a connection, and splicing adds five (a duplicate of the client socket and a
/// pipe each way), so three slots cover them.
#[cfg(target_os = "linux")]
pub(crate) const SPLICE_EXTRA_SLOTS: usize = 3;

/// Carries an open tunnel's bytes both ways until both sides close, one fails, or `idle`
/// passes with no byte either way: `early` (what the client sent right behind its CONNECT)
/// goes up first, then `upstream.early` (what the member side sent before it was handed over)
/// comes down. Both sides plain TCP: splice(2), with no copy through user space, when the
/// connection cap has [`SPLICE_EXTRA_SLOTS`] slots free for the descriptors splicing adds
/// (`extra_slots`, held while the tunnel lasts); else the copy loop.
pub(crate) async fn carry(
    client: &mut Stream,
    upstream: open::Upstream,
    early: &[u8],
    idle: Duration,
    counters: &Counters,
    extra_slots: Option<&crate::extra_slots::ExtraSlots>,
) -> Pumped {
    let mut early_up = early.to_vec();
    // None: too few slots free, so no splicing. Some: splice, holding the slots (if there is a
    // cap to share) until the tunnel ends, with this function.
    #[cfg(target_os = "linux")]
    let held = match extra_slots {
        Some(slots) => slots.take(SPLICE_EXTRA_SLOTS).map(Some),
        None => Some(None),
    };
    #[cfg(target_os = "linux")]
    let client_socket = held
        .is_some()
        .then(|| splice::client_socket(client, &mut early_up))
        .flatten();
    // Copied after all (a TLS client, splicing switched off, a client that sent too much at
    // once): the slots go back now, as a copied tunnel holds no more than a connection.
    #[cfg(target_os = "linux")]
    let _held = client_socket.is_some().then_some(held).flatten();
    #[cfg(not(target_os = "linux"))]
    let _ = extra_slots;
    #[cfg(not(target_os = "linux"))]
    let client_socket: Option<std::convert::Infallible> = None;
    match client_socket {
        #[cfg(target_os = "linux")]
        Some(socket) => {
            splice::pump(
                socket,
                upstream.stream,
                &early_up,
                &upstream.early,
                idle,
                counters,
            )
            .await
        }
        #[cfg(not(target_os = "linux"))]
        Some(never) => match never {},
        None => {
            pump::pump(
                client,
                upstream.stream,
                &early_up,
                &upstream.early,
                idle,
                counters,
            )
            .await
        }
    }
}
