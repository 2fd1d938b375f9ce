//! The demo's HTTPS: a TLS origin on `localhost:9443`, with a certificate made at start, and
//! a client that reaches it the way every `HTTPS_PROXY` client does: `CONNECT` through sluice,
//! then TLS end to end. sluice sees the target's name and port, never the bytes inside.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Where the origin listens: `localhost` resolves to both, and sluice tries each checked
/// address in turn.
pub const ORIGIN: [&str; 2] = ["127.0.0.1:9443", "[::1]:9443"];
/// The name in the origin's certificate and in the CONNECT the demo client sends.
pub const HOST: &str = "localhost";
const PORT: u16 = 9443;

/// The demo's TLS pieces: the origin's acceptor and a client that trusts it.
pub struct Tls {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

impl Tls {
    /// A self-signed certificate for `localhost`, made now: nothing to ship, nothing to expire.
    pub fn new() -> Result<Tls, String> {
        let made = rcgen::generate_simple_self_signed(vec![HOST.to_string()])
            .map_err(|e| format!("demo certificate: {e}"))?;
        let cert: CertificateDer<'static> = made.cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(made.key_pair.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .and_then(|b| {
                b.with_no_client_auth()
                    .with_single_cert(vec![cert.clone()], key)
            })
            .map_err(|e| format!("demo TLS origin: {e}"))?;
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(cert)
            .map_err(|e| format!("demo TLS client: {e}"))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("demo TLS client: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Tls {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
        })
    }

    /// Serves `hello over TLS` on each address of [`ORIGIN`] that can be bound.
    pub async fn serve_origin(&self) -> Result<(), String> {
        let mut bound = 0;
        for addr in ORIGIN {
            let Ok(listener) = TcpListener::bind(addr).await else {
                continue;
            };
            bound += 1;
            let acceptor = self.acceptor.clone();
            tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        let Ok(Ok(mut tls)) =
                            tokio::time::timeout(Duration::from_secs(5), acceptor.accept(tcp))
                                .await
                        else {
                            return;
                        };
                        let mut head = Vec::new();
                        let mut buf = [0u8; 1024];
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16384 {
                            match tls.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => head.extend_from_slice(&buf[..n]),
                            }
                        }
                        let body = "hello over TLS, end to end through a CONNECT tunnel\n";
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        let _ = tls.write_all(answer.as_bytes()).await;
                        let _ = tls.shutdown().await;
                    });
                }
            });
        }
        if bound == 0 {
            return Err(format!("cannot listen on {HOST}:{PORT}"));
        }
        Ok(())
    }

    /// `GET https://localhost:9443/` through the gateway: a CONNECT, then TLS inside it.
    /// Returns the origin's status.
    pub async fn get(&self, gateway: SocketAddr) -> std::io::Result<u16> {
        let io = |what: &str| std::io::Error::other(what.to_string());
        let exchange = async {
            let mut tcp = TcpStream::connect(gateway).await?;
            let authority = format!("{HOST}:{PORT}");
            tcp.write_all(
                format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes(),
            )
            .await?;
            // The answer's head alone: the origin says nothing until the client's TLS hello.
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if tcp.read(&mut byte).await? == 0 || head.len() > 16384 {
                    return Err(io("the gateway closed the CONNECT"));
                }
                head.push(byte[0]);
            }
            let connect_status = status_of(&head);
            if connect_status != 200 {
                return Err(io(&format!(
                    "the gateway answered the CONNECT with {connect_status}"
                )));
            }
            let name = ServerName::try_from(HOST).map_err(|_| io("server name"))?;
            let mut tls = self.connector.connect(name, tcp).await?;
            tls.write_all(
                format!("GET / HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
            let mut answer = Vec::new();
            // A peer that closes without close_notify still gave its whole answer.
            let _ = tls.read_to_end(&mut answer).await;
            Ok(status_of(&answer))
        };
        tokio::time::timeout(Duration::from_secs(5), exchange)
            .await
            .map_err(|_| io("timed out"))?
    }
}

/// The status code of an HTTP/1 answer's first line; 0 if there is none.
fn status_of(answer: &[u8]) -> u16 {
    std::str::from_utf8(answer)
        .ok()
        .and_then(|t| t.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}
