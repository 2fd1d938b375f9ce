//! The admin dashboard (`GET /`) in a real browser: headless Chromium driven by Selenium
//! (tests/browser/dashboard.py) shows what `/status` says (a usage window's reserved and settled
//! amounts too), and follows a member going down; tests/browser/dashboard_charts.py checks the
//! charts against `/status/history`, a quota bar that moves, a cooldown's countdown, and saves a
//! screenshot. `/status/history` itself is checked over HTTP on both stores.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use sluice_echo::{EchoOptions, EchoServer};
use support::{
    start_backends, url, wait_until_async, Backend, Config, Cooldown, Gateway, HealthCheck,
    KeyMember, Quota, Route, Store,
};

/// A key member's secret: unique to this process, so a search for it cannot match anything else.
fn secret(name: &str) -> String {
    format!("sk-{name}-{}-d00d", std::process::id())
}

/// The API stub the key members call, keyed by their `Authorization`.
async fn api() -> EchoServer {
    EchoServer::start_with(
        "api",
        SocketAddr::from(([127, 0, 0, 1], 0)),
        EchoOptions::key_limited(1000, Duration::from_secs(60)),
    )
    .await
    .expect("start the API stub")
}

/// Route `keys` (host `keys.test`): least-used over `names`, keys on `api`, cooling a key on
/// its 429 for at most a minute.
fn keys(api: &EchoServer, names: &[&str]) -> Route {
    names
        .iter()
        .fold(Route::new("keys").least_used(), |route, name| {
            route.key_member(
                KeyMember::new(url(api.local_addr()), name)
                    .header("Authorization", &format!("Bearer {}", secret(name))),
            )
        })
        .cooldown(Cooldown::new().default_for("30s").max("1m"))
}

/// Route `route` of `/status/history`.
async fn history_of(gw: &Gateway, route: &str) -> serde_json::Value {
    let doc = gw.admin("/status/history").await.json();
    doc["routes"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["name"] == route))
        .cloned()
        .unwrap_or_default()
}

fn sum(series: &serde_json::Value) -> u64 {
    series
        .as_array()
        .map_or(0, |s| s.iter().filter_map(|v| v.as_u64()).sum())
}

on_both_stores!(history_counts_each_second_by_class_with_no_token_and_no_secret);

/// `/status/history` counts a route's requests per second by status class (a quota's 429s
/// apart from the member's 200s), with their latencies, each member's share of the attempts and
/// a rate above 0 while requests flow; it needs no token even with one configured, and shows no
/// member's secret.
async fn history_counts_each_second_by_class_with_no_token_and_no_secret(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["a"]).await;
    let api = api().await;
    let gw = Config::new()
        .store(&store)
        .admin_token_env("SLUICE_TEST_UNSET_ADMIN_TOKEN")
        .route(
            Route::new("metered")
                .member(url(backends[0].local_addr()))
                .quota(Quota::window("hour", 3, "1h")),
        )
        .route(keys(&api, &["key-a", "key-b"]))
        .start();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(
            support::get(gw.proxy_addr(), "metered.test", "/")
                .await
                .status,
        );
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    for _ in 0..4 {
        let r = support::get(gw.proxy_addr(), "keys.test", "/").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let counted = wait_until_async(Duration::from_secs(20), || async {
        let h = history_of(&gw, "metered").await;
        sum(&h["requests"]["2xx"]) == 3 && sum(&h["requests"]["429"]) == 2
    })
    .await;
    let metered = history_of(&gw, "metered").await;
    assert!(counted, "{metered}");
    assert_eq!(sum(&metered["requests"]["5xx"]), 0, "{metered}");
    assert!(metered["rate"].as_f64().unwrap() > 0.0, "{metered}");
    // Each second's series is as long as the ring holds, the same for every field.
    let samples = metered["samples"].as_u64().unwrap() as usize;
    assert!(samples >= 1, "{metered}");
    for field in [
        &metered["p50_ms"],
        &metered["p99_ms"],
        &metered["in_flight"],
    ] {
        assert_eq!(field.as_array().unwrap().len(), samples, "{metered}");
    }
    assert!(
        metered["p99_ms"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v.as_f64().is_some_and(|ms| ms > 0.0)),
        "a latency for the seconds with requests: {metered}"
    );
    // The quota's refusals reached no member: the member's attempts are the 3 admitted.
    assert_eq!(sum(&metered["members"][0]["assignments"]), 3, "{metered}");
    assert_eq!(metered["members"][0]["share"], 1.0, "{metered}");

    // Least-used spreads the keys' 4 requests 2 and 2.
    let spread = wait_until_async(Duration::from_secs(20), || async {
        let h = history_of(&gw, "keys").await;
        h["members"].as_array().is_some_and(|m| {
            m.len() == 2
                && m.iter()
                    .all(|m| sum(&m["assignments"]) == 2 && m["share"] == 0.5)
        })
    })
    .await;
    assert!(spread, "{}", history_of(&gw, "keys").await);

    let page = gw.admin("/status/history").await;
    assert_eq!(page.status, 200, "no token needed: {}", page.text());
    assert!(page
        .header("content-type")
        .is_some_and(|c| c.starts_with("application/json")));
    for key in ["key-a", "key-b"] {
        assert!(!page.text().contains(&secret(key)), "no secret shown");
    }
}

