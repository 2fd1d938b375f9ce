//! An OpenAI-compatible stub: the member that usage-metered routes are tested against.
//!
//! [`OpenAiStub`] answers `POST /v1/chat/completions` the way the OpenAI API does, with a
//! `usage` the test chooses, so that a test can tell what sluice should have settled:
//!
//! * **JSON** (`"stream"` absent or false): a `chat.completion` with `usage`, and the total
//!   also in an `x-usage-total-tokens` header (a provider that reports usage in a header).
//! * **Server-Sent Events** (`"stream": true`): a role chunk, `x-stub-chunks` content chunks, a
//!   finish chunk, and `data: [DONE]`. With `"stream_options": {"include_usage": true}` every
//!   chunk carries `"usage": null` and one more chunk before `[DONE]` carries the usage, as
//!   OpenAI sends it; without it the stream holds no usage at all.
//! * **gzip** when the request accepts it (the openai SDK always does), for JSON and streams
//!   alike; each event is flushed, so a client decodes it as it arrives. Send
//!   `Accept-Encoding: identity` for plain bytes.
//! * `POST /v1/messages` answers as Anthropic's Messages API does, with the same knobs: a
//!   `message` with `usage.input_tokens` and `usage.output_tokens`, or a stream whose
//!   `message_start` event holds the input tokens and whose `message_delta` event, near the
//!   end, holds the output tokens; its errors have Anthropic's `{"type": "error", ...}` body.
//!   [`Usage`] then means input and output tokens.
//! * `GET /v1/models` lists one model, `GET /healthz` answers `ok` (and is not recorded), and
//!   anything else is a 404 with an OpenAI error body.
//!
//! The answer is set by request headers, which the SDK sends with `extra_headers`:
//!
//! | header | effect |
//! |---|---|
//! | `x-stub-prompt-tokens: N` | `usage.prompt_tokens` (default: the request body's length / 4, rounded up) |
//! | `x-stub-completion-tokens: N` | `usage.completion_tokens` (default: the request's `max_completion_tokens`, else `max_tokens`, else 16) |
//! | `x-stub-chunks: N` | content chunks in a stream, 1 to [`MAX_CHUNKS`] (default 3) |
//! | `x-stub-status: NNN` | an error answer, 400 to 599, with OpenAI's `{"error": {...}}` body (429: `rate_limit_exceeded`) |
//! | `x-stub-retry-after: V` | a `Retry-After: V` on that error answer |
//! | `x-stub-cut-after: N` | the connection is cut after N events of a stream, or N bytes of a JSON body as sent (N must be less than there are) |
//! | `x-stub-hold-after: N` | while the stub holds, the answer stops after N events or bytes (0: right after its head) instead of before its head |
//!
//! A bad value in one of them is a 400 that says which. Every answer carries `x-upstream` (the
//! stub's name) and `x-request-id`; the bytes of an answer depend only on the request, so a
//! test can compare what a client received with [`Exchange::sent`].
//!
//! The stub records every exchange ([`OpenAiStub::exchanges`]): the request as it arrived
//! (headers and whole body) and the answer as it was sent. [`OpenAiStub::hold`] keeps answers
//! back, before their head or in the middle, so that a test can look at a gateway while
//! requests are in flight.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use flate2::write::GzEncoder;
use flate2::Compression;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderName, HeaderValue};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// The most content chunks a stream may be asked for.
pub const MAX_CHUNKS: u64 = 1000;

/// The largest request body the stub reads; a larger one gets a 413. Tests send far less.
const MAX_REQUEST_BODY: usize = 16 * 1024 * 1024;

/// Upper bound for a request head, as for the echo server.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// The `created` of every answer: fixed, so that the bytes depend only on the request.
const CREATED: u64 = 1_700_000_000;

/// The model named when the request names none.
const DEFAULT_MODEL: &str = "gpt-4o-mini";

