//! Clients (SPEC §9) end to end, through the real `sluice` binary: identification by
//! `Proxy-Authorization` (curl's `-x http://name:token@…`, Bearer), by a route's
//! `client_token` header in gateway form, and by address; every row of the answers table for
//! plain requests, CONNECT tunnels and WebSocket upgrades; `report` mode; `unknown:
//! anonymous`; a failing credential that never falls back; the credentials removed before the
//! member sees the request; a reload that adds and removes a client; and no token anywhere an
//! operator can look.

mod support;

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use support::{
    open_tunnel, request, start_backends, url, wait_until_async, Backend, Gateway, HttpClient,
    Response, Store,
};

const BILLING: &str = "billing-token-0123456789";
const BATCH: &str = "batch-token-0123456789abc";
const REMOVED: &str = "removed-token-0123456789";
/// The provider's key, which only the member's `headers` hold.
const PROVIDER_KEY: &str = "sk-provider-key-00000000";

/// The config: `openai` (gateway form, client_token, a key member), `api` (any form, an echo
/// member), `admin-api` (nobody's), `direct` (the client's own target, loopback allowed), and
/// the clients. `{CLIENTS_EXTRA}` goes at the top of the clients section, `{MORE}` at the end
/// of its list.
fn config(member: &str, direct_port: u16, state: &str, clients_extra: &str, more: &str) -> String {
    let other = direct_port.wrapping_add(1);
    format!(
        r#"listen: ["{{PROXY}}"]
admin: {{ listen: "{{ADMIN}}" }}
threads: 1
{state}
egress: {{ deny: [], connect_ports: [{direct_port}, {other}] }}
routes:
  - name: openai
    match: {{ hosts: [openai.test] }}
    client_token: authorization
    upstream:
      members:
        - url: "{member}"
          name: key-a
          headers: {{ Authorization: "Bearer {PROVIDER_KEY}" }}
    quota: {{ windows: [{{ name: burst, limit: 1000, window: 1m }}] }}
  - name: api
    match: {{ hosts: [api.test] }}
    client_token: x-sluice-token
    upstream: {{ members: [{{ url: "{member}" }}] }}
  - name: admin-api
    match: {{ hosts: [admin-api.test] }}
    upstream: {{ members: [{{ url: "{member}" }}] }}
  - name: direct
    match: {{ hosts: ["127.0.0.1"] }}
    upstream: {{ members: [{{ direct: true }}] }}
clients:
{clients_extra}  list:
    - name: billing
      tokens: ["${{BILLING_TOKEN}}"]
      routes: [openai, api, direct]
      destinations: ["127.0.0.1:{direct_port}"]
    - name: batch
      tokens: ["{BATCH}"]
      routes: ["*"]
      cidrs: ["10.99.0.0/16"]
{more}"#
    )
}

fn start(member: SocketAddr, direct_port: u16, store: &Store, extra: &str, more: &str) -> Gateway {
    let state = match store.redis() {
        Some(redis) => format!(
            // The tests' generous call timeout, not the 50 ms default: a slow call on a loaded
            // machine would be a store error, which admits uncounted.
            "state: {{ backend: redis, redis: {{ url: \"{}\", timeout: {} }} }}",
            redis.url(),
            support::config::REDIS_TIMEOUT
        ),
        None => String::new(),
    };
    Gateway::start_with_ports_and_env(
        &config(&url(member), direct_port, &state, extra, more),
        &[("BILLING_TOKEN", BILLING)],
    )
}

fn basic(name: &str, token: &str) -> String {
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{name}:{token}"));
    format!("Basic {encoded}")
}

/// A request in proxy form (`GET http://host/path`) on a new connection.
async fn proxy_get(gw: &Gateway, host: &str, headers: &[(&str, &str)]) -> Response {
    let mut all = headers.to_vec();
    all.push(("Connection", "close"));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    client
        .request("GET", host, &format!("http://{host}/x"), &all, b"")
        .await
        .unwrap()
}

