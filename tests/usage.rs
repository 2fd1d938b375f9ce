//! Usage-metered quotas end to end: the real `sluice` binary in front of the OpenAI stub, on
//! both stores. Admission reserves in a window of tokens, the answer settles the request's own
//! entry (a JSON body, the final usage chunk of a stream), an answer without usage leaves the
//! reservation and is counted, a member's 429 settles to 0, and a full window refuses what
//! does not fit until a settlement frees room. Totals are read from `/status`, which reads the
//! store, never from timing.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use sluice_echo::openai::OpenAiStub;
use support::{request, url, wait_until_async, Backend, Config, Gateway, HttpClient, Route, Store};

/// The route's windows: tokens per minute and tokens per calendar day, both of `limit` tokens,
/// reserving the request's `max_tokens` (default 100) and settling `usage.total_tokens`.
async fn setup(store: &Store, limit: u64) -> (Gateway, OpenAiStub) {
    setup_settling(store, limit, r#"{ json: "usage.total_tokens" }"#).await
}

/// [`setup`], its tokens settled by `settle` (YAML).
async fn setup_settling(store: &Store, limit: u64, settle: &str) -> (Gateway, OpenAiStub) {
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let base = Config::new()
        .store(store)
        .route(
            Route::new("openai")
                // The SDK's base URL names the gateway by its address.
                .hosts(&["openai.test", "127.0.0.1"])
                .member(url(stub.local_addr())),
        )
        .yaml();
    let mut config: Value = serde_yaml::from_str(&base).unwrap();
    let quota: Value = serde_yaml::from_str(&format!(
        r#"
windows:
  - {{ name: tpm, limit: {limit}, window: 1m, unit: tokens }}
  - {{ name: day, limit: {limit}, window: calendar_day, unit: tokens, tz: "Europe/Paris" }}
usage:
  tokens:
    reserve: {{ json: "max_tokens", default: 100 }}
    settle: {settle}
"#
    ))
    .unwrap();
    config["routes"][0]["quota"] = quota;
    let gw = Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());
    (gw, stub)
}

/// What the route's windows hold now, in tokens, from `/status`.
async fn held(gw: &Gateway) -> Vec<u64> {
    let status = gw.status().await;
    let route = status["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "openai")
        .unwrap()
        .clone();
    route["quota"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            // The store keeps millionths of a token; `/status` shows tokens.
            assert_eq!(w["unit"], "tokens", "{w}");
            let limit = w["limit"].as_u64().unwrap();
            limit - w["remaining"].as_u64().unwrap_or(limit)
        })
        .collect()
}

/// Waits until both windows hold `tokens`, and says what they held last.
async fn holds(gw: &Gateway, tokens: u64) -> Vec<u64> {
    let mut last = Vec::new();
    let ok = wait_until_async(Duration::from_secs(20), || {
        let gw = &*gw;
        async move { held(gw).await == vec![tokens; 2] }
    })
    .await;
    if !ok {
        last = held(gw).await;
    }
    assert!(ok, "the windows hold {last:?}, not {tokens} tokens each");
    last
}