/// Tokens a chat completion uses, as the answer reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Usage {
    /// `prompt_tokens + completion_tokens`, saturating.
    pub fn total_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// One request and the answer the stub gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    pub method: String,
    /// The request-target as it appeared on the request line.
    pub target: String,
    /// Header fields in arrival order, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The whole request body.
    pub body: Vec<u8>,
    pub status: u16,
    /// Whether the answer is a stream of Server-Sent Events.
    pub stream: bool,
    /// The usage the answer reports, as far as it was sent: `None` for an error, a stream
    /// without usage, or an answer cut before its usage.
    pub usage: Option<Usage>,
    /// `Some("gzip")` when the answer was compressed.
    pub content_encoding: Option<String>,
    /// The whole answer body the stub meant to send, before compression.
    pub answer: Vec<u8>,
    /// The body bytes as they went on the wire (compressed when `content_encoding` is set),
    /// up to the cut when there was one.
    pub sent: Vec<u8>,
    /// Whether the connection was cut before the answer was complete.
    pub cut: bool,
}

impl Exchange {
    /// The first value of request header `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Handle to a running stub. Clones control the same stub; it runs until [`OpenAiStub::stop`]
/// or until its runtime shuts down.
#[derive(Clone, Debug)]
pub struct OpenAiStub {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    name: String,
    local_addr: SocketAddr,
    next_id: AtomicU64,
    exchanges: Mutex<Vec<Exchange>>,
    /// `true` while answers are held back.
    hold: watch::Sender<bool>,
    /// Answers waiting for [`OpenAiStub::release`].
    held: Arc<AtomicUsize>,
    acceptor: tokio::sync::Mutex<Option<(oneshot::Sender<()>, JoinHandle<()>)>>,
}

impl OpenAiStub {
    /// Binds `addr` (port 0 for a free port) and serves in the current tokio runtime. `name`
    /// is sent back in `x-upstream`, so it must hold no control characters.
    pub async fn start(name: &str, addr: SocketAddr) -> io::Result<OpenAiStub> {
        if HeaderValue::from_str(name).is_err() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the stub's name must be a valid header value",
            ));
        }
        let listener = TcpListener::bind(addr).await?;
        let (shutdown, shutdown_rx) = oneshot::channel();
        let shared = Arc::new(Shared {
            name: name.to_string(),
            local_addr: listener.local_addr()?,
            next_id: AtomicU64::new(1),
            exchanges: Mutex::new(Vec::new()),
            hold: watch::channel(false).0,
            held: Arc::new(AtomicUsize::new(0)),
            acceptor: tokio::sync::Mutex::new(None),
        });
        let task = tokio::spawn(accept_loop(shared.clone(), listener, shutdown_rx));
        *shared.acceptor.lock().await = Some((shutdown, task));
        Ok(OpenAiStub { shared })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Every exchange so far but `/healthz` probes, in the order the answers were decided. An
    /// exchange is recorded once the request is read and before its answer is sent (or held).
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.shared.exchanges().clone()
    }

    /// Answers decided from now on wait until [`OpenAiStub::release`]: before their head, or
    /// where their `x-stub-hold-after` says.
    pub fn hold(&self) {
        self.shared.hold.send_replace(true);
    }

    /// Sends every held answer, and stops holding.
    pub fn release(&self) {
        self.shared.hold.send_replace(false);
    }

    /// How many answers are being held now.
    pub fn held(&self) -> usize {
        self.shared.held.load(Ordering::SeqCst)
    }

    /// Closes the listener; open connections keep being served. Calling it again is a no-op.
    pub async fn stop(&self) {
        if let Some((shutdown, task)) = self.shared.acceptor.lock().await.take() {
            let _ = shutdown.send(());
            let _ = task.await;
        }
    }
}

async fn accept_loop(
    shared: Arc<Shared>,
    listener: TcpListener,
    mut shutdown: oneshot::Receiver<()>,
) {
    loop {
        tokio::select! {
            biased;
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(serve_connection(shared.clone(), stream));
                }
                // EMFILE and the like: back off instead of spinning on the error.
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            },
        }
    }
}

