//! The admin dashboard (`GET /`) in a real browser: headless Chromium driven by Selenium
//! (tests/browser/dashboard.py) shows what `/status` says (a usage window's reserved and settled
//! amounts too), and follows a member going down.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{start_backends, url, Config, HealthCheck, KeyMember, Quota, Route};

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
    let requests_counted = support::wait_until_async(Duration::from_secs(5), || async {
        let metered = &gw.status().await["routes"][1];
        metered["requests"] == 3 && metered["quota"][1]["settled"] == 0.75
    })
    .await;
    assert!(requests_counted, "{}", gw.status().await["routes"][1]);

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
