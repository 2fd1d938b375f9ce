use super::*;

use std::io::Read;
use std::process::Command;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

const IO_TIMEOUT: Duration = Duration::from_secs(10);

async fn start() -> OpenAiStub {
    OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .expect("start the stub")
}

/// An answer read to the end of the connection: status, headers, and the body with any
/// chunked framing undone. `complete` is false when the body ended before its framing said.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// The body's pieces as framed: one per chunk, or the whole Content-Length body.
    pieces: Vec<Vec<u8>>,
    complete: bool,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends one POST with `Connection: close` on a raw connection, and reads until the stub
/// closes it, so that a cut answer shows exactly what arrived.
async fn post(stub: &OpenAiStub, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut stream = timeout(IO_TIMEOUT, TcpStream::connect(stub.local_addr()))
        .await
        .unwrap()
        .unwrap();
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: stub\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    timeout(IO_TIMEOUT, stream.read_to_end(&mut raw))
        .await
        .expect("the stub closes the connection")
        .expect("read");
    parse(&raw)
}

fn parse(raw: &[u8]) -> Answer {
    let mut fields = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut fields);
    let httparse::Status::Complete(head_len) = response.parse(raw).expect("a valid head") else {
        panic!("incomplete head: {}", String::from_utf8_lossy(raw));
    };
    let headers: Vec<(String, String)> = response
        .headers
        .iter()
        .map(|h| {
            let value = String::from_utf8_lossy(h.value).into_owned();
            (h.name.to_ascii_lowercase(), value)
        })
        .collect();
    let status = response.code.unwrap();
    let rest = &raw[head_len..];
    let length = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .map(|(_, v)| v.parse::<usize>().unwrap());
    let (pieces, complete) = match length {
        Some(length) => (vec![rest.to_vec()], rest.len() == length),
        None => dechunk(rest),
    };
    Answer {
        status,
        headers,
        body: pieces.concat(),
        pieces,
        complete,
    }
}

/// The chunks of a chunked body, and whether its last (empty) chunk arrived.
fn dechunk(mut rest: &[u8]) -> (Vec<Vec<u8>>, bool) {
    let mut pieces = Vec::new();
    loop {
        let Some(line_end) = rest.windows(2).position(|w| w == b"\r\n") else {
            return (pieces, false);
        };
        let size_text = std::str::from_utf8(&rest[..line_end]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        rest = &rest[line_end + 2..];
        if size == 0 {
            return (pieces, rest.starts_with(b"\r\n"));
        }
        if rest.len() < size + 2 {
            return (pieces, false);
        }
        pieces.push(rest[..size].to_vec());
        rest = &rest[size + 2..];
    }
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut plain = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut plain)
        .expect("valid gzip");
    plain
}

/// The JSON documents of the `data:` lines of an event stream, `[DONE]` as a string.
fn events_of(body: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("\n\n"), "{text}");
    text.split_terminator("\n\n")
        .map(|event| {
            let data = event
                .strip_prefix("data: ")
                .expect("one data line per event");
            serde_json::from_str(data).unwrap_or_else(|_| Value::String(data.to_string()))
        })
        .collect()
}

const CHAT: &str =
    r#"{"model":"gpt-test","messages":[{"role":"user","content":"hi"}],"max_tokens":7}"#;
const STREAM: &str =
    r#"{"model":"gpt-test","messages":[],"stream":true,"stream_options":{"include_usage":true}}"#;

