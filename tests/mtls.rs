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
    start_with_origin(files, mode, echo, 443, extra)
}

/// [`start`], where route `web` (host 127.0.0.1) takes tunnels to a `direct` target, which the
/// egress guard lets reach loopback on `origin_port`.
fn start_with_origin(
    files: &Files,
    mode: &str,
    echo: &EchoServer,
    origin_port: u16,
    extra: &str,
) -> Gateway {
    Gateway::start_with_ports(&config(files, mode, echo, origin_port, extra))
}

/// The config template of [`start_with_origin`].
fn config(files: &Files, mode: &str, echo: &EchoServer, origin_port: u16, extra: &str) -> String {
    let echo = url(echo.local_addr());
    format!(
        r#"listen:
  - addr: "{{PROXY}}"
    tls:
      cert: "{cert}"
      key: "{key}"
      client_ca: "{client_ca}"
      client_cert: {mode}
admin: {{listen: "{{ADMIN}}"}}
threads: 1
egress: {{allow_cidrs: ["127.0.0.0/8"], connect_ports: [{origin_port}]}}
routes:
  - name: api
    match: {{hosts: [api.test]}}
    upstream: {{members: [{{url: "{echo}"}}]}}
  - name: local
    match: {{hosts: [localhost]}}
    upstream: {{members: [{{url: "{echo}"}}]}}
  - name: web
    match: {{hosts: ["127.0.0.1"]}}
    upstream: {{members: [{{direct: true}}]}}
{extra}"#,
        cert = files.arg("server.pem"),
        key = files.arg("server.key"),
        client_ca = files.arg("clients-ca.pem"),
    )
}

/// curl with none of the caller's proxy settings.
fn curl_command() -> Command {
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
    cmd.args(["-sS", "--max-time", "20"]);
    cmd
}

/// curl with `args`: the status code it got, or None when it got none (the TLS handshake
/// failed).
async fn curl(args: Vec<String>) -> Option<String> {
    tokio::task::spawn_blocking(move || {
        let out = curl_command()
            .args(["-o", "/dev/null", "-w", "%{http_code}"])
            .args(&args)
            .output()
            .expect("curl must be installed");
        let code = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success() && code != "000").then_some(code)
    })
    .await
    .unwrap()
}

/// curl in proxy form (`--proxy https://…`, `http://api.test/`), presenting the client
/// certificate `cert` (a name in [`Files`]) to sluice with `--proxy-cert`, or none: the status
/// code it got.
async fn via_proxy(files: &Files, gw: &Gateway, cert: Option<&str>) -> Option<String> {
    let mut args = cert_args(files, gw, cert, true);
    args.push("http://api.test/hello".to_string());
    curl(args).await
}

/// curl in gateway form (`https://localhost:<port>/` straight to sluice), presenting `cert`
/// with `--cert`/`--key`, or none.
async fn direct(files: &Files, gw: &Gateway, cert: Option<&str>) -> Option<String> {
    let mut args = cert_args(files, gw, cert, false);
    args.push(format!(
        "https://localhost:{}/hello",
        gw.proxy_addr().port()
    ));
    curl(args).await
}

fn ok() -> Option<String> {
    Some("200".to_string())
}

/// curl with `-i` and `args`: what it printed (the answer's head and body), once it got an
/// answer; None when the handshake failed.
async fn answer(args: Vec<String>) -> Option<String> {
    tokio::task::spawn_blocking(move || {
        let out = curl_command()
            .arg("-i")
            .args(&args)
            .output()
            .expect("curl must be installed");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.starts_with("HTTP/").then_some(text)
    })
    .await
    .unwrap()
}

/// The arguments of [`via_proxy`] (`proxy: true`) or [`direct`] for `cert`, before the URL.
fn cert_args(files: &Files, gw: &Gateway, cert: Option<&str>, proxy: bool) -> Vec<String> {
    let (cert_flag, key_flag) = if proxy {
        ("--proxy-cert", "--proxy-key")
    } else {
        ("--cert", "--key")
    };
    let mut args = if proxy {
        vec![
            "--proxy".to_string(),
            format!("https://{}", gw.proxy_addr()),
            "--proxy-cacert".to_string(),
            files.arg("ca.pem"),
        ]
    } else {
        Vec::new()
    };
    args.extend(["--cacert".to_string(), files.arg("ca.pem")]);
    if let Some(cert) = cert {
        args.extend([
            cert_flag.to_string(),
            files.arg(&format!("{cert}.pem")),
            key_flag.to_string(),
            files.arg(&format!("{cert}.key")),
        ]);
    }
    args
}

/// The answer to `http://api.test/hello` through the TLS listener as a proxy, presenting `cert`.
async fn proxy_answer(files: &Files, gw: &Gateway, cert: Option<&str>) -> Option<String> {
    let mut args = cert_args(files, gw, cert, true);
    args.push("http://api.test/hello".to_string());
    answer(args).await
}

