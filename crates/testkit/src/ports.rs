//! Ports for the servers a test starts (gateways, Redis nodes, origins it must name before they
//! run).
//!
//! The usual trick, bind port 0 and release it, races: the kernel hands the same port out again
//! as the ephemeral port of the next `bind(0)` or of an outgoing connection (a test's client, a
//! gateway's upstream connection) before the server that was meant to have it binds it. The
//! server then fails to bind, and worse, a test that waits for "the port accepts" talks to
//! whoever took it. A soak run of the suite hit exactly that.
//!
//! So ports are handed out from a band *below* the kernel's ephemeral range, which neither
//! `bind(0)` nor outgoing connections ever use, by a counter, so that no two callers in one
//! process get the same port; each is checked free with a bind when handed out. The band's
//! starting point depends on the process id, so that two test processes running at once (other
//! checkouts) rarely walk the same ports. Where the ephemeral range leaves no room for the
//! band, it falls back to `bind(0)`.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

use socket2::{Domain, Socket, Type};

/// The band: ports `BASE .. BASE + SPAN`; Redis Cluster bus ports (+10000) land in the
/// `SPAN` ports above it, so the two never meet.
const BASE: u32 = 12_000;
const SPAN: u32 = 10_000;
const BUS_OFFSET: u16 = 10_000;

/// Whether the band is clear of the ephemeral range, which starts at `BASE + SPAN + SPAN` or
/// later on Debian and most distributions (32768).
fn band_usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range");
        let low = range.ok().and_then(|r| {
            r.split_whitespace()
                .next()
                .and_then(|l| l.parse::<u32>().ok())
        });
        low.is_some_and(|low| low >= BASE + 2 * SPAN)
    })
}

fn counter() -> &'static AtomicU32 {
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    NEXT.get_or_init(|| AtomicU32::new(std::process::id().wrapping_mul(2_654_435_761) % SPAN))
}

fn free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A port nobody in this process was handed before; with `bus`, its Redis Cluster bus port
/// (`port + 10000`) is free too.
pub(crate) fn reserve(bus: bool) -> u16 {
    if band_usable() {
        for _ in 0..SPAN {
            let port = (BASE + counter().fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
            if free(port) && (!bus || free(port + BUS_OFFSET)) {
                return port;
            }
        }
    }
    // No band: the kernel's choice, with its race. Cluster bus ports need the band.
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind 127.0.0.1:0")
            .port();
        if !bus || port.checked_add(BUS_OFFSET).is_some_and(free) {
            return port;
        }
    }
}

/// A port on 127.0.0.1 that refuses connections for as long as this process runs.
///
/// A port that was merely free a moment ago is not enough for a test of a dead member: another
/// test process's server, or an outgoing connection's ephemeral port, may take it, and then
/// the "dead" member answers. So the port is bound by a socket that never listens and is kept
/// to the end of the process: nothing else can bind it, and the kernel answers a connection to
/// it with a reset, at once, as it does for any port nothing listens on.
pub(crate) fn refused() -> u16 {
    static HELD: Mutex<Vec<Socket>> = Mutex::new(Vec::new());
    loop {
        let port = reserve(false);
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("a TCP socket");
        if socket
            .bind(&SocketAddr::from(([127, 0, 0, 1], port)).into())
            .is_ok()
        {
            HELD.lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(socket);
            return port;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_and_free() {
        let ports: Vec<u16> = (0..50).map(|i| reserve(i % 5 == 0)).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        for p in ports {
            assert!(free(p), "port {p} was handed out but is taken");
        }
    }

    #[test]
    fn a_refused_port_refuses_and_cannot_be_taken() {
        let port = refused();
        let err = std::net::TcpStream::connect(("127.0.0.1", port)).expect_err("nothing listens");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
        assert!(
            !free(port),
            "the port stays bound, so no server can take it"
        );
    }
}