#[tokio::test]
async fn json_answer_reports_the_usage_the_request_sets() {
    let stub = start().await;
    let answer = post(&stub, "/v1/chat/completions", &[], CHAT).await;
    assert_eq!(answer.status, 200);
    assert!(answer.complete);
    assert_eq!(answer.header("content-type"), Some("application/json"));
    assert_eq!(answer.header("content-encoding"), None);
    let document: Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(document["object"], "chat.completion");
    assert_eq!(document["model"], "gpt-test");
    // Completion from max_tokens, prompt from the body's length.
    let prompt = (CHAT.len() as u64).div_ceil(4);
    assert_eq!(document["usage"]["completion_tokens"], 7);
    assert_eq!(document["usage"]["prompt_tokens"], prompt);
    assert_eq!(document["usage"]["total_tokens"], prompt + 7);
    let total = (prompt + 7).to_string();
    assert_eq!(answer.header("x-usage-total-tokens"), Some(total.as_str()));

    let headers = [
        ("x-stub-prompt-tokens", "1000"),
        ("x-stub-completion-tokens", "234"),
    ];
    let answer = post(&stub, "/v1/chat/completions", &headers, CHAT).await;
    let document: Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(document["usage"]["total_tokens"], 1234);

    let exchanges = stub.exchanges();
    assert_eq!(exchanges.len(), 2);
    let first = &exchanges[0];
    assert_eq!(first.method, "POST");
    assert_eq!(first.target, "/v1/chat/completions");
    assert_eq!(first.body, CHAT.as_bytes());
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert_eq!(
        first.usage,
        Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: 7
        })
    );
    assert!(!first.stream && !first.cut);
    assert_eq!(first.sent, first.answer);
    assert_eq!(exchanges[1].usage.unwrap().total_tokens(), 1234);
}

#[tokio::test]
async fn a_stream_ends_with_its_usage_chunk_when_asked_for() {
    let stub = start().await;
    let headers = [("x-stub-chunks", "4"), ("x-stub-completion-tokens", "50")];
    let answer = post(&stub, "/v1/chat/completions", &headers, STREAM).await;
    assert_eq!(answer.status, 200);
    assert!(answer.complete);
    assert_eq!(
        answer.header("content-type"),
        Some("text/event-stream; charset=utf-8")
    );
    assert_eq!(answer.header("transfer-encoding"), Some("chunked"));
    let events = events_of(&answer.body);
    // Role, four content chunks, finish, usage, [DONE].
    assert_eq!(events.len(), 8, "{events:?}");
    assert_eq!(events[7], "[DONE]");
    for event in &events[..6] {
        assert_eq!(event["usage"], Value::Null, "{event}");
        assert!(event.get("usage").is_some());
    }
    assert_eq!(events[5]["choices"][0]["finish_reason"], "stop");
    assert_eq!(events[6]["choices"], json!([]));
    assert_eq!(events[6]["usage"]["completion_tokens"], 50);
    let exchange = &stub.exchanges()[0];
    assert!(exchange.stream);
    assert_eq!(exchange.usage.unwrap().completion_tokens, 50);
    assert_eq!(exchange.sent, answer.body);
    assert_eq!(exchange.answer, answer.body);

    // Without include_usage, no event mentions usage at all.
    let plain = r#"{"model":"m","messages":[],"stream":true}"#;
    let answer = post(&stub, "/v1/chat/completions", &[], plain).await;
    let events = events_of(&answer.body);
    assert_eq!(events.len(), 6, "{events:?}");
    assert!(events.iter().all(|e| e.get("usage").is_none()));
    assert_eq!(stub.exchanges()[1].usage, None);
}

#[tokio::test]
async fn gzip_when_accepted_one_flushed_piece_per_event() {
    let stub = start().await;
    let gzip = [("accept-encoding", "gzip, deflate")];
    let answer = post(&stub, "/v1/chat/completions", &gzip, STREAM).await;
    assert_eq!(answer.header("content-encoding"), Some("gzip"));
    let exchange = &stub.exchanges()[0];
    assert_eq!(exchange.content_encoding.as_deref(), Some("gzip"));
    assert_eq!(exchange.sent, answer.body);
    assert_eq!(gunzip(&answer.body), exchange.answer);
    // Each event is decodable as it arrives: the pieces before the last hold whole events.
    let events_in_answer = events_of(&exchange.answer).len();
    assert_eq!(answer.pieces.len(), events_in_answer);
    let mut decoder = flate2::write::GzDecoder::new(Vec::new());
    decoder.write_all(&answer.pieces[0]).unwrap();
    decoder.flush().unwrap();
    let first = String::from_utf8(decoder.get_ref().clone()).unwrap();
    assert!(
        first.starts_with("data: {") && first.ends_with("\n\n"),
        "{first}"
    );

    let json_answer = post(&stub, "/v1/chat/completions", &gzip, CHAT).await;
    assert_eq!(json_answer.header("content-encoding"), Some("gzip"));
    let document: Value = serde_json::from_slice(&gunzip(&json_answer.body)).unwrap();
    assert_eq!(document["usage"]["completion_tokens"], 7);

    // q=0 refuses gzip.
    let refused = [("accept-encoding", "gzip;q=0, identity")];
    let answer = post(&stub, "/v1/chat/completions", &refused, CHAT).await;
    assert_eq!(answer.header("content-encoding"), None);
    serde_json::from_slice::<Value>(&answer.body).unwrap();
}

