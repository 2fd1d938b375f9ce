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

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use pingora::listeners::tls::TlsSettings;
use pingora::protocols::ALPN;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

pub use crate::config::listen_tls::{load, Blame, TlsFileError};

/// Pingora listener settings that serve `tls`'s certificate over HTTP/1.1 (no h2: the proxy's
/// connection loop, `crate::limits::LimitedApp`, speaks HTTP/1 only).
pub fn settings(cert: &Path, key_file: &Path) -> Result<TlsSettings, TlsFileError> {
    // The provider Pingora's acceptor uses, installed before the key is loaded with it.
    pingora::tls::install_default_crypto_provider();
    let key = load(cert, key_file)?;
    // The paths are never read by Pingora once a resolver is set; they only fill the struct.
    let mut settings =
        TlsSettings::intermediate(&cert.to_string_lossy(), &key_file.to_string_lossy()).map_err(
            |e| TlsFileError {
                blame: Blame::Cert,
                message: format!("TLS settings: {e}"),
            },
        )?;
    settings.set_cert_resolver(Arc::new(OneCert(key)));
    settings.set_alpn(ALPN::H1);
    Ok(settings)
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
