//! What operators see of a request: the access line's fields, the
//! redaction of queries and Pingora's own lines, request ids and W3C trace context, against the
//! real binary and echo members.

mod support;

use std::time::Duration;

use serde_json::Value;
use support::{dead_url, request, start_backends, url, Config, Gateway, HttpClient, Route};

/// The access lines written so far, waiting until there are `n`.
async fn access_lines(gw: &Gateway, n: usize) -> Vec<Value> {
    let lines = || -> Vec<Value> {
        gw.log_json()
            .into_iter()
            .filter(|l| l["target"] == "sluice::access")
            .collect()
    };
    let found = support::wait_until(Duration::from_secs(20), || lines().len() >= n).await;
    assert!(found, "fewer than {n} access lines:\n{}", gw.logs());
    lines()
}

/// The access line of the request whose id is `id`, waiting for it. Lines of requests on
/// different connections are written in no guaranteed order (each connection's task logs
/// after its response has gone, and another connection's request may finish first), so a
/// test that made several requests finds each line by its id rather than by its position.
async fn access_line(gw: &Gateway, id: &str) -> Value {
    let find = || {
        gw.log_json()
            .into_iter()
            .find(|l| l["target"] == "sluice::access" && l["request_id"] == id)
    };
    let found = support::wait_until(Duration::from_secs(20), || find().is_some()).await;
    assert!(found, "no access line with request id {id}:\n{}", gw.logs());
    find().unwrap()
}