#[tokio::test]
async fn a_cut_stream_ends_after_the_events_asked_for() {
    let stub = start().await;
    let headers = [("x-stub-cut-after", "2")];
    let answer = post(&stub, "/v1/chat/completions", &headers, STREAM).await;
    assert_eq!(answer.status, 200);
    assert!(!answer.complete, "no last chunk after a cut");
    assert_eq!(events_of(&answer.body).len(), 2);
    let exchange = &stub.exchanges()[0];
    assert!(exchange.cut);
    assert_eq!(exchange.usage, None);
    assert_eq!(exchange.sent, answer.body);

    // Cut just before [DONE]: the usage chunk went out, and counts.
    let headers = [("x-stub-cut-after", "6"), ("accept-encoding", "gzip")];
    let answer = post(&stub, "/v1/chat/completions", &headers, STREAM).await;
    assert!(!answer.complete);
    let exchange = &stub.exchanges()[1];
    assert_eq!(exchange.sent, answer.body);
    assert!(exchange.usage.is_some());

    // A JSON answer cut after 10 of its bytes, under a Content-Length of all of them.
    let headers = [("x-stub-cut-after", "10")];
    let answer = post(&stub, "/v1/chat/completions", &headers, CHAT).await;
    assert!(!answer.complete);
    assert_eq!(answer.body.len(), 10);
    assert_eq!(
        answer.header("content-length"),
        Some(stub.exchanges()[2].answer.len().to_string().as_str())
    );
    assert_eq!(stub.exchanges()[2].usage, None);

    // Past the end is a mistake in the test, said so.
    let headers = [("x-stub-cut-after", "8")];
    let answer = post(&stub, "/v1/chat/completions", &headers, STREAM).await;
    assert_eq!(answer.status, 400);
    let text = String::from_utf8(answer.body).unwrap();
    assert!(text.contains("x-stub-cut-after"), "{text}");
}

#[tokio::test]
async fn errors_have_openais_body() {
    let stub = start().await;
    let headers = [("x-stub-status", "429"), ("x-stub-retry-after", "3")];
    let answer = post(&stub, "/v1/chat/completions", &headers, CHAT).await;
    assert_eq!(answer.status, 429);
    assert_eq!(answer.header("retry-after"), Some("3"));
    let document: Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(document["error"]["code"], "rate_limit_exceeded");

    let answer = post(
        &stub,
        "/v1/chat/completions",
        &[("x-stub-status", "500")],
        CHAT,
    )
    .await;
    assert_eq!(answer.status, 500);
    let document: Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(document["error"]["type"], "server_error");
    assert!(stub.exchanges().iter().all(|e| e.usage.is_none()));

    for (name, value) in [
        ("x-stub-status", "200"),
        ("x-stub-chunks", "0"),
        ("x-stub-prompt-tokens", "-1"),
    ] {
        let answer = post(&stub, "/v1/chat/completions", &[(name, value)], CHAT).await;
        assert_eq!(answer.status, 400, "{name}: {value}");
    }
    let answer = post(&stub, "/v1/chat/completions", &[], "{not json").await;
    assert_eq!(answer.status, 400);
    let answer = post(&stub, "/v1/nothing", &[], CHAT).await;
    assert_eq!(answer.status, 404);
    assert_eq!(stub.exchanges().len(), 7);
}

#[tokio::test]
async fn held_answers_wait_for_release() {
    let stub = start().await;
    stub.hold();
    let pending = tokio::spawn({
        let stub = stub.clone();
        async move { post(&stub, "/v1/chat/completions", &[], CHAT).await }
    });
    let deadline = tokio::time::Instant::now() + IO_TIMEOUT;
    while stub.held() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Recorded before it is sent, so a test can see what is in flight.
    assert_eq!(stub.exchanges().len(), 1);
    assert!(!pending.is_finished());
    stub.release();
    let answer = timeout(IO_TIMEOUT, pending).await.unwrap().unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(stub.held(), 0);
}

