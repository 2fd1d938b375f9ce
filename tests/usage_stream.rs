//! The real `openai` Python SDK through sluice in gateway form, to the OpenAI-compatible stub:
//! what the member sent reaches the client byte for byte (SSE streams with and without their
//! usage chunk, JSON answers, gzip on and off), the SDK reads the usage the member reported,
//! the request body reaches the member unchanged, and a stream the member cuts stays an error
//! to the client, not a clean end. The route meters tokens, so sluice reads every answer as it
//! passes: each test also checks what the window settled (the usage the member reported, or the
//! reservation when the answer holds none).

mod support;

use std::process::Command;

use serde_json::{json, Value};
use sluice_echo::openai::{Exchange, OpenAiStub};
use support::{url, wait_until_async, Config, Gateway, Route};

/// A gateway whose one route, matched by the address the SDK is given as its base URL, goes to
/// the stub, and meters tokens: the request's `max_tokens` (100 without it) reserved, the
/// answer's `usage.total_tokens` settled, in a window no test fills.
async fn setup() -> (Gateway, OpenAiStub) {
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let base = Config::new()
        .route(
            Route::new("openai")
                .hosts(&["127.0.0.1"])
                .member(url(stub.local_addr())),
        )
        .yaml();
    let mut config: Value = serde_yaml::from_str(&base).unwrap();
    config["routes"][0]["quota"] = serde_yaml::from_str(
        r#"
windows: [{ name: tpm, limit: 1000000, window: 1h, unit: tokens }]
usage:
  tokens:
    reserve: { json: "max_tokens", default: 100 }
    settle: { json: "usage.total_tokens" }
"#,
    )
    .unwrap();
    let gw = Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());
    (gw, stub)
}

/// What a request reserves: the script's `max_tokens` when the spec gives none.
const RESERVED: u64 = 16;

/// Waits until the route's window holds `tokens`, all settled, and fails saying what it held.
async fn settled(gw: &Gateway, tokens: u64) {
    let held = || async {
        let status = gw.status().await;
        let w = status["routes"][0]["quota"][0].clone();
        (w["settled"].as_u64(), w["reserved"].as_u64())
    };
    let ok = wait_until_async(std::time::Duration::from_secs(20), || async {
        held().await == (Some(tokens), Some(0))
    })
    .await;
    assert!(
        ok,
        "the window holds {:?}, not {tokens} settled",
        held().await
    );
}

/// One chat completion by the SDK (tests/python/openai_chat.py) through `gw`, and the stub's
/// record of it.
async fn chat(gw: &Gateway, stub: &OpenAiStub, spec: Value) -> (Value, Exchange) {
    let python = support::test_python().expect("checked by the caller");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/openai_chat.py"
    );
    let base_url = format!("http://{}/v1", gw.proxy_addr());
    let before = stub.exchanges().len();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args([script, &base_url, &spec.to_string()])
            // No proxy of the machine's may stand between the SDK and sluice.
            .env("NO_PROXY", "*")
            .env_remove("HTTP_PROXY")
            .env_remove("http_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy")
            .output()
            .expect("run the venv's python")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out: Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
    let exchanges = stub.exchanges();
    assert_eq!(
        exchanges.len(),
        before + 1,
        "one request reached the stub: {out}"
    );
    (out, exchanges[before].clone())
}

fn unhex(value: &Value) -> Vec<u8> {
    hex::decode(value.as_str().expect("a hex string")).expect("hex")
}

/// What every answer through sluice must keep: the member's bytes and framing-free headers as
/// sent, the request body as the SDK sent it, and the usage the SDK reads equal to the stub's.
fn assert_unchanged(out: &Value, exchange: &Exchange) {
    assert_eq!(out["status"], exchange.status, "{out}");
    assert_eq!(
        unhex(&out["raw"]),
        exchange.sent,
        "the client's bytes are the member's"
    );
    assert_eq!(unhex(&out["decoded"]), exchange.answer);
    assert_eq!(
        out["headers"]["content-encoding"].as_str(),
        exchange.content_encoding.as_deref()
    );
    assert_eq!(unhex(&out["request_body"]), exchange.body);
    match exchange.usage {
        Some(usage) => {
            assert_eq!(out["usage"]["prompt_tokens"], usage.prompt_tokens, "{out}");
            assert_eq!(out["usage"]["completion_tokens"], usage.completion_tokens);
            assert_eq!(out["usage"]["total_tokens"], usage.total_tokens());
        }
        None => assert_eq!(out["usage"], Value::Null, "{out}"),
    }
}