/// One echo member behind route `api` (host `api.test`), with `extra` appended to the config's
/// top level.
async fn one_member(extra: &str) -> (sluice_echo::EchoServer, Gateway) {
    let mut backends = start_backends(&["b1"]).await;
    let yaml = Config::new()
        .route(Route::new("api").member(url(backends[0].local_addr())))
        .yaml()
        + extra;
    let gw = Gateway::start_with_ports(&yaml);
    (backends.remove(0), gw)
}

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_has_every_field_and_no_query_or_header_value() {
    let (backend, gw) = one_member("").await;
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let client_addr = client.local_addr().unwrap();
    let r = client
        .request(
            "POST",
            "api.test",
            "/v1/things?q=secret-query&api_key=secret-key",
            &[
                ("user-agent", "obs-test/1.0"),
                ("authorization", "Bearer secret-token"),
                ("x-request-id", "client-id-1"),
                ("traceparent", &format!("00-{TRACE_ID}-{CLIENT_SPAN}-01")),
                ("tracestate", "vendor=opaque"),
            ],
            b"12345",
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-request-id"), Some("client-id-1"));
    let upstream = r.json();
    let seen = &upstream["headers"];
    assert_eq!(seen["x-request-id"], "client-id-1");
    assert_eq!(seen["tracestate"], "vendor=opaque");
    let tp = seen["traceparent"].as_str().expect("traceparent upstream");
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!((parts[0], parts[1], parts[3]), ("00", TRACE_ID, "01"));
    assert_ne!(
        parts[2], CLIENT_SPAN,
        "sluice's own span is the member's parent"
    );

    let line = &access_lines(&gw, 1).await[0];
    assert_eq!(line["path"], "/v1/things");
    assert!(line.get("query").is_none(), "{line}");
    assert_eq!(line["client"], client_addr.to_string());
    assert_eq!(line["bytes_in"], 5);
    assert_eq!(line["bytes_out"].as_u64(), Some(r.body.len() as u64));
    assert_eq!(line["upstream_addr"], backend.local_addr().to_string());
    assert!(
        line["connect_ms"].as_f64().is_some(),
        "a new connection: {line}"
    );
    let ttfb = line["ttfb_ms"].as_f64().expect("ttfb_ms");
    assert!(ttfb <= line["duration_ms"].as_f64().unwrap());
    assert_eq!(line["user_agent"], "obs-test/1.0");
    assert_eq!(line["request_id"], "client-id-1");
    assert_eq!(line["trace_id"], TRACE_ID);
    assert_eq!(line["span_id"], parts[2]);
    assert_eq!(
        line["members_tried"],
        serde_json::json!([url(backend.local_addr())])
    );
    assert!(line.get("error").is_none(), "{line}");

    // A second request on the same member reuses the pooled connection: no connect time.
    let r = client
        .request("GET", "api.test", "/again", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let generated = r
        .header("x-request-id")
        .expect("a generated id")
        .to_string();
    assert_eq!(generated.len(), 32, "{generated}");
    let line = access_line(&gw, &generated).await;
    assert!(line.get("connect_ms").is_none(), "{line}");
    // No traceparent, and export is off: sluice starts no trace and sends none.
    assert!(line.get("trace_id").is_none(), "{line}");
    assert!(
        r.json()["headers"].get("traceparent").is_none(),
        "{}",
        r.json()
    );

    let logs = gw.logs();
    for secret in ["secret-query", "secret-key", "secret-token", "opaque"] {
        assert!(!logs.contains(secret), "{secret} logged:\n{logs}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_query_logs_the_query_with_secret_values_redacted() {
    let (_backend, gw) = one_member("log:\n  query: true\n").await;
    let r = request(
        gw.proxy_addr(),
        "GET",
        "api.test",
        "/search?q=cats&api_key=secret1&Access_Token=secret2&page=2",
        &[],
        b"",
    )
    .await;
    assert_eq!(r.status, 200);
    let line = &access_lines(&gw, 1).await[0];
    assert_eq!(
        line["query"],
        "q=cats&api_key=REDACTED&Access_Token=REDACTED&page=2"
    );
    assert!(!gw.logs().contains("secret"), "{}", gw.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_request_lists_its_members_and_pingoras_warning_leaks_nothing() {
    let backends = start_backends(&["b1"]).await;
    let dead = dead_url();
    let alive = url(backends[0].local_addr());
    let gw = Config::new()
        .route(
            Route::new("api")
                .member(dead.clone())
                .member(alive.clone())
                .retries(1),
        )
        .start();
    // Round-robin: one of the first two requests starts on the dead member and is retried.
    for _ in 0..2 {
        let r = request(
            gw.proxy_addr(),
            "GET",
            "api.test",
            "/x?q=secret-query",
            &[("cookie", "session=secret-cookie")],
            b"",
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let lines = access_lines(&gw, 2).await;
    let retried = lines
        .iter()
        .find(|l| l["attempts"] == 2)
        .unwrap_or_else(|| panic!("no retried request:\n{}", gw.logs()));
    assert_eq!(
        retried["members_tried"],
        serde_json::json!([dead.as_str(), alive.as_str()])
    );
    assert_eq!(
        retried["upstream_addr"],
        backends[0].local_addr().to_string()
    );
    // Pingora warns of the retried connect failure: through sluice's redaction.
    assert!(
        gw.wait_for_log("Fail to proxy", Duration::from_secs(20))
            .await,
        "{}",
        gw.logs()
    );
    let logs = gw.logs();
    assert!(!logs.contains("secret"), "{logs}");
    assert!(!logs.contains("?q="), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_answers_and_parser_rejections_carry_a_request_id_and_a_code() {
    let gw = Config::new()
        .route(Route::new("api").member(dead_url()))
        .start();
    // A gateway-made answer: 404 no_route.
    let r = request(
        gw.proxy_addr(),
        "GET",
        "nowhere.test",
        "/",
        &[("x-request-id", "bad id with spaces")],
        b"",
    )
    .await;
    assert_eq!(r.status, 404);
    let id = r
        .header("x-request-id")
        .expect("an id on a 404")
        .to_string();
    assert_eq!(id.len(), 32, "an insane client id is replaced: {id}");
    // A member that refuses the connection: 502 upstream_unreachable.
    let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 502);
    let unreachable_id = r
        .header("x-request-id")
        .expect("an id on a 502")
        .to_string();
    // A head the parser refuses.
    let mut c = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    c.write_raw(b"GET /?q=secret HTTP/1.1\r\nHost: a\r\nBad\x01Name: x\r\n\r\n")
        .await
        .unwrap();
    let r = c.read_response(false).await.unwrap();
    assert_eq!(r.status, 400);
    let parsed_id = r
        .header("x-request-id")
        .expect("an id on a parser 400")
        .to_string();

    assert_eq!(access_line(&gw, &id).await["error"], "no_route");
    let unreachable = access_line(&gw, &unreachable_id).await;
    assert_eq!(unreachable["error"], "upstream_unreachable");
    assert_eq!(unreachable["detail"], "refused");
    let parsed = access_line(&gw, &parsed_id).await;
    assert_eq!(parsed["error"], "bad_request");
    assert!(parsed["client"].is_string());
    assert!(!gw.logs().contains("secret"), "{}", gw.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_traceparent_goes_on_untouched_with_export_off() {
    let (_backend, gw) = one_member("").await;
    let invalid = "00-00000000000000000000000000000000-00f067aa0ba902b7-01";
    let r = request(
        gw.proxy_addr(),
        "GET",
        "api.test",
        "/",
        &[("traceparent", invalid)],
        b"",
    )
    .await;
    // sluice takes no part in a trace it cannot continue and does not export: the member
    // sees what the client sent, and the line has no trace.
    assert_eq!(r.json()["headers"]["traceparent"], invalid);
    let line = &access_lines(&gw, 1).await[0];
    assert!(line.get("trace_id").is_none(), "{line}");
    assert!(line.get("span_id").is_none(), "{line}");
}

/// A small OTLP/HTTP receiver on loopback: answers every `POST /v1/traces` with 200 and keeps
/// the spans, decoded with the OTLP protobuf types.
async fn otlp_receiver() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::Mutex<Vec<opentelemetry_proto::tonic::trace::v1::Span>>>,
) {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message as _;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let spans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = spans.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // One request: the head, then Content-Length bytes of body.
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
                    assert!(head.starts_with("post /v1/traces "), "{head}");
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map(|v| v.trim().parse().unwrap())
                        .expect("a Content-Length");
                    while buf.len() < head_end + len {
                        let mut chunk = [0u8; 4096];
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let body: Vec<u8> = buf.drain(..head_end + len).skip(head_end).collect();
                    let request = ExportTraceServiceRequest::decode(&body[..]).unwrap();
                    for rs in request.resource_spans {
                        for ss in rs.scope_spans {
                            kept.lock().unwrap().extend(ss.spans);
                        }
                    }
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if conn.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, spans)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_receiver_with_the_clients_trace_id() {
    let (receiver, spans) = otlp_receiver().await;
    let (backend, gw) = one_member(&format!(
        "tracing:\n  otlp:\n    endpoint: http://{receiver}\n    sample_ratio: 1.0\n"
    ))
    .await;
    let r = request(
        gw.proxy_addr(),
        "GET",
        "api.test",
        "/traced?q=secret",
        &[("traceparent", &format!("00-{TRACE_ID}-{CLIENT_SPAN}-01"))],
        b"",
    )
    .await;
    assert_eq!(r.status, 200);
    let sent = r.json()["headers"]["traceparent"]
        .as_str()
        .unwrap()
        .to_string();
    let sluice_span = sent.split('-').nth(2).unwrap().to_string();
    // A request with no traceparent starts a sampled trace of its own (sample_ratio 1).
    let r = request(gw.proxy_addr(), "GET", "api.test", "/new", &[], b"").await;
    let new_trace = r.json()["headers"]["traceparent"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(new_trace.ends_with("-01"), "{new_trace}");

    let arrived =
        support::wait_until(Duration::from_secs(20), || spans.lock().unwrap().len() >= 2).await;
    assert!(arrived, "no spans at the receiver:\n{}", gw.logs());
    let spans = spans.lock().unwrap().clone();
    let span = spans
        .iter()
        .find(|s| hex::encode(&s.trace_id) == TRACE_ID)
        .unwrap_or_else(|| panic!("no span of the client's trace: {spans:?}"));
    assert_eq!(hex::encode(&span.span_id), sluice_span);
    assert_eq!(hex::encode(&span.parent_span_id), CLIENT_SPAN);
    assert_eq!(span.name, "GET api");
    let attr = |key: &str| {
        span.attributes
            .iter()
            .find(|a| a.key == key)
            .and_then(|a| a.value.clone())
            .and_then(|v| v.value)
    };
    use opentelemetry_proto::tonic::common::v1::any_value::Value as V;
    assert_eq!(attr("http.route"), Some(V::StringValue("api".into())));
    assert_eq!(attr("url.path"), Some(V::StringValue("/traced".into())));
    assert_eq!(attr("http.response.status_code"), Some(V::IntValue(200)));
    assert_eq!(
        attr("sluice.member"),
        Some(V::StringValue(url(backend.local_addr())))
    );
    assert!(format!("{spans:?}").find("secret").is_none());
    let other = spans
        .iter()
        .find(|s| hex::encode(&s.trace_id) != TRACE_ID)
        .unwrap();
    assert_eq!(
        hex::encode(&other.trace_id),
        new_trace.split('-').nth(1).unwrap()
    );
    assert!(other.parent_span_id.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_has_a_request_id_client_bytes_and_members_tried() {
    let backends = start_backends(&["b1"]).await;
    let target = backends[0].local_addr();
    // A tunnel goes to the client's own target, through a direct member.
    let gw = Config::new()
        .egress(support::Egress::loopback_allowed().connect_ports(&[target.port()]))
        .route(
            Route::new("api")
                .hosts(&["127.0.0.1"])
                .direct_member()
                .methods(&["CONNECT"]),
        )
        .start();
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let client_addr = client.local_addr().unwrap();
    client
        .write_raw(
            format!(
                "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nX-Request-Id: tunnel-1\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let r = client.read_response(true).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-request-id"), Some("tunnel-1"));
    // Through the tunnel, the member is the echo server.
    let r = client
        .request(
            "GET",
            "api.test",
            "/inside",
            &[("connection", "close")],
            b"",
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    drop(client);
    let line = &access_lines(&gw, 1).await[0];
    assert_eq!(line["method"], "CONNECT");
    assert_eq!(line["request_id"], "tunnel-1");
    assert_eq!(line["client"], client_addr.to_string());
    assert_eq!(line["members_tried"], serde_json::json!(["direct"]));
    assert!(line["bytes_in"].as_u64().unwrap() > 0, "{line}");
    assert!(line["bytes_out"].as_u64().unwrap() > 0, "{line}");
    assert_eq!(line["bytes_in"], line["bytes_up"]);

    // A CONNECT refused by sluice carries an id too.
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    client
        .write_raw(b"CONNECT nowhere.test:443 HTTP/1.1\r\nHost: nowhere.test:443\r\n\r\n")
        .await
        .unwrap();
    let r = client.read_response(true).await.unwrap();
    assert_eq!(r.status, 404);
    let id = r.header("x-request-id").expect("an id").to_string();
    assert_eq!(access_line(&gw, &id).await["status"], 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_refusal_has_its_line_code_and_request_id() {
    let backends = start_backends(&["b1"]).await;
    let gw = Config::new()
        .route(
            Route::new("api")
                .member(url(backends[0].local_addr()))
                .quota(support::Quota::window("minute", 1, "1m")),
        )
        .start();
    let first = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(first.status, 200);
    let refused = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(refused.status, 429);
    let id = refused.header("x-request-id").expect("an id on a 429");
    let line = access_line(&gw, id).await;
    assert_eq!(line["status"], 429);
    assert_eq!(line["error"], "quota_exceeded");
    assert_eq!(line["members_tried"], serde_json::json!([]));
    assert_eq!(line["bytes_out"].as_u64(), Some(refused.body.len() as u64));
}

/// A member that answers every request with a JSON body echoing `secret`, as an API that
/// echoes the key it was sent would; keeps each connection open for more requests.
async fn member_echoing(secret: &'static str) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    // A whole head, then as many body bytes as its Content-Length says.
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < end + 4 + length {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..end + 4 + length);
                    let body = format!("{{\"echoed_key\":\"{secret}\"}}");
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if stream.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// With every log target at trace, neither a member's response body (an echoed key), nor a
/// client's request body, nor a key sluice injects reaches the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_logging_carries_no_body_and_no_injected_key() {
    const ECHOED: &str = "sk-echoed-by-member-7Qx2";
    const SENT: &str = "client-body-secret-9Kd4";
    const INJECTED: &str = "sk-injected-by-sluice-3Hw8";
    let member = member_echoing(ECHOED).await;
    let yaml = Config::new()
        .route(
            Route::new("api").key_member(
                support::KeyMember::new(url(member), "k1")
                    .header("Authorization", &format!("Bearer {INJECTED}")),
            ),
        )
        .yaml();
    let gw = Gateway::start_with_ports_and_env(&yaml, &[("RUST_LOG", "trace")]);
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for method in ["GET", "POST"] {
        let body = format!("{{\"prompt\":\"{SENT}\"}}");
        let body = if method == "POST" {
            body.as_bytes()
        } else {
            b""
        };
        let r = client
            .request(method, "api.test", "/v1/echo", &[], body)
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.text().contains(ECHOED), "the member echoed: {}", r.text());
    }
    // The access lines of both requests are written, and so is everything before them.
    access_lines(&gw, 2).await;
    let logs = gw.logs();
    assert!(
        logs.contains("\"level\":\"TRACE\"") || logs.contains("\"level\":\"DEBUG\""),
        "RUST_LOG=trace took effect"
    );
    for secret in [ECHOED, SENT, INJECTED] {
        assert!(
            !logs.contains(secret),
            "{secret} is in the log:\n{}",
            logs.lines()
                .filter(|l| l.contains(secret))
                .take(3)
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// A stderr nobody reads fills its pipe; the log writer then drops whole batches rather than
/// hold requests, and `sluice_log_lines_dropped_total` counts every line it dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_dropped_on_a_stuck_stderr_are_counted() {
    let backends = start_backends(&["b1"]).await;
    let dir = support::TempDir::new("sluice-stuck-stderr");
    let [proxy_port, admin_port] = support::free_ports::<2>();
    let proxy = std::net::SocketAddr::from(([127, 0, 0, 1], proxy_port));
    let admin = std::net::SocketAddr::from(([127, 0, 0, 1], admin_port));
    let yaml = Config::new()
        .route(Route::new("api").member(url(backends[0].local_addr())))
        .yaml()
        .replace("{PROXY}", &proxy.to_string())
        .replace("{ADMIN}", &admin.to_string());
    let config = dir.path().join("sluice.yaml");
    std::fs::write(&config, yaml).unwrap();
    // Stderr is a pipe this test holds open and never reads. Killed however the test ends.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = Killed(
        std::process::Command::new(support::sluice_binary())
            .args(["run", "-c"])
            .arg(&config)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Ready means both listeners answer: the admin API and the proxy bind in parallel.
    let up = support::wait_until_async(support::STARTUP_TIMEOUT, || async {
        support::try_request(admin, "GET", "admin", "/healthz", &[], b"")
            .await
            .is_ok_and(|r| r.status == 200)
            && tokio::net::TcpStream::connect(proxy).await.is_ok()
    })
    .await;
    assert!(up, "the gateway did not start");

    let dropped = || async {
        let text = support::admin_get(admin, "/metrics").await.text();
        support::metric_value(&text, "sluice_log_lines_dropped_total", &[])
    };
    assert_eq!(dropped().await, Some(0.0), "the counter starts at 0");
    // Each request writes an access line; enough of them fill the pipe and then the queue.
    let mut client = HttpClient::connect(proxy).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut counted = false;
    while !counted && tokio::time::Instant::now() < deadline {
        for _ in 0..500 {
            let r = client
                .request("GET", "api.test", "/", &[], b"")
                .await
                .unwrap();
            assert_eq!(r.status, 200, "requests are served while the log is stuck");
        }
        counted = dropped().await.is_some_and(|n| n > 0.0);
    }
    assert!(counted, "no dropped line counted");
}

/// An OTLP receiver that is down (a closed port on loopback) is not silent: failed spans are
/// counted and a warning names the failure, and a SIGTERM still exits at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_otlp_receiver_is_counted_and_logged_and_does_not_hold_the_exit() {
    let dead = support::refused_port();
    let (_backend, mut gw) = one_member(&format!(
        "tracing:\n  otlp:\n    endpoint: http://127.0.0.1:{dead}\n    sample_ratio: 1.0\n"
    ))
    .await;
    let failed = || async {
        gw.metric("sluice_otlp_spans_failed_total", &[])
            .await
            .unwrap_or(0.0)
    };
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while failed().await == 0.0 && tokio::time::Instant::now() < deadline {
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(failed().await > 0.0, "{}", gw.metrics().await);
    assert!(
        gw.wait_for_log(
            "span export to the OTLP receiver failed",
            Duration::from_secs(20)
        )
        .await,
        "{}",
        gw.logs()
    );
    // The warning is rate-limited: more failed exports, still one line.
    let before = failed().await;
    for _ in 0..3 {
        client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
    }
    assert!(
        support::wait_until_async(Duration::from_secs(20), || async {
            failed().await > before
        })
        .await
    );
    let warnings = gw
        .logs()
        .matches("span export to the OTLP receiver failed")
        .count();
    assert_eq!(warnings, 1, "{}", gw.logs());

    gw.sigterm();
    assert!(
        gw.wait_exit_async(Duration::from_secs(20)).await.is_some(),
        "the gateway did not exit"
    );
}

/// A receiver that takes the connection and never answers holds each export until its
/// timeout: spans past `max_queue` meanwhile are dropped and counted, and the exit does not
/// wait for the stuck export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_past_the_queue_of_a_stuck_receiver_are_counted_as_dropped() {
    // Accepts, reads, and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let receiver = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    let (_backend, mut gw) = one_member(&format!(
        "tracing:\n  otlp:\n    endpoint: http://{receiver}\n    sample_ratio: 1.0\n    max_queue: 2\n"
    ))
    .await;
    let dropped = || async {
        gw.metric("sluice_otlp_spans_dropped_total", &[])
            .await
            .unwrap_or(0.0)
    };
    assert_eq!(
        gw.metric("sluice_otlp_spans_dropped_total", &[]).await,
        Some(0.0)
    );
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while dropped().await == 0.0 && tokio::time::Instant::now() < deadline {
        let r = client
            .request("GET", "api.test", "/", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200, "requests are served while export is stuck");
    }
    assert!(dropped().await > 0.0, "{}", gw.metrics().await);
    gw.sigterm();
    assert!(
        gw.wait_exit_async(Duration::from_secs(20)).await.is_some(),
        "the gateway did not exit"
    );
}