async fn chat(gw: &Gateway, body: &Value, headers: &[(&str, &str)]) -> support::Response {
    let body = body.to_string();
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

async fn json_usage_settles_exactly(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 1000).await;
    let body =
        json!({"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]});
    let plain = [
        ("x-stub-prompt-tokens", "7"),
        ("x-stub-completion-tokens", "30"),
        ("Accept-Encoding", "identity"),
    ];
    let r = chat(&gw, &body, &plain).await;
    assert_eq!(r.status, 200, "{}", r.text());
    holds(&gw, 37).await;
    // A gzip answer is read decompressed; the client gets it as sent.
    let gzip = [
        ("x-stub-prompt-tokens", "3"),
        ("x-stub-completion-tokens", "10"),
        ("Accept-Encoding", "gzip"),
    ];
    let r = chat(&gw, &body, &gzip).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-encoding"), Some("gzip"));
    assert_eq!(
        r.body,
        stub.exchanges()[1].sent,
        "the member's bytes, unchanged"
    );
    holds(&gw, 50).await;
}

async fn sse_final_usage_chunk_settles(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 1000).await;
    let body = json!({"model": "m", "max_tokens": 80, "stream": true,
        "stream_options": {"include_usage": true}, "messages": []});
    let headers = [
        ("x-stub-prompt-tokens", "12"),
        ("x-stub-completion-tokens", "9"),
        ("x-stub-chunks", "5"),
    ];
    let r = chat(&gw, &body, &headers).await;
    assert_eq!(r.status, 200);
    let sent = stub.exchanges()[0].clone();
    assert!(sent.content_encoding.is_none());
    assert_eq!(
        r.body, sent.sent,
        "the stream reaches the client byte for byte"
    );
    holds(&gw, 21).await;
}

async fn a_stream_without_usage_leaves_its_reservation(backend: Backend) {
    let store = Store::start(backend);
    let (gw, _stub) = setup(&store, 1000).await;
    let body = json!({"model": "m", "max_tokens": 60, "stream": true, "messages": []});
    let r = chat(&gw, &body, &[("x-stub-completion-tokens", "5")]).await;
    assert_eq!(r.status, 200);
    let labels = [("route", "openai"), ("reason", "no_usage")];
    let counted = wait_until_async(Duration::from_secs(20), || async {
        gw.metric("sluice_usage_unsettled_total", &labels).await == Some(1.0)
    })
    .await;
    assert!(counted, "{}", gw.metrics().await);
    holds(&gw, 60).await;
}

/// A chat request reserving 70 tokens (answered with `x-stub-status` when given), sent while
/// the stub holds answers: returns once the stub holds it, before its answer's head.
async fn held_chat(
    gw: &Gateway,
    stub: &OpenAiStub,
    status: Option<&'static str>,
) -> tokio::task::JoinHandle<support::Response> {
    stub.hold();
    let addr = gw.proxy_addr();
    let body = json!({"model": "m", "max_tokens": 70, "messages": []}).to_string();
    let task = tokio::spawn(async move {
        let mut headers = vec![("Content-Type", "application/json")];
        headers.extend(status.map(|s| ("x-stub-status", s)));
        request(
            addr,
            "POST",
            "openai.test",
            "/v1/chat/completions",
            &headers,
            body.as_bytes(),
        )
        .await
    });
    assert!(wait_until_async(Duration::from_secs(20), || async { stub.held() == 1 }).await);
    task
}

/// A `Content-Length` sent as a list of equal values, or as equal lines, frames the body as
/// one length (RFC 9112 §6.3), as Pingora serves it: the reservation reads the same body and
/// takes its `max_tokens` exactly as with a plain `Content-Length`, never its default. Sent
/// raw, as no client library writes such a head.
async fn a_listed_content_length_reserves_from_the_body(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 1000).await;
    let body = json!({"model": "m", "max_tokens": 70, "messages": []}).to_string();
    let n = body.len();
    for lengths in [
        format!("Content-Length: {n}\r\n"),
        format!("Content-Length: {n}, {n}\r\n"),
        format!("Content-Length: {n}\r\nContent-Length: {n}\r\n"),
    ] {
        stub.hold();
        let raw = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: openai.test\r\n\
             Content-Type: application/json\r\nx-stub-status: 429\r\n{lengths}\r\n{body}"
        );
        let addr = gw.proxy_addr();
        let task = tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            client.write_raw(raw.as_bytes()).await.unwrap();
            client.read_response(false).await.unwrap()
        });
        let held_one =
            wait_until_async(Duration::from_secs(20), || async { stub.held() == 1 }).await;
        assert!(held_one, "{lengths:?}: the member never got the request");
        // The default would reserve 100.
        holds(&gw, 70).await;
        stub.release();
        let r = task.await.unwrap();
        assert_eq!(r.status, 429, "{lengths:?}: {}", r.text());
        // The member's 429 settles to 0, so the next case starts from empty windows.
        holds(&gw, 0).await;
    }
}

async fn a_member_429_settles_to_zero(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 1000).await;
    // Held before its head, so the reservation can be seen standing first.
    let task = held_chat(&gw, &stub, Some("429")).await;
    holds(&gw, 70).await;
    stub.release();
    let r = task.await.unwrap();
    assert_eq!(r.status, 429);
    holds(&gw, 0).await;
}