async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let cut = Arc::new(AtomicBool::new(false));
    let io = CutIo {
        inner: stream,
        cut: cut.clone(),
    };
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let shared = shared.clone();
        let cut = cut.clone();
        async move { Ok::<_, Infallible>(shared.answer(request, cut).await) }
    });
    // A cut ends the connection with an error, by design: nothing to report.
    let _ = hyper::server::conn::http1::Builder::new()
        .max_buf_size(MAX_HEAD_BYTES)
        .serve_connection(TokioIo::new(io), service)
        .await;
}

/// The request as the stub reads it.
struct Seen {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.trim())
    }

    fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or_default()
    }

    /// Whether the request accepts gzip: a `gzip` coding whose `q` is not zero.
    fn accepts_gzip(&self) -> bool {
        self.headers
            .iter()
            .filter(|(n, _)| n == "accept-encoding")
            .flat_map(|(_, v)| v.split(','))
            .any(|item| {
                let mut parts = item.split(';').map(str::trim);
                let coding = parts.next().unwrap_or_default();
                let refused = parts.any(|p| {
                    p.strip_prefix("q=")
                        .and_then(|q| q.parse::<f32>().ok())
                        .is_some_and(|q| q <= 0.0)
                });
                coding.eq_ignore_ascii_case("gzip") && !refused
            })
    }
}

/// What to send: the plain segments of the body (one per event, or the whole JSON), and how.
struct Plan {
    status: u16,
    content_type: &'static str,
    headers: Vec<(&'static str, String)>,
    segments: Vec<Vec<u8>>,
    stream: bool,
    /// The usage and the index of the segment that first reports it.
    usage: Option<(Usage, usize)>,
    /// Events (stream) or bytes as sent (JSON) before the cut.
    cut_after: Option<usize>,
    /// Events or bytes as sent before a held answer waits.
    hold_after: Option<usize>,
}

impl Plan {
    fn error(status: u16, kind: &str, code: Option<&str>, message: &str) -> Plan {
        let document = json!({
            "error": { "message": message, "type": kind, "param": null, "code": code }
        });
        Plan::json(status, &document)
    }

    fn bad_header(name: &str) -> Plan {
        Plan::error(
            400,
            "invalid_request_error",
            None,
            &format!("stub: invalid {name} header"),
        )
    }

    fn json(status: u16, document: &Value) -> Plan {
        let mut body = document.to_string().into_bytes();
        body.push(b'\n');
        Plan {
            status,
            content_type: "application/json",
            headers: Vec::new(),
            segments: vec![body],
            stream: false,
            usage: None,
            cut_after: None,
            hold_after: None,
        }
    }
}

impl Shared {
    fn exchanges(&self) -> std::sync::MutexGuard<'_, Vec<Exchange>> {
        // A test double keeps serving after a panic elsewhere; the log stays readable.
        self.exchanges.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn answer(
        &self,
        request: hyper::Request<Incoming>,
        cut: Arc<AtomicBool>,
    ) -> hyper::Response<StubBody> {
        let (parts, body) = request.into_parts();
        let headers = parts
            .headers
            .iter()
            .map(|(n, v)| {
                let value = String::from_utf8_lossy(v.as_bytes()).into_owned();
                (n.as_str().to_string(), value)
            })
            .collect();
        let body = Limited::new(body, MAX_REQUEST_BODY).collect().await;
        let (body, too_large) = match body {
            Ok(collected) => (collected.to_bytes().to_vec(), false),
            Err(_) => (Vec::new(), true),
        };
        let seen = Seen {
            method: parts.method.to_string(),
            target: parts.uri.to_string(),
            headers,
            body,
        };
        if seen.path() == "/healthz" {
            let ok = Plan {
                content_type: "text/plain",
                segments: vec![b"ok".to_vec()],
                ..Plan::json(200, &Value::Null)
            };
            return self.send(ok, &seen, false, cut, false).await;
        }
        let plan = if too_large {
            Plan::error(
                413,
                "invalid_request_error",
                None,
                "stub: request body too large",
            )
        } else {
            route(&seen)
        };
        let gzip = seen.accepts_gzip();
        self.send(plan, &seen, gzip, cut, true).await
    }