/// The CI venv's Python with the openai SDK; unset: a failure under `CI=true`, else a skip.
fn test_python() -> Option<String> {
    match std::env::var("SLUICE_TEST_PYTHON") {
        Ok(python) if !python.is_empty() => Some(python),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but SLUICE_TEST_PYTHON is unset")
        }
        _ => {
            eprintln!("SKIPPED: SLUICE_TEST_PYTHON is unset");
            None
        }
    }
}

/// Runs tests/python/openai_chat.py against `base_url` with `spec`, off the runtime.
async fn sdk(python: &str, base_url: String, spec: Value) -> Value {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/openai_chat.py"
    );
    let python = python.to_string();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args([script, &base_url, &spec.to_string()])
            .env("NO_PROXY", "*")
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

fn unhex(value: &Value) -> Vec<u8> {
    hex::decode(value.as_str().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_reads_the_stubs_usage() {
    let Some(python) = test_python() else {
        return;
    };
    let stub = start().await;
    let base = format!("http://{}/v1", stub.local_addr());

    let out = sdk(&python, base.clone(), json!({"max_tokens": 21})).await;
    assert_eq!(out["error"], Value::Null, "{out}");
    assert_eq!(out["usage"]["completion_tokens"], 21);
    assert_eq!(out["content"], "Hello 1 2");
    // The SDK asks for gzip of its own accord, and reads it.
    assert_eq!(out["headers"]["content-encoding"], "gzip");
    let exchange = &stub.exchanges()[0];
    assert_eq!(unhex(&out["raw"]), exchange.sent);
    assert_eq!(unhex(&out["request_body"]), exchange.body);
    let usage = exchange.usage.unwrap();
    assert_eq!(out["usage"]["prompt_tokens"], usage.prompt_tokens);
    assert_eq!(out["usage"]["total_tokens"], usage.total_tokens());

    let spec = json!({"stream": true, "include_usage": true, "headers": {"x-stub-completion-tokens": "99"}});
    let out = sdk(&python, base.clone(), spec).await;
    assert_eq!(out["error"], Value::Null, "{out}");
    assert_eq!(out["usage"]["completion_tokens"], 99);
    assert_eq!(out["content"], "Hello 1 2");
    // Role, three content chunks, finish, usage.
    assert_eq!(out["chunks"], 6);
    assert_eq!(unhex(&out["raw"]), stub.exchanges()[1].sent);

    let spec = json!({"stream": true, "headers": {"accept-encoding": "identity"}});
    let out = sdk(&python, base.clone(), spec).await;
    assert_eq!(out["error"], Value::Null, "{out}");
    assert_eq!(out["usage"], Value::Null);
    assert_eq!(out["headers"].get("content-encoding"), None);
    assert_eq!(unhex(&out["raw"]), stub.exchanges()[2].answer);

    // A cut stream is an error to the SDK, after the events that arrived.
    let spec = json!({"stream": true, "include_usage": true, "headers": {"x-stub-cut-after": "3"}});
    let out = sdk(&python, base.clone(), spec).await;
    assert_ne!(out["error"], Value::Null, "{out}");
    assert_eq!(out["chunks"], 3);
    assert_eq!(out["usage"], Value::Null);

    let spec = json!({"headers": {"x-stub-status": "429"}});
    let out = sdk(&python, base, spec).await;
    assert_eq!(out["error"]["class"], "RateLimitError", "{out}");
}

/// Reads from `stream` into `raw` until `done(raw)`.
async fn read_until(stream: &mut TcpStream, raw: &mut Vec<u8>, done: impl Fn(&[u8]) -> bool) {
    let mut chunk = [0u8; 4096];
    while !done(raw) {
        let n = timeout(IO_TIMEOUT, stream.read(&mut chunk))
            .await
            .expect("read timed out")
            .expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(raw));
        raw.extend_from_slice(&chunk[..n]);
    }
}

fn count(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}

#[tokio::test]
async fn an_answer_held_mid_stream_waits_for_release() {
    let stub = start().await;
    stub.hold();
    let mut stream = TcpStream::connect(stub.local_addr()).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: stub\r\nConnection: close\r\nx-stub-hold-after: 2\r\nContent-Length: {}\r\n\r\n{STREAM}",
        STREAM.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    read_until(&mut stream, &mut raw, |raw| count(raw, b"data: ") == 2).await;
    assert_eq!(stub.held(), 1);
    // Two events are out and the stub waits before the third, so none follows yet.
    assert_eq!(count(&raw, b"data: "), 2);
    stub.release();
    timeout(IO_TIMEOUT, stream.read_to_end(&mut raw))
        .await
        .unwrap()
        .unwrap();
    let answer = parse(&raw);
    assert!(answer.complete);
    assert_eq!(answer.body, stub.exchanges()[0].answer);
    assert_eq!(stub.held(), 0);

    // A JSON answer held after 5 of its bytes; without hold(), hold-after does nothing.
    stub.hold();
    let mut stream = TcpStream::connect(stub.local_addr()).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: stub\r\nConnection: close\r\nx-stub-hold-after: 5\r\nContent-Length: {}\r\n\r\n{CHAT}",
        CHAT.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    read_until(&mut stream, &mut raw, |raw| {
        raw.ends_with(b"\r\n\r\n{\"cho")
    })
    .await;
    assert_eq!(stub.held(), 1);
    stub.release();
    timeout(IO_TIMEOUT, stream.read_to_end(&mut raw))
        .await
        .unwrap()
        .unwrap();
    assert!(parse(&raw).complete);
    let answer = post(
        &stub,
        "/v1/chat/completions",
        &[("x-stub-hold-after", "5")],
        CHAT,
    )
    .await;
    assert!(answer.complete);
    let answer = post(
        &stub,
        "/v1/chat/completions",
        &[("x-stub-hold-after", "100000")],
        CHAT,
    )
    .await;
    assert_eq!(answer.status, 400);
}

/// `(event name, data)` of each event of an Anthropic stream.
fn named_events(body: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("\n\n"), "{text}");
    text.split_terminator("\n\n")
        .map(|event| {
            let (name, data) = event.split_once('\n').expect("two lines");
            let name = name.strip_prefix("event: ").expect("an event line");
            let data = data.strip_prefix("data: ").expect("a data line");
            (name.to_string(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

const MESSAGES: &str =
    r#"{"model":"claude-test","max_tokens":40,"messages":[{"role":"user","content":"hi"}]}"#;

#[tokio::test]
async fn anthropic_messages_report_input_and_output_tokens() {
    let stub = start().await;
    let headers = [("x-stub-prompt-tokens", "25")];
    let answer = post(&stub, "/v1/messages", &headers, MESSAGES).await;
    assert_eq!(answer.status, 200);
    let document: Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(document["type"], "message");
    assert_eq!(document["content"][0]["text"], "Hello 1 2");
    assert_eq!(
        document["usage"],
        json!({"input_tokens": 25, "output_tokens": 40})
    );

    let stream = MESSAGES.replace("\"max_tokens\"", "\"stream\":true,\"max_tokens\"");
    let answer = post(&stub, "/v1/messages", &headers, &stream).await;
    assert!(answer.complete);
    let events = named_events(&answer.body);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str());
    }
    assert_eq!(events[0].1["message"]["usage"]["input_tokens"], 25);
    assert_eq!(events[7].1["usage"]["output_tokens"], 40);
    let exchange = &stub.exchanges()[1];
    assert_eq!(
        exchange.usage,
        Some(Usage {
            prompt_tokens: 25,
            completion_tokens: 40
        })
    );
    assert_eq!(exchange.sent, answer.body);

    // Cut before message_delta: the output tokens never came.
    let cut = [("x-stub-cut-after", "7")];
    post(&stub, "/v1/messages", &cut, &stream).await;
    assert_eq!(stub.exchanges()[2].usage, None);

    let answer = post(&stub, "/v1/messages", &[("x-stub-status", "529")], MESSAGES).await;
    assert_eq!(answer.status, 529);
    let document: Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(document["type"], "error");
    assert_eq!(document["error"]["type"], "overloaded_error");
}
