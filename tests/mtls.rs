//! Client certificates on a TLS listener (`listen[].tls.client_ca`, `client_cert`): real clients
//! (curl with `--cert` and `--proxy-cert`, Python requests with `cert=`) against the real
//! binary, with certificates the test makes: valid ones naming a SPIFFE ID (URI SAN) or a DNS
//! name, one from another CA, an expired one, one with no SAN.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};
use sluice_echo::EchoServer;
use support::tls::make_certificates;
use support::{start_backends, url, Gateway, TempDir};

/// The SPIFFE ID of the `spiffe` certificate.
const BILLING: &str = "spiffe://corp.example/ns/billing/sa/api";
/// The DNS name of the `dns` certificate.
const REPORTS: &str = "reports.corp.example";

/// A CA that signs certificates.
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

    /// Writes `<name>.pem` and `<name>.key` in `dir`: a client certificate for `sans`, expired
    /// since 2020 with `expired`.
    fn client(&self, dir: &Path, name: &str, sans: Vec<SanType>, expired: bool) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        if expired {
            params.not_before = rcgen::date_time_ymd(2019, 1, 1);
            params.not_after = rcgen::date_time_ymd(2020, 1, 1);
        }
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    }
}

fn uri(s: &str) -> SanType {
    SanType::URI(s.try_into().unwrap())
}

fn dns(s: &str) -> SanType {
    SanType::DnsName(s.try_into().unwrap())
}

/// The files of one test: the listener's certificate (`server.pem`, trusted through `ca.pem`),
/// the client CA bundle `clients-ca.pem`, and client certificates `<name>.pem`/`<name>.key`:
/// `spiffe` (URI SAN [`BILLING`]), `dns` (DNS SAN [`REPORTS`]), `unlisted` (a SPIFFE ID no
/// client lists), `nosan` (no SAN), `expired` (for [`BILLING`], expired) and `stranger` (for
/// [`BILLING`], from another CA).
struct Files(TempDir);

