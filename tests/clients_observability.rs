//! What operators see of clients, through the real `sluice` binary: the `client` label of
//! `sluice_client_requests_total` and `sluice_client_denials_total`, bounded by the list
//! (plus `unknown`) however many distinct credentials callers make up, following reloads;
//! the clients in `/status` with their counts; and no token on any surface an operator can
//! look at (logs at trace level, `/status`, `/metrics`, answers, exported spans, `sluice
//! check`).

mod support;

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use support::{
    request, start_backends, url, wait_until_async, Backend, Gateway, HttpClient, Response, Store,
};

const BILLING: &str = "billing-token-obs-0123456789";
const BATCH: &str = "batch-token-obs-0123456789ab";
const OPS: &str = "ops-token-obs-0123456789abcd";
/// The provider's key, which only the member's `headers` hold.
const PROVIDER_KEY: &str = "sk-provider-obs-0000000000";
const WAIT: Duration = Duration::from_secs(20);

/// `api` (any form; `client_token: x-sluice-token`), `openai` (gateway form, `client_token:
/// authorization`, the provider's key in the member's headers), `admin-api` (nobody's), and
/// clients `billing` and `batch`, then `more` at the end of the list. `MODE` is the mode.
/// The failed-identification bound is high, so that many bad credentials stay failures
/// instead of becoming `auth_throttled`.
fn config(member: &str, mode: &str, more: &str) -> String {
    r#"listen: ["{PROXY}"]
admin: { listen: "{ADMIN}" }
threads: 1
routes:
  - name: api
    match: { hosts: [api.test] }
    client_token: x-sluice-token
    upstream: { members: [{ url: "MEMBER" }] }
  - name: openai
    match: { hosts: [openai.test] }
    client_token: authorization
    upstream:
      members:
        - url: "MEMBER"
          name: key-a
          headers: { Authorization: "Bearer PROVIDER_KEY" }
  - name: admin-api
    match: { hosts: [admin-api.test] }
    upstream: { members: [{ url: "MEMBER" }] }
clients:
  mode: MODE
  failed_auth: { limit: 100000 }
  list:
    - name: billing
      tokens: ["${BILLING_TOKEN}"]
      routes: [api, openai]
    - name: batch
      tokens: ["BATCH"]
      routes: ["*"]
      quota: { windows: [{ name: daily, limit: 100, window: 1h }] }
"#
    .replace("MEMBER", member)
    .replace("MODE", mode)
    .replace("PROVIDER_KEY", PROVIDER_KEY)
    .replace("BATCH", BATCH)
        + more
}

fn start(member: &str, mode: &str, more: &str, env: &[(&str, &str)]) -> Gateway {
    let mut all = vec![("BILLING_TOKEN", BILLING)];
    all.extend_from_slice(env);
    Gateway::start_with_ports_and_env(&config(member, mode, more), &all)
}

fn basic(name: &str, token: &str) -> String {
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{name}:{token}"));
    format!("Basic {encoded}")
}

/// A request in proxy form (`GET http://host/x`) on a new connection.
async fn proxy_get(gw: &Gateway, host: &str, headers: &[(&str, &str)]) -> Response {
    let mut all = headers.to_vec();
    all.push(("Connection", "close"));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    client
        .request("GET", host, &format!("http://{host}/x"), &all, b"")
        .await
        .unwrap()
}

/// A request in gateway form (`GET /x`, `Host: host`).
async fn gateway_get(gw: &Gateway, host: &str, headers: &[(&str, &str)]) -> Response {
    request(gw.proxy_addr(), "GET", host, "/x", headers, b"").await
}

async fn reload(gw: &Gateway, yaml: &str) {
    gw.write_config_template(yaml);
    let r = gw.post_reload().await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Every value the `client` label has in the scrape, over all metrics.
fn client_labels(metrics: &str) -> BTreeSet<String> {
    let scrape = prometheus_parse::Scrape::parse(metrics.lines().map(|l| Ok(l.to_string())))
        .expect("a valid exposition");
    scrape
        .samples
        .iter()
        .filter_map(|s| s.labels.get("client").map(str::to_string))
        .collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| n.to_string()).collect()
}