/// A request in gateway form (`GET /path`, `Host: host`).
async fn gateway_get(gw: &Gateway, host: &str, headers: &[(&str, &str)]) -> Response {
    request(gw.proxy_addr(), "GET", host, "/x", headers, b"").await
}

/// `curl -x <proxy URL> <url>`: the status, and the body.
async fn curl(proxy: String, target: String) -> (String, String) {
    tokio::task::spawn_blocking(move || {
        let out = Command::new("curl")
            .env_clear()
            .args(["-sS", "--max-time", "20", "-w", "\n%{http_code}", "-x"])
            .arg(&proxy)
            .arg(&target)
            .output()
            .expect("curl must be installed");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, status) = stdout.rsplit_once('\n').unwrap_or(("", ""));
        (status.to_string(), body.to_string())
    })
    .await
    .unwrap()
}

fn error_code(r: &Response) -> Option<&str> {
    r.header("x-sluice-error")
}

/// The access lines whose `client_name` is `name`.
fn lines_of(gw: &Gateway, name: &str) -> Vec<serde_json::Value> {
    gw.log_json()
        .into_iter()
        .filter(|l| l["target"] == "sluice::access" && l["client_name"] == name)
        .collect()
}

on_both_stores!(
    every_answer_of_the_table_for_requests_and_tunnels,
    report_mode_logs_counts_and_lets_go,
);

