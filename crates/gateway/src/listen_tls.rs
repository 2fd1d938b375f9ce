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
//! gives Pingora a resolver that always answers with the loaded certificate.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use pingora::listeners::tls::TlsSettings;
use pingora::protocols::ALPN;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::InconsistentKeys;

/// Which part of `listen[].tls` a problem is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The certificate file.
    Cert,
    /// The key file.
    Key,
    /// The two together: the key is not the certificate's.
    Pair,
}

/// Why a listener's certificate or key cannot be used; names the file, never its content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFileError {
    /// What to blame.
    pub blame: Blame,
    /// What is wrong, naming the file.
    pub message: String,
}

impl fmt::Display for TlsFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

fn fail(blame: Blame, message: String) -> TlsFileError {
    TlsFileError { blame, message }
}

/// Reads and checks the certificate chain at `cert` and its key at `key` (`listen[].tls`):
/// both parse as PEM, the key is one rustls can sign with, and it is the key of the chain's
/// first certificate. Paths, not the config's type: the config calls this, not the reverse.
pub fn load(cert: &Path, key_file: &Path) -> Result<Arc<CertifiedKey>, TlsFileError> {
    let certs = read_certs(cert)?;
    let key = read_key(key_file)?;
    let provider = provider();
    let signing = provider.key_provider.load_private_key(key).map_err(|e| {
        // rustls's message names the key type it could not use, nothing of the key itself.
        fail(
            Blame::Key,
            format!(
                "{}: not a private key sluice can use: {e}",
                key_file.display()
            ),
        )
    })?;
    let certified = CertifiedKey::new(certs, signing);
    match certified.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(InconsistentKeys::Unknown)) => {}
        Err(rustls::Error::InconsistentKeys(_)) => {
            return Err(fail(
                Blame::Pair,
                format!(
                    "the key in {} is not the key of the first certificate in {}",
                    key_file.display(),
                    cert.display()
                ),
            ))
        }
        Err(e) => {
            return Err(fail(
                Blame::Cert,
                format!(
                    "{}: the first certificate is not a valid X.509 certificate: {e}",
                    cert.display()
                ),
            ))
        }
    }
    Ok(Arc::new(certified))
}

/// Pingora listener settings that serve `tls`'s certificate over HTTP/1.1 (no h2: the proxy's
/// connection loop, `crate::limits::LimitedApp`, speaks HTTP/1 only).
pub fn settings(cert: &Path, key_file: &Path) -> Result<TlsSettings, TlsFileError> {
    let key = load(cert, key_file)?;
    // The paths are never read by Pingora once a resolver is set; they only fill the struct.
    let mut settings =
        TlsSettings::intermediate(&cert.to_string_lossy(), &key_file.to_string_lossy())
            .map_err(|e| fail(Blame::Cert, format!("TLS settings: {e}")))?;
    settings.set_cert_resolver(Arc::new(OneCert(key)));
    settings.set_alpn(ALPN::H1);
    Ok(settings)
}

/// The process-wide rustls provider, installed if nothing did yet (Pingora installs the same).
fn provider() -> Arc<CryptoProvider> {
    pingora::tls::install_default_crypto_provider();
    CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let unreadable = |e: pem::Error| match e {
        pem::Error::Io(e) => fail(Blame::Cert, format!("cannot read {}: {e}", path.display())),
        e => fail(
            Blame::Cert,
            format!("{}: not a PEM certificate chain: {e}", path.display()),
        ),
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(unreadable)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(unreadable)?;
    if certs.is_empty() {
        return Err(fail(
            Blame::Cert,
            format!(
                "{}: no certificate in it (expected PEM, -----BEGIN CERTIFICATE-----)",
                path.display()
            ),
        ));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsFileError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        let why = match e {
            pem::Error::Io(e) => return fail(Blame::Key, format!("cannot read {}: {e}", path.display())),
            pem::Error::NoItemsFound => "no private key in it (expected an unencrypted PEM key: PKCS#8 -----BEGIN PRIVATE KEY-----, PKCS#1 or SEC1)",
            // The parser's own message may quote a line of the file: not for a key.
            _ => "not a readable PEM file",
        };
        fail(Blame::Key, format!("{}: {why}", path.display()))
    })
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
