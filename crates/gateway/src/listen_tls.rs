//! The certificate of a TLS listener (`listen[].tls`, SPEC §7): read and checked by
//! `sluice check` and on every config load, read again at start and made into Pingora's rustls
//! acceptor, with which `crate::limits::LimitedApp` does each handshake inside the connection
//! cap (Pingora itself only listens on plain TCP).
//!
//! The files are read once, at start: a new certificate takes a restart, like any change to
//! `listen`. Messages name the file and what is wrong with it, never its content: a key file's
//! bytes must not reach a terminal or a log.
//!
//! Pingora's own `TlsSettings::build` loads the files itself, but panics on a bad file
//! (pingora-core 0.9.1 src/listeners/tls/rustls/mod.rs:56-90), inside a service thread after the
//! process is up. So sluice loads them here, where a mistake is an error naming the file, and
//! gives Pingora a resolver that always answers with the loaded certificate. Reading and
//! checking the files is the config's (`config::listen_tls`), so that `sluice check` places a
//! bad file at its YAML path.
//!
//! With `client_ca`, the listener asks for a client certificate and verifies it against that
//! bundle (rustls' webpki verifier). One that fails verification ends the handshake, with
//! `client_cert: optional` too: rustls has no way to go on without it once a certificate was
//! sent. The names of a verified certificate (its URI and DNS SANs, so SPIFFE IDs too) are put
//! on the connection's TLS digest once, at the handshake, for the clients step to match against
//! each client's `certs` ([`peer_names`]).

use std::any::Any;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use pingora::listeners::tls::TlsSettings;
use pingora::listeners::TlsAccept;
use pingora::protocols::tls::{SslDigest, TlsRef};
use pingora::protocols::ALPN;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use x509_parser::extensions::GeneralName;

pub use crate::config::listen_tls::{load, load_client_ca, Blame, TlsFileError};

/// How a TLS listener asks for client certificates (`listen[].tls.client_ca`, `client_cert`).
#[derive(Debug, Clone, Copy)]
pub struct ClientAuth<'a> {
    /// The PEM bundle of the CAs client certificates are verified against.
    pub ca: &'a Path,
    /// `client_cert: required`: a client that sends none is refused at the handshake. Otherwise
    /// it goes on without a certificate, to be identified some other way.
    pub required: bool,
}

/// Pingora listener settings that serve `tls`'s certificate over HTTP/1.1 (no h2: the proxy's
/// connection loop, `crate::limits::LimitedApp`, speaks HTTP/1 only).
/// With `client`, it also asks for client certificates and puts a verified one's names on
/// the connection ([`peer_names`]).
pub fn settings(
    cert: &Path,
    key_file: &Path,
    client: Option<ClientAuth<'_>>,
) -> Result<TlsSettings, TlsFileError> {
    // The provider Pingora's acceptor uses, installed before the key is loaded with it.
    pingora::tls::install_default_crypto_provider();
    let key = load(cert, key_file)?;
    let settings_error = |e: Box<pingora::Error>| TlsFileError {
        blame: Blame::Cert,
        message: format!("TLS settings: {e}"),
    };
    let mut settings = match client {
        // The names are taken once per connection, at the handshake, rather than parsed
        // from the certificate on every request.
        Some(_) => TlsSettings::with_callbacks(Box::new(TakeNames)).map_err(settings_error)?,
        // The paths are never read by Pingora once a resolver is set; they only fill the struct.
        None => TlsSettings::intermediate(&cert.to_string_lossy(), &key_file.to_string_lossy())
            .map_err(settings_error)?,
    };
    if let Some(client) = client {
        let roots = load_client_ca(client.ca)?;
        let builder = WebPkiClientVerifier::builder_with_provider(
            roots,
            crate::config::listen_tls::provider(),
        );
        let builder = if client.required {
            builder
        } else {
            builder.allow_unauthenticated()
        };
        let verifier = builder.build().map_err(|e| TlsFileError {
            blame: Blame::ClientCa,
            message: format!(
                "{}: cannot verify client certificates with it: {e}",
                client.ca.display()
            ),
        })?;
        settings.set_client_cert_verifier(verifier);
    }
    settings.set_cert_resolver(Arc::new(OneCert(key)));
    settings.set_alpn(ALPN::H1);
    Ok(settings)
}

/// The names of the verified client certificate of a connection: its URI and DNS SANs, in the
/// certificate's order, DNS names in lower case (they match without regard to case). Empty for
/// a verified certificate with no such name, which is still a certificate presented.
struct PeerNames(Box<[String]>);

/// Takes the names of the client certificate, once the handshake has verified it.
struct TakeNames;

#[async_trait]
impl TlsAccept for TakeNames {
    async fn handshake_complete_callback(
        &self,
        tls: &TlsRef,
    ) -> Option<Arc<dyn Any + Send + Sync>> {
        // rustls only completes a handshake whose client certificate it verified: any
        // certificate here is a verified one. None: the client sent none (`optional`).
        let der = tls.peer_certificate_der()?;
        Some(Arc::new(PeerNames(names_of(der).into_boxed_slice())))
    }
}

/// The URI and DNS SANs of the DER certificate `der`. One that webpki accepted but this parser
/// cannot read gives no names: the caller then stays unmatched, never matched by accident.
///
/// A client's `certs` entry is a URI when it has `://` and a DNS name otherwise; a SAN whose
/// form belongs to the other kind (a DNS SAN `spiffe://…`, a URI SAN `billing.corp.example`,
/// both mere IA5 strings to X.509) is no name, so that a CA allowed to issue one kind of name
/// cannot issue, through the other, a certificate matching a client it never meant.
fn names_of(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) if uri.contains("://") => Some(canonical_name(uri)),
            GeneralName::DNSName(dns) if !dns.contains("://") => Some(canonical_name(dns)),
            _ => None,
        })
        .collect()
}

/// How a certificate name is compared with a client's `certs` (shared with `check`, which
/// refuses two clients whose names compare equal).
pub(crate) use crate::config::listen_tls::canonical_name;

/// The names of the verified client certificate the request's connection presented (see
/// [`peer_names_of`]).
pub(crate) fn peer_names(session: &pingora::proxy::Session) -> Option<&[String]> {
    peer_names_of(session.digest()?.ssl_digest.as_deref()?)
}

/// The names of the verified client certificate of the TLS connection of `digest` (for a
/// CONNECT tunnel: the stream's `get_ssl_digest()`): its URI and DNS SANs, DNS names in lower
/// case. None when no certificate was presented (a plain listener, a listener without
/// `client_ca`, or `client_cert: optional` and none sent); `Some(&[])` for a verified
/// certificate with no URI or DNS SAN, a credential presented that names no one. A certificate
/// that failed verification never gets here: its handshake failed.
pub(crate) fn peer_names_of(digest: &SslDigest) -> Option<&[String]> {
    digest.extension.get::<PeerNames>().map(|n| &n.0[..])
}

/// Always the one certificate of the listener, whatever the client asks for in SNI.
struct OneCert(Arc<CertifiedKey>);

impl fmt::Debug for OneCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the key, even its type's Debug.
        f.write_str("OneCert")
    }
}

impl ResolvesServerCert for OneCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

#[cfg(test)]
mod tests;
