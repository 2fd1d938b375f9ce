//! Clients as real client programs identify themselves, through the real `sluice` binary:
//! curl with `-x http://name:token@…`, Python `requests` and `httpx` with credentials in the
//! proxy URL, Node's `http` module with `Proxy-Authorization` (for an `http://` target and
//! a CONNECT to an `https://` one), and the `openai` SDK with a sluice token as its API key on
//! a key-pool route, where the member's provider key takes the token's place.

mod support;

use std::process::Command;
use std::time::Duration;

use support::tls::{make_certificates, tls_origin};
use support::{url, Gateway, TempDir};

const BILLING: &str = "billing-real-0123456789abcdef";
const WRONG: &str = "wrong-real-0123456789abcdefgh";
/// The provider's key, which only the member's `headers` hold.
const PROVIDER_KEY: &str = "sk-provider-real-000000000000";

/// `echo` (proxy form to an echo member), `openai` (gateway form on `localhost`, the sluice
/// token in `Authorization`, the provider's key in the member's headers), and `tls` (a
/// `direct` route to an `https://` origin on loopback, reached by CONNECT); one client.
fn config(member: &str, tls_port: u16) -> String {
    r#"listen: ["{PROXY}"]
admin: { listen: "{ADMIN}" }
threads: 1
egress: { deny: [], connect_ports: [TLS_PORT] }
routes:
  - name: echo
    match: { hosts: [echo.test] }
    upstream: { members: [{ url: "MEMBER" }] }
  - name: openai
    match: { hosts: [localhost] }
    client_token: authorization
    upstream:
      members:
        - url: "MEMBER"
          name: key-a
          headers: { Authorization: "Bearer PROVIDER_KEY" }
  - name: tls
    match: { hosts: ["127.0.0.1"] }
    upstream: { members: [{ direct: true }] }
clients:
  list:
    - name: billing
      tokens: ["BILLING"]
      routes: [echo, openai, tls]
      destinations: ["127.0.0.1:TLS_PORT"]
"#
    .replace("MEMBER", member)
    .replace("TLS_PORT", &tls_port.to_string())
    .replace("PROVIDER_KEY", PROVIDER_KEY)
    .replace("BILLING", BILLING)
}

/// A gateway, its echo member, and an `https://` origin with its CA in `dir`.
struct Setup {
    gw: Gateway,
    member: sluice_echo::EchoServer,
    _origin: support::tls::Process,
    tls_port: u16,
    dir: TempDir,
}

async fn setup() -> Setup {
    let dir = TempDir::new("sluice-clients-real");
    make_certificates(dir.path());
    let (origin, tls_port) = tls_origin(dir.path());
    // The member keeps the Authorization of every request it gets.
    let options = sluice_echo::EchoOptions {
        log_requests: true,
        ..Default::default()
    };
    let member =
        sluice_echo::EchoServer::start_with("member", "127.0.0.1:0".parse().unwrap(), options)
            .await
            .unwrap();
    let gw = Gateway::start_with_ports(&config(&url(member.local_addr()), tls_port));
    Setup {
        gw,
        member,
        _origin: origin,
        tls_port,
        dir,
    }
}

impl Setup {
    fn proxy_url(&self, token: &str) -> String {
        format!("http://billing:{token}@{}", self.gw.proxy_addr())
    }

    fn ca(&self) -> String {
        self.dir.path().join("ca.pem").display().to_string()
    }

    fn https_target(&self) -> String {
        format!("https://127.0.0.1:{}/", self.tls_port)
    }
}

/// Runs `program` with `args` off the runtime, with a deadline; its stdout, or a panic with
/// what it printed.
async fn run(program: String, args: Vec<String>) -> String {
    run_checked(program, args, true).await
}