/// The answer to `https://localhost:<port>/hello` in gateway form, presenting `cert`.
async fn direct_answer(files: &Files, gw: &Gateway, cert: Option<&str>) -> Option<String> {
    let mut args = cert_args(files, gw, cert, false);
    args.push(format!(
        "https://localhost:{}/hello",
        gw.proxy_addr().port()
    ));
    answer(args).await
}

/// The status sluice gave the CONNECT of a tunnel to `127.0.0.1:origin_port`, asked for
/// through the TLS listener presenting `cert`, and whether the request inside it succeeded.
async fn tunnel(
    files: &Files,
    gw: &Gateway,
    cert: Option<&str>,
    origin_port: u16,
) -> (String, bool) {
    let mut args = cert_args(files, gw, cert, true);
    args.extend([
        "-o".to_string(),
        "/dev/null".to_string(),
        "-w".to_string(),
        "%{http_connect}".to_string(),
        format!("https://127.0.0.1:{origin_port}/"),
    ]);
    tokio::task::spawn_blocking(move || {
        let out = curl_command()
            .args(&args)
            .output()
            .expect("curl must be installed");
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            out.status.success(),
        )
    })
    .await
    .unwrap()
}

/// The status line's code of `text`, an answer [`answer`] printed.
fn status(text: &Option<String>) -> &str {
    text.as_deref()
        .and_then(|t| t.split(' ').nth(1))
        .unwrap_or("no answer")
}

/// The token of the client `ops` in [`clients`].
const OPS_TOKEN: &str = "ops-token-0123456789abcdef";

/// `clients:` with `billing` (the SPIFFE ID [`BILLING`]; routes `api` and `web`, and the
/// origin on `origin_port` as its one destination), `reports` (the DNS name [`REPORTS`];
/// route `local`) and `ops` (a token; every route). `billing_cidrs` and `reports_cidrs` are
/// their `cidrs` (YAML flow lists).
fn clients(origin_port: u16, billing_cidrs: &str, reports_cidrs: &str) -> String {
    format!(
        r#"clients:
  list:
    - name: billing
      certs: ["{BILLING}"]
      cidrs: {billing_cidrs}
      routes: [api, web]
      destinations: ["127.0.0.1:{origin_port}"]
{}"#,
        others(reports_cidrs)
    )
}

/// The entries of [`clients`] after `billing`.
fn others(reports_cidrs: &str) -> String {
    format!(
        r#"    - name: reports
      certs: ["{REPORTS}"]
      cidrs: {reports_cidrs}
      routes: [local]
    - name: ops
      tokens: ["{OPS_TOKEN}"]
      routes: ["*"]
"#
    )
}

