//! A tiny HTTP/1.1 server that answers with its own name.
//!
//! `sluice-echo` is the demo upstream for sluice and the backend used by its
//! tests. Every answer says which server produced it (the `x-upstream` header
//! and the `upstream` field of the JSON body), so a test can tell where the
//! gateway sent a request.
//!
//! Besides echoing, a few knobs make failure scenarios easy to script:
//!
//! * `GET /healthz` answers `200 ok`, or `503 unhealthy` after
//!   [`EchoServer::set_healthy(false)`](EchoServer::set_healthy).
//! * An `x-delay-ms: N` request header delays the answer by N milliseconds.
//! * `/status/NNN` answers with status NNN.
//! * [`EchoServer::stop`] behaves like an instance leaving during a rolling
//!   deploy.
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

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Mutex};
use tokio::task::JoinHandle;

use connection::{Connection, ReadError, Request, Response};

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
        if name.chars().any(char::is_control) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "server name must not contain control characters",
            ));
        }
        let listener = TcpListener::bind(addr).await?;
        let (shutdown, shutdown_rx) = oneshot::channel();
        let shared = Arc::new(Shared {
            name: name.to_string(),
            local_addr: listener.local_addr()?,
            requests: AtomicU64::new(0),
            proxied_requests: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
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

    /// Makes `GET /healthz` answer 200 (`true`) or 503 (`false`).
    pub fn set_healthy(&self, healthy: bool) {
        self.shared.healthy.store(healthy, Ordering::SeqCst);
    }

    /// Stops the server gracefully, like an instance leaving during a rolling
    /// deploy.
    ///
    /// The listener is closed at once, so new connection attempts are refused.
    /// Every connection that is already open answers its next request normally
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
            _ = &mut shutdown => return,
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

/// Serves requests on one connection until either side wants it closed.
async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    // Small answers are written in one go; don't let Nagle hold them back.
    let _ = stream.set_nodelay(true);
    let mut connection = Connection::new(stream);
    loop {
        let request = match connection.read_request().await {
            Ok(Some(request)) => request,
            Ok(None) | Err(ReadError::Disconnected) => return,
            Err(ReadError::Malformed(reason)) => {
                let mut response = shared.tagged(text(400, &format!("bad request: {reason}\n")));
                response.close = true;
                let _ = connection.write_response(&response, false).await;
                connection.close().await;
                return;
            }
        };
        shared.record(&request);

        let mut response = shared.respond(&request).await;
        // Read only now, after any delay, so that requests in flight when
        // `stop` is called also announce the close.
        response.close |= request.wants_close() || shared.stopping.load(Ordering::SeqCst);
        if !response.close && request.minor_version == 0 {
            response
                .headers
                .push(("connection", "keep-alive".to_string()));
        }

        let written = connection
            .write_response(&response, request.method == "HEAD")
            .await;
        if written.is_err() {
            return;
        }
        if response.close {
            connection.close().await;
            return;
        }
    }
}

impl Shared {
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

        let path = request.path();
        let response = if path == "/healthz" {
            if self.healthy.load(Ordering::SeqCst) {
                text(200, "ok")
            } else {
                text(503, "unhealthy")
            }
        } else if let Some(code) = path.strip_prefix("/status/") {
            match code.parse::<u16>() {
                // 1xx are interim responses and cannot end an exchange.
                Ok(status @ 200..=599) => self.echo(status, request),
                _ => text(400, "bad request: status must be 200..=599\n"),
            }
        } else {
            self.echo(200, request)
        };
        self.tagged(response)
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