/// `sluice_client_requests_total` of `client`, all statuses, or of one status.
fn requests(metrics: &str, client: &str, status: Option<&str>) -> f64 {
    let mut labels = vec![("client", client)];
    labels.extend(status.map(|s| ("status", s)));
    support::metric_value(metrics, "sluice_client_requests_total", &labels).unwrap_or(0.0)
}

/// The client named `name` in `/status`.
fn status_client(status: &serde_json::Value, name: &str) -> serde_json::Value {
    status["clients"]["list"]
        .as_array()
        .unwrap_or_else(|| panic!("no clients in /status: {status}"))
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no client {name} in /status: {status}"))
        .clone()
}

/// Many callers making up credentials (Basic with made-up names, Bearer, the route's
/// `client_token` header) add no label value: the `client` label holds the listed names and
/// `unknown`, whatever callers send. Each client's requests and refusals are counted under its
/// name, `/status` lists them, and a reload that adds a client adds its series (at 0) while
/// one that removes a client takes its series away. In `report` mode the refusals let go are
/// counted apart, per client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_label_is_bounded_by_the_list_and_status_shows_each_client() {
    let backends = start_backends(&["api"]).await;
    let member = url(backends[0].local_addr());
    let gw = start(&member, "enforce", "", &[]);

    // Before any traffic, every listed client and `unknown` are there, at 0.
    let before = gw.metrics().await;
    assert_eq!(
        client_labels(&before),
        set(&["batch", "billing", "unknown"]),
        "{before}"
    );
    assert_eq!(
        support::metric_value(
            &before,
            "sluice_client_requests_total",
            &[("client", "billing"), ("status", "200")]
        ),
        Some(0.0)
    );

    // So are the refusals of callers nobody identified, so an alert on them needs no first one.
    assert_eq!(
        support::metric_value(
            &before,
            "sluice_client_denials_total",
            &[
                ("mode", "enforce"),
                ("code", "proxy_auth_required"),
                ("client", "unknown")
            ]
        ),
        Some(0.0)
    );

    let billing = basic("billing", BILLING);
    for _ in 0..3 {
        let r = proxy_get(&gw, "api.test", &[("Proxy-Authorization", &billing)]).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    for _ in 0..2 {
        let r = proxy_get(&gw, "admin-api.test", &[("Proxy-Authorization", &billing)]).await;
        assert_eq!(r.status, 403, "{}", r.text());
    }
    let r = gateway_get(&gw, "api.test", &[("X-Sluice-Token", BATCH)]).await;
    assert_eq!(r.status, 200, "{}", r.text());

    // Made-up credentials, each one distinct, in each way a caller can present one.
    const EACH: usize = 15;
    for i in 0..EACH {
        let made_up = format!("made-up-token-{i:04}-0123456789");
        let r = proxy_get(
            &gw,
            "api.test",
            &[(
                "Proxy-Authorization",
                &basic(&format!("user-{i}"), &made_up),
            )],
        )
        .await;
        assert_eq!(r.status, 407, "{}", r.text());
        let bearer = format!("Bearer {made_up}");
        let r = proxy_get(&gw, "api.test", &[("Proxy-Authorization", &bearer)]).await;
        assert_eq!(r.status, 407, "{}", r.text());
        let r = gateway_get(&gw, "api.test", &[("X-Sluice-Token", &made_up)]).await;
        assert_eq!(r.status, 401, "{}", r.text());
    }
    let r = proxy_get(&gw, "api.test", &[]).await;
    assert_eq!(r.status, 407, "{}", r.text());

    // Counted once each answer is written: poll until the last one is in.
    let unknown = (3 * EACH + 1) as f64;
    let counted = wait_until_async(WAIT, || async {
        let m = gw.metrics().await;
        requests(&m, "billing", None) == 5.0
            && requests(&m, "batch", None) == 1.0
            && requests(&m, "unknown", None) == unknown
    })
    .await;
    let metrics = gw.metrics().await;
    assert!(counted, "{metrics}");
    assert_eq!(
        client_labels(&metrics),
        set(&["batch", "billing", "unknown"]),
        "{metrics}"
    );
    assert_eq!(requests(&metrics, "billing", Some("200")), 3.0);
    assert_eq!(requests(&metrics, "billing", Some("403")), 2.0);
    assert_eq!(
        requests(&metrics, "unknown", Some("407")),
        (2 * EACH + 1) as f64
    );
    assert_eq!(requests(&metrics, "unknown", Some("401")), EACH as f64);
    let denials = |labels: &[(&str, &str)]| {
        support::metric_value(&metrics, "sluice_client_denials_total", labels).unwrap_or(0.0)
    };
    assert_eq!(
        denials(&[
            ("mode", "enforce"),
            ("code", "route_denied"),
            ("client", "billing")
        ]),
        2.0
    );
    assert_eq!(
        denials(&[("mode", "enforce"), ("client", "unknown")]),
        unknown
    );
    assert!(!metrics.contains("made-up") && !metrics.contains("user-"));

    // /status: the mode, each client with its routes and counts, then `unknown`.
    let status = gw.status().await;
    assert_eq!(status["clients"]["mode"], "enforce", "{status}");
    let names: Vec<&str> = status["clients"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["billing", "batch", "unknown"], "{status}");
    let b = status_client(&status, "billing");
    assert_eq!(
        (&b["requests"], &b["denied"], &b["would_deny"]),
        (&5.into(), &2.into(), &0.into()),
        "{b}"
    );
    assert_eq!(b["routes"], serde_json::json!(["api", "openai"]));
    assert_eq!(
        status_client(&status, "batch")["routes"],
        serde_json::json!(["*"])
    );
    assert_eq!(
        status_client(&status, "batch")["quota"],
        serde_json::json!([{"name": "daily", "limit": 100, "window_ms": 3_600_000, "remaining": 99, "reserved": 0, "settled": 1}])
    );
    let u = status_client(&status, "unknown");
    let n = 3 * EACH as u64 + 1;
    assert_eq!(
        (&u["requests"], &u["denied"]),
        (&n.into(), &n.into()),
        "{u}"
    );
    assert!(!status.to_string().contains("made-up"));

    // A reload in report mode that adds `ops` and removes `batch`: `ops` is there at once, at
    // 0; `batch` is gone; billing's refusal is let go and counted as would_deny.
    let ops = format!("    - name: ops\n      tokens: [\"{OPS}\"]\n      routes: [api]\n");
    let next = config(&member, "report", &ops).replace(
        &format!(
            "    - name: batch\n      tokens: [\"{BATCH}\"]\n      routes: [\"*\"]\n      quota: {{ windows: [{{ name: daily, limit: 100, window: 1h }}] }}\n"
        ),
        "",
    );
    assert!(!next.contains("batch"), "{next}");
    reload(&gw, &next).await;
    let metrics = gw.metrics().await;
    assert_eq!(
        client_labels(&metrics),
        set(&["billing", "ops", "unknown"]),
        "{metrics}"
    );
    assert_eq!(requests(&metrics, "ops", Some("200")), 0.0);
    let r = proxy_get(&gw, "admin-api.test", &[("Proxy-Authorization", &billing)]).await;
    assert_eq!(r.status, 200, "report mode lets it go: {}", r.text());
    let seen = wait_until_async(WAIT, || async {
        // The request counts come with the access line, after the answer: wait for both.
        let status = gw.status().await;
        let b = status_client(&status, "billing");
        b["would_deny"] == 1 && b["requests"] == 6
    })
    .await;
    let status = gw.status().await;
    assert!(seen, "{status}");
    assert_eq!(status["clients"]["mode"], "report");
    let b = status_client(&status, "billing");
    assert_eq!(
        (&b["requests"], &b["denied"]),
        (&6.into(), &2.into()),
        "{b}"
    );
    assert_eq!(
        gw.metric(
            "sluice_client_denials_total",
            &[("mode", "report"), ("client", "billing")]
        )
        .await,
        Some(1.0)
    );
    let names: Vec<&str> = status["clients"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["billing", "ops", "unknown"], "{status}");
}

