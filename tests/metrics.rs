//! The Prometheus exposition end to end: every request counted once, by status and by who
//! answered it, series present from the start, and a scrape that `promtool` accepts.

mod support;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use prometheus_parse::{Scrape, Value};
use support::{
    dead_url, start_backends, url, Config, Gateway, HttpClient, KeyMember, Quota, Route,
};

const WAIT: Duration = Duration::from_secs(20);

/// A scrape of the gateway's `/metrics`, parsed.
async fn scrape(gw: &Gateway) -> Scrape {
    let text = gw.metrics().await;
    Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("a valid exposition")
}

/// The value of the one sample of `name` whose labels include `labels`; panics when several
/// match, since the caller then named too few labels.
fn value(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = scrape
        .samples
        .iter()
        .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)));
    let sample = found.next()?;
    assert!(found.next().is_none(), "{name}{labels:?} is ambiguous");
    Some(match sample.value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
        ref other => panic!("{name}: not a single value: {other:?}"),
    })
}

/// Sum of every sample of `name`.
fn total(scrape: &Scrape, name: &str) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .map(|s| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

fn config(api: &str, quota_member: &str) -> Config {
    Config::new()
        .route(Route::new("api").member(api))
        .route(
            Route::new("metered")
                .member(quota_member)
                .quota(Quota::window("hour", 3, "1h")),
        )
        .route(Route::new("dead").member(dead_url()))
        .route(
            Route::new("keys")
                .key_member(KeyMember::new(quota_member, "key-a").window("rpm", 2, "1m")),
        )
}

/// `GARBAGE` as a request line: Pingora's parser refuses it and sluice answers 400.
async fn send_garbage(gw: &Gateway) -> u16 {
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    client.write_raw(b"GARBAGE\r\n\r\n").await.unwrap();
    client.read_response(false).await.unwrap().status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_counted_once_by_status_and_source() {
    let backends = start_backends(&["api", "metered"]).await;
    let api = url(backends[0].local_addr());
    let gw = config(&api, &url(backends[1].local_addr())).start();

    // Before any traffic: every series with known labels is there, at 0.
    let before = scrape(&gw).await;
    for route in ["api", "metered", "dead", "keys"] {
        for status in ["200", "429", "502", "503", "504"] {
            let labels = [("route", route), ("status", status)];
            assert_eq!(
                value(&before, "sluice_requests_total", &labels),
                Some(0.0),
                "{labels:?}"
            );
        }
        for source in ["upstream", "gateway"] {
            let labels = [("route", route), ("source", source)];
            assert_eq!(
                value(&before, "sluice_request_duration_seconds_count", &labels),
                Some(0.0),
                "{labels:?}"
            );
        }
        let r = [("route", route)];
        assert_eq!(value(&before, "sluice_requests_in_flight", &r), Some(0.0));
        assert_eq!(
            value(&before, "sluice_selection_fallbacks_total", &r),
            Some(0.0)
        );
    }
    for op in ["quota", "select", "cool"] {
        let labels = [("op", op)];
        assert_eq!(
            value(&before, "sluice_store_errors_total", &labels),
            Some(0.0)
        );
    }
    for result in ["ok", "error"] {
        let labels = [("result", result)];
        assert_eq!(
            value(&before, "sluice_config_reloads_total", &labels),
            Some(0.0)
        );
    }
    let member = [("route", "api"), ("member", api.as_str())];
    assert_eq!(
        value(
            &before,
            "sluice_member_request_duration_seconds_count",
            &member
        ),
        Some(0.0)
    );
    let window = [("route", "metered"), ("window", "hour")];
    assert_eq!(value(&before, "sluice_quota_remaining", &window), Some(3.0));
    let key_window = [("route", "keys"), ("member", "key-a"), ("window", "rpm")];
    assert_eq!(
        value(&before, "sluice_member_quota_remaining", &key_window),
        Some(2.0)
    );
    assert_eq!(
        value(&before, "sluice_build_info", &[]),
        Some(1.0),
        "build info"
    );
    assert!(value(&before, "process_resident_memory_bytes", &[]).is_some_and(|v| v > 0.0));

    // Known answers: from members (200, 500), from the gateway (429 quota, 502 unreachable,
    // 503 no member, 404 no route, 400 unparsable head).
    let proxy = gw.proxy_addr();
    let mut sent: HashMap<(&str, u16), u32> = HashMap::new();
    let mut send =
        |route: &'static str, status: u16| *sent.entry((route, status)).or_default() += 1;
    for _ in 0..4 {
        assert_eq!(
            support::get(proxy, "api.test", "/status/200").await.status,
            200
        );
        send("api", 200);
    }
    for _ in 0..2 {
        assert_eq!(
            support::get(proxy, "api.test", "/status/500").await.status,
            500
        );
        send("api", 500);
    }
    for i in 0..5 {
        let want = if i < 3 { 200 } else { 429 };
        assert_eq!(support::get(proxy, "metered.test", "/").await.status, want);
        send("metered", want);
    }
    assert_eq!(support::get(proxy, "keys.test", "/").await.status, 200);
    send("keys", 200);
    // The failed connect marks the only member down: the next request finds none.
    for want in [502, 503] {
        assert_eq!(support::get(proxy, "dead.test", "/").await.status, want);
        send("dead", want);
    }
    for _ in 0..3 {
        assert_eq!(support::get(proxy, "nope.test", "/").await.status, 404);
        send("_none", 404);
    }
    assert_eq!(send_garbage(&gw).await, 400);
    send("-", 400);
    let requests: u32 = sent.values().sum();

    // Counted after the answer is written: poll until the last one is in.
    let counted = support::wait_until_async(WAIT, || async {
        let s = scrape(&gw).await;
        total(&s, "sluice_request_duration_seconds_count") == f64::from(requests)
            && total(&s, "sluice_requests_total") == f64::from(requests)
    })
    .await;
    let after = scrape(&gw).await;
    assert!(
        counted,
        "{requests} requests sent; counted {} and timed {}",
        total(&after, "sluice_requests_total"),
        total(&after, "sluice_request_duration_seconds_count")
    );
    for ((route, status), n) in &sent {
        let status = status.to_string();
        let labels = [("route", *route), ("status", status.as_str())];
        assert_eq!(
            value(&after, "sluice_requests_total", &labels),
            Some(f64::from(*n)),
            "{labels:?}"
        );
    }
    let timed = [
        ("api", "upstream", 6.0),
        ("api", "gateway", 0.0),
        ("metered", "upstream", 3.0),
        ("metered", "gateway", 2.0),
        ("dead", "upstream", 0.0),
        ("dead", "gateway", 2.0),
        ("_none", "gateway", 3.0),
        ("-", "gateway", 1.0),
        ("keys", "upstream", 1.0),
    ];
    for (route, source, want) in timed {
        let labels = [("route", route), ("source", source)];
        assert_eq!(
            value(&after, "sluice_request_duration_seconds_count", &labels),
            Some(want),
            "{labels:?}"
        );
    }
    assert_eq!(
        value(
            &after,
            "sluice_member_request_duration_seconds_count",
            &member
        ),
        Some(6.0)
    );
    assert_eq!(
        total(&after, "sluice_member_request_duration_seconds_count"),
        10.0,
        "only members' answers are timed per member"
    );
    assert_eq!(
        value(&after, "sluice_quota_rejections_total", &window),
        Some(2.0)
    );
    assert_eq!(value(&after, "sluice_quota_remaining", &window), Some(0.0));
    assert_eq!(
        value(&after, "sluice_member_quota_remaining", &key_window),
        Some(1.0)
    );
    assert_eq!(total(&after, "sluice_requests_in_flight"), 0.0);

    // /status carries the same per-route totals.
    let status = gw.status().await;
    for route in status["routes"].as_array().unwrap() {
        let name = route["name"].as_str().unwrap();
        let want: u32 = sent
            .iter()
            .filter(|((r, _), _)| *r == name)
            .map(|(_, n)| n)
            .sum();
        assert_eq!(route["requests"], want, "{name}");
    }
    assert_eq!(status["routes"][1]["quota"][0]["remaining"], 0);
    assert_eq!(
        status["routes"][3]["members"][0]["quota"][0]["remaining"],
        1
    );
}

/// `promtool check metrics` (Debian's `prometheus` package): the exposition's syntax, and
/// Prometheus's naming lints. Missing: a failure with CI=true, elsewhere a skip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_passes_promtool() {
    let backends = start_backends(&["api", "metered"]).await;
    let gw = config(
        &url(backends[0].local_addr()),
        &url(backends[1].local_addr()),
    )
    .start();
    // Some traffic, so that lazily made series are in the scrape too.
    for path in ["/status/200", "/status/404", "/status/418"] {
        support::get(gw.proxy_addr(), "api.test", path).await;
    }
    support::get(gw.proxy_addr(), "dead.test", "/").await;
    let text = gw.metrics().await;
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but promtool cannot run ({e}): .ci/run installs `prometheus`")
        }
        Err(e) => {
            eprintln!("SKIPPED: promtool cannot run ({e}); apt-get install prometheus");
            return;
        }
    };
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// On Redis, `sluice_quota_remaining` is what every gateway together left, read at scrape time;
/// with Redis gone it disappears rather than show a stale number, and the scrape still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_remaining_is_shared_and_never_stale() {
    let mut redis = sluice_testkit::RedisServer::start();
    let backends = start_backends(&["api", "metered"]).await;
    let config = config(
        &url(backends[0].local_addr()),
        &url(backends[1].local_addr()),
    )
    .state(support::State::redis(redis.url()));
    let (one, two) = (config.start(), config.start());
    let window = [("route", "metered"), ("window", "hour")];
    let key_window = [("route", "keys"), ("member", "key-a"), ("window", "rpm")];
    support::get(one.proxy_addr(), "metered.test", "/").await;
    support::get(two.proxy_addr(), "metered.test", "/").await;
    support::get(two.proxy_addr(), "keys.test", "/").await;
    for gw in [&one, &two] {
        let s = scrape(gw).await;
        assert_eq!(value(&s, "sluice_quota_remaining", &window), Some(1.0));
        assert_eq!(
            value(&s, "sluice_member_quota_remaining", &key_window),
            Some(1.0)
        );
    }

    redis.kill();
    let s = scrape(&one).await;
    assert_eq!(value(&s, "sluice_quota_remaining", &window), None);
    assert_eq!(
        value(&s, "sluice_member_quota_remaining", &key_window),
        None
    );
    assert!(value(
        &s,
        "sluice_requests_total",
        &[("route", "metered"), ("status", "200")]
    )
    .is_some());
    let status = one.status().await;
    assert!(status["routes"][1]["quota"][0].get("remaining").is_none());
}