    /// Encodes `plan`, records the exchange, waits while answers are held, and answers.
    async fn send(
        &self,
        mut plan: Plan,
        seen: &Seen,
        gzip: bool,
        cut: Arc<AtomicBool>,
        record: bool,
    ) -> hyper::Response<StubBody> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let mut chunks = encode(&plan.segments, gzip);
        // Where to cut or hold is counted in what goes on the wire: a point past its end is a
        // mistake in the test, and said so.
        let room = if plan.stream {
            chunks.len()
        } else {
            chunks.iter().map(Bytes::len).sum()
        };
        for (at, name) in [
            (plan.cut_after, "x-stub-cut-after"),
            (plan.hold_after, "x-stub-hold-after"),
        ] {
            if at.is_some_and(|at| at >= room) {
                plan = Plan::bad_header(name);
                chunks = encode(&plan.segments, gzip);
            }
        }
        let answer = plan.segments.concat();
        let full_len: usize = chunks.iter().map(Bytes::len).sum();
        let mut usage = plan.usage.map(|(usage, _)| usage);
        let mut was_cut = false;
        if let Some(n) = plan.cut_after {
            was_cut = true;
            if plan.stream {
                chunks.truncate(n);
                if plan.usage.is_some_and(|(_, at)| at >= n) {
                    usage = None;
                }
            } else {
                let mut wire = chunks.concat();
                wire.truncate(n);
                chunks = vec![Bytes::from(wire)];
                usage = None;
            }
        }
        if record {
            self.exchanges().push(Exchange {
                method: seen.method.clone(),
                target: seen.target.clone(),
                headers: seen.headers.clone(),
                body: seen.body.clone(),
                status: plan.status,
                stream: plan.stream,
                usage,
                content_encoding: gzip.then(|| "gzip".to_string()),
                answer,
                sent: chunks.concat(),
                cut: was_cut,
            });
        }
        let mut hold_after = plan.hold_after;
        if hold_after.is_none() {
            wait_while_held(self.hold.subscribe(), self.held.clone()).await;
        } else if let (false, Some(at)) = (plan.stream, hold_after) {
            // One chunk of a JSON answer, split where it is to wait.
            let wire = chunks.concat();
            if at > 0 && at < wire.len() {
                chunks = vec![
                    Bytes::copy_from_slice(&wire[..at]),
                    Bytes::copy_from_slice(&wire[at..]),
                ];
                hold_after = Some(1);
            } else if at > 0 {
                hold_after = Some(chunks.len());
            }
        }

        plan.headers.push(("x-upstream", self.name.clone()));
        plan.headers
            .push(("x-request-id", format!("req_stub_{id}")));
        if gzip {
            plan.headers.push(("content-encoding", "gzip".to_string()));
        }
        let body = StubBody {
            chunks: chunks.into(),
            // A JSON answer has a Content-Length, cut or not, as a real one would.
            length: (!plan.stream).then_some(full_len as u64),
            cut: was_cut.then_some(cut),
            armed: false,
            given: 0,
            hold_after,
            hold: self.hold.subscribe(),
            held: self.held.clone(),
            waiting: None,
        };
        let mut response = hyper::Response::new(body);
        *response.status_mut() =
            hyper::StatusCode::from_u16(plan.status).unwrap_or(hyper::StatusCode::OK);
        let headers = response.headers_mut();
        headers.insert(
            hyper::header::CONTENT_TYPE,
            HeaderValue::from_static(plan.content_type),
        );
        for (name, value) in plan.headers {
            // Values come from the stub itself or from request fields hyper accepted; one that
            // still fails is left out rather than a panic.
            if let Ok(value) = HeaderValue::from_str(&value) {
                headers.append(HeaderName::from_static(name), value);
            }
        }
        response
    }
}

/// Returns at once unless the stub holds; else counts itself held until released.
async fn wait_while_held(mut hold: watch::Receiver<bool>, held: Arc<AtomicUsize>) {
    if !*hold.borrow_and_update() {
        return;
    }
    held.fetch_add(1, Ordering::SeqCst);
    // Ends on release, or when the stub is gone (the sender dropped).
    let _ = hold.wait_for(|held| !held).await;
    held.fetch_sub(1, Ordering::SeqCst);
}

