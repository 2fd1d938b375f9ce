//! Client certificates at the handshake: a real rustls client on loopback against the acceptor
//! [`settings`] builds, with certificates made here. What the handshake does with each kind of
//! certificate, and which names the connection then carries.

use std::path::Path;
use std::sync::Arc;

use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::Ssl;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{peer_names_of, settings, ClientAuth};

/// A CA, able to sign certificates.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    /// A client certificate with `sans`, or one that expired in 2020 with `expired`.
    fn client(&self, sans: Vec<SanType>, expired: bool) -> Identity {
        self.sign(sans, expired, ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn sign(&self, sans: Vec<SanType>, expired: bool, usage: ExtendedKeyUsagePurpose) -> Identity {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "a test client");
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![usage];
        if expired {
            params.not_before = rcgen::date_time_ymd(2019, 1, 1);
            params.not_after = rcgen::date_time_ymd(2020, 1, 1);
        }
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        Identity { cert, key }
    }
}

/// A certificate and its key.
struct Identity {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn uri(s: &str) -> SanType {
    SanType::URI(s.try_into().unwrap())
}

fn dns(s: &str) -> SanType {
    SanType::DnsName(s.try_into().unwrap())
}

/// In `dir`: the server's certificate for localhost (signed by `server_ca`) and the client CA
/// bundle of `client_ca`.
fn write_files(dir: &Path, server_ca: &Ca, client_ca: &Ca) {
    let server = server_ca.sign(
        vec![dns("localhost")],
        false,
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    std::fs::write(dir.join("server.pem"), server.cert.pem()).unwrap();
    std::fs::write(dir.join("server.key"), server.key.serialize_pem()).unwrap();
    std::fs::write(dir.join("clients.pem"), client_ca.cert.pem()).unwrap();
}

/// What the server side of one handshake gave.
enum Outcome {
    /// The handshake failed.
    Refused,
    /// It succeeded; the names on the connection.
    Accepted(Option<Vec<String>>),
}

/// One handshake on loopback: sluice's acceptor for `dir`'s files (`required` or not), a
/// rustls client trusting `server_ca` and presenting `identity` if any.
async fn handshake(
    dir: &Path,
    required: bool,
    server_ca: &Ca,
    identity: Option<&Identity>,
) -> Outcome {
    let client = ClientAuth {
        ca: &dir.join("clients.pem"),
        required,
    };
    let acceptor = settings(
        &dir.join("server.pem"),
        &dir.join("server.key"),
        Some(client),
    )
    .unwrap()
    .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();

    let mut roots = rustls::RootCertStore::empty();
    roots.add(server_ca.cert.der().clone()).unwrap();
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    let config = match identity {
        Some(id) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from(id.cert.der().to_vec())],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(id.key.serialize_der())),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let client = tokio::spawn(async move {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        // With TLS 1.3 the client is done before the server has looked at its certificate:
        // whether the server accepted it shows on the server's side, and in the one byte it
        // sends back.
        if let Ok(mut tls) = connector
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
        {
            let _ = tls.write_all(b"?").await;
            let mut byte = [0u8; 1];
            let _ = tls.read(&mut byte).await;
        }
    });

    let (tcp, _) = listener.accept().await.unwrap();
    let outcome = match acceptor.tls_handshake(L4Stream::from(tcp)).await {
        Err(_) => Outcome::Refused,
        Ok(mut tls) => {
            let digest = tls
                .get_ssl_digest()
                .expect("a TLS digest after the handshake");
            let names = peer_names_of(&digest).map(<[String]>::to_vec);
            let _ = tls.write_all(b"!").await;
            let _ = tls.flush().await;
            Outcome::Accepted(names)
        }
    };
    client.await.unwrap();
    outcome
}

fn accepted(outcome: Outcome) -> Option<Vec<String>> {
    match outcome {
        Outcome::Accepted(names) => names,
        Outcome::Refused => panic!("the handshake was refused"),
    }
}

fn refused(outcome: Outcome) -> bool {
    matches!(outcome, Outcome::Refused)
}

#[tokio::test]
async fn a_verified_certificate_puts_its_uri_and_dns_names_on_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let (server_ca, client_ca) = (Ca::new("server CA"), Ca::new("clients CA"));
    write_files(dir.path(), &server_ca, &client_ca);

    let spiffe = client_ca.client(vec![uri("spiffe://corp.example/ns/billing/sa/api")], false);
    let names = accepted(handshake(dir.path(), true, &server_ca, Some(&spiffe)).await);
    assert_eq!(
        names,
        Some(vec!["spiffe://corp.example/ns/billing/sa/api".to_string()])
    );

