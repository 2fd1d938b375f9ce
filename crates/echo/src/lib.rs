//! A tiny HTTP/1.1 server that answers with its own name.
//!
//! `sluice-echo` is the demo upstream for sluice and the backend used by its
//! tests. Every answer says which server produced it (the `x-upstream` header
//! and the `upstream` field of the JSON body), so a test can tell where the
//! gateway sent a request. hyper serves the HTTP/1.1 (framing, keep-alive, pipelining,
//! `Expect: 100-continue`); tests that need a member answering with broken framing run a raw
//! TCP member of their own.
//!
//! Besides echoing, a few knobs make failure scenarios easy to script:
//!
//! * `GET /healthz` answers `200 ok`, or `503 unhealthy` after
//!   [`EchoServer::set_healthy(false)`](EchoServer::set_healthy).
//! * An `x-delay-ms: N` request header delays the answer by N milliseconds.
//! * `/status/NNN` answers with status NNN.
//! * [`EchoServer::stop`] behaves like an instance leaving during a rolling
//!   deploy.
//! * An `x-force-429: VALUE` request header answers `429` with
//!   `Retry-After: VALUE` (a refusal a client such as curl can trigger).
//!
//! # A key-limited API stub
//!
//! [`EchoServer::start_with`] and [`EchoOptions`] make the server behave like
//! an API that limits each API key, which is what a pool of keys in front of
//! it has to cope with. A request's key is its `Authorization` value (none:
//! the empty key); `/healthz` is never counted or limited.
//!
//! * With [`EchoOptions::key_limit`] `Some((limit, window))`, each key has a
//!   sliding window at the server's own monotonic clock. A request past the
//!   limit gets `429` with `Retry-After` (whole seconds until the oldest
//!   counted request leaves the window, at least 1) and the JSON body
//!   `{"error":"rate_limited","key_hint":"<last 4 characters of the key>"}`.
//!   Refused requests are not counted in the window.
//! * With [`EchoOptions::ratelimit_headers`], answers of a key-limited server
//!   carry `RateLimit-Policy: "api";q=LIMIT;w=SECS` and
//!   `RateLimit: "api";r=REMAINING;t=SECS`.
//! * [`EchoServer::refuse_next`] scripts refusals for one key, whatever its
//!   window says; [`EchoServer::served`], [`EchoServer::refused`] and
//!   [`EchoServer::keys`] count per key, and with
//!   [`EchoOptions::log_requests`], [`EchoServer::request_log`] tells which
//!   body went to which key.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use std::time::Duration;
//! use sluice_echo::{EchoOptions, EchoServer};
//!
//! let options = EchoOptions::key_limited(5, Duration::from_secs(60));
//! let api = EchoServer::start_with("api", "127.0.0.1:0".parse().unwrap(), options).await?;
//! api.refuse_next("Bearer key-a", 1, "2")?;
//! // ... send requests through the gateway ...
//! assert_eq!(api.refused("Bearer key-a"), 1);
//! # Ok(())
//! # }
//! ```
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let server = sluice_echo::EchoServer::start("blue", "127.0.0.1:0".parse().unwrap()).await?;
//! println!("{} listens on {}", server.name(), server.local_addr());
//! server.stop().await;
//! # Ok(())
//! # }
//! ```
//!
//! # An OpenAI-compatible stub
//!
//! [`openai::OpenAiStub`] answers `POST /v1/chat/completions` as the OpenAI API does, and
//! `POST /v1/messages` as Anthropic's (JSON or Server-Sent Events, usage chosen by the test,
//! errors, gzip, a connection cut or held mid-stream), and records every exchange: the member
//! that usage-metered routes are tested against.

mod connection;
mod keys;
pub mod openai;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Mutex};
use tokio::task::JoinHandle;

use connection::{Request, Response};
use keys::{Decision, Keys, Quota, Scripted, POLICY};

pub use connection::MAX_KEPT_BODY;

/// How a server started with [`EchoServer::start_with`] behaves beyond echoing.
///
/// `EchoOptions::default()` is the plain echo server of [`EchoServer::start`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EchoOptions {
    /// `Some((limit, window))`: at most `limit` admitted requests per key in
    /// any `window`, at the server's own clock. Both must be non-zero.
    pub key_limit: Option<(u64, Duration)>,
    /// Send `RateLimit-Policy` and `RateLimit` fields on the answers of a
    /// key-limited server (ignored without `key_limit`).
    pub ratelimit_headers: bool,
    /// Keep a [`LoggedRequest`] for every request but `/healthz` probes, body
    /// hash included. Memory grows with every request: for tests.
    pub log_requests: bool,
}

