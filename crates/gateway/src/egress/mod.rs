//! The egress guard: may sluice connect to a destination the *client* chose (SPEC §7)?
//!
//! A `direct` member, or a CONNECT, sends traffic wherever the client says. Without a guard an
//! internal client could reach anything the gateway can: its loopback services, the cloud
//! metadata endpoint at 169.254.169.254, the private network behind it. This module decides,
//! and knows nothing of Pingora; the tunnel and proxy code call it.
//!
//! - [`Guard`] (from the config) classifies one address: [`Guard::check_ip`]; one address and
//!   port, which must not be sluice's own listener either: [`Guard::check_addr`]; and one
//!   CONNECT port: [`Guard::check_connect_port`].
//! - [`Resolver::resolve_checked`] resolves a client-chosen destination and checks every
//!   address it finds. The resolver itself is [`crate::resolve`]'s, shared with member DNS; it
//!   is re-exported here for the callers that check what they resolve.
//!
//! The guard's rules (what `private` denies, the precedence of `allow_cidrs`, sluice's own
//! listeners) are told with it, in `egress/guard.rs`.
//!
//! # Names
//!
//! A name is resolved to *all* its addresses (A and AAAA), and refused if *any* of them is
//! denied: whoever controls the name's DNS can mix a public address with a private one, and
//! which one a connection ends up using is not something to bet on. The addresses that passed
//! are returned, and the caller connects to exactly those: resolving again to connect would let
//! a DNS answer with a short TTL change between the check and the connection (DNS rebinding).

mod guard;

use std::fmt;
use std::net::SocketAddr;

use crate::resolve::LookupError;

pub use crate::resolve::Resolver;
pub use guard::{
    embedded, Allowed, Class, Denial, Embedded, Form, Guard, PortDenied, Range, Rule, V4_CLASSES,
    V6_CLASSES,
};

/// Why a client-chosen destination was refused by [`Resolver::resolve_checked`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// One of its addresses is denied (SPEC §7: 403 `destination_denied`).
    Denied(Denial),
    /// It has no address.
    NoAddresses {
        /// The name.
        host: String,
    },
    /// It could not be resolved.
    LookupFailed {
        /// The name.
        host: String,
        /// The resolver's message.
        message: String,
    },
}

impl From<LookupError> for Refusal {
    fn from(e: LookupError) -> Self {
        match e {
            LookupError::NoAddresses { host } => Refusal::NoAddresses { host },
            LookupError::Failed { host, message } => Refusal::LookupFailed { host, message },
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Denied(d) => write!(f, "destination denied: {d}"),
            Refusal::NoAddresses { host } => write!(f, "{host} has no IP address"),
            Refusal::LookupFailed { host, message } => {
                write!(f, "cannot resolve {host}: {message}")
            }
        }
    }
}

impl std::error::Error for Refusal {}

/// The most checked addresses of one client-chosen destination that one attempt connects to,
/// in the resolver's order, each after the one before failed to connect (refused, unreachable,
/// or no answer within the route's `connect_timeout`): a name with an IPv6 and an IPv4 address,
/// or two A records of which the first is down, still works, as with curl. Bounded so that a
/// name with many dead addresses costs at most this many connect timeouts.
pub const MAX_ADDRESSES_TRIED: usize = 4;

// The resolver belongs to `crate::resolve`, which knows nothing of the guard; checking what it
// finds is the guard's business, so that method is here.
impl Resolver {
    /// The addresses to connect to for a client-chosen `host:port`: every address of `host`,
    /// refused if *any* of them is denied ([`Guard::check_addr`]: sluice's own listeners
    /// included). Connect to these, and only these: resolving again
    /// would let the name's owner answer differently the second time. An IP literal is checked
    /// without any lookup. The CONNECT port is checked apart, by
    /// [`Guard::check_connect_port`].
    pub async fn resolve_checked(
        &self,
        guard: &Guard,
        host: &str,
        port: u16,
    ) -> Result<Vec<SocketAddr>, Refusal> {
        let lookup = self.lookup(host).await?;
        lookup
            .addrs
            .into_iter()
            .map(|ip| {
                let addr = SocketAddr::new(ip, port);
                guard
                    .check_addr(addr)
                    .map(|_| addr)
                    .map_err(Refusal::Denied)
            })
            .collect()
    }
}

/// The reason a client is given for a denied `host`: the rule, and the name when the client
/// gave one (`localhost: 127.0.0.1 is loopback (RFC 1122)`), never more.
pub fn describe(host: &str, denial: &Denial) -> String {
    match crate::resolve::literal(host) {
        Some(_) => denial.to_string(),
        None => format!("{host}: {denial}"),
    }
}

#[cfg(test)]
mod tests;