/// A client that leaves while the member works does not take the reservation back: the
/// member got the request and may bill it, so it stands, counted as `no_answer`.
async fn a_client_gone_after_the_member_got_the_request_leaves_its_reservation(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 1000).await;
    let task = held_chat(&gw, &stub, None).await;
    // The client hangs up while the member holds its answer.
    task.abort();
    let labels = [("route", "openai"), ("reason", "no_answer")];
    let counted = wait_until_async(Duration::from_secs(20), || async {
        gw.metric("sluice_usage_unsettled_total", &labels).await == Some(1.0)
    })
    .await;
    assert!(counted, "{}", gw.metrics().await);
    holds(&gw, 70).await;
    stub.release();
}

/// An answer cut after its head (the member fails mid-body) is no measure of the work: the
/// reservation stands, counted as `no_answer`, even where a `default` would settle an answer
/// that holds no amount. Both a JSON body and a stream, cut at their first byte.
async fn an_answer_cut_short_leaves_its_reservation(backend: Backend) {
    let store = Store::start(backend);
    let settle = r#"{ json: "usage.total_tokens", default: 0 }"#;
    let (gw, _stub) = setup_settling(&store, 1000, settle).await;
    let json = json!({"model": "m", "max_tokens": 70, "messages": []});
    let stream = json!({"model": "m", "max_tokens": 70, "messages": [], "stream": true,
        "stream_options": {"include_usage": true}});
    for (n, body) in [(1.0, json), (2.0, stream)] {
        // The head goes to the client (200); the body never comes, and the connection closes.
        let cut = support::try_request(
            gw.proxy_addr(),
            "POST",
            "openai.test",
            "/v1/chat/completions",
            &[
                ("Content-Type", "application/json"),
                ("x-stub-cut-after", "0"),
            ],
            body.to_string().as_bytes(),
        )
        .await;
        assert!(
            cut.is_err(),
            "the answer is cut: {:?}",
            cut.map(|r| r.status)
        );
        let labels = [("route", "openai"), ("reason", "no_answer")];
        let counted = wait_until_async(Duration::from_secs(20), || async {
            gw.metric("sluice_usage_unsettled_total", &labels).await == Some(n)
        })
        .await;
        assert!(counted, "{}", gw.metrics().await);
    }
    holds(&gw, 140).await;
}

/// A client that hangs up before its body is whole is not admitted: its body cannot be read
/// for the reservation, and Pingora would count it finished and send it on cut short. Nothing
/// is charged, and the request ends at once rather than with its member's read timeout.
async fn a_client_gone_mid_body_is_not_charged(backend: Backend) {
    use tokio::io::AsyncWriteExt;
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 1000).await;
    let mut client = tokio::net::TcpStream::connect(gw.proxy_addr())
        .await
        .unwrap();
    let head = "POST /v1/chat/cut HTTP/1.1\r\nHost: openai.test\r\n\
                Content-Type: application/json\r\nContent-Length: 500\r\n\r\n";
    client.write_all(head.as_bytes()).await.unwrap();
    client
        .write_all(br#"{"model":"m","max_tokens":70,"#)
        .await
        .unwrap();
    drop(client);
    assert!(
        gw.wait_for_log("\"path\":\"/v1/chat/cut\"", Duration::from_secs(20))
            .await,
        "the request ends"
    );
    assert_eq!(held(&gw).await, [0, 0]);
    assert!(stub.exchanges().is_empty());
}

/// A request no member got (its only member is gone) settles to 0.
async fn a_request_no_member_got_settles_to_zero(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 1000).await;
    stub.stop().await;
    let body = json!({"model": "m", "max_tokens": 70, "messages": []});
    let r = chat(&gw, &body, &[]).await;
    assert_eq!(r.status, 502, "{}", r.text());
    holds(&gw, 0).await;
}