/// The dashboard, in a real headless Chromium (tests/browser/dashboard_clients.py), shows each
/// client's routes and counts as `/status` has them, and holds no token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_each_client() {
    let Some(python) = support::test_python() else {
        return;
    };
    let backends = start_backends(&["api"]).await;
    let gw = start(&url(backends[0].local_addr()), "enforce", "", &[]);
    let billing = basic("billing", BILLING);
    for host in ["api.test", "api.test", "admin-api.test"] {
        proxy_get(&gw, host, &[("Proxy-Authorization", &billing)]).await;
    }
    proxy_get(&gw, "api.test", &[]).await;
    let counted = wait_until_async(WAIT, || async {
        let status = gw.status().await;
        status_client(&status, "billing")["requests"] == 3
            && status_client(&status, "unknown")["requests"] == 1
    })
    .await;
    assert!(counted, "{}", gw.status().await);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/browser/dashboard_clients.py"
    );
    let admin = format!("http://{}", gw.admin_addr());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args([script, &admin, BILLING, BATCH])
            .output()
            .expect("the test python runs")
    })
    .await
    .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    if printed.starts_with("MISSING") {
        assert!(
            !std::env::var("CI").is_ok_and(|v| v == "true"),
            "CI=true but the browser test cannot run: {printed}"
        );
        eprintln!("SKIPPED: {printed}");
        return;
    }
    assert_eq!(
        printed.trim(),
        "CHECKED",
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

on_both_stores!(status_shows_what_is_left_of_each_clients_windows);

/// `/status` reads what is left of each client's own windows from the store every instance
/// shares, without charging them.
async fn status_shows_what_is_left_of_each_clients_windows(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["api"]).await;
    let state = match store.redis() {
        Some(redis) => format!(
            // The tests' generous call timeout, not the 50 ms default: a slow call on a loaded
            // machine would be a store error, which admits uncounted.
            "state: {{ backend: redis, redis: {{ url: \"{}\", timeout: {} }} }}\n",
            redis.url(),
            support::config::REDIS_TIMEOUT
        ),
        None => String::new(),
    };
    let gw = start(&url(backends[0].local_addr()), "enforce", &state, &[]);
    for _ in 0..3 {
        let r = gateway_get(&gw, "api.test", &[("X-Sluice-Token", BATCH)]).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Read twice: reading charges nothing.
    for _ in 0..2 {
        let status = gw.status().await;
        let quota = &status_client(&status, "batch")["quota"][0];
        assert_eq!(
            (&quota["name"], &quota["remaining"]),
            (&"daily".into(), &97.into()),
            "{status}"
        );
        assert!(
            status_client(&status, "billing").get("quota").is_none(),
            "{status}"
        );
    }
}

/// A small OTLP/HTTP receiver on loopback: answers every `POST /v1/traces` with 200 and keeps
/// the raw bodies, so that a test can look for bytes in what was exported.
async fn raw_otlp_receiver() -> (std::net::SocketAddr, Arc<Mutex<Vec<u8>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let kept = bodies.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        let mut chunk = [0u8; 4096];
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    kept.lock().unwrap().extend(buf.drain(..head_end + len));
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if conn.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, bodies)
}