/// The plan for a request other than `/healthz`.
fn route(seen: &Seen) -> Plan {
    match (seen.method.as_str(), seen.path()) {
        ("POST", "/v1/chat/completions") => chat(seen, Flavor::OpenAi),
        ("POST", "/v1/messages") => chat(seen, Flavor::Anthropic),
        ("GET", "/v1/models") => Plan::json(
            200,
            &json!({
                "object": "list",
                "data": [{ "id": DEFAULT_MODEL, "object": "model", "created": CREATED, "owned_by": "stub" }]
            }),
        ),
        _ => Plan::error(
            404,
            "invalid_request_error",
            Some("unknown_url"),
            &format!("stub: unknown URL {} {}", seen.method, seen.path()),
        ),
    }
}

/// A number in request header `name`, `Ok(None)` without one.
fn number_header(seen: &Seen, name: &'static str) -> Result<Option<u64>, Box<Plan>> {
    match seen.header(name) {
        None => Ok(None),
        Some(value) => value
            .parse::<u64>()
            .map(Some)
            .map_err(|_| Box::new(Plan::bad_header(name))),
    }
}

/// Whose API a completion answers as.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavor {
    OpenAi,
    Anthropic,
}

impl Flavor {
    /// An error answer with this API's body.
    fn error(self, status: u16, message: &str) -> Plan {
        match self {
            Flavor::OpenAi => match status {
                429 => Plan::error(429, "requests", Some("rate_limit_exceeded"), message),
                500..=599 => Plan::error(status, "server_error", None, message),
                _ => Plan::error(status, "invalid_request_error", None, message),
            },
            Flavor::Anthropic => {
                let kind = match status {
                    429 => "rate_limit_error",
                    529 => "overloaded_error",
                    500..=599 => "api_error",
                    _ => "invalid_request_error",
                };
                Plan::json(
                    status,
                    &json!({ "type": "error", "error": { "type": kind, "message": message } }),
                )
            }
        }
    }
}

fn chat(seen: &Seen, flavor: Flavor) -> Plan {
    match chat_plan(seen, flavor) {
        Ok(plan) => plan,
        Err(plan) => *plan,
    }
}

fn chat_plan(seen: &Seen, flavor: Flavor) -> Result<Plan, Box<Plan>> {
    if let Some(status) = seen.header("x-stub-status") {
        let status = status
            .parse::<u16>()
            .ok()
            .filter(|s| (400..=599).contains(s))
            .ok_or_else(|| Box::new(Plan::bad_header("x-stub-status")))?;
        let message = match status {
            429 => "stub: Rate limit reached for requests",
            500..=599 => "stub: The server had an error while processing your request.",
            _ => "stub: scripted error",
        };
        let mut plan = flavor.error(status, message);
        if let Some(retry_after) = seen.header("x-stub-retry-after") {
            if HeaderValue::from_str(retry_after).is_err() || retry_after.is_empty() {
                return Err(Box::new(Plan::bad_header("x-stub-retry-after")));
            }
            plan.headers.push(("retry-after", retry_after.to_string()));
        }
        return Ok(plan);
    }

    let request: Value = match serde_json::from_slice(&seen.body) {
        Ok(value @ Value::Object(_)) => value,
        _ => {
            return Err(Box::new(
                flavor.error(400, "stub: the body is not a JSON object"),
            ))
        }
    };
    let prompt_tokens = number_header(seen, "x-stub-prompt-tokens")?
        .unwrap_or_else(|| (seen.body.len() as u64).div_ceil(4));
    let completion_tokens = number_header(seen, "x-stub-completion-tokens")?
        .or_else(|| request["max_completion_tokens"].as_u64())
        .or_else(|| request["max_tokens"].as_u64())
        .unwrap_or(16);
    let usage = Usage {
        prompt_tokens,
        completion_tokens,
    };
    let chunks = number_header(seen, "x-stub-chunks")?.unwrap_or(3);
    if !(1..=MAX_CHUNKS).contains(&chunks) {
        return Err(Box::new(Plan::bad_header("x-stub-chunks")));
    }
    let cut_after = number_header(seen, "x-stub-cut-after")?;
    let hold_after = number_header(seen, "x-stub-hold-after")?;
    let model = request["model"].as_str().unwrap_or(DEFAULT_MODEL);
    // From the request alone, like every byte of the answer.
    let id = match flavor {
        Flavor::OpenAi => format!("chatcmpl-stub-{}", seen.body.len()),
        Flavor::Anthropic => format!("msg_stub_{}", seen.body.len()),
    };
    let words: Vec<String> = (0..chunks)
        .map(|i| {
            if i == 0 {
                "Hello".to_string()
            } else {
                format!(" {i}")
            }
        })
        .collect();

    let stream = request["stream"] == Value::Bool(true);
    let mut plan = if stream && flavor == Flavor::Anthropic {
        anthropic_stream_plan(&id, model, &words, usage)
    } else if stream {
        let include_usage = request["stream_options"]["include_usage"] == Value::Bool(true);
        stream_plan(&id, model, &words, usage, include_usage)
    } else {
        let document = match flavor {
            Flavor::OpenAi => completion(&id, model, &words.concat(), usage),
            Flavor::Anthropic => anthropic_message(&id, model, &words.concat(), usage),
        };
        let mut plan = Plan::json(200, &document);
        plan.usage = Some((usage, 0));
        plan.headers
            .push(("x-usage-total-tokens", usage.total_tokens().to_string()));
        plan
    };
    // Checked against what goes on the wire when it is encoded; usize::MAX is past any end.
    let point = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    plan.cut_after = cut_after.map(point);
    plan.hold_after = hold_after.map(point);
    Ok(plan)
}