async fn a_full_window_refuses_until_a_settlement_frees_room(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 100).await;
    stub.hold();
    let addr = gw.proxy_addr();
    let big = json!({"model": "m", "max_tokens": 80, "messages": []}).to_string();
    let first = big.clone();
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
                ("Accept-Encoding", "identity"),
            ],
            first.as_bytes(),
        )
        .await
    });
    assert!(wait_until_async(Duration::from_secs(20), || async { stub.held() == 1 }).await);
    // 80 reserved of 100: another 80 does not fit.
    let refused = chat(&gw, &serde_json::from_str(&big).unwrap(), &[]).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert!(refused.header("retry-after").is_some());
    assert_eq!(
        stub.exchanges().len(),
        1,
        "only the held request reached the member"
    );
    stub.release();
    assert_eq!(task.await.unwrap().status, 200);
    // Settled to 10: room for 80 again.
    holds(&gw, 10).await;
    let admitted = chat(
        &gw,
        &serde_json::from_str(&big).unwrap(),
        &[
            ("x-stub-prompt-tokens", "1"),
            ("x-stub-completion-tokens", "1"),
        ],
    )
    .await;
    assert_eq!(admitted.status, 200, "{}", admitted.text());
    holds(&gw, 12).await;
}

async fn the_body_reaches_the_member_byte_exact(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 1000).await;
    // Odd spacing, key order and escapes: the member gets these bytes, not a re-encoding.
    let body = b"{ \"max_tokens\" :20,\"model\":\"m\",  \"messages\":[{\"content\":\"\\u00e9t\\u00e9\"}]}\n";
    let r = request(
        gw.proxy_addr(),
        "POST",
        "openai.test",
        "/v1/chat/completions",
        &[
            ("Content-Type", "application/json"),
            ("x-stub-prompt-tokens", "2"),
            ("x-stub-completion-tokens", "3"),
        ],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(stub.exchanges()[0].body, body.to_vec());
    holds(&gw, 5).await;
}

async fn a_settlement_past_the_limit_is_recorded_and_counted(backend: Backend) {
    let store = Store::start(backend);
    let (gw, _stub) = setup(&store, 100).await;
    let body = json!({"model": "m", "max_tokens": 10, "messages": []});
    let used = [
        ("x-stub-prompt-tokens", "50"),
        ("x-stub-completion-tokens", "100"),
    ];
    assert_eq!(chat(&gw, &body, &used).await.status, 200);
    // 10 reserved, 150 used: recorded as used, past the limit, so nothing remains.
    holds(&gw, 100).await;
    let status = gw.status().await;
    for w in status["routes"][0]["quota"].as_array().unwrap() {
        assert_eq!(
            (&w["settled"], &w["reserved"]),
            (&150.into(), &0.into()),
            "{w}"
        );
    }
    // Counted by the settlement's task after the store answered it: waited for.
    let labels = [("route", "openai")];
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            gw.metric("sluice_usage_overrun_total", &labels).await == Some(1.0)
        })
        .await,
        "{:?}",
        gw.metric("sluice_usage_overrun_total", &labels).await
    );
    let refused = chat(&gw, &json!({"max_tokens": 1}), &[]).await;
    assert_eq!(
        refused.status, 429,
        "a window past its limit admits nothing"
    );
}

/// One chat completion by the real openai SDK (tests/python/openai_chat.py) through `gw`.
async fn sdk_chat(gw: &Gateway, spec: Value) -> Value {
    let python = support::test_python().expect("checked by the caller");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/openai_chat.py"
    );
    let base_url = format!("http://{}/v1", gw.proxy_addr());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args([script, &base_url, &spec.to_string()])
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
    serde_json::from_slice(&out.stdout).expect("one JSON line")
}

async fn the_openai_sdk_settles_from_gzip_streams_and_bodies(backend: Backend) {
    if support::test_python().is_none() {
        return;
    }
    let store = Store::start(backend);
    let (gw, stub) = setup(&store, 10_000).await;
    // The SDK asks for gzip: the stream is read decompressed and reaches it as sent.
    let headers = json!({"x-stub-prompt-tokens": "1200", "x-stub-completion-tokens": "345", "x-stub-chunks": "40"});
    let out = sdk_chat(
        &gw,
        json!({"stream": true, "include_usage": true, "headers": headers}),
    )
    .await;
    assert_eq!(out["error"], Value::Null, "{out}");
    let exchange = stub.exchanges()[0].clone();
    assert_eq!(exchange.content_encoding.as_deref(), Some("gzip"));
    assert_eq!(
        hex::decode(out["raw"].as_str().unwrap()).unwrap(),
        exchange.sent
    );
    assert_eq!(out["usage"]["total_tokens"], 1545);
    holds(&gw, 1545).await;
    let headers = json!({"x-stub-prompt-tokens": "5"});
    let out = sdk_chat(&gw, json!({"max_tokens": 77, "headers": headers})).await;
    assert_eq!(out["error"], Value::Null, "{out}");
    assert_eq!(
        stub.exchanges()[1].content_encoding.as_deref(),
        Some("gzip")
    );
    holds(&gw, 1545 + 82).await;
}

