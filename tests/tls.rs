//! https members: TLS origination with SNI and certificate verification, against real TLS
//! servers (`openssl s_server`) with certificates from a CA made for each test (by the testkit).

mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sluice_testkit::{make_certificates, make_expired_certificates};
use support::{free_port, request, Config, Gateway, Passive, Route};

/// `openssl s_server -www` on 127.0.0.1: a TLS server answering GET with a status page.
struct TlsServer {
    child: Child,
    port: u16,
}

impl TlsServer {
    fn start(dir: &Path) -> TlsServer {
        TlsServer::start_with(dir, &["-cert", "server.pem", "-key", "server.key"])
    }

    /// `openssl s_server -www` on a free port with `args`, run in `dir`.
    fn start_with(dir: &Path, args: &[&str]) -> TlsServer {
        let port = free_port();
        let mut child = Command::new("openssl")
            .args(["s_server", "-accept", &port.to_string(), "-www", "-quiet"])
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("openssl s_server");
        // Up to 30 s: a bound for a loaded machine, not a wait.
        for _ in 0..600 {
            if std::net::TcpStream::connect(("localhost", port)).is_ok() {
                return TlsServer { child, port };
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("openssl s_server did not listen");
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One route `api` on host `api.test` over the https `member`: no retry, and a member that
/// fails stays down for the test.
fn config(member: &str) -> String {
    Config::new()
        .route(
            Route::new("api")
                .member(member)
                .preserve_host(false)
                .retries(0)
                .passive(Passive::cooldown("1h")),
        )
        .yaml()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_a_certificate_from_a_trusted_ca_is_reached_over_tls() {
    let dir = support::TempDir::new("sluice-tls");
    make_certificates(dir.path(), "IP:127.0.0.1");
    let server = TlsServer::start(dir.path());
    let ca = dir.path().join("ca.pem").display().to_string();
    // The system roots come from rustls-native-certs, which honours SSL_CERT_FILE.
    let gw = Gateway::start_with_ports_and_env(
        &config(&format!("https://127.0.0.1:{}", server.port)),
        &[("SSL_CERT_FILE", &ca)],
    );
    let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 200, "{}\n{}", r.text(), gw.logs());
    assert!(
        r.text().contains("TLS"),
        "s_server's status page: {}",
        r.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_certificate_does_not_verify_is_never_used() {
    let dir = support::TempDir::new("sluice-tls");
    // Signed by a CA the gateway does not trust.
    make_certificates(dir.path(), "IP:127.0.0.1");
    let server = TlsServer::start(dir.path());
    let gw = Gateway::start_with_ports(&config(&format!("https://127.0.0.1:{}", server.port)));
    let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("upstream_tls"));
    let reason = "certificate verify failed: unknown issuer";
    assert_eq!(r.json()["detail"], reason);
    assert_tls_line(&gw, reason).await;
}

/// The access line of the one request says `upstream_tls` and why.
async fn assert_tls_line(gw: &Gateway, reason: &str) {
    let line = || {
        gw.log_json()
            .into_iter()
            .find(|l| l["target"] == "sluice::access")
    };
    assert!(
        support::wait_until(Duration::from_secs(20), || line().is_some()).await,
        "{}",
        gw.logs()
    );
    let line = line().unwrap();
    assert_eq!(line["error"], "upstream_tls", "{line}");
    assert_eq!(line["detail"], reason, "{line}");
}

/// A member whose certificate comes from a CA the gateway trusts (made in `dir`) but fails
/// verification: 502 `upstream_tls`, with `reason` in the answer and in the access line.
async fn assert_trusted_ca_refusal(dir: &support::TempDir, reason: &str) {
    let server = TlsServer::start(dir.path());
    let ca = dir.path().join("ca.pem").display().to_string();
    let gw = Gateway::start_with_ports_and_env(
        &config(&format!("https://127.0.0.1:{}", server.port)),
        &[("SSL_CERT_FILE", &ca)],
    );
    let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("upstream_tls"));
    assert_eq!(r.json()["detail"], reason);
    assert_tls_line(&gw, reason).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_name_is_refused() {
    let dir = support::TempDir::new("sluice-tls");
    // A trusted CA, but the certificate names another host than the member's.
    make_certificates(dir.path(), "DNS:elsewhere.example");
    assert_trusted_ca_refusal(&dir, "certificate verify failed: wrong name").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_is_refused_as_expired() {
    let dir = support::TempDir::new("sluice-tls");
    make_expired_certificates(dir.path(), "IP:127.0.0.1");
    assert_trusted_ca_refusal(&dir, "certificate verify failed: expired").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_member_host_name_goes_out_as_sni() {
    let trusted = support::TempDir::new("sluice-tls");
    make_certificates(trusted.path(), "DNS:localhost");
    let untrusted = support::TempDir::new("sluice-tls");
    make_certificates(untrusted.path(), "DNS:localhost");
    // The server presents the trusted certificate only to a client that asks for "localhost"
    // by SNI; anyone else gets one from a CA the gateway does not know.
    let untrusted_cert = untrusted.path().join("server.pem").display().to_string();
    let untrusted_key = untrusted.path().join("server.key").display().to_string();
    let server = TlsServer::start_with(
        trusted.path(),
        &[
            "-cert",
            &untrusted_cert,
            "-key",
            &untrusted_key,
            "-servername",
            "localhost",
            "-cert2",
            "server.pem",
            "-key2",
            "server.key",
        ],
    );
    let ca = trusted.path().join("ca.pem").display().to_string();
    let gw = Gateway::start_with_ports_and_env(
        &config(&format!("https://localhost:{}", server.port)),
        &[("SSL_CERT_FILE", &ca)],
    );
    let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 200, "{}\n{}", r.text(), gw.logs());
}