    // DNS names match without regard to case, so they are handed on in lower case; other
    // kinds of SAN (an IP address here) are no names.
    let both = client_ca.client(
        vec![
            dns("Reports.Corp.Example"),
            SanType::IpAddress("127.0.0.1".parse().unwrap()),
            uri("spiffe://corp.example/ns/reports/sa/job"),
        ],
        false,
    );
    let names = accepted(handshake(dir.path(), false, &server_ca, Some(&both)).await);
    assert_eq!(
        names,
        Some(vec![
            "reports.corp.example".to_string(),
            "spiffe://corp.example/ns/reports/sa/job".to_string(),
        ])
    );

    // A SAN in the form of the other kind of name is none: a DNS SAN cannot pass for a SPIFFE
    // ID, nor a URI SAN for a DNS name.
    let disguised = client_ca.client(
        vec![
            dns("spiffe://corp.example/ns/billing/sa/api"),
            uri("billing.corp.example"),
            uri("spiffe://corp.example/ns/jobs/sa/cron"),
        ],
        false,
    );
    let names = accepted(handshake(dir.path(), true, &server_ca, Some(&disguised)).await);
    assert_eq!(
        names,
        Some(vec!["spiffe://corp.example/ns/jobs/sa/cron".to_string()])
    );

    // Verified but naming no one: a certificate presented all the same, not the absence of one.
    let nameless = client_ca.client(Vec::new(), false);
    let names = accepted(handshake(dir.path(), true, &server_ca, Some(&nameless)).await);
    assert_eq!(names, Some(Vec::new()));
}

#[tokio::test]
async fn a_certificate_that_fails_verification_ends_the_handshake_even_when_optional() {
    let dir = tempfile::tempdir().unwrap();
    let (server_ca, client_ca) = (Ca::new("server CA"), Ca::new("clients CA"));
    write_files(dir.path(), &server_ca, &client_ca);
    let stranger = Ca::new("someone else's CA").client(vec![uri("spiffe://corp.example/x")], false);
    let expired = client_ca.client(vec![uri("spiffe://corp.example/x")], true);

    for required in [true, false] {
        assert!(
            refused(handshake(dir.path(), required, &server_ca, Some(&stranger)).await),
            "a certificate from another CA, required: {required}"
        );
        assert!(
            refused(handshake(dir.path(), required, &server_ca, Some(&expired)).await),
            "an expired certificate, required: {required}"
        );
    }
}

#[tokio::test]
async fn no_certificate_is_refused_when_required_and_names_no_one_when_optional() {
    let dir = tempfile::tempdir().unwrap();
    let (server_ca, client_ca) = (Ca::new("server CA"), Ca::new("clients CA"));
    write_files(dir.path(), &server_ca, &client_ca);

    assert!(refused(handshake(dir.path(), true, &server_ca, None).await));
    assert_eq!(
        accepted(handshake(dir.path(), false, &server_ca, None).await),
        None
    );
}

#[test]
fn a_client_ca_that_is_no_ca_bundle_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (server_ca, client_ca) = (Ca::new("server CA"), Ca::new("clients CA"));
    write_files(dir.path(), &server_ca, &client_ca);
    let bundle = dir.path().join("clients.pem");
    std::fs::write(&bundle, "not PEM at all").unwrap();
    let client = ClientAuth {
        ca: &bundle,
        required: true,
    };
    let err = settings(
        &dir.path().join("server.pem"),
        &dir.path().join("server.key"),
        Some(client),
    )
    .err()
    .expect("a bundle with no certificate is refused");
    assert_eq!(err.blame, super::Blame::ClientCa);
    assert!(err.message.contains("clients.pem"), "{}", err.message);
}

#[test]
fn a_uri_name_keeps_the_case_of_its_path_and_a_dns_name_has_none() {
    use super::canonical_name;
    assert_eq!(
        canonical_name("SPIFFE://Corp.Example/ns/Billing/sa/API"),
        "spiffe://corp.example/ns/Billing/sa/API"
    );
    assert_ne!(
        canonical_name("spiffe://corp.example/ns/Billing"),
        canonical_name("spiffe://corp.example/ns/billing")
    );
    assert_eq!(
        canonical_name("spiffe://Corp.Example"),
        "spiffe://corp.example"
    );
    assert_eq!(canonical_name("API.Corp.Example"), "api.corp.example");
}