/// What each member's own window holds now, in tokens, from `/status`.
async fn members_hold(gw: &Gateway) -> Vec<u64> {
    let status = gw.status().await;
    status["routes"][0]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let w = &m["quota"][0];
            assert_eq!(w["unit"], "tokens", "{w}");
            let limit = w["limit"].as_u64().unwrap();
            limit - w["remaining"].as_u64().unwrap_or(limit)
        })
        .collect()
}

async fn members_windows_in_tokens_pick_a_key_with_room_and_settle(backend: Backend) {
    keys_with_token_windows(backend, "least_used").await;
}

/// `least_in_flight` takes a key whose windows admit the reservation too, and settles it.
async fn least_in_flight_picks_a_key_whose_tokens_admit_the_reservation(backend: Backend) {
    keys_with_token_windows(backend, "least_in_flight").await;
}

/// Two keys of 100 tokens a minute under `selection`: two held requests reserving 80 take one
/// key each, a third fits neither, and each key settles to what its answer used.
async fn keys_with_token_windows(backend: Backend, selection: &str) {
    let store = Store::start(backend);
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let member = url(stub.local_addr());
    let base = Config::new()
        .store(&store)
        .route(
            Route::new("openai")
                .hosts(&["openai.test"])
                .least_used()
                .key_member(support::KeyMember::new(member.clone(), "key-a"))
                .key_member(support::KeyMember::new(member, "key-b")),
        )
        .yaml();
    let mut config: Value = serde_yaml::from_str(&base).unwrap();
    let tpm: Value =
        serde_yaml::from_str("windows: [{ name: tpm, limit: 100, window: 1m, unit: tokens }]")
            .unwrap();
    for m in 0..2 {
        config["routes"][0]["upstream"]["members"][m]["quota"] = tpm.clone();
    }
    config["routes"][0]["quota"] = serde_yaml::from_str(
        "usage: { tokens: { reserve: { json: max_tokens, default: 100 }, settle: { json: usage.total_tokens } } }",
    )
    .unwrap();
    config["routes"][0]["upstream"]["selection"] = selection.into();
    let gw = Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap());

    stub.hold();
    let big = json!({"model": "m", "max_tokens": 80, "messages": []}).to_string();
    let used = [
        ("Content-Type", "application/json"),
        ("x-stub-prompt-tokens", "4"),
        ("x-stub-completion-tokens", "6"),
    ];
    let mut held = Vec::new();
    for n in 1..=2 {
        let (addr, body) = (gw.proxy_addr(), big.clone());
        held.push(tokio::spawn(async move {
            request(
                addr,
                "POST",
                "openai.test",
                "/v1/chat/completions",
                &used,
                body.as_bytes(),
            )
            .await
        }));
        assert!(wait_until_async(Duration::from_secs(20), || async { stub.held() == n }).await);
    }
    // Each key holds one reservation of 80 of its 100: a third does not fit either.
    assert_eq!(members_hold(&gw).await, vec![80, 80]);
    let refused = chat(&gw, &serde_json::from_str(&big).unwrap(), &[]).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    stub.release();
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    let settled = wait_until_async(Duration::from_secs(20), || async {
        members_hold(&gw).await == vec![10, 10]
    })
    .await;
    assert!(settled, "{:?}", members_hold(&gw).await);
    let admitted = chat(&gw, &serde_json::from_str(&big).unwrap(), &used[1..]).await;
    assert_eq!(admitted.status, 200, "{}", admitted.text());
}

/// A key of [`key_pool`]: its member's url, its name, its tpm limit and the headers sent to it.
type Key<'a> = (String, &'a str, u64, &'a [(&'a str, &'a str)]);