/// In a real browser: the charts draw `/status/history`'s points, a quota bar grows as requests
/// are admitted, a cooling key counts down, and the page refers to nothing outside the admin
/// listener. A screenshot is left at `<target>/dashboard.png` for a person to look at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_draws_history_quota_and_countdowns() {
    let Some(python) = support::test_python() else {
        return;
    };
    let backends = start_backends(&["a"]).await;
    let api = api().await;
    let gw = Config::new()
        .route(
            Route::new("metered")
                .member(url(backends[0].local_addr()))
                .quota(Quota::window("hour", 40, "1h")),
        )
        .route(keys(&api, &["key-a", "key-b", "key-c"]))
        .start();
    // key-a's next answer is a 429 asking for ten days: sluice cools it for a minute.
    let auth_a = format!("Bearer {}", secret("key-a"));
    api.refuse_next(&auth_a, 1, "864000").unwrap();
    let first = support::get(gw.proxy_addr(), "keys.test", "/").await;
    assert_eq!(first.status, 429, "{}", first.text());
    for _ in 0..6 {
        support::get(gw.proxy_addr(), "keys.test", "/").await;
        support::get(gw.proxy_addr(), "metered.test", "/").await;
    }
    let sampled = wait_until_async(Duration::from_secs(20), || async {
        sum(&history_of(&gw, "metered").await["requests"]["2xx"]) == 6
    })
    .await;
    assert!(sampled, "{}", history_of(&gw, "metered").await);

    // The screenshot goes next to the build's outputs: `<target>/tmp/..`.
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target dir")
        .join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/browser/dashboard_charts.py"
    );
    let admin = format!("http://{}", gw.admin_addr());
    let mut child = Command::new(&python)
        .args([script, &admin, shot.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the test python runs");
    let mut stdin = child.stdin.take().unwrap();
    let lines = lines_of(child.stdout.take().unwrap());
    let next = |what: &str| {
        let line = lines
            .recv_timeout(Duration::from_secs(90))
            .unwrap_or_else(|_| {
                panic!("no line from dashboard_charts.py while waiting for {what}")
            });
        eprintln!("dashboard_charts.py: {line}");
        line
    };
    let first = next("CHARTS");
    if first.starts_with("MISSING") {
        assert!(!in_ci(), "CI=true but the browser test cannot run: {first}");
        eprintln!("SKIPPED: {first}");
        let _ = child.wait();
        return;
    }
    assert_eq!(first, "CHARTS", "the charts should draw /status/history");
    assert_eq!(next("COUNTDOWN"), "COUNTDOWN");
    assert_eq!(next("BAR-READ"), "BAR-READ");
    for _ in 0..10 {
        let r = support::get(gw.proxy_addr(), "metered.test", "/").await;
        assert_eq!(r.status, 200);
    }
    writeln!(stdin, "sent").unwrap();
    assert_eq!(next("BAR-MOVED"), "BAR-MOVED");
    assert_eq!(next("NO-EXTERNAL"), "NO-EXTERNAL");
    assert_eq!(next("SHOT"), "SHOT");
    let status = child.wait().unwrap();
    assert!(status.success(), "dashboard_charts.py: {status}");
    let png = std::fs::read(&shot).expect("the screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG at {}", shot.display());
    eprintln!("screenshot: {}", shot.display());
}

/// A child's stdout lines, read on a thread: the script blocks on the browser.
fn lines_of(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    lines
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_status_and_follows_health() {
    let Some(python) = support::test_python() else {
        return;
    };
    let backends = start_backends(&["a", "b", "metered"]).await;
    let [a, b, metered] = [0, 1, 2].map(|i| url(backends[i].local_addr()));
    let base = Config::new()
        .route(
            Route::new("api")
                .members([a.clone(), b])
                .health_check(HealthCheck::fast_http("100ms", 1, 1)),
        )
        .route(
            Route::new("metered")
                .member(metered)
                .quota(Quota::window("hour", 5, "1h")),
        )
        .route(Route::new("keys").least_used().key_member(
            KeyMember::new(url(backends[2].local_addr()), "key-a").window("rpm", 4, "1m"),
        ))
        .yaml();
    // `metered` also keeps a budget in dollars, each request settled at its reservation of
    // $0.25 (the echo answers hold no usage): the page shows amounts with decimals, reserved
    // apart from settled.
    let mut config: serde_json::Value = serde_yaml::from_str(&base).unwrap();
    let quota = &mut config["routes"][1]["quota"];
    quota["windows"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!(
            {"name": "budget", "limit": 2, "window": "1h", "unit": "usd"}
        ));
    quota["usage"] = serde_json::json!(
        {"usd": {"reserve": {"value": 0.25}, "settle": {"json": "usage.cost"}}}
    );
    // `api` caps its members' requests in flight, so each member has an `in_flight` count.
    config["routes"][0]["upstream"]["max_in_flight"] = serde_json::json!(10);
    let gw = support::Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());
    let page = gw.admin("/").await;
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/html")));
    assert!(
        !page.text().contains("http://") && !page.text().contains("https://"),
        "no external assets"
    );
    // Some traffic, so that the numbers compared are not all 0.
    for _ in 0..4 {
        support::get(gw.proxy_addr(), "api.test", "/").await;
    }
    for _ in 0..3 {
        support::get(gw.proxy_addr(), "metered.test", "/").await;
    }
    support::get(gw.proxy_addr(), "keys.test", "/").await;
    let requests_counted = support::wait_until_async(Duration::from_secs(20), || async {
        let metered = &gw.status().await["routes"][1];
        metered["requests"] == 3 && metered["quota"][1]["settled"] == 0.75
    })
    .await;
    assert!(requests_counted, "{}", gw.status().await["routes"][1]);
    assert_eq!(gw.status().await["routes"][0]["members"][0]["in_flight"], 0);

    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/browser/dashboard.py"
    );
    let admin = format!("http://{}", gw.admin_addr());
    let mut child = Command::new(&python)
        .args([script, &admin, &a])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the test python runs");
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    // The script's lines, read on a thread: it blocks on the browser.
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let next = |what: &str| {
        let line = lines
            .recv_timeout(Duration::from_secs(90))
            .unwrap_or_else(|_| panic!("no line from dashboard.py while waiting for {what}"));
        eprintln!("dashboard.py: {line}");
        line
    };
    let first = next("CHECKED");
    if first.starts_with("MISSING") {
        assert!(!in_ci(), "CI=true but the browser test cannot run: {first}");
        eprintln!("SKIPPED: {first}");
        let _ = child.wait();
        return;
    }
    assert_eq!(first, "CHECKED", "the page should match /status");

    // Down goes member a: the health check sees it, /status says so, and the page follows.
    backends[0].stop().await;
    writeln!(stdin, "stopped").unwrap();
    assert_eq!(next("DOWN-SEEN"), "DOWN-SEEN");
    let status = child.wait().unwrap();
    assert!(status.success(), "dashboard.py: {status}");
    let down = gw.status().await["routes"][0]["members"][0]["healthy"].clone();
    assert_eq!(down, false);
}