impl Files {
    fn new() -> Files {
        let dir = TempDir::new("sluice-mtls");
        make_certificates(dir.path());
        let clients = Ca::new("sluice test clients CA");
        std::fs::write(dir.path().join("clients-ca.pem"), clients.cert.pem()).unwrap();
        let d = dir.path();
        clients.client(d, "spiffe", vec![uri(BILLING)], false);
        clients.client(d, "dns", vec![dns(REPORTS)], false);
        clients.client(
            d,
            "unlisted",
            vec![uri("spiffe://corp.example/ns/other/sa/x")],
            false,
        );
        clients.client(d, "nosan", Vec::new(), false);
        clients.client(d, "expired", vec![uri(BILLING)], true);
        Ca::new("someone else's CA").client(d, "stranger", vec![uri(BILLING)], false);
        Files(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }

    fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

/// A gateway whose TLS listener (`{PROXY}`) asks for client certificates (`client_cert:
/// mode`), with route `api` (host api.test, proxy form) and route `local` (host localhost,
/// gateway form) both to `echo`; `extra` is appended to the top level (e.g. a `clients:`
/// section).
fn start(files: &Files, mode: &str, echo: &EchoServer, extra: &str) -> Gateway {
    let echo = url(echo.local_addr());
    Gateway::start_with_ports(&format!(
        r#"listen:
  - addr: "{{PROXY}}"
    tls:
      cert: "{cert}"
      key: "{key}"
      client_ca: "{client_ca}"
      client_cert: {mode}
admin: {{listen: "{{ADMIN}}"}}
threads: 1
routes:
  - name: api
    match: {{hosts: [api.test]}}
    upstream: {{members: [{{url: "{echo}"}}]}}
  - name: local
    match: {{hosts: [localhost]}}
    upstream: {{members: [{{url: "{echo}"}}]}}
{extra}"#,
        cert = files.arg("server.pem"),
        key = files.arg("server.key"),
        client_ca = files.arg("clients-ca.pem"),
    ))
}

/// curl with `args` and none of the caller's proxy settings: the status code it got, or None
/// when it got none (the TLS handshake failed).
async fn curl(args: Vec<String>) -> Option<String> {
    tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new("curl");
        for var in [
            "http_proxy",
            "https_proxy",
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "all_proxy",
            "ALL_PROXY",
            "no_proxy",
            "NO_PROXY",
        ] {
            cmd.env_remove(var);
        }
        cmd.args([
            "-sS",
            "--max-time",
            "20",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .args(&args);
        let out = cmd.output().expect("curl must be installed");
        let code = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success() && code != "000").then_some(code)
    })
    .await
    .unwrap()
}

/// curl in proxy form (`--proxy https://…`, `http://api.test/`), presenting the client
/// certificate `cert` (a name in [`Files`]) to sluice with `--proxy-cert`, or none.
async fn via_proxy(files: &Files, gw: &Gateway, cert: Option<&str>) -> Option<String> {
    let mut args = vec![
        "--proxy".to_string(),
        format!("https://{}", gw.proxy_addr()),
        "--proxy-cacert".to_string(),
        files.arg("ca.pem"),
    ];
    if let Some(cert) = cert {
        args.extend([
            "--proxy-cert".to_string(),
            files.arg(&format!("{cert}.pem")),
            "--proxy-key".to_string(),
            files.arg(&format!("{cert}.key")),
        ]);
    }
    args.push("http://api.test/hello".to_string());
    curl(args).await
}

/// curl in gateway form (`https://localhost:<port>/` straight to sluice), presenting `cert`
/// with `--cert`/`--key`, or none.
async fn direct(files: &Files, gw: &Gateway, cert: Option<&str>) -> Option<String> {
    let mut args = vec!["--cacert".to_string(), files.arg("ca.pem")];
    if let Some(cert) = cert {
        args.extend([
            "--cert".to_string(),
            files.arg(&format!("{cert}.pem")),
            "--key".to_string(),
            files.arg(&format!("{cert}.key")),
        ]);
    }
    args.push(format!(
        "https://localhost:{}/hello",
        gw.proxy_addr().port()
    ));
    curl(args).await
}

fn ok() -> Option<String> {
    Some("200".to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_client_certificate_must_be_one_the_client_ca_signed_and_in_date() {
    let files = Files::new();
    let backends = start_backends(&["a"]).await;
    let gw = start(&files, "required", &backends[0], "");

    for cert in ["spiffe", "dns", "nosan", "unlisted"] {
        assert_eq!(via_proxy(&files, &gw, Some(cert)).await, ok(), "{cert}");
        assert_eq!(direct(&files, &gw, Some(cert)).await, ok(), "{cert}");
    }
    assert_eq!(backends[0].requests(), 8);
    for cert in [None, Some("stranger"), Some("expired")] {
        assert_eq!(via_proxy(&files, &gw, cert).await, None, "{cert:?}");
        assert_eq!(direct(&files, &gw, cert).await, None, "{cert:?}");
    }
    assert_eq!(
        backends[0].requests(),
        8,
        "a refused handshake reached the route"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_optional_client_certificate_may_be_absent_but_never_bad() {
    let files = Files::new();
    let backends = start_backends(&["a"]).await;
    let gw = start(&files, "optional", &backends[0], "");

    assert_eq!(via_proxy(&files, &gw, None).await, ok());
    assert_eq!(direct(&files, &gw, None).await, ok());
    assert_eq!(via_proxy(&files, &gw, Some("spiffe")).await, ok());
    assert_eq!(backends[0].requests(), 3);
    // rustls cannot go on without a certificate that was sent and failed: the handshake ends.
    for cert in ["stranger", "expired"] {
        assert_eq!(via_proxy(&files, &gw, Some(cert)).await, None, "{cert}");
        assert_eq!(direct(&files, &gw, Some(cert)).await, None, "{cert}");
    }
    assert_eq!(backends[0].requests(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_presents_its_certificate_with_cert() {
    let Some(python) = support::test_python() else {
        return;
    };
    let files = Files::new();
    let backends = start_backends(&["a"]).await;
    let gw = start(&files, "required", &backends[0], "");
    let script = format!(
        "import requests\n\
         url = 'https://localhost:{port}/hello'\n\
         print(requests.get(url, cert=({cert:?}, {key:?}), verify={ca:?}, timeout=20).status_code)\n\
         try:\n\
         \x20   requests.get(url, verify={ca:?}, timeout=20)\n\
         \x20   print('no certificate: admitted')\n\
         except requests.exceptions.RequestException:\n\
         \x20   print('no certificate: refused')\n",
        port = gw.proxy_addr().port(),
        cert = files.arg("spiffe.pem"),
        key = files.arg("spiffe.key"),
        ca = files.arg("ca.pem"),
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(["-c", &script])
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .output()
            .expect("run SLUICE_TEST_PYTHON")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        gw.logs()
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "200\nno certificate: refused\n"
    );
    assert_eq!(backends[0].requests(), 1);
}

#[test]
fn check_names_an_unreadable_client_ca_and_client_cert_without_it() {
    let files = Files::new();
    let check = |tls: &str| {
        let file = files.path("sluice.yaml");
        std::fs::write(
            &file,
            format!(
                "listen:\n  - addr: \"127.0.0.1:8443\"\n    tls: {{cert: \"{}\", key: \"{}\", {tls}}}\nroutes: []\n",
                files.arg("server.pem"),
                files.arg("server.key"),
            ),
        )
        .unwrap();
        let out = Command::new(support::sluice_binary())
            .args(["check", "-c"])
            .arg(&file)
            .output()
            .expect("run sluice check");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let missing = files.arg("missing-ca.pem");
    let err = check(&format!("client_ca: \"{missing}\""));
    assert!(
        err.contains("listen[0].tls.client_ca: cannot read") && err.contains(&missing),
        "{err}"
    );
    // A key where the bundle should be: refused, and nothing of the key is shown.
    let err = check(&format!("client_ca: \"{}\"", files.arg("spiffe.key")));
    assert!(
        err.contains("listen[0].tls.client_ca:") && err.contains("no certificate in it"),
        "{err}"
    );
    assert!(!err.contains("PRIVATE KEY"), "{err}");
    let err = check("client_cert: optional");
    assert!(err.contains("client_cert needs client_ca"), "{err}");
}
