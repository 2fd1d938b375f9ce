//! Opening the member side of a tunnel, by member kind.

use std::fmt;
use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::config::{MemberKind, UpstreamConfig};
use crate::egress::{Denial, Guard, Refusal, Resolver, MAX_ADDRESSES_TRIED};
use crate::problem::ConnectFailure;
use crate::table::Member;
use crate::target::Target;

/// The most bytes of a proxy's answer to CONNECT that sluice reads.
const MAX_PROXY_HEAD: usize = 16 * 1024;

/// An open member side.
pub(crate) struct Upstream {
    pub(crate) stream: TcpStream,
    /// Bytes a proxy sent after its `200` head: they go down first.
    pub(crate) early: Bytes,
}

/// Why an attempt failed. Nothing of the client's was sent in any case.
pub(crate) struct Failure {
    /// A proxy answered our CONNECT with a non-2xx status (else: no connection).
    pub(crate) refused: bool,
    /// The egress guard refused the target (a `direct` member): nothing was contacted.
    pub(crate) denied: Option<Denial>,
    /// Why, as the client is told (`502 upstream_unreachable` lists each attempt's).
    pub(crate) reason: ConnectFailure,
    /// The failure says nothing about the member's health: a proxy that was reached and
    /// answered for the client's target. The client chooses the target, and an unreachable or
    /// refusing one must not let it eject every proxy of the route in turn.
    pub(crate) target_failed: bool,
    what: String,
}

impl Failure {
    fn unreachable(reason: ConnectFailure, what: impl Into<String>) -> Failure {
        Failure {
            refused: false,
            denied: None,
            reason,
            target_failed: false,
            what: what.into(),
        }
    }

    /// This failure, as the client's target's rather than the member's.
    fn of_target(self) -> Failure {
        Failure {
            target_failed: true,
            ..self
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)
    }
}

/// What the egress guard needs: the process's resolver and the current table's guard.
pub(crate) struct Egress<'a> {
    pub(crate) resolver: &'a Resolver,
    pub(crate) guard: &'a Guard,
}