/// The event of `body` (an SSE stream) that reports usage, as its exact bytes.
fn usage_event(body: &[u8]) -> Option<String> {
    String::from_utf8_lossy(body)
        .split_terminator("\n\n")
        .find(|event| event.contains("\"total_tokens\""))
        .map(|event| format!("{event}\n\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_reaches_the_openai_sdk_byte_for_byte_with_its_usage_chunk() {
    if support::test_python().is_none() {
        return;
    }
    let (gw, stub) = setup().await;
    for identity in [false, true] {
        let mut headers = json!({"x-stub-prompt-tokens": "1200", "x-stub-completion-tokens": "345", "x-stub-chunks": "40"});
        if identity {
            headers["accept-encoding"] = json!("identity");
        }
        let spec = json!({"stream": true, "include_usage": true, "headers": headers});
        let (out, exchange) = chat(&gw, &stub, spec).await;
        assert_eq!(out["error"], Value::Null, "{out}");
        assert_eq!(exchange.content_encoding.is_none(), identity);
        assert!(exchange.stream && !exchange.cut);
        assert_unchanged(&out, &exchange);
        assert_eq!(out["usage"]["total_tokens"], 1545);
        // Role, 40 content chunks, finish, usage.
        assert_eq!(out["chunks"], 43);
        // The usage chunk arrived whole, and is the stub's.
        let sent = usage_event(&exchange.answer).expect("the stub sent a usage chunk");
        assert_eq!(usage_event(&unhex(&out["decoded"])), Some(sent));
        // Read from the stream as it passed, gzip or not.
        settled(&gw, if identity { 2 * 1545 } else { 1545 }).await;
    }

    // A stream that reports no usage (no include_usage) reaches the SDK as it was, too, and
    // its reservation stands.
    let (out, exchange) = chat(&gw, &stub, json!({"stream": true})).await;
    assert_eq!(out["error"], Value::Null, "{out}");
    assert_eq!(exchange.usage, None);
    assert_unchanged(&out, &exchange);
    assert_eq!(usage_event(&unhex(&out["decoded"])), None);
    settled(&gw, 2 * 1545 + RESERVED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_answer_reaches_the_openai_sdk_byte_for_byte() {
    if support::test_python().is_none() {
        return;
    }
    let (gw, stub) = setup().await;
    let mut used = 0;
    for identity in [false, true] {
        let headers = if identity {
            json!({"accept-encoding": "identity"})
        } else {
            json!({})
        };
        let spec = json!({"max_tokens": 77, "headers": headers});
        let (out, exchange) = chat(&gw, &stub, spec).await;
        assert_eq!(out["error"], Value::Null, "{out}");
        assert_eq!(exchange.content_encoding.is_none(), identity);
        assert_unchanged(&out, &exchange);
        assert_eq!(out["usage"]["completion_tokens"], 77);
        // The usage header of a provider that reports it there comes through as well.
        let total = exchange.usage.unwrap().total_tokens();
        assert_eq!(
            out["headers"]["x-usage-total-tokens"],
            total.to_string().as_str()
        );
        used += total;
        settled(&gw, used).await;
    }

    // An error answer is the member's, byte for byte, and the SDK's error class follows it;
    // it reports no usage, so the reservation stands.
    let spec = json!({"headers": {"x-stub-status": "500"}});
    let (out, exchange) = chat(&gw, &stub, spec).await;
    assert_eq!(out["error"]["class"], "InternalServerError", "{out}");
    assert_unchanged(&out, &exchange);
    settled(&gw, used + RESERVED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_member_cuts_stays_an_error_to_the_sdk() {
    if support::test_python().is_none() {
        return;
    }
    let (gw, stub) = setup().await;
    for identity in [false, true] {
        let mut headers = json!({"x-stub-cut-after": "3"});
        if identity {
            headers["accept-encoding"] = json!("identity");
        }
        let spec = json!({"stream": true, "include_usage": true, "headers": headers});
        let (out, exchange) = chat(&gw, &stub, spec).await;
        assert!(exchange.cut);
        // The events before the cut arrived, and then an error, not a clean end of stream.
        assert_ne!(out["error"], Value::Null, "{out}");
        assert_eq!(out["chunks"], 3, "{out}");
        assert_eq!(unhex(&out["raw"]), exchange.sent);
        assert_eq!(out["usage"], Value::Null);
        // The usage chunk never came: the reservation stands.
        settled(&gw, if identity { 2 } else { 1 } * RESERVED).await;
    }
}
