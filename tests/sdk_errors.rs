//! What an SDK shows of sluice's own answers. The OpenAI, Anthropic and Stripe SDKs read
//! `error.message` from an error body; with only problem+json fields they print a bare
//! "Error code: 429". The real `openai` Python SDK, from the CI venv, talks to sluice here.

mod support;

use std::process::Command;

use support::{start_backends, url, Config, Quota, Route};

/// The SDK's exception class, message and code for a call through sluice at `base_url`.
fn sdk_error(python: &str, base_url: &str) -> serde_json::Value {
    let script = r#"
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="sk-client", max_retries=0, timeout=10)
try:
    client.models.list()
    print(json.dumps({"class": None}))
except openai.APIStatusError as e:
    print(json.dumps({"class": type(e).__name__, "message": e.message, "code": e.code, "status": e.status_code}))
"#;
    let out = Command::new(python)
        .args(["-c", script, base_url])
        .output()
        .expect("run the venv's python");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON line")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_shows_sluices_reason() {
    let Some(python) = support::test_python() else {
        return;
    };
    let backends = start_backends(&["api"]).await;
    let gw = Config::new()
        .route(
            Route::new("api")
                .hosts(&["127.0.0.1"])
                .path_prefix("/metered")
                .member(url(backends[0].local_addr()))
                .quota(Quota::window("hour", 1, "1h")),
        )
        .route(Route::new("empty").hosts(&["127.0.0.1"]))
        .start();
    let base = format!("http://{}", gw.proxy_addr());

    let e = sdk_error(&python, &format!("{base}/v1"));
    assert_eq!(e["class"], "InternalServerError", "{e}");
    assert_eq!(e["status"], 503);
    assert_eq!(e["code"], "no_member");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.ends_with(
            "sluice: No eligible upstream member: the route's pool is empty or all its members are down"
        ),
        "{message}"
    );

    // The first call spends the hour's one request (the member's answer is no model list, so
    // the SDK may fail to read it: that is not what this test is about); the second is sluice's.
    let _ = sdk_error(&python, &format!("{base}/metered"));
    let e = sdk_error(&python, &format!("{base}/metered"));
    assert_eq!(e["class"], "RateLimitError", "{e}");
    assert_eq!(e["code"], "quota_exceeded");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("sluice: Quota exceeded: the quota window \"hour\""),
        "{e}"
    );
}
