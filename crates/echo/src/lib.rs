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

mod connection;
mod keys;

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
mod tests {
    use super::*;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::time::timeout;

    const IO_TIMEOUT: Duration = Duration::from_secs(5);

    /// A parsed response as the tests need it.
    #[derive(Debug)]
    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        }

        fn json(&self) -> serde_json::Value {
            serde_json::from_slice(&self.body).expect("body is JSON")
        }
    }

    /// A raw client connection, so that the tests control every byte sent.
    struct Client {
        stream: TcpStream,
        buffer: Vec<u8>,
    }

    impl Client {
        async fn connect(addr: SocketAddr) -> Client {
            let stream = timeout(IO_TIMEOUT, TcpStream::connect(addr))
                .await
                .expect("connect timed out")
                .expect("connect");
            Client {
                stream,
                buffer: Vec::new(),
            }
        }

        async fn send(&mut self, raw: &[u8]) {
            timeout(IO_TIMEOUT, self.stream.write_all(raw))
                .await
                .expect("write timed out")
                .expect("write");
        }

        /// Reads one response framed by Content-Length (the server always sends it).
        async fn receive(&mut self) -> Reply {
            loop {
                let mut headers = [httparse::EMPTY_HEADER; 32];
                let mut parsed = httparse::Response::new(&mut headers);
                if let httparse::Status::Complete(head_len) =
                    parsed.parse(&self.buffer).expect("valid response head")
                {
                    let headers: Vec<(String, String)> = parsed
                        .headers
                        .iter()
                        .map(|h| {
                            let value = String::from_utf8(h.value.to_vec()).unwrap();
                            (h.name.to_ascii_lowercase(), value)
                        })
                        .collect();
                    let status = parsed.code.unwrap();
                    let body_len: usize = headers
                        .iter()
                        .find(|(n, _)| n == "content-length")
                        .map_or(0, |(_, v)| v.parse().unwrap());
                    while self.buffer.len() < head_len + body_len {
                        self.fill().await;
                    }
                    let body = self.buffer[head_len..head_len + body_len].to_vec();
                    self.buffer.drain(..head_len + body_len);
                    return Reply {
                        status,
                        headers,
                        body,
                    };
                }
                self.fill().await;
            }
        }

        async fn fill(&mut self) {
            let mut chunk = [0u8; 4096];
            let n = timeout(IO_TIMEOUT, self.stream.read(&mut chunk))
                .await
                .expect("read timed out")
                .expect("read");
            assert!(n > 0, "server closed the connection early");
            self.buffer.extend_from_slice(&chunk[..n]);
        }

        /// True if the server closes the connection without sending anything more.
        async fn closed_by_server(&mut self) -> bool {
            let mut chunk = [0u8; 64];
            matches!(
                timeout(IO_TIMEOUT, self.stream.read(&mut chunk)).await,
                Ok(Ok(0))
            )
        }
    }

    async fn start(name: &str) -> EchoServer {
        EchoServer::start(name, "127.0.0.1:0".parse().unwrap())
            .await
            .expect("start echo server")
    }

    #[tokio::test]
    async fn get_roundtrip_keeps_connection_alive() {
        let server = start("alpha").await;
        let mut client = Client::connect(server.local_addr()).await;

        client
            .send(b"GET /some/path?x=1&y=%20 HTTP/1.1\r\nHost: example.test\r\nX-Tag: one\r\nx-tag: two\r\n\r\n")
            .await;
        let first = client.receive().await;
        assert_eq!(first.status, 200);
        assert_eq!(first.header("x-upstream"), Some("alpha"));
        assert_eq!(first.header("content-type"), Some("application/json"));
        assert_eq!(first.header("connection"), None);
        assert!(first.body.ends_with(b"}\n"));
        let json = first.json();
        assert_eq!(json["upstream"], "alpha");
        assert_eq!(json["method"], "GET");
        assert_eq!(json["target"], "/some/path?x=1&y=%20");
        assert_eq!(json["headers"]["host"], "example.test");
        assert_eq!(json["headers"]["x-tag"], "one, two");
        assert_eq!(json["body_len"], 0);

        client
            .send(b"GET /second HTTP/1.1\r\nHost: example.test\r\n\r\n")
            .await;
        let second = client.receive().await;
        assert_eq!(second.status, 200);
        assert_eq!(second.json()["target"], "/second");

        assert_eq!(server.requests(), 2);
        assert_eq!(server.proxied_requests(), 2);
    }

    #[tokio::test]
    async fn post_with_content_length_body() {
        let server = start("beta").await;
        let mut client = Client::connect(server.local_addr()).await;

        // Sent in pieces so the server has to deal with partial reads.
        client
            .send(b"POST /submit HTTP/1.1\r\nHost: b\r\nContent-Le")
            .await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        client.send(b"ngth: 11\r\n\r\nhello").await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        client.send(b" world").await;

        let reply = client.receive().await;
        assert_eq!(reply.status, 200);
        let json = reply.json();
        assert_eq!(json["method"], "POST");
        assert_eq!(json["body_len"], 11);
        assert_eq!(json["headers"]["content-length"], "11");
    }

    #[tokio::test]
    async fn chunked_post_is_decoded() {
        let server = start("gamma").await;
        let mut client = Client::connect(server.local_addr()).await;

        client
            .send(
                b"POST /upload HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n\
                  5\r\nhello\r\n\
                  6;ext=1\r\n world\r\n\
                  0\r\nx-trailer: yes\r\n\r\n",
            )
            .await;
        let reply = client.receive().await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.json()["body_len"], 11);

        // The body must have been consumed exactly, or this request would be garbled.
        client.send(b"GET /after HTTP/1.1\r\nHost: g\r\n\r\n").await;
        assert_eq!(client.receive().await.json()["target"], "/after");
    }

    #[tokio::test]
    async fn unsupported_transfer_encoding_is_rejected() {
        let server = start("delta").await;
        let mut client = Client::connect(server.local_addr()).await;

        client
            .send(b"POST / HTTP/1.1\r\nHost: d\r\nTransfer-Encoding: gzip, chunked\r\n\r\n")
            .await;
        let reply = client.receive().await;
        assert_eq!(reply.status, 400);
        assert_eq!(reply.header("connection"), Some("close"));
        assert!(client.closed_by_server().await);
    }

    #[tokio::test]
    async fn healthz_follows_set_healthy() {
        let server = start("epsilon").await;
        let mut client = Client::connect(server.local_addr()).await;
        let probe = b"GET /healthz HTTP/1.1\r\nHost: e\r\n\r\n";

        client.send(probe).await;
        let healthy = client.receive().await;
        assert_eq!((healthy.status, healthy.body.as_slice()), (200, &b"ok"[..]));

        server.set_healthy(false);
        client.send(probe).await;
        let unhealthy = client.receive().await;
        assert_eq!(
            (unhealthy.status, unhealthy.body.as_slice()),
            (503, &b"unhealthy"[..])
        );

        server.set_healthy(true);
        client.send(probe).await;
        assert_eq!(client.receive().await.status, 200);

        client.send(b"GET / HTTP/1.1\r\nHost: e\r\n\r\n").await;
        client.receive().await;
        assert_eq!(server.requests(), 4);
        assert_eq!(server.proxied_requests(), 1);
    }

    #[tokio::test]
    async fn status_path_and_delay_header() {
        let server = start("zeta").await;
        let mut client = Client::connect(server.local_addr()).await;

        client
            .send(b"GET /status/503 HTTP/1.1\r\nHost: z\r\n\r\n")
            .await;
        let reply = client.receive().await;
        assert_eq!(reply.status, 503);
        assert_eq!(reply.header("x-upstream"), Some("zeta"));

        let started = tokio::time::Instant::now();
        client
            .send(b"GET / HTTP/1.1\r\nHost: z\r\nx-delay-ms: 150\r\n\r\n")
            .await;
        assert_eq!(client.receive().await.status, 200);
        assert!(started.elapsed() >= Duration::from_millis(150));
    }

    #[tokio::test]
    async fn client_connection_close_is_honoured() {
        let server = start("eta").await;
        let mut client = Client::connect(server.local_addr()).await;

        client
            .send(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
            .await;
        let reply = client.receive().await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("connection"), Some("close"));
        assert!(client.closed_by_server().await);
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order() {
        let server = start("kappa").await;
        let mut client = Client::connect(server.local_addr()).await;

        client
            .send(b"POST /one HTTP/1.1\r\nHost: k\r\nContent-Length: 3\r\n\r\nabcGET /two HTTP/1.1\r\nHost: k\r\n\r\n")
            .await;
        let first = client.receive().await.json();
        assert_eq!(
            (&first["target"], &first["body_len"]),
            (&"/one".into(), &3.into())
        );
        assert_eq!(client.receive().await.json()["target"], "/two");
    }

    #[tokio::test]
    async fn http_1_0_closes_unless_keep_alive_is_requested() {
        let server = start("lambda").await;

        let mut keep = Client::connect(server.local_addr()).await;
        keep.send(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            .await;
        assert_eq!(
            keep.receive().await.header("connection"),
            Some("keep-alive")
        );
        keep.send(b"GET /b HTTP/1.0\r\n\r\n").await;
        assert_eq!(keep.receive().await.header("connection"), Some("close"));
        assert!(keep.closed_by_server().await);
    }

    #[tokio::test]
    async fn stop_refuses_new_connections_and_drains_keep_alive() {
        let server = start("theta").await;
        let addr = server.local_addr();

        let mut idle = Client::connect(addr).await;
        idle.send(b"GET /before HTTP/1.1\r\nHost: t\r\n\r\n").await;
        assert_eq!(idle.receive().await.header("connection"), None);

        server.stop().await;

        let refused = TcpStream::connect(addr).await.expect_err("listener closed");
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);

        // The idle connection was left open and answers one last time.
        idle.send(b"GET /after HTTP/1.1\r\nHost: t\r\n\r\n").await;
        let last = idle.receive().await;
        assert_eq!(last.status, 200);
        assert_eq!(last.header("connection"), Some("close"));
        assert_eq!(last.json()["target"], "/after");
        assert!(idle.closed_by_server().await);

        // Stopping twice is harmless.
        server.stop().await;
        assert_eq!(server.requests(), 2);
    }

    /// A client the kernel accepted (its handshake done, its request sent) but the server had
    /// not yet taken when it was told to stop is still answered, once, not reset. The test
    /// runtime has one thread, and nothing yields between the blocking connect and `stop`, so
    /// the accept loop first runs when it is already stopping.
    #[tokio::test]
    async fn stop_answers_connections_still_in_the_backlog() {
        let server = start("iota").await;
        let mut waiting = std::net::TcpStream::connect(server.local_addr()).expect("connect");
        std::io::Write::write_all(&mut waiting, b"GET /queued HTTP/1.1\r\nHost: t\r\n\r\n")
            .expect("write");
        waiting.set_nonblocking(true).expect("non-blocking");
        server.stop().await;
        let mut queued = Client {
            stream: TcpStream::from_std(waiting).expect("into tokio"),
            buffer: Vec::new(),
        };
        let last = queued.receive().await;
        assert_eq!(last.status, 200);
        assert_eq!(last.header("connection"), Some("close"));
        assert_eq!(last.json()["target"], "/queued");
        assert!(queued.closed_by_server().await);
    }

    // --- the key-limited API stub -------------------------------------------------------

    /// Long enough that no window can expire while a test runs.
    const WINDOW: Duration = Duration::from_secs(60);

    async fn start_keyed(name: &str, options: EchoOptions) -> EchoServer {
        EchoServer::start_with(name, "127.0.0.1:0".parse().unwrap(), options)
            .await
            .expect("start echo server")
    }

    fn get_with_key(key: Option<&str>) -> Vec<u8> {
        let auth = key.map_or(String::new(), |k| format!("Authorization: {k}\r\n"));
        format!("GET /v1/things HTTP/1.1\r\nHost: api\r\n{auth}\r\n").into_bytes()
    }

    #[tokio::test]
    async fn key_limit_holds_per_key_with_retry_after_and_ratelimit_fields() {
        let api = start_keyed("api", EchoOptions::key_limited(3, WINDOW)).await;
        let mut client = Client::connect(api.local_addr()).await;

        for remaining in [2, 1, 0] {
            client.send(&get_with_key(Some("Bearer key-aaaa"))).await;
            let reply = client.receive().await;
            assert_eq!(reply.status, 200);
            assert_eq!(reply.header("x-upstream"), Some("api"));
            assert_eq!(reply.json()["headers"]["authorization"], "Bearer key-aaaa");
            assert_eq!(reply.header("ratelimit-policy"), Some("\"api\";q=3;w=60"));
            let ratelimit = reply.header("ratelimit").expect("RateLimit on a 200");
            let prefix = format!("\"api\";r={remaining};t=");
            let t: u64 = ratelimit
                .strip_prefix(&prefix)
                .unwrap_or_else(|| panic!("{ratelimit:?} should start with {prefix:?}"))
                .parse()
                .expect("t is whole seconds");
            assert!((1..=60).contains(&t), "{ratelimit}");
        }

        client.send(&get_with_key(Some("Bearer key-aaaa"))).await;
        let refused = client.receive().await;
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("x-upstream"), Some("api"));
        assert_eq!(refused.header("content-type"), Some("application/json"));
        let retry_after: u64 = refused
            .header("retry-after")
            .expect("Retry-After on the 429")
            .parse()
            .expect("whole seconds");
        // The oldest request leaves the 60 s window at most 60 s from now, at least 1 s.
        assert!((1..=60).contains(&retry_after), "{retry_after}");
        assert_eq!(
            refused.json(),
            serde_json::json!({"error": "rate_limited", "key_hint": "aaaa"})
        );
        assert_eq!(
            refused.header("ratelimit"),
            Some(format!("\"api\";r=0;t={retry_after}").as_str())
        );

        // Other keys, and the key-less requests, have windows of their own.
        client.send(&get_with_key(Some("Bearer key-bbbb"))).await;
        assert_eq!(client.receive().await.status, 200);
        for _ in 0..3 {
            client.send(&get_with_key(None)).await;
            assert_eq!(client.receive().await.status, 200);
        }
        client.send(&get_with_key(None)).await;
        let keyless = client.receive().await;
        assert_eq!(keyless.status, 429);
        assert_eq!(keyless.json()["key_hint"], "");

        // Health probes are neither counted nor limited.
        client
            .send(b"GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n")
            .await;
        assert_eq!(client.receive().await.status, 200);

        assert_eq!(api.served("Bearer key-aaaa"), 3);
        assert_eq!(api.refused("Bearer key-aaaa"), 1);
        assert_eq!(api.served("Bearer key-zzzz"), 0);
        assert_eq!(
            api.keys(),
            vec![
                (String::new(), 3, 1),
                ("Bearer key-aaaa".to_string(), 3, 1),
                ("Bearer key-bbbb".to_string(), 1, 0),
            ]
        );
    }

    #[tokio::test]
    async fn scripted_refusals_say_exactly_what_they_were_given() {
        let api = start_keyed("api", EchoOptions::key_limited(100, WINDOW)).await;
        let mut client = Client::connect(api.local_addr()).await;
        let key = "Bearer sk-cool";
        api.refuse_next(key, 2, "864000").unwrap();
        api.refuse_next(key, 1, "Wed, 21 Oct 2037 07:28:00 GMT")
            .unwrap();
        api.refuse_next_with_ratelimit(key, 1, "\"api\";r=0;t=7")
            .unwrap();

        for expected in ["864000", "864000", "Wed, 21 Oct 2037 07:28:00 GMT"] {
            client.send(&get_with_key(Some(key))).await;
            let reply = client.receive().await;
            assert_eq!(reply.status, 429);
            assert_eq!(reply.header("retry-after"), Some(expected));
            assert_eq!(reply.header("ratelimit"), None);
            assert_eq!(reply.json()["key_hint"], "cool");
        }
        client.send(&get_with_key(Some(key))).await;
        let ratelimited = client.receive().await;
        assert_eq!(ratelimited.status, 429);
        assert_eq!(ratelimited.header("retry-after"), None);
        assert_eq!(ratelimited.header("ratelimit"), Some("\"api\";r=0;t=7"));

        // Scripted refusals were not counted in the window: all 100 are left.
        client.send(&get_with_key(Some(key))).await;
        let served = client.receive().await;
        assert_eq!(served.status, 200);
        assert!(
            served
                .header("ratelimit")
                .is_some_and(|v| v.starts_with("\"api\";r=99;")),
            "{:?}",
            served.header("ratelimit")
        );
        // Another key was never affected.
        client.send(&get_with_key(Some("Bearer other"))).await;
        assert_eq!(client.receive().await.status, 200);

        assert_eq!((api.served(key), api.refused(key)), (1, 4));
        assert!(api.refuse_next(key, 1, "2\r\nx-evil: 1").is_err());
        assert!(api.refuse_next(key, 1, "").is_err());
    }

    #[tokio::test]
    async fn refusals_work_without_a_key_limit_too() {
        let server = start("plain").await;
        let mut client = Client::connect(server.local_addr()).await;
        server.refuse_next("Bearer k", 1, "2").unwrap();

        client.send(&get_with_key(Some("Bearer k"))).await;
        assert_eq!(client.receive().await.header("retry-after"), Some("2"));
        // x-force-429 is the same refusal, asked for by the request itself.
        client
            .send(b"GET / HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer k\r\nx-force-429: 5\r\n\r\n")
            .await;
        let forced = client.receive().await;
        assert_eq!(forced.status, 429);
        assert_eq!(forced.header("retry-after"), Some("5"));
        assert_eq!(forced.header("x-upstream"), Some("plain"));

        client.send(&get_with_key(Some("Bearer k"))).await;
        let served = client.receive().await;
        assert_eq!(served.status, 200);
        // Without a key limit there are no RateLimit fields, and no request log.
        assert_eq!(served.header("ratelimit"), None);
        assert_eq!(served.header("ratelimit-policy"), None);
        assert_eq!(server.keys(), vec![("Bearer k".to_string(), 1, 2)]);
        assert!(server.request_log().is_empty());
    }

    #[tokio::test]
    async fn the_request_log_tells_which_body_went_to_which_key() {
        let api = start_keyed("api", EchoOptions::key_limited(1, WINDOW)).await;
        let mut client = Client::connect(api.local_addr()).await;

        client
            .send(b"POST /v1/chat HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer a\r\nContent-Length: 11\r\n\r\nhello world")
            .await;
        assert_eq!(client.receive().await.status, 200);
        // Refused by the window, but logged: the body did reach the API.
        client
            .send(
                b"POST /v1/chat HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer a\r\nTransfer-Encoding: chunked\r\n\r\n\
                  5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            )
            .await;
        assert_eq!(client.receive().await.status, 429);
        // Larger than what is kept: the hash still covers all of it.
        let big = vec![b'x'; MAX_KEPT_BODY + 10];
        let mut raw =
            format!("PUT /big HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer b\r\nContent-Length: {}\r\n\r\n", big.len())
                .into_bytes();
        raw.extend_from_slice(&big);
        client.send(&raw).await;
        assert_eq!(client.receive().await.status, 200);
        client
            .send(b"GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n")
            .await;
        client.receive().await;

        let log = api.request_log();
        assert_eq!(log.len(), 3, "{log:?}");
        let hello_sha = "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9";
        for (entry, status) in log[..2].iter().zip([200, 429]) {
            assert_eq!(entry.key, "Bearer a");
            assert_eq!(
                (entry.method.as_str(), entry.target.as_str()),
                ("POST", "/v1/chat")
            );
            assert_eq!(entry.status, status);
            assert_eq!(entry.body_len, 11);
            assert_eq!(entry.body, b"hello world");
            assert_eq!(entry.body_sha256, hello_sha);
        }
        let big_entry = &log[2];
        assert_eq!(
            (big_entry.key.as_str(), big_entry.status),
            ("Bearer b", 200)
        );
        assert_eq!(big_entry.body_len, big.len() as u64);
        assert_eq!(big_entry.body, &big[..MAX_KEPT_BODY]);
        use sha2::Digest;
        assert_eq!(
            big_entry.body_sha256,
            hex::encode(sha2::Sha256::digest(&big))
        );
    }

    #[tokio::test]
    async fn a_zero_key_limit_is_refused() {
        for limit in [(0, WINDOW), (1, Duration::ZERO)] {
            let options = EchoOptions {
                key_limit: Some(limit),
                ..EchoOptions::default()
            };
            let err = EchoServer::start_with("api", "127.0.0.1:0".parse().unwrap(), options)
                .await
                .expect_err("a zero limit or window");
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        }
    }

    #[tokio::test]
    async fn request_in_flight_during_stop_completes_with_close() {
        let server = start("iota").await;
        let mut client = Client::connect(server.local_addr()).await;

        client
            .send(b"GET / HTTP/1.1\r\nHost: i\r\nx-delay-ms: 200\r\n\r\n")
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        server.stop().await;

        let reply = client.receive().await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("connection"), Some("close"));
    }
}

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    sluice_testkit::architecture::assert_no_cycles(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    );
}
