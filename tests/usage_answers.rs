//! What settles a usage-metered request, end to end with the real `sluice` binary in front of
//! the OpenAI stub: a provider that reports usage in a header (the stub's
//! `x-usage-total-tokens`), on both stores; and a gateway killed while its request is in flight,
//! which leaves the reservation standing in the shared window (SPEC §10: the conservative
//! outcome), read by a second gateway on the same Redis.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use sluice_echo::openai::OpenAiStub;
use support::{request, url, wait_until_async, Backend, Config, Gateway, Route, Store};

/// How long a condition may take to hold on a loaded machine.
const WAIT: Duration = Duration::from_secs(20);

/// A gateway config on `store` whose route `openai` goes to `stub` and meters tokens with
/// `settle`: `max_tokens` (default 100) reserved, in a window of 1,000 tokens a minute.
fn config(store: &Store, stub: &OpenAiStub, settle: &str) -> String {
    let base = Config::new()
        .store(store)
        .route(
            Route::new("openai")
                .hosts(&["openai.test"])
                .member(url(stub.local_addr())),
        )
        .yaml();
    let mut config: Value = serde_yaml::from_str(&base).unwrap();
    config["routes"][0]["quota"] = serde_yaml::from_str(&format!(
        r#"
windows: [{{ name: tpm, limit: 1000, window: 1m, unit: tokens }}]
usage:
  tokens:
    reserve: {{ json: "max_tokens", default: 100 }}
    settle: {settle}
"#
    ))
    .unwrap();
    serde_yaml::to_string(&config).unwrap()
}

/// The route's window as `/status` shows it: (settled, reserved) tokens.
async fn holds(gw: &Gateway) -> (Option<u64>, Option<u64>) {
    let status = gw.status().await;
    let w = &status["routes"][0]["quota"][0];
    (w["settled"].as_u64(), w["reserved"].as_u64())
}

/// Waits until the window holds `want`, and fails saying what it held.
async fn waits_for(gw: &Gateway, want: (u64, u64)) {
    let want = (Some(want.0), Some(want.1));
    let ok = wait_until_async(WAIT, || async { holds(gw).await == want }).await;
    assert!(ok, "the window holds {:?}, not {want:?}", holds(gw).await);
}

async fn chat(gw: &Gateway, max_tokens: u64, headers: &[(&str, &str)]) -> support::Response {
    let body = json!({"model": "m", "max_tokens": max_tokens, "messages": []}).to_string();
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    request(
        gw.proxy_addr(),
        "POST",
        "openai.test",
        "/v1/chat/completions",
        &all,
        body.as_bytes(),
    )
    .await
}

/// `settle: {header: x-usage-total-tokens}`: the amount comes from the answer's head, JSON or
/// stream alike, and the body is not needed for it.
async fn a_usage_header_settles_the_request(backend: Backend) {
    let store = Store::start(backend);
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let gw = Gateway::start_with_ports(&config(
        &store,
        &stub,
        r#"{ header: "x-usage-total-tokens" }"#,
    ));
    let used = [
        ("x-stub-prompt-tokens", "7"),
        ("x-stub-completion-tokens", "5"),
    ];
    let r = chat(&gw, 60, &used).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-usage-total-tokens"), Some("12"));
    waits_for(&gw, (12, 0)).await;
}

on_both_stores!(a_usage_header_settles_the_request);

/// A gateway killed while its request is in flight never settles it: the reservation stays in
/// the shared window (more than was used, never less), as another gateway on the same Redis
/// reads it, until it slides out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateway_leaves_its_reservation() {
    let store = Store::start(Backend::Redis);
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let yaml = config(&store, &stub, r#"{ json: "usage.total_tokens" }"#);
    let doomed = Gateway::start_with_ports(&yaml);
    let survivor = Gateway::start_with_ports(&yaml);
    stub.hold();
    let addr = doomed.proxy_addr();
    let held = tokio::spawn(async move {
        let body = json!({"model": "m", "max_tokens": 70, "messages": []}).to_string();
        support::try_request(
            addr,
            "POST",
            "openai.test",
            "/v1/chat/completions",
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        )
        .await
    });
    assert!(wait_until_async(WAIT, || async { stub.held() == 1 }).await);
    waits_for(&survivor, (0, 70)).await;
    doomed.signal("KILL");
    // The client sees the connection die; the member's answer, released now, reaches no one.
    assert!(held.await.unwrap().is_err(), "the killed gateway answered");
    stub.release();
    // Nothing settles the reservation: it stands, for every gateway.
    let r = chat(&survivor, 10, &[("x-stub-completion-tokens", "3")]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let settled_other = r.json()["usage"]["total_tokens"].as_u64().unwrap();
    waits_for(&survivor, (settled_other, 70)).await;
}