/// A least-used key pool on one route that meters tokens: per member `(url, name, tpm limit,
/// headers sent to it)`, each key with a window of tokens per minute, requests reserving their
/// `max_tokens` and settling `usage.total_tokens`. With `replay`, a 429 cools the key and the
/// request goes to another (`cooldown.retry`); one connect retry either way.
fn key_pool(store: &Store, keys: &[Key<'_>], replay: bool) -> Gateway {
    let mut route = Route::new("openai")
        .hosts(&["openai.test"])
        .least_used()
        .retries(1);
    for (url, name, _, headers) in keys {
        let mut member = support::KeyMember::new(url.clone(), name);
        for (h, v) in *headers {
            member = member.header(h, v);
        }
        route = route.key_member(member);
    }
    if replay {
        route = route.cooldown(support::Cooldown::new().on_status(&[429]).retry());
    }
    let base = Config::new().store(store).route(route).yaml();
    let mut config: Value = serde_yaml::from_str(&base).unwrap();
    for (m, (_, _, limit, _)) in keys.iter().enumerate() {
        config["routes"][0]["upstream"]["members"][m]["quota"] = serde_yaml::from_str(&format!(
            "windows: [{{ name: tpm, limit: {limit}, window: 1m, unit: tokens }}]"
        ))
        .unwrap();
    }
    config["routes"][0]["quota"] = serde_yaml::from_str(
        "usage: { tokens: { reserve: { json: max_tokens, default: 100 }, settle: { json: usage.total_tokens } } }",
    )
    .unwrap();
    Gateway::start_with_ports(&serde_yaml::to_string(&config).unwrap())
}

/// Waits until the members' windows hold `tokens`, and fails with what they held last.
async fn members_settle_to(gw: &Gateway, tokens: &[u64]) {
    let settled = wait_until_async(Duration::from_secs(20), || async {
        members_hold(gw).await == tokens
    })
    .await;
    assert!(
        settled,
        "the keys hold {:?}, not {tokens:?}",
        members_hold(gw).await
    );
}

/// A request reserving 50 tokens that uses 10.
async fn chat_using_10(gw: &Gateway) -> support::Response {
    let body = json!({"model": "m", "max_tokens": 50, "messages": []});
    let used = [
        ("x-stub-prompt-tokens", "4"),
        ("x-stub-completion-tokens", "6"),
    ];
    chat(gw, &body, &used).await
}

/// key-a, whose answers are 429s, and key-b, with a window of `key_b_limit` tokens, over one
/// stub, with the cooldown replay on.
async fn replay_pool(store: &Store, key_b_limit: u64) -> (Gateway, OpenAiStub) {
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let member = url(stub.local_addr());
    let refuses: &[(&str, &str)] = &[("x-stub-status", "429")];
    let keys = [
        (member.clone(), "key-a", 100, refuses),
        (member, "key-b", key_b_limit, &[][..]),
    ];
    (key_pool(store, &keys, true), stub)
}

/// key-a answers 429 and the request is replayed to key-b, which answers: key-b did the work
/// and its window holds the answer's usage; key-a did none and holds nothing.
async fn a_replay_charges_the_key_that_answered(backend: Backend) {
    let store = Store::start(backend);
    let (gw, stub) = replay_pool(&store, 100).await;
    // Ties go to the smallest name: key-a gets the request first.
    let r = chat_using_10(&gw).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        stub.exchanges().len(),
        2,
        "key-a's 429, then key-b's answer"
    );
    members_settle_to(&gw, &[0, 10]).await;
}

/// key-a answers 429 and key-b's window cannot take the request's reservation: there is no
/// replay, the 429 goes to the client, and neither key holds anything.
async fn no_replay_to_a_key_whose_window_cannot_take_the_reservation(backend: Backend) {
    let store = Store::start(backend);
    // key-b's whole window is 40 tokens: the request reserves 50.
    let (gw, stub) = replay_pool(&store, 40).await;
    let r = chat_using_10(&gw).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(stub.exchanges().len(), 1, "key-b never gets the request");
    members_settle_to(&gw, &[0, 0]).await;
}