/// Every row of SPEC §9's answers table, in proxy form, gateway form and CONNECT, and the
/// requests that are let through, on each store.
async fn every_answer_of_the_table_for_requests_and_tunnels(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["api"]).await;
    let member = backends[0].local_addr();
    let gw = start(member, member.port(), &store, "", "");

    // Identified, in proxy form, with curl's own `-x http://name:token@…`.
    let proxy = gw.proxy_addr();
    let (status, body) = curl(
        format!("http://billing:{BILLING}@{proxy}"),
        "http://api.test/x".into(),
    )
    .await;
    assert_eq!(status, "200", "{body}\n{}", gw.logs());
    let seen: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        seen["headers"].get("proxy-authorization").is_none(),
        "Proxy-Authorization reached the member: {seen}"
    );
    // And with Bearer.
    let bearer = format!("Bearer {BILLING}");
    let r = proxy_get(&gw, "api.test", &[("Proxy-Authorization", &bearer)]).await;
    assert_eq!(r.status, 200, "{}", r.text());

    // No identity, proxy form: 407 with the challenge.
    let r = proxy_get(&gw, "api.test", &[]).await;
    assert_eq!(
        (r.status, error_code(&r)),
        (407, Some("proxy_auth_required"))
    );
    assert_eq!(
        r.header("proxy-authenticate"),
        Some("Basic realm=\"sluice\"")
    );
    let (status, _) = curl(format!("http://{proxy}"), "http://api.test/x".into()).await;
    assert_eq!(status, "407");

    // No identity, gateway form: 401 with the challenge.
    let r = gateway_get(&gw, "api.test", &[]).await;
    assert_eq!(
        (r.status, error_code(&r)),
        (401, Some("client_auth_required"))
    );
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    assert!(r.text().contains("x-sluice-token"), "{}", r.text());

    // Known client, route not in its routes: 403 route_denied, in either form.
    let r = proxy_get(&gw, "admin-api.test", &[("Proxy-Authorization", &bearer)]).await;
    assert_eq!((r.status, error_code(&r)), (403, Some("route_denied")));
    let r = gateway_get(&gw, "api.test", &[("X-Sluice-Token", BATCH)]).await;
    assert_eq!(
        (r.status, error_code(&r)),
        (401, Some("client_auth_required")),
        "batch must connect from 10.99.0.0/16: a known token from elsewhere is a failure"
    );

    // Known client, `direct` target not in its destinations: 403 destination_denied; the one
    // it lists is reached.
    // In egress.connect_ports (the config adds it), in no destinations of billing.
    let other_port = member.port().wrapping_add(1);
    let r = proxy_get(
        &gw,
        &format!("127.0.0.1:{other_port}"),
        &[("Proxy-Authorization", &bearer)],
    )
    .await;
    assert_eq!(
        (r.status, error_code(&r)),
        (403, Some("destination_denied")),
        "{}",
        r.text()
    );
    let r = proxy_get(
        &gw,
        &format!("127.0.0.1:{}", member.port()),
        &[("Proxy-Authorization", &bearer)],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());

    // CONNECT: the same answers, before anything is contacted.
    let authority = format!("127.0.0.1:{}", member.port());
    let (_, r) = open_tunnel(proxy, &authority, false).await;
    assert_eq!(
        (r.status, error_code(&r)),
        (407, Some("proxy_auth_required"))
    );
    assert_eq!(
        r.header("proxy-authenticate"),
        Some("Basic realm=\"sluice\"")
    );
    // `opens`: a 200 is expected, whose head alone is read; else a refusal, head and body.
    let tunnel = |auth: String, to: String, opens: bool| async move {
        let mut client = HttpClient::connect(proxy).await.unwrap();
        client
            .write_raw(
                format!(
                    "CONNECT {to} HTTP/1.1\r\nHost: {to}\r\nProxy-Authorization: {auth}\r\n\r\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        let r = client.read_response(opens).await.unwrap();
        (client, r)
    };
    let (mut open, r) = tunnel(basic("billing", BILLING), authority.clone(), true).await;
    assert_eq!(r.status, 200, "{}", gw.logs());
    // The tunnel carries a request to the member.
    let through = open
        .request(
            "GET",
            "api.test",
            "/through",
            &[("Connection", "close")],
            b"",
        )
        .await
        .unwrap();
    assert_eq!(through.status, 200);
    let (_, r) = tunnel(
        basic("billing", "wrong-token-0123456789"),
        authority.clone(),
        false,
    )
    .await;
    assert_eq!(
        (r.status, error_code(&r)),
        (407, Some("proxy_auth_required"))
    );
    // A CONNECT to a port egress allows and the client's destinations do not: the clients
    // step refuses it, before anything is contacted.
    let (_, r) = tunnel(
        basic("billing", BILLING),
        format!("127.0.0.1:{other_port}"),
        false,
    )
    .await;
    assert_eq!(
        (r.status, error_code(&r)),
        (403, Some("destination_denied"))
    );
    assert!(r.text().contains("its destinations"), "{}", r.text());
    // A route the client may not use, by CONNECT: `batch` comes from the wrong address.
    let (_, r) = tunnel(format!("Bearer {BATCH}"), authority.clone(), false).await;
    assert_eq!(
        (r.status, error_code(&r)),
        (407, Some("proxy_auth_required"))
    );

    // Enforce counts what it refused.
    let refused = gw
        .metric("sluice_client_denials_total", &[("mode", "enforce")])
        .await
        .unwrap_or(0.0);
    assert!(refused >= 8.0, "{refused}");
    // The access lines name the client.
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            lines_of(&gw, "billing").len() >= 4
        })
        .await,
        "{}",
        gw.logs()
    );
    drop(backends);
}

/// `mode: report`: what enforce would refuse is logged (`"authz": "would_deny"`), counted
/// (`mode="report"`), and let through; enforce counts its refusals as `mode="enforce"`.
async fn report_mode_logs_counts_and_lets_go(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["api"]).await;
    let member = backends[0].local_addr();
    let gw = start(member, member.port(), &store, "  mode: report\n", "");
    let r = proxy_get(&gw, "api.test", &[]).await;
    assert_eq!(r.status, 200, "report mode lets it go: {}", r.text());
    let bearer = format!("Bearer {BILLING}");
    let r = proxy_get(&gw, "admin-api.test", &[("Proxy-Authorization", &bearer)]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let counted = |code: &'static str| {
        let gw = &gw;
        async move {
            gw.metric(
                "sluice_client_denials_total",
                &[("mode", "report"), ("code", code)],
            )
            .await
            .unwrap_or(0.0)
        }
    };
    assert_eq!(counted("proxy_auth_required").await, 1.0);
    assert_eq!(counted("route_denied").await, 1.0);
    let deadline = Duration::from_secs(20);
    assert!(
        wait_until_async(deadline, || async {
            let lines = gw.log_json();
            let would = |route: &str| {
                lines.iter().any(|l| {
                    l["target"] == "sluice::access"
                        && l["route"] == route
                        && l["authz"] == "would_deny"
                })
            };
            would("api") && would("admin-api")
        })
        .await,
        "{}",
        gw.logs()
    );
    // The identified client is still named.
    assert!(lines_of(&gw, "billing")
        .iter()
        .any(|l| l["route"] == "admin-api"));
}

