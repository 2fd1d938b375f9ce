//! What a quota window holds, shown apart: open reservations (`reserved`) and settled usage
//! (`settled`), in `/status` and in the `sluice_*quota_reserved` / `_settled` gauges, each in the
//! window's own unit, end to end on both stores. A request held by the OpenAI stub shows its
//! reservation; once released and settled, `reserved` is 0 and `settled` is the usage, exactly.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use sluice_echo::openai::OpenAiStub;
use sluice_echo::EchoServer;
use support::{
    metric_value, request, url, wait_until_async, Backend, Config, Gateway, Quota, Route, Store,
};

/// Route `openai`: requests per minute, tokens per minute, tokens per calendar day and a budget
/// in dollars priced per token, in front of one key (`key-a`) with its own tokens per minute.
/// Route `plain`: a quota of requests and no usage. The backends live as long as the gateway.
async fn setup(store: &Store) -> (Gateway, OpenAiStub, Vec<EchoServer>) {
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let backends = support::start_backends(&["plain"]).await;
    let base = Config::new()
        .store(store)
        .route(
            Route::new("openai")
                .hosts(&["openai.test"])
                .key_member(support::KeyMember::new(url(stub.local_addr()), "key-a")),
        )
        .route(
            Route::new("plain")
                .member(url(backends[0].local_addr()))
                .quota(Quota::window("hour", 5, "1h")),
        )
        .yaml();
    let mut config: Value = serde_yaml::from_str(&base).unwrap();
    config["routes"][0]["quota"] = serde_yaml::from_str(
        r#"
windows:
  - { name: rpm, limit: 10, window: 1m }
  - { name: tpm, limit: 1000, window: 1m, unit: tokens }
  - { name: day, limit: 1000, window: calendar_day, unit: tokens, tz: "Europe/Paris" }
  - { name: budget, limit: 1, window: 1h, unit: usd }
usage:
  tokens:
    reserve: { json: "max_tokens", default: 100 }
    settle: { json: "usage.total_tokens" }
  usd:
    reserve: { json: "max_tokens", default: 100, times: 0.00001 }
    settle:
      sum: [ { json: "usage.prompt_tokens", times: 0.0000025 }, { json: "usage.completion_tokens", times: 0.00001 } ]
"#,
    )
    .unwrap();
    config["routes"][0]["upstream"]["members"][0]["quota"] =
        serde_yaml::from_str("windows: [{ name: key-tpm, limit: 500, window: 1m, unit: tokens }]")
            .unwrap();
    let gw = Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());
    (gw, stub, backends)
}

/// The windows of `openai`'s quota, then `key-a`'s own: `(window, unit label)`.
const WINDOWS: [(&str, &str); 5] = [
    ("rpm", "requests"),
    ("tpm", "tokens"),
    ("day", "tokens"),
    ("budget", "usd"),
    ("key-tpm", "tokens"),
];

/// `(reserved, settled)` of each of [`WINDOWS`], from `/status`.
async fn shown(gw: &Gateway) -> Vec<(f64, f64)> {
    let status = gw.status().await;
    let route = &status["routes"][0];
    assert_eq!(route["name"], "openai");
    let windows = route["quota"]
        .as_array()
        .unwrap()
        .iter()
        .chain(route["members"][0]["quota"].as_array().unwrap());
    windows
        .map(|w| {
            let n = |f: &str| w[f].as_f64().unwrap_or_else(|| panic!("no {f} in {w}"));
            (n("reserved"), n("settled"))
        })
        .collect()
}

/// The labels of the `i`th of [`WINDOWS`], without its unit: (gauge prefix, labels).
fn labels(i: usize) -> (&'static str, Vec<(&'static str, &'static str)>) {
    if i < 4 {
        (
            "sluice_quota",
            vec![("route", "openai"), ("window", WINDOWS[i].0)],
        )
    } else {
        let labels = vec![
            ("route", "openai"),
            ("member", "key-a"),
            ("window", WINDOWS[i].0),
        ];
        ("sluice_member_quota", labels)
    }
}