fn completion(id: &str, model: &str, content: &str, usage: Usage) -> Value {
    json!({
        "id": id,
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "system_fingerprint": "fp_stub",
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": content, "refusal": null },
            "logprobs": null,
            "finish_reason": "stop"
        }],
        "usage": usage_json(usage)
    })
}

fn anthropic_message(id: &str, model: &str, text: &str, usage: Usage) -> Value {
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{ "type": "text", "text": text }],
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": { "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens }
    })
}

/// Anthropic's events: `message_start` (input tokens, and 1 output token so far), a text block
/// with `words`, a `ping` among them, `message_delta` (all output tokens), `message_stop`.
fn anthropic_stream_plan(id: &str, model: &str, words: &[String], usage: Usage) -> Plan {
    let mut events = vec![
        (
            "message_start",
            json!({ "type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "content": [], "model": model,
                "stop_reason": null, "stop_sequence": null,
                "usage": { "input_tokens": usage.prompt_tokens, "output_tokens": 1 }
            }}),
        ),
        (
            "content_block_start",
            json!({ "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" } }),
        ),
        ("ping", json!({ "type": "ping" })),
    ];
    events.extend(words.iter().map(|w| {
        (
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": w } }),
        )
    }));
    events.push((
        "content_block_stop",
        json!({ "type": "content_block_stop", "index": 0 }),
    ));
    let reported = Some((usage, events.len()));
    events.push((
        "message_delta",
        json!({ "type": "message_delta", "delta": { "stop_reason": "end_turn", "stop_sequence": null },
                "usage": { "output_tokens": usage.completion_tokens } }),
    ));
    events.push(("message_stop", json!({ "type": "message_stop" })));
    Plan {
        status: 200,
        content_type: "text/event-stream; charset=utf-8",
        headers: Vec::new(),
        segments: events
            .iter()
            .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n").into_bytes())
            .collect(),
        stream: true,
        usage: reported,
        cut_after: None,
        hold_after: None,
    }
}

fn usage_json(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens(),
        "prompt_tokens_details": { "cached_tokens": 0, "audio_tokens": 0 },
        "completion_tokens_details": { "reasoning_tokens": 0, "audio_tokens": 0 }
    })
}