/// [`run`], where a failed exit is a panic only when `must_succeed`.
async fn run_checked(program: String, args: Vec<String>, must_succeed: bool) -> String {
    tokio::task::spawn_blocking(move || {
        let out = Command::new(&program)
            .args(&args)
            // No proxy of the machine's may stand between the client and sluice.
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .env_remove("HTTP_PROXY")
            .env_remove("HTTPS_PROXY")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy")
            .env("NO_PROXY", "")
            .output()
            .unwrap_or_else(|e| panic!("{program}: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() || !must_succeed,
            "{program} {args:?} failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    })
    .await
    .unwrap()
}

/// `curl -x <proxy URL> <target>`: the status code curl saw (the proxy's, for a refused
/// CONNECT).
async fn curl(proxy: String, target: String, ca: String) -> String {
    let args = [
        "-sS",
        "-o",
        "/dev/null",
        "--max-time",
        "20",
        "--cacert",
        &ca,
        "-w",
        "%{http_code} %{http_connect}",
        "-x",
        &proxy,
        &target,
    ];
    // A refused CONNECT is a failed exit: the status written out says what happened.
    let args = args.iter().map(|a| a.to_string()).collect();
    run_checked("curl".into(), args, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_with_credentials_in_the_proxy_url() {
    let s = setup().await;
    let echo = "http://echo.test/curl".to_string();
    assert_eq!(
        curl(s.proxy_url(BILLING), echo.clone(), s.ca()).await,
        "200 000"
    );
    assert_eq!(curl(s.proxy_url(WRONG), echo, s.ca()).await, "407 000");
    // https: curl sends the credentials on its CONNECT, then speaks TLS to the origin.
    assert_eq!(
        curl(s.proxy_url(BILLING), s.https_target(), s.ca()).await,
        "200 200"
    );
    assert_eq!(
        curl(s.proxy_url(WRONG), s.https_target(), s.ca()).await,
        "000 407"
    );
    // The member saw no credential of the client's.
    let seen: Vec<String> = s.member.request_log().into_iter().map(|r| r.key).collect();
    assert_eq!(seen, [""], "{seen:?}");
}

/// Python: `requests` and `httpx`, each with the credentials in the proxy URL, for an
/// `http://` target (proxy form) and an `https://` one (CONNECT). Prints one status per line.
const PYTHON_CLIENTS: &str = r#"
import sys, requests, httpx
proxy, wrong, ca, https_target = sys.argv[1:5]
plain = "http://echo.test/python"
proxies = {"http": proxy, "https": proxy}
print("requests http", requests.get(plain, proxies=proxies, timeout=20).status_code)
print("requests https", requests.get(https_target, proxies=proxies, verify=ca, timeout=20).status_code)
print("requests wrong", requests.get(plain, proxies={"http": wrong}, timeout=20).status_code)
with httpx.Client(proxy=proxy, verify=ca, timeout=20) as client:
    print("httpx http", client.get(plain).status_code)
    print("httpx https", client.get(https_target).status_code)
with httpx.Client(proxy=wrong, timeout=20) as client:
    print("httpx wrong", client.get(plain).status_code)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_and_httpx_with_credentials_in_the_proxy_url() {
    let Some(python) = support::test_python() else {
        return;
    };
    let s = setup().await;
    let out = run(
        python,
        vec![
            "-c".into(),
            PYTHON_CLIENTS.into(),
            s.proxy_url(BILLING),
            s.proxy_url(WRONG),
            s.ca(),
            s.https_target(),
        ],
    )
    .await;
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "requests http 200",
            "requests https 200",
            "requests wrong 407",
            "httpx http 200",
            "httpx https 200",
            "httpx wrong 407",
        ],
        "{out}"
    );
    let seen: Vec<String> = s.member.request_log().into_iter().map(|r| r.key).collect();
    assert_eq!(seen, ["", ""], "{seen:?}");
}

/// Node with no package: `http.request` to the proxy with an absolute URL and
/// `Proxy-Authorization`, and a CONNECT with it, then TLS to the origin over the tunnel.
const NODE_CLIENT: &str = r#"
const http = require("http"), tls = require("tls"), fs = require("fs");
const [proxyHost, proxyPort, auth, wrong, ca, tlsPort] = process.argv.slice(1);
const basic = (cred) => "Basic " + Buffer.from(cred).toString("base64");
function plain(cred) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: proxyHost, port: proxyPort, path: "http://echo.test/node",
      headers: { Host: "echo.test", "Proxy-Authorization": basic(cred) } }, (res) => {
      res.resume();
      res.on("end", () => resolve(res.statusCode));
    });
    req.on("error", reject);
    req.end();
  });
}
function tunnel(cred) {
  return new Promise((resolve, reject) => {
    const target = `127.0.0.1:${tlsPort}`;
    // A connection of its own, as proxy agents (https-proxy-agent) open for each tunnel.
    const req = http.request({ host: proxyHost, port: proxyPort, method: "CONNECT", path: target,
      agent: false, headers: { Host: target, "Proxy-Authorization": basic(cred) } });
    req.on("connect", (res, socket) => {
      if (res.statusCode !== 200) { socket.destroy(); return resolve(`connect ${res.statusCode}`); }
      const secure = tls.connect({ socket, ca: fs.readFileSync(ca), host: "127.0.0.1" }, () => {
        secure.write("GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
      });
      let data = "";
      secure.on("data", (d) => { data += d; });
      secure.on("end", () => resolve(data.split("\r\n")[0]));
      secure.on("error", reject);
    });
    req.on("error", reject);
    req.end();
  });
}
(async () => {
  console.log("http", await plain(auth));
  console.log("http wrong", await plain(wrong));
  console.log("https", await tunnel(auth));
  console.log("https wrong", await tunnel(wrong));
})().catch((e) => { console.error(e); process.exit(1); });
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_with_proxy_authorization() {
    if Command::new("node").arg("--version").output().is_err() {
        assert!(
            !std::env::var("CI").is_ok_and(|v| v == "true"),
            "CI=true but node is missing: scripts/test-deps installs it (Debian: nodejs)"
        );
        eprintln!("SKIPPED: node is not installed (Debian: apt-get install nodejs)");
        return;
    }
    let s = setup().await;
    let proxy = s.gw.proxy_addr();
    let out = run(
        "node".into(),
        vec![
            "-e".into(),
            NODE_CLIENT.into(),
            proxy.ip().to_string(),
            proxy.port().to_string(),
            format!("billing:{BILLING}"),
            format!("billing:{WRONG}"),
            s.ca(),
            s.tls_port.to_string(),
        ],
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    assert_eq!(lines[0], "http 200", "{out}");
    assert_eq!(lines[1], "http wrong 407", "{out}");
    assert!(lines[2].starts_with("https HTTP/1.0 200"), "{out}");
    assert_eq!(lines[3], "https wrong connect 407", "{out}");
}

/// The `openai` SDK, pointed at sluice (gateway form) with the client's sluice token as its
/// API key. It prints the Authorization it sent and the one the member reports having got.
const OPENAI_CLIENT: &str = r#"
import json, sys, openai
base_url, token = sys.argv[1:3]
client = openai.OpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=20)
raw = client.chat.completions.with_raw_response.create(
    model="gpt-test", messages=[{"role": "user", "content": "hello"}])
print(json.dumps({
    "status": raw.status_code,
    "sent": raw.http_request.headers.get("authorization"),
    "member_got": json.loads(raw.text)["headers"].get("authorization"),
}))
try:
    openai.OpenAI(base_url=base_url, api_key="not-a-sluice-token-000000", max_retries=0,
                  timeout=20).models.list()
    print(json.dumps({"wrong": "accepted"}))
except openai.AuthenticationError as e:
    print(json.dumps({"wrong": e.status_code}))
"#;

/// Virtual keys: the SDK holds a sluice token, never the provider's key; sluice identifies the
/// client by it, removes it, and the member's `headers` put the provider's key in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_with_a_sluice_token_as_its_key() {
    let Some(python) = support::test_python() else {
        return;
    };
    let s = setup().await;
    let base_url = format!("http://localhost:{}/v1", s.gw.proxy_addr().port());
    let out = run(
        python,
        vec!["-c".into(), OPENAI_CLIENT.into(), base_url, BILLING.into()],
    )
    .await;
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("{out}")))
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(lines[0]["status"], 200, "{out}");
    assert_eq!(lines[0]["sent"], format!("Bearer {BILLING}"), "{out}");
    assert_eq!(
        lines[0]["member_got"],
        format!("Bearer {PROVIDER_KEY}"),
        "{out}"
    );
    assert_eq!(lines[1]["wrong"], 401, "{out}");
    // What the member itself recorded: the provider's key, once; never the sluice token.
    let seen: Vec<String> = s.member.request_log().into_iter().map(|r| r.key).collect();
    assert_eq!(seen, [format!("Bearer {PROVIDER_KEY}")], "{seen:?}");
    // The client is named in the access log.
    let named = support::wait_until(Duration::from_secs(20), || {
        s.gw.log_json().iter().any(|l| {
            l["target"] == "sluice::access"
                && l["route"] == "openai"
                && l["client_name"] == "billing"
        })
    })
    .await;
    assert!(named, "{}", s.gw.logs());
}