/// Virtual keys: in gateway form the client's `Authorization: Bearer <sluice token>`
/// identifies it and is removed; the member's `headers` put the provider's key in its place.
/// A route's `client_token` header is removed whether or not it identified anyone, and
/// `Proxy-Authorization` always is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_removed_and_the_member_key_takes_their_place() {
    let store = Store::start(Backend::Memory);
    let backends = start_backends(&["api"]).await;
    let member = backends[0].local_addr();
    let gw = start(
        member,
        member.port(),
        &store,
        "  unknown: anonymous\n",
        ANONYMOUS,
    );

    let r = gateway_get(
        &gw,
        "openai.test",
        &[("Authorization", &format!("Bearer {BILLING}"))],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["headers"]["authorization"],
        format!("Bearer {PROVIDER_KEY}")
    );

    // On `api` (client_token: x-sluice-token, no member headers): the token never reaches the
    // member, nor does Proxy-Authorization, identified or not (anonymous may use `api`).
    let r = gateway_get(&gw, "api.test", &[("X-Sluice-Token", BILLING)]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.json()["headers"].get("x-sluice-token").is_none(),
        "{}",
        r.text()
    );
    let r = proxy_get(
        &gw,
        "api.test",
        &[("Proxy-Authorization", &basic("billing", BILLING))],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.json()["headers"].get("proxy-authorization").is_none(),
        "{}",
        r.text()
    );
    let r = gateway_get(&gw, "api.test", &[]).await;
    assert_eq!(r.status, 200, "anonymous may use api: {}", r.text());
    // Anonymous has its own routes, no more.
    let r = gateway_get(&gw, "admin-api.test", &[]).await;
    assert_eq!((r.status, error_code(&r)), (403, Some("route_denied")));
    assert!(r.text().contains("anonymous"), "{}", r.text());
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            !lines_of(&gw, "anonymous").is_empty() && lines_of(&gw, "billing").len() >= 3
        })
        .await,
        "{}",
        gw.logs()
    );
}

/// The anonymous client of `unknown: anonymous`: only `api`.
const ANONYMOUS: &str = "    - name: anonymous\n      routes: [api]\n";

/// A credential presented that fails gets 407 or 401: never the address's client, never
/// anonymous. Malformed `Proxy-Authorization` headers are failures too, and crash nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_credential_never_falls_back() {
    let store = Store::start(Backend::Memory);
    let backends = start_backends(&["api"]).await;
    let member = backends[0].local_addr();
    // `local` is known by address alone, and is where the test connects from.
    let local = "    - name: local\n      cidrs: [\"127.0.0.0/8\"]\n      routes: [\"*\"]\n";
    let gw = start(
        member,
        member.port(),
        &store,
        "  unknown: anonymous\n",
        &format!("{ANONYMOUS}{local}"),
    );
    // No credential: the address identifies `local`.
    let r = proxy_get(&gw, "admin-api.test", &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            !lines_of(&gw, "local").is_empty()
        })
        .await,
        "{}",
        gw.logs()
    );
    let long = basic("billing", &"a".repeat(10 * 1024));
    let not_utf8 = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode([0xff, 0xfe, b':', b'x'])
    );
    for value in [
        basic("billing", "wrong-token-0123456789"),
        basic("batch", BILLING),
        format!("Bearer {BILLING}x"),
        "Basic !!!".to_string(),
        basic("no-colon", "").replace("Basic ", "Basic A"),
        "Basic".to_string(),
        long,
        not_utf8,
    ] {
        let r = proxy_get(&gw, "admin-api.test", &[("Proxy-Authorization", &value)]).await;
        assert_eq!(
            (r.status, error_code(&r)),
            (407, Some("proxy_auth_required")),
            "{}…",
            &value[..value.len().min(30)]
        );
        let sent = value.get(6..value.len().min(40)).unwrap_or_default();
        assert!(
            sent.is_empty() || !r.text().contains(sent),
            "the answer quotes the credential"
        );
    }
    // In gateway form, a wrong token in the route's header: 401, not `local`.
    let r = gateway_get(
        &gw,
        "api.test",
        &[("X-Sluice-Token", "wrong-token-0123456789")],
    )
    .await;
    assert_eq!(
        (r.status, error_code(&r)),
        (401, Some("client_auth_required"))
    );
    assert!(gw.logs().contains("\"client_name\":\"local\""));
    assert!(
        gw.metric("sluice_client_denials_total", &[("mode", "enforce")])
            .await
            .unwrap_or(0.0)
            >= 9.0
    );
}