/// The events of a stream: role, content, finish, the usage chunk when asked for, `[DONE]`.
fn stream_plan(id: &str, model: &str, words: &[String], usage: Usage, include_usage: bool) -> Plan {
    let chunk = |delta: Value, finish: Option<&str>| {
        let mut chunk = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "system_fingerprint": "fp_stub",
            "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }]
        });
        if include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    };
    let mut events = vec![chunk(
        json!({ "role": "assistant", "content": "", "refusal": null }),
        None,
    )];
    events.extend(words.iter().map(|w| chunk(json!({ "content": w }), None)));
    events.push(chunk(json!({}), Some("stop")));
    let mut reported = None;
    if include_usage {
        let mut last = chunk(json!({}), None);
        last["choices"] = json!([]);
        last["usage"] = usage_json(usage);
        reported = Some((usage, events.len()));
        events.push(last);
    }
    let mut segments: Vec<Vec<u8>> = events
        .iter()
        .map(|event| format!("data: {event}\n\n").into_bytes())
        .collect();
    segments.push(b"data: [DONE]\n\n".to_vec());
    Plan {
        status: 200,
        content_type: "text/event-stream; charset=utf-8",
        headers: Vec::new(),
        segments,
        stream: true,
        usage: reported,
        cut_after: None,
        hold_after: None,
    }
}

/// The wire chunks of `segments`: as they are, or gzip with a flush after each segment, so
/// that a client can decode every event as it arrives. The gzip trailer ends the last chunk.
fn encode(segments: &[Vec<u8>], gzip: bool) -> Vec<Bytes> {
    if !gzip {
        return segments.iter().map(|s| Bytes::from(s.clone())).collect();
    }
    let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
    let mut chunks = Vec::with_capacity(segments.len());
    for (i, segment) in segments.iter().enumerate() {
        // Writing into a Vec cannot fail.
        let _ = encoder.write_all(segment);
        if i + 1 == segments.len() {
            let rest = std::mem::replace(
                &mut encoder,
                GzEncoder::new(Vec::new(), Compression::default()),
            );
            chunks.push(Bytes::from(rest.finish().unwrap_or_default()));
        } else {
            let _ = encoder.flush();
            chunks.push(Bytes::from(std::mem::take(encoder.get_mut())));
        }
    }
    chunks
}

/// An answer's body: its chunks one by one, then the end, or, for a cut answer, nothing more
/// until the connection is cut (see [`CutIo`]). A held answer waits after `hold_after` chunks.
struct StubBody {
    chunks: VecDeque<Bytes>,
    length: Option<u64>,
    cut: Option<Arc<AtomicBool>>,
    armed: bool,
    /// Chunks handed out so far.
    given: usize,
    hold_after: Option<usize>,
    hold: watch::Receiver<bool>,
    held: Arc<AtomicUsize>,
    waiting: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl Body for StubBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.hold_after == Some(self.given) {
            let (hold, held) = (self.hold.clone(), self.held.clone());
            let waiting = self
                .waiting
                .get_or_insert_with(|| Box::pin(wait_while_held(hold, held)));
            std::task::ready!(waiting.as_mut().poll(cx));
            self.waiting = None;
            self.hold_after = None;
        }
        if let Some(chunk) = self.chunks.pop_front() {
            self.given += 1;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        match self.cut.clone() {
            None => Poll::Ready(None),
            Some(cut) => {
                // Every chunk has been handed to hyper: the connection's next flush writes the
                // last of them, then cuts. Until then the body has nothing more, and no wake-up
                // is needed, since hyper flushes right after a pending body.
                if !self.armed {
                    self.armed = true;
                    cut.store(true, Ordering::SeqCst);
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty() && self.cut.is_none() && self.hold_after.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.length {
            Some(length) => SizeHint::with_exact(length),
            None => SizeHint::default(),
        }
    }
}

/// The connection's socket, which cuts the connection at the first flush after a cut answer
/// has handed over its last chunk: what was written reaches the client, then a FIN ends an
/// answer that is not complete. hyper writes a body's bytes in its flush, so a flush after the
/// body armed the cut has written all of them.
struct CutIo {
    inner: TcpStream,
    cut: Arc<AtomicBool>,
}

impl AsyncRead for CutIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CutIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
        if !self.cut.load(Ordering::SeqCst) {
            return Poll::Ready(Ok(()));
        }
        let _ = std::task::ready!(Pin::new(&mut self.inner).poll_shutdown(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "stub: answer cut",
        )))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