impl EchoOptions {
    /// A key-limited API stub as tests want it: `limit` requests per key per
    /// `window`, its own RateLimit fields, and the request log.
    pub fn key_limited(limit: u64, window: Duration) -> EchoOptions {
        EchoOptions {
            key_limit: Some((limit, window)),
            ratelimit_headers: true,
            log_requests: true,
        }
    }

    /// Parses a key limit written `LIMIT/WINDOW`, as `sluice-echo --key-limit`
    /// takes it: `5/10s`, `100/1m`, `3/500ms`, `1000/1h`.
    pub fn parse_key_limit(text: &str) -> Result<(u64, Duration), String> {
        keys::parse_key_limit(text)
    }
}

/// One request as a server with [`EchoOptions::log_requests`] saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedRequest {
    /// The `Authorization` value, or "" without one.
    pub key: String,
    pub method: String,
    pub target: String,
    /// The status the server answered with.
    pub status: u16,
    pub body_len: u64,
    /// SHA-256 of the whole body, lowercase hex.
    pub body_sha256: String,
    /// The body's first [`MAX_KEPT_BODY`] bytes.
    pub body: Vec<u8>,
}

/// Handle to a running echo server.
///
/// Cloning is cheap and every clone controls the same server. The server runs
/// until [`EchoServer::stop`] is called or its tokio runtime shuts down;
/// dropping the handles does not stop it.
#[derive(Clone, Debug)]
pub struct EchoServer {
    shared: Arc<Shared>,
}

/// State shared between the handles, the accept loop and the connections.
#[derive(Debug)]
struct Shared {
    name: String,
    local_addr: SocketAddr,
    requests: AtomicU64,
    proxied_requests: AtomicU64,
    /// Requests (not `/healthz`) being answered now, and the most there ever were at once.
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
    healthy: AtomicBool,
    options: EchoOptions,
    /// Per-key windows, counters and scripted refusals. A std mutex: it is
    /// never held across an await.
    keys: std::sync::Mutex<Keys>,
    log: std::sync::Mutex<Vec<LoggedRequest>>,
    /// Set by `stop`; connections read it when answering to decide whether
    /// this is their last response.
    stopping: AtomicBool,
    /// Taken by the first `stop`. An async mutex so that a concurrent `stop`
    /// waits until the listener is really closed instead of returning early.
    acceptor: Mutex<Option<Acceptor>>,
}