/// A WebSocket upgrade takes the same step: refused without identity, passed to the member
/// (which answers 101) with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_upgrade_is_identified_like_any_request() {
    let store = Store::start(Backend::Memory);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let member = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await {
                    use futures_util::StreamExt;
                    while let Some(Ok(_)) = ws.next().await {}
                }
            });
        }
    });
    let gw = start(member, member.port(), &store, "", "");
    let upgrade = |extra: Option<(&'static str, String)>| {
        let proxy = gw.proxy_addr();
        async move {
            let mut headers = vec![
                ("Upgrade", "websocket".to_string()),
                ("Connection", "Upgrade".to_string()),
                ("Sec-WebSocket-Version", "13".to_string()),
                ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==".to_string()),
            ];
            headers.extend(extra);
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            // Read by hand: a 101 is no interim answer here, and the test client skips those.
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
            let head = support::request_head("GET", "api.test", "/ws", &headers, 0);
            stream.write_all(head.as_bytes()).await.unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
                    .await
                    .expect("an answer within 10s")
                    .unwrap();
                assert!(n > 0, "closed before an answer");
                got.extend_from_slice(&buf[..n]);
            }
            let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
            let status: u16 = text[9..12].parse().unwrap();
            let code = text
                .lines()
                .find_map(|l| l.strip_prefix("x-sluice-error: "))
                .map(|c| c.trim().to_string());
            (status, code)
        }
    };
    let refused = (401, Some("client_auth_required".to_string()));
    assert_eq!(upgrade(None).await, refused);
    let wrong = Some(("X-Sluice-Token", "wrong-token-0123456789".into()));
    assert_eq!(upgrade(wrong).await, refused);
    let batch = Some(("X-Sluice-Token", BATCH.to_string()));
    assert_eq!(
        upgrade(batch).await,
        refused,
        "batch from the wrong address"
    );
    let r = upgrade(Some(("X-Sluice-Token", BILLING.into()))).await;
    assert_eq!(r, (101, None), "{}", gw.logs());
}