/// The `client_name` of each access line of a request to `route`, in order.
fn client_names(gw: &Gateway, route: &str) -> Vec<String> {
    gw.log_json()
        .into_iter()
        .filter(|l| l["target"] == "sluice::access" && l["route"] == route)
        .map(|l| l["client_name"].as_str().unwrap_or("-").to_string())
        .collect()
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
async fn a_certificate_identifies_its_client_for_requests_and_tunnels_alike() {
    let files = Files::new();
    let backends = start_backends(&["a"]).await;
    let (_origin, origin_port) = support::tls::tls_origin(files.0.path());
    let gw = start_with_origin(
        &files,
        "optional",
        &backends[0],
        origin_port,
        &clients(origin_port, "[]", "[]"),
    );

    // Each client reaches its own routes, by proxy form, gateway form and tunnel.
    let billing = proxy_answer(&files, &gw, Some("spiffe")).await;
    assert_eq!(status(&billing), "200", "{billing:?}\n{}", gw.logs());
    let reports = direct_answer(&files, &gw, Some("dns")).await;
    assert_eq!(status(&reports), "200", "{reports:?}\n{}", gw.logs());
    assert_eq!(
        tunnel(&files, &gw, Some("spiffe"), origin_port).await,
        ("200".to_string(), true)
    );
    assert!(
        support::wait_until(std::time::Duration::from_secs(20), || {
            client_names(&gw, "api") == ["billing"] && client_names(&gw, "local") == ["reports"]
        })
        .await,
        "{}",
        gw.logs()
    );

    // And no other.
    let denied = direct_answer(&files, &gw, Some("spiffe")).await;
    assert_eq!(status(&denied), "403", "{denied:?}");
    assert!(denied.unwrap().contains("route_denied"));
    let denied = proxy_answer(&files, &gw, Some("dns")).await;
    assert_eq!(status(&denied), "403", "{denied:?}");
    assert!(denied.unwrap().contains("route_denied"));
    let (code, ok) = tunnel(&files, &gw, Some("dns"), origin_port).await;
    assert_eq!((code.as_str(), ok), ("403", false));
    assert_eq!(backends[0].requests(), 2);

    // A verified certificate that names no listed client, or nothing at all, is a credential
    // that failed: 407 in proxy form, 401 in gateway form.
    for cert in ["unlisted", "nosan"] {
        let refused = proxy_answer(&files, &gw, Some(cert)).await;
        assert_eq!(status(&refused), "407", "{cert}: {refused:?}");
        let refused = refused.unwrap();
        assert!(
            refused
                .to_ascii_lowercase()
                .contains("proxy-authenticate: basic realm=\"sluice\""),
            "{cert}: {refused}"
        );
        let refused = direct_answer(&files, &gw, Some(cert)).await;
        assert_eq!(status(&refused), "401", "{cert}: {refused:?}");
        let (code, ok) = tunnel(&files, &gw, Some(cert), origin_port).await;
        assert_eq!((code.as_str(), ok), ("407", false), "{cert}");
    }
    // It is never passed over for a credential that would have worked: ops's token identifies
    // ops with no certificate, and not beside one that failed.
    let token = [
        "--proxy-user".to_string(),
        format!("ops:{OPS_TOKEN}"),
        "http://api.test/hello".to_string(),
    ];
    let mut alone = cert_args(&files, &gw, None, true);
    alone.extend(token.clone());
    assert_eq!(status(&answer(alone).await), "200");
    let mut beside_a_failed_cert = cert_args(&files, &gw, Some("unlisted"), true);
    beside_a_failed_cert.extend(token);
    assert_eq!(status(&answer(beside_a_failed_cert).await), "407");
    // No certificate and no token, on an optional listener: unidentified, so 407.
    assert_eq!(status(&proxy_answer(&files, &gw, None).await), "407");
    assert_eq!(backends[0].requests(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_listing_cidrs_with_its_certs_must_also_connect_from_them() {
    let files = Files::new();
    let backends = start_backends(&["a"]).await;
    let gw = start(
        &files,
        "required",
        &backends[0],
        &clients(443, "[10.0.0.0/8]", "[127.0.0.0/8]"),
    );
    // billing's certificate, from an address outside billing's cidrs.
    let refused = proxy_answer(&files, &gw, Some("spiffe")).await;
    assert_eq!(status(&refused), "407", "{refused:?}\n{}", gw.logs());
    // reports's, from inside reports's.
    let reports = direct_answer(&files, &gw, Some("dns")).await;
    assert_eq!(status(&reports), "200", "{reports:?}\n{}", gw.logs());
    assert_eq!(backends[0].requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_clients_reload_with_the_config_and_the_client_ca_stays_the_one_read_at_start()
{
    let files = Files::new();
    let backends = start_backends(&["a"]).await;
    let gw = start(&files, "required", &backends[0], &clients(443, "[]", "[]"));
    assert_eq!(via_proxy(&files, &gw, Some("spiffe")).await, ok());

    // billing leaves the list, and the bundle on disk now names another CA.
    std::fs::write(
        files.path("clients-ca.pem"),
        Ca::new("a CA made after the start").cert.pem(),
    )
    .unwrap();
    let without_billing = format!("clients:\n  list:\n{}", others("[]"));
    gw.write_config_template(&config(
        &files,
        "required",
        &backends[0],
        443,
        &without_billing,
    ));
    let reloaded = gw.post_reload().await;
    assert_eq!(reloaded.status, 200, "{}", gw.logs());

    // billing's next request is refused; reports's certificate still passes the handshake,
    // since the CA is the one read at start.
    let refused = proxy_answer(&files, &gw, Some("spiffe")).await;
    assert_eq!(status(&refused), "407", "{refused:?}");
    assert_eq!(direct(&files, &gw, Some("dns")).await, ok());
    assert_eq!(backends[0].requests(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_presents_its_certificate_with_cert() {
    let Some(python) = support::test_python() else {
        return;
    };
    let files = Files::new();
    let backends = start_backends(&["a"]).await;
    let gw = start(&files, "required", &backends[0], &clients(443, "[]", "[]"));
    // reports's certificate, to the route reports may use; then billing's, to the same route.
    let script = format!(
        "import requests\n\
         url = 'https://localhost:{port}/hello'\n\
         print(requests.get(url, cert=({cert:?}, {key:?}), verify={ca:?}, timeout=20).status_code)\n\
         print(requests.get(url, cert=({other:?}, {other_key:?}), verify={ca:?}, timeout=20).status_code)\n\
         try:\n\
         \x20   requests.get(url, verify={ca:?}, timeout=20)\n\
         \x20   print('no certificate: admitted')\n\
         except requests.exceptions.RequestException:\n\
         \x20   print('no certificate: refused')\n",
        port = gw.proxy_addr().port(),
        cert = files.arg("dns.pem"),
        key = files.arg("dns.key"),
        other = files.arg("spiffe.pem"),
        other_key = files.arg("spiffe.key"),
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
        "200\n403\nno certificate: refused\n"
    );
    assert_eq!(backends[0].requests(), 1);
    assert!(
        support::wait_until(std::time::Duration::from_secs(20), || {
            client_names(&gw, "local") == ["reports", "billing"]
        })
        .await,
        "{}",
        gw.logs()
    );
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