/// `(reserved, settled)` of each of [`WINDOWS`], from its gauges (labelled with its unit).
async fn gauged(gw: &Gateway) -> Vec<Option<(f64, f64)>> {
    let text = gw.metrics().await;
    (0..WINDOWS.len())
        .map(|i| {
            let (prefix, mut labels) = labels(i);
            labels.push(("unit", WINDOWS[i].1));
            let value = |what: &str| metric_value(&text, &format!("{prefix}_{what}"), &labels);
            Some((value("reserved")?, value("settled")?))
        })
        .collect()
}

/// Waits until `/status` and the gauges both show `want`, and fails with what they showed.
async fn shows(gw: &Gateway, want: &[(f64, f64)]) {
    let gauges: Vec<_> = want.iter().copied().map(Some).collect();
    let ok = wait_until_async(Duration::from_secs(20), || async {
        shown(gw).await == want && gauged(gw).await == gauges
    })
    .await;
    assert!(
        ok,
        "/status shows {:?}, the gauges {:?}, not {want:?}",
        shown(gw).await,
        gauged(gw).await
    );
}

async fn reserved_and_settled_are_shown_apart_in_each_unit(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub, _backends) = setup(&store).await;
    stub.hold();
    let addr = gw.proxy_addr();
    let body = json!({"model": "m", "max_tokens": 70, "messages": []}).to_string();
    let task = tokio::spawn(async move {
        request(
            addr,
            "POST",
            "openai.test",
            "/v1/chat/completions",
            &[
                ("Content-Type", "application/json"),
                ("x-stub-prompt-tokens", "4"),
                ("x-stub-completion-tokens", "6"),
            ],
            body.as_bytes(),
        )
        .await
    });
    assert!(wait_until_async(Duration::from_secs(20), || async { stub.held() == 1 }).await);
    // Held: each window holds the reservation alone, none of it settled: one request, 70
    // tokens, and 70 tokens at $0.00001, $0.0007.
    let held = [
        (1.0, 0.0),
        (70.0, 0.0),
        (70.0, 0.0),
        (0.0007, 0.0),
        (70.0, 0.0),
    ];
    shows(&gw, &held).await;
    stub.release();
    let r = task.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // Settled: one request, 4 + 6 tokens, and 4 × $0.0000025 + 6 × $0.00001 = $0.00007,
    // exactly; nothing reserved.
    let settled = [
        (0.0, 1.0),
        (0.0, 10.0),
        (0.0, 10.0),
        (0.0, 0.00007),
        (0.0, 10.0),
    ];
    shows(&gw, &settled).await;

    // What is left, in each window's unit: exact in the gauges ($1 − $0.00007), rounded down
    // to a whole unit in /status (so $0.99993 reads 0).
    let text = gw.metrics().await;
    let status = gw.status().await;
    let route = &status["routes"][0];
    let in_status = [
        &route["quota"][0],
        &route["quota"][1],
        &route["quota"][2],
        &route["quota"][3],
        &route["members"][0]["quota"][0],
    ];
    for (i, (gauge, shown)) in [9.0, 990.0, 990.0, 0.99993, 490.0]
        .into_iter()
        .zip([9, 990, 990, 0, 490])
        .enumerate()
    {
        let (prefix, labels) = labels(i);
        let name = format!("{prefix}_remaining");
        assert_eq!(
            metric_value(&text, &name, &labels),
            Some(gauge),
            "{name} {labels:?}"
        );
        assert_eq!(in_status[i]["remaining"], shown, "{}", in_status[i]);
    }
    // A whole amount in a usage unit is a JSON integer, as the limit is.
    assert_eq!(route["quota"][1]["settled"], 10, "{}", route["quota"][1]);

    // A route without usage: its requests are settled as they are admitted.
    for _ in 0..2 {
        support::get(gw.proxy_addr(), "plain.test", "/").await;
    }
    let plain = wait_until_async(Duration::from_secs(20), || async {
        let w = gw.status().await["routes"][1]["quota"][0].clone();
        w["reserved"] == 0 && w["settled"] == 2 && w["remaining"] == 3
    })
    .await;
    assert!(plain, "{}", gw.status().await["routes"][1]);
    let labels = [("route", "plain"), ("window", "hour"), ("unit", "requests")];
    assert_eq!(gw.metric("sluice_quota_settled", &labels).await, Some(2.0));
    assert_eq!(gw.metric("sluice_quota_reserved", &labels).await, Some(0.0));
}

on_both_stores!(reserved_and_settled_are_shown_apart_in_each_unit);