/// The `clients` section reloads with the routes: a client added is let in, and a removed
/// client's next request is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_and_removes_clients() {
    let store = Store::start(Backend::Memory);
    let backends = start_backends(&["api"]).await;
    let member = backends[0].local_addr();
    let removed =
        format!("    - name: leaving\n      tokens: [\"{REMOVED}\"]\n      routes: [api]\n");
    let gw = start(member, member.port(), &store, "", &removed);
    let bearer = |t: &str| format!("Bearer {t}");
    let leaving = bearer(REMOVED);
    let leaving = [("Proxy-Authorization", leaving.as_str())];
    let as_leaving = || proxy_get(&gw, "api.test", &leaving);
    assert_eq!(as_leaving().await.status, 200);

    // `leaving` goes, `arriving` comes.
    let arriving = "arriving-token-0123456789";
    let next =
        format!("    - name: arriving\n      tokens: [\"{arriving}\"]\n      routes: [api]\n");
    gw.write_config_template(&config(&url(member), member.port(), "", "", &next));
    let reload = gw.post_reload().await;
    // The new file reads ${BILLING_TOKEN} from the process's environment, set at start.
    assert_eq!(reload.status, 200, "{}", reload.text());
    let r = as_leaving().await;
    assert_eq!(
        (r.status, error_code(&r)),
        (407, Some("proxy_auth_required"))
    );
    let r = proxy_get(
        &gw,
        "api.test",
        &[("Proxy-Authorization", &bearer(arriving))],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Tokens never show in logs (any level), `/status`, `/metrics`, answers, or `sluice check`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_show_nowhere() {
    let backends = start_backends(&["api"]).await;
    let member = backends[0].local_addr();
    let yaml = config(&url(member), member.port(), "", "", "");
    let gw = Gateway::start_with_ports_and_env(
        &yaml,
        &[("BILLING_TOKEN", BILLING), ("RUST_LOG", "trace")],
    );
    let mut answers = String::new();
    for headers in [
        vec![("Proxy-Authorization", basic("billing", BILLING))],
        vec![("Proxy-Authorization", format!("Bearer {BATCH}"))],
        vec![(
            "Proxy-Authorization",
            basic("nobody", "nobody-token-0123456789"),
        )],
    ] {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        for host in ["api.test", "admin-api.test"] {
            answers.push_str(&proxy_get(&gw, host, &headers).await.text());
        }
    }
    answers.push_str(
        &gateway_get(
            &gw,
            "openai.test",
            &[("Authorization", &format!("Bearer {BILLING}"))],
        )
        .await
        .text(),
    );
    let status = gw.admin("/status").await.text();
    let metrics = gw.metrics().await;
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            lines_of(&gw, "billing").len() >= 2
        })
        .await,
        "{}",
        gw.logs()
    );
    let logs = gw.logs();
    for token in [BILLING, BATCH, "nobody-token-0123456789", PROVIDER_KEY] {
        for (surface, text) in [
            ("logs", &logs),
            ("status", &status),
            ("metrics", &metrics),
            ("answers", &answers),
        ] {
            // The echo member shows the request it got, with the key sluice gave it.
            if token == PROVIDER_KEY && surface == "answers" {
                continue;
            }
            assert!(!text.contains(token), "{token} in {surface}");
        }
    }
    // `sluice check` on a config where two clients share a token names neither the token nor
    // its variable's value.
    let dir = support::TempDir::new("sluice-clients-check");
    let file = dir.path().join("sluice.yaml");
    let shared = format!("    - name: copy\n      tokens: [\"{BILLING}\"]\n      routes: [api]\n");
    let bad = config(&url(member), member.port(), "", "", &shared)
        .replace("{PROXY}", "127.0.0.1:1")
        .replace("{ADMIN}", "127.0.0.1:2");
    std::fs::write(&file, bad).unwrap();
    let out = Command::new(support::sluice_binary())
        .args(["check", "-c"])
        .arg(&file)
        .env("BILLING_TOKEN", BILLING)
        .output()
        .unwrap();
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{printed}");
    assert!(printed.contains("clients.list[2].tokens[0]"), "{printed}");
    assert!(!printed.contains(BILLING), "{printed}");
}

/// Without a `clients` section nothing changes: every caller uses every route, and a
/// non-loopback proxy listener is warned about at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_clients_everything_is_as_before() {
    let backends = start_backends(&["api"]).await;
    let member = backends[0].local_addr();
    let yaml = format!(
        "listen: [\"{{PROXY}}\", \"0.0.0.0:{}\"]\nadmin: {{ listen: \"{{ADMIN}}\" }}\nthreads: 1\nroutes:\n  - name: api\n    match: {{ hosts: [api.test] }}\n    upstream: {{ members: [{{ url: \"{}\" }}] }}\n",
        support::free_port(),
        url(member)
    );
    let gw = Gateway::start_with_ports(&yaml);
    let r = proxy_get(
        &gw,
        "api.test",
        &[("Proxy-Authorization", &basic("x", "y"))],
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.json()["headers"].get("proxy-authorization").is_none());
    assert!(
        gw.logs().contains("there is no clients section"),
        "{}",
        gw.logs()
    );
    assert!(!gw.logs().contains("client_name"));
}