/// The accept loop and the means to end it.
#[derive(Debug)]
struct Acceptor {
    shutdown: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl EchoServer {
    /// Binds `addr` (use port 0 for a free port) and serves in the current
    /// tokio runtime.
    ///
    /// Fails if the address cannot be bound, or if `name` contains control
    /// characters (it is sent back in a header).
    pub async fn start(name: &str, addr: SocketAddr) -> io::Result<EchoServer> {
        EchoServer::start_with(name, addr, EchoOptions::default()).await
    }

    /// Like [`EchoServer::start`], with the key-limited API behaviour that
    /// `options` asks for (see the [crate documentation](crate)).
    ///
    /// Also fails if `options.key_limit` has a zero limit or window.
    pub async fn start_with(
        name: &str,
        addr: SocketAddr,
        options: EchoOptions,
    ) -> io::Result<EchoServer> {
        if name.chars().any(char::is_control) {
            return Err(invalid_input(
                "server name must not contain control characters",
            ));
        }
        if let Some((limit, window)) = options.key_limit {
            if limit == 0 || window.is_zero() {
                return Err(invalid_input("key_limit needs a non-zero limit and window"));
            }
        }
        let listener = TcpListener::bind(addr).await?;
        let (shutdown, shutdown_rx) = oneshot::channel();
        let shared = Arc::new(Shared {
            name: name.to_string(),
            local_addr: listener.local_addr()?,
            requests: AtomicU64::new(0),
            proxied_requests: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            peak_in_flight: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            keys: std::sync::Mutex::new(Keys::new(options.key_limit)),
            log: std::sync::Mutex::new(Vec::new()),
            options,
            stopping: AtomicBool::new(false),
            acceptor: Mutex::new(None),
        });
        let task = tokio::spawn(accept_loop(shared.clone(), listener, shutdown_rx));
        *shared.acceptor.lock().await = Some(Acceptor { shutdown, task });
        Ok(EchoServer { shared })
    }

    /// The address the server listens on, with the actual port if 0 was requested.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// The name this server answers with.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Number of complete requests received (all paths, including `/healthz`).
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Requests received, excluding `/healthz` probes.
    pub fn proxied_requests(&self) -> u64 {
        self.shared.proxied_requests.load(Ordering::SeqCst)
    }

    /// Requests (not `/healthz`) being answered now, delays included.
    pub fn in_flight(&self) -> u64 {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// The most requests (not `/healthz`) this server ever answered at once: a test of a
    /// concurrency cap reads it after the fact, with no timing of its own.
    pub fn peak_in_flight(&self) -> u64 {
        self.shared.peak_in_flight.load(Ordering::SeqCst)
    }

    /// Requests with the `Authorization` value `key` that were admitted (not
    /// answered 429 by this server). `/healthz` probes are never counted.
    pub fn served(&self, key: &str) -> u64 {
        self.shared.keys().served(key)
    }

    /// Requests with the `Authorization` value `key` that this server
    /// answered 429: past the key's limit, scripted, or `x-force-429`.
    pub fn refused(&self, key: &str) -> u64 {
        self.shared.keys().refused(key)
    }

    /// `(key, served, refused)` for every key seen (or scripted), sorted by key.
    pub fn keys(&self) -> Vec<(String, u64, u64)> {
        self.shared.keys().snapshot()
    }

    /// The requests seen so far, in the order they were answered. Empty
    /// unless started with [`EchoOptions::log_requests`].
    pub fn request_log(&self) -> Vec<LoggedRequest> {
        self.shared.log().clone()
    }

    /// The next `n` requests with the `Authorization` value `key` get `429`
    /// with exactly `Retry-After: retry_after` (seconds such as `"2"`, or an
    /// HTTP-date), whatever the key's window says, and are not counted in it.
    ///
    /// Fails if `retry_after` is not a valid header value.
    pub fn refuse_next(&self, key: &str, n: u64, retry_after: &str) -> io::Result<()> {
        check_header_value(retry_after)?;
        self.shared
            .keys()
            .script(key, n, Scripted::RetryAfter(retry_after.to_string()));
        Ok(())
    }

    /// Like [`EchoServer::refuse_next`], but the 429s carry no `Retry-After`,
    /// only `RateLimit: ratelimit` (e.g. `"api";r=0;t=7`), the way an API
    /// that tells its reset time only in the RateLimit fields does.
    pub fn refuse_next_with_ratelimit(&self, key: &str, n: u64, ratelimit: &str) -> io::Result<()> {
        check_header_value(ratelimit)?;
        self.shared
            .keys()
            .script(key, n, Scripted::RateLimit(ratelimit.to_string()));
        Ok(())
    }

    /// Makes `GET /healthz` answer 200 (`true`) or 503 (`false`).
    pub fn set_healthy(&self, healthy: bool) {
        self.shared.healthy.store(healthy, Ordering::SeqCst);
    }

    /// Stops the server gracefully, like an instance leaving during a rolling
    /// deploy.
    ///
    /// The listener is closed at once, so new connection attempts are refused;
    /// connections the kernel had already completed are taken from its backlog
    /// first. Every connection that is already open answers its next request normally
    /// but with `Connection: close`, then closes; requests in flight complete
    /// the same way. Idle connections are deliberately not closed: a proxy
    /// that picks a pooled connection must never see a reset because of a
    /// deploy. Returns once the listener is closed; calling it again is a no-op.
    pub async fn stop(&self) {
        let mut acceptor = self.shared.acceptor.lock().await;
        // Raised before the listener closes so that a connection accepted in
        // the last moment still learns that it is the last one.
        self.shared.stopping.store(true, Ordering::SeqCst);
        if let Some(Acceptor { shutdown, task }) = acceptor.take() {
            let _ = shutdown.send(());
            // The listener lives inside the task, so it is closed once the task ends.
            let _ = task.await;
        }
    }
}

/// Accepts connections until told to shut down, then drops the listener.
async fn accept_loop(
    shared: Arc<Shared>,
    listener: TcpListener,
    mut shutdown: oneshot::Receiver<()>,
) {
    loop {
        tokio::select! {
            biased;
            _ = &mut shutdown => {
                drain_backlog(&shared, listener);
                return;
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    tokio::spawn(serve_connection(shared.clone(), stream));
                }
                Err(_) => {
                    // Typically EMFILE or a connection aborted before accept;
                    // back off briefly instead of spinning on the error.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// Takes the connections still waiting in the listener's backlog, then drops the listener.
///
/// The kernel completes handshakes on its own, so a client may have connected, and sent its
/// request, after this task stopped accepting and before it got here; closing the listener
/// would reset those connections, which no deploy of a real server should do to a request.
/// Each one is served like the others: one answer, with `Connection: close`. The accepts are
/// plain system calls, not readiness waits, so none that has arrived is missed; only one that
/// arrives in the instant between the last accept and the close can still be reset.
fn drain_backlog(shared: &Arc<Shared>, listener: TcpListener) {
    let Ok(listener) = listener.into_std() else {
        return;
    };
    // Still non-blocking, as tokio left it: `accept` fails with WouldBlock once it is empty.
    while let Ok((stream, _)) = listener.accept() {
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        if let Ok(stream) = TcpStream::from_std(stream) {
            tokio::spawn(serve_connection(shared.clone(), stream));
        }
    }
}

/// Counts a request out of `Shared::in_flight` when dropped.
struct InFlight<'a>(Option<&'a AtomicU64>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(n) = self.0 {
            n.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Serves requests on one connection until either side wants it closed.
async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    let capture = shared.options.log_requests;
    let answer = move |request: Result<Request, &'static str>| {
        let shared = shared.clone();
        async move {
            match request {
                Ok(request) => shared.answer(request).await,
                Err(reason) => shared.tagged(text(400, &format!("bad request: {reason}\n"))),
            }
        }
    };
    connection::serve(stream, capture, answer).await;
}

impl Shared {
    /// The answer to one request, with `connection` fields that say whether it is the last.
    async fn answer(&self, request: Request) -> Response {
        self.record(&request);
        let counted = request.path() != "/healthz";
        if counted {
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak_in_flight.fetch_max(now, Ordering::SeqCst);
        }
        // Counted down even when the connection drops mid-answer (the future is dropped).
        let _done = InFlight(counted.then_some(&self.in_flight));
        let mut response = self.respond(&request).await;
        // Read only now, after any delay, so that requests in flight when
        // `stop` is called also announce the close.
        response.close |= request.wants_close() || self.stopping.load(Ordering::SeqCst);
        if !response.close && request.minor_version == 0 {
            response
                .headers
                .push(("connection", "keep-alive".to_string()));
        }
        response
    }

    fn record(&self, request: &Request) {
        self.requests.fetch_add(1, Ordering::SeqCst);
        if request.path() != "/healthz" {
            self.proxied_requests.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Builds the answer to `request`; framing is left to the connection.
    async fn respond(&self, request: &Request) -> Response {
        if let Some(delay) = request.header("x-delay-ms") {
            match delay.trim().parse::<u64>() {
                Ok(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                Err(_) => return self.tagged(text(400, "bad request: invalid x-delay-ms\n")),
            }
        }

        let response = if request.path() == "/healthz" {
            if self.healthy.load(Ordering::SeqCst) {
                text(200, "ok")
            } else {
                text(503, "unhealthy")
            }
        } else {
            let response = self.keyed(request);
            self.log_request(request, &response);
            response
        };
        self.tagged(response)
    }

    /// The answer to a request that counts against its key.
    fn keyed(&self, request: &Request) -> Response {
        let key = request.header("authorization").unwrap_or("");
        if let Some(retry_after) = request.header("x-force-429") {
            if retry_after.trim().is_empty() {
                return text(400, "bad request: empty x-force-429\n");
            }
            self.keys().count_refused(key);
            let mut response = rate_limited(key);
            response
                .headers
                .push(("retry-after", retry_after.trim().to_string()));
            return response;
        }
        let decision = self.keys().decide(key, tokio::time::Instant::now());
        match decision {
            Decision::Admit(quota) => {
                let mut response = self.route(request);
                if let Some(quota) = quota.filter(|_| self.options.ratelimit_headers) {
                    ratelimit_fields(&mut response, &quota);
                }
                response
            }
            Decision::OverLimit(quota) => {
                let mut response = rate_limited(key);
                response
                    .headers
                    .push(("retry-after", quota.reset_secs.to_string()));
                if self.options.ratelimit_headers {
                    ratelimit_fields(&mut response, &quota);
                }
                response
            }
            Decision::Scripted(Scripted::RetryAfter(value)) => {
                let mut response = rate_limited(key);
                response.headers.push(("retry-after", value));
                response
            }
            Decision::Scripted(Scripted::RateLimit(value)) => {
                let mut response = rate_limited(key);
                response.headers.push(("ratelimit", value));
                response
            }
        }
    }

    /// The answer to an admitted request: `/status/NNN` or the echo.
    fn route(&self, request: &Request) -> Response {
        if let Some(code) = request.path().strip_prefix("/status/") {
            match code.parse::<u16>() {
                // 1xx are interim responses and cannot end an exchange.
                Ok(status @ 200..=599) => self.echo(status, request),
                _ => text(400, "bad request: status must be 200..=599\n"),
            }
        } else {
            self.echo(200, request)
        }
    }

    fn log_request(&self, request: &Request, response: &Response) {
        if !self.options.log_requests {
            return;
        }
        let (body_sha256, body) = match &request.body {
            Some(captured) => (hex::encode(captured.sha256), captured.kept.clone()),
            None => (String::new(), Vec::new()),
        };
        self.log().push(LoggedRequest {
            key: request.header("authorization").unwrap_or("").to_string(),
            method: request.method.clone(),
            target: request.target.clone(),
            status: response.status,
            body_len: request.body_len,
            body_sha256,
            body,
        });
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, Keys> {
        // A panic while holding the lock cannot leave the counters half-updated
        // in a way that matters to a test double; keep serving.
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Vec<LoggedRequest>> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A JSON description of `request` as seen by this server.
    fn echo(&self, status: u16, request: &Request) -> Response {
        let mut headers = serde_json::Map::new();
        for (name, value) in &request.headers {
            match headers.get_mut(name) {
                // Repeated fields are combined the way HTTP allows (RFC 9110 §5.3).
                Some(serde_json::Value::String(joined)) => {
                    joined.push_str(", ");
                    joined.push_str(value);
                }
                _ => {
                    headers.insert(name.clone(), value.clone().into());
                }
            }
        }
        let document = serde_json::json!({
            "upstream": self.name,
            "method": request.method,
            "target": request.target,
            "headers": headers,
            "body_len": request.body_len,
        });
        let mut body = document.to_string().into_bytes();
        body.push(b'\n');
        Response::new(status, "application/json", body)
    }

    /// Every answer names its server, so tests can tell who produced it.
    fn tagged(&self, mut response: Response) -> Response {
        response.headers.push(("x-upstream", self.name.clone()));
        response
    }
}

fn text(status: u16, body: &str) -> Response {
    Response::new(status, "text/plain", body)
}

/// The stub's 429, without the field that says when to come back.
fn rate_limited(key: &str) -> Response {
    let document = serde_json::json!({
        "error": "rate_limited",
        "key_hint": keys::key_hint(key),
    });
    let mut body = document.to_string().into_bytes();
    body.push(b'\n');
    Response::new(429, "application/json", body)
}

/// The stub's own RateLimit fields (draft-ietf-httpapi-ratelimit-headers).
fn ratelimit_fields(response: &mut Response, quota: &Quota) {
    response.headers.push((
        "ratelimit-policy",
        format!("\"{POLICY}\";q={};w={}", quota.limit, quota.window_secs),
    ));
    response.headers.push((
        "ratelimit",
        format!("\"{POLICY}\";r={};t={}", quota.remaining, quota.reset_secs),
    ));
}

fn invalid_input(message: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message.to_string())
}

/// A value we send back in a header must not break the response head.
fn check_header_value(value: &str) -> io::Result<()> {
    if value.is_empty() || value.chars().any(|c| c.is_control() && c != '\t') {
        return Err(invalid_input(
            "a header value must be non-empty and free of control characters",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    sluice_testkit::architecture::assert_no_cycles(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    );
}