/// Opens the member side of a tunnel to `target`:
/// - an origin: a connection to the member's own host and port;
/// - `direct`: a connection to the target, if the egress guard allows every address of it
///   (else a [`Failure`] with `denied`, before anything is contacted);
/// - `proxy`: a connection to the proxy, then `CONNECT target` through it, with the URL's
///   credentials as `Proxy-Authorization: Basic`; a non-2xx answer is a refusal.
pub(crate) async fn connect(
    member: &Member,
    target: &Target<'_>,
    up: &UpstreamConfig,
    egress: &Egress<'_>,
) -> Result<Upstream, Failure> {
    let port = target.port.unwrap_or(443);
    match &member.kind {
        MemberKind::Origin => {
            let stream = tcp(member_address(member)?, up).await?;
            Ok(Upstream {
                stream,
                early: Bytes::new(),
            })
        }
        MemberKind::Direct => {
            // The egress guard: every address of the target is checked, and only the checked
            // addresses are connected to, in order, the next after a connect failure, at most
            // MAX_ADDRESSES_TRIED of them (no second lookup: DNS rebinding).
            let lookup = egress
                .resolver
                .resolve_checked(egress.guard, &target.host, port);
            let addrs = match tokio::time::timeout(up.connect_timeout.0, lookup).await {
                Ok(Ok(addrs)) => addrs,
                Ok(Err(Refusal::Denied(denial))) => {
                    return Err(Failure {
                        refused: false,
                        denied: Some(denial),
                        reason: ConnectFailure::Other,
                        target_failed: true,
                        what: format!("destination denied: {denial}"),
                    })
                }
                Ok(Err(refusal)) => {
                    return Err(Failure::unreachable(
                        ConnectFailure::Dns,
                        refusal.to_string(),
                    ))
                }
                Err(_) => {
                    return Err(Failure::unreachable(
                        ConnectFailure::Dns,
                        "name lookup timed out",
                    ))
                }
            };
            let mut last = Failure::unreachable(
                ConnectFailure::Dns,
                format!("{} has no address", target.host),
            );
            for addr in addrs.into_iter().take(MAX_ADDRESSES_TRIED) {
                match tcp(addr, up).await {
                    Ok(stream) => {
                        return Ok(Upstream {
                            stream,
                            early: Bytes::new(),
                        })
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
        MemberKind::Proxy { authorization } => {
            let mut stream = tcp(member_address(member)?, up).await?;
            let authority = if target.host.contains(':') {
                format!("[{}]:{port}", target.host)
            } else {
                format!("{}:{port}", target.host)
            };
            let mut head = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n");
            if let Some(auth) = authorization {
                head.push_str("Proxy-Authorization: ");
                head.push_str(auth.to_str().unwrap_or_default());
                head.push_str("\r\n");
            }
            // `check` refuses headers on a proxy member: a key there would go wherever the
            // client's CONNECT points. sluice's own name goes on, so that a proxy chain that
            // leads back to this instance is caught.
            head.push_str("Via: ");
            head.push_str(crate::headers::via().to_str().unwrap_or_default());
            head.push_str("\r\n\r\n");
            let answer = async {
                stream.write_all(head.as_bytes()).await.map_err(|e| {
                    Failure::unreachable(reason_of(&e), format!("proxy write: {e}"))
                })?;
                proxy_answer(&mut stream).await
            };
            // The proxy connects to the target before it answers, so its answer gets the
            // route's read_timeout. A proxy that takes longer is most likely still trying a
            // target that does not answer: that is the target's failure, not the proxy's (one
            // that hangs for every target is found by its health check).
            let early = tokio::time::timeout(up.read_timeout.0, answer)
                .await
                .map_err(|_| {
                    Failure::unreachable(
                        ConnectFailure::TimedOut,
                        "the proxy did not answer CONNECT in time",
                    )
                    .of_target()
                })??;
            Ok(Upstream { stream, early })
        }
    }
}

/// The member's resolved address (origins and proxies).
fn member_address(member: &Member) -> Result<SocketAddr, Failure> {
    member.address().ok_or_else(|| {
        Failure::unreachable(ConnectFailure::Dns, "the member's host did not resolve")
    })
}

async fn tcp(addr: SocketAddr, up: &UpstreamConfig) -> Result<TcpStream, Failure> {
    match tokio::time::timeout(up.connect_timeout.0, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
        Ok(Err(e)) => Err(Failure::unreachable(
            reason_of(&e),
            format!("connect {addr}: {e}"),
        )),
        Err(_) => Err(Failure::unreachable(
            ConnectFailure::TimedOut,
            format!("connect {addr}: timed out"),
        )),
    }
}

/// Why a socket call failed, in the words the client is told.
fn reason_of(e: &std::io::Error) -> ConnectFailure {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => ConnectFailure::Refused,
        TimedOut => ConnectFailure::TimedOut,
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => ConnectFailure::Reset,
        HostUnreachable | NetworkUnreachable => ConnectFailure::NoRoute,
        _ => ConnectFailure::Other,
    }
}

/// Reads the proxy's answer head: the bytes after it when it is 2xx, a refusal otherwise.
async fn proxy_answer(stream: &mut TcpStream) -> Result<Bytes, Failure> {
    let mut buf = BytesMut::with_capacity(1024);
    loop {
        let n = stream
            .read_buf(&mut buf)
            .await
            .map_err(|e| Failure::unreachable(reason_of(&e), format!("proxy read: {e}")))?;
        if n == 0 {
            return Err(Failure::unreachable(
                ConnectFailure::Reset,
                "the proxy closed before answering CONNECT",
            ));
        }
        let mut fields = [httparse::EMPTY_HEADER; 64];
        let mut res = httparse::Response::new(&mut fields);
        match res.parse(&buf) {
            Ok(httparse::Status::Complete(len)) => {
                let status = res.code.unwrap_or(0);
                if (200..300).contains(&status) {
                    return Ok(buf.split_off(len).freeze());
                }
                // A 407 is the member's own credentials refused: its failure. Any other
                // refusal (403, 502, 503, 504...) is the proxy answering for the target.
                return Err(Failure {
                    refused: true,
                    denied: None,
                    reason: ConnectFailure::Other,
                    target_failed: status != 407,
                    what: format!("the proxy answered CONNECT with {status}"),
                });
            }
            Ok(httparse::Status::Partial) if buf.len() <= MAX_PROXY_HEAD => {}
            _ => {
                return Err(Failure::unreachable(
                    ConnectFailure::Other,
                    "the proxy's answer is not HTTP",
                ))
            }
        }
    }
}
