//! The certificate of a TLS listener (`listen[].tls`, SPEC §7), read and checked on every
//! config load (and by `sluice check`), so that a bad file is a config error naming it and its
//! YAML path; the gateway loads the same files with [`load`] at start to serve them.
//!
//! Messages name the file and what is wrong with it, never its content: a key file's bytes must
//! not reach a terminal or a log.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::{InconsistentKeys, RootCertStore};

/// Which part of `listen[].tls` a problem is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The certificate file.
    Cert,
    /// The key file.
    Key,
    /// The two together: the key is not the certificate's.
    Pair,
    /// The CA bundle client certificates are verified against (`client_ca`).
    ClientCa,
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
/// first certificate. The gateway loads the same files with it to serve them.
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

/// Reads the CA bundle at `path` (`listen[].tls.client_ca`) that client certificates are
/// verified against: PEM, at least one certificate, and every one a certificate webpki can use
/// as a trust anchor. A bundle with one bad certificate is refused whole, rather than trusting
/// the rest and leaving the operator to find out which clients fail.
pub fn load_client_ca(path: &Path) -> Result<Arc<RootCertStore>, TlsFileError> {
    let certs = read_certs(path).map_err(|e| fail(Blame::ClientCa, e.message))?;
    let mut roots = RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        roots.add(cert).map_err(|e| {
            fail(
                Blame::ClientCa,
                format!(
                    "{}: certificate {} is not one sluice can verify clients with: {e}",
                    path.display(),
                    i + 1
                ),
            )
        })?;
    }
    Ok(Arc::new(roots))
}

/// The process-wide rustls provider, or ring's (the one Pingora installs) when none is yet:
/// its key loader, and the gateway's client-certificate verifier, use it; nothing is installed
/// here, since `sluice check` needs no process-wide state.
pub fn provider() -> Arc<CryptoProvider> {
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

/// A certificate name as it is compared with a client's `certs`: a DNS name is
/// case-insensitive as a whole; a URI (a SPIFFE ID) only in its scheme and authority, since
/// its path names a workload and `/ns/Billing` is not `/ns/billing`. Both the configured names
/// and the presented ones go through here, so neither side needs a second, looser lookup.
pub fn canonical_name(name: &str) -> String {
    match name.find("://") {
        Some(at) => {
            let authority_end = name[at + 3..].find('/').map_or(name.len(), |i| at + 3 + i);
            let mut out = name[..authority_end].to_ascii_lowercase();
            out.push_str(&name[authority_end..]);
            out
        }
        None => name.to_ascii_lowercase(),
    }
}