/// key-a does not listen: the request goes to key-b, which holds the usage; key-a never got
/// the request and holds nothing.
async fn a_connect_retry_charges_the_key_that_answered(backend: Backend) {
    let store = Store::start(backend);
    let gone = OpenAiStub::start("gone", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    gone.stop().await;
    let keys = [
        (url(gone.local_addr()), "key-a", 100, &[][..]),
        (url(stub.local_addr()), "key-b", 100, &[][..]),
    ];
    let gw = key_pool(&store, &keys, false);
    let r = chat_using_10(&gw).await;
    assert_eq!(r.status, 200, "{}", r.text());
    members_settle_to(&gw, &[0, 10]).await;
}

/// The `r` of a `RateLimit` item, and the policy's `q` of the window it names.
fn ratelimit(r: &support::Response) -> (String, u64, u64) {
    let item = r.header("ratelimit").expect("a RateLimit header");
    let list: sfv::List = sfv::Parser::new(item.as_bytes()).parse().unwrap();
    let sfv::ListEntry::Item(item) = &list[0] else {
        panic!("an item: {list:?}");
    };
    let name = item.bare_item.as_string().unwrap().as_str().to_owned();
    let param = |item: &sfv::Item, p: &str| {
        item.params
            .iter()
            .find(|(k, _)| k.as_str() == p)
            .and_then(|(_, v)| v.as_integer())
            .map(|v| u64::try_from(i64::from(v)).unwrap())
            .unwrap()
    };
    let remaining = param(item, "r");
    let policy = r
        .header("ratelimit-policy")
        .expect("a RateLimit-Policy header");
    let policies: sfv::List = sfv::Parser::new(policy.as_bytes()).parse().unwrap();
    let limit = policies
        .iter()
        .find_map(|e| match e {
            sfv::ListEntry::Item(p)
                if p.bare_item.as_string().map(|s| s.as_str()) == Some(&name) =>
            {
                Some(param(p, "q"))
            }
            _ => None,
        })
        .expect("the item's window in the policy");
    (name, remaining, limit)
}

/// After a settlement, the `RateLimit` headers and `/status` report a window of tokens in
/// tokens (SPEC §10), not in the millionths the store keeps.
async fn ratelimit_and_status_report_tokens(backend: Backend) {
    let store = Store::start(backend);
    let (gw, _stub) = setup(&store, 1000).await;
    let body =
        json!({"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]});
    let used = [
        ("x-stub-prompt-tokens", "7"),
        ("x-stub-completion-tokens", "30"),
        ("Accept-Encoding", "identity"),
    ];
    let first = chat(&gw, &body, &used).await;
    assert_eq!(first.status, 200, "{}", first.text());
    // Admitted with 50 reserved of 1000.
    assert_eq!(ratelimit(&first), ("tpm".to_owned(), 950, 1000));
    holds(&gw, 37).await;
    // Settled to 37; the next request reserves 50 beside them: 913 tokens remain.
    let second = chat(&gw, &body, &used).await;
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(ratelimit(&second), ("tpm".to_owned(), 913, 1000));
    holds(&gw, 74).await;
    let status = gw.status().await;
    let windows = status["routes"][0]["quota"].as_array().unwrap().clone();
    assert_eq!(windows.len(), 2, "{windows:?}");
    for (w, name) in windows.iter().zip(["tpm", "day"]) {
        assert_eq!(w["name"], name);
        assert_eq!(w["unit"], "tokens", "{w}");
        assert_eq!(w["limit"], 1000, "{w}");
        assert_eq!(w["remaining"], 926, "{w}");
    }
}

on_both_stores!(
    a_listed_content_length_reserves_from_the_body,
    a_client_gone_after_the_member_got_the_request_leaves_its_reservation,
    a_client_gone_mid_body_is_not_charged,
    an_answer_cut_short_leaves_its_reservation,
    a_request_no_member_got_settles_to_zero,
    ratelimit_and_status_report_tokens,
    members_windows_in_tokens_pick_a_key_with_room_and_settle,
    least_in_flight_picks_a_key_whose_tokens_admit_the_reservation,
    a_replay_charges_the_key_that_answered,
    no_replay_to_a_key_whose_window_cannot_take_the_reservation,
    a_connect_retry_charges_the_key_that_answered,
    a_settlement_past_the_limit_is_recorded_and_counted,
    the_openai_sdk_settles_from_gzip_streams_and_bodies,
    json_usage_settles_exactly,
    sse_final_usage_chunk_settles,
    a_stream_without_usage_leaves_its_reservation,
    a_member_429_settles_to_zero,
    a_full_window_refuses_until_a_settlement_frees_room,
    the_body_reaches_the_member_byte_exact,
);