/// Tokens, valid and not, presented every way a caller can (Basic and Bearer
/// `Proxy-Authorization`, a route's `client_token` header, `Authorization` on a key-pool route,
/// a CONNECT), show on no surface: the logs at trace level, `/status`, `/metrics`, the answers
/// (the echo member shows what it got: the provider's key, never a sluice token), the spans
/// exported, and `sluice check` on a config whose error sits next to the tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_shows_on_any_surface() {
    let backends = start_backends(&["api"]).await;
    let member = url(backends[0].local_addr());
    let (receiver, spans) = raw_otlp_receiver().await;
    let tracing =
        format!("tracing:\n  otlp:\n    endpoint: http://{receiver}\n    sample_ratio: 1.0\n");
    // The `tracing` section goes at the top level, after the clients list.
    let gw = Gateway::start_with_ports_and_env(
        &format!("{}{tracing}", config(&member, "enforce", "")),
        &[("BILLING_TOKEN", BILLING), ("RUST_LOG", "trace")],
    );
    let bad = "wrong-token-obs-0123456789ab";
    let mut answers = String::new();
    let mut sent = 0;
    for value in [
        basic("billing", BILLING),
        basic("billing", bad),
        basic("", BATCH),
        format!("Bearer {BATCH}"),
        format!("Bearer {bad}"),
    ] {
        for host in ["api.test", "admin-api.test"] {
            let r = proxy_get(&gw, host, &[("Proxy-Authorization", &value)]).await;
            answers.push_str(&format!("{} {:?} {}\n", r.status, r.headers, r.text()));
            sent += 1;
        }
        // A CONNECT with the same credential: refused (407, or 403: no route reaches it), or
        // let through to an echo member that answers it.
        let mut c = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        let head = format!(
            "CONNECT admin-api.test:443 HTTP/1.1\r\nHost: admin-api.test:443\r\nProxy-Authorization: {value}\r\n\r\n"
        );
        c.write_raw(head.as_bytes()).await.unwrap();
        if let Ok(r) = c.read_response(true).await {
            answers.push_str(&format!("{} {:?} {}\n", r.status, r.headers, r.text()));
        }
        sent += 1;
    }
    for (host, header, value) in [
        ("api.test", "X-Sluice-Token", BILLING.to_string()),
        ("api.test", "X-Sluice-Token", bad.to_string()),
        ("openai.test", "Authorization", format!("Bearer {BILLING}")),
        ("openai.test", "Authorization", format!("Bearer {bad}")),
    ] {
        let r = gateway_get(&gw, host, &[(header, &value)]).await;
        answers.push_str(&format!("{} {:?} {}\n", r.status, r.headers, r.text()));
        sent += 1;
    }
    // Every request has its access line and its span before the surfaces are read.
    let logged = wait_until_async(WAIT, || async {
        gw.log_json()
            .iter()
            .filter(|l| l["target"] == "sluice::access")
            .count()
            >= sent
    })
    .await;
    assert!(logged, "{}", gw.logs());
    let exported = wait_until_async(WAIT, || async { !spans.lock().unwrap().is_empty() }).await;
    assert!(exported, "no spans exported:\n{}", gw.logs());
    // The key-pool route put the provider's key where the sluice token was.
    assert!(answers.contains(PROVIDER_KEY), "{answers}");

    let status = gw.admin("/status").await.text();
    let metrics = gw.metrics().await;
    let dashboard = gw.admin("/").await.text();
    let logs = gw.logs();
    let spans = String::from_utf8_lossy(&spans.lock().unwrap()).into_owned();
    assert!(
        logs.contains("\"level\":\"TRACE\""),
        "trace level is on:\n{logs}"
    );

    // `sluice check` with an error right next to the tokens: a typo'd key in billing's entry.
    let dir = support::TempDir::new("sluice-clients-obs-check");
    let file = dir.path().join("sluice.yaml");
    let broken = config(&member, "enforce", "")
        .replace(
            "routes: [api, openai]",
            "routes: [api, openai]\n      tokenz: [\"x\"]",
        )
        .replace("{PROXY}", "127.0.0.1:1")
        .replace("{ADMIN}", "127.0.0.1:2");
    std::fs::write(&file, broken).unwrap();
    let out = Command::new(support::sluice_binary())
        .args(["check", "-c"])
        .arg(&file)
        .env("BILLING_TOKEN", BILLING)
        .output()
        .unwrap();
    let check = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{check}");
    assert!(check.contains("tokenz"), "{check}");

    for token in [BILLING, BATCH, bad] {
        for (surface, text) in [
            ("logs", &logs),
            ("status", &status),
            ("metrics", &metrics),
            ("dashboard", &dashboard),
            ("answers", &answers),
            ("spans", &spans),
            ("check", &check),
        ] {
            assert!(!text.contains(token), "{token} in {surface}:\n{text}");
        }
        // Nor in the Basic credential's encoded form.
        let encoded = base64::engine::general_purpose::STANDARD.encode(format!("billing:{token}"));
        assert!(!logs.contains(&encoded) && !spans.contains(&encoded));
    }
    for (surface, text) in [("logs", &logs), ("status", &status), ("metrics", &metrics)] {
        assert!(
            !text.contains(PROVIDER_KEY),
            "the provider's key in {surface}"
        );
    }
}
